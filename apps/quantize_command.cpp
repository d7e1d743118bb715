// `ringlm quantize IN OUT --type TYPE`: rewrites a GGUF model with its weight matrices in TYPE.
//
// Which tensors change: 2-D `*.weight` matrices other than norms get TYPE; token_embd.weight and
// output.weight get --embd-type (or Q8_0 with --keep-8bit-embeddings, else TYPE); everything else
// (norms, 1-D tensors) is copied byte for byte. TYPE may also be one of llama.cpp's K-quant mixes
// (Q4_K_M, ...): then each matrix gets the type llama-quantize gives it (mix_type() below). A
// matrix whose row length is not a multiple of the target's block falls back, with a notice, as
// llama-quantize falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; other types to Q8_0; or
// --fallback-type), else to F16: the run never stops on a shape.
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
#include <unordered_map>
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
  std::string fallback_type;
  bool keep_8bit_embeddings = false;
  bool clip_search = false;
  int n_threads = 0;
};

// llama.cpp's K-quant mixes (llama-quantize's file types): the base type for most matrices and more
// bits where mix_type() says. S (small) and M (medium) differ only in those exceptions.
struct Mix {
  std::string_view name;
  TensorType base;
  bool medium;
  uint32_t file_type;  // llama.cpp's llama_ftype, written to general.file_type
};
constexpr Mix kMixes[] = {
    {"Q4_K_S", TensorType::Q4_K, false, 14},
    {"Q4_K_M", TensorType::Q4_K, true, 15},
    {"Q5_K_S", TensorType::Q5_K, false, 16},
    {"Q5_K_M", TensorType::Q5_K, true, 17},
};

// The parsed types of one run.
struct Targets {
  std::string name;                      // --type as given, in its canonical spelling
  TensorType weights;                    // a plain type, or the mix's base type
  const Mix* mix = nullptr;              // set for a mix
  std::optional<TensorType> embeddings;  // --embd-type or --keep-8bit-embeddings
  std::optional<TensorType> fallback;    // --fallback-type
};

// What a mix's rules read of the model beyond the tensor at hand.
struct ModelFacts {
  bool tied = true;     // no output.weight: token_embd.weight is the output matrix too
  int n_layer = 0;      // <arch>.block_count
  int n_attn_v = 0;     // attn_v matrices
  bool is_70b = false;  // llama.cpp's LLM_TYPE_70B (is_70b_model())
  // An attn_v or ffn_down matrix's position among those of its kind in the order llama-quantize
  // visits tensors (by layer number, then name): its counters i_attention_wv and i_ffn_down.
  std::unordered_map<std::string, int> index;
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

// The names --type takes: every plain type, then the mixes.
std::string valid_names(bool with_mixes) {
  std::string valid;
  for (const std::string_view n : quantize_type_names()) valid += (valid.empty() ? "" : ", ") + std::string(n);
  if (with_mixes) {
    for (const Mix& m : kMixes) valid += ", " + std::string(m.name);
  }
  return valid;
}

TensorType parse_type(const std::string& name, const char* flag) {
  if (const std::optional<TensorType> t = parse_quantize_type(name)) return *t;
  throw std::runtime_error(std::string(flag) + ": unknown type '" + name + "' (valid: " + valid_names(false) + ")");
}

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [&](char x, char y) { return lower(x) == lower(y); });
}

