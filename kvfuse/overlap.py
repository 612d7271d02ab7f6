"""Memory overlap of a call's tensors (SPEC §9, aliasing).

A call's outputs (``out``, ``q``/``sf``, the cache) must not overlap themselves, each other or any
input (x, the norm weight, positions, cos_sin, slot_mapping; store_kv_cache's data, sf, tail): the
kernels read and write them concurrently. The one exception is in-place: ``out`` may be x itself
(same data pointer, shape and strides). A violation is a ValueError naming the arguments, raised
before anything is written.

What depends only on shapes and strides (an output overlapping itself: stride 0, rows closer than a
row's length, heads that overlap) is decided at validation, once per call signature, exactly: an
output of rows [n, ...] keeps ``row_limit``, the largest n for which its rows do not overlap (the
plan cache's key leaves n out, so n is compared on every call). What depends on data pointers (one
tensor overlapping another) is checked on every call by :class:`OverlapCheck`: each tensor's byte
span [data_ptr, data_ptr + extent) is compared with every output's (a few integer compares); only
when two spans intersect are their elements compared exactly (:func:`tensors_overlap`: interleaved
layouts, e.g. q and sf packed side by side in one buffer's rows, do not overlap), and such a verdict
is remembered per (pair, pointer distance, n). A call with the same data pointers and n as the
previous accepted call of its signature reuses that call's verdict.

Meta tensors and traced (fake) tensors carry no addresses: nothing is checked for them.
"""
from __future__ import annotations

import math
import operator

import torch

INF = math.inf


def addresses_known(device: torch.device) -> bool:
    """Whether tensors on ``device`` have addresses to compare now: not meta tensors, and not while
    torch.compile traces (fake tensors). Every per-call aliasing check asks this first."""
    return device.type != "meta" and not torch.compiler.is_compiling()
_MAX_ENUMERATED = 1 << 16   # inner row starts enumerated at validation (heads of one row: a few hundred at most)
_MEMO_SIZE = 64
_DATA_PTR = torch.Tensor.data_ptr


def _runs(shape, stride):
    """(run length L, [(size, stride)] of the other dims) in elements: the elements of a tensor as runs of L
    contiguous elements (the innermost dim when its stride is 1, else single elements); dims of size 1 dropped."""
    dims = [(int(s), int(st)) for s, st in zip(shape, stride) if s != 1]
    if dims and dims[-1][1] == 1:
        return dims[-1][0], dims[:-1]
    return 1, dims


def _starts(dims):
    starts = [0]
    for size, st in dims:
        if len(starts) * size > _MAX_ENUMERATED:
            return None
        starts = [a + i * st for a in starts for i in range(size)]
    return starts


