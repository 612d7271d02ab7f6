"""The peers a point is timed with, each a zero-argument callable on the point's inputs
(:func:`make_peer`): ``fused`` (the public call), ``reference`` (the same call on the reference backend),
``compile`` (torch.compile of the reference stages as one function, :func:`make_chain`), ``stages``
(kvfuse's kernels one stage per launch), ``calls`` (a group's member calls one by one) and ``two_launch``
(the engines' two launches of a GQA call, with kvfuse's kernels).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch

from .. import api as _api
from .. import dispatch as _dispatch
from ..plans import gqa as _gqa_plans
from .. import reference
from ..reference import cache as reference_cache
from ..args import ContiguousOutArgs, FusedCall, KVCacheOutArgs, NormArgs, RopeArgs
from ..backend import use_backend
from ..formats import KVCacheFormat
from ..gqa import fused_qk_norm_rope_store_kv
from ..group import fused_group
from .inputs import Inputs
from .workloads import WORKLOADS, Workload

PEERS = ("reference", "compile", "stages", "two_launch", "calls", "fused")
GQA_PEERS = ("two_launch",)  # peers of the kind "gqa" workloads only (others record them as skipped)
EPS = 1e-6


def fused_call(wl: Workload, inp: Inputs) -> Callable[[], None]:
    """One public call of the fused operator for this workload (the fused and reference peers); a group:
    one kvfuse.fused_group call of its members."""
    if wl.kind == "gqa":
        return _gqa_call(wl, inp)
    if wl.kind == "group":
        calls = [FusedCall(*_call_args(WORKLOADS[name], m)) for name, m in zip(wl.members, inp.members)]
        return lambda: fused_group(calls)
    x, norm, rope, had, cast, out = _call_args(wl, inp)

    def call():
        _api.fused_norm_rope_hadamard_cast_store_kvcache(x, norm, rope, had, cast, out)
    return call


def _calls_one_by_one(wl: Workload, inp: Inputs) -> Callable[[], None]:
    """A group's member calls one after the other, each on its own kernel (the "calls" peer)."""
    calls = [fused_call(WORKLOADS[name], m) for name, m in zip(wl.members, inp.members)]

    def call():
        for c in calls:
            c()
    return call


def _call_args(wl: Workload, inp: Inputs) -> tuple:
    """(x, norm_args, rope_args, hadamard_args, cast_args, out_args) of the workload's call."""
    norm = NormArgs(inp.weight, EPS, inp.bias, wl.norm_kind) if wl.norm else None
    rope = RopeArgs(inp.positions, inp.cos_sin, wl.rotary_dim, wl.is_neox, wl.rope_offset) if wl.rope else None
    had = wl.hadamard_args
    if wl.kind == "write":
        out = KVCacheOutArgs(inp.cache, inp.slots, layout=wl.fmt)
    elif wl.kind == "q_pre":
        out = ContiguousOutArgs(out=inp.out)
    else:
        out = ContiguousOutArgs(out=inp.q, sf=inp.sf)
    x = inp.x if wl.split is None else (inp.x[..., :wl.split], inp.x[..., wl.split:])
    return x, norm, rope, had, wl.cast_args, out


def _gqa_args(wl: Workload, inp: Inputs):
    cfg = wl.gqa
    q, k, v = inp.qkv(wl)
    eps = cfg.norm_eps
    qn = NormArgs(inp.weight, eps) if cfg.qk_norm else None
    kn = NormArgs(inp.k_weight, eps) if cfg.qk_norm else None
    rope = cfg.rope_args(inp.positions, inp.cos_sin)         # mRoPE models: text positions [3, n]
    return q, k, v, qn, kn, rope


def _gqa_call(wl: Workload, inp: Inputs) -> Callable[[], None]:
    q, k, v, qn, kn, rope = _gqa_args(wl, inp)
    kc, vc, ks, vs, slots, out = inp.k_cache, inp.v_cache, inp.k_scale, inp.v_scale, inp.slots, inp.out
    vn = wl.gqa.v_norm_args()

    def call():
        fused_qk_norm_rope_store_kv(q, k, v, kc, vc, slots, qn, kn, rope, ks, vs, "NHD", out, v_norm_args=vn)
    return call


_GQA_STORE_FORMATS: Dict[int, KVCacheFormat] = {}


