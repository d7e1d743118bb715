// LlamaModel: attention over each sequence's cache. The pass's sequences as the backend sees them
// (their caches' rings, the prefixes they read first), the store of each layer's keys and values,
// and one attention call per layer for every sequence; a speculative draft's checking rows attend
// as their decode steps would.
#include <algorithm>
#include <cmath>

#include "core/model/llama.h"

namespace ringlm {

void LlamaModel::store_kv(int layer, size_t sequence, const Rows& rows) {
  const Scratch& s = *scratch_;
  const KvCache::LayerPlace place = rows.cache->place(layer);
  const KvView& view = s.kv_views[kv_view_index(sequence, place.ring)];
  const int n = static_cast<int>(rows.tokens.size());
  const size_t kv_dim = static_cast<size_t>(hp_.n_head_kv) * hp_.head_dim;
  const float* k = s.k->data() + static_cast<size_t>(rows.row0) * kv_dim;
  const float* v = s.v->data() + static_cast<size_t>(rows.row0) * kv_dim;
  if (place.ring == KvRing::kFull) return backend_.store_kv(view, place.index, rows.first_slot, n, k, v);
  // The window ring overwrites its oldest slots; a run that reaches its end goes on at slot 0.
  const int to_end = std::min(n, view.capacity - rows.window_slot);
  backend_.store_kv(view, place.index, rows.window_slot, to_end, k, v);
  if (to_end < n) backend_.store_kv(view, place.index, 0, n - to_end, k + to_end * kv_dim, v + to_end * kv_dim);
}

// The pass's sequences as the backend sees them: a view of each cache (and of the prefix it
// reads first) and its attention call, filled once per pass for every layer.
void LlamaModel::describe_sequences(std::span<const Rows> rows) {
  Scratch& s = *scratch_;
  // Sized first: views point into prefix_views, calls into kv_views.
  s.kv_views.resize(2 * rows.size());
  s.prefix_views.resize(2 * rows.size());
  s.attention_calls.resize(rows.size());
  const size_t q_dim = static_cast<size_t>(hp_.n_head) * hp_.head_dim;
  for (size_t i = 0; i < rows.size(); ++i) {
    KvCache& cache = *rows[i].cache;
    for (const KvRing ring : {KvRing::kFull, KvRing::kWindow}) {
      const size_t at = kv_view_index(i, ring);
      s.kv_views[at] = cache.view(ring);
      if (cache.prefix() != nullptr) {
        s.prefix_views[at] = cache.prefix_view(ring);
        s.kv_views[at].prefix = &s.prefix_views[at];
      }
      s.kv_views[at].key_scales = ring_key_scales(ring);
      s.prefix_views[at].key_scales = ring_key_scales(ring);
    }
    if (async_softmax_) {
      std::vector<float>& phi = cache.softmax_phi();
      const size_t n = static_cast<size_t>(hp_.n_layer) * static_cast<size_t>(hp_.n_head);
      if (phi.size() != n) phi.assign(n, NAN);
    }
    cache.softmax_phi_rows().clear();
    if (rows[i].steps && async_softmax_) {
      cache.softmax_phi_rows().assign(rows[i].tokens.size(), cache.softmax_phi());
    }
    const size_t q_at = static_cast<size_t>(rows[i].row0) * q_dim;
    s.attention_calls[i] = AttentionCall{s.q->data() + q_at, static_cast<int>(rows[i].tokens.size()), rows[i].pos0,
                                         s.attn->data() + q_at, nullptr, nullptr};
  }
}

void LlamaModel::attention(int layer, std::span<const Rows> rows) {
  Scratch& s = *scratch_;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<float>& phi = rows[i].cache->softmax_phi();
    s.attention_calls[i].softmax_phi = async_softmax_ ? &phi[static_cast<size_t>(layer) * hp_.n_head] : nullptr;
    s.attention_calls[i].kv = &s.kv_views[kv_view_index(i, rows[i].cache->place(layer).ring)];
  }
  // The backend sees the layer by its index among its ring's layers: the layer of its view.
  // Every sequence of a pass has the same rings (one model, one context size per pass).
  const int index = rows[0].cache->place(layer).index;
  const int window = layers_[static_cast<size_t>(layer)].window;
  const AttentionShape shape{hp_.n_head, hp_.n_head_kv, hp_.head_dim, window, hp_.attn_scale,
                             layers_[static_cast<size_t>(layer)].attn_sinks};
  const bool any_steps = std::any_of(rows.begin(), rows.end(), [](const Rows& r) { return r.steps; });
  if (!any_steps) return backend_.attention(index, shape, s.attention_calls);
  if (backend_.attends_stepwise()) return attention_stepwise(layer, index, shape, rows);
  attention_by_rows(layer, index, shape, rows);
}

