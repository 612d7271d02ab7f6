"""Paged KV-cache formats (SPEC §7 and §8).

A cache is a ``uint8`` tensor ``[num_blocks, block_size, num_heads, bytes_per_token]``. A
:class:`KVCacheFormat` says what one (token, head) record holds and where its bytes lie:

* token-interleaved (main caches): the record of (block b, offset o, head h) starts at byte
  ``b*stride(0) + o*stride(1) + h*bytes_per_token`` and holds
  ``[quantized data | scales (+ reserved) | bf16 tail]``.
* block-wide (index caches, num_heads == 1): inside block b, all tokens' data first
  (``block_size * data_bytes``; per token ``[quantized | bf16 tail]``), then all tokens' scales
  (``block_size * sf_bytes``).

Strides (bytes): stride(3) = 1, stride(2) = bytes_per_token; token-interleaved: stride(1) a
multiple of stride_alignment = gcd(32, bytes_per_token) and >= num_heads * bytes_per_token;
block-wide: num_heads 1 and stride(1) = bytes_per_token (stride_alignment 32). The block stride
stride(0) is a multiple of stride_alignment and may exceed the block's records (padding between
blocks: FlashMLA's own tests allocate FLASHMLA_V32 blocks of (block_size + 1) * 656 bytes).

Dequantization of group k (g = elements_per_sf consecutive quantized elements) of a record:
``v_i = bf16(float32(q_i) * d_k)`` with ``d_k = 2**(byte - 127)`` for ue8m0, the stored fp32 for
ue8m0_fp32 and fp32, and the e4m3 value of the stored byte for e4m3. e2m1 codes are packed two
per byte, the even element in the low nibble. The bf16 tail is stored raw.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Optional

import torch

__all__ = [
    "KVCacheFormat", "RecordAddressing", "PRESETS", "allocate_kv_cache",
    "MAIN_FP8", "MAIN_MXFP8", "MAIN_FP4", "INDEX_MXFP8", "INDEX_FP8_FP32", "INDEX_MXFP4", "INDEX_NVFP4",
    "INDEX_BF16", "FLASHMLA_V32", "FLASHMLA_MODEL1",
]

CAST_FORMATS = ("e4m3", "e2m1")
GROUP_SIZES = (16, 32, 64, 128)
FMAX = {"e4m3": 448.0, "e2m1": 6.0}


@dataclasses.dataclass(frozen=True)
class ScaleFormat:
    """How a group's scale is stored (an sf_format): its dtype in a scale tensor, its bytes in a
    record, and whether the scale is rounded up to a power of two (``CastArgs.round_sf``)."""
    name: str
    dtype: torch.dtype
    item_bytes: int
    power_of_two: bool


SCALE_FORMATS = {s.name: s for s in (
    ScaleFormat("ue8m0", torch.uint8, 1, True),              # the exponent byte: scale 2^(byte - 127)
    ScaleFormat("ue8m0_fp32", torch.float32, 4, True),       # the same scale stored as fp32
    ScaleFormat("e4m3", torch.float8_e4m3fn, 1, False),
    ScaleFormat("fp32", torch.float32, 4, False),
)}
SF_FORMATS = tuple(SCALE_FORMATS)
SF_ITEM_BYTES = {name: s.item_bytes for name, s in SCALE_FORMATS.items()}   # bytes of one stored scale
POWER_OF_TWO_SF_FORMATS = tuple(name for name, s in SCALE_FORMATS.items() if s.power_of_two)


def sf_dtype(sf_format: str) -> torch.dtype:
    """The dtype of a scale tensor of ``sf_format``."""
    return SCALE_FORMATS[sf_format].dtype


def q_dtype(cast_fmt: str) -> torch.dtype:
    """The dtype of quantized values: float8_e4m3fn for e4m3, uint8 (two e2m1 a byte) for e2m1."""
    return torch.float8_e4m3fn if cast_fmt == "e4m3" else torch.uint8


def scale_floor_exponent(scale_floor, what: str = "scale_floor") -> int:
    """ceil(log2(float32(scale_floor))) (SPEC §6 scale_floor: the smallest power-of-two scale is
    2^that); ValueError naming ``what`` unless scale_floor is a number whose float32 is a normal
    value in [2^-126, 2^127]."""
    if isinstance(scale_floor, bool) or not isinstance(scale_floor, (int, float)) or not math.isfinite(scale_floor):
        raise ValueError(f"{what} must be a finite number > 0 or None, got {scale_floor!r}")
    f = struct.unpack("<f", struct.pack("<f", float(scale_floor)))[0] if abs(scale_floor) < 3.4e38 else math.inf
    if not 2.0 ** -126 <= f <= 2.0 ** 127:
        raise ValueError(f"{what} must lie in [2^-126, 2^127] (as float32), got {scale_floor!r}")
    bits = struct.unpack("<i", struct.pack("<f", f))[0]
    return ((bits - 1) >> 23) + 1 - 127


def check_cast_combination(cast_fmt, num_per_channels, round_sf, sf_format, quant_dim, what, scale_floor=None):
    """SPEC §6 allowed combinations; raises ValueError naming ``what``."""
    if cast_fmt not in CAST_FORMATS:
        raise ValueError(f"{what}: cast_fmt must be one of {CAST_FORMATS}, got {cast_fmt!r}")
    if sf_format not in SF_FORMATS:
        raise ValueError(f"{what}: sf_format must be one of {SF_FORMATS}, got {sf_format!r}")
    if not isinstance(num_per_channels, int) or isinstance(num_per_channels, bool) or num_per_channels not in GROUP_SIZES:
        raise ValueError(f"{what}: num_per_channels must be one of {GROUP_SIZES}, got {num_per_channels!r}")
    if not isinstance(round_sf, bool):
        raise TypeError(f"{what}: round_sf must be a bool, got {type(round_sf).__name__}")
    want_round = SCALE_FORMATS[sf_format].power_of_two
    if round_sf != want_round:
        raise ValueError(f"{what}: round_sf must be {want_round} for sf_format {sf_format!r}, got {round_sf}")
    if cast_fmt == "e2m1" and (num_per_channels, sf_format) not in ((16, "e4m3"), (32, "ue8m0")):
        raise ValueError(f"{what}: e2m1 needs (num_per_channels, sf_format) in ((16, 'e4m3'), (32, 'ue8m0')), "
                         f"got ({num_per_channels}, {sf_format!r})")
    if quant_dim is not None and (quant_dim <= 0 or quant_dim % num_per_channels):
        raise ValueError(f"{what}: num_per_channels={num_per_channels} must divide the quantized dims "
                         f"({quant_dim})")
    if scale_floor is not None:
        if sf_format not in POWER_OF_TWO_SF_FORMATS:
            raise ValueError(f"{what}: scale_floor needs a power-of-two sf_format {POWER_OF_TWO_SF_FORMATS}, "
                             f"got sf_format {sf_format!r} with scale_floor={scale_floor!r}")
        scale_floor_exponent(scale_floor, f"{what}: scale_floor")


@dataclasses.dataclass(frozen=True)
class RecordAddressing:
    """Byte offsets of one (token, head) record inside a block (add ``block * stride(0)``).

    data of token offset o, head h: ``o*data_token_stride + h*head_stride + data_offset``;
    scales: ``o*sf_token_stride + h*head_stride + sf_offset``; bf16 tail:
    ``o*data_token_stride + h*head_stride + tail_offset``.
    """
    data_token_stride: int
    sf_token_stride: int
    head_stride: int
    data_offset: int
    sf_offset: int
    tail_offset: int


@dataclasses.dataclass(frozen=True)
class KVCacheFormat:
    """One record format of a paged KV cache (see the module docstring for layouts).

    Args:
        name: a label.
        head_dim: elements per (token, head), a multiple of 16.
        cast_fmt: "e4m3", "e2m1" or None (a bf16 cache: elements_per_sf and sf_format None).
        elements_per_sf: the group size g (16, 32, 64, 128).
        sf_format: "ue8m0", "ue8m0_fp32", "e4m3" or "fp32".
        token_interleaved: True for the record-per-token layout, False for block-wide.
        sf_bytes: bytes for the scales of one record; defaults to the exact scale bytes and may be
            larger (the rest is reserved: never written, or written as zeros with ``zero_reserved``).
        bf16_tail: the last ``bf16_tail`` dims are stored as raw bf16 beside the quantized part
            (FlashMLA formats, SPEC §8); scales cover only the first head_dim - bf16_tail dims.
        block_alignment: what ``allocate_kv_cache`` rounds a block's byte stride up to (lcm with
            stride_alignment): 32 by default; 656 for FLASHMLA_V32 and 576 for FLASHMLA_MODEL1, the
            multiples FlashMLA's sparse decode asserts. Not part of the record layout, and not
            checked by ``check_cache`` (which needs stride(0) a multiple of stride_alignment only).
        scale_floor: the smallest power-of-two scale, as FlashMLA's quantizer floors it (SPEC §6:
            the scale is 2^ceil(log2(max(amax / fmax, scale_floor)))); only with ue8m0 / ue8m0_fp32.
            FLASHMLA_V32 and FLASHMLA_MODEL1 carry 1e-4; ``CastArgs.from_cache_format`` copies it.
        zero_reserved: the reserved bytes (sf_bytes beyond the exact scale bytes) are written as zeros
            with every record; False: never written (they keep what the cache held). MAIN_FP8 writes
            them: its 532-byte records then fill every DRAM sector they touch, where a never-written
            byte costs its sector a read-modify-write on eviction (docs/performance.md, "The cast
            alone"). Needs reserved bytes.
    """
    name: str
    head_dim: int
    cast_fmt: Optional[str]
    elements_per_sf: Optional[int]
    sf_format: Optional[str]
    token_interleaved: bool
    sf_bytes: Optional[int] = None
    bf16_tail: int = 0
    block_alignment: int = 32
    scale_floor: Optional[float] = None
    zero_reserved: bool = False

    def __post_init__(self):
        what = f"KVCacheFormat {self.name!r}"
        for field in ("head_dim", "bf16_tail", "block_alignment"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{what}: {field} must be an int, got {type(v).__name__}")
        for field in ("token_interleaved", "zero_reserved"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{what}: {field} must be a bool, got {type(getattr(self, field)).__name__}")
        if self.head_dim <= 0 or self.head_dim % 16:
            raise ValueError(f"{what}: head_dim must be a positive multiple of 16, got {self.head_dim}")
        if self.block_alignment <= 0:
            raise ValueError(f"{what}: block_alignment must be positive, got {self.block_alignment}")
        if self.cast_fmt is None:
            if self.elements_per_sf is not None or self.sf_format is not None:
                raise ValueError(f"{what}: a bf16 cache (cast_fmt None) needs elements_per_sf and sf_format None, "
                                 f"got {self.elements_per_sf!r}, {self.sf_format!r}")
            if self.bf16_tail != 0:
                raise ValueError(f"{what}: bf16_tail needs a quantized format, got bf16_tail={self.bf16_tail}")
            if self.sf_bytes not in (None, 0):
                raise ValueError(f"{what}: a bf16 cache has no scales, got sf_bytes={self.sf_bytes}")
            if self.zero_reserved:
                raise ValueError(f"{what}: zero_reserved needs reserved scale bytes; a bf16 cache has none")
            object.__setattr__(self, "sf_bytes", 0)
            return
        if not 0 <= self.bf16_tail < self.head_dim or self.bf16_tail % 16:
            raise ValueError(f"{what}: bf16_tail must be a multiple of 16 in [0, head_dim), got {self.bf16_tail}")
        check_cast_combination(self.cast_fmt, self.elements_per_sf, self.sf_format in POWER_OF_TWO_SF_FORMATS,
                               self.sf_format, self.quant_dim, what, self.scale_floor)
        exact = self.num_scales * SF_ITEM_BYTES[self.sf_format]
        if self.sf_bytes is None:
            object.__setattr__(self, "sf_bytes", exact)
        elif isinstance(self.sf_bytes, bool) or not isinstance(self.sf_bytes, int) or self.sf_bytes < exact:
            raise ValueError(f"{what}: sf_bytes must be an int >= the exact scale bytes {exact}, got {self.sf_bytes!r}")
        if self.zero_reserved and self.sf_bytes == exact:
            raise ValueError(f"{what}: zero_reserved needs reserved scale bytes (sf_bytes > the exact {exact}), "
                             f"got sf_bytes={self.sf_bytes}")

    # ---- sizes
    @property
    def quantized(self) -> bool:
        return self.cast_fmt is not None

    @property
    def quant_dim(self) -> int:
        """Dims covered by quantization (head_dim - bf16_tail); head_dim for a bf16 cache."""
        return self.head_dim - self.bf16_tail

    @property
    def num_scales(self) -> int:
        return self.quant_dim // self.elements_per_sf if self.quantized else 0

    @property
    def quant_bytes(self) -> int:
        """Bytes of the quantized values (bf16 cache: 2 * head_dim)."""
        if not self.quantized:
            return 2 * self.head_dim
        return self.quant_dim // 2 if self.cast_fmt == "e2m1" else self.quant_dim

    @property
    def sf_exact_bytes(self) -> int:
        return self.num_scales * SF_ITEM_BYTES[self.sf_format] if self.quantized else 0

    @property
    def reserved_bytes(self) -> int:
        """The record's reserved bytes after its scales (sf_bytes - sf_exact_bytes)."""
        return self.sf_bytes - self.sf_exact_bytes

    @property
    def zeroed_bytes(self) -> int:
        """The reserved bytes a write stores as zeros: all of them with ``zero_reserved``, else none."""
        return self.reserved_bytes if self.zero_reserved else 0

    @property
    def data_bytes(self) -> int:
        """Quantized bytes plus the bf16 tail's bytes."""
        return self.quant_bytes + 2 * self.bf16_tail

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.sf_bytes

    @property
    def stride_alignment(self) -> int:
        return math.gcd(32, self.bytes_per_token) if self.token_interleaved else 32

    @property
    def sf_dtype(self) -> Optional[torch.dtype]:
        """dtype of a contiguous scale tensor of this format ((q, sf) outputs, store_kv_cache)."""
        if not self.quantized:
            return None
        return sf_dtype(self.sf_format)

    def addressing_for(self, kv_cache: torch.Tensor) -> RecordAddressing:
        """Record addressing for a validated cache tensor of this format."""
        bpt = self.bytes_per_token
        if self.token_interleaved:
            return RecordAddressing(kv_cache.stride(1), kv_cache.stride(1), bpt, 0, self.quant_bytes,
                                    self.quant_bytes + self.sf_bytes)
        bs = kv_cache.shape[1]
        return RecordAddressing(self.data_bytes, self.sf_bytes, bpt, 0, bs * self.data_bytes, self.quant_bytes)

    # ---- validation and views
    def check_cache(self, kv_cache, what: str = "kv_cache") -> None:
        """Raise ValueError/TypeError unless ``kv_cache`` is a cache of this format (SPEC §7)."""
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dtype != torch.uint8:
            raise TypeError(f"{what} must be uint8, got {kv_cache.dtype}")
        if kv_cache.dim() != 4:
            raise ValueError(f"{what} must be [num_blocks, block_size, num_heads, bytes_per_token], "
                             f"got {kv_cache.dim()} dims {tuple(kv_cache.shape)}")
        nb, bs, nh, bpt = kv_cache.shape
        if bpt != self.bytes_per_token:
            raise ValueError(f"{what}: last dim must be {self.name}'s bytes_per_token {self.bytes_per_token}, got {bpt}")
        if nb < 1 or bs < 1 or nh < 1:
            raise ValueError(f"{what}: num_blocks, block_size and num_heads must be >= 1, got {tuple(kv_cache.shape)}")
        s0, s1, s2, s3 = kv_cache.stride()
        if s3 != 1 or s2 != bpt:
            raise ValueError(f"{what}: stride(3) must be 1 and stride(2) bytes_per_token={bpt}, got {s3}, {s2}")
        if self.token_interleaved:
            if s1 % self.stride_alignment or s1 < nh * bpt:
                raise ValueError(f"{what}: stride(1) must be a multiple of {self.stride_alignment} ({self.name}'s "
                                 f"stride_alignment) and >= num_heads*bytes_per_token={nh * bpt}, got {s1}")
            block_bytes = (bs - 1) * s1 + nh * bpt
        else:
            if nh != 1:
                raise ValueError(f"{what}: a block-wide format ({self.name}) needs num_heads == 1, got {nh}")
            if s1 != bpt:
                raise ValueError(f"{what}: a block-wide block must be dense, stride(1) == {bpt}, got {s1}")
            block_bytes = bs * bpt
        align = self.stride_alignment
        if s0 % align or s0 < block_bytes:
            raise ValueError(f"{what}: stride(0) must be a multiple of {align} ({self.name}'s stride_alignment) "
                             f"and >= {block_bytes} (the block's records; padding after them is allowed), got {s0}")

    def split(self, kv_cache: torch.Tensor):
        """Views ``(data, sf)`` of a cache of this format.

        token-interleaved: data [num_blocks, block_size, num_heads, quant_bytes] (the whole data for
        formats without a tail), sf [num_blocks, block_size, num_heads, sf_bytes].
        block-wide: data [num_blocks, block_size, data_bytes], sf [num_blocks, block_size, sf_bytes].
        For token-interleaved §8 formats the record is [quantized | scales | tail], so ``data`` is
        returned as the quantized bytes only and the tail is ``tail_view``.
        """
        self.check_cache(kv_cache)
        nb, bs, nh, bpt = kv_cache.shape
        s0 = kv_cache.stride(0)
        off = kv_cache.storage_offset()
        if self.token_interleaved:
            data = kv_cache[..., : self.quant_bytes] if self.bf16_tail else kv_cache[..., : self.data_bytes]
            sf = kv_cache[..., self.quant_bytes: self.quant_bytes + self.sf_bytes]
            return data, sf
        data = torch.as_strided(kv_cache, (nb, bs, self.data_bytes), (s0, self.data_bytes, 1), off)
        sf = torch.as_strided(kv_cache, (nb, bs, self.sf_bytes), (s0, self.sf_bytes, 1), off + bs * self.data_bytes)
        return data, sf

    def tail_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The bf16 tail bytes of every record, [nb, bs, (nh,) 2*bf16_tail] uint8 (§8 formats)."""
        self.check_cache(kv_cache)
        if not self.bf16_tail:
            raise ValueError(f"{self.name} has no bf16 tail")
        if self.token_interleaved:
            return kv_cache[..., self.quant_bytes + self.sf_bytes:]
        data, _ = self.split(kv_cache)
        return data[..., self.quant_bytes:]

    def allocate(self, num_blocks: int, block_size: int, num_heads: int = 1, *, block_padding: int = 0,
                 token_padding: int = 0, device=None) -> torch.Tensor:
        """See :func:`allocate_kv_cache`."""
        return allocate_kv_cache(self, num_blocks, block_size, num_heads, block_padding=block_padding,
                                 token_padding=token_padding, device=device)



def allocate_kv_cache(fmt: KVCacheFormat, num_blocks: int, block_size: int, num_heads: int = 1, *,
                      block_padding: int = 0, token_padding: int = 0, device=None) -> torch.Tensor:
    """Allocate a zeroed cache of ``fmt``: uint8 [num_blocks, block_size, num_heads, bytes_per_token].

    ``token_padding`` (token-interleaved only) adds bytes after each token's records before
    rounding stride(1) up to the format's stride_alignment; ``block_padding`` adds bytes after
    each block before rounding stride(0) up to lcm(fmt.stride_alignment, fmt.block_alignment).
    The presets' block_alignment gives the block strides FlashMLA's sparse decode kernels assert
    (a multiple of 656 bytes for FLASHMLA_V32, 576 for FLASHMLA_MODEL1) and 32 for the others.
    """
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("num_heads", num_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if block_padding < 0 or token_padding < 0:
        raise ValueError(f"block_padding and token_padding must be >= 0, got {block_padding}, {token_padding}")
    bpt = fmt.bytes_per_token
    if fmt.token_interleaved:
        s1 = _round_up(num_heads * bpt + token_padding, fmt.stride_alignment)
    else:
        if num_heads != 1 or token_padding:
            raise ValueError(f"a block-wide format ({fmt.name}) needs num_heads == 1 and no token_padding")
        s1 = bpt
    align = math.lcm(fmt.stride_alignment, fmt.block_alignment)
    s0 = _round_up((block_size - 1) * s1 + num_heads * bpt + block_padding, align)
    if fmt.token_interleaved:
        s0 = max(s0, _round_up(block_size * s1 + block_padding, align))
    storage = torch.zeros(num_blocks * s0, dtype=torch.uint8, device=device)
    return torch.as_strided(storage, (num_blocks, block_size, num_heads, bpt), (s0, s1, bpt, 1))


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


MAIN_FP8 = KVCacheFormat("MAIN_FP8", 512, "e4m3", 32, "ue8m0", True, sf_bytes=20, zero_reserved=True)
"""DeepInfer's DeepSeek V4 main-cache record: 512 e4m3 codes (RoPE dims included), 16 UE8M0 scale bytes,
one per 32 codes, then 4 reserved bytes written as zeros (``zero_reserved``); 532 bytes a token."""
MAIN_MXFP8 = KVCacheFormat("MAIN_MXFP8", 512, "e4m3", 32, "ue8m0", True, scale_floor=1e-4)
"""DeepSeek V4.1's main-cache record: 512 e4m3 codes (the 448 latent dims and the 64 RoPE dims, after
RoPE) then 16 UE8M0 scale bytes, one per 32 codes; 528 bytes a token, token-interleaved, no reserved
bytes. Scale 2^ceil(log2(max(amax / 448, 1e-4))): the power of two at or above amax / 448, floored at
2^-13. Readers checked: FlashMLA ``csrc/cuda_kernels/kv_cache_format.h`` (commit 2e5429f,
``KVCacheFormat<ModelType::V41>``: 512 e4m3 + 16 ue8m0, 528 bytes a token, "including the RoPE dims");
SGLang 0.5.23 (wheel), ``KVLayout.V41_NEW`` (``sgl_kernel/deepseek_v4/kv_layout.cuh``: the V41 bytes per
token, data then scales; ``store_row_fp8`` floors the exponent byte at 114, i.e. 2^-13, and encodes
``e4m3(x * 2^-e)`` round-to-nearest-even) and its oracle ``dsv41_kv_quant_reference.quantize_k_cache_v41``.
The two agree on every byte, so one preset; ``kvfuse.engines.sglang.V41_NEW`` is this object."""
MAIN_FP4 = KVCacheFormat("MAIN_FP4", 512, "e2m1", 16, "e4m3", True)
INDEX_MXFP8 = KVCacheFormat("INDEX_MXFP8", 128, "e4m3", 32, "ue8m0", False)
INDEX_FP8_FP32 = KVCacheFormat("INDEX_FP8_FP32", 128, "e4m3", 128, "fp32", False)
INDEX_MXFP4 = KVCacheFormat("INDEX_MXFP4", 128, "e2m1", 32, "ue8m0", False)
INDEX_NVFP4 = KVCacheFormat("INDEX_NVFP4", 128, "e2m1", 16, "e4m3", False)
INDEX_BF16 = KVCacheFormat("INDEX_BF16", 128, None, None, None, False)
# FlashMLA's SM100 sparse decode asserts k_cache.stride(0) % 656 == 0 (V32) / % 576 == 0 (MODEL1); its
# quantizer (tests/quant.py) floors the scale at 1e-4, so the smallest scale is 2^-13
FLASHMLA_V32 = KVCacheFormat("FLASHMLA_V32", 576, "e4m3", 128, "ue8m0_fp32", True, bf16_tail=64,
                             block_alignment=656, scale_floor=1e-4)
FLASHMLA_MODEL1 = KVCacheFormat("FLASHMLA_MODEL1", 512, "e4m3", 64, "ue8m0", False, sf_bytes=8, bf16_tail=64,
                                block_alignment=576, scale_floor=1e-4)

# Who reads each preset's records (docs/guide.md "Who reads each preset" has the sources).
READERS = {
    "MAIN_FP8": "DeepInfer's DeepSeek V4 main cache (FlashMLA-family sparse decode)",
    "MAIN_MXFP8": "DeepSeek V4.1's main cache: FlashMLA's V41 sparse decode, SGLang's v41_new pages",
    "MAIN_FP4": "DeepInfer's DeepSeek V4 main cache (FlashMLA-family sparse decode)",
    "INDEX_MXFP8": "DeepInfer's lightning indexer (K cache; Q in the same format)",
    "INDEX_MXFP4": "DeepInfer's lightning indexer (K cache; Q in the same format)",
    "INDEX_NVFP4": "DeepInfer's lightning indexer (K cache; Q in the same format)",
    "INDEX_FP8_FP32": "DeepSeek V3.2's indexer K: DeepGEMM fp8_paged_mqa_logits",
    "INDEX_BF16": "unquantized index cache (read side)",
    "FLASHMLA_V32": "FlashMLA sparse decode, V3.2 layout (DeepSeek V3 / V3.1 / V3.2)",
    "FLASHMLA_MODEL1": "FlashMLA sparse decode, MODEL1 layout (DeepSeek V4)",
}

PRESETS = {f.name: f for f in (MAIN_FP8, MAIN_MXFP8, MAIN_FP4, INDEX_MXFP8, INDEX_FP8_FP32, INDEX_MXFP4, INDEX_NVFP4,
                               INDEX_BF16, FLASHMLA_V32, FLASHMLA_MODEL1)}
