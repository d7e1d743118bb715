#!/usr/bin/env python3
"""Independent numpy reference of the GGUF `llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`, `qwen3moe` and `gpt-oss` forward passes.

This is the oracle that ringlm's C++ forward pass is checked against, so it is
written to be obviously correct rather than fast:

  * the model is read only through the `gguf` PyPI package (GGUFReader for the
    container, gguf.quants.dequantize for the weight formats), never through
    ringlm code, so a bug in ringlm's GGUF reader or dequantizers cannot hide
    itself by being shared with the oracle;
  * every weight is dequantized once at load time and all arithmetic is done in
    float64 by default (--dtype float32 is available to see how much of a
    difference fp32 accumulation makes);
  * the whole decoder is the ~60 lines of `forward()` below, top to bottom.

Architectures (general.architecture; hyperparameters under "<arch>."):
  llama  pre-RMSNorm decoder: RMSNorm -> q/k/v projections -> RoPE -> causal GQA
         softmax attention (scale 1/sqrt(head_dim)) -> attn_output; RMSNorm ->
         SwiGLU FFN (down(silu(gate(x)) * up(x))); final RMSNorm -> output
         (token_embd when output.weight is absent: tied embeddings).
  qwen2  llama plus biases on the q, k and v projections (blk.N.attn_{q,k,v}.bias,
         added right after the matmul; none on attn_output), and NEOX RoPE.
         llama.cpp's qwen2 also needs n_head * head_dim == n_embd.
  qwen3  llama plus a per-head RMSNorm of q and of k over head_dim
         (blk.N.attn_{q,k}_norm.weight [head_dim], the model's rms epsilon),
         applied after the projection and BEFORE RoPE; NEOX RoPE; head_dim is
         attention.key_length and may differ from n_embd / n_head (then attn_q is
         [n_embd -> n_head*head_dim] and attn_output [n_head*head_dim -> n_embd]).
  gemma3 qwen3's per-head q/k RMSNorm and NEOX RoPE, plus (HF transformers'
         Gemma3ForCausalLM, llama.cpp's LLM_ARCH_GEMMA3 graph):
         * the input embedding multiplied by sqrt(n_embd) (as llama.cpp, in full
           precision; HF rounds the factor to the weights' dtype, 25.25 for bf16 640);
         * "sandwich" norms: the attention output (after attn_output) and the FFN
           output each go through their own RMSNorm (blk.N.post_attention_norm /
           blk.N.post_ffw_norm.weight) BEFORE being added to the residual;
         * GeGLU FFN: down(gelu_tanh(gate(x)) * up(x)), the tanh-approximate GELU
           (HF "gelu_pytorch_tanh");
         * sliding-window attention on every layer except each 6th: layer il is
           global iff (il + 1) % 6 == 0. A local layer's query at position p sees only
           keys at positions s with p - s < attention.sliding_window (HF: kv_idx >
           q_idx - window; llama.cpp masks p - s >= n_swa), i.e. the last `window`
           positions including its own. No sliding_window key (or 0): every layer global;
         * RoPE base per layer kind: global layers use rope.freq_base (1e6 in real
           files) and the rope scaling; local layers use rope.freq_base_swa when the
           file has it, else 10000 (llama.cpp's default; the converter writes no such
           key), and never the scaling;
         * attention scale 1/sqrt(key_length) (llama.cpp; = HF's query_pre_attn_scalar
           for every size but 27B, where llama.cpp uses 1/sqrt(n_embd/n_head), taken
           here when block_count == 62 as llama.cpp decides);
         * norm weights are used as stored: the converter already added Gemma's +1.
         Keys llama.cpp honours that are not modelled here are refused
         (final_logit_softcapping, attention.sliding_window_pattern, the *_swa head
         sizes); attn_logit_softcapping too (llama.cpp ignores it, HF would apply it).
  phi3   HF transformers' Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4; llama.cpp's LLM_ARCH_PHI3):
         the llama layer with
         * q, k and v in one matrix, qkv_proj -> blk.N.attn_qkv.weight [n_embd -> q_dim + 2 kv_dim]:
           its first q_dim output rows are q, the next kv_dim k, the last kv_dim v (HF slices
           the projection's output in that order);
         * gate and up in one matrix, gate_up_proj -> blk.N.ffn_up.weight [n_embd -> 2 n_ff]:
           HF's `gate, up = gate_up.chunk(2)`: the first n_ff outputs are the gate, the FFN is
           down(silu(gate) * up);
         * NEOX RoPE over rope.dimension_count dims (partial: Phi-4-mini rotates 3/4 of each head,
           the rest passes through);
         * LongRoPE (Phi-3 128k): per-pair factors rope_factors_short.weight / _long.weight divide
           the inverse frequencies, and cos and sin are multiplied by rope.scaling.attn_factor.
           HF picks the long factors when the sequence so far is longer than
           rope.scaling.original_context_length; llama.cpp (get_rope_factors) when the context
           size is, and so does this reference: n_ctx of reset();
         * attention.sliding_window is ignored: llama.cpp disables Phi-3's window ("Phi SWA is
           currently disabled"), and so does this reference.
         Separate attn_q/k/v matrices are also read (llama.cpp accepts both layouts, for every
         family here).
  qwen3moe  qwen3's attention (per-head q/k RMSNorm, NEOX RoPE, key_length) with a mixture of
         experts as the FFN of every layer (below); the experts' hidden size is
         expert_feed_forward_length, or feed_forward_length / expert_used_count without that key
         (llama.cpp's fallback). feed_forward_length itself is not used.
  gpt-oss  OpenAI's gpt-oss (HF GptOssForCausalLM, llama.cpp's LLM_ARCH_OPENAI_MOE graph), a MoE
         decoder (the experts below, with the differences listed here):
         * head_dim = attention.key_length (= value_length; 64 where n_embd is 2880): attn_q is
           [n_embd -> n_head*head_dim]; q, k and v have biases (attn_{q,k,v}.bias), attn_output
           too (attn_output.bias, added after the matmul); NEOX RoPE, scale 1/sqrt(head_dim);
         * sliding-window attention on the even layers (il % 2 == 0; llama.cpp's swa pattern 2:
           is_swa = il % 2 < 1), global on the odd ones; the window is attention.sliding_window
           (required) with gemma3's rule (a query at p sees keys p - window + 1 .. p). The window
           layers use rope.freq_base_swa when the file has it, else rope.freq_base, and the SAME
           rope scaling as the global ones (YaRN on every layer: llama.cpp sets
           rope_freq_scale_train_swa = rope_freq_scale_train). attention.sliding_window_pattern
           is refused;
         * attention sinks: blk.N.attn_sinks.weight [n_head] (F32), one learned logit per head
           that joins the softmax's denominator and carries no value:
           p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink_h - m)), m = max(max_j s_j, sink_h)
           (ggml's soft_max with sinks; HF appends the sink column and drops it after softmax);
         * the FFN input norm is blk.N.post_attention_norm.weight (there is no ffn_norm): a
           pre-norm with another name, NOT gemma3's sandwich norm;
         * router with a bias (ffn_gate_inp.bias [E]); the weights are the softmax over the K
           chosen logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT: the same numbers as the
           softmax-then-renormalise below), no scale;
         * each expert has biases ffn_{gate,up}_exps.bias (GGML [n_ff_exp, E]) and
           ffn_down_exps.bias (GGML [n_embd, E]) and the clamped "SwiGLU-OAI" activation
           (ggml_swiglu_oai, alpha 1.702, limit 7): with g = gate_e h + bg_e, u = up_e h + bu_e,
           a = min(g, 7), b = clamp(u, -7, 7): down_e((a * sigmoid(1.702 a)) * (b + 1)) + bd_e;
         * the experts are expert_feed_forward_length wide (required); feed_forward_length is
           not used (optional);
         * a separate output.weight (required; no tied fallback).
         YaRN as everywhere here: llama.cpp floors/ceils the correction dims (HF's gpt-oss config
         says truncate: false, which would not); llama.cpp ignores yarn_beta_fast/_slow for
         gpt-oss (32/1, what the converter writes), the reference honours them as for the others.
  Mixture of experts (llama.cpp's build_moe_ffn with softmax gating and normalised weights, as its
  llama (Mixtral), qwen3moe and gpt-oss graphs call it): <arch>.expert_count = E > 0 (llama: optional; then
  every layer is a MoE layer) and expert_used_count = K (1 <= K <= E). A layer's FFN is, per token,
  with h = RMSNorm(x) * ffn_norm:
         logits = ffn_gate_inp @ h                       (E values; GGML [n_embd, E])
         chosen = the K largest logits, an exact tie going to the lower expert index
         w      = softmax of the chosen logits           (= softmax over all E, renormalised over K)
         out    = sum over chosen e of w_e * down_e(silu(gate_e h) * up_e h)
  where expert e of ffn_gate_exps / ffn_up_exps (GGML [n_embd, n_ff_exp, E]) is the e-th
  [n_ff_exp, n_embd] slab and of ffn_down_exps (GGML [n_ff_exp, n_embd, E]) the e-th
  [n_embd, n_ff_exp] slab (numpy order [E, rows, cols]). A llama (Mixtral) file's experts are
  feed_forward_length wide (llama.cpp ignores expert_feed_forward_length there). The chosen
  experts' counts and the smallest gap between the K-th and the (K+1)-th logit (how close the
  choice came to a tie) are kept per layer in `routing` for diagnostics.
  RoPE scaling (rope.scaling.*, as llama.cpp reads them): a missing type is "linear", "none" never
  scales; linear divides every frequency by rope.scaling.factor; "yarn" is HF's
  _compute_yarn_parameters: with s = factor, L = original_context_length and the correction
  range [floor(d(beta_fast)), ceil(d(beta_slow))] clamped to [0, n_rot - 1], where
  d(b) = n_rot ln(L / (2 pi b)) / (2 ln base) (beta_fast 32, beta_slow 1 unless the file has
  rope.scaling.yarn_beta_fast/_slow), each pair's inverse frequency is
  interp * ramp + extrap * (1 - ramp), interp = extrap / s, ramp = clamp((i - low) / (high - low), 0, 1),
  and cos and sin are multiplied by 0.1 ln(s) + 1 (s > 1) times rope.scaling.attn_factor.
  The other YaRN keys (yarn_ext_factor, yarn_attn_factor, yarn_log_multiplier) are refused:
  llama.cpp ignores them for these families. gemma3 with yarn is refused.
  Any of them: q/k/v biases are added when the file has them (llama.cpp loads them
  as optional for all of these but qwen2); a tensor the reference would not use is an error.

RoPE layout (the one detail that is easy to get silently wrong): llama.cpp maps
LLM_ARCH_LLAMA to LLAMA_ROPE_TYPE_NORM ("a normal RoPE, operating on pairs of
consecutive head values"). Its HF->GGUF converter permutes the rows of
attn_q/attn_k so that the HF "rotate_half" (NEOX, x[i] with x[i + d/2])
convention becomes rotation of ADJACENT pairs (x[2i], x[2i+1]) with
theta_i = pos * base^(-2i / n_rot). qwen2 and qwen3 are the opposite case: the
converter copies their q/k rows unpermuted, so the file keeps HF's rotate_half
layout and llama.cpp maps LLM_ARCH_QWEN2/QWEN3/GEMMA3 to LLAMA_ROPE_TYPE_NEOX: pairs
(x[i], x[i + n_rot/2]), same theta_i. The wrong pairing still gives
plausible-looking numbers but wrong text; `--rope-style` exists only to
demonstrate that (it overrides the architecture's layout).

CLI:
  python3 llama_ref.py MODEL --tokens 1,2,3 -n 32 --json OUT.json
writes {"prompt_tokens": [...], "last_logits": [n_vocab floats at the last
prompt position], "generated": [n greedy ids, not stopping at EOS]} plus
"generated_margins" (top-1 minus top-2 logit at each greedy step, a diagnostic
that tells a near-tie from a real divergence).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# One BLAS thread unless the caller says otherwise: the work is small GEMVs, and
# on a loaded 2-core machine (CTest runs tests in parallel) OpenBLAS's spinning
# threads made decoding 5-7x slower than single-threaded. Must precede numpy's import.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from gguf_fast import GGUFReader  # noqa: E402  (gguf's own reader, without np.memmap's per-read cost)

# Formats the reference promises to read. gguf.quants can dequantize more, but
# these are the ones ringlm supports, and limiting the set keeps a model in an
# unexpected format from being "verified" by accident.
SUPPORTED_TYPES = {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K,
                   QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4}

# The RoPE pairing of each architecture (llama.cpp's llama_model_rope_type; see the docstring).
ROPE_STYLE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox", "phi3": "neox",
              "qwen3moe": "neox", "gpt-oss": "neox"}
# The architectures whose FFN may be a mixture of experts (see the docstring); qwen3moe's and
# gpt-oss's always is.
MOE_ARCHS = ("llama", "qwen3moe", "gpt-oss")
# gpt-oss's expert activation (ggml_swiglu_oai's constants in llama.cpp's build_moe_ffn).
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


class GGUFModelError(RuntimeError):
    pass


def _field(reader: GGUFReader, key: str, default=None, required=True):
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFModelError(f"missing required metadata key '{key}'")
        return default
    return f.contents()


def dequantize_tensor(t) -> np.ndarray:
    """ReaderTensor -> float32 array in numpy order (ggml ne reversed)."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise GGUFModelError(f"tensor '{t.name}' has unsupported type {t.tensor_type.name}")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    # t.shape is ggml order (ne0 = contiguous row length first); numpy wants
    # the reverse. Reshape rather than trust the reader's array shape so that a
    # 1-D norm and a 2-D matrix are handled the same way.
    return np.asarray(w, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh approximation of GELU (gemma3's FFN activation; HF "gelu_pytorch_tanh")."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))   # sqrt(2/pi)


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gpt-oss's expert activation: min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)."""
    a = np.minimum(g, OAI_LIMIT)
    b = np.clip(u, -OAI_LIMIT, OAI_LIMIT)
    return a / (1.0 + np.exp(-OAI_ALPHA * a)) * (b + 1.0)


def linear(x: np.ndarray, w: np.ndarray, b=None) -> np.ndarray:
    """x @ w.T (+ b): w is [out, in] in numpy order."""
    y = x @ w.T
    return y if b is None else y + b


class LlamaModel:
    def __init__(self, path, dtype=np.float64, rope_style: str | None = None):
        """path: a GGUF file, or a GGUFReader of one already open."""
        self.dtype = np.dtype(dtype)
        r = path if isinstance(path, gguf.GGUFReader) else GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch not in ROPE_STYLE:
            raise GGUFModelError(f"unsupported architecture '{arch}' (this reference implements "
                                 f"{', '.join(repr(a) for a in ROPE_STYLE)})")
        self.arch = arch
        self.rope_style = rope_style or ROPE_STYLE[arch]   # an explicit style is for experiments only
        a = arch + "."
        self.n_embd = int(_field(r, a + "embedding_length"))
        self.n_layer = int(_field(r, a + "block_count"))
        oss = arch == "gpt-oss"
        # gpt-oss: llama.cpp reads feed_forward_length as optional (only the experts' width is used).
        self.n_ff = int(_field(r, a + "feed_forward_length", default=0, required=not oss))
        self.n_head = int(_field(r, a + "attention.head_count"))
        self.n_head_kv = int(_field(r, a + "attention.head_count_kv", default=self.n_head))
        self.eps = float(_field(r, a + "attention.layer_norm_rms_epsilon"))
        self.rope_base = float(_field(r, a + "rope.freq_base", default=10000.0))
        if self.n_embd % self.n_head:
            raise GGUFModelError(f"embedding_length {self.n_embd} not divisible by head_count {self.n_head}")
        default_hd = self.n_embd // self.n_head
        self.hd_k = int(_field(r, a + "attention.key_length", default=default_hd))
        self.hd_v = int(_field(r, a + "attention.value_length", default=default_hd))
        self.n_rot = int(_field(r, a + "rope.dimension_count", default=self.hd_k))
        if self.n_head % self.n_head_kv:
            raise GGUFModelError(f"head_count {self.n_head} not a multiple of head_count_kv {self.n_head_kv}")
        # llama.cpp rejects partial RoPE for the llama arch ("invalid n_rot") and asserts
        # n_rot == head_dim in the qwen2/qwen3 graphs; so do we, rather than define
        # semantics the runtime we compare against does not have. phi3 rotates part of each head.
        if (self.n_rot != self.hd_k and arch != "phi3") or self.n_rot % 2 or self.n_rot > self.hd_k:
            raise GGUFModelError(f"rope.dimension_count {self.n_rot} != key_length {self.hd_k} "
                                 f"(llama.cpp requires them equal for {arch})")
        if arch == "qwen2" and self.n_head * self.hd_k != self.n_embd:
            raise GGUFModelError(f"head_count * key_length = {self.n_head * self.hd_k} != embedding_length "
                                 f"{self.n_embd} (llama.cpp's qwen2 tensors are [n_embd, n_embd])")

        # RoPE scaling of the global layers (see the docstring): per layer a base and whether it
        # is scaled; the frequencies themselves are built by inv_freq().
        scaling = _field(r, a + "rope.scaling.type", default="linear", required=False)
        if scaling not in ("none", "linear", "yarn"):
            raise GGUFModelError(f"rope.scaling.type '{scaling}' not supported by the reference")
        for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier"):
            if (a + key) in r.fields:
                raise GGUFModelError(f"'{a + key}' is not modelled by this reference")
        self.scaling = scaling
        factor = _field(r, a + "rope.scaling.factor", required=False)
        self.scale_factor = float(factor) if (factor and scaling != "none") else 1.0
        self.n_ctx_orig = int(_field(r, a + "rope.scaling.original_context_length", required=False,
                                     default=_field(r, a + "context_length")))
        self.beta_fast = float(_field(r, a + "rope.scaling.yarn_beta_fast", default=32.0, required=False))
        self.beta_slow = float(_field(r, a + "rope.scaling.yarn_beta_slow", default=1.0, required=False))
        self.mscale = float(_field(r, a + "rope.scaling.attn_factor", default=1.0, required=False))
        if scaling == "yarn" and self.scale_factor > 1.0:
            self.mscale *= 0.1 * float(np.log(self.scale_factor)) + 1.0
        if scaling == "yarn" and arch == "gemma3":
            raise GGUFModelError("yarn RoPE scaling on gemma3 is not modelled by this reference")
        if oss and self.hd_v != self.hd_k:
            raise GGUFModelError("gpt-oss needs key_length == value_length (llama.cpp sizes q, k, v and "
                                 "attn_output by one head size)")

        # Attention scale and, for gemma3, the per-layer window / RoPE base / scaling.
        self.attn_scale = 1.0 / float(np.sqrt(self.hd_k))
        self.embd_scale = None
        self.window = [0] * self.n_layer                              # 0: no sliding window
        self.layer_rope = [(self.rope_base, True)] * self.n_layer    # (base, scaled)
        if arch == "gemma3":
            for key in ("final_logit_softcapping", "attn_logit_softcapping", "attention.sliding_window_pattern",
                        "attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa"):
                if (a + key) in r.fields:
                    raise GGUFModelError(f"'{a + key}' is not modelled by this reference")
            if self.hd_v != self.hd_k:
                raise GGUFModelError("gemma3 needs key_length == value_length (llama.cpp's graph uses one head size)")
            self.embd_scale = float(np.sqrt(self.n_embd))
            if self.n_layer == 62:    # llama.cpp's LLM_TYPE_27B rule (HF: query_pre_attn_scalar = 168)
                self.attn_scale = 1.0 / float(np.sqrt(self.n_embd // self.n_head))
            n_swa = int(_field(r, a + "attention.sliding_window", default=0, required=False))
            base_swa = float(_field(r, a + "rope.freq_base_swa", default=10000.0, required=False))
            if n_swa > 0:
                for il in range(self.n_layer):
                    if (il + 1) % 6 != 0:                            # local layer
                        self.window[il] = n_swa
                        self.layer_rope[il] = (base_swa, False)
        if oss:
            if (a + "attention.sliding_window_pattern") in r.fields:
                raise GGUFModelError(f"'{a}attention.sliding_window_pattern' is not modelled by this reference")
            n_swa = int(_field(r, a + "attention.sliding_window"))
            if n_swa <= 0:
                raise GGUFModelError(f"gpt-oss needs attention.sliding_window > 0 (have {n_swa})")
            base_swa = float(_field(r, a + "rope.freq_base_swa", default=self.rope_base, required=False))
            for il in range(0, self.n_layer, 2):                      # even layers: the window ones
                self.window[il] = n_swa
                self.layer_rope[il] = (base_swa, True)                # scaled like the global layers
        # Mixture of experts (see the docstring).
        self.n_expert = int(_field(r, a + "expert_count", default=0, required=False))
        self.n_expert_used = int(_field(r, a + "expert_used_count", default=0, required=False))
        if self.n_expert and arch not in MOE_ARCHS:
            raise GGUFModelError(f"'{a}expert_count' on {arch}: experts are modelled for "
                                 f"{' and '.join(MOE_ARCHS)} only")
        if arch in ("qwen3moe", "gpt-oss") and not self.n_expert:
            raise GGUFModelError(f"{arch} needs expert_count > 0 (llama.cpp refuses it too)")
        if self.n_expert and not 1 <= self.n_expert_used <= self.n_expert:
            raise GGUFModelError(f"expert_used_count {self.n_expert_used} not in [1, expert_count "
                                 f"{self.n_expert}]")
        self.n_ff_exp = self.n_ff
        if arch == "qwen3moe":
            self.n_ff_exp = int(_field(r, a + "expert_feed_forward_length", required=False,
                                       default=self.n_ff // self.n_expert_used))
        elif oss:
            self.n_ff_exp = int(_field(r, a + "expert_feed_forward_length"))
        self.routing = None
        self.context_length = int(_field(r, a + "context_length", default=0, required=False))
        self.eos_id = _field(r, "tokenizer.ggml.eos_token_id", required=False)
        self._tok_field = r.fields.get("tokenizer.ggml.tokens")
        self.tok_model = _field(r, "tokenizer.ggml.model", required=False)

        tensors = {t.name: t for t in r.tensors}
        used = set()

        def get(name, shape, required=True):
            t = tensors.get(name)
            if t is None:
                if not required:
                    return None
                raise GGUFModelError(f"missing tensor '{name}'")
            used.add(name)
            w = dequantize_tensor(t)
            if w.shape != shape:
                raise GGUFModelError(f"tensor '{name}' has shape {w.shape} (numpy order), expected {shape}")
            return w.astype(self.dtype)

        emb = tensors.get("token_embd.weight")
        if emb is None:
            raise GGUFModelError("missing tensor 'token_embd.weight'")
        self.n_vocab = int(emb.shape[1])  # ggml [n_embd, n_vocab]
        d, hk, hv = self.n_embd, self.hd_k, self.hd_v
        self.tok_embd = get("token_embd.weight", (self.n_vocab, d))
        self.output_norm = get("output_norm.weight", (d,))
        # Tied embeddings: llama.cpp falls back to token_embd when output.weight is absent
        # (not for gpt-oss, whose loader requires output.weight).
        self.tied = "output.weight" not in tensors and not oss
        self.output = self.tok_embd if self.tied else get("output.weight", (self.n_vocab, d))

        # Per-pair frequency divisors: Llama 3's rope_freqs (llama.cpp's qwen2/qwen3/gemma3/phi3
        # graphs pass none, so there the tensor is refused below) and phi3's LongRoPE factors.
        half = self.n_rot // 2
        self.rope_freqs = self.short_factors = self.long_factors = None
        if arch == "llama" and "rope_freqs.weight" in tensors:
            self.rope_freqs = get("rope_freqs.weight", (half,)).astype(np.float64)
        if arch == "phi3":
            for name in ("short", "long"):
                f = get(f"rope_factors_{name}.weight", (half,), required=False)
                setattr(self, f"{name}_factors", None if f is None else f.astype(np.float64))

        # Optional (and absent in practice) for the others; gpt-oss's files have them, but llama.cpp
        # loads them as optional there too.
        bias_required = arch == "qwen2"
        qk_norm = arch in ("qwen3", "qwen3moe", "gemma3")
        gemma = arch == "gemma3"
        nq, nk, nv = self.n_head * hk, self.n_head_kv * hk, self.n_head_kv * hv
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            L = dict(attn_norm=get(p + "attn_norm.weight", (d,)))
            if p + "attn_qkv.weight" in tensors:           # fused: q's rows, then k's, then v's
                wqkv = get(p + "attn_qkv.weight", (nq + nk + nv, d))
                L.update(wq=wqkv[:nq], wk=wqkv[nq:nq + nk], wv=wqkv[nq + nk:])
                bqkv = get(p + "attn_qkv.bias", (nq + nk + nv,), required=False)
                if bqkv is not None:
                    L.update(bq=bqkv[:nq], bk=bqkv[nq:nq + nk], bv=bqkv[nq + nk:])
            else:
                L.update(wq=get(p + "attn_q.weight", (nq, d)), wk=get(p + "attn_k.weight", (nk, d)),
                         wv=get(p + "attn_v.weight", (nv, d)))
            if "bq" not in L:
                L.update(bq=get(p + "attn_q.bias", (nq,), required=bias_required),
                         bk=get(p + "attn_k.bias", (nk,), required=bias_required),
                         bv=get(p + "attn_v.bias", (nv,), required=bias_required))
            L.update(
                q_norm=get(p + "attn_q_norm.weight", (hk,)) if qk_norm else None,
                k_norm=get(p + "attn_k_norm.weight", (hk,)) if qk_norm else None,
                wo=get(p + "attn_output.weight", (d, self.n_head * hv)),
                bo=get(p + "attn_output.bias", (d,)) if oss else None,
                sinks=get(p + "attn_sinks.weight", (self.n_head,)) if oss else None,
                post_attn_norm=get(p + "post_attention_norm.weight", (d,)) if gemma else None,
                # gpt-oss: post_attention_norm is the FFN's (pre-)norm, under another name
                ffn_norm=get(p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), (d,)),
                post_ffn_norm=get(p + "post_ffw_norm.weight", (d,)) if gemma else None,
                router=None,
            )
            if self.n_expert:                              # experts [E, rows, cols], numpy order
                E, fe = self.n_expert, self.n_ff_exp
                L.update(router=get(p + "ffn_gate_inp.weight", (E, d)),
                         w_gate=get(p + "ffn_gate_exps.weight", (E, fe, d)),
                         w_up=get(p + "ffn_up_exps.weight", (E, fe, d)),
                         w_down=get(p + "ffn_down_exps.weight", (E, d, fe)))
                if oss:                                    # biases [E, n] (GGML [n, E])
                    L.update(router_b=get(p + "ffn_gate_inp.bias", (E,)),
                             b_gate=get(p + "ffn_gate_exps.bias", (E, fe)),
                             b_up=get(p + "ffn_up_exps.bias", (E, fe)),
                             b_down=get(p + "ffn_down_exps.bias", (E, d)))
            elif arch == "phi3":                             # gate_up_proj: the gate's rows, then up's
                gate_up = get(p + "ffn_up.weight", (2 * self.n_ff, d))
                L.update(w_gate=gate_up[:self.n_ff], w_up=gate_up[self.n_ff:])
            else:
                L.update(w_gate=get(p + "ffn_gate.weight", (self.n_ff, d)), w_up=get(p + "ffn_up.weight", (self.n_ff, d)))
            if not self.n_expert:
                L.update(w_down=get(p + "ffn_down.weight", (d, self.n_ff)))
            self.layers.append(L)
        self.act = gelu_tanh if gemma else silu
        # The gated activation of the FFN / experts: act(gate) * up, or gpt-oss's clamped variant.
        self.glu = swiglu_oai if oss else (lambda g, u: self.act(g) * u)
        # A tensor we do not read may be one llama.cpp applies (an attn_output or output
        # bias, a fused attn_qkv...): refuse rather than "verify" a different model.
        unused = sorted(set(tensors) - used)
        if unused:
            raise GGUFModelError(f"tensors this reference does not model for '{arch}': "
                                 f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
        self.reset(0)

    # ---- KV cache -----------------------------------------------------------
    def reset(self, n_ctx: int):
        """Allocate an empty KV cache for n_ctx positions (prompt + generated)."""
        self.n_ctx = n_ctx
        self.n_past = 0
        if self.n_expert:
            # Per layer: how often each expert was chosen, and the smallest K-th minus (K+1)-th
            # router logit seen (inf when K == E: nothing is left out).
            self.routing = [dict(picks=np.zeros(self.n_expert, np.int64), min_gap=float("inf"))
                            for _ in range(self.n_layer)]
        self.k_cache = [np.zeros((n_ctx, self.n_head_kv, self.hd_k), self.dtype) for _ in range(self.n_layer)]
        self.v_cache = [np.zeros((n_ctx, self.n_head_kv, self.hd_v), self.dtype) for _ in range(self.n_layer)]

    # ---- RoPE ---------------------------------------------------------------
    def inv_freq(self, base: float, scaled: bool) -> np.ndarray:
        """Inverse frequency of each rotary pair (float64): base^(-2i/n_rot), then for the scaled
        (global) layers divided by the file's per-pair factors and scaled (see the docstring)."""
        half = self.n_rot // 2
        inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / self.n_rot)
        if not scaled:
            return inv
        factors = self.rope_freqs
        if self.short_factors is not None or self.long_factors is not None:   # LongRoPE, by context size
            factors = self.long_factors if self.n_ctx > self.n_ctx_orig else self.short_factors
        if factors is not None:
            inv = inv / factors
        s = self.scale_factor
        if self.scaling != "yarn":
            return inv / s
        # HF's _compute_yarn_parameters (find_correction_range, linear_ramp_factor).
        def corr_dim(turns):
            return self.n_rot * np.log(self.n_ctx_orig / (turns * 2 * np.pi)) / (2 * np.log(base))
        low = max(np.floor(corr_dim(self.beta_fast)), 0)
        high = min(np.ceil(corr_dim(self.beta_slow)), self.n_rot - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (inv / s) * (1 - extrapolation) + inv * extrapolation

    def rope(self, x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        """x: [T, heads, head_dim]; rotates the first n_rot dims of each head, cos and sin times
        the scaling's magnitude factor (1 without LongRoPE/YaRN)."""
        half = self.n_rot // 2
        # Angles in float64 regardless of dtype: ggml builds them in fp32 by
        # repeated multiplication, which is the less accurate of the two.
        theta = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
        cos = (self.mscale * np.cos(theta))[:, None, :].astype(self.dtype)
        sin = (self.mscale * np.sin(theta))[:, None, :].astype(self.dtype)
        out = x.copy()
        if self.rope_style == "norm":
            x0, x1 = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]   # adjacent pairs
            out[..., 0:self.n_rot:2] = x0 * cos - x1 * sin
            out[..., 1:self.n_rot:2] = x0 * sin + x1 * cos
        else:  # "neox": pairs (i, i + n_rot/2) -- qwen2/qwen3/gemma3/phi3, NOT llama
            x0, x1 = x[..., :half], x[..., half:self.n_rot]
            out[..., :half] = x0 * cos - x1 * sin
            out[..., half:self.n_rot] = x0 * sin + x1 * cos
        return out

    # ---- mixture of experts -------------------------------------------------------
    def moe_ffn(self, h: np.ndarray, L: dict, il: int) -> np.ndarray:
        """The FFN of a MoE layer (see the docstring) on h = RMSNorm(x) * ffn_norm, [T, d]."""
        K = self.n_expert_used
        logits = linear(h, L["router"], L.get("router_b"))              # [T, E]
        # A stable sort of the negated logits: the largest first, an exact tie to the lower index.
        order = np.argsort(-logits, axis=-1, kind="stable")
        chosen = order[:, :K]                                            # [T, K]
        top = np.take_along_axis(logits, chosen, axis=-1)                # [T, K], descending
        w = np.exp(top - top[:, :1])
        w = w / w.sum(axis=-1, keepdims=True)
        stats = self.routing[il]
        stats["picks"] += np.bincount(chosen.ravel(), minlength=self.n_expert)
        if K < self.n_expert:
            gap = top[:, -1] - np.take_along_axis(logits, order[:, K:K + 1], axis=-1)[:, 0]
            stats["min_gap"] = min(stats["min_gap"], float(gap.min()))
        out = np.zeros_like(h)
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)                         # the tokens that chose e
            he = h[rows]
            if "b_gate" in L:                                            # gpt-oss: biased experts
                g = linear(he, L["w_gate"][e], L["b_gate"][e])
                u = linear(he, L["w_up"][e], L["b_up"][e])
                y = linear(self.glu(g, u), L["w_down"][e], L["b_down"][e])
            else:
                y = self.glu(he @ L["w_gate"][e].T, he @ L["w_up"][e].T) @ L["w_down"][e].T
            out[rows] += w[rows, slot][:, None] * y
        return out

    # ---- forward ------------------------------------------------------------
    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions n_past..n_past+T-1, appending to the KV
        cache. Returns logits of the last position ([n_vocab]) or of all ([T, n_vocab])."""
        x = self.hidden_states(tokens)
        if not all_logits:
            x = x[-1:]
        logits = rms_norm(x, self.output_norm, self.eps) @ self.output.T
        return logits if all_logits else logits[0]

    def final_hidden(self, tokens) -> np.ndarray:
        """Every position's final hidden state after the output norm ([T, n_embd]): what an
        embedding pools (llama.cpp's result_norm), the logits being it times output.T."""
        return rms_norm(self.hidden_states(tokens), self.output_norm, self.eps)

    def hidden_states(self, tokens) -> np.ndarray:
        """The layers over `tokens` (appended to the KV cache, as forward()): the residual stream
        after the last layer, [T, n_embd], before the output norm."""
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        start = self.n_past
        if start + T > self.n_ctx:
            raise ValueError(f"KV cache too small: {start + T} > {self.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        pos = np.arange(start, start + T)
        S = start + T                                   # keys visible to the last query
        group = self.n_head // self.n_head_kv
        # Scales are Python floats, not np.float64: under NumPy 2 promotion rules a float64
        # scalar would silently turn a float32 run into mixed-precision (and off BLAS).
        scale = self.attn_scale
        # Causal mask: query t (absolute position start+t) sees keys s <= start+t.
        # A sliding window w also hides keys with start+t - s >= w.
        dist = pos[:, None] - np.arange(S)[None, :]      # [T, S] query position - key position
        masks = {w: ((dist < 0) | (dist >= w)) if w else (dist < 0) for w in set(self.window)}   # True = hidden

        x = self.tok_embd[tokens]                        # [T, d]
        if self.embd_scale is not None:                  # gemma3
            x = x * self.embd_scale
        for il, L in enumerate(self.layers):
            mask = masks[self.window[il]]
            inv_freq = self.inv_freq(*self.layer_rope[il])
            h = rms_norm(x, L["attn_norm"], self.eps)
            q = linear(h, L["wq"], L["bq"]).reshape(T, self.n_head, self.hd_k)
            k = linear(h, L["wk"], L["bk"]).reshape(T, self.n_head_kv, self.hd_k)
            v = linear(h, L["wv"], L["bv"]).reshape(T, self.n_head_kv, self.hd_v)
            if L["q_norm"] is not None:                  # qwen3, gemma3: per-head RMSNorm, before RoPE
                q, k = rms_norm(q, L["q_norm"], self.eps), rms_norm(k, L["k_norm"], self.eps)
            q, k = self.rope(q, pos, inv_freq), self.rope(k, pos, inv_freq)
            self.k_cache[il][start:S] = k
            self.v_cache[il][start:S] = v
            K, V = self.k_cache[il][:S], self.v_cache[il][:S]   # [S, n_kv, hd]

            # GQA without copying K/V: query head h = g*group + r uses kv head g = h // group.
            qg = q.reshape(T, self.n_head_kv, group, self.hd_k)
            scores = np.einsum("tgrd,sgd->grts", qg, K) * scale          # [n_kv, group, T, S]
            scores = np.where(mask, -np.inf, scores)
            if L["sinks"] is None:
                scores = scores - scores.max(axis=-1, keepdims=True)
                p = np.exp(scores)
                p /= p.sum(axis=-1, keepdims=True)
            else:                                        # gpt-oss: one extra logit per head, no value
                sink = L["sinks"].reshape(self.n_head_kv, group)[:, :, None, None]
                m = np.maximum(scores.max(axis=-1, keepdims=True), sink)
                p = np.exp(scores - m)
                p /= p.sum(axis=-1, keepdims=True) + np.exp(sink - m)
            attn = np.einsum("grts,sgd->tgrd", p, V).reshape(T, self.n_head * self.hd_v)
            o = linear(attn, L["wo"], L["bo"])
            if L["post_attn_norm"] is not None:          # gemma3: norm before the residual add
                o = rms_norm(o, L["post_attn_norm"], self.eps)
            x = x + o

            h = rms_norm(x, L["ffn_norm"], self.eps)
            if L["router"] is not None:
                f = self.moe_ffn(h, L, il)
            else:
                f = self.glu(h @ L["w_gate"].T, h @ L["w_up"].T) @ L["w_down"].T
            if L["post_ffn_norm"] is not None:           # gemma3
                f = rms_norm(f, L["post_ffn_norm"], self.eps)
            x = x + f

        assert x.dtype == self.dtype, x.dtype
        self.n_past = S
        return x

    # ---- greedy generation ----------------------------------------------------
    def generate(self, prompt, n: int):
        """Prefill `prompt`, then n greedy steps (no EOS stop).
        Returns (last prompt logits, generated ids, top1-top2 margin per step)."""
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        self.reset(len(prompt) + n)
        logits = self.forward(prompt)
        last_logits = logits
        generated, margins = [], []
        for i in range(n):
            # np.argmax returns the lowest index on an exact tie; ringlm's greedy
            # sampler must break ties the same way for ids to match.
            tok = int(np.argmax(logits))
            top2 = np.partition(logits, -2)[-2:]
            generated.append(tok)
            margins.append(float(top2[1] - top2[0]))
            if i + 1 < n:
                logits = self.forward([tok])
        return last_logits, generated, margins

    # ---- display only ---------------------------------------------------------
    def routing_summary(self):
        """Lines describing the expert choices since reset() (none for a dense model)."""
        if not self.routing:
            return []
        lines = [f"routing: {self.n_expert_used} of {self.n_expert} experts per token"]
        for il, st in enumerate(self.routing):
            unused = int((st["picks"] == 0).sum())
            lines.append(f"  layer {il}: picks {st['picks'].tolist()} ({unused} unused), "
                         f"smallest K-th - (K+1)-th logit gap {st['min_gap']:.3g}")
        return lines

    def detokenize(self, ids) -> str:
        """Crude detokenizer for human inspection (not used in any comparison)."""
        if self._tok_field is None:
            return ""
        pieces = [self._tok_field.contents(int(i)) for i in ids]
        if self.tok_model == "gpt2":
            # GPT-2 byte-level BPE: each byte was mapped to a printable code point.
            bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
            cs = bs[:]
            n = 0
            for b in range(256):
                if b not in bs:
                    bs.append(b)
                    cs.append(256 + n)
                    n += 1
            dec = {chr(c): b for b, c in zip(bs, cs)}
            data = bytes(dec.get(ch, ord("?")) for piece in pieces for ch in piece)
            return data.decode("utf-8", errors="replace")
        out = bytearray()
        for piece in pieces:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(int(piece[3:5], 16))
            else:
                out += piece.replace("\u2581", " ").encode("utf-8")
        return out.decode("utf-8", errors="replace")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    ap.add_argument("-n", type=int, default=32, help="greedy tokens to generate (default 32)")
    ap.add_argument("--json", help="write the result JSON here (default: stdout)")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--rope-style", choices=["norm", "neox"],
                    help="experiments only: override the architecture's RoPE pairing "
                         "(llama: norm = adjacent pairs; qwen2/qwen3/gemma3: neox = (i, i + n_rot/2))")
    ap.add_argument("--show-text", action="store_true", help="print the decoded continuation to stderr")
    ap.add_argument("--show-routing", action="store_true",
                    help="MoE models: print each layer's expert choices and closest K-th/(K+1)-th gap to stderr")
    args = ap.parse_args(argv)

    prompt = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
    t0 = time.perf_counter()
    try:
        model = LlamaModel(args.model, dtype=np.dtype(args.dtype), rope_style=args.rope_style)
    except GGUFModelError as e:
        print(f"llama_ref: {args.model}: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    last_logits, generated, margins = model.generate(prompt, args.n)
    t2 = time.perf_counter()

    result = {"prompt_tokens": prompt,
              "last_logits": [float(v) for v in last_logits],
              "generated": generated,
              "generated_margins": margins}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    else:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    print(f"llama_ref: load {t1 - t0:.2f}s, prompt {len(prompt)} + generate {args.n} tokens {t2 - t1:.2f}s "
          f"({args.dtype}, {model.n_layer} layers, vocab {model.n_vocab})", file=sys.stderr)
    if args.show_routing:
        for line in model.routing_summary():
            print(f"llama_ref: {line}", file=sys.stderr)
    if args.show_text:
        print(f"llama_ref: generated ids {generated}", file=sys.stderr)
        print(f"llama_ref: text {model.detokenize(prompt)!r} + {model.detokenize(generated)!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
