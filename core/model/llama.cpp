#include "core/model/llama.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_set>

namespace ringlm {

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The tensor `name` with exactly `shape` (GGML order), or a GgufError naming what is wrong.
const GgufTensorInfo& expect_tensor(const GgufFile& gguf, const std::string& name, std::vector<int64_t> shape) {
  const GgufTensorInfo* t = gguf.find_tensor(name);
  if (t == nullptr) gguf.fail("missing tensor '" + name + "'");
  // Trailing dimensions of 1 are equivalent (some writers keep them).
  std::vector<int64_t> got = t->shape;
  while (got.size() > shape.size() && got.back() == 1) got.pop_back();
  if (got != shape) {
    gguf.fail("tensor '" + name + "': shape " + shape_string(t->shape) + ", expected " + shape_string(shape));
  }
  const auto traits = type_traits(static_cast<uint32_t>(t->type));
  if (!traits->readable) {
    gguf.fail("tensor '" + name + "': type " + std::string(traits->name) + " is not supported");
  }
  return *t;
}

std::vector<float> load_vector(const GgufFile& gguf, const std::string& name, int64_t n) {
  const GgufTensorInfo& t = expect_tensor(gguf, name, {n});
  std::vector<float> v(static_cast<size_t>(n));
  dequantize_row(t.type, t.data, v.data(), n);
  return v;
}

// The file's tensors as the decoder reads them. Each one read is marked, so that what is left at
// the end (a bias, a fused matrix, a frequency table that llama.cpp would apply and this decoder
// would not) is refused by name instead of silently ignored.
class ModelTensors {
 public:
  explicit ModelTensors(const GgufFile& gguf) : gguf_(gguf) {}
  bool has(const std::string& name) const { return gguf_.find_tensor(name) != nullptr; }
  const GgufTensorInfo& get(const std::string& name, std::vector<int64_t> shape) {
    used_.insert(name);
    return expect_tensor(gguf_, name, std::move(shape));
  }
  std::vector<float> vector(const std::string& name, int64_t n) {
    used_.insert(name);
    return load_vector(gguf_, name, n);
  }
  // Every tensor whose name starts with `prefix` counts as read: another pipeline stage reads it.
  // Returns them (the model's size counts them all the same).
  std::vector<const GgufTensorInfo*> leave_to_another_stage(const std::string& prefix) {
    std::vector<const GgufTensorInfo*> left;
    for (const GgufTensorInfo& t : gguf_.tensors()) {
      if (!t.name.starts_with(prefix)) continue;
      used_.insert(t.name);
      left.push_back(&t);
    }
    return left;
  }
  void refuse_unused(const std::string& arch) const {
    for (const GgufTensorInfo& t : gguf_.tensors()) {
      if (!used_.contains(t.name)) gguf_.fail("tensor '" + t.name + "' is not part of the '" + arch + "' decoder");
    }
  }

 private:
  const GgufFile& gguf_;
  std::unordered_set<std::string> used_;
};

}  // namespace

// The norm weights and biases live in the backend's activation memory (constants_), where its
// ops read them; nullptr: the layer has none.
struct LlamaModel::Layer {
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_bias = nullptr;  // qkv_bias families
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  const float* q_norm = nullptr;  // qk_norm families: [head_dim]
  const float* k_norm = nullptr;
  const float* post_attn_norm = nullptr;  // post_norms families
  const float* post_ffn_norm = nullptr;
  int window = 0;    // sliding window of its attention (0: none)
  int rope_set = 0;  // its RoPE frequencies: rope_inv_freq_[rope_set]
  std::unique_ptr<PreparedWeight> wq, wk, wv, wo, gate, up, down;
};

// Activations for one chunk of up to max_batch tokens, allocated once in the backend's memory
// (one allocation each: a device backend keeps each one's copies in step separately).
struct LlamaModel::Scratch {
  std::unique_ptr<ActivationBuffer> x, xn, q, k, v, attn, gate;
  // [rope set][tokens][n_rot / 2]: each row's RoPE angles, per set of frequencies; computed on
  // the host (host_cos, host_sin) and written to the backend's (rope_cos, rope_sin) once per pass.
  std::vector<std::unique_ptr<ActivationBuffer>> rope_cos, rope_sin;
  std::vector<std::vector<float>> host_cos, host_sin;
  // The logits of the rows that want them, read back to the caller's buffer; grown on demand.
  std::unique_ptr<ActivationBuffer> logits;
  std::vector<float> host_rows;  // embedding rows dequantized on the host, before write()
  // The pass's sequences as the backend sees them: their caches' rings ([sequence][ring]), the
  // rings of their prefixes, and one attention call each (reused, sized before any pointer into
  // them is taken).
  std::vector<KvView> kv_views, prefix_views;
  std::vector<AttentionCall> attention_calls;
  std::vector<AttentionCall> attention_steps;  // one row of each sequence (stepwise attention)
  std::vector<float*> step_phi;                 // each checking row's maxima of this layer
};

namespace {

// A weight to prepare once every tensor of the file is known to be used, so that a file the
// decoder refuses fails before anything is packed: where it goes, and its rows in the file.
struct PendingWeight {
  std::unique_ptr<PreparedWeight>* slot;
  WeightView view;
};

// Rows [row0, row0 + n) of matrix t as a weight of its own. A row is a whole number of blocks,
// contiguous in the file, so a range of rows of a fused matrix is a view of its bytes: nothing
// is copied, and the backend prepares it as any other weight.
WeightView row_range(const GgufFile& gguf, const GgufTensorInfo& t, int64_t row0, int64_t n, const std::string& label) {
  const int64_t block = type_traits(static_cast<uint32_t>(t.type))->block_elems;
  if (t.cols() % block != 0) gguf.fail("tensor '" + t.name + "': rows are not whole blocks, cannot be split");
  const size_t stride = row_bytes(t.type, t.cols());
  return WeightView{label, t.type, n, t.cols(), t.data + static_cast<size_t>(row0) * stride, true};
}

}  // namespace

