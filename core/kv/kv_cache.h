// Per-layer key/value cache as a ring of `capacity` slots (StreamingLLM).
//
// Slots [0, n_keep) hold the first n_keep tokens for good: the attention sinks. The other slots
// form a ring: tokens are written at its tail; when the cache is full, discard() frees the
// n_discard oldest tokens after the sinks (they are at the ring's head) and every token that
// stays moves back n_discard positions. Nothing moves in memory: a slot keeps its token until a
// new one is written over it, and each slot's position is tracked (-1: empty), because
// attention masks by position, never by slot order. The keys stay rotated for their position:
// whoever discards re-rotates them by -n_discard (LlamaModel::shift_context, "shift-RoPE").
//
// Keys and values are fp16 (half the memory and bandwidth) or fp32, in one buffer sized for the
// whole context whose pages become resident as tokens are written (PageBuffer): a cache costs
// the memory of the tokens it holds.
//
// A prefix (attach_prefix) is another cache, read-only and shared, whose tokens come before this
// one's: the segment KV cache of batch sampling, where n samples of one prompt share the
// prompt's keys and values and each holds only its own response.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "core/kv/page_buffer.h"

namespace ringlm {

enum class KvType { kF16, kF32 };

struct KvCacheOptions {
  KvType type = KvType::kF16;
  int n_keep = 0;              // attention sinks: the first tokens, never discarded
  int n_discard = 0;           // tokens a context shift drops (0: half of those after the sinks)
  bool context_shift = false;  // when full: shift (StreamingLLM) or refuse more tokens
};

class KvCache {
 public:
  KvCache(int n_layer, int capacity, int n_kv_head, int head_dim, const KvCacheOptions& options = {});

  int capacity() const { return capacity_; }
  int size() const { return n_sink_ + ring_count_; }  // tokens cached here (not in the prefix)
  int n_keep() const { return n_keep_; }
  KvType type() const { return type_; }
  const KvCacheOptions& options() const { return options_; }
  // Tokens the next context shift discards: --discard, else half of those after the sinks.
  int shift_size() const;
  int row_width() const { return n_kv_head_ * head_dim_; }
  int head_dim() const { return head_dim_; }
  int n_kv_head() const { return n_kv_head_; }
  size_t bytes() const { return storage_.size(); }  // reserved for the whole context
  // Memory the tokens held here occupy: size() tokens of every layer's keys and values.
  size_t bytes_in_use() const { return static_cast<size_t>(size()) * bytes_per_token(); }
  size_t bytes_per_token() const { return static_cast<size_t>(n_layer_) * 2 * row_bytes(); }
  // Memory the cache occupies now: the pages its tokens were written to (see PageBuffer).
  size_t resident_bytes() const { return storage_.resident_bytes(); }
  int64_t shifts() const { return shifts_; }         // discard() calls so far
  int64_t discarded() const { return discarded_; }   // tokens discarded so far

  // Slots that ever held a token: attention covers [0, extent()) and masks the empty ones.
  int extent() const { return extent_; }
  // Position of the token in each slot of [0, extent()), -1 where empty.
  std::span<const int64_t> positions() const { return {positions_.data(), static_cast<size_t>(extent_)}; }
  // Position the next token takes: one past the newest cached token (0 when empty).
  int64_t next_position() const { return next_position_; }

  // Tokens the next append() can take in contiguous slots (0: full).
  int contiguous_free() const;
  // Reserves `n` (<= contiguous_free()) contiguous slots for new tokens at positions
  // next_position().. and returns the first. The caller writes every layer's keys and values.
  int append(int n);

  // Frees the n_discard oldest tokens after the sinks (n_discard <= size() - sinks) and moves
  // every later token back n_discard positions. Returns the slots whose keys must be re-rotated
  // by -n_discard (every remaining token after the sinks).
  std::vector<int> discard(int n_discard);
  // Empties the cache (and drops its prefix); the memory of its tokens goes back to the system.
  void clear();

  // Makes `prefix`'s tokens this (empty) cache's first ones: attention reads them from there,
  // and this cache's own tokens continue at prefix->next_position(). The prefix must have the
  // same shape and type and no prefix of its own; it must not change while attached. A cache
  // with a prefix does not shift (can_shift()).
  void attach_prefix(std::shared_ptr<const KvCache> prefix);
  const KvCache* prefix() const { return prefix_.get(); }
  // A full cache shifts its context (options().context_shift) unless it reads a prefix.
  bool can_shift() const { return options_.context_shift && prefix_ == nullptr; }
  // Tokens the sequence's attention sees: the prefix's and this cache's.
  int context_size() const { return (prefix_ ? prefix_->size() : 0) + size(); }

  // The sequence's decode attention state, kept between steps: FlashDecoding++'s unified max of
  // each (layer, query head)'s scores. The model sizes it on first use; empty or NaN: not known
  // yet (the exact softmax runs). It belongs to the sequence, not the model, so sequences
  // decoded together never see each other's maxima.
  std::vector<float>& softmax_phi() { return softmax_phi_; }

  // The cache as the backend's ops see it (backends/backend.h): its rows, positions and the
  // backend's own state for it (a device copy, which the backend made and keeps in step). The
  // prefix's view is the caller's to set (it must outlive the calls).
  KvView view();
  // A read-only view without backend state: how a cache is read as another one's prefix.
  KvView prefix_view() const;
  // Whether a backend keeps state of its own for this cache (a copy in a device's memory).
  bool has_backend_state() const { return backend_state_ != nullptr; }

  // Row `slot` of layer `layer`: row_width() values of type(), K or V.
  void* key(int layer, int slot) { return storage_.data() + offset(layer, slot, false); }
  void* value(int layer, int slot) { return storage_.data() + offset(layer, slot, true); }
  const void* key(int layer, int slot) const { return storage_.data() + offset(layer, slot, false); }
  const void* value(int layer, int slot) const { return storage_.data() + offset(layer, slot, true); }
  size_t row_bytes() const { return static_cast<size_t>(row_width()) * (type_ == KvType::kF16 ? 2 : 4); }

 private:
  size_t offset(int layer, int slot, bool value) const {
    return ((static_cast<size_t>(layer) * 2 + (value ? 1 : 0)) * capacity_ + static_cast<size_t>(slot)) * row_bytes();
  }
  int ring_capacity() const { return capacity_ - n_keep_; }
  int ring_slot(int i) const { return n_keep_ + (ring_head_ + i) % ring_capacity(); }  // i-th oldest after the sinks

  int n_layer_, capacity_, n_kv_head_, head_dim_;
  KvCacheOptions options_;
  KvType type_;
  int n_keep_;
  int n_sink_ = 0;      // sink slots filled (< n_keep only while the cache is young)
  int ring_head_ = 0;   // ring index of the oldest token after the sinks
  int ring_count_ = 0;  // tokens in the ring
  int extent_ = 0;
  int64_t next_position_ = 0;
  int64_t shifts_ = 0, discarded_ = 0;
  std::vector<int64_t> positions_;
  PageBuffer storage_;
  std::shared_ptr<const KvCache> prefix_;
  std::vector<float> softmax_phi_;
  std::unique_ptr<BackendKvState> backend_state_;
};

}  // namespace ringlm
