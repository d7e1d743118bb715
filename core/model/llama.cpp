// The forward pass: a pass's rows through the layers (run_layers, one screen for every backend
// and every pipeline rank), and one output path for a single sequence and a batch, alone or as
// one stage of a pipeline. Beside it: loading (llama_load.cpp, the layer schema in
// layer_weights.cpp), attention over the caches (llama_attention.cpp), the RoPE tables
// (rope_tables.cpp) and the protocol between pipeline stages (pipeline.cpp).
#include "core/model/llama.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "core/model/key_scales.h"

namespace ringlm {

LlamaModel::~LlamaModel() = default;

// Activations for a chunk of up to max_batch tokens.
void LlamaModel::allocate_scratch() {
  scratch_ = std::make_unique<Scratch>();
  Scratch& s = *scratch_;
  const auto M = static_cast<size_t>(max_batch_);
  const size_t d = static_cast<size_t>(hp_.n_embd), q_dim = static_cast<size_t>(hp_.n_head) * hp_.head_dim,
               kv_dim = static_cast<size_t>(hp_.n_head_kv) * hp_.head_dim;
  s.x = backend_.alloc_activations(M * d);
  s.xn = backend_.alloc_activations(M * d);
  s.q = backend_.alloc_activations(M * q_dim);
  s.k = backend_.alloc_activations(M * kv_dim);
  s.v = backend_.alloc_activations(M * kv_dim);
  s.attn = backend_.alloc_activations(M * q_dim);
  s.gate = backend_.alloc_activations(M * static_cast<size_t>(hp_.moe() ? 1 : hp_.n_ff));
  if (hp_.moe()) {
    const size_t routes = M * static_cast<size_t>(hp_.n_expert_used);
    s.router_logits = backend_.alloc_activations(M * static_cast<size_t>(hp_.n_expert));
    if (backend_.offloads()) {
      s.expert_rows = backend_.alloc_activations(routes * d);
      s.expert_hidden = backend_.alloc_activations(routes * static_cast<size_t>(hp_.n_ff_exp));
      s.expert_products = backend_.alloc_activations(routes * d);
      if (hp_.expert_biases) s.expert_up = backend_.alloc_activations(routes * static_cast<size_t>(hp_.n_ff_exp));
    }
    s.route_experts.resize(routes);
    s.route_weights.resize(routes);
  }
  const size_t half = static_cast<size_t>(rope_->half());
  for (size_t set = 0; set < rope_->n_sets(); ++set) {
    s.rope_cos.push_back(backend_.alloc_activations(M * half));
    s.rope_sin.push_back(backend_.alloc_activations(M * half));
  }
  s.host_cos.assign(rope_->n_sets(), std::vector<float>(M * half));
  s.host_sin = s.host_cos;
}

// --- Passes ----------------------------------------------------------------------------------

void LlamaModel::forward(std::span<const int32_t> tokens, KvCache& cache, float* logits, bool all_logits) {
  SequenceTokens sequence(tokens, &cache, logits);
  sequence.all_logits = all_logits;
  forward(sequence);
}

void LlamaModel::forward_top(std::span<const int32_t> tokens, KvCache& cache, std::span<TopLogit> top) {
  if (top.empty() || top.size() > static_cast<size_t>(hp_.n_vocab)) {
    throw std::invalid_argument("forward_top: " + std::to_string(top.size()) + " top tokens of a vocabulary of " +
                                std::to_string(hp_.n_vocab));
  }
  forward(SequenceTokens(tokens, &cache, nullptr, top));
}

void LlamaModel::forward_steps(std::span<const int32_t> tokens, KvCache& cache, float* logits) {
  forward(SequenceTokens(tokens, &cache, logits, {}, true));
}

void LlamaModel::forward(const SequenceTokens& sequence) {
  KvCache& cache = *sequence.cache;
  const std::span<const int32_t> tokens = sequence.tokens;
  for (int32_t t : tokens) {
    if (t < 0 || t >= hp_.n_vocab) {
      throw std::out_of_range("token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                              std::to_string(hp_.n_vocab - 1) + ")");
    }
  }
  if (!cache.can_shift() && cache.size() + static_cast<int64_t>(tokens.size()) > cache.capacity()) {
    throw std::length_error("context full: " + std::to_string(cache.size()) + " cached + " +
                            std::to_string(tokens.size()) + " new tokens exceed the context size " +
                            std::to_string(cache.capacity()));
  }
  check_pooling(sequence);
  if (!pending_batches_.empty()) throw std::logic_error("forward: batched passes are still in flight (finish_batch)");
  if (!stage_.alone() && stage_.first()) pipeline_->announce_tokens(sequence);
  // Chunks of at most max_batch tokens, each in contiguous slots of the ring (a chunk stops
  // where the ring wraps), shifting the context whenever the cache is full. (The other stages of
  // a pipeline run this same loop over their copy of the cache: the same chunks, the same shifts.)
  const bool every_row = sequence.steps || sequence.all_logits;
  size_t start = 0;
  while (start < tokens.size()) {
    if (cache.contiguous_free() == 0) shift_context(cache);
    const size_t n = std::min({tokens.size() - start, static_cast<size_t>(max_batch_),
                               static_cast<size_t>(cache.contiguous_free())});
    // Every chunk's logits when all are wanted; else only the last chunk's output.
    SequenceTokens chunk(tokens.subspan(start, n), &cache);
    chunk.steps = sequence.steps;
    chunk.all_logits = sequence.all_logits;
    chunk.pooling = sequence.pooling;  // every chunk's rows are pooled, folded into one vector
    chunk.embedding = sequence.embedding;
    chunk.pooled_before = sequence.pooled_before + static_cast<int64_t>(start);
    if (every_row && sequence.logits != nullptr) {
      chunk.logits = sequence.logits + start * static_cast<size_t>(hp_.n_vocab);
    } else if (start + n == tokens.size()) {
      chunk.logits = sequence.logits;
      chunk.top = sequence.top;
    }
    finish_pass(run_pass(std::span(&chunk, 1)));
    start += n;
  }
}

void LlamaModel::forward_batch(std::span<const SequenceTokens> batch) {
  if (!begin_batch(batch)) return;
  if (stage_.first()) finish_batch();
}

bool LlamaModel::begin_batch(std::span<const SequenceTokens> batch) {
  check_batch(batch);  // everything is checked before any cache changes
  size_t total = 0;
  for (const SequenceTokens& b : batch) total += b.tokens.size();
  if (total == 0) return false;
  if (!stage_.alone() && stage_.first()) pipeline_->announce_batch(batch);
  PendingBatch pass = run_pass(batch);
  if (stage_.first()) {
    pending_batches_.push_back(std::move(pass));
  } else {
    finish_pass(std::move(pass));
  }
  return true;
}

void LlamaModel::check_batch(std::span<const SequenceTokens> batch) const {
  size_t total = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceTokens& b = batch[i];
    if (b.cache == nullptr || b.tokens.empty()) throw std::invalid_argument("forward_batch: sequence without cache or tokens");
    for (size_t j = 0; j < i; ++j) {
      if (batch[j].cache == b.cache) throw std::invalid_argument("forward_batch: a cache appears twice in one batch");
    }
    if (b.cache->has_window_ring() != batch[0].cache->has_window_ring()) {
      throw std::invalid_argument("forward_batch: caches with and without a window ring in one batch");
    }
    if (static_cast<int>(b.tokens.size()) > b.cache->contiguous_free()) {
      throw std::invalid_argument("forward_batch: " + std::to_string(b.tokens.size()) + " tokens do not fit the " +
                                  std::to_string(b.cache->contiguous_free()) + " free slots of their cache");
    }
    for (int32_t t : b.tokens) {
      if (t < 0 || t >= hp_.n_vocab) throw std::out_of_range("token id " + std::to_string(t) + " is outside the vocabulary");
    }
    if (b.top.size() > static_cast<size_t>(hp_.n_vocab)) {
      throw std::invalid_argument("forward_batch: " + std::to_string(b.top.size()) + " top tokens of a vocabulary of " +
                                  std::to_string(hp_.n_vocab));
    }
    // (A middle stage of a pipeline runs a checking pass that hands back nothing.)
    if (b.steps && (b.wants_top() || (stage_.first() && b.logits == nullptr))) {
      throw std::invalid_argument("forward_batch: a checking pass (steps) hands back every row's logits");
    }
    if (b.steps && b.cache->type().keys == KvType::kKivi2) {
      throw std::invalid_argument(kKiviRefusesDrafts);
    }
    check_pooling(b);
    total += b.tokens.size();
  }
  if (total > static_cast<size_t>(max_batch_)) {
    throw std::invalid_argument("forward_batch: " + std::to_string(total) + " tokens exceed the batch of " +
                                std::to_string(max_batch_));
  }
}