def row_limit(t: torch.Tensor, name: str):
    """For an output whose leading dim is the call's n: the largest n for which no two of its elements share
    memory (INF: none for any n). Raises ValueError naming ``name`` when the elements of one row already
    overlap (a head stride shorter than the row, a broadcast inner dim)."""
    shape, stride = tuple(t.shape), t.stride()
    inner_shape, inner_stride = shape[1:], stride[1:]
    if 0 in inner_shape:
        return INF                      # rows without elements
    if _dense_enough(inner_shape, inner_stride, stride[0]):
        return INF                      # every dense or padded layout: no enumeration
    L, dims = _runs(inner_shape, inner_stride)
    starts = _starts(dims)
    if starts is None:                  # too many inner runs to enumerate, and the cheap test above failed
        _reject(name, t)
    starts.sort()
    if any(b - a < L for a, b in zip(starts, starts[1:])):
        raise ValueError(f"{name}: its elements overlap in memory (shape {shape}, strides {stride}): an output "
                         f"must not be expanded (stride 0) or otherwise overlap itself")
    s0 = int(stride[0])
    if s0 == 0:
        return 1
    diffs = {0}                         # every difference of two run starts: per dim, k * stride for |k| < size
    for size, st in dims:
        diffs = {d + k * st for d in diffs for k in range(1 - size, size)}
    best = INF
    for d in diffs:   # rows i and i + k overlap iff |k*s0 + d| < L for some difference d of run starts
        k = max(1, (-L - d) // s0 + 1)
        if k * s0 + d < L:
            best = min(best, k)
    return best


def _dense_enough(shape, stride, s0):
    """Sufficient for no overlap at any n: the dims sorted by stride, each stride at least the extent of the
    smaller ones, and the row stride at least a row's extent."""
    dims = sorted(zip(stride, shape)) if len(shape) > 1 else zip(stride, shape)
    span = 1                       # elements covered so far (exclusive end)
    for st, size in dims:
        if size != 1:
            if st < span:
                return False
            span += st * (size - 1)
    return s0 >= span


def _reject(name, t):
    raise ValueError(f"{name}: cannot prove its rows do not overlap in memory (shape {tuple(t.shape)}, strides "
                     f"{t.stride()}); use a layout whose strides do not interleave")


def _intervals(t: torch.Tensor):
    """Sorted, disjoint [start, end) byte intervals (int64 tensors) covering t's elements."""
    es = t.element_size()
    L, dims = _runs(tuple(t.shape), t.stride())
    starts = torch.zeros(1, dtype=torch.int64)
    for size, st in dims:
        starts = (starts[:, None] + torch.arange(size, dtype=torch.int64) * st).reshape(-1)
    starts = torch.unique(starts) * es + t.data_ptr()
    ends = starts + L * es
    reach = torch.cummax(ends, 0).values                   # merge runs that overlap or touch (inputs may overlap)
    new = torch.ones_like(starts, dtype=torch.bool)
    new[1:] = starts[1:] > reach[:-1]
    first = new.nonzero().flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([starts.numel() - 1])])
    return starts[first], reach[last]


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some byte of an element of a is a byte of an element of b (exact)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    sa, ea = _intervals(a)
    sb, eb = _intervals(b)
    starts = torch.cat([sa, sb])
    ends = torch.cat([ea, eb])
    order = torch.argsort(starts, stable=True)
    starts, ends = starts[order], ends[order]
    reach = torch.cummax(ends, 0).values
    # each list is disjoint, so an interval that starts before an earlier interval's end meets the other list
    return bool((starts[1:] < reach[:-1]).any())


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are one tensor's view: same data pointer, dtype, shape, and strides on every dim of size > 1."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and all(sa == sb for sa, sb, size in zip(a.stride(), b.stride(), a.shape) if size > 1))


