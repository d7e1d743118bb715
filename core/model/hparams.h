// What a GGUF file says about its decoder: the family (an entry of the table of supported
// architectures, each saying what it adds to the Llama layer) and the hyperparameters, RoPE
// scaling included, read and checked. The forward pass (llama.cpp) reads these; nothing here runs.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "backends/backend.h"
#include "core/gguf/gguf.h"
#include "core/model/sequence_tokens.h"

namespace ringlm {

enum class RopeStyle {
  kAdjacentPairs,  // GGML "normal": rotates (x[2i], x[2i+1]); llama GGUFs are converted for this
  kHalfSplit,      // GGML "neox": rotates (x[i], x[i + n_rot/2])
};

// How the rotary frequencies are stretched past the trained context (<arch>.rope.scaling.type).
enum class RopeScaling {
  kNone,
  kLinear,  // every frequency divided by the factor (positions interpolated)
  kYarn,    // YaRN: low frequencies interpolated, high ones kept, a ramp between; q and k scaled up
};

struct LlamaHparams {
  std::string arch;
  int n_vocab = 0;
  int n_ctx_train = 0;
  int n_embd = 0;
  int n_layer = 0;
  int n_ff = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;   // key/value length per head
  int n_rot = 0;      // rotary dimensions (<= head_dim)
  float rope_base = 10000.0f;
  RopeStyle rope_style = RopeStyle::kAdjacentPairs;
  // RoPE scaling. The frequencies of the global layers only (Gemma 3's sliding-window layers are
  // never scaled); rope_mscale() multiplies every layer's rotations, as in llama.cpp.
  RopeScaling rope_scaling = RopeScaling::kNone;
  float rope_scale = 1.0f;  // rope.scaling.factor: the context multiplier
  // rope.scaling.original_context_length (default: context_length): the context the model was
  // trained for before scaling; YaRN's ramp and LongRoPE's choice of factors depend on it.
  int rope_n_ctx_orig = 0;
  // YaRN's ramp: rotary pairs turning more than yarn_beta_fast times over the original context keep
  // their frequency, those turning fewer than yarn_beta_slow times are interpolated by the factor.
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
  // rope.scaling.attn_factor: multiplies cos and sin of the rotations of q and k (LongRoPE's
  // magnitude correction; with YaRN, on top of its own).
  float rope_attn_factor = 1.0f;
  // What cos and sin of the forward pass's rotations are multiplied by: rope_attn_factor, times
  // YaRN's 1 + 0.1 ln(factor). Never applied by the StreamingLLM shift, which is a pure rotation.
  float rope_mscale() const;
  float rms_eps = 1e-5f;
  bool qkv_bias = false;  // the family's q/k/v projections have biases (Qwen2)
  bool qk_norm = false;   // ... RMSNorm every head of q and k before RoPE (Qwen3, Gemma 3)
  Activation activation = Activation::kSilu;  // of the gated feed-forward block (Gemma: GELU)
  bool post_norms = false;   // RMSNorm of each block's output before the residual (Gemma 3)
  bool embed_scale = false;  // embeddings times sqrt(n_embd) (Gemma)
  bool fused_gate_up = false;  // ffn_up holds gate then up, 2 * n_ff rows (Phi-3)
  bool attn_sinks = false;     // per-head learned sinks in the attention softmax (gpt-oss)
  bool attn_out_bias = false;  // attn_output.bias (gpt-oss, or any file that has it)
  bool expert_biases = false;  // the router's and every expert's matrices have biases (gpt-oss)
  bool ffn_norm_post_attention = false;  // the FFN's input norm is named post_attention_norm (gpt-oss)
  // Attention scores are q·k times this: 1/sqrt(head_dim), but Gemma 3 27B's 1/sqrt(n_embd / n_head).
  float attn_scale = 0.0f;
  // Sliding-window layers (Gemma 3, gpt-oss): all but every swa_period-th layer see the last
  // sliding_window positions, with RoPE base swa_rope_base, scaled as the global layers' only when
  // swa_rope_scaled (gpt-oss; Gemma 3's never are). 0: none.
  int sliding_window = 0;
  int swa_period = 0;
  float swa_rope_base = 0.0f;
  bool swa_rope_scaled = false;
  // Mixture of experts (<arch>.expert_count > 0): every layer's feed-forward block is n_expert
  // experts of n_ff_exp hidden units each, of which a router picks n_expert_used per token.
  // Their outputs are summed with the router's softmax weights over the chosen experts' logits
  // (renormalised: every family here; a file that says otherwise is refused). gpt-oss adds
  // biases to the router and to every expert's products (expert_biases).
  int n_expert = 0;
  int n_expert_used = 0;
  int n_ff_exp = 0;
  bool moe() const { return n_expert > 0; }
  // How an embedding pools the final hidden states: <arch>.pooling_type when the file has it (an
  // embedding model's conversion writes it), else mean, llama.cpp's choice for a generative model
  // asked for embeddings (pooling_from_file false).
  Pooling pooling = Pooling::kMean;
  bool pooling_from_file = false;