LlamaModel::PendingBatch LlamaModel::run_pass(std::span<const SequenceTokens> batch) {
  std::vector<Rows>& rows = batch_rows_;
  rows.clear();
  int row = 0;
  for (const SequenceTokens& b : batch) {
    rows.push_back(append_rows(b.tokens, *b.cache, row));
    rows.back().steps = b.steps;
    row += static_cast<int>(b.tokens.size());
  }
  run_layers(rows, row);
  PendingBatch pass = plan_output(batch, rows);
  if (stage_.last() && pass.hands_back()) {
    // Pooling first: the projection's gather reuses the scratch rows that pooling reads.
    if (!pass.pool_into.empty()) pool_hidden_states(pass);
    if (pass.wanted() > 0) project_output(pass);
    if (!stage_.first()) pipeline_->send_results(pass.picks_to, pass.logits_to, pass.pooled);
  } else if (stage_.first() && pass.hands_back()) {
    pipeline_->start_receiving_results(pass.picks_to, pass.logits_to, pass.pooled);
  }
  return pass;
}

LlamaModel::Rows LlamaModel::append_rows(std::span<const int32_t> tokens, KvCache& cache, int row0) {
  const int64_t pos0 = cache.next_position();
  const int window_slot = cache.window_slot();
  const int first_slot = cache.append(static_cast<int>(tokens.size()));
  return Rows{tokens, &cache, row0, pos0, first_slot, window_slot};
}

