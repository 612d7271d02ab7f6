"""The GPU test matrix, built from the dispatcher's own tables (tests/gpu/test_gpu_matrix.py runs it
on a CUDA machine; tests/test_gpu_matrix_coverage.py checks its coverage on the CPU).

What the dispatcher can pick for a call (kvfuse.kernels.router): a Gluon fast path
(``FAST_PATH_MODULES``, each with its ``LAUNCH_TABLE`` and ``MIN_ROWS``) when one is eligible, else
the portable kernel with an entry of ``plain_launch_table(block_d, cast)``; then, on the second call
of a signature, the direct launcher instead of Triton's. The matrix holds

1. for every fast path, every entry of its launch table, with each RoPE style it serves, each of
   its formats, weight and cos/sin dtypes and int32 / int64 indices (``fast_cases``);
2. an all-pairs cover of the features that change the generated code (``FACTORS``: the format or
   contiguous destination, RoPE style x offset x conjugate, the norm kind and the dims it covers,
   Hadamard, each out_stage including in place, heads, x as one or two inputs, index and parameter
   dtypes) crossed with the launch the dispatcher
   takes (every plain-kernel table entry of every tile width and cast), chosen greedily from
   random valid cases (``pairwise_cases``).

3. the GQA / MHA entry point's section (``gqa_cases``): every entry of its kernel's launch table
   (kvfuse.kernels.qkv) for every tile width, crossed with the features that change its code.

Every case is run on the GPU twice (Triton's launch, then the direct launcher; GQA: two launches) and
compared byte for byte with the reference on whole poisoned storages (kernel_cases.run_case; GQA: the
CPU reference, gqa_cases.run_gqa_case).
"""
from __future__ import annotations

import dataclasses
import itertools
import random

from kvfuse import CastArgs, formats
from kvfuse.models import INDEX_FP8_UE8M0_FP32
from kvfuse.kernels import portable, router
from kvfuse.kernels.gluon.common import table_entry, table_index

from kernel_cases import ALL_FORMATS, Case, plan_of

CONTIG_CASTS = {
    "contig:e4m3/32/ue8m0": CastArgs("e4m3", 32, True, "ue8m0"),
    "contig:e2m1/16/e4m3": CastArgs("e2m1", 16, False, "e4m3"),
    "contig:e2m1/32/ue8m0": CastArgs("e2m1", 32, True, "ue8m0"),
    "contig:e4m3/128/fp32": CastArgs("e4m3", 128, False, "fp32"),
    "contig:e4m3/64/ue8m0_fp32": CastArgs("e4m3", 64, True, "ue8m0_fp32"),
    "contig:cast_back/e4m3/16/e4m3": CastArgs("e4m3", 16, False, "e4m3", cast_back=True),
    "bf16": None,
}
FORMATS = {f.name: f for f in ALL_FORMATS}
FACTORS = {
    "dest": list(FORMATS) + list(CONTIG_CASTS),
    "rope": ["none", "neox", "gptj"],
    "offset": ["tail", "zero", "middle"],
    "conjugate": [False, True],
    "norm": ["none", "rms", "layer", "layer+bias"],
    "hadamard": [False, True],
    "stage": ["none", "norm", "transform", "cast_back", "norm in place", "transform in place"],
    "heads": [1, 3],
    "idx32": [False, True],
    "w_fp32": [False, True],
    "cs_bf16": [False, True],
    "rows": ["decode", "multi", "large"],
    "input": ["one", "split"],              # x as one tensor, or its columns as two (split 64 before the end)
    "norm_dim": ["whole", "leading"],       # the norm over head_dim, or over all but the last 64 dims
}
ROWS = {"decode": (1, 3, 300), "multi": (600, 2049, 4097), "large": (16384, 20000)}


def dispatch_of(case: Case) -> str:
    """What the dispatcher takes for the case on a CUDA device with the fast paths on: "<module>
    entry <i>" (the i-th entry of its LAUNCH_TABLE) or "plain <block_d>/<cast> entry <i>"."""
    rows = case.n * case.heads
    small = dataclasses.replace(case, n=2, num_blocks=2, seed=0, slot_kind="random")
    key = (repr(small), rows)
    if key not in _DISPATCH:
        _DISPATCH[key] = _dispatch_table(small, rows)
    table, label = _DISPATCH[key]
    return f"{label} entry {table_index(table, rows)}"