def _gqa_store_format(record_bytes: int) -> KVCacheFormat:
    """A token-interleaved bf16 :class:`KVCacheFormat` of ``record_bytes`` bytes per (token, head), to
    scatter a GQA cache's elements with :func:`kvfuse.store_kv_cache`: that store copies a record's bytes
    as they are, so the e4m3 codes of an fp8 cache travel as bf16-sized pairs. One object per size (the
    store's plan cache keys on it)."""
    fmt = _GQA_STORE_FORMATS.get(record_bytes)
    if fmt is None:
        fmt = KVCacheFormat(f"GQA_NHD_{record_bytes}B", record_bytes // 2, None, None, None, True)
        _GQA_STORE_FORMATS[record_bytes] = fmt
    return fmt


def _gqa_stage_chain(wl: Workload, inp: Inputs) -> Callable[[], None]:
    """GQA unfused, what an engine without a fused write runs, one stage per launch and no host
    synchronization (CUDA-graph capturable):

    1. kvfuse's fused operator on q (its QK-norm, if the model has one, + RoPE -> q_out);
    2. the same on k (-> a bf16 buffer);
    3. fp8 caches only: the per-tensor cast of K and of V, :func:`kvfuse.reference.quantize_per_tensor`
       (torch elementwise ops: kvfuse has no per-tensor cast launch);
    4. :func:`kvfuse.store_kv_cache` of K and of V into the NHD caches by slot (records of
       :func:`_gqa_store_format`: the bytes as they are). The store copies dense bytes, so a bf16 V (a
       strided view of the packed projection) is first made dense by one torch copy.

    An mRoPE model's text positions rotate as plain RoPE by their first row (the three rows are equal),
    which the fused operator takes; a V-norm (Gemma 4) is one more launch of it on v, its weightless RMSNorm
    as a norm by an fp32 weight of ones (the same bits), into a bf16 buffer.

    Byte-equal to the fused call (q_out and both caches). Every benchmark slot is valid."""
    q, k, v, qn, kn, rope = _gqa_args(wl, inp)
    if rope.mrope_section is not None:
        rope = dataclasses.replace(rope, positions=rope.positions[0], mrope_section=None, mrope_interleaved=False)
    vn = None
    if wl.gqa.v_norm:
        vn = NormArgs(torch.ones(v.shape[-1], dtype=torch.float32, device=v.device), wl.gqa.norm_eps)
        vbuf = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    fused = _api.fused_norm_rope_hadamard_cast_store_kvcache
    store = _api.store_kv_cache
    ks, vs, slots, kbuf = inp.k_scale, inp.v_scale, inp.slots, inp.rope_buf
    qo, kb = ContiguousOutArgs(out=inp.out), ContiguousOutArgs(out=kbuf)
    fmt = _gqa_store_format(wl.head_dim * inp.k_cache.element_size())
    kc, vc = inp.k_cache.view(torch.uint8), inp.v_cache.view(torch.uint8)

    def call():
        fused(q, qn, rope, out_args=qo)
        fused(k, kn, rope, out_args=kb)
        v_in = v
        if vn is not None:
            fused(v, vn, out_args=ContiguousOutArgs(out=vbuf))
            v_in = vbuf
        if ks is None:
            kd, vd = kbuf, v_in
        else:
            kd = reference.quantize_per_tensor(kbuf, ks).view(torch.bfloat16)
            vd = reference.quantize_per_tensor(v_in, vs).view(torch.bfloat16)
        store(kd, None, kc, slots, fmt)
        store(vd, None, vc, slots, fmt)
    return call


V_SINK_DIM = 16              # two_launch's first launch: the narrowest V the GQA entry point takes


def _gqa_two_launch(wl: Workload, inp: Inputs) -> Callable[[], None]:
    """The structure engines run today for Qwen3 / Llama-style models, with kvfuse's kernels: two launches.

    vLLM runs a fused QK-norm + RoPE kernel over q and k in place (RoPE alone for a model without
    QK-norm), then ``reshape_and_cache_flash``, which scatters K and V by slot (for an fp8 cache dividing
    by the per-tensor scales). Here:

    1. one :func:`kvfuse.fused_qk_norm_rope_store_kv` launch (the GQA kernel) does q and k: q (its norm +
       RoPE) into q_out, k (its own norm weight + RoPE) into a bf16 buffer, passed as a bf16 NHD "cache"
       of one token per block with slot i = token i. kvfuse has no launch that transforms q and k with
       two norm weights and writes nothing else: the entry point also takes a V, so the first
       V_SINK_DIM (16) dims of each V head go to a bf16 scratch. Against the engines' launch 1 this moves
       (64 * Hkv + 4) bytes more per token (those V dims read and written, the int32 token slots: 516 of
       ~20.5 KB per token for Qwen3 8B, 2.5%) and runs Hkv more small programs per token block; the
       outputs are out of place (q_out, the buffer) rather than in place, the same bytes, and the
       inputs stay unchanged for the other peers.
    2. one launch of the same kernel over the K and V heads only: no norm, no RoPE, K from the buffer and
       V from the projection scattered by slot into the real caches, e4m3 by the per-tensor scales for
       fp8: exactly ``reshape_and_cache_flash``'s work, no other bytes. The public entry point needs at
       least one q head, so the call is validated with q = K (:func:`kvfuse.plans.gqa.validate`, every other
       rule applies) and its plan run with q emptied to zero heads (:func:`kvfuse.dispatch.run`).

    Byte-equal to the fused call (q_out and both caches)."""
    q, k, v, qn, kn, rope = _gqa_args(wl, inp)
    n, hkv, d = k.shape
    kbuf = inp.rope_buf                                              # bf16 [n, Hkv, D]
    k_as_cache = kbuf.view(n, 1, hkv, d)                             # NHD: block i holds token i
    token_slots = torch.arange(n, dtype=torch.int32, device=k.device)
    v_part = v[..., :V_SINK_DIM]
    v_sink = torch.empty((n, 1, hkv, V_SINK_DIM), dtype=torch.bfloat16, device=k.device)
    plan = _gqa_plans.validate(kbuf, kbuf, v, inp.k_cache, inp.v_cache, inp.slots, None, None, None, inp.k_scale,
                             inp.v_scale, "NHD", v_norm_args=wl.gqa.v_norm_args())
    no_q = kbuf[:, :0]
    plan = dataclasses.replace(plan, q=no_q, q_out=no_q)
    out, run = inp.out, _dispatch.run

    def call():
        fused_qk_norm_rope_store_kv(q, k, v_part, k_as_cache, v_sink, token_slots, qn, kn, rope, None, None, "NHD",
                                    out)
        run(plan)
    return call


def _stage_chain(wl: Workload, inp: Inputs) -> Callable[[], None]:
    """kvfuse's kernels one stage per launch: norm, rope, cast, then store_kv_cache (writes)."""
    if wl.kind == "gqa":
        return _gqa_stage_chain(wl, inp)
    if wl.kind == "group":
        chains = [_stage_chain(WORKLOADS[name], m) for name, m in zip(wl.members, inp.members)]

        def chain():
            for c in chains:
                c()
        return chain
    fused = _api.fused_norm_rope_hadamard_cast_store_kvcache
    steps = []
    src = inp.x
    if wl.norm:
        steps.append((fused, (src,), dict(norm_args=NormArgs(inp.weight, EPS, inp.bias, wl.norm_kind),
                                          out_args=ContiguousOutArgs(out=inp.norm_buf))))
        src = inp.norm_buf
    roped = inp.out if wl.kind == "q_pre" else inp.rope_buf
    if wl.rope:
        steps.append((fused, (src,), dict(rope_args=RopeArgs(inp.positions, inp.cos_sin, wl.rotary_dim, wl.is_neox,
                                                             wl.rope_offset),
                                          out_args=ContiguousOutArgs(out=roped))))
    else:
        roped = src                      # the cast reads the norm's output, or x itself
    if wl.hadamard:
        steps.append((fused, (roped,), dict(hadamard_args=wl.hadamard_args, out_args=ContiguousOutArgs(out=roped))))
    if wl.kind != "q_pre":
        qd = wl.fmt.quant_dim
        steps.append((fused, (roped[..., :qd],), dict(cast_args=wl.cast_args,
                                                      out_args=ContiguousOutArgs(out=inp.q, sf=inp.sf))))
    if wl.kind == "write":
        tail = roped[..., wl.fmt.quant_dim:] if wl.fmt.bf16_tail else None
        steps.append((_api.store_kv_cache, (inp.q, inp.sf, inp.cache, inp.slots, wl.fmt), dict(tail=tail)))

    def call():
        for fn, args, kwargs in steps:
            fn(*args, **kwargs)
    return call


def _flat_store(flat, slots, geom, payloads) -> None:
    """Scatter [n, k] uint8 payloads into the cache's flat byte storage. geom = (block_size, block
    stride, (token stride, byte offset) per payload). All benchmark slots are valid, so no masking."""
    bs, s0, parts = geom
    s = slots.long()
    blk = torch.div(s, bs, rounding_mode="floor")
    off = s - blk * bs
    base = blk * s0
    for (tok_stride, offset), payload in zip(parts, payloads):
        idx = (base + off * tok_stride + offset)[:, None] + torch.arange(payload.shape[-1], device=flat.device)
        flat[idx] = payload


def make_chain(wl: Workload) -> Callable:
    """The reference stages composed as one function (what the compile peer compiles).
    Arguments: :func:`chain_args`."""
    rd, neox, off = wl.rotary_dim, wl.is_neox, wl.rope_offset
    fmt = wl.fmt
    had = None if not wl.hadamard else wl.head_dim ** -0.5
    if wl.kind == "gqa":
        cfg = wl.gqa
        eps = cfg.norm_eps

        def gqa_chain(q, k, v, k_cache, v_cache, slots, q_out, q_weight, k_weight, positions, cos_sin, k_scale,
                      v_scale):
            reference.qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slots, q_out, q_weight, eps, k_weight, eps,
                                            positions, cos_sin, rd, 0, neox, False, k_scale, v_scale, "NHD",
                                            mrope_section=cfg.mrope_section, mrope_interleaved=cfg.mrope_interleaved,
                                            v_norm=cfg.v_norm, v_eps=eps)
        return gqa_chain

    def transform(x, weight, bias, positions, cos_sin):
        y = reference.norm(x, weight, EPS, wl.norm_kind, bias) if wl.norm else x
        if wl.rope:
            y = reference.rope(y, positions, cos_sin, rd, neox, off)
        return y if had is None else reference.hadamard(y, had)
    if wl.kind == "write":
        qd = fmt.quant_dim

        def write_chain(x, weight, bias, positions, cos_sin, slots, flat, geom):
            y = transform(x, weight, bias, positions, cos_sin)
            q, sf = reference.quantize(y[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format,
                                       fmt.scale_floor)
            payloads = [q.view(torch.uint8), reference_cache.scale_record_bytes(fmt, sf)]
            if fmt.bf16_tail:
                payloads.append(y[..., qd:].contiguous().view(torch.uint8))
            _flat_store(flat, slots, geom, payloads)
        return write_chain
    if wl.kind == "q_pre":
        def q_chain(x, weight, positions, cos_sin, out):
            out.copy_(transform(x, weight, None, positions, cos_sin))
        return q_chain

    def index_q_chain(x, positions, cos_sin, q_out, sf_out):
        q, sf = reference.quantize(transform(x, None, None, positions, cos_sin), fmt.cast_fmt,
                                   fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
        q_out.copy_(q)
        sf_out.copy_(sf)
    return index_q_chain


def chain_args(wl: Workload, inp: Inputs) -> tuple:
    if wl.kind == "gqa":
        return (*inp.qkv(wl), inp.k_cache, inp.v_cache, inp.slots, inp.out, inp.weight, inp.k_weight, inp.positions,
                inp.cos_sin, inp.k_scale, inp.v_scale)
    if wl.kind == "write":
        cache, fmt = inp.cache, wl.fmt
        a = fmt.addressing_for(cache)
        parts = [(a.data_token_stride, a.data_offset), (a.sf_token_stride, a.sf_offset)]
        if fmt.bf16_tail:
            parts.append((a.data_token_stride, a.tail_offset))
        flat = torch.as_strided(cache, (cache.untyped_storage().nbytes(),), (1,), 0)
        geom = (cache.shape[1], cache.stride(0), tuple((t, o + cache.storage_offset()) for t, o in parts))
        return (inp.x, inp.weight, inp.bias, inp.positions, inp.cos_sin, inp.slots, flat, geom)
    if wl.kind == "q_pre":
        return (inp.x, inp.weight, inp.positions, inp.cos_sin, inp.out)
    return (inp.x, inp.positions, inp.cos_sin, inp.q, inp.sf)


def make_peer(peer: str, wl: Workload, inp: Inputs, compiled: Optional[Callable] = None) -> Callable[[], None]:
    """A zero-argument callable running ``peer`` once on ``inp``. The fused and stages peers use the
    backend in effect (run_suite sets it); the reference peer forces "reference"."""
    if peer == "fused":
        return fused_call(wl, inp)
    if peer == "stages":
        return _stage_chain(wl, inp)
    if peer == "calls":
        return _calls_one_by_one(wl, inp)
    if peer == "two_launch":
        reason = peer_not_applicable(peer, wl)
        if reason:
            raise ValueError(f"two_launch for {wl.name}: {reason}")
        return _gqa_two_launch(wl, inp)
    if peer == "reference":
        call = fused_call(wl, inp)

        def ref():
            with use_backend("reference"):
                call()
        return ref
    if peer == "compile":
        fn = compiled if compiled is not None else make_chain(wl)
        args = chain_args(wl, inp)
        return lambda: fn(*args)
    raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")


def peer_not_applicable(peer: str, wl: Workload) -> str:
    """Why ``peer`` has no meaning for ``wl`` ("" when it has)."""
    if peer == "calls" and wl.kind != "group":
        return "the member calls one by one: group workloads only"
    if peer in GQA_PEERS and wl.kind != "gqa":
        return "the engines' two launches of a GQA call (fused_qk_norm_rope_store_kv): GQA workloads only"
    if peer == "compile" and wl.kind == "group":
        return "no torch.compile chain of a group (its members' chains are measured on their own)"
    return ""
