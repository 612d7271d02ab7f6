"""Compile the Gluon fast paths' kernel variants for sm_90 on the CPU (no GPU needed) and print
one line per variant: a hash of its PTX (``ptx_check.code_fingerprint``) and a hash of the
constexprs the module's own host code chose for it (their values and Python types). A refactor
that must not change the kernels or their launches prints the same lines before and after; the
same spirit as ``ptx_check.py --fingerprint`` for the portable kernels.

Each variant is a validated plan (tests/kernel_cases.py) put through its module's launch code
(main_latent.launch_parts_records, flashmla.launch_parts, indexer.launch_args, with
the grid given so that nothing queries a device), plus a few constexprs set by hand where no CPU
plan reaches them (PDL, int64 slots or offsets, the fp32 e2m1 encoder). Compiled as a launch
specializes them: pointer types from the plan's tensors, pointers and 16-divisible integers
16-divisible. Needs Triton 3.6, the Gluon the kernels are written for (another refuses to run and
exits 2); a variant that does not compile prints ``n/a`` and its innermost error, and the script
exits 1. Run as a script, never under TRITON_INTERPRET; ``--constexprs`` also prints each variant's
constexprs."""
from __future__ import annotations

import hashlib
import inspect
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kvfuse import CastArgs, KVCacheFormat, formats as F  # noqa: E402
from kvfuse.kernels.gluon import indexer as GI, main_latent_fp4 as M4, main_latent as M8  # noqa: E402
from kvfuse.kernels.gluon import flashmla as MLA  # noqa: E402
from kvfuse.kernels.gluon.common import gluon  # noqa: E402
from kvfuse.kernels.launcher import PlanTensor, tensor_arg  # noqa: E402
from kernel_cases import FAST_CHAIN, FAST_MAIN, FAST_Q, Case, plan_of  # noqa: E402
from ptx_check import code_fingerprint  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
         torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
SM_COUNT = 132               # the grid is not part of the code: any fixed value avoids the device query


def _main(rec, case, nw=1, rpw=1, pipe=False, **force):
    plan = plan_of(case)
    x = plan.x[:, 0, :]
    _, args, consts, options = M8.launch_parts_records(
        rec, tensor_arg, x.shape[0], plan.eps, x, plan.weight, plan.positions, plan.cos_sin, plan.slot_mapping,
        plan.kv_cache, nw, rpw, pipe, ctas_per_sm=1, sm_count=SM_COUNT, neox=plan.is_neox)
    return M8.main_fp8_kernel, plan, args, {**consts, **force}, options


def _mla(case, nw=2, rpw=1, pipe=False, **force):
    plan = plan_of(case)
    _, args, consts, options = MLA.launch_parts(plan, tensor_arg, nw, rpw, pipe, ctas_per_sm=1, sm_count=SM_COUNT)
    return MLA.mla_tail_kernel, plan, args, {**consts, **force}, options


def _index(case, nw=4, rpt=1, pipe=False, **force):
    plan = plan_of(case)
    args, consts, options = GI.launch_args(plan, tensor_arg, nw, rpt, pipe)
    return GI.index_write_kernel, plan, args, {**consts, **force}, options


