"""Random and matrix cases that run one call on two backends over identical poisoned buffers
and compare every byte (outputs, the cache's whole storage with guards and padding).
Shared by the interpreter tests (CI) and the GPU module (tests/gpu)."""
from __future__ import annotations

import dataclasses
import random
from typing import Optional

import torch

import kvfuse
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs,
                    formats)
from kvfuse.plans.fused import build_plan

CUSTOM_FORMATS = [
    KVCacheFormat("TI_E4M3_G64_FP32_D192", 192, "e4m3", 64, "fp32", True),
    KVCacheFormat("TI_NVFP4_D256", 256, "e2m1", 16, "e4m3", True, sf_bytes=20),
    KVCacheFormat("BW_E4M3_G16_E4M3_D64", 64, "e4m3", 16, "e4m3", False),
    KVCacheFormat("TI_BF16_D1024", 1024, None, None, None, True),
    KVCacheFormat("TI_TAIL_D320", 320, "e4m3", 32, "ue8m0_fp32", True, bf16_tail=64),
    KVCacheFormat("BW_MX4_TAIL_D160", 160, "e2m1", 32, "ue8m0", False, sf_bytes=5, bf16_tail=32),
    # reserved bytes written as zeros: after fp32 scales in block-wide records (8 + 4), after byte scales in
    # token-interleaved ones (4 + 3)
    KVCacheFormat("BW_FP32_ZR_TAIL_D192", 192, "e4m3", 64, "fp32", False, sf_bytes=12, bf16_tail=64,
                  zero_reserved=True),
    KVCacheFormat("TI_MX8_ZR_D128", 128, "e4m3", 32, "ue8m0", True, sf_bytes=7, zero_reserved=True),
]
ALL_FORMATS = list(formats.PRESETS.values()) + CUSTOM_FORMATS


@dataclasses.dataclass
class Case:
    n: int
    heads: int
    head_dim: int
    fmt: Optional[KVCacheFormat]      # cache destination (None: contiguous)
    norm: bool = True
    w_fp32: bool = False
    rope: bool = True
    rotary_dim: int = 64
    rope_offset: Optional[int] = None
    neox: bool = True
    conjugate: bool = False
    cs_bf16: bool = False
    hadamard: bool = False
    cast: Optional[CastArgs] = None   # contiguous cast (fmt None)
    out_stage: Optional[str] = None
    x_row_pad: int = 0
    block_size: int = 16
    num_blocks: int = 4
    token_padding: int = 0
    block_padding: int = 0
    slot_kind: str = "random"         # continuous / cross_page / random / invalid
    seed: int = 0
    idx32: bool = False               # int32 positions / slots (else int64)
    x2d: bool = False                 # x passed as [n, D] (needs heads == 1)
    norm_kind: str = "rms"            # "rms" | "layer"
    bias: bool = False                # a LayerNorm bias (needs norm_kind "layer")
    in_place: bool = False            # the stage copy goes into x itself (out = x; needs out_stage)
    split: Optional[int] = None       # x passed as two inputs, its columns [0, split) and [split, D) (not in place)
    norm_dim: Optional[int] = None    # the norm over the first norm_dim dims only (weight [norm_dim])
    cache_offset: int = 0             # the cache starts this many bytes past a 64-byte boundary of its storage

    def describe(self):
        f = self.fmt.name if self.fmt else f"contig:{self.cast}"
        return (f"n={self.n} H={self.heads} D={self.head_dim} {f} norm={self.norm} rope={self.rope}"
                f"(r={self.rotary_dim},off={self.rope_offset},neox={self.neox},conj={self.conjugate}) "
                f"had={self.hadamard} stage={self.out_stage}{' in place' if self.in_place else ''} slots={self.slot_kind} "
                f"norm_kind={self.norm_kind}{'+bias' if self.bias else ''}"
                f"{'' if self.split is None else f' split={self.split}'}"
                f"{'' if self.norm_dim is None else f' norm_dim={self.norm_dim}'} seed={self.seed}")


