"""A scalar model of the core's integer products (native/quant.c): activations quantized
to 16 bits per block of 32, the weights' small integers, exact integer block sums, and the
one float order per output element. Independent of the C code: the integers are parsed
from the GGUF block layouts here, and every float step is the float32 operation the core
performs, fused multiply-adds included (fmaf32 below), so the core's outputs must equal
it bit for bit."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

# weight types the core multiplies over 16-bit activations
INT_TYPES = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k")
QMAX = 32767


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token, blocks of 32 float32 values: dx = amax / 32767, q = rint(x * (32767 /
    amax)) (nearest even; dx = 0 and q = 0 for an all-zero block), every step in float32.
    Returns q [..., blocks, 32] (int64) and dx [..., blocks] (float32)."""
    x32 = np.asarray(x, dtype=np.float32)
    blocks = x32.reshape(*x32.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(QMAX) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    return q, (amax / np.float32(QMAX)).astype(np.float32)


def dequantize_activations(x: np.ndarray) -> np.ndarray:
    """x as its 16-bit blocks stand for it (float64 dx * q)."""
    q, dx = quantize(x)
    return (dx[..., None].astype(np.float64) * q).reshape(np.shape(x))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and mins of Q4_K/Q5_K blocks ([..., 12] bytes)."""
    sc = sc.astype(np.int64)
    s, m = np.empty(sc.shape[:-1] + (8,), np.int64), np.empty(sc.shape[:-1] + (8,), np.int64)
    for j in range(8):
        if j < 4:
            s[..., j], m[..., j] = sc[..., j] & 63, sc[..., j + 4] & 63
        else:
            s[..., j] = (sc[..., j + 4] & 0xF) | ((sc[..., j - 4] >> 6) << 4)
            m[..., j] = (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)
    return s, m


def weight_blocks(raw: np.ndarray, dtype: str, cols: int) -> tuple[np.ndarray, ...]:
    """Rows of a quantized type ([rows][row bytes]) as the integer product sees them:
    w [rows, cols/32, 32] (int64), dw and dw2 (Q6_K's second half) and mw [rows, cols/32]
    (float32: the scales of the block's integer sums and of its activation sum)."""
    rows = raw.shape[0]
    nb = cols // 32
    z = np.zeros((rows, nb), np.float32)
    if dtype in ("q8_0", "q4_0", "q4_1", "q5_0"):
        size = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22}[dtype]
        b = raw.reshape(rows, nb, size)
        dw = _f16(b[..., 0:2])
        if dtype == "q8_0":
            return b[..., 2:].view(np.int8).astype(np.int64), dw, z, z
        qs = b[..., size - 16:].astype(np.int64)
        w = np.concatenate([qs & 0xF, qs >> 4], -1)
        if dtype == "q4_0":
            return w - 8, dw, z, z
        if dtype == "q4_1":
            return w, dw, z, _f16(b[..., 2:4])
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)[..., 0].astype(np.int64)
        bits = (qh[..., None] >> np.arange(32)) & 1
        return (w | bits << 4) - 16, dw, z, z
    size = {"q4_k": 144, "q5_k": 176, "q6_k": 210}[dtype]
    b = raw.reshape(rows, cols // 256, size)
    w = np.empty((rows, cols // 256, 8, 32), np.int64)
    if dtype == "q6_k":
        ql, qh = b[..., 0:128].astype(np.int64), b[..., 128:192].astype(np.int64)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        dw = np.empty((rows, cols // 256, 8), np.float32)
        dw2 = np.empty_like(dw)
        for s in range(8):
            h, g = s // 4, s % 4
            lo = ql[..., 64 * h + 32 * (g & 1):64 * h + 32 * (g & 1) + 32]
            lo = lo >> 4 if g >= 2 else lo & 0xF
            hi = (qh[..., 32 * h:32 * h + 32] >> (2 * g)) & 3
            w[..., s, :] = (lo | hi << 4) - 32
            dw[..., s] = d * sc[..., 8 * h + 2 * g]
            dw2[..., s] = d * sc[..., 8 * h + 2 * g + 1]
        return w.reshape(rows, nb, 32), dw.reshape(rows, nb), dw2.reshape(rows, nb), z
    k5 = dtype == "q5_k"
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k4_scales(b[..., 4:16])
    qh = b[..., 16:48].astype(np.int64) if k5 else None
    qs = b[..., 48 if k5 else 16:].astype(np.int64)
    for s in range(8):
        v = qs[..., 32 * (s // 2):32 * (s // 2) + 32]
        v = v >> 4 if s & 1 else v & 0xF
        if k5:
            v = v | ((qh >> s) & 1) << 4
        w[..., s, :] = v
    dw = d[..., None] * sc.astype(np.float32)
    mw = -(dmin[..., None] * mn.astype(np.float32))
    return w.reshape(rows, nb, 32), dw.reshape(rows, nb), z, mw.reshape(rows, nb)


def fmaf32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add, correctly rounded: a * b + c in float64 (the product
    is exact), rounded to float32; that double rounding can differ from one rounding
    only when the float64 result is a float32 midpoint, and those are redone exactly."""
    shape = np.broadcast_shapes(np.shape(a), np.shape(b), np.shape(c))
    a, b, c = (np.broadcast_to(np.asarray(v, np.float32), shape).ravel() for v in (a, b, c))
    r64 = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    out = r64.astype(np.float32)
    lo = np.nextafter(out, np.float32(-np.inf)).astype(np.float64)
    hi = np.nextafter(out, np.float32(np.inf)).astype(np.float64)
    mid = ((out.astype(np.float64) + lo) / 2 == r64) | ((out.astype(np.float64) + hi) / 2 == r64)
    for i in zip(*np.nonzero(mid), strict=True):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        cand = [np.float32(v) for v in (lo[i], out[i], hi[i])]
        dist = [abs(Fraction(float(v)) - exact) for v in cand]
        best = min(dist)
        ties = [v for v, dd in zip(cand, dist, strict=True) if dd == best]
        out[i] = ties[0] if len(ties) == 1 else next(
            v for v in ties if not np.float32(v).view(np.uint32) & 1)
    return out.reshape(shape)


def product(raw: np.ndarray, dtype: str, cols: int, x: np.ndarray) -> np.ndarray:
    """out [tokens, rows] of rows (raw) times x [tokens, cols], in the core's order."""
    w, dw, dw2, mw = weight_blocks(raw, dtype, cols)
    q, dx = quantize(x)                                                  # [T, nb, 32], [T, nb]
    sq = q.sum(-1).astype(np.float32)                                    # exact: < 2^24
    halves = dtype == "q6_k"
    acc = np.zeros((x.shape[0], raw.shape[0]), np.float32)
    for blk in range(cols // 32):
        wb, qb = w[:, blk, :], q[:, blk, :]                              # [R, 32], [T, 32]
        d = dx[:, blk][:, None]
        if halves:
            i1 = (qb[:, None, :16] * wb[None, :, :16]).sum(-1)
            i2 = (qb[:, None, 16:] * wb[None, :, 16:]).sum(-1)
            acc = fmaf32(dw[None, :, blk] * d, i1.astype(np.float32), acc)
            acc = fmaf32(dw2[None, :, blk] * d, i2.astype(np.float32), acc)
        else:
            isum = (qb[:, None, :] * wb[None, :, :]).sum(-1)
            acc = fmaf32(dw[None, :, blk] * d, isum.astype(np.float32), acc)
        if dtype in ("q4_1", "q4_k", "q5_k"):
            acc = fmaf32(mw[None, :, blk], d * sq[:, blk][:, None], acc)
    return acc
