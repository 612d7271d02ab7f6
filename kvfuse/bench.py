"""``kvfuse bench``: the fused write path against its peers, on one CUDA device.

It measures the device (copy bandwidth, the launch floor), then for every workload (a call site of
the fused operator, a GQA model's ``fused_qk_norm_rope_store_kv`` call, or a layer's calls as one
``fused_group``) and size n builds realistic inputs (:func:`token_layout`: decode steps up to 256
tokens, prefills above; paged or random slots) and times the peers on the same inputs:
``reference`` (the eager reference chain), ``compile`` (torch.compile of it), ``stages`` (kvfuse's
kernels one stage per launch), ``calls`` (a group's calls one by one), ``two_launch`` (the engines'
two launches for GQA models, with kvfuse's kernels) and ``fused``. It prints a table and PASS / MISS
lines against the targets and writes JSON (+ PNG).

Effective bandwidth is the compulsory DRAM bytes of one call (:func:`moved_bytes`, applied to the
point's inputs by :func:`input_bytes`: a cos/sin row once per distinct position, the weight once)
over its GPU time, against the copy bandwidth; every peer of a point is charged the same bytes.
benchmarks/README.md says how to read the output. Timing is injectable (``run_suite(...,
timer=...)``), so the orchestration, the byte model and the report are tested without CUDA;
nothing here needs matplotlib or tqdm at import.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import api as _api
from . import reference
from .args import CastArgs, ContiguousOutArgs, FusedCall, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs
from .backend import use_backend
from . import gqa as _gqa_mod
from .gqa import fused_qk_norm_rope_store_kv
from .group import fused_group
from .models import GQA_MODELS, GQAConfig
from .formats import (FLASHMLA_MODEL1, FLASHMLA_V32, INDEX_FP8_FP32, INDEX_MXFP4, INDEX_MXFP8, INDEX_NVFP4, MAIN_FP4,
                      MAIN_FP8, KVCacheFormat)
from . import backend as _backend
from .plan import q_dtype
from .rope import cos_sin_cache

try:  # triton is a kvfuse dependency; still, keep this module importable without it
    import triton
    import triton.language as tl

    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def _tiny_kernel(p):
        tl.store(p, tl.load(p) + 1)

    @triton.jit
    def _producer_kernel(p):
        # a PDL-aware predecessor that writes x (its first element, with its own value: inputs unchanged)
        gdc_launch_dependents()
        tl.store(p, tl.load(p))
except Exception:  # pragma: no cover
    triton = None
    _tiny_kernel = _producer_kernel = None

NEEDS_CUDA = "kvfuse bench needs a CUDA device (torch.cuda.is_available() is False): nothing measured."

PEERS = ("reference", "compile", "stages", "two_launch", "calls", "fused")
GQA_PEERS = ("two_launch",)  # peers of the kind "gqa" workloads only (others record them as skipped)
DEFAULT_SIZES = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
QUICK_SIZES = (1, 256, 4096, 65536, 262144)
QUICK_WORKLOADS = ("main_fp8", "index_mxfp4", "q_pre")
MAX_POSITION = 8192          # rows of the cos/sin table (positions: token_layout)
BLOCK_SIZE = 64              # tokens per cache block
ROTARY_DIM = 64
EPS = 1e-6
MAX_X_ELEMS = 1 << 29        # skip a point whose x would exceed 1 GiB of bf16 (the 64-head Q workloads)
COLD_L2_BYTES = 512 << 20    # --cold-l2: cycle through input sets totalling at least this much
OUT_NAME = "kvfuse_bench"


# =============================================================================== workloads
@dataclasses.dataclass(frozen=True)
class Workload:
    """One call site. kind "write": norm + rope + cast into a paged cache of ``fmt``; "q_pre": norm +
    rope into a preallocated bf16 out; "index_q": rope + cast of ``fmt`` into preallocated (q, sf);
    "gqa": :func:`kvfuse.fused_qk_norm_rope_store_kv` of the model ``gqa`` (packed QKV [n, (Hq + 2 Hkv) D],
    QK-norm if the model has one, RoPE, q_out, K and V into NHD caches, fp8 with per-tensor scales when
    ``cache_fp8``); num_heads is then Hq + 2 Hkv (the rows a call reads); "group": the ``members``
    workloads (same n, positions and cos/sin table) in one :func:`kvfuse.fused_group` launch, head_dim
    and num_heads those of its largest member."""
    name: str
    kind: str
    head_dim: int
    fmt: Optional[KVCacheFormat] = None
    num_heads: int = 1
    norm: bool = True
    rotary_dim: int = ROTARY_DIM
    description: str = ""
    is_neox: bool = True                 # RoPE style (False: GPT-J, interleaved pairs)
    rope_offset: Optional[int] = None    # None: the tail
    norm_kind: str = "rms"               # "rms" | "layer" (LayerNorm, with a bias when norm_bias)
    norm_bias: bool = False
    hadamard: bool = False               # the orthonormal Hadamard (scale head_dim ** -0.5) after RoPE
    rope: bool = True                    # False: no RoPE (with norm=False: the cast alone)
    gqa: Optional[GQAConfig] = None      # kind "gqa": the model
    cache_fp8: bool = False              # kind "gqa": float8_e4m3fn caches with per-tensor scales (else bf16)
    members: Tuple[str, ...] = ()        # kind "group": the workloads run as one kvfuse.fused_group launch

    @property
    def hadamard_args(self) -> Optional[HadamardArgs]:
        return HadamardArgs(self.head_dim ** -0.5) if self.hadamard else None

    @property
    def cast_args(self) -> Optional[CastArgs]:
        return None if self.fmt is None else CastArgs.from_cache_format(self.fmt)


def _gqa(name, model, fp8):
    cfg = GQA_MODELS[model]
    norm = "QK-norm + " if cfg.qk_norm else ""
    return Workload(name, "gqa", cfg.head_dim, None, num_heads=cfg.num_heads + 2 * cfg.num_kv_heads, norm=cfg.qk_norm,
                    rotary_dim=cfg.rotary_dim, rope_offset=0, is_neox=cfg.rope_is_neox, gqa=cfg, cache_fp8=fp8,
                    description=f"{model} q/k/v: {norm}NEOX rope -> q_out, K/V into {'fp8' if fp8 else 'bf16'} NHD "
                                f"caches ({cfg.num_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim})")




# MAIN_FP8's codes and UE8M0 scales without the token-interleaved record: FlashInfer's DeepSeek cache page
MAIN_FP8_PAGEWISE = KVCacheFormat("MAIN_FP8_PAGEWISE", 512, "e4m3", 32, "ue8m0", False)
# MAIN_FP8's record with its exact 16 scale bytes (528 bytes: no reserved bytes) and with 32 (544 bytes, 16
# reserved): what the reserved bytes cost a write (benchmarks/record_alignment.py)
MAIN_FP8_NO_RESERVED = KVCacheFormat("MAIN_FP8_528", 512, "e4m3", 32, "ue8m0", True, sf_bytes=16)
MAIN_FP8_SECTOR_ALIGNED = KVCacheFormat("MAIN_FP8_544", 512, "e4m3", 32, "ue8m0", True, sf_bytes=32)
# (label, format) of the record-layout study: the same codes and scales in each
RECORD_LAYOUTS = (("MAIN_FP8 (532-B records)", MAIN_FP8), ("528-B records", MAIN_FP8_NO_RESERVED),
                  ("544-B records", MAIN_FP8_SECTOR_ALIGNED), ("page layout", MAIN_FP8_PAGEWISE))


def _write(name, fmt, what, is_neox=True):
    style = "NEOX" if is_neox else "GPT-J"
    return Workload(name, "write", fmt.head_dim, fmt, is_neox=is_neox,
                    description=f"{what}: norm + {style} rope (last 64) -> {fmt.name}")


WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    _write("main_fp8", MAIN_FP8, "main KV 512"),
    _write("main_fp4", MAIN_FP4, "main KV 512"),
    _write("flashmla_v32", FLASHMLA_V32, "FlashMLA V3.2 KV 576"),
    _write("flashmla_model1", FLASHMLA_MODEL1, "FlashMLA MODEL1 KV 512"),
    _write("index_mxfp4", INDEX_MXFP4, "indexer K 128"),
    _write("index_nvfp4", INDEX_NVFP4, "indexer K 128"),
    _write("index_fp8_fp32", INDEX_FP8_FP32, "indexer K 128"),
    Workload("main_fp8_cast", "write", 512, MAIN_FP8, norm=False, rope=False,
             description="the MAIN_FP8 cast alone (no norm, no RoPE: the CP second pass, store_gathered)"),
    Workload("main_fp8_pagewise_cast", "write", 512, MAIN_FP8_PAGEWISE, norm=False, rope=False,
             description="main_fp8_cast's codes and scales in FlashInfer's DeepSeek page layout (a page: its "
                         "tokens' 512-B code rows, then their 16-B scale rows): the layout's cost (the portable kernel: no fast "
                         "path writes this layout)"),
    _write("main_fp8_gptj", MAIN_FP8, "main KV 512", is_neox=False),
    _write("main_fp4_gptj", MAIN_FP4, "main KV 512", is_neox=False),
    _write("flashmla_v32_gptj", FLASHMLA_V32, "FlashMLA V3.2 KV 576", is_neox=False),
    _write("flashmla_model1_gptj", FLASHMLA_MODEL1, "FlashMLA MODEL1 KV 512", is_neox=False),
    _write("index_mxfp8_gptj", INDEX_MXFP8, "indexer K 128", is_neox=False),
    Workload("index_fp8_fp32_off0", "write", 128, INDEX_FP8_FP32, rope_offset=0,
             description="indexer K 128: norm + NEOX rope (first 64) -> INDEX_FP8_FP32"),
    # the models' own calls (kvfuse.models): DeepSeek V3 / V3.1 / V3.2 main cache, the V3.2 indexer K,
    # the V4 main caches and indexer K
    _write("dsv3_main_v32", FLASHMLA_V32, "DeepSeek V3 main KV 576 (latent normalized)", is_neox=False),
    Workload("dsv32_index_k", "write", 128, INDEX_FP8_FP32, rope_offset=0, norm_kind="layer", norm_bias=True,
             hadamard=True, description="DeepSeek V3.2 indexer K: LayerNorm + bias, NEOX rope (first 64), "
                                         "Hadamard -> INDEX_FP8_FP32"),
    _write("dsv4_main_fp8", MAIN_FP8, "DeepSeek V4 main KV 512", is_neox=False),
    _write("dsv4_main_fp4", MAIN_FP4, "DeepSeek V4 main KV 512", is_neox=False),
    _write("dsv4_main_model1", FLASHMLA_MODEL1, "DeepSeek V4 main KV 512", is_neox=False),
    Workload("dsv4_index_k", "write", 128, INDEX_MXFP8, is_neox=False, hadamard=True,
             description="DeepSeek V4 indexer K: norm + GPT-J rope (last 64), Hadamard -> INDEX_MXFP8"),
    Workload("q_pre", "q_pre", 512, None, num_heads=64,
             description="Q preprocessing: x [n, 64, 512], norm + NEOX rope (last 64) -> bf16 out"),
    Workload("index_q", "index_q", 128, INDEX_MXFP4, num_heads=64, norm=False,
             description="indexer Q: x [n, 64, 128], NEOX rope (last 64) + INDEX_MXFP4 cast -> (q, sf)"),
    # the models' Q calls (q_preprocess, quantize_indexer_q), members of the layer groups below
    Workload("dsv4_q", "q_pre", 512, None, num_heads=64, is_neox=False,
             description="DeepSeek V4 Q: x [n, 64, 512], RMSNorm + GPT-J rope (last 64) -> bf16 out"),
    Workload("dsv4_index_q", "index_q", 128, INDEX_MXFP8, num_heads=64, norm=False, is_neox=False, hadamard=True,
             description="DeepSeek V4 indexer Q: x [n, 64, 128], GPT-J rope (last 64), Hadamard -> INDEX_MXFP8 (q, sf)"),
    Workload("dsv32_q", "q_pre", 192, None, num_heads=128, norm=False, is_neox=False,
             description="DeepSeek V3.2 Q: x [n, 128, 192], GPT-J rope (last 64) -> bf16 out"),
    Workload("dsv32_index_q", "index_q", 128, INDEX_FP8_FP32, num_heads=64, norm=False, rope_offset=0,
             hadamard=True, description="DeepSeek V3.2 indexer Q: x [n, 64, 128], NEOX rope (first 64), Hadamard "
                                        "-> INDEX_FP8_FP32 (q, sf)"),
    # GQA / MHA models (kvfuse.models.GQA_MODELS): one fused_qk_norm_rope_store_kv call per layer
    _gqa("llama3_8b_bf16", "llama-3-8b", False),
    _gqa("llama3_8b_fp8", "llama-3-8b", True),
    _gqa("llama3_70b_fp8", "llama-3-70b", True),
    _gqa("qwen3_8b_bf16", "qwen3-8b", False),
    _gqa("qwen3_8b_fp8", "qwen3-8b", True),
    _gqa("qwen3_32b_fp8", "qwen3-32b", True),
    _gqa("gemma3_12b_bf16", "gemma-3-12b", False),
    _gqa("gemma3_12b_fp8", "gemma-3-12b", True),
)}


def _group(name, members, description):
    widest = max((WORKLOADS[m] for m in members), key=lambda w: w.num_heads * w.head_dim)
    return Workload(name, "group", widest.head_dim, None, num_heads=widest.num_heads, members=tuple(members),
                    description=description)


# an MLA layer's calls in one launch (kvfuse.fused_group / kvfuse.mla.write_layer)
WORKLOADS.update({w.name: w for w in (
    _group("group_dsv4_q_kv", ("dsv4_q", "dsv4_main_fp8"), "DeepSeek V4 Q (64 heads) + main KV MAIN_FP8, one launch"),
    _group("group_dsv4_layer", ("dsv4_q", "dsv4_main_fp8", "dsv4_index_k", "dsv4_index_q"),
           "DeepSeek V4 layer: Q, main KV, indexer K, indexer Q, one launch"),
    _group("group_dsv32_layer", ("dsv32_q", "dsv3_main_v32", "dsv32_index_k", "dsv32_index_q"),
           "DeepSeek V3.2 layer: Q (128 heads), FlashMLA KV, indexer K, indexer Q, one launch"),
)})


ACCOUNTING = ("compulsory DRAM bytes per call, computed from the inputs: x, positions and slots read once, "
              "records / outputs written once, the norm weight (and bias) once, one cos/sin row per distinct "
              "in-range position")


def moved_bytes(wl: Workload, n: int, index_bytes: int = 4, cos_sin_bytes: int = 4,
                weight_bytes: int = 2, cos_sin_rows: Optional[int] = None, written: Optional[int] = None,
                slot_bytes: Optional[int] = None) -> Dict[str, int]:
    """Compulsory DRAM bytes of one call (the effective-bandwidth numerator), by component.

    Every byte that must cross DRAM at least once, counted once per call:

    - read: x (bf16) of the tokens processed, their positions and, for a write, the whole
      slot_mapping; the norm weight (and bias) once; ``cos_sin_rows`` rows of the cos/sin table
      (``rotary_dim * cos_sin_bytes`` each): one per DISTINCT in-range position of the call, however
      many tokens share it (:func:`cos_sin_rows`; ``None``: every token at its own position, at most
      MAX_POSITION rows);
    - written: the cache record bytes a write touches (quantized data + exact scales + bf16 tail;
      reserved bytes and padding excluded), the bf16 out, or (q, sf);
    - GQA (:func:`_gqa_bytes`): q, k, v read and q written (bf16), the K and V cache elements
      written, the two norm weights once, the cos/sin rows as above, positions and slots (the fp8
      scales' 8 bytes left out).

    ``written``: for a write, the tokens with a valid slot (default n); a token whose slot is invalid
    writes nothing and needs no x, position or cos/sin row, only its slot. Intermediates of unfused
    peers are not counted: every peer of a point is charged the same bytes. :func:`input_bytes`
    applies this model to actual inputs.
    """
    if wl.kind == "gqa":
        return _gqa_bytes(wl, n, index_bytes, cos_sin_bytes, weight_bytes, cos_sin_rows, slot_bytes)
    if wl.kind == "group":      # as _group_bytes: the members', the positions and cos/sin rows they share once
        b = {}
        for i, name in enumerate(wl.members):
            part = moved_bytes(WORKLOADS[name], n, index_bytes, cos_sin_bytes, weight_bytes, cos_sin_rows,
                               slot_bytes=slot_bytes)
            b.update((f"{name}.{k}", v) for k, v in part.items() if k != "total"
                     and not (i and k in ("positions", "cos_sin")))
        b["total"] = sum(b.values())
        return b
    tokens = n if wl.kind != "write" or written is None else written
    rows = tokens * wl.num_heads
    if cos_sin_rows is None:
        cos_sin_rows = min(tokens, MAX_POSITION)
    b = {"x": rows * wl.head_dim * 2}
    if wl.norm:
        b["norm_weight"] = wl.head_dim * weight_bytes * (2 if wl.norm_bias else 1)
    if wl.rope:
        b["cos_sin"] = cos_sin_rows * wl.rotary_dim * cos_sin_bytes
        b["positions"] = tokens * index_bytes
    if wl.kind == "write":
        b["slots"] = n * (index_bytes if slot_bytes is None else slot_bytes)
        b["cache_data"] = rows * wl.fmt.quant_bytes
        b["cache_scales"] = rows * wl.fmt.sf_exact_bytes
        if wl.fmt.bf16_tail:
            b["cache_tail"] = rows * 2 * wl.fmt.bf16_tail
    elif wl.kind == "q_pre":
        b["out"] = rows * wl.head_dim * 2
    else:
        b["q"] = rows * wl.fmt.quant_bytes
        b["sf"] = rows * wl.fmt.sf_exact_bytes
    b["total"] = sum(b.values())
    return b


def cos_sin_rows(positions: torch.Tensor, table_rows: int) -> int:
    """The cos/sin rows a call must read: its distinct positions inside [0, table_rows) (a position
    outside the table rotates by the identity and reads no row)."""
    p = positions.reshape(-1)
    return int(p[(p >= 0) & (p < table_rows)].unique().numel())


def input_bytes(wl: Workload, inp: "Inputs") -> Dict[str, int]:
    """:func:`moved_bytes` of one call on these inputs: the distinct positions, the valid slots and
    the element sizes of the actual tensors."""
    if wl.kind == "group":
        return _group_bytes(wl, inp)
    positions, written = inp.positions, None
    if wl.kind == "write":
        capacity = inp.cache.shape[0] * inp.cache.shape[1]
        valid = (inp.slots >= 0) & (inp.slots < capacity)
        written = int(valid.sum())
        positions = positions[valid]
    return moved_bytes(wl, inp.n, index_bytes=inp.positions.element_size(),
                       cos_sin_bytes=inp.cos_sin.element_size(),
                       weight_bytes=inp.weight.element_size() if inp.weight is not None else 2,
                       cos_sin_rows=cos_sin_rows(positions, inp.cos_sin.shape[0]), written=written,
                       slot_bytes=inp.slots.element_size() if inp.slots is not None else None)


def _group_bytes(wl: Workload, inp: "Inputs") -> Dict[str, int]:
    """The members' bytes, by member, with the positions and cos/sin rows they share counted once."""
    b = {}
    for i, (name, m) in enumerate(zip(wl.members, inp.members)):
        for k, v in input_bytes(WORKLOADS[name], m).items():
            if k == "total" or (i and k in ("positions", "cos_sin")):
                continue
            b[f"{name}.{k}"] = v
    b["total"] = sum(b.values())
    return b


def mean_bytes(details: Sequence[Dict[str, int]]) -> Dict[str, int]:
    """Per-component mean (rounded) over input sets timed together (--cold-l2 cycles through them)."""
    keys = [k for k in dict.fromkeys(k for d in details for k in d) if k != "total"]
    b = {k: round(sum(d.get(k, 0) for d in details) / len(details)) for k in keys}
    b["total"] = sum(b.values())
    return b


def _gqa_bytes(wl: Workload, n: int, index_bytes: int, cos_sin_bytes: int, weight_bytes: int,
               cos_sin_rows: Optional[int] = None, slot_bytes: Optional[int] = None) -> Dict[str, int]:
    cfg = wl.gqa
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    elem = 1 if wl.cache_fp8 else 2
    w_bytes = 4 if cfg.norm_weight_offset else weight_bytes       # Gemma's 1 + w is an fp32 weight
    b = {"q": n * hq * d * 2, "k": n * hkv * d * 2, "v": n * hkv * d * 2}
    if cfg.qk_norm:
        b["norm_weights"] = 2 * d * w_bytes
    rows = min(n, MAX_POSITION) if cos_sin_rows is None else cos_sin_rows
    b["cos_sin"] = rows * wl.rotary_dim * cos_sin_bytes
    b["positions"] = n * index_bytes
    b["slots"] = n * (index_bytes if slot_bytes is None else slot_bytes)
    b["q_out"] = n * hq * d * 2
    b["k_cache"] = n * hkv * d * elem
    b["v_cache"] = n * hkv * d * elem
    b["total"] = sum(b.values())
    return b


# =============================================================================== inputs
@dataclasses.dataclass
class Inputs:
    """Device tensors of one (workload, n) point. ``q``/``sf`` are the stage chain's cast outputs
    for writes and the result for index_q; ``norm_buf``/``rope_buf`` are stage-chain buffers."""
    n: int
    x: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    slots: Optional[torch.Tensor] = None
    cache: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    sf: Optional[torch.Tensor] = None
    norm_buf: Optional[torch.Tensor] = None
    rope_buf: Optional[torch.Tensor] = None
    regime: str = ""                     # "decode" | "prefill" | "uniform" (token_layout)
    slot_pattern: str = ""               # writes: SLOT_PATTERNS
    # kind "gqa": the packed projection, q_out, the caches and scales, the k norm weight (``weight`` is q's)
    k_weight: Optional[torch.Tensor] = None
    k_cache: Optional[torch.Tensor] = None
    v_cache: Optional[torch.Tensor] = None
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    members: Optional[list] = None       # kind "group": each member workload's Inputs

    def nbytes(self) -> int:
        if self.members:
            return sum(m.nbytes() for m in self.members)
        total = 0
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes() if f.name == "cache" else t.numel() * t.element_size()
        return total

    def qkv(self, wl: "Workload"):
        """kind "gqa": the q, k, v views of the packed projection x."""
        return wl.gqa.split_qkv(self.x)


SLOT_PATTERNS = ("paged", "random", "contiguous")
REGIMES = ("auto", "decode", "prefill", "uniform")
DECODE_MAX_N = 256           # regime "auto": n <= this is a decode step, larger n a prefill
PREFILL_SEQ_LEN = (1024, 4096)   # a prefill's sequence lengths are uniform in this range (tokens)


def slot_mapping(n: int, blocks: int, pattern: str, g: torch.Generator, device) -> torch.Tensor:
    """int32 [n] slots of a cache of ``blocks`` blocks of BLOCK_SIZE tokens, whatever the tokens'
    positions (the "uniform" regime). random: a random permutation of all slots (every record
    scattered: the hardest write pattern); paged: the blocks in a random order, the tokens of a block
    together; contiguous: token i in slot i."""
    if pattern == "random":
        slots = torch.randperm(blocks * BLOCK_SIZE, generator=g, device=device)[:n]
    elif pattern == "paged":
        order = torch.randperm(blocks, generator=g, device=device)
        slots = (order[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()[:n]
    elif pattern == "contiguous":
        slots = torch.arange(n, device=device)
    else:
        raise ValueError(f"slots: expected one of {SLOT_PATTERNS}, got {pattern!r}")
    return slots.to(torch.int32)


def input_regime(n: int, regime: str = "auto") -> str:
    """The input regime of a point: "auto" is "decode" for n <= DECODE_MAX_N, else "prefill"."""
    if regime not in REGIMES:
        raise ValueError(f"regime: expected one of {REGIMES}, got {regime!r}")
    if regime == "auto":
        return "decode" if n <= DECODE_MAX_N else "prefill"
    return regime


def _regime_text(regime: str) -> str:
    return {"auto": f"decode for n <= {DECODE_MAX_N}, else prefill",
            "decode": "one token per sequence", "prefill": "whole sequences",
            "uniform": "uniform positions"}.get(regime, regime)


def prefill_lengths(n: int, g: torch.Generator) -> List[int]:
    """The sequences of a prefill of n tokens: lengths uniform in PREFILL_SEQ_LEN, the last one cut so
    that they total n (n below the range: one sequence of n tokens)."""
    lo, hi = PREFILL_SEQ_LEN
    lens: List[int] = []
    total = 0
    while total < n:
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        lens.append(min(length, n - total))
        total += lens[-1]
    return lens


def token_layout(n: int, regime: str, pattern: str, g: torch.Generator):
    """(positions, slots, cache blocks) of n tokens, int32 on the CPU, for one input regime
    (:func:`input_regime`) and slot pattern:

    - decode: one token per sequence, at a position (the sequence's context length) uniform in
      [0, MAX_POSITION); the cache has n blocks. paged: each sequence's token in its own block (the
      blocks in a random order), at offset position % BLOCK_SIZE; random: n slots drawn from all the
      cache's slots; contiguous: token i in slot i.
    - prefill: sequences of :func:`prefill_lengths`, positions 0..len-1 each; the cache has the
      sequences' blocks (ceil(len / BLOCK_SIZE) each). paged: each sequence's tokens in its own
      consecutive blocks, the sequences' runs of blocks in a random order (the last block of a
      sequence partly empty); random: a random permutation of all the cache's slots, every record
      scattered; contiguous: token i in slot i.
    - uniform: positions uniform in [0, MAX_POSITION) whatever the sequence, ceil(n / BLOCK_SIZE)
      blocks and :func:`slot_mapping`'s pattern.
    """
    if pattern not in SLOT_PATTERNS:
        raise ValueError(f"slots: expected one of {SLOT_PATTERNS}, got {pattern!r}")
    if regime == "uniform":
        blocks = max(1, -(-n // BLOCK_SIZE))
        positions = torch.randint(0, MAX_POSITION, (n,), generator=g)
        return positions.to(torch.int32), slot_mapping(n, blocks, pattern, g, "cpu"), blocks
    if regime == "decode":
        positions = torch.randint(0, MAX_POSITION, (n,), generator=g)
        blocks = n
        if pattern == "paged":
            slots = torch.randperm(blocks, generator=g) * BLOCK_SIZE + positions % BLOCK_SIZE
        elif pattern == "random":
            slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:n]
        else:
            blocks = max(1, -(-n // BLOCK_SIZE))
            slots = torch.arange(n)
    elif regime == "prefill":
        lens = prefill_lengths(n, g)
        positions = torch.cat([torch.arange(length) for length in lens])
        runs = [-(-length // BLOCK_SIZE) for length in lens]
        blocks = sum(runs)
        if pattern == "paged":
            start, first = [0] * len(lens), 0
            for i in torch.randperm(len(lens), generator=g).tolist():
                start[i], first = first, first + runs[i]
            slots = torch.cat([start[i] * BLOCK_SIZE + torch.arange(length) for i, length in enumerate(lens)])
        elif pattern == "random":
            slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:n]
        else:
            blocks = max(1, -(-n // BLOCK_SIZE))
            slots = torch.arange(n)
    else:
        raise ValueError(f"regime: expected one of {REGIMES[1:]}, got {regime!r}")
    return positions.to(torch.int32), slots.to(torch.int32), blocks


def build_inputs(wl: Workload, n: int, device, seed: int = 0, slots: str = "paged",
                 regime: str = "auto") -> Inputs:
    """Random realistic inputs: bf16 activations (normal, per-token scales 2^-3..2^3), a norm weight
    near 1, the positions, cache and slots of :func:`token_layout` for the point's regime
    (:func:`input_regime`) and slot pattern. The layout depends on (seed, n) only: every workload
    of a size gets the same positions and slots."""
    device = torch.device(device)
    regime = input_regime(n, regime)
    layout = torch.Generator().manual_seed(seed * 1_000_003 + n)
    positions, slot_map, blocks = token_layout(n, regime, slots, layout)
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + n * 7 + len(wl.name))
    if wl.kind == "gqa":
        return _gqa_inputs(wl, n, device, g, positions, slot_map, blocks, regime, slots)
    if wl.kind == "group":
        members = [build_inputs(WORKLOADS[m], n, device, seed, slots, regime) for m in wl.members]
        for m in members[1:]:               # one positions tensor and one cos/sin table for the layer
            m.positions, m.cos_sin = members[0].positions, members[0].cos_sin
        return Inputs(n=n, x=members[0].x, positions=members[0].positions, cos_sin=members[0].cos_sin,
                      regime=regime, slot_pattern=slots, members=members)
    H, D = wl.num_heads, wl.head_dim
    shape = (n, D) if H == 1 else (n, H, D)
    x = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    scale = torch.randint(-3, 4, (n,) + (1,) * (len(shape) - 1), generator=g, device=device)
    x.mul_(torch.exp2(scale.float()).to(torch.bfloat16))
    inp = Inputs(n=n, x=x, cos_sin=cos_sin_cache(MAX_POSITION, wl.rotary_dim, device=device),
                 positions=positions.to(device), regime=regime)
    if wl.norm:
        inp.weight = (torch.randn(D, generator=g, device=device) * 0.1 + 1.0).to(torch.bfloat16)
        if wl.norm_bias:
            inp.bias = (torch.randn(D, generator=g, device=device) * 0.1).to(torch.bfloat16)
        inp.norm_buf = torch.empty_like(x)
    if wl.kind == "write":
        fmt = wl.fmt
        inp.cache = fmt.allocate(blocks, BLOCK_SIZE, device=device)
        inp.slots = slot_map.to(device)
        inp.slot_pattern = slots
        inp.rope_buf = torch.empty_like(x)
        inp.q = torch.empty((n, fmt.quant_bytes), dtype=q_dtype(fmt.cast_fmt), device=device)
        inp.sf = torch.empty((n, fmt.num_scales), dtype=fmt.sf_dtype, device=device)
    elif wl.kind == "q_pre":
        inp.out = torch.empty_like(x)
    else:
        inp.rope_buf = torch.empty_like(x)
        inp.q = torch.empty((n, H, wl.fmt.quant_bytes), dtype=q_dtype(wl.fmt.cast_fmt), device=device)
        inp.sf = torch.empty((n, H, wl.fmt.num_scales), dtype=wl.fmt.sf_dtype, device=device)
    return inp


def _gqa_inputs(wl: Workload, n: int, device, g: torch.Generator, positions, slot_map, blocks: int, regime: str,
                slots: str) -> Inputs:
    """kind "gqa": a packed projection [n, (Hq + 2 Hkv) D] (normal, per-token scales 2^-3..2^3), the model's
    norm weights (Gemma: 1 + w in fp32), NHD caches of ``blocks`` blocks, per-tensor scales for fp8, and the
    positions and slots of :func:`token_layout` (as every workload of the size)."""
    cfg = wl.gqa
    x = torch.randn((n, cfg.qkv_width), generator=g, device=device, dtype=torch.bfloat16)
    scale = torch.randint(-3, 4, (n, 1), generator=g, device=device)
    x.mul_(torch.exp2(scale.float()).to(torch.bfloat16))
    inp = Inputs(n=n, x=x, cos_sin=cos_sin_cache(MAX_POSITION, cfg.rotary_dim, device=device),
                 positions=positions.to(device), regime=regime, slot_pattern=slots)
    if cfg.qk_norm:
        raw = [(torch.randn(cfg.head_dim, generator=g, device=device) * 0.1
                + (0.0 if cfg.norm_weight_offset else 1.0)).to(torch.bfloat16) for _ in range(2)]
        inp.weight, inp.k_weight = (cfg.norm_args(w).weight for w in raw)
    dtype = torch.float8_e4m3fn if wl.cache_fp8 else torch.bfloat16
    shape = (blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    inp.k_cache = torch.zeros(shape, dtype=torch.uint8 if wl.cache_fp8 else dtype, device=device).view(dtype)
    inp.v_cache = torch.zeros(shape, dtype=torch.uint8 if wl.cache_fp8 else dtype, device=device).view(dtype)
    if wl.cache_fp8:
        inp.k_scale = torch.tensor([0.02], device=device)
        inp.v_scale = torch.tensor([0.05], device=device)
    inp.slots = slot_map.to(device)
    inp.out = torch.empty((n, cfg.num_heads, cfg.head_dim), dtype=torch.bfloat16, device=device)
    inp.rope_buf = torch.empty((n, cfg.num_kv_heads, cfg.head_dim), dtype=torch.bfloat16, device=device)
    return inp


def build_input_sets(wl: Workload, n: int, device, cold_l2: bool = False, seed: int = 0,
                     slots: str = "paged", regime: str = "auto") -> List[Inputs]:
    """One set; with cold_l2, as many (at most 16) as needed to total COLD_L2_BYTES."""
    first = build_inputs(wl, n, device, seed, slots, regime)
    count = 1
    if cold_l2:
        count = max(1, min(16, math.ceil(COLD_L2_BYTES / max(1, first.nbytes()))))
    return [first] + [build_inputs(wl, n, device, seed + i, slots, regime) for i in range(1, count)]


def result_tensors(wl: Workload, inp: Inputs) -> List[torch.Tensor]:
    """What a call of the workload produces (to compare peers): the cache, the bf16 out, or (q, sf); for
    "gqa" q_out and the two caches."""
    if wl.kind == "gqa":
        return [inp.out, inp.k_cache, inp.v_cache]
    if wl.kind == "group":
        return [t for name, m in zip(wl.members, inp.members) for t in result_tensors(WORKLOADS[name], m)]
    if wl.kind == "write":
        return [inp.cache]
    if wl.kind == "q_pre":
        return [inp.out]
    return [inp.q, inp.sf]


# =============================================================================== peers
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
    return inp.x, norm, rope, had, wl.cast_args, out


def _gqa_args(wl: Workload, inp: Inputs):
    cfg = wl.gqa
    q, k, v = inp.qkv(wl)
    eps = cfg.norm_eps
    qn = NormArgs(inp.weight, eps) if cfg.qk_norm else None
    kn = NormArgs(inp.k_weight, eps) if cfg.qk_norm else None
    rope = RopeArgs(inp.positions, inp.cos_sin, cfg.rotary_dim, cfg.rope_is_neox, 0)
    return q, k, v, qn, kn, rope


def _gqa_call(wl: Workload, inp: Inputs) -> Callable[[], None]:
    q, k, v, qn, kn, rope = _gqa_args(wl, inp)
    kc, vc, ks, vs, slots, out = inp.k_cache, inp.v_cache, inp.k_scale, inp.v_scale, inp.slots, inp.out

    def call():
        fused_qk_norm_rope_store_kv(q, k, v, kc, vc, slots, qn, kn, rope, ks, vs, "NHD", out)
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

    Byte-equal to the fused call (q_out and both caches). Every benchmark slot is valid."""
    q, k, v, qn, kn, rope = _gqa_args(wl, inp)
    fused = _api.fused_norm_rope_hadamard_cast_store_kvcache
    store = _api.store_kv_cache
    ks, vs, slots, kbuf = inp.k_scale, inp.v_scale, inp.slots, inp.rope_buf
    qo, kb = ContiguousOutArgs(out=inp.out), ContiguousOutArgs(out=kbuf)
    fmt = _gqa_store_format(wl.head_dim * inp.k_cache.element_size())
    kc, vc = inp.k_cache.view(torch.uint8), inp.v_cache.view(torch.uint8)

    def call():
        fused(q, qn, rope, out_args=qo)
        fused(k, kn, rope, out_args=kb)
        if ks is None:
            kd, vd = kbuf, v
        else:
            kd = reference.quantize_per_tensor(kbuf, ks).view(torch.bfloat16)
            vd = reference.quantize_per_tensor(v, vs).view(torch.bfloat16)
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
       least one q head, so the call is validated with q = K (:func:`kvfuse.gqa.validate`, every other
       rule applies) and its plan run with q emptied to zero heads (:func:`kvfuse.gqa.run`).

    Byte-equal to the fused call (q_out and both caches)."""
    q, k, v, qn, kn, rope = _gqa_args(wl, inp)
    n, hkv, d = k.shape
    kbuf = inp.rope_buf                                              # bf16 [n, Hkv, D]
    k_as_cache = kbuf.view(n, 1, hkv, d)                             # NHD: block i holds token i
    token_slots = torch.arange(n, dtype=torch.int32, device=k.device)
    v_part = v[..., :V_SINK_DIM]
    v_sink = torch.empty((n, 1, hkv, V_SINK_DIM), dtype=torch.bfloat16, device=k.device)
    plan = _gqa_mod.validate(kbuf, kbuf, v, inp.k_cache, inp.v_cache, inp.slots, None, None, None, inp.k_scale,
                             inp.v_scale, "NHD")
    no_q = kbuf[:, :0]
    plan = dataclasses.replace(plan, q=no_q, q_out=no_q)
    out, run = inp.out, _gqa_mod.run

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
        eps = wl.gqa.norm_eps

        def gqa_chain(q, k, v, k_cache, v_cache, slots, q_out, q_weight, k_weight, positions, cos_sin, k_scale,
                      v_scale):
            reference.qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slots, q_out, q_weight, eps, k_weight, eps,
                                            positions, cos_sin, rd, 0, neox, False, k_scale, v_scale, "NHD")
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
            payloads = [q.view(torch.uint8), sf.contiguous().view(torch.uint8)]
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


# =============================================================================== timing
@dataclasses.dataclass
class Timing:
    gpu_us: float
    gpu_method: str          # "graph": CUDA-graph replay; "events": CUDA events around eager calls
    eager_us: float
    note: str = ""


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def _clamp(v, lo, hi):
    return max(lo, min(hi, v))


class CudaTimer:
    """GPU time per call by CUDA-graph replay (K calls captured in one graph, median per call over
    replays), falling back to CUDA events around eager calls for ops that cannot be captured
    (host synchronization); eager wall time per call (a loop of calls, one synchronize at the end)."""

    def __init__(self, graph_calls: int = 20, target_s: float = 0.05, eager_target_s: float = 0.03,
                 min_reps: int = 3, max_reps: int = 40, max_eager_calls: int = 200):
        self.graph_calls, self.target_s, self.eager_target_s = graph_calls, target_s, eager_target_s
        self.min_reps, self.max_reps, self.max_eager_calls = min_reps, max_reps, max_eager_calls

    def measure(self, fns: Sequence[Callable[[], None]], label=None) -> Timing:
        for f in fns:                      # warm-up: JIT compiles, torch.compile, autotuning
            f()
        torch.cuda.synchronize()
        est = self._estimate(fns)
        gpu, method, note = None, "events", ""
        blocker = self._host_sync(fns[0])
        if blocker:
            note = f"not graph-capturable ({blocker}); GPU time from events"
        else:
            try:
                gpu, method = self._graph_us(fns, est), "graph"
            except Exception as e:
                note = f"graph capture failed ({_short(e, 160)}); GPU time from events"
                recover_cuda()
        if gpu is None:
            gpu = self._events_us(fns, est)
        return Timing(gpu, method, self._eager_us(fns, est), note)

    @staticmethod
    def _estimate(fns) -> float:
        best = float("inf")
        for i in range(2):
            t = time.perf_counter()
            fns[i % len(fns)]()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return max(best, 1e-6)

    @staticmethod
    def _host_sync(fn) -> str:
        """'' if fn runs with synchronizing CUDA calls turned into errors, else the error."""
        try:
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        except Exception:
            return ""
        try:
            fn()
            return ""
        except Exception as e:
            return _short(e, 120)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
            recover_cuda()

    def _graph_us(self, fns, est) -> float:
        k = _clamp(int(0.02 / est), 1, self.graph_calls)
        k = max(k, min(len(fns), self.graph_calls))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for i in range(k):
                    fns[i % len(fns)]()
        except Exception:
            # a failed capture_end leaves the capture stream current: put ours back
            torch.cuda.set_stream(stream)
            raise
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        one = _events_ms(lambda: graph.replay(), 1) / 1e3
        reps = _clamp(int(self.target_s / max(one, 1e-7)), self.min_reps, self.max_reps)
        times = [_events_ms(lambda: graph.replay(), 1) * 1e3 / k for _ in range(reps)]
        del graph
        return statistics.median(times)

    def _events_us(self, fns, est) -> float:
        """Median of 3 groups: events around a group of eager calls, divided by the group's size."""
        per = max(1, _clamp(int(self.target_s / est), self.min_reps, self.max_reps) // 3)
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(per):
                fns[i % len(fns)]()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / per)
        return statistics.median(times)

    def _eager_us(self, fns, est) -> float:
        calls = _clamp(int(self.eager_target_s / est), 3, self.max_eager_calls)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6 / calls


def _events_ms(fn, count: int) -> float:
    """Milliseconds between two CUDA events around ``count`` calls of fn."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(count):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def recover_cuda() -> None:
    """After a failed GPU call: wait for the device so that the failure is not reported by the next
    call; an error that ended the CUDA context is swallowed here (what follows will report it)."""
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def measure_copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> Dict[str, float]:
    """Device-to-device copy: (bytes read + written) / median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = [_events_ms(lambda: dst.copy_(src), 1) / 1e3 for _ in range(reps)]
    del src, dst
    torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"copy_GBps": 2 * nbytes / t / 1e9, "copy_ms": t * 1e3, "copy_bytes": 2 * nbytes}


def measure_launch_floor(launches: int = 100, reps: int = 50) -> Dict[str, object]:
    """GPU time of one tiny Triton kernel (load + store of one int) replayed in a CUDA graph."""
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    if _tiny_kernel is not None:
        launch, kernel = (lambda: _tiny_kernel[(1,)](buf)), "triton"
    else:  # pragma: no cover
        launch, kernel = (lambda: buf.add_(1)), "torch add_ (triton unavailable)"
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = [_events_ms(lambda: graph.replay(), 1) * 1e3 / launches for _ in range(reps)]
    del graph
    return {"floor_us": statistics.median(times), "floor_min_us": min(times), "floor_kernel": kernel,
            "floor_launches_per_graph": launches}


# =============================================================================== records
@dataclasses.dataclass
class Record:
    workload: str
    n: int
    peer: str
    rows: int = 0
    bytes: int = 0
    status: str = "ok"               # "ok" | "skipped" | "error"
    gpu_us: Optional[float] = None
    gpu_method: Optional[str] = None
    eager_us: Optional[float] = None
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    x_floor: Optional[float] = None
    fused_speedup: Optional[float] = None   # this peer's GPU time / the fused GPU time, same point
    note: str = ""
    regime: str = ""                 # the inputs' regime (input_regime): "decode" | "prefill" | "uniform"
    slots: str = ""                  # writes: the slot pattern of the inputs
    bytes_detail: Optional[Dict[str, int]] = None   # input_bytes by component (None: no inputs built)


def finalize(rec: Record, copy_gbps: Optional[float], floor_us: Optional[float]) -> Record:
    """Derived columns of one record from its GPU time."""
    if rec.gpu_us and rec.gpu_us > 0:
        rec.gbps = rec.bytes / (rec.gpu_us * 1e-6) / 1e9
        rec.pct_copy = 100.0 * rec.gbps / copy_gbps if copy_gbps else None
        rec.x_floor = rec.gpu_us / floor_us if floor_us else None
    return rec


def add_speedups(records: Sequence[Record]) -> None:
    fused = {(r.workload, r.n): r.gpu_us for r in records if r.peer == "fused" and r.status == "ok" and r.gpu_us}
    for r in records:
        f = fused.get((r.workload, r.n))
        if f and r.status == "ok" and r.gpu_us:
            r.fused_speedup = r.gpu_us / f


# =============================================================================== the run
@dataclasses.dataclass
class Config:
    workloads: List[str]
    sizes: List[int]
    peers: List[str]
    peer_max_n: int = 65536
    cold_l2: bool = False
    out: Optional[str] = None
    quick: bool = False
    budget_s: float = 330.0
    compile_budget_s: float = 100.0
    max_x_elems: int = MAX_X_ELEMS
    seed: int = 0
    slots: str = "paged"
    regime: str = "auto"
    plot: bool = True
    progress: bool = True
    pdl: bool = False          # the whole suite with programmatic dependent launch (kvfuse.set_pdl)
    pdl_pairs: bool = False    # also time producer + call pairs, PDL off and on (measure_pdl_pairs)


class _CompileState:
    """The compile peer: one compiled chain per workload, its failures, the time spent compiling."""

    def __init__(self, compiler, budget_s: float):
        self.compiler, self.budget_s = compiler, budget_s
        self.spent_s = 0.0
        self.failed: Dict[str, str] = {}
        self._fns: Dict[str, Callable] = {}

    def chain(self, wl: Workload) -> Callable:
        if wl.name not in self._fns:
            if self.compiler is torch.compile:
                _reset_dynamo()
            self._fns[wl.name] = self.compiler(make_chain(wl))
        return self._fns[wl.name]

    def skip_reason(self, wl: Workload) -> str:
        if wl.name in self.failed:
            return f"compile failed earlier for this workload: {self.failed[wl.name]}"
        if self.spent_s > self.budget_s:
            return f"compile budget spent ({self.spent_s:.0f}s > --compile-budget-s {self.budget_s:.0f})"
        return ""


def _reset_dynamo() -> None:
    try:
        import torch._dynamo as dynamo
        dynamo.reset()
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
    except Exception:  # pragma: no cover
        pass


def peer_not_applicable(peer: str, wl: Workload) -> str:
    """Why ``peer`` has no meaning for ``wl`` ("" when it has)."""
    if peer == "calls" and wl.kind != "group":
        return "the member calls one by one: group workloads only"
    if peer in GQA_PEERS and wl.kind != "gqa":
        return "the engines' two launches of a GQA call (fused_qk_norm_rope_store_kv): GQA workloads only"
    if peer == "compile" and wl.kind == "group":
        return "no torch.compile chain of a group (its members' chains are measured on their own)"
    return ""


def _skip_reason(peer: str, wl: Workload, n: int, cfg: Config, cstate: _CompileState) -> str:
    rows = n * wl.num_heads
    reason = peer_not_applicable(peer, wl)
    if reason:
        return reason
    if peer in ("reference", "compile") and rows > cfg.peer_max_n:
        return f"rows n*heads={rows} > --peer-max-n {cfg.peer_max_n}"
    if peer == "compile":
        return cstate.skip_reason(wl)
    return ""


def measure_point(wl: Workload, n: int, cfg: Config, device, timer, cstate: _CompileState,
                  deadline: float, log=print) -> List[Record]:
    """All peers of one (workload, n): build the inputs once, time each peer on them."""
    rows = n * wl.num_heads
    base = dict(workload=wl.name, n=n, rows=rows, regime=input_regime(n, cfg.regime),
                slots=cfg.slots if wl.kind in ("write", "group") else "")
    skip = ""
    if rows * wl.head_dim > cfg.max_x_elems:
        skip = f"x would hold {rows * wl.head_dim} elements > {cfg.max_x_elems} (--max-x-elems)"
    elif time.perf_counter() > deadline:
        skip = "time budget spent (--budget-s)"
    if skip:
        return [Record(peer=p, status="skipped", note=skip, **base) for p in cfg.peers]
    try:
        sets = build_input_sets(wl, n, device, cfg.cold_l2, cfg.seed, cfg.slots, cfg.regime)
        detail = mean_bytes([input_bytes(wl, s) for s in sets])
    except Exception as e:
        recover_cuda()
        return [Record(peer=p, status="error", note=f"building inputs: {_short(e)}", **base) for p in cfg.peers]
    base.update(bytes=detail["total"], bytes_detail=detail)
    out = []
    for peer in cfg.peers:
        reason = _skip_reason(peer, wl, n, cfg, cstate)
        if reason:
            out.append(Record(peer=peer, status="skipped", note=reason, **base))
            continue
        t0 = time.perf_counter()
        try:
            compiled = cstate.chain(wl) if peer == "compile" else None
            fns = [make_peer(peer, wl, s, compiled) for s in sets]
            t = timer.measure(fns, (wl.name, n, peer))
            out.append(Record(peer=peer, gpu_us=t.gpu_us, gpu_method=t.gpu_method, eager_us=t.eager_us,
                              note=t.note + (f" ({len(sets)} input sets)" if len(sets) > 1 else ""), **base))
        except Exception as e:
            msg = _short(e)
            out.append(Record(peer=peer, status="error", note=msg, **base))
            log(f"[{wl.name} n={n} {peer}] {msg}")
            if peer == "compile":
                cstate.failed[wl.name] = msg
            recover_cuda()
        finally:
            if peer == "compile":
                cstate.spent_s += time.perf_counter() - t0
    del sets
    return out


def run_suite(cfg: Config, device, timer, copy_gbps: Optional[float] = None, floor_us: Optional[float] = None,
              kernel_backend: str = "triton", compiler=None, progress=None, log=print) -> List[Record]:
    """Every (workload, n, peer) of cfg, in order; never raises for a failing peer."""
    cstate = _CompileState(torch.compile if compiler is None else compiler, cfg.compile_budget_s)
    deadline = time.perf_counter() + cfg.budget_s
    records: List[Record] = []
    with use_backend(kernel_backend):
        for name in cfg.workloads:
            wl = WORKLOADS[name]
            for n in cfg.sizes:
                if progress is not None:
                    progress.set_description(f"{name} n={n}")
                records += measure_point(wl, n, cfg, device, timer, cstate, deadline, log)
                if progress is not None:
                    progress.update(1)
                _free(device, big=n * wl.num_heads >= 65536)
    for r in records:
        finalize(r, copy_gbps, floor_us)
    add_speedups(records)
    return records


def _free(device, big: bool) -> None:
    """Give the point's buffers back (refcounting frees them; a collection only after big points)."""
    if big:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# =============================================================================== report
def _f(v, spec: str) -> str:
    """format(v, spec), or '-' padded to the spec's width when v is None."""
    if v is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(v, spec)


TABLE_COLUMNS = ("workload", "n", "peer", "GPU us", "timing", "eager us", "GB/s", "%copy", "x floor", "vs fused")


def format_table(records: Sequence[Record]) -> str:
    """The stdout table: one line per (workload, n, peer); a blank line between workloads."""
    head = (f"{'workload':<16} {'n':>7} {'peer':<9} {'GPU us':>10} {'timing':<6} {'eager us':>10} "
            f"{'GB/s':>8} {'%copy':>6} {'x floor':>8} {'vs fused':>8}  note")
    lines = [head, "-" * len(head)]
    prev = None
    for r in records:
        if prev is not None and r.workload != prev:
            lines.append("")
        prev = r.workload
        note = r.note if r.status == "ok" else f"{r.status.upper()}: {r.note}"
        lines.append(f"{r.workload:<16} {r.n:>7} {r.peer:<9} {_f(r.gpu_us, '10.2f')} {r.gpu_method or '-':<6} "
                     f"{_f(r.eager_us, '10.2f')} {_f(r.gbps, '8.1f')} {_f(r.pct_copy, '6.1f')} "
                     f"{_f(r.x_floor, '8.2f')} {_f(r.fused_speedup, '8.2f')}  {note}".rstrip())
    return "\n".join(lines)


def format_summary(records: Sequence[Record]) -> str:
    """A compact view, one line per (workload, n): the fused kernel and how many times slower the
    other peers are (their GPU time / the fused GPU time)."""
    by = {(r.workload, r.n, r.peer): r for r in records}
    points = list(dict.fromkeys((r.workload, r.n) for r in records))
    head = (f"{'workload':<16} {'n':>7} {'fused us':>9} {'GB/s':>7} {'%copy':>6} {'x floor':>7} "
            f"{'stages x':>8} {'compile x':>9} {'ref x':>7}")
    lines = ["summary (fused GPU time; other peers as multiples of it):", head]
    for wl, n in points:
        f = by.get((wl, n, "fused"))
        if f is None or f.status != "ok":
            lines.append(f"{wl:<16} {n:>7} {'-':>9}  fused {f.status if f else 'not run'}")
            continue
        ratio = [getattr(by.get((wl, n, p)), "fused_speedup", None) for p in ("stages", "compile", "reference")]
        lines.append(f"{wl:<16} {n:>7} {_f(f.gpu_us, '9.2f')} {_f(f.gbps, '7.0f')} {_f(f.pct_copy, '6.1f')} "
                     f"{_f(f.x_floor, '7.2f')} {_f(ratio[0], '8.2f')} {_f(ratio[1], '9.1f')} {_f(ratio[2], '7.1f')}")
    return "\n".join(lines)


# The project's targets (docs/performance.md, "Targets"): % of copy at PCT_COPY_N of every cache write, by
# cache format and slot pattern; decode at most FLOOR_TARGET times the launch floor at FLOOR_SIZES with
# programmatic dependent launch, for the writes, q_pre and index_q.
PCT_COPY_N = 262144
PCT_COPY_TARGET = 85.0                                      # every format but those below
PCT_COPY_TARGETS = {("MAIN_FP8", "random"): 80.0, ("MAIN_FP4", None): 80.0}   # (format, slots or None: any)
FLOOR_SIZES = (1, 256)
FLOOR_TARGET = 1.3
FLOOR_KINDS = ("write", "q_pre", "index_q")


def pct_copy_target(fmt_name: str, slots: str) -> float:
    """The % of copy target of a write of cache format ``fmt_name`` on ``slots`` ("" : paged)."""
    slots = slots or "paged"
    return PCT_COPY_TARGETS.get((fmt_name, slots), PCT_COPY_TARGETS.get((fmt_name, None), PCT_COPY_TARGET))


TARGET_KINDS = ("pct_copy", "floor", "stages", "stages_65536")     # an entry's "kind", in the order of each workload's


def check_targets(records: Sequence[Record], pdl: bool = True) -> List[dict]:
    """The performance targets as PASS / MISS / N/A (not measured) entries (target, status, value, op,
    threshold, detail, workload, kind: one of TARGET_KINDS); reporting only. ``pdl``: the run had
    programmatic dependent launch (the launch-floor target needs it: N/A without)."""
    ok = {(r.workload, r.n, r.peer): r for r in records if r.status == "ok" and r.gpu_us}
    present = list(dict.fromkeys(r.workload for r in records))
    out = []

    def add(name, value, op, target, detail="", *, workload, kind):
        if value is None:
            status = "N/A"
        else:
            status = "PASS" if (value >= target if op == ">=" else value <= target) else "MISS"
        out.append(dict(target=name, status=status, value=value, op=op, threshold=target, detail=detail,
                        workload=workload, kind=kind))

    def fused(wl, n, attr):
        r = ok.get((wl, n, "fused"))
        return None if r is None else getattr(r, attr)

    def slot_pattern(wl):
        """The slots of the fused record at PCT_COPY_N, else of any record of ``wl``; "" (old runs): paged."""
        r = ok.get((wl, PCT_COPY_N, "fused"))
        slots = r.slots if r is not None and r.slots else next((q.slots for q in records if q.workload == wl
                                                                 and q.slots), "")
        return slots or "paged"

    sizes = ", ".join(map(str, FLOOR_SIZES))
    for wl in present:
        w = WORKLOADS.get(wl)
        if w is not None and w.kind == "write":
            slots = slot_pattern(wl)
            add(f"{wl} fused % copy at n={PCT_COPY_N} ({slots} slots)", fused(wl, PCT_COPY_N, "pct_copy"), ">=",
                pct_copy_target(w.fmt.name, slots), workload=wl, kind="pct_copy")
        if w is not None and w.kind in FLOOR_KINDS:
            name = f"{wl} fused GPU time / launch floor at n in {{{sizes}}} (worst), with programmatic dependent launch"
            floors = [(r.x_floor, n) for (q, n, p), r in ok.items() if q == wl and p == "fused" and n in FLOOR_SIZES
                      and r.x_floor is not None]
            if not pdl:
                add(name, None, "<=", FLOOR_TARGET, "needs a --pdl run", workload=wl, kind="floor")
            else:
                worst = max(floors) if floors else (None, None)
                add(name, worst[0], "<=", FLOOR_TARGET, f"at n={worst[1]}" if floors else "", workload=wl, kind="floor")
        sp = [(r.fused_speedup, n) for (q, n, p), r in ok.items() if q == wl and p == "stages" and n <= 4096
              and r.fused_speedup is not None]
        least = min(sp) if sp else (None, None)
        add(f"{wl} fused vs stage chain, n<=4096 (least)", least[0], ">=", 2.0, f"at n={least[1]}" if sp else "",
            workload=wl, kind="stages")
        r = ok.get((wl, 65536, "stages"))
        add(f"{wl} fused vs stage chain at n=65536", None if r is None else r.fused_speedup, ">=", 1.8,
            workload=wl, kind="stages_65536")
    return out


def format_targets(targets: Sequence[dict]) -> str:
    lines = ["targets (reporting, not asserting):"]
    for t in targets:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        detail = "" if not t["detail"] else f" ({t['detail']})" if t["value"] is None else f" {t['detail']}"
        lines.append(f"  {t['status']:<4}  {t['target']}: {value}{detail} (target {t['op']} {t['threshold']:g})")
    return "\n".join(lines)


def measure_pdl_pairs(cfg: Config, device, timer) -> List[dict]:
    """GPU us per pair [a producer kernel that writes x (and lets its dependents launch), then the fused
    call], replayed in a CUDA graph with kvfuse's PDL off and on, and of the producer alone; the call's
    share of a pair is pair - producer. Sizes above the decode range are skipped (PDL hides a launch,
    not bandwidth)."""
    pairs = []
    for name in cfg.workloads:
        wl = WORKLOADS[name]
        for n in cfg.sizes:
            if n > DECODE_MAX_N:
                continue
            inp = build_inputs(wl, n, device, seed=cfg.seed, slots=cfg.slots, regime=cfg.regime)
            call = fused_call(wl, inp)
            x = inp.x

            def producer():
                _producer_kernel[(1,)](x)
            row = dict(workload=name, n=n, producer_us=timer.measure([producer]).gpu_us)
            for pdl in (False, True):
                _backend.set_pdl(pdl)

                def pair():
                    producer()
                    call()
                row["pair_pdl_us" if pdl else "pair_us"] = timer.measure([pair]).gpu_us
            _backend.set_pdl(cfg.pdl)
            row["call_us"] = row["pair_us"] - row["producer_us"]
            row["call_pdl_us"] = row["pair_pdl_us"] - row["producer_us"]
            pairs.append(row)
            del inp
    return pairs


def format_pdl_pairs(pairs: Sequence[dict]) -> str:
    lines = ["producer + call pairs (GPU us, CUDA-graph replay; call = pair - producer):",
             f"{'workload':22s} {'n':>6s} {'producer':>9s} {'pair':>8s} {'pair PDL':>9s} {'call':>7s} {'call PDL':>9s}"]
    for r in pairs:
        lines.append(f"{r['workload']:22s} {r['n']:6d} {r['producer_us']:9.2f} {r['pair_us']:8.2f} "
                     f"{r['pair_pdl_us']:9.2f} {r['call_us']:7.2f} {r['call_pdl_us']:9.2f}")
    return "\n".join(lines)


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def build_report(cfg: Config, info: dict, device: dict, records: Sequence[Record], targets: Sequence[dict],
                 elapsed_s: float, pdl_pairs: Sequence[dict] = ()) -> dict:
    return _json_safe({
        "meta": dict(info, elapsed_s=elapsed_s, config=dataclasses.asdict(cfg)),
        "device": device,
        "workloads": {w: dict(kind=WORKLOADS[w].kind, head_dim=WORKLOADS[w].head_dim,
                              num_heads=WORKLOADS[w].num_heads, format=getattr(WORKLOADS[w].fmt, "name", None),
                              description=WORKLOADS[w].description,
                              bytes_per_token=moved_bytes(WORKLOADS[w], 1))
                      for w in cfg.workloads},
        "inputs": dict(regime=cfg.regime, slots=cfg.slots, decode_max_n=DECODE_MAX_N,
                       prefill_seq_len=list(PREFILL_SEQ_LEN), max_position=MAX_POSITION, block_size=BLOCK_SIZE),
        "accounting": ACCOUNTING,
        "results": [dataclasses.asdict(r) for r in records],
        "targets": list(targets),
        "pdl_pairs": list(pdl_pairs),
    })


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)


def plot_results(records: Sequence[Record], path: str, copy_gbps: Optional[float] = None,
                 floor_us: Optional[float] = None) -> None:
    """PNG: one row per workload, GPU time vs n (left) and effective bandwidth vs n (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(r.workload for r in records if r.status == "ok" and r.gpu_us))
    if not wls:
        return
    fig, axes = plt.subplots(len(wls), 2, figsize=(13, 3.3 * len(wls)), squeeze=False)
    for row, wl in zip(axes, wls):
        for peer in PEERS:
            pts = sorted((r.n, r.gpu_us, r.gbps) for r in records
                         if r.workload == wl and r.peer == peer and r.status == "ok" and r.gpu_us)
            if pts:
                ns = [p[0] for p in pts]
                row[0].plot(ns, [p[1] for p in pts], marker="o", ms=3, label=peer)
                row[1].plot(ns, [p[2] for p in pts], marker="o", ms=3, label=peer)
        if floor_us:
            row[0].axhline(floor_us, ls=":", color="gray", label="launch floor")
        if copy_gbps:
            row[1].axhline(copy_gbps, ls="--", color="gray", label="copy bandwidth")
        row[0].set(xscale="log", yscale="log", title=f"{wl}: GPU time per call", xlabel="n (tokens)",
                   ylabel="us")
        row[1].set(xscale="log", title=f"{wl}: effective bandwidth", xlabel="n (tokens)", ylabel="GB/s")
        for ax in row:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# =============================================================================== CLI
def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_config(argv: Optional[Sequence[str]]) -> Config:
    p = argparse.ArgumentParser(prog="kvfuse bench", description="Time the fused KV write against its peers "
                                "(eager reference, torch.compile, kvfuse stage by stage) on a CUDA device.")
    p.add_argument("--workloads", default=None, help=f"comma list or 'all' (default all; --quick: "
                   f"{','.join(QUICK_WORKLOADS)}); names: {','.join(WORKLOADS)}")
    p.add_argument("--n", default=None, help=f"comma list of sizes (default {','.join(map(str, DEFAULT_SIZES))})")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list (default {','.join(PEERS)}; a peer "
                   f"that has no meaning for a workload is recorded as skipped)")
    p.add_argument("--quick", action="store_true", help="fewer workloads, sizes and replays (~90 s)")
    p.add_argument("--out", default=None, help="directory for kvfuse_bench.{json,png,txt} (default $OUT or "
                   "./kvfuse-bench)")
    p.add_argument("--cold-l2", action="store_true", help="cycle through several input sets (>= 512 MiB in all)")
    p.add_argument("--peer-max-n", type=int, default=65536, help="skip the reference and compile peers when "
                   "n * num_heads exceeds this (default 65536)")
    p.add_argument("--budget-s", type=float, default=None, help="stop measuring new points after this many "
                   "seconds (default 330; --quick 75)")
    p.add_argument("--compile-budget-s", type=float, default=None, help="stop running the compile peer once "
                   "it has used this many seconds (default 100; --quick 25)")
    p.add_argument("--max-x-elems", type=int, default=MAX_X_ELEMS, help="skip points whose x has more elements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", choices=SLOT_PATTERNS, default="paged", help="where the tokens of a write go: "
                   "paged (default: each sequence's tokens in its own blocks), random (a random permutation of "
                   "the cache's slots, every record scattered) or contiguous (token i in slot i)")
    p.add_argument("--regime", choices=REGIMES, default="auto", help=f"the inputs' positions and sequences: "
                   f"auto (default: decode for n <= {DECODE_MAX_N}, else prefill), decode (one token per "
                   f"sequence at spread positions), prefill (sequences of {PREFILL_SEQ_LEN[0]}-{PREFILL_SEQ_LEN[1]} "
                   f"tokens at positions 0..len-1) or uniform (positions uniform in [0, {MAX_POSITION}))")
    p.add_argument("--pdl", action="store_true", help="run kvfuse with programmatic dependent launch "
                   "(kvfuse.set_pdl(True)): each call of a graph may start while the previous one finishes")
    p.add_argument("--pdl-pairs", action="store_true", help="also time, per workload and n, a producer kernel "
                   "that writes x followed by the fused call, PDL off and on (the call's share: pair - producer)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(list(argv) if argv is not None else [])
    if a.workloads in (None, ""):
        workloads = list(QUICK_WORKLOADS if a.quick else WORKLOADS)
    elif a.workloads == "all":
        workloads = list(WORKLOADS)
    else:
        workloads = _csv(a.workloads)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise ValueError(f"--workloads: unknown {bad}; choose from {list(WORKLOADS)}")
    peers = _csv(a.peers)
    if not peers or any(x not in PEERS for x in peers):
        raise ValueError(f"--peers: expected a comma list of {PEERS}, got {a.peers!r}")
    try:
        sizes = [int(v) for v in _csv(a.n)] if a.n else list(QUICK_SIZES if a.quick else DEFAULT_SIZES)
    except ValueError:
        raise ValueError(f"--n: expected a comma list of integers, got {a.n!r}") from None
    if not sizes or any(v < 1 for v in sizes):
        raise ValueError(f"--n: sizes must be >= 1, got {sizes}")
    return Config(workloads=workloads, sizes=sizes, peers=[x for x in PEERS if x in peers],
                  peer_max_n=a.peer_max_n, cold_l2=a.cold_l2, out=a.out, quick=a.quick,
                  budget_s=a.budget_s if a.budget_s is not None else (75.0 if a.quick else 330.0),
                  compile_budget_s=(a.compile_budget_s if a.compile_budget_s is not None
                                    else (25.0 if a.quick else 100.0)),
                  max_x_elems=a.max_x_elems, seed=a.seed, slots=a.slots, regime=a.regime, plot=not a.no_plot,
                  progress=not a.no_progress, pdl=a.pdl, pdl_pairs=a.pdl_pairs)


def run_info() -> dict:
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
                triton=getattr(triton, "__version__", None), argv=sys.argv)
    try:
        from . import __version__ as kv_version
        info["kvfuse"] = kv_version
    except Exception:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", memory_GiB=round(props.total_memory / 2 ** 30, 1))
    return info


class _NoBar:
    def update(self, k=1):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass

    @staticmethod
    def write(text):
        print(text, file=sys.stderr)


def _progress_bar(total: int, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(total=total, unit="point", dynamic_ncols=True)
        except Exception:
            pass
    return _NoBar()


def measure_device(quick: bool, log=print) -> dict:
    dev = {}
    try:
        dev.update(measure_copy_bandwidth(reps=5 if quick else 10))
    except Exception as e:
        dev["copy_error"] = _short(e)
        recover_cuda()
    try:
        dev.update(measure_launch_floor(reps=20 if quick else 50))
    except Exception as e:
        dev["floor_error"] = _short(e)
        recover_cuda()
    log(f"copy bandwidth: {_f(dev.get('copy_GBps'), '.0f')} GB/s (2 GiB device-to-device copy, read + written); "
        f"launch floor: {_f(dev.get('floor_us'), '.2f')} us (tiny Triton kernel, "
        f"{dev.get('floor_launches_per_graph', '-')} launches per CUDA graph)")
    for key in ("copy_error", "floor_error"):
        if key in dev:
            log(f"  {key}: {dev[key]}")
    return dev


def write_outputs(cfg: Config, report: dict, records, text: str, dev: dict, log=print) -> None:
    out = cfg.out or os.environ.get("OUT") or "kvfuse-bench"
    try:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, OUT_NAME + ".json"), report)
        with open(os.path.join(out, OUT_NAME + ".txt"), "w") as f:
            f.write(text + "\n")
        log(f"wrote {os.path.join(out, OUT_NAME + '.json')} and .txt")
    except Exception as e:
        log(f"could not write the JSON/text report under {out}: {_short(e)}")
    if cfg.plot:
        try:
            plot_results(records, os.path.join(out, OUT_NAME + ".png"), dev.get("copy_GBps"), dev.get("floor_us"))
            log(f"wrote {os.path.join(out, OUT_NAME + '.png')}")
        except Exception as e:
            log(f"no plot: {_short(e)}")


def run_on_device(cfg: Config, device="cuda", timer=None, measure=measure_device, **suite_kwargs) -> int:
    """The whole run: device ceilings, the suite, the report. ``timer``/``measure`` (and run_suite's
    keyword arguments) are injectable so that the flow is tested without a GPU."""
    t_start = time.perf_counter()
    info = run_info()
    print(f"kvfuse bench on {info.get('device')} ({info.get('sm_count')} SMs): torch {info['torch']} "
          f"(CUDA {info['torch_cuda']}), triton {info['triton']}, python {info['python']}, {info['date']}")
    print(f"workloads {','.join(cfg.workloads)}; n {','.join(map(str, cfg.sizes))}; peers {','.join(cfg.peers)}; "
          f"reference/compile only for n*heads <= {cfg.peer_max_n}; {'cold' if cfg.cold_l2 else 'warm'} L2; "
          f"{cfg.slots} slots; {cfg.regime} regime ({_regime_text(cfg.regime)})")
    dev = measure(cfg.quick)
    bar = _progress_bar(len(cfg.workloads) * len(cfg.sizes), cfg.progress)
    if timer is None:
        timer = CudaTimer(graph_calls=10 if cfg.quick else 20, target_s=0.02 if cfg.quick else 0.05,
                          eager_target_s=0.015 if cfg.quick else 0.03, max_reps=15 if cfg.quick else 40)
    pdl_before = _backend.pdl_enabled()
    try:
        _backend.set_pdl(cfg.pdl)
        records = run_suite(cfg, device, timer, dev.get("copy_GBps"), dev.get("floor_us"),
                            progress=bar, log=bar.write, **suite_kwargs)
        pairs = measure_pdl_pairs(cfg, device, timer) if cfg.pdl_pairs else []
    finally:
        bar.close()
        _backend.set_pdl(pdl_before)
    targets = check_targets(records, pdl=cfg.pdl)
    elapsed = time.perf_counter() - t_start
    summary = (f"copy bandwidth {_f(dev.get('copy_GBps'), '.0f')} GB/s; launch floor {_f(dev.get('floor_us'), '.2f')}"
               f" us; total {elapsed:.0f} s. GPU us: per call, CUDA-graph replay ('graph') or CUDA events around "
               f"eager calls ('events', for host-synchronizing peers); vs fused = this peer's GPU time / fused's.")
    text = "\n".join([format_table(records), "", format_summary(records), "", summary, "",
                      format_targets(targets)] + (["", format_pdl_pairs(pairs)] if pairs else []))
    print(text)
    report = build_report(cfg, info, dev, records, targets, elapsed, pairs)
    write_outputs(cfg, report, records, text, dev)
    if "fused" in cfg.peers and not any(r.peer == "fused" and r.status == "ok" for r in records):
        print("no fused measurement succeeded")
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kvfuse bench [options]``; returns the exit status (0 without CUDA: nothing to measure)."""
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        print(f"kvfuse bench: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 0
    return run_on_device(cfg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
