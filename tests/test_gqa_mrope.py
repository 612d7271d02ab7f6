"""mRoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) and the V-norm (Gemma 4) of fused_qk_norm_rope_store_kv (SPEC §3).

The reference's mRoPE rule against an oracle written the way transformers and vLLM write it (each token's
cos / sin gathered from the three position rows, then ordinary RoPE), partial rotary included (the
partial-NeoX case engines have got wrong); the kernel through Triton's interpreter byte-equal to the
reference over chunked / interleaved sections, NEOX / GPT-J, partial rotary, pairs, every numerics profile
and dtype, with positions out of range in single rows; text positions (three equal rows) as plain RoPE;
the V-norm (weightless and with a weight) likewise; the plan cache across batch sizes; every validation
rule; the model configurations and the position helpers. (Through torch.compile: tests/test_gqa_api.py.)"""
import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import models, reference
from kvfuse.plans import cache as kv_plan
from kvfuse.rope import (cos_sin_cache, mrope_grid_positions, mrope_text_positions, proportional_cos_sin_cache)
from gqa_cases import GQACase, build, diff_report, run_gqa_case

interpreter = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")


# =============================================================================== the rule
def _oracle_rows(positions, table, section, interleaved):
    """[n, rotary_dim]: each token's cos | sin row as transformers / vLLM assemble it from the three rows'
    table rows (every position in range)."""
    half = table.shape[1] // 2
    full = table[positions.long()]                            # [3, n, rotary_dim]
    cos, sin = full[..., :half], full[..., half:]
    if interleaved:         # transformers' apply_interleaved_mrope: row 0, with rows 1 and 2 written in
        def pick(x):
            out = x[0].clone()
            for row, offset in ((1, 1), (2, 2)):
                out[..., offset:section[row] * 3:3] = x[row][..., offset:section[row] * 3:3]
            return out
    else:                   # apply_multimodal_rotary_pos_emb: chunk i of the section from row i
        def pick(x):
            return torch.cat([chunk[i] for i, chunk in enumerate(x.split(list(section), dim=-1))], dim=-1)
    return torch.cat([pick(cos), pick(sin)], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("neox,rotary_dim,offset", [(True, 128, 0), (False, 128, 0), (True, 64, 0), (True, 64, 48),
                                                     (False, 48, 16)])
def test_reference_rule_matches_the_engines_formulation(interleaved, neox, rotary_dim, offset):
    """reference.rope with an mrope_section rotates exactly as plain RoPE by the rows transformers /
    vLLM assemble (a table of one row per token): chunked and interleaved, NEOX and GPT-J, partial
    rotary with the pairs inside the rotated dims (the partial-NeoX path an engine has got wrong)."""
    n, half = 9, rotary_dim // 2
    section = (24, 20, 20) if half == 64 else (half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8)
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 50, (3, n), generator=g)
    table = cos_sin_cache(50, rotary_dim)
    x = torch.randn(n, 3, 128, generator=g).to(torch.bfloat16)
    got = reference.rope(x, positions, table, rotary_dim, neox, offset, mrope_section=section,
                         mrope_interleaved=interleaved)
    want = reference.rope(x, torch.arange(n), _oracle_rows(positions, table, section, interleaved), rotary_dim,
                          neox, offset)
    assert torch.equal(got, want)
    plain = reference.rope(x, positions[0], table, rotary_dim, neox, offset)
    assert not torch.equal(got, plain)                        # the rows do matter


def test_position_rows_by_frequency():
    """The SPEC's table of which row each frequency takes: Qwen2.5-VL's (16, 24, 24) chunked, Qwen3-VL's
    (24, 20, 20) interleaved."""
    chunked = reference.mrope_position_rows(64, (16, 24, 24), False)
    assert chunked.tolist() == [0] * 16 + [1] * 24 + [2] * 24
    inter = reference.mrope_position_rows(64, (24, 20, 20), True)
    assert inter[:6].tolist() == [0, 1, 2, 0, 1, 2] and inter[57:].tolist() == [0, 1, 2, 0, 0, 0, 0]
    assert [int((inter == r).sum()) for r in range(3)] == [24, 20, 20]


def test_a_position_out_of_range_leaves_only_its_pairs():
    """Token 0's height position is past the table: the height row's pairs keep their values, the others
    rotate; token 1's three positions are in range."""
    table = cos_sin_cache(8, 16)
    positions = torch.tensor([[3, 3], [99, 5], [2, 6]])
    x = torch.randn(2, 1, 16).to(torch.bfloat16)
    y = reference.rope(x, positions, table, 16, True, 0, mrope_section=(2, 3, 3))
    rows = reference.mrope_position_rows(8, (2, 3, 3), False)
    h = torch.nonzero(rows == 1).flatten()
    kept = torch.cat([h, h + 8])
    assert torch.equal(y[0, 0, kept], x[0, 0, kept])
    others = torch.tensor([j for j in range(16) if j not in kept.tolist()])
    assert not torch.equal(y[0, 0, others], x[0, 0, others]) and not torch.equal(y[1], x[1])


