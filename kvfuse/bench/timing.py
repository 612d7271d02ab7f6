"""GPU time of a peer (:class:`CudaTimer`: CUDA-graph replay, CUDA events for what cannot be captured,
eager wall time) and the device's ceilings the records are read against: the copy bandwidth and the
launch floor (one tiny Triton kernel). The run takes the timer as an argument, so that the rest of the
bench is tested without CUDA.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, Sequence

import torch


try:  # triton is a kvfuse dependency; still, keep this module importable without it
    import triton
    import triton.language as tl

    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def _tiny_kernel(p):
        tl.store(p, tl.load(p) + 1)

    @triton.jit
    def _producer_kernel(p):
        # a PDL-aware predecessor that writes x (its first element, with its own value: inputs unchanged)
        gdc_launch_dependents()
        tl.store(p, tl.load(p))
except Exception:  # pragma: no cover
    triton = None
    _tiny_kernel = _producer_kernel = None


@dataclasses.dataclass
class Timing:
    gpu_us: float
    gpu_method: str          # "graph": CUDA-graph replay; "events": CUDA events around eager calls
    eager_us: float
    note: str = ""


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def _clamp(v, lo, hi):
    return max(lo, min(hi, v))


class CudaTimer:
    """GPU time per call by CUDA-graph replay (K calls captured in one graph, median per call over
    replays), falling back to CUDA events around eager calls for ops that cannot be captured
    (host synchronization); eager wall time per call (a loop of calls, one synchronize at the end)."""

    def __init__(self, graph_calls: int = 20, target_s: float = 0.05, eager_target_s: float = 0.03,
                 min_reps: int = 3, max_reps: int = 40, max_eager_calls: int = 200):
        self.graph_calls, self.target_s, self.eager_target_s = graph_calls, target_s, eager_target_s
        self.min_reps, self.max_reps, self.max_eager_calls = min_reps, max_reps, max_eager_calls

    def measure(self, fns: Sequence[Callable[[], None]], label=None) -> Timing:
        for f in fns:                      # warm-up: JIT compiles, torch.compile, autotuning
            f()
        torch.cuda.synchronize()
        est = self._estimate(fns)
        gpu, method, note = None, "events", ""
        blocker = self._host_sync(fns[0])
        if blocker:
            note = f"not graph-capturable ({blocker}); GPU time from events"
        else:
            try:
                gpu, method = self._graph_us(fns, est), "graph"
            except Exception as e:
                note = f"graph capture failed ({_short(e, 160)}); GPU time from events"
                recover_cuda()
        if gpu is None:
            gpu = self._events_us(fns, est)
        return Timing(gpu, method, self._eager_us(fns, est), note)

    @staticmethod
    def _estimate(fns) -> float:
        best = float("inf")
        for i in range(2):
            t = time.perf_counter()
            fns[i % len(fns)]()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return max(best, 1e-6)

    @staticmethod
    def _host_sync(fn) -> str:
        """'' if fn runs with synchronizing CUDA calls turned into errors, else the error."""
        try:
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        except Exception:
            return ""
        try:
            fn()
            return ""
        except Exception as e:
            return _short(e, 120)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
            recover_cuda()

    def _graph_us(self, fns, est) -> float:
        k = _clamp(int(0.02 / est), 1, self.graph_calls)
        k = max(k, min(len(fns), self.graph_calls))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for i in range(k):
                    fns[i % len(fns)]()
        except Exception:
            # a failed capture_end leaves the capture stream current: put ours back
            torch.cuda.set_stream(stream)
            raise
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        one = _events_ms(lambda: graph.replay(), 1) / 1e3
        reps = _clamp(int(self.target_s / max(one, 1e-7)), self.min_reps, self.max_reps)
        times = [_events_ms(lambda: graph.replay(), 1) * 1e3 / k for _ in range(reps)]
        del graph
        return statistics.median(times)

    def _events_us(self, fns, est) -> float:
        """Median of 3 groups: events around a group of eager calls, divided by the group's size."""
        per = max(1, _clamp(int(self.target_s / est), self.min_reps, self.max_reps) // 3)
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(per):
                fns[i % len(fns)]()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / per)
        return statistics.median(times)

    def _eager_us(self, fns, est) -> float:
        calls = _clamp(int(self.eager_target_s / est), 3, self.max_eager_calls)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6 / calls


def _events_ms(fn, count: int) -> float:
    """Milliseconds between two CUDA events around ``count`` calls of fn."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(count):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def recover_cuda() -> None:
    """After a failed GPU call: wait for the device so that the failure is not reported by the next
    call; an error that ended the CUDA context is swallowed here (what follows will report it)."""
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def measure_copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> Dict[str, float]:
    """Device-to-device copy: (bytes read + written) / median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = [_events_ms(lambda: dst.copy_(src), 1) / 1e3 for _ in range(reps)]
    del src, dst
    torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"copy_GBps": 2 * nbytes / t / 1e9, "copy_ms": t * 1e3, "copy_bytes": 2 * nbytes}


def measure_launch_floor(launches: int = 100, reps: int = 50) -> Dict[str, object]:
    """GPU time of one tiny Triton kernel (load + store of one int) replayed in a CUDA graph."""
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    if _tiny_kernel is not None:
        launch, kernel = (lambda: _tiny_kernel[(1,)](buf)), "triton"
    else:  # pragma: no cover
        launch, kernel = (lambda: buf.add_(1)), "torch add_ (triton unavailable)"
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = [_events_ms(lambda: graph.replay(), 1) * 1e3 / launches for _ in range(reps)]
    del graph
    return {"floor_us": statistics.median(times), "floor_min_us": min(times), "floor_kernel": kernel,
            "floor_launches_per_graph": launches}