LlamaModel::LlamaModel(const GgufFile& gguf, Backend& backend, const PipelineStage& stage)
    : hp_(LlamaHparams::from_gguf(gguf)), backend_(backend), stage_(stage) {
  if (stage_.end_layer < 0) stage_.end_layer = hp_.n_layer;
  if (stage_.first_layer < 0 || stage_.first_layer >= stage_.end_layer || stage_.end_layer > hp_.n_layer) {
    throw std::invalid_argument("pipeline stage " + std::to_string(stage_.index) + ": layers [" +
                                std::to_string(stage_.first_layer) + ", " + std::to_string(stage_.end_layer) +
                                ") of a model of " + std::to_string(hp_.n_layer));
  }
  const ArchInfo& arch = *find_arch(hp_.arch);
  const int64_t d = hp_.n_embd;
  const int64_t q_dim = static_cast<int64_t>(hp_.n_head) * hp_.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(hp_.n_head_kv) * hp_.head_dim;
  ModelTensors tensors(gguf);
  std::vector<PendingWeight> pending;
  // Norm weights and biases, read now and written to the backend's memory once all are known.
  std::vector<std::pair<const float**, std::vector<float>>> constants;
  auto constant = [&](const float*& slot, std::vector<float> values) { constants.emplace_back(&slot, std::move(values)); };

  // A matrix of the file, counted once, prepared as one weight or as row ranges.
  auto matrix = [&](const std::string& name, int64_t cols, int64_t rows) -> const GgufTensorInfo& {
    const GgufTensorInfo& t = tensors.get(name, {cols, rows});
    weight_bytes_ += t.n_bytes;
    n_params_ += t.n_elements();
    return t;
  };
  // The matrices another pipeline stage loads: part of the model's size all the same.
  auto count_elsewhere = [&](const std::vector<const GgufTensorInfo*>& left) {
    for (const GgufTensorInfo* t : left) {
      if (t->shape.size() < 2) continue;  // norms and biases: not counted here either
      weight_bytes_ += t->n_bytes;
      n_params_ += t->n_elements();
    }
  };
  int weight_layer = -1;  // the layer of the weights prepared now (WeightView::layer)
  auto prepare = [&](std::unique_ptr<PreparedWeight>& slot, const std::string& name, int64_t cols, int64_t rows) {
    const GgufTensorInfo& t = matrix(name, cols, rows);
    pending.push_back({&slot, WeightView{name, t.type, rows, cols, t.data, true, weight_layer}});
  };
  auto prepare_rows = [&](std::unique_ptr<PreparedWeight>& slot, const GgufTensorInfo& t, int64_t row0, int64_t n,
                          const std::string& part) {
    pending.push_back({&slot, row_range(gguf, t, row0, n, t.name + " (" + part + ")")});
    pending.back().view.layer = weight_layer;
  };

  token_embd_ = &tensors.get("token_embd.weight", {d, hp_.n_vocab});
  weight_bytes_ += token_embd_->n_bytes;
  n_params_ += token_embd_->n_elements();

  layers_.resize(static_cast<size_t>(hp_.n_layer));
  for (int il = 0; il < hp_.n_layer; ++il) {
    Layer& L = layers_[static_cast<size_t>(il)];
    const std::string b = "blk." + std::to_string(il) + ".";
    weight_layer = il;
    if (hp_.swa_period > 0 && (il + 1) % hp_.swa_period != 0) {
      L.window = hp_.sliding_window;
      L.rope_set = 1;
    }
    // Another stage's layer: its tensors are its to check and load (the file's pages of them
    // are never touched here).
    if (!stage_.runs_layer(il)) {
      count_elsewhere(tensors.leave_to_another_stage(b));
      continue;
    }
    constant(L.attn_norm, tensors.vector(b + "attn_norm.weight", d));
    constant(L.ffn_norm, tensors.vector(b + "ffn_norm.weight", d));
    // q, k and v: three matrices, or one fused matrix of their rows in that order (llama.cpp's
    // build_qkv views), with one fused bias or three.
    const bool fused_qkv = tensors.has(b + "attn_qkv.weight");
    if (fused_qkv) {
      const GgufTensorInfo& qkv = matrix(b + "attn_qkv.weight", d, q_dim + 2 * kv_dim);
      prepare_rows(L.wq, qkv, 0, q_dim, "q");
      prepare_rows(L.wk, qkv, q_dim, kv_dim, "k");
      prepare_rows(L.wv, qkv, q_dim + kv_dim, kv_dim, "v");
    } else {
      prepare(L.wq, b + "attn_q.weight", d, q_dim);
      prepare(L.wk, b + "attn_k.weight", d, kv_dim);
      prepare(L.wv, b + "attn_v.weight", d, kv_dim);
    }
    // Biases: required where the family has them, read wherever a file has them (as llama.cpp).
    if (fused_qkv && tensors.has(b + "attn_qkv.bias")) {
      const std::vector<float> bias = tensors.vector(b + "attn_qkv.bias", q_dim + 2 * kv_dim);
      constant(L.q_bias, {bias.begin(), bias.begin() + q_dim});
      constant(L.k_bias, {bias.begin() + q_dim, bias.begin() + q_dim + kv_dim});
      constant(L.v_bias, {bias.begin() + q_dim + kv_dim, bias.end()});
    } else if (hp_.qkv_bias || tensors.has(b + "attn_q.bias")) {
      constant(L.q_bias, tensors.vector(b + "attn_q.bias", q_dim));
      constant(L.k_bias, tensors.vector(b + "attn_k.bias", kv_dim));
      constant(L.v_bias, tensors.vector(b + "attn_v.bias", kv_dim));
    }
    if (hp_.qk_norm) {
      constant(L.q_norm, tensors.vector(b + "attn_q_norm.weight", hp_.head_dim));
      constant(L.k_norm, tensors.vector(b + "attn_k_norm.weight", hp_.head_dim));
    }
    if (hp_.post_norms) {
      constant(L.post_attn_norm, tensors.vector(b + "post_attention_norm.weight", d));
      constant(L.post_ffn_norm, tensors.vector(b + "post_ffw_norm.weight", d));
    }
    prepare(L.wo, b + "attn_output.weight", q_dim, d);
    if (hp_.fused_gate_up) {
      const GgufTensorInfo& gate_up = matrix(b + "ffn_up.weight", d, 2 * static_cast<int64_t>(hp_.n_ff));
      prepare_rows(L.gate, gate_up, 0, hp_.n_ff, "gate");
      prepare_rows(L.up, gate_up, hp_.n_ff, hp_.n_ff, "up");
    } else {
      prepare(L.gate, b + "ffn_gate.weight", d, hp_.n_ff);
      prepare(L.up, b + "ffn_up.weight", d, hp_.n_ff);
    }
    prepare(L.down, b + "ffn_down.weight", hp_.n_ff, d);
  }
  weight_layer = hp_.n_layer;
  if (!stage_.last()) {  // the output norm and projection are the last stage's
    tensors.leave_to_another_stage("output_norm.weight");
    count_elsewhere(tensors.leave_to_another_stage("output.weight"));
  } else {
    constant(output_norm_, tensors.vector("output_norm.weight", d));
    if (tensors.has("output.weight")) {
      prepare(output_, "output.weight", d, hp_.n_vocab);
    } else {  // tied embeddings: the output projection reuses token_embd
      tied_output_ = true;
      pending.push_back(
          {&output_, WeightView{"token_embd.weight", token_embd_->type, hp_.n_vocab, d, token_embd_->data, true, weight_layer}});
    }
  }

  // RoPE frequencies: set 0 for every layer (scaled; with the file's per-pair factors), set 1
  // for sliding-window layers, with a base of their own and no scaling.
  const int half = hp_.n_rot / 2;
  auto factors = [&](const std::string& name) {
    return tensors.has(name) ? std::optional(tensors.vector(name, half)) : std::nullopt;
  };
  const std::optional<std::vector<float>> rope_freqs = arch.rope_freqs ? factors("rope_freqs.weight") : std::nullopt;
  const std::optional<std::vector<float>> short_factors = arch.long_rope ? factors("rope_factors_short.weight") : std::nullopt;
  const std::optional<std::vector<float>> long_factors = arch.long_rope ? factors("rope_factors_long.weight") : std::nullopt;
  const auto ptr = [](const std::optional<std::vector<float>>& v) { return v ? &*v : nullptr; };
  rope_inv_freq_.push_back(rope_frequencies(hp_, hp_.rope_base, rope_freqs ? ptr(rope_freqs) : ptr(short_factors), true));
  if (short_factors || long_factors) rope_inv_freq_long_ = rope_frequencies(hp_, hp_.rope_base, ptr(long_factors), true);
  if (hp_.swa_period > 0) rope_inv_freq_.push_back(rope_frequencies(hp_, hp_.swa_rope_base, nullptr, false));

  tensors.refuse_unused(hp_.arch);
  // Sliding-window layers keep a ring of their window plus one pass (make_cache), so shorter
  // passes keep it small: with 256, Gemma 3 270M's cache at 8k tokens is 24% of a full one
  // (27% with 512).
  if (hp_.sliding_window > 0) max_batch_ = kWindowedMaxBatch;

  // The activations before the weights: on a device, what is left once they are placed is the
  // weights' (and a --gpu-layers out-of-memory error counts layers that really fit).
  scratch_ = std::make_unique<Scratch>();
  Scratch& s = *scratch_;
  const auto M = static_cast<size_t>(max_batch_);
  s.x = backend_.alloc_activations(M * d);
  s.xn = backend_.alloc_activations(M * d);
  s.q = backend_.alloc_activations(M * q_dim);
  s.k = backend_.alloc_activations(M * kv_dim);
  s.v = backend_.alloc_activations(M * kv_dim);
  s.attn = backend_.alloc_activations(M * q_dim);
  s.gate = backend_.alloc_activations(M * hp_.n_ff);
  for (size_t set = 0; set < rope_inv_freq_.size(); ++set) {
    s.rope_cos.push_back(backend_.alloc_activations(M * half));
    s.rope_sin.push_back(backend_.alloc_activations(M * half));
  }
  s.host_cos.assign(rope_inv_freq_.size(), std::vector<float>(M * static_cast<size_t>(half)));
  s.host_sin = s.host_cos;

  // The output first: a backend that fills its device layer by layer (--gpu-layers) then knows,
  // when a layer does not fit, that the output already does.
  std::stable_partition(pending.begin(), pending.end(), [&](const PendingWeight& w) { return w.slot == &output_; });
  backend_.plan_layers(hp_.n_layer);
  for (PendingWeight& w : pending) *w.slot = backend_.prepare(w.view);
  size_t n_constants = 0;
  for (const auto& c : constants) n_constants += c.second.size();
  constants_ = backend_.alloc_activations(n_constants);
  float* at = constants_->data();
  for (auto& [slot, values] : constants) {
    backend_.write(at, values.data(), values.size());
    *slot = at;
    at += values.size();
  }
}

