"""Cases of kvfuse.fused_qk_norm_rope_store_kv (SPEC §3) shared by the CPU tests (the interpreter) and
tests/gpu/test_gpu_gqa.py (not a test module itself).

:func:`run_gqa_case` builds one case's inputs from its seed on the CPU, moves them to the device, calls
the public function on a backend and returns every byte the call could have touched, as CPU uint8
tensors: the whole storages of the two caches (random bytes, with guards before and after the cache
views and padding between blocks), the whole q_out buffer (NaN-poisoned, with padding between rows)
and the whole packed QKV buffer (unchanged, or q rewritten in place). Two runs of the same case on
two backends or devices must return equal bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import kvfuse
from helpers import cos_sin_cache, random_bf16

GUARD = 48        # elements before and after a cache view in its storage
MAX_POS = 40      # rows of the cos/sin table
ACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def random_act(shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """random_bf16's values (outliers, tiny values, signed zeros) in ``dtype``; fp16 / fp32 values get
    mantissa bits past bf16's (a relative perturbation of about 2^-10)."""
    v = random_bf16(shape, seed)
    if dtype == torch.bfloat16:
        return v
    g = torch.Generator().manual_seed(seed + 77)
    return (v.float() * (1.0 + 2.0 ** -10 * torch.randn(shape, generator=g))).to(dtype)


@dataclasses.dataclass(frozen=True)
class GQACase:
    n: int = 5
    hq: int = 4
    hkv: int = 2
    d: int = 128
    dv: Optional[int] = None             # None: d
    layout: str = "NHD"
    fp8: bool = False
    q_norm: Optional[str] = "bf16"       # the weight's dtype ("bf16" / "fp16" / "fp32"), None: no q norm
    k_norm: Optional[str] = "fp32"
    rotary_dim: Optional[int] = None     # None: d (full rotary); 0: no RoPE
    rope_offset: Optional[int] = None    # None: the default (0)
    neox: bool = True
    conjugate: bool = False
    cos_sin: str = "fp32"                # the cos / sin table's dtype: "fp32" / "bf16" / "fp16"
    inplace: bool = False                # q_out is q
    q_out_none: bool = False             # q_out=None: allocated by the call
    packed: bool = True                  # q, k, v views of one packed QKV buffer
    cache: str = "guarded"               # "guarded": each cache a view into random bytes with guards and block
                                         # padding; "vllm": kv[:, 0] / kv[:, 1] of one [NB, 2, ...] allocation
    block_size: int = 4
    extra_blocks: int = 1
    slots: str = "invalid"               # "invalid": shuffled, with invalid slots; "contiguous": 0..n-1
    idx32: bool = False                  # int32 slots and positions
    scales: tuple = (0.37, 0.11)         # k_scale, v_scale (fp8): the kernel divides by a reciprocal for
                                         # 2^-64 <= |scale| <= 2^64, else element by element
    scale_per_head: str = ""             # "k", "v" or "kv": those scales one per kv head (fp8), head h's
                                         # scale * (0.5 + h), the last of 3 or more heads 2^70 (divided)
    dtype: str = "bf16"                  # the activations' dtype: "bf16" / "fp16" / "fp32" (q, k, v, q_out and
                                         # an unquantized cache)
    numerics: str = "staged"             # the profile (kvfuse.numerics_profiles.NUMERICS)
    kv_cache: bool = True                # False: no caches, k written to k_out (k itself when inplace)
    v_cache: bool = True                 # False (with kv_cache): a K cache alone, v None (MLA's latent)
    split: int = 0                       # > 0: q, k, q_out and k_out passed as pairs (first `split` columns, the rest)
    k_cache_split: bool = False          # k_cache a pair of caches split at `split` (FlashInfer's kpe / ckv)
    q_fp8: bool = False                  # q_out float8_e4m3fn with q_scale
    q_scale: float = 0.29
    k_out_fp8: bool = False              # without caches: k_out float8_e4m3fn with k_scale
    scale_convention: str = "divide"     # or "multiply" (FlashInfer's)
    scale_numbers: bool = False          # the scales passed as Python floats
    paged_append: bool = False           # the slots as FlashInfer's append addressing (kvfuse.PagedAppend)
    fp4_k: str = ""                      # "nvfp4" / "mxfp4": k_cache in that 4-bit format (uint8 codes, a scale
    fp4_v: str = ""                      # cache of its own; nvfp4's global scale from `scales`); likewise v_cache
    seed: int = 0
    mrope: str = ""                      # "chunked" / "interleaved": mRoPE, positions [3, n] (rows of a wider buffer)
    mrope_section: tuple = ()            # () : t, h, w = rdim / 2 - 2 h, 3 rdim / 16, 3 rdim / 16
    v_norm: Optional[str] = None         # V-norm: its weight's dtype ("bf16" / "fp16" / "fp32"), "none": weightless

    @property
    def act(self) -> torch.dtype:
        return ACT_DTYPES[self.dtype]

    @property
    def v_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    @property
    def rdim(self) -> int:
        return self.d if self.rotary_dim is None else self.rotary_dim

    @property
    def section(self) -> tuple:
        """The mRoPE section of the case (mrope_section, or one derived from the rotary dims)."""
        if self.mrope_section:
            return self.mrope_section
        half = self.rdim // 2
        h = 3 * half // 8
        return (half - 2 * h, h, h)

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        default = dataclasses.asdict(GQACase())
        return "GQACase(" + ", ".join(f"{k}={v!r}" for k, v in fields.items() if v != default[k] or k in (
            "n", "hq", "hkv", "d", "layout", "fp8")) + ")"