_DISPATCH = {}


def _dispatch_table(small: Case, rows: int):
    """(launch table, label) of the path that takes a case (eligibility does not depend on n,
    except through MIN_ROWS)."""
    plan = plan_of(small)
    for module in router.FAST_PATH_MODULES:
        if rows >= module.MIN_ROWS and module.eligible(plan):
            return module.LAUNCH_TABLE, module.__name__.rsplit(".", 1)[1]
    block_d = portable.next_pow2(small.head_dim)
    cast = plan.cast.cast_fmt if plan.cast else None
    return portable.plain_launch_table(block_d, cast), f"plain {block_d}/{cast}"


def all_table_entries() -> set:
    """Every (path, entry) label the dispatcher can produce for the matrix's tile widths and casts."""
    labels = set()
    for module in router.FAST_PATH_MODULES:
        name = module.__name__.rsplit(".", 1)[1]
        labels |= {f"{name} entry {i}" for i in range(len(module.LAUNCH_TABLE))}
    for f in ALL_FORMATS:
        bd = portable.next_pow2(f.head_dim)
        labels |= {f"plain {bd}/{f.cast_fmt} entry {i}" for i in range(len(portable.plain_launch_table(bd, f.cast_fmt)))}
    return labels


# ------------------------------------------------------------------------------ fast paths
FAST_MAIN = dict(heads=1, head_dim=512, rotary_dim=64, out_stage=None)
FAST_INDEX_WRITE = dict(heads=1, head_dim=128, rotary_dim=64, out_stage=None, neox=True)
# the indexer fast path's chains: the NEOX preset, DeepSeek V3.2's K (LayerNorm + bias, RoPE on columns
# 0..63, Hadamard), V4's (GPT-J on the tail, Hadamard), and each new feature alone
INDEX_CHAINS = [dict(), dict(norm_kind="layer", bias=True, rope_offset=0, hadamard=True),
                dict(neox=False, hadamard=True), dict(neox=False, rope_offset=0, norm_kind="layer")]
INDEX_Q_CHAINS = [dict(neox=True), dict(neox=True, rope_offset=0, hadamard=True), dict(neox=False, hadamard=True)]


