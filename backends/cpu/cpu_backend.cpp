// CPU backend. Three ways to a product, chosen per call:
//  - packed (ComputeType::kInt8, every type of packed_format.h, M below the weight's crossover):
//    the weights copied 16 rows interleaved at prepare (kernel_packed.h); activations quantized
//    once per call in the form the weights' formats need (int8 per 32 or per 256), or read as
//    fp32 rows by the F32/F16/BF16 kernels.
//  - fp32 rows (fp32 compute, small M): each weight row is dequantized to fp32 once per call
//    and multiplied with every token's activations: the reference path.
//  - fp32 sgemm (M >= kSgemmMinTokens on fp32 compute, or the weight's crossover on int8
//    compute, where it is the faster prefill GEMM): fixed tiles of weight rows are dequantized
//    to fp32 (from the packed copy when there is one) and multiplied by OpenBLAS sgemm.
// The crossover is per weight shape, from the tuning table `ringlm tune` measured on this
// machine (tuning.h), looked up once at prepare.
//
// Memory: once a weight is packed, the pages of the file that held it are given back to the
// kernel (madvise), so the model's weights are resident once, not twice.
//
// Fusion: matmul_many prepares its input once (RMSNorm applied row by row as it is quantized,
// the rows shared among the threads of the product's own parallel region) and covers all its
// weights in that region (the QKV projection); matmul_glu has each thread apply
// act(gate) * up to the outputs it has just computed.
//
// Threads: one OpenMP parallel region per call splits the weight rows N. Each output element
// is computed by one thread, in an order fixed by the shape alone, so results do not depend on
// the thread count. OpenBLAS is set to one thread: it runs inside our split, never beside it.
//
// No allocation per call: buffers (quantized activations, per-thread dequantized rows/tiles)
// are sized at prepare for the largest K and kPreparedTokens tokens, and only grow when a
// larger call arrives (a first prefill chunk).
#include "backends/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "backends/cpu/activation.h"
#include "backends/cpu/amx.h"
#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/layer_ops.h"
#include "backends/cpu/quantize_acts.h"

namespace ringlm {
namespace {

// Calls with at least this many tokens take the sgemm path on fp32 compute. On int8 compute the
// crossover is per weight shape (KernelTable; without a table, KernelTable::kDefaultCrossover:
// the int8 kernels for every M).
constexpr int64_t kSgemmMinTokens = 16;
// Token rows the activation buffer holds from prepare on (decode batches: flat GEMM sizes).
constexpr int64_t kPreparedTokens = 16;
// From this many input rows the threads share their quantization (with_quantized_input).
constexpr int64_t kSharedQuantizeTokens = 4;
// Largest tile of weight rows dequantized for one sgemm call.
constexpr int64_t kMaxTileRows = 128;

class CpuWeight final : public PreparedWeight {
 public:
  CpuWeight(const WeightView& w, int64_t int8_max_tokens)
      : PreparedWeight(w.rows, w.cols),
        type(w.type),
        data(w.data),
        row_stride(row_bytes(w.type, w.cols)),
        int8_below(int8_max_tokens) {}
  TensorType type;
  const uint8_t* data;
  size_t row_stride;
  // Calls with fewer tokens take the packed kernels: the crossover of this weight's shape, or 0
  // when they never run it (fp32 compute). One comparison per call.
  int64_t int8_below;
  // The weights interleaved 16 rows at a time (kernel_packed.h), made once here; the sgemm
  // prefill path dequantizes from it too. Empty on fp32 compute.
  cpu::PackedWeight packed;
  cpu::ActKind acts = cpu::ActKind::kFloat;  // what the packed kernels read
  // Products of `tiles_from` tokens or more (the tuning table's, by shape) run on the AMX tiles
  // (amx.h): where amx_state() is on (or emulated), for every int8 format. The same bits as the
  // packed kernels on VNNI.
  cpu::TilePath tiles = cpu::TilePath::kNone;
  int64_t tiles_from = KernelTable::kNever;
};

// Rows of work the packed products hand out at a time, at least: one 16-row group. OpenMP's
// guided schedule hands out shrinking runs of these: large first, a single one at the end, so
// that the threads finish together even when one core of a shared machine runs slower. With
// fixed chunks (1/16 of the work, handed out dynamically) the waits at the end of each product
// cost a --parallel 16 step about a tenth of its time: 8 paired runs, median ratio 1.12
// (bench/README.md).
constexpr int64_t kPieceUnits = 1;

// Hands out the work items [0, n) to the threads of a parallel region in runs, as OpenMP's guided
// schedule does (a run is the items left over the thread count, at least one), from `next`, which
// the region's threads share and which starts at 0; calls body(begin, end) for each run this thread
// takes. Unlike an `omp for`, the body sees a whole run, so it can make one call of what the run's
// items share (an expert's consecutive pieces), and there is no barrier at the end.
template <class Body>
void take_guided_runs(std::atomic<int64_t>& next, int64_t n, int threads, Body&& body) {
  int64_t begin = next.load(std::memory_order_relaxed);
  for (;;) {
    if (begin >= n) return;
    const int64_t end = std::min(n, begin + std::max<int64_t>(1, (n - begin) / threads));
    if (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) continue;  // begin reloaded
    body(begin, end);
    begin = next.load(std::memory_order_relaxed);
  }
}

// Rows the packed kernels take as one unit of work (threads split N on these boundaries).
constexpr int64_t kUnitRows = cpu::kPackRows;
int64_t row_units(int64_t rows) { return (rows + kUnitRows - 1) / kUnitRows; }

// Whether w's product of n_tokens rows runs on the AMX tiles.
bool on_tiles(const CpuWeight& w, int64_t n_tokens) { return w.tiles != cpu::TilePath::kNone && n_tokens >= w.tiles_from; }

// The packed product of rows [n0, n1) of w (n0 a multiple of kUnitRows); `terms`: the product's
// tokens' terms, for the tiles.
void gemm_packed_rows(const CpuWeight& w, int64_t n0, int64_t n1, const cpu::PackedInput& x,
                      const cpu::TileTokenTerms& terms, int64_t n_tokens, float* y) {
  if (on_tiles(w, n_tokens)) return cpu::gemm_on_tiles(w.tiles, w.packed, n0, n1, x, terms, n_tokens, y, w.rows());
  cpu::gemm_packed(w.packed, n0, n1, x, n_tokens, y, w.rows());
}

// Thread t's contiguous share [begin, end) of `units` work units among n threads.
struct Range {
  int64_t begin, end;
};
Range share(int64_t units, int t, int n) { return {units * t / n, units * (t + 1) / n}; }

// Rows per sgemm tile: a function of N only (never of the thread count), about N/8 so that
// small matrices still split evenly over a few threads, capped to keep the tile in L2.
int64_t sgemm_tile_rows(int64_t rows) { return std::min(kMaxTileRows, std::max<int64_t>(8, (rows + 63) / 64 * 8)); }

class CpuBackend final : public Backend {
 public:
  // A fixed crossover > 0 holds for every weight; 0 leaves each to `table`. A table measured
  // with another thread count is still used: it is the best guess there is (`ringlm tune -t N`
  // measures for N).
  CpuBackend(int n_threads, ComputeType compute, int64_t fixed_crossover, KernelTable table)
      : n_threads_(n_threads > 0 ? n_threads : omp_get_max_threads()),
        compute_(compute),
        fixed_crossover_(fixed_crossover),
        table_(std::move(table)),
        layer_ops_(n_threads_) {
    openblas_set_num_threads(1);
    per_thread_.resize(static_cast<size_t>(n_threads_));
  }

