#include "core/kv/kv_cache.h"

#include <stdexcept>
#include <string>

namespace ringlm {

KvCache::KvCache(int n_layer, int capacity, int n_kv_head, int head_dim)
    : n_layer_(n_layer), capacity_(capacity), n_kv_head_(n_kv_head), head_dim_(head_dim) {
  if (n_layer <= 0 || capacity <= 0 || n_kv_head <= 0 || head_dim <= 0) {
    throw std::invalid_argument("KvCache: every dimension must be positive");
  }
  const size_t n = static_cast<size_t>(n_layer) * capacity * n_kv_head * head_dim;
  keys_.assign(n, 0.0f);
  values_.assign(n, 0.0f);
  positions_.assign(static_cast<size_t>(capacity), 0);
}

int KvCache::append(int n, int64_t pos0) {
  if (n < 0 || size_ + n > capacity_) {
    throw std::length_error("KV cache full: " + std::to_string(size_) + " + " + std::to_string(n) +
                            " tokens exceed the context size " + std::to_string(capacity_));
  }
  const int first = size_;
  for (int i = 0; i < n; ++i) positions_[static_cast<size_t>(first + i)] = pos0 + i;
  size_ += n;
  return first;
}

}  // namespace ringlm
