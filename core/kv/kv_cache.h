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
// Sliding-window layers (Gemma 3's local layers) see only the last `window` positions, so they
// keep a ring of their own (KvWindowRing): `slots` slots, the window plus the most tokens one
// pass appends, each new token written over the oldest. Their keys keep their absolute
// positions; a context shift drops the same tokens there and re-rotates the rest, as in the
// full ring. At 8k tokens of Gemma 3 270M that is 24% of the memory of a full cache per layer.
//
// Keys and values are fp16 (half the memory and bandwidth), fp32, or q8_0 / q4_0 (an fp16 scale
// per 32 codes of 8 or 4 bits: 53% / 28% of fp16's bytes; the head size must be a multiple of
// 32), each side its own type (-ctk, -ctv), or KIVI's 2 bits on both (KvKiviGroups: keys per
// channel over groups of 32 slots, values per token; a group's rows wait in fp16 while it is
// written and until its newest token is kivi_residual tokens old, then append() seals it; a write
// into a sealed group opens it again), in one buffer per ring
// sized for all its slots, whose pages become resident as tokens are written (PageBuffer): a
// cache costs the memory of the tokens it holds.
//
// A prefix (attach_prefix) is another cache, read-only and shared, whose first tokens (all, or
// the first n) come before this one's: the segment KV cache of batch sampling, where n samples
// of one prompt share the prompt's keys and values and each holds only its own response, and of
// a server, where a request whose prompt begins like an earlier one reads that one's segment.
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

struct KvCacheOptions {
  KvTypes type = KvType::kF16;  // the keys' and the values' (-ctk, -ctv)
  int n_keep = 0;              // attention sinks: the first tokens, never discarded
  int n_discard = 0;           // tokens a context shift drops (0: half of those after the sinks)
  bool context_shift = false;  // when full: shift (StreamingLLM) or refuse more tokens
  int kivi_residual = kKiviResidual;  // kivi2: the newest tokens kept in fp16 (--kivi-residual)
};

// The layers of a model that keep only a sliding window, and the slots of their ring.
struct KvWindowRing {
  std::vector<bool> layers;  // [n_layer]: true for a sliding-window layer; empty: none
  int window = 0;            // positions a query sees
  int slots = 0;             // the window plus the most tokens one pass appends
};

// Which ring holds a layer's rows.
enum class KvRing { kFull, kWindow };

// What discard() moved: the slots of each ring whose keys must turn by -n_discard.
struct KvDiscard {
  std::vector<int> full, window;
};

class KvCache {
 public:
  KvCache(int n_layer, int capacity, int n_kv_head, int head_dim, const KvCacheOptions& options = {},
          const KvWindowRing& window = {});

  int capacity() const { return capacity_; }
  // Unique in the process: what a pipeline's other stages know this cache by (a moved cache keeps it).
  uint64_t id() const { return id_.value; }
  // Called with the id of every cache that goes (not of one moved from): a pipeline's first stage
  // tells the others, which then drop their copies. One observer per process; nullptr: none.
  static void set_release_observer(void (*observer)(uint64_t id));
  int size() const { return n_sink_ + ring_count_; }  // tokens cached here (not in the prefix)
  int n_keep() const { return n_keep_; }
  KvTypes type() const { return type_; }
  // The types a ring holds: type(), but for kivi2's window ring, which holds q4_0 on both sides.
  // KIVI's point is a cache that grows with the context, and the window ring does not grow
  // (Gemma 3 270M at 8k: 768 slots); there its 2-bit keys lost most of kivi2's perplexity
  // (fast-turning RoPE pairs span a channel's whole range within a group of 32 tokens) and its
  // fp16 staging of the residual made half of the ring's bytes (bench/README.md, "KIVI").
  KvTypes ring_type(KvRing ring) const { return ring == KvRing::kWindow ? window_type_ : type_; }
  const KvCacheOptions& options() const { return options_; }
  // Tokens the next context shift discards: --discard, else half of those after the sinks.
  int shift_size() const;
  int row_width() const { return n_kv_head_ * head_dim_; }
  int head_dim() const { return head_dim_; }
  int n_kv_head() const { return n_kv_head_; }
  // Memory reserved for every slot of both rings.
  size_t bytes() const { return full_.storage.size() + window_.storage.size(); }
  // Memory the tokens held here occupy: every layer's keys and values of the tokens each ring holds.
  size_t bytes_in_use() const { return full_.bytes_for(size()) + window_.bytes_for(window_.held); }
  // What a cache of this shape holding n tokens would occupy (the window ring keeps its last slots).
  size_t bytes_for_tokens(int64_t n) const;
  // Memory the cache occupies now: the pages its tokens were written to (see PageBuffer).
  size_t resident_bytes() const { return full_.storage.resident_bytes() + window_.storage.resident_bytes(); }
  int64_t shifts() const { return shifts_; }         // discard() calls so far
  int64_t discarded() const { return discarded_; }   // tokens discarded so far

