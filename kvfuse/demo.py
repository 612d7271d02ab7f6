"""``kvfuse demo``: a KV-cache format explorer on a realistic MLA batch.

Every preset of :mod:`kvfuse.formats` (the 128-d index formats with and without the Hadamard) gets
the batch through the call site it serves, one call of
:func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache` into a paged cache with shuffled slots;
:func:`kvfuse.load_paged_kv_cache` reads it back, and each row of the table gives bytes/token
against bf16, the relative error against the cast's bf16 input (``out_stage="transform"`` of the
same call) and, for index formats, recall@k of the top-k scores with Q quantized as the indexer does.

``--model NAME`` runs a model's own call sites (:mod:`kvfuse.mla`, :mod:`kvfuse.models`); ``--input``
takes K activations from a .pt / .safetensors file (which tensor each call site took, and how it
was reshaped, is printed); ``--gqa NAME`` shows the GQA page (every cache format of
:mod:`kvfuse.gqa_formats` written by :func:`kvfuse.fused_qk_norm_rope_store_kv` and read back by
:func:`kvfuse.load_gqa_kv_cache`: bytes per token, error against the bf16 and fp64 chains, attention
recall@k; then each numerics profile's accuracy against an fp64 chain, :mod:`kvfuse.numerics_accuracy`,
on the CPU reference backend). A recall@k with k >= the keys is flagged trivial, not reported. Outputs:
the table, ``results.csv`` and ``kv_formats.png`` (``gqa_results.csv`` and ``gqa_formats.png``) under
``--out``, which is checked before any work. CUDA when present, else the CPU reference chain
(``TRITON_INTERPRET=1 kvfuse demo --backend triton`` runs the kernel in Triton's interpreter). The
docs/guide.md ("The demo, the benchmark and CI") describes a run.
"""
from __future__ import annotations

import argparse
import importlib
import csv
import math
import os
import sys
import tempfile
import textwrap
import time
from typing import Dict, List, Optional

import torch

import kvfuse
from kvfuse import formats as F
from kvfuse import gqa_formats as GF
from kvfuse import mla
from kvfuse import models as M
from kvfuse import reference as R
from kvfuse.args import CastArgs, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs
from kvfuse.numerics_accuracy import exact_chain, profile_accuracy
from kvfuse.rope import cos_sin_cache

EXTRA_HINT = "pip install 'kvfuse[demo]'"


def missing_modules(*names: str) -> list:
    """The modules of ``names`` that cannot be imported (optional extras that are not installed)."""
    out = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


ROPE_DIM = 64
MAIN_KEYS = ("kv", "k", "latent", "kv_c", "key")
INDEX_KEYS = ("index_k", "indexer_k", "idx_k")
PNG_NAME = "kv_formats.png"
CSV_NAME = "results.csv"
TRIVIAL = "trivial"         # a recall@k with k >= the keys: 1 whatever the cache holds, not a result
COLUMNS = ("format", "layout", "head_dim", "hadamard", "bytes/token", "vs_bf16", "rel_err", "rel_err_q", "recall", "k",
           "read_by")


# --------------------------------------------------------------------------- data
def synthetic_batch(n: int, seed: int) -> Dict[str, torch.Tensor]:
    """K activations with the statistics that make KV quantization hard: per-token scale spread
    (log-normal), a few outlier channels (x10..x60) and a smooth low-rank part."""
    g = torch.Generator().manual_seed(seed)

    def acts(d, n_out):
        base = torch.randn(n, d, generator=g)
        low = torch.randn(n, 8, generator=g) @ torch.randn(8, d, generator=g) * 0.5
        tok_scale = torch.exp(0.5 * torch.randn(n, 1, generator=g))
        ch_scale = torch.ones(d)
        ch = torch.randperm(d, generator=g)[:n_out]
        ch_scale[ch] = 10.0 + 50.0 * torch.rand(n_out, generator=g)
        return ((base + low) * ch_scale * tok_scale).to(torch.bfloat16)

    return {"kv": acts(576, 6), "index_k": acts(128, 3)}