  std::string_view name() const override { return "CPU"; }

  void rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) override {
    layer_ops_.rope(x, n_rows, n_heads, head_dim, angles);
  }
  void store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) override {
    layer_ops_.store_kv(kv, layer, first_slot, n, k, v);
  }
  void attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) override {
    layer_ops_.attention(layer, shape, calls);
  }
  bool attends_stepwise() const override { return true; }
  void shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots, const RopeAngles& angles,
                  int n_head_kv, int head_dim) override {
    layer_ops_.shift_keys(kv, layers, slots, angles, n_head_kv, head_dim);
  }
  bool keeps_key_scales() const override { return true; }
  void scale(float* x, int64_t n, float factor) override { layer_ops_.scale(x, n, factor); }
  void add(float* x, const float* delta, int64_t n) override { layer_ops_.add(x, delta, n); }
  void add_row(float* x, const float* row, int64_t n_rows, int64_t width) override {
    layer_ops_.add_row(x, row, n_rows, width);
  }
  void rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps) override {
    layer_ops_.rms_norm(x, n_rows, width, weight, eps);
  }
  void glu(Activation act, float* gate, const float* up, int64_t n) override {
#pragma omp parallel num_threads(n_threads_)
    {
      const Range r = share(n, omp_get_thread_num(), omp_get_num_threads());
      cpu::glu(act, gate + r.begin, up + r.begin, r.end - r.begin);
    }
  }

  std::unique_ptr<PreparedWeight> prepare(const WeightView& w) override {
    const std::optional<TypeTraits> traits = type_traits(static_cast<uint32_t>(w.type));
    if (!traits || !traits->readable) {
      throw std::runtime_error("weight '" + w.name + "': tensor type " +
                               std::string(traits ? traits->name : "unknown") + " is not supported");
    }
    if (w.cols % traits->block_elems != 0) {
      throw std::runtime_error("weight '" + w.name + "': row length " + std::to_string(w.cols) +
                               " is not a multiple of the block size " + std::to_string(traits->block_elems));
    }
    const bool packed = compute_ == ComputeType::kInt8 && cpu::packed_supported(w.type, w.cols);
    reserve(packed ? kPreparedTokens : 0, w.cols, sgemm_tile_rows(w.rows));
    auto prepared = std::make_unique<CpuWeight>(w, packed ? crossover(w) : 0);
    if (!packed) return prepared;
    prepared->packed = cpu::pack_weight(w.type, w.data, prepared->row_stride, w.rows, w.cols, &arena_, w.mapped);
    if (prepared->packed.data == nullptr) throw std::runtime_error("weight '" + w.name + "': could not be packed");
    prepared->acts = cpu::packed_format(w.type)->acts;
    prepared->tiles = cpu::tile_path_for(w.type);
    prepared->tiles_from = table_.tiles_from(w.type, w.rows, w.cols);
    return prepared;
  }

  void rows(const PreparedWeight& weight, std::span<const int32_t> ids, float* out) override {
    const auto& w = static_cast<const CpuWeight&>(weight);
    for (size_t i = 0; i < ids.size(); ++i) dequantize_rows(w, ids[i], ids[i] + 1, out + static_cast<int64_t>(i) * w.cols());
  }

  void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    const PreparedWeight* weights[] = {&weight};
    float* const ys[] = {y};
    matmul_many(weights, MatmulInput{x, n_tokens, nullptr, 0.0f}, ys);
  }

  void matmul_add(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    const auto n = static_cast<size_t>(n_tokens * weight.rows());
    if (residual_.size() < n) residual_.resize(n);
    matmul(weight, x, n_tokens, residual_.data());
    layer_ops_.add(y, residual_.data(), static_cast<int64_t>(n));
  }

  void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& in,
                   std::span<float* const> ys) override {
    if (in.n_tokens <= 0 || weights.empty()) return;
    const int64_t cols = common_cols(weights);
    std::vector<const CpuWeight*>& packed_weights = packed_batch_;
    std::vector<float*>& packed_ys = packed_batch_ys_;
    packed_weights.clear();
    packed_ys.clear();
    const float* x32 = nullptr;
    for (size_t i = 0; i < weights.size(); ++i) {
      const auto& w = static_cast<const CpuWeight&>(*weights[i]);
      if (takes_packed(w, in.n_tokens)) {
        packed_weights.push_back(&w);
        packed_ys.push_back(ys[i]);
        continue;
      }
      if (x32 == nullptr) x32 = fp32_input(in, cols);
      matmul_fp32(w, x32, in.n_tokens, ys[i]);
    }
    if (packed_weights.empty()) return;
    matmul_packed(packed_weights, packed_ys, in, cols);
  }

  // The experts' products in one parallel region: each chosen expert's rows (gathered in expert
  // order) prepared once, every expert's gate|up pieces handed out together with act(g) * u
  // fused, the hidden rows prepared, every expert's down pieces, and each row's weighted sum.
  // Where a product would leave the packed kernels (fp32 compute, a crossover, the tiles), each
  // expert runs on its own (experts_apart): the seam default's bits, as the fused region's are
  // where both run the packed kernels (test_experts). Neither allocates once its buffers have
  // grown (test_decode_alloc).
  void moe_ffn(const ExpertBlock& experts, const ExpertRoutes& routes, const MatmulInput& in, Activation act,
               float* out) override {
    const auto n_expert = static_cast<int>(experts.gate.size());
    group_by_expert(routes, n_expert, moe_groups_);
    entries_by_row(moe_groups_, in.n_tokens, routes.k, moe_entries_);
    const int64_t d = experts.down[0]->rows(), ff = experts.gate[0]->rows();
    const auto n_routes = static_cast<int64_t>(moe_groups_.row.size());
    grow(moe_hidden_, n_routes * ff);
    grow(moe_products_, n_routes * d);
    if (!experts_fuse(experts, moe_groups_)) return experts_apart(experts, routes, in, act, out);
    moe_pieces(experts.gate, moe_up_pieces_);
    moe_pieces(experts.down, moe_down_pieces_);
    reserve(n_routes + in.n_tokens, std::max(d, ff), 0);  // the routes' slots, then each token's row
    grow(up_out_, n_routes * ff);
    const Needs up_needs = expert_needs(experts.gate, experts.up, d), down_needs = expert_needs(experts.down, {}, ff);
    float* const hidden = moe_hidden_.data();
    float* const up_y = up_out_.data();
    float* const products = moe_products_.data();
    const std::span<const int64_t> entries(moe_entries_);
    // One expert's rows [p.n0, p.n1) of gate and up, act(g) * u fused; of down.
    const auto gate_up_span = [&](const ExpertPiece& p) {
      const int64_t m0 = moe_groups_.start[static_cast<size_t>(p.expert)], m = moe_groups_.count(p.expert);
      const cpu::PackedInput x = gathered_input(d, m0, m);
      const auto& gate = static_cast<const CpuWeight&>(*experts.gate[static_cast<size_t>(p.expert)]);
      const auto& up = static_cast<const CpuWeight&>(*experts.up[static_cast<size_t>(p.expert)]);
      gemm_packed_rows(gate, p.n0, p.n1, x, tile_terms_, m, hidden + m0 * ff);
      gemm_packed_rows(up, p.n0, p.n1, x, tile_terms_, m, up_y + m0 * ff);
      add_expert_bias(experts.gate_bias, p, ff, m0, m, hidden);
      add_expert_bias(experts.up_bias, p, ff, m0, m, up_y);
      for (int64_t r = m0; r < m0 + m; ++r) cpu::glu(act, hidden + r * ff + p.n0, up_y + r * ff + p.n0, p.n1 - p.n0);
    };
    const auto down_span = [&](const ExpertPiece& p) {
      const int64_t m0 = moe_groups_.start[static_cast<size_t>(p.expert)], m = moe_groups_.count(p.expert);
      const auto& down = static_cast<const CpuWeight&>(*experts.down[static_cast<size_t>(p.expert)]);
      gemm_packed_rows(down, p.n0, p.n1, gathered_input(ff, m0, m), tile_terms_, m, products + m0 * d);
      add_expert_bias(experts.down_bias, p, d, m0, m, products);
    };
    std::atomic<int64_t> up_next{0}, down_next{0};  // the pieces handed out so far
#pragma omp parallel num_threads(n_threads_)
    {
      float* const scratch = per_thread_[static_cast<size_t>(omp_get_thread_num())].row.data();
      // Each token's row prepared once (in the slots after the routes'), then copied to the slot
      // of each expert it is routed to.
#pragma omp for schedule(static)
      for (int64_t r = 0; r < in.n_tokens; ++r) prepare_row_at(in.x + r * d, in, n_routes + r, d, up_needs, scratch);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n_routes; ++i) {
        copy_prepared_row(n_routes + moe_groups_.row[static_cast<size_t>(i)], i, d, up_needs);
        lay_out_gathered_row(i, d, up_needs, moe_groups_);
      }
      take_guided_runs(up_next, static_cast<int64_t>(moe_up_pieces_.size()), omp_get_num_threads(),
                       [&](int64_t c0, int64_t c1) { for_each_span(moe_up_pieces_, c0, c1, gate_up_span); });
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n_routes; ++i) {
        prepare_row_at(hidden + i * ff, MatmulInput{}, i, ff, down_needs, scratch);
        lay_out_gathered_row(i, ff, down_needs, moe_groups_);
      }
      take_guided_runs(down_next, static_cast<int64_t>(moe_down_pieces_.size()), omp_get_num_threads(),
                       [&](int64_t c0, int64_t c1) { for_each_span(moe_down_pieces_, c0, c1, down_span); });
