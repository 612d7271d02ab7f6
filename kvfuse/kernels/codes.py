"""The names of the kernels' numeric constexpr switches (CAST, SF, OUT_STAGE, DEST, ROPE, NATIVE, PTH,
FLOOR_E), defined once for the portable kernels (portable.py, store_load.py, numerics.py, qkv.py)
and the Gluon fast paths (gluon/*.py).

Kernel code compares with the names (``if CAST == CAST_E4M3:``). @triton.jit and @gluon.jit code
may read a module global only when it is a ``tl.constexpr`` instance (Triton 3.6 and 3.9 alike;
a plain or merely annotated int is a NameError when compiled), hence ``tl.constexpr(n)``. Host
code passes the plain ints (``.value``, and the dicts below): launches, Triton's cache keys and
the direct launcher see the same values as before the names existed.
"""
import triton.language as tl

# CAST: what the values are quantized to
CAST_NONE = tl.constexpr(0)          # no cast: bf16 values
CAST_E4M3 = tl.constexpr(1)          # float8 e4m3fn codes, one a byte
CAST_E2M1 = tl.constexpr(2)          # fp4 e2m1 codes, two a byte (the even column in the low nibble)

# SF: how a group's scale is stored
SF_UE8M0 = tl.constexpr(0)           # one byte, the power of two's biased exponent
SF_UE8M0_FP32 = tl.constexpr(1)      # the power of two as an fp32 value
SF_E4M3 = tl.constexpr(2)            # one e4m3 byte
SF_FP32 = tl.constexpr(3)            # amax / FMAX as fp32

# OUT_STAGE: which bf16 stage the fused kernel copies to ``out``
STAGE_NONE = tl.constexpr(0)         # none
STAGE_NORM = tl.constexpr(1)         # after the norm
STAGE_TRANSFORM = tl.constexpr(2)    # after norm, RoPE and Hadamard (the result when nothing is cast)
STAGE_CAST_BACK = tl.constexpr(3)    # the quantized values decoded back to bf16

# DEST: where the fused kernel's quantized (or bf16) result goes
DEST_NONE = tl.constexpr(0)          # nowhere but ``out`` (a bf16 result)
DEST_CONTIGUOUS = tl.constexpr(1)    # contiguous (q, sf) outputs
DEST_CACHE = tl.constexpr(2)         # paged KV-cache records

# ROPE: how the fused kernel rotates (portable.rope_mode chooses)
ROPE_NONE = tl.constexpr(0)          # no RoPE
ROPE_TILE = tl.constexpr(1)          # on the whole tile, each element from itself and its reloaded partner
ROPE_SUBTILE = tl.constexpr(2)       # the rotated columns as a sub-tile of their own (whole groups, no Hadamard)

# NATIVE: how values are narrowed to bf16 / e4m3 (KVFUSE_NATIVE_CASTS; the interpreter always 0)
NATIVE_INTEGER = tl.constexpr(0)     # integer round-to-nearest-even on the bit patterns
NATIVE_GUARDED = tl.constexpr(1)     # native conversions, e4m3 with its explicit signed-zero guard
NATIVE_UNGUARDED = tl.constexpr(2)   # native, e4m3 unguarded where the codes are only stored

# PTH: a GQA cache quantized per (token, head), its fp32 scale stored (kvfuse.gqa_formats scale "token_head")
PTH_NONE = tl.constexpr(0)           # not quantized so (the activations' dtype, or a static scale)
PTH_E4M3 = tl.constexpr(1)           # e4m3 codes, scale amax / 448 ("fp8_per_token_head")
PTH_INT8 = tl.constexpr(2)           # int8 codes, scale amax / 127 ("int8_per_token_head")

# FLOOR_E without a scale_floor (numerics.group_scales and ue8m0_exponent)
NO_FLOOR = tl.constexpr(-999)

# host side: format strings -> the ints the launches pass
CAST_CODES = {None: CAST_NONE.value, "e4m3": CAST_E4M3.value, "e2m1": CAST_E2M1.value}
SF_CODES = {"ue8m0": SF_UE8M0.value, "ue8m0_fp32": SF_UE8M0_FP32.value, "e4m3": SF_E4M3.value,
            "fp32": SF_FP32.value}
STAGE_CODES = {None: STAGE_NONE.value, "norm": STAGE_NORM.value, "transform": STAGE_TRANSFORM.value,
               "cast_back": STAGE_CAST_BACK.value}
PTH_CODES = {"fp8_per_token_head": PTH_E4M3.value, "int8_per_token_head": PTH_INT8.value}
