// Time of each op of a decode step on a plugin's device (the OpenCL plugin by default), one op
// at a time: enqueued 50 times back to back, then one finish, so the figure is the op's device
// time plus its enqueue cost, without a host wait per op. The shapes are a decode step of the
// SmolLM2-135M shape (d 576, 9 heads of 64, 3 KV heads, ff 1536, vocab 49152, Q4_1), or of the
// Llama-3.2-1B shape with --1b (d 2048, 32 heads, 8 KV heads, ff 8192, vocab 128256, Q4_0).
//
//   bench_opencl_ops [--plugin PATH] [--device N] [--1b] [--slots N] [--flat] [--prompt M]
//
// The products run as matmul2 (the decode GEMV, the norm fused into the products of a norm's
// output); --flat times the version-1 flat GEMM instead. --prompt M times a prompt chunk of M
// tokens instead of a decode step: every product on M rows (past 16 the GEMM on a GPU, on int8
// activations where the plugin takes that path: RINGLM_OPENCL_INT8=0|1 forces it either way) and
// the chunk's causal attention over its own M slots (the tiled attention on a GPU).
//
// What it is for: seeing which op a decode step spends its time in on a device (and what one
// launch costs there: "scale n=1"), before and after a kernel changes.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/plugin_api.h"

namespace {

const ringlm_plugin* g_api = nullptr;
ringlm_context* g_ctx = nullptr;

void check(int32_t status, const char* what) {
  if (status != RINGLM_OK) throw std::runtime_error(std::string(what) + ": " + g_api->last_error(g_ctx));
}

ringlm_buffer* alloc(size_t bytes) {
  ringlm_buffer* b = g_api->alloc(g_ctx, bytes);
  if (b == nullptr) throw std::runtime_error("alloc: " + std::string(g_api->last_error(g_ctx)));
  std::vector<unsigned char> zeros(bytes, 0);
  check(g_api->upload(g_ctx, b, 0, zeros.data(), bytes), "upload");
  return b;
}

// Microseconds per op: `reps` enqueues, one finish; the median of 5 such rounds.
double time_op(const std::function<void()>& op, int reps = 50) {
  op();
  check(g_api->finish(g_ctx), "finish");
  std::vector<double> rounds;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) op();
    check(g_api->finish(g_ctx), "finish");
    rounds.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[2];
}

struct Shape {
  int64_t d, n_head, n_head_kv, head_dim, ff, vocab, n_layer;
  uint32_t format;
  size_t block_bytes;
  int64_t q_dim() const { return n_head * head_dim; }
  int64_t kv_dim() const { return n_head_kv * head_dim; }
};

struct Options {
  std::string plugin = RINGLM_OPENCL_PLUGIN;
  int device = 0, slots = 64, m = 1;
  bool flat_only = false;  // --flat: the version-1 matmul instead of matmul2's GEMV
  Shape s{576, 9, 3, 64, 1536, 49152, 30, RINGLM_FORMAT_Q4_1, 20};
};

// The command line; false (after printing the usage) for anything else.
bool parse_options(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--plugin" && i + 1 < argc) o.plugin = argv[++i];
    else if (a == "--device" && i + 1 < argc) o.device = std::atoi(argv[++i]);
    else if (a == "--slots" && i + 1 < argc) o.slots = std::atoi(argv[++i]);
    else if (a == "--flat") o.flat_only = true;
    else if (a == "--prompt" && i + 1 < argc) o.m = std::max(1, std::atoi(argv[++i]));
    else if (a == "--1b") o.s = Shape{2048, 32, 8, 64, 8192, 128256, 16, RINGLM_FORMAT_Q4_0, 18};
    else {
      std::fprintf(stderr, "usage: %s [--plugin PATH] [--device N] [--1b] [--slots N] [--flat] [--prompt M]\n",
                   argv[0]);
      return false;
    }
  }
  if (o.m > 1) o.slots = std::max(o.slots, o.m);  // a prompt chunk attends over its own slots at least
  return true;
}

