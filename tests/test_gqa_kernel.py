"""kvfuse/kernels/qkv.py through Triton's interpreter: fused_qk_norm_rope_store_kv on the "triton"
backend equals the reference chain byte for byte (SPEC §3), over whole cache storages with guard
bytes, block padding and random contents, a NaN-poisoned q_out buffer and the packed QKV input.

Features crossed: NHD / HND, bf16 / fp8 caches, NEOX / GPT-J / conjugate, full and partial rotary at
offsets, q / k norm on and off (bf16 and fp32 weights), in-place q, q_out allocated, packed-QKV views and
separate tensors, vLLM's kv_cache[:, 0] / [:, 1] views, Dv != D, int32 / int64 slots and positions with
invalid slots and out-of-range positions, head dims 64 / 128 / 256 and 1..16 heads, the int64 slot path,
and invariance under the tokens per program."""
import pytest
import torch

import kvfuse
from kvfuse.kernels import config, qkv
from gqa_cases import GQACase, build, diff_report, run_gqa_case

pytestmark = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")

CASES = {
    "nhd_bf16_neox": GQACase(),
    "hnd_bf16_neox": GQACase(layout="HND", seed=1),
    "nhd_fp8_neox": GQACase(fp8=True, seed=2),
    "hnd_fp8_gptj": GQACase(layout="HND", fp8=True, neox=False, seed=3),
    "nhd_bf16_gptj_conj": GQACase(neox=False, conjugate=True, seed=4),
    "partial_rotary_neox_offset": GQACase(rotary_dim=64, rope_offset=32, seed=5),
    "partial_rotary_gptj_default_offset": GQACase(rotary_dim=32, neox=False, fp8=True, seed=6),
    "no_norms": GQACase(q_norm=None, k_norm=None, seed=7),
    "q_norm_only_no_rope": GQACase(k_norm=None, rotary_dim=0, layout="HND", seed=8),
    "k_norm_only_bf16_cos_sin": GQACase(q_norm=None, k_norm="bf16", cos_sin="bf16", seed=9),
    "inplace_fp8": GQACase(inplace=True, fp8=True, seed=10),
    "inplace_gptj_hnd": GQACase(inplace=True, neox=False, layout="HND", seed=11),
    "q_out_allocated": GQACase(q_out_none=True, seed=12),
    "separate_tensors_int32": GQACase(packed=False, idx32=True, seed=13),
    "vllm_kv_views_nhd_fp8": GQACase(cache="vllm", fp8=True, seed=14),
    "vllm_kv_views_hnd": GQACase(cache="vllm", layout="HND", idx32=True, seed=15),
    "dv_ne_d": GQACase(d=64, dv=128, hq=2, hkv=1, seed=16),
    "d64_mha": GQACase(d=64, hq=3, hkv=3, neox=False, seed=17),
    "d256_fp8": GQACase(d=256, hq=2, hkv=1, fp8=True, layout="HND", seed=18),
    "d80_not_pow2": GQACase(d=80, hq=2, hkv=1, rotary_dim=40, fp8=True, seed=19),
    "heads_16_16": GQACase(n=3, hq=16, hkv=16, d=64, seed=20),
    "heads_16_1_contiguous_slots": GQACase(n=3, hq=16, hkv=1, d=64, slots="contiguous", block_size=1, seed=21),
    "per_head_scales_kv": GQACase(hq=6, hkv=3, fp8=True, scale_per_head="kv", seed=22),
    "per_head_k_scale_rows_hnd": GQACase(hq=4, hkv=4, d=64, rotary_dim=32, fp8=True, layout="HND",
                                         scale_per_head="k", seed=23),
    # heads as two tensors, fp8 q_out, the multiply convention, scales as numbers, a K cache alone
    "split_fp8_q_multiply_numbers": GQACase(split=64, rotary_dim=64, q_norm=None, k_norm=None, fp8=True, q_fp8=True,
                                            numerics="fused_fp32_cast", scale_convention="multiply",
                                            scale_numbers=True, seed=24),
    "mla_split_caches_k_only_gptj": GQACase(d=576, hq=3, hkv=1, split=64, rotary_dim=64, neox=False, q_norm=None,
                                            k_norm=None, fp8=True, q_fp8=True, k_cache_split=True, v_cache=False,
                                            numerics="fused_fp32_cast", scale_convention="multiply", seed=25),
    "split_no_cache_fp8_k_out_fp16": GQACase(split=48, dtype="fp16", kv_cache=False, q_fp8=True, k_out_fp8=True,
                                             rotary_dim=64, rope_offset=32, seed=26),
    "split_norm_bf16_cache_in_place": GQACase(split=96, inplace=True, layout="HND", seed=27),
    "split_cache_bf16_with_v": GQACase(split=40, k_cache_split=True, neox=False, seed=28),
    "k_only_bf16_staged": GQACase(v_cache=False, hq=0, seed=29),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_per_head_scales_are_each_heads_per_tensor_cast(backend):
    """A scale per kv head casts head h exactly as a call of that head alone with scale[h] as its one
    per-tensor scale does (SPEC §3): the semantics, checked head by head on each backend."""
    case = GQACase(n=6, hq=3, hkv=3, fp8=True, scale_per_head="kv", layout="NHD", seed=24, cache="guarded")
    kw, _, _, _ = build(case)
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
        for h in range(case.hkv):
            one = {k: v for k, v in kw.items()}
            kc, vc = (torch.full_like(kw[c][:, :, h:h + 1].contiguous().view(torch.uint8), 0xAB).view(torch.float8_e4m3fn)
                      for c in ("k_cache", "v_cache"))
            one.update(q=kw["q"][:, :0], q_out=None, k=kw["k"][:, h:h + 1], v=kw["v"][:, h:h + 1], k_cache=kc,
                       v_cache=vc, k_scale=kw["k_scale"][h:h + 1], v_scale=kw["v_scale"][h:h + 1])
            kvfuse.fused_qk_norm_rope_store_kv(**one)
            slots = kw["slot_mapping"].long()
            bs = kc.shape[1]
            valid = (slots >= 0) & (slots < kc.shape[0] * bs)
            s = slots[valid]
            for name, alone in (("k_cache", kc), ("v_cache", vc)):
                got = kw[name][s // bs, s % bs, h].view(torch.uint8)
                want = alone[s // bs, s % bs, 0].view(torch.uint8)
                assert torch.equal(got, want), f"{name} head {h}"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference(name):
    case = CASES[name]
    ref = run_gqa_case(case, "reference")
    tri = run_gqa_case(case, "triton")
    report = diff_report(ref, tri)
    assert not report, f"{case.describe()}: {report}"


def test_kernel_writes_something():
    """A control for the comparisons above: the call changes the caches and q_out (a no-op kernel
    would fail here, not pass everywhere)."""
    case = GQACase(fp8=True, seed=30)
    kw_before = run_gqa_case(case, "reference", fn=lambda **kw: kw["q_out"])    # nothing written
    after = run_gqa_case(case, "triton")
    for name in ("cache_storage0", "cache_storage1", "q_out"):
        assert not torch.equal(kw_before[name], after[name]), name


INVARIANCE_CASES = {
    "gptj_inplace": GQACase(n=5, hq=6, hkv=3, fp8=True, neox=False, inplace=True, seed=31),
    "halves_inplace": GQACase(n=5, hq=6, hkv=3, fp8=True, inplace=True, seed=33),
    "halves_no_norm_hnd": GQACase(n=5, hq=6, hkv=3, layout="HND", q_norm=None, k_norm=None, seed=34),
}


@pytest.mark.parametrize("block_m,heads", [(1, 1), (2, 1), (1, 2), (2, 3), (4, 8)])
@pytest.mark.parametrize("name", list(INVARIANCE_CASES))
def test_tokens_and_heads_per_program_do_not_change_bytes(name, block_m, heads):
    """A token's bytes do not depend on the tokens or heads per program (the GPU's launch table picks
    one of one head at decode sizes, more above; the interpreter as many tokens as fit and 4 heads):
    forced here, with a partial last block of tokens and partial head groups (6 q and 3 kv heads)."""
    case = INVARIANCE_CASES[name]
    ref = run_gqa_case(case, "reference")
    with config.force_config(block_m=block_m, heads=heads):
        tri = run_gqa_case(case, "triton")
    assert not diff_report(ref, tri)


@pytest.mark.parametrize("name", list(INVARIANCE_CASES))
def test_heads_loaded_before_any_store(name):
    """A program loads every one of its heads' rows before its first store: the bytes are the
    reference's, in place included (q_out = q: head g's store must not reach a row another head still
    reads), with partial head groups (3 heads a program over 6 q and 3 kv heads)."""
    case = INVARIANCE_CASES[name]
    ref = run_gqa_case(case, "reference")
    with config.force_config(block_m=2, heads=3):
        tri = run_gqa_case(case, "triton")
    assert not diff_report(ref, tri)


@pytest.mark.parametrize("scales", [(2.0 ** -64, 2.0 ** 64), (-3.0e-20, 2.5e19), (1.0, -0.75), (7.1e-4, 1.0e6)])
def test_fp8_scales_both_division_paths(scales):
    """The per-tensor cast divides by the scale's reciprocal with Markstein's correction for
    2^-64 <= scale <= 2^64 (the bounds themselves: first case) and element by element outside them
    (a negative scale, or just past a bound: second and third cases); both give the bytes of the IEEE
    division (SPEC §3). The k and v values (helpers.random_bf16: normal, outlier channels, bf16
    subnormals, signed zeros) against these scales give saturated codes, e4m3 subnormals and signed
    zeros; the division's proof over every bf16 value is offline (docs/design.md)."""
    case = GQACase(n=6, hq=4, hkv=2, fp8=True, scales=scales, seed=40)
    assert not diff_report(run_gqa_case(case, "reference"), run_gqa_case(case, "triton"))


def test_halves_mode_choice():
    """The two-halves form serves NEOX RoPE over the whole row; GPT-J, partial rotary, an offset and
    no RoPE take the general form (both proven above and in the GPU matrix)."""
    def halves(**kw):
        return qkv.launch_args(_plan(GQACase(**kw)))[2]["HALVES"]
    assert halves() and halves(d=64) and halves(d=256, hq=2, hkv=1)
    assert not halves(neox=False)
    assert not halves(rotary_dim=64)
    assert not halves(rotary_dim=64, rope_offset=64)
    assert not halves(rotary_dim=0)
    assert not halves(d=80, hq=2, hkv=1, rotary_dim=80)
    # a 4-bit K cache: where each half holds whole groups of its format (16 for NVFP4, 32 for MXFP4)
    assert halves(fp4_k="nvfp4") and halves(fp4_k="mxfp4") and halves(d=64, fp4_k="mxfp4")
    assert halves(d=32, hq=2, hkv=1, fp4_k="nvfp4") and not halves(d=32, hq=2, hkv=1, fp4_k="mxfp4")


@pytest.mark.parametrize("case", [GQACase(d=32, hq=2, hkv=1, fp4_k="nvfp4", seed=61),
                                  GQACase(d=32, hq=2, hkv=1, fp4_k="mxfp4", fp4_v="nvfp4", seed=62),
                                  GQACase(d=64, n=9, fp4_k="mxfp4", layout="HND", numerics="fused_fp32_cast", seed=63),
                                  GQACase(n=3, fp4_k="nvfp4", fp4_v="mxfp4", numerics="fused", q_norm=None, seed=64)],
                         ids=lambda c: c.describe())
def test_fp4_k_halves_form_equals_reference(case):
    """A 4-bit K cast half by half (the halves form) writes the reference's bytes, at head widths where the
    halves hold whole groups and where they do not (the whole-row form then)."""
    assert not diff_report(run_gqa_case(case, "reference"), run_gqa_case(case, "triton"))


def test_int64_slot_path(monkeypatch):
    """Caches of 2^31 slots or more take the int64 slot division: exercised by lowering the bound."""
    monkeypatch.setattr(config, "INT32_LIMIT", 4)
    case = GQACase(layout="HND", fp8=True, seed=32)
    _, _, options = qkv.launch_args(_plan(case))
    assert options["SLOT32"] is False
    assert not diff_report(run_gqa_case(case, "reference"), run_gqa_case(case, "triton"))


def _plan(case):
    from gqa_cases import build
    kw, _, _, _ = build(case)
    plan = kvfuse.plans.gqa.validate(**kw)
    plan.q_out = kw["q"]
    return plan


def test_wide_tile_table_is_indexed_by_rows():
    """Tiles of 512 and more (MLA's 576-d heads): one row a program below 1024 tokens x heads, then 4."""
    for block_d in (512, 1024):
        assert qkv.launch_table(block_d) == ((1, (1, 1, 1)), (1024, (4, 1, 1)))
        assert qkv.launch_config(1023, block_d, 1, interpret=False) == (1, 1, 1)
        assert qkv.launch_config(1024, block_d, 1, interpret=False) == (4, 1, 1)
        assert qkv.launch_config(8, block_d, 128, interpret=False) == (4, 1, 1)
        assert qkv.launch_config(7, block_d, 128, interpret=False) == (1, 1, 1)


def test_launch_table_shapes():
    """The GPU launch table (the GPU matrix runs every entry): one token of one head at n = 1, then two
    tokens of ~512 elements a program, ~1024 from 192 tokens for heads up to 128 wide; one warp; G
    never exceeds the call's heads."""
    for block_d, g_small, g_large in ((64, 4, 8), (128, 2, 4), (256, 1, 1)):
        table = qkv.launch_table(block_d)
        assert table == ((1, (1, 1, 1)), (2, (2, g_small, 1)), (192, (2, g_large, 1)))
        assert qkv.launch_config(1, block_d, 8, interpret=False) == (1, 1, 1)
        assert qkv.launch_config(2, block_d, 8, interpret=False) == (2, g_small, 1)
        assert qkv.launch_config(191, block_d, 8, interpret=False) == (2, g_small, 1)
        assert qkv.launch_config(192, block_d, 8, interpret=False) == (2, g_large, 1)
        assert qkv.launch_config(65536, block_d, 32, interpret=False) == (2, g_large, 1)
        assert qkv.launch_config(65536, block_d, 1, interpret=False) == (2, 1, 1)
        assert qkv.launch_config(65536, block_d, 3, interpret=False) == (2, min(g_large, 4), 1)
    # caches whose scales the kernel stores (4-bit, per (token, head)): 4 tokens of one head a program from 192
    # tokens, up to 128-d heads
    for block_d, stored_large in ((64, (4, 1, 1)), (128, (4, 1, 1)), (256, (2, 1, 1))):
        assert qkv.launch_config(191, block_d, 8, interpret=False, stored_scale=True) == \
            qkv.launch_config(191, block_d, 8, interpret=False)
        assert qkv.launch_config(192, block_d, 8, interpret=False, stored_scale=True) == stored_large


@pytest.mark.parametrize("k_format,hq,stored", [
    ("fp8_per_token_head", 6, True), ("int8_per_token_head", 6, True),     # a call with q heads
    ("fp8_per_token_head", 0, False),                                      # a cache write alone (vLLM's writer)
    ("nvfp4", 0, True), ("mxfp4", 6, True),                                # 4-bit caches: always
    ("fp8_e4m3", 6, False), ("auto", 6, False),
])
def test_stored_scale_table_by_format_and_q_heads(monkeypatch, k_format, hq, stored):
    """launch_args asks for the stored-scale launch table (qkv.launch_table(d, stored_scale=True)) for a 4-bit
    cache, and for a per-(token, head) cache only in a call with q heads."""
    from gqa_cases import GQACase
    from gqa_format_cases import FormatCase, run_format_case
    from kvfuse.plans.cache import clear_plan_cache
    asked = []
    real = qkv.launch_config

    def spy(*args, **kwargs):
        asked.append(kwargs.get("stored_scale", False))
        return real(*args, **kwargs)
    monkeypatch.setattr(qkv, "launch_config", spy)
    clear_plan_cache()
    extra = dict(q_norm=None, k_norm=None, rotary_dim=0) if hq == 0 else {}
    case = GQACase(n=3, d=128, hq=hq, hkv=2, seed=11, **extra)
    run_format_case(FormatCase(case, k_format, k_format), "triton")
    assert asked and set(asked) == {stored}
