#include "backends/cpu/layer_ops.h"

#include <omp.h>

#include <algorithm>
#include <span>
#include <stdexcept>
#include <vector>

#include "backends/cpu/kv_rows.h"
#include "quant/formats.h"
#include "quant/kivi.h"
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
  KvLayer out;
  out.keys = kv.key(layer, 0);
  out.values = kv.value(layer, 0);
  out.row_stride = kv.row_width;
  out.key_type = kv.key_type;
  out.value_type = kv.value_type;
  out.positions = kv.positions.data();
  out.n_slots = static_cast<int>(kv.positions.size());
  out.prefix = prefix;
  if (kv.kivi != nullptr) {
    out.kivi = kv.kivi;
    out.kivi_params = kv.kivi_params(layer, 0);
    out.kivi_staging = kv.kivi_staged(layer, 0, 0, false);
  }
  return out;
}

// A KIVI cache's part of shift_keys: each group holding keys to turn is read in fp32, those keys
// rotated, and the group stored again (a sealed one quantized again per channel).
void shift_kivi_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots, const float* cos_x,
                     const float* sin_x, const RopeAngles& angles, int n_head_kv, int head_dim, int n_threads) {
  const KvKiviGroups& groups = *kv.kivi;
  std::vector<std::vector<int>> by_group(static_cast<size_t>(groups.n_groups));
  for (const int slot : slots) by_group[static_cast<size_t>(groups.group_of(slot))].push_back(slot);
  std::vector<int> touched;
  for (int g = 0; g < groups.n_groups; ++g) {
    if (!by_group[static_cast<size_t>(g)].empty()) touched.push_back(g);
  }
  const auto width = static_cast<size_t>(kv.row_width);
  const auto n_layers = static_cast<int64_t>(layers.size()), n_groups = static_cast<int64_t>(touched.size());
  const RopePairs pairs = angles.adjacent_pairs ? RopePairs::kAdjacent : RopePairs::kHalves;
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> rows(kKiviGroup * width);
#pragma omp for collapse(2) schedule(static)
    for (int64_t l = 0; l < n_layers; ++l) {
      for (int64_t i = 0; i < n_groups; ++i) {
        const int layer = layers[static_cast<size_t>(l)], g = touched[static_cast<size_t>(i)];
        const int first = groups.first_slot(g), size = groups.group_size(g), buffer = groups.staged[g];
        const auto rotate = [&](float* key) { rotate_heads(key, n_head_kv, head_dim, angles.n_rot, pairs, cos_x, sin_x); };
        if (buffer >= 0) {
          for (const int slot : by_group[static_cast<size_t>(g)]) {
            uint16_t* key = kv.kivi_staged(layer, buffer, slot - first, false);
            fp16_to_fp32_row(key, rows.data(), kv.row_width);
            rotate(rows.data());
            fp32_to_fp16_row(rows.data(), key, kv.row_width);
          }
          continue;
        }
        kivi_dequantize_keys(kv.key(layer, first), static_cast<int64_t>(kv.key_row_bytes()), size, kv.kivi_params(layer, g),
                             kv.kivi_params(layer, g) + kv.row_width, 0,
                             kv.row_width, rows.data(), kv.row_width);
        for (const int slot : by_group[static_cast<size_t>(g)]) rotate(rows.data() + (slot - first) * width);
        bool live[kKiviGroup];
        for (int s = 0; s < size; ++s) {
          const auto slot = static_cast<size_t>(first + s);
          live[s] = slot < kv.positions.size() && kv.positions[slot] >= 0;
        }
        kivi_quantize_keys(rows.data(), kv.row_width, live, size, kv.row_width, kv.key(layer, first),
                           static_cast<int64_t>(kv.key_row_bytes()), kv.kivi_params(layer, g),
                           kv.kivi_params(layer, g) + kv.row_width);
      }
    }
  }
}

