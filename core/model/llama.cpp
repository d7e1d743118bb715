#include "core/model/llama.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace ringlm {

namespace {

// The families that run on this decoder, as data: what each adds to the Llama layer. The RoPE
// layout is the one their GGUF conversion leaves: llama.cpp's converter permutes Llama's q/k
// rows for adjacent pairs, and leaves Qwen's in the NeoX layout of the original checkpoints.
struct ArchInfo {
  std::string_view name;
  RopeStyle rope_style;
  bool qkv_bias = false;   // attn_q/k/v.bias, added to the projections (Qwen2)
  bool qk_norm = false;    // attn_q_norm / attn_k_norm: RMSNorm of every head of q and k before RoPE
  Activation activation = Activation::kSilu;  // of the gated feed-forward block
  bool post_norms = false;   // post_attention_norm / post_ffw_norm on each block's output, before the residual
  bool embed_scale = false;  // token embeddings multiplied by sqrt(n_embd)
  // Sliding-window layers (<arch>.attention.sliding_window, when the file gives one): every
  // layer but each swa_period-th, with RoPE base <arch>.rope.freq_base_swa (default
  // swa_rope_base) and no RoPE scaling (which is the global layers').
  int swa_period = 0;
  float swa_rope_base = 0.0f;
  // A model of this many layers scales its attention scores by 1/sqrt(n_embd / n_head) instead of
  // 1/sqrt(head_dim): Gemma 3 27B's query_pre_attn_scalar, which llama.cpp applies by layer count.
  int wide_query_scale_n_layer = 0;
};
constexpr ArchInfo kSupportedArchs[] = {
    {.name = "llama", .rope_style = RopeStyle::kAdjacentPairs},
    {.name = "qwen2", .rope_style = RopeStyle::kHalfSplit, .qkv_bias = true},
    {.name = "qwen3", .rope_style = RopeStyle::kHalfSplit, .qk_norm = true},
    {.name = "gemma3",
     .rope_style = RopeStyle::kHalfSplit,
     .qk_norm = true,
     .activation = Activation::kGeluTanh,
     .post_norms = true,
     .embed_scale = true,
     .swa_period = 6,
     .swa_rope_base = 10000.0f,
     .wide_query_scale_n_layer = 62},
};

std::string supported_arch_names() {
  std::string names;
  for (const ArchInfo& a : kSupportedArchs) names += (names.empty() ? "" : ", ") + std::string(a.name);
  return names;
}

int checked_dim(const GgufFile& gguf, const std::string& key, uint64_t value, uint64_t max) {
  if (value == 0 || value > max) {
    gguf.fail("metadata '" + key + "': " + std::to_string(value) + " is out of range (1 to " + std::to_string(max) + ")");
  }
  return static_cast<int>(value);
}

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


}  // namespace

