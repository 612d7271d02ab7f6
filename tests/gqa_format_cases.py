"""Cases of kvfuse.fused_qk_norm_rope_store_kv with caches of named formats (kvfuse.gqa_formats), shared by
tests/test_gqa_formats.py (the interpreter) and tests/gpu/test_gpu_gqa_formats.py (not a test module itself).

A :class:`FormatCase` is a :class:`gqa_cases.GQACase` (its inputs, slots, norms, RoPE, layout; fp8 False)
whose caches are replaced by caches of ``k_format`` / ``v_format``: views into random bytes with guards
before and after and padding between blocks, static scales where the format takes them, and for a
format that stores its scales a scale cache of random bits (guarded the same way), or (``inline``)
vLLM's layout: K codes, K scale, V codes, V scale in one row of bytes per (token, head), the scales
strided fp32 views of that allocation. :func:`run_format_case` returns every byte the call could have
touched, as CPU uint8 tensors; two runs on two backends or devices must return equal bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import kvfuse
from kvfuse.gqa_formats import PRESETS
from gqa_cases import GUARD, GQACase, build, diff_report

STATIC_SCALES = (0.37, 0.011)     # k, v: the second makes e4m3 / e5m2 codes saturate for the larger values


@dataclasses.dataclass(frozen=True)
class FormatCase:
    base: GQACase
    k_format: str
    v_format: Optional[str]               # None: a K cache alone (base.v_cache False)
    inline: bool = False                  # vLLM's inline scales (both formats per-(token, head), d == dv)

    def describe(self) -> str:
        return f"FormatCase({self.base.describe()}, k_format={self.k_format!r}, v_format={self.v_format!r}" + \
            (", inline=True)" if self.inline else ")")


def _blocks(case: GQACase) -> int:
    return -(-case.n // case.block_size) + case.extra_blocks


def _inner(case: GQACase, dim: int, row: int):
    """One block's shape and strides (elements) for rows of ``dim`` elements ``row`` apart."""
    bs, h = case.block_size, case.hkv
    if case.layout == "NHD":
        return (bs, h, dim), (h * row, row, 1)
    return (h, bs, dim), (bs * row, row, 1)


def _random_bytes(count: int, g: torch.Generator, device) -> torch.Tensor:
    return torch.randint(0, 256, (count,), generator=g, dtype=torch.int64).to(torch.uint8).to(device)


def _guarded(case: GQACase, dtype, dim: int, pad: int, g, device):
    """(view [NB, ...] of ``dtype`` with rows of ``dim`` elements, its storage): random bytes, GUARD elements
    before and after, ``pad`` elements after every block."""
    nb = _blocks(case)
    shape, strides = _inner(case, dim, dim)
    block = case.block_size * case.hkv * dim + pad
    size = torch.empty((), dtype=dtype).element_size()
    storage = _random_bytes((nb * block + 2 * GUARD) * size, g, device)
    return torch.as_strided(storage.view(dtype), (nb,) + shape, (block,) + strides, GUARD), storage


def _guarded_scales(case: GQACase, g, device):
    """An fp32 scale cache [NB, BS, H] (NHD) / [NB, H, BS] (HND) of random bits, guarded, padded, strided."""
    t, storage = _guarded(case, torch.float32, 2, 3, g, device)       # every other fp32 of a row of two
    return t[..., 0], storage