# =============================================================================== the kernel
MROPE_CASES = {
    "chunked_neox_halves": GQACase(mrope="chunked"),
    "interleaved_qwen3_vl": GQACase(mrope="interleaved", mrope_section=(24, 20, 20), seed=1),
    "chunked_gptj": GQACase(mrope="chunked", neox=False, seed=2),
    "interleaved_gptj_conj_hnd": GQACase(mrope="interleaved", neox=False, conjugate=True, layout="HND", seed=3),
    "partial_neox_offset0": GQACase(mrope="chunked", rotary_dim=64, seed=4),
    "partial_neox_offset": GQACase(mrope="interleaved", rotary_dim=64, rope_offset=32, seed=5),
    "partial_gptj_fp8": GQACase(mrope="chunked", rotary_dim=32, neox=False, fp8=True, seed=6),
    "fp8_fused_fp32_cast": GQACase(mrope="interleaved", fp8=True, numerics="fused_fp32_cast", seed=7),
    "fp16_fused_bf16_table": GQACase(mrope="chunked", dtype="fp16", numerics="fused", cos_sin="bf16", seed=8),
    "fp32_fp16_table_idx32": GQACase(mrope="interleaved", dtype="fp32", cos_sin="fp16", idx32=True, seed=9),
    "pairs_rope_nope": GQACase(mrope="chunked", split=64, rotary_dim=64, fp8=True, seed=10),
    "in_place_no_norms": GQACase(mrope="interleaved", inplace=True, q_norm=None, k_norm=None, seed=11),
    "no_caches": GQACase(mrope="chunked", kv_cache=False, seed=12),
    "d256_heads": GQACase(mrope="interleaved", d=256, hq=4, hkv=1, seed=13),
    "d80_not_pow2": GQACase(mrope="chunked", d=80, hq=2, hkv=1, rotary_dim=40, seed=14),
    "vllm_kv_views_paged_append": GQACase(mrope="interleaved", cache="vllm", paged_append=True, fp8=True, seed=15),
}


@interpreter
@pytest.mark.parametrize("case", [GQACase(), GQACase(neox=False, rotary_dim=64, rope_offset=16, fp8=True, seed=1)],
                         ids=["halves", "rows"])
def test_text_positions_rotate_as_plain_rope(case):
    """Three equal position rows (a text-only batch) give plain RoPE's bytes; rows that differ do not."""
    kw, storages, _, q_buf = build(case)
    rope = kw["rope_args"]
    plain = _run(kw, storages, q_buf)
    kw, storages, _, q_buf = build(case)
    kw["rope_args"] = dataclasses.replace(rope, positions=mrope_text_positions(rope.positions),
                                          mrope_section=case.section, mrope_interleaved=True)
    assert all(torch.equal(a, b) for a, b in zip(_run(kw, storages, q_buf), plain))
    kw, storages, _, q_buf = build(case)
    rows = mrope_text_positions(rope.positions)
    rows[1] = torch.where(rows[1] >= 0, (rows[1] + 1) % 40, rows[1])
    kw["rope_args"] = dataclasses.replace(rope, positions=rows, mrope_section=case.section)
    assert not all(torch.equal(a, b) for a, b in zip(_run(kw, storages, q_buf), plain))