void LlamaModel::shift_context(KvCache& cache) const {
  const int n_discard = cache.shift_size();
  const KvDiscard moved = cache.discard(n_discard);
  // The rotation by -n_discard positions of the layers of each set of frequencies, in each ring.
  std::vector<float> cos(static_cast<size_t>(rope_->half())), sin(cos.size());
  for (size_t set = 0; set < rope_->n_sets(); ++set) {
    rope_->shift_angles(set, n_discard, cache.capacity(), cos.data(), sin.data());
    for (const KvRing ring : {KvRing::kFull, KvRing::kWindow}) {
      std::vector<int> layers;  // indices among the ring's layers
      for (int il = 0; il < hp_.n_layer; ++il) {
        const KvCache::LayerPlace place = cache.place(il);
        if (place.ring == ring && layers_[static_cast<size_t>(il)].rope_set == static_cast<int>(set)) {
          layers.push_back(place.index);
        }
      }
      const std::vector<int>& slots = ring == KvRing::kFull ? moved.full : moved.window;
      if (layers.empty() || slots.empty()) continue;
      KvView view = cache.view(ring);
      view.key_scales = ring_key_scales(ring);
      backend_.shift_keys(view, layers, slots, rope_->layout(cos.data(), sin.data()), hp_.n_head_kv, hp_.head_dim);
    }
  }
}

// --- The layers ------------------------------------------------------------------------------

