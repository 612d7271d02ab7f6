"""CI's compile step: every kernel variant kvfuse's dispatcher can pick, compiled for sm_90 on the CPU
(no GPU) under Triton 3.6 (the GPU's), each PTX scanned as ptx_check.py scans it. Exits 1, with one
line naming each variant and its innermost error or findings, when any variant fails.

Where the variants come from: the GPU matrix's calls (tests/gpu_matrix.py: every fast path x every
launch-table entry x its formats and chains, an all-pairs cover of the portable kernel's features x
its launch table, the GQA section), the group cases (group_cases.gpu_cases) and a store
and two loads of every format (kernel_cases.ALL_FORMATS), each run once without and once with
programmatic dependent launch. A call runs through kvfuse's public entry points as on the GPU,
with every fast path allowed (``router.fast_paths``) and its inputs unfilled (values choose no
launch), but each kernel is a recorder (``recording``; ``recording_gaps`` fails the step when a
kernel or a PDL value was never recorded, say after a refactor moved a name): Triton's own
binder turns the launch into its compile key (parameter types, 16-divisibility, constexprs, options),
and each distinct key is compiled once. So a new launch-table entry, format or constexpr the host
code chooses is compiled here without being listed. One exception keeps the step short: the portable
kernels' PDL constexpr only puts the wait at their entry, so their PDL variants are compiled once per
launch configuration (num_warps, rows and heads per program), the Gluon kernels' all.

Scan (ptx_check.py): no contracted fma (the explicit fma.rn of the GQA cast and of the indexer's
Hadamard told apart by a twin without them), no .approx, no div.full; griddepcontrol.wait exactly in
the PDL variants (and before the first global load in the portable kernels: the Gluon ones load
their weights first); the portable kernel's cache records stored as wide as a lane's columns and
their alignment allow (``wanted_store_bytes``). ``--list`` prints the variants without compiling them;
``--jobs N`` compiles in N processes (default: the CPU count). Never under TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

REQUIRED_TRITON = "3.6."


def _require_triton() -> None:
    if not triton.__version__.startswith(REQUIRED_TRITON):
        sys.exit(f"compile_matrix.py: needs Triton {REQUIRED_TRITON}x (the Gluon fast paths' and the GPU's), "
                 f"found {triton.__version__}")


_require_triton()

from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import kvfuse  # noqa: E402
from kvfuse import CastArgs, backend as kvfuse_backend  # noqa: E402
from kvfuse.kernels import grouped as G, qkv as Q, router as R, store_load as SL  # noqa: E402
from kvfuse.kernels.gluon import common as gluon_common  # noqa: E402

from ptx_check import BAD, STORE, gqa_fp8_fma_findings  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SM_COUNT = 132               # the persistent grids' size is not part of the code: no device query
KERNEL_MODULES = (R, SL, Q, G) + tuple(R.FAST_PATH_MODULES)


# --------------------------------------------------------------------------- recording the launches
class Variant:
    """One compile key: the kernel, Triton's signature / constexprs / attrs / options for it, and the
    label of the first call that launched it."""

    __slots__ = ("kernel", "signature", "constexprs", "attrs", "options", "label")

    def __init__(self, kernel, signature, constexprs, attrs, options, label):
        self.kernel, self.signature, self.constexprs, self.attrs, self.options, self.label = \
            kernel, signature, constexprs, attrs, options, label

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def constexpr(self, name: str):
        """The constexpr ``name``'s value (None: the kernel has no such parameter)."""
        names = self.kernel.arg_names
        return self.constexprs.get((names.index(name),)) if name in names else None


class Recorder:
    """Stands where a kernel is launched (``kernel[grid](*args, **kwargs)``): binds the arguments with
    Triton's own binder for sm_90, as JITFunction.run does, and keeps one Variant per compile key."""

    def __init__(self, kernel, book):
        self.kernel, self.book = kernel, book
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.book.add(self.kernel, args, kwargs)


class Book:
    """The distinct compile keys seen, in order; ``label``: the call now being recorded."""

    def __init__(self):
        self.backend = make_backend(TARGET)
        self.binders = {}
        self.variants = {}
        self.label = ""
        self.launches = 0
        self.pdl_configs = set()
        self.pdl_left_out = set()

    def add(self, kernel, args, kwargs):
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = self.binders.get(kernel)
        if binder is None:
            binder = self.binders[kernel] = create_function_from_signature(kernel.signature, kernel.params,
                                                                          self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        self.launches += 1
        key = (kernel, tuple(specialization), str(options))     # Triton's own cache key (JITFunction.run)
        if key in self.variants or key in self.pdl_left_out:
            return
        opts, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization, options)
        v = Variant(kernel, signature, constexprs, attrs, opts.__dict__, self.label)
        if v.constexpr("PDL") is True and not kernel.is_gluon():
            # a portable kernel's PDL only puts griddepcontrol.wait at its entry (``if PDL: gdc_wait()``
            # first in fused_kernel, qkv_kernel, grouped_kernel): one PDL variant per launch configuration
            config = (v.name, v.options["num_warps"]) + tuple(v.constexpr(k) for k in ("BLOCK_M", "G", "EARLY", "NUM"))
            if config in self.pdl_configs:
                self.pdl_left_out.add(key)
                return
            self.pdl_configs.add(config)
        self.variants[key] = v


