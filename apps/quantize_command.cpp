// `ringlm quantize IN OUT --type TYPE`: rewrites a GGUF model with its weight matrices in TYPE.
//
// Which tensors change: 2-D `*.weight` matrices other than norms get TYPE; token_embd.weight and
// output.weight get --embd-type (or Q8_0 with --keep-8bit-embeddings, else TYPE); everything else
// (norms, 1-D tensors) is copied byte for byte. A matrix whose row length is not a multiple of
// the target's block falls back to --fallback-type (Q8_0), else F16, with a notice, as
// llama-quantize falls back: the run never stops on a shape.
//
// How: a tensor already in its target type is copied; Q4_0 -> i4s-g32 and Q4_1 -> i4a-g32 (fp16
// scales) are the same bytes under a new type id and are copied too (lossless); anything else is
// dequantized to fp32 row by row and quantized again (quant/quantize.h), rows in parallel. Going
// from one 4-bit grid to another compounds the two rounding errors: quantize from F16/BF16/F32
// when the original weights are at hand.
//
// The output is written to OUT.tmp, streamed tensor by tensor, and renamed to OUT only when
// complete, so an interrupted run never leaves a partial file under OUT's name.
#include "apps/quantize_command.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/common_options.h"
#include "core/gguf/gguf.h"
#include "core/gguf/gguf_writer.h"
#include "quant/int4.h"
#include "quant/quantize.h"

