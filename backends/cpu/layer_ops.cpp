#include "backends/cpu/layer_ops.h"

#include <omp.h>

#include <algorithm>

#include "backends/cpu/kv_rows.h"
#include "quant/formats.h"
#include "quant/quantize.h"

namespace ringlm::cpu {
namespace {

// Rows from which the threads share per-row work (RoPE, the KV store): below it (a decode step),
// a parallel region costs more than the work.
constexpr int64_t kParallelRows = 4;
// Elements from which the threads share the residual add.
constexpr int64_t kParallelAdd = 1 << 14;

RopePairs pairs_of(const RopeAngles& angles) { return angles.adjacent_pairs ? RopePairs::kAdjacent : RopePairs::kHalves; }

// One layer's slots of a cache as the attention kernel reads them.
KvLayer layer_of(const KvView& kv, int layer, const KvLayer* prefix) {
  return KvLayer{kv.key(layer, 0), kv.value(layer, 0), kv.row_width, kv.key_type, kv.value_type,
                 kv.positions.data(), static_cast<int>(kv.positions.size()), prefix};
}

// A cache row of n elements of `type` from fp32 (q8_0, q4_0: GGML's reference rounding, the
// blocks llama.cpp would store), and back.
void write_kv_row(KvType type, const float* in, int64_t n, uint8_t* row) {
  switch (type) {
    case KvType::kF16: return fp32_to_fp16_row(in, reinterpret_cast<uint16_t*>(row), n);
    case KvType::kF32: std::copy_n(in, n, reinterpret_cast<float*>(row)); return;
    case KvType::kQ8_0:
    case KvType::kQ4_0: return quantize_row(kv_stored_type(type), in, row, n);
  }
}
void read_kv_row(KvType type, const uint8_t* row, int64_t n, float* out) {
  switch (type) {
    case KvType::kF16: return fp16_to_fp32_row(reinterpret_cast<const uint16_t*>(row), out, n);
    case KvType::kF32: std::copy_n(reinterpret_cast<const float*>(row), n, out); return;
    case KvType::kQ8_0:
    case KvType::kQ4_0: return dequantize_row(kv_stored_type(type), row, out, n);
  }
}

}  // namespace

void LayerOps::rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) {
  const int half = angles.n_rot / 2;
  const int64_t row_width = static_cast<int64_t>(n_heads) * head_dim;
  // Each thread expands a row's angles to one entry per rotary element (expand_rope_angles)
  // into its own part of rope_tables_, sized here: no allocation per call once warm.
  const size_t table = 2 * static_cast<size_t>(angles.n_rot);
  if (rope_tables_.size() < table * static_cast<size_t>(n_threads_)) rope_tables_.resize(table * n_threads_);
#pragma omp parallel num_threads(n_threads_) if (n_rows >= kParallelRows)
  {
    float* cos_x = rope_tables_.data() + table * static_cast<size_t>(omp_get_thread_num());
    float* sin_x = cos_x + angles.n_rot;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) {
      expand_rope_angles(angles.cos + r * half, angles.sin + r * half, angles.n_rot, pairs_of(angles), cos_x, sin_x);
      rotate_heads(x + r * row_width, n_heads, head_dim, angles.n_rot, pairs_of(angles), cos_x, sin_x);
    }
  }
}

void LayerOps::store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) {
  const bool turns = kv_turns_heads(kv.key_type, kv.head_dim) || kv_turns_heads(kv.value_type, kv.head_dim);
  const auto width = static_cast<size_t>(kv.row_width);
  if (turns && turned_.size() < width * static_cast<size_t>(n_threads_)) turned_.resize(width * n_threads_);
#pragma omp parallel num_threads(n_threads_) if (n >= kParallelRows)
  {
    float* row = turns ? turned_.data() + width * static_cast<size_t>(omp_get_thread_num()) : nullptr;
    // A row as the cache keeps it in `type`: its heads turned first where the type asks.
    const auto store = [&](KvType type, const float* src, uint8_t* dst) {
      if (kv_turns_heads(type, kv.head_dim)) {
        std::copy_n(src, width, row);
        hadamard_heads(row, kv.row_width / kv.head_dim, kv.head_dim);
        src = row;
      }
      write_kv_row(type, src, kv.row_width, dst);
    };
#pragma omp for schedule(static)
    for (int i = 0; i < n; ++i) {
      store(kv.key_type, k + static_cast<int64_t>(i) * kv.row_width, kv.key(layer, first_slot + i));
      store(kv.value_type, v + static_cast<int64_t>(i) * kv.row_width, kv.value(layer, first_slot + i));
    }
  }
}