def _fast_n(table, i, min_rows, heads=1):
    """A row count inside entry i of a launch table (its first row, raised to MIN_ROWS), as tokens."""
    first = max(table[i][0], min_rows)
    return max(1, -(-first // heads))


def fast_cases() -> list:
    """Every fast path x every entry of its launch table x the RoPE styles it serves, with its
    formats and the dtypes it reads rotating over the entries."""
    from kvfuse.kernels.gluon import indexer, main_latent_fp4, main_latent, flashmla
    cases = []
    seed = 5000
    styles = (True, False)
    from kvfuse.kernels.router import FAST_PATH_MODULES
    chains = {main_latent: FAST_MAIN, main_latent_fp4: FAST_MAIN, indexer: FAST_INDEX_WRITE}
    for module in FAST_PATH_MODULES:
        chain = chains.get(module)
        # its preset formats; the indexer also the models' UE8M0-as-fp32 one (DeepSeek V3.2 variant)
        fmts = list(module.FORMATS) + ([INDEX_FP8_UE8M0_FP32] if module is indexer else [])
        table = module.LAUNCH_TABLE
        variants = INDEX_CHAINS if module is indexer else [dict(neox=neox) for neox in styles]
        if module in (main_latent, main_latent_fp4):
            variants = variants + [dict(norm=False, rope=False)]           # the cast alone (CAST_ONLY)
        if module is flashmla:    # x as two inputs split at the quantized part; V32's norm over the latent only;
            # no norm (NO_NORM: the engines' normalized latent); no RoPE (NO_ROPE: vLLM's fp8_ds_mla write)
            variants = variants + [dict(neox=True, split="quant"), dict(neox=False, split="quant"),
                                   dict(neox=True, norm_dim="quant"), dict(neox=False, split="quant", norm_dim="quant"),
                                   dict(neox=False, norm=False), dict(neox=True, split="quant", norm=False),
                                   dict(rope=False), dict(split="quant", norm=False, rope=False)]
        for i, variant in itertools.product(range(len(table)), variants):
            for k, fmt in enumerate(fmts):
                if variant.get("norm_dim") and fmt.head_dim != 576:
                    continue                                           # the latent-only norm: V32's record
                chosen = {key: fmt.quant_dim if v == "quant" else v for key, v in variant.items()}
                seed += 1
                n = _fast_n(table, i, module.MIN_ROWS) + (seed % 3)
                base = {**(chain or dict(heads=1, head_dim=fmt.head_dim, rotary_dim=64, out_stage=None)), **chosen}
                bs = (16, 64, 24)[seed % 3]
                cases.append(Case(n=n, **base, fmt=fmt, seed=seed, idx32=bool(seed % 2),
                                  w_fp32=(seed // 2) % 2 == 1, cs_bf16=(seed // 4) % 2 == 1, block_size=bs,
                                  num_blocks=n // bs + 3, slot_kind=("random", "invalid", "cross_page")[seed % 3],
                                  x2d=seed % 5 == 0))
        if module is indexer:     # the contiguous (q, sf) path: the indexer Q, rows = tokens x heads
            for i, variant in itertools.product(range(len(table)), INDEX_Q_CHAINS):
                for k, fmt in enumerate(fmts):
                    seed += 1
                    heads = (64, 4, 16)[seed % 3]
                    n = _fast_n(table, i, module.MIN_ROWS, heads)
                    cases.append(Case(n=n, heads=heads, head_dim=128, fmt=None, norm=seed % 4 == 0, rotary_dim=64,
                                      **variant, cast=CastArgs.from_cache_format(fmt), seed=seed,
                                      idx32=bool(seed % 2), cs_bf16=seed % 3 == 0))
    return cases


# ------------------------------------------------------------------------------ all pairs
def _candidate(rng: random.Random, seed: int):
    """(a random valid Case, its realized factor values) from FACTORS, repaired to what the contract allows."""
    pick = {k: rng.choice(v) for k, v in FACTORS.items()}
    dest = pick["dest"]
    if dest in FORMATS:
        fmt, cast, D = FORMATS[dest], None, FORMATS[dest].head_dim
        heads = pick["heads"] if fmt.token_interleaved else 1
    else:
        fmt, cast = None, CONTIG_CASTS[dest]
        D = rng.choice([128, 256, 576] if cast is None or cast.num_per_channels <= 64 else [128, 256, 512])
        heads = pick["heads"]
    rope = pick["rope"] != "none"
    rdim = 64 if D >= 128 else 32
    offset = {"tail": None, "zero": 0, "middle": (D - rdim) // 32 * 16}[pick["offset"]] if rope else None
    norm_kind = pick["norm"]
    norm = norm_kind != "none"
    pow2 = D & (D - 1) == 0 and 16 <= D <= 1024
    had = pick["hadamard"] and pow2
    stage = pick["stage"]
    in_place = stage.endswith("in place")
    stage = stage.replace(" in place", "")
    if stage == "none" or fmt is None or (stage == "norm" and not norm) \
            or (stage == "cast_back" and not fmt.quantized):
        stage, in_place = "none", False
    if in_place and pick["heads"] != heads:
        in_place = False
    lead = D - 64 if D > 64 else D // 2           # the latent of a [latent | k_pe] record, say
    split = lead if pick["input"] == "split" and not in_place else None
    norm_dim = lead if norm and pick["norm_dim"] == "leading" else None
    rows = pick["rows"]
    n = rng.choice(ROWS[rows])
    bs = rng.choice([16, 64, 24])
    case = Case(n=n, heads=heads, head_dim=D, fmt=fmt, norm=norm, w_fp32=pick["w_fp32"], rope=rope,
                rotary_dim=rdim, rope_offset=offset, neox=pick["rope"] != "gptj", conjugate=rope and pick["conjugate"],
                cs_bf16=rope and pick["cs_bf16"], hadamard=had, cast=cast,
                out_stage=None if stage == "none" else stage, block_size=bs, num_blocks=n // bs + 2,
                token_padding=rng.choice([0, 32]) if fmt is not None and fmt.token_interleaved else 0,
                block_padding=rng.choice([0, 64]), slot_kind=rng.choice(["continuous", "cross_page", "random", "invalid"]),
                seed=seed, idx32=pick["idx32"], x2d=heads == 1 and rng.random() < 0.3,
                x_row_pad=rng.choice([0, 0, 16, 8]), norm_kind="layer" if norm_kind.startswith("layer") else "rms",
                bias=norm_kind == "layer+bias", in_place=in_place, split=split, norm_dim=norm_dim)
    realized = dict(dest=dest, rope=pick["rope"], offset=pick["offset"] if rope else "-",
                    conjugate=case.conjugate if rope else "-", norm=norm_kind, hadamard=had,
                    stage=("none" if case.out_stage is None else case.out_stage) + (" in place" if in_place else ""),
                    heads=heads, idx32=pick["idx32"], w_fp32=case.w_fp32 if norm else "-",
                    cs_bf16=case.cs_bf16 if rope else "-", input="one" if split is None else "split",
                    norm_dim=("whole" if norm_dim is None else "leading") if norm else "-", launch=dispatch_of(case))
    return case, realized


def pairs_of(realized: dict) -> set:
    items = sorted((k, str(v)) for k, v in realized.items())
    return set(itertools.combinations(items, 2))


def pairwise_cases(seed: int = 20261201, candidates: int = 16, universe_samples: int = 1000):
    """(cases, uncovered): a greedy all-pairs cover of the realized factors (FACTORS and the launch
    the dispatcher takes). The universe is every pair realized by ``universe_samples`` random valid
    cases plus the candidates seen; each step keeps the best of ``candidates`` fresh ones."""
    rng = random.Random(seed)
    universe, samples = set(), []
    for i in range(universe_samples):
        sample = _candidate(rng, 500 + i)
        samples.append(sample)
        universe |= pairs_of(sample[1])
    covered, cases = set(), []
    stale = 0
    while not universe <= covered and stale < 200:
        best = max((_candidate(rng, 1000 + len(cases)) for _ in range(candidates)),
                   key=lambda cr: len(pairs_of(cr[1]) - covered))
        new = pairs_of(best[1]) - covered
        universe |= pairs_of(best[1])
        if not new:
            stale += 1
            continue
        covered |= new
        cases.append(best)
    for sample in samples:        # the rare pairs the greedy steps missed: a sample that realized each
        new = pairs_of(sample[1]) - covered
        if new:
            covered |= new
            cases.append(sample)
    return cases, universe - covered


def matrix():
    """[(label, Case)] of the whole GPU matrix."""
    out = [(f"fast {dispatch_of(c)} {c.describe()}", c) for c in fast_cases()]
    cases, _ = pairwise_cases()
    out += [(f"pairs {r['launch']} {c.describe()}", c) for c, r in cases]
    return out


# ------------------------------------------------------------------------------ GQA / MHA
# features crossed with the launch configurations (one variant per case, in turn)
GQA_VARIANTS = [
    dict(),                                                                     # NHD bf16 NEOX, both norms
    dict(layout="HND", fp8=True, neox=False),
    dict(fp8=True, inplace=True, q_norm="fp32", k_norm="bf16", cos_sin="bf16"),
    dict(layout="HND", conjugate=True, q_norm=None, packed=False, idx32=True),
    dict(cache="vllm", fp8=True, rotary_dim=32, rope_offset=16, q_norm="fp16", k_norm=None, cos_sin="fp16"),
    dict(cache="vllm", layout="HND", neox=False, rotary_dim=0, inplace=True, idx32=True),
    dict(q_out_none=True, fp8=True, slots="contiguous", block_size=16),
    dict(dv=64, fp8=True, layout="HND", q_norm=None, k_norm=None),
    dict(fp8=True, scale_per_head="kv"),                                        # one scale per kv head
    dict(fp8=True, layout="HND", neox=False, scale_per_head="k", idx32=True),
    # activations' dtypes x numerics profiles (kvfuse.numerics_profiles), calls without caches, fp16 norm
    # weights and cos / sin tables (as vLLM's fused_qk_norm_rope passes them with fp16 activations)
    dict(dtype="fp16", fp8=True, numerics="fused", q_norm="fp16", k_norm="fp16", cos_sin="fp16"),
    dict(dtype="fp32", layout="HND", fp8=True, numerics="fused_fp32_cast", scale_per_head="kv"),
    dict(dtype="fp16", numerics="fused_fp32_cast", neox=False, cache="vllm"),
    dict(kv_cache=False, inplace=True, numerics="fused"),
    dict(kv_cache=False, dtype="fp16", rotary_dim=32, rope_offset=16, neox=False, k_norm="fp16", cos_sin="fp16"),
    # mRoPE (MROPE_*: chunked in the halves form, interleaved in the whole-row form with partial GPT-J) and
    # the V-norm (V_NORM: with a weight, and weightless into an fp8 cache whose cast reads fp32)
    dict(mrope="chunked", fp8=True),
    dict(mrope="interleaved", neox=False, rotary_dim=32, rope_offset=16, v_norm="bf16", layout="HND"),
    dict(mrope="interleaved", v_norm="none", fp8=True, numerics="fused_fp32_cast", scale_per_head="v"),
]
# head_dims that are not a multiple of 16 (the tile is their power of two): (d, n, features)
GQA_ODD_HEAD_DIMS = [
    (120, 1, dict(fp8=True, rotary_dim=64)),
    (120, 200, dict(dtype="fp16", numerics="fused", q_norm="fp16", k_norm="fp16",
                    cos_sin="fp16")),
    (72, 3, dict(layout="HND", fp8=True, numerics="fused_fp32_cast", dv=40)),
    (8, 192, dict(rotary_dim=8, neox=False, kv_cache=False, inplace=True)),
]
# heads held as two tensors (SPLIT), an fp8 q_out (Q_FP8), FlashInfer's multiply convention (SCALE_MUL) with
# scales passed as numbers (SCALE_BY_VALUE), a K cache alone (not HAS_V): FlashInfer's rope_quantize_fp8
# calls (GQA, and MLA's separate kpe / ckv caches), and a split head under a norm with per-head scales
_FLASHINFER = dict(split=64, rotary_dim=64, q_norm=None, k_norm=None, fp8=True, q_fp8=True,
                   numerics="fused_fp32_cast", scale_convention="multiply", scale_numbers=True, paged_append=True)
GQA_PARTS = [
    (128, 1, dict(_FLASHINFER)),
    (128, 300, dict(_FLASHINFER, layout="HND", neox=False, dtype="fp16")),
    (576, 1, dict(_FLASHINFER, hq=16, hkv=1, k_cache_split=True, v_cache=False, neox=False)),
    (576, 200, dict(_FLASHINFER, hq=16, hkv=1, k_cache_split=True, v_cache=False)),
    (128, 9, dict(_FLASHINFER, kv_cache=False, k_out_fp8=True)),
    (128, 7, dict(split=32, fp8=True, scale_per_head="kv", rotary_dim=64, rope_offset=16, q_fp8=True)),
    (128, 260, dict(paged_append=True, idx32=True, layout="HND")),     # FlashInfer's append_paged_kv_cache
]
# Gemma 4's 512-d global heads with the V-norm (the wide tile's launch table, by rows), mRoPE with heads
# held as two tensors and under the fused profile with fp16 activations
GQA_MROPE_V_NORM = [
    (512, 3, dict(hq=8, hkv=1, v_norm="none", fp8=True)),
    (512, 300, dict(hq=8, hkv=2, v_norm="none", layout="HND", numerics="fused")),
    (128, 5, dict(mrope="chunked", split=64, rotary_dim=64, fp8=True, q_fp8=True)),
    (128, 4097, dict(mrope="interleaved", mrope_section=(24, 20, 20), hq=8, hkv=2)),     # Qwen3-VL's, prefill
    (256, 200, dict(mrope="interleaved", v_norm="fp32", dtype="fp16", numerics="fused", q_norm="fp16",
                    k_norm="fp16")),
]


def gqa_fp4_cases():
    """(d, n, features) of the 4-bit caches, derived from kvfuse.gqa_formats' presets of code e2m1: each in
    both layouts, K and V, alone and beside another format, staged and casting the fp32 value, fp16 / fp32
    activations, every entry of the 4-bit launch table at 64- and 128-d heads; and FlashInfer's NVFP4 append (no q heads, scales by value, its page
    addressing)."""
    from kvfuse.gqa_formats import PRESETS
    out = []
    for name in (n for n, f in PRESETS.items() if f.code == "e2m1"):
        out += [(128, 1, dict(fp4_k=name, fp4_v=name)),
                (128, 300, dict(fp4_k=name, fp4_v=name, layout="HND", numerics="fused_fp32_cast", dtype="fp16",
                                q_norm="fp16", k_norm="fp16", cos_sin="fp16")),
                (64, 9, dict(fp4_k=name, fp8=True, neox=False, rotary_dim=32, rope_offset=16)),
                (256, 40, dict(fp4_v=name, dtype="fp32", layout="HND", idx32=True)),
                # the stored-scale launch table's entries at 64-d heads too (qkv.launch_table(d, stored_scale=True))
                (64, 1, dict(fp4_k=name, layout="HND")), (64, 200, dict(fp4_k=name, fp4_v=name)),
                (128, 17, dict(fp4_v=name, fp8=True))]
    if "nvfp4" in PRESETS:
        out.append((128, 260, dict(fp4_k="nvfp4", fp4_v="nvfp4", hq=0, q_norm=None, k_norm=None, rotary_dim=0,
                                   paged_append=True, scale_numbers=True, idx32=True)))
    return out


GQA_HEADS = {64: (12, 6), 128: (6, 3), 256: (4, 4)}   # partial groups: 64-d of 8 heads (q 8 + 4, kv 6), 128-d of 4 (q 4 + 2, kv 3)


def gqa_cases():
    """The matrix's GQA section (kvfuse.fused_qk_norm_rope_store_kv, kvfuse/kernels/qkv.py): (label,
    GQACase) for every entry of qkv.launch_table of every tile width (head_dim 64, 128, 256), at its
    first and last n (a larger n with a partial last program for the open-ended entry), crossed in turn
    with the features that change the generated code (``GQA_VARIANTS``)."""
    from gqa_cases import GQACase
    from kvfuse.kernels import qkv
    out = []
    variant = itertools.cycle(GQA_VARIANTS)
    for d in (64, 128, 256):
        table = qkv.launch_table(d)
        for i, (first, cfg) in enumerate(table):
            last = table[i + 1][0] - 1 if i + 1 < len(table) else None
            sizes = [first, last] if last is not None else [first, first + 3 * cfg[0] + 1, 4097]
            for n in sizes:
                if n is None:
                    continue
                assert table_entry(table, n) == cfg
                v = dict(next(variant))
                if "dv" in v:
                    v["dv"] = 64 if d != 64 else 128
                if v.get("cache") == "vllm" and v.get("dv"):
                    v.pop("cache")
                if v.get("rotary_dim") == 32 and d == 64:
                    v["rope_offset"] = 0
                hq, hkv = GQA_HEADS[d]
                case = GQACase(n=n, hq=hq, hkv=hkv, d=d, seed=n * 7 + d, **v)
                out.append((f"gqa d{d}_n{n}_bm{cfg[0]}_g{cfg[1]}_w{cfg[2]}_" + "_".join(f"{k}={v[k]}" for k in v), case))
    for d, n, v in GQA_ODD_HEAD_DIMS + GQA_PARTS + GQA_MROPE_V_NORM + gqa_fp4_cases():
        case = GQACase(n=n, d=d, seed=n * 7 + d, **{"hq": 6, "hkv": 3, **v})
        out.append((f"gqa d{d}_n{n}_" + "_".join(f"{k}={v[k]}" for k in v), case))
    return out


# ------------------------------------------------------------------------------ GQA cache formats
def gqa_format_cases():
    """The GQA section's cache formats (kvfuse.gqa_formats.PRESETS; tests/gqa_format_cases.py): (label,
    FormatCase) with every preset as K's format and as V's, each in the kernel's two row forms (halves: NEOX
    RoPE over the whole head; rows: partial or GPT-J RoPE) at a decode (one program) and a batch of many
    programs, crossed in turn with the layouts, activations' dtypes, profiles and per-head static scales;
    and vLLM's inline scales for the formats that store theirs per (token, head). A 4-bit K cache in the
    halves form casts each half as a row of whole groups (qkv.halves_mode). Derived from PRESETS: a preset added there gets its cases here
    (test_gqa_formats.py checks that each is reached)."""
    from gqa_cases import GQACase
    from gqa_format_cases import FormatCase
    from kvfuse.gqa_formats import PRESETS
    names = list(PRESETS)
    out = []
    for i, name in enumerate(names):
        other = names[(i + 1) % len(names)]
        partner = "fp8_e4m3" if name == "auto" else "auto"     # V of this format beside another K
        features = [
            (1, 128, name, other, dict(layout="NHD")),                                           # halves, decode
            (2, 128, partner, name, dict(layout="NHD")),                             # halves with V of this format
            (300, 128, other, name, dict(layout="HND", neox=False, numerics="fused_fp32_cast",
                                        dtype="fp16" if i % 2 else "bf16", q_norm="fp16" if i % 2 else "bf16",
                                        k_norm="fp16" if i % 2 else "fp32", cos_sin="fp16" if i % 2 else "fp32")),
            (260, 64, name, name, dict(rotary_dim=32, scale_per_head="kv", numerics="fused", block_size=16)),
            (5, 256, name, name, dict(layout="HND", split=64, rotary_dim=64, dtype="fp32")),      # rows, heads as pairs
        ]
        for n, d, kf, vf, v in features:
            hq, hkv = GQA_HEADS[d]
            case = GQACase(n=n, d=d, hq=hq, hkv=hkv, seed=n * 7 + d + i, **v)
            out.append((f"gqa_formats {kf}/{vf} d{d}_n{n}_" + "_".join(f"{k}={v[k]}" for k in v),
                        FormatCase(case, kf, vf)))
        if PRESETS[name].scale == "token_head":
            for n, layout in ((513, "NHD"), (3, "HND")):
                case = GQACase(n=n, d=128, hq=6, hkv=3, layout=layout, seed=n + i)
                out.append((f"gqa_formats {name} inline d128_n{n}_{layout}", FormatCase(case, name, name, inline=True)))
            # the stored-scale launch table's first two entries at 64-d heads (qkv.launch_table(64, True))
            for n in (1, 40):
                case = GQACase(n=n, d=64, hq=12, hkv=6, seed=n + 64 + i)
                out.append((f"gqa_formats {name}/{name} d64_n{n}", FormatCase(case, name, name)))
    # K's cache as two (FlashInfer's kpe / ckv) with a per-row scale over both; the multiply convention
    out.append(("gqa_formats fp8_per_token_head k_cache_split d576_n9", FormatCase(
        GQACase(n=9, d=576, hq=16, hkv=1, split=64, k_cache_split=True, v_cache=False, rotary_dim=64, neox=False,
                seed=9), "fp8_per_token_head", None)))
    out.append(("gqa_formats fp8_e5m2/fp8_e4m3 multiply d128_n300", FormatCase(
        GQACase(n=300, hq=6, hkv=3, layout="HND", scale_convention="multiply", scale_per_head="k", seed=300),
        "fp8_e5m2", "fp8_e4m3")))
    # the features crossed: mRoPE and the V-norm with per-(token, head), e5m2 and 4-bit caches
    out.append(("gqa_formats fp8_per_token_head/int8_per_token_head mrope=interleaved v_norm=fp32 d128_n300",
                FormatCase(GQACase(n=300, hq=6, hkv=3, v_norm="fp32", mrope="interleaved", seed=301),
                           "fp8_per_token_head", "int8_per_token_head")))
    out.append(("gqa_formats fp8_e5m2/fp8_per_token_head v_norm=none fused_fp32_cast HND d128_n1",
                FormatCase(GQACase(n=1, hq=6, hkv=3, v_norm="none", numerics="fused_fp32_cast", layout="HND",
                                   seed=302), "fp8_e5m2", "fp8_per_token_head")))
    out.append(("gqa_formats nvfp4/mxfp4 mrope=chunked v_norm=bf16 d128_n300",
                FormatCase(GQACase(n=300, hq=6, hkv=3, v_norm="bf16", mrope="chunked", rotary_dim=64, seed=303),
                           "nvfp4", "mxfp4")))
    return out