// One screen for every backend and every pipeline rank: the first stage embeds, the others
// receive the hidden states; every layer of this stage runs; all but the last stage send them on.
void LlamaModel::run_layers(std::span<const Rows> rows, int n) {
  Scratch& s = *scratch_;
  const int d = hp_.n_embd;
  const int kv_dim = hp_.n_head_kv * hp_.head_dim;
  float* const x = s.x->data();    // the hidden state, [n][d]
  float* const q = s.q->data();
  float* const k = s.k->data();
  float* const v = s.v->data();
  float* const attn = s.attn->data();
  const size_t hidden = static_cast<size_t>(n) * static_cast<size_t>(d);
  backend_.begin_layer(-1);
  for (const Rows& r : rows) {
    if (stage_.first()) embed(r.tokens, x + static_cast<size_t>(r.row0) * d);
    rope_angles(r.row0, r.pos0, static_cast<int>(r.tokens.size()), r.cache->capacity());
  }
  if (!stage_.first()) {
    pipeline_->receive_hidden(x, hidden);
  } else if (hp_.embed_scale) {
    backend_.scale(x, static_cast<int64_t>(n) * d, std::sqrt(static_cast<float>(d)));
  }
  const bool calibrating = calibrates_key_scales(rows);
  if (calibrating) key_scales_set_ = true;  // (with fewer than kKeyScaleMinRows rows: left at 1)
  describe_sequences(rows);
  for (int il = stage_.first_layer; il < stage_.end_layer; ++il) {
    backend_.begin_layer(il);
    const LayerWeights& L = layers_[static_cast<size_t>(il)];
    const RopeAngles angles = rope_->layout(s.rope_cos[L.rope_set]->data(), s.rope_sin[L.rope_set]->data());
    // Attention block: one QKV projection of the normalised input (the norm is fused into the
    // backend's input preparation), RoPE on q and k, k and v into each sequence's cache.
    const PreparedWeight* qkv[] = {L.wq.get(), L.wk.get(), L.wv.get()};
    float* const qkv_out[] = {q, k, v};
    backend_.matmul_many(qkv, MatmulInput{x, n, L.attn_norm, hp_.rms_eps}, qkv_out);
    if (L.q_bias != nullptr) backend_.add_row(q, L.q_bias, n, hp_.n_head * hp_.head_dim);
    if (L.k_bias != nullptr) backend_.add_row(k, L.k_bias, n, kv_dim);
    if (L.v_bias != nullptr) backend_.add_row(v, L.v_bias, n, kv_dim);
    if (hp_.qk_norm) {  // every head of every row is one row of head_dim here
      backend_.rms_norm(q, static_cast<int64_t>(n) * hp_.n_head, hp_.head_dim, L.q_norm, hp_.rms_eps);
      backend_.rms_norm(k, static_cast<int64_t>(n) * hp_.n_head_kv, hp_.head_dim, L.k_norm, hp_.rms_eps);
    }
    if (calibrating && n >= kKeyScaleMinRows) calibrate_key_scales(il, *rows[0].cache, n);  // (before RoPE)
    backend_.rope(q, n, hp_.n_head, hp_.head_dim, angles);
    backend_.rope(k, n, hp_.n_head_kv, hp_.head_dim, angles);
    for (size_t i = 0; i < rows.size(); ++i) store_kv(il, i, rows[i]);
    attention(il, rows);
    residual(*L.wo, attn, n, L.o_bias, L.post_attn_norm);

    feed_forward(L, n);
  }
  if (!stage_.last()) pipeline_->send_hidden(x, hidden);
}

const float* LlamaModel::ring_key_scales(KvRing ring) const {
  return backend_.keeps_key_scales() ? key_scales_[ring_slot(ring)].data() : nullptr;
}

bool LlamaModel::calibrates_key_scales(std::span<const Rows> rows) const {
  if (key_scales_set_ || !backend_.keeps_key_scales()) return false;
  return std::any_of(rows.begin(), rows.end(),
                     [&](const Rows& r) {
                       const KvCache& c = *r.cache;
                       return kv_turns_heads(c.type().keys, hp_.head_dim) ||
                              (c.has_window_ring() && kv_turns_heads(c.ring_type(KvRing::kWindow).keys, hp_.head_dim));
                     });
}

void LlamaModel::calibrate_key_scales(int layer, const KvCache& cache, int n) {
  const Scratch& s = *scratch_;
  const size_t kv_dim = static_cast<size_t>(hp_.n_head_kv) * hp_.head_dim;
  const size_t q_values = static_cast<size_t>(n) * hp_.n_head * hp_.head_dim, k_values = n * kv_dim;
  std::vector<float> q(q_values), k(k_values);
  backend_.read(s.q->data(), q.data(), q_values);
  backend_.read(s.k->data(), k.data(), k_values);
  const KeyScaleShape shape{hp_.n_head, hp_.n_head_kv, hp_.head_dim};
  KeyScaleRope rope;
  rope.inv_freq = rope_->inv_freq(layers_[static_cast<size_t>(layer)].rope_set, cache.capacity());
  rope.n_rot = hp_.n_rot;
  rope.adjacent_pairs = hp_.rope_style == RopeStyle::kAdjacentPairs;
  rope.n_positions = cache.capacity();
  const std::vector<float> scales = ringlm::calibrate_key_scales(q, k, n, shape, rope);
  const KvCache::LayerPlace place = cache.place(layer);
  std::copy(scales.begin(), scales.end(),
            key_scales_[ring_slot(place.ring)].begin() + static_cast<std::ptrdiff_t>(place.index * kv_dim));
}