// --type: a mix or a plain type.
void parse_weights_type(const std::string& name, Targets& targets) {
  for (const Mix& m : kMixes) {
    if (equal_ignoring_case(name, m.name)) {
      targets.mix = &m;
      targets.weights = m.base;
      targets.name = m.name;
      return;
    }
  }
  const std::optional<TensorType> t = parse_quantize_type(name);
  if (!t) throw std::runtime_error("--type: unknown type '" + name + "' (valid: " + valid_names(true) + ")");
  targets.weights = *t;
  targets.name = type_name(*t);
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

// --- llama.cpp's mixes --------------------------------------------------------------------------

// The kinds of matrix llama.cpp's rules tell apart (llama-quant.cpp, tensor_get_category).
enum class Kind { kOutput, kTokenEmbd, kAttnV, kFfnDown, kOther };

Kind kind_of(std::string_view name, bool tied) {
  const auto has = [&](std::string_view part) { return name.find(part) != std::string_view::npos; };
  if (name == "output.weight") return Kind::kOutput;
  if (name == "token_embd.weight") return tied ? Kind::kOutput : Kind::kTokenEmbd;  // tied: it is the output too
  if (has("attn_qkv.weight") || has("attn_kv_b.weight") || has("attn_v.weight")) return Kind::kAttnV;
  if (has("ffn_down")) return Kind::kFfnDown;
  return Kind::kOther;
}

// The layer of "blk.N.*", -1 for tensors outside the layers.
int layer_of(std::string_view name) {
  if (name.substr(0, 4) != "blk.") return -1;
  int layer = 0;
  size_t i = 4;
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) layer = std::min(layer * 10 + (name[i] - '0'), 1 << 20);
  return i < name.size() && name[i] == '.' ? layer : -1;
}

// llama.cpp's LLM_TYPE_70B, which its loader gives by family and layer count: a llama of 80 layers
// with grouped-query attention (with as many KV heads as query heads it is a 65B), a qwen2 of 80
// layers (Qwen2-72B); no other family ringlm runs has one.
bool is_70b_model(const std::string& arch, int n_layer, std::optional<uint64_t> n_head, uint64_t n_head_kv) {
  if (n_layer != 80) return false;
  if (arch == "llama") return n_head && *n_head != n_head_kv;
  return arch == "qwen2";
}

ModelFacts model_facts(const GgufFile& in, const Mix& mix) {
  ModelFacts f;
  const std::string arch(in.get_string("general.architecture").value_or(""));
  f.tied = in.find_tensor("output.weight") == nullptr;
  std::vector<const GgufTensorInfo*> attn_v, ffn_down;
  for (const GgufTensorInfo& t : in.tensors()) {
    if (!is_weight_matrix(t)) continue;
    const Kind k = kind_of(t.name, f.tied);
    if (k == Kind::kAttnV) attn_v.push_back(&t);
    if (k == Kind::kFfnDown) ffn_down.push_back(&t);
  }
  for (std::vector<const GgufTensorInfo*>* list : {&attn_v, &ffn_down}) {
    std::sort(list->begin(), list->end(), [](const GgufTensorInfo* a, const GgufTensorInfo* b) {
      const int la = layer_of(a->name), lb = layer_of(b->name);
      return la != lb ? la < lb : a->name < b->name;
    });
    for (size_t i = 0; i < list->size(); ++i) f.index[(*list)[i]->name] = static_cast<int>(i);
  }
  f.n_attn_v = static_cast<int>(attn_v.size());
  f.n_layer = static_cast<int>(in.get_uint(arch + ".block_count").value_or(ffn_down.size()));
  const std::optional<uint64_t> n_head = in.get_uint(arch + ".attention.head_count");
  const uint64_t n_head_kv = in.get_uint(arch + ".attention.head_count_kv").value_or(n_head.value_or(0));
  f.is_70b = is_70b_model(arch, f.n_layer, n_head, n_head_kv);
  if (in.get_uint(arch + ".expert_count").value_or(0) > 1) {
    // llama.cpp has rules of its own for experts (and ringlm quantizes only 2-D matrices).
    throw std::runtime_error("--type " + std::string(mix.name) + ": this model has experts; the mixes are implemented for dense models");
  }
  return f;
}

// Layers 0 .. n/8-1, 7n/8 .. n-1 and every third layer between: where llama.cpp spends more bits
// (llama-quant.cpp, use_more_bits).
bool more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