  // Where layer `layer`'s rows are: its ring and its index among that ring's layers.
  struct LayerPlace {
    KvRing ring;
    int index;
  };
  LayerPlace place(int layer) const { return places_[static_cast<size_t>(layer)]; }
  bool has_window_ring() const { return window_.n_layer > 0; }
  int window_slots() const { return window_.slots; }

  // Slots of the full ring that ever held a token: attention covers [0, extent()) and masks the
  // empty ones.
  int extent() const { return full_.extent; }
  // Position of the token in each slot of [0, extent()) of the full ring, -1 where empty.
  std::span<const int64_t> positions() const { return full_.used_positions(); }
  // Position the next token takes: one past the newest cached token (0 when empty).
  int64_t next_position() const { return next_position_; }

  // Tokens the next append() can take in contiguous slots of the full ring (0: full).
  int contiguous_free() const;
  // Reserves `n` (<= contiguous_free()) contiguous slots of the full ring for new tokens at
  // positions next_position().. and returns the first; the window ring's slots for them start
  // at window_slot() (read before the call) and wrap around its end. The caller writes every
  // layer's keys and values.
  int append(int n);
  // The window ring's slot for the next appended token.
  int window_slot() const { return window_.slots > 0 ? static_cast<int>(window_appended_ % window_.slots) : 0; }

  // Frees the n_discard oldest tokens after the sinks (n_discard <= size() - sinks) in both
  // rings and moves every later token back n_discard positions. Returns the slots whose keys
  // must be re-rotated by -n_discard (every remaining token after the sinks).
  KvDiscard discard(int n_discard);
  // Forgets the n newest tokens (speculative decoding's rejected draft): their slots are empty
  // and the next token takes the position of the first of them, as if they had never been
  // appended. A window ring gives back its slots (the tokens they held before are out of every
  // later window), so n is at most what it keeps beyond its window; std::invalid_argument
  // otherwise, or past size(). Tokens a context shift already moved are not rolled back.
  void rollback(int n);
  // The most tokens rollback() can forget after an append (the window ring's slack).
  int max_rollback() const { return has_window_ring() ? window_.slots - window_size_ : capacity_; }
  // Empties the cache (and drops its prefix); the memory of its tokens goes back to the system.
  void clear();
  // Makes this cache's own tokens a copy of `other`'s (a beam that forks): their rows, slots and
  // positions, and the sequence's attention state. Both read the same prefix (or none) and have
  // the same shape and type; no backend keeps a copy of either elsewhere (std::invalid_argument,
  // std::logic_error otherwise). Only the slots `other` ever wrote are copied, never the prefix.
  void copy_from(const KvCache& other);

