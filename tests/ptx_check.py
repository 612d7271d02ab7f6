"""Compile kernel variants for sm_90 on the CPU (no GPU needed) and scan the PTX for
non-IEEE arithmetic: contracted multiply-adds (fma; the GQA cast's explicit ones are told apart by a
bf16 twin, _gqa_fp8_fma_findings), approximate ops (.approx) and div.full;
and, for the hot cache writes, that the record stores stay vectorized (Triton 3.6 once turned
them all into byte stores: docs/performance.md). Variants compile as a launch specializes
them: 16-divisible pointers and row strides, 32-bit integers. Run as a script (it must not run
under TRITON_INTERPRET): prints one line per variant, exits 1 on any finding. ``--fingerprint``
prints a hash of each variant's code instead: a refactor that must not change the kernels prints
the same hashes before and after."""
from __future__ import annotations

import hashlib
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvfuse.kernels import portable as F  # noqa: E402
from kvfuse.kernels import grouped as G  # noqa: E402
from kvfuse.kernels import qkv as Q  # noqa: E402
from kvfuse.kernels import store_load as SL  # noqa: E402

BAD = re.compile(r"\bfma\.|\.approx|div\.full")
PTR_TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "out_ptr": "*bf16",
             "q_ptr": "*u8", "sf_ptr": "*u8", "slot_ptr": "*i64", "cache_ptr": "*u8", "data_ptr": "*u8",
             "tail_ptr": "*u8", "sf_out_ptr": "*u8", "xt_ptr": "*bf16",
             # the GQA kernel (kvfuse/kernels/qkv.py)
             "k_ptr": "*bf16", "v_ptr": "*bf16", "qo_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
             "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
FLOATS = ("eps", "had_scale", "q_eps", "k_eps", "v_eps")
DIVISIBLE_BY_16 = ("sx_n", "sx_h", "sxt_n", "sxt_h", "s_cs", "so_n", "so_h", "sq_n", "sq_h", "s_blk",   # as in the benchmark's calls
                   "sk_n", "sk_h", "sv_n", "sv_h", "kc_blk", "kc_tok", "kc_head", "vc_blk", "vc_tok", "vc_head",
                   "sq2_n", "sq2_h", "sk2_n", "sk2_h", "so2_n", "so2_h", "kd2_blk", "kd2_tok", "kd2_head")
STORE = re.compile(r"\b(st\.global(?:\.[a-z0-9]+)+)")
# variant -> (the store that must be there, at least how many, at most how many byte stores)
WIDE_STORES = {"main_fp8": ("st.global.b32", 8, 4), "main_fp8_decode": ("st.global.b32", 4, 5), "main_fp4+cast_back": ("st.global.v4.b32", 4, 8),
               "bf16_out_rope_only": ("st.global.v4.b32", 4, 0),
               # GQA: q_out and bf16 records in 16-byte stores, e4m3 records in 8-byte ones (4 at one row per warp)
               "gqa_fp8_neox_decode": ("st.global.b32", 2, 0), "gqa_fp8_neox_heads4": ("st.global.v2.b32", 4, 0),
               "gqa_bf16_gptj_conj_multirow_slot64": ("st.global.v4.b32", 8, 0),
               "gqa_fp8_d256_partial_rotary": ("st.global.v2.b32", 4, 0)}


# x's second input: None (a constexpr) for one input, as the launch passes it
ONE_INPUT = {"xt_ptr": None, "sxt_n": None, "sxt_h": None}
# the GQA kernel's heads held as one tensor each, no fp8 q_out, scales by pointer, divided, with V: its
# defaults, as the launch leaves them
GQA_TAILS = ("q2_ptr", "sq2_n", "sq2_h", "k2_ptr", "sk2_n", "sk2_h", "qo2_ptr", "so2_n", "so2_h", "kd2_ptr",
             "kd2_blk", "kd2_tok", "kd2_head")