def _bf16_data(shape, gen, device):
    x = torch.randn(shape, generator=gen) * 2.0
    x[..., :: 37] *= 40.0                                   # outlier channels
    tiny = torch.rand(shape, generator=gen) < 0.01
    x = torch.where(tiny, x * 1e-38, x)                      # a few bf16 subnormals
    if len(shape) >= 2 and shape[0] >= 4:                    # zero rows, tiny and huge rows (scale floors, amax)
        row = torch.arange(shape[0])
        scale = torch.where(row % 7 == 3, 0.0, torch.where(row % 7 == 5, 1e-5, torch.where(row % 11 == 4, 1e3, 1.0)))
        x = x * scale.view((-1,) + (1,) * (len(shape) - 1))
    return x.to(torch.bfloat16).to(device)


def _slots(case, gen):
    cap = case.num_blocks * case.block_size
    n = case.n
    if case.slot_kind == "continuous":
        s = torch.arange(n) % cap
    elif case.slot_kind == "cross_page":
        s = (torch.arange(n) + case.block_size - 2) % cap
    else:
        s = torch.randperm(max(cap, n), generator=gen)[:n] % cap if n <= cap else torch.randint(0, cap, (n,), generator=gen)
        if n > cap:                                          # more tokens than slots: only a unique subset valid
            s = torch.full((n,), -1, dtype=torch.long)
            keep = torch.randperm(n, generator=gen)[:cap]
            s[keep] = torch.randperm(cap, generator=gen)
    if case.slot_kind in ("invalid", "random"):
        bad = torch.rand(n, generator=gen) < 0.25
        junk = torch.tensor([-1, -5, cap, cap + 7, 2 ** 31 - 1, -2 ** 31])[torch.randint(0, 6, (n,), generator=gen)]
        s = torch.where(bad, junk, s)
    return s.to(torch.int32 if case.idx32 else torch.int64)


def build(case: Case, device):
    """-> (args dict for the API, dict of output tensors to compare, storage to compare)."""
    gen = torch.Generator().manual_seed(case.seed)
    n, H, D = case.n, case.heads, case.head_dim
    xfull = _bf16_data((n, H, D + case.x_row_pad), gen, device)
    x = xfull[..., :D]
    if H == 1 and case.x2d:
        x = x[:, 0]
    norm = rope = had = None
    if case.norm:
        k = D if case.norm_dim is None else case.norm_dim
        w = (torch.rand(k, generator=gen) * 2).to(torch.float32 if case.w_fp32 else torch.bfloat16).to(device)
        b = None
        if case.bias:
            b = (torch.randn(k, generator=gen) * 0.5).to(torch.float32 if case.w_fp32 else torch.bfloat16).to(device)
        norm = NormArgs(w, eps=1e-6 if case.seed % 2 else 1e-5, bias=b, kind=case.norm_kind)
    if case.rope:
        P = 64
        ang = torch.rand(P, case.rotary_dim // 2, generator=gen) * 6.3
        cs = torch.cat([ang.cos(), ang.sin()], 1)
        cs = cs.to(torch.bfloat16 if case.cs_bf16 else torch.float32).to(device)
        pos = torch.randint(-3, P + 3, (n,), generator=gen).to(torch.int32 if case.idx32 else torch.int64).to(device)
        rope = RopeArgs(pos, cs, case.rotary_dim, case.neox, case.rope_offset, case.conjugate)
    if case.hadamard:
        had = HadamardArgs(D ** -0.5 if case.seed % 2 else 1.0)
    outs = {}
    storage = None
    if case.fmt is not None:
        fmt = case.fmt
        cache = fmt.allocate(case.num_blocks, case.block_size, H, token_padding=case.token_padding,
                             block_padding=case.block_padding, device="cpu")
        nbytes = cache.untyped_storage().nbytes()
        guard = 64
        storage = torch.randint(0, 256, (nbytes + 2 * guard + case.cache_offset,), generator=gen,
                                dtype=torch.uint8).to(device)
        cache = torch.as_strided(storage, cache.shape, cache.stride(), guard + case.cache_offset)
        slots = _slots(case, gen).to(device)
        out = None
        if case.out_stage is not None:
            out = x if case.in_place else torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device=device)
            outs["out"] = out
        cast = CastArgs.from_cache_format(fmt)
        out_args = KVCacheOutArgs(cache, slots, out=out, out_stage=case.out_stage, layout=fmt)
    else:
        cast = case.cast
        if cast is None or cast.cast_back:
            out = torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device=device)
            outs["out"] = out
            out_args = out
        else:
            qd = D // 2 if cast.cast_fmt == "e2m1" else D
            qt = torch.float8_e4m3fn if cast.cast_fmt == "e4m3" else torch.uint8
            q = torch.randint(0, 256, x.shape[:-1] + (qd,), generator=gen, dtype=torch.uint8).to(device).view(qt)
            st = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(cast.sf_format, torch.float32)
            sf = torch.randint(0, 256, x.shape[:-1] + (D // cast.num_per_channels * st.itemsize,), generator=gen,
                               dtype=torch.uint8).to(device).view(st)
            outs["q"], outs["sf"] = q, sf
            out_args = ContiguousOutArgs(q, sf)
    if case.split is not None:
        x = (x[..., :case.split], x[..., case.split:])
    args = dict(x=x, norm_args=norm, rope_args=rope, hadamard_args=had, cast_args=cast, out_args=out_args)
    return args, outs, storage


def run_case(case: Case, backend: str, device):
    args, outs, storage = build(case, device)
    with kvfuse.use_backend(backend):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**args)
    res = {k: v.view(torch.uint8).cpu() for k, v in outs.items()}
    if storage is not None:
        res["storage"] = storage.cpu()
    return res