  // Reads and checks every field; GgufError naming the key on a missing or absurd value.
  static LlamaHparams from_gguf(const GgufFile& gguf);
};

// The families that run on this decoder, as data: what each adds to the Llama layer. The RoPE
// layout is the one their GGUF conversion leaves: llama.cpp's converter permutes Llama's q/k
// rows for adjacent pairs, and leaves Qwen's, Gemma's and Phi's in the NeoX layout of the
// original checkpoints. Any family's file may hold q, k and v as one fused attn_qkv matrix (Phi-3's
// always do), as llama.cpp accepts for all of them: that is the file's layout, not the family's.
struct ArchInfo {
  std::string_view name;
  RopeStyle rope_style;
  bool qkv_bias = false;   // attn_q/k/v.bias, added to the projections (Qwen2)
  bool qk_norm = false;    // attn_q_norm / attn_k_norm: RMSNorm of every head of q and k before RoPE
  Activation activation = Activation::kSilu;  // of the gated feed-forward block
  bool post_norms = false;   // post_attention_norm / post_ffw_norm on each block's output, before the residual
  bool embed_scale = false;  // token embeddings multiplied by sqrt(n_embd)
  // ffn_up [n_embd -> 2 * n_ff] holds the gate's rows, then up's (no ffn_gate): the feed-forward
  // block is act(first half) * second half, as llama.cpp's SwiGLU of a fused tensor.
  bool fused_gate_up = false;
  bool rope_freqs = false;  // may carry rope_freqs.weight: per-pair frequency divisors (Llama 3.1+)
  // May carry LongRoPE's rope_factors_short.weight / rope_factors_long.weight (Phi-3 128k): the
  // short ones for a context up to rope.scaling.original_context_length, the long ones past it.
  bool long_rope = false;
  // <arch>.attention.sliding_window is read and ignored: llama.cpp disables Phi-3's sliding window
  // ("Phi SWA is currently disabled", its phi3 hparams), the converters' windows not being what the
  // checkpoints use consistently; every layer attends to the whole context, as there.
  bool ignores_sliding_window = false;
  // Sliding-window layers (<arch>.attention.sliding_window, when the file gives one): every
  // layer but each swa_period-th, with RoPE base <arch>.rope.freq_base_swa (default
  // swa_rope_base; 0: the global layers' base) and, unless swa_rope_scaled, no RoPE scaling
  // (which is the global layers').
  int swa_period = 0;
  float swa_rope_base = 0.0f;
  bool swa_rope_scaled = false;
  // gpt-oss: learned per-head attention sinks (attn_sinks.weight, a logit with no value in every
  // softmax's denominator), attn_output.bias, biases on the router and on every expert's three
  // products, and the FFN's input norm stored as post_attention_norm.weight.
  bool attn_sinks = false;
  bool attn_out_bias = false;
  bool expert_biases = false;
  bool ffn_norm_post_attention = false;
  // A model of this many layers scales its attention scores by 1/sqrt(n_embd / n_head) instead of
  // 1/sqrt(head_dim): Gemma 3 27B's query_pre_attn_scalar, which llama.cpp applies by layer count.
  int wide_query_scale_n_layer = 0;
  // Mixture-of-experts files of this family (<arch>.expert_count) are read: Mixtral's `llama`,
  // and `qwen3moe`, which always is one (moe_only).
  bool experts = false;
  bool moe_only = false;
};

// The family `name`, or nullptr when it is not one this decoder runs.
const ArchInfo* find_arch(std::string_view name);

// The inverse frequency of every rotary pair of `hp`'s RoPE for `base`, the file's per-pair
// factors and (when `scaled`) its RoPE scaling folded in.
std::vector<double> rope_frequencies(const LlamaHparams& hp, double base, const std::vector<float>* factors, bool scaled);

}  // namespace ringlm
