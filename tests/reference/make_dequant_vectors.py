#!/usr/bin/env python3
"""Write dequantization test vectors: one GGUF holding, for each weight format,

    <TYPE>.q    shape [512, 3] (ggml order: 3 rows of 512 values), random VALID raw blocks
    <TYPE>.ref  F32 [512, 3], gguf.quants.dequantize of exactly those bytes

for TYPE in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS, MXFP4. ringlm's C++ test dequantizes <TYPE>.q with its own code
and compares with <TYPE>.ref. The blocks are random fields rather than quantized
data so that they reach corners real weights seldom do: negative, zero,
subnormal and maximal fp16 scales; every 2-, 3-, 4-, 5- and 6-bit code and int8
value; all-ones and all-zero high-bit masks (Q5_0/Q5_1 qh, Q3_K hmask, Q5_K qh);
packed 6-bit scale bytes with every bit set (Q3_K, Q4_K, Q5_K, IQ4_XS) and
scales 0 and 63 (-32 and +31 once Q3_K / IQ4_XS subtract 32); negative Q6_K
sub-block scales including -128; MXFP4 exponents from 0 (a subnormal scale) to 255
(the top byte, which gguf reads as 2^127; only its codes 0 and +-1 stay finite).
No value is Inf or NaN, so an exact or ulp-level comparison is meaningful.

gguf computes in float32 with one rounding per operation, in this order (q, s,
sc, m and the grid value kv[q] are small integers, exact in float32):
  Q8_0  q*d          Q4_0  d*(q-8)        Q4_1  d*q + m
  Q5_0  d*(q-16)     Q5_1  d*q + m        IQ4_NL  d*kv[q]
  Q2_K  (d*sc)*q - (dmin*m)               Q3_K  (d*(s-32))*(q - 4*!hbit)
  Q4_K  (d*sc)*q - (dmin*m)               Q5_K  (d*sc)*q - (dmin*m)
  Q6_K  (d*sc)*(q-32)                     IQ4_XS  (d*(s-32))*kv[q]
  MXFP4  2^(e-128) * kv[q]  (kv: the E2M1 values times two, integers up to 12)
This script proves that list: it computes every value from the fields in that
order and asserts that gguf's result is identical, bit for bit. Every product
in it is exact in float32 (an fp16 scale has 11 significant bits, the integers
multiplied with it at most 12 between them), so the only rounding is the final
+ m / - (dmin*m) (an MXFP4 product is a power of two times a small integer, exact
even among the subnormals): reordering the products or fusing the last step (FMA) gives
the same floats, and ringlm's dequantize_row() is compared exactly. A kernel
that folds the min in another way (e.g. d*(q + m/d)) may differ by an ulp or so
of the largest term; compare such a one with a tolerance of a few ulp of |each
term|, not of the result.

The file also carries gguf's table of GGML tensor types (ggml.types.*: id,
name, block elements, block bytes) so that the C++ test checks ringlm's table of
type ids and sizes against it.

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
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4"]
QK_K = 256

# fp16 scales that stress a converter: signs, zero, both zeros, the smallest
# subnormal, the largest subnormal, the smallest normal, the largest finite value.
EDGE_F16 = np.array([1.0, -1.0, 0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14 - 2.0 ** -24,
                     2.0 ** -14, 65504.0, -65504.0, 0.1, -3.5e-3], dtype=np.float16)


# K-quant tensors here have only 6 blocks: a shorter list with the sharpest cases.
EDGE_F16_K = np.array([1.0, -1.0, 2.0 ** -24, -(2.0 ** -14), 65504.0, -0.0], dtype=np.float16)

F32 = np.float32


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


def f16_bytes(x) -> np.ndarray:
    """[n] fp16 values -> [n, 2] bytes."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float16)).reshape(-1, 1).view(np.uint8)


def col(x) -> np.ndarray:
    """[n] fp16 (or small ints) -> [n, 1] float32, to broadcast over a block."""
    return np.asarray(x).astype(F32).reshape(-1, 1)


def per_sub(x, width) -> np.ndarray:
    """[nb, n_sub] per-sub-block factor -> [nb, n_sub * width], each repeated over its sub-block."""
    return np.repeat(np.asarray(x, dtype=F32), width, axis=1)


def nibbles(q) -> np.ndarray:
    """[nb, 2k] codes 0..15 -> [nb, k] bytes: element j in the low nibble of byte j, element
    j + k in the high nibble (the Q4_0 / Q5_0 / IQ4_NL order)."""
    q = np.asarray(q, dtype=np.uint8)
    k = q.shape[1] // 2
    assert q.max(initial=0) < 16
    return q[:, :k] | (q[:, k:] << 4)


