"""What the Gluon fast paths (main_latent, main_latent_fp4, flashmla, indexer) share: the Gluon import,
the host-side checks and switches, and the @gluon.jit helpers their kernels have in common (inline
PTX shuffles and conversions, bf16 unpacking, offsets, index loads, slot addressing, group scales; the
UE8M0 rule is the portable kernel's, kvfuse.kernels.numerics.ue8m0_exponent).

Imports without a GPU and under any Triton: the jit helpers exist only where Gluon imports.
"""
from __future__ import annotations

import os

import torch

from ...backend import env_flag
from ..codes import NO_FLOOR, SF_UE8M0, SF_UE8M0_FP32
from ..launcher import PlanTensor
from ..numerics import ue8m0_exponent

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - triton without Gluon
    triton = gluon = gl = None
    IMPORT_ERROR = e

INT32_LIMIT = 2 ** 31
MAX_CTAS_PER_SM = 32         # sm_90 resident-block limit


def available() -> bool:
    """True when the Gluon API these kernels are written for (Triton 3.6) and a CUDA device exist."""
    if IMPORT_ERROR is not None or not torch.cuda.is_available():
        return False
    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    except Exception:
        return False
    return (major, minor) == (3, 6)


FAST_PATH_NAMES = ("main_latent", "main_latent_fp4", "flashmla", "indexer")   # each module's NAME


def allowed_by_env(path: str) -> bool:
    """False when KVFUSE_GLUON=0 (every Gluon path off) or KVFUSE_GLUON_SKIP (a comma list of
    FAST_PATH_NAMES) names ``path``; ValueError for a name that is not a fast path's."""
    skip = {t.strip() for t in os.environ.get("KVFUSE_GLUON_SKIP", "").split(",")} - {""}
    unknown = sorted(skip - set(FAST_PATH_NAMES))
    if unknown:
        raise ValueError(f"KVFUSE_GLUON_SKIP: expected names from {FAST_PATH_NAMES}, got {', '.join(unknown)}")
    return path not in skip and env_flag("KVFUSE_GLUON", True)


def word_aligned(x, weight) -> bool:
    """x and the weight are read as 4-byte words."""
    return not ((x.data_ptr() | weight.data_ptr()) & 3)


def one_input_whole_norm(plan) -> bool:
    """x is one input and its norm (if any) covers the whole row: what the fast paths other than FlashMLA
    read (two inputs and norms over the leading dims go to the portable kernel there)."""
    return plan.x_tail is None and plan.norm_dim in (0, plan.head_dim)


def x_weight_guard(plan) -> tuple:
    """A fast path's ``call_guard`` when it reads x and the weight as 4-byte words: (word_aligned,
    their plan fields); a plan without a weight gives x twice (kvfuse's stand-in)."""
    return word_aligned, ("x", "weight")


def table_index(table, n_rows: int) -> int:
    """The position of the launch-table entry ``((first n_rows, entry), ...)`` (ascending firsts,
    the first 1) that covers ``n_rows``: the last whose first is <= n_rows. The tables are data so
    that the GPU test matrix (tests/gpu_matrix.py) can enumerate every entry a dispatch can pick."""
    index = 0
    for i, (first, _) in enumerate(table):
        if n_rows < first:
            break
        index = i
    return index


def table_entry(table, n_rows: int):
    """The entry of a launch table that covers ``n_rows`` (``table_index``)."""
    return table[table_index(table, n_rows)][1]