def _grid_without_device(kernel, known, x, tiles, args, tensors, constexprs, options, ctas_per_sm=None,
                         sm_count=None):
    """gluon.common.occupancy_grid without its compile and device query (the grid is not in the code)."""
    return gluon_common.persistent_grid(tiles, ctas_per_sm or 1, sm_count or SM_COUNT)


@contextlib.contextmanager
def _patched(pairs):
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in pairs]
    try:
        for obj, name, value in pairs:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(old):
            setattr(obj, name, value)


@contextlib.contextmanager
def recording(book: Book, pdl: bool):
    """kvfuse's calls on CPU tensors launch as on an sm_90 GPU (the Triton backend, every fast path
    allowed, PDL as given, persistent grids without a device query) into ``book``'s recorders."""
    pairs = [(kvfuse_backend, "resolve_backend", lambda device, device_type=None: "triton"),
             (R, "pdl_launch", lambda x: pdl), (Q, "pdl_launch", lambda x: pdl), (G, "pdl_launch", lambda x: pdl)]
    for module in KERNEL_MODULES:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                pairs.append((module, name, Recorder(value, book)))
        if "occupancy_grid" in vars(module):
            pairs.append((module, "occupancy_grid", _grid_without_device))
    with _patched(pairs), R.fast_paths(only=R.FAST_PATH_MODULES):
        yield


# --------------------------------------------------------------------------- the calls
def _fused_calls():
    from gpu_matrix import matrix
    from kernel_cases import run_case
    for label, case in matrix():
        yield label, lambda case=case: run_case(case, "triton", "cpu")


def _gqa_calls():
    from gpu_matrix import gqa_cases
    from gqa_cases import run_gqa_case
    for label, case in gqa_cases():
        yield label, lambda case=case: run_gqa_case(case, "triton", "cpu")


def _group_calls():
    from group_cases import gpu_cases, run_layer
    for case, _ in gpu_cases():          # every case runs with and without PDL here
        yield f"group {case}", lambda case=case: run_layer(case, "cpu", grouped=True)