void LlamaModel::feed_forward(const LayerWeights& L, int n) {
  if (hp_.moe()) return mixture_of_experts(L, n);
  // down(act(gate(x)) * up(x)), gate and up in one fused pass.
  float* const gate = scratch_->gate->data();
  backend_.matmul_glu(*L.gate, *L.up, MatmulInput{scratch_->x->data(), n, L.ffn_norm, hp_.rms_eps}, hp_.activation, gate);
  residual(*L.down, gate, n, nullptr, L.post_ffn_norm);
}

// The backend routes each row (the router's product, its top k and their weights, to the host),
// then runs every chosen expert over its rows.
void LlamaModel::mixture_of_experts(const LayerWeights& L, int n) {
  Scratch& s = *scratch_;
  const MatmulInput input{s.x->data(), n, L.ffn_norm, hp_.rms_eps};
  const size_t n_routes = static_cast<size_t>(n) * static_cast<size_t>(hp_.n_expert_used);
  const std::span<int32_t> experts(s.route_experts.data(), n_routes);
  const std::span<float> weights(s.route_weights.data(), n_routes);
  backend_.route(*L.router, L.router_bias, input, s.router_logits->data(), hp_.n_expert_used, experts, weights);
  ExpertBlock block{L.gate_experts, L.up_experts, L.down_experts};
  block.gate_bias = L.gate_exps_bias;
  block.up_bias = L.up_exps_bias;
  block.down_bias = L.down_exps_bias;
  if (s.expert_rows != nullptr) {
    block.scratch_rows = s.expert_rows->data();
    block.scratch_hidden = s.expert_hidden->data();
    block.scratch_products = s.expert_products->data();
    if (s.expert_up != nullptr) block.scratch_up = s.expert_up->data();
    block.scratch_routes = static_cast<int64_t>(max_batch_) * hp_.n_expert_used;
  }
  float* const sum = s.xn->data();
  backend_.moe_ffn(block, ExpertRoutes{hp_.n_expert_used, experts, weights}, input, hp_.activation, sum);
  if (L.post_ffn_norm != nullptr) backend_.rms_norm(sum, n, hp_.n_embd, L.post_ffn_norm, hp_.rms_eps);
  backend_.add(s.x->data(), sum, static_cast<int64_t>(n) * hp_.n_embd);
}

void LlamaModel::embed(std::span<const int32_t> tokens, float* out) {
  // Tied: the table is the output projection's weight, which the backend holds (and the file's
  // pages of it may have been given back).
  if (tied_output_) return backend_.rows(*output_, tokens, out);
  const size_t stride = row_bytes(token_embd_->type, hp_.n_embd);
  std::vector<float>& rows = scratch_->host_rows;
  rows.resize(tokens.size() * static_cast<size_t>(hp_.n_embd));
  for (size_t i = 0; i < tokens.size(); ++i) {
    dequantize_row(token_embd_->type, token_embd_->data + static_cast<size_t>(tokens[i]) * stride,
                   rows.data() + i * static_cast<size_t>(hp_.n_embd), hp_.n_embd);
  }
  backend_.write(out, rows.data(), rows.size());
}

// The angles of every rope set for the tokens at positions pos0.. (rows row0..), computed once
// per pass for all layers.
void LlamaModel::rope_angles(int row0, int64_t pos0, int n_tokens, int n_ctx) {
  Scratch& s = *scratch_;
  const size_t half = static_cast<size_t>(rope_->half());
  const size_t first = static_cast<size_t>(row0) * half, n = static_cast<size_t>(n_tokens) * half;
  for (size_t set = 0; set < rope_->n_sets(); ++set) {
    rope_->angles(set, pos0, n_tokens, n_ctx, s.host_cos[set].data() + first, s.host_sin[set].data() + first);
    backend_.write(s.rope_cos[set]->data() + first, s.host_cos[set].data() + first, n);
    backend_.write(s.rope_sin[set]->data() + first, s.host_sin[set].data() + first, n);
  }
}

