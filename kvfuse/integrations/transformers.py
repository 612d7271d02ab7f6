"""Hugging Face transformers models with kvfuse's K/V write (SPEC §3): ``install(model)`` and ``PagedCache``.

transformers runs the QK-norm and RoPE inline in each attention module's forward, before ``cache.update``,
so no public hook sees the raw projections. :func:`install` therefore replaces the forward of each
attention module *instance* (no class is patched; :func:`uninstall` restores it) with one that applies
kvfuse's numerics (the profile chosen at install: :mod:`kvfuse.numerics_profiles`); with a
:class:`PagedCache` as the model's cache one :func:`kvfuse.fused_qk_norm_rope_store_kv` call per layer
writes q (in place) and scatters K and V into NHD paged caches, and attention reads them back with
:func:`kvfuse.load_gqa_kv_cache`. With any other cache (transformers' DynamicCache) the reference chain
computes q and k and the cache stores them as transformers does: the same numerics, transformers'
storage. The RoPE table is built from the model's own rotary embedding (inv_freq and attention_scaling,
fp32). Guide: docs/integrations.md.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from typing import Callable, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..args import NormArgs, RopeArgs
from ..gqa import fused_qk_norm_rope_store_kv, load_gqa_kv_cache
from ..numerics_profiles import NUMERICS, profile
from ..reference.chain import qk_norm_rope

__all__ = ["install", "uninstall", "PagedCache", "NUMERICS", "SUPPORTED_ATTENTION"]

_DYNAMIC_ROPE = ("dynamic", "longrope")   # inv_freq recomputed from the sequence length at each forward


@dataclasses.dataclass(frozen=True)
class _AttentionKind:
    """What the adapter's forward must reproduce of one transformers attention class."""
    module: str                  # transformers.models.<module>
    qk_norm: bool                # per-head RMSNorm of q and k (q_norm / k_norm) before RoPE
    norm_weight_offset: float    # the norm scales by (offset + w): Gemma's (1 + w)
    sliding_window: str          # where the class reads the sliding_window it passes: "attr", "config", ""


SUPPORTED_ATTENTION = {
    "LlamaAttention": _AttentionKind("llama", False, 0.0, ""),
    "MistralAttention": _AttentionKind("mistral", False, 0.0, "config"),
    "Qwen2Attention": _AttentionKind("qwen2", False, 0.0, "attr"),
    "Qwen3Attention": _AttentionKind("qwen3", True, 0.0, "attr"),
    "Gemma3Attention": _AttentionKind("gemma3", True, 1.0, "attr"),
}
"""The transformers attention classes :func:`install` serves (exact classes: a subclass is refused)."""


def _attention_class(name: str):
    kind = SUPPORTED_ATTENTION[name]
    return getattr(sys.modules.get(f"transformers.models.{kind.module}.modeling_{kind.module}"), name, None)


def _attention_modules(model: torch.nn.Module):
    """[(module, kind)] of every self-attention module of ``model`` (modules with q/k/v/o projections and
    a layer_idx); TypeError naming the class of one that is not supported."""
    found = []
    for _, m in model.named_modules():
        if not all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx")):
            continue
        name = type(m).__name__
        if name not in SUPPORTED_ATTENTION or type(m) is not _attention_class(name):
            raise TypeError(f"model: attention class {type(m).__module__}.{type(m).__qualname__} is not supported by "
                            f"kvfuse.integrations.transformers (supported: {', '.join(SUPPORTED_ATTENTION)})")
        found.append((m, SUPPORTED_ATTENTION[name]))
    if not found:
        raise TypeError(f"model: no attention module found in {type(model).__name__} (supported classes: "
                        f"{', '.join(SUPPORTED_ATTENTION)})")
    return found


def _rotary_module(model: torch.nn.Module):
    for _, m in model.named_modules():
        if hasattr(m, "rotary_emb") and hasattr(m, "layers"):
            return m, m.rotary_emb
    raise TypeError(f"model: no base model with a rotary_emb found in {type(model).__name__}")