def _store_load(fmt):
    """A store of quantized rows into a two-head (one for a block-wide layout) cache, and its loads."""
    heads = 2 if fmt.token_interleaved else 1
    n = 13
    x = (torch.randn(n, heads, fmt.head_dim, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    slots = torch.tensor([0, 3, 4, 31, -1, 8, 40, 9, 17, 16, -9, 2, 1])
    cache = fmt.allocate(4, 8, heads, block_padding=32)
    if fmt.quantized:
        spec = CastArgs.from_cache_format(fmt)
        q, sf = kvfuse.reference.quantize(x[..., :fmt.quant_dim], spec.cast_fmt, spec.num_per_channels,
                                          spec.sf_format)
        kvfuse.store_kv_cache(q, sf, cache, slots, fmt, tail=x[..., fmt.quant_dim:] if fmt.bf16_tail else None)
    else:
        kvfuse.store_kv_cache(x, None, cache, slots, fmt)
    kvfuse.load_paged_kv_cache(cache, slots, fmt)
    kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=False)


def _store_load_calls():
    from kernel_cases import ALL_FORMATS
    for fmt in ALL_FORMATS:
        yield f"store/load {fmt.name}", lambda fmt=fmt: _store_load(fmt)


SOURCES = (_fused_calls, _gqa_calls, _group_calls, _store_load_calls)


def _unfilled_bf16(shape, *_, **__):
    """The cases' random bf16 inputs (kernel_cases._bf16_data, helpers.random_bf16) without their values,
    which choose no launch (filling the GPU matrix's large inputs took most of the recording's time)."""
    return torch.empty(shape, dtype=torch.bfloat16)


PDL_MODES = (R.PDL_OFF, R.PDL_ON, R.PDL_EARLY)   # router.pdl_launch's answers: every call runs under each
PDL_LABELS = {R.PDL_OFF: "", R.PDL_ON: " [pdl]", R.PDL_EARLY: " [pdl early]"}


def record_variants(progress=None) -> Book:
    """Run every call of SOURCES into recorders, without PDL, with it, and with its early reads."""
    import gqa_cases
    import group_cases
    import kernel_cases
    book = Book()
    with _patched([(kernel_cases, "_bf16_data", _unfilled_bf16), (gqa_cases, "random_bf16", _unfilled_bf16),
                   (group_cases, "random_bf16", _unfilled_bf16)]):
        for source in SOURCES:
            for label, call in source():
                for pdl in PDL_MODES:
                    book.label = label + PDL_LABELS[pdl]
                    with recording(book, pdl):
                        call()
            if progress:
                progress(f"{source.__name__.strip('_')}: {len(book.variants)} variants after {book.launches} launches")
    return book


def recording_gaps(book: Book) -> list:
    """What the recording should have seen and did not: a launched kernel of KERNEL_MODULES never
    recorded, or a kernel with a PDL parameter recorded without both of its values (a launch path
    that no longer looks its kernel or ``pdl_launch`` up where ``recording`` replaces them)."""
    seen, seen_early = {}, {}
    for v in book.variants.values():
        seen.setdefault(v.name, set()).add(v.constexpr("PDL"))
        seen_early.setdefault(v.name, set()).add(v.constexpr("PDL_EARLY"))
    gaps = []
    for module in KERNEL_MODULES:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                for param, book_of in (("PDL", seen), ("PDL_EARLY", seen_early)):
                    want = {True, False} if param in value.arg_names else {None}
                    got = book_of.get(value.fn.__name__, set())
                    if not want <= got:
                        gaps.append(f"{module.__name__}.{name}: recorded with {param} {sorted(got, key=str)}, "
                                    f"want {sorted(want, key=str)}")
    return gaps


# --------------------------------------------------------------------------- compiling and scanning
def compile_variant(v: Variant, **changes) -> str:
    """The PTX of a variant for sm_90; ``changes``: parameter name -> (signature type, constexpr value
    or None) to compile a twin."""
    signature, constexprs = dict(v.signature), dict(v.constexprs)
    for name, (ty, value) in changes.items():
        signature[name] = ty
        if value is not None:
            constexprs[(v.kernel.arg_names.index(name),)] = value
    source = GluonASTSource if v.kernel.is_gluon() else ASTSource
    src = source(v.kernel, signature, constexprs, v.attrs)
    return triton.compile(src, target=TARGET, options=v.options).asm["ptx"]


STORE_BYTES = {"b8": 1, "b16": 2, "b32": 4, "b64": 8, "v2.b8": 2, "v2.b16": 4, "v4.b8": 4, "v2.b32": 8,
               "v4.b16": 8, "v2.b64": 16, "v4.b32": 16}


def _widest_store(ptx: str) -> int:
    widest = 0
    for st in STORE.findall(ptx):
        kind = re.sub(r"^st\.global(\.[a-z]+\d*)*?\.((?:v\d\.)?b\d+)$", r"\2", st)
        widest = max(widest, STORE_BYTES.get(kind, 0))
    return widest


def wanted_store_bytes(v: Variant) -> int:
    """The store width a portable-kernel variant's cache records must leave in, from its constexprs: a
    lane's columns (VEC, fewer when the tile has fewer than VEC a lane: BLOCK_M * BLOCK_D over the
    threads), 2 bytes each for bf16, 1 for e4m3, 1/2 for e2m1, no wider than the records' alignment
    QALIGN. 0 where no rule is derived (the Gluon kernels store by explicit width)."""
    if v.name != "fused_kernel" or v.constexpr("DEST") != 2:          # into a cache
        return 0
    threads = 32 * v.options["num_warps"]
    columns = min(v.constexpr("VEC"), v.constexpr("BLOCK_M") * v.constexpr("BLOCK_D") // threads)
    bytes_per_2 = {0: 4, 1: 2, 2: 1}[v.constexpr("CAST")]
    return min(columns * bytes_per_2 // 2, v.constexpr("QALIGN"))


def hadamard_fma_findings(ptx: str, twin: str) -> list:
    """The indexer kernel's Hadamard adds a lane's partner with one exact fma (v * +-1 + w: the product
    is exact, so the fma rounds once, as the sum does; kvfuse/kernels/gluon/indexer.py). So a variant
    with HAD may hold fma.rn.f32 and nothing else of the kind, and ``twin``, its PTX without the
    Hadamard, must hold none; every other finding stands."""
    bad = [b for b in sorted(set(BAD.findall(ptx))) if b != "fma."]
    fmas = len(re.findall(r"\bfma\.", ptx))
    if fmas == 0 or fmas != len(re.findall(r"\bfma\.rn\.f32\b", ptx)):
        bad.append(f"fma: {fmas}, want only the Hadamard's fma.rn.f32 (at least one)")
    return bad + [f"twin without Hadamard: {b}" for b in sorted(set(BAD.findall(twin)))]


def gqa_unquantized_twin(v: Variant) -> dict:
    """compile_variant's changes for the GQA variant's twin without fp8 casts (its divisions are the fma
    the scan allows): caches, q_out and their second parts of the activations' width instead of bytes."""
    changes = {"FP8": ("constexpr", False), "Q_FP8": ("constexpr", False)}
    if v.constexpr("V_FP8") is not None:        # V in a cast of its own (K in another format): bf16 too
        changes["V_FP8"] = ("constexpr", False)
    for name in ("kc_ptr", "vc_ptr", "qo_ptr", "qo2_ptr", "kd2_ptr"):
        if str(v.signature.get(name, "")).startswith("*"):
            changes[name] = ("*bf16", None)
    return changes


def findings(v: Variant, ptx: str) -> list:
    """What ptx_check.py would report for this variant's PTX (an empty list: clean)."""
    bad = sorted(set(BAD.findall(ptx)))
    if v.name == "qkv_kernel" and (v.constexpr("FP8") or v.constexpr("Q_FP8") or v.constexpr("V_FP8")) \
            and not v.constexpr("SCALE_MUL"):
        bad = gqa_fp8_fma_findings(ptx, compile_variant(v, **gqa_unquantized_twin(v)))
    elif v.name == "index_write_kernel" and v.constexpr("HAD"):
        bad = hadamard_fma_findings(ptx, compile_variant(v, HAD=("constexpr", False)))
    pdl = v.constexpr("PDL") is True
    wait = ptx.find("griddepcontrol.wait")
    if pdl != (wait >= 0):
        bad.append("griddepcontrol.wait " + ("missing" if pdl else "unasked"))
    elif pdl and not v.kernel.is_gluon() and 0 <= ptx.find("ld.global") < wait:
        bad.append("griddepcontrol.wait after a global load")
    want = wanted_store_bytes(v)
    if want > 1 and _widest_store(ptx) < want:
        bad.append(f"narrow stores (the widest {_widest_store(ptx)} bytes, want {want})")
    return bad


def _innermost(e: BaseException) -> str:
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]


def _check(index: int):
    v = _VARIANTS[index]
    t0 = time.perf_counter()
    try:
        ptx = compile_variant(v)
        bad = findings(v, ptx)
        error = None
    except Exception as e:        # a variant that does not compile: the error says why
        bad, error, ptx = [], _innermost(e), ""
    return index, bad, error, len(ptx), time.perf_counter() - t0


_VARIANTS: list = []


def describe(v: Variant) -> str:
    consts = ", ".join(f"{v.kernel.arg_names[path[0]]}={value}" for path, value in sorted(v.constexprs.items())
                       if len(path) == 1 and value is not None and not isinstance(value, tuple))
    return f"{v.name}(num_warps={v.options['num_warps']}; {consts})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the variants, compile nothing")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    opts = parser.parse_args()
    t0 = time.perf_counter()
    book = record_variants(progress=lambda s: print(f"[{time.perf_counter() - t0:6.1f}s] {s}", flush=True))
    _VARIANTS[:] = list(book.variants.values())
    counts = {}
    for v in _VARIANTS:
        counts[v.name] = counts.get(v.name, 0) + 1
    print(f"{len(_VARIANTS)} variants from {book.launches} launches: "
          + ", ".join(f"{k} {c}" for k, c in sorted(counts.items()))
          + f" ({len(book.pdl_left_out)} PDL twins of portable variants left out: their launch configuration's is in)",
          flush=True)
    gaps = recording_gaps(book)
    for gap in gaps:
        print(f"FAIL recording: {gap}")
    if opts.list:
        for v in _VARIANTS:
            print(f"{describe(v)}  <- {v.label}")
        return 1 if gaps else 0
    failed, done, seconds = 0, 0, {}
    with multiprocessing.get_context("fork").Pool(max(1, opts.jobs)) as pool:
        for i, bad, error, size, secs in pool.imap_unordered(_check, range(len(_VARIANTS))):
            v = _VARIANTS[i]
            done += 1
            seconds[v.name] = seconds.get(v.name, 0.0) + secs
            if error or bad:
                failed += 1
                why = f"does not compile: {error}" if error else f"PTX findings: {bad}"
                print(f"FAIL {describe(v)}\n     first launched by: {v.label}\n     {why}", flush=True)
            if done % 100 == 0:
                print(f"[{time.perf_counter() - t0:6.1f}s] {done} compiled", flush=True)
    print("compile seconds (one process): " + ", ".join(f"{k} {t:.0f}" for k, t in sorted(seconds.items())))
    print(f"[{time.perf_counter() - t0:6.1f}s] {len(_VARIANTS) - failed} of {len(_VARIANTS)} variants compiled "
          f"clean for sm_90 under Triton {triton.__version__}; {failed} failed")
    return 1 if failed or gaps else 0


if __name__ == "__main__":
    sys.exit(main())
