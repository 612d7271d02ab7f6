"""The run: every (workload, n) point of a :class:`Config` built once and timed with each peer
(:func:`measure_point`, :func:`run_suite`; a failing peer is recorded, never raised), the device
ceilings, the PDL pairs, and the outputs (:func:`run_on_device`: the table, the targets, JSON, text and
PNG under ``--out``). The timer and the device measurement are arguments, so the flow runs without CUDA.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from .. import backend as _backend
from ..backend import use_backend
from .byte_model import input_bytes, mean_bytes
from .inputs import DECODE_MAX_N, _regime_text, build_input_sets, build_inputs, input_regime
from .peers import fused_call, make_chain, make_peer, peer_not_applicable
from .records import Record, add_speedups, build_report, finalize, write_json
from .tables import _f, format_pdl_pairs, format_summary, format_table, plot_results
from .targets import check_targets, format_targets
from .timing import CudaTimer, _producer_kernel, _short, measure_copy_bandwidth, measure_launch_floor, recover_cuda, \
    triton
from .workloads import WORKLOADS, Workload

MAX_X_ELEMS = 1 << 29        # skip a point whose x would exceed 1 GiB of bf16 (the 64-head Q workloads)
OUT_NAME = "kvfuse_bench"


@dataclasses.dataclass
class Config:
    workloads: List[str]
    sizes: List[int]
    peers: List[str]
    peer_max_n: int = 65536
    cold_l2: bool = False
    out: Optional[str] = None
    quick: bool = False
    budget_s: float = 330.0
    compile_budget_s: float = 100.0
    max_x_elems: int = MAX_X_ELEMS
    seed: int = 0
    slots: str = "paged"
    regime: str = "auto"
    plot: bool = True
    progress: bool = True
    pdl: object = False        # the whole suite with programmatic dependent launch (kvfuse.set_pdl): False,
                               # True, or "early" (set_pdl(True, early_reads=True))
    pdl_pairs: bool = False    # also time producer + call pairs, PDL off and on (measure_pdl_pairs)


class _CompileState:
    """The compile peer: one compiled chain per workload, its failures, the time spent compiling."""

    def __init__(self, compiler, budget_s: float):
        self.compiler, self.budget_s = compiler, budget_s
        self.spent_s = 0.0
        self.failed: Dict[str, str] = {}
        self._fns: Dict[str, Callable] = {}

    def chain(self, wl: Workload) -> Callable:
        if wl.name not in self._fns:
            if self.compiler is torch.compile:
                _reset_dynamo()
            self._fns[wl.name] = self.compiler(make_chain(wl))
        return self._fns[wl.name]

    def skip_reason(self, wl: Workload) -> str:
        if wl.name in self.failed:
            return f"compile failed earlier for this workload: {self.failed[wl.name]}"
        if self.spent_s > self.budget_s:
            return f"compile budget spent ({self.spent_s:.0f}s > --compile-budget-s {self.budget_s:.0f})"
        return ""


def _reset_dynamo() -> None:
    try:
        import torch._dynamo as dynamo
        dynamo.reset()
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
    except Exception:  # pragma: no cover
        pass


def _skip_reason(peer: str, wl: Workload, n: int, cfg: Config, cstate: _CompileState) -> str:
    rows = n * wl.num_heads
    reason = peer_not_applicable(peer, wl)
    if reason:
        return reason
    if peer in ("reference", "compile") and rows > cfg.peer_max_n:
        return f"rows n*heads={rows} > --peer-max-n {cfg.peer_max_n}"
    if peer == "compile":
        return cstate.skip_reason(wl)
    return ""


def measure_point(wl: Workload, n: int, cfg: Config, device, timer, cstate: _CompileState,
                  deadline: float, log=print) -> List[Record]:
    """All peers of one (workload, n): build the inputs once, time each peer on them."""
    rows = n * wl.num_heads
    base = dict(workload=wl.name, n=n, rows=rows, regime=input_regime(n, cfg.regime),
                slots=cfg.slots if wl.kind in ("write", "group") else "")
    skip = ""
    if rows * wl.head_dim > cfg.max_x_elems:
        skip = f"x would hold {rows * wl.head_dim} elements > {cfg.max_x_elems} (--max-x-elems)"
    elif time.perf_counter() > deadline:
        skip = "time budget spent (--budget-s)"
    if skip:
        return [Record(peer=p, status="skipped", note=skip, **base) for p in cfg.peers]
    try:
        sets = build_input_sets(wl, n, device, cfg.cold_l2, cfg.seed, cfg.slots, cfg.regime)
        detail = mean_bytes([input_bytes(wl, s) for s in sets])
    except Exception as e:
        recover_cuda()
        return [Record(peer=p, status="error", note=f"building inputs: {_short(e)}", **base) for p in cfg.peers]
    base.update(bytes=detail["total"], bytes_detail=detail)
    out = []
    for peer in cfg.peers:
        reason = _skip_reason(peer, wl, n, cfg, cstate)
        if reason:
            out.append(Record(peer=peer, status="skipped", note=reason, **base))
            continue
        t0 = time.perf_counter()
        try:
            compiled = cstate.chain(wl) if peer == "compile" else None
            fns = [make_peer(peer, wl, s, compiled) for s in sets]
            t = timer.measure(fns, (wl.name, n, peer))
            out.append(Record(peer=peer, gpu_us=t.gpu_us, gpu_method=t.gpu_method, eager_us=t.eager_us,
                              note=t.note + (f" ({len(sets)} input sets)" if len(sets) > 1 else ""), **base))
        except Exception as e:
            msg = _short(e)
            out.append(Record(peer=peer, status="error", note=msg, **base))
            log(f"[{wl.name} n={n} {peer}] {msg}")
            if peer == "compile":
                cstate.failed[wl.name] = msg
            recover_cuda()
        finally:
            if peer == "compile":
                cstate.spent_s += time.perf_counter() - t0
    del sets
    return out


def run_suite(cfg: Config, device, timer, copy_gbps: Optional[float] = None, floor_us: Optional[float] = None,
              kernel_backend: str = "triton", compiler=None, progress=None, log=print) -> List[Record]:
    """Every (workload, n, peer) of cfg, in order; never raises for a failing peer."""
    cstate = _CompileState(torch.compile if compiler is None else compiler, cfg.compile_budget_s)
    deadline = time.perf_counter() + cfg.budget_s
    records: List[Record] = []
    with use_backend(kernel_backend):
        for name in cfg.workloads:
            wl = WORKLOADS[name]
            for n in cfg.sizes:
                if progress is not None:
                    progress.set_description(f"{name} n={n}")
                records += measure_point(wl, n, cfg, device, timer, cstate, deadline, log)
                if progress is not None:
                    progress.update(1)
                _free(device, big=n * wl.num_heads >= 65536)
    for r in records:
        finalize(r, copy_gbps, floor_us)
    add_speedups(records)
    return records


def _free(device, big: bool) -> None:
    """Give the point's buffers back (refcounting frees them; a collection only after big points)."""
    if big:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _set_pdl_mode(mode) -> None:
    """kvfuse.set_pdl from a bench setting or :func:`kvfuse.pdl_mode`'s value: False / "off", True / "on",
    "early"."""
    _backend.set_pdl(mode not in (False, "off"), early_reads=mode == "early")


