#!/usr/bin/env python3
"""Write a Llama-shaped GGUF with random Q4_0 weights, for speed measurements.

    python3 bench/make_synthetic_models.py --shape llama-3.2-1b --out /tmp/llama-3.2-1b.Q4_0.gguf
    python3 bench/make_synthetic_models.py --shape qwen3-30b-a3b --layers 8 --out /tmp/q3moe-8l.gguf
    python3 bench/make_synthetic_models.py --shape gpt-oss-20b --layers 8 --out /tmp/gpt-oss-8l.gguf

Shapes (all weight matrices, the embedding and the output in Q4_0, norms and routers in F32;
gpt-oss-20b is typed as its official GGUF instead, see below):
    smollm2-135m   30 layers, d 576,  ffn 1536,  9/3 heads,   vocab 49152 (tied)   ~72 MiB
    llama-3.2-1b   16 layers, d 2048, ffn 8192,  32/8 heads,  vocab 128256 (tied)  ~663 MiB
    llama-2-7b     32 layers, d 4096, ffn 11008, 32/32 heads, vocab 32000 (untied) ~3.53 GiB
  Mixtures of experts (every layer's FFN: the router and n experts, k used per token):
    qwen3-30b-a3b  qwen3moe, 48 layers, d 2048, 128 experts of 768, 8 used, 32/4 heads of 128,
                   vocab 128256 (untied; Qwen3's is 151936: no vocabulary file of that size here)
                   ~15.6 GiB, about 1.4 GiB read per token
    mixtral-8x7b   llama, 32 layers, d 4096, 8 experts of 14336, 2 used, 32/8 heads,
                   vocab 32000 (untied) ~24.6 GiB, about 7 GiB read per token
    gpt-oss-20b    gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE), 24 layers, d 2880, 32 experts of 2880,
                   4 used, 64/8 heads of 64 (q 4096 wide), sliding window 128 on the even layers,
                   rope 150000 with yarn x32 from 4096, biases on q/k/v/o, the router and the
                   experts, attention sinks; vocab 128256 (untied; gpt-oss's o200k_harmony is
                   201088: no vocabulary file of that size here, the same substitution as qwen3's)
                   ~10.86 GiB (the official file, 201088 tokens: 11.27 GiB), about 2.35 GB read
                   per token (82 MB a layer, 393 MB of output). Typed as ggml-org/gpt-oss-20b-GGUF's
                   mxfp4 file (file type 38, MXFP4 MoE; 289 f32, 98 q8_0, 72 mxfp4 tensors): the
                   experts' gate/up/down in MXFP4, the embedding, the output and attention q/k/v/o
                   in Q8_0, the norms, every bias, the sinks and the router in F32.

--layers N keeps the first N layers of a shape (the same layers, fewer of them): a quick run on a
small machine that still reads the expert products of the full model, layer by layer.

Speed does not depend on weight values, so the blocks are random bytes with a sane scale (fp16
for Q4_0 and Q8_0; for MXFP4 an E8M0 exponent per block, half 2^-8 and half 2^-9 at d 2880, so
weights are at most 0.047 and about 0.018 rms): cheap to make (no quantization pass), each weight
about 1/sqrt(fan-in) in size, and the activations stay finite. Biases are small random values
(0.02 rms), the sinks random values of 0.5 rms, the routers unit-scale logits so that tokens
spread over the experts. The tokenizer metadata is copied from a vocabulary GGUF in
../shared/data/vocab whose size matches the shape, so both ringlm and llama.cpp load the file.
Tensors are written one at a time (header first, then each tensor's data), so a 7B file never
sits in memory whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VOCAB_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "data", "vocab"))

Q4_0_BLOCK = 32       # weights per block
Q4_0_BLOCK_BYTES = 18  # fp16 scale + 16 bytes of nibbles
FILE_TYPE_Q4_0 = 2
FILE_TYPE_MXFP4_MOE = 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE: the experts in MXFP4, the rest Q8_0/F32

QBLOCK = 32           # weights per block, Q4_0, Q8_0 and MXFP4 alike
QTYPES = {"q4_0": (QT.Q4_0, Q4_0_BLOCK_BYTES),
          "q8_0": (QT.Q8_0, 34),   # fp16 scale + 32 int8
          "mxfp4": (QT.MXFP4, 17)}  # E8M0 exponent + 16 bytes of E2M1 nibbles
BIAS_STD = 0.02       # gpt-oss biases
SINK_STD = 0.5        # gpt-oss attention sinks (logits beside the scores, which are of unit scale)


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    tied: bool
    vocab: str        # ggml-vocab-<vocab>.gguf
    rope_base: float
    n_ctx: int
    arch: str = "llama"
    head_dim: int = 0     # 0: n_embd / n_head
    n_expert: int = 0     # 0: a dense FFN of n_ff
    n_expert_used: int = 0
    n_ff_exp: int = 0     # each expert's hidden units (qwen3moe; Mixtral's are n_ff)
    wtype: str = "q4_0"   # the embedding, the output and the attention/dense FFN matrices
    exp_type: str = ""    # the experts ("": wtype)
    file_type: int = FILE_TYPE_Q4_0
    n_swa: int = 0        # sliding window (gpt-oss: even layers windowed)
    yarn_factor: float = 0.0  # rope.scaling yarn factor (0: no scaling)
    yarn_orig_ctx: int = 0

    def key_length(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES = {
    "smollm2-135m": Shape(30, 576, 1536, 9, 3, 49152, True, "starcoder", 100000.0, 8192),
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 128256, True, "llama-bpe", 500000.0, 131072),
    "llama-2-7b": Shape(32, 4096, 11008, 32, 32, 32000, False, "llama-spm", 10000.0, 4096),
    "qwen3-30b-a3b": Shape(48, 2048, 6144, 32, 4, 128256, False, "llama-bpe", 1000000.0, 40960, arch="qwen3moe",
                           head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768),
    "mixtral-8x7b": Shape(32, 4096, 14336, 32, 8, 32000, False, "llama-spm", 1000000.0, 32768,
                          n_expert=8, n_expert_used=2),
    # gpt-oss-20b's vocabulary is 201088 (o200k_harmony): no vocabulary file of that size here
    "gpt-oss-20b": Shape(24, 2880, 2880, 64, 8, 128256, False, "llama-bpe", 150000.0, 131072, arch="gpt-oss",
                         head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=2880, wtype="q8_0",
                         exp_type="mxfp4", file_type=FILE_TYPE_MXFP4_MOE, n_swa=128, yarn_factor=32.0,
                         yarn_orig_ctx=4096),
}


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: str) -> int:
    """Copies every tokenizer.ggml.* key; returns the vocabulary size."""
    r = gguf.GGUFReader(vocab_path)
    n_vocab = 0
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        val = f.contents()
        if f.types[0] == VT.ARRAY:
            writer.add_key_value(key, val, VT.ARRAY, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, val, f.types[0])
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(val)
    return n_vocab


def ffn_tensors(s: Shape, p: str):
    """A layer's feed-forward tensors: (name, experts, rows, cols, kind), experts 0 for a matrix."""
    w = s.wtype
    if s.n_expert == 0:
        return [(p + "ffn_gate.weight", 0, s.n_ff, s.n_embd, w),
                (p + "ffn_up.weight", 0, s.n_ff, s.n_embd, w),
                (p + "ffn_down.weight", 0, s.n_embd, s.n_ff, w)]
    ff = s.n_ff_exp or s.n_ff
    e = s.exp_type or w
    out = [(p + "ffn_gate_inp.weight", 0, s.n_expert, s.n_embd, "router"),
           (p + "ffn_gate_exps.weight", s.n_expert, ff, s.n_embd, e),
           (p + "ffn_up_exps.weight", s.n_expert, ff, s.n_embd, e),
           (p + "ffn_down_exps.weight", s.n_expert, s.n_embd, ff, e)]
    if s.arch == "gpt-oss":  # biases on the router and each expert's three products
        out += [(p + "ffn_gate_inp.bias", 0, 1, s.n_expert, "bias"),
                (p + "ffn_gate_exps.bias", 0, s.n_expert, ff, "bias"),
                (p + "ffn_up_exps.bias", 0, s.n_expert, ff, "bias"),
                (p + "ffn_down_exps.bias", 0, s.n_expert, s.n_embd, "bias")]
    return out