def diff_bytes(a: dict, b: dict) -> int:
    assert a.keys() == b.keys()
    return sum(int((a[k] != b[k]).sum()) for k in a)


def random_case(rng: random.Random, max_n: int = 64, variants: Optional[int] = None) -> Case:
    """A random valid case: formats (presets and custom), stage toggles, head_dims, heads, slots, strides.
    With ``variants``, the choices that select a compiled kernel come from a pool of that many
    (the GPU compiles each once) while data, n, heads, slots, strides and padding stay random."""
    v = rng if variants is None else random.Random(rng.randrange(variants))
    seed = rng.randrange(1 << 30)
    if v.random() < 0.7:
        fmt = v.choice(ALL_FORMATS)
        D = fmt.head_dim
        heads = rng.choice([1, 1, 2, 3]) if fmt.token_interleaved else 1
        cast = None
    else:
        fmt = None
        D = v.choice([64, 128, 192, 256, 512, 576, 1024])
        heads = rng.choice([1, 2, 4])
        combos = [("e4m3", g, sf) for g in (16, 32, 64, 128) for sf in ("ue8m0", "e4m3", "fp32", "ue8m0_fp32")
                  if D % g == 0] + [("e2m1", 16, "e4m3"), ("e2m1", 32, "ue8m0")]
        c = v.choice(combos + [None])
        cast = None if c is None else CastArgs(c[0], c[1], c[2].startswith("ue8m0"), c[2], cast_back=v.random() < 0.3)
    rope = v.random() < 0.7
    rdim = v.choice([r for r in (16, 32, 64, 128) if r <= D])
    roff = v.choice([None, 0, D - rdim, (D - rdim) // 32 * 16])
    pow2 = D & (D - 1) == 0 and 16 <= D <= 1024
    norm = v.random() < 0.7
    stage = None
    if fmt is not None and v.random() < 0.5:
        opts = ["transform"] + (["norm"] if norm else []) + (["cast_back"] if fmt.quantized else [])
        stage = v.choice(opts)
    layer = norm and v.random() < 0.3
    n = rng.choice([1, 2, 3, 5, 17, rng.randrange(1, max_n + 1)])
    bs = rng.choice([1, 2, 16, 64])
    nb = max(1, (n + bs - 1) // bs + rng.choice([0, 1, 2]))
    return Case(n=n, heads=heads, head_dim=D, fmt=fmt, norm=norm, w_fp32=v.random() < 0.3, rope=rope,
                rotary_dim=rdim, rope_offset=roff, neox=v.random() < 0.5, conjugate=v.random() < 0.3,
                cs_bf16=v.random() < 0.3, hadamard=pow2 and v.random() < 0.4, cast=cast, out_stage=stage,
                x_row_pad=rng.choice([0, 0, 16, 8]), block_size=bs, num_blocks=nb,
                token_padding=rng.choice([0, 0, 32]) if fmt is not None and fmt.token_interleaved else 0,
                block_padding=rng.choice([0, 64]), slot_kind=rng.choice(["continuous", "cross_page", "random", "invalid"]),
                seed=seed, idx32=v.random() < 0.5, x2d=heads == 1 and rng.random() < 0.3,
                norm_kind="layer" if layer else "rms", bias=layer and v.random() < 0.7,
                in_place=stage is not None and v.random() < 0.3)


def diff_report(a: dict, b: dict, limit: int = 8) -> str:
    """Where two results differ: per key, the count and the first byte offsets with both values."""
    lines = []
    for k in a:
        fa, fb = a[k].flatten(), b[k].flatten()
        idx = (fa != fb).nonzero().flatten()
        if idx.numel():
            shown = ", ".join(f"@{int(i)}: {int(fa[i]):#04x} vs {int(fb[i]):#04x}" for i in idx[:limit])
            lines.append(f"{k}: {idx.numel()} bytes differ ({shown})")
    return "; ".join(lines)


def plan_of(case: Case):
    """The validated kvfuse.plans.types.Plan of a case's call (CPU tensors)."""
    args, _, _ = build(case, "cpu")
    return build_plan(**args)[0]


def recast(plan, **fields):
    """The plan with some fields replaced (a Plan is a plain dataclass)."""
    return dataclasses.replace(plan, **fields)


FAST_MAIN = dict(heads=1, head_dim=512, rotary_dim=64, neox=True, out_stage=None)       # + a fmt
FAST_CHAIN = dict(heads=1, rotary_dim=64, neox=True, out_stage=None)
FAST_Q = dict(fmt=None, head_dim=128, norm=False, rotary_dim=64, neox=True)            # the indexer Q


def _q_cast(fmt):
    return CastArgs.from_cache_format(fmt)


# The Gluon fast paths' cases (tests/gpu/test_gpu_gluon.py runs them on the GPU; tests/test_gluon_dispatch.py
# checks that each is eligible for its module): (module in kvfuse.kernels.gluon, its kernel's name there, case)
_M8, _M4, _MLA, _IX = (("main_latent", "main_fp8_kernel"), ("main_latent_fp4", "main_fp4_kernel"),
                       ("flashmla", "mla_tail_kernel"), ("indexer", "index_write_kernel"))
FAST_CASES = [(*where, case) for where, case in [
    (_M8, Case(n=1, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=1)),
    (_M8, Case(n=3, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=2, idx32=True, w_fp32=True)),
    (_M8, Case(n=300, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=3, cs_bf16=True, slot_kind="invalid", block_size=24,
               num_blocks=16)),
    (_M8, Case(n=4097, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=4, block_size=64, num_blocks=70,
               slot_kind="cross_page", token_padding=8, block_padding=96)),
    (_M8, Case(n=20000, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=5, block_size=1, num_blocks=20050, x_row_pad=16)),
    (_M8, Case(n=65537, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=6, block_size=64, num_blocks=1100,
               slot_kind="random", idx32=True, x2d=True)),
    # records at every 4-byte phase of a 16-byte boundary: caches 4 and 8 bytes past one (the pointer is not
    # 16-byte aligned: Triton's launch, specialized for it, instead of the direct launcher), 536-byte token
    # strides, the cast alone; continuous slots: neighbouring records share DRAM sectors within a launch
    (_M8, Case(n=300, **FAST_MAIN, fmt=formats.MAIN_FP8, seed=7, block_size=24, num_blocks=16, cache_offset=4,
               slot_kind="continuous")),
    (_M8, Case(n=4097, **{**FAST_MAIN, "norm": False, "rope": False}, fmt=formats.MAIN_FP8, seed=8, block_size=64,
               num_blocks=70, token_padding=4, slot_kind="continuous")),
    (_M8, Case(n=1000, **{**FAST_MAIN, "norm": False, "rope": False}, fmt=formats.MAIN_FP8, seed=9, block_size=16,
               num_blocks=70, cache_offset=8, slot_kind="invalid")),
    (_M4, Case(n=1, **FAST_MAIN, fmt=formats.MAIN_FP4, seed=11)),
    (_M4, Case(n=300, **FAST_MAIN, fmt=formats.MAIN_FP4, seed=12, idx32=True, w_fp32=True, cs_bf16=True,
               slot_kind="invalid", block_size=24, num_blocks=16)),
    (_M4, Case(n=20000, **FAST_MAIN, fmt=formats.MAIN_FP4, seed=13, block_size=64, num_blocks=330,
               slot_kind="cross_page", token_padding=32, block_padding=64)),
    (_M4, Case(n=65537, **FAST_MAIN, fmt=formats.MAIN_FP4, seed=14, block_size=64, num_blocks=1100,
               slot_kind="random", x2d=True)),
    (_MLA, Case(n=1, head_dim=576, fmt=formats.FLASHMLA_V32, **FAST_CHAIN, seed=21)),
    (_MLA, Case(n=4097, head_dim=576, fmt=formats.FLASHMLA_V32, **FAST_CHAIN, seed=22, block_size=64, num_blocks=70,
                slot_kind="random", idx32=True)),
    (_MLA, Case(n=20000, head_dim=512, fmt=formats.FLASHMLA_MODEL1, **FAST_CHAIN, seed=23, block_size=64,
                num_blocks=330, slot_kind="cross_page", w_fp32=True)),
    # DeepSeek V3's write from (kv_c, k_pe) with the norm over the latent only; MODEL1 from two inputs
    (_MLA, Case(n=1, head_dim=576, fmt=formats.FLASHMLA_V32, **FAST_CHAIN, seed=24, split=512, norm_dim=512)),
    (_MLA, Case(n=20000, head_dim=576, fmt=formats.FLASHMLA_V32, **FAST_CHAIN, seed=25, split=512, norm_dim=512,
                block_size=64, num_blocks=330, slot_kind="random", x_row_pad=16, idx32=True)),
    (_MLA, Case(n=300, head_dim=576, fmt=formats.FLASHMLA_V32, **{**FAST_CHAIN, "neox": False}, seed=26,
                norm_dim=512, slot_kind="invalid", block_size=24, num_blocks=16)),
    (_MLA, Case(n=4097, head_dim=512, fmt=formats.FLASHMLA_MODEL1, **FAST_CHAIN, seed=27, split=448, block_size=64,
                num_blocks=70, w_fp32=True)),
    (_IX, Case(n=300, head_dim=128, fmt=formats.INDEX_NVFP4, **FAST_CHAIN, seed=31, block_size=24, num_blocks=16,
               slot_kind="invalid")),
    (_IX, Case(n=70000, head_dim=128, fmt=formats.INDEX_MXFP4, **FAST_CHAIN, seed=32, block_size=64, num_blocks=1100,
               slot_kind="random", cs_bf16=True)),
    (_IX, Case(n=1, heads=64, **FAST_Q, cast=_q_cast(formats.INDEX_MXFP4), seed=41)),
    (_IX, Case(n=3, heads=64, **FAST_Q, cast=_q_cast(formats.INDEX_NVFP4), seed=42, idx32=True)),
    (_IX, Case(n=300, heads=4, **{**FAST_Q, "norm": True}, cast=_q_cast(formats.INDEX_FP8_FP32), seed=43,
               x_row_pad=8, w_fp32=True)),
    (_IX, Case(n=1100, heads=64, **FAST_Q, cast=_q_cast(formats.INDEX_MXFP8), seed=44, cs_bf16=True)),
]]
