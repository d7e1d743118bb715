// Per-layer key/value cache: `capacity` slots per layer, each holding one token's keys and
// values for every KV head. Keys are stored already rotated (RoPE) for their position.
//
// Slots are filled in order; a slot's position is tracked so that attention and a later
// context shift (StreamingLLM) need not assume slot == position.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringlm {

class KvCache {
 public:
  KvCache(int n_layer, int capacity, int n_kv_head, int head_dim);

  int capacity() const { return capacity_; }
  int size() const { return size_; }               // tokens cached
  int row_width() const { return n_kv_head_ * head_dim_; }
  int head_dim() const { return head_dim_; }
  int n_kv_head() const { return n_kv_head_; }
  size_t bytes() const { return (keys_.size() + values_.size()) * sizeof(float); }

  // Slot of the i-th cached token (0 = oldest) and its position in the sequence.
  int slot(int i) const { return i; }
  int64_t position(int i) const { return positions_[static_cast<size_t>(i)]; }

  float* key(int layer, int slot) { return keys_.data() + offset(layer, slot); }
  float* value(int layer, int slot) { return values_.data() + offset(layer, slot); }
  const float* key(int layer, int slot) const { return keys_.data() + offset(layer, slot); }
  const float* value(int layer, int slot) const { return values_.data() + offset(layer, slot); }

  // Reserves the slots for `n` new tokens at positions pos0.. and returns the first slot.
  // The caller writes the keys and values of every layer into them.
  int append(int n, int64_t pos0);
  void clear() { size_ = 0; }

 private:
  size_t offset(int layer, int slot) const {
    return (static_cast<size_t>(layer) * capacity_ + static_cast<size_t>(slot)) * row_width();
  }

  int n_layer_;
  int capacity_;
  int n_kv_head_;
  int head_dim_;
  int size_ = 0;
  std::vector<float> keys_;
  std::vector<float> values_;
  std::vector<int64_t> positions_;
};

}  // namespace ringlm