def _rope_table(rotary, layer_type, max_position: int) -> torch.Tensor:
    """fp32 [max_position, rotary_dim] (kvfuse's cos | sin layout) from the model's own rotary embedding:
    angle = f(p) * inv_freq in fp32 and cos / sin times attention_scaling, as its forward computes them
    (kept fp32 here, where transformers rounds them to the activations' dtype)."""
    prefix = f"{layer_type}_" if layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq") else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq").float()
    scaling = getattr(rotary, f"{prefix}attention_scaling")
    rope_type = rotary.rope_type if isinstance(rotary.rope_type, str) else rotary.rope_type.get(layer_type)
    if rope_type in _DYNAMIC_ROPE:
        raise ValueError(f"model: rope_type {rope_type!r} recomputes the RoPE table from the sequence length at "
                         f"every forward; kvfuse.integrations.transformers supports static tables only")
    pos = torch.arange(max_position, device=inv_freq.device, dtype=torch.float32)
    angle = pos[:, None] * inv_freq[None, :]
    return torch.cat([angle.cos() * scaling, angle.sin() * scaling], dim=-1).contiguous()


@dataclasses.dataclass
class _LayerSetup:
    kind: _AttentionKind
    cos_sin: torch.Tensor
    numerics: str                # the profile of the q / k chain and the paged write
    saved_forward: object        # the instance's own forward attribute before install, or _NONE


_NONE = object()


class _Installation:
    """What :func:`install` changed on one model; a context manager that uninstalls on exit."""

    def __init__(self, model, numerics, layers, hook):
        self.model, self.numerics, self.layers, self.hook = model, numerics, layers, hook

    def uninstall(self) -> None:
        uninstall(self.model)

    def __enter__(self):
        return self.model

    def __exit__(self, *exc):
        if getattr(self.model, "_kvfuse_installation", None) is self:
            uninstall(self.model)
        return False


def install(model: torch.nn.Module, numerics: str = "staged") -> _Installation:
    """Run ``model``'s attention with kvfuse: QK-norm and RoPE with kvfuse's numerics on every layer, and with
    a :class:`PagedCache` as the cache one :func:`kvfuse.fused_qk_norm_rope_store_kv` call per layer.

    Replaces the forward of each attention module instance (Llama, Mistral, Qwen2, Qwen3, Gemma 3; see
    :data:`SUPPORTED_ATTENTION`) and adds a forward pre-hook to the base model that hands a PagedCache the
    2D attention mask (its pad tokens get slot -1). Returns a handle that is also a context manager
    (``with install(model): ...`` uninstalls on exit). ``numerics``: the profile of
    :func:`kvfuse.fused_qk_norm_rope_store_kv` (:data:`NUMERICS`: "staged", the default, rounds each stage
    to bf16; "fused" rounds q and k once; "fused_fp32_cast" also has an fp8 cache's cast read the fp32
    value), used for the paged write and for q / k with any other cache.
    Raises TypeError for an unsupported attention class or a model whose projections are not bf16,
    ValueError for an unknown ``numerics``, a dynamic RoPE type, or a model already installed.
    """
    profile(numerics)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_kvfuse_installation", None) is not None:
        raise ValueError("model: kvfuse is already installed on it (uninstall(model) first)")
    attention = _attention_modules(model)
    base, rotary = _rotary_module(model)
    tables = {}
    layers = []
    for module, kind in attention:
        if module.q_proj.weight.dtype != torch.bfloat16:
            raise TypeError(f"model: {type(module).__name__} projections are {module.q_proj.weight.dtype}; kvfuse's "
                            f"K/V write takes bf16 (load the model with dtype=torch.bfloat16)")
        layer_type = getattr(module, "layer_type", None)
        if layer_type not in tables:
            tables[layer_type] = _rope_table(rotary, layer_type, module.config.max_position_embeddings)
        rotated = tables[layer_type].shape[1]
        if rotated != module.head_dim:
            raise TypeError(f"model: {type(module).__name__} rotates {rotated} of {module.head_dim} dims (partial "
                            f"rotary): not supported")
        layers.append((module, _LayerSetup(kind, tables[layer_type], numerics,
                                           module.__dict__.get("forward", _NONE))))
    for module, setup in layers:
        module._kvfuse_setup = setup
        module.forward = types.MethodType(_attention_forward, module)
    hook = base.register_forward_pre_hook(_begin_forward, with_kwargs=True)
    handle = _Installation(model, numerics, layers, hook)
    model._kvfuse_installation = handle
    return handle


