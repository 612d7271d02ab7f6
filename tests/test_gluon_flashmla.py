"""kvfuse/kernels/gluon/flashmla.py on the CPU: which calls the Gluon FlashMLA fast path takes
(``eligible``: the FLASHMLA_V32 and FLASHMLA_MODEL1 chains and user formats with the same records,
not their neighbours), the per-call word alignment, the launch table, the launch interface kvfuse's
dispatch and direct launcher rely on, and that the module imports and stays off unless asked for
with Triton 3.6 + CUDA (unless KVFUSE_GLUON=0 or KVFUSE_GLUON_SKIP names it). The kernel itself runs only on the H200
(tests/gpu/test_gpu_fast_paths.py; Gluon has no interpreter)."""
from __future__ import annotations

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheFormat
from kvfuse.kernels import router as fused_kernels
from kvfuse.kernels.gluon import flashmla as G
from kvfuse.kernels.launcher import PlanTensor, tensor_arg
from kernel_cases import Case, plan_of

V32 = kvfuse.formats.FLASHMLA_V32
MODEL1 = kvfuse.formats.FLASHMLA_MODEL1
TENSOR_FIELDS = {"x", "weight", "positions", "cos_sin", "slot_mapping", "kv_cache"}


def mla_case(fmt, **kw):
    """The fast path's chain: norm, NEOX RoPE on the 64 tail columns, a FlashMLA cache, no stage copy."""
    base = dict(n=5, heads=1, head_dim=fmt.head_dim, fmt=fmt, rotary_dim=64, neox=True, out_stage=None)
    return Case(**{**base, **kw})


BOTH = pytest.mark.parametrize("fmt", [V32, MODEL1], ids=["V32", "MODEL1"])


@BOTH
def test_the_flashmla_chains_are_eligible(fmt):
    assert G.eligible(plan_of(mla_case(fmt)))
    assert G.eligible(plan_of(mla_case(fmt, w_fp32=True, cs_bf16=True, idx32=True, block_size=24, x2d=True)))
    assert G.eligible(plan_of(mla_case(fmt, block_size=1, num_blocks=9, block_padding=64, x_row_pad=16)))
    assert G.eligible(plan_of(mla_case(fmt, neox=False)))                # GPT-J on the tail (DeepSeek)


def test_padded_token_stride_is_eligible():
    assert G.eligible(plan_of(mla_case(V32, token_padding=32)))