// x += input · weightᵀ + bias, the block's output added to the hidden state; with a post-norm
// (Gemma), the output is RMS-normalised before it is added.
void LlamaModel::residual(const PreparedWeight& weight, const float* input, int n, const float* bias,
                          const float* post_norm) {
  float* const x = scratch_->x->data();
  if (post_norm == nullptr) {
    backend_.matmul_add(weight, input, n, x);
    if (bias != nullptr) backend_.add_row(x, bias, n, hp_.n_embd);
    return;
  }
  float* const out = scratch_->xn->data();
  backend_.matmul(weight, input, n, out);
  if (bias != nullptr) backend_.add_row(out, bias, n, hp_.n_embd);
  backend_.rms_norm(out, n, hp_.n_embd, post_norm, hp_.rms_eps);
  backend_.add(x, out, static_cast<int64_t>(n) * hp_.n_embd);
}

// --- The output path: one for a single sequence and a batch, alone or in a pipeline ----------

// The last row of each sequence that wants its next token's scores (every row of a checking pass
// or of an all-logits pass), top first, and where the results go.
LlamaModel::PendingBatch LlamaModel::plan_output(std::span<const SequenceTokens> batch, std::span<const Rows> rows) {
  PendingBatch pass = take_spare_batch();
  const size_t vocab = static_cast<size_t>(hp_.n_vocab);
  for (const bool top : {true, false}) {
    for (size_t i = 0; i < batch.size(); ++i) {
      const size_t n_rows = batch[i].rows_wanted();
      if (n_rows == 0 || batch[i].wants_top() != top) continue;
      const int first = rows[i].row0 + static_cast<int>(batch[i].tokens.size() - n_rows);
      for (size_t r = 0; r < n_rows; ++r) pass.rows.push_back(first + static_cast<int>(r));
      if (top) {
        ++pass.n_top;
        pass.k_max = std::max(pass.k_max, static_cast<int>(batch[i].top.size()));
        pass.top_out.push_back(batch[i].top);
      } else {
        for (size_t r = 0; r < n_rows; ++r) pass.logits_out.push_back(batch[i].logits + r * vocab);
        pass.n_logit_rows += static_cast<int>(n_rows);
      }
    }
  }
  // One sequence's results land in its own buffers; several sequences' are copied out of the pass's.
  if (pass.top_out.size() == 1) {
    pass.picks_to = pass.top_out[0];
    pass.top_out.clear();
  } else {
    pass.picks.resize(static_cast<size_t>(pass.n_top) * static_cast<size_t>(pass.k_max));
    pass.picks_to = pass.picks;
  }
  const size_t n_floats = static_cast<size_t>(pass.n_logit_rows) * vocab;
  bool one_run = !pass.logits_out.empty();  // (one sequence's rows, or buffers that happen to be adjacent)
  for (size_t r = 1; r < pass.logits_out.size(); ++r) one_run = one_run && pass.logits_out[r] == pass.logits_out[0] + r * vocab;
  if (one_run) {
    pass.logits_to = std::span(pass.logits_out[0], n_floats);
    pass.logits_out.clear();
  } else {
    if (pass.logits.size() < n_floats) pass.logits.resize(n_floats);
    pass.logits_to = std::span(pass.logits.data(), n_floats);
  }
  // Pooled sequences: mean reads every row of the pass, cls and last one (cls's matters only in
  // the first chunk, where it is the input's first token).
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!batch[i].wants_pooling()) continue;
    const auto n_rows = static_cast<int>(batch[i].tokens.size());
    const Pooling pooling = batch[i].pooling;
    const int first = pooling == Pooling::kLast ? rows[i].row0 + n_rows - 1 : rows[i].row0;
    pass.pooled_rows.push_back({first, pooling == Pooling::kMean ? n_rows : 1});
    pass.pool_into.push_back({batch[i].embedding, pooling, batch[i].pooled_before, n_rows});
  }
  pass.pooled.resize(pass.pool_into.size() * static_cast<size_t>(hp_.n_embd));
  return pass;
}