// A cache row of n elements of `type` from fp32, and back. q8_0: GGML's reference rounding, the
// blocks llama.cpp would store; q4_0: blocks of the same format whose steps a clip search
// chooses (quantize_q4_0_searched, kv_rows.h).
void write_kv_row(KvType type, const float* in, int64_t n, uint8_t* row) {
  switch (type) {
    case KvType::kF16: return fp32_to_fp16_row(in, reinterpret_cast<uint16_t*>(row), n);
    case KvType::kF32: std::copy_n(in, n, reinterpret_cast<float*>(row)); return;
    case KvType::kQ8_0: return quantize_row(kv_stored_type(type), in, row, n);
    case KvType::kQ4_0: return quantize_q4_0_searched(in, row, n);
    case KvType::kKivi2: break;  // (store_kivi: the groups' business)
  }
}
void read_kv_row(KvType type, const uint8_t* row, int64_t n, float* out) {
  switch (type) {
    case KvType::kF16: return fp16_to_fp32_row(reinterpret_cast<const uint16_t*>(row), out, n);
    case KvType::kF32: std::copy_n(reinterpret_cast<const float*>(row), n, out); return;
    case KvType::kQ8_0:
    case KvType::kQ4_0: return dequantize_row(kv_stored_type(type), row, out, n);
    case KvType::kKivi2: break;
  }
}

// Each of n_tokens rows of queries (shape.n_head heads) multiplied by the key scales of its
// heads' key head (KvView::key_scales), element by element.
void scale_queries(float* q, int n_tokens, const AttentionShape& shape, const float* scales) {
  const int group = shape.n_head / shape.n_head_kv;
  for (int r = 0; r < n_tokens; ++r) {
    for (int h = 0; h < shape.n_head; ++h) {
      float* head = q + (static_cast<size_t>(r) * shape.n_head + h) * shape.head_dim;
      const float* s = scales + static_cast<size_t>(h / group) * shape.head_dim;
      for (int i = 0; i < shape.head_dim; ++i) head[i] *= s[i];
    }
  }
}

// Layer `layer`'s key scales (KvView::key_scales) where the view's keys are turned, else nullptr.
const float* key_scales_of(const KvView& kv, int layer) {
  if (kv.key_scales == nullptr || !kv_turns_heads(kv.key_type, kv.head_dim)) return nullptr;
  return kv.key_scales + static_cast<size_t>(layer) * static_cast<size_t>(kv.row_width);
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

// A KIVI cache's part of store_kv: rows of an open group go to its staging buffer in fp16; the
// groups a prompt fills whole that append() left sealed wait in fp32 (pending_kivi_) until the
// layer's attention has read them, then are quantized (seal_pending_kivi). Values are turned as
// the type asks (kv_turns_values), keys never.
void LayerOps::store_kivi(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) {
  const KvKiviGroups& groups = *kv.kivi;
  const auto width = static_cast<size_t>(kv.row_width);
  const int g_first = groups.group_of(first_slot), g_last = groups.group_of(first_slot + n - 1);
  const bool turns = kv_turns_values(kv.value_type, kv.head_dim);
  // The sealed groups the write fills: a run of whole ones (the older part of a prompt).
  int direct_first = first_slot + n, direct_end = first_slot;
  for (int g = g_first; g <= g_last; ++g) {
    if (groups.staged[g] >= 0) continue;
    const int begin = groups.first_slot(g), end = begin + groups.group_size(g);
    if (begin < first_slot || end > first_slot + n) {
      throw std::logic_error("store_kv: a sealed KIVI group is written in part (KvCache::append opens those)");
    }
    if (direct_end != first_slot && begin != direct_end) {
      throw std::logic_error("store_kv: the KIVI groups a write fills whole are not one run");
    }
    direct_first = std::min(direct_first, begin);
    direct_end = end;
  }
  PendingKivi* pending = nullptr;
  if (direct_end > direct_first) {
    pending = &pending_kivi_.emplace_back();
    pending->view = kv;
    pending->layer = layer;
    pending->k.assign(k + static_cast<size_t>(direct_first - first_slot) * width, k + static_cast<size_t>(direct_end - first_slot) * width);
    pending->v.resize(pending->k.size());
    pending->rows = {direct_first, direct_end - direct_first, pending->k.data(), pending->v.data()};
  }
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n >= kParallelRows)
  for (int i = 0; i < n; ++i) {
    const int slot = first_slot + i, g = groups.group_of(slot), buffer = groups.staged[g];
    const float* key = k + static_cast<size_t>(i) * width;
    float* value = pending != nullptr && slot >= direct_first && slot < direct_end
                       ? pending->v.data() + static_cast<size_t>(slot - direct_first) * width
                       : nullptr;
    std::vector<float> own;
    if (value == nullptr) own.resize(width), value = own.data();
    std::copy_n(v + static_cast<size_t>(i) * width, width, value);
    if (turns) hadamard_heads(value, kv.row_width / kv.head_dim, kv.head_dim);
    if (buffer < 0) continue;  // (pending: attention reads it from there)
    const int at = slot - groups.first_slot(g);
    fp32_to_fp16_row(key, kv.kivi_staged(layer, buffer, at, false), kv.row_width);
    fp32_to_fp16_row(value, kv.kivi_staged(layer, buffer, at, true), kv.row_width);
  }
}

