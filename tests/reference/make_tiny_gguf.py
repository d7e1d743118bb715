#!/usr/bin/env python3
"""Write a small llama / qwen2 / qwen3 / gemma3 / phi3 / qwen3moe / gpt-oss GGUF with random weights, for fast unit tests.

    make_tiny_gguf.py OUT.gguf --vocab ../shared/data/vocab/ggml-vocab-starcoder.gguf \
        [--type Q4_0] [--untied] [--n-layer 2] [--n-head 4 --n-head-kv 2] [--seed 0] ...

The tokenizer is copied from --vocab (every tokenizer.ggml.* key, plus
tokenizer.chat_template if present), so the file loads with a real tokenizer and
n_vocab equals that vocabulary's token count. Weights are random but scaled so
that activations stay O(1) through the layers and logits have a healthy spread
(greedy picks are then far from ties, and fp32 and fp64 agree on them).

--arch qwen2 adds random F32 biases blk.N.attn_{q,k,v}.bias; --arch qwen3 adds
random F32 per-head norms blk.N.attn_{q,k}_norm.weight [head dim] and always
writes attention.key_length/value_length (--head-dim may differ from
n_embd/n_head there). For both, rope.dimension_count is written only when
--rope-dims is given, as llama.cpp's converter does. The q/k rows need no
permutation for their NEOX RoPE: the weights are random either way.

--arch gemma3 writes qwen3's q/k norms and key_length/value_length, plus the
post-norms blk.N.post_attention_norm / blk.N.post_ffw_norm.weight (F32, near 1,
like every norm here), attention.sliding_window = --sliding-window (default 8,
so prompts of a few dozen tokens cross it; 0 omits the key: every layer global),
rope.freq_base = --rope-base (default 1e6 for gemma3, as in the real files, so
that the global base differs from the local layers' 10000) and, only when
--rope-base-swa is given, rope.freq_base_swa; rope.dimension_count only with
--rope-dims (the real files have none). Every 6th layer (il % 6 == 5) is
global: use --n-layer 6 or more to have both kinds.

--arch phi3 writes Phi-3's layout: q, k and v in one blk.N.attn_qkv.weight (q's rows, then
k's, then v's) and gate and up in one blk.N.ffn_up.weight (the gate's n_ff rows, then up's; no
ffn_gate), rope.dimension_count (always, as the converter; --rope-dims below the head size for
Phi-4-mini's partial rotary), rope.scaling.original_context_length (= --ctx) and
attention.sliding_window = --sliding-window (which llama.cpp, and so ringlm, ignores for phi3).
--long-rope N makes it a LongRoPE file (Phi-3 128k): original_context_length N,
rope_factors_short.weight (random, 1 to 1.5) and rope_factors_long.weight (random, growing from 1
to ~20 over the pairs), rope.scaling.attn_factor = sqrt(1 + ln(ctx / N) / ln N) as the converter
computes it. --fused-qkv writes the fused attn_qkv (and a fused attn_qkv.bias for qwen2) for the
other families too.

--rope-freqs N (llama) writes Llama 3.1's rope_freqs.weight as the converter computes it
(factor 8, low/high frequency factors 1 and 4) for an original context of N.

Mixture of experts (llama.cpp's layout): --n-expert E --n-expert-used K replaces every layer's
ffn_gate/ffn_up/ffn_down with a router blk.N.ffn_gate_inp.weight (GGML [n_embd, E], --router-type,
default F32, random with a logit spread of about --router-scale so that tokens pick different
experts) and the experts stacked along a third dimension: blk.N.ffn_gate_exps.weight and
ffn_up_exps.weight (GGML [n_embd, n_ff_exp, E]), ffn_down_exps.weight (GGML [n_ff_exp, n_embd, E]),
in --type; keys <arch>.expert_count and <arch>.expert_used_count. With --arch llama that is a
Mixtral file (the experts' hidden size is feed_forward_length = --n-ff). --arch qwen3moe is
qwen3's attention (q/k norms, NEOX RoPE, key_length) with experts on every layer (E > 0 required)
and qwen3moe.expert_feed_forward_length = --n-ff-exp (default 32, or 256 with a 256-block type;
feed_forward_length is --n-ff, unused by the layers, as in the real files).

--arch gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE; E > 0 required) is OpenAI's gpt-oss layout, tensors and
keys as conversion/gpt_oss.py writes them: per layer attn_norm, q/k/v with random F32 biases
attn_{q,k,v}.bias, attn_output.weight and .bias, blk.N.attn_sinks.weight ([n_head] F32, normal with
std 1.5, so that the sink visibly takes a share of each softmax), post_attention_norm.weight (the
FFN's input norm, near 1; no ffn_norm), the router ffn_gate_inp.weight and .bias, the experts
ffn_{gate,up,down}_exps.weight (in --type) with F32 biases ffn_{gate,up}_exps.bias (GGML
[n_ff_exp, E]) and ffn_down_exps.bias (GGML [n_embd, E]); always a separate output.weight (in
--output-type). The gate and up values are about 3 in std (bias included) so that the activation's
clamps (gate <= 7, |up| <= 7) bite on a few percent of them; down is scaled to keep the expert's
output O(1). Keys: expert_feed_forward_length = --n-ff-exp (qwen3moe's default) and
feed_forward_length = --n-ff or else the same value (the converter writes intermediate_size to
both), key_length/value_length = the head dim (always; --head-dim may make n_head * head_dim differ
from n_embd, as in the real model: 64 * 64 vs 2880), attention.sliding_window = --sliding-window
(default 4; 0 omits the key, which llama.cpp requires: an error-path file), no
rope.dimension_count (unless --rope-dims), rope.freq_base_swa only with --rope-base-swa; with --yarn
also rope.scaling.yarn_beta_fast/_slow (32/1 unless given), as the current converter writes them from
gpt-oss's config.json. Even layers are the sliding-window ones.

RoPE scaling for any family: --yarn FACTOR writes rope.scaling.type yarn, rope.scaling.factor
and rope.scaling.original_context_length = --orig-ctx (default --ctx / FACTOR);
--yarn-beta-fast / --yarn-beta-slow write those keys; --rope-attn-factor writes
rope.scaling.attn_factor.

Error-path tests: --arch NAME writes NAME to general.architecture (and uses it
as the prefix of the hyperparameter keys, as a real file of that arch would;
other names than the four get llama's tensors);
--drop-key KEY and --drop-tensor NAME omit one metadata key / tensor (repeatable).
Deterministic for a given --seed and argument list.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kquants  # noqa: E402
from gguf_fast import GGUFReader  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4"]
# Types with 256-value blocks: they need row lengths that are multiples of 256.
K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
# general.file_type values (llama.cpp's LLAMA_FTYPE_*, the _M variant where there are several);
# informational only.
FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12,
             "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32, "MXFP4": 38}


def encode(name: str, w: np.ndarray, type_name: str):
    """Float matrix [rows, cols] (numpy order) -> (array, raw_dtype) for GGUFWriter.add_tensor."""
    qt = QT[type_name]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if w.shape[-1] % block:
        raise SystemExit(f"tensor {name}: row length {w.shape[-1]} is not a multiple of the {type_name} block "
                         f"size {block} (use --n-embd/--n-ff, and n_head * head dim, multiples of {block})")
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in kquants.QUANTIZERS:                          # K-quants, IQ4_NL, IQ4_XS
        return kquants.QUANTIZERS[type_name](w), qt
    return gguf.quants.quantize(w.astype(np.float32), qt), qt   # BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: str) -> int:
    r = GGUFReader(vocab_path)
    n_vocab = None
    for key, f in r.fields.items():
        if not (key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template"):
            continue
        val = f.contents()
        if f.types[0] == VT.ARRAY:
            writer.add_key_value(key, val, VT.ARRAY, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, val, f.types[0])
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(val)
    if not n_vocab:
        raise SystemExit(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


def gpt_oss_layer(p, args, d, hd, ff_exp, normal, norm_weight, rng):
    """The tensors of one gpt-oss layer (llama.cpp's openai-moe loader: names and GGML shapes), in the
    order the loader creates them. Scales: q/k/v/o outputs O(1) per element, their biases 0.5 (dropping
    one moves the logits clearly); sinks N(0, 1.5) against attention scores of about unit spread;
    gate and up about 3 in std (weights 2.6, biases 1.5) so that min(g, 7) and clamp(u, -7, 7) bite on a
    few percent of the values; down scaled by 1/7 (the hidden values' RMS is about 7) plus a 0.5 bias."""
    E, nq, nkv = args.n_expert, args.n_head * hd, args.n_head_kv * hd
    t = [(p + "attn_norm.weight", norm_weight(), "F32"),
         (p + "post_attention_norm.weight", norm_weight(), "F32"),
         (p + "attn_q.weight", normal((nq, d), d ** -0.5), args.type),
         (p + "attn_k.weight", normal((nkv, d), d ** -0.5), args.type),
         (p + "attn_v.weight", normal((nkv, d), d ** -0.5), args.type),
         (p + "attn_q.bias", normal(nq, 0.5), "F32"),
         (p + "attn_k.bias", normal(nkv, 0.5), "F32"),
         (p + "attn_v.bias", normal(nkv, 0.2), "F32"),
         (p + "attn_output.weight", normal((d, nq), nq ** -0.5), args.type),
         (p + "attn_sinks.weight", normal(args.n_head, 1.5), "F32"),
         (p + "ffn_gate_inp.weight", rng.normal(0.0, args.router_scale * d ** -0.5, (E, d)).astype(np.float32),
          args.router_type),
         (p + "ffn_gate_exps.weight", normal((E, ff_exp, d), 2.6 * d ** -0.5), args.type),
         (p + "ffn_down_exps.weight", normal((E, d, ff_exp), ff_exp ** -0.5 / 7.0), args.type),
         (p + "ffn_up_exps.weight", normal((E, ff_exp, d), 2.6 * d ** -0.5), args.type),
         (p + "attn_output.bias", normal(d, 0.2), "F32"),
         (p + "ffn_gate_inp.bias", rng.normal(0.0, 0.25 * args.router_scale, E).astype(np.float32), "F32"),
         (p + "ffn_gate_exps.bias", normal((E, ff_exp), 1.5), "F32"),
         (p + "ffn_down_exps.bias", normal((E, d), 0.2), "F32"),
         (p + "ffn_up_exps.bias", normal((E, ff_exp), 1.5), "F32")]
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("out")
    ap.add_argument("--vocab", required=True, help="GGUF to copy the tokenizer.ggml.* keys from")
    ap.add_argument("--type", default="F32", choices=TYPES, help="type of the layer matrices (default F32)")
    ap.add_argument("--embd-type", choices=TYPES, help="type of token_embd (default: --type)")
    ap.add_argument("--output-type", choices=TYPES, help="type of output.weight when --untied (default: --type)")
    ap.add_argument("--untied", action="store_true", help="write a separate output.weight (default: tied)")
    ap.add_argument("--arch", default="llama", help="general.architecture value and key prefix")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, help="default 64, or 256 when a K-quant or IQ4_XS type is used")
    ap.add_argument("--n-ff", type=int, help="default 128, or 512 when a K-quant or IQ4_XS type is used")
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--head-dim", type=int,
                    help="write attention.key_length/value_length = this (default: n_embd/n_head, keys omitted "
                         "except for qwen3/gemma3)")
    ap.add_argument("--rope-dims", type=int,
                    help="rope.dimension_count (default: head dim; for qwen2/qwen3/gemma3 the key is omitted)")
    ap.add_argument("--rope-base", type=float, help="rope.freq_base (default 10000; 1e6 for gemma3)")
    ap.add_argument("--rope-base-swa", type=float,
                    help="gemma3/gpt-oss: write rope.freq_base_swa (the local layers' base; default: key omitted "
                         "= 10000 for gemma3, rope.freq_base for gpt-oss)")
    ap.add_argument("--sliding-window", type=int,
                    help="gemma3/phi3/gpt-oss: attention.sliding_window (default 8, gpt-oss 4; 0 omits the key)")
    ap.add_argument("--long-rope", type=int, metavar="N",
                    help="phi3: LongRoPE factors and attn_factor, original context length N")
    ap.add_argument("--fused-qkv", action="store_true", help="one attn_qkv matrix (phi3: always)")
    ap.add_argument("--rope-freqs", type=int, metavar="N", help="llama: Llama 3.1's rope_freqs for an original context N")
    ap.add_argument("--yarn", type=float, metavar="FACTOR", help="YaRN RoPE scaling by FACTOR")
    ap.add_argument("--orig-ctx", type=int, help="rope.scaling.original_context_length with --yarn")
    ap.add_argument("--yarn-beta-fast", type=float, help="write rope.scaling.yarn_beta_fast")
    ap.add_argument("--yarn-beta-slow", type=float, help="write rope.scaling.yarn_beta_slow")
    ap.add_argument("--rope-attn-factor", type=float, help="write rope.scaling.attn_factor")
    ap.add_argument("--n-expert", type=int, default=0, help="experts per layer (default 0: a dense FFN)")
    ap.add_argument("--n-expert-used", type=int, help="experts chosen per token (with --n-expert)")
    ap.add_argument("--n-ff-exp", type=int,
                    help="qwen3moe/gpt-oss: the experts' hidden size, expert_feed_forward_length (default 32, or "
                         "256 with a 256-block type)")
    ap.add_argument("--router-type", default="F32", choices=TYPES, help="type of ffn_gate_inp (default F32)")
    ap.add_argument("--router-scale", type=float, default=2.0,
                    help="standard deviation of the router logits, about (default 2.0)")
    ap.add_argument("--eps", type=float, default=1e-5, help="attention.layer_norm_rms_epsilon")
    ap.add_argument("--ctx", type=int, default=512, help="context_length")
    ap.add_argument("--init-scale", type=float, default=1.0, help="multiplier on all random weight scales")
    ap.add_argument("--drop-key", action="append", default=[], help="omit this metadata key (repeatable)")
    ap.add_argument("--drop-tensor", action="append", default=[], help="omit this tensor (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    embd_type = args.embd_type or args.type
    out_type = args.output_type or args.type
    moe = args.n_expert > 0
    qwen3moe = args.arch == "qwen3moe"
    oss = args.arch == "gpt-oss"
    if (qwen3moe or oss) and not moe:
        raise SystemExit(f"--arch {args.arch} needs --n-expert (and --n-expert-used)")
    if moe:
        if args.arch in ("qwen2", "qwen3", "gemma3", "phi3"):
            raise SystemExit(f"--n-expert: llama.cpp has no experts for {args.arch} (use llama or qwen3moe)")
        if not args.n_expert_used or args.n_expert_used < 1:
            raise SystemExit("--n-expert needs --n-expert-used K >= 1")
        if args.n_expert_used > args.n_expert:
            print(f"make_tiny_gguf: note: expert_used_count {args.n_expert_used} > expert_count {args.n_expert}: "
                  f"an invalid file, for error-path tests", file=sys.stderr)
    elif args.n_expert_used or args.n_ff_exp:
        raise SystemExit("--n-expert-used / --n-ff-exp need --n-expert")
    if args.n_ff_exp and not (qwen3moe or oss):
        raise SystemExit("--n-ff-exp is for --arch qwen3moe/gpt-oss (a llama/Mixtral file's experts are --n-ff wide)")
    untied = args.untied or oss                          # gpt-oss always has its own output.weight
    used = {args.type, embd_type, out_type if untied else None, args.router_type if moe else None}
    uses_k = bool(used & K_TYPES)
    if used & set(kquants.QUANTIZERS):
        # The packers' layout is proven against gguf's decoders (a few ms) every time they are
        # used: a packer bug would otherwise only give other valid blocks, and no test would fail.
        kquants.selfcheck()
    d = args.n_embd or (256 if uses_k else 64)
    ff_exp = (args.n_ff_exp or (256 if uses_k else 32)) if (qwen3moe or oss) else None   # the experts' hidden size
    # gpt-oss: the converter writes intermediate_size (the experts' width) as feed_forward_length too.
    ff = args.n_ff or (ff_exp if oss else 512 if uses_k else 128)
    ff_exp = ff_exp or ff
    if d % args.n_head or args.n_head % args.n_head_kv:
        raise SystemExit("need n_embd % n_head == 0 and n_head % n_head_kv == 0")
    hd = args.head_dim or d // args.n_head
    rot = args.rope_dims or hd
    qwen = args.arch in ("qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss")   # NEOX: rope.dimension_count only on request
    gemma = args.arch == "gemma3"
    phi3 = args.arch == "phi3"
    fused_qkv = phi3 or args.fused_qkv
    rope_base = args.rope_base if args.rope_base is not None else (1e6 if gemma else 10000.0)
    sliding_window = args.sliding_window if args.sliding_window is not None else (4 if oss else 8)
    if args.arch == "qwen2" and args.n_head * hd != d:
        raise SystemExit("qwen2 needs n_head * head_dim == n_embd (llama.cpp's qwen2 attn_q and attn_output "
                         "are [n_embd, n_embd])")

    rng = np.random.default_rng(args.seed)
    s = args.init_scale

    def normal(shape, std):
        return rng.normal(0.0, std * s, shape).astype(np.float32)

    def norm_weight(n=d):
        # Near 1 but not exactly, so a kernel that ignores the norm weight fails.
        return (1.0 + rng.normal(0.0, 0.1, n)).astype(np.float32)

    w = gguf.GGUFWriter(args.out, args.arch)
    a = args.arch + "."
    w.add_string("general.name", f"ringlm tiny random {args.arch}")
    w.add_uint32("general.file_type", FILE_TYPE[args.type])
    w.add_uint32("general.quantization_version", 2)
    n_vocab = copy_tokenizer(w, args.vocab)
    w.add_uint32(a + "vocab_size", n_vocab)
    w.add_uint32(a + "context_length", args.ctx)
    w.add_uint32(a + "embedding_length", d)
    w.add_uint32(a + "block_count", args.n_layer)
    w.add_uint32(a + "feed_forward_length", ff)
    w.add_uint32(a + "attention.head_count", args.n_head)
    w.add_uint32(a + "attention.head_count_kv", args.n_head_kv)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", args.eps)
    w.add_float32(a + "rope.freq_base", rope_base)
    if not qwen or args.rope_dims:
        w.add_uint32(a + "rope.dimension_count", rot)
    if args.head_dim or args.arch in ("qwen3", "qwen3moe", "gemma3", "gpt-oss"):   # the converter writes them when config.json has head_dim
        w.add_uint32(a + "attention.key_length", hd)
        w.add_uint32(a + "attention.value_length", hd)
    if (gemma or phi3 or oss) and sliding_window:
        w.add_uint32(a + "attention.sliding_window", sliding_window)
    if phi3:
        w.add_uint32(a + "rope.scaling.original_context_length", args.long_rope or args.ctx)
        if args.long_rope:
            scale = args.ctx / args.long_rope
            w.add_float32(a + "rope.scaling.attn_factor", float(np.sqrt(1 + np.log(scale) / np.log(args.long_rope))))
    if args.yarn:
        w.add_string(a + "rope.scaling.type", "yarn")
        w.add_float32(a + "rope.scaling.factor", args.yarn)
        w.add_uint32(a + "rope.scaling.original_context_length", args.orig_ctx or int(args.ctx / args.yarn))
    beta_fast, beta_slow = args.yarn_beta_fast, args.yarn_beta_slow
    if oss and args.yarn:          # gpt-oss's config.json has beta_fast 32, beta_slow 1: the converter writes them
        beta_fast = 32.0 if beta_fast is None else beta_fast
        beta_slow = 1.0 if beta_slow is None else beta_slow
    for key, value in (("yarn_beta_fast", beta_fast), ("yarn_beta_slow", beta_slow),
                       ("attn_factor", args.rope_attn_factor)):
        if value is not None:
            w.add_float32(a + "rope.scaling." + key, value)
    if (gemma or oss) and args.rope_base_swa is not None:
        w.add_float32(a + "rope.freq_base_swa", args.rope_base_swa)
    if moe:
        w.add_uint32(a + "expert_count", args.n_expert)
        w.add_uint32(a + "expert_used_count", args.n_expert_used)
        if qwen3moe or oss:
            w.add_uint32(a + "expert_feed_forward_length", ff_exp)

    for key in args.drop_key:
        if key not in w.kv_data[0]:
            raise SystemExit(f"--drop-key {key}: no such key (have: {', '.join(w.kv_data[0])})")
        del w.kv_data[0][key]

    # Small embeddings (0.1 per element) against O(1) per-element layer outputs:
    # with large ones the residual stream stays dominated by the input token's
    # own embedding, a tied output then predicts that same token forever, and a
    # broken attention or FFN would go unnoticed. The logit std is still
    # ~0.1*sqrt(n_embd) (tied) or 2 (untied): greedy choices far from ties.
    tensors = [("token_embd.weight", normal((n_vocab, d), 0.1), embd_type),
               ("output_norm.weight", norm_weight(), "F32")]
    if untied:
        tensors.append(("output.weight", normal((n_vocab, d), 2.0 * d ** -0.5), out_type))
    if args.rope_freqs:
        # Llama 3.1's frequency divisors (convert_hf_to_gguf's "llama3" rope type): 1 for
        # wavelengths under N/4, 8 over N, a smooth step between.
        factors = []
        for i in range(rot // 2):
            wavelen = 2 * np.pi / rope_base ** (-2.0 * i / rot)
            smooth = (args.rope_freqs / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1.0 if wavelen < args.rope_freqs / 4 else 8.0 if wavelen > args.rope_freqs
                           else 1 / ((1 - smooth) / 8.0 + smooth))
        tensors += [("rope_freqs.weight", np.array(factors, dtype=np.float32), "F32")]
    if phi3 and args.long_rope:
        half = rot // 2
        tensors += [("rope_factors_short.weight", np.sort(1.0 + 0.5 * rng.random(half)).astype(np.float32), "F32"),
                    ("rope_factors_long.weight",
                     (np.exp(np.linspace(0.0, 3.0, half)) * (0.9 + 0.2 * rng.random(half))).astype(np.float32), "F32")]
    for i in range(args.n_layer):
        p = f"blk.{i}."
        if oss:
            tensors += gpt_oss_layer(p, args, d, hd, ff_exp, normal, norm_weight, rng)
            continue
        tensors += [(p + "attn_norm.weight", norm_weight(), "F32")]
        # 1/sqrt(fan_in) keeps each projection's output O(1) per element.
        wq = normal((args.n_head * hd, d), d ** -0.5)
        wk = normal((args.n_head_kv * hd, d), d ** -0.5)
        wv = normal((args.n_head_kv * hd, d), d ** -0.5)
        if fused_qkv:
            tensors += [(p + "attn_qkv.weight", np.concatenate([wq, wk, wv]), args.type)]
        else:
            tensors += [(p + "attn_q.weight", wq, args.type), (p + "attn_k.weight", wk, args.type),
                        (p + "attn_v.weight", wv, args.type)]
        if args.arch == "qwen2":
            # A fifth of the projections' O(1) outputs: dropping one bias moves the logits by 5-30%
            # of their range. Larger v biases (a constant added at every position) make a tied
            # model repeat one token.
            bq, bk, bv = normal(args.n_head * hd, 0.2), normal(args.n_head_kv * hd, 0.2), normal(args.n_head_kv * hd, 0.2)
            if fused_qkv:
                tensors += [(p + "attn_qkv.bias", np.concatenate([bq, bk, bv]), "F32")]
            else:
                tensors += [(p + "attn_q.bias", bq, "F32"), (p + "attn_k.bias", bk, "F32"), (p + "attn_v.bias", bv, "F32")]
        if args.arch in ("qwen3", "qwen3moe", "gemma3"):
            tensors += [(p + "attn_q_norm.weight", norm_weight(hd), "F32"),
                        (p + "attn_k_norm.weight", norm_weight(hd), "F32")]
        tensors += [(p + "attn_output.weight", normal((d, args.n_head * hd), (args.n_head * hd) ** -0.5), args.type)]
        if gemma:
            tensors += [(p + "post_attention_norm.weight", norm_weight(), "F32")]
        tensors += [(p + "ffn_norm.weight", norm_weight(), "F32")]
        if moe:
            # The router sees the RMS-normed input (elements ~1): logits ~ router_scale apart, so
            # that the K chosen differ from token to token and the softmax weights are far from
            # uniform. Each expert is an FFN as large as the dense one below; their weighted sum
            # (weights summing to 1) keeps the output O(1).
            E = args.n_expert
            tensors += [(p + "ffn_gate_inp.weight", rng.normal(0.0, args.router_scale * d ** -0.5, (E, d))
                         .astype(np.float32), args.router_type),
                        (p + "ffn_gate_exps.weight", normal((E, ff_exp, d), d ** -0.5), args.type),
                        (p + "ffn_up_exps.weight", normal((E, ff_exp, d), d ** -0.5), args.type),
                        (p + "ffn_down_exps.weight", normal((E, d, ff_exp), ff_exp ** -0.5), args.type)]
            continue
        gate, up = normal((ff, d), d ** -0.5), normal((ff, d), d ** -0.5)
        if phi3:
            tensors += [(p + "ffn_up.weight", np.concatenate([gate, up]), args.type)]
        else:
            tensors += [(p + "ffn_gate.weight", gate, args.type), (p + "ffn_up.weight", up, args.type)]
        tensors += [(p + "ffn_down.weight", normal((d, ff), ff ** -0.5), args.type)]
        if gemma:
            tensors += [(p + "post_ffw_norm.weight", norm_weight(), "F32")]
    names = {t[0] for t in tensors}
    for name in args.drop_tensor:
        if name not in names:
            raise SystemExit(f"--drop-tensor {name}: no such tensor")
    for name, value, type_name in tensors:
        if name in args.drop_tensor:
            continue
        # A stack of experts [E, rows, cols] is quantized as one [E * rows, cols] matrix (rows are
        # whole blocks), then given back its third dimension.
        arr, raw = encode(name, value.reshape(-1, value.shape[-1]) if value.ndim == 3 else value, type_name)
        if value.ndim == 3:
            arr = arr.reshape(value.shape[:2] + arr.shape[-1:])
        w.add_tensor(name, arr, raw_dtype=raw)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: arch {args.arch}, {args.n_layer} layers, d {d}, ff {ff}, heads {args.n_head}/"
          f"{args.n_head_kv}, head dim {hd}, vocab {n_vocab}, matrices {args.type}, token_embd {embd_type}, "
          + (f"output {out_type}" if untied else "tied output")
          + (f", sliding window {sliding_window or 'none'}" if (gemma or oss) else "")
          + (f", {args.n_expert_used} of {args.n_expert} experts of hidden size {ff_exp}, router {args.router_type}"
             if moe else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