// The type llama-quantize gives a matrix in a mix: llama-quant.cpp's llama_tensor_get_type_impl as
// a dense model of a family ringlm runs goes through it with a K-quant mix (no imatrix), before the
// shape fallback. The families differ only in is_70b; a fused attn_qkv (Phi-3) takes attn_v's
// rules and counters, as there (its ATTENTION_QKV branch comes after the attn_v one and is never
// reached), and Phi-3's fused gate|up in ffn_up the base type, as any ffn_up.
TensorType mix_type(const Mix& mix, const GgufTensorInfo& t, const ModelFacts& m) {
  const bool q4_k_s = mix.base == TensorType::Q4_K && !mix.medium;
  switch (kind_of(t.name, m.tied)) {
    case Kind::kOutput:
      // output.weight (and a tied token_embd): Q6_K, or Q8_0 where its rows do not split into the
      // base type's blocks of 256.
      return row_fits(mix.base, t.cols()) ? TensorType::Q6_K : TensorType::Q8_0;
    case Kind::kTokenEmbd:
      return mix.base;  // an embedding table apart from the output matrix: the base type
    case Kind::kAttnV: {
      const int i = m.index.at(t.name);
      TensorType type = mix.base;
      if (mix.medium && more_bits(i, m.n_attn_v)) {
        type = TensorType::Q6_K;  // *_M: attn_v in the more_bits layers
      } else if (q4_k_s && i < 4) {
        type = TensorType::Q5_K;  // Q4_K_S: the first four attn_v
      }
      // A 70B's attn_v is 8 times smaller than its attn_q (8 query heads per KV head): more bits
      // there cost little.
      if (m.is_70b && type == TensorType::Q4_K) type = TensorType::Q5_K;
      return type;
    }
    case Kind::kFfnDown: {
      const int i = m.index.at(t.name);
      if (mix.medium && more_bits(i, m.n_layer)) return TensorType::Q6_K;  // *_M: ffn_down in the more_bits layers
      if (q4_k_s && i < m.n_layer / 8) return TensorType::Q5_K;            // Q4_K_S: the first eighth of ffn_down
      return mix.base;
    }
    case Kind::kOther:
      break;
  }
  return mix.base;  // attn_q, attn_k, attn_output, ffn_gate, ffn_up
}

// The type for a matrix whose rows do not split into `wanted`'s blocks: --fallback-type when given,
// else llama-quantize's (llama-quant.cpp, tensor_type_fallback) for the K-quants and Q8_0 for the
// rest; F16 where that does not fit either.
TensorType fallback_type(TensorType wanted, const Targets& targets, int64_t cols) {
  TensorType type = TensorType::Q8_0;
  if (targets.fallback) {
    type = *targets.fallback;
  } else if (wanted == TensorType::Q4_K) {
    type = TensorType::Q5_0;
  } else if (wanted == TensorType::Q5_K) {
    type = TensorType::Q5_1;
  }
  return row_fits(type, cols) ? type : TensorType::F16;
}

// The same bytes under two type ids: no requantizing needed.
bool same_layout(TensorType from, TensorType to) {
  const uint32_t to_id = static_cast<uint32_t>(to);
  return (from == TensorType::Q4_0 && to_id == int4_type_id({32, false, ScaleType::kF16})) ||
         (from == TensorType::Q4_1 && to_id == int4_type_id({32, true, ScaleType::kF16}));
}

