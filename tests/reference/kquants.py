"""Packing of K-quant and IQ4 blocks in numpy, for the synthetic-GGUF scripts.

gguf.quants can dequantize Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS but
cannot quantize them, so the test generators need their own packers. Only the
packing (integer fields -> block bytes) has to be right; `selfcheck()` proves it
by decoding packed random fields with gguf.quants.dequantize and comparing to the
value formula, so the layout here is never trusted on its own. The quantizers are
simple round-to-nearest (not llama.cpp's search for optimal scales): tests need
valid, realistic blocks, not the best possible ones.

Block layouts (QK_K = 256 values per block, little-endian):
  Q2_K, 84 bytes: 16 bytes scales | 64 bytes qs | f16 d | f16 dmin
        value = d*sc[j]*q - dmin*m[j], sub-block j = 16 values, q in 0..3
        scales byte j = sc[j] | m[j] << 4 (both 0..15)
        element 128h + 32k + l in bits 2k..2k+1 of qs[32h + l]
  Q3_K, 110 bytes: 32 bytes hmask | 64 bytes qs | 12 bytes scales | f16 d
        value = d*(s[j]-32)*v, sub-block j = 16 values, v = (q & 3) - 4*!hbit in -4..3
        low 2 bits placed as Q2_K's; hbit of element 32b + l is bit b of hmask[l] (set = no -4)
        scales: byte j (0..7) = (s[j] & 15) | (s[j+8] & 15) << 4
                byte 8+j (0..3) = s[j]>>4 | (s[j+4]>>4) << 2 | (s[j+8]>>4) << 4 | (s[j+12]>>4) << 6
  Q4_K, 144 bytes: f16 d | f16 dmin | 12 bytes of 6-bit (scale, min) x 8 | 128 bytes nibbles
        value = d*sc[j]*q - dmin*m[j], sub-block j = 32 values, q in 0..15
        qs byte c*32+l holds sub-block 2c (low nibble) and 2c+1 (high nibble), element l
        scales: bytes 0-3 = sc[0..3] | (sc[4..7] >> 4) << 6
                bytes 4-7 = m[0..3]  | (m[4..7]  >> 4) << 6
                bytes 8-11 = (sc[4..7] & 15) | (m[4..7] & 15) << 4
  Q5_K, 176 bytes: f16 d | f16 dmin | 12 bytes scales as Q4_K | 32 bytes qh | 128 bytes nibbles
        value = d*sc[j]*q - dmin*m[j], sub-block j = 32 values, q in 0..31
        low 4 bits placed as Q4_K's; bit 4 of element 32b + l is bit b of qh[l]
  Q6_K, 210 bytes: 128 bytes ql | 64 bytes qh | 16 x int8 scales | f16 d
        value = d*scales[j]*(q - 32), sub-block j = 16 values, q in 0..63
        in each 128-value half h, value r: low 4 bits in ql[h*64 + r%64] at bit 4*(r//64),
        high 2 bits in qh[h*32 + r%32] at bit 2*(r//32)
  IQ4_NL, 18 bytes per 32 values: f16 d | 16 bytes nibbles
        value = d*kv[q], q in 0..15, kv = kIq4nlValues; element l in the low nibble of byte l,
        element 16 + l in the high nibble
  IQ4_XS, 136 bytes: f16 d | u16 scales_h | 4 bytes scales_l | 128 bytes nibbles
        value = d*(s[j]-32)*kv[q], sub-block j = 32 values, s 6 bits: low 4 in nibble j%2 of
        scales_l[j//2], high 2 in bits 2j..2j+1 of scales_h; sub-block j's 16 bytes at 16j,
        nibbles as IQ4_NL
"""

from __future__ import annotations

import numpy as np

QK_K = 256
QK4_NL = 32
# The IQ4_NL / IQ4_XS code book (= gguf.quants.IQ4_NL.kvalues, checked in selfcheck()).
kIq4nlValues = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float16)).reshape(-1, 1).view(np.uint8)


def _crumbs(q) -> np.ndarray:
    """[nb, 256] codes 0..3 -> [nb, 64] bytes: element 128h + 32k + l in bits 2k..2k+1 of byte
    32h + l (Q2_K, Q3_K)."""
    q = np.asarray(q, dtype=np.uint8).reshape(-1, 2, 4, 32)
    assert q.max(initial=0) < 4
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _bitplanes(bits) -> np.ndarray:
    """[nb, 256] bits -> [nb, 32] bytes: element 32b + l is bit b of byte l (Q3_K hmask, Q5_K qh)."""
    bits = np.asarray(bits, dtype=np.uint8).reshape(-1, 8, 32)
    assert bits.max(initial=0) < 2
    return np.bitwise_or.reduce(bits << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)