LlamaHparams LlamaHparams::from_gguf(const GgufFile& gguf) {
  LlamaHparams hp;
  hp.arch = std::string(gguf.require_string("general.architecture"));
  const ArchInfo* arch = nullptr;
  for (const ArchInfo& a : kSupportedArchs) {
    if (a.name == hp.arch) arch = &a;
  }
  if (arch == nullptr) gguf.fail("unsupported architecture '" + hp.arch + "' (supported: " + supported_arch_names() + ")");
  hp.rope_style = arch->rope_style;
  hp.qkv_bias = arch->qkv_bias;
  hp.qk_norm = arch->qk_norm;
  hp.activation = arch->activation;
  hp.post_norms = arch->post_norms;
  hp.embed_scale = arch->embed_scale;

  const std::string p = hp.arch + ".";
  auto dim = [&](const std::string& key, uint64_t max) { return checked_dim(gguf, key, gguf.require_uint(key), max); };
  hp.n_ctx_train = dim(p + "context_length", uint64_t{1} << 24);
  hp.n_embd = dim(p + "embedding_length", 1 << 16);
  hp.n_layer = dim(p + "block_count", 1024);
  hp.n_ff = dim(p + "feed_forward_length", 1 << 20);
  hp.n_head = dim(p + "attention.head_count", 1024);
  hp.n_head_kv = hp.n_head;
  if (auto v = gguf.get_uint(p + "attention.head_count_kv")) hp.n_head_kv = checked_dim(gguf, p + "attention.head_count_kv", *v, 1024);
  if (hp.n_head % hp.n_head_kv != 0) {
    gguf.fail("metadata '" + p + "attention.head_count_kv': " + std::to_string(hp.n_head_kv) +
              " does not divide the head count " + std::to_string(hp.n_head));
  }
  if (auto v = gguf.get_uint(p + "attention.key_length")) {
    hp.head_dim = checked_dim(gguf, p + "attention.key_length", *v, 4096);
  } else if (hp.n_embd % hp.n_head != 0) {
    gguf.fail("metadata '" + p + "attention.head_count': " + std::to_string(hp.n_head) + " does not divide '" + p +
              "embedding_length' " + std::to_string(hp.n_embd) + " (and no attention.key_length is given)");
  } else {
    hp.head_dim = hp.n_embd / hp.n_head;
  }
  if (auto v = gguf.get_uint(p + "attention.value_length"); v && *v != static_cast<uint64_t>(hp.head_dim)) {
    gguf.fail("metadata '" + p + "attention.value_length': differs from the key length, which is not supported");
  }
  if (hp.head_dim <= 0 || hp.head_dim % 2 != 0) gguf.fail("head dimension " + std::to_string(hp.head_dim) + " must be even");
  hp.n_rot = hp.head_dim;
  if (auto v = gguf.get_uint(p + "rope.dimension_count")) hp.n_rot = checked_dim(gguf, p + "rope.dimension_count", *v, 4096);
  if (hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0) {
    gguf.fail("metadata '" + p + "rope.dimension_count': " + std::to_string(hp.n_rot) +
              " must be even and at most the head dimension " + std::to_string(hp.head_dim));
  }
  hp.rope_base = static_cast<float>(gguf.get_float(p + "rope.freq_base").value_or(10000.0));
  if (!(hp.rope_base > 1.0f) || !std::isfinite(hp.rope_base)) gguf.fail("metadata '" + p + "rope.freq_base': must be > 1");
  const std::string scaling = std::string(gguf.get_string(p + "rope.scaling.type").value_or("none"));
  if (scaling == "linear") {
    hp.rope_scale = static_cast<float>(gguf.get_float(p + "rope.scaling.factor").value_or(1.0));
  } else if (scaling != "none") {
    gguf.fail("metadata '" + p + "rope.scaling.type': '" + scaling + "' is not supported (none, linear)");
  }
  if (auto v = gguf.get_float(p + "rope.scale_linear")) hp.rope_scale = static_cast<float>(*v);
  if (!(hp.rope_scale > 0.0f) || !std::isfinite(hp.rope_scale)) {
    gguf.fail("metadata '" + p + "rope.scaling.factor': the RoPE scaling factor must be a positive number");
  }
  // Gemma 3 27B's scale, by layer count as llama.cpp decides it (with its integer division).
  const bool wide_query = arch->wide_query_scale_n_layer > 0 && hp.n_layer == arch->wide_query_scale_n_layer;
  hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(wide_query ? hp.n_embd / hp.n_head : hp.head_dim));
  if (arch->swa_period > 0) {
    // A window of 0 (or none) makes every layer global.
    const uint64_t window = gguf.get_uint(p + "attention.sliding_window").value_or(0);
    if (window > (uint64_t{1} << 24)) {
      gguf.fail("metadata '" + p + "attention.sliding_window': " + std::to_string(window) + " is out of range");
    }
    hp.sliding_window = static_cast<int>(window);
    if (hp.sliding_window > 0) {
      hp.swa_period = arch->swa_period;
      hp.swa_rope_base = static_cast<float>(gguf.get_float(p + "rope.freq_base_swa").value_or(arch->swa_rope_base));
      if (!(hp.swa_rope_base > 1.0f) || !std::isfinite(hp.swa_rope_base)) {
        gguf.fail("metadata '" + p + "rope.freq_base_swa': must be > 1");
      }
    }
  }
  // What this decoder does not model is refused, never ignored.
  for (const char* key : {"attention.sliding_window_pattern", "final_logit_softcapping", "attn_logit_softcapping"}) {
    if (gguf.find(p + key) != nullptr) gguf.fail("metadata '" + p + key + "' is not supported");
  }
  hp.rms_eps = static_cast<float>(gguf.require_float(p + "attention.layer_norm_rms_epsilon"));
  if (!(hp.rms_eps > 0.0f) || hp.rms_eps > 1.0f) gguf.fail("metadata '" + p + "attention.layer_norm_rms_epsilon': out of range");

  const GgufTensorInfo* embd = gguf.find_tensor("token_embd.weight");
  if (embd == nullptr) gguf.fail("missing tensor 'token_embd.weight'");
  if (embd->shape.size() < 2) gguf.fail("tensor 'token_embd.weight': expected 2 dimensions");
  if (embd->shape[1] > (1 << 22)) {
    gguf.fail("tensor 'token_embd.weight': " + std::to_string(embd->shape[1]) + " rows is not a plausible vocabulary size");
  }
  hp.n_vocab = static_cast<int>(embd->shape[1]);
  return hp;
}