def variants():
    """(name, build) pairs; build() -> (kernel, plan, positional args, constexprs, options)."""
    m8 = dict(FAST_MAIN, fmt=F.MAIN_FP8)
    m4 = dict(FAST_MAIN, fmt=F.MAIN_FP4)
    mx8 = dict(FAST_MAIN, fmt=F.MAIN_MXFP8)
    cast_only = dict(norm=False, rope=False)
    v32 = dict(FAST_CHAIN, head_dim=576, fmt=F.FLASHMLA_V32)
    model1 = dict(FAST_CHAIN, head_dim=512, fmt=F.FLASHMLA_MODEL1)
    # V32's records without its scale_floor (a user format: FLOOR_E none)
    v32_nofloor = KVCacheFormat("V32_NO_FLOOR", 576, "e4m3", 128, "ue8m0_fp32", True, bf16_tail=64)
    ix = dict(FAST_CHAIN, head_dim=128)
    v32_indexer = dict(norm_kind="layer", bias=True, rope_offset=0, hadamard=True)    # DeepSeek V3.2's indexer K
    v4_indexer = dict(neox=False, hadamard=True)                                       # V4's
    from kvfuse.models import INDEX_FP8_UE8M0_FP32

    def q(fmt, **kw):
        return Case(**{**FAST_Q, "n": 3, "heads": 64, "cast": CastArgs.from_cache_format(fmt), **kw})

    yield "main_fp8", lambda: _main(M8.RECORDS, Case(n=1, **m8, seed=1))
    yield "main_fp8_w32_idx32", lambda: _main(M8.RECORDS, Case(n=3, **m8, seed=2, idx32=True, w_fp32=True))
    yield "main_fp8_gptj_4warps", lambda: _main(M8.RECORDS, Case(n=3, **{**m8, "neox": False}, seed=3), nw=4)
    yield "main_fp8_pipeline_bs24", lambda: _main(M8.RECORDS, Case(n=300, **m8, seed=4, block_size=24,
                                                                   num_blocks=16, cs_bf16=True), pipe=True)
    yield "main_fp8_pdl_slot64", lambda: _main(M8.RECORDS, Case(n=1, **m8, seed=5), PDL=True, SLOT32=False,
                                               OFFSETS32=False)
    yield "main_fp8_cast_only", lambda: _main(M8.RECORDS, Case(n=3, **m8, **cast_only, seed=6))
    yield "main_fp8_cast_only_pipeline", lambda: _main(M8.RECORDS, Case(n=3, **m8, **cast_only, seed=7),
                                                       pipe=True, PDL=True)
    # DeepSeek V4.1's 528-byte records (FLOOR_E -13)
    yield "main_mxfp8_gptj", lambda: _main(M8.RECORDS_MXFP8, Case(n=1, **{**mx8, "neox": False}, seed=15))
    yield "main_mxfp8_w32_pipeline_bs24", lambda: _main(M8.RECORDS_MXFP8, Case(n=300, **mx8, seed=16, block_size=24,
                                                                               num_blocks=16, w_fp32=True),
                                                        pipe=True, nw=4)
    yield "main_mxfp8_cast_only_pdl_slot64", lambda: _main(M8.RECORDS_MXFP8, Case(n=3, **mx8, **cast_only, seed=17),
                                                           PDL=True, SLOT32=False, OFFSETS32=False)
    yield "main_fp4", lambda: _main(M4.RECORDS, Case(n=1, **m4, seed=11), nw=2)
    yield "main_fp4_w32_gptj", lambda: _main(M4.RECORDS, Case(n=3, **{**m4, "neox": False}, seed=12, w_fp32=True,
                                                              cs_bf16=True, idx32=True))
    yield "main_fp4_cast_only", lambda: _main(M4.RECORDS, Case(n=3, **m4, **cast_only, seed=13))
    yield "main_fp4_cast_only_bs24_slot64", lambda: _main(M4.RECORDS, Case(n=3, **m4, **cast_only, seed=14,
                                                                           block_size=24, num_blocks=16),
                                                          SLOT32=False, OFFSETS32=False)
    yield "mla_v32", lambda: _mla(Case(n=1, **v32, seed=21))
    yield "mla_v32_2rows_idx32", lambda: _mla(Case(n=5, **v32, seed=22, idx32=True), rpw=2)
    yield "mla_v32_pipeline_gptj", lambda: _mla(Case(n=5, **{**v32, "neox": False}, seed=23), pipe=True)
    yield "mla_v32_no_floor_pdl", lambda: _mla(Case(n=5, **{**v32, "fmt": v32_nofloor}, seed=24), PDL=True)
    yield "mla_model1_w32_bs24", lambda: _mla(Case(n=5, **model1, seed=25, w_fp32=True, block_size=24,
                                                   num_blocks=16))
    yield "mla_model1_slot64", lambda: _mla(Case(n=5, **model1, seed=26), SLOT32=False, OFFSETS32=False)
    # x as two inputs (the quantized columns, the tail) and V32's norm over the latent only
    yield "mla_v32_split", lambda: _mla(Case(n=1, **v32, seed=27, split=512))
    yield "mla_v32_latent_norm_gptj", lambda: _mla(Case(n=5, **{**v32, "neox": False}, seed=28, norm_dim=512))
    yield "mla_v32_split_latent_norm_2rows", lambda: _mla(Case(n=5, **v32, seed=29, split=512, norm_dim=512),
                                                          rpw=2)
    yield "mla_model1_split_pipeline", lambda: _mla(Case(n=5, **model1, seed=30, split=448), pipe=True)
    # no norm (the engines' normalized latent), one input and two
    yield "mla_v32_no_norm_gptj", lambda: _mla(Case(n=5, **{**v32, "neox": False, "norm": False}, seed=35))
    yield "mla_v32_split_no_norm", lambda: _mla(Case(n=1, **{**v32, "norm": False}, seed=36, split=512))
    # no RoPE (vLLM's concat_and_cache_mla fp8_ds_mla, the context-parallel second pass), with and without a norm
    yield "mla_v32_split_cast_only", lambda: _mla(Case(n=5, **{**v32, "norm": False, "rope": False}, seed=37,
                                                       split=512))
    yield "mla_model1_norm_no_rope_pipeline", lambda: _mla(Case(n=5, **{**model1, "rope": False}, seed=38), pipe=True)
    for fmt in (F.INDEX_FP8_FP32, F.INDEX_MXFP8, F.INDEX_MXFP4, F.INDEX_NVFP4):
        yield f"index_{fmt.name}", lambda fmt=fmt: _index(Case(n=5, **ix, fmt=fmt, seed=31))
        yield f"index_{fmt.name}_v32_chain", lambda fmt=fmt: _index(Case(**{**ix, **v32_indexer}, n=5, fmt=fmt, seed=32))
        yield f"index_{fmt.name}_v4_chain", lambda fmt=fmt: _index(Case(**{**ix, **v4_indexer}, n=5, fmt=fmt, seed=33))
        yield f"index_{fmt.name}_q", lambda fmt=fmt: _index(q(fmt, seed=34))
    yield "index_ue8m0_fp32_v32_chain", lambda: _index(Case(**{**ix, **v32_indexer}, n=5,
                                                            fmt=INDEX_FP8_UE8M0_FP32, seed=35))
    yield "index_mxfp4_fp32_encoder_pipeline", lambda: _index(Case(n=5, **ix, fmt=F.INDEX_MXFP4, seed=36), rpt=2,
                                                              pipe=True, PACKED_E2M1=False)
    yield "index_nvfp4_w32_bs24_slot64_pdl", lambda: _index(Case(n=5, **ix, fmt=F.INDEX_NVFP4, seed=37, w_fp32=True,
                                                                 cs_bf16=True, block_size=24, num_blocks=16),
                                                            nw=2, SLOT32=False, OFFSETS32=False, PDL=True)
    yield "index_fp8_fp32_q_norm_w32", lambda: _index(q(F.INDEX_FP8_FP32, heads=4, norm=True, w_fp32=True, seed=38,
                                                        rope_offset=0, hadamard=True))