void LayerOps::attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) {
  // Sized before filling: jobs point into prefixes_ and turned_queries_.
  prefixes_.assign(calls.size(), KvLayer{});
  turned_queries_.resize(calls.size());
  jobs_.clear();
  // Keys kept with their heads turned (kv_turns_heads) are scored with queries turned alike (the
  // same dot products); outputs that are sums of turned values are turned back.
  const auto turns_keys = [&](const AttentionCall& c) { return kv_turns_heads(c.kv->key_type, shape.head_dim); };
  const auto turns_values = [&](const AttentionCall& c) { return kv_turns_heads(c.kv->value_type, shape.head_dim); };
  for (size_t i = 0; i < calls.size(); ++i) {
    const AttentionCall& c = calls[i];
    const KvLayer* prefix = nullptr;
    if (c.kv->prefix != nullptr) {
      prefixes_[i] = layer_of(*c.kv->prefix, layer, nullptr);
      prefix = &prefixes_[i];
    }
    const float* q = c.q;
    if (turns_keys(c)) {
      std::vector<float>& turned = turned_queries_[i];
      turned.assign(c.q, c.q + static_cast<size_t>(c.n_tokens) * shape.n_head * shape.head_dim);
      hadamard_heads(turned.data(), c.n_tokens * shape.n_head, shape.head_dim);
      q = turned.data();
    }
    const AttentionJob job{q, layer_of(*c.kv, layer, prefix), c.pos0, c.n_tokens, c.out, c.softmax_phi, c.step_phi};
    // A checking pass on its own; the other calls together.
    if (c.steps) {
      attention_steps(shape, job, scratch_, n_threads_);
    } else {
      jobs_.push_back(job);
    }
  }
  if (!jobs_.empty()) {
    attention_batch(shape, jobs_, scratch_, n_threads_);
  }
  for (const AttentionCall& c : calls) {
    if (turns_values(c)) hadamard_heads(c.out, c.n_tokens * shape.n_head, shape.head_dim);
  }
}

void LayerOps::shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots,
                          const RopeAngles& angles, int n_head_kv, int head_dim) {
  std::vector<float> cos_x(static_cast<size_t>(angles.n_rot)), sin_x(cos_x.size());
  expand_rope_angles(angles.cos, angles.sin, angles.n_rot, pairs_of(angles), cos_x.data(), sin_x.data());
  const auto n_slots = static_cast<int64_t>(slots.size());
  const auto n_layers = static_cast<int64_t>(layers.size());
  const bool turns = kv_turns_heads(kv.key_type, head_dim);
#pragma omp parallel num_threads(n_threads_)
  {
    std::vector<float> row(static_cast<size_t>(kv.row_width));
#pragma omp for collapse(2) schedule(static)
    for (int64_t l = 0; l < n_layers; ++l) {
      for (int64_t m = 0; m < n_slots; ++m) {
        // Rotated in fp32 and stored again (q8_0: quantized again, per block; a cache that keeps
        // its heads turned turns them back for RoPE, and again after).
        uint8_t* key = kv.key(layers[static_cast<size_t>(l)], slots[static_cast<size_t>(m)]);
        read_kv_row(kv.key_type, key, kv.row_width, row.data());
        if (turns) hadamard_heads(row.data(), n_head_kv, head_dim);
        rotate_heads(row.data(), n_head_kv, head_dim, angles.n_rot, pairs_of(angles), cos_x.data(), sin_x.data());
        if (turns) hadamard_heads(row.data(), n_head_kv, head_dim);
        write_kv_row(kv.key_type, row.data(), kv.row_width, key);
      }
    }
  }
}

void LayerOps::add(float* x, const float* delta, int64_t n) {
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n >= kParallelAdd)
  for (int64_t i = 0; i < n; ++i) x[i] += delta[i];
}

void LayerOps::scale(float* x, int64_t n, float factor) {
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n >= kParallelAdd)
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

void LayerOps::add_row(float* x, const float* row, int64_t n_rows, int64_t width) {
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n_rows * width >= kParallelAdd)
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t c = 0; c < width; ++c) x[r * width + c] += row[c];
  }
}

void LayerOps::rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps) {
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n_rows * width >= kParallelAdd)
  for (int64_t r = 0; r < n_rows; ++r) {
    // normalized_input_row reads the row whole before it writes: in place is safe.
    const MatmulInput in{x + r * width, 1, weight, eps};
    normalized_input_row(in, 0, width, x + r * width);
  }
}

}  // namespace ringlm::cpu