def _run(kw, storages, q_buf):
    with kvfuse.use_backend("triton"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    return [t.clone().view(torch.uint8) for t in storages + [q_buf]]      # bytes (q_buf holds NaN)


V_NORM_CASES = {
    "weightless_bf16": GQACase(v_norm="none"),
    "weightless_fp8_hnd": GQACase(v_norm="none", fp8=True, layout="HND", seed=1),
    "bf16_weight_fp8_fp32_cast": GQACase(v_norm="bf16", fp8=True, numerics="fused_fp32_cast", seed=2),
    "fp32_weight_fused_fp8_per_head": GQACase(v_norm="fp32", fp8=True, numerics="fused", scale_per_head="v",
                                              hkv=3, hq=3, seed=3),
    "fp16_act_dv72": GQACase(v_norm="fp16", dtype="fp16", dv=72, seed=4),
    "fp32_act_dv_ne_d": GQACase(v_norm="none", dtype="fp32", d=64, dv=128, hq=2, hkv=1, seed=5),
    "d512_gemma4_global_shape": GQACase(v_norm="none", d=512, hq=2, hkv=1, n=3, mrope="", rotary_dim=512, seed=6),
    "vllm_views_multiply_scales": GQACase(v_norm="bf16", cache="vllm", fp8=True, scale_convention="multiply",
                                          scale_numbers=True, seed=7),
    "with_mrope": GQACase(v_norm="none", mrope="interleaved", fp8=True, seed=8),
}


@interpreter
@pytest.mark.parametrize("name", list(MROPE_CASES) + list(V_NORM_CASES))
def test_kernel_equals_reference(name):
    case = MROPE_CASES.get(name) or V_NORM_CASES[name]
    want = run_gqa_case(case, "reference")
    got = run_gqa_case(case, "triton")
    assert not diff_report(want, got), f"{case.describe()}: {diff_report(want, got)}"


def test_v_norm_reference_values():
    """The V cache holds RMSNorm(v) (staged, bf16: bf16((v * rstd) * w)) and, without a weight, v * rstd;
    k's record is unchanged by the V-norm."""
    case = GQACase(n=4, v_norm="none", slots="contiguous", cache="vllm")
    kw, _, _, _ = build(case)
    ref = {}
    for v_norm in (None, kvfuse.NormArgs(None, eps=1e-6)):
        kw2, _, _, _ = build(case)
        kw2["v_norm_args"] = v_norm
        with kvfuse.use_backend("reference"):
            kvfuse.fused_qk_norm_rope_store_kv(**kw2)
        ref[v_norm is None] = kvfuse.load_gqa_kv_cache(kw2["k_cache"], kw2["v_cache"], kw2["slot_mapping"])
    v = kw["v"].float()
    rstd = 1.0 / torch.sqrt((v * v).mean(-1, keepdim=True).double() + 1e-6)
    assert torch.allclose(ref[False][1].float(), (v * rstd).float(), rtol=2 ** -7, atol=1e-30)   # bf16 rounding (subnormals: atol)
    assert torch.equal(ref[False][0], ref[True][0]) and torch.equal(ref[True][1], kw["v"])
    ones = reference.rmsnorm(kw["v"], torch.ones(case.d), 1e-6)
    assert torch.equal(ref[False][1], ones)


# =============================================================================== the plan cache
@interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mrope_signature_hits_across_batch_sizes(backend):
    """positions [3, n] key n as rows: a second batch size hits the first's template, with its own bytes."""
    kv_plan.clear_plan_cache()
    results = {}
    for enabled in (True, False):
        kv_plan.set_plan_cache(enabled)
        try:
            for n, seed in ((5, 0), (7, 3)):
                for buffer in ("contiguous", "persistent"):     # [3, n] itself, or [:, :n] of a [3, 32] buffer
                    results[enabled, n, buffer] = _mrope_call(n, seed, buffer, backend)
        finally:
            kv_plan.set_plan_cache(True)
    assert kv_plan.plan_cache_info().hits == 2                  # n = 7 found each layout's n = 5 template
    for key in [k for k in results if k[0]]:
        assert all(torch.equal(a, b) for a, b in zip(results[key], results[(False,) + key[1:]])), key


def _mrope_call(n, seed, buffer, backend):
    case = GQACase(mrope="interleaved", v_norm="none", n=n, seed=seed, extra_blocks=3 - n // 4)
    kw, storages, _, q_buf = build(case)
    pos = kw["rope_args"].positions
    if buffer == "persistent":
        whole = torch.full((3, 32), -7, dtype=pos.dtype)
        whole[:, :n] = pos
        pos = whole[:, :n]
    else:
        pos = pos.contiguous()
    kw["rope_args"] = dataclasses.replace(kw["rope_args"], positions=pos)
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    return [t.clone().view(torch.uint8) for t in storages + [q_buf]]


def test_positions_overlapping_q_out_are_rejected_at_every_size():
    """q_out written over mRoPE's positions [3, n] (int64 views of q_out's buffer) raises at each batch
    size, the second found in the plan cache (its spans per size)."""
    kv_plan.clear_plan_cache()
    for n in (4, 6):
        kw, _, _, q_buf = build(GQACase(mrope="chunked", n=n, slots="contiguous", extra_blocks=3 - -(-n // 4)))
        rows = q_buf.view(torch.int64).view(-1)[: 3 * n].view(3, n)
        rows.copy_(kw["rope_args"].positions)
        kw["rope_args"] = dataclasses.replace(kw["rope_args"], positions=rows)
        with pytest.raises(ValueError, match="q_out overlaps rope_args.positions"):
            kvfuse.fused_qk_norm_rope_store_kv(**kw)
    assert kv_plan.plan_cache_info().hits == 1


# =============================================================================== validation
def _kw(**rope):
    kw, _, _, _ = build(GQACase(mrope="chunked"))
    kw["rope_args"] = dataclasses.replace(kw["rope_args"], **rope)
    return kw


@pytest.mark.parametrize("change,error,match", [
    (dict(mrope_section=(16, 24)), ValueError, r"rope_args\.mrope_section must be three positive ints"),
    (dict(mrope_section=(16, 24, 23)), ValueError, r"rope_args\.mrope_section must sum to rotary_dim / 2 = 64"),
    (dict(mrope_section=(0, 32, 32)), ValueError, r"rope_args\.mrope_section must be three positive ints"),
    (dict(mrope_section=(16.0, 24, 24)), ValueError, r"rope_args\.mrope_section must be three positive ints"),
    (dict(mrope_section=(True, 31, 32)), ValueError, r"rope_args\.mrope_section must be three positive ints"),
    (dict(mrope_interleaved=1), TypeError, r"rope_args\.mrope_interleaved must be a bool"),
    (dict(mrope_section=None, mrope_interleaved=True), ValueError, r"rope_args\.mrope_interleaved: True without"),
    (dict(mrope_section=None), ValueError, r"rope_args\.positions: expected shape \(5,\)"),
])
def test_mrope_validation(change, error, match):
    with pytest.raises(error, match=match):
        kvfuse.fused_qk_norm_rope_store_kv(**_kw(**change))


def test_mrope_positions_shape_and_dtype():
    kw = _kw()
    pos = kw["rope_args"].positions
    for bad, error, match in ((pos[0], ValueError, r"rope_args\.positions: with an mrope_section expected shape "
                                                   r"\(3, 5\)"),
                              (pos[:2], ValueError, r"expected shape \(3, 5\)"),
                              (pos.float(), TypeError, r"rope_args\.positions: expected dtype")):
        kw["rope_args"] = dataclasses.replace(kw["rope_args"], positions=bad)
        with pytest.raises(error, match=match):
            kvfuse.fused_qk_norm_rope_store_kv(**kw)


def test_the_fused_entry_rejects_mrope():
    x = torch.randn(4, 2, 128).to(torch.bfloat16)
    rope = kvfuse.RopeArgs(torch.zeros(3, 4, dtype=torch.int64), cos_sin_cache(8, 64), 64, True,
                           mrope_section=(8, 12, 12))
    with pytest.raises(ValueError, match=r"rope_args\.mrope_section: mRoPE is not supported by this entry point"):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, None, rope, out_args=kvfuse.ContiguousOutArgs())


@pytest.mark.parametrize("change,error,match", [
    (lambda kw: kw.update(v_norm_args=kvfuse.NormArgs(torch.ones(64))), ValueError,
     r"v_norm_args\.weight: expected shape \(128,\)"),
    (lambda kw: kw.update(v_norm_args=kvfuse.NormArgs(None, kind="layer")), ValueError, r"v_norm_args\.kind must be 'rms'"),
    (lambda kw: kw.update(v_norm_args=kvfuse.NormArgs(None, bias=torch.ones(128))), ValueError,
     r"v_norm_args\.bias must be None"),
    (lambda kw: kw.update(v_norm_args=kvfuse.NormArgs(None, eps=0.0)), ValueError, r"v_norm_args\.eps must be"),
    (lambda kw: kw.update(v_norm_args=torch.ones(128)), TypeError, r"v_norm_args must be a NormArgs"),
    (lambda kw: kw.update(v_norm_args=kvfuse.NormArgs(torch.ones(128, dtype=torch.int32))), TypeError,
     r"v_norm_args\.weight: expected dtype"),
    (lambda kw: kw.update(v_norm_args=kvfuse.NormArgs(None), v=None, v_cache=None, v_scale=None), ValueError,
     r"v_norm_args must be None when no V is written"),
    (lambda kw: kw.update(q_norm_args=kvfuse.NormArgs(None)), TypeError, r"q_norm_args\.weight must be a torch\.Tensor"),
])
def test_v_norm_validation(change, error, match):
    kw, _, _, _ = build(GQACase())
    change(kw)
    with pytest.raises(error, match=match):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)


# =============================================================================== models and helpers
def test_model_configurations():
    qwen25, qwen3, g_slide, g_glob = (models.get_gqa(n) for n in ("qwen2.5-vl-7b", "qwen3-vl-8b",
                                                                  "gemma-4-31b-sliding", "gemma-4-31b-global"))
    assert (qwen25.num_heads, qwen25.num_kv_heads, qwen25.head_dim, qwen25.rope_theta, qwen25.qk_norm) == \
        (28, 4, 128, 1e6, False)
    assert qwen25.mrope_section == (16, 24, 24) and not qwen25.mrope_interleaved
    assert (qwen3.num_heads, qwen3.num_kv_heads, qwen3.head_dim, qwen3.rope_theta, qwen3.qk_norm) == \
        (32, 8, 128, 5e6, True)
    assert qwen3.mrope_section == (24, 20, 20) and qwen3.mrope_interleaved
    assert (g_slide.num_kv_heads, g_slide.head_dim, g_slide.rope_theta, g_slide.v_norm) == (16, 256, 1e4, True)
    assert (g_glob.num_kv_heads, g_glob.head_dim, g_glob.rotary_dim, g_glob.rope_rotated) == (4, 512, 512, 64)
    for cfg in (g_slide, g_glob):
        assert cfg.norm_weight_offset == 0.0 and cfg.v_norm_args().weight is None and cfg.v_norm_args().eps == 1e-6
    assert qwen3.rope_args(torch.zeros(3, 2, dtype=torch.int64), cos_sin_cache(4, 128)).mrope_section == (24, 20, 20)
    with pytest.raises(ValueError, match="mrope_section"):
        dataclasses.replace(qwen3, mrope_section=(24, 20, 21))


def test_proportional_table():
    """Gemma 4's global layers: frequencies base^(-2j / 512) for j < 64, then cos 1, sin 0; the turning
    part equals the unscaled table over 512 dims."""
    t = proportional_cos_sin_cache(16, 512, 64, 1e6)
    full = cos_sin_cache(16, 512, 1e6)
    assert torch.equal(t[:, :64], full[:, :64]) and torch.equal(t[:, 256:320], full[:, 256:320])
    assert torch.equal(t[:, 64:256], torch.ones(16, 192)) and torch.equal(t[:, 320:], torch.zeros(16, 192))
    assert torch.equal(models.GEMMA4_31B_GLOBAL.cos_sin_cache(16), t)
    with pytest.raises(ValueError, match="rotated"):
        proportional_cos_sin_cache(4, 512, 257)


def test_position_helpers():
    text = mrope_text_positions(torch.tensor([5, 6, 7], dtype=torch.int32))
    assert text.shape == (3, 3) and text.dtype == torch.int32 and torch.equal(text[2], text[0])
    grid = mrope_grid_positions(4, 2, 2, 3)
    assert grid.shape == (3, 12)
    assert grid[:, 0].tolist() == [4, 4, 4] and grid[:, 5].tolist() == [4, 5, 6] and grid[:, 11].tolist() == [5, 5, 6]
    assert models.QWEN3_VL_8B.text_positions(torch.arange(3)).shape == (3, 3)
    assert models.LLAMA3_8B.text_positions(torch.arange(3)).shape == (3,)
    with pytest.raises(ValueError, match="grid_h"):
        mrope_grid_positions(0, 1, 0, 2)


@interpreter
@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen2.5-vl-7b", "gemma-4-31b-global"])
def test_store_kv_of_the_new_models(name):
    """GQAConfig.store_kv on a slice of each model (its head width, norms, mRoPE / proportional RoPE and
    V-norm; two KV heads): the kernel writes the reference's bytes, an image's grid positions included."""
    cfg = dataclasses.replace(models.get_gqa(name), num_heads=2, num_kv_heads=1)
    n, g = 6, torch.Generator().manual_seed(1)
    qkv = torch.randn(n, cfg.qkv_width, generator=g).to(torch.bfloat16)
    w = [torch.randn(cfg.head_dim, generator=g).to(torch.bfloat16) for _ in range(2)]
    positions = torch.arange(n) if cfg.mrope_section is None else \
        torch.cat([mrope_text_positions(torch.arange(2)), mrope_grid_positions(2, 1, 2, 2)], dim=1)
    cos_sin = cfg.cos_sin_cache(16)
    out = {}
    for backend in ("reference", "triton"):
        caches = [torch.zeros(2, 4, 1, cfg.head_dim, dtype=torch.bfloat16) for _ in range(2)]
        with kvfuse.use_backend(backend):
            q_out = cfg.store_kv(qkv, *caches, torch.arange(n), positions, cos_sin, *(w if cfg.qk_norm else ()))
        out[backend] = [q_out] + caches
    assert all(torch.equal(a, b) for a, b in zip(out["reference"], out["triton"]))
