#!/usr/bin/env python3
"""Write dequantization test vectors: one GGUF holding, for each weight format,

    <TYPE>.q    shape [512, 3] (ggml order: 3 rows of 512 values), random VALID raw blocks
    <TYPE>.ref  F32 [512, 3], gguf.quants.dequantize of exactly those bytes

for TYPE in F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K. ringlm's C++ test dequantizes
<TYPE>.q with its own code and compares with <TYPE>.ref. The blocks are random
bytes rather than quantized data so that they reach corners real weights seldom
do: negative, zero, subnormal and maximal fp16 scales; every nibble / 6-bit /
int8 value; Q4_K scale bytes with the high bits (the packed upper bits of
sub-blocks 4..7) set; negative Q6_K sub-block scales including -128.
No value is Inf or NaN, so an exact or ulp-level comparison is meaningful.

gguf computes in float32 with one rounding per operation, in this order:
  Q8_0  q*d          Q4_0  d*(q-8)        Q4_1  d*q + m
  Q4_K  (d*sc)*q - (dmin*m)               Q6_K  (d*sc)*(q-32)
A C++ kernel that fuses (FMA) or reorders may differ by an ulp or so of the
largest term; compare with a tolerance of a few ulp of |each term|, not of the result.

    make_dequant_vectors.py OUT.gguf [--seed N]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kquants  # noqa: E402

ROWS, COLS = 3, 512
TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]

# fp16 scales that stress a converter: signs, zero, both zeros, the smallest
# subnormal, the largest subnormal, the smallest normal, the largest finite value.
EDGE_F16 = np.array([1.0, -1.0, 0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14 - 2.0 ** -24,
                     2.0 ** -14, 65504.0, -65504.0, 0.1, -3.5e-3], dtype=np.float16)


# K-quant tensors here have only 6 blocks: a shorter list with the sharpest cases.
EDGE_F16_K = np.array([1.0, -1.0, 2.0 ** -24, -(2.0 ** -14), 65504.0, -0.0], dtype=np.float16)


def f16_scales(rng, n, edges=EDGE_F16):
    """n fp16 scales: the edge values first, then random magnitudes over many
    binades (1e-6 .. 10) with random sign."""
    rand = (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float16)
    k = min(n, len(edges))
    rand[:k] = edges[:k]
    return rand


def random_half_bits(rng, n, exp_mask, exp_shift):
    """Random 16-bit patterns (all signs, exponents incl. subnormal, mantissas)
    with Inf/NaN (all-ones exponent) replaced by the largest finite exponent."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32)
    exp_all_ones = (bits & exp_mask) == exp_mask
    bits = np.where(exp_all_ones, bits & ~np.uint32(1 << exp_shift), bits)
    return bits.astype(np.uint16)


def make_blocks(type_name: str, rng) -> np.ndarray:
    """Raw bytes [ROWS, bytes_per_row] of random valid blocks of this type."""
    qt = QT[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    nb = ROWS * COLS // block

    if type_name == "F16":
        # exponent bits 10..14; all-ones = Inf/NaN
        bits = random_half_bits(rng, ROWS * COLS, 0x7C00, 10)
        bits[:len(EDGE_F16)] = EDGE_F16.view(np.uint16)
        raw = bits.view(np.uint8)
    elif type_name == "BF16":
        # exponent bits 7..14; covers values up to ~3e38 and bf16 subnormals
        bits = random_half_bits(rng, ROWS * COLS, 0x7F80, 7)
        bits[:4] = [0x3F80, 0xBF80, 0x0000, 0x8000]          # 1, -1, 0, -0
        bits[4:8] = [0x0001, 0x807F, 0x0080, 0x7F7F]         # subnormals, min normal, max finite
        raw = bits.view(np.uint8)
    elif type_name == "Q8_0":
        d = f16_scales(rng, nb)
        qs = rng.integers(-128, 128, (nb, 32)).astype(np.int8)
        qs[0] = np.arange(-128, 128, 8)                        # extremes -128 and 120..127 region
        qs[1] = np.arange(-16, 16) * 8 + 7
        raw = np.concatenate([d.reshape(-1, 1).view(np.uint8), qs.view(np.uint8)], axis=1)
    elif type_name == "Q4_0":
        d = f16_scales(rng, nb)
        qs = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
        qs[0] = np.arange(16) | (np.arange(15, -1, -1) << 4)  # every nibble, both halves
        raw = np.concatenate([d.reshape(-1, 1).view(np.uint8), qs], axis=1)
    elif type_name == "Q4_1":
        d = f16_scales(rng, nb)
        m = f16_scales(rng, nb)[::-1].copy()                   # edge mins meet ordinary scales
        qs = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
        qs[0] = np.arange(16) | (np.arange(15, -1, -1) << 4)
        raw = np.concatenate([d.reshape(-1, 1).view(np.uint8), m.reshape(-1, 1).view(np.uint8), qs], axis=1)
    elif type_name == "Q4_K":
        d = f16_scales(rng, nb, EDGE_F16_K)
        dmin = f16_scales(rng, nb, EDGE_F16_K)[::-1].copy()
        sc = rng.integers(0, 64, (nb, 8))
        mn = rng.integers(0, 64, (nb, 8))
        sc[0], mn[0] = 63, 63                                   # every packed bit set
        sc[1], mn[1] = [0, 63, 16, 47, 63, 48, 32, 31], [63, 0, 47, 16, 48, 63, 31, 32]
        q = rng.integers(0, 16, (nb, 256))
        q[0, :16] = np.arange(16)
        raw = kquants.pack_q4_k(d, dmin, sc, mn, q)
        # In a block with all scales/mins >= 16 for sub-blocks 4..7 every one of the
        # 12 scale bytes has its high bits in use: check the packer really did that.
        assert (raw[0, 4:16] == 0xFF).all()
    elif type_name == "Q6_K":
        d = f16_scales(rng, nb, EDGE_F16_K)
        sc = rng.integers(-128, 128, (nb, 16))
        sc[0] = [-128, 127, -1, 0, 1, -64, 63, -127, 100, -100, 2, -2, 50, -50, 126, -126]
        q = rng.integers(0, 64, (nb, 256))
        q[0, :64] = np.arange(64)                               # every 6-bit value
        raw = kquants.pack_q6_k(d, sc, q)
    else:
        raise ValueError(type_name)

    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(ROWS, -1)
    assert raw.shape[1] == COLS // block * size, (type_name, raw.shape)
    return raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write dequantization test vectors (see module docstring).")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    kquants.selfcheck()

    rng = np.random.default_rng(args.seed)
    w = gguf.GGUFWriter(args.out, "ringlm-dequant-vectors")
    w.add_string("general.name", "ringlm dequantization test vectors")
    for type_name in TYPES:
        raw = make_blocks(type_name, rng)
        ref = gguf.quants.dequantize(raw, QT[type_name]).astype(np.float32).reshape(ROWS, COLS)
        assert np.all(np.isfinite(ref)), type_name
        w.add_tensor(f"{type_name}.q", raw, raw_dtype=QT[type_name])
        w.add_tensor(f"{type_name}.ref", ref)
        nz = ref[ref != 0]
        print(f"{type_name:5s}: {raw.nbytes:5d} bytes, ref range [{ref.min():.4g}, {ref.max():.4g}], "
              f"smallest |nonzero| {np.abs(nz).min() if nz.size else 0:.3g}, negatives {int((ref < 0).sum())}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