def load_input(path: str) -> Dict[str, torch.Tensor]:
    """The floating-point tensors of a .safetensors or .pt file (a tensor, or a dict of tensors),
    as stored: name -> tensor (a bare tensor is named ``k``)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input: no such file {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        obj = load_file(path)
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, torch.Tensor):
        obj = {"k": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"--input: expected a tensor or a dict of tensors, got {type(obj).__name__}")
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1}
    if not tensors:
        raise ValueError(f"--input: {path!r} holds no floating-point tensor")
    return tensors


def choose_inputs(tensors: Dict[str, torch.Tensor], input_keys=None):
    """Which tensor feeds the main call sites and which the index ones: {"main": (name, why),
    "index": (name, why)}. ``input_keys``: --input-key values, ``NAME`` (every call site) or
    ``main=NAME`` / ``index=NAME``; otherwise the conventional names (MAIN_KEYS, INDEX_KEYS), else
    the first tensor by name (and the index sites take the main tensor)."""
    chosen = {}
    for spec in input_keys or ():
        role, _, name = spec.rpartition("=") if spec.split("=", 1)[0] in ("main", "index") else ("", "", spec)
        if name not in tensors:
            have = ", ".join(map(repr, sorted(tensors)))
            raise ValueError(f"--input-key: no tensor {name!r} in the file (it has: {have})")
        for r in ((role,) if role else ("main", "index")):
            chosen[r] = (name, "--input-key")
    if "main" not in chosen:
        name = next((k for k in MAIN_KEYS if k in tensors), None)
        if len(tensors) == 1:
            chosen["main"] = (next(iter(tensors)), "the only tensor")
        elif name is not None:
            chosen["main"] = (name, "by name")
        else:
            chosen["main"] = (sorted(tensors)[0], f"first by name of {len(tensors)}, none named "
                                                  f"{'/'.join(MAIN_KEYS)}; --input-key NAME picks another")
    if "index" not in chosen:
        name = next((k for k in INDEX_KEYS if k in tensors), None)
        chosen["index"] = (name, "by name") if name is not None else (chosen["main"][0], "the main tensor")
    return chosen


def to_bf16(name: str, v: torch.Tensor):
    """[..., D] -> bf16 [rows, D], and a one-line warning (or None) when the cast overflows to inf
    or the data is all zeros. NaN in the file is a ValueError."""
    if torch.isnan(v).any():
        raise ValueError(f"--input: tensor {name!r} holds NaN values")
    x = v.reshape(-1, v.shape[-1]).to(torch.bfloat16)
    inf = torch.isinf(x)
    if inf.any():
        in_file = int(torch.isinf(v).sum())
        over = int(inf.sum()) - in_file
        what = ", ".join(p for p in (f"{over} beyond bf16's max {torch.finfo(torch.bfloat16).max:.3g}" if over else "",
                                     f"{in_file} already inf in the file ({v.dtype})" if in_file else "") if p)
        return x, (f"warning: --input tensor {name!r}: {int(inf.sum())} of {x.numel()} values are inf in bf16 "
                   f"({what}); its errors are NaN, not measurements")
    if not x.any():
        why = "" if not v.any() else f" (the file's {v.dtype} values underflow bf16)"
        return x, (f"warning: --input tensor {name!r} is all zeros in bf16{why}; its errors are undefined (NaN), "
                   f"not lossless")
    return x, None


def describe_fit(d: int, dim: int) -> str:
    """How :func:`fit_width` makes a [rows, d] tensor ``dim`` wide."""
    if d == dim:
        return "as is"
    if d > dim and d % dim == 0:
        return f"each row split into {d // dim}"
    if d > dim:
        return f"first {dim} of {d} columns"
    return f"columns tiled {math.ceil(dim / d)}x" + (f" and cut to {dim}" if dim % d else "")


def prepare_input(path: str, widths: Dict[str, List[int]], n: int, input_keys=None):
    """--input: the tensors the call sites take ({"kv": main, "index_k": index}, bf16 [rows, D]), a
    one-line report of what was used and how it was reshaped (``widths``: role -> the head dims the
    role's call sites take; n: the rows they take at most) and the warnings (one line each)."""
    tensors = load_input(path)
    chosen = choose_inputs(tensors, input_keys)
    out, parts, warnings, done = {}, [], [], {}
    for role, key in (("main", "kv"), ("index", "index_k")):
        name, why = chosen[role]
        if name not in done:
            done[name] = to_bf16(name, tensors[name])
            if done[name][1]:
                warnings.append(done[name][1])
        x = out[key] = done[name][0]
        v = tensors[name]
        desc = f"{role} = {name!r} {list(v.shape)} {str(v.dtype).replace('torch.', '')} ({why})"
        if v.dim() != 2:
            desc += f" as {list(x.shape)}"
        fits = [f"-> {w}: {describe_fit(x.shape[1], w)}, {min(n, fit_width(x[:1], w).shape[0] * x.shape[0])} rows"
                for w in widths.get(role, ())]
        parts.append(desc + (": " + "; ".join(fits) if fits else ": unused"))
    unused = [k for k in tensors if k not in done]
    if unused:
        parts.append("unused: " + ", ".join(map(repr, unused)))
    return out, f"input {os.path.basename(path)}: " + " | ".join(parts), warnings


def _pick(tensors: Dict[str, torch.Tensor], keys) -> torch.Tensor:
    for k in keys:
        if k in tensors:
            return tensors[k]
    return tensors[sorted(tensors)[0]]


def fit_width(x: torch.Tensor, dim: int) -> torch.Tensor:
    """[rows, D] -> [rows', dim]: the same, more rows (D a multiple of dim), the first columns
    (D > dim) or repeated columns (D < dim)."""
    d = x.shape[-1]
    if d == dim:
        return x
    if d > dim and d % dim == 0:
        return x.reshape(-1, dim)
    if d > dim:
        return x[:, :dim]
    return x.repeat(1, math.ceil(dim / d))[:, :dim]


# --------------------------------------------------------------------------- one format
def _slots(n: int, block_size: int, seed: int, device):
    num_blocks = max(1, math.ceil(n / block_size))
    g = torch.Generator().manual_seed(seed)
    return num_blocks, torch.randperm(num_blocks * block_size, generator=g)[:n].to(device)


def write_and_read(fmt: F.KVCacheFormat, x: torch.Tensor, hadamard: bool, block_size: int, seed: int):
    """The call site of ``fmt`` on x [n, head_dim] (bf16, on its device): one fused write into a
    paged cache. Returns (transform output y [n, head_dim], dequantized read-back [n, head_dim])."""
    n, dev = x.shape[0], x.device
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 4096, (n,), generator=g).to(dev)
    cos_sin = cos_sin_cache(4096, ROPE_DIM, device=dev)
    num_blocks, slots = _slots(n, block_size, seed + 2, dev)
    cache = fmt.allocate(num_blocks, block_size, device=dev)
    y = torch.empty_like(x)
    norm_w = (1.0 + 0.1 * torch.randn(fmt.head_dim, generator=g)).to(torch.bfloat16).to(dev)
    norm = NormArgs(norm_w)
    if fmt.bf16_tail and fmt.token_interleaved:
        # FLASHMLA_V32: RMSNorm covers the latent only (V3.2's kv_a_layernorm), k_pe is rotated
        q_dim = fmt.quant_dim
        latent = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x[:, :q_dim].contiguous(), NormArgs(norm_w[:q_dim]))
        x = torch.cat([latent, x[:, q_dim:]], dim=-1)
        norm = None
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        x, norm_args=norm, rope_args=RopeArgs(positions, cos_sin, ROPE_DIM, True),
        hadamard_args=HadamardArgs(1.0 / math.sqrt(fmt.head_dim)) if hadamard else None,
        cast_args=CastArgs.from_cache_format(fmt),
        out_args=KVCacheOutArgs(cache, slots, out=y, out_stage="transform", layout=fmt))
    back = kvfuse.load_paged_kv_cache(cache, slots, fmt)[:, 0]
    return y, back


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||_F / ||exact||_F; NaN when ``exact`` is all zeros or not finite (nothing to
    measure against: such data is not "lossless")."""
    a, e = approx.double(), exact.double()
    ref = torch.linalg.vector_norm(e)
    if not bool(torch.isfinite(ref)) or float(ref) == 0.0:
        return math.nan
    return float(torch.linalg.vector_norm(a - e) / ref)


def score(label: str, fmt: F.KVCacheFormat, hadamard: bool, y: torch.Tensor, back: torch.Tensor) -> dict:
    """A table row: sizes and the read-back's relative error against the transform output y, over
    the whole record (``rel_err``) and over the quantized dims only (``rel_err_q``: without the
    exact bf16 tail of the FlashMLA formats; the same as rel_err for the others)."""
    qd = fmt.quant_dim
    return {"format": label, "layout": "token" if fmt.token_interleaved else "block",
            "head_dim": fmt.head_dim, "hadamard": hadamard, "bytes/token": fmt.bytes_per_token,
            "vs_bf16": 2 * fmt.head_dim / fmt.bytes_per_token, "rel_err": relative_error(back, y),
            "rel_err_q": relative_error(back[:, :qd], y[:, :qd]), "bf16_tail": fmt.bf16_tail, "recall": None, "k": None,
            "trivial": False}


def quantized_queries(fmt: F.KVCacheFormat, q: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """The indexer's Q path in fmt: Hadamard (if the K side uses it) and the same cast, dequantized."""
    had = HadamardArgs(1.0 / math.sqrt(fmt.head_dim)) if hadamard else None
    cast = CastArgs.from_cache_format(fmt)
    if cast is None:
        return kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(q, hadamard_args=had) if had else q
    qq, sf = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(q, hadamard_args=had, cast_args=cast)
    return R.dequantize(qq, sf, cast.cast_fmt, cast.num_per_channels, cast.sf_format)


def recall_at_k(scores: torch.Tensor, ref_scores: torch.Tensor, k: int) -> float:
    """Mean over queries of |top-k(scores) & top-k(ref_scores)| / k."""
    top = scores.topk(k, dim=-1).indices
    ref = ref_scores.topk(k, dim=-1).indices
    hit = (top[:, :, None] == ref[:, None, :]).any(-1).sum(-1)
    return float(hit.double().mean() / k)


# --------------------------------------------------------------------------- a model's call sites
def model_sites(cfg: mla.MLAConfig):
    """(site, format, hadamard) of the cache-writing call sites of ``cfg``: main, index, compressed."""
    sites = [("main", cfg.main_format, False)]
    if cfg.index_format is not None:
        sites.append(("index", cfg.index_format, cfg.index_hadamard))
    if cfg.compressed_format is not None:
        sites.append(("compressed", cfg.compressed_format, False))
    return sites