LlamaModel::~LlamaModel() = default;

KvCache LlamaModel::make_cache(int n_ctx, const KvCacheOptions& options) const {
  // Sliding-window layers get a ring of the window plus one pass's tokens (a pass writes its
  // keys before its first query reads the oldest key in its window), where that is smaller
  // than the context.
  KvWindowRing window;
  window.window = hp_.sliding_window;
  window.slots = hp_.sliding_window + max_batch_;
  if (hp_.sliding_window > 0 && window.slots < n_ctx) {
    for (const Layer& L : layers_) window.layers.push_back(L.window > 0);
  }
  return KvCache(hp_.n_layer, n_ctx, hp_.n_head_kv, hp_.head_dim, options, window);
}

void LlamaModel::forward(std::span<const int32_t> tokens, KvCache& cache, float* logits, bool all_logits) {
  forward_tokens(tokens, cache, PassOutput{logits, all_logits, {}});
}

void LlamaModel::forward_top(std::span<const int32_t> tokens, KvCache& cache, std::span<TopLogit> top) {
  if (top.empty() || top.size() > static_cast<size_t>(hp_.n_vocab)) {
    throw std::invalid_argument("forward_top: " + std::to_string(top.size()) + " top tokens of a vocabulary of " +
                                std::to_string(hp_.n_vocab));
  }
  forward_tokens(tokens, cache, PassOutput{nullptr, false, top});
}