GQA_PAGED_APPEND = ("pa_b", "pa_p", "pa_indptr", "pa_idx", "pa_nreq", "pa_nidx")
# the caches' formats: K and V of one (FP8's), static casts to e4m3, no per-(token, head) scales, no 4-bit
# caches; plain RoPE (no mRoPE), no V-norm
GQA_SCALE_CACHES = ("ksc_ptr", "ksc_blk", "ksc_tok", "ksc_head", "vsc_ptr", "vsc_blk", "vsc_tok", "vsc_head")
GQA_FP4_SCALES = ("ksf_ptr", "ksf_blk", "ksf_tok", "ksf_head", "vsf_ptr", "vsf_blk", "vsf_tok", "vsf_head")
GQA_MROPE = ("s_pos3",)
GQA_V_NORM = ("vw_ptr", "v_eps")
ONE_PART = {**{name: None for name in GQA_TAILS + GQA_PAGED_APPEND + GQA_SCALE_CACHES + GQA_FP4_SCALES + GQA_MROPE
               + GQA_V_NORM},
            "qs_ptr": None, "SPLIT": 0, "Q_FP8": False, "SCALE_MUL": False, "SCALE_BY_VALUE": False, "HAS_V": True,
            "V_FP8": None, "K_E5M2": False, "V_E5M2": False, "K_PTH": 0, "V_PTH": 0, "MROPE_T": 0, "MROPE_H": 0,
            "MROPE_W": 0, "MROPE_INTERLEAVED": False, "V_NORM": False, "VW_BF16": False, "LOG2_BLOCK_DV": 0,
            "K_FP4": 0, "V_FP4": 0}


def compile_ptx(fn, consts, num_warps=4, ptr_types=None):
    ptr_types = {**PTR_TYPES, **(ptr_types or {})}
    sig, attrs = {}, {}
    for p in fn.params:
        name = p.name
        sig[name] = "constexpr" if name in consts else ptr_types.get(name, "fp32" if name in FLOATS else "i32")
        if (name in ptr_types or name in DIVISIBLE_BY_16) and name not in consts:
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"enable_fp_fusion": False, "num_warps": num_warps, "num_stages": 1})
    return kernel.asm["ptx"]