def _nibbles16(q) -> np.ndarray:
    """[n, 32] codes 0..15 -> [n, 16] bytes: element l low nibble of byte l, 16 + l high (IQ4_NL)."""
    q = np.asarray(q, dtype=np.uint8).reshape(-1, 32)
    assert q.max(initial=0) < 16
    return q[:, :16] | (q[:, 16:] << 4)


def pack_q2_k(d, dmin, sc, mn, q) -> np.ndarray:
    """d, dmin: [nb] (fp16); sc, mn: [nb, 16] ints 0..15; q: [nb, 256] ints 0..3.
    Returns [nb, 84] uint8."""
    nb = len(d)
    sc = np.asarray(sc, dtype=np.uint8).reshape(nb, 16)
    mn = np.asarray(mn, dtype=np.uint8).reshape(nb, 16)
    assert sc.max(initial=0) < 16 and mn.max(initial=0) < 16
    scales = sc | (mn << 4)
    return np.concatenate([scales, _crumbs(np.asarray(q).reshape(nb, QK_K)), _f16_bytes(d), _f16_bytes(dmin)],
                          axis=1)


def pack_q3_k(d, s, v) -> np.ndarray:
    """d: [nb] (fp16); s: [nb, 16] ints 0..63 (the factor is s - 32); v: [nb, 256] ints -4..3.
    Returns [nb, 110] uint8."""
    nb = len(d)
    s = np.asarray(s, dtype=np.uint8).reshape(nb, 16)
    assert s.max(initial=0) < 64
    v = np.asarray(v, dtype=np.int16).reshape(nb, QK_K)
    assert v.min(initial=0) >= -4 and v.max(initial=0) <= 3
    hbit = (v >= 0).astype(np.uint8)                      # a set bit means "no -4"
    lo, hi = s & 15, s >> 4
    scales = np.concatenate([
        lo[:, :8] | (lo[:, 8:] << 4),
        hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6),
    ], axis=1).astype(np.uint8)
    return np.concatenate([_bitplanes(hbit), _crumbs(v & 3), scales, _f16_bytes(d)], axis=1)


def _pack_k_scales(sc, mn) -> np.ndarray:
    """[nb, 8] 6-bit scales and mins -> [nb, 12] bytes (Q4_K, Q5_K)."""
    sc = np.asarray(sc, dtype=np.uint8)
    mn = np.asarray(mn, dtype=np.uint8)
    assert sc.max(initial=0) < 64 and mn.max(initial=0) < 64
    return np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], axis=1).astype(np.uint8)


def _k_nibbles(q) -> np.ndarray:
    """[nb, 256] codes 0..15 -> [nb, 128] bytes: sub-block 2c low, 2c+1 high of bytes 32c.. (Q4_K, Q5_K)."""
    nb = len(q)
    q = np.asarray(q, dtype=np.uint8).reshape(nb, 8, 32)
    assert q.max(initial=0) < 16
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(nb, 128)


def pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """d, dmin: [nb] (stored as fp16); sc, mn: [nb, 8] ints 0..63; q: [nb, 256] ints 0..15.
    Returns [nb, 144] uint8."""
    nb = len(d)
    scales = _pack_k_scales(np.asarray(sc).reshape(nb, 8), np.asarray(mn).reshape(nb, 8))
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _k_nibbles(np.asarray(q).reshape(nb, QK_K))],
                          axis=1)


def pack_q5_k(d, dmin, sc, mn, q) -> np.ndarray:
    """d, dmin: [nb] (fp16); sc, mn: [nb, 8] ints 0..63; q: [nb, 256] ints 0..31.
    Returns [nb, 176] uint8."""
    nb = len(d)
    q = np.asarray(q, dtype=np.uint8).reshape(nb, QK_K)
    assert q.max(initial=0) < 32
    scales = _pack_k_scales(np.asarray(sc).reshape(nb, 8), np.asarray(mn).reshape(nb, 8))
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _bitplanes(q >> 4), _k_nibbles(q & 15)],
                          axis=1)


def pack_q6_k(d, sc, q) -> np.ndarray:
    """d: [nb] (fp16); sc: [nb, 16] ints -128..127; q: [nb, 256] ints 0..63 (value q-32).
    Returns [nb, 210] uint8."""
    nb = len(d)
    q = np.asarray(q, dtype=np.uint8).reshape(nb, 2, 128)
    assert q.max(initial=0) < 64
    ql = (q[:, :, 0:64] & 15) | ((q[:, :, 64:128] & 15) << 4)            # [nb, 2, 64]
    hi = (q >> 4) & 3
    qh = hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)
    scales = np.asarray(sc, dtype=np.int8).reshape(nb, 16).view(np.uint8)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), scales, _f16_bytes(d)], axis=1)