namespace ringlm {

namespace {

struct QuantizeCommandOptions {
  std::string input, output;
  std::string type;
  std::string embd_type;
  std::string fallback_type = "Q8_0";
  bool keep_8bit_embeddings = false;
  bool clip_search = false;
  int n_threads = 0;
};

// The parsed types of one run.
struct Targets {
  TensorType weights;
  TensorType embeddings;
  TensorType fallback;
};

enum class Action { kCopy, kConvert };

struct TensorPlan {
  const GgufTensorInfo* in;
  TensorType out;
  Action action;
};

// Output rows gathered before each write: bounds memory whatever the tensor's size.
constexpr size_t kChunkBytes = size_t{16} << 20;

std::string_view type_name(TensorType t) { return type_traits(static_cast<uint32_t>(t))->name; }

TensorType parse_type(const std::string& name, const char* flag) {
  if (const std::optional<TensorType> t = parse_quantize_type(name)) return *t;
  std::string valid;
  for (const std::string_view n : quantize_type_names()) valid += (valid.empty() ? "" : ", ") + std::string(n);
  throw std::runtime_error(std::string(flag) + ": unknown type '" + name + "' (valid: " + valid + ")");
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool is_embedding(std::string_view name) { return name == "token_embd.weight" || name == "output.weight"; }

// A weight matrix: quantized. Norm weights (1-D in Llama, but any norm) and other tensors are not.
bool is_weight_matrix(const GgufTensorInfo& t) {
  return ends_with(t.name, ".weight") && t.shape.size() == 2 && t.name.find("norm") == std::string::npos;
}

bool row_fits(TensorType type, int64_t cols) { return cols % type_traits(static_cast<uint32_t>(type))->block_elems == 0; }

// The same bytes under two type ids: no requantizing needed.
bool same_layout(TensorType from, TensorType to) {
  const uint32_t to_id = static_cast<uint32_t>(to);
  return (from == TensorType::Q4_0 && to_id == int4_type_id({32, false, ScaleType::kF16})) ||
         (from == TensorType::Q4_1 && to_id == int4_type_id({32, true, ScaleType::kF16}));
}

TensorPlan plan_tensor(const GgufTensorInfo& t, const Targets& targets) {
  if (!is_weight_matrix(t)) return {&t, t.type, Action::kCopy};
  TensorType out = is_embedding(t.name) ? targets.embeddings : targets.weights;
  if (!row_fits(out, t.cols())) {
    const TensorType fallback = row_fits(targets.fallback, t.cols()) ? targets.fallback : TensorType::F16;
    std::fprintf(stderr, "ringlm quantize: note: %s: row length %lld is not a multiple of the %s block size %lld; using %s\n",
                 t.name.c_str(), static_cast<long long>(t.cols()), std::string(type_name(out)).c_str(),
                 static_cast<long long>(type_traits(static_cast<uint32_t>(out))->block_elems),
                 std::string(type_name(fallback)).c_str());
    out = fallback;
  }
  if (out == t.type || same_layout(t.type, out)) return {&t, out, Action::kCopy};
  if (!type_traits(static_cast<uint32_t>(t.type))->readable) {
    throw std::runtime_error("tensor '" + t.name + "': cannot read its type " + std::string(type_name(t.type)) +
                             " to quantize it");
  }
  return {&t, out, Action::kConvert};
}

// llama.cpp's general.file_type for the GGML types; ringlm's own types have none.
std::optional<uint32_t> llama_file_type(TensorType t) {
  switch (t) {
    case TensorType::F32: return 0;
    case TensorType::F16: return 1;
    case TensorType::Q4_0: return 2;
    case TensorType::Q4_1: return 3;
    case TensorType::Q8_0: return 7;
    case TensorType::BF16: return 32;
    default: return std::nullopt;
  }
}

void copy_metadata(const GgufFile& in, TensorType type, GgufWriter& w) {
  for (const std::string& key : in.keys()) {
    const GgufValue& v = *in.find(key);
    if (v.type == GgufValueType::ARRAY && v.array_type == GgufValueType::ARRAY) {
      std::fprintf(stderr, "ringlm quantize: note: metadata '%s' is a nested array; not copied\n", key.c_str());
      continue;
    }
    w.set_value(key, v);
  }
  w.set_string("ringlm.quantization", type_name(type));
  if (const std::optional<uint32_t> ft = llama_file_type(type)) {
    w.set_uint32("general.file_type", *ft);
  } else {
    w.remove("general.file_type");  // it would name the input's type
  }
}

// Dequantizes and requantizes a tensor a chunk of rows at a time, the rows of a chunk in parallel.
void convert_tensor(const TensorPlan& p, const QuantizeOptions& q, GgufWriter& w) {
  const GgufTensorInfo& in = *p.in;
  const int64_t cols = in.cols(), rows = in.rows();
  const size_t in_stride = row_bytes(in.type, cols), out_stride = row_bytes(p.out, cols);
  const int64_t chunk_rows = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / out_stride));
  std::vector<uint8_t> out(static_cast<size_t>(std::min(chunk_rows, rows)) * out_stride);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r0);
#pragma omp parallel
    {
      std::vector<float> row(static_cast<size_t>(cols));
#pragma omp for schedule(dynamic, 16)
      for (int64_t r = 0; r < n; ++r) {
        dequantize_row(in.type, in.data + static_cast<size_t>(r0 + r) * in_stride, row.data(), cols);
        quantize_row(p.out, row.data(), out.data() + static_cast<size_t>(r) * out_stride, cols, q);
      }
    }
    w.write_data(out.data(), static_cast<size_t>(n) * out_stride);
  }
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string size_string(uint64_t bytes) {
  char buf[32];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else if (bytes < (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(bytes) / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  }
  return buf;
}

double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

void write_model(const GgufFile& in, const std::vector<TensorPlan>& plans, TensorType type, const QuantizeOptions& q,
                 const std::string& path) {
  GgufWriter w(path);
  copy_metadata(in, type, w);
  for (const TensorPlan& p : plans) w.add_tensor(p.in->name, p.in->shape, p.out);
  w.write_header();
  uint64_t before = 0, after = 0;
  for (size_t i = 0; i < plans.size(); ++i) {
    const TensorPlan& p = plans[i];
    if (p.action == Action::kCopy) {
      w.write_data(p.in->data, p.in->n_bytes);
    } else {
      convert_tensor(p, q, w);
    }
    before += p.in->n_bytes;
    after += w.tensor_bytes(i);
    std::printf("[%4zu/%4zu] %-32s %-14s %-6s -> %-14s %10s -> %s\n", i + 1, plans.size(), p.in->name.c_str(),
                shape_string(p.in->shape).c_str(), std::string(type_name(p.in->type)).c_str(),
                std::string(type_name(p.out)).c_str(), size_string(p.in->n_bytes).c_str(),
                size_string(w.tensor_bytes(i)).c_str());
    std::fflush(stdout);
  }
  w.finish();
  std::printf("tensor data: %.2f MiB -> %.2f MiB\n", mib(before), mib(after));
}

void quantize(const QuantizeCommandOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.keep_8bit_embeddings && !o.embd_type.empty()) {
    throw std::runtime_error("--keep-8bit-embeddings and --embd-type are exclusive: give one");
  }
  Targets targets{};
  targets.weights = parse_type(o.type, "--type");
  targets.embeddings = o.keep_8bit_embeddings ? TensorType::Q8_0
                       : o.embd_type.empty()  ? targets.weights
                                              : parse_type(o.embd_type, "--embd-type");
  targets.fallback = parse_type(o.fallback_type, "--fallback-type");
  omp_set_num_threads(resolve_threads(o.n_threads));

  const std::unique_ptr<GgufFile> in = GgufFile::open(o.input);
  std::vector<TensorPlan> plans;
  for (const GgufTensorInfo& t : in->tensors()) plans.push_back(plan_tensor(t, targets));

  QuantizeOptions q;
  q.clip_search = o.clip_search;
  const std::string tmp = o.output + ".tmp";
  try {
    write_model(*in, plans, targets.weights, q, tmp);
    std::filesystem::rename(tmp, o.output);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("model size: %.2f MiB -> %.2f MiB (%s -> %s), %.1f s\n", mib(in->file_size()),
              mib(std::filesystem::file_size(o.output)), o.input.c_str(), o.output.c_str(), seconds);
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto o = std::make_shared<QuantizeCommandOptions>();
  CLI::App* cmd = app.add_subcommand("quantize", "rewrite a GGUF model with its weight matrices in another type");
  cmd->add_option("input", o->input, "GGUF model to read")->required();
  cmd->add_option("output", o->output, "GGUF file to write (replaced only once complete)")->required();
  std::string types;
  for (const std::string_view n : quantize_type_names()) types += (types.empty() ? "" : ", ") + std::string(n);
  cmd->add_option("--type", o->type, "type of the weight matrices: " + types)->required();
  cmd->add_flag("--keep-8bit-embeddings", o->keep_8bit_embeddings, "token_embd and output weights in Q8_0");
  cmd->add_option("--embd-type", o->embd_type, "type of token_embd and output weights (default: --type)");
  cmd->add_option("--fallback-type", o->fallback_type,
                  "type of a matrix whose rows do not split into --type's blocks (else F16)")
      ->capture_default_str();
  cmd->add_option("-t,--threads", o->n_threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  // Off by default: on SmolLM2 (requantized from Q4_1) the search lowered every group's squared
  // error yet raised perplexity (KJV, 20 chunks of 512: i4s-g32 10.80 plain, 11.45 searched).
  cmd->add_flag("--clip-search", o->clip_search,
                "INT4 types: per group, search the clipping ratio (0.80-1.00) that minimises the squared error, "
                "instead of plain round-to-nearest");
  cmd->callback([o] { quantize(*o); });
}

}  // namespace ringlm