// The final norm and the vocabulary projection of the wanted rows (gathered first unless they
// are already one run), then the top k or the logits to where they go.
void LlamaModel::project_output(PendingBatch& pass) {
  Scratch& s = *scratch_;
  const size_t d = static_cast<size_t>(hp_.n_embd);
  const float* x = s.x->data() + static_cast<size_t>(pass.rows[0]) * d;
  bool one_run = true;
  for (size_t i = 1; i < pass.rows.size(); ++i) one_run = one_run && pass.rows[i] == pass.rows[i - 1] + 1;
  if (!one_run) {
    for (size_t i = 0; i < pass.rows.size(); ++i) {
      backend_.copy(s.xn->data() + i * d, s.x->data() + static_cast<size_t>(pass.rows[i]) * d, d);
    }
    x = s.xn->data();
  }
  const float* logits = project_logits(x, pass.wanted());
  if (pass.n_top > 0) backend_.top_k(logits, pass.n_top, hp_.n_vocab, pass.k_max, pass.picks_to);
  if (pass.n_logit_rows > 0) {
    backend_.read(logits + static_cast<size_t>(pass.n_top) * hp_.n_vocab, pass.logits_to.data(), pass.logits_to.size());
  }
}

// The wanted rows gathered into the scratch's xn (the hidden state itself stays as it is: a
// sequence may also want its logits from it), normed as the output norm norms them, read back,
// and summed per sequence on the host (in double: a mean over a long prompt's rows).
void LlamaModel::pool_hidden_states(PendingBatch& pass) {
  backend_.begin_layer(hp_.n_layer);
  Scratch& s = *scratch_;
  const size_t d = static_cast<size_t>(hp_.n_embd);
  size_t n = 0;
  for (const PendingBatch::PooledRows& p : pass.pooled_rows) {
    const size_t count = static_cast<size_t>(p.n_rows);
    backend_.copy(s.xn->data() + n * d, s.x->data() + static_cast<size_t>(p.first_row) * d, count * d);
    n += count;
  }
  backend_.rms_norm(s.xn->data(), static_cast<int64_t>(n), hp_.n_embd, output_norm_, hp_.rms_eps);
  s.host_normed.resize(n * d);
  backend_.read(s.xn->data(), s.host_normed.data(), n * d);
  const float* row = s.host_normed.data();
  std::vector<double> sum(d);
  for (size_t i = 0; i < pass.pooled_rows.size(); ++i) {
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int r = 0; r < pass.pooled_rows[i].n_rows; ++r, row += d) {
      for (size_t j = 0; j < d; ++j) sum[j] += row[j];
    }
    std::copy(sum.begin(), sum.end(), pass.pooled.begin() + static_cast<std::ptrdiff_t>(i * d));
  }
}

// A pass's part (the sum of its rows for mean, else its one row) into the sequence's embedding.
void LlamaModel::fold_pooled(const PendingBatch::PoolInto& into, const float* part, size_t n_embd) {
  float* const out = into.embedding;
  switch (into.pooling) {
    case Pooling::kMean: {
      const double before = static_cast<double>(into.pooled_before), total = before + into.n_rows;
      for (size_t j = 0; j < n_embd; ++j) {
        const double earlier = into.pooled_before > 0 ? static_cast<double>(out[j]) * before : 0.0;
        out[j] = static_cast<float>((earlier + part[j]) / total);
      }
      return;
    }
    case Pooling::kCls:
      if (into.pooled_before == 0) std::copy_n(part, n_embd, out);
      return;
    case Pooling::kLast:
      std::copy_n(part, n_embd, out);
      return;
    case Pooling::kNone:
    case Pooling::kRank:
      return;  // refused before the pass (check_pooling)
  }
}