def pack_iq4_nl(d, q) -> np.ndarray:
    """d: [nb] (fp16); q: [nb, 32] code book indices 0..15. Returns [nb, 18] uint8."""
    nb = len(d)
    return np.concatenate([_f16_bytes(d), _nibbles16(np.asarray(q).reshape(nb, QK4_NL))], axis=1)


def pack_iq4_xs(d, s, q) -> np.ndarray:
    """d: [nb] (fp16); s: [nb, 8] ints 0..63 (the factor is s - 32); q: [nb, 256] code book
    indices 0..15. Returns [nb, 136] uint8."""
    nb = len(d)
    s = np.asarray(s, dtype=np.uint16).reshape(nb, 8)
    assert s.max(initial=0) < 64
    scales_h = np.bitwise_or.reduce((s >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype(np.uint16)
    scales_l = ((s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)).astype(np.uint8)
    qs = _nibbles16(np.asarray(q).reshape(nb * 8, 32)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), scales_h.reshape(nb, 1).view(np.uint8), scales_l, qs], axis=1)


def _f16_round(x):
    return np.asarray(x, dtype=np.float16).astype(np.float32)


def _rows(x: np.ndarray, name: str, block: int = QK_K):
    rows, cols = x.shape
    assert cols % block == 0, f"{name} row length {cols} not a multiple of {block}"
    return rows, x.astype(np.float32)