  // Makes the first n tokens of `prefix` (n < 0: all of them) this (empty) cache's first ones:
  // attention reads them from there (its later tokens are masked out), and this cache's own
  // tokens continue at position n. The prefix must be readable so (can_read_prefix); it must
  // not change while attached. A cache with a prefix does not shift (can_shift()).
  // std::invalid_argument / std::logic_error otherwise.
  void attach_prefix(std::shared_ptr<const KvCache> prefix, int n = -1);
  // Whether this cache could read the first n tokens of `prefix`: 0 < n <= its size, the same
  // shape, rings and type, no prefix of its own, and (with a window ring) the prefix's window
  // ring still holding the last window tokens before position n.
  bool can_read_prefix(const KvCache& prefix, int n) const;
  const KvCache* prefix() const { return prefix_.get(); }
  int prefix_tokens() const { return prefix_ ? prefix_tokens_ : 0; }  // the prefix's tokens read here
  // A full cache shifts its context (options().context_shift) unless it reads a prefix.
  bool can_shift() const { return options_.context_shift && prefix_ == nullptr; }
  // Tokens the sequence's attention sees: the prefix's and this cache's.
  int context_size() const { return prefix_tokens() + size(); }
  // Whether the cache can take one more token: it has a free slot, or it shifts when full.
  bool has_room() const { return can_shift() || context_size() < capacity(); }
  // How many draft tokens may follow the next token in one pass: what fits before a context
  // shift would be needed (decoding shifts at the token that needs it, not earlier), and what a
  // rollback can forget.
  int draft_room() const;

  // The sequence's decode attention state, kept between steps: FlashDecoding++'s unified max of
  // each (layer, query head)'s scores. The model sizes it on first use; empty or NaN: not known
  // yet (the exact softmax runs). It belongs to the sequence, not the model, so sequences
  // decoded together never see each other's maxima.
  std::vector<float>& softmax_phi() { return softmax_phi_; }
  // After a pass that checked a draft (LlamaModel::forward_steps), the maxima as each of its
  // rows left them ([row][n_layer * n_head]), so that rollback() leaves them as the last row
  // kept left them, as plain decoding would have. Empty after any other pass.
  std::vector<std::vector<float>>& softmax_phi_rows() { return softmax_phi_rows_; }

  // A ring as the backend's ops see it (backends/backend.h): its rows, positions and the
  // backend's own state for it (a device copy, which the backend made and keeps in step). The
  // prefix's view is the caller's to set (it must outlive the calls).
  KvView view(KvRing ring = KvRing::kFull);
  // The attached prefix's ring as this cache reads it: read-only, without backend state, its
  // tokens past the first prefix_tokens() masked (the caller checks that there is a prefix).
  KvView prefix_view(KvRing ring = KvRing::kFull) const;
  // Whether a backend keeps state of its own for a ring of this cache (a copy in a device's memory).
  bool has_backend_state() const { return full_.backend_state != nullptr || window_.backend_state != nullptr; }

  // Row `slot` of layer `layer` (a slot of the layer's ring): row_width() keys of the ring's
  // type (ring_type), or values.
  void* key(int layer, int slot) { return rows_of(layer).row(place(layer).index, slot, false); }
  void* value(int layer, int slot) { return rows_of(layer).row(place(layer).index, slot, true); }
  const void* key(int layer, int slot) const { return const_cast<KvCache*>(this)->key(layer, slot); }
  const void* value(int layer, int slot) const { return const_cast<KvCache*>(this)->value(layer, slot); }
  // A row of the full ring's (type()).
  size_t key_row_bytes() const { return kv_bytes_of(type_.keys, row_width()); }
  size_t value_row_bytes() const { return kv_value_bytes_of(type_.values, row_width()); }
  // A slot's keys and values in one layer.
  size_t slot_bytes() const { return key_row_bytes() + value_row_bytes(); }

 private:
  // One ring's rows, [n_layer][keys [slots], values [slots]] (KvView's layout), and each slot's
  // position.
  struct Rows {
    int n_layer = 0;
    int slots = 0;
    size_t key_bytes = 0, value_bytes = 0;  // a row's
    PageBuffer storage;
    std::vector<int64_t> positions;  // [slots], -1: empty
    int extent = 0;                  // slots that ever held a token
    int held = 0;                    // slots holding a token now
    std::unique_ptr<BackendKvState> backend_state;
    // KIVI (both sides kKivi2): the groups, each open one's staging buffer and the count of
    // tokens written to the ring when its newest token was.
    KvKiviGroups kivi;
    std::vector<int16_t> staged;  // [n_groups], -1: sealed
    std::vector<int64_t> newest;  // [n_groups]
    std::vector<int16_t> free_buffers;
    int64_t writes = 0;  // tokens written to the ring since it was cleared
    int residual = 0, buffers = 0;