struct LlamaModel::Layer {
  std::vector<float> attn_norm;
  std::vector<float> ffn_norm;
  std::vector<float> q_bias, k_bias, v_bias;  // qkv_bias families
  std::vector<float> q_norm, k_norm;          // qk_norm families: [head_dim]
  std::vector<float> post_attn_norm, post_ffn_norm;  // post_norms families
  int window = 0;    // sliding window of its attention (0: none)
  int rope_set = 0;  // its RoPE frequencies: rope_inv_freq_[rope_set]
  std::unique_ptr<PreparedWeight> wq, wk, wv, wo, gate, up, down;
};

// Activations for one chunk of up to max_batch tokens, allocated once.
struct LlamaModel::Scratch {
  std::vector<float> x, xn, q, k, v, attn, gate;
  // [rope set][tokens][n_rot / 2]: each row's RoPE angles, per set of frequencies.
  std::vector<std::vector<float>> rope_cos, rope_sin;
  // The pass's sequences as the backend sees them: their caches, their prefixes, and one
  // attention call each (reused, sized before any pointer into them is taken).
  std::vector<KvView> kv_views, prefix_views;
  std::vector<AttentionCall> attention_calls;
};

LlamaModel::LlamaModel(const GgufFile& gguf, Backend& backend)
    : hp_(LlamaHparams::from_gguf(gguf)), backend_(backend) {
  const int64_t d = hp_.n_embd;
  const int64_t q_dim = static_cast<int64_t>(hp_.n_head) * hp_.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(hp_.n_head_kv) * hp_.head_dim;

  auto prepare = [&](const std::string& name, int64_t cols, int64_t rows) {
    const GgufTensorInfo& t = expect_tensor(gguf, name, {cols, rows});
    weight_bytes_ += t.n_bytes;
    n_params_ += t.n_elements();
    return backend_.prepare(WeightView{name, t.type, rows, cols, t.data, true});
  };

  token_embd_ = &expect_tensor(gguf, "token_embd.weight", {d, hp_.n_vocab});
  weight_bytes_ += token_embd_->n_bytes;
  n_params_ += token_embd_->n_elements();

  layers_.resize(static_cast<size_t>(hp_.n_layer));
  for (int il = 0; il < hp_.n_layer; ++il) {
    Layer& L = layers_[static_cast<size_t>(il)];
    const std::string b = "blk." + std::to_string(il) + ".";
    L.attn_norm = load_vector(gguf, b + "attn_norm.weight", d);
    L.ffn_norm = load_vector(gguf, b + "ffn_norm.weight", d);
    L.wq = prepare(b + "attn_q.weight", d, q_dim);
    L.wk = prepare(b + "attn_k.weight", d, kv_dim);
    L.wv = prepare(b + "attn_v.weight", d, kv_dim);
    // Biases: required where the family has them, read wherever a file has them (as llama.cpp).
    if (hp_.qkv_bias || gguf.find_tensor(b + "attn_q.bias") != nullptr) {
      L.q_bias = load_vector(gguf, b + "attn_q.bias", q_dim);
      L.k_bias = load_vector(gguf, b + "attn_k.bias", kv_dim);
      L.v_bias = load_vector(gguf, b + "attn_v.bias", kv_dim);
    }
    if (hp_.qk_norm) {
      L.q_norm = load_vector(gguf, b + "attn_q_norm.weight", hp_.head_dim);
      L.k_norm = load_vector(gguf, b + "attn_k_norm.weight", hp_.head_dim);
    }
    if (hp_.post_norms) {
      L.post_attn_norm = load_vector(gguf, b + "post_attention_norm.weight", d);
      L.post_ffn_norm = load_vector(gguf, b + "post_ffw_norm.weight", d);
    }
    if (hp_.swa_period > 0 && (il + 1) % hp_.swa_period != 0) {
      L.window = hp_.sliding_window;
      L.rope_set = 1;
    }
    L.wo = prepare(b + "attn_output.weight", q_dim, d);
    L.gate = prepare(b + "ffn_gate.weight", d, hp_.n_ff);
    L.up = prepare(b + "ffn_up.weight", d, hp_.n_ff);
    L.down = prepare(b + "ffn_down.weight", hp_.n_ff, d);
  }
  output_norm_ = load_vector(gguf, "output_norm.weight", d);
  if (gguf.find_tensor("output.weight") != nullptr) {
    output_ = prepare("output.weight", d, hp_.n_vocab);
  } else {  // tied embeddings: the output projection reuses token_embd
    tied_output_ = true;
    output_ = backend_.prepare(WeightView{"token_embd.weight", token_embd_->type, hp_.n_vocab, d, token_embd_->data, true});
  }

  // RoPE frequencies: theta_i = pos * base^(-2i / n_rot), optionally divided by per-pair factors;
  // a second set for sliding-window layers with a base of their own.
  const auto frequencies = [&](float base) {
    std::vector<float> inv_freq(static_cast<size_t>(hp_.n_rot / 2));
    for (int i = 0; i < hp_.n_rot / 2; ++i) {
      inv_freq[static_cast<size_t>(i)] = static_cast<float>(std::pow(static_cast<double>(base), -2.0 * i / hp_.n_rot));
    }
    return inv_freq;
  };
  rope_inv_freq_.push_back(frequencies(hp_.rope_base));
  if (gguf.find_tensor("rope_freqs.weight") != nullptr) {
    const std::vector<float> factors = load_vector(gguf, "rope_freqs.weight", hp_.n_rot / 2);
    for (size_t i = 0; i < factors.size(); ++i) rope_inv_freq_[0][i] /= factors[i];
  }
  if (hp_.swa_period > 0) rope_inv_freq_.push_back(frequencies(hp_.swa_rope_base));

  scratch_ = std::make_unique<Scratch>();
  const auto M = static_cast<size_t>(max_batch_);
  scratch_->x.resize(M * d);
  scratch_->xn.resize(M * d);
  scratch_->q.resize(M * q_dim);
  scratch_->k.resize(M * kv_dim);
  scratch_->v.resize(M * kv_dim);
  scratch_->attn.resize(M * q_dim);
  scratch_->gate.resize(M * hp_.n_ff);
  scratch_->rope_cos.assign(rope_inv_freq_.size(), std::vector<float>(M * static_cast<size_t>(hp_.n_rot / 2)));
  scratch_->rope_sin = scratch_->rope_cos;
}