def _model_inputs(cfg: mla.MLAConfig, site: str, fmt: F.KVCacheFormat, x: torch.Tensor, seed: int):
    """Positions, cos/sin table and norm weight (and LayerNorm bias) of one call site."""
    n, dev = x.shape[0], x.device
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 4096, (n,), generator=g).to(dev)
    rotary = cfg.qk_rope_head_dim if site == "main" else cfg.index_rope_head_dim
    cos_sin = cos_sin_cache(4096, rotary, device=dev)
    norm_dim = cfg.kv_lora_rank if site == "main" and cfg.splits_k_pe(fmt) else fmt.head_dim
    w = (1.0 + 0.1 * torch.randn(norm_dim, generator=g)).to(torch.bfloat16).to(dev)
    b = None
    if site == "index" and cfg.index_norm_kind == "layer":
        b = (0.1 * torch.randn(fmt.head_dim, generator=g)).to(torch.bfloat16).to(dev)
    return positions, cos_sin, w, b


def model_write_and_read(cfg: mla.MLAConfig, site: str, x: torch.Tensor, block_size: int, seed: int):
    """The model's call site ``site`` ("main", "index" or "compressed") on x [n, head_dim]: its
    kvfuse.mla call writing a paged cache. Returns (transform output y, dequantized read-back,
    y without the Hadamard: the bf16 keys the recall is measured against)."""
    fmt = dict((s, f) for s, f, _ in model_sites(cfg))[site]
    n, dev = x.shape[0], x.device
    positions, cos_sin, w, b = _model_inputs(cfg, site, fmt, x, seed)
    num_blocks, slots = _slots(n, block_size, seed + 2, dev)
    cache = fmt.allocate(num_blocks, block_size, device=dev)
    y = torch.empty_like(x)
    plain = None
    if site == "main":
        mla.write_main_cache(cfg, x, positions, cos_sin, w, cache, slots, out=y, out_stage="transform")
    elif site == "index":
        mla.write_indexer_k(cfg, x, positions, cos_sin, w, cache, slots, norm_bias=b, out=y, out_stage="transform")
        plain = y if not cfg.index_hadamard else kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, norm_args=cfg.index_norm_args(w, b), rope_args=cfg.index_rope_args(positions, cos_sin))
    else:
        latent = mla.write_compressed_kv(cfg, x, positions, cos_sin, w, cache, slots)
        y = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(latent,
                                                               rope_args=cfg.index_rope_args(positions, cos_sin))
    back = kvfuse.load_paged_kv_cache(cache, slots, fmt)[:, 0]
    return y, back, plain


def model_quantized_queries(cfg: mla.MLAConfig, q: torch.Tensor) -> torch.Tensor:
    """Queries [m, index_head_dim] through the model's ``quantize_indexer_q`` (its Hadamard and
    cast; at position 0, where RoPE is the identity), dequantized."""
    pos = torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    cos_sin = cos_sin_cache(1, cfg.index_rope_head_dim, device=q.device)
    qq, sf = mla.quantize_indexer_q(cfg, q[:, None, :], pos, cos_sin)
    if sf is None:
        return qq[:, 0]
    fmt = cfg.index_format
    return R.dequantize(qq, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)[:, 0]


def explore_model(cfg: mla.MLAConfig, tensors: Dict[str, torch.Tensor], n: int, block_size: int, seed: int,
                  topk: int, num_queries: int, device) -> List[dict]:
    """One row per call site of ``cfg`` (see :func:`model_sites`), as :func:`explore` scores them."""
    main = _pick(tensors, MAIN_KEYS)
    index = next((tensors[k] for k in INDEX_KEYS if k in tensors), main)
    g = torch.Generator().manual_seed(seed + 3)
    rows = []
    for site, fmt, had in model_sites(cfg):
        src = main if site == "main" else index
        x = fit_width(src, fmt.head_dim)[:n].contiguous().to(device)
        y, back, plain = model_write_and_read(cfg, site, x, block_size, seed)
        row = score(f"{site}:{fmt.name}", fmt, had, y, back)
        if site == "index":
            queries = torch.randn(num_queries, fmt.head_dim, generator=g).to(torch.bfloat16).to(device)
            k = min(topk, x.shape[0])
            ref_scores = queries.float() @ plain.float().T
            scores = model_quantized_queries(cfg, queries).float() @ back.float().T
            row["recall"] = recall_at_k(scores, ref_scores, k) if math.isfinite(row["rel_err"]) else math.nan
            row["k"] = k
            row["trivial"] = k >= x.shape[0]      # every key in the top-k: recall 1 by construction
        rows.append(row)
    return rows


def describe_model(cfg: mla.MLAConfig) -> str:
    """One line: the model's RoPE styles and offsets, norms, Hadamard and formats."""
    def style(neox: bool) -> str:
        return "NEOX" if neox else "GPT-J"

    parts = [f"Q {cfg.num_heads} x {cfg.qk_head_dim} RoPE {cfg.qk_rope_head_dim} {style(cfg.rope_is_neox)} at "
             f"{cfg.rope_offset}" + (" (weightless RMSNorm)" if cfg.q_norm else ""),
             f"main {cfg.main_format.name} (RMSNorm{' on the latent' if cfg.splits_k_pe() else ''})"]
    if cfg.index_format is not None:
        off = cfg.index_head_dim - cfg.index_rope_head_dim if cfg.index_rope_offset is None else cfg.index_rope_offset
        parts.append(f"index {cfg.index_format.name} ({'LayerNorm' if cfg.index_norm_kind == 'layer' else 'RMSNorm'}, "
                     f"RoPE {cfg.index_rope_head_dim} {style(cfg.index_rope_is_neox)} at {off}"
                     f"{', Hadamard' if cfg.index_hadamard else ''})")
    if cfg.compressed_format is not None:
        parts.append(f"compressed {cfg.compressed_format.name}")
    return f"model {cfg.name}: " + "; ".join(parts)


# --------------------------------------------------------------------------- the explorer
def site_widths(cfg: Optional[mla.MLAConfig] = None) -> Dict[str, List[int]]:
    """"main" / "index" -> the head dims of the call sites that take the main / index input: the
    presets' (index: the 128-d formats) or, with a model configuration, its call sites'."""
    pairs = ([("main" if site == "main" else "index", fmt) for site, fmt, _ in model_sites(cfg)] if cfg is not None
             else [("index" if fmt.head_dim == 128 else "main", fmt) for fmt, _ in configurations()])
    out: Dict[str, List[int]] = {}
    for role, fmt in pairs:
        if fmt.head_dim not in out.setdefault(role, []):
            out[role].append(fmt.head_dim)
    return out


def configurations():
    """(format, hadamard) pairs: every preset, and the 128-d ones with Hadamard too."""
    out = []
    for fmt in F.PRESETS.values():
        out.append((fmt, False))
        if fmt.head_dim == 128:
            out.append((fmt, True))
    return out


