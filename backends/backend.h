// The backend seam: how the model asks for its matrix products.
//
// The model hands every weight matrix to the backend once, at load (prepare), and from then on
// only asks for products with it (matmul). What "prepare" does is the backend's business:
// reference the mmap in place, repack into a kernel layout, or upload to a device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "quant/formats.h"

namespace ringlm {

class DeviceAttention;  // below

// A weight matrix as stored in the model file: `rows` output features (N), each a contiguous
// row of `cols` input features (K) in `type`'s block layout.
struct WeightView {
  std::string name;
  TensorType type = TensorType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;
  // `data` lies in a read-only file mapping: a backend that keeps its own copy may give the
  // mapping's pages back (they are re-read from the file if touched again).
  bool mapped = false;
};

// A weight after the backend prepared it. Opaque to the model except for its shape.
class PreparedWeight {
 public:
  PreparedWeight(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) {}
  virtual ~PreparedWeight() = default;
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }

 private:
  int64_t rows_;
  int64_t cols_;
};

// An input to a product: `n_tokens` rows of `cols` fp32 values. With `rms_weight` set, each row
// is RMS-normalised and scaled by it on the way in, x / sqrt(mean(x^2) + rms_eps) * rms_weight,
// so the normalisation is fused with whatever the backend does to its inputs (the CPU backend's
// int8 quantization) and never written out as a separate activation array.
struct MatmulInput {
  const float* x = nullptr;
  int64_t n_tokens = 0;
  const float* rms_weight = nullptr;  // [cols], or nullptr for no normalisation
  float rms_eps = 0.0f;
};

// Row m of `in` as the products see it: RMS-normalised and scaled into `out` ([cols]) when the
// input asks for it (returns out), else the row itself (returns in.x + m * cols, out untouched).
// Every backend normalises through this one function, so they agree on the rounding.
const float* normalized_input_row(const MatmulInput& in, int64_t m, int64_t cols, float* out);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Called once per weight at load. Throws std::runtime_error naming the weight if its
  // type or shape cannot be run.
  virtual std::unique_ptr<PreparedWeight> prepare(const WeightView& weight) = 0;

  // out[i] = row ids[i] of the weight in fp32 ([ids.size()][cols]): the embedding lookup of a
  // model whose output projection is its embedding table, read from the backend's own copy
  // (the file's pages may be gone, see WeightView::mapped). ids must be valid rows.
  virtual void rows(const PreparedWeight& weight, std::span<const int32_t> ids, float* out) = 0;

  // y[m][n] = sum_k x[m][k] * W[n][k] for m < n_tokens: x is [n_tokens][cols], y is [n_tokens][rows].
  virtual void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) = 0;

  // ys[i] = input x weights[i]^T for every i, with the input prepared (normalised, quantized)
  // once and one pass over all the weights' rows: a fused QKV projection without copying the
  // three matrices into one. Every weight has the input's number of columns.
  virtual void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                           std::span<float* const> ys) = 0;

  // out = silu(input x gate^T) * (input x up^T), the SwiGLU feed-forward input, with the
  // activation applied as each output tile is produced. out is [n_tokens][gate.rows()].
  virtual void matmul_swiglu(const PreparedWeight& gate, const PreparedWeight& up, const MatmulInput& input,
                             float* out) = 0;

  // Attention on the backend's device, for backends that keep KV caches in their own memory
  // (a plugin's GPU); nullptr: attention runs on the CPU.
  virtual DeviceAttention* device_attention() { return nullptr; }
  // Where the products run, for reports: "cpu", "opencl:0 (NVIDIA ...)".
  virtual std::string device_description() const { return std::string(name()); }
};

// A KV cache's keys and values in a device's memory. Opaque outside the backend that made it.
class DeviceKvCache {
 public:
  virtual ~DeviceKvCache() = default;
};

// The shape of a KV cache a device keeps: the host cache's (core/kv/kv_cache.h), slot for slot.
struct DeviceKvShape {
  int n_layer = 0;
  int capacity = 0;  // slots
  int row_width = 0;  // n_kv_head * head_dim elements per slot and layer
  bool f16 = false;
};

// One sequence's attention query on the device: n_tokens rows of q ([n_tokens][n_head *
// head_dim], host memory) at positions q_pos0..; the result goes to out (host, same shape).
struct DeviceAttentionQuery {
  int layer = 0;
  const float* q = nullptr;
  int n_tokens = 0;
  int64_t q_pos0 = 0;
  float* out = nullptr;
};

// Attention over KV caches kept on a device. The model keeps each cache's bookkeeping (slots,
// positions, sinks, the shift) and a host copy of its rows, and mirrors every change here: rows
// written (store), slot positions (set_positions), keys re-rotated (shift_keys). The semantics
// are those of cpu::attention_causal.
class DeviceAttention {
 public:
  virtual ~DeviceAttention() = default;
  // Whether this device runs attention of this geometry at all.
  virtual bool supports(int n_head, int n_head_kv, int head_dim, bool f16_kv) const = 0;
  virtual std::unique_ptr<DeviceKvCache> make_kv(const DeviceKvShape& shape) = 0;
  // Copies n consecutive slots from first_slot of one layer's keys and values: host rows in the
  // cache's type (fp16 bits or fp32), n * row_width elements each.
  virtual void store(DeviceKvCache& kv, int layer, int first_slot, int n, const void* keys, const void* values) = 0;
  // Positions of slots [0, positions.size()) (-1: empty), as the next attend() calls see them.
  virtual void set_positions(DeviceKvCache& kv, std::span<const int64_t> positions) = 0;
  virtual void attend(DeviceKvCache& kv, const DeviceAttentionQuery& query, int n_head, int n_head_kv, int head_dim) = 0;
  // Rotates the keys of `slots` in every layer by the angles with cosines cos[i] and sines
  // sin[i] (i < n_rot / 2), pairs adjacent or split in halves (the model's RoPE layout).
  virtual void shift_keys(DeviceKvCache& kv, std::span<const int> slots, std::span<const float> cos,
                          std::span<const float> sin, int n_kv_head, int head_dim, bool adjacent_pairs) = 0;
};

// The CPU backend with int8 compute (backends/cpu/cpu_backend.h has the other choices);
// `n_threads` OpenMP threads for every kernel.
std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace ringlm