// Loads the plugin and opens the device (g_api, g_ctx), and says which device it is.
void open_device(const std::string& plugin, int device) {
  void* lib = dlopen(plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error(dlerror());
  auto entry = reinterpret_cast<ringlm_plugin_entry_fn>(dlsym(lib, RINGLM_PLUGIN_ENTRY));
  if (entry == nullptr) throw std::runtime_error("no entry point");
  g_api = entry();
  if (g_api->abi_version < 2) throw std::runtime_error("the plugin speaks ABI 1: this bench needs 2");
  ringlm_device_info info{};
  check(g_api->device_info(device, &info), "device_info");
  ringlm_open_options options{};
  options.struct_size = sizeof(options);
  g_ctx = g_api->open(device, &options);
  if (g_ctx == nullptr) throw std::runtime_error(g_api->last_error(nullptr));
  std::printf("device: %s (%s)\n", info.name, info.version);
}

// The activations and the KV cache of a step (zeros: an op's time does not depend on values).
struct StepBuffers {
  ringlm_buffer *x, *y, *norm_w, *angles, *keys, *values, *positions;
};

StepBuffers alloc_step(const Options& o) {
  const Shape& s = o.s;
  const int64_t m = o.m;
  StepBuffers b{};
  b.x = alloc(static_cast<size_t>(m * std::max({s.d, s.ff, s.q_dim()})) * 4);
  b.y = alloc(static_cast<size_t>(m * std::max({s.vocab, s.ff})) * 4);
  b.norm_w = alloc(static_cast<size_t>(s.d) * 4);
  b.angles = alloc(static_cast<size_t>(m * s.head_dim) * 4);
  b.keys = alloc(static_cast<size_t>(o.slots * s.kv_dim()) * 2);
  b.values = alloc(static_cast<size_t>(o.slots * s.kv_dim()) * 2);
  std::vector<int32_t> pos(static_cast<size_t>(o.slots));
  for (int j = 0; j < o.slots; ++j) pos[static_cast<size_t>(j)] = j;
  b.positions = alloc(pos.size() * 4);
  check(g_api->upload(g_ctx, b.positions, 0, pos.data(), pos.size() * 4), "upload");
  return b;
}

struct Row {
  std::string name;
  int per_layer;  // how often a decode step runs it per layer (0: once per step; -1: not in the step's sum)
  double us;
};

// One product of an n x k weight: matmul2 (with the norm fused where its input is a norm's
// output), or with --flat the version-1 matmul.
Row time_product(const Options& o, const StepBuffers& b, const char* name, int64_t n, int64_t k, int per_layer) {
  ringlm_buffer* w = alloc(static_cast<size_t>(n * k / 32) * o.s.block_bytes);
  ringlm_matmul_args a{};
  a.weight = w;
  a.weight_format = o.s.format;
  a.n = n;
  a.k = k;
  a.x = b.x;
  a.y = b.y;
  a.m = o.m;
  ringlm_matmul2_args fused{};
  fused.base = a;
  fused.rms_weight = b.norm_w;
  fused.rms_eps = 1e-5f;
  Row row;
  if (!o.flat_only) {
    const bool normed = k == o.s.d;  // the products whose input is a norm's output
    if (!normed) fused.rms_weight = nullptr;
    row = {std::string(name) + (normed ? " +norm" : ""), per_layer,
           time_op([&] { check(g_api->matmul2(g_ctx, &fused), "matmul2"); })};
  } else {
    row = {std::string(name) + " (flat)", per_layer, time_op([&] { check(g_api->matmul(g_ctx, &a), "matmul"); })};
  }
  g_api->free(g_ctx, w);
  return row;
}

void time_products(const Options& o, const StepBuffers& b, std::vector<Row>& rows) {
  const Shape& s = o.s;
  rows.push_back(time_product(o, b, "matmul q (d x d)", s.q_dim(), s.d, 1));
  rows.push_back(time_product(o, b, "matmul k/v (kv x d)", s.kv_dim(), s.d, 2));
  rows.push_back(time_product(o, b, "matmul o (d x d)", s.d, s.q_dim(), 1));
  rows.push_back(time_product(o, b, "matmul gate/up (ff x d)", s.ff, s.d, 2));
  rows.push_back(time_product(o, b, "matmul down (d x ff)", s.d, s.ff, 1));
  if (o.m == 1) rows.push_back(time_product(o, b, "matmul logits (vocab x d)", s.vocab, s.d, 0));  // a prompt's logits: its last row only
}

// The row-wise ops of a layer: norm, residual, activation, RoPE, the KV store.
void time_row_ops(const Options& o, const StepBuffers& b, std::vector<Row>& rows) {
  const Shape& s = o.s;
  const int m = o.m;
  ringlm_rms_norm_args rn{b.x, 0, b.x, 0, b.norm_w, 0, m, s.d, 1e-5f};
  rows.push_back({"rms_norm (1 x d)", 2, time_op([&] { check(g_api->rms_norm(g_ctx, &rn), "rms_norm"); })});
  ringlm_add_args ad{b.x, 0, b.y, 0, m * s.d, s.d};
  rows.push_back({"add (d)", 2, time_op([&] { check(g_api->add(g_ctx, &ad), "add"); })});
  ringlm_glu_args gl{b.y, 0, b.x, 0, m * s.ff, RINGLM_ACT_SILU};
  ringlm_buffer* up = alloc(static_cast<size_t>(m * s.ff) * 4);
  gl.up = up;
  rows.push_back({"glu (ff)", 1, time_op([&] { check(g_api->glu(g_ctx, &gl), "glu"); })});
  ringlm_rope_args rp{b.x, 0, m, static_cast<int32_t>(s.n_head), static_cast<int32_t>(s.head_dim),
                      static_cast<int32_t>(s.head_dim), 0, b.angles, 0, b.angles, 0};
  rows.push_back({"rope (q)", 2, time_op([&] { check(g_api->rope(g_ctx, &rp), "rope"); })});
  ringlm_store_kv_args st{b.x, 0, b.keys, 0, RINGLM_FORMAT_F16, m, s.kv_dim()};
  rows.push_back({"store_kv (" + std::to_string(m) + " rows)", 2, time_op([&] { check(g_api->store_kv(g_ctx, &st), "store_kv"); })});
}

// Attention over the cache, the picks a step reads back, and the cost of one launch.
void time_attention_and_picks(const Options& o, const StepBuffers& b, std::vector<Row>& rows) {
  const Shape& s = o.s;
  const int m = o.m, slots = o.slots;
  ringlm_attention2_args at{};
  at.base = ringlm_attention_args{b.x, 0, b.y, 0, b.keys, 0, b.values, 0, RINGLM_FORMAT_F16, s.kv_dim(), b.positions,
                                  slots, m, slots - m, static_cast<int32_t>(s.n_head),
                                  static_cast<int32_t>(s.n_head_kv), static_cast<int32_t>(s.head_dim), 0.125f};
  rows.push_back({"attention (" + std::to_string(slots) + " slots)", 1,
                  time_op([&] { check(g_api->attention2(g_ctx, &at), "attention"); })});
  if (g_api->abi_version >= 3 && m == 1) {  // the greedy pick a step reads back instead of the logits; top-40 beside it
    ringlm_buffer* picks = alloc(RINGLM_TOP_K_MAX * sizeof(ringlm_top_entry));
    for (int32_t k : {1, 40}) {
      ringlm_top_k_args tk{b.y, 0, 1, s.vocab, k, picks, 0};
      rows.push_back({"top_k (vocab, k=" + std::to_string(k) + ")", k == 1 ? 0 : -1,
                      time_op([&] { check(g_api->top_k(g_ctx, &tk), "top_k"); })});
    }
  }
  rows.push_back({"scale n=1 (a launch)", -1, time_op([&] { check(g_api->scale(g_ctx, b.x, 0, 1, 1.0f), "scale"); })});
}

// The table, and the step's (or the chunk's) sum of its ops.
void print_table(const std::vector<Row>& rows, const Options& o) {
  double step = 0;
  std::printf("%-32s %10s %12s\n", "op", "us", "us/step");
  for (const Row& r : rows) {
    const double per_step = r.per_layer < 0 ? 0 : r.us * (r.per_layer == 0 ? 1 : r.per_layer * o.s.n_layer);
    step += per_step;
    std::printf("%-32s %10.1f %12.1f\n", r.name.c_str(), r.us, per_step);
  }
  if (o.m == 1) {
    std::printf("%-32s %10s %12.1f  (%.1f t/s)\n", "decode step (sum)", "", step, 1e6 / step);
  } else {
    std::printf("%-32s %10s %12.1f  (%.1f t/s)\n", ("prompt chunk of " + std::to_string(o.m) + " (sum)").c_str(), "",
                step, 1e6 * o.m / step);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, o)) return 2;
  try {
    open_device(o.plugin, o.device);
    const StepBuffers buffers = alloc_step(o);
    std::vector<Row> rows;
    time_products(o, buffers, rows);
    time_row_ops(o, buffers, rows);
    time_attention_and_picks(o, buffers, rows);
    print_table(rows, o);
    g_api->close(g_ctx);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_opencl_ops: %s\n", e.what());
    return 1;
  }
  return 0;
}