def uninstall(model: torch.nn.Module) -> None:
    """Undo :func:`install`: every attention module gets back the forward it had, the pre-hook is removed.
    ValueError when kvfuse is not installed on ``model``."""
    handle = getattr(model, "_kvfuse_installation", None)
    if handle is None:
        raise ValueError("model: kvfuse is not installed on it")
    for module, setup in handle.layers:
        if setup.saved_forward is _NONE:
            del module.forward
        else:
            module.forward = setup.saved_forward
        del module._kvfuse_setup
    handle.hook.remove()
    del model._kvfuse_installation


def _begin_forward(module, args, kwargs):
    """Base model pre-hook: a PagedCache assigns the slots of this forward's tokens from the 2D mask."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PagedCache):
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = args[0] if args else kwargs.get("inputs_embeds")
        cache._begin_forward(tokens.shape[0], tokens.shape[1], kwargs.get("attention_mask"))
    return None


def _norm_args(norm: torch.nn.Module, offset: float) -> NormArgs:
    eps = getattr(norm, "variance_epsilon", None)
    eps = norm.eps if eps is None else eps
    return NormArgs(norm.weight if not offset else offset + norm.weight.float(), eps=eps)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                       past_key_values=None, **kwargs):
    """The attention module's forward with kvfuse's q / k numerics (installed per instance by install())."""
    setup: _LayerSetup = self._kvfuse_setup
    if cache is None:
        cache = past_key_values
    if torch.compiler.is_compiling():
        raise NotImplementedError("kvfuse.integrations.transformers does not run under torch.compile")
    if getattr(cache, "is_compileable", False):
        raise NotImplementedError(f"cache: {type(cache).__name__} (a static cache) is not supported; use a "
                                  f"PagedCache or transformers' DynamicCache")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(f"{type(self).__name__}: position_ids were not passed to the attention module")
    b, t = hidden_states.shape[:2]
    d = self.head_dim
    q = self.q_proj(hidden_states).view(b * t, -1, d)
    k = self.k_proj(hidden_states).view(b * t, -1, d)
    v = self.v_proj(hidden_states).view(b * t, -1, d)
    hq, hkv = q.shape[1], k.shape[1]
    positions = position_ids.expand(b, t).reshape(-1)
    kind = setup.kind
    q_norm = _norm_args(self.q_norm, kind.norm_weight_offset) if kind.qk_norm else None
    k_norm = _norm_args(self.k_norm, kind.norm_weight_offset) if kind.qk_norm else None
    rope = RopeArgs(positions, setup.cos_sin, setup.cos_sin.shape[1], True, offset=0)
    if isinstance(cache, PagedCache):
        keys, values = cache._write_and_read(self.layer_idx, q, k, v, q_norm, k_norm, rope, b, t, setup.numerics)
    else:
        rot = dict(positions=positions, cos_sin=setup.cos_sin, rotary_dim=setup.cos_sin.shape[1], rope_offset=0,
                   numerics=setup.numerics)
        # the fused profiles return fp32: one rounding to the activations' dtype
        q = qk_norm_rope(q, *((q_norm.weight, q_norm.eps) if q_norm else (None,)), **rot).to(q.dtype)
        k = qk_norm_rope(k, *((k_norm.weight, k_norm.eps) if k_norm else (None,)), **rot).to(k.dtype)
        keys, values = k.view(b, t, hkv, d).transpose(1, 2), v.view(b, t, hkv, d).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx, kwargs=kwargs)
    query = q.view(b, t, hq, d).transpose(1, 2)
    eager = sys.modules[type(self).__module__].eager_attention_forward
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    extra = {}
    if kind.sliding_window == "attr":
        extra["sliding_window"] = self.sliding_window
    elif kind.sliding_window == "config":
        extra["sliding_window"] = getattr(self.config, "sliding_window", None)
    out, weights = interface(self, query, keys, values, attention_mask,
                             dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                             **extra, **kwargs)
    out = out.reshape(b, t, -1).contiguous()
    return self.o_proj(out), weights


class _PagedLayer(CacheLayerMixin):
    """One layer of a :class:`PagedCache`: its NHD K and V caches and the token columns it has stored."""
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        self.k_cache, self.v_cache = k_cache, v_cache
        self.length = 0              # columns of the (left-padded) batch stored so far, pads included
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("cache: a PagedCache is written by kvfuse's attention forward; call "
                        "kvfuse.integrations.transformers.install(model) before running the model with it")

    def get_mask_sizes(self, query_length: int):
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


def _unsupported(what: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"PagedCache does not support {what}")
    method.__name__ = what
    return method


class PagedCache(Cache):
    """A transformers ``Cache`` of NHD paged K/V caches (vLLM's layout), one pair per attention layer, written
    by :func:`kvfuse.fused_qk_norm_rope_store_kv`. Pass it to ``model.generate(..., cache=...)`` or to a
    forward as its cache, on a model where :func:`install` is active.

    Args:
        model: the transformers model (its attention layers give the caches' heads, head_dim and device).
        num_blocks, block_size: the shape of each cache, [num_blocks, block_size, num_kv_heads, head_dim],
            shared by the sequences of the batch (each gets blocks as it grows, a block table per sequence).
        kv_dtype: torch.bfloat16 or torch.float8_e4m3fn.
        k_scale, v_scale: the per-tensor scales of an fp8 cache (float or fp32 tensor of one element;
            None means 1.0); None for bf16.
        block_shuffle_seed: None hands out blocks in order; an int shuffles the free blocks with it.

    One batch per cache: its rows (left padding allowed, pad tokens get slot -1) stay the same from the
    prefill to the last decode step. Beam search (reorder), cropping and batch expansion raise
    NotImplementedError.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype=torch.bfloat16,
                 k_scale=None, v_scale=None, block_shuffle_seed: Optional[int] = None):
        for name, val in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError(f"kv_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {kv_dtype}")
        attention = _attention_modules(model)
        devices = {m.q_proj.weight.device for m, _ in attention}
        if len(devices) != 1:
            raise ValueError(f"model: its attention layers are on several devices {sorted(map(str, devices))}; a "
                             f"PagedCache needs them on one")
        self.device = devices.pop()
        self.kv_dtype = kv_dtype
        self.k_scale = self._scale(k_scale, "k_scale")
        self.v_scale = self._scale(v_scale, "v_scale")
        self.num_blocks, self.block_size = num_blocks, block_size
        by_index = {}
        for m, _ in attention:
            hkv, d = m.config.num_key_value_heads, m.head_dim
            shape = (num_blocks, block_size, hkv, d)
            by_index[m.layer_idx] = _PagedLayer(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                                                torch.zeros(shape, dtype=kv_dtype, device=self.device))
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"model: attention layer indices {sorted(by_index)} are not 0..{len(by_index) - 1}")
        super().__init__(layers=[by_index[i] for i in range(len(by_index))])
        self._seed = block_shuffle_seed
        self._clear()

    def _scale(self, scale, name):
        if self.kv_dtype == torch.bfloat16:
            if scale is not None:
                raise ValueError(f"{name} must be None for a bf16 cache, got {scale!r}")
            return None
        if scale is None:
            scale = 1.0
        t = torch.as_tensor(scale, dtype=torch.float32).reshape(()).to(self.device)
        if not (bool(torch.isfinite(t)) and float(t) > 0):
            raise ValueError(f"{name} must be finite and > 0, got {float(t)}")
        return t

    def _clear(self):
        order = torch.arange(self.num_blocks)
        if self._seed is not None:
            order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(self._seed))
        self._free = order.tolist()[::-1]       # pop() hands out order[0] first
        self._tables = None                     # per row: its block ids, in position order
        self._columns = None                    # [rows, columns] slot of each column, -1 for pads (on device)
        self._columns_host = None               # the same on the CPU, where the slots are assigned
        self._new_slots = None                  # [rows * new columns] slots of the current forward

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self._clear()

    reorder_cache = _unsupported("reorder_cache (beam search)")
    crop = _unsupported("crop (assisted decoding)")
    batch_repeat_interleave = _unsupported("batch_repeat_interleave (num_return_sequences > 1, beam search)")
    batch_select_indices = _unsupported("batch_select_indices")

    def _begin_forward(self, rows: int, new: int, attention_mask) -> None:
        """Assign slots to the ``new`` columns of a forward of ``rows`` sequences: a block table per row,
        blocks taken from the free list as a row needs them; masked (pad) columns get slot -1."""
        past = self.layers[0].length
        if self._columns_host is None:
            self._tables = [[] for _ in range(rows)]
            self._columns_host = torch.empty((rows, 0), dtype=torch.int64)
        elif rows != len(self._tables):
            raise ValueError(f"input: {rows} sequences, the PagedCache holds {len(self._tables)}: one batch per cache "
                             f"(beam search and a changing batch are not supported)")
        columns = self._columns_host[:, :past]
        if attention_mask is None:
            valid = torch.ones((rows, new), dtype=torch.bool)
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise ValueError("attention_mask: a PagedCache needs the 2D padding mask [batch, columns] (or None)")
            if tuple(attention_mask.shape) != (rows, past + new):
                raise ValueError(f"attention_mask: expected shape {(rows, past + new)} (cached + new columns), got "
                                 f"{tuple(attention_mask.shape)}")
            valid = attention_mask[:, past:].cpu().bool()
        counts = (columns >= 0).sum(dim=1).tolist()
        slots = torch.full((rows, new), -1, dtype=torch.int64)
        bs = self.block_size
        for r in range(rows):
            m = int(valid[r].sum())
            table = self._tables[r]
            need = -(-(counts[r] + m) // bs) - len(table)
            if need > len(self._free):
                raise ValueError(f"PagedCache: out of blocks ({self.num_blocks} of {bs} tokens): sequence {r} needs "
                                 f"{counts[r] + m} tokens")
            table.extend(self._free.pop() for _ in range(need))
            idx = counts[r] + torch.arange(m)
            slots[r, valid[r]] = torch.tensor(table, dtype=torch.int64)[idx // bs] * bs + idx % bs
        self._columns_host = torch.cat([columns, slots], dim=1)
        self._columns = self._columns_host.to(self.device)
        self._new_slots = slots.reshape(-1).to(self.device)

    def _write_and_read(self, layer_idx, q, k, v, q_norm, k_norm, rope, rows, new, numerics):
        """One layer: q in place, K / V into the caches (one fused call), then K and V of every column
        as [rows, Hkv, columns, D] for transformers' attention (zeros at pad columns: masked)."""
        layer = self.layers[layer_idx]
        total = layer.length + new
        if self._new_slots is None or self._columns.shape[1] != total or self._new_slots.numel() != rows * new:
            raise RuntimeError("PagedCache: this forward's slots were not assigned: run the model (its base model's "
                               "forward, where install() hooks in), not a layer alone")
        fused_qk_norm_rope_store_kv(q, k, v, layer.k_cache, layer.v_cache, self._new_slots, q_norm, k_norm, rope,
                                    self.k_scale, self.v_scale, "NHD", q_out=q, numerics=numerics)
        layer.length = total
        keys, values = load_gqa_kv_cache(layer.k_cache, layer.v_cache, self._columns.reshape(-1), "NHD",
                                         self.k_scale, self.v_scale)
        keys = keys.view(rows, total, *keys.shape[1:]).transpose(1, 2).contiguous()
        values = values.view(rows, total, *values.shape[1:]).transpose(1, 2).contiguous()
        return keys, values

    def key_value(self, layer_idx: int, batch_index: int = 0):
        """K and V of sequence ``batch_index`` in layer ``layer_idx``: bf16 [num_kv_heads, length, head_dim]
        each (fp8 dequantized), its tokens in position order (pads excluded)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be an int in [0, {len(self.layers)}), got {layer_idx!r}")
        rows = 0 if self._tables is None else len(self._tables)
        if not isinstance(batch_index, int) or not 0 <= batch_index < rows:
            raise ValueError(f"batch_index must be an int in [0, {rows}), got {batch_index!r}")
        layer = self.layers[layer_idx]
        cols = self._columns[batch_index, :layer.length]
        k, v = load_gqa_kv_cache(layer.k_cache, layer.v_cache, cols[cols >= 0], "NHD", self.k_scale, self.v_scale)
        return k.transpose(0, 1), v.transpose(0, 1)

    def block_table(self, batch_index: int = 0):
        """The block ids of sequence ``batch_index``, in position order (a copy)."""
        rows = 0 if self._tables is None else len(self._tables)
        if not isinstance(batch_index, int) or not 0 <= batch_index < rows:
            raise ValueError(f"batch_index must be an int in [0, {rows}), got {batch_index!r}")
        return list(self._tables[batch_index])