FP4_SCALE_DTYPES = {"nvfp4": (16, torch.float8_e4m3fn), "mxfp4": (32, torch.uint8)}   # group, scale dtype


def _cache_views(case: GQACase, g: torch.Generator, device):
    """(k_cache, v_cache, [storages], (k_scale_cache, v_scale_cache)) for the case: views into random bytes
    (bf16, fp8, or a 4-bit format's uint8 codes and its scale cache)."""
    nb = -(-case.n // case.block_size) + case.extra_blocks
    bs, h, d, dv = case.block_size, case.hkv, case.d, case.v_dim
    dt = torch.float8_e4m3fn if case.fp8 else case.act

    def rand(count, dtype):
        if dtype.itemsize == 1:
            return torch.randint(0, 256, (count,), generator=g, dtype=torch.int64).to(torch.uint8)
        lim = 1 << (8 * dtype.itemsize - 1)
        return torch.randint(-lim, lim, (count,), generator=g, dtype=torch.int64).to(
            {2: torch.int16, 4: torch.int32}[dtype.itemsize])

    def inner(dim):     # the shape and strides of one block in elements, dense
        if case.layout == "NHD":
            return (bs, h, dim), (h * dim, dim, 1)
        return (h, bs, dim), (bs * dim, dim, 1)

    if case.cache == "vllm":
        assert d == dv and not (case.fp4_k or case.fp4_v)
        shape, strides = inner(d)
        block = bs * h * d
        storage = rand(nb * 2 * block + 2 * GUARD, dt).to(device)
        view = storage.view(dt)
        k = torch.as_strided(view, (nb,) + shape, (2 * block,) + strides, GUARD)
        v = torch.as_strided(view, (nb,) + shape, (2 * block,) + strides, GUARD + block)
        return k, v, [storage], (None, None)
    caches, storages = [], []

    def view(dim, dtype, pad):
        shape, strides = inner(dim)
        block = bs * h * dim + pad                  # padding after every block
        storage = rand(nb * block + 2 * GUARD, dtype).to(device)
        storages.append(storage)
        return torch.as_strided(storage.view(dtype), (nb,) + shape, (block,) + strides, GUARD)

    k_dims = ((case.split, 16), (d - case.split, 32)) if case.k_cache_split else ((d, 16),)
    for (dim, pad), fp4 in [(kd, case.fp4_k) for kd in k_dims] + ([((dv, 48), case.fp4_v)] if case.v_cache else []):
        caches.append(view(dim // 2, torch.uint8, pad) if fp4 else view(dim, dt, pad))
    scale_caches = []
    for fp4, dim in ((case.fp4_k, d), (case.fp4_v, dv)):
        group, sdt = FP4_SCALE_DTYPES[fp4] if fp4 else (0, None)
        scale_caches.append(view(dim // group, sdt, 8) if fp4 else None)
    k_cache = tuple(caches[:2]) if case.k_cache_split else caches[0]
    return k_cache, caches[-1] if case.v_cache else None, storages, tuple(scale_caches)


def build(case: GQACase, device="cpu"):
    """The call's keyword arguments and the buffers whose bytes are compared."""
    g = torch.Generator().manual_seed(case.seed)
    n, hq, hkv, d, dv = case.n, case.hq, case.hkv, case.d, case.v_dim
    width = hq * d + hkv * d + hkv * dv
    if case.packed:
        qkv = random_act((n, width + 8), case.seed, case.act).to(device)   # 8 spare columns: a row stride != width
        q = qkv[:, :hq * d].view(n, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
        v = qkv[:, (hq + hkv) * d:width].view(n, hkv, dv)
        inputs = [qkv]
    else:
        q = random_act((n, hq, d), case.seed, case.act).to(device)
        k = random_act((n, hkv, d), case.seed + 1, case.act).to(device)
        v = random_act((n, hkv, dv), case.seed + 2, case.act).to(device)
        inputs = [q, k, v]
    k_cache, v_cache, storages, scale_caches = _cache_views(case, g, device)
    cap = _first(k_cache).shape[0] * case.block_size
    idx = torch.int32 if case.idx32 else torch.int64
    if case.slots == "contiguous":
        slots = torch.arange(n)
    else:
        slots = torch.randperm(cap, generator=g)[:n]
        bad = torch.tensor([-1, cap, -5, cap + 7, -(2 ** 31) if case.idx32 else -(2 ** 40)])
        slots[1::3] = bad.repeat(n)[: slots[1::3].numel()]
    kw = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots.to(idx).to(device),
              layout=case.layout, numerics=case.numerics)

    def weight(kind):
        if kind is None:
            return None
        w = 1.0 + 0.2 * torch.randn(d, generator=g)
        return kvfuse.NormArgs(w.to(ACT_DTYPES[kind]).to(device), eps=1e-6 if kind == "bf16" else 1e-5)

    kw["q_norm_args"], kw["k_norm_args"] = weight(case.q_norm), weight(case.k_norm)
    if case.rdim:
        pos = torch.randint(0, MAX_POS, (n,), generator=g)
        pos[2::4] = torch.tensor([-1, MAX_POS, MAX_POS + 9]).repeat(n)[: pos[2::4].numel()]   # identity rotations
        cs = cos_sin_cache(MAX_POS, case.rdim, ACT_DTYPES[case.cos_sin])
        mrope = {}
        if case.mrope:          # three rows of a wider buffer, each with positions out of range at other tokens
            rows = torch.randint(0, MAX_POS, (3, n + 3), generator=g)
            for r in range(3):
                rows[r, r + 1:n:4] = torch.tensor([-1, MAX_POS, MAX_POS + 3]).repeat(n)[: rows[r, r + 1:n:4].numel()]
            pos = rows[:, 1:n + 1]
            mrope = dict(mrope_section=case.section, mrope_interleaved=case.mrope == "interleaved")
        kw["rope_args"] = kvfuse.RopeArgs(pos.to(idx).to(device), cs.to(device), case.rdim, case.neox,
                                          case.rope_offset, case.conjugate, **mrope)
    if case.v_norm is not None:
        w = None if case.v_norm == "none" else (1.0 + 0.2 * torch.randn(dv, generator=g)).to(ACT_DTYPES[case.v_norm])
        kw["v_norm_args"] = kvfuse.NormArgs(None if w is None else w.to(device), eps=1e-6)
    if not case.v_cache:
        kw["v"] = None
    if case.fp4_k or case.fp4_v:        # the formats named (caches of two formats), 4-bit ones with their scales
        other = "fp8_e4m3" if case.fp8 else "auto"
        kw["k_format"] = case.fp4_k or other
        kw["k_scale_cache"] = scale_caches[0]
        if case.v_cache:
            kw["v_format"] = case.fp4_v or other
            kw["v_scale_cache"] = scale_caches[1]
    if case.fp8:
        kw["k_scale"] = torch.tensor([case.scales[0]], device=device)
        kw["v_scale"] = torch.tensor(case.scales[1], device=device) if case.v_cache else None
        for which, name, base in (("k", "k_scale", case.scales[0]), ("v", "v_scale", case.scales[1])):
            if which in case.scale_per_head:
                per_head = [base * (0.5 + h) for h in range(case.hkv)]
                if case.hkv >= 3:
                    per_head[-1] = 2.0 ** 70
                kw[name] = torch.tensor(per_head, dtype=torch.float32, device=device)
    for fp4, name, base in ((case.fp4_k, "k_scale", case.scales[0]), (case.fp4_v, "v_scale", case.scales[1])):
        if fp4 or not case.fp8:
            kw.pop(name, None)
        if fp4 == "nvfp4" and (name == "k_scale" or case.v_cache):      # the global decode scale
            kw[name] = torch.tensor([base], device=device)
    if case.inplace:
        kw["q_out"] = q
        q_buf = None
    elif case.q_out_none:
        q_buf = None
    else:
        q_buf = _poisoned((n, hq * d + 24), case.act, case.q_fp8, device)
        kw["q_out"] = q_buf[:, :hq * d].view(n, hq, d)
    if case.q_fp8:
        kw["q_scale"] = torch.tensor(case.q_scale, device=device)
    if not case.kv_cache:       # no caches: k to k_out (k itself in place, else a poisoned buffer)
        kw.update(k_cache=None, v_cache=None, slot_mapping=None, k_scale=None, v_scale=None)
        storages = []
        if case.inplace:
            kw["k_out"] = k
        else:
            k_buf = _poisoned((n, hkv * d + 40), case.act, case.k_out_fp8, device)
            kw["k_out"] = k_buf[:, :hkv * d].view(n, hkv, d)
            storages = [k_buf]
        if case.k_out_fp8:
            kw["k_scale"] = torch.tensor(case.scales[0], device=device)
    if case.split:              # heads as (first `split` columns, the rest): views of the tensors above
        for name in ("q", "k", "q_out", "k_out"):
            t = kw.get(name)
            if t is not None:
                kw[name] = (t[..., :case.split], t[..., case.split:])
        if case.inplace:        # in place: the same pair of views
            kw["q_out"] = kw["q"]
            if not case.kv_cache:
                kw["k_out"] = kw["k"]
    if case.paged_append and kw.get("slot_mapping") is not None:
        kw["slot_mapping"] = paged_append_of(kw["slot_mapping"], case.block_size)
    if case.scale_numbers:
        for name in ("q_scale", "k_scale", "v_scale"):
            if kw.get(name) is not None:
                kw[name] = float(kw[name].reshape(-1)[0])
    if case.scale_convention != "divide":
        kw["scale_convention"] = case.scale_convention
    return kw, storages, inputs, q_buf


def paged_append_of(slots: torch.Tensor, block_size: int) -> kvfuse.PagedAppend:
    """The same writes as ``slots`` in FlashInfer's addressing: token i its own request of one page
    (kv_indices[i] = slot // block_size, position slot % block_size), requests in reverse order; an
    invalid slot becomes, in turn, a padding token (batch index -1), a batch index past the requests, a
    negative position, or a position whose page index runs past kv_indices."""
    n = slots.shape[0]
    s = slots.long().cpu()
    cap_ok = s >= 0
    order = torch.arange(n - 1, -1, -1)                     # token i is request n - 1 - i
    kv_indices = torch.where(cap_ok, torch.div(s, block_size, rounding_mode="floor"), 0)[order]
    kv_indptr = torch.arange(n + 1)
    batch = order.clone()
    pos = torch.where(cap_ok, torch.remainder(s, block_size), 0)
    bad = torch.nonzero(~cap_ok).flatten().tolist()
    for j, i in enumerate(bad):
        kind = j % 4
        if kind == 0:
            batch[i] = -1
        elif kind == 1:
            batch[i] = n + 3
        elif kind == 2:
            pos[i] = -2
        else:
            batch[i], pos[i] = 0, block_size * (n + 2)        # kv_indptr[0] + pos // bs runs past kv_indices
    # slots past the capacity stay pages past the cache (the kernel's capacity check)
    big = s >= 0
    kv_indices[order[big]] = torch.div(s[big], block_size, rounding_mode="floor")
    dt, dev = slots.dtype, slots.device
    return kvfuse.PagedAppend(kv_indices.to(dt).to(dev), kv_indptr.to(dt).to(dev), batch.to(dt).to(dev),
                              pos.to(dt).to(dev))


def _first(t):
    return t[0] if isinstance(t, tuple) else t


def _poisoned(shape, act, fp8: bool, device):
    """An output buffer: NaN of the activations' dtype, or (fp8) e4m3 NaN codes 0x7f."""
    if fp8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return torch.full(shape, float("nan"), dtype=act, device=device)


def _bytes(t):
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).clone()


def run_gqa_case(case: GQACase, backend: str, device="cpu", fn=None) -> dict:
    """Run the case on ``backend``; every byte it could have touched (CPU uint8 tensors by name)."""
    kw, storages, inputs, q_buf = build(case, device)
    call = kvfuse.fused_qk_norm_rope_store_kv if fn is None else fn
    with kvfuse.use_backend(backend):
        result = call(**kw)
    if not case.kv_cache and fn is None:
        result, k_result = result
        assert _same(k_result, kw["k_out"])
    if case.inplace:
        assert _same(result, kw["q"])
    elif not case.q_out_none:
        assert _same(result, kw["q_out"])
    out = {f"cache_storage{i}": _bytes(s) for i, s in enumerate(storages)}
    out.update({f"input{i}": _bytes(t) for i, t in enumerate(inputs)})
    if q_buf is not None:
        out["q_out"] = _bytes(q_buf)
    else:
        parts = result if isinstance(result, tuple) else (result,)
        out["q_out"] = torch.cat([_bytes(t) for t in parts])
    return out


def _same(a, b) -> bool:
    """The call returned the tensor given (each of a pair)."""
    if isinstance(b, tuple):
        return isinstance(a, tuple) and len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def diff_report(a: dict, b: dict) -> str:
    """'' when every buffer is byte-equal, else which differ and where first."""
    bad = []
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape:
            bad.append(f"{name}: {x.numel()} vs {y.numel()} bytes")
        elif not torch.equal(x, y):
            idx = (x != y).nonzero().flatten()
            bad.append(f"{name}: {idx.numel()} bytes differ, first at {int(idx[0])}")
    return "; ".join(bad)


def gpu_against_cpu_reference(case: GQACase, launches: int = 2):
    """The case on the CPU reference, then ``launches`` times on the GPU (the first launch compiles, the
    next reuse the kernel): (reports of the launches that differ, their differing bytes)."""
    ref = run_gqa_case(case, "reference", "cpu")
    reports, differing = [], 0
    for i in range(launches):
        got = run_gqa_case(case, "triton", "cuda")
        report = diff_report(ref, got)
        if report:
            reports.append(f"launch {i + 1}: {report}")
            differing += sum(int((ref[k] != got[k]).sum()) if ref[k].shape == got[k].shape else ref[k].numel()
                             for k in ref)
    return reports, differing