class OverlapCheck:
    """The per-call overlap check of one validated call signature (kept with its plan-cache entry).

    ``items``: (tensor index, fixed bytes, bytes per row) of each tensor of the call that holds bytes: its span
    is [data_ptr, data_ptr + fixed + per_row * n). ``outputs``: the positions in ``items`` of the outputs the
    caller gave. ``names``: the argument name of each item. ``inplace``: (position of out, position of
    x) in ``items``, the one pair allowed to be the same tensor, or None; ``inplace_strides``: whether their
    strides are equal (then equal data pointers mean the same elements). ``row_limit`` / ``limit_name``: see
    :func:`row_limit`.
    """

    __slots__ = ("items", "outputs", "names", "inplace", "inplace_strides", "row_limit", "limit_name", "_fine",
                 "_tensors", "_sizes", "_pairs", "_last")

    def __init__(self, items, outputs, names, inplace=None, inplace_strides=False, row_limit_=INF, limit_name=None):
        self.items = tuple(items)
        self.outputs = tuple(outputs)
        self.names = names
        self.inplace = inplace
        self.inplace_strides = inplace_strides
        self.row_limit = row_limit_
        self.limit_name = limit_name
        self._fine = {}                # (k, j, pointer distance, n) -> True: the spans meet, the elements do not
        indices = tuple(i for i, _, _ in self.items)
        # the call's tensors of the items, as a tuple (itemgetter of one index would give the tensor itself)
        self._tensors = operator.itemgetter(*indices) if len(indices) > 1 else (lambda t: (t[indices[0]],))
        self._sizes = {}               # n -> the span sizes in bytes
        outs = set(self.outputs)       # (output, other) pairs to compare; two outputs once
        self._pairs = tuple((k, j) for k in self.outputs for j in range(len(self.items))
                            if j != k and not (j in outs and j < k))
        self._last = (None, None, False)   # (n, data pointers, in place) of the last accepted call

    def __call__(self, tensors: tuple, n: int) -> bool:
        """Raise ValueError if the call's outputs overlap themselves, each other or an input; return whether
        the call is in place (out is x). The hot path: the items' data pointers, then 2 compares per pair."""
        if n > self.row_limit:
            raise ValueError(f"{self.limit_name}: its rows overlap in memory for n = {n} (at most {self.row_limit} "
                             f"rows fit its strides): an output must not be expanded (stride 0) or otherwise "
                             f"overlap itself")
        sizes = self._sizes.get(n)
        if sizes is None:
            if not n:
                return False
            if len(self._sizes) >= _MEMO_SIZE:
                self._sizes.clear()
            sizes = self._sizes[n] = [fixed + per_row * n for _, fixed, per_row in self.items]
        ptrs = list(map(_DATA_PTR, self._tensors(tensors)))
        last = self._last
        if ptrs == last[1] and n == last[0]:
            return last[2]             # the same buffers as the last call (engines reuse theirs): the same verdict
        ends = list(map(operator.add, ptrs, sizes))
        inplace = False
        for k, j in self._pairs:
            if ptrs[j] < ends[k] and ptrs[k] < ends[j]:
                inplace = self._meeting(tensors, n, ptrs, ends)
                break
        self._last = (n, ptrs, inplace)
        return inplace

    def _meeting(self, tensors, n, ptrs, ends) -> bool:
        """Some spans meet: decide every meeting pair exactly; return whether the call is in place."""
        inplace = False
        for k, j in self._pairs:
            if ptrs[j] < ends[k] and ptrs[k] < ends[j]:
                inplace |= self._exact(tensors, n, k, j, ptrs)
        return inplace

    def _exact(self, tensors, n, k, j, ptrs) -> bool:
        """Spans k (an output) and j meet: allowed if they are out and x in place (returns True), or if their
        elements are disjoint (returns False); else ValueError."""
        a, b = tensors[self.items[k][0]], tensors[self.items[j][0]]
        if (k, j) == self.inplace and ((self.inplace_strides and ptrs[k] == ptrs[j]) or same_elements(a, b)):
            return True                                      # out is x itself: in place
        key = (k, j, ptrs[j] - ptrs[k], n)
        if key in self._fine:
            return False
        if tensors_overlap(a, b):
            name_a, name_b = self.names[k], self.names[j]
            what = "another output" if j in self.outputs else "an input"
            hint = (f" ({name_a} may be x itself for an in-place call: the same tensor or view, same shape and "
                    f"strides)" if (k, j) == self.inplace else "")
            raise ValueError(f"{name_a} overlaps {name_b} in memory: an output must not overlap {what}{hint}")
        if len(self._fine) >= _MEMO_SIZE:
            self._fine.clear()
        self._fine[key] = True
        return False


def span_terms(t: torch.Tensor, rows: bool):
    """(fixed bytes, bytes per row) of t's span: [data_ptr, data_ptr + fixed + per_row * n) where n is the call's
    row count when ``rows`` (t's leading dim is n), else t's own extent (per_row 0). None when t holds no bytes."""
    shape, stride = t.shape, t.stride()
    first = 1 if rows else 0
    size = 1                                   # elements from the first to one past the last (strides >= 0)
    for d in range(first, len(shape)):
        if shape[d] == 0:
            return None
        size += (shape[d] - 1) * stride[d]
    es = t.element_size()
    if rows:
        return es * (size - stride[0]), es * stride[0]
    return es * size, 0
