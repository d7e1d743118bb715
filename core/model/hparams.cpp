#include "core/model/hparams.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace ringlm {

namespace {

constexpr ArchInfo kSupportedArchs[] = {
    {.name = "llama", .rope_style = RopeStyle::kAdjacentPairs, .rope_freqs = true, .experts = true},
    {.name = "qwen2", .rope_style = RopeStyle::kHalfSplit, .qkv_bias = true},
    {.name = "qwen3", .rope_style = RopeStyle::kHalfSplit, .qk_norm = true},
    {.name = "qwen3moe", .rope_style = RopeStyle::kHalfSplit, .qk_norm = true, .experts = true, .moe_only = true},
    {.name = "gemma3",
     .rope_style = RopeStyle::kHalfSplit,
     .qk_norm = true,
     .activation = Activation::kGeluTanh,
     .post_norms = true,
     .embed_scale = true,
     .swa_period = 6,
     .swa_rope_base = 10000.0f,
     .wide_query_scale_n_layer = 62},
    // gpt-oss (llama.cpp's openai-moe): experts in MXFP4 with biases and a clamped SwiGLU, every
    // other layer a sliding window with the same YaRN RoPE as the global ones, attention sinks.
    {.name = "gpt-oss",
     .rope_style = RopeStyle::kHalfSplit,
     .qkv_bias = true,
     .activation = Activation::kSwigluOai,
     .swa_period = 2,
     .swa_rope_scaled = true,
     .attn_sinks = true,
     .attn_out_bias = true,
     .expert_biases = true,
     .ffn_norm_post_attention = true,
     .experts = true,
     .moe_only = true},
    {.name = "phi3",
     .rope_style = RopeStyle::kHalfSplit,
     .fused_gate_up = true,
     .long_rope = true,
     .ignores_sliding_window = true},
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

float positive_float(const GgufFile& gguf, const std::string& key, double fallback) {
  const double v = gguf.get_float(key).value_or(fallback);
  if (!(v > 0.0) || !std::isfinite(v) || v > 1e30) gguf.fail("metadata '" + key + "': must be a positive number");
  return static_cast<float>(v);
}

// <arch>.rope.scaling.*, as llama.cpp reads them: a missing type is linear (so a bare factor
// scales), "none" never scales, and rope.scale_linear is the factor's old name.
void read_rope_scaling(const GgufFile& gguf, const std::string& p, const ArchInfo& arch, LlamaHparams& hp) {
  const std::string type(gguf.get_string(p + "rope.scaling.type").value_or("linear"));
  if (type == "none") {
    hp.rope_scaling = RopeScaling::kNone;
  } else if (type == "linear") {
    hp.rope_scaling = RopeScaling::kLinear;
  } else if (type == "yarn") {
    hp.rope_scaling = RopeScaling::kYarn;
  } else {
    gguf.fail("metadata '" + p + "rope.scaling.type': '" + type + "' is not supported (none, linear, yarn)");
  }
  if (hp.rope_scaling != RopeScaling::kNone) {
    const std::string key = p + (gguf.find(p + "rope.scaling.factor") ? "rope.scaling.factor" : "rope.scale_linear");
    if (gguf.get_float(key).value_or(0.0) != 0.0) hp.rope_scale = positive_float(gguf, key, 1.0);  // 0: none, as llama.cpp
  }
  hp.rope_n_ctx_orig = hp.n_ctx_train;
  if (auto v = gguf.get_uint(p + "rope.scaling.original_context_length")) {
    hp.rope_n_ctx_orig = checked_dim(gguf, p + "rope.scaling.original_context_length", *v, uint64_t{1} << 24);
  }
  // Read for every family, as HF's YaRN does; llama.cpp reads them only for some (Grok, Mistral 3)
  // and uses 32 and 1 for the others, which is what files without the keys get here.
  hp.yarn_beta_fast = positive_float(gguf, p + "rope.scaling.yarn_beta_fast", 32.0);
  hp.yarn_beta_slow = positive_float(gguf, p + "rope.scaling.yarn_beta_slow", 1.0);
  hp.rope_attn_factor = positive_float(gguf, p + "rope.scaling.attn_factor", 1.0);
  if (hp.rope_scaling == RopeScaling::kYarn && arch.swa_period > 0 && !arch.swa_rope_scaled) {
    gguf.fail("metadata '" + p + "rope.scaling.type': yarn is not supported for a family whose sliding-window layers are unscaled");
  }
}

// <arch>.expert_count and the keys that go with it. Shared experts (Qwen2-MoE's, DeepSeek's) and
// other gating functions are refused by name.
void read_experts(const GgufFile& gguf, const std::string& p, const ArchInfo& arch, LlamaHparams& hp) {
  const uint64_t n_expert = gguf.get_uint(p + "expert_count").value_or(0);
  if (n_expert == 0) {
    if (arch.moe_only) gguf.fail("missing metadata '" + p + "expert_count'");
    return;
  }
  if (!arch.experts) gguf.fail("metadata '" + p + "expert_count': mixtures of experts are not supported for '" + hp.arch + "'");
  hp.n_expert = checked_dim(gguf, p + "expert_count", n_expert, 4096);
  hp.n_expert_used = checked_dim(gguf, p + "expert_used_count", gguf.require_uint(p + "expert_used_count"),
                                 static_cast<uint64_t>(hp.n_expert));
  // Mixtral's experts are feed_forward_length wide; Qwen3-MoE's and gpt-oss's
  // expert_feed_forward_length, or (as llama.cpp falls back) feed_forward_length / expert_used_count.
  hp.n_ff_exp = hp.n_ff;
  if (arch.moe_only) {
    const auto v = gguf.get_uint(p + "expert_feed_forward_length");
    hp.n_ff_exp = v ? checked_dim(gguf, p + "expert_feed_forward_length", *v, 1 << 20) : std::max(1, hp.n_ff / hp.n_expert_used);
  }
  // Every family here weighs the chosen experts by the softmax over their logits alone: Mixtral's
  // and gpt-oss's directly, Qwen3-MoE's renormalised (llama.cpp reads no key for it there).
  if (auto v = gguf.get_bool(p + "expert_weights_norm"); v && !*v) {
    gguf.fail("metadata '" + p + "expert_weights_norm': false is not supported for '" + hp.arch + "'");
  }
  // llama.cpp's gating functions: 1 is the softmax, the only one these families use.
  if (auto v = gguf.get_uint(p + "expert_gating_func"); v && *v != 1) {
    gguf.fail("metadata '" + p + "expert_gating_func': " + std::to_string(*v) + " is not supported (only 1, the softmax)");
  }
  if (auto v = gguf.get_float(p + "expert_weights_scale"); v && *v != 1.0) {
    gguf.fail("metadata '" + p + "expert_weights_scale': only 1 is supported");
  }
  for (const char* key : {"expert_shared_count", "expert_shared_feed_forward_length", "leading_dense_block_count"}) {
    if (gguf.find(p + key) != nullptr) gguf.fail("metadata '" + p + key + "' is not supported (shared or dense expert layers)");
  }
}

}  // namespace

const ArchInfo* find_arch(std::string_view name) {
  for (const ArchInfo& a : kSupportedArchs) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

float LlamaHparams::rope_mscale() const {
  // YaRN's magnitude correction, 0.1 ln(s) + 1 for a factor s > 1 (llama.cpp: yarn_attn_factor
  // divided by it, ggml's rope_yarn multiplied by it again: the product is this).
  const bool yarn = rope_scaling == RopeScaling::kYarn && rope_scale > 1.0f;
  return rope_attn_factor * (yarn ? 1.0f + 0.1f * std::log(rope_scale) : 1.0f);
}

LlamaHparams LlamaHparams::from_gguf(const GgufFile& gguf) {
  LlamaHparams hp;
  hp.arch = std::string(gguf.require_string("general.architecture"));
  const ArchInfo* arch = find_arch(hp.arch);
  if (arch == nullptr) gguf.fail("unsupported architecture '" + hp.arch + "' (supported: " + supported_arch_names() + ")");
  hp.rope_style = arch->rope_style;
  hp.qkv_bias = arch->qkv_bias;
  hp.qk_norm = arch->qk_norm;
  hp.activation = arch->activation;
  hp.post_norms = arch->post_norms;
  hp.embed_scale = arch->embed_scale;
  hp.fused_gate_up = arch->fused_gate_up;
  hp.attn_sinks = arch->attn_sinks;
  hp.attn_out_bias = arch->attn_out_bias;
  hp.expert_biases = arch->expert_biases;
  hp.ffn_norm_post_attention = arch->ffn_norm_post_attention;

  const std::string p = hp.arch + ".";
  auto dim = [&](const std::string& key, uint64_t max) { return checked_dim(gguf, key, gguf.require_uint(key), max); };
  hp.n_ctx_train = dim(p + "context_length", uint64_t{1} << 24);
  hp.n_embd = dim(p + "embedding_length", 1 << 16);
  hp.n_layer = dim(p + "block_count", 1024);
  hp.n_ff = dim(p + "feed_forward_length", 1 << 20);
  read_experts(gguf, p, *arch, hp);
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
  read_rope_scaling(gguf, p, *arch, hp);
  // Gemma 3 27B's scale, by layer count as llama.cpp decides it (with its integer division).
  const bool wide_query = arch->wide_query_scale_n_layer > 0 && hp.n_layer == arch->wide_query_scale_n_layer;
  hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(wide_query ? hp.n_embd / hp.n_head : hp.head_dim));
  if (arch->swa_period == 0 && !arch->ignores_sliding_window && gguf.get_uint(p + "attention.sliding_window").value_or(0) > 0) {
    gguf.fail("metadata '" + p + "attention.sliding_window' is not supported for '" + hp.arch + "'");
  }
  if (arch->swa_period > 0) {
    // A window of 0 (or none) makes every layer global.
    const uint64_t window = gguf.get_uint(p + "attention.sliding_window").value_or(0);
    if (window > (uint64_t{1} << 24)) {
      gguf.fail("metadata '" + p + "attention.sliding_window': " + std::to_string(window) + " is out of range");
    }
    hp.sliding_window = static_cast<int>(window);
    if (hp.sliding_window > 0) {
      hp.swa_period = arch->swa_period;
      hp.swa_rope_scaled = arch->swa_rope_scaled;
      const double base = arch->swa_rope_base > 0.0f ? arch->swa_rope_base : hp.rope_base;
      hp.swa_rope_base = static_cast<float>(gguf.get_float(p + "rope.freq_base_swa").value_or(base));
      if (!(hp.swa_rope_base > 1.0f) || !std::isfinite(hp.swa_rope_base)) {
        gguf.fail("metadata '" + p + "rope.freq_base_swa': must be > 1");
      }
    }
  }
  // What this decoder does not model is refused, never ignored. (The YaRN variants' keys are read
  // by llama.cpp only for Grok, DeepSeek and Mistral 3, whose decoders these are not.)
  for (const char* key : {"attention.sliding_window_pattern", "final_logit_softcapping", "attn_logit_softcapping",
                          "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
                          "rope.scaling.yarn_log_multiplier"}) {
    if (gguf.find(p + key) != nullptr) gguf.fail("metadata '" + p + key + "' is not supported");
  }
  if (auto v = gguf.get_uint(p + "pooling_type")) {
    if (*v > static_cast<uint64_t>(Pooling::kRank)) {
      gguf.fail("metadata '" + p + "pooling_type': " + std::to_string(*v) +
                " is not a pooling type (0 none, 1 mean, 2 cls, 3 last, 4 rank)");
    }
    hp.pooling = static_cast<Pooling>(*v);
    hp.pooling_from_file = true;
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

namespace {

// YaRN's correction dimension: the rotary dimension whose pair turns n_turns times over the
// original context, n_rot * ln(n_ctx_orig / (2 pi n_turns)) / (2 ln base) (ggml's
// ggml_rope_yarn_corr_dim; HF's find_correction_dim).
double yarn_corr_dim(int n_rot, int n_ctx_orig, double n_turns, double base) {
  return n_rot * std::log(n_ctx_orig / (n_turns * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

}  // namespace

// The inverse frequency of every rotary pair i: base^(-2i / n_rot), divided by the file's per-pair
// factors (Llama 3's rope_freqs, LongRoPE's), then scaled. Linear scaling divides every frequency
// by the factor s. YaRN mixes, per pair, the interpolated frequency (divided by s) with the
// original one: pairs below the ramp (many turns over the original context) keep theirs, pairs
// past it are interpolated. Both are linear in the position, so the forward pass and the shift
// need nothing else; YaRN's magnitude factor is LlamaHparams::rope_mscale(), apart.
std::vector<double> rope_frequencies(const LlamaHparams& hp, double base, const std::vector<float>* factors, bool scaled) {
  const int half = hp.n_rot / 2;
  const double s = scaled ? hp.rope_scale : 1.0;
  double ramp_low = 0.0, ramp_high = 0.0;
  if (scaled && hp.rope_scaling == RopeScaling::kYarn) {
    ramp_low = std::max(0.0, std::floor(yarn_corr_dim(hp.n_rot, hp.rope_n_ctx_orig, hp.yarn_beta_fast, base)));
    ramp_high = std::min(hp.n_rot - 1.0, std::ceil(yarn_corr_dim(hp.n_rot, hp.rope_n_ctx_orig, hp.yarn_beta_slow, base)));
  }
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    double f = std::pow(base, -2.0 * i / hp.n_rot);
    if (factors != nullptr) f /= (*factors)[static_cast<size_t>(i)];
    if (scaled && hp.rope_scaling == RopeScaling::kYarn) {
      const double ramp = std::clamp((i - ramp_low) / std::max(0.001, ramp_high - ramp_low), 0.0, 1.0);
      f = f / s * ramp + f * (1.0 - ramp);  // ramp 0: kept; 1: interpolated
    } else {
      f /= s;
    }
    inv_freq[static_cast<size_t>(i)] = f;
  }
  return inv_freq;
}


}  // namespace ringlm