#pragma omp barrier
      const Range r = share(in.n_tokens, omp_get_thread_num(), omp_get_num_threads());
      sum_weighted_rows(moe_groups_, entries, routes.k, products, d, r.begin, r.end, out);
    }
  }

  // Each chosen expert's rows gathered (in expert order) and multiplied by its own calls, then
  // each row's weighted sum.
  void experts_apart(const ExpertBlock& experts, const ExpertRoutes& routes, const MatmulInput& in, Activation act,
                     float* out) {
    const int64_t d = experts.down[0]->rows(), ff = experts.gate[0]->rows();
    grow(moe_gathered_, static_cast<int64_t>(moe_groups_.row.size()) * d);
    for (size_t i = 0; i < moe_groups_.row.size(); ++i) {
      std::copy_n(in.x + moe_groups_.row[i] * d, d, moe_gathered_.data() + static_cast<int64_t>(i) * d);
    }
    for (size_t e = 0; e < experts.gate.size(); ++e) {
      const int64_t m = moe_groups_.count(static_cast<int>(e)), m0 = moe_groups_.start[e];
      if (m == 0) continue;
      const MatmulInput rows{moe_gathered_.data() + m0 * d, m, in.rms_weight, in.rms_eps};
      if (experts.has_biases()) {
        grow(moe_up_, m * ff);
        expert_with_biases(experts, static_cast<int>(e), rows, act, moe_hidden_.data() + m0 * ff, moe_up_.data(),
                           moe_products_.data() + m0 * d);
        continue;
      }
      matmul_glu(*experts.gate[e], *experts.up[e], rows, act, moe_hidden_.data() + m0 * ff);
      matmul(*experts.down[e], moe_hidden_.data() + m0 * ff, m, moe_products_.data() + m0 * d);
    }
    sum_weighted_rows(moe_groups_, moe_entries_, routes.k, moe_products_.data(), d, 0, in.n_tokens, out);
  }

  void matmul_glu(const PreparedWeight& gate_w, const PreparedWeight& up_w, const MatmulInput& in, Activation act,
                  float* out) override {
    const auto& gate = static_cast<const CpuWeight&>(gate_w);
    const auto& up = static_cast<const CpuWeight&>(up_w);
    if (gate.rows() != up.rows() || gate.cols() != up.cols()) {
      throw std::invalid_argument("matmul_glu: gate and up differ in shape");
    }
    const int64_t n = in.n_tokens, ff = gate.rows();
    if (n <= 0) return;
    grow(up_out_, n * ff);
    float* up_y = up_out_.data();
    if (takes_packed(gate, n) && takes_packed(up, n)) {
      // Each thread computes the same rows of gate and up, then applies act(g) * u to the
      // outputs it just wrote, while they are still in its cache.
      // A thread's run of pieces goes in spans whose gate and up outputs fit in about 64 KiB:
      // one span for a decode step's run, a piece at a time for a prompt's.
      const int64_t pieces = (row_units(ff) + kPieceUnits - 1) / kPieceUnits;
      const int64_t span_pieces = std::max<int64_t>(1, (int64_t{8} << 10) / (n * kPieceUnits * kUnitRows));
      const CpuWeight* both[] = {&gate, &up};
      std::atomic<int64_t> next{0};
      with_prepared_input(in, gate.cols(), plan_inputs(both, n, gate.cols()), [&](const cpu::PackedInput& x) {
        take_guided_runs(next, pieces, omp_get_num_threads(), [&](int64_t c0, int64_t c1) {
          for (int64_t c = c0; c < c1; c += span_pieces) {
            const int64_t n0 = c * kPieceUnits * kUnitRows;
            const int64_t n1 = std::min(ff, std::min(c1, c + span_pieces) * kPieceUnits * kUnitRows);
            gemm_packed_rows(gate, n0, n1, x, tile_terms_, n, out);
            gemm_packed_rows(up, n0, n1, x, tile_terms_, n, up_y);
            for (int64_t m = 0; m < n; ++m) cpu::glu(act, out + m * ff + n0, up_y + m * ff + n0, n1 - n0);
          }
        });
      });
      return;
    }
    const PreparedWeight* weights[] = {&gate, &up};
    float* const ys[] = {out, up_y};
    matmul_many(weights, in, ys);
#pragma omp parallel num_threads(n_threads_)
    {
      const Range r = share(n * ff, omp_get_thread_num(), omp_get_num_threads());
      cpu::glu(act, out + r.begin, up_y + r.begin, r.end - r.begin);
    }
  }

 private:
  struct ThreadBuffers {
    std::vector<float> row;   // one dequantized weight row, or one normalised input row (K)
    std::vector<float> tile;  // one dequantized sgemm tile (tile rows x K)
  };
  // The forms of the input some weight of a call reads (cpu::ActKind).
  struct Needs {
    bool block = false, super = false, f32 = false;
    bool tile_terms = false;  // tile_terms_, for the weights on the tiles
  };

  template <class V>
  static void grow(V& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  }

  static int64_t common_cols(std::span<const PreparedWeight* const> weights) {
    const int64_t cols = weights[0]->cols();
    for (const PreparedWeight* w : weights) {
      if (w->cols() != cols) throw std::invalid_argument("matmul_many: the weights differ in their number of columns");
    }
    return cols;
  }

  static Needs needed_inputs(std::span<const CpuWeight* const> weights) {
    Needs n;
    for (const CpuWeight* w : weights) {
      n.block |= w->acts == cpu::ActKind::kBlock32;
      n.super |= w->acts == cpu::ActKind::kSuper256;
      n.f32 |= w->acts == cpu::ActKind::kFloat;
    }
    return n;
  }

  // What the packed products of `weights` on n_tokens rows of `cols` read: the input's forms and,
  // for those on the tiles, the tokens' terms (tile_terms_, sized here, filled with the input).
  Needs plan_inputs(std::span<const CpuWeight* const> weights, int64_t n_tokens, int64_t cols) {
    Needs n = needed_inputs(weights);
    tile_terms_.reset(n_tokens, cols / cpu::kActBlock);
    for (const CpuWeight* w : weights) {
      if (on_tiles(*w, n_tokens)) tile_terms_.add_format(*cpu::packed_format(w->type));
    }
    n.tile_terms = !tile_terms_.empty();
    return n;
  }

  static bool takes_packed(const CpuWeight& w, int64_t n_tokens) { return n_tokens < w.int8_below; }

  // --- Mixture of experts (moe_ffn) ---
  // A piece of work of one expert's product: its rows [n0, n1).
  struct ExpertPiece {
    int expert;
    int64_t n0, n1;
  };

  // Whether every chosen expert's products run on the packed kernels, off the tiles, at the
  // number of rows routed to it.
  bool experts_fuse(const ExpertBlock& experts, const ExpertGroups& groups) const {
    if (compute_ != ComputeType::kInt8) return false;
    for (size_t e = 0; e < experts.gate.size(); ++e) {
      const int64_t m = groups.count(static_cast<int>(e));
      if (m == 0) continue;
      for (const auto* list : {&experts.gate, &experts.up, &experts.down}) {
        const auto& w = static_cast<const CpuWeight&>(*(*list)[e]);
        if (w.packed.data == nullptr || !takes_packed(w, m) || on_tiles(w, m)) return false;
      }
    }
    return true;
  }

  // The columns [p.n0, p.n1) of expert p.expert's bias (`bias`: [n_expert][width]; nullptr: none)
  // added to the m rows from m0 of `y` ([rows][width]): the piece the thread just computed.
  static void add_expert_bias(const float* bias, const ExpertPiece& p, int64_t width, int64_t m0, int64_t m, float* y) {
    if (bias == nullptr) return;
    const float* b = bias + p.expert * width;
    for (int64_t r = m0; r < m0 + m; ++r) {
      for (int64_t c = p.n0; c < p.n1; ++c) y[r * width + c] += b[c];
    }
  }

  // Calls f for each span of the pieces [c0, c1): each run of one expert's consecutive pieces as
  // one piece of all their rows, so that a thread's run of pieces takes a few long products
  // rather than many of 16 rows (each of which starts its prefetching anew).
  template <class F>
  static void for_each_span(std::span<const ExpertPiece> pieces, int64_t c0, int64_t c1, F&& f) {
    for (int64_t c = c0; c < c1;) {
      ExpertPiece span = pieces[static_cast<size_t>(c)];
      for (++c; c < c1 && pieces[static_cast<size_t>(c)].expert == span.expert && pieces[static_cast<size_t>(c)].n0 == span.n1; ++c) {
        span.n1 = pieces[static_cast<size_t>(c)].n1;
      }
      f(span);
    }
  }

  // The pieces of the chosen experts' products with `weights` (one unit of rows each).
  void moe_pieces(std::span<const PreparedWeight* const> weights, std::vector<ExpertPiece>& pieces) const {
    pieces.clear();
    for (size_t e = 0; e < weights.size(); ++e) {
      if (moe_groups_.count(static_cast<int>(e)) == 0) continue;
      const int64_t rows = weights[e]->rows();
      for (int64_t u = 0; u < row_units(rows); u += kPieceUnits) {
        pieces.push_back({static_cast<int>(e), u * kUnitRows, std::min(rows, (u + kPieceUnits) * kUnitRows)});
      }
    }
  }

  // The input forms the chosen experts' weights (of `cols` columns) read.
  Needs expert_needs(std::span<const PreparedWeight* const> a, std::span<const PreparedWeight* const> b, int64_t cols) const {
    Needs n;
    for (const auto list : {a, b}) {
      for (size_t e = 0; e < list.size(); ++e) {
        if (moe_groups_.count(static_cast<int>(e)) == 0) continue;
        const CpuWeight* w = &static_cast<const CpuWeight&>(*list[e]);
        const Needs one = needed_inputs(std::span<const CpuWeight* const>(&w, 1));
        n.block |= one.block;
        n.super |= one.super && cols % cpu::kSuperBlock == 0;
        n.f32 |= one.f32;
      }
    }
    return n;
  }

  // `src` (one row of `cols`, normalised as `in` asks) into slot `slot` of the prepared inputs,
  // in the forms `needs` asks for: prepare_row's bits, for a row gathered from elsewhere.
  void prepare_row_at(const float* src, const MatmulInput& in, int64_t slot, int64_t cols, const Needs& needs,
                      float* scratch) {
    const MatmulInput one{src, 1, in.rms_weight, in.rms_eps};
    float* const dst = needs.f32 ? normed_.data() + slot * cols : scratch;
    const float* row = normalized_input_row(one, 0, cols, dst);
    if (needs.f32 && row != dst) std::copy_n(row, cols, dst);
    if (needs.block) cpu::quantize_acts(row, 0, 1, block_acts(cols, slot));
    if (needs.super) cpu::quantize_acts_super(row, 0, 1, super_acts(cols, slot));
  }

  // The prepared slot `from` copied to slot `to`, in the forms `needs` asks for.
  void copy_prepared_row(int64_t from, int64_t to, int64_t cols, const Needs& needs) {
    if (needs.f32) std::copy_n(normed_.data() + from * cols, cols, normed_.data() + to * cols);
    if (needs.block) {
      const cpu::QuantizedActs a = block_acts(cols, from), b = block_acts(cols, to);
      std::copy_n(a.q, cols, b.q);
      std::copy_n(a.d, a.blocks(), b.d);
      std::copy_n(a.s, a.blocks(), b.s);
      std::copy_n(a.sum, a.blocks(), b.sum);
    }
    if (needs.super) {
      const cpu::SuperActs a = super_acts(cols, from), b = super_acts(cols, to);
      std::copy_n(a.q, cols, b.q);
      std::copy_n(a.d, a.blocks(), b.d);
      std::copy_n(a.sum16, cols / 16, b.sum16);
      std::copy_n(a.sum32, cols / 32, b.sum32);
    }
  }

  // Prepared slot `slot` laid out for the passes of its expert's run of slots in `groups`.
  void lay_out_gathered_row(int64_t slot, int64_t cols, const Needs& needs, const ExpertGroups& groups) {
    const auto run = std::upper_bound(groups.start.begin(), groups.start.end(), slot) - 1;  // its expert's
    const int64_t m0 = *run, count = *(run + 1) - m0;
    if (count <= 1) return;
    if (needs.block) cpu::lay_out_for_passes(block_acts(cols, m0), slot - m0, count, pass_acts(cols, m0));
    if (needs.super) cpu::lay_out_for_passes(super_acts(cols, m0), slot - m0, count, super_pass_acts(cols, m0));
  }

  // The prepared inputs of the `count` rows `cols` wide from slot m0 on.
  cpu::PackedInput gathered_input(int64_t cols, int64_t m0, int64_t count) {
    cpu::PackedInput x;
    x.block = block_acts(cols, m0);
    x.super = super_acts(cols, m0);
    x.f32 = normed_.data() + m0 * cols;
    if (count > 1) x.passes = pass_acts(cols, m0);
    if (count > 1 && cols % cpu::kSuperBlock == 0) x.super_passes = super_pass_acts(cols, m0);
    return x;
  }

  // Tokens from which sgemm beats the packed kernels on this weight.
  int64_t crossover(const WeightView& w) const {
    return fixed_crossover_ > 0 ? fixed_crossover_ : table_.crossover(w.type, w.rows, w.cols);
  }

  // Grows the buffers to hold `tokens` input rows of `cols` in every prepared form and, per
  // thread, a row and a tile of `tile_rows` rows. Never shrinks, so steady-state calls
  // allocate nothing.
  void reserve(int64_t tokens, int64_t cols, int64_t tile_rows) {
    grow(act_q_, tokens * cols);
    grow(act_d_, tokens * cols / cpu::kActBlock);
    grow(act_s_, tokens * cols / cpu::kActBlock);
    grow(act_sum_, tokens * cols / cpu::kActBlock);
    grow(pass_q_, tokens * cols);
    grow(pass_d_, tokens * cols / cpu::kActBlock);
    grow(pass_s_, tokens * cols / cpu::kActBlock);
    grow(pass_sum_, tokens * cols / cpu::kActBlock);
    grow(super_q_, tokens * cols);
    grow(super_d_, tokens * cols / cpu::kSuperBlock);
    grow(super_sum16_, tokens * cols / 16);
    grow(super_sum32_, tokens * cols / 32);
    grow(super_pass_q_, tokens * cols);
    grow(super_pass_d_, tokens * cols / cpu::kSuperBlock);
    grow(super_pass_sum16_, tokens * cols / 16);
    grow(super_pass_sum32_, tokens * cols / 32);
    grow(normed_, tokens * cols);
    for (ThreadBuffers& b : per_thread_) {
      grow(b.row, cols);
      grow(b.tile, tile_rows * cols);
    }
  }

  // The prepared input buffers for rows of `cols`, from row m on.
  cpu::QuantizedActs block_acts(int64_t cols, int64_t m = 0) {
    const int64_t blocks = cols / cpu::kActBlock;
    return {act_q_.data() + m * cols, act_d_.data() + m * blocks, act_s_.data() + m * blocks,
            act_sum_.data() + m * blocks, cols};
  }
  // The same values laid out for the kernels' passes (cpu::lay_out_for_passes), from row m on.
  cpu::QuantizedActs pass_acts(int64_t cols, int64_t m = 0) {
    const int64_t blocks = cols / cpu::kActBlock;
    return {pass_q_.data() + m * cols, pass_d_.data() + m * blocks, pass_s_.data() + m * blocks,
            pass_sum_.data() + m * blocks, cols};
  }
  cpu::SuperActs super_pass_acts(int64_t cols, int64_t m = 0) {
    return {super_pass_q_.data() + m * cols, super_pass_d_.data() + m * (cols / cpu::kSuperBlock),
            super_pass_sum16_.data() + m * (cols / 16), super_pass_sum32_.data() + m * (cols / 32), cols};
  }
  cpu::SuperActs super_acts(int64_t cols, int64_t m = 0) {
    return {super_q_.data() + m * cols, super_d_.data() + m * (cols / cpu::kSuperBlock),
            super_sum16_.data() + m * (cols / 16), super_sum32_.data() + m * (cols / 32), cols};
  }

  // The input as fp32 rows: itself, or normalised into a backend buffer.
  const float* fp32_input(const MatmulInput& in, int64_t cols) {
    if (in.rms_weight == nullptr) return in.x;
    grow(normed_, in.n_tokens * cols);
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (in.n_tokens > 1)
    for (int64_t m = 0; m < in.n_tokens; ++m) {
      float* dst = normed_.data() + m * cols;
      const float* src = normalized_input_row(in, m, cols, dst);
      if (src != dst) std::copy_n(src, cols, dst);
    }
    return normed_.data();
  }

  // Row m of the input in every form `needs` asks for (`scratch`: a row buffer of this thread).
  void prepare_row(const MatmulInput& in, int64_t m, int64_t cols, const Needs& needs, float* scratch) {
    float* dst = needs.f32 && in.rms_weight != nullptr ? normed_.data() + m * cols : scratch;
    const float* row = normalized_input_row(in, m, cols, dst);
    if (needs.block) {
      cpu::quantize_acts(row, 0, 1, block_acts(cols, m));
      if (in.n_tokens > 1) cpu::lay_out_for_passes(block_acts(cols), m, in.n_tokens, pass_acts(cols));
    }
    if (needs.tile_terms) tile_terms_.fill(block_acts(cols), m);
    if (needs.super) {
      cpu::quantize_acts_super(row, 0, 1, super_acts(cols, m));
      if (in.n_tokens > 1) cpu::lay_out_for_passes(super_acts(cols), m, in.n_tokens, super_pass_acts(cols));
    }
  }

  // Normalises (when asked) and prepares the input rows in the forms the weights need, then runs
  // body(input) on every thread of one parallel region (body holds an orphaned `omp for`). A row
  // at a time goes through a per-thread row buffer: the normalised row never leaves the L1
  // cache. From kSharedQuantizeTokens rows the threads prepare a share each and meet at a
  // barrier, which costs less than the idle threads waiting for one to do it all; below, the
  // calling thread prepares them before the region.
  template <class Body>
  void with_prepared_input(const MatmulInput& in, int64_t cols, const Needs& needs, Body&& body) {
    reserve(in.n_tokens, cols, 0);
    const bool super = needs.super && cols % cpu::kSuperBlock == 0;
    Needs n = needs;
    n.super = super;
    const auto prepare_rows = [&](int64_t m_begin, int64_t m_end, float* scratch) {
      for (int64_t m = m_begin; m < m_end; ++m) prepare_row(in, m, cols, n, scratch);
    };
    const bool shared = in.n_tokens >= kSharedQuantizeTokens;
    if (!shared) prepare_rows(0, in.n_tokens, per_thread_[0].row.data());
    cpu::PackedInput x;
    x.block = block_acts(cols);
    x.super = super_acts(cols);
    x.f32 = in.rms_weight != nullptr ? normed_.data() : in.x;
    if (in.n_tokens > 1) x.passes = pass_acts(cols);
    if (in.n_tokens > 1 && super) x.super_passes = super_pass_acts(cols);
#pragma omp parallel num_threads(n_threads_)
    {
      if (shared) {  // the same for every thread: all or none meet the barrier
        const int t = omp_get_thread_num();
        const Range r = share(in.n_tokens, t, omp_get_num_threads());
        prepare_rows(r.begin, r.end, per_thread_[static_cast<size_t>(t)].row.data());
#pragma omp barrier
      }
      body(x);
    }
  }

  // Products of the input with several weights in one parallel region: the 16-row kernel units
  // of all the weights are numbered in sequence and handed out in pieces of kPieceUnits, in
  // guided runs, to whichever thread is free; a run is one call per weight it covers. Each
  // output is computed by one thread whichever it is, in the same order.
  void matmul_packed(std::span<const CpuWeight* const> weights, std::span<float* const> ys, const MatmulInput& in,
                     int64_t cols) {
    const int64_t n_tokens = in.n_tokens;
    int64_t total_units = 0;
    for (const CpuWeight* w : weights) total_units += row_units(w->rows());
    const int64_t pieces = (total_units + kPieceUnits - 1) / kPieceUnits;
    std::atomic<int64_t> next{0};
    with_prepared_input(in, cols, plan_inputs(weights, n_tokens, cols), [&](const cpu::PackedInput& x) {
      take_guided_runs(next, pieces, omp_get_num_threads(), [&](int64_t c0, int64_t c1) {
        const Range r{c0 * kPieceUnits, std::min(total_units, c1 * kPieceUnits)};
        int64_t first_unit = 0;  // of the current weight, in the joint numbering
        for (size_t i = 0; i < weights.size() && first_unit < r.end; ++i) {
          const CpuWeight& w = *weights[i];
          const int64_t units = row_units(w.rows());
          const int64_t u0 = std::max(r.begin, first_unit) - first_unit;
          const int64_t u1 = std::min(r.end, first_unit + units) - first_unit;
          if (u0 < u1) {
            gemm_packed_rows(w, u0 * kUnitRows, std::min(w.rows(), u1 * kUnitRows), x, tile_terms_, n_tokens, ys[i]);
          }
          first_unit += units;
        }
      });
    });
  }

  void matmul_fp32(const CpuWeight& w, const float* x, int64_t n_tokens, float* y) {
    if (n_tokens >= kSgemmMinTokens) return matmul_sgemm(w, x, n_tokens, y);
    matmul_rows(w, x, n_tokens, y);
  }

  void matmul_sgemm(const CpuWeight& w, const float* x, int64_t n_tokens, float* y) {
    const int64_t rows = w.rows(), cols = w.cols();
    const int64_t tile_rows = sgemm_tile_rows(rows);
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
    reserve(0, cols, tile_rows);
#pragma omp parallel num_threads(n_threads_)
    {
      const int t = omp_get_thread_num();
      const Range r = share(tiles, t, omp_get_num_threads());
      float* tile = per_thread_[static_cast<size_t>(t)].tile.data();
      for (int64_t i = r.begin; i < r.end; ++i) {
        const int64_t n0 = i * tile_rows, nr = std::min(tile_rows, rows - n0);
        dequantize_rows(w, n0, n0 + nr, tile);
        // y[:, n0:n0+nr] = x [n_tokens x K] * tile^T [K x nr]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n_tokens), static_cast<int>(nr),
                    static_cast<int>(cols), 1.0f, x, static_cast<int>(cols), tile, static_cast<int>(cols), 0.0f,
                    y + n0, static_cast<int>(rows));
      }
    }
  }

  // Rows [n0, n1) of w in fp32 into out: from the packed copy when there is one (the file's
  // pages are gone), else from the file.
  static void dequantize_rows(const CpuWeight& w, int64_t n0, int64_t n1, float* out) {
    if (w.packed.data != nullptr) return cpu::dequantize_packed(w.packed, n0, n1, out);
    for (int64_t n = n0; n < n1; ++n) {
      dequantize_row(w.type, w.data + static_cast<size_t>(n) * w.row_stride, out + (n - n0) * w.cols(), w.cols());
    }
  }

  void matmul_rows(const CpuWeight& w, const float* x, int64_t n_tokens, float* y) {
    const int64_t rows = w.rows(), cols = w.cols();
    reserve(0, cols, 0);
#pragma omp parallel num_threads(n_threads_)
    {
      const int t = omp_get_thread_num();
      const Range r = share(rows, t, omp_get_num_threads());
      float* row = per_thread_[static_cast<size_t>(t)].row.data();
      for (int64_t n = r.begin; n < r.end; ++n) {
        dequantize_rows(w, n, n + 1, row);
        // OpenBLAS's dot: vectorized for this CPU, and, not being instrumented, as fast in the
        // sanitizer build, where this reference path runs every oracle test.
        for (int64_t m = 0; m < n_tokens; ++m) {
          y[m * rows + n] = cblas_sdot(static_cast<int>(cols), x + m * cols, 1, row, 1);
        }
      }
    }
  }

  int n_threads_;
  ComputeType compute_;
  int64_t fixed_crossover_;  // > 0: every weight's crossover, else table_'s
  KernelTable table_;
  std::vector<int8_t> act_q_;  // the input quantized per 32 (block formats)
  std::vector<float> act_d_, act_s_;
  std::vector<int32_t> act_sum_;
  std::vector<int8_t> pass_q_;  // ... the same laid out for the kernels' passes
  std::vector<float> pass_d_, pass_s_;
  std::vector<int32_t> pass_sum_;
  std::vector<int8_t> super_q_;  // ... per 256 (super formats)
  std::vector<float> super_d_;
  std::vector<int32_t> super_sum16_, super_sum32_;
  std::vector<int8_t> super_pass_q_;  // ... the same laid out for the kernels' passes
  std::vector<float> super_pass_d_;
  std::vector<int32_t> super_pass_sum16_, super_pass_sum32_;
  cpu::TileTokenTerms tile_terms_;  // the tokens' terms of the products on the AMX tiles
  std::vector<float> normed_;  // normalised fp32 input rows (float formats and fp32 paths with RMSNorm)
  std::vector<float> up_out_;  // the up projection's outputs inside matmul_glu
  std::vector<float> residual_;  // matmul_add's product before it is added
  // moe_ffn's: the routes grouped by expert, each row's entries, the pieces of work, the hidden
  // rows and the experts' products (both in expert order).
  ExpertGroups moe_groups_;
  std::vector<int64_t> moe_entries_;
  std::vector<ExpertPiece> moe_up_pieces_, moe_down_pieces_;
  std::vector<float> moe_gathered_, moe_hidden_, moe_products_, moe_up_;
  std::vector<const CpuWeight*> packed_batch_;  // reused lists: no allocation per call
  std::vector<float*> packed_batch_ys_;
  std::vector<ThreadBuffers> per_thread_;
  cpu::WeightArena arena_;  // the packed weights, in the order the model prepares them
  cpu::LayerOps layer_ops_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, int64_t int8_sgemm_min_tokens) {
  // Only int8 compute has a crossover to look up: fp32 compute reads no file.
  const bool needs_table = int8_sgemm_min_tokens <= 0 && compute == ComputeType::kInt8;
  return std::make_unique<CpuBackend>(n_threads, compute, int8_sgemm_min_tokens,
                                      needs_table ? load_configured_kernel_table() : KernelTable{});
}

std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, const KernelTable& table) {
  return std::make_unique<CpuBackend>(n_threads, compute, 0, table);
}

std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute) { return make_cpu_backend(n_threads, compute, 0); }

}  // namespace ringlm
