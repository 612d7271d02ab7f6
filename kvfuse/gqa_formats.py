"""The cache formats of the GQA / MHA entry (:func:`kvfuse.fused_qk_norm_rope_store_kv`, SPEC §3) as data.

A :class:`GQACacheFormat` says what a K or V cache of that entry holds: the code of each value (the
activations' dtype, e4m3, e5m2, int8, ...), how values are scaled (not at all, by a scale the caller
gives, by one computed per (token, head) row or per group of a row and stored in a scale cache), and
which engine code reads the layout. :data:`PRESETS` holds the formats the kernels implement, named
after vLLM's ``kv_cache_dtype`` strings where one exists; :func:`get` resolves a name (or an alias,
:data:`ALIASES`). Validation (:mod:`kvfuse.plans.gqa`) checks a call's caches and scales against the
format; the plan carries the preset's name.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["GQACacheFormat", "PRESETS", "ALIASES", "CODES", "SCALE_KINDS", "get", "names", "resolve"]

CODES = ("act", "e4m3", "e5m2", "int8", "e2m1")
SCALE_KINDS = ("none", "static", "token_head", "block")
STORED_SCALE_KINDS = ("token_head", "block")
_CODE_BITS = {"e4m3": 8, "e5m2": 8, "int8": 8, "e2m1": 4}


@dataclasses.dataclass(frozen=True)
class GQACacheFormat:
    """One cache format of the GQA entry.

    Args:
        name: the preset's name (vLLM's kv_cache_dtype string where one exists).
        code: what a cache element holds: "act" (the activations' dtype, their bits), "e4m3", "e5m2",
            "int8" or "e2m1" (two codes a byte).
        cache_dtype: the code cache's torch dtype; None for "act" (the activations' dtype).
        scale: "none" (no scale), "static" (given by the caller: one per tensor, or one per kv head by the
            scale's shape), "token_head" (computed per (token, head) row and stored in a scale cache of the
            cache's shape minus its last dim), "block" (one per ``group`` elements of a row, stored in a
            scale cache of the cache's shape with last dim head_dim // group).
        group: elements per stored scale (0 where no scale is stored; a "token_head" scale covers the row).
        scale_dtype: the dtype of a stored scale (None where none is stored).
        qmax: the largest code magnitude the cast produces (the clamp bound; 0 for "act").
        reader: the engine code that reads this layout (engine, release, file / function).
        global_scale: besides its stored scales the format takes one static fp32 global decode scale per
            cache (``k_scale`` / ``v_scale``: NVFP4's second level).
    """
    name: str
    code: str
    cache_dtype: Optional[torch.dtype]
    scale: str
    group: int = 0
    scale_dtype: Optional[torch.dtype] = None
    qmax: float = 0.0
    reader: str = ""
    global_scale: bool = False

    def __post_init__(self):
        if self.code not in CODES:
            raise ValueError(f"code must be one of {CODES}, got {self.code!r}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"scale must be one of {SCALE_KINDS}, got {self.scale!r}")
        if (self.code == "act") != (self.cache_dtype is None) or (self.code == "act") != (self.scale == "none"):
            raise ValueError(f"{self.name}: code 'act' goes with cache_dtype None and scale 'none', and only it")
        if self.stores_scale != (self.scale_dtype is not None):
            raise ValueError(f"{self.name}: scale_dtype must be given exactly for a stored scale "
                             f"{STORED_SCALE_KINDS}, got {self.scale_dtype} with scale {self.scale!r}")
        if (self.scale == "block") != (self.group > 0):
            raise ValueError(f"{self.name}: group must be > 0 exactly for scale 'block', got {self.group}")

    @property
    def stores_scale(self) -> bool:
        """Its scales are computed by the kernel and written to a scale cache."""
        return self.scale in STORED_SCALE_KINDS

    @property
    def values_per_element(self) -> int:
        """Values one element of the code cache holds (2 for e2m1: a cache's last dim is head_dim / 2)."""
        return 2 if self.code == "e2m1" else 1

    @property
    def takes_static_scale(self) -> bool:
        """The caller gives a scale (k_scale / v_scale): a static one, or a global scale over stored ones."""
        return self.scale == "static" or self.global_scale

    def dtype_for(self, act: torch.dtype) -> torch.dtype:
        """The code cache's dtype for activations of dtype ``act``."""
        return act if self.cache_dtype is None else self.cache_dtype

    def scale_cache_shape(self, cache_shape, head_dim: int) -> Optional[tuple]:
        """The scale cache's shape for a code cache of ``cache_shape`` (NHD or HND) holding heads of
        ``head_dim`` elements; None where no scale is stored."""
        if self.scale == "token_head":
            return tuple(cache_shape[:-1])
        if self.scale == "block":
            return tuple(cache_shape[:-1]) + (head_dim // self.group,)
        return None

    def value_bytes(self, act: torch.dtype = torch.bfloat16) -> float:
        """Bytes of one stored value's code (0.5 for e2m1)."""
        if self.code == "act":
            return torch.empty((), dtype=act).element_size()
        return _CODE_BITS[self.code] / 8

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of the stored scales of one (token, head) row of ``head_dim`` values (0 where none)."""
        if not self.stores_scale:
            return 0
        per_row = 1 if self.scale == "token_head" else head_dim // self.group
        return per_row * torch.empty((), dtype=self.scale_dtype).element_size()

    def row_bytes(self, head_dim: int, act: torch.dtype = torch.bfloat16) -> float:
        """Bytes one (token, head) row of ``head_dim`` values takes in the caches: codes and stored scales."""
        return head_dim * self.value_bytes(act) + self.scale_bytes(head_dim)


_VLLM_FLASH = ("vLLM 0.33.0, vllm/v1/attention/backends/flash_attn.py (FlashAttention), triton_attn.py "
               "(unified_attention)")
_VLLM_PER_TOKEN_HEAD = ("vLLM 0.33.0, vllm/v1/attention/backends/triton_attn.py (TritonAttentionImpl: scale caches "
                        "from _ensure_scale_caches, read by unified_attention)")
_FLASHINFER = "FlashInfer 0.7.2, flashinfer/decode.py, prefill.py (BatchDecode/PrefillWithPagedKVCacheWrapper)"
_NVFP4 = ("FlashInfer 0.7.2.post1, flashinfer/page.py nvfp4_quantize_append_paged_kv_cache[_with_slot_mapping] "
          "(its writer; its NVFP4 attention reads e2m1 * block scale * global scale); vLLM 0.33.0 kv_cache_dtype "
          "'nvfp4' on SM80 / SM90 / SM120, vllm/v1/attention/backends/flashinfer.py do_kv_cache_update (that "
          "writer on the views _nvfp4_kv_views cuts from its pages)")
_MXFP4 = ("none found: no engine kvfuse follows reads an MXFP4 GQA cache (vLLM 0.33.0's ultraquant_4bit, "
          "vllm/v1/attention/ops/ultraquant, is another rule); the rule is SPEC §6's e2m1 / ue8m0 one")

PRESETS = {f.name: f for f in (
    GQACacheFormat("auto", "act", None, "none", reader=f"{_VLLM_FLASH}; {_FLASHINFER}"),
    GQACacheFormat("fp8_e4m3", "e4m3", torch.float8_e4m3fn, "static", qmax=448.0,
                   reader=f"{_VLLM_FLASH}, k_scale / v_scale as descale; {_FLASHINFER}, k_scale / v_scale"),
    GQACacheFormat("fp8_e5m2", "e5m2", torch.float8_e5m2, "static", qmax=57344.0,
                   reader="vLLM 0.33.0, vllm/v1/attention/backends/triton_attn.py (unified_attention, "
                          f"kv_cache_dtype 'fp8_e5m2'); {_FLASHINFER}, kv dtype float8_e5m2"),
    GQACacheFormat("fp8_per_token_head", "e4m3", torch.float8_e4m3fn, "token_head", scale_dtype=torch.float32,
                   qmax=448.0, reader=_VLLM_PER_TOKEN_HEAD),
    GQACacheFormat("int8_per_token_head", "int8", torch.int8, "token_head", scale_dtype=torch.float32,
                   qmax=127.0, reader=_VLLM_PER_TOKEN_HEAD),
    # 4-bit: e2m1 codes two a byte with stored group scales (kvfuse/reference/fp4.py, SPEC §3)
    GQACacheFormat("nvfp4", "e2m1", torch.uint8, "block", group=16, scale_dtype=torch.float8_e4m3fn, qmax=6.0,
                   reader=_NVFP4, global_scale=True),
    GQACacheFormat("mxfp4", "e2m1", torch.uint8, "block", group=32, scale_dtype=torch.uint8, qmax=6.0,
                   reader=_MXFP4),
)}
# other names of a preset (vLLM's "fp8" is its "fp8_e4m3")
ALIASES = {"fp8": "fp8_e4m3"}


def names() -> tuple:
    """The preset names (without the aliases)."""
    return tuple(PRESETS)


def get(name: str) -> GQACacheFormat:
    """The preset of ``name`` or of an alias (case-insensitive); ValueError listing the names otherwise."""
    if isinstance(name, str):
        key = name.lower()
        found = PRESETS.get(ALIASES.get(key, key))
        if found is not None:
            return found
    known = ", ".join(repr(n) for n in tuple(PRESETS) + tuple(ALIASES))
    raise ValueError(f"expected a GQA cache format name ({known}), got {name!r}")


def resolve(fmt, what: str) -> GQACacheFormat:
    """A preset from a name or a GQACacheFormat equal to a preset (the kernels implement the presets);
    ValueError / TypeError naming ``what`` otherwise."""
    if isinstance(fmt, GQACacheFormat):
        preset = PRESETS.get(fmt.name)
        if preset != fmt:
            raise ValueError(f"{what}: expected one of kvfuse.gqa_formats.PRESETS (the formats the kernels "
                             f"implement), got {fmt!r}")
        return preset
    if not isinstance(fmt, str):
        raise TypeError(f"{what}: expected a format name (str) or a GQACacheFormat, got {type(fmt).__name__}")
    try:
        return get(fmt)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