def _inline(case: GQACase, dtype, g, device):
    """vLLM's per-token-head allocation: per (token, head) a row [K codes | K scale | V codes | V scale] of
    bytes, d + 4 bytes a half; (k codes, k scales, v codes, v scales, storage)."""
    nb, d = _blocks(case), case.d
    row = 2 * (d + 4)
    shape, strides = _inner(case, d, row)
    block = case.block_size * case.hkv * row
    storage = _random_bytes(nb * block + 2 * GUARD, g, device)
    codes = storage.view(dtype)
    f32 = storage.view(torch.float32)
    k = torch.as_strided(codes, (nb,) + shape, (block,) + strides, GUARD)
    v = torch.as_strided(codes, (nb,) + shape, (block,) + strides, GUARD + d + 4)
    scale_strides = (block // 4,) + tuple(s // 4 for s in strides[:2])
    ks = torch.as_strided(f32, (nb,) + shape[:2], scale_strides, (GUARD + d) // 4)
    vs = torch.as_strided(f32, (nb,) + shape[:2], scale_strides, (GUARD + 2 * d + 4) // 4)
    return k, ks, v, vs, storage


def _static_scale(case: GQACase, which: str, device, per_head_allowed: bool = True):
    """The static scale of ``which`` (one per kv head where the case says so and the format takes them; a
    global scale, NVFP4's, is one)."""
    base = STATIC_SCALES[0 if which == "k" else 1]
    if which in case.scale_per_head and per_head_allowed:
        return torch.tensor([base * (0.5 + h) for h in range(case.hkv)], dtype=torch.float32, device=device)
    return torch.tensor([base], dtype=torch.float32, device=device)


def build_format_call(fc: FormatCase, device="cpu"):
    """(keyword arguments, {name: storage} of the caches and scale caches, inputs, q_out buffer)."""
    case = fc.base
    assert not case.fp8 and case.kv_cache and (fc.v_format is None) == (not case.v_cache)
    assert not (fc.inline and case.k_cache_split)
    kw, _, inputs, q_buf = build(case, device)
    g = torch.Generator().manual_seed(case.seed + 1000)
    act = case.act
    fmts = {"k": PRESETS[fc.k_format]}
    if fc.v_format is not None:
        fmts["v"] = PRESETS[fc.v_format]
    storages = {}
    if fc.inline:
        assert fmts["k"].scale == fmts["v"].scale == "token_head" and fmts["k"].code == fmts["v"].code
        k, ks, v, vs, storages["kv"] = _inline(case, fmts["k"].dtype_for(act), g, device)
        kw.update(k_cache=k, k_scale_cache=ks, v_cache=v, v_scale_cache=vs)
    else:
        for which, fmt in fmts.items():
            dim = case.d if which == "k" else case.v_dim
            codes = dim // fmt.values_per_element       # e2m1: two codes a byte
            kw[which + "_cache"], storages[which] = _guarded(case, fmt.dtype_for(act), codes, 16, g, device)
            if which == "k" and case.k_cache_split:      # K's cache as two (its heads' first split columns, the rest)
                first, storages["k"] = _guarded(case, fmt.dtype_for(act), case.split, 16, g, device)
                rest, storages["k_rest"] = _guarded(case, fmt.dtype_for(act), case.d - case.split, 32, g, device)
                kw["k_cache"] = (first, rest)
            if fmt.scale == "block":                    # one scale per group: the cache's shape, dim / group
                kw[which + "_scale_cache"], storages[which + "_scales"] = _guarded(
                    case, fmt.scale_dtype, dim // fmt.group, 16, g, device)
            elif fmt.stores_scale:
                kw[which + "_scale_cache"], storages[which + "_scales"] = _guarded_scales(case, g, device)
    for which, fmt in fmts.items():
        kw[which + "_format"] = fmt.name
        if fmt.takes_static_scale:
            kw[which + "_scale"] = _static_scale(case, which, device, per_head_allowed=not fmt.global_scale)
    return kw, storages, inputs, q_buf


def _bytes(t):
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).clone()


def run_format_case(fc: FormatCase, backend: str, device="cpu") -> dict:
    """Run the case on ``backend``; every byte it could have touched (CPU uint8 tensors by name)."""
    kw, storages, inputs, q_buf = build_format_call(fc, device)
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    out = {f"storage_{name}": _bytes(s) for name, s in storages.items()}
    out.update({f"input{i}": _bytes(t) for i, t in enumerate(inputs)})
    out["q_out"] = _bytes(q_buf)
    return out


def format_gpu_against_cpu_reference(fc: FormatCase, launches: int = 2):
    """The case on the CPU reference, then ``launches`` times on the GPU: the reports of the launches that
    differ ('' each when equal)."""
    ref = run_format_case(fc, "reference", "cpu")
    return [diff_report(ref, run_format_case(fc, "triton", "cuda")) for _ in range(launches)]


# V through each format carrying every bf16 value: (format, static scale)
EVERY_BF16_FORMATS = [("fp8_e5m2", 1.0), ("fp8_e5m2", 2.0 ** -20), ("fp8_e4m3", 1.0), ("fp8_per_token_head", None),
                      ("int8_per_token_head", None)]


def every_bf16_run(fmt: str, scale, backend: str, device="cpu") -> dict:
    """A call whose V holds every bf16 bit pattern but the NaNs (their sign and payload are the device's)
    as 512 tokens of one 128-wide head, V's cache of ``fmt`` (static scale ``scale``): the bytes of its
    caches and scale caches."""
    fc = FormatCase(GQACase(n=512, hq=1, hkv=1, d=128, slots="contiguous", block_size=16, seed=90), "auto", fmt)
    kw, storages, _, _ = build_format_call(fc, device)
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = torch.where(torch.isnan(values), torch.zeros_like(values), values)
    kw["v"].copy_(values.reshape(512, 1, 128).to(device))
    if scale is not None:
        kw["v_scale"] = torch.tensor([scale], device=device)
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    return {k: _bytes(s) for k, s in storages.items()}