def compile_ptx(kernel, plan, args, consts, options):
    """The PTX of ``kernel`` for sm_90 with ``args`` (PlanTensors: the plan's tensors, x standing in for
    the ones it has not) and ``consts``."""
    from triton.experimental.gluon._runtime import GluonASTSource
    names = list(kernel.arg_names)
    # the constexprs after the positional arguments: named by the launch, or left to the kernel's defaults
    later = names[len(args):]
    assert [k for k in later if k in consts] == list(consts) and all(
        kernel.params[len(args) + i].default is not inspect.Parameter.empty
        for i, k in enumerate(later) if k not in consts), (names, list(consts))
    sig, attrs = {}, {}
    consts = {k: consts[k] if k in consts else kernel.params[len(args) + i].default for i, k in enumerate(later)}
    for i, (name, value) in enumerate(zip(names, args)):
        if value is None:                 # a None argument: a constexpr of its own (Triton's specialization)
            sig[name] = "constexpr"
            consts[name] = None
        elif isinstance(value, PlanTensor):
            t = getattr(plan, value.field, None)
            sig[name] = "*" + TYPES[(plan.x if t is None else t).dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0 and value and not kernel.params[i].do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in consts:
        sig[name] = "constexpr"
    src = GluonASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def constexpr_fingerprint(consts: dict) -> str:
    """A hash of the constexprs' names, values and Python types (a value that became another type of the
    same number, a tl.constexpr say, changes it)."""
    text = repr([(k, type(v).__name__, v) for k, v in consts.items()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


GLUON_TRITON = "3.6."         # the Triton whose Gluon API the fast paths are written for (gluon.common.available)


def main() -> int:
    if not triton.__version__.startswith(GLUON_TRITON) or gluon is None:
        print(f"gluon_fingerprint.py: the Gluon fast paths are built for Triton {GLUON_TRITON}x; this is Triton "
              f"{triton.__version__}{'' if gluon is not None else ' (no Gluon)'}: not fingerprinting")
        return 2
    show = "--constexprs" in sys.argv
    print(f"triton {triton.__version__}")
    failed = 0
    for name, build in variants():
        kernel, plan, args, consts, options = build()
        try:
            code = code_fingerprint(compile_ptx(kernel, plan, args, consts, options))
        except Exception as e:       # a variant that does not build: reported, and the exit status says so
            while e.__cause__ is not None:          # the compiler's errors wrap the one that says what
                e = e.__cause__
            last = (str(e).strip().splitlines() or [""])[-1]
            code = f"n/a ({type(e).__name__}: {last[:120]})"
            failed += 1
        print(f"{name:40s} constexprs {constexpr_fingerprint(consts)}  code {code}")
        if show:
            print("    ", consts)
    print(f"{failed} variant(s) not compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