def log2_block(block_size: int) -> int:
    """The kernels' LOG2_BLOCK: log2(block_size) when it is a power of two, else -1 (a division)."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


def compile_options(num_warps: int) -> dict:
    """The launch options of every Gluon kernel here (no FMA: fp32 ops rounded one by one)."""
    return dict(num_warps=num_warps, num_stages=1, enable_fp_fusion=False)


def device_index_of(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def resident_ctas_per_sm(compiled, num_warps: int, device_index: int) -> int:
    """CTAs of a compiled variant that fit on one SM at once (registers, warps, the block limit): a
    persistent grid larger than that would run a second wave holding a fixed share of the tiles."""
    compiled._init_handles()                      # loads the binary: n_regs
    props = torch.cuda.get_device_properties(device_index)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    warps_per_sm = getattr(props, "max_threads_per_multi_processor", 2048) // 32
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256     # allocated per warp in units of 256
    warps = min(warps_per_sm, regs_per_sm // regs_per_warp)
    return max(1, min(MAX_CTAS_PER_SM, warps // num_warps))


def bind_tensors(args: tuple, tensors: dict) -> tuple:
    """``args`` with each launcher.PlanTensor replaced by ``tensors[field]`` (everything else, tensors
    already in place included, as it is): the real arguments a compile for the occupancy needs."""
    return tuple(tensors[a.field] if isinstance(a, PlanTensor) else a for a in args)


def plan_tensors(plan) -> dict:
    """The tensors the Gluon kernels take, by field, from a validated plan."""
    return {"x": plan.x, "weight": plan.weight, "positions": plan.positions, "cos_sin": plan.cos_sin,
            "slot_mapping": plan.slot_mapping, "kv_cache": plan.kv_cache}


def cached_ctas_per_sm(kernel, known: dict, key, real_args, constexprs: dict, options: dict, device_index: int) -> int:
    """``resident_ctas_per_sm`` of a kernel variant, found once per ``key`` (kept in ``known``) by
    compiling it with ``real_args``: Triton's cache then has it for the launch."""
    per_sm = known.get(key)
    if per_sm is None:
        compiled = kernel.warmup(*real_args, grid=(1,), **constexprs, **options)
        per_sm = known[key] = resident_ctas_per_sm(compiled, options["num_warps"], device_index)
    return per_sm


# kvfuse.set_pdl's early reads, where the H200 measured them faster (2026-12-04, the side-by-side harness's
# DeepSeek groups with and without them, twice each): up to this many rows (at 1 and 256 rows 0.05-0.48 us
# less); at 4096 rows the MAIN_FP8 and FlashMLA writes took 0.3-0.65 us longer with them
PDL_EARLY_MAX_ROWS = 256


def early_reads_option(rows: int) -> dict:
    """The PDL_EARLY constexpr, named (off: router.with_pdl turns it on under set_pdl's early_reads), for a
    launch of ``rows`` rows where the early reads apply; nothing above PDL_EARLY_MAX_ROWS."""
    return {"PDL_EARLY": False} if rows <= PDL_EARLY_MAX_ROWS else {}


def persistent_grid(tiles: int, ctas_per_sm: int, sm_count: int) -> tuple:
    """One CTA per tile up to what is resident on the device at once (each CTA then loops over tiles)."""
    return (max(1, min(tiles, sm_count * ctas_per_sm)),)


def occupancy_grid(kernel, known: dict, x, tiles: int, args: tuple, tensors: dict, constexprs: dict, options: dict,
                   ctas_per_sm: int = None, sm_count: int = None) -> tuple:
    """The persistent grid of a launch of ``tiles`` tiles: ``ctas_per_sm`` CTAs (default: the compiled
    variant's occupancy, ``cached_ctas_per_sm``, kept in ``known`` by x's device, the tensors' dtypes,
    the constexprs and num_warps) on each of ``sm_count`` SMs (default: x's device's), at most one per
    tile. ``tensors`` (field -> tensor; None: x stands in, never read) bind ``args`` for that compile.
    With both numbers given: no compilation and no device query."""
    if not ctas_per_sm or sm_count is None:
        device_index = device_index_of(x)
        if not ctas_per_sm:
            real = {field: (x if t is None else t) for field, t in tensors.items()}
            key = (device_index, tuple(t.dtype for t in real.values()), tuple(constexprs.items()),
                   options["num_warps"])
            ctas_per_sm = cached_ctas_per_sm(kernel, known, key, bind_tensors(args, real), constexprs, options,
                                             device_index)
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(device_index).multi_processor_count
    return persistent_grid(tiles, ctas_per_sm, sm_count)


# ``e2m1_nibble`` restated with torch integer / fp32 ops, step for step (the proof that it gives
# kvfuse.reference.encode_e2m1's codes runs on this: tests/test_gluon_main_latent_fp4.py on samples,
# tests/gpu/test_gpu_fast_paths.py over every fp32 input).
def e2m1_nibble_mirror(t: torch.Tensor) -> torch.Tensor:
    """``e2m1_nibble`` on the host: fp32 t -> int32 codes 0..15."""
    a = torch.fmin(t.abs(), torch.tensor(6.0))                    # fmin ignores NaN, as min.f32
    magic = torch.clamp_min((a.view(torch.int32) & 0x7F800000) + 0x0B000006, 0x4A800006)
    code = (a + magic.view(torch.float32)).view(torch.int32) + (magic >> 22)
    sign = (t.view(torch.int32) >> 28) & 15                        # the logical shift of the kernel
    return (code & 7) | (sign & ~7)