def _quantize_min_scale(b: np.ndarray, qmax: int, smax: int):
    """Round to nearest with an unsigned per-sub-block scale and min: value = d*sc*q - dmin*m.
    b: [nb, n_sub, width] -> d, dmin [nb]; sc, mn [nb, n_sub] in 0..smax; q [nb, n_sub, width] in 0..qmax."""
    lo = np.minimum(b.min(axis=2), 0.0)                   # the format's min is subtracted: keep it <= 0
    scale = (b.max(axis=2) - lo) / qmax
    d = _f16_round(scale.max(axis=1) / smax)
    dmin = _f16_round((-lo).max(axis=1) / smax)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, smax)
        mn = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, smax)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint((b + (dmin[:, None] * mn)[..., None]) / step[..., None]), 0)
    return d, dmin, sc, mn, q.clip(0, qmax)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _nearest_iq4(y: np.ndarray) -> np.ndarray:
    """Index of the nearest code book value to each y (ties: the lower index)."""
    return np.abs(y[..., None] - kIq4nlValues).argmin(axis=-1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*84] uint8 (round to nearest)."""
    rows, x = _rows(x, "Q2_K")
    d, dmin, sc, mn, q = _quantize_min_scale(x.reshape(-1, 16, 16), 3, 15)
    return pack_q2_k(d, dmin, sc, mn, q.reshape(-1, QK_K)).reshape(rows, -1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*110] uint8 (round to nearest; symmetric scales,
    signed so that each sub-block's largest magnitude lands on the -4 end)."""
    rows, x = _rows(x, "Q3_K")
    b = x.reshape(-1, 16, 16)
    scale = -_signed_absmax(b) / 4.0
    d = _f16_round(np.abs(scale).max(axis=1) / 31.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-32, 31)
        step = d[:, None] * sc
        v = np.where(step[..., None] != 0, np.rint(b / step[..., None]), 0)
    return pack_q3_k(d, sc + 32, v.clip(-4, 3).reshape(-1, QK_K)).reshape(rows, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*144] uint8 (round to nearest)."""
    rows, x = _rows(x, "Q4_K")
    d, dmin, sc, mn, q = _quantize_min_scale(x.reshape(-1, 8, 32), 15, 63)
    return pack_q4_k(d, dmin, sc, mn, q.reshape(-1, QK_K)).reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*176] uint8 (round to nearest)."""
    rows, x = _rows(x, "Q5_K")
    d, dmin, sc, mn, q = _quantize_min_scale(x.reshape(-1, 8, 32), 31, 63)
    return pack_q5_k(d, dmin, sc, mn, q.reshape(-1, QK_K)).reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*210] uint8 (round to nearest)."""
    rows, x = _rows(x, "Q6_K")
    b = x.reshape(-1, 16, 16)
    sub = np.abs(b).max(axis=2) / 31.0
    d = _f16_round(sub.max(axis=1) / 127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(sub / d[:, None]), 0).clip(-128, 127)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint(b / step[..., None]), 0)
    q = q.clip(-32, 31) + 32
    return pack_q6_k(d, sc, q.reshape(-1, QK_K)).reshape(rows, -1)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/32*18] uint8: per block of 32, d maps the largest
    magnitude onto the code book's -127 end, then each value takes the nearest code."""
    rows, x = _rows(x, "IQ4_NL", QK4_NL)
    b = x.reshape(-1, QK4_NL)
    d = _f16_round(-_signed_absmax(b) / 127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(d[:, None] != 0, b / d[:, None], 0)
    return pack_iq4_nl(d, _nearest_iq4(y)).reshape(rows, -1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*136] uint8: per sub-block of 32 a signed scale that
    maps its largest magnitude onto -127, stored as d*(s-32); then the nearest code per value."""
    rows, x = _rows(x, "IQ4_XS")
    b = x.reshape(-1, 8, 32)
    scale = -_signed_absmax(b) / 127.0
    d = _f16_round(np.abs(scale).max(axis=1) / 31.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-32, 31)
        step = d[:, None] * ls
        y = np.where(step[..., None] != 0, b / step[..., None], 0)
    return pack_iq4_xs(d, ls + 32, _nearest_iq4(y).reshape(-1, QK_K)).reshape(rows, -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
              "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs}


def selfcheck(seed: int = 1234) -> None:
    """Pack random fields and decode them with gguf: the only authority on layout."""
    import gguf
    from gguf import GGMLQuantizationType as QT
    rng = np.random.default_rng(seed)
    nb = 8
    F32 = np.float32
    assert kIq4nlValues.tolist() == list(gguf.quants.IQ4_NL.kvalues), "code book differs from gguf's"
    d = rng.normal(0, 1, nb).astype(np.float16)
    dmin = rng.normal(0, 1, nb).astype(np.float16)
    df = d.astype(F32)[:, None]
    dminf = dmin.astype(F32)[:, None]

    def check(name, raw, want, n_sub):
        qt = QT[name]
        assert raw.shape == (nb, gguf.GGML_QUANT_SIZES[qt][1] * QK_K // gguf.GGML_QUANT_SIZES[qt][0]), \
            (name, raw.shape)
        got = gguf.quants.dequantize(raw, qt).reshape(nb, n_sub, -1)
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6), f"{name} packing disagrees with gguf"

    sc = rng.integers(0, 16, (nb, 16))
    mn = rng.integers(0, 16, (nb, 16))
    q = rng.integers(0, 4, (nb, QK_K))
    check("Q2_K", pack_q2_k(d, dmin, sc, mn, q),
          (df * sc)[..., None] * q.reshape(nb, 16, 16) - (dminf * mn)[..., None], 16)

    s = rng.integers(0, 64, (nb, 16))
    v = rng.integers(-4, 4, (nb, QK_K))
    check("Q3_K", pack_q3_k(d, s, v), (df * (s - 32))[..., None] * v.reshape(nb, 16, 16), 16)

    sc = rng.integers(0, 64, (nb, 8))
    mn = rng.integers(0, 64, (nb, 8))
    q = rng.integers(0, 16, (nb, QK_K))
    check("Q4_K", pack_q4_k(d, dmin, sc, mn, q),
          (df * sc)[..., None] * q.reshape(nb, 8, 32) - (dminf * mn)[..., None], 8)

    q = rng.integers(0, 32, (nb, QK_K))
    check("Q5_K", pack_q5_k(d, dmin, sc, mn, q),
          (df * sc)[..., None] * q.reshape(nb, 8, 32) - (dminf * mn)[..., None], 8)

    sc6 = rng.integers(-128, 128, (nb, 16))
    q6 = rng.integers(0, 64, (nb, QK_K))
    check("Q6_K", pack_q6_k(d, sc6, q6), (df * sc6)[..., None] * (q6.reshape(nb, 16, 16) - 32), 16)

    # IQ4_NL: nb*8 blocks of 32, so the same (nb, 256) shape check applies.
    dn = rng.normal(0, 1, nb * 8).astype(np.float16)
    q = rng.integers(0, 16, (nb * 8, QK4_NL))
    check("IQ4_NL", pack_iq4_nl(dn, q).reshape(nb, -1),
          (dn.astype(F32)[:, None] * kIq4nlValues[q]).reshape(nb, 8, 32), 8)

    s = rng.integers(0, 64, (nb, 8))
    q = rng.integers(0, 16, (nb, QK_K))
    check("IQ4_XS", pack_iq4_xs(d, s, q), (df * (s - 32))[..., None] * kIq4nlValues[q].reshape(nb, 8, 32), 8)

    # Quantizers: round trip error must be a small fraction of the data scale.
    x = rng.normal(0, 0.05, (4, 512)).astype(np.float32)
    for name, tol in (("Q2_K", 0.45), ("Q3_K", 0.25), ("Q4_K", 0.15), ("Q5_K", 0.06), ("Q6_K", 0.04),
                      ("IQ4_NL", 0.12), ("IQ4_XS", 0.12)):
        y = gguf.quants.dequantize(QUANTIZERS[name](x), QT[name]).reshape(x.shape)
        rel = np.sqrt(np.mean((y - x) ** 2)) / np.std(x)
        assert rel < tol, f"{name} round trip rms error {rel:.3f} of std"


if __name__ == "__main__":
    selfcheck()
    print("kquants: Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS packing and quantizers agree with "
          "gguf.quants.dequantize")