@BOTH
@pytest.mark.parametrize("change", [
    dict(out_stage="transform"), dict(out_stage="cast_back"), dict(out_stage="norm"),   # a stage copy
    dict(norm_kind="layer"), dict(neox=False, rope_offset=0), dict(conjugate=True), dict(rotary_dim=32), dict(rope_offset=0),
    dict(x_row_pad=1),                                                                    # odd x row stride
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_neighbour_chains_are_not(fmt, change):
    assert not G.eligible(plan_of(mla_case(fmt, **change)))


def test_hadamard_and_two_heads_are_not():
    assert not G.eligible(plan_of(mla_case(MODEL1, hadamard=True)))   # 576 is not a power of two: V32 can't
    assert not G.eligible(plan_of(mla_case(V32, heads=2)))             # block-wide MODEL1 has one head


@pytest.mark.parametrize("fmt", [f for f in kvfuse.formats.PRESETS.values() if f not in (V32, MODEL1)],
                         ids=lambda f: f.name)
def test_other_presets_are_not(fmt):
    rope_ok = fmt.head_dim >= 64
    case = mla_case(fmt, rotary_dim=64 if rope_ok else 32)
    assert not G.eligible(plan_of(case))


def test_user_formats_with_the_same_records_are_eligible():
    same_v32 = KVCacheFormat("MY_V32", 576, "e4m3", 128, "ue8m0_fp32", True, bf16_tail=64)
    same_model1 = KVCacheFormat("MY_MODEL1", 512, "e4m3", 64, "ue8m0", False, sf_bytes=8, bf16_tail=64)  # alignment 32
    assert G.eligible(plan_of(mla_case(same_v32)))
    assert G.eligible(plan_of(mla_case(same_model1)))


@pytest.mark.parametrize("fmt", [
    KVCacheFormat("V32_RESERVED", 576, "e4m3", 128, "ue8m0_fp32", True, sf_bytes=20, bf16_tail=64),  # other records
    KVCacheFormat("V32_G64", 576, "e4m3", 64, "ue8m0_fp32", True, bf16_tail=64),
    KVCacheFormat("V32_BYTE_SCALES", 576, "e4m3", 128, "ue8m0", True, bf16_tail=64),
    KVCacheFormat("V32_BLOCKWIDE", 576, "e4m3", 128, "ue8m0_fp32", False, bf16_tail=64),
    KVCacheFormat("MODEL1_TI", 512, "e4m3", 64, "ue8m0", True, sf_bytes=8, bf16_tail=64),
    KVCacheFormat("MODEL1_EXACT_SF", 512, "e4m3", 64, "ue8m0", False, bf16_tail=64),                  # 7 scale bytes
    KVCacheFormat("MODEL1_FP32_SCALES", 512, "e4m3", 64, "fp32", False, bf16_tail=64),
    KVCacheFormat("TAIL_128", 512, "e4m3", 64, "ue8m0", False, sf_bytes=8, bf16_tail=128),
], ids=lambda f: f.name)
def test_user_formats_with_other_records_are_not(fmt):
    assert not G.eligible(plan_of(mla_case(fmt)))


def test_custom_tail_format_of_the_kernel_cases_is_not():
    tail320 = next(f for f in __import__("kernel_cases").CUSTOM_FORMATS if f.name == "TI_TAIL_D320")
    assert not G.eligible(plan_of(mla_case(tail320)))


@BOTH
def test_a_cache_pointer_not_4_byte_aligned_is_not(fmt):
    plan = plan_of(mla_case(fmt))
    cache = plan.kv_cache
    storage = torch.zeros(cache.untyped_storage().nbytes() + 64, dtype=torch.uint8)
    for offset, ok in ((0, True), (4, True), (2, False), (1, False)):
        plan.kv_cache = torch.as_strided(storage, cache.shape, cache.stride(), offset)
        assert G.eligible(plan) is ok, offset


def test_launch_table():
    assert G.launch_table(1) == (2, 1, False) and G.launch_table(4096) == (2, 1, False)
    assert G.launch_table(16384) == (2, 1, False)
    assert G.launch_table(16385) == (2, 2, False) and G.launch_table(262144) == (2, 2, False)
    for n in (1, 2, 300, 513, 4097, 16385, 1 << 20):
        num_warps, rows_per_warp, pipeline = G.launch_table(n)
        assert num_warps in (1, 2, 4, 8) and rows_per_warp in (1, 2, 4) and isinstance(pipeline, bool)


def _kernel_params():
    kernel = G.mla_tail_kernel
    return kernel.arg_names, [p.is_constexpr for p in kernel.params]


@BOTH
def test_launch_parts_fill_every_parameter_in_order(fmt):
    """Positional args cover exactly the non-constexpr parameters (all first), keyword args the
    constexprs (kvfuse's direct launcher relies on both); tensors go where the plan's fields say."""
    plan = plan_of(mla_case(fmt, n=300, block_size=16, num_blocks=30))
    names, is_constexpr = _kernel_params()
    n_args = is_constexpr.index(True)
    assert not any(is_constexpr[:n_args]) and all(is_constexpr[n_args:])
    grid, args, constexprs, options = G.launch_parts(plan, tensor_arg, *G.launch_table(300), ctas_per_sm=4,
                                                     sm_count=132)
    assert len(args) == n_args
    # one input, the norm over the whole record: the input and norm constexprs left to the kernel's defaults,
    # and above PDL_EARLY_MAX_ROWS rows the early reads' (named, off, up to it: below)
    assert set(constexprs) == set(names[n_args:]) - {"SPLIT_X", "LATENT_NORM", "NO_NORM", "NO_ROPE", "PDL_EARLY"}
    assert options["enable_fp_fusion"] is False and options["num_stages"] == 1
    fields = {a.field for a in args if isinstance(a, PlanTensor)}
    assert fields == TENSOR_FIELDS
    by_name = dict(zip(names, args))
    a = plan.addressing
    assert by_name["x_ptr"] == tensor_arg("x") and by_name["cache_ptr"] == tensor_arg("kv_cache")
    assert by_name["sx_w"] * 2 == plan.x.stride(0)
    assert (by_name["data_tok"], by_name["sf_tok"], by_name["sf_off"], by_name["tail_off"]) == (
        a.data_token_stride, a.sf_token_stride, a.sf_offset, a.tail_offset)
    assert by_name["capacity"] == plan.kv_cache.shape[0] * plan.kv_cache.shape[1] and by_name["n_rows"] == 300
    assert constexprs["LOG2_BLOCK"] == 4 and constexprs["SLOT32"] and constexprs["OFFSETS32"]
    assert (constexprs["QUANT_DIM"], constexprs["GROUP"], constexprs["SF_FP32"]) == (
        (512, 128, True) if fmt is V32 else (448, 64, False))
    assert grid == (150,)                           # 300 rows in tiles of 2 (two one-row warps)
    # a non-power-of-two block size divides; every argument but the tensors is a plain number
    plan24 = plan_of(mla_case(fmt, n=50, block_size=24))
    _, args24, constexprs24, _ = G.launch_parts(plan24, tensor_arg, 1, 1, False, ctas_per_sm=1, sm_count=8)
    assert constexprs24["LOG2_BLOCK"] == -1 and constexprs24["PDL_EARLY"] is False   # 50 rows: the early reads named
    assert all(isinstance(v, (int, float, PlanTensor)) for v in args24[:-2]) and args24[-2:] == (None, None)


@BOTH
def test_plan_launch_shape(fmt, monkeypatch):
    plan = plan_of(mla_case(fmt, n=7))
    real = G.launch_parts
    # no device here: a fixed occupancy (2 CTAs on each of 4 SMs) instead of compiling the kernel
    monkeypatch.setattr(G, "launch_parts", lambda *a: real(*a, ctas_per_sm=2, sm_count=4))
    name, grid, args, kwargs, namespace = G.plan_launch(plan, tensor_arg)
    assert name == "mla_tail_kernel" and namespace[name] is G.mla_tail_kernel
    assert grid == (4,) and kwargs["num_warps"] == 2 and kwargs["PIPELINE"] is False   # 7 rows, tiles of 2
    # every constexpr named (kvfuse.kernels.launcher's direct launch takes them by name), defaults included
    names, is_constexpr = _kernel_params()
    assert {k for k, c in zip(names, is_constexpr) if c} <= set(kwargs)
    assert kwargs["SPLIT_X"] is False and kwargs["LATENT_NORM"] is False


@BOTH
def test_two_inputs_split_at_the_quantized_part_are_eligible(fmt):
    q = fmt.quant_dim
    assert G.eligible(plan_of(mla_case(fmt, split=q)))
    assert G.eligible(plan_of(mla_case(fmt, split=q, neox=False, x2d=True, w_fp32=True, x_row_pad=16)))
    assert not G.eligible(plan_of(mla_case(fmt, split=q - 64)))           # the tail's words from x's pointer
    assert not G.eligible(plan_of(mla_case(fmt, split=q, x_row_pad=1)))   # odd row strides
    plan = plan_of(mla_case(fmt, split=q, n=300, block_size=16, num_blocks=30))
    grid, args, constexprs, _ = G.launch_parts(plan, tensor_arg, *G.launch_table(300), ctas_per_sm=4, sm_count=132)
    by_name = dict(zip(_kernel_params()[0], args))
    assert by_name["xt_ptr"] == tensor_arg("x_tail") and by_name["sxt_w"] * 2 == plan.x_tail.stride(0)
    assert constexprs["SPLIT_X"] is True and "LATENT_NORM" not in constexprs


def test_the_latent_only_norm_is_eligible_for_v32_only():
    for kw in (dict(norm_dim=512), dict(norm_dim=512, split=512), dict(norm_dim=512, neox=False, w_fp32=True)):
        plan = plan_of(mla_case(V32, **kw))
        assert G.eligible(plan), kw
        _, _, constexprs, _ = G.launch_parts(plan, tensor_arg, 2, 1, False, ctas_per_sm=1, sm_count=8)
        assert constexprs["LATENT_NORM"] is True and constexprs.get("SPLIT_X", False) == ("split" in kw)
    for norm_dim in (448, 480, 64):
        assert not G.eligible(plan_of(mla_case(V32, norm_dim=norm_dim))), norm_dim
    assert not G.eligible(plan_of(mla_case(MODEL1, norm_dim=448)))


@BOTH
def test_no_norm_is_eligible(fmt):
    """The engines hand the latent normalized (vLLM's concat_and_cache_mla, FlashInfer's MLA append): no
    norm is one of the chains (NO_NORM), one input or two; the weight pointer is None and the call
    guard checks x (and the tail input) only."""
    q = fmt.quant_dim
    for kw in (dict(norm=False), dict(norm=False, split=q), dict(norm=False, neox=False, x2d=True)):
        plan = plan_of(mla_case(fmt, **kw))
        assert G.eligible(plan), kw
        _, args, constexprs, _ = G.launch_parts(plan, tensor_arg, 2, 1, False, ctas_per_sm=1, sm_count=8)
        assert constexprs["NO_NORM"] is True and "LATENT_NORM" not in constexprs and not constexprs["W_BF16"]
        assert dict(zip(_kernel_params()[0], args))["w_ptr"] is None
        check, fields = G.call_guard(plan)
        assert fields == ("x", "x_tail" if "split" in kw else "x")
        assert check(plan.x, plan.x if plan.x_tail is None else plan.x_tail)
        assert not check(torch.zeros(8, dtype=torch.bfloat16)[1:], plan.x)


@BOTH
def test_no_rope_is_eligible(fmt):
    """No RoPE (vLLM's concat_and_cache_mla fp8_ds_mla: the cast alone; the context-parallel second pass):
    NO_ROPE, with or without the norm, one input or two; positions and the cos/sin table are None."""
    q = fmt.quant_dim
    for kw in (dict(rope=False), dict(norm=False, rope=False, split=q), dict(rope=False, norm=False, x2d=True)):
        plan = plan_of(mla_case(fmt, **kw))
        assert G.eligible(plan), kw
        _, args, constexprs, _ = G.launch_parts(plan, tensor_arg, 2, 1, False, ctas_per_sm=1, sm_count=8)
        assert constexprs["NO_ROPE"] is True and constexprs.get("NO_NORM", False) == ("norm" in kw)
        by_name = dict(zip(_kernel_params()[0], args))
        assert by_name["pos_ptr"] is None and by_name["cs_ptr"] is None and by_name["P"] == 0


def test_two_inputs_need_every_pointer_word_aligned():
    """x, its tail input and the weight are read as 4-byte words: the call guard checks all three."""
    plan = plan_of(mla_case(V32, split=512))
    check, fields = G.call_guard(plan)
    assert fields == ("x", "weight", "x_tail")
    x, w, xt = plan.x, plan.weight, plan.x_tail
    assert check(x, w, xt)
    buf = torch.zeros(2 * 600, dtype=torch.bfloat16)
    assert not check(x, w, buf[1:65])
    assert G.call_guard(plan_of(mla_case(V32)))[1] == ("x", "weight")


def test_dispatch_takes_both_formats_but_not_a_conjugate_rope():
    """(The dispatch rules every fast path shares: tests/test_gluon_dispatch.py.)"""
    with fused_kernels.fast_paths(only=G):
        assert fused_kernels.fast_path(plan_of(mla_case(MODEL1))) is G
        assert fused_kernels.fast_path(plan_of(mla_case(MODEL1, conjugate=True))) is None


def test_main_fp8_is_not_taken_by_this_path_nor_the_mla_chains_by_main_fp8():
    from kvfuse.kernels.gluon import main_latent
    main = Case(n=5, heads=1, head_dim=512, fmt=kvfuse.formats.MAIN_FP8, rotary_dim=64, neox=True)
    assert main_latent.eligible(plan_of(main)) and not G.eligible(plan_of(main))
    for fmt in (V32, MODEL1):
        assert not main_latent.eligible(plan_of(mla_case(fmt)))


def test_off_without_triton_36_and_cuda(monkeypatch):
    if not torch.cuda.is_available():
        assert not G.available() and not G.enabled()
    assert G not in fused_kernels.FAST_PATHS or torch.cuda.is_available()


def test_both_formats_have_constexprs():
    """(The Plan / RecordAddressing fields it reads: tests/test_gluon_dispatch.py.)"""
    for fmt in (V32, MODEL1):
        assert G.format_constexprs(fmt) is not None
        assert CastArgs.from_cache_format(fmt).num_per_channels == fmt.elements_per_sf
