#!/usr/bin/env python3
"""Write a Llama-shaped GGUF with random Q4_0 weights, for speed measurements.

    python3 bench/make_synthetic_models.py --shape llama-3.2-1b --out /tmp/llama-3.2-1b.Q4_0.gguf

Shapes (all weight matrices, the embedding and the output in Q4_0, norms in F32):
    smollm2-135m   30 layers, d 576,  ffn 1536,  9/3 heads,   vocab 49152 (tied)   ~72 MiB
    llama-3.2-1b   16 layers, d 2048, ffn 8192,  32/8 heads,  vocab 128256 (tied)  ~663 MiB
    llama-2-7b     32 layers, d 4096, ffn 11008, 32/32 heads, vocab 32000 (untied) ~3.53 GiB

Speed does not depend on weight values, so the blocks are random bytes with a sane fp16 scale:
cheap to make (no quantization pass) and the activations stay finite. The tokenizer metadata is
copied from a vocabulary GGUF in ../shared/data/vocab whose size matches the shape, so both
ringlm and llama.cpp load the file. Tensors are written one at a time (header first, then each
tensor's data), so a 7B file never sits in memory whole.
"""

from __future__ import annotations

import argparse
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


SHAPES = {
    "smollm2-135m": Shape(30, 576, 1536, 9, 3, 49152, True, "starcoder", 100000.0, 8192),
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 128256, True, "llama-bpe", 500000.0, 131072),
    "llama-2-7b": Shape(32, 4096, 11008, 32, 32, 32000, False, "llama-spm", 10000.0, 4096),
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


def tensor_list(s: Shape):
    """(name, rows, cols, quantized) in GGUF order; rows x cols is numpy order [out, in]."""
    head_dim = s.n_embd // s.n_head
    kv = s.n_head_kv * head_dim
    out = [("token_embd.weight", s.n_vocab, s.n_embd, True)]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", 1, s.n_embd, False),
            (p + "attn_q.weight", s.n_embd, s.n_embd, True),
            (p + "attn_k.weight", kv, s.n_embd, True),
            (p + "attn_v.weight", kv, s.n_embd, True),
            (p + "attn_output.weight", s.n_embd, s.n_embd, True),
            (p + "ffn_norm.weight", 1, s.n_embd, False),
            (p + "ffn_gate.weight", s.n_ff, s.n_embd, True),
            (p + "ffn_up.weight", s.n_ff, s.n_embd, True),
            (p + "ffn_down.weight", s.n_embd, s.n_ff, True),
        ]
    out.append(("output_norm.weight", 1, s.n_embd, False))
    if not s.tied:
        out.append(("output.weight", s.n_vocab, s.n_embd, True))
    return out


def random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 blocks as bytes [rows, cols/32*18], scaled so that each weight has a standard
    deviation of about 1/sqrt(cols) (nibble - 8 has a standard deviation of about 4.6)."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    scale = np.float16(1.0 / (4.6 * np.sqrt(cols)))
    blocks[:, :, 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_model(shape_name: str, out_path: str, vocab_dir: str, seed: int) -> None:
    s = SHAPES[shape_name]
    vocab_path = os.path.join(vocab_dir, f"ggml-vocab-{s.vocab}.gguf")
    w = gguf.GGUFWriter(out_path, "llama")
    w.add_string("general.name", f"ringlm synthetic {shape_name} (random Q4_0)")
    w.add_uint32("general.file_type", FILE_TYPE_Q4_0)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32("llama.vocab_size", s.n_vocab)
    w.add_uint32("llama.context_length", s.n_ctx)
    w.add_uint32("llama.embedding_length", s.n_embd)
    w.add_uint32("llama.block_count", s.n_layer)
    w.add_uint32("llama.feed_forward_length", s.n_ff)
    w.add_uint32("llama.attention.head_count", s.n_head)
    w.add_uint32("llama.attention.head_count_kv", s.n_head_kv)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", s.rope_base)
    w.add_uint32("llama.rope.dimension_count", s.n_embd // s.n_head)
    n_vocab = copy_tokenizer(w, vocab_path)
    if n_vocab != s.n_vocab:
        raise SystemExit(f"{vocab_path} has {n_vocab} tokens, shape {shape_name} needs {s.n_vocab}")

    tensors = tensor_list(s)
    for name, rows, cols, quantized in tensors:
        if quantized:
            nbytes = rows * cols // Q4_0_BLOCK * Q4_0_BLOCK_BYTES
            w.add_tensor_info(name, (rows, cols // Q4_0_BLOCK * Q4_0_BLOCK_BYTES), np.dtype(np.uint8), nbytes,
                              raw_dtype=QT.Q4_0)
        else:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(seed)
    total = 0
    for name, rows, cols, quantized in tensors:
        data = random_q4_0(rng, rows, cols) if quantized else np.ones(cols, dtype=np.float32)
        w.write_tensor_data(data)
        total += data.nbytes
    w.close()
    print(f"{out_path}: {shape_name}, {len(tensors)} tensors, {total / 2**20:.1f} MiB of weights")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--vocab-dir", default=DEFAULT_VOCAB_DIR, help="folder of ggml-vocab-*.gguf (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_model(args.shape, args.out, args.vocab_dir, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