// Quantizes the groups store_kivi left pending: keys per channel, values per token.
void LayerOps::seal_pending_kivi() {
  for (const PendingKivi& p : pending_kivi_) {
    const KvKiviGroups& groups = *p.view.kivi;
    const auto width = static_cast<size_t>(p.view.row_width);
    const int g_first = groups.group_of(p.rows.first_slot), g_last = groups.group_of(p.rows.first_slot + p.rows.n - 1);
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (g_last > g_first)
    for (int g = g_first; g <= g_last; ++g) {
      const int first = groups.first_slot(g), size = groups.group_size(g);
      const size_t row0 = static_cast<size_t>(first - p.rows.first_slot) * width;
      bool live[kKiviGroup];
      std::fill_n(live, kKiviGroup, true);
      kivi_quantize_keys(p.k.data() + row0, p.view.row_width, live, size, p.view.row_width, p.view.key(p.layer, first),
                         static_cast<int64_t>(p.view.key_row_bytes()), p.view.kivi_params(p.layer, g),
                         p.view.kivi_params(p.layer, g) + p.view.row_width);
      for (int i = 0; i < size; ++i) {
        kivi_quantize_value(p.v.data() + row0 + i * width, p.view.row_width, p.view.value(p.layer, first + i));
      }
    }
  }
  pending_kivi_.clear();
}

void LayerOps::store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) {
  for (const PendingKivi& p : pending_kivi_) {  // (a layer whose attention never ran: quantized as they are)
    if (p.layer != layer || p.view.rows != kv.rows) {
      seal_pending_kivi();
      break;
    }
  }
  if (kv.kivi != nullptr) return store_kivi(kv, layer, first_slot, n, k, v);
  const bool turns = kv_turns_heads(kv.key_type, kv.head_dim) || kv_turns_heads(kv.value_type, kv.head_dim);
  const auto width = static_cast<size_t>(kv.row_width);
  if (turns && turned_.size() < width * static_cast<size_t>(n_threads_)) turned_.resize(width * n_threads_);
#pragma omp parallel num_threads(n_threads_) if (n >= kParallelRows)
  {
    float* row = turns ? turned_.data() + width * static_cast<size_t>(omp_get_thread_num()) : nullptr;
    // A row as the cache keeps it in `type`: divided by the key scales (keys) and its heads
    // turned first where the type asks.
    const auto store = [&](KvType type, const float* src, const float* scales, uint8_t* dst) {
      if (kv_turns_heads(type, kv.head_dim)) {
        std::copy_n(src, width, row);
        if (scales != nullptr) {
          for (size_t c = 0; c < width; ++c) row[c] /= scales[c];
        }
        hadamard_heads(row, kv.row_width / kv.head_dim, kv.head_dim);
        src = row;
      }
      write_kv_row(type, src, kv.row_width, dst);
    };
    const float* const scales = key_scales_of(kv, layer);
#pragma omp for schedule(static)
    for (int i = 0; i < n; ++i) {
      store(kv.key_type, k + static_cast<int64_t>(i) * kv.row_width, scales, kv.key(layer, first_slot + i));
      store(kv.value_type, v + static_cast<int64_t>(i) * kv.row_width, nullptr, kv.value(layer, first_slot + i));
    }
  }
}