LlamaModel::~LlamaModel() = default;

KvCache LlamaModel::make_cache(int n_ctx, const KvCacheOptions& options) const {
  return KvCache(hp_.n_layer, n_ctx, hp_.n_head_kv, hp_.head_dim, options);
}

void LlamaModel::forward(std::span<const int32_t> tokens, KvCache& cache, float* logits, bool all_logits) {
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
  // Chunks of at most max_batch tokens, each in contiguous slots of the ring (a chunk stops
  // where the ring wraps), shifting the context whenever the cache is full.
  size_t start = 0;
  while (start < tokens.size()) {
    if (cache.contiguous_free() == 0) shift_context(cache);
    const size_t n = std::min({tokens.size() - start, static_cast<size_t>(max_batch_),
                               static_cast<size_t>(cache.contiguous_free())});
    const bool last_chunk = start + n == tokens.size();
    float* out = all_logits ? logits + start * static_cast<size_t>(hp_.n_vocab) : (last_chunk ? logits : nullptr);
    forward_chunk(tokens.subspan(start, n), cache, out, all_logits);
    start += n;
  }
}

void LlamaModel::shift_context(KvCache& cache) const {
  const int n_discard = cache.shift_size();
  const std::vector<int> moved = cache.discard(n_discard);
  // The rotation by -n_discard positions, per rotary pair (in double, as rope_angles()), of the
  // layers of each set of frequencies.
  const int half = hp_.n_rot / 2;
  for (size_t set = 0; set < rope_inv_freq_.size(); ++set) {
    std::vector<float> cos(static_cast<size_t>(half)), sin(static_cast<size_t>(half));
    for (int i = 0; i < half; ++i) {
      const double theta = -static_cast<double>(n_discard) / rope_scale(set) * rope_inv_freq_[set][static_cast<size_t>(i)];
      cos[static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
      sin[static_cast<size_t>(i)] = static_cast<float>(std::sin(theta));
    }
    std::vector<int> layers;
    for (int il = 0; il < hp_.n_layer; ++il) {
      if (layers_[static_cast<size_t>(il)].rope_set == static_cast<int>(set)) layers.push_back(il);
    }
    backend_.shift_keys(cache.view(), layers, moved, rope_layout(cos.data(), sin.data()), hp_.n_head_kv, hp_.head_dim);
  }
}

// Linear RoPE scaling divides the positions of the layers of set 0 only (Gemma 3 scales its
// global layers, not its sliding-window ones).
double LlamaModel::rope_scale(size_t set) const { return set == 0 ? hp_.rope_scale : 1.0; }

RopeAngles LlamaModel::rope_layout(const float* cos, const float* sin) const {
  return RopeAngles{cos, sin, hp_.n_rot, hp_.rope_style == RopeStyle::kAdjacentPairs};
}

void LlamaModel::embed(std::span<const int32_t> tokens, float* out) {
  // Tied: the table is the output projection's weight, which the backend holds (and the file's
  // pages of it may have been given back).
  if (tied_output_) return backend_.rows(*output_, tokens, out);
  const size_t stride = row_bytes(token_embd_->type, hp_.n_embd);
  for (size_t i = 0; i < tokens.size(); ++i) {
    dequantize_row(token_embd_->type, token_embd_->data + static_cast<size_t>(tokens[i]) * stride,
                   out + i * static_cast<size_t>(hp_.n_embd), hp_.n_embd);
  }
}

// cos and sin of every rotation angle of the tokens at positions pos0.. (rows row0..),
// computed once per pass for all layers, in double: positions reach millions, where float
// angles lose digits.
void LlamaModel::rope_angles(int row0, int64_t pos0, int n_tokens) {
  const int half = hp_.n_rot / 2;
  for (size_t set = 0; set < rope_inv_freq_.size(); ++set) {
    for (int t = 0; t < n_tokens; ++t) {
      const double p = static_cast<double>(pos0 + t) / rope_scale(set);
      const size_t at = static_cast<size_t>(row0 + t) * static_cast<size_t>(half);
      for (int i = 0; i < half; ++i) {
        const double theta = p * rope_inv_freq_[set][static_cast<size_t>(i)];
        scratch_->rope_cos[set][at + static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
        scratch_->rope_sin[set][at + static_cast<size_t>(i)] = static_cast<float>(std::sin(theta));
      }
    }
  }
}

// The pass's sequences as the backend sees them: a view of each cache (and of the prefix it
// reads first) and its attention call, filled once per pass for every layer.
void LlamaModel::describe_sequences(std::span<const Rows> rows) {
  Scratch& s = *scratch_;
  // Sized first: views point into prefix_views, calls into kv_views.
  s.kv_views.resize(rows.size());
  s.prefix_views.resize(rows.size());
  s.attention_calls.resize(rows.size());
  const size_t q_dim = static_cast<size_t>(hp_.n_head) * hp_.head_dim;
  for (size_t i = 0; i < rows.size(); ++i) {
    KvCache& cache = *rows[i].cache;
    s.kv_views[i] = cache.view();
    if (cache.prefix() != nullptr) {
      s.prefix_views[i] = cache.prefix()->prefix_view();
      s.kv_views[i].prefix = &s.prefix_views[i];
    }
    if (async_softmax_) {
      std::vector<float>& phi = cache.softmax_phi();
      const size_t n = static_cast<size_t>(hp_.n_layer) * static_cast<size_t>(hp_.n_head);
      if (phi.size() != n) phi.assign(n, NAN);
    }
    const size_t q_at = static_cast<size_t>(rows[i].row0) * q_dim;
    s.attention_calls[i] = AttentionCall{s.q.data() + q_at, static_cast<int>(rows[i].tokens.size()), rows[i].pos0,
                                         s.attn.data() + q_at, &s.kv_views[i], nullptr};
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
  }
  const int window = layers_[static_cast<size_t>(layer)].window;
  backend_.attention(layer, {hp_.n_head, hp_.n_head_kv, hp_.head_dim, window, hp_.attn_scale}, s.attention_calls);
}

void LlamaModel::run_layers(std::span<const Rows> rows, int n) {
  Scratch& s = *scratch_;
  const int d = hp_.n_embd;
  const int kv_dim = hp_.n_head_kv * hp_.head_dim;
  for (const Rows& r : rows) {
    embed(r.tokens, &s.x[static_cast<size_t>(r.row0) * d]);
    rope_angles(r.row0, r.pos0, static_cast<int>(r.tokens.size()));
  }
  if (hp_.embed_scale) backend_.scale(s.x.data(), static_cast<int64_t>(n) * d, std::sqrt(static_cast<float>(d)));
  describe_sequences(rows);
  for (int il = 0; il < hp_.n_layer; ++il) {
    const Layer& L = layers_[static_cast<size_t>(il)];
    const RopeAngles angles = rope_layout(s.rope_cos[L.rope_set].data(), s.rope_sin[L.rope_set].data());
    // Attention block: one QKV projection of the normalised input (the norm is fused into the
    // backend's input preparation), RoPE on q and k, k and v into each sequence's cache.
    const PreparedWeight* qkv[] = {L.wq.get(), L.wk.get(), L.wv.get()};
    float* const qkv_out[] = {s.q.data(), s.k.data(), s.v.data()};
    backend_.matmul_many(qkv, MatmulInput{s.x.data(), n, L.attn_norm.data(), hp_.rms_eps}, qkv_out);
    if (!L.q_bias.empty()) {
      backend_.add_row(s.q.data(), L.q_bias.data(), n, hp_.n_head * hp_.head_dim);
      backend_.add_row(s.k.data(), L.k_bias.data(), n, kv_dim);
      backend_.add_row(s.v.data(), L.v_bias.data(), n, kv_dim);
    }
    if (hp_.qk_norm) {  // every head of every row is one row of head_dim here
      backend_.rms_norm(s.q.data(), static_cast<int64_t>(n) * hp_.n_head, hp_.head_dim, L.q_norm.data(), hp_.rms_eps);
      backend_.rms_norm(s.k.data(), static_cast<int64_t>(n) * hp_.n_head_kv, hp_.head_dim, L.k_norm.data(), hp_.rms_eps);
    }
    backend_.rope(s.q.data(), n, hp_.n_head, hp_.head_dim, angles);
    backend_.rope(s.k.data(), n, hp_.n_head_kv, hp_.head_dim, angles);
    for (size_t i = 0; i < rows.size(); ++i) {
      const size_t at = static_cast<size_t>(rows[i].row0) * kv_dim;
      backend_.store_kv(s.kv_views[i], il, rows[i].first_slot, static_cast<int>(rows[i].tokens.size()), &s.k[at],
                        &s.v[at]);
    }
    attention(il, rows);
    backend_.matmul(*L.wo, s.attn.data(), n, s.xn.data());
    if (hp_.post_norms) backend_.rms_norm(s.xn.data(), n, d, L.post_attn_norm.data(), hp_.rms_eps);
    backend_.add(s.x.data(), s.xn.data(), static_cast<int64_t>(n) * d);

    // Feed-forward block: down(silu(gate(x)) * up(x)), gate and up in one fused pass.
    backend_.matmul_glu(*L.gate, *L.up, MatmulInput{s.x.data(), n, L.ffn_norm.data(), hp_.rms_eps}, hp_.activation,
                        s.gate.data());
    backend_.matmul(*L.down, s.gate.data(), n, s.xn.data());
    if (hp_.post_norms) backend_.rms_norm(s.xn.data(), n, d, L.post_ffn_norm.data(), hp_.rms_eps);
    backend_.add(s.x.data(), s.xn.data(), static_cast<int64_t>(n) * d);
  }
}

void LlamaModel::project_logits(int row, int n, float* logits) {
  const PreparedWeight* output[] = {output_.get()};
  float* const output_logits[] = {logits};
  const float* x = &scratch_->x[static_cast<size_t>(row) * hp_.n_embd];
  backend_.matmul_many(output, MatmulInput{x, n, output_norm_.data(), hp_.rms_eps}, output_logits);
}

void LlamaModel::forward_chunk(std::span<const int32_t> tokens, KvCache& cache, float* logits, bool all_logits) {
  const int n = static_cast<int>(tokens.size());
  const int64_t pos0 = cache.next_position();
  const Rows rows[] = {{tokens, &cache, 0, pos0, cache.append(n)}};
  run_layers(rows, n);
  if (logits == nullptr) return;
  // Only the rows whose logits are wanted go through the final norm and the vocabulary projection.
  const int first_row = all_logits ? 0 : n - 1;
  project_logits(first_row, n - first_row, logits);
}

void LlamaModel::forward_batch(std::span<const SequenceTokens> batch) {
  // Everything is checked before any cache changes.
  size_t total = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceTokens& b = batch[i];
    if (b.cache == nullptr || b.tokens.empty()) throw std::invalid_argument("forward_batch: sequence without cache or tokens");
    for (size_t j = 0; j < i; ++j) {
      if (batch[j].cache == b.cache) throw std::invalid_argument("forward_batch: a cache appears twice in one batch");
    }
    if (static_cast<int>(b.tokens.size()) > b.cache->contiguous_free()) {
      throw std::invalid_argument("forward_batch: " + std::to_string(b.tokens.size()) + " tokens do not fit the " +
                                  std::to_string(b.cache->contiguous_free()) + " free slots of their cache");
    }
    for (int32_t t : b.tokens) {
      if (t < 0 || t >= hp_.n_vocab) throw std::out_of_range("token id " + std::to_string(t) + " is outside the vocabulary");
    }
    total += b.tokens.size();
  }
  if (total > static_cast<size_t>(max_batch_)) {
    throw std::invalid_argument("forward_batch: " + std::to_string(total) + " tokens exceed the batch of " +
                                std::to_string(max_batch_));
  }
  if (total == 0) return;

  std::vector<Rows>& rows = batch_rows_;
  rows.clear();
  int row = 0;
  for (const SequenceTokens& b : batch) {
    const int n = static_cast<int>(b.tokens.size());
    const int64_t pos0 = b.cache->next_position();
    rows.push_back({b.tokens, b.cache, row, pos0, b.cache->append(n)});
    row += n;
  }
  run_layers(rows, row);

  // The last row of each sequence that wants logits, gathered so that the vocabulary
  // projection is one matrix product.
  Scratch& s = *scratch_;
  const size_t d = static_cast<size_t>(hp_.n_embd), vocab = static_cast<size_t>(hp_.n_vocab);
  int wanted = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].logits == nullptr) continue;
    const size_t last = static_cast<size_t>(rows[i].row0) + batch[i].tokens.size() - 1;
    std::copy_n(&s.x[last * d], d, &s.xn[static_cast<size_t>(wanted) * d]);
    ++wanted;
  }
  if (wanted == 0) return;
  std::copy_n(s.xn.data(), static_cast<size_t>(wanted) * d, s.x.data());
  if (batch_logits_.size() < static_cast<size_t>(wanted) * vocab) batch_logits_.resize(static_cast<size_t>(wanted) * vocab);
  project_logits(0, wanted, batch_logits_.data());
  // Out to each sequence's buffer: 3 MiB at 16 sequences, split over the threads.
  std::vector<float*>& out = batch_logits_out_;
  out.clear();
  for (const SequenceTokens& b : batch) {
    if (b.logits != nullptr) out.push_back(b.logits);
  }
#pragma omp parallel for schedule(static) if (wanted > 1)
  for (int k = 0; k < wanted; ++k) std::copy_n(&batch_logits_[static_cast<size_t>(k) * vocab], vocab, out[static_cast<size_t>(k)]);
}

}  // namespace ringlm