def measure_pdl_pairs(cfg: Config, device, timer) -> List[dict]:
    """GPU us per pair [a producer kernel that writes x (and lets its dependents launch), then the fused
    call], replayed in a CUDA graph with kvfuse's PDL off and on, and of the producer alone; the call's
    share of a pair is pair - producer. Sizes above the decode range are skipped (PDL hides a launch,
    not bandwidth)."""
    pairs = []
    for name in cfg.workloads:
        wl = WORKLOADS[name]
        for n in cfg.sizes:
            if n > DECODE_MAX_N:
                continue
            inp = build_inputs(wl, n, device, seed=cfg.seed, slots=cfg.slots, regime=cfg.regime)
            call = fused_call(wl, inp)
            x = inp.x

            def producer():
                _producer_kernel[(1,)](x)
            row = dict(workload=name, n=n, producer_us=timer.measure([producer]).gpu_us)
            for pdl in (False, True):
                _backend.set_pdl(pdl)

                def pair():
                    producer()
                    call()
                row["pair_pdl_us" if pdl else "pair_us"] = timer.measure([pair]).gpu_us
            _set_pdl_mode(cfg.pdl)
            row["call_us"] = row["pair_us"] - row["producer_us"]
            row["call_pdl_us"] = row["pair_pdl_us"] - row["producer_us"]
            pairs.append(row)
            del inp
    return pairs


def run_info() -> dict:
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
                triton=getattr(triton, "__version__", None), argv=sys.argv)
    try:
        from .. import __version__ as kv_version
        info["kvfuse"] = kv_version
    except Exception:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", memory_GiB=round(props.total_memory / 2 ** 30, 1))
    return info


class _NoBar:
    def update(self, k=1):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass

    @staticmethod
    def write(text):
        print(text, file=sys.stderr)