def fused_variants():
    base = dict(D=512, BLOCK_D=512, LOG2_BLOCK_D=9, VEC=4, BLOCK_M=2, ONE_HEAD=True, ROWS32=True, HAS_NORM=True,
                W_BF16=True, LAYER=False, HAS_BIAS=False, B_BF16=True, ROPE=2, R=64, ROPE_OFF=448, NEOX=True, CONJ=False, CS_BF16=False, HAS_HAD=False, CAST=1,
                G=32, SF=0, FMAX=448.0, DQ=512, OUT_STAGE=0, DEST=2, NATIVE=2, SLOT32=True, QALIGN=4, SFALIGN=4,
                TALIGN=4, EARLY=False, FLOOR_E=-999, SPLIT=0, NORM_DIM=0, RESERVED=0, BLOCK_RESERVED=1, PDL=False,
                **ONE_INPUT)
    yield "main_fp8", base
    yield "main_fp8_decode", {**base, "BLOCK_M": 1, "EARLY": True}
    yield "main_fp8_decode_pdl", {**base, "BLOCK_M": 1, "EARLY": True, "PDL": True}
    yield "main_fp8_gptj_multirow", {**base, "NEOX": False}
    yield "layernorm_bias_copy_rope2", {**base, "LAYER": True, "HAS_BIAS": True, "OUT_STAGE": 1}
    yield "index_layernorm_offset0_had_fp32", {**base, "D": 128, "BLOCK_D": 128, "LOG2_BLOCK_D": 7, "VEC": 8,
                                               "ROPE": 1, "ROPE_OFF": 0, "HAS_HAD": True, "LAYER": True,
                                               "HAS_BIAS": True, "B_BF16": False, "G": 128, "SF": 3, "DQ": 128,
                                               "QALIGN": 16, "BLOCK_M": 4}
    yield "main_fp4+cast_back", {**base, "VEC": 8, "CAST": 2, "G": 16, "SF": 2, "FMAX": 6.0, "OUT_STAGE": 3,
                                 "QALIGN": 16, "SFALIGN": 16, "TALIGN": 16}
    yield "index_fp32+had+conj+interleaved", {**base, "D": 128, "BLOCK_D": 128, "LOG2_BLOCK_D": 7, "VEC": 8,
                                                "ROPE": 1, "ROPE_OFF": 64, "HAS_HAD": True, "CONJ": True,
                                                "NEOX": False, "G": 128, "SF": 3, "DQ": 128, "W_BF16": False,
                                                "CS_BF16": True, "OUT_STAGE": 1, "QALIGN": 16}
    yield "v32_tail_ue8m0_fp32_multihead", {**base, "D": 576, "BLOCK_D": 1024, "LOG2_BLOCK_D": 10, "VEC": 8,
                                            "ROPE_OFF": 512, "G": 128, "SF": 1, "DQ": 512, "OUT_STAGE": 2,
                                            "FLOOR_E": -13,
                                            "ONE_HEAD": False, "QALIGN": 16, "SFALIGN": 16, "TALIGN": 16}
    yield "bf16_cache_slot64_rows64", {**base, "CAST": 0, "ROPE": 1, "HAS_HAD": True, "SLOT32": False,
                                       "ROWS32": False, "ONE_HEAD": False, "QALIGN": 1}
    yield "contiguous_nvfp4_interleaved_subtile", {**base, "D": 128, "BLOCK_D": 128, "LOG2_BLOCK_D": 7, "VEC": 8,
                                                   "ROPE_OFF": 64, "NEOX": False, "CAST": 2, "G": 16, "SF": 2,
                                                   "FMAX": 6.0, "DQ": 128, "DEST": 1}
    yield "contiguous_fp32_sf", {**base, "SF": 3, "DEST": 1, "HAS_NORM": False, "VEC": 8}
    yield "bf16_out_rope_only", {**base, "HAS_NORM": False, "CAST": 0, "DEST": 0, "OUT_STAGE": 2, "VEC": 8}
    # reserved bytes written as zeros (KVCacheFormat.zero_reserved): MAIN_FP8's 4 after byte scales, one row a
    # program; 4 after two fp32 scales of a multi-head cache
    yield "main_fp8_zero_reserved_decode", {**base, "BLOCK_M": 1, "EARLY": True, "RESERVED": 4, "BLOCK_RESERVED": 4}
    yield "fp32_sf_zero_reserved_multihead", {**base, "D": 128, "BLOCK_D": 128, "LOG2_BLOCK_D": 7, "VEC": 8,
                                              "ROPE": 1, "ROPE_OFF": 64, "G": 64, "SF": 3, "DQ": 128, "ONE_HEAD": False,
                                              "RESERVED": 4, "BLOCK_RESERVED": 4, "QALIGN": 16}
    # two inputs (x's columns from SPLIT on held apart) and norms over the leading dims
    split = {k: v for k, v in base.items() if k not in ONE_INPUT}
    yield "v32_split_latent_norm_decode", {**split, "D": 576, "BLOCK_D": 1024, "LOG2_BLOCK_D": 10, "VEC": 8,
                                           "ROPE_OFF": 512, "G": 128, "SF": 1, "DQ": 512, "FLOOR_E": -13,
                                           "QALIGN": 16, "SFALIGN": 16, "TALIGN": 16, "BLOCK_M": 1, "EARLY": True,
                                           "SPLIT": 512, "NORM_DIM": 512}
    yield "main_fp8_split_layernorm_leading_copy", {**split, "LAYER": True, "HAS_BIAS": True, "OUT_STAGE": 1,
                                                    "SPLIT": 448, "NORM_DIM": 448}
    yield "v32_leading_norm_one_input", {**base, "D": 576, "BLOCK_D": 1024, "LOG2_BLOCK_D": 10, "VEC": 8,
                                         "ROPE_OFF": 512, "G": 128, "SF": 1, "DQ": 512, "FLOOR_E": -13,
                                         "QALIGN": 16, "SFALIGN": 16, "TALIGN": 16, "BLOCK_M": 1, "EARLY": True,
                                         "NORM_DIM": 512}
    yield "bf16_out_split_gptj_tile_had", {**split, "D": 128, "BLOCK_D": 128, "LOG2_BLOCK_D": 7, "VEC": 8,
                                           "CAST": 0, "DEST": 0, "OUT_STAGE": 2, "ROPE": 1, "ROPE_OFF": 32,
                                           "NEOX": False, "HAS_HAD": True, "SPLIT": 48, "NORM_DIM": 96}


