"""GPU module for fused_qk_norm_rope_store_kv (kvfuse/kernels/qkv.py, SPEC §11): the compiled kernel
against the reference chain computed on the CPU, bytes compared over whole storages (caches with guards
and block padding, the NaN-poisoned q_out buffer, the packed QKV input).

The cases are derived from the kernel's launch table (kvfuse.kernels.qkv.launch_table): for every tile
width (head_dim 64, 128, 256) every entry is run at its first and its last n (and a larger n with a
partial last program for the open-ended entry), crossed with the features that change the generated code
(layout, cache dtype, RoPE pairing and rotary width, norms and their weight dtypes, in place, packed /
separate inputs, vLLM's kv_cache[:, 0] / [:, 1] views, int32 / int64 indices, Dv != D), plus the int64
slot path and real model shapes. Each case runs twice on the GPU (the second launch reuses the compiled
kernel) and both results must equal the CPU reference. Run with KVFUSE_TEST_GPU=1 on a CUDA machine:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_gqa.py
"""
import itertools

import pytest
import torch

import kvfuse
from kvfuse.kernels import fused, qkv
from kvfuse.kernels.gluon_common import table_entry
from gqa_cases import GQACase, diff_report, run_gqa_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")

# features crossed with the launch configurations (one variant per case, in turn)
VARIANTS = [
    dict(),                                                                     # NHD bf16 NEOX, both norms
    dict(layout="HND", fp8=True, neox=False),
    dict(fp8=True, inplace=True, q_norm="fp32", k_norm="bf16", cs_bf16=True),
    dict(layout="HND", conjugate=True, q_norm=None, packed=False, idx32=True),
    dict(cache="vllm", fp8=True, rotary_dim=32, rope_offset=16, k_norm=None),
    dict(cache="vllm", layout="HND", neox=False, rotary_dim=0, inplace=True, idx32=True),
    dict(q_out_none=True, fp8=True, slots="contiguous", block_size=16),
    dict(dv=64, fp8=True, layout="HND", q_norm=None, k_norm=None),
]
HEADS = {64: (4, 2), 128: (8, 2), 256: (4, 4)}


def launch_cases():
    """(label, case) for every launch-table entry of every tile width, at its boundaries."""
    out = []
    variant = itertools.cycle(VARIANTS)
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
                hq, hkv = HEADS[d]
                case = GQACase(n=n, hq=hq, hkv=hkv, d=d, seed=n * 7 + d, **v)
                out.append((f"d{d}_n{n}_bm{cfg[0]}_w{cfg[1]}_" + "_".join(f"{k}={v[k]}" for k in v), case))
    return out


CASES = launch_cases() if torch.cuda.is_available() else []
SUMMARY = {"cases": 0, "runs": 0, "byte_diffs": 0}


def check(case: GQACase):
    ref = run_gqa_case(case, "reference", "cpu")
    reports = []
    for attempt in ("first launch", "second launch"):
        tri = run_gqa_case(case, "triton", "cuda")
        SUMMARY["runs"] += 1
        r = diff_report(ref, tri)
        if r:
            reports.append(f"{attempt}: {r}")
    SUMMARY["cases"] += 1
    SUMMARY["byte_diffs"] += len(reports)
    assert not reports, case.describe() + " :: " + " | ".join(reports)


@pytest.mark.parametrize("label,case", CASES, ids=[label for label, _ in CASES])
def test_launch_table_case(label, case):
    check(case)


def test_every_launch_entry_is_covered():
    for d in (64, 128, 256):
        picked = {table_entry(qkv.launch_table(d), c.n) for _, c in CASES if c.d == d}
        assert picked == {cfg for _, cfg in qkv.launch_table(d)}


def test_int64_slot_path(monkeypatch):
    monkeypatch.setattr(fused, "_INT32_LIMIT", 4)
    check(GQACase(n=300, fp8=True, layout="HND", seed=1))
    check(GQACase(n=3, neox=False, seed=2))


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-8b", "gemma-3-12b"])
def test_model_shapes(name):
    """The models' real head counts and widths (decode and a prefill block), NHD fp8 and HND bf16."""
    cfg = kvfuse.models.get_gqa(name)
    base = dict(hq=cfg.num_heads, hkv=cfg.num_kv_heads, d=cfg.head_dim, q_norm="fp32" if cfg.norm_weight_offset
                else "bf16", k_norm=("fp32" if cfg.norm_weight_offset else "bf16") if cfg.qk_norm else None)
    if not cfg.qk_norm:
        base["q_norm"] = None
    check(GQACase(n=7, fp8=True, seed=3, **base))
    check(GQACase(n=257, layout="HND", inplace=True, block_size=16, seed=4, **base))


def test_zz_summary():
    print(f"\nGQA GPU summary: {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__}: {SUMMARY['cases']} cases, {SUMMARY['runs']} GPU runs vs the CPU "
          f"reference, {SUMMARY['byte_diffs']} runs with differing bytes")
    assert SUMMARY["cases"] > 0 and SUMMARY["byte_diffs"] == 0