// attention() of a pass with checking rows, on a backend that does not run them itself: the other
// sequences in one call, as always; then each query row of a checking pass as the decode step of
// its token would run it, the j-th rows of all of them together, one j after the other (a row's
// softmax maxima are the next row's start).
void LlamaModel::attention_by_rows(int layer, int index, const AttentionShape& shape, std::span<const Rows> rows) {
  Scratch& s = *scratch_;
  std::vector<AttentionCall>& step = s.attention_steps;
  step.clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].steps) step.push_back(s.attention_calls[i]);
  }
  if (!step.empty()) backend_.attention(index, shape, step);
  const size_t q_dim = static_cast<size_t>(hp_.n_head) * hp_.head_dim;
  int longest = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].steps) longest = std::max(longest, s.attention_calls[i].n_tokens);
  }
  for (int j = 0; j < longest; ++j) {
    step.clear();
    for (size_t i = 0; i < rows.size(); ++i) {
      const AttentionCall& c = s.attention_calls[i];
      if (!rows[i].steps || j >= c.n_tokens) continue;
      AttentionCall one = c;
      one.q += static_cast<size_t>(j) * q_dim;
      one.out += static_cast<size_t>(j) * q_dim;
      one.pos0 += j;
      one.n_tokens = 1;
      step.push_back(one);
    }
    backend_.attention(index, shape, step);
    if (!async_softmax_) continue;
    // The maxima row j left in this layer, for a rollback to the row it keeps.
    const size_t at = static_cast<size_t>(layer) * static_cast<size_t>(hp_.n_head);
    for (const Rows& r : rows) {
      if (!r.steps || j >= static_cast<int>(r.tokens.size())) continue;
      const std::vector<float>& phi = r.cache->softmax_phi();
      std::copy_n(phi.begin() + static_cast<std::ptrdiff_t>(at), hp_.n_head,
                  r.cache->softmax_phi_rows()[static_cast<size_t>(j)].begin() + static_cast<std::ptrdiff_t>(at));
    }
  }
}

// attention() of a pass with checking rows, on a backend that runs them itself: every call in one,
// each checking row's maxima written where a rollback finds them.
void LlamaModel::attention_stepwise(int layer, int index, const AttentionShape& shape, std::span<const Rows> rows) {
  Scratch& s = *scratch_;
  std::vector<float*>& row_phi = s.step_phi;
  row_phi.clear();
  const size_t at = static_cast<size_t>(layer) * static_cast<size_t>(hp_.n_head);
  for (const Rows& r : rows) {
    if (!r.steps || !async_softmax_) continue;
    for (std::vector<float>& phi : r.cache->softmax_phi_rows()) row_phi.push_back(phi.data() + at);
  }
  size_t next = 0;  // (filled before any pointer into row_phi is taken: it does not move)
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].steps) continue;
    s.attention_calls[i].steps = true;
    if (async_softmax_) {
      s.attention_calls[i].step_phi = row_phi.data() + next;
      next += rows[i].tokens.size();
    }
  }
  backend_.attention(index, shape, s.attention_calls);
}

}  // namespace ringlm
