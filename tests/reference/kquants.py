"""Packing of Q4_K and Q6_K blocks in numpy, for the synthetic-GGUF scripts.

gguf.quants can dequantize Q4_K/Q6_K but cannot quantize them, so the test
generators need their own packers. Only the packing (integer fields -> block
bytes) has to be right; `selfcheck()` proves it by decoding packed random fields
with gguf.quants.dequantize and comparing to the value formula, so the layout
here is never trusted on its own. The quantizers are simple round-to-nearest
(not llama.cpp's search for optimal scales): tests need valid, realistic
blocks, not the best possible ones.

Block layouts (QK_K = 256 values per block, little-endian):
  Q4_K, 144 bytes: f16 d | f16 dmin | 12 bytes of 6-bit (scale, min) x 8 | 128 bytes nibbles
        value = d*sc[j]*q - dmin*m[j], sub-block j = 32 values, q in 0..15
        qs byte c*32+l holds sub-block 2c (low nibble) and 2c+1 (high nibble), element l
        scales: bytes 0-3 = sc[0..3] | (sc[4..7] >> 4) << 6
                bytes 4-7 = m[0..3]  | (m[4..7]  >> 4) << 6
                bytes 8-11 = (sc[4..7] & 15) | (m[4..7] & 15) << 4
  Q6_K, 210 bytes: 128 bytes ql | 64 bytes qh | 16 x int8 scales | f16 d
        value = d*scales[j]*(q - 32), sub-block j = 16 values, q in 0..63
        in each 128-value half h, value r: low 4 bits in ql[h*64 + r%64] at bit 4*(r//64),
        high 2 bits in qh[h*32 + r%32] at bit 2*(r//32)
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float16)).reshape(-1, 1).view(np.uint8)


def pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """d, dmin: [nb] (stored as fp16); sc, mn: [nb, 8] ints 0..63; q: [nb, 256] ints 0..15.
    Returns [nb, 144] uint8."""
    nb = len(d)
    sc = np.asarray(sc, dtype=np.uint8).reshape(nb, 8)
    mn = np.asarray(mn, dtype=np.uint8).reshape(nb, 8)
    assert sc.max(initial=0) < 64 and mn.max(initial=0) < 64
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], axis=1).astype(np.uint8)
    q = np.asarray(q, dtype=np.uint8).reshape(nb, 8, 32)
    assert q.max(initial=0) < 16
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


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


def _f16_round(x):
    return np.asarray(x, dtype=np.float16).astype(np.float32)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*144] uint8 (round to nearest)."""
    rows, cols = x.shape
    assert cols % QK_K == 0, f"Q4_K row length {cols} not a multiple of {QK_K}"
    b = x.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(b.min(axis=2), 0.0)                   # the format's min is subtracted: keep it <= 0
    scale = (b.max(axis=2) - lo) / 15.0
    d = _f16_round(scale.max(axis=1) / 63.0)
    dmin = _f16_round((-lo).max(axis=1) / 63.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63)
        mn = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint((b + (dmin[:, None] * mn)[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15)
    return pack_q4_k(d, dmin, sc, mn, q.reshape(-1, QK_K)).reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*210] uint8 (round to nearest)."""
    rows, cols = x.shape
    assert cols % QK_K == 0, f"Q6_K row length {cols} not a multiple of {QK_K}"
    b = x.astype(np.float32).reshape(-1, 16, 16)
    sub = np.abs(b).max(axis=2) / 31.0
    d = _f16_round(sub.max(axis=1) / 127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(sub / d[:, None]), 0).clip(-128, 127)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint(b / step[..., None]), 0)
    q = q.clip(-32, 31) + 32
    return pack_q6_k(d, sc, q.reshape(-1, QK_K)).reshape(rows, -1)


def selfcheck(seed: int = 1234) -> None:
    """Pack random fields and decode them with gguf: the only authority on layout."""
    import gguf
    from gguf import GGMLQuantizationType as QT
    rng = np.random.default_rng(seed)
    nb = 8
    d = rng.normal(0, 1, nb).astype(np.float16)
    dmin = rng.normal(0, 1, nb).astype(np.float16)
    sc = rng.integers(0, 64, (nb, 8))
    mn = rng.integers(0, 64, (nb, 8))
    q = rng.integers(0, 16, (nb, QK_K))
    got = gguf.quants.dequantize(pack_q4_k(d, dmin, sc, mn, q), QT.Q4_K).reshape(nb, 8, 32)
    want = (d.astype(np.float32)[:, None] * sc)[..., None] * q.reshape(nb, 8, 32) \
        - (dmin.astype(np.float32)[:, None] * mn)[..., None]
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6), "Q4_K packing disagrees with gguf"

    sc6 = rng.integers(-128, 128, (nb, 16))
    q6 = rng.integers(0, 64, (nb, QK_K))
    got = gguf.quants.dequantize(pack_q6_k(d, sc6, q6), QT.Q6_K).reshape(nb, 16, 16)
    want = (d.astype(np.float32)[:, None] * sc6)[..., None] * (q6.reshape(nb, 16, 16) - 32)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6), "Q6_K packing disagrees with gguf"

    # Quantizers: round trip error must be a small fraction of the data scale.
    x = rng.normal(0, 0.05, (4, 512)).astype(np.float32)
    for qt, fn, tol in ((QT.Q4_K, quantize_q4_k, 0.15), (QT.Q6_K, quantize_q6_k, 0.04)):
        y = gguf.quants.dequantize(fn(x), qt).reshape(x.shape)
        rel = np.sqrt(np.mean((y - x) ** 2)) / np.std(x)
        assert rel < tol, f"{qt.name} round trip rms error {rel:.3f} of std"


if __name__ == "__main__":
    selfcheck()
    print("kquants: Q4_K/Q6_K packing and quantizers agree with gguf.quants.dequantize")