def crumbs(q) -> np.ndarray:
    """[nb, 256] codes 0..3 -> [nb, 64] bytes: element 128h + 32k + l in bits 2k..2k+1 of byte
    32h + l (Q2_K / Q3_K)."""
    q = np.asarray(q, dtype=np.uint8).reshape(-1, 2, 4, 32)
    assert q.max(initial=0) < 4
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def bitmask(bits, runs) -> np.ndarray:
    """[nb, runs * L] bits -> [nb, L] bytes: element i*L + l is bit i of byte l (Q3_K's hmask and
    Q5_K's qh: L = 32, runs = 8)."""
    bits = np.asarray(bits, dtype=np.uint8).reshape(len(bits), runs, -1)
    assert bits.max(initial=0) < 2
    return np.bitwise_or.reduce(bits << np.arange(runs, dtype=np.uint8).reshape(1, -1, 1), axis=1)


def q5_blocks(rng, nb):
    """Codes 0..31 for Q5_0 / Q5_1: block 0 counts up (fifth bit clear in the first half, set in
    the second), block 1 counts down (the opposite), so every code sits at both halves' places."""
    q = rng.integers(0, 32, (nb, 32))
    q[0] = np.arange(32)
    q[1] = np.arange(31, -1, -1)
    q[2] = rng.integers(16, 32, 32)  # qh all ones
    q[3] = rng.integers(0, 16, 32)   # qh all zeros
    return q