    void allocate(int n_layer, int slots, size_t key_bytes, size_t value_bytes);
    // KIVI: groups of slots (the first `sinks` pinned in groups of their own), `buffers` staging
    // buffers of row_width-wide rows per layer besides the sink groups'.
    void allocate_kivi(int sinks, int row_width, int residual, int buffers);
    bool is_kivi() const { return kivi.n_groups > 0; }
    size_t layer_bytes() const {
      return is_kivi() ? kivi.layer_bytes : static_cast<size_t>(slots) * (key_bytes + value_bytes);
    }
    uint8_t* row(int index, int slot, bool value) {
      const size_t layer = static_cast<size_t>(index) * layer_bytes();
      return storage.data() + layer + (value ? static_cast<size_t>(slots) * key_bytes + slot * value_bytes : slot * key_bytes);
    }
    size_t bytes_for(int64_t n_tokens) const;
    std::span<const int64_t> used_positions() const { return {positions.data(), static_cast<size_t>(extent)}; }
    void clear();
    void copy_from(const Rows& other);  // the same shape: every slot other ever wrote
  };
  Rows& rows_of(int layer) { return place(layer).ring == KvRing::kWindow ? window_ : full_; }
  // The window ring's part of discard(): positions [first, first + n) dropped, later ones moved back.
  std::vector<int> discard_window(int64_t first, int n);
  // KIVI: gets a ring's groups ready for n tokens about to be written at `ranges` of its slots
  // (in order; before their positions are set): seals the open groups whose newest token left
  // the residual, and opens the groups the write touches, unless it fills one whole and that one
  // is out of the residual already (the backend quantizes those from the pass's rows once the
  // layer's attention has read them). The sink groups (KvKiviGroups::pinned) stay open for good.
  void prepare_kivi_write(KvRing ring, std::span<const std::pair<int, int>> ranges, int n);
  int ring_capacity() const { return capacity_ - n_keep_; }
  int ring_slot(int i) const { return n_keep_ + (ring_head_ + i) % ring_capacity(); }  // i-th oldest after the sinks

  // The id moves with the cache; a cache moved from has none (0), and its end releases nothing.
  struct Id {
    uint64_t value;
    explicit Id(uint64_t v) : value(v) {}
    Id(Id&& other) noexcept : value(std::exchange(other.value, 0)) {}
    Id& operator=(Id&& other) noexcept;
    ~Id();
  };
  Id id_;
  int n_layer_, capacity_, n_kv_head_, head_dim_;
  KvCacheOptions options_;
  KvTypes type_;
  KvTypes window_type_;  // ring_type(KvRing::kWindow)
  int n_keep_;
  std::vector<LayerPlace> places_;  // [n_layer]
  Rows full_, window_;
  int n_sink_ = 0;      // sink slots filled (< n_keep only while the cache is young)
  int ring_head_ = 0;   // ring index of the oldest token after the sinks
  int ring_count_ = 0;  // tokens in the ring
  int64_t window_appended_ = 0;  // tokens appended to the window ring since clear()
  int64_t next_position_ = 0;
  int64_t shifts_ = 0, discarded_ = 0;
  std::shared_ptr<const KvCache> prefix_;
  int prefix_tokens_ = 0;
  std::vector<int64_t> prefix_positions_[2];  // the prefix's rings' positions as read here ([full, window])
  int window_size_ = 0;  // positions a sliding-window layer sees (with a window ring)
  std::vector<float> softmax_phi_;
  std::vector<std::vector<float>> softmax_phi_rows_;
};

}  // namespace ringlm