TensorPlan plan_tensor(const GgufTensorInfo& t, const Targets& targets, const ModelFacts& facts) {
  if (!is_weight_matrix(t)) return {&t, t.type, Action::kCopy};
  TensorType out = targets.weights;
  if (is_embedding(t.name) && targets.embeddings) {
    out = *targets.embeddings;
  } else if (targets.mix) {
    out = mix_type(*targets.mix, t, facts);
  }
  if (!row_fits(out, t.cols())) {
    const TensorType fallback = fallback_type(out, targets, t.cols());
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

// llama.cpp's general.file_type (llama_ftype): a mix's own, else the one llama.cpp's loader gives a
// file made mostly of the type (a plain Q4_K file reads as Q4_K_M); ringlm's own types have none.
std::optional<uint32_t> llama_file_type(const Targets& targets) {
  if (targets.mix) return targets.mix->file_type;
  switch (targets.weights) {
    case TensorType::F32: return 0;
    case TensorType::F16: return 1;
    case TensorType::Q4_0: return 2;
    case TensorType::Q4_1: return 3;
    case TensorType::Q8_0: return 7;
    case TensorType::Q5_0: return 8;
    case TensorType::Q5_1: return 9;
    case TensorType::Q4_K: return 15;
    case TensorType::Q5_K: return 17;
    case TensorType::Q6_K: return 18;
    case TensorType::BF16: return 32;
    default: return std::nullopt;
  }
}

void copy_metadata(const GgufFile& in, const Targets& targets, GgufWriter& w) {
  for (const std::string& key : in.keys()) {
    const GgufValue& v = *in.find(key);
    if (v.type == GgufValueType::ARRAY && v.array_type == GgufValueType::ARRAY) {
      std::fprintf(stderr, "ringlm quantize: note: metadata '%s' is a nested array; not copied\n", key.c_str());
      continue;
    }
    w.set_value(key, v);
  }
  w.set_string("ringlm.quantization", targets.name);
  if (const std::optional<uint32_t> ft = llama_file_type(targets)) {
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

void write_model(const GgufFile& in, const std::vector<TensorPlan>& plans, const Targets& targets,
                 const QuantizeOptions& q, const std::string& path) {
  GgufWriter w(path);
  copy_metadata(in, targets, w);
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
  parse_weights_type(o.type, targets);
  if (o.keep_8bit_embeddings) {
    targets.embeddings = TensorType::Q8_0;
  } else if (!o.embd_type.empty()) {
    targets.embeddings = parse_type(o.embd_type, "--embd-type");
  }
  if (!o.fallback_type.empty()) targets.fallback = parse_type(o.fallback_type, "--fallback-type");
  omp_set_num_threads(resolve_threads(o.n_threads));

  const std::unique_ptr<GgufFile> in = GgufFile::open(o.input);
  const ModelFacts facts = targets.mix ? model_facts(*in, *targets.mix) : ModelFacts{};
  std::vector<TensorPlan> plans;
  for (const GgufTensorInfo& t : in->tensors()) plans.push_back(plan_tensor(t, targets, facts));

  QuantizeOptions q;
  q.clip_search = o.clip_search;
  const std::string tmp = o.output + ".tmp";
  try {
    write_model(*in, plans, targets, q, tmp);
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
  cmd->add_option("--type", o->type,
                  "type of the weight matrices, or one of llama.cpp's mixes: " + valid_names(true))
      ->required();
  cmd->add_flag("--keep-8bit-embeddings", o->keep_8bit_embeddings, "token_embd and output weights in Q8_0");
  cmd->add_option("--embd-type", o->embd_type,
                  "type of token_embd and output weights (default: --type, or the mix's choice)");
  cmd->add_option("--fallback-type", o->fallback_type,
                  "type of a matrix whose rows do not split into its type's blocks (default: as llama-quantize, "
                  "Q5_0 for Q4_K, Q5_1 for Q5_K, else Q8_0; F16 where that does not fit either)");
  cmd->add_option("-t,--threads", o->n_threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  // Off by default: on SmolLM2 (requantized from Q4_1) the search lowered every group's squared
  // error yet raised perplexity (KJV, 20 chunks of 512: i4s-g32 10.80 plain, 11.45 searched).
  cmd->add_flag("--clip-search", o->clip_search,
                "INT4 types: per group, search the clipping ratio (0.80-1.00) that minimises the squared error, "
                "instead of plain round-to-nearest");
  cmd->callback([o] { quantize(*o); });
}

}  // namespace ringlm