def make_blocks(type_name: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """Raw bytes [ROWS, bytes_per_row] of random valid blocks of this type, and the values they
    stand for computed from the fields in the order the module docstring gives."""
    qt = QT[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    nb = ROWS * COLS // block

    if type_name == "F32":
        # exponent bits 23..30; every sign, subnormals, both zeros, the largest finite value
        bits = rng.integers(0, 1 << 32, ROWS * COLS, dtype=np.uint64).astype(np.uint32)
        bits = np.where((bits & 0x7F800000) == 0x7F800000, bits & ~np.uint32(1 << 23), bits)
        bits[:6] = [0x3F800000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF]
        raw = bits.view(np.uint8)
        want = bits.view(F32)
    elif type_name == "F16":
        # exponent bits 10..14; all-ones = Inf/NaN
        bits = random_half_bits(rng, ROWS * COLS, 0x7C00, 10)
        bits[:len(EDGE_F16)] = EDGE_F16.view(np.uint16)
        raw = bits.view(np.uint8)
        want = bits.view(np.float16).astype(F32)
    elif type_name == "BF16":
        # exponent bits 7..14; covers values up to ~3e38 and bf16 subnormals
        bits = random_half_bits(rng, ROWS * COLS, 0x7F80, 7)
        bits[:4] = [0x3F80, 0xBF80, 0x0000, 0x8000]          # 1, -1, 0, -0
        bits[4:8] = [0x0001, 0x807F, 0x0080, 0x7F7F]         # subnormals, min normal, max finite
        raw = bits.view(np.uint8)
        want = (bits.astype(np.uint32) << 16).view(F32)
    elif type_name == "Q8_0":
        d = f16_scales(rng, nb)
        qs = rng.integers(-128, 128, (nb, 32)).astype(np.int8)
        qs[0] = np.arange(-128, 128, 8)                        # extremes -128 and 120..127 region
        qs[1] = np.arange(-16, 16) * 8 + 7
        raw = np.concatenate([f16_bytes(d), qs.view(np.uint8)], axis=1)
        want = qs.astype(F32) * col(d)
    elif type_name == "Q4_0":
        d = f16_scales(rng, nb)
        q = rng.integers(0, 16, (nb, 32))
        q[0] = np.concatenate([np.arange(16), np.arange(15, -1, -1)])  # every nibble, both halves
        raw = np.concatenate([f16_bytes(d), nibbles(q)], axis=1)
        want = col(d) * (q - 8).astype(F32)
    elif type_name == "Q4_1":
        d = f16_scales(rng, nb)
        m = f16_scales(rng, nb)[::-1].copy()                   # edge mins meet ordinary scales
        q = rng.integers(0, 16, (nb, 32))
        q[0] = np.concatenate([np.arange(16), np.arange(15, -1, -1)])
        raw = np.concatenate([f16_bytes(d), f16_bytes(m), nibbles(q)], axis=1)
        want = col(d) * q.astype(F32) + col(m)
    elif type_name in ("Q5_0", "Q5_1"):
        d = f16_scales(rng, nb)
        q = q5_blocks(rng, nb)
        qh = np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")  # bit j = element j
        if type_name == "Q5_0":
            raw = np.concatenate([f16_bytes(d), qh, nibbles(q & 15)], axis=1)
            want = col(d) * (q - 16).astype(F32)
        else:
            m = f16_scales(rng, nb)[::-1].copy()
            raw = np.concatenate([f16_bytes(d), f16_bytes(m), qh, nibbles(q & 15)], axis=1)
            want = col(d) * q.astype(F32) + col(m)
        assert (raw[2, -20:-16] == 0xFF).all() and (raw[3, -20:-16] == 0).all()
    elif type_name == "Q2_K":
        d = f16_scales(rng, nb, EDGE_F16_K)
        dmin = f16_scales(rng, nb, EDGE_F16_K)[::-1].copy()
        sc = rng.integers(0, 16, (nb, 16))
        mn = rng.integers(0, 16, (nb, 16))
        sc[0], mn[0] = 15, 15                                   # every scale bit set
        sc[1], mn[1] = np.arange(16), np.arange(15, -1, -1)     # every scale and min value
        q = rng.integers(0, 4, (nb, 256))
        q[0] = np.arange(256) % 4                               # every code in every sub-block
        q[1] = 3
        scales = (sc | (mn << 4)).astype(np.uint8)
        raw = np.concatenate([scales, crumbs(q), f16_bytes(d), f16_bytes(dmin)], axis=1)
        want = per_sub(col(d) * sc.astype(F32), 16) * q.astype(F32) - per_sub(col(dmin) * mn.astype(F32), 16)
        assert (raw[0, :16] == 0xFF).all() and (raw[1, 16:80] == 0xFF).all()
    elif type_name == "Q3_K":
        d = f16_scales(rng, nb, EDGE_F16_K)
        s = rng.integers(0, 64, (nb, 16))                       # stored 6-bit scale; the factor is s - 32
        s[0] = 63                                               # every scale bit set
        s[1] = [0, 63, 32, 31, 1, 62, 16, 47, 15, 48, 33, 30, 60, 3, 40, 24]
        v = rng.integers(-4, 4, (nb, 256))                      # the 3-bit value q - 4*!hbit
        v[0] = np.arange(256) % 8 - 4                           # every value in every sub-block
        v[1] = rng.integers(0, 4, 256)                          # hmask all ones
        v[2] = rng.integers(-4, 0, 256)                         # hmask all zeros
        hbit = (v >= 0).astype(np.uint8)                        # a set bit means "no -4"
        lo, hi = s & 15, s >> 4
        scales = np.concatenate([
            lo[:, :8] | (lo[:, 8:] << 4),                                       # bytes 0..7
            hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6),  # bytes 8..11
        ], axis=1).astype(np.uint8)
        raw = np.concatenate([bitmask(hbit, 8), crumbs(v & 3), scales, f16_bytes(d)], axis=1)
        want = per_sub(col(d) * (s - 32).astype(F32), 16) * v.astype(F32)
        assert (raw[0, 96:108] == 0xFF).all() and (raw[1, :32] == 0xFF).all() and (raw[2, :32] == 0).all()
    elif type_name in ("Q4_K", "Q5_K"):
        bits = 4 if type_name == "Q4_K" else 5
        d = f16_scales(rng, nb, EDGE_F16_K)
        dmin = f16_scales(rng, nb, EDGE_F16_K)[::-1].copy()
        sc = rng.integers(0, 64, (nb, 8))
        mn = rng.integers(0, 64, (nb, 8))
        sc[0], mn[0] = 63, 63                                   # every packed bit set
        sc[1], mn[1] = [0, 63, 16, 47, 63, 48, 32, 31], [63, 0, 47, 16, 48, 63, 31, 32]
        q = rng.integers(0, 1 << bits, (nb, 256))
        q[0, :1 << bits] = np.arange(1 << bits)                 # every code
        if type_name == "Q5_K":
            q[1] = rng.integers(16, 32, 256)                    # qh all ones
            q[2] = rng.integers(0, 16, 256)                     # qh all zeros
        raw = kquants.pack_q4_k(d, dmin, sc, mn, q & 15)
        if type_name == "Q5_K":
            # Q5_K is Q4_K with the 32 bytes of fifth bits between the scales and the nibbles.
            raw = np.concatenate([raw[:, :16], bitmask(q >> 4, 8), raw[:, 16:]], axis=1)
            assert (raw[1, 16:48] == 0xFF).all() and (raw[2, 16:48] == 0).all()
        want = per_sub(col(d) * sc.astype(F32), 32) * q.astype(F32) - per_sub(col(dmin) * mn.astype(F32), 32)
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
        want = per_sub(col(d) * sc.astype(F32), 16) * (q - 32).astype(F32)
    elif type_name == "IQ4_NL":
        d = f16_scales(rng, nb)
        q = rng.integers(0, 16, (nb, 32))
        q[0] = np.concatenate([np.arange(16), np.arange(15, -1, -1)])  # every grid value, both halves
        raw = np.concatenate([f16_bytes(d), nibbles(q)], axis=1)
        want = col(d) * np.array(gguf.quants.IQ4_NL.kvalues, dtype=F32)[q]
    elif type_name == "IQ4_XS":
        d = f16_scales(rng, nb, EDGE_F16_K)
        s = rng.integers(0, 64, (nb, 8))                        # stored 6-bit scale; the factor is s - 32
        s[0] = 63                                               # scales_h 0xFFFF, scales_l 0xFF
        s[1] = [0, 63, 32, 31, 1, 62, 16, 47]
        q = rng.integers(0, 16, (nb, 256))
        q[0] = np.arange(256) % 16                              # every grid value in every sub-block
        scales_h = np.bitwise_or.reduce((s >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
        scales_l = ((s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)).astype(np.uint8)
        qs = nibbles(q.reshape(nb * 8, 32)).reshape(nb, 128)  # each sub-block of 32 as an IQ4_NL block
        raw = np.concatenate([f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)
        want = per_sub(col(d) * (s - 32).astype(F32), 32) * np.array(gguf.quants.IQ4_NL.kvalues, dtype=F32)[q]
        assert (raw[0, 2:8] == 0xFF).all()
    elif type_name == "MXFP4":
        # E8M0 exponent byte e; the scale 2^(e-127) is halved because kv holds the E2M1 values
        # times two. Edges: e = 0 and 1 (subnormal scales), 2 (the first normal one), 127, 252
        # (the largest whose every code is finite), 255 (the top byte) with codes 0 and +-1 only.
        e = rng.integers(0, 253, nb)
        e[:6] = [0, 1, 2, 127, 252, 255]
        q = rng.integers(0, 16, (nb, 32))
        q[:5, :16] = np.arange(16)                              # every code in the low nibbles ...
        q[:5, 16:] = np.arange(15, -1, -1)                      # ... and in the high ones
        q[5] = rng.choice([0, 1, 8, 9], 32)                     # 0, 1, -0, -1 times 2^127
        kv = np.array(gguf.quants.MXFP4.kvalues, dtype=F32)
        raw = np.concatenate([e.astype(np.uint8).reshape(-1, 1), nibbles(q)], axis=1)
        want = col(np.ldexp(F32(1), e - 128).astype(F32)) * kv[q]
    else:
        raise ValueError(type_name)

    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(ROWS, -1)
    assert raw.shape[1] == COLS // block * size, (type_name, raw.shape)
    want = np.asarray(want)
    assert want.dtype == F32, (type_name, want.dtype)
    return raw, want.reshape(ROWS, COLS)


def write_type_table(w: gguf.GGUFWriter) -> None:
    """gguf's own table of GGML tensor types: what ringlm's type_traits() must agree with."""
    types = sorted(gguf.GGML_QUANT_SIZES.items(), key=lambda kv: kv[0].value)
    w.add_array("ggml.types.id", [int(t.value) for t, _ in types])
    w.add_array("ggml.types.name", [t.name for t, _ in types])
    w.add_array("ggml.types.block_elems", [int(block) for _, (block, _) in types])
    w.add_array("ggml.types.block_bytes", [int(size) for _, (_, size) in types])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write dequantization test vectors (see module docstring).")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    kquants.selfcheck()

    rng = np.random.default_rng(args.seed)
    w = gguf.GGUFWriter(args.out, "ringlm-dequant-vectors")
    w.add_string("general.name", "ringlm dequantization test vectors")
    write_type_table(w)
    for type_name in TYPES:
        raw, want = make_blocks(type_name, rng)
        ref = gguf.quants.dequantize(raw, QT[type_name]).astype(np.float32).reshape(ROWS, COLS)
        assert np.all(np.isfinite(ref)), type_name
        # Bit for bit (signed zeros included): the docstring's operation order is gguf's.
        bad = np.flatnonzero(ref.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, f"{type_name}: gguf differs from the documented formula at {bad[:5]}: " \
                              f"{ref.ravel()[bad[:5]]} vs {want.ravel()[bad[:5]]}"
        w.add_tensor(f"{type_name}.q", raw, raw_dtype=QT[type_name])
        w.add_tensor(f"{type_name}.ref", ref)
        nz = ref[ref != 0]
        print(f"{type_name:6s}: {raw.nbytes:5d} bytes, ref range [{ref.min():.4g}, {ref.max():.4g}], "
              f"smallest |nonzero| {np.abs(nz).min() if nz.size else 0:.3g}, negatives {int((ref < 0).sum())}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
