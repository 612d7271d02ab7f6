"""The inputs of one (workload, n) point, on the device: :func:`token_layout` places n tokens (a decode
step, a prefill's sequences or uniform positions) into paged, random or contiguous slots,
:func:`build_inputs` draws the activations and weights and allocates the caches and outputs
(:class:`Inputs`), :func:`result_tensors` names what a call writes. The layout depends on the seed and n
only, so every workload of a size sees the same positions and slots.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch

from ..formats import q_dtype
from ..rope import cos_sin_cache
from .workloads import WORKLOADS, Workload

MAX_POSITION = 8192          # rows of the cos/sin table (positions: token_layout)
BLOCK_SIZE = 64              # tokens per cache block
COLD_L2_BYTES = 512 << 20    # --cold-l2: cycle through input sets totalling at least this much


@dataclasses.dataclass
class Inputs:
    """Device tensors of one (workload, n) point. ``q``/``sf`` are the stage chain's cast outputs
    for writes and the result for index_q; ``norm_buf``/``rope_buf`` are stage-chain buffers."""
    n: int
    x: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    slots: Optional[torch.Tensor] = None
    cache: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    sf: Optional[torch.Tensor] = None
    norm_buf: Optional[torch.Tensor] = None
    rope_buf: Optional[torch.Tensor] = None
    regime: str = ""                     # "decode" | "prefill" | "uniform" (token_layout)
    slot_pattern: str = ""               # writes: SLOT_PATTERNS
    # kind "gqa": the packed projection, q_out, the caches and scales, the k norm weight (``weight`` is q's)
    k_weight: Optional[torch.Tensor] = None
    k_cache: Optional[torch.Tensor] = None
    v_cache: Optional[torch.Tensor] = None
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    members: Optional[list] = None       # kind "group": each member workload's Inputs

    def nbytes(self) -> int:
        if self.members:
            return sum(m.nbytes() for m in self.members)
        total = 0
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes() if f.name == "cache" else t.numel() * t.element_size()
        return total

    def qkv(self, wl: "Workload"):
        """kind "gqa": the q, k, v views of the packed projection x."""
        return wl.gqa.split_qkv(self.x)


SLOT_PATTERNS = ("paged", "random", "contiguous")
REGIMES = ("auto", "decode", "prefill", "uniform")
DECODE_MAX_N = 256           # regime "auto": n <= this is a decode step, larger n a prefill
PREFILL_SEQ_LEN = (1024, 4096)   # a prefill's sequence lengths are uniform in this range (tokens)


def slot_mapping(n: int, blocks: int, pattern: str, g: torch.Generator, device) -> torch.Tensor:
    """int32 [n] slots of a cache of ``blocks`` blocks of BLOCK_SIZE tokens, whatever the tokens'
    positions (the "uniform" regime). random: a random permutation of all slots (every record
    scattered: the hardest write pattern); paged: the blocks in a random order, the tokens of a block
    together; contiguous: token i in slot i."""
    if pattern == "random":
        slots = torch.randperm(blocks * BLOCK_SIZE, generator=g, device=device)[:n]
    elif pattern == "paged":
        order = torch.randperm(blocks, generator=g, device=device)
        slots = (order[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()[:n]
    elif pattern == "contiguous":
        slots = torch.arange(n, device=device)
    else:
        raise ValueError(f"slots: expected one of {SLOT_PATTERNS}, got {pattern!r}")
    return slots.to(torch.int32)


def input_regime(n: int, regime: str = "auto") -> str:
    """The input regime of a point: "auto" is "decode" for n <= DECODE_MAX_N, else "prefill"."""
    if regime not in REGIMES:
        raise ValueError(f"regime: expected one of {REGIMES}, got {regime!r}")
    if regime == "auto":
        return "decode" if n <= DECODE_MAX_N else "prefill"
    return regime


def _regime_text(regime: str) -> str:
    return {"auto": f"decode for n <= {DECODE_MAX_N}, else prefill",
            "decode": "one token per sequence", "prefill": "whole sequences",
            "uniform": "uniform positions"}.get(regime, regime)


def prefill_lengths(n: int, g: torch.Generator) -> List[int]:
    """The sequences of a prefill of n tokens: lengths uniform in PREFILL_SEQ_LEN, the last one cut so
    that they total n (n below the range: one sequence of n tokens)."""
    lo, hi = PREFILL_SEQ_LEN
    lens: List[int] = []
    total = 0
    while total < n:
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        lens.append(min(length, n - total))
        total += lens[-1]
    return lens


def token_layout(n: int, regime: str, pattern: str, g: torch.Generator):
    """(positions, slots, cache blocks) of n tokens, int32 on the CPU, for one input regime
    (:func:`input_regime`) and slot pattern:

    - decode: one token per sequence, at a position (the sequence's context length) uniform in
      [0, MAX_POSITION); the cache has n blocks. paged: each sequence's token in its own block (the
      blocks in a random order), at offset position % BLOCK_SIZE; random: n slots drawn from all the
      cache's slots; contiguous: token i in slot i.
    - prefill: sequences of :func:`prefill_lengths`, positions 0..len-1 each; the cache has the
      sequences' blocks (ceil(len / BLOCK_SIZE) each). paged: each sequence's tokens in its own
      consecutive blocks, the sequences' runs of blocks in a random order (the last block of a
      sequence partly empty); random: a random permutation of all the cache's slots, every record
      scattered; contiguous: token i in slot i.
    - uniform: positions uniform in [0, MAX_POSITION) whatever the sequence, ceil(n / BLOCK_SIZE)
      blocks and :func:`slot_mapping`'s pattern.
    """
    if pattern not in SLOT_PATTERNS:
        raise ValueError(f"slots: expected one of {SLOT_PATTERNS}, got {pattern!r}")
    if regime == "uniform":
        blocks = max(1, -(-n // BLOCK_SIZE))
        positions = torch.randint(0, MAX_POSITION, (n,), generator=g)
        return positions.to(torch.int32), slot_mapping(n, blocks, pattern, g, "cpu"), blocks
    if regime == "decode":
        positions = torch.randint(0, MAX_POSITION, (n,), generator=g)
        blocks = n
        if pattern == "paged":
            slots = torch.randperm(blocks, generator=g) * BLOCK_SIZE + positions % BLOCK_SIZE
        elif pattern == "random":
            slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:n]
        else:
            blocks = max(1, -(-n // BLOCK_SIZE))
            slots = torch.arange(n)
    elif regime == "prefill":
        lens = prefill_lengths(n, g)
        positions = torch.cat([torch.arange(length) for length in lens])
        runs = [-(-length // BLOCK_SIZE) for length in lens]
        blocks = sum(runs)
        if pattern == "paged":
            start, first = [0] * len(lens), 0
            for i in torch.randperm(len(lens), generator=g).tolist():
                start[i], first = first, first + runs[i]
            slots = torch.cat([start[i] * BLOCK_SIZE + torch.arange(length) for i, length in enumerate(lens)])
        elif pattern == "random":
            slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:n]
        else:
            blocks = max(1, -(-n // BLOCK_SIZE))
            slots = torch.arange(n)
    else:
        raise ValueError(f"regime: expected one of {REGIMES[1:]}, got {regime!r}")
    return positions.to(torch.int32), slots.to(torch.int32), blocks


def build_inputs(wl: Workload, n: int, device, seed: int = 0, slots: str = "paged",
                 regime: str = "auto") -> Inputs:
    """Random realistic inputs: bf16 activations (normal, per-token scales 2^-3..2^3), a norm weight
    near 1, the positions, cache and slots of :func:`token_layout` for the point's regime
    (:func:`input_regime`) and slot pattern. The layout depends on (seed, n) only: every workload
    of a size gets the same positions and slots."""
    device = torch.device(device)
    regime = input_regime(n, regime)
    layout = torch.Generator().manual_seed(seed * 1_000_003 + n)
    positions, slot_map, blocks = token_layout(n, regime, slots, layout)
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + n * 7 + len(wl.name))
    if wl.kind == "gqa":
        return _gqa_inputs(wl, n, device, g, positions, slot_map, blocks, regime, slots)
    if wl.kind == "group":
        members = [build_inputs(WORKLOADS[m], n, device, seed, slots, regime) for m in wl.members]
        for m in members[1:]:               # one positions tensor and one cos/sin table for the layer
            m.positions, m.cos_sin = members[0].positions, members[0].cos_sin
        return Inputs(n=n, x=members[0].x, positions=members[0].positions, cos_sin=members[0].cos_sin,
                      regime=regime, slot_pattern=slots, members=members)
    H, D = wl.num_heads, wl.head_dim
    shape = (n, D) if H == 1 else (n, H, D)
    x = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    scale = torch.randint(-3, 4, (n,) + (1,) * (len(shape) - 1), generator=g, device=device)
    x.mul_(torch.exp2(scale.float()).to(torch.bfloat16))
    inp = Inputs(n=n, x=x, cos_sin=cos_sin_cache(MAX_POSITION, wl.rotary_dim, device=device),
                 positions=positions.to(device), regime=regime)
    if wl.norm:
        k = wl.norm_width
        inp.weight = (torch.randn(k, generator=g, device=device) * 0.1 + 1.0).to(torch.bfloat16)
        if wl.norm_bias:
            inp.bias = (torch.randn(k, generator=g, device=device) * 0.1).to(torch.bfloat16)
        inp.norm_buf = torch.empty_like(x)
    if wl.kind == "write":
        fmt = wl.fmt
        inp.cache = fmt.allocate(blocks, BLOCK_SIZE, device=device)
        inp.slots = slot_map.to(device)
        inp.slot_pattern = slots
        inp.rope_buf = torch.empty_like(x)
        inp.q = torch.empty((n, fmt.quant_bytes), dtype=q_dtype(fmt.cast_fmt), device=device)
        inp.sf = torch.empty((n, fmt.num_scales), dtype=fmt.sf_dtype, device=device)
    elif wl.kind == "q_pre":
        inp.out = torch.empty_like(x)
    else:
        inp.rope_buf = torch.empty_like(x)
        inp.q = torch.empty((n, H, wl.fmt.quant_bytes), dtype=q_dtype(wl.fmt.cast_fmt), device=device)
        inp.sf = torch.empty((n, H, wl.fmt.num_scales), dtype=wl.fmt.sf_dtype, device=device)
    return inp


def _gqa_inputs(wl: Workload, n: int, device, g: torch.Generator, positions, slot_map, blocks: int, regime: str,
                slots: str) -> Inputs:
    """kind "gqa": a packed projection [n, (Hq + 2 Hkv) D] (normal, per-token scales 2^-3..2^3), the model's
    norm weights (Gemma: 1 + w in fp32), its cos/sin table (GQAConfig.cos_sin_cache: GPT-OSS's YaRN), NHD
    caches of ``blocks`` blocks, per-tensor scales for fp8, and the positions and slots of
    :func:`token_layout` (as every workload of the size; an mRoPE model's as text positions [3, n])."""
    cfg = wl.gqa
    x = torch.randn((n, cfg.qkv_width), generator=g, device=device, dtype=torch.bfloat16)
    scale = torch.randint(-3, 4, (n, 1), generator=g, device=device)
    x.mul_(torch.exp2(scale.float()).to(torch.bfloat16))
    inp = Inputs(n=n, x=x, cos_sin=cfg.cos_sin_cache(MAX_POSITION, device),
                 positions=cfg.text_positions(positions.to(device)), regime=regime, slot_pattern=slots)
    if cfg.qk_norm:
        raw = [(torch.randn(cfg.head_dim, generator=g, device=device) * 0.1
                + (0.0 if cfg.norm_weight_offset else 1.0)).to(torch.bfloat16) for _ in range(2)]
        inp.weight, inp.k_weight = (cfg.norm_args(w).weight for w in raw)
    dtype = torch.float8_e4m3fn if wl.cache_fp8 else torch.bfloat16
    shape = (blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    inp.k_cache = torch.zeros(shape, dtype=torch.uint8 if wl.cache_fp8 else dtype, device=device).view(dtype)
    inp.v_cache = torch.zeros(shape, dtype=torch.uint8 if wl.cache_fp8 else dtype, device=device).view(dtype)
    if wl.cache_fp8:
        inp.k_scale = torch.tensor([0.02], device=device)
        inp.v_scale = torch.tensor([0.05], device=device)
    inp.slots = slot_map.to(device)
    inp.out = torch.empty((n, cfg.num_heads, cfg.head_dim), dtype=torch.bfloat16, device=device)
    inp.rope_buf = torch.empty((n, cfg.num_kv_heads, cfg.head_dim), dtype=torch.bfloat16, device=device)
    return inp


def build_input_sets(wl: Workload, n: int, device, cold_l2: bool = False, seed: int = 0,
                     slots: str = "paged", regime: str = "auto") -> List[Inputs]:
    """One set; with cold_l2, as many (at most 16) as needed to total COLD_L2_BYTES."""
    first = build_inputs(wl, n, device, seed, slots, regime)
    count = 1
    if cold_l2:
        count = max(1, min(16, math.ceil(COLD_L2_BYTES / max(1, first.nbytes()))))
    return [first] + [build_inputs(wl, n, device, seed + i, slots, regime) for i in range(1, count)]


def result_tensors(wl: Workload, inp: Inputs) -> List[torch.Tensor]:
    """What a call of the workload produces (to compare peers): the cache, the bf16 out, or (q, sf); for
    "gqa" q_out and the two caches."""
    if wl.kind == "gqa":
        return [inp.out, inp.k_cache, inp.v_cache]
    if wl.kind == "group":
        return [t for name, m in zip(wl.members, inp.members) for t in result_tensors(WORKLOADS[name], m)]
    if wl.kind == "write":
        return [inp.cache]
    if wl.kind == "q_pre":
        return [inp.out]
    return [inp.q, inp.sf]
