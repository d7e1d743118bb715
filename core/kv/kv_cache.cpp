#include "core/kv/kv_cache.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

namespace ringlm {

void KvCache::Rows::allocate(int n_layer_in_ring, int n_slots, size_t bytes_per_key, size_t bytes_per_value) {
  n_layer = n_layer_in_ring;
  slots = n_slots;
  key_bytes = bytes_per_key;
  value_bytes = bytes_per_value;
  storage = PageBuffer(static_cast<size_t>(n_layer) * static_cast<size_t>(slots) * (key_bytes + value_bytes));
  positions.assign(static_cast<size_t>(slots), -1);
}

void KvCache::Rows::allocate_kivi(int sinks, int row_width, int residual_tokens, int n_buffers) {
  kivi = KvKiviGroups{};
  if (slots == 0) return;
  kivi.sinks = std::min(sinks, slots);
  kivi.slots = slots;
  kivi.n_groups = KvKiviGroups::groups_for(slots, kivi.sinks);
  residual = residual_tokens;
  buffers = n_buffers;  // (clear() asks again)
  n_buffers += kivi.sink_groups();
  kivi.params_at = static_cast<size_t>(slots) * (key_bytes + value_bytes);
  kivi.staging_at = kivi.params_at + static_cast<size_t>(kivi.n_groups) * kivi_key_params_bytes(row_width);
  kivi.layer_bytes = kivi.staging_at + static_cast<size_t>(n_buffers) * 2 * kKiviGroup * row_width * sizeof(uint16_t);
  storage = PageBuffer(static_cast<size_t>(n_layer) * kivi.layer_bytes);
  staged.assign(static_cast<size_t>(kivi.n_groups), -1);
  newest.assign(staged.size(), 0);
  kivi.staged = staged.data();
  free_buffers.clear();
  for (int b = n_buffers - 1; b >= 0; --b) free_buffers.push_back(static_cast<int16_t>(b));
  writes = 0;
}

size_t KvCache::Rows::bytes_for(int64_t n_tokens) const {
  const size_t per_layer_rows = static_cast<size_t>(n_tokens) * (key_bytes + value_bytes);
  if (!is_kivi()) return static_cast<size_t>(n_layer) * per_layer_rows;
  const int64_t groups = std::min<int64_t>(kivi.n_groups, (n_tokens + kKiviGroup - 1) / kKiviGroup + 1);
  const size_t params = (kivi.staging_at - kivi.params_at) / static_cast<size_t>(kivi.n_groups);
  return static_cast<size_t>(n_layer) *
         (per_layer_rows + static_cast<size_t>(groups) * params + (kivi.layer_bytes - kivi.staging_at));
}

namespace {
// Whether slot s of a ring's view holds a token.
bool live_slot(const KvView& v, int slot) {
  return slot < static_cast<int>(v.positions.size()) && v.positions[static_cast<size_t>(slot)] >= 0;
}

// Seals open group g in every layer of a KIVI ring: its staged keys quantized per channel (the
// slots holding a token set the ranges), its values per token.
void seal_group(const KvView& v, int g) {
  const KvKiviGroups& k = *v.kivi;
  const int b = k.staged[g], first = k.first_slot(g), size = k.group_size(g);
  const auto width = static_cast<size_t>(v.row_width);
  bool live[kKiviGroup];
  for (int i = 0; i < size; ++i) live[i] = live_slot(v, first + i);
  std::vector<float> rows(static_cast<size_t>(size) * width);
  for (int layer = 0; layer < v.n_layer; ++layer) {
    for (int i = 0; i < size; ++i) {
      const uint16_t* key = v.kivi_staged(layer, b, i, false);
      for (size_t e = 0; e < width; ++e) rows[i * width + e] = fp16_to_fp32(key[e]);
    }
    uint16_t* params = v.kivi_params(layer, g);
    kivi_quantize_keys(rows.data(), v.row_width, live, size, v.row_width, v.key(layer, first),
                       static_cast<int64_t>(v.key_row_bytes()), params, params + v.row_width);
    for (int i = 0; i < size; ++i) {
      const uint16_t* value = v.kivi_staged(layer, b, i, true);
      for (size_t e = 0; e < width; ++e) rows[e] = fp16_to_fp32(value[e]);
      kivi_quantize_value(rows.data(), v.row_width, v.value(layer, first + i));
    }
  }
}

// Fills staging buffer b with sealed group g's rows in every layer, dequantized (zero: `empty`).
void load_group(const KvView& v, int g, int b, bool empty) {
  const KvKiviGroups& k = *v.kivi;
  const int first = k.first_slot(g), size = k.group_size(g);
  const auto width = static_cast<size_t>(v.row_width);
  std::vector<float> rows(static_cast<size_t>(size) * width, 0.0f), value(width, 0.0f);
  for (int layer = 0; layer < v.n_layer; ++layer) {
    if (!empty) {
      const uint16_t* params = v.kivi_params(layer, g);
      kivi_dequantize_keys(v.key(layer, first), static_cast<int64_t>(v.key_row_bytes()), size, params, params + v.row_width, 0,
                           v.row_width, rows.data(), v.row_width);
    }
    for (int i = 0; i < size; ++i) {
      uint16_t* key = v.kivi_staged(layer, b, i, false);
      uint16_t* staged_value = v.kivi_staged(layer, b, i, true);
      if (!empty) kivi_dequantize_value(v.value(layer, first + i), 0, v.row_width, value.data());
      for (size_t e = 0; e < width; ++e) {
        key[e] = fp32_to_fp16(rows[i * width + e]);
        staged_value[e] = fp32_to_fp16(value[e]);
      }
    }
  }
}
}  // namespace

void KvCache::prepare_kivi_write(KvRing ring, std::span<const std::pair<int, int>> ranges, int n) {
  Rows& r = ring == KvRing::kWindow ? window_ : full_;
  if (!r.is_kivi() || n == 0) return;
  const KvView v = view(ring);
  const KvKiviGroups& k = r.kivi;
  const int64_t after = r.writes + n;
  const auto touched = [&](int g) {
    const int first = k.first_slot(g), end = first + k.group_size(g);
    for (const auto& [a, b] : ranges) {
      if (a < end && first < b) return true;
    }
    return false;
  };
  const auto seal = [&](int g) {
    seal_group(v, g);
    r.free_buffers.push_back(r.staged[static_cast<size_t>(g)]);
    r.staged[static_cast<size_t>(g)] = -1;
  };
  // A free staging buffer: one no open group holds, else the buffer of the open group written
  // longest ago that this write does not touch, sealed early.
  const auto take_buffer = [&] {
    if (r.free_buffers.empty()) {
      int oldest = -1;
      for (int g = k.sink_groups(); g < k.n_groups; ++g) {
        if (r.staged[static_cast<size_t>(g)] >= 0 && !touched(g) &&
            (oldest < 0 || r.newest[static_cast<size_t>(g)] < r.newest[static_cast<size_t>(oldest)])) {
          oldest = g;
        }
      }
      if (oldest < 0) throw std::logic_error("KvCache: a KIVI write touches more groups than the staging buffers hold");
      seal(oldest);
    }
    const int16_t b = r.free_buffers.back();
    r.free_buffers.pop_back();
    return b;
  };
  for (int g = k.sink_groups(); g < k.n_groups; ++g) {
    if (r.staged[static_cast<size_t>(g)] >= 0 && r.newest[static_cast<size_t>(g)] <= after - r.residual && !touched(g)) seal(g);
  }
  int64_t done = 0;  // tokens of the write in the ranges before this one
  for (const auto& [a, b] : ranges) {
    for (int s = a; s < b;) {
      const int g = k.group_of(s), first = k.first_slot(g), end = first + k.group_size(g);
      const int s_end = std::min(b, end);
      const int64_t newest = r.writes + done + (s_end - a);
      int16_t& staged = r.staged[static_cast<size_t>(g)];
      if (!k.pinned(g) && s == first && s_end == end && newest <= after - r.residual) {
        if (staged >= 0) r.free_buffers.push_back(staged);  // written over whole: quantized after the attention
        staged = -1;
      } else if (staged < 0) {
        bool kept = false;  // tokens of the group the write leaves, which the buffer must hold
        for (int slot = first; slot < end; ++slot) kept |= (slot < s || slot >= s_end) && live_slot(v, slot);
        const int16_t buffer = take_buffer();
        load_group(v, g, buffer, !kept);
        staged = buffer;
      }
      r.newest[static_cast<size_t>(g)] = newest;
      s = s_end;
    }
    done += b - a;
  }
  r.writes = after;
}

namespace {
uint64_t next_cache_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
std::atomic<void (*)(uint64_t)> g_release_observer{nullptr};
void release_id(uint64_t id) {
  if (id == 0) return;
  if (auto* observer = g_release_observer.load(std::memory_order_acquire)) observer(id);
}
}  // namespace

void KvCache::set_release_observer(void (*observer)(uint64_t id)) {
  g_release_observer.store(observer, std::memory_order_release);
}

KvCache::Id& KvCache::Id::operator=(Id&& other) noexcept {
  if (this != &other) {
    release_id(value);  // the cache assigned over goes
    value = std::exchange(other.value, 0);
  }
  return *this;
}

KvCache::Id::~Id() { release_id(value); }

void KvCache::Rows::clear() {
  std::fill(positions.begin(), positions.end(), -1);
  extent = held = 0;
  storage.release();
  if (is_kivi()) allocate_kivi(kivi.sinks, static_cast<int>(key_bytes * 4), residual, buffers);
}

KvCache::KvCache(int n_layer, int capacity, int n_kv_head, int head_dim, const KvCacheOptions& options,
                 const KvWindowRing& window)
    : id_(Id(next_cache_id())),
      n_layer_(n_layer),
      capacity_(capacity),
      n_kv_head_(n_kv_head),
      head_dim_(head_dim),
      options_(options),
      type_(options.type),
      window_type_(type_.keys == KvType::kKivi2 ? KvTypes{KvType::kQ4_0, KvType::kQ4_0} : type_),
      n_keep_(options.n_keep) {
  if (n_layer <= 0 || capacity <= 0 || n_kv_head <= 0 || head_dim <= 0) {
    throw std::invalid_argument("KvCache: every dimension must be positive");
  }
  if ((type_.keys == KvType::kKivi2) != (type_.values == KvType::kKivi2)) {
    throw std::invalid_argument("--cache-type kivi2 quantizes keys and values together (keys per channel, values per "
                                "token): give it to both sides, or neither (-ctk kivi2 -ctv kivi2, or --cache-type kivi2)");
  }
  if (type_.keys == KvType::kKivi2 && (head_dim % kKiviValueBlock != 0 || head_dim > kKiviMaxHead)) {
    throw std::invalid_argument("--cache-type kivi2 needs a head size that is a multiple of " +
                                std::to_string(kKiviValueBlock) + " up to " + std::to_string(kKiviMaxHead) +
                                " (this model's is " + std::to_string(head_dim) + "): use q4_0 or f16");
  }
  if (type_.keys == KvType::kKivi2 && options.kivi_residual < 0) {
    throw std::invalid_argument("--kivi-residual " + std::to_string(options.kivi_residual) + " must be 0 or more");
  }
  for (const KvType side : {type_.keys, type_.values}) {
    if (kv_type_has_blocks(side) && head_dim % 32 != 0) {
      throw std::invalid_argument(std::string("--cache-type ") + kv_type_name(side) +
                                  " needs a head size that is a multiple of 32 (this model's is " + std::to_string(head_dim) +
                                  "): use f16");
    }
  }
  if (n_keep_ < 0 || n_keep_ >= capacity) {
    throw std::invalid_argument("--keep " + std::to_string(n_keep_) + " must be at least 0 and less than the context size " +
                                std::to_string(capacity));
  }
  if (options.n_discard < 0 || options.n_discard > capacity - n_keep_) {
    throw std::invalid_argument("--discard " + std::to_string(options.n_discard) + " must be between 1 and the " +
                                std::to_string(capacity - n_keep_) + " tokens after the kept ones (0: half of them)");
  }
  if (!window.layers.empty() && static_cast<int>(window.layers.size()) != n_layer) {
    throw std::invalid_argument("KvCache: the window ring names " + std::to_string(window.layers.size()) + " layers of " +
                                std::to_string(n_layer));
  }
  int n_full = 0, n_window = 0;
  for (int il = 0; il < n_layer; ++il) {
    const bool windowed = !window.layers.empty() && window.layers[static_cast<size_t>(il)];
    places_.push_back(windowed ? LayerPlace{KvRing::kWindow, n_window++} : LayerPlace{KvRing::kFull, n_full++});
  }
  if (n_window > 0 && !(window.window > 0 && window.slots > window.window)) {
    throw std::invalid_argument("KvCache: a window ring needs a window and more slots than it");
  }
  // The full ring keeps the positions of the sequence even when every layer is windowed.
  full_.allocate(n_full, capacity, key_row_bytes(), value_row_bytes());
  window_.allocate(n_window, n_window > 0 ? window.slots : 0, kv_bytes_of(window_type_.keys, row_width()),
                   kv_value_bytes_of(window_type_.values, row_width()));
  window_size_ = n_window > 0 ? window.window : 0;
  if (type_.keys == KvType::kKivi2) {
    // The open groups besides the sinks': those of the residual's tokens (which include the
    // groups a write opens at its ends), one more where they straddle two, and one more where
    // the ring wraps (a short last group). (Were they all taken, the oldest would be sealed
    // early.) The window ring holds q4_0 instead (ring_type).
    const int residual_groups = (options.kivi_residual + kKiviGroup - 1) / kKiviGroup;
    full_.allocate_kivi(std::max(n_keep_, 1), row_width(), options.kivi_residual, residual_groups + 2);
  }
}

int KvCache::shift_size() const {
  if (options_.n_discard > 0) return std::min(options_.n_discard, ring_count_);
  return std::max(1, ring_count_ / 2);
}

size_t KvCache::bytes_for_tokens(int64_t n) const {
  return full_.bytes_for(n) + window_.bytes_for(std::min<int64_t>(n, window_.slots));
}

void KvCache::clear() {
  n_sink_ = ring_head_ = ring_count_ = 0;
  window_appended_ = 0;
  next_position_ = 0;
  full_.clear();
  window_.clear();
  softmax_phi_.clear();
  prefix_.reset();
  prefix_tokens_ = 0;
}

void KvCache::Rows::copy_from(const Rows& other) {
  for (int index = 0; index < n_layer; ++index) {
    for (const bool value : {false, true}) {
      std::copy_n(const_cast<Rows&>(other).row(index, 0, value),
                  static_cast<size_t>(other.extent) * (value ? value_bytes : key_bytes), row(index, 0, value));
    }
    if (is_kivi() && other.extent > 0) {  // the written groups' parameters, and the staging buffers
      const size_t layer = static_cast<size_t>(index) * kivi.layer_bytes;
      const size_t params = (kivi.staging_at - kivi.params_at) / static_cast<size_t>(kivi.n_groups);
      std::copy_n(other.storage.data() + layer + kivi.params_at,
                  static_cast<size_t>(kivi.group_of(other.extent - 1) + 1) * params, storage.data() + layer + kivi.params_at);
      std::copy_n(other.storage.data() + layer + kivi.staging_at, kivi.layer_bytes - kivi.staging_at,
                  storage.data() + layer + kivi.staging_at);
    }
  }
  positions = other.positions;
  extent = other.extent;
  held = other.held;
  if (is_kivi()) {
    staged = other.staged;
    newest = other.newest;
    free_buffers = other.free_buffers;
    writes = other.writes;
  }
}

void KvCache::copy_from(const KvCache& other) {
  if (this == &other) return;
  const bool same_shape = other.n_layer_ == n_layer_ && other.capacity_ == capacity_ && other.n_kv_head_ == n_kv_head_ &&
                          other.head_dim_ == head_dim_ && other.type_ == type_ && other.n_keep_ == n_keep_ &&
                          other.window_.slots == window_.slots && other.window_.n_layer == window_.n_layer;
  if (!same_shape) throw std::invalid_argument("KvCache::copy_from: the caches have different shapes or types");
  if (other.prefix_ != prefix_ || other.prefix_tokens_ != prefix_tokens_) {
    throw std::invalid_argument("KvCache::copy_from: the caches read different prefixes");
  }
  if (has_backend_state() || other.has_backend_state()) {
    throw std::logic_error("KvCache::copy_from: a backend keeps a copy of the cache elsewhere (a device)");
  }
  full_.clear();
  window_.clear();
  full_.copy_from(other.full_);
  window_.copy_from(other.window_);
  n_sink_ = other.n_sink_;
  ring_head_ = other.ring_head_;
  ring_count_ = other.ring_count_;
  window_appended_ = other.window_appended_;
  next_position_ = other.next_position_;
  shifts_ = other.shifts_;
  discarded_ = other.discarded_;
  softmax_phi_ = other.softmax_phi_;
  softmax_phi_rows_ = other.softmax_phi_rows_;
}

bool KvCache::can_read_prefix(const KvCache& prefix, int n) const {
  const bool same_shape = prefix.n_layer_ == n_layer_ && prefix.n_kv_head_ == n_kv_head_ && prefix.head_dim_ == head_dim_ &&
                          prefix.type_ == type_ && prefix.places_.size() == places_.size() &&
                          prefix.window_.slots == window_.slots && prefix.window_size_ == window_size_;
  if (!same_shape || prefix.prefix_ != nullptr || n <= 0 || n > prefix.size()) return false;
  for (size_t il = 0; il < places_.size(); ++il) {
    if (prefix.places_[il].ring != places_[il].ring) return false;
  }
  // The window ring keeps the last window_.slots tokens: those a query at position n sees must
  // still be there.
  return !has_window_ring() || prefix.size() - n <= window_.slots - window_size_;
}

void KvCache::attach_prefix(std::shared_ptr<const KvCache> prefix, int n) {
  if (prefix == nullptr) throw std::invalid_argument("KvCache::attach_prefix: no prefix");
  if (size() != 0 || prefix_ != nullptr) throw std::logic_error("KvCache::attach_prefix: the cache is not empty");
  if (n < 0) n = prefix->size();
  if (!can_read_prefix(*prefix, n)) {
    throw std::invalid_argument("KvCache::attach_prefix: the prefix has another shape or type, a prefix of its own, or "
                                "not the " + std::to_string(n) + " tokens asked for");
  }
  // The positions this cache reads: the prefix's, with its tokens from position n on masked.
  for (const KvRing ring : {KvRing::kFull, KvRing::kWindow}) {
    const std::span<const int64_t> positions = (ring == KvRing::kWindow ? prefix->window_ : prefix->full_).used_positions();
    std::vector<int64_t>& seen = prefix_positions_[ring == KvRing::kWindow ? 1 : 0];
    seen.assign(positions.begin(), positions.end());
    for (int64_t& p : seen) p = p < n ? p : -1;
  }
  prefix_tokens_ = n;
  next_position_ = n;
  prefix_ = std::move(prefix);
}

int KvCache::contiguous_free() const {
  if (n_sink_ < n_keep_) return capacity_ - n_sink_;  // young cache: sinks and ring are one run from slot 0
  const int tail = (ring_head_ + ring_count_) % ring_capacity();
  return std::min(ring_capacity() - ring_count_, ring_capacity() - tail);
}

int KvCache::draft_room() const { return std::max(0, std::min(contiguous_free() - 1, max_rollback())); }

int KvCache::append(int n) {
  if (n < 0 || n > contiguous_free()) {
    throw std::length_error("KV cache full: " + std::to_string(size()) + " cached + " + std::to_string(n) +
                            " new tokens exceed the context size " + std::to_string(capacity_));
  }
  if (n > window_.slots && has_window_ring()) {
    throw std::length_error("KV cache: " + std::to_string(n) + " tokens in one pass exceed the window ring of " +
                            std::to_string(window_.slots) + " slots");
  }
  const int first = n_sink_ < n_keep_ ? n_sink_ : ring_slot(ring_count_);
  if (full_.is_kivi()) {
    const std::pair<int, int> full_range[] = {{first, first + n}};
    prepare_kivi_write(KvRing::kFull, full_range, n);
    if (has_window_ring()) {
      const int w = window_slot(), to_end = std::min(n, window_.slots - w);
      const std::pair<int, int> window_ranges[] = {{w, w + to_end}, {0, n - to_end}};
      prepare_kivi_write(KvRing::kWindow, std::span(window_ranges, to_end < n ? 2 : 1), n);
    }
  }
  const int to_sinks = std::min(n, n_keep_ - n_sink_);
  n_sink_ += to_sinks;
  ring_count_ += n - to_sinks;
  for (int i = 0; i < n; ++i) full_.positions[static_cast<size_t>(first + i)] = next_position_ + i;
  full_.extent = std::max(full_.extent, first + n);
  full_.held = size();
  if (has_window_ring()) {
    for (int i = 0; i < n; ++i) {
      int64_t& slot_position = window_.positions[static_cast<size_t>((window_appended_ + i) % window_.slots)];
      window_.held += slot_position < 0;  // a slot written over keeps the count
      slot_position = next_position_ + i;
    }
    window_appended_ += n;
    window_.extent = static_cast<int>(std::min<int64_t>(window_appended_, window_.slots));
  }
  next_position_ += n;
  return first;
}

void KvCache::rollback(int n) {
  if (n < 0 || n > size()) {
    throw std::invalid_argument("cannot roll back " + std::to_string(n) + " of the " + std::to_string(size()) +
                                " tokens of the cache");
  }
  if (n > max_rollback()) {
    throw std::invalid_argument("cannot roll back " + std::to_string(n) + " tokens: the window ring keeps " +
                                std::to_string(max_rollback()) + " beyond its window");
  }
  for (int i = 0; i < n; ++i) {  // the newest first: the ring's, then the sinks'
    const int slot = ring_count_ > 0 ? ring_slot(--ring_count_) : --n_sink_;
    full_.positions[static_cast<size_t>(slot)] = -1;
  }
  full_.held = size();
  for (int i = 0; i < n && has_window_ring(); ++i) {
    --window_appended_;
    int64_t& p = window_.positions[static_cast<size_t>(window_appended_ % window_.slots)];
    window_.held -= p >= 0;
    p = -1;
  }
  if (has_window_ring()) window_.extent = static_cast<int>(std::min<int64_t>(window_appended_, window_.slots));
  next_position_ -= n;
  const auto rows = static_cast<int>(softmax_phi_rows_.size());
  if (n < rows) softmax_phi_ = softmax_phi_rows_[static_cast<size_t>(rows - 1 - n)];
  softmax_phi_rows_.clear();
}

KvDiscard KvCache::discard(int n_discard) {
  if (prefix_ != nullptr) throw std::logic_error("KvCache::discard: a cache with a shared prefix does not shift");
  if (n_discard <= 0 || n_discard > ring_count_) {
    throw std::invalid_argument("cannot discard " + std::to_string(n_discard) + " of the " + std::to_string(ring_count_) +
                                " tokens after the " + std::to_string(n_keep_) + " kept ones");
  }
  const int64_t first_dropped = full_.positions[static_cast<size_t>(ring_slot(0))];
  for (int i = 0; i < n_discard; ++i) full_.positions[static_cast<size_t>(ring_slot(i))] = -1;
  ring_head_ = (ring_head_ + n_discard) % ring_capacity();
  ring_count_ -= n_discard;
  KvDiscard moved;
  moved.full.resize(static_cast<size_t>(ring_count_));
  for (int i = 0; i < ring_count_; ++i) {
    moved.full[static_cast<size_t>(i)] = ring_slot(i);
    full_.positions[static_cast<size_t>(ring_slot(i))] -= n_discard;
  }
  full_.held = size();
  moved.window = discard_window(first_dropped, n_discard);
  next_position_ -= n_discard;
  ++shifts_;
  discarded_ += n_discard;
  return moved;
}

std::vector<int> KvCache::discard_window(int64_t first, int n) {
  std::vector<int> moved;
  for (int slot = 0; slot < window_.extent; ++slot) {
    int64_t& p = window_.positions[static_cast<size_t>(slot)];
    if (p < first) continue;  // empty, or a sink the window ring still holds
    if (p < first + n) {
      p = -1;
      --window_.held;
    } else {
      p -= n;
      moved.push_back(slot);
    }
  }
  return moved;
}

KvView KvCache::view(KvRing ring) {
  Rows& r = ring == KvRing::kWindow ? window_ : full_;
  KvView v;
  v.rows = r.storage.data();
  v.n_layer = r.n_layer;
  v.capacity = r.slots;
  v.row_width = row_width();
  v.head_dim = head_dim_;
  v.key_type = ring_type(ring).keys;
  v.value_type = ring_type(ring).values;
  v.cache_types = type_;
  v.positions = r.used_positions();
  v.cache_id = id();
  v.state = &r.backend_state;
  if (r.is_kivi()) {
    r.kivi.staged = r.staged.data();
    v.kivi = &r.kivi;
  }
  return v;
}

KvView KvCache::prefix_view(KvRing ring) const {
  KvView v = const_cast<KvCache&>(*prefix_).view(ring);  // the ops only read a prefix's rows
  v.positions = prefix_positions_[ring == KvRing::kWindow ? 1 : 0];
  v.source_state = v.state;
  v.state = nullptr;
  return v;
}

}  // namespace ringlm