void LayerOps::attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) {
  // Sized before filling: jobs point into prefixes_, turned_queries_ and pending_of_call_.
  prefixes_.assign(calls.size(), KvLayer{});
  turned_queries_.resize(calls.size());
  pending_of_call_.resize(2 * calls.size());
  jobs_.clear();
  // Keys kept with their heads turned (kv_turns_heads) are scored with queries turned alike (the
  // same dot products); outputs that are sums of turned values are turned back.
  const auto turns_keys = [&](const AttentionCall& c) { return kv_turns_heads(c.kv->key_type, shape.head_dim); };
  const auto turns_values = [&](const AttentionCall& c) { return kv_turns_values(c.kv->value_type, shape.head_dim); };
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
      if (const float* scales = key_scales_of(*c.kv, layer)) {
        scale_queries(turned.data(), c.n_tokens, shape, scales);
      }
      hadamard_heads(turned.data(), c.n_tokens * shape.n_head, shape.head_dim);
      q = turned.data();
    }
    AttentionJob job{q, layer_of(*c.kv, layer, prefix), c.pos0, c.n_tokens, c.out, c.softmax_phi, c.step_phi};
    size_t n_pending = 0;  // this cache's groups in fp32 until the attention below has read them
    for (const PendingKivi& p : pending_kivi_) {
      if (p.layer == layer && p.view.rows == c.kv->rows && n_pending < 2) pending_of_call_[2 * i + n_pending++] = p.rows;
    }
    job.kv.kivi_pending = std::span<const KvLayer::KiviPending>(pending_of_call_.data() + 2 * i, n_pending);
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
  seal_pending_kivi();
}

void LayerOps::shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots,
                          const RopeAngles& angles, int n_head_kv, int head_dim) {
  std::vector<float> cos_x(static_cast<size_t>(angles.n_rot)), sin_x(cos_x.size());
  expand_rope_angles(angles.cos, angles.sin, angles.n_rot, pairs_of(angles), cos_x.data(), sin_x.data());
  seal_pending_kivi();
  if (kv.kivi != nullptr) {
    return shift_kivi_keys(kv, layers, slots, cos_x.data(), sin_x.data(), angles, n_head_kv, head_dim, n_threads_);
  }
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
        // its heads turned turns them back for RoPE, and again after; keys kept divided by
        // their scales are multiplied back for it, and divided again after).
        const int layer = layers[static_cast<size_t>(l)];
        const float* scales = key_scales_of(kv, layer);
        uint8_t* key = kv.key(layer, slots[static_cast<size_t>(m)]);
        read_kv_row(kv.key_type, key, kv.row_width, row.data());
        if (turns) hadamard_heads(row.data(), n_head_kv, head_dim);
        if (scales != nullptr) {
          for (int c = 0; c < kv.row_width; ++c) row[static_cast<size_t>(c)] *= scales[c];
        }
        rotate_heads(row.data(), n_head_kv, head_dim, angles.n_rot, pairs_of(angles), cos_x.data(), sin_x.data());
        if (scales != nullptr) {
          for (int c = 0; c < kv.row_width; ++c) row[static_cast<size_t>(c)] /= scales[c];
        }
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
