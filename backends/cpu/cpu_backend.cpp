// CPU backend. Three ways to a product, chosen per call:
//  - int8 (ComputeType::kInt8, Q4_0/Q4_1/Q8_0 weights, M < kInt8SgemmMinTokens): activations
//    quantized once per call, integer kernels of int8_kernels.h straight from the mmap.
//  - fp32 rows (small M): each weight row is dequantized to fp32 once per call and multiplied
//    with every token's activations: the reference path.
//  - fp32 sgemm (M >= kSgemmMinTokens, or kInt8SgemmMinTokens on int8 compute, where it is the
//    faster prefill GEMM here): fixed tiles of weight rows are dequantized to fp32 and
//    multiplied by OpenBLAS sgemm.
// F32, F16, BF16, Q4_K and Q6_K weights always take an fp32 path.
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
#include <stdexcept>
#include <vector>

#include "backends/cpu/int8_kernels.h"

namespace ringlm {
namespace {

// Calls with at least this many tokens take the sgemm path on fp32 compute.
constexpr int64_t kSgemmMinTokens = 16;
// ... and on int8 compute: measured on the Zen 3 CI machine (1 thread, SmolLM2 shapes 576x576,
// 1536x576, 576x1536, Q4_0/Q4_1), the int8 kernels win up to M = 32, tie or lose at M = 64
// and take about twice sgemm's time at M = 512. A per-shape table from a tuning run is to
// replace this single crossover.
constexpr int64_t kInt8SgemmMinTokens = 48;
// Token rows the activation buffer holds from prepare on (decode batches: flat GEMM sizes).
constexpr int64_t kPreparedTokens = 16;
// Largest tile of weight rows dequantized for one sgemm call.
constexpr int64_t kMaxTileRows = 128;

class CpuWeight final : public PreparedWeight {
 public:
  explicit CpuWeight(const WeightView& w)
      : PreparedWeight(w.rows, w.cols), type(w.type), data(w.data), row_stride(row_bytes(w.type, w.cols)) {}
  TensorType type;
  const uint8_t* data;
  size_t row_stride;
};

// Eight independent partial sums let the compiler keep a vector register per lane.
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
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
  CpuBackend(int n_threads, ComputeType compute, int64_t int8_sgemm_min_tokens)
      : n_threads_(n_threads > 0 ? n_threads : omp_get_max_threads()),
        compute_(compute),
        int8_sgemm_min_tokens_(int8_sgemm_min_tokens > 0 ? int8_sgemm_min_tokens : kInt8SgemmMinTokens) {
    openblas_set_num_threads(1);
    per_thread_.resize(static_cast<size_t>(n_threads_));
  }

  std::string_view name() const override { return "CPU"; }

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
    const bool int8 = compute_ == ComputeType::kInt8 && cpu::int8_supported(w.type);
    reserve(int8 ? kPreparedTokens : 0, w.cols, sgemm_tile_rows(w.rows));
    return std::make_unique<CpuWeight>(w);
  }

  void matmul(const PreparedWeight& prepared, const float* x, int64_t n_tokens, float* y) override {
    const auto& w = static_cast<const CpuWeight&>(prepared);
    if (n_tokens <= 0 || w.rows() == 0) return;
    if (compute_ == ComputeType::kInt8 && cpu::int8_supported(w.type) && n_tokens < int8_sgemm_min_tokens_) {
      return matmul_int8(w, x, n_tokens, y);
    }
    if (n_tokens >= kSgemmMinTokens) return matmul_sgemm(w, x, n_tokens, y);
    matmul_rows(w, x, n_tokens, y);
  }

 private:
  struct ThreadBuffers {
    std::vector<float> row;   // one dequantized row (K)
    std::vector<float> tile;  // one dequantized sgemm tile (tile rows x K)
  };

  // Grows the buffers to hold `tokens` quantized activation rows of `cols` and, per thread, a
  // dequantized row and a tile of `tile_rows` rows. Never shrinks, so steady-state calls
  // allocate nothing.
  void reserve(int64_t tokens, int64_t cols, int64_t tile_rows) {
    const auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    };
    grow(act_q_, tokens * cols);
    grow(act_d_, tokens * cols / cpu::kActBlock);
    grow(act_s_, tokens * cols / cpu::kActBlock);
    for (ThreadBuffers& b : per_thread_) {
      grow(b.row, cols);
      grow(b.tile, tile_rows * cols);
    }
  }

  void matmul_int8(const CpuWeight& w, const float* x, int64_t n_tokens, float* y) {
    const int64_t rows = w.rows(), cols = w.cols();
    grow_acts(n_tokens, cols);
    const cpu::QuantizedActs xq{act_q_.data(), act_d_.data(), act_s_.data(), cols};
    // Quantizing a few rows is cheaper than the barrier it would need inside the region.
    const bool quantize_inside = n_tokens > kPreparedTokens;
    if (!quantize_inside) cpu::quantize_acts(x, 0, n_tokens, xq);
    const int64_t tiles = (rows + 3) / 4;  // threads split N in whole 4-row kernel tiles
#pragma omp parallel num_threads(n_threads_)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      if (quantize_inside) {
        const Range m = share(n_tokens, t, nt);
        cpu::quantize_acts(x, m.begin, m.end, xq);
#pragma omp barrier
      }
      const Range r = share(tiles, t, nt);
      const int64_t n0 = r.begin * 4, n1 = std::min(rows, r.end * 4);
      if (n0 < n1) cpu::gemm_int8(w.type, w.data, w.row_stride, n0, n1, xq, n_tokens, y, rows);
    }
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
        for (int64_t n = 0; n < nr; ++n) {
          dequantize_row(w.type, w.data + static_cast<size_t>(n0 + n) * w.row_stride, tile + n * cols, cols);
        }
        // y[:, n0:n0+nr] = x [n_tokens x K] * tile^T [K x nr]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n_tokens), static_cast<int>(nr),
                    static_cast<int>(cols), 1.0f, x, static_cast<int>(cols), tile, static_cast<int>(cols), 0.0f,
                    y + n0, static_cast<int>(rows));
      }
    }
  }

  void matmul_rows(const CpuWeight& w, const float* x, int64_t n_tokens, float* y) {
    const int64_t rows = w.rows(), cols = w.cols();
#pragma omp parallel num_threads(n_threads_)
    {
      const int t = omp_get_thread_num();
      const Range r = share(rows, t, omp_get_num_threads());
      float* row = per_thread_[static_cast<size_t>(t)].row.data();
      for (int64_t n = r.begin; n < r.end; ++n) {
        dequantize_row(w.type, w.data + static_cast<size_t>(n) * w.row_stride, row, cols);
        for (int64_t m = 0; m < n_tokens; ++m) y[m * rows + n] = dot_f32(x + m * cols, row, cols);
      }
    }
  }

  void grow_acts(int64_t tokens, int64_t cols) {
    if (static_cast<int64_t>(act_q_.size()) < tokens * cols) reserve(tokens, cols, 0);
  }

  int n_threads_;
  ComputeType compute_;
  int64_t int8_sgemm_min_tokens_;
  std::vector<int8_t> act_q_;
  std::vector<float> act_d_, act_s_;
  std::vector<ThreadBuffers> per_thread_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, int64_t int8_sgemm_min_tokens) {
  return std::make_unique<CpuBackend>(n_threads, compute, int8_sgemm_min_tokens);
}

// Until the integration switches defaults, the plain factory keeps the fp32 reference path.
std::unique_ptr<Backend> make_cpu_backend(int n_threads) { return make_cpu_backend(n_threads, ComputeType::kFp32); }

}  // namespace ringlm
