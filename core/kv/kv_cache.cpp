#include "core/kv/kv_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ringlm {

KvCache::KvCache(int n_layer, int capacity, int n_kv_head, int head_dim, const KvCacheOptions& options)
    : n_layer_(n_layer),
      capacity_(capacity),
      n_kv_head_(n_kv_head),
      head_dim_(head_dim),
      options_(options),
      type_(options.type),
      n_keep_(options.n_keep) {
  if (n_layer <= 0 || capacity <= 0 || n_kv_head <= 0 || head_dim <= 0) {
    throw std::invalid_argument("KvCache: every dimension must be positive");
  }
  if (n_keep_ < 0 || n_keep_ >= capacity) {
    throw std::invalid_argument("--keep " + std::to_string(n_keep_) + " must be at least 0 and less than the context size " +
                                std::to_string(capacity));
  }
  if (options.n_discard < 0 || options.n_discard > capacity - n_keep_) {
    throw std::invalid_argument("--discard " + std::to_string(options.n_discard) + " must be between 1 and the " +
                                std::to_string(capacity - n_keep_) + " tokens after the kept ones (0: half of them)");
  }
  storage_ = PageBuffer(static_cast<size_t>(n_layer) * 2 * static_cast<size_t>(capacity) * row_bytes());
  positions_.assign(static_cast<size_t>(capacity), -1);
}

int KvCache::shift_size() const {
  if (options_.n_discard > 0) return std::min(options_.n_discard, ring_count_);
  return std::max(1, ring_count_ / 2);
}

void KvCache::clear() {
  n_sink_ = ring_head_ = ring_count_ = extent_ = 0;
  next_position_ = 0;
  std::fill(positions_.begin(), positions_.end(), -1);
  softmax_phi_.clear();
  prefix_.reset();
  storage_.release();
}

void KvCache::attach_prefix(std::shared_ptr<const KvCache> prefix) {
  if (prefix == nullptr) throw std::invalid_argument("KvCache::attach_prefix: no prefix");
  if (size() != 0 || prefix_ != nullptr) throw std::logic_error("KvCache::attach_prefix: the cache is not empty");
  if (prefix->n_layer_ != n_layer_ || prefix->n_kv_head_ != n_kv_head_ || prefix->head_dim_ != head_dim_ ||
      prefix->type_ != type_) {
    throw std::invalid_argument("KvCache::attach_prefix: the prefix has another shape or type");
  }
  if (prefix->prefix_ != nullptr) throw std::invalid_argument("KvCache::attach_prefix: the prefix has a prefix");
  next_position_ = prefix->next_position();
  prefix_ = std::move(prefix);
}

int KvCache::contiguous_free() const {
  if (n_sink_ < n_keep_) return capacity_ - n_sink_;  // young cache: sinks and ring are one run from slot 0
  const int tail = (ring_head_ + ring_count_) % ring_capacity();
  return std::min(ring_capacity() - ring_count_, ring_capacity() - tail);
}

int KvCache::append(int n) {
  if (n < 0 || n > contiguous_free()) {
    throw std::length_error("KV cache full: " + std::to_string(size()) + " cached + " + std::to_string(n) +
                            " new tokens exceed the context size " + std::to_string(capacity_));
  }
  const int first = n_sink_ < n_keep_ ? n_sink_ : ring_slot(ring_count_);
  const int to_sinks = std::min(n, n_keep_ - n_sink_);
  n_sink_ += to_sinks;
  ring_count_ += n - to_sinks;
  for (int i = 0; i < n; ++i) positions_[static_cast<size_t>(first + i)] = next_position_ + i;
  next_position_ += n;
  extent_ = std::max(extent_, first + n);
  return first;
}

std::vector<int> KvCache::discard(int n_discard) {
  if (prefix_ != nullptr) throw std::logic_error("KvCache::discard: a cache with a shared prefix does not shift");
  if (n_discard <= 0 || n_discard > ring_count_) {
    throw std::invalid_argument("cannot discard " + std::to_string(n_discard) + " of the " + std::to_string(ring_count_) +
                                " tokens after the " + std::to_string(n_keep_) + " kept ones");
  }
  for (int i = 0; i < n_discard; ++i) positions_[static_cast<size_t>(ring_slot(i))] = -1;
  ring_head_ = (ring_head_ + n_discard) % ring_capacity();
  ring_count_ -= n_discard;
  std::vector<int> moved(static_cast<size_t>(ring_count_));
  for (int i = 0; i < ring_count_; ++i) {
    moved[static_cast<size_t>(i)] = ring_slot(i);
    positions_[static_cast<size_t>(ring_slot(i))] -= n_discard;
  }
  next_position_ -= n_discard;
  ++shifts_;
  discarded_ += n_discard;
  return moved;
}

KvView KvCache::view() {
  KvView v;
  v.rows = storage_.data();
  v.n_layer = n_layer_;
  v.capacity = capacity_;
  v.row_width = row_width();
  v.f16 = type_ == KvType::kF16;
  v.positions = positions();
  v.state = &backend_state_;
  return v;
}

KvView KvCache::prefix_view() const {
  KvView v = const_cast<KvCache*>(this)->view();  // the ops only read a prefix's rows
  v.state = nullptr;
  return v;
}

}  // namespace ringlm