void LlamaModel::check_pooling(const SequenceTokens& sequence) const {
  if (!sequence.wants_pooling()) return;
  if (!pooling_runs(sequence.pooling)) {
    throw std::invalid_argument(std::string("pooling '") + pooling_name(sequence.pooling) +
                                "' cannot make an embedding here (mean, cls or last can; rank needs a reranker's "
                                "classification head, which ringlm does not run)");
  }
  // (A later stage of a pipeline pools for the first stage, which holds the buffer.)
  if (stage_.first() && sequence.embedding == nullptr) {
    throw std::invalid_argument("a pooled pass needs a buffer of n_embd floats for its embedding");
  }
  if (sequence.pooled_before < 0) throw std::invalid_argument("pooled_before must not be negative");
}

const float* LlamaModel::project_logits(const float* x, int n) {
  backend_.begin_layer(hp_.n_layer);
  Scratch& s = *scratch_;
  const size_t wanted = static_cast<size_t>(n) * static_cast<size_t>(hp_.n_vocab);
  if (s.logits == nullptr || s.logits->size() < wanted) s.logits = backend_.alloc_activations(wanted);
  const PreparedWeight* output[] = {output_.get()};
  float* const output_logits[] = {s.logits->data()};
  backend_.matmul_many(output, MatmulInput{x, n, output_norm_, hp_.rms_eps}, output_logits);
  return s.logits->data();
}

void LlamaModel::finish_batch() {
  if (pending_batches_.empty()) throw std::logic_error("finish_batch: no pass begun on the first stage");
  PendingBatch pass = std::move(pending_batches_.front());
  pending_batches_.pop_front();
  finish_pass(std::move(pass));
}

// Waits for a pass's results (on the first stage of a pipeline) and hands them out; its buffers
// are kept for the next pass. (A later stage hands nothing out: the last one sent the results.)
void LlamaModel::finish_pass(PendingBatch pass) {
  if (!stage_.first()) return spare_batches_.push_back(std::move(pass));
  if (!stage_.last() && pass.hands_back()) pipeline_->finish_receiving_results();
  const size_t d = static_cast<size_t>(hp_.n_embd);
  for (size_t i = 0; i < pass.pool_into.size(); ++i) fold_pooled(pass.pool_into[i], pass.pooled.data() + i * d, d);
  for (size_t i = 0; i < pass.top_out.size(); ++i) {
    const std::span<TopLogit> out = pass.top_out[i];
    std::copy_n(pass.picks.begin() + static_cast<std::ptrdiff_t>(i * static_cast<size_t>(pass.k_max)), out.size(), out.begin());
  }
  // Out to each sequence's buffer: 3 MiB at 16 sequences, split over the threads.
  const size_t vocab = static_cast<size_t>(hp_.n_vocab);
  const auto n_logits = static_cast<int64_t>(pass.logits_out.size());
#pragma omp parallel for schedule(static) if (n_logits > 1)
  for (int64_t k = 0; k < n_logits; ++k) {
    std::copy_n(&pass.logits[static_cast<size_t>(k) * vocab], vocab, pass.logits_out[static_cast<size_t>(k)]);
  }
  spare_batches_.push_back(std::move(pass));
}

// A pass record with its buffers from an earlier pass (their capacity kept), emptied.
LlamaModel::PendingBatch LlamaModel::take_spare_batch() {
  if (spare_batches_.empty()) return {};
  PendingBatch pass = std::move(spare_batches_.back());
  spare_batches_.pop_back();
  pass.k_max = pass.n_top = pass.n_logit_rows = 0;
  pass.rows.clear();
  pass.top_out.clear();
  pass.logits_out.clear();
  pass.pooled_rows.clear();
  pass.pool_into.clear();
  pass.picks_to = {};
  pass.logits_to = {};
  return pass;
}

// --- Pipeline stages -------------------------------------------------------------------------

void LlamaModel::connect_pipeline(PipelineLink& link) {
  pipeline_ = std::make_unique<PipelineHook>(*this, backend_, link, stage_);
}

void LlamaModel::serve_pipeline() {
  if (pipeline_ == nullptr || stage_.first()) {
    throw std::logic_error("serve_pipeline: not a later stage of a connected pipeline");
  }
  pipeline_->serve();
}

void LlamaModel::close_pipeline() {
  if (pipeline_ == nullptr || !stage_.first() || stage_.alone()) return;
  pipeline_->close();
  pipeline_.reset();
}

}  // namespace ringlm