if gluon is not None:

    @gluon.constexpr_function
    def _bfly_asm(lane_mask):
        # butterfly shuffle over the whole warp: lane l receives the value of lane l ^ lane_mask
        return f"shfl.sync.bfly.b32 $0, $1, {lane_mask}, 0x1f, 0xffffffff;"

    @gluon.jit
    def pdl_wait(PDL: gl.constexpr):
        """Launched with programmatic dependent launch (PDL): wait for the previous kernel on the stream
        (griddepcontrol.wait) before the first read of data it may write (x, positions, slots: the
        kernels call this after loading only their weights), then let the next kernel launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @gluon.jit
    def shfl_xor(v, LANE_MASK: gl.constexpr):
        """v of lane l ^ LANE_MASK, for a 32-bit tensor (every lane of the warp must run it: the kernels
        have no divergent code around it)."""
        return gl.inline_asm_elementwise(_bfly_asm(LANE_MASK), "=r,r", [v], dtype=v.dtype, is_pure=True, pack=1)

    @gluon.jit
    def lane_tree(v):
        """The adjacent-pairs tree over the 32 lanes (lane l holds the partial sum of the l-th block):
        level k adds the partner at xor 2^k; both lanes of a pair hold the same bits (commutative)."""
        v = v + shfl_xor(v, 1)
        v = v + shfl_xor(v, 2)
        v = v + shfl_xor(v, 4)
        v = v + shfl_xor(v, 8)
        v = v + shfl_xor(v, 16)
        return v

    @gluon.jit
    def bf16x2(lo, hi):
        """Two fp32 -> one int32 word holding bf16(lo) | bf16(hi) << 16 (cvt.rn: round to nearest even)."""
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def e4m3x4(v0, v1, v2, v3):
        """Four fp32 -> one int32 word of e4m3 codes, v0 in the low byte (cvt.rn.satfinite: RTNE,
        saturating to +-448, NaN -> an e4m3 NaN): what .to(float8e4nv) emits on sm_90, the plain
        kernel's NATIVE_UNGUARDED encode."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [v0, v1, v2, v3], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def lo_f32(w):
        """The bf16 in the low half of int32 words, as fp32 (exact)."""
        return (w << 16).to(gl.float32, bitcast=True)

    @gluon.jit
    def hi_f32(w):
        """The bf16 in the high half of int32 words, as fp32 (exact)."""
        return (w & -65536).to(gl.float32, bitcast=True)

    @gluon.jit
    def expand_rows(v):
        """[R] (a row slice layout) -> [R, 1, 1] in its parent layout (no data movement)."""
        return gl.expand_dims(gl.expand_dims(v, 1), 2)

    @gluon.jit
    def as_offset(v, OFFSETS32: gl.constexpr):
        """An element / byte offset: int32 when every offset of the launch fits (cheaper address math)."""
        if OFFSETS32:
            off = v.to(gl.int32)
        else:
            off = v.to(gl.int64)
        return off

    @gluon.jit
    def load_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32: gl.constexpr):
        """Positions and slots of the rows [R] (-1 past n_rows: no position, no slot)."""
        rmask = rows < n_rows
        r = as_offset(rows, OFFSETS32)
        pos = gl.load(pos_ptr + r * s_pos, mask=rmask, other=-1)
        slot = gl.load(slot_ptr + r * s_slot, mask=rmask, other=-1)
        return pos, slot

    @gluon.jit
    def slot_block(slot, ok, block_size, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr):
        """(slot, its block) of each row, 0 where not ok: int32 when capacity <= 2**31 (SLOT32, host),
        else int64; the block by a shift where LOG2_BLOCK >= 0, else by a division."""
        if SLOT32:
            s = gl.where(ok, slot, 0).to(gl.int32)
        else:
            s = gl.where(ok, slot, 0).to(gl.int64)
        if LOG2_BLOCK >= 0:
            blk = s >> LOG2_BLOCK
        else:
            blk = s // block_size
        return s, blk

    @gluon.jit
    def block_and_token(slot, ok, block_size, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr,
                        OFFSETS32: gl.constexpr):
        """(block, token inside the block) of each row's slot (``slot_block``), as offsets."""
        s, blk = slot_block(slot, ok, block_size, SLOT32, LOG2_BLOCK)
        if SLOT32:
            blk_at = as_offset(blk, OFFSETS32)
            tok = as_offset(s - blk * block_size, OFFSETS32)
        else:
            blk_at = blk
            tok = s - blk * block_size
        return blk_at, tok

    @gluon.jit
    def e2m1_nibble(t):
        """fp32 -> e2m1 code 0..15 (sign in bit 3): numerics.encode_e2m1's bits for every fp32, the
        rounding done by one fp32 addition. a = min(|t|, 6) (NaN -> 6, as encode_e2m1's saturation);
        the binade's magic number 2^(E + 22) (E = max(exponent of a, 0)) plus 6 units in its last place:
        the sum a + magic rounds a to the e2m1 grid of its binade (RTNE: the offset 6 is even), and its
        low bits are 6 + k (k: a rounded, in units of the grid, 0..4); the code is k + 2E, which is
        bits(sum) + (magic >> 22) modulo 8 (magic >> 22 = 298 + 2E; 6 + 298 = 304 = 0 mod 8)."""
        a = gl.minimum(gl.abs(t), 6.0)
        magic = gl.maximum((a.to(gl.int32, bitcast=True) & 0x7F800000) + 0x0B000006, 0x4A800006)
        code = (a + magic.to(gl.float32, bitcast=True)).to(gl.int32, bitcast=True) + (magic >> 22)
        sign = (t.to(gl.uint32, bitcast=True) >> 28).to(gl.int32)                  # the sign in bit 3, zeros above
        # bits 0..2 of code, bits 3.. of sign: one lop3 (0xE4: a & c | b & ~c)
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 7, 0xE4;", "=r,r,r", [code, sign], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def e4m3_scale(s):
        """fp32 s in [2^-9, 448] -> (e4m3 code of s as int32 (cvt.rn.satfinite), its value as fp32 (exact:
        e4m3 -> f16 -> f32 widen without rounding))."""
        code = gl.inline_asm_elementwise(
            "{ .reg .b16 c; .reg .f32 z; mov.f32 z, 0f00000000; cvt.rn.satfinite.e4m3x2.f32 c, z, $1; "
            "cvt.u32.u16 $0, c; }", "=r,r", [s], dtype=gl.int32, is_pure=True, pack=1)
        value = gl.inline_asm_elementwise(
            "{ .reg .b16 c, lo, hi; .reg .b32 h; cvt.u16.u32 c, $1; cvt.rn.f16x2.e4m3x2 h, c; mov.b32 {lo, hi}, h; "
            "cvt.f32.f16 $0, lo; }", "=r,r", [code], dtype=gl.float32, is_pure=True, pack=1)
        return code, value

    @gluon.jit
    def b64(lo, hi):
        """Two int32 words -> one int64 (lo in the low half)."""
        return gl.inline_asm_elementwise("mov.b64 $0, {$1, $2};", "=l,r,r", [lo, hi], dtype=gl.int64,
                                         is_pure=True, pack=1)

    @gluon.jit
    def group_scale(amax, SF: gl.constexpr, FMAX: gl.constexpr):
        """numerics.group_scales for SF_UE8M0, SF_UE8M0_FP32 and SF_E4M3: (multiplier m, the stored scale
        byte, or the fp32 bits of 2^e, as int32)."""
        if SF == SF_UE8M0:
            e, m = ue8m0_exponent(amax, FMAX)
            stored = e + 127
        elif SF == SF_UE8M0_FP32:
            e, m = ue8m0_exponent(amax, FMAX)
            stored = (e + 127) << 23                                    # 2^e as fp32 bits (amax >= 1e-4: normal)
        else:
            s = gl.minimum(gl.maximum(gl.div_rn(amax, gl.full_like(amax, FMAX)), 0.001953125), 448.0)
            stored, d = e4m3_scale(s)
            m = gl.div_rn(gl.full_like(d, 1.0), d)
        return m, stored