def gqa_variants():
    """The GQA kernel: (name, constexprs, pointer types); the packed-QKV strides and cache strides divisible
    by 16 as in an engine's calls."""
    base = dict(D=128, BLOCK_D=128, LOG2_BLOCK_D=7, DV=128, BLOCK_DV=128, VEC=8, BLOCK_M=1, G=1, Q_NORM=True,
                QW_BF16=True, K_NORM=True, KW_BF16=True, ROPE=True, R=128, ROPE_OFF=0, NEOX=True, CONJ=False,
                CS_BF16=False, FP8=True, SLOT32=True, NATIVE=2, PDL=False, HALVES=True, K_SCALE_PER_HEAD=False,
                V_SCALE_PER_HEAD=False, ACT=0, NUMERICS=0, KV_CACHE=True, **ONE_PART)
    ptrs = {"q_ptr": "*bf16"}
    yield "gqa_fp8_neox_decode", base, ptrs
    yield "gqa_fp8_neox_heads4", {**base, "BLOCK_M": 2, "G": 4}, ptrs
    yield "gqa_fp8_heads4_per_head_scales", {**base, "BLOCK_M": 2, "G": 4, "K_SCALE_PER_HEAD": True,
                                             "V_SCALE_PER_HEAD": True}, ptrs
    yield "gqa_fp8_rows_per_head_scales", {**base, "BLOCK_M": 4, "G": 2, "HALVES": False, "R": 64,
                                           "K_SCALE_PER_HEAD": True, "V_SCALE_PER_HEAD": True}, ptrs
    yield "gqa_bf16_gptj_conj_multirow_slot64", {**base, "BLOCK_M": 8, "G": 2, "FP8": False, "NEOX": False,
                                                 "CONJ": True, "KW_BF16": False, "CS_BF16": True, "SLOT32": False,
                                                 "HALVES": False}, \
        {**ptrs, "kc_ptr": "*bf16", "vc_ptr": "*bf16", "kw_ptr": "*fp32", "cs_ptr": "*bf16"}
    yield "gqa_fp8_d256_partial_rotary", {**base, "D": 256, "BLOCK_D": 256, "LOG2_BLOCK_D": 8, "DV": 256,
                                          "BLOCK_DV": 256, "BLOCK_M": 4, "R": 64, "ROPE_OFF": 32, "HALVES": False}, ptrs
    fp16 = {name: "*fp16" for name in ("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "kc_ptr", "vc_ptr")}
    yield "gqa_fp16_no_cache_fp16_weights_cos_sin", {**base, "BLOCK_M": 2, "G": 2, "FP8": False, "QW_BF16": False,
                                                     "KW_BF16": False, "ACT": 1, "NUMERICS": 1, "KV_CACHE": False}, \
        {**fp16, "qw_ptr": "*fp16", "kw_ptr": "*fp16", "cs_ptr": "*fp16"}
    # FlashInfer's RoPE-quantize: heads as (rope, nope) tensors, an fp8 q_out, the multiply convention with
    # scales as fp32 arguments, the cast reading fp32; and MLA's kpe / ckv caches, a K cache alone
    parts = {**base, "HALVES": False, "R": 64, "Q_NORM": False, "K_NORM": False, "NUMERICS": 2, "SPLIT": 64,
             "Q_FP8": True, "SCALE_MUL": True, "SCALE_BY_VALUE": True}
    part_ptrs = {**ptrs, "q2_ptr": "*bf16", "k2_ptr": "*bf16", "qo_ptr": "*u8", "qo2_ptr": "*u8",
                 "ks_ptr": "fp32", "vs_ptr": "fp32", "qs_ptr": "fp32"}
    q_parts = ("q2_ptr", "sq2_n", "sq2_h", "k2_ptr", "sk2_n", "sk2_h", "qo2_ptr", "so2_n", "so2_h", "qs_ptr")

    def passed(consts, names):      # these arguments are given (pointers, strides, the q scale), not None
        return {k: v for k, v in consts.items() if k not in names}

    paged = {name: "*i32" for name in GQA_PAGED_APPEND[:4]}
    yield "gqa_split_fp8_q_multiply_by_value_paged_append", passed(parts, q_parts + GQA_PAGED_APPEND), \
        {**part_ptrs, **paged}
    yield "gqa_mla_split_caches_k_only", passed({**parts, "D": 576, "BLOCK_D": 1024, "LOG2_BLOCK_D": 10, "DV": 576,
                                                 "BLOCK_DV": 1024, "NEOX": False, "HAS_V": False},
                                                q_parts + ("kd2_ptr", "kd2_blk", "kd2_tok", "kd2_head")), \
        {**part_ptrs, "kd2_ptr": "*u8"}
    # the other cache formats (kvfuse.gqa_formats): e5m2 by static scales; K and V of two formats (a bf16 K
    # cache, an e5m2 V cache); per-(token, head) scales (e4m3 in the halves form, int8 in the rows form)
    yield "gqa_e5m2_neox_heads4", {**base, "BLOCK_M": 2, "G": 4, "K_E5M2": True, "V_E5M2": True}, ptrs
    yield "gqa_bf16_k_e5m2_v_per_head_scales", {**base, "BLOCK_M": 2, "G": 2, "FP8": False, "V_FP8": True,
                                                "V_E5M2": True, "V_SCALE_PER_HEAD": True}, {**ptrs, "kc_ptr": "*bf16"}
    scale_caches = {"ksc_ptr": "*fp32", "vsc_ptr": "*fp32"}
    yield "gqa_fp8_per_token_head_neox_heads4", passed({**base, "BLOCK_M": 2, "G": 4, "FP8": False, "K_PTH": 1,
                                                        "V_PTH": 1}, GQA_SCALE_CACHES), {**ptrs, **scale_caches}
    yield "gqa_int8_per_token_head_rows_fp32_cast", passed({**base, "BLOCK_M": 4, "G": 2, "HALVES": False, "R": 64,
                                                            "FP8": False, "K_PTH": 2, "V_PTH": 2, "NUMERICS": 2},
                                                           GQA_SCALE_CACHES), {**ptrs, **scale_caches}
    # mRoPE (Qwen2.5-VL's chunked section in the halves form; Qwen3-VL's interleaved one, and a partial GPT-J
    # rotation, in the whole-row form) and Gemma 4's V-norm (weightless into a bf16 cache; with a weight
    # into an fp8 cache whose cast reads the fp32 value)
    mrope = passed(base, GQA_MROPE)
    yield "gqa_fp8_mrope_chunked_halves", {**mrope, "BLOCK_M": 2, "G": 4, "MROPE_T": 16, "MROPE_H": 24,
                                           "MROPE_W": 24}, ptrs
    yield "gqa_fp8_mrope_interleaved_rows", {**mrope, "BLOCK_M": 2, "G": 2, "HALVES": False, "MROPE_T": 24,
                                             "MROPE_H": 20, "MROPE_W": 20, "MROPE_INTERLEAVED": True}, ptrs
    yield "gqa_bf16_mrope_gptj_partial", {**mrope, "BLOCK_M": 4, "G": 2, "FP8": False, "HALVES": False, "R": 64,
                                          "NEOX": False, "MROPE_T": 8, "MROPE_H": 12, "MROPE_W": 12},\
        {**ptrs, "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
    v_norm = {**base, "D": 256, "BLOCK_D": 256, "LOG2_BLOCK_D": 8, "DV": 256, "BLOCK_DV": 256, "BLOCK_M": 2,
              "V_NORM": True, "LOG2_BLOCK_DV": 8}
    yield "gqa_bf16_v_norm_weightless_d256", {**passed(v_norm, ("v_eps",)), "FP8": False},\
        {**ptrs, "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
    yield "gqa_fp8_v_norm_weight_fp32_cast", {**passed(v_norm, GQA_V_NORM), "NUMERICS": 2, "VW_BF16": True},\
        {**ptrs, "vw_ptr": "*bf16"}
    # 4-bit caches (kvfuse/kernels/gqa_fp4.py): codes and scale caches as bytes; NVFP4 with
    # its global scales by pointer or (FlashInfer's append) by value, MXFP4 reading the fp32 values
    fp4 = passed({**base, "FP8": False, "HALVES": False, "K_FP4": 1, "V_FP4": 1}, GQA_FP4_SCALES)
    fp4_ptrs = {**ptrs, "ksf_ptr": "*u8", "vsf_ptr": "*u8"}
    yield "gqa_nvfp4_kv", fp4, fp4_ptrs
    yield "gqa_nvfp4_kv_by_value_paged_append_heads4", passed({**fp4, "BLOCK_M": 2, "G": 4, "Q_NORM": False,
                                                               "K_NORM": False, "ROPE": False, "SCALE_BY_VALUE": True},
                                                              GQA_PAGED_APPEND), \
        {**fp4_ptrs, **paged, "ks_ptr": "fp32", "vs_ptr": "fp32"}
    yield "gqa_mxfp4_kv_fp32_cast_gptj", {**fp4, "K_FP4": 2, "V_FP4": 2, "BLOCK_M": 4, "G": 2, "NUMERICS": 2,
                                          "NEOX": False}, fp4_ptrs
    # the halves form (NEOX over the whole head): each half of a 4-bit K cast as a row of whole groups
    yield "gqa_nvfp4_kv_halves_heads4", {**fp4, "HALVES": True, "BLOCK_M": 2, "G": 4}, fp4_ptrs
    yield "gqa_mxfp4_k_halves_fp8_v", {**fp4, "HALVES": True, "K_FP4": 2, "V_FP4": 0, "V_FP8": True}, fp4_ptrs


def grouped_variants():
    """kvfuse.fused_group's kernel: (name, the members' fused_rows constexprs, PDL)."""
    fused = dict(fused_variants())
    yield "grouped_q_main_index_decode", [fused["bf16_out_rope_only"], fused["main_fp8_decode"],
                                          fused["contiguous_fp32_sf"]], False
    yield "grouped_main_index_q_pdl", [fused["main_fp8"], fused["index_layernorm_offset0_had_fp32"],
                                       fused["bf16_out_rope_only"], fused["contiguous_nvfp4_interleaved_subtile"]], True
    yield "grouped_q_v32_split_index", [fused["bf16_out_rope_only"], fused["v32_split_latent_norm_decode"],
                                        fused["contiguous_fp32_sf"]], False


def compile_grouped_ptx(members, pdl):
    """grouped_kernel with one tuple of runtime arguments (types as in compile_ptx) and one of constexprs per
    member; unused member slots None."""
    sig, attrs, consts = {}, {}, {}
    names = G.grouped_kernel.arg_names
    for m in range(G.MAX_CALLS):
        a_at, c_at = names.index(f"A{m}"), names.index(f"C{m}")
        if m < len(members):
            types = []
            for k, name in enumerate(G.TUPLE_NAMES):
                if name in members[m] and members[m][name] is None:
                    types.append("constexpr")
                    consts[(a_at, k)] = None
                    continue
                types.append(PTR_TYPES.get(name, "fp32" if name in FLOATS else "i32"))
                if name in PTR_TYPES or name in DIVISIBLE_BY_16:
                    attrs[(a_at, k)] = [["tt.divisibility", 16]]
            sig[f"A{m}"] = tuple(types)
            sig[f"C{m}"] = "constexpr"
            consts[(c_at,)] = tuple(members[m][k] for k in G.CONSTEXPR_NAMES)
        else:
            sig[f"A{m}"] = sig[f"C{m}"] = "constexpr"
            consts[(a_at,)] = consts[(c_at,)] = None
        for k in ("N", "P", "CAP"):
            sig[f"{k}{m}"] = "i32"
    for k in ("E0", "E1", "E2"):
        sig[k] = "i32"
    sig["NUM"] = sig["PDL"] = "constexpr"
    consts[(names.index("NUM"),)] = len(members)
    consts[(names.index("PDL"),)] = pdl
    src = ASTSource(fn=G.grouped_kernel, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"enable_fp_fusion": False, "num_warps": 1, "num_stages": 1})
    return kernel.asm["ptx"]


def load_variants():
    base = dict(D=512, BLOCK_D=512, DQ=512, CAST=1, G=32, SF=0, QB=512, DATA_B=512, BLOCK_DATA_B=512, SFB=20,
                BLOCK_SFB=32, DEQUANT=True, BLOCK_M=4, NATIVE=True)
    yield "load_main_fp8", base
    yield "load_nvfp4", {**base, "D": 128, "BLOCK_D": 128, "DQ": 128, "CAST": 2, "G": 16, "SF": 2, "QB": 64,
                         "DATA_B": 64, "BLOCK_DATA_B": 64, "SFB": 8, "BLOCK_SFB": 8}
    yield "load_v32", {**base, "D": 576, "BLOCK_D": 1024, "G": 128, "SF": 1, "DATA_B": 640, "BLOCK_DATA_B": 1024,
                       "SFB": 16, "BLOCK_SFB": 16}
    yield "load_fp32_sf", {**base, "D": 128, "BLOCK_D": 128, "DQ": 128, "G": 128, "SF": 3, "QB": 128,
                           "DATA_B": 128, "BLOCK_DATA_B": 128, "SFB": 4, "BLOCK_SFB": 4}
    yield "load_bf16", {**base, "CAST": 0, "DATA_B": 1024, "BLOCK_DATA_B": 1024, "SFB": 0, "BLOCK_SFB": 1}


@triton.jit
def _mul_add(a, b, c, o):
    tl.store(o, tl.load(a) * tl.load(b) + tl.load(c))


def negative_control() -> int:
    """The scan must find the fma that fp fusion makes of a*b + c."""
    src = ASTSource(fn=_mul_add, signature={"a": "*fp32", "b": "*fp32", "c": "*fp32", "o": "*fp32"}, constexprs={})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True}).asm["ptx"]
    found = bool(BAD.search(ptx))
    print("negative control:", "FOUND" if found else "CLEAN")
    return 0 if found else 1


def code_fingerprint(ptx: str) -> str:
    """A hash of the PTX without its debug and line information: equal before and after a change
    that moves or renames code but compiles to the same instructions."""
    keep = [ln for ln in ptx.splitlines()
            if not ln.lstrip().startswith((".loc", ".file", "//", ".b8", ".b32", ".b64", ".section", "$L__"))
            and "debug" not in ln]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def jobs():
    found = [(name, F.fused_kernel, c, {}) for name, c in fused_variants()]
    found += [(name, SL.load_kernel, c, {"out_ptr": "*bf16"}) for name, c in load_variants()]
    found += [(name, Q.qkv_kernel, c, ptrs) for name, c, ptrs in gqa_variants()]
    found += [(name, G.grouped_kernel, (members, pdl), None) for name, members, pdl in grouped_variants()]
    return found


def gqa_fp8_fma_findings(ptx: str, twin: str) -> list:
    """The GQA kernel's per-tensor cast divides by a reciprocal with explicit fma.rn (Markstein's
    correction, numerics.div_rn_by_reciprocal), which the scan cannot tell from a contracted one. So an
    fp8 variant may hold fma.rn.f32 (a nonzero, even count: two per quotient), and ``twin``, the PTX of
    its bf16-cache twin (the same arithmetic but for the cast), must hold none; every other finding
    stands."""
    bad = [b for b in sorted(set(BAD.findall(ptx))) if b != "fma."]
    fmas = len(re.findall(r"\bfma\.", ptx))
    if fmas != len(re.findall(r"\bfma\.rn\.f32\b", ptx)) or fmas == 0 or fmas % 2:
        bad.append(f"fma: {fmas}, want only fma.rn.f32 of the cast's quotients (a nonzero even count)")
    bad += [f"bf16 twin: {b}" for b in sorted(set(BAD.findall(twin)))]
    return bad


def _gqa_fp8_fma_findings(ptx: str, consts: dict, ptrs: dict) -> list:
    """gqa_fp8_fma_findings with the twin compiled here."""
    twin = compile_ptx(Q.qkv_kernel, {**consts, "FP8": False, "Q_FP8": False, "V_FP8": None}, num_warps=1,
                       ptr_types={**ptrs, "kc_ptr": "*bf16", "vc_ptr": "*bf16", "qo_ptr": "*bf16", "qo2_ptr": "*bf16",
                                  "kd2_ptr": "*bf16"})
    return gqa_fp8_fma_findings(ptx, twin)


def main() -> int:
    if "--negative-control" in sys.argv:
        return negative_control()
    fingerprint = "--fingerprint" in sys.argv   # one hash per variant (refactors: same code before and after)
    findings = 0
    for name, fn, consts, ptrs in jobs():
        if fn is G.grouped_kernel:
            ptx = compile_grouped_ptx(*consts)
        else:
            ptx = compile_ptx(fn, consts, num_warps=1, ptr_types=ptrs)
        if fingerprint:
            print(f"{name:36s} {code_fingerprint(ptx)}")
            continue
        bad = sorted(set(BAD.findall(ptx)))
        if fn is Q.qkv_kernel and (consts["FP8"] or consts.get("Q_FP8") or consts.get("V_FP8")) and \
                not consts.get("SCALE_MUL"):
            # (a multiply holds no fma)
            bad = _gqa_fp8_fma_findings(ptx, consts, ptrs)
        stores = {}
        for st in STORE.findall(ptx):
            stores[st] = stores.get(st, 0) + 1
        # programmatic dependent launch: the wait comes before the first global load, and only with PDL
        wait = ptx.find("griddepcontrol.wait")
        if name.endswith("_pdl") != (wait >= 0) or 0 <= ptx.find("ld.global") < wait:
            bad.append("griddepcontrol.wait missing, misplaced or unasked")
        if name in WIDE_STORES:
            wide, at_least, max_bytes = WIDE_STORES[name]
            if stores.get(wide, 0) < at_least or stores.get("st.global.b8", 0) > max_bytes:
                bad.append(f"narrow stores (want >= {at_least} {wide}, <= {max_bytes} st.global.b8)")
        findings += bool(bad)
        seen = " ".join(f"{k[10:]}:{v}" for k, v in sorted(stores.items()))
        print(f"{name:36s} ptx {len(ptx):7d} chars  stores {seen:40s} {'BAD ' + str(bad) if bad else 'ok'}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