void LlamaModel::forward_steps(std::span<const int32_t> tokens, KvCache& cache, float* logits) {
  stepwise_attention_ = true;
  try {
    forward_tokens(tokens, cache, PassOutput{logits, true, {}});
  } catch (...) {
    stepwise_attention_ = false;
    throw;
  }
  stepwise_attention_ = false;
}

void LlamaModel::forward_tokens(std::span<const int32_t> tokens, KvCache& cache, PassOutput out) {
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
  if (!pending_batches_.empty()) throw std::logic_error("forward: batched passes are still in flight (finish_batch)");
  if (!stage_.alone() && stage_.first()) announce_tokens(cache, tokens.size(), out);
  // Chunks of at most max_batch tokens, each in contiguous slots of the ring (a chunk stops
  // where the ring wraps), shifting the context whenever the cache is full. (The other stages of
  // a pipeline run this same loop over their copy of the cache: the same chunks, the same shifts.)
  size_t start = 0;
  while (start < tokens.size()) {
    if (cache.contiguous_free() == 0) shift_context(cache);
    const size_t n = std::min({tokens.size() - start, static_cast<size_t>(max_batch_),
                               static_cast<size_t>(cache.contiguous_free())});
    const bool last_chunk = start + n == tokens.size();
    // Every chunk's logits when all are wanted; else only the last chunk's output.
    PassOutput chunk_out;
    if (out.all_logits) {
      chunk_out = {out.logits + start * static_cast<size_t>(hp_.n_vocab), true, {}};
    } else if (last_chunk) {
      chunk_out = out;
    }
    forward_chunk(tokens.subspan(start, n), cache, chunk_out);
    start += n;
  }
}

void LlamaModel::shift_context(KvCache& cache) const {
  const int n_discard = cache.shift_size();
  const KvDiscard moved = cache.discard(n_discard);
  // The rotation by -n_discard positions, per rotary pair (in double, as rope_angles()), of the
  // layers of each set of frequencies, in each ring: a pure rotation, without rope_mscale(), which
  // the keys already carry from their own RoPE.
  const int half = hp_.n_rot / 2;
  for (size_t set = 0; set < rope_inv_freq_.size(); ++set) {
    std::vector<float> cos(static_cast<size_t>(half)), sin(static_cast<size_t>(half));
    for (int i = 0; i < half; ++i) {
      const double theta = -static_cast<double>(n_discard) * rope_inv_freq(set, cache.capacity())[static_cast<size_t>(i)];
      cos[static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
      sin[static_cast<size_t>(i)] = static_cast<float>(std::sin(theta));
    }
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
      backend_.shift_keys(cache.view(ring), layers, slots, rope_layout(cos.data(), sin.data()), hp_.n_head_kv,
                          hp_.head_dim);
    }
  }
}

// LongRoPE's long factors past the original context, as llama.cpp's get_rope_factors chooses
// them by the context's size (HF's Phi-3 by the length of the sequence so far).
const std::vector<double>& LlamaModel::rope_inv_freq(size_t set, int n_ctx) const {
  const bool long_context = set == 0 && !rope_inv_freq_long_.empty() && n_ctx > hp_.rope_n_ctx_orig;
  return long_context ? rope_inv_freq_long_ : rope_inv_freq_[set];
}

