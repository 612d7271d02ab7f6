"""An independent, pure-numpy oracle of docs/SPEC.md §2, §6, §7 and §8 (written from the SPEC text only).

Conventions
-----------
* bf16 tensors are numpy ``uint16`` arrays holding the bf16 bit patterns.
* fp32 tensors are numpy ``float32`` arrays.
* All arithmetic is numpy float32 (each operation correctly rounded, no FMA); bf16 narrowing
  is round-to-nearest-even on the uint32 bit pattern; sqrt is computed in float64 and rounded
  to float32 (correctly rounded sqrt for fp32 inputs).
* e4m3 / e2m1 encoders are a nearest-value search over the code tables with ties to the even
  code (no bit tricks).

Entry points: :func:`oracle_call` (the fused operator), :func:`oracle_store` (store_kv_cache),
:func:`oracle_load` (load_paged_kv_cache).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

F32 = np.float32
FMAX = {"e4m3": F32(448.0), "e2m1": F32(6.0)}
AMAX_MARGIN = F32(1e-4)
SF_ITEM = {"ue8m0": 1, "ue8m0_fp32": 4, "e4m3": 1, "fp32": 4}


# --------------------------------------------------------------------------------------------
# scalar formats
# --------------------------------------------------------------------------------------------
def bf16_to_f32(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> exact float32."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (integer arithmetic on the bits)."""
    x = np.array(x, dtype=np.float32)
    shape = x.shape
    x = x.reshape(-1)
    u = x.view(np.uint32).astype(np.uint64)
    lsb = (u >> np.uint64(16)) & np.uint64(1)
    r = ((u + np.uint64(0x7FFF) + lsb) >> np.uint64(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r = np.where(nan, ((u >> np.uint64(16)) | np.uint64(0x40)).astype(np.uint16), r)
    return r.reshape(shape)


def _e4m3_value(code: int) -> float:
    """Value of an e4m3fn magnitude code 0..126 (0x7F is NaN)."""
    e = code >> 3
    m = code & 7
    if e == 0:
        return m * 2.0 ** -9          # subnormal: m/8 * 2^-6
    return (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3_TABLE = np.array([_e4m3_value(c) for c in range(127)], dtype=np.float64)  # codes 0..126
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)  # codes 0..7


def _nearest_code(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table value to each |value| (float64, exact), ties to the even index;
    values above the table saturate to the last code (callers clamp before)."""
    mag = mag.astype(np.float64)
    hi = np.searchsorted(table, mag, side="left")        # first table value >= mag
    hi = np.clip(hi, 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    lo_v = table[lo]
    hi_v = table[hi]
    exact = hi_v == mag
    # compare 2*mag with lo+hi (both exact in float64 for these small-precision tables)
    two = 2.0 * mag
    mid2 = lo_v + hi_v
    code = np.where(two < mid2, lo, np.where(two > mid2, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(exact, hi, code)
    code = np.where(mag > table[-1], len(table) - 1, code)
    return code.astype(np.uint8)


def _is_negative(x: np.ndarray) -> np.ndarray:
    return np.signbit(x)


def encode_e4m3(x) -> np.ndarray:
    """float32 -> e4m3fn byte, RTNE, sign kept (negative values rounding to 0 give 0x80).
    Inputs must be finite with |x| <= 448 (the SPEC clamps before every conversion)."""
    x = np.asarray(x, dtype=np.float32)
    code = _nearest_code(np.abs(x), E4M3_TABLE)
    return np.where(_is_negative(x), code | np.uint8(0x80), code).astype(np.uint8)


def decode_e4m3(b) -> np.ndarray:
    b = np.asarray(b, dtype=np.uint8)
    mag = b & np.uint8(0x7F)
    v = np.where(mag == 0x7F, np.nan, E4M3_TABLE[np.minimum(mag, 126)])
    v = np.where(b & 0x80, -v, v)
    return v.astype(np.float32)


def encode_e2m1(x) -> np.ndarray:
    """float32 -> e2m1 code (0..15, sign in bit 3), RTNE, sign kept. |x| <= 6 expected."""
    x = np.asarray(x, dtype=np.float32)
    code = _nearest_code(np.abs(x), E2M1_TABLE)
    return np.where(_is_negative(x), code | np.uint8(8), code).astype(np.uint8)


def decode_e2m1(c) -> np.ndarray:
    c = np.asarray(c, dtype=np.uint8)
    v = E2M1_TABLE[c & 7]
    v = np.where(c & 8, -v, v)
    return v.astype(np.float32)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[..., D] codes -> [..., D/2] bytes, the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_e2m1(b: np.ndarray) -> np.ndarray:
    lo = b & np.uint8(0xF)
    hi = b >> np.uint8(4)
    return np.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def as_f32(t) -> np.ndarray:
    """A weight / table given as uint16 (bf16 bits) or float32 -> float32."""
    t = np.asarray(t)
    if t.dtype == np.uint16:
        return bf16_to_f32(t)
    assert t.dtype == np.float32, t.dtype
    return t


# --------------------------------------------------------------------------------------------
# stages
# --------------------------------------------------------------------------------------------
def _tree(p: np.ndarray) -> np.ndarray:
    """The adjacent-pairs tree sum over the last axis, zero-padded to a power of two."""
    D = p.shape[-1]
    P = 1
    while P < D:
        P *= 2
    if P != D:
        p = np.concatenate([p, np.zeros(p.shape[:-1] + (P - D,), np.float32)], axis=-1)
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def rmsnorm(x_bits: np.ndarray, w, eps: float) -> np.ndarray:
    xf = bf16_to_f32(x_bits)
    D = xf.shape[-1]
    ss = _tree(xf * xf)
    mean = ss / F32(D)
    arg = mean + F32(eps)
    sq = np.sqrt(arg.astype(np.float64)).astype(np.float32)
    rstd = F32(1.0) / sq
    wf = as_f32(w)
    return f32_to_bf16((xf * rstd[..., None]) * wf)


def layernorm(x_bits: np.ndarray, w, b, eps: float) -> np.ndarray:
    """SPEC §6 LayerNorm: s = tree(x); mean = s / D; d = x - mean; var = tree(d * d) / D;
    rstd = 1 / sqrt(var + eps); y = bf16(((d * rstd) * w) + b) (no + b without a bias)."""
    xf = bf16_to_f32(x_bits)
    D = F32(xf.shape[-1])
    mean = _tree(xf) / D
    d = xf - mean[..., None]
    var = _tree(d * d) / D
    sq = np.sqrt((var + F32(eps)).astype(np.float64)).astype(np.float32)
    rstd = F32(1.0) / sq
    y = (d * rstd[..., None]) * as_f32(w)
    if b is not None:
        y = y + as_f32(b)
    return f32_to_bf16(y)


def rope(y_bits: np.ndarray, positions, cos_sin, rotary_dim: int, is_neox: bool,
         offset: Optional[int], conjugate: bool) -> np.ndarray:
    """y_bits [n, H, D] (uint16); positions [n]."""
    n, H, D = y_bits.shape
    if offset is None:
        offset = D - rotary_dim
    half = rotary_dim // 2
    cs = as_f32(cos_sin)
    maxpos = cs.shape[0]
    out = y_bits.copy()
    positions = np.asarray(positions).astype(np.int64)
    j = np.arange(half)
    if is_neox:
        i0 = offset + j
        i1 = offset + half + j
    else:
        i0 = offset + 2 * j
        i1 = offset + 2 * j + 1
    valid = (positions >= 0) & (positions < maxpos)
    rows = np.flatnonzero(valid)
    if len(rows):
        pv = positions[rows]
        c = cs[pv, :half][:, None, :]                 # [r, 1, half], shared by the heads
        s = cs[pv, half:2 * half][:, None, :]
        a = bf16_to_f32(y_bits[rows][:, :, i0])
        b = bf16_to_f32(y_bits[rows][:, :, i1])
        if not conjugate:
            r0 = (a * c) - (b * s)
            r1 = (a * s) + (b * c)
        else:
            r0 = (a * c) + (b * s)
            r1 = (b * c) - (a * s)
        sub = out[rows]
        sub[:, :, i0] = f32_to_bf16(r0)
        sub[:, :, i1] = f32_to_bf16(r1)
        out[rows] = sub                                  # invalid positions: identity
    return out


def hadamard(y_bits: np.ndarray, scale: float) -> np.ndarray:
    h = bf16_to_f32(y_bits).copy()
    D = h.shape[-1]
    assert D & (D - 1) == 0
    lead = h.shape[:-1]
    r = 0
    while (1 << r) < D:
        step = 1 << r
        v = h.reshape(lead + (D // (2 * step), 2, step))
        a = v[..., 0, :]
        b = v[..., 1, :]
        h = np.stack([a + b, a - b], axis=-2).reshape(lead + (D,))
        r += 1
    return f32_to_bf16(h * F32(scale))


class Quant(NamedTuple):
    q: np.ndarray          # e4m3: uint8 bytes [..., Dq]; e2m1: packed uint8 [..., Dq/2]
    codes: np.ndarray      # unpacked codes [..., Dq] (uint8)
    sf_bytes: np.ndarray   # [..., ngroups * item] raw little-endian scale bytes
    sf_value: np.ndarray   # [..., ngroups] the stored scale as a numpy value (uint8 / uint8 / f32)
    d: np.ndarray          # [..., ngroups] dequant scales, float32
    cast_back: np.ndarray  # bf16 bits [..., Dq]


def quantize(v_bits: np.ndarray, cast_fmt: str, g: int, sf_format: str, scale_floor=None) -> Quant:
    """SPEC §6 quantization; scale_floor (power-of-two formats): the scale is
    2^ceil(log2(max(amax / fmax, scale_floor)))."""
    vf = bf16_to_f32(v_bits)
    Dq = vf.shape[-1]
    lead = vf.shape[:-1]
    G = vf.reshape(lead + (Dq // g, g))
    fmax = FMAX[cast_fmt]
    amax = np.maximum(np.abs(G).max(axis=-1), AMAX_MARGIN).astype(np.float32)
    if sf_format in ("ue8m0", "ue8m0_fp32"):
        s = (amax / fmax).astype(np.float32)
        if scale_floor is not None:
            s = np.maximum(s, F32(scale_floor)).astype(np.float32)
        bits = s.view(np.int32).astype(np.int64)
        e = ((bits - 1) >> 23) + 1 - 127
        m = np.ldexp(np.float32(1.0), (-e).astype(np.int32)).astype(np.float32)
        d = np.ldexp(np.float32(1.0), e.astype(np.int32)).astype(np.float32)
        if sf_format == "ue8m0":
            sf_value = (e + 127).astype(np.uint8)
            sf_bytes = sf_value.copy()
        else:
            sf_value = d.copy()
            sf_bytes = np.ascontiguousarray(d.astype("<f4")).view(np.uint8).reshape(lead + (-1,))
    elif sf_format == "e4m3":
        s = np.minimum(np.maximum(amax / fmax, F32(2.0 ** -9)), F32(448.0)).astype(np.float32)
        sbyte = encode_e4m3(s)
        sq = decode_e4m3(sbyte)
        m = (F32(1.0) / sq).astype(np.float32)
        d = sq
        sf_value = sbyte
        sf_bytes = sbyte.copy()
    elif sf_format == "fp32":
        s = (amax / fmax).astype(np.float32)
        m = (fmax / amax).astype(np.float32)
        d = s
        sf_value = s.copy()
        sf_bytes = np.ascontiguousarray(s.astype("<f4")).view(np.uint8).reshape(lead + (-1,))
    else:
        raise ValueError(sf_format)
    t = np.minimum(np.maximum(G * m[..., None], -fmax), fmax).astype(np.float32)
    if cast_fmt == "e4m3":
        codes = encode_e4m3(t)
        qf = decode_e4m3(codes)
        codes = codes.reshape(lead + (Dq,))
        q = codes
    else:
        codes = encode_e2m1(t)
        qf = decode_e2m1(codes)
        codes = codes.reshape(lead + (Dq,))
        q = pack_e2m1(codes)
    cb = f32_to_bf16((qf * d[..., None]).astype(np.float32)).reshape(lead + (Dq,))
    return Quant(q, codes, sf_bytes, sf_value, d, cb)


# --------------------------------------------------------------------------------------------
# cache layout
# --------------------------------------------------------------------------------------------
class Fmt(NamedTuple):
    head_dim: int
    cast_fmt: Optional[str]
    g: Optional[int]
    sf_format: Optional[str]
    token_interleaved: bool
    sf_bytes: int           # total scale bytes of a record, reserved included
    bf16_tail: int
    scale_floor: Optional[float] = None
    zero_reserved: bool = False   # the reserved scale bytes are written as zeros with each record

    @property
    def quant_dim(self):
        return self.head_dim - self.bf16_tail if self.cast_fmt else self.head_dim

    @property
    def quant_bytes(self):
        if self.cast_fmt is None:
            return 2 * self.head_dim
        return self.quant_dim if self.cast_fmt == "e4m3" else self.quant_dim // 2

    @property
    def data_bytes(self):
        return self.quant_bytes + (2 * self.bf16_tail if self.cast_fmt else 0)

    @property
    def sf_exact(self):
        if self.cast_fmt is None:
            return 0
        return (self.quant_dim // self.g) * SF_ITEM[self.sf_format]

    @property
    def bytes_per_token(self):
        return self.data_bytes + self.sf_bytes


def make_fmt(head_dim, cast_fmt, g, sf_format, token_interleaved, sf_bytes=None, bf16_tail=0, scale_floor=None,
             zero_reserved=False) -> Fmt:
    """Build from the SPEC fields (sf_bytes None = the exact scale bytes)."""
    f = Fmt(head_dim, cast_fmt, g, sf_format, token_interleaved, 0, bf16_tail if cast_fmt else 0, scale_floor,
            zero_reserved)
    if sf_bytes is None:
        sf_bytes = f.sf_exact
    return f._replace(sf_bytes=sf_bytes)


class CacheDesc(NamedTuple):
    storage: np.ndarray     # flat uint8: the whole underlying storage
    fmt: Fmt
    shape: tuple            # (num_blocks, block_size, num_heads, bytes_per_token)
    strides: tuple          # byte strides
    offset: int             # storage offset in bytes
    slots: np.ndarray       # [n]


def _record_spans(c: CacheDesc, block: int, off: int, head: int):
    """(data_addr, sf_addr, tail_addr) byte addresses of one record."""
    f = c.fmt
    s0, s1, s2, _ = c.strides
    if f.token_interleaved:
        rec = c.offset + block * s0 + off * s1 + head * s2
        return rec, rec + f.quant_bytes, rec + f.quant_bytes + f.sf_bytes
    assert head == 0
    base = c.offset + block * s0
    data = base + off * f.data_bytes
    sf = base + c.shape[1] * f.data_bytes + off * f.sf_bytes
    return data, sf, data + f.quant_bytes


def write_records(c: CacheDesc, qbytes, sfbytes, tailbytes) -> np.ndarray:
    """Scatter per-(row, head) record parts into a copy of the storage.
    qbytes [n, H, quant_bytes]; sfbytes [n, H, sf_exact] or None; tailbytes [n, H, 2*tail] or None.
    A format with zero_reserved gets zeros in the reserved bytes after the scales (sf_exact .. sf_bytes)."""
    st = c.storage.copy()
    nb, bs, nh, _ = c.shape
    cap = nb * bs
    n = len(c.slots)
    for t in range(n):
        s = int(c.slots[t])
        if not (0 <= s < cap):
            continue
        b, o = divmod(s, bs)
        for h in range(nh):
            da, sa, ta = _record_spans(c, b, o, h)
            st[da:da + qbytes.shape[-1]] = qbytes[t, h]
            if sfbytes is not None and sfbytes.shape[-1]:
                st[sa:sa + sfbytes.shape[-1]] = sfbytes[t, h]
                if c.fmt.zero_reserved:
                    st[sa + c.fmt.sf_exact:sa + c.fmt.sf_bytes] = 0
            if tailbytes is not None and tailbytes.shape[-1]:
                st[ta:ta + tailbytes.shape[-1]] = tailbytes[t, h]
    return st


def bf16_bytes(bits: np.ndarray) -> np.ndarray:
    """bf16 bits [..., k] -> little-endian bytes [..., 2k]."""
    b = np.ascontiguousarray(bits.astype("<u2"))
    return b.view(np.uint8).reshape(bits.shape[:-1] + (2 * bits.shape[-1],))


# --------------------------------------------------------------------------------------------
# the fused operator
# --------------------------------------------------------------------------------------------
def oracle_call(x, norm=None, rope=None, hadamard_scale=None, cast=None, cache=None, out_stage=None):
    """What fused_norm_rope_hadamard_cast_store_kvcache must produce.

    x: uint16 bf16 bits [n, D] or [n, H, D].
    norm: (w, eps) with w uint16 (bf16) or float32 [D] (RMSNorm), or (w, eps, b, "layer") (LayerNorm;
        b as w, or None).
    rope: (positions, cos_sin, rotary_dim, is_neox, offset|None, conjugate).
    hadamard_scale: float or None.
    cast: (cast_fmt, g, sf_format, cast_back) or None (ignored with a cache: the cache's format
        decides; it must match).
    cache: CacheDesc or None.
    out_stage: "norm" | "transform" | "cast_back" | None (with a cache).

    Returns a dict with
      'result': what the call returns (no cache) -- bf16 bits, or a tuple (q bytes, sf value);
      'norm', 'transform', 'cast_back': the bf16 bits of each stage (shaped like x) when defined;
      'storage': the expected new storage bytes (with a cache);
      'out': the expected bf16 bits of out_stage (with a cache and out_stage).
    """
    x = np.asarray(x, dtype=np.uint16)
    squeeze = x.ndim == 2
    x3 = x[:, None, :] if squeeze else x
    res = {}
    y = x3
    if norm is not None:
        if len(norm) == 4:
            w, eps, b, _ = norm
            y = layernorm(y, w, b, eps)
        else:
            w, eps = norm
            y = rmsnorm(y, w, eps)
        res["norm"] = y
    if rope is not None:
        positions, cos_sin, rotary_dim, is_neox, offset, conjugate = rope
        y = globals()["rope"](y, positions, cos_sin, rotary_dim, is_neox, offset, conjugate)
    if hadamard_scale is not None:
        y = hadamard(y, hadamard_scale)
    res["transform"] = y

    def shape_back(a):
        return a[:, 0] if squeeze else a

    if cache is None:
        if cast is None:
            res["result"] = shape_back(y)
        else:
            cast_fmt, g, sf_format, cast_back = cast[:4]
            Q = quantize(y, cast_fmt, g, sf_format, cast[4] if len(cast) > 4 else None)
            res["cast_back"] = Q.cast_back
            if cast_back:
                res["result"] = shape_back(Q.cast_back)
            else:
                res["result"] = (shape_back(Q.q), shape_back(Q.sf_value))
        for k in ("norm", "transform", "cast_back"):
            if k in res:
                res[k] = shape_back(res[k])
        return res

    f = cache.fmt
    if f.cast_fmt is None:
        st = write_records(cache, bf16_bytes(y), None, None)
    else:
        Dq = f.quant_dim
        Q = quantize(y[..., :Dq], f.cast_fmt, f.g, f.sf_format, f.scale_floor)
        tail = y[..., Dq:]
        res["cast_back"] = np.concatenate([Q.cast_back, tail], axis=-1)
        st = write_records(cache, Q.q, Q.sf_bytes, bf16_bytes(tail) if f.bf16_tail else None)
    res["storage"] = st
    for k in ("norm", "transform", "cast_back"):
        if k in res:
            res[k] = shape_back(res[k])
    if out_stage is not None:
        res["out"] = res[out_stage]
    return res


def oracle_store(cache: CacheDesc, q_bytes, sf_bytes, tail_bits=None) -> np.ndarray:
    """store_kv_cache: q_bytes [n, (H,) quant_bytes] uint8; sf_bytes [n, (H,) sf_exact] uint8
    (raw little-endian scale bytes) or None; tail_bits uint16 [n, (H,) tail] or None."""
    def h3(a):
        return None if a is None else (a[:, None] if a.ndim == 2 else a)
    tb = None if tail_bits is None else bf16_bytes(h3(tail_bits))
    return write_records(cache, h3(q_bytes), h3(sf_bytes), tb)


def oracle_load(cache: CacheDesc, dequantize=True):
    """load_paged_kv_cache: bf16 bits [n, H, head_dim] (zeros for invalid slots), or the raw bytes
    (data [n, H, data_bytes], sf [n, H, sf_bytes]) with dequantize=False."""
    f = cache.fmt
    nb, bs, nh, _ = cache.shape
    n = len(cache.slots)
    st = cache.storage
    data = np.zeros((n, nh, f.data_bytes), np.uint8)
    sf = np.zeros((n, nh, f.sf_bytes), np.uint8)
    out = np.zeros((n, nh, f.head_dim), np.uint16)
    for t in range(n):
        s = int(cache.slots[t])
        if not (0 <= s < nb * bs):
            continue
        b, o = divmod(s, bs)
        for h in range(nh):
            da, sa, ta = _record_spans(cache, b, o, h)
            q = st[da:da + f.quant_bytes]
            tail = st[ta:ta + 2 * f.bf16_tail] if f.cast_fmt else st[0:0]
            data[t, h] = np.concatenate([q, tail])
            sf[t, h] = st[sa:sa + f.sf_bytes]
            if f.cast_fmt is None:
                out[t, h] = q.view("<u2")
                continue
            ng = f.quant_dim // f.g
            sfb = st[sa:sa + f.sf_exact]
            if f.sf_format == "ue8m0":
                # SPEC §7: the byte 0xFF is NaN (OCP MX), not 2^128 (which overflows fp32 here, on purpose)
                with np.errstate(over="ignore"):
                    d = np.ldexp(np.float32(1.0), sfb.astype(np.int32) - 127).astype(np.float32)
                d = np.where(sfb == 0xFF, np.float32(np.nan), d).astype(np.float32)
            elif f.sf_format == "e4m3":
                d = decode_e4m3(sfb)
            else:
                d = sfb.copy().view("<f4").astype(np.float32)
            if f.cast_fmt == "e4m3":
                qf = decode_e4m3(q)
            else:
                qf = decode_e2m1(unpack_e2m1(q))
            with np.errstate(over="ignore"):  # arbitrary bytes: a large value times a large scale is inf
                v = (qf.reshape(ng, f.g) * d[:, None]).astype(np.float32).reshape(-1)
            # every decoded NaN is the bf16 0x7FC0 (kvfuse's choice, docs/guide.md "Non-finite values")
            out[t, h, :f.quant_dim] = np.where(np.isnan(v), np.uint16(0x7FC0), f32_to_bf16(v))
            if f.bf16_tail:
                out[t, h, f.quant_dim:] = tail.view("<u2")
    if dequantize:
        return out
    return data, sf


def sqrt_check():
    """Self-check of helpers (used by the tests)."""
    assert _e4m3_value(126) == 448.0 and _e4m3_value(1) == 2.0 ** -9 and _e4m3_value(8) == 2.0 ** -6
    assert math.isclose(E4M3_TABLE[0x38], 1.0)