def explore(tensors: Dict[str, torch.Tensor], n: int, block_size: int, seed: int, topk: int, num_queries: int,
            device, progress: Optional[bool] = None) -> List[dict]:
    try:
        from tqdm import tqdm
    except ImportError:  # no [demo] extra: no progress bar (main says so)
        def tqdm(it, **_):
            return it

    main = _pick(tensors, MAIN_KEYS)
    index = next((tensors[k] for k in INDEX_KEYS if k in tensors), main)
    g = torch.Generator().manual_seed(seed + 3)
    queries = torch.randn(num_queries, 128, generator=g).to(torch.bfloat16).to(device)
    rows = []
    ref_scores = {}
    for fmt, had in tqdm(configurations(), desc="kvfuse demo", unit="format", file=sys.stderr,
                         disable=(not progress) if progress is not None else None):
        src = index if fmt.head_dim == 128 else main
        x = fit_width(src, fmt.head_dim)[:n].contiguous().to(device)
        y, back = write_and_read(fmt, x, had, block_size, seed)
        row = score(fmt.name, fmt, had, y, back)
        if fmt.head_dim == 128:
            k = min(topk, x.shape[0])
            if x.shape[0] not in ref_scores:
                # bf16 truth: the same keys without rotation or quantization (Hadamard is orthonormal)
                y_plain, _ = (y, None) if not had else write_and_read(F.INDEX_BF16, x, False, block_size, seed)
                ref_scores[x.shape[0]] = queries.float() @ y_plain.float().T
            scores = quantized_queries(fmt, queries, had).float() @ back.float().T
            # zero or non-finite keys: every score ties (or is NaN), the top-k is arbitrary
            row["recall"] = recall_at_k(scores, ref_scores[x.shape[0]], k) if math.isfinite(row["rel_err"]) \
                else math.nan
            row["k"] = k
            row["trivial"] = k >= x.shape[0]      # every key in the top-k: recall 1 by construction
        rows.append(row)
    return rows


def recall_label(rows: List[dict]) -> str:
    """``recall@K`` with the k the rows used (--topk clamped to the keys there are), ``recall@k``
    when the rows used different ks."""
    ks = sorted({r["k"] for r in rows if r.get("k") is not None})
    return f"recall@{ks[0]}" if len(ks) == 1 else "recall@k"


def format_table(rows: List[dict], topk: Optional[int] = None) -> str:
    """The table; ``topk``: the --topk asked for (a note says when fewer keys made k smaller)."""
    fw = max([16] + [len(r["format"]) for r in rows])
    head = f"{'format':<{fw}} {'layout':<6} {'dim':>4} {'hadamard':>8} {'bytes/token':>11} {'vs bf16':>8} " \
           f"{'rel.err':>9} {'rel.err(q)':>10} {recall_label(rows):>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = TRIVIAL + "*" if r.get("trivial") else "-" if r["recall"] is None else f"{r['recall']:.4f}"
        lines.append(f"{r['format']:<{fw}} {r['layout']:<6} {r['head_dim']:>4} {('yes' if r['hadamard'] else 'no'):>8} "
                     f"{r['bytes/token']:>11} {r['vs_bf16']:>7.2f}x {r['rel_err']:>9.2e} {r['rel_err_q']:>10.2e} {rec:>10}")
    tails = {r["format"]: r["bf16_tail"] for r in rows if r.get("bf16_tail")}
    lines += ["", "rel.err: over the whole record; rel.err(q): over the quantized dims only"
              + (" (" + ", ".join(f"{name} keeps its last {t} dims in exact bf16" for name, t in tails.items()) + ")"
                 if tails else "")]
    ks = sorted({r["k"] for r in rows if r.get("k") is not None})
    if topk is not None and ks and ks != [topk]:
        lines.append(f"recall: --topk {topk} asked for, k = {', '.join(map(str, ks))} used (the keys there are)")
    if any(r.get("trivial") for r in rows):
        lines.append(trivial_note(ks[0], ks[0]) if len(ks) == 1 else
                     f"* {TRIVIAL}: recall@k with k >= the keys is 1 whatever the cache holds, so it is not reported")
    readers = [(name, F.READERS[name]) for name in dict.fromkeys(r["format"] for r in rows) if name in F.READERS]
    if readers:
        lines += ["", "read by:"] + [f"  - {name}: {who}" for name, who in readers]
    return "\n".join(lines)


def write_csv(rows: List[dict], path: str) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([r["format"], r["layout"], r["head_dim"], int(r["hadamard"]), r["bytes/token"],
                        f"{r['vs_bf16']:.4f}", f"{r['rel_err']:.6e}", f"{r['rel_err_q']:.6e}",
                        TRIVIAL if r.get("trivial") else "" if r["recall"] is None else f"{r['recall']:.6f}",
                        "" if r.get("k") is None else r["k"],
                        F.READERS.get(r["format"], "")])


def _spread(values, min_gap):
    """Label positions near ``values`` (sorted order kept) at least ``min_gap`` apart."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    pos = [0.0] * len(values)
    last = None
    for i in order:
        p = values[i] if last is None else max(values[i], last + min_gap)
        pos[i] = last = p
    shift = (sum(pos) - sum(values)) / max(len(values), 1)   # re-centre the stack on the points
    return [p - shift for p in pos]


def _clusters(xs, ratio: float = 1.2) -> List[List[int]]:
    """Indices of xs grouped into runs of values within ``ratio`` of their neighbour (log axis)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out: List[List[int]] = []
    for i in order:
        if out and xs[i] <= xs[out[-1][-1]] * ratio:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _short(r) -> str:
    return r["format"].replace("INDEX_", "").replace("FLASHMLA_", "FlashMLA ") + (" +H" if r["hadamard"] else "")