def tensor_list(s: Shape):
    """(name, experts, rows, cols, kind) in GGUF order; [experts,] rows x cols is numpy order
    [out, in], rows 1 a vector; kind: a quantized type of QTYPES (q4_0, q8_0, mxfp4), or F32:
    norm (ones), router (random), bias (small random), sinks (random)."""
    q = s.n_head * s.key_length()
    kv = s.n_head_kv * s.key_length()
    w = s.wtype
    out = [("token_embd.weight", 0, s.n_vocab, s.n_embd, w)]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", 0, 1, s.n_embd, "norm"),
            (p + "attn_q.weight", 0, q, s.n_embd, w),
            (p + "attn_k.weight", 0, kv, s.n_embd, w),
            (p + "attn_v.weight", 0, kv, s.n_embd, w),
            (p + "attn_output.weight", 0, s.n_embd, q, w),
        ]
        if s.arch == "qwen3moe":
            out += [(p + "attn_q_norm.weight", 0, 1, s.key_length(), "norm"),
                    (p + "attn_k_norm.weight", 0, 1, s.key_length(), "norm")]
        if s.arch == "gpt-oss":
            out += [(p + "attn_q.bias", 0, 1, q, "bias"),
                    (p + "attn_k.bias", 0, 1, kv, "bias"),
                    (p + "attn_v.bias", 0, 1, kv, "bias"),
                    (p + "attn_output.bias", 0, 1, s.n_embd, "bias"),
                    (p + "attn_sinks.weight", 0, 1, s.n_head, "sinks"),
                    (p + "post_attention_norm.weight", 0, 1, s.n_embd, "norm")]
        else:
            out.append((p + "ffn_norm.weight", 0, 1, s.n_embd, "norm"))
        out += ffn_tensors(s, p)
    out.append(("output_norm.weight", 0, 1, s.n_embd, "norm"))
    if not s.tied:
        out.append(("output.weight", 0, s.n_vocab, s.n_embd, w))
    return out