RopeAngles LlamaModel::rope_layout(const float* cos, const float* sin) const {
  return RopeAngles{cos, sin, hp_.n_rot, hp_.rope_style == RopeStyle::kAdjacentPairs};
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

// cos and sin of every rotation angle of the tokens at positions pos0.. (rows row0..),
// computed once per pass for all layers, in double: positions reach millions, where float
// angles lose digits. Both carry rope_mscale(): q and k come out of RoPE scaled by it.
void LlamaModel::rope_angles(int row0, int64_t pos0, int n_tokens, int n_ctx) {
  Scratch& s = *scratch_;
  const int half = hp_.n_rot / 2;
  const double mscale = hp_.rope_mscale();
  for (size_t set = 0; set < rope_inv_freq_.size(); ++set) {
    const std::vector<double>& inv_freq = rope_inv_freq(set, n_ctx);
    const size_t first = static_cast<size_t>(row0) * static_cast<size_t>(half);
    for (int t = 0; t < n_tokens; ++t) {
      const double p = static_cast<double>(pos0 + t);
      const size_t at = first + static_cast<size_t>(t) * static_cast<size_t>(half);
      for (int i = 0; i < half; ++i) {
        const double theta = p * inv_freq[static_cast<size_t>(i)];
        s.host_cos[set][at + static_cast<size_t>(i)] = static_cast<float>(mscale * std::cos(theta));
        s.host_sin[set][at + static_cast<size_t>(i)] = static_cast<float>(mscale * std::sin(theta));
      }
    }
    const size_t n = static_cast<size_t>(n_tokens) * static_cast<size_t>(half);
    backend_.write(s.rope_cos[set]->data() + first, s.host_cos[set].data() + first, n);
    backend_.write(s.rope_sin[set]->data() + first, s.host_sin[set].data() + first, n);
  }
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

// Causal attention of every sequence's queries over its own cache, in one backend call: query i
// sees the cached tokens up to and including itself. The asynchronized softmax's maxima live in
// each sequence's cache.
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
  const AttentionShape shape{hp_.n_head, hp_.n_head_kv, hp_.head_dim, window, hp_.attn_scale};
  const bool any_steps = std::any_of(rows.begin(), rows.end(), [](const Rows& r) { return r.steps; });
  if (!any_steps) return backend_.attention(index, shape, s.attention_calls);
  if (backend_.attends_stepwise()) return attention_stepwise(layer, index, shape, rows);
  // The other sequences in one call, as always; then each query row of a checking pass as the
  // decode step of its token would run it: the j-th rows of all of them together, one j after
  // the other (a row's softmax maxima are the next row's start).
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

void LlamaModel::run_layers(std::span<const Rows> rows, int n) {
  Scratch& s = *scratch_;
  const int d = hp_.n_embd;
  const int kv_dim = hp_.n_head_kv * hp_.head_dim;
  float* const x = s.x->data();    // the hidden state, [n][d]
  float* const q = s.q->data();
  float* const k = s.k->data();
  float* const v = s.v->data();
  float* const attn = s.attn->data();
  float* const gate = s.gate->data();
  backend_.begin_layer(-1);
  for (const Rows& r : rows) {
    if (stage_.first()) embed(r.tokens, x + static_cast<size_t>(r.row0) * d);
    rope_angles(r.row0, r.pos0, static_cast<int>(r.tokens.size()), r.cache->capacity());
  }
  const size_t hidden = static_cast<size_t>(n) * static_cast<size_t>(d);
  if (!stage_.first()) {  // the previous stage's hidden states
    pipeline_hidden_.resize(hidden);
    link_->recv(stage_.index - 1, pipeline_hidden_.data(), hidden * sizeof(float));
    backend_.write(x, pipeline_hidden_.data(), hidden);
  } else if (hp_.embed_scale) {
    backend_.scale(x, static_cast<int64_t>(n) * d, std::sqrt(static_cast<float>(d)));
  }
  describe_sequences(rows);
  for (int il = stage_.first_layer; il < stage_.end_layer; ++il) {
    backend_.begin_layer(il);
    const Layer& L = layers_[static_cast<size_t>(il)];
    const RopeAngles angles = rope_layout(s.rope_cos[L.rope_set]->data(), s.rope_sin[L.rope_set]->data());
    // Attention block: one QKV projection of the normalised input (the norm is fused into the
    // backend's input preparation), RoPE on q and k, k and v into each sequence's cache.
    const PreparedWeight* qkv[] = {L.wq.get(), L.wk.get(), L.wv.get()};
    float* const qkv_out[] = {q, k, v};
    backend_.matmul_many(qkv, MatmulInput{x, n, L.attn_norm, hp_.rms_eps}, qkv_out);
    if (L.q_bias != nullptr) {
      backend_.add_row(q, L.q_bias, n, hp_.n_head * hp_.head_dim);
      backend_.add_row(k, L.k_bias, n, kv_dim);
      backend_.add_row(v, L.v_bias, n, kv_dim);
    }
    if (hp_.qk_norm) {  // every head of every row is one row of head_dim here
      backend_.rms_norm(q, static_cast<int64_t>(n) * hp_.n_head, hp_.head_dim, L.q_norm, hp_.rms_eps);
      backend_.rms_norm(k, static_cast<int64_t>(n) * hp_.n_head_kv, hp_.head_dim, L.k_norm, hp_.rms_eps);
    }
    backend_.rope(q, n, hp_.n_head, hp_.head_dim, angles);
    backend_.rope(k, n, hp_.n_head_kv, hp_.head_dim, angles);
    for (size_t i = 0; i < rows.size(); ++i) store_kv(il, i, rows[i]);
    attention(il, rows);
    residual(*L.wo, attn, n, L.post_attn_norm);

    // Feed-forward block: down(silu(gate(x)) * up(x)), gate and up in one fused pass.
    backend_.matmul_glu(*L.gate, *L.up, MatmulInput{x, n, L.ffn_norm, hp_.rms_eps}, hp_.activation, gate);
    residual(*L.down, gate, n, L.post_ffn_norm);
  }
  if (!stage_.last()) {  // on to the next stage
    pipeline_hidden_.resize(hidden);
    backend_.read(x, pipeline_hidden_.data(), hidden);
    link_->send(stage_.index + 1, pipeline_hidden_.data(), hidden * sizeof(float));
  }
}

// x += input · weightᵀ, the block's output added to the hidden state; with a post-norm
// (Gemma), the output is RMS-normalised before it is added.
void LlamaModel::residual(const PreparedWeight& weight, const float* input, int n, const float* post_norm) {
  float* const x = scratch_->x->data();
  if (post_norm == nullptr) return backend_.matmul_add(weight, input, n, x);
  float* const out = scratch_->xn->data();
  backend_.matmul(weight, input, n, out);
  backend_.rms_norm(out, n, hp_.n_embd, post_norm, hp_.rms_eps);
  backend_.add(x, out, static_cast<int64_t>(n) * hp_.n_embd);
}

LlamaModel::Rows LlamaModel::append_rows(std::span<const int32_t> tokens, KvCache& cache, int row0) {
  const int64_t pos0 = cache.next_position();
  const int window_slot = cache.window_slot();
  const int first_slot = cache.append(static_cast<int>(tokens.size()));
  return Rows{tokens, &cache, row0, pos0, first_slot, window_slot};
}

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

const float* LlamaModel::project_logits(int row, int n) {
  backend_.begin_layer(hp_.n_layer);
  Scratch& s = *scratch_;
  const size_t wanted = static_cast<size_t>(n) * static_cast<size_t>(hp_.n_vocab);
  if (s.logits == nullptr || s.logits->size() < wanted) s.logits = backend_.alloc_activations(wanted);
  const PreparedWeight* output[] = {output_.get()};
  float* const output_logits[] = {s.logits->data()};
  const float* x = s.x->data() + static_cast<size_t>(row) * hp_.n_embd;
  backend_.matmul_many(output, MatmulInput{x, n, output_norm_, hp_.rms_eps}, output_logits);
  return s.logits->data();
}

void LlamaModel::forward_chunk(std::span<const int32_t> tokens, KvCache& cache, PassOutput out) {
  const int n = static_cast<int>(tokens.size());
  Rows rows[] = {append_rows(tokens, cache, 0)};
  rows[0].steps = stepwise_attention_;
  run_layers(rows, n);
  if (!out.wanted() || !(stage_.first() || stage_.last())) return;
  // Only the rows whose logits are wanted go through the final norm and the vocabulary projection.
  const int first_row = out.all_logits ? 0 : n - 1;
  const size_t n_logits = static_cast<size_t>(n - first_row) * static_cast<size_t>(hp_.n_vocab);
  // What the pass hands back, as bytes: from the last stage to the first, when they differ.
  void* const result = out.top.empty() ? static_cast<void*>(out.logits) : static_cast<void*>(out.top.data());
  const size_t result_bytes = out.top.empty() ? n_logits * sizeof(float) : out.top.size_bytes();
  if (!stage_.last()) return link_->recv(stage_.count - 1, result, result_bytes);
  const float* logits = project_logits(first_row, n - first_row);
  if (!out.top.empty()) {
    backend_.top_k(logits, 1, hp_.n_vocab, static_cast<int>(out.top.size()), out.top);
  } else {
    backend_.read(logits, out.logits, n_logits);
  }
  if (!stage_.first()) link_->send(0, result, result_bytes);
}

void LlamaModel::forward_batch(std::span<const SequenceTokens> batch) {
  if (!begin_batch(batch)) return;
  if (stage_.first()) finish_batch();
}

bool LlamaModel::begin_batch(std::span<const SequenceTokens> batch) {
  // Everything is checked before any cache changes.
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
    if (b.steps && (b.logits == nullptr || !b.top.empty())) {
      throw std::invalid_argument("forward_batch: a checking pass (steps) hands back every row's logits");
    }
    total += b.tokens.size();
  }
  if (total > static_cast<size_t>(max_batch_)) {
    throw std::invalid_argument("forward_batch: " + std::to_string(total) + " tokens exceed the batch of " +
                                std::to_string(max_batch_));
  }
  if (total == 0) return false;
  if (!stage_.alone() && stage_.first()) announce_batch(batch);

  std::vector<Rows>& rows = batch_rows_;
  rows.clear();
  int row = 0;
  for (const SequenceTokens& b : batch) {
    rows.push_back(append_rows(b.tokens, *b.cache, row));
    rows.back().steps = b.steps;
    row += static_cast<int>(b.tokens.size());
  }
  run_layers(rows, row);

  // The last row of each sequence that wants its next token's scores (every row of a checking
  // pass), gathered so that the vocabulary projection is one matrix product: first those that
  // want only their top k (picked in one call for all of them, at the largest k: a row's top k is
  // the start of its top k_max), then those that want every logit. (In a pipeline the last stage
  // computes them and sends them to the first, which hands them out when the pass finishes.)
  Scratch& s = *scratch_;
  const size_t d = static_cast<size_t>(hp_.n_embd), vocab = static_cast<size_t>(hp_.n_vocab);
  PendingBatch pass = take_spare_batch();
  int n_top = 0, n_logits = 0;
  for (const bool top : {true, false}) {
    for (size_t i = 0; i < batch.size(); ++i) {
      const bool wants_top = !batch[i].top.empty();
      if (wants_top != top || (!wants_top && batch[i].logits == nullptr)) continue;
      const size_t n_rows = batch[i].steps ? batch[i].tokens.size() : 1;
      const size_t first = static_cast<size_t>(rows[i].row0) + batch[i].tokens.size() - n_rows;
      if (stage_.last()) {
        backend_.copy(s.xn->data() + static_cast<size_t>(n_top + n_logits) * d, s.x->data() + first * d, n_rows * d);
      }
      if (top) {
        ++n_top;
        pass.k_max = std::max(pass.k_max, static_cast<int>(batch[i].top.size()));
        pass.top_out.push_back(batch[i].top);
      } else {
        for (size_t r = 0; r < n_rows; ++r) pass.logits_out.push_back(batch[i].logits + r * vocab);
        n_logits += static_cast<int>(n_rows);
      }
    }
  }
  const int wanted = n_top + n_logits;
  pass.picks.resize(static_cast<size_t>(n_top) * static_cast<size_t>(pass.k_max));
  const size_t n_floats = static_cast<size_t>(n_logits) * vocab;
  if (pass.logits.size() < n_floats) pass.logits.resize(n_floats);
  if (stage_.last() && wanted > 0) {
    backend_.copy(s.x->data(), s.xn->data(), static_cast<size_t>(wanted) * d);
    const float* logits = project_logits(0, wanted);
    if (n_top > 0) backend_.top_k(logits, n_top, hp_.n_vocab, pass.k_max, pass.picks);
    if (n_logits > 0) backend_.read(logits + static_cast<size_t>(n_top) * vocab, pass.logits.data(), n_floats);
    if (!stage_.first()) {
      link_->send(0, pass.picks.data(), pass.picks.size() * sizeof(TopLogit));
      link_->send(0, pass.logits.data(), n_floats * sizeof(float));
    }
  } else if (stage_.first() && wanted > 0) {
    link_->start_recv(stage_.count - 1, pass.picks.data(), pass.picks.size() * sizeof(TopLogit));
    link_->start_recv(stage_.count - 1, pass.logits.data(), n_floats * sizeof(float));
  }
  if (!stage_.first()) {
    spare_batches_.push_back(std::move(pass));
    return true;
  }
  pending_batches_.push_back(std::move(pass));
  return true;
}

void LlamaModel::finish_batch() {
  if (pending_batches_.empty()) throw std::logic_error("finish_batch: no pass begun on the first stage");
  PendingBatch pass = std::move(pending_batches_.front());
  pending_batches_.pop_front();
  const size_t wanted = pass.top_out.size() + pass.logits_out.size();
  if (!stage_.last() && wanted > 0) {  // the last stage's picks, then its logits
    link_->finish_recv();
    link_->finish_recv();
  }
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
  pass.k_max = 0;
  pass.top_out.clear();
  pass.logits_out.clear();
  return pass;
}

// --- Pipeline parallelism --------------------------------------------------------------------

// What the first stage tells the others before each pass (POD: it crosses as bytes): the kind
// of pass, how many sequences, and the caches the first stage dropped since the last one. The
// sequences' records follow, then the dropped ids.
struct LlamaModel::PipelineCommand {
  enum Op : int32_t { kExit = 0, kTokens = 1, kBatch = 2 };
  int32_t op = kExit;
  int32_t n_sequences = 0;
  int64_t n_released = 0;
};

// One sequence of a pass: its cache (by id, with what another stage needs to make its copy of it
// and to check that the copy is in step: where the cache stands, its prefix), its tokens' count
// and what the pass hands back for it.
struct LlamaModel::PipelineSequence {
  uint64_t cache_id = 0, prefix_id = 0;
  int64_t cache_size = 0, next_position = 0, n_tokens = 0;
  int32_t capacity = 0, prefix_tokens = 0;
  int32_t kv_type = 0, n_keep = 0, n_discard = 0, context_shift = 0;
  int32_t want_logits = 0, all_logits = 0, top_k = 0, stepwise_attention = 0;
};

namespace {
// The caches that went since the first stage last announced a pass (KvCache's release observer).
std::mutex g_released_mutex;
std::vector<uint64_t> g_released;
void note_released(uint64_t id) {
  std::lock_guard lock(g_released_mutex);
  g_released.push_back(id);
}
}  // namespace

void LlamaModel::connect_pipeline(PipelineLink& link) {
  link_ = &link;
  if (stage_.first() && !stage_.alone()) KvCache::set_release_observer(note_released);
}

LlamaModel::PipelineSequence LlamaModel::describe_for_pipeline(const KvCache& cache, size_t n_tokens) {
  PipelineSequence q;
  q.cache_id = cache.id();
  q.prefix_id = cache.prefix() != nullptr ? cache.prefix()->id() : 0;
  q.prefix_tokens = cache.prefix_tokens();
  q.cache_size = cache.size();
  q.next_position = cache.next_position();
  q.n_tokens = static_cast<int64_t>(n_tokens);
  q.capacity = cache.capacity();
  q.kv_type = static_cast<int32_t>(cache.options().type);
  q.n_keep = cache.options().n_keep;
  q.n_discard = cache.options().n_discard;
  q.context_shift = cache.options().context_shift ? 1 : 0;
  return q;
}

void LlamaModel::announce_pass(int32_t op, std::vector<PipelineSequence>& sequences) {
  std::vector<uint64_t> released;
  {
    std::lock_guard lock(g_released_mutex);
    released.swap(g_released);
  }
  PipelineCommand c;
  c.op = op;
  c.n_sequences = static_cast<int32_t>(sequences.size());
  c.n_released = static_cast<int64_t>(released.size());
  link_->send_copy(1, &c, sizeof(c));
  link_->send_copy(1, sequences.data(), sequences.size() * sizeof(PipelineSequence));
  link_->send_copy(1, released.data(), released.size() * sizeof(uint64_t));
}

void LlamaModel::announce_tokens(const KvCache& cache, size_t n_tokens, const PassOutput& out) {
  std::vector<PipelineSequence> one = {describe_for_pipeline(cache, n_tokens)};
  one[0].want_logits = out.logits != nullptr ? 1 : 0;
  one[0].all_logits = out.all_logits ? 1 : 0;
  one[0].top_k = static_cast<int32_t>(out.top.size());
  one[0].stepwise_attention = stepwise_attention_ ? 1 : 0;
  announce_pass(PipelineCommand::kTokens, one);
}

void LlamaModel::announce_batch(std::span<const SequenceTokens> batch) {
  std::vector<PipelineSequence> all;
  for (const SequenceTokens& b : batch) {
    PipelineSequence q = describe_for_pipeline(*b.cache, b.tokens.size());
    q.want_logits = b.logits != nullptr ? 1 : 0;
    q.top_k = static_cast<int32_t>(b.top.size());
    q.all_logits = b.steps ? 1 : 0;
    q.stepwise_attention = b.steps ? 1 : 0;
    all.push_back(q);
  }
  announce_pass(PipelineCommand::kBatch, all);
}

// This stage's copy of one of the first stage's caches: made when first named, made afresh when
// the first stage's cache starts over (empty there: cleared, maybe given a prefix), and
// otherwise exactly as far along, or an error.
KvCache& LlamaModel::pipeline_cache(const PipelineSequence& q) {
  auto it = pipeline_caches_.find(q.cache_id);
  const auto in_step = [&](const KvCache& c) {
    const uint64_t prefix = c.prefix() != nullptr ? c.prefix()->id() : 0;
    return c.size() == q.cache_size && c.next_position() == q.next_position && prefix == copied_id(q.prefix_id) &&
           c.prefix_tokens() == q.prefix_tokens;
  };
  if (it != pipeline_caches_.end() && q.cache_size == 0 && !in_step(*it->second)) {
    pipeline_caches_.erase(it);
    it = pipeline_caches_.end();
  }
  if (it == pipeline_caches_.end()) {
    const KvCacheOptions options{static_cast<KvType>(q.kv_type), q.n_keep, q.n_discard, q.context_shift != 0};
    auto made = std::make_shared<KvCache>(make_cache(q.capacity, options));
    if (q.prefix_id != 0) {
      const auto prefix = pipeline_caches_.find(q.prefix_id);
      if (prefix == pipeline_caches_.end()) {
        throw std::logic_error("pipeline stage " + std::to_string(stage_.index) + ": prefix cache " +
                               std::to_string(q.prefix_id) + " is unknown here");
      }
      made->attach_prefix(prefix->second, q.prefix_tokens);
    }
    it = pipeline_caches_.emplace(q.cache_id, std::move(made)).first;
  }
  KvCache& cache = *it->second;
  // The first stage rolled back a speculative draft's rejected tokens: the copy forgets them too.
  const int64_t ahead = cache.size() - q.cache_size;
  if (ahead > 0 && cache.next_position() - q.next_position == ahead && ahead <= cache.max_rollback()) {
    cache.rollback(static_cast<int>(ahead));
  }
  if (!in_step(cache)) {
    throw std::logic_error("pipeline stage " + std::to_string(stage_.index) + ": cache " + std::to_string(q.cache_id) +
                           " holds " + std::to_string(cache.size()) + " tokens up to position " +
                           std::to_string(cache.next_position()) + ", the first stage's " +
                           std::to_string(q.cache_size) + " up to " + std::to_string(q.next_position));
  }
  return cache;
}

// The id this stage's copy of cache `id` carries (its own KvCache, its own id); 0 for 0.
uint64_t LlamaModel::copied_id(uint64_t id) const {
  if (id == 0) return 0;
  const auto it = pipeline_caches_.find(id);
  return it != pipeline_caches_.end() ? it->second->id() : ~uint64_t{0};
}

void LlamaModel::serve_pipeline() {
  if (link_ == nullptr || stage_.first()) throw std::logic_error("serve_pipeline: not a later stage of a connected pipeline");
  std::vector<PipelineSequence> sequences;
  std::vector<uint64_t> released;
  std::vector<std::vector<int32_t>> tokens;  // the first stage embeds: later stages need only the counts
  std::vector<std::vector<float>> logits;    // what the last stage computes, before it sends it on
  std::vector<std::vector<TopLogit>> top;
  std::vector<SequenceTokens> batch;
  // Each command comes from the stage before and goes on to the next before this one runs it.
  const int from = stage_.index - 1, to = stage_.last() ? -1 : stage_.index + 1;
  for (;;) {
    PipelineCommand c;
    link_->recv(from, &c, sizeof(c));
    if (to >= 0) link_->send_copy(to, &c, sizeof(c));
    if (c.op == PipelineCommand::kExit) return;
    if ((c.op != PipelineCommand::kTokens && c.op != PipelineCommand::kBatch) || c.n_sequences < 1 ||
        c.n_released < 0 || (c.op == PipelineCommand::kTokens && c.n_sequences != 1)) {
      throw std::runtime_error("pipeline stage " + std::to_string(stage_.index) + ": a command it cannot read (op " +
                               std::to_string(c.op) + ")");
    }
    sequences.resize(static_cast<size_t>(c.n_sequences));
    released.resize(static_cast<size_t>(c.n_released));
    link_->recv(from, sequences.data(), sequences.size() * sizeof(PipelineSequence));
    link_->recv(from, released.data(), released.size() * sizeof(uint64_t));
    if (to >= 0) {
      link_->send_copy(to, sequences.data(), sequences.size() * sizeof(PipelineSequence));
      link_->send_copy(to, released.data(), released.size() * sizeof(uint64_t));
    }
    for (const uint64_t id : released) pipeline_caches_.erase(id);

    tokens.resize(sequences.size());
    logits.resize(sequences.size());
    top.resize(sequences.size());
    batch.clear();
    for (size_t i = 0; i < sequences.size(); ++i) {
      const PipelineSequence& q = sequences[i];
      tokens[i].assign(static_cast<size_t>(std::max<int64_t>(q.n_tokens, 0)), 0);
      // The last stage computes what the pass hands back (and sends it to the first); a middle
      // stage hands back nothing.
      float* out_logits = nullptr;
      std::span<TopLogit> out_top;
      if (stage_.last() && q.top_k > 0) {
        top[i].resize(static_cast<size_t>(q.top_k));
        out_top = top[i];
      } else if (stage_.last() && q.want_logits != 0) {
        logits[i].resize((q.all_logits != 0 ? tokens[i].size() : 1) * static_cast<size_t>(hp_.n_vocab));
        out_logits = logits[i].data();
      }
      KvCache& cache = pipeline_cache(q);
      if (c.op == PipelineCommand::kTokens) {
        stepwise_attention_ = q.stepwise_attention != 0;
        forward_tokens(tokens[i], cache, PassOutput{out_logits, q.all_logits != 0, out_top});
        stepwise_attention_ = false;
      } else {
        batch.emplace_back(tokens[i], &cache, out_logits, out_top, q.stepwise_attention != 0);
      }
    }
    if (c.op == PipelineCommand::kBatch) forward_batch(batch);
  }
}

void LlamaModel::close_pipeline() {
  if (link_ == nullptr || !stage_.first() || stage_.alone()) return;
  while (!pending_batches_.empty()) finish_batch();
  PipelineCommand c;
  c.op = PipelineCommand::kExit;
  link_->send_copy(1, &c, sizeof(c));
  KvCache::set_release_observer(nullptr);
  link_ = nullptr;
}

}  // namespace ringlm