def _plain_log_ticks(axis, lo: float, hi: float, steps=(1, 2, 5)) -> None:
    """Log-axis major ticks at round numbers in [lo, hi] labelled as plain numbers (100, 200, 0.05),
    minor ticks unlabelled."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    ticks = [k * 10.0 ** e for e in range(-8, 8) for k in steps if lo <= k * 10.0 ** e <= hi]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _error_axes(ax, xs, right_room: float, lo: float, hi: float, xlabel: str, ylabel: str) -> None:
    """The error panel's log axes: x from the sizes ``xs`` (``right_room`` times the largest leaves room for the
    labels), y [lo, hi], plain-number ticks, grid."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    if xs:
        ax.set_xlim(min(xs) / 1.25, max(xs) * right_room)
        _plain_log_ticks(ax.xaxis, min(xs) / 1.25, max(xs) * right_room, (1, 2, 3, 5, 7))
    ax.set_ylim(lo, hi)
    _plain_log_ticks(ax.yaxis, lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title("error vs size", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def _recall_panel(ax, points, right_room: float, xlabel: str, k, title: str) -> None:
    """recall@k vs bytes: ``points`` (bytes, recall, colour, marker, label), labels spread right of each size."""
    xs = [p[0] for p in points]
    for idx in _clusters(xs):
        ys = _spread([points[i][1] for i in idx], 0.035)
        ys = [y - max(0.0, max(ys) - 1.015) for y in ys]        # no label above the top edge
        right = max(xs[i] for i in idx)
        for i, ly in zip(idx, ys):
            x, recall, c, m, label = points[i]
            ax.scatter(x, recall, color=c, marker=m, s=46, zorder=3)
            ax.annotate(f"{label} {recall:.3f}", (x, recall), xytext=(right * 1.06, ly), fontsize=7, va="center",
                        arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5"), annotation_clip=False)
    ax.set_xscale("log")
    ax.set_xlim(min(xs) / 1.2, max(xs) * right_room)
    _plain_log_ticks(ax.xaxis, min(xs) / 1.2, max(xs) * right_room, (1, 2, 3, 5, 7))
    ax.set_ylim(max(0.0, min(p[1] for p in points) - 0.08), 1.03)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"recall@{k} of q.k top-{k} vs bf16")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, title: str, path: str) -> None:
    import matplotlib.pyplot as plt
    fig.suptitle(textwrap.fill(title, int(11 * fig.get_figwidth())), fontsize=10)      # ~11 characters an inch
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot(rows: List[dict], path: str, title: str) -> None:
    """Two panels: relative error vs bytes/token (every format; the quantized-dims error too where
    a bf16 tail dilutes it; lossless formats on the bottom edge, marked as such; rows whose error is
    NaN left out and named), and recall@k vs bytes/token (index formats)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    def style(r):
        if r["head_dim"] != 128:
            return "tab:blue", "s"
        return ("tab:red", "^") if r["hadamard"] else ("tab:orange", "o")

    idx_rows = [r for r in rows if r["recall"] is not None and math.isfinite(r["recall"]) and not r.get("trivial")]
    if idx_rows:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    else:       # no recall measured (no index format, or a trivial one): the error panel alone
        fig, ax = plt.subplots(1, 1, figsize=(8.5, 5.5), dpi=110)
    shown = [r for r in rows if math.isfinite(r["rel_err"])]
    missing = [r for r in rows if not math.isfinite(r["rel_err"])]
    measured = [e for r in shown for e in (r["rel_err"], r["rel_err_q"]) if e > 0]
    lo, hi = (min(measured) / 2.5, max(measured) * 2) if measured else (1e-3, 1e-1)
    errs = [r["rel_err"] if r["rel_err"] > 0 else lo for r in shown]     # lossless: on the bottom edge
    xs = [r["bytes/token"] for r in shown]
    # labels: one column right of each bytes/token value, spread in log10(error)
    for idx in _clusters(xs):
        ys = _spread([math.log10(errs[i]) for i in idx], 0.09)
        lift = max(0.0, math.log10(lo) + 0.06 - min(ys))        # no label below the bottom edge
        ys = [y + lift for y in ys]
        right = max(xs[i] for i in idx)
        for i, ly in zip(idx, ys):
            r = shown[i]
            c, m = style(r)
            if r["rel_err"] == 0:
                ax.scatter(xs[i], lo, marker="v", s=70, facecolors="white", edgecolors=c, linewidths=1.5, zorder=4,
                           clip_on=False)
            else:
                ax.scatter(xs[i], errs[i], c=c, marker=m, s=46, zorder=3, clip_on=False)
            if r["bf16_tail"] and r["rel_err_q"] > r["rel_err"] > 0:
                ax.plot([xs[i], xs[i]], [r["rel_err"], r["rel_err_q"]], color=c, lw=0.8, ls=":", zorder=2)
                ax.scatter(xs[i], r["rel_err_q"], marker=m, s=46, facecolors="white", edgecolors=c, zorder=3)
            text = _short(r) + (" (lossless)" if r["rel_err"] == 0 else "")
            ax.annotate(text, (xs[i], errs[i]), xytext=(right * 1.06, 10 ** ly), fontsize=7, va="center",
                        arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5"), annotation_clip=False)
    _error_axes(ax, xs, 1.9, lo, hi, "bytes per token (cache record)",
                "relative error of the read-back  ||deq - x|| / ||x||")
    drawn = {style(r) for r in shown if r["rel_err"] != 0}
    handles = [Line2D([], [], color=c, marker=m, ls="", label=l) for c, m, l in
               (("tab:blue", "s", "main / FlashMLA (512, 576)"), ("tab:orange", "o", "index (128)"),
                ("tab:red", "^", "index (128) + Hadamard")) if (c, m) in drawn]
    if any(r["bf16_tail"] and r["rel_err_q"] > r["rel_err"] > 0 for r in shown):
        handles.append(Line2D([], [], color="tab:blue", marker="s", markerfacecolor="white", ls=":",
                              label="quantized dims only (without the bf16 tail)"))
    if any(r["rel_err"] == 0 for r in shown):
        handles.append(Line2D([], [], color="0.3", marker="v", markerfacecolor="white", ls="",
                              label="lossless (0 error), on the bottom edge"))
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    if missing:
        ax.text(0.01, 0.99, "not plotted, error NaN (zero or non-finite data): "
                + ", ".join(dict.fromkeys(_short(r) for r in missing)), transform=ax.transAxes, fontsize=7,
                va="top", wrap=True)

    trivial = [r for r in rows if r.get("trivial")]
    if trivial:
        ax.text(0.01, 0.01, f"recall@{trivial[0]['k']} not drawn: trivial (k >= the keys)",
                transform=ax.transAxes, fontsize=7, va="bottom")
    if idx_rows:
        ks = sorted({r["k"] for r in idx_rows})
        k = ks[0] if len(ks) == 1 else "k"
        _recall_panel(ax2, [(r["bytes/token"], r["recall"], *style(r), _short(r)) for r in idx_rows], 2.2,
                      "bytes per token (index cache record)", k, "indexer top-k recall (Q quantized like K)")
    _save(fig, title, path)


# --------------------------------------------------------------------------- the GQA page
GQA_CSV_NAME = "gqa_results.csv"
GQA_PNG_NAME = "gqa_formats.png"
GQA_COLUMNS = ("model", "format", "k_scale", "v_scale", "kv bytes/token/layer", "vs_bf16", "k_err_vs_bf16",
               "v_err_vs_bf16", "k_err_vs_fp64", "v_err_vs_fp64", "recall", "k")
E4M3_MAX = 448.0            # an NVFP4 group scale's largest value (e4m3)


def _gqa_batch(cfg: M.GQAConfig, n: int, seed: int, device):
    """A packed projection [n, qkv_width] (per-token scale spread, a few outlier channels in k and v), the
    model's q / k norm weights (raw: GQAConfig.norm_args maps them), positions and a cos/sin table."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.qkv_width, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    kv0 = cfg.num_heads * cfg.head_dim
    out_ch = kv0 + torch.randperm(2 * cfg.num_kv_heads * cfg.head_dim, generator=g)[:4 * cfg.num_kv_heads]
    x[:, out_ch] *= 10.0 + 20.0 * torch.rand(out_ch.numel(), generator=g)
    base = 0.0 if cfg.norm_weight_offset else 1.0
    weights = [(base + 0.1 * torch.randn(cfg.head_dim, generator=g)).to(torch.bfloat16).to(device) for _ in range(2)]
    positions = torch.randint(0, 4096, (n,), generator=g).to(device)
    return x.to(torch.bfloat16).to(device), weights, positions, cfg.cos_sin_cache(4096, device)


def static_scale(fmt: GF.GQACacheFormat, exact: torch.Tensor) -> Optional[torch.Tensor]:
    """The scale the caller gives a cache of ``fmt``, derived from the data it will hold: amax / qmax for a
    static per-tensor scale (fp8), amax / (6 * 448) for NVFP4's global decode scale (its group scales, e4m3,
    then span the data); None where the format takes none."""
    if not fmt.takes_static_scale:
        return None
    amax = float(exact.abs().max())
    bound = fmt.qmax * (E4M3_MAX if fmt.global_scale else 1.0)
    return torch.tensor([amax / bound if amax > 0 else 1.0], dtype=torch.float32, device=exact.device)


def _gqa_caches(fmt: GF.GQACacheFormat, blocks: int, block_size: int, heads: int, dim: int, device):
    """(code cache, scale cache or None) of ``fmt``: NHD [blocks, block_size, heads, dim / values a byte]."""
    shape = (blocks, block_size, heads, dim // fmt.values_per_element)
    codes = torch.zeros(shape, dtype=fmt.dtype_for(torch.bfloat16), device=device)
    scale_shape = fmt.scale_cache_shape(shape, dim)
    scales = None if scale_shape is None else torch.zeros(scale_shape, dtype=fmt.scale_dtype, device=device)
    return codes, scales


def attention_recall(q: torch.Tensor, keys: torch.Tensor, ref_keys: torch.Tensor, k: int) -> float:
    """recall@k of each query head's q . k scores over the cached keys: q [m, Hq, D], keys / ref_keys
    [n, Hkv, D] (query head h reads kv head h // (Hq / Hkv)); the top-k of ``keys`` against that of ``ref_keys``,
    averaged over queries and heads."""
    group = q.shape[1] // keys.shape[1]

    def scores(kk):
        kk = kk.float().repeat_interleave(group, dim=1)              # [n, Hq, D]
        return torch.einsum("mhd,nhd->hmn", q.float(), kk).flatten(0, 1)      # [Hq * m, n]

    return recall_at_k(scores(keys), scores(ref_keys), k)


def gqa_page(cfg: M.GQAConfig, n: int, block_size: int, seed: int, device, topk: int = 64,
             num_queries: int = 64) -> List[dict]:
    """One row per cache format of :data:`kvfuse.gqa_formats.PRESETS`, K and V in that format: one
    fused_qk_norm_rope_store_kv call (staged numerics) into NHD caches (tokens on shuffled slots), read back with
    load_gqa_kv_cache. Each row: bytes per token and layer (codes and stored scales), the relative error of K and
    V against the bf16 chain (the "auto" cache's K and V) and against an fp64 chain of the same inputs, and
    recall@k of the q . k scores of the first ``num_queries`` tokens' q (bf16, over all n cached keys) against
    the bf16 keys' top-k (``recall`` None and ``trivial`` True where k >= n: every key is in the top-k)."""
    qkv, (wq, wk), positions, cos_sin = _gqa_batch(cfg, n, seed, device)
    q, k, v = cfg.split_qkv(qkv)
    positions = cfg.text_positions(positions)        # an mRoPE model's text positions [3, n]
    qn, kn, rope, vn = cfg.norm_args(wq), cfg.norm_args(wk), cfg.rope_args(positions, cos_sin), cfg.v_norm_args()
    flat_pos = (positions if positions.dim() == 1 else positions[0]).cpu()
    k64 = exact_chain(k.cpu(), None if kn is None else kn.weight.cpu(), cfg.norm_eps, flat_pos, cos_sin.cpu(), cfg)
    v64 = v.cpu().double()
    if vn is not None:                                 # Gemma 4's weightless V-norm
        v64 = v64 * torch.rsqrt(v64.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    blocks = -(-n // block_size)
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(blocks * block_size, generator=g)[:n].to(device)
    kk = min(topk, n)
    trivial = kk >= n
    rows, bf16 = [], None
    presets = sorted(GF.PRESETS.values(), key=lambda f: f.name != "auto")     # "auto" first: the bf16 chain
    for fmt in presets:
        (kc, ksc), (vc, vsc) = (_gqa_caches(fmt, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, device)
                                for _ in range(2))
        ks = vs = None
        if bf16 is not None:
            ks, vs = static_scale(fmt, bf16[0]), static_scale(fmt, bf16[1])
        # q once, with the bf16 caches; the other formats write K and V alone (0 query heads)
        q_out = kvfuse.fused_qk_norm_rope_store_kv(q if bf16 is None else q[:, :0], k, v, kc, vc, slots, qn, kn,
                                                   rope, ks, vs, "NHD",
                                                   v_norm_args=vn, k_format=fmt.name, v_format=fmt.name,
                                                   k_scale_cache=ksc, v_scale_cache=vsc)
        k_back, v_back = kvfuse.load_gqa_kv_cache(kc, vc, slots, "NHD", ks, vs, fmt.name, fmt.name, ksc, vsc)
        if bf16 is None:
            bf16 = (k_back, v_back, q_out[:num_queries])
        row_bytes = cfg.num_kv_heads * 2 * fmt.row_bytes(cfg.head_dim)
        row = {"model": cfg.name, "format": fmt.name,
               "k_scale": "-" if ks is None else float(ks), "v_scale": "-" if vs is None else float(vs),
               "kv bytes/token/layer": int(row_bytes) if float(row_bytes).is_integer() else row_bytes,
               "vs_bf16": cfg.kv_bytes_per_token(2) / row_bytes,
               "k_err_vs_bf16": relative_error(k_back, bf16[0]), "v_err_vs_bf16": relative_error(v_back, bf16[1]),
               "k_err_vs_fp64": relative_error(k_back.cpu(), k64), "v_err_vs_fp64": relative_error(v_back.cpu(), v64),
               "recall": None if trivial else attention_recall(bf16[2], k_back, bf16[0], kk), "k": kk,
               "trivial": trivial, "stores_scale": fmt.stores_scale}
        rows.append(row)
    return rows


def _ruled(head: str, lines) -> str:
    """A table: its header, a rule as wide, its lines."""
    return "\n".join([head, "-" * len(head), *lines])


def trivial_note(k: int, keys: int) -> str:
    """The footnote of a recall flagged trivial."""
    return (f"* {TRIVIAL}: recall@{k} over {keys} keys is 1 whatever the cache holds (k >= the keys: every key is in "
            f"the top-k), so it is not reported; a larger --n (or a smaller --topk) measures it")


def _scale_cell(value, width: int) -> str:
    return f"{value:>{width}}" if isinstance(value, str) else f"{value:>{width}.4g}"


def format_gqa_table(rows: List[dict]) -> str:
    """The GQA page's table, with its notes (the scales, the recall's queries, a trivial recall)."""
    k = rows[0]["k"]
    fw = max([20] + [len(r["format"]) for r in rows])
    head = f"{'format':<{fw}} {'k_scale':>9} {'v_scale':>9} {'KV bytes/token/layer':>20} {'vs bf16':>7} " \
           f"{'K err/bf16':>10} {'V err/bf16':>10} {'K err/fp64':>10} {'V err/fp64':>10} {f'recall@{k}':>10}"
    lines = [f"{r['format']:<{fw}} {_scale_cell(r['k_scale'], 9)} {_scale_cell(r['v_scale'], 9)} "
             f"{r['kv bytes/token/layer']:>20g} {r['vs_bf16']:>6.2f}x {r['k_err_vs_bf16']:>10.2e} "
             f"{r['v_err_vs_bf16']:>10.2e} {r['k_err_vs_fp64']:>10.2e} {r['v_err_vs_fp64']:>10.2e} "
             f"{(TRIVIAL + '*') if r['trivial'] else format(r['recall'], '.4f'):>10}" for r in rows]
    return _ruled(head, lines)


def gqa_notes(rows: List[dict], n: int, num_queries: int) -> List[str]:
    """The lines under the GQA table: what the columns measure."""
    k = rows[0]["k"]
    out = ["err/bf16: relative error ||read-back - x|| / ||x|| of the K / V caches against the bf16 chain (the "
           "'auto' cache); err/fp64: against an fp64 chain of the same bf16 inputs",
           "static scales derived from the data: amax / qmax of the bf16 K / V (fp8 e4m3 448, e5m2 57344); nvfp4's "
           "global decode scale amax / (6 * 448), its group scales stored; '-': the format takes none (per-(token, "
           "head) and mxfp4 scales are computed and stored by the write)",
           f"recall@{k}: top-{k} of q . k (the first {min(num_queries, n)} tokens' bf16 q, every query head against "
           f"its kv head, over all {n} cached keys) against the bf16 keys' top-{k}"]
    if any(r["trivial"] for r in rows):
        out.append(trivial_note(k, n))
    return out


def write_gqa_csv(rows: List[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=GQA_COLUMNS)
        w.writeheader()
        for r in rows:
            cells = {c: (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c]) for c in GQA_COLUMNS}
            if r["trivial"]:
                cells["recall"] = TRIVIAL
            w.writerow(cells)


def _gqa_color(name: str):
    import matplotlib
    names = list(GF.PRESETS)
    return matplotlib.colormaps["tab10"](names.index(name) % 10) if name in names else "0.3"


def plot_gqa(rows: List[dict], path: str, title: str) -> None:
    """Relative error of the K and V read-back against the fp64 chain vs KV bytes per token and layer (one
    colour per format, K filled, V hollow), and recall@k vs bytes when it is measured (a trivial recall is not
    drawn: a single panel says so)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    recall_rows = [r for r in rows if r["recall"] is not None and math.isfinite(r["recall"])]
    panels = 2 if recall_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(13 if panels == 2 else 8.5, 5.5), dpi=110, squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2][:panels]})
    ax = axes[0][0]
    xs = [r["kv bytes/token/layer"] for r in rows]
    errs = [e for r in rows for e in (r["k_err_vs_fp64"], r["v_err_vs_fp64"]) if math.isfinite(e) and e > 0]
    lo, hi = (min(errs) / 2.5, max(errs) * 2.5) if errs else (1e-4, 1.0)
    drawn = set()

    def point(x, err, c, which):
        if not math.isfinite(err):
            return
        if err == 0:       # exact (e.g. bf16 V without a V-norm): on the bottom edge
            ax.scatter(x, lo, marker="v", s=80, facecolors="none", edgecolors=c, linewidths=1.5, zorder=4,
                       clip_on=False)
            drawn.add("exact")
        elif which == "K":
            ax.scatter(x, err, color=c, marker="o", s=40, zorder=4)
        else:
            ax.scatter(x, err, facecolors="none", edgecolors=c, marker="s", s=110, linewidths=1.5, zorder=3)
        drawn.add(which)

    for idx in _clusters(xs):
        ys = _spread([math.log10(max(rows[i]["k_err_vs_fp64"], rows[i]["v_err_vs_fp64"], lo)) for i in idx], 0.1)
        right = max(xs[i] for i in idx)
        for i, ly in zip(idx, ys):
            r = rows[i]
            c = _gqa_color(r["format"])
            point(xs[i], r["k_err_vs_fp64"], c, "K")
            point(xs[i], r["v_err_vs_fp64"], c, "V")
            ax.annotate(r["format"], (xs[i], max(r["k_err_vs_fp64"], r["v_err_vs_fp64"], lo)),
                        xytext=(right * 1.08, 10 ** ly), fontsize=8, va="center",
                        arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5"), annotation_clip=False)
    _error_axes(ax, xs, 2.2, lo, hi, "KV cache bytes per token and layer (codes + stored scales)",
                "relative error of the read-back vs the fp64 chain")
    handles = {"K": Line2D([], [], color="0.3", marker="o", ls="", label="K cache"),
               "V": Line2D([], [], color="0.3", marker="s", markersize=9, markerfacecolor="none", ls="",
                           label="V cache"),
               "exact": Line2D([], [], color="0.3", marker="v", markerfacecolor="none", ls="",
                               label="exact (0 error), on the bottom edge")}
    ax.legend(handles=[h for key, h in handles.items() if key in drawn], fontsize=8, loc="upper right")
    if not recall_rows and any(r["trivial"] for r in rows):
        ax.text(0.01, 0.01, f"recall@{rows[0]['k']} not drawn: trivial (k >= the {rows[0]['k']} keys)",
                transform=ax.transAxes, fontsize=8, va="bottom")
    if recall_rows:
        ax2 = axes[0][1]
        k = recall_rows[0]["k"]
        _recall_panel(ax2, [(r["kv bytes/token/layer"], r["recall"], _gqa_color(r["format"]), "o", r["format"])
                            for r in recall_rows], 3.2, "KV cache bytes per token and layer", k,
                      "attention top-k recall (bf16 q)")
    _save(fig, title, path)


ACCURACY_TOKENS = 256          # the profiles' accuracy: CPU reference chain, any --n and device


def gqa_accuracy(cfg: M.GQAConfig, seed: int) -> List[dict]:
    """One row per numerics profile (bf16 activations, :data:`ACCURACY_TOKENS` tokens): the shares of
    q_out and k elements not correctly rounded from the fp64 chain, of fp8 codes other than e4m3(exact /
    scale), and the max abs errors (fp8: the dequantized code)."""
    rows = {}
    for numerics, output, st in profile_accuracy(cfg, torch.bfloat16, ACCURACY_TOKENS, seed):
        row = rows.setdefault(numerics, {"numerics": numerics})
        row[f"{output} not rounded"], row[f"{output} max abs"] = st["not_rounded"], st["max_abs"]
    return list(rows.values())


def format_gqa_accuracy(rows: List[dict]) -> str:
    head = f"{'numerics':<16} {'q_out not rounded':>17} {'k not rounded':>13} {'fp8 codes off':>13} " \
           f"{'q_out max abs':>13} {'k max abs':>10} {'fp8 max abs':>11}"
    return _ruled(head, (f"{r['numerics']:<16} {100 * r['q_out not rounded']:>16.3f}% "
                         f"{100 * r['k not rounded']:>12.3f}% {100 * r['k fp8 not rounded']:>12.3f}% "
                         f"{r['q_out max abs']:>13.3e} {r['k max abs']:>10.3e} {r['k fp8 max abs']:>11.3e}"
                         for r in rows))


def _gqa_rope_label(cfg: M.GQAConfig) -> str:
    """The model's RoPE in words: NEOX RoPE, or its mRoPE sections (the demo's text positions)."""
    if cfg.mrope_section is None:
        return "NEOX RoPE"
    order = "interleaved" if cfg.mrope_interleaved else "chunked"
    return f"NEOX {order} mRoPE {list(cfg.mrope_section)} (text positions)"


def run_gqa(args, device) -> int:
    cfg = M.get_gqa(args.gqa)
    n = args.n if args.n is not None else (65536 if device.type == "cuda" else 512)
    t0 = time.perf_counter()
    with kvfuse.use_backend(args.backend):
        try:
            backend = kvfuse.backend.resolve_backend(device)
        except ValueError as e:
            print(f"kvfuse demo: {e}", file=sys.stderr)
            return 2
        rows = gqa_page(cfg, n, args.block_size, args.seed, device, args.topk, args.queries)
    print(f"kvfuse demo --gqa {cfg.name}: {cfg.num_heads} Q heads, {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
          f"{'QK-norm, ' if cfg.qk_norm else ''}{_gqa_rope_label(cfg)}{', V-norm' if cfg.v_norm else ''}; {n} tokens, "
          f"block_size {args.block_size}, device {device}, "
          f"backend {backend}")
    print(format_gqa_table(rows))
    print("\n".join(gqa_notes(rows, n, args.queries)))
    print(f"\nnumerics= profiles of fused_qk_norm_rope_store_kv against an fp64 chain (bf16 activations, "
          f"{ACCURACY_TOKENS} tokens, CPU reference backend; 'not rounded': not the correctly rounded fp64 value; "
          f"fp8 per-tensor scale amax / 448):")
    print(format_gqa_accuracy(gqa_accuracy(cfg, args.seed)))
    elapsed = time.perf_counter() - t0
    path = os.path.join(args.out, GQA_CSV_NAME)
    write_gqa_csv(rows, path)
    if missing_modules("matplotlib"):
        print(f"wrote {path} ({elapsed:.1f} s; no chart: matplotlib is not installed, {EXTRA_HINT} adds it)")
        return 0
    png = os.path.join(args.out, GQA_PNG_NAME)
    plot_gqa(rows, png, f"kvfuse GQA cache formats, {cfg.name}: {n} tokens, {device.type}, backend {backend}")
    print(f"wrote {png} and {path} ({elapsed:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfuse demo", description="KV-cache format explorer: every kvfuse format on a "
                                "realistic MLA batch (bytes/token, error, top-k recall), table + PNG chart.")
    p.add_argument("--n", type=int, default=None, help="tokens (default 4096 on the CPU, 65536 on CUDA; with "
                   "--input, at most this many rows)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per cache block (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (data, positions, slots, queries)")
    p.add_argument("--out", default="./kvfuse_demo_out", help="output folder (default ./kvfuse_demo_out)")
    p.add_argument("--input", default=None, help="K activations, a .pt or .safetensors file ([tokens, dim])")
    p.add_argument("--input-key", action="append", default=None, metavar="[main=|index=]NAME",
                   help="the tensor of --input to use: NAME for every call site, main=NAME / index=NAME for one "
                        "kind (repeatable; default: kv/k/latent/kv_c/key and index_k/indexer_k/idx_k, else the "
                        "first by name)")
    p.add_argument("--topk", type=int, default=64, help="k of recall@k for the index formats and the GQA page "
                   "(default 64)")
    p.add_argument("--queries", type=int, default=64, help="queries for recall@k (default 64: random ones; the GQA "
                   "page: the first tokens' q)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--backend", default="auto", choices=kvfuse.backend.BACKENDS, help="kvfuse backend (default auto)")
    p.add_argument("--model", default=None, type=str.lower, choices=M.names(), metavar="NAME",
                   help="run a model configuration's call sites (kvfuse.models: " + ", ".join(M.names()) + ")")
    p.add_argument("--gqa", default=None, type=str.lower, choices=M.gqa_names(), metavar="NAME",
                   help="the GQA page: every GQA cache format (kvfuse.gqa_formats) on a GQA / MHA model's K / V "
                        "(bytes/token, error, attention recall@k) and its numerics profiles' accuracy against fp64 "
                        "(kvfuse.models: "
                        + ", ".join(M.gqa_names()) + "; default --n 512 on the CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


WITHOUT = {"tqdm": "progress bar", "matplotlib": "PNG chart"}


def _one_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch.load's can run to a page), or its type's name."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def parse_device(text: Optional[str]) -> torch.device:
    """``--device``: cpu, cuda or cuda:N (default: cuda when present). ValueError, one line, otherwise."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text!r}: no CUDA device (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def out_problem(path: str, names) -> Optional[str]:
    """Why ``--out`` cannot take the demo's output files ``names`` (a file where the folder goes, a folder
    that cannot be created or written, a folder where an output file goes), or None; creates the folder."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--out {path!r} is a file, not a folder"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"--out {path!r}: cannot create the folder ({e.strerror or _one_line(e)})"
    for name in names:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            return f"--out {path!r}: {target!r} is a folder, where the demo writes its file {name}"
        if os.path.exists(target) and not os.access(target, os.W_OK):
            return f"--out {path!r}: {target!r} cannot be overwritten (no write permission)"
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"--out {path!r}: cannot write in the folder ({e.strerror or _one_line(e)})"
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = parse_device(args.device)
    except ValueError as e:
        print(f"kvfuse demo: {e}", file=sys.stderr)
        return 2
    if args.gqa:
        if args.input or args.model:
            parser.error("--gqa takes neither --input nor --model")
    for name in ("n", "block_size", "topk", "queries"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.input_key and not args.input:
        parser.error("--input-key needs --input")
    problem = out_problem(args.out, (GQA_CSV_NAME, GQA_PNG_NAME) if args.gqa else (CSV_NAME, PNG_NAME))
    if problem:
        print(f"kvfuse demo: {problem}", file=sys.stderr)
        return 2
    if args.gqa:
        return run_gqa(args, device)
    if args.n is None:
        args.n = 65536 if device.type == "cuda" else 4096
    cfg = M.get(args.model) if args.model else None
    input_report = None
    if args.input:
        try:
            tensors, input_report, warnings = prepare_input(args.input, site_widths(cfg), args.n, args.input_key)
        except ImportError as e:  # a .safetensors file without the [demo] extra
            print(f"kvfuse demo: --input {args.input!r} needs {e.name or 'safetensors'}: {EXTRA_HINT}",
                  file=sys.stderr)
            return 2
        except (OSError, ValueError) as e:
            print(f"kvfuse demo: {_one_line(e)}", file=sys.stderr)
            return 2
        except Exception as e:  # torch.load's / safetensors' errors on a file that is neither
            detail = _one_line(e)
            detail = type(e).__name__ + (f": {detail}" if detail != type(e).__name__ else "")
            print(f"kvfuse demo: --input {args.input!r} is not a readable .pt or .safetensors file ({detail})",
                  file=sys.stderr)
            return 2
        for w in warnings:
            print(f"kvfuse demo: {w}", file=sys.stderr)
        source = os.path.basename(args.input)
    else:
        tensors = synthetic_batch(args.n, args.seed)
        source = "synthetic MLA batch with outlier channels"
    missing = missing_modules(*(("tqdm",) if not (args.no_progress or args.model) else ()), "matplotlib")
    if missing:  # the [demo] extra is not installed: run without what it adds, and say so
        print(f"kvfuse demo: {' and '.join(missing)} not installed: no "
              f"{' and no '.join(WITHOUT[m] for m in missing)} ({EXTRA_HINT} adds {'them' if len(missing) > 1 else 'it'})",
              file=sys.stderr)
    t0 = time.perf_counter()
    with kvfuse.use_backend(args.backend):
        try:
            kvfuse.backend.resolve_backend(device)
        except ValueError as e:
            print(f"kvfuse demo: {e}", file=sys.stderr)
            return 2
        if args.model:
            rows = explore_model(cfg, tensors, args.n, args.block_size, args.seed, args.topk, args.queries, device)
        else:
            rows = explore(tensors, args.n, args.block_size, args.seed, args.topk, args.queries, device,
                           progress=False if args.no_progress else None)
    elapsed = time.perf_counter() - t0
    n_main = min(args.n, fit_width(_pick(tensors, MAIN_KEYS), 512).shape[0])
    with kvfuse.use_backend(args.backend):
        backend = kvfuse.backend.resolve_backend(device)
    print(f"kvfuse demo: {source}, {n_main} tokens, block_size {args.block_size}, device {device}, backend {backend}")
    if device.type == "cpu":
        print("backend reference: kvfuse's PyTorch reference chain, not the Triton kernel; to run the kernel on the "
              "CPU: TRITON_INTERPRET=1 kvfuse demo --backend triton (Triton's interpreter, slow)" if backend == "reference"
              else "backend triton on the CPU: the Triton kernel through Triton's interpreter (TRITON_INTERPRET=1)")
    if input_report:
        print(input_report)
    if args.model:
        print(describe_model(cfg))
    print(format_table(rows, args.topk))
    write_csv(rows, os.path.join(args.out, CSV_NAME))
    png = os.path.join(args.out, PNG_NAME)
    what = f"{cfg.name} call sites" if args.model else "formats"
    if "matplotlib" in missing:
        print(f"wrote {os.path.join(args.out, CSV_NAME)} ({elapsed:.1f} s; no chart: matplotlib is not installed)")
        return 0
    plot(rows, png, f"kvfuse {what}: error vs bytes/token ({source}, n={n_main}, {device.type}, "
                    f"backend {backend})")
    print(f"wrote {png} and {os.path.join(args.out, CSV_NAME)} ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