def random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 blocks as bytes [rows, cols/32*18], scaled so that each weight has a standard
    deviation of about 1/sqrt(cols) (nibble - 8 has a standard deviation of about 4.6)."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    scale = np.float16(1.0 / (4.6 * np.sqrt(cols)))
    blocks[:, :, 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def random_q8_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 blocks as bytes [rows, cols/32*34]: int8 in [-127, 127] (as ggml's quantizer
    writes them; a standard deviation of about 73.6) under an fp16 scale giving each weight a
    standard deviation of about 1/sqrt(cols)."""
    blocks = rng.integers(0, 256, size=(rows, cols // QBLOCK, 34), dtype=np.uint8)
    qs = blocks[:, :, 2:].view(np.int8)
    np.maximum(qs, -127, out=qs)
    scale = np.float16(1.0 / (73.6 * np.sqrt(cols)))
    blocks[:, :, 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def mxfp4_exponent(cols: int) -> int:
    """The larger of the two E8M0 exponents random_mxfp4 uses for a fan-in of cols.

    A weight is kvalue * 2^(e-128) (ggml_e8m0_to_fp32_half: the kvalues are E2M1 doubled, 0..12);
    uniform nibbles give kvalues of rms sqrt(274/8) = 5.85, and blocks drawing e and e-1 with
    equal odds make the weights' rms 5.85 * sqrt(0.625) * 2^(e-128) = 4.63 * 2^(e-128): e is
    chosen so that this is nearest 1/sqrt(cols) (d 2880: e = 120, rms 0.018, at most 0.047)."""
    return 128 + int(round(np.log2(1.0 / (4.63 * np.sqrt(cols)))))


def random_mxfp4(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random MXFP4 blocks as bytes [rows, cols/32*17] (ggml's block_mxfp4: one E8M0 exponent,
    then 16 bytes of E2M1 nibbles, any of the 16 codes a valid weight), the exponent of each block
    mxfp4_exponent(cols) or one less, at random: real MXFP4 weights vary their scale block by block."""
    blocks = rng.integers(0, 256, size=(rows, cols // QBLOCK, 17), dtype=np.uint8)
    e = mxfp4_exponent(cols)
    blocks[:, :, 0] = e - (blocks[:, :, 0] & 1)
    return blocks.reshape(rows, -1)


RANDOM_BLOCKS = {"q4_0": random_q4_0, "q8_0": random_q8_0, "mxfp4": random_mxfp4}


def write_model(shape_name: str, out_path: str, vocab_dir: str, seed: int, n_layers: int = 0) -> None:
    s = SHAPES[shape_name]
    if n_layers:
        if not 0 < n_layers <= s.n_layer:
            raise SystemExit(f"--layers {n_layers}: {shape_name} has {s.n_layer} layers")
        s = dataclasses.replace(s, n_layer=n_layers)
    vocab_path = os.path.join(vocab_dir, f"ggml-vocab-{s.vocab}.gguf")
    a = s.arch + "."
    w = gguf.GGUFWriter(out_path, s.arch)
    types = "random Q4_0" if s.file_type == FILE_TYPE_Q4_0 else "random MXFP4 experts, Q8_0"
    w.add_string("general.name", f"ringlm synthetic {shape_name} ({types})")
    w.add_uint32("general.file_type", s.file_type)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(a + "vocab_size", s.n_vocab)
    w.add_uint32(a + "context_length", s.n_ctx)
    w.add_uint32(a + "embedding_length", s.n_embd)
    w.add_uint32(a + "block_count", s.n_layer)
    w.add_uint32(a + "feed_forward_length", s.n_ff)
    w.add_uint32(a + "attention.head_count", s.n_head)
    w.add_uint32(a + "attention.head_count_kv", s.n_head_kv)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(a + "rope.freq_base", s.rope_base)
    w.add_uint32(a + "rope.dimension_count", s.key_length())
    if s.head_dim:
        w.add_uint32(a + "attention.key_length", s.head_dim)
        w.add_uint32(a + "attention.value_length", s.head_dim)
    if s.n_expert:
        w.add_uint32(a + "expert_count", s.n_expert)
        w.add_uint32(a + "expert_used_count", s.n_expert_used)
        if s.n_ff_exp:
            w.add_uint32(a + "expert_feed_forward_length", s.n_ff_exp)
    if s.n_swa:
        w.add_uint32(a + "attention.sliding_window", s.n_swa)
    if s.yarn_factor:
        w.add_string(a + "rope.scaling.type", "yarn")
        w.add_float32(a + "rope.scaling.factor", s.yarn_factor)
        w.add_uint32(a + "rope.scaling.original_context_length", s.yarn_orig_ctx)
    n_vocab = copy_tokenizer(w, vocab_path)
    if n_vocab != s.n_vocab:
        raise SystemExit(f"{vocab_path} has {n_vocab} tokens, shape {shape_name} needs {s.n_vocab}")

    tensors = tensor_list(s)
    for name, experts, rows, cols, kind in tensors:
        lead = (experts,) if experts else ()
        if kind in QTYPES:
            qtype, block_bytes = QTYPES[kind]
            row_bytes = cols // QBLOCK * block_bytes
            w.add_tensor_info(name, lead + (rows, row_bytes), np.dtype(np.uint8), max(experts, 1) * rows * row_bytes,
                              raw_dtype=qtype)
        else:
            shape = (cols,) if rows == 1 else (rows, cols)
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(seed)
    total = 0
    for name, experts, rows, cols, kind in tensors:
        if kind in QTYPES:
            data = RANDOM_BLOCKS[kind](rng, max(experts, 1) * rows, cols)
        elif kind == "router":  # logits of unit scale: every token picks its own experts
            data = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        elif kind in ("bias", "sinks"):
            std = BIAS_STD if kind == "bias" else SINK_STD
            data = (rng.standard_normal((cols,) if rows == 1 else (rows, cols)) * std).astype(np.float32)
        else:
            data = np.ones(cols, dtype=np.float32)
        w.write_tensor_data(data)
        total += data.nbytes
    w.close()
    print(f"{out_path}: {shape_name}, {s.n_layer} layers, {len(tensors)} tensors, {total / 2**20:.1f} MiB of weights")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--vocab-dir", default=DEFAULT_VOCAB_DIR, help="folder of ggml-vocab-*.gguf (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (default: all)")
    args = ap.parse_args(argv)
    write_model(args.shape, args.out, args.vocab_dir, args.seed, args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