def _progress_bar(total: int, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(total=total, unit="point", dynamic_ncols=True)
        except Exception:
            pass
    return _NoBar()


def measure_device(quick: bool, log=print) -> dict:
    dev = {}
    try:
        dev.update(measure_copy_bandwidth(reps=5 if quick else 10))
    except Exception as e:
        dev["copy_error"] = _short(e)
        recover_cuda()
    try:
        dev.update(measure_launch_floor(reps=20 if quick else 50))
    except Exception as e:
        dev["floor_error"] = _short(e)
        recover_cuda()
    log(f"copy bandwidth: {_f(dev.get('copy_GBps'), '.0f')} GB/s (2 GiB device-to-device copy, read + written); "
        f"launch floor: {_f(dev.get('floor_us'), '.2f')} us (tiny Triton kernel, "
        f"{dev.get('floor_launches_per_graph', '-')} launches per CUDA graph)")
    for key in ("copy_error", "floor_error"):
        if key in dev:
            log(f"  {key}: {dev[key]}")
    return dev


def write_outputs(cfg: Config, report: dict, records, text: str, dev: dict, log=print) -> None:
    out = cfg.out or os.environ.get("OUT") or "kvfuse-bench"
    try:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, OUT_NAME + ".json"), report)
        with open(os.path.join(out, OUT_NAME + ".txt"), "w") as f:
            f.write(text + "\n")
        log(f"wrote {os.path.join(out, OUT_NAME + '.json')} and .txt")
    except Exception as e:
        log(f"could not write the JSON/text report under {out}: {_short(e)}")
    if cfg.plot:
        try:
            plot_results(records, os.path.join(out, OUT_NAME + ".png"), dev.get("copy_GBps"), dev.get("floor_us"))
            log(f"wrote {os.path.join(out, OUT_NAME + '.png')}")
        except Exception as e:
            log(f"no plot: {_short(e)}")


def run_on_device(cfg: Config, device="cuda", timer=None, measure=measure_device, **suite_kwargs) -> int:
    """The whole run: device ceilings, the suite, the report. ``timer``/``measure`` (and run_suite's
    keyword arguments) are injectable so that the flow is tested without a GPU."""
    t_start = time.perf_counter()
    info = run_info()
    print(f"kvfuse bench on {info.get('device')} ({info.get('sm_count')} SMs): torch {info['torch']} "
          f"(CUDA {info['torch_cuda']}), triton {info['triton']}, python {info['python']}, {info['date']}")
    print(f"workloads {','.join(cfg.workloads)}; n {','.join(map(str, cfg.sizes))}; peers {','.join(cfg.peers)}; "
          f"reference/compile only for n*heads <= {cfg.peer_max_n}; {'cold' if cfg.cold_l2 else 'warm'} L2; "
          f"{cfg.slots} slots; {cfg.regime} regime ({_regime_text(cfg.regime)})")
    dev = measure(cfg.quick)
    bar = _progress_bar(len(cfg.workloads) * len(cfg.sizes), cfg.progress)
    if timer is None:
        timer = CudaTimer(graph_calls=10 if cfg.quick else 20, target_s=0.02 if cfg.quick else 0.05,
                          eager_target_s=0.015 if cfg.quick else 0.03, max_reps=15 if cfg.quick else 40)
    pdl_before = _backend.pdl_mode()
    try:
        _set_pdl_mode(cfg.pdl)
        records = run_suite(cfg, device, timer, dev.get("copy_GBps"), dev.get("floor_us"),
                            progress=bar, log=bar.write, **suite_kwargs)
        pairs = measure_pdl_pairs(cfg, device, timer) if cfg.pdl_pairs else []
    finally:
        bar.close()
        _set_pdl_mode(pdl_before)
    targets = check_targets(records, pdl=bool(cfg.pdl))
    elapsed = time.perf_counter() - t_start
    summary = (f"copy bandwidth {_f(dev.get('copy_GBps'), '.0f')} GB/s; launch floor {_f(dev.get('floor_us'), '.2f')}"
               f" us; total {elapsed:.0f} s. GPU us: per call, CUDA-graph replay ('graph') or CUDA events around "
               f"eager calls ('events', for host-synchronizing peers); vs fused = this peer's GPU time / fused's.")
    text = "\n".join([format_table(records), "", format_summary(records), "", summary, "",
                      format_targets(targets)] + (["", format_pdl_pairs(pairs)] if pairs else []))
    print(text)
    report = build_report(cfg, info, dev, records, targets, elapsed, pairs)
    write_outputs(cfg, report, records, text, dev)
    if "fused" in cfg.peers and not any(r.peer == "fused" and r.status == "ok" for r in records):
        print("no fused measurement succeeded")
        return 1
    return 0
