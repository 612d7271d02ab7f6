"""Host time of one eager kvfuse.fused_qk_norm_rope_store_kv call, plan cache on vs off, on the CPU.

The call is kvfuse.bench's GQA workload (--workload, default Qwen3 8B with an fp8 cache: QK-norm,
RoPE, q_out given) at --n tokens. Rows:

- "reference backend": the whole call on CPU tensors, the reference chain included;
- "kvfuse Python (launch a no-op)": the "triton" backend with qkv_kernel replaced by a no-op (in
  Triton's interpreter, set here when there is no GPU): validation or the plan-cache lookup, the
  aliasing check, the launch arguments, and Launch's own work, not Triton's binder;
- "validate + allocate + aliasing (prepare)", "qkv.launch_args": the parts an uncached call runs.

Median (and min) over batches of calls, the modes alternating batch by batch (host_overhead.py's
per_call_us). Usage: python benchmarks/gqa_host_time.py [--n 1] [--calls 20] [--batches 100]
"""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernel objects depend on it

import kvfuse  # noqa: E402
from kvfuse import bench  # noqa: E402
from kvfuse.bench import peers  # noqa: E402
from kvfuse.kernels import qkv  # noqa: E402
from kvfuse.plans import gqa  # noqa: E402

from host_overhead import launches_mocked, per_call_us  # noqa: E402  (a sibling script)


def call_args(workload: str, n: int) -> tuple:
    """The positional arguments of the workload's call (kvfuse.bench's exact call, captured)."""
    wl = bench.WORKLOADS[workload]
    if wl.kind != "gqa":
        raise SystemExit(f"--workload: {workload} is not a GQA workload")
    fn = bench.fused_call(wl, bench.build_inputs(wl, n, torch.device("cpu")))
    seen = []
    real, peers.fused_qk_norm_rope_store_kv = peers.fused_qk_norm_rope_store_kv, lambda *a: seen.append(a)
    try:
        fn()
    finally:
        peers.fused_qk_norm_rope_store_kv = real
    return seen[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="qwen3_8b_fp8")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--calls", type=int, default=20, help="calls per batch")
    p.add_argument("--batches", type=int, default=100)
    a = p.parse_args(argv)
    args = call_args(a.workload, a.n)

    def public():
        kvfuse.fused_qk_norm_rope_store_kv(*args)

    plan = gqa.prepare(*args)
    rows = []
    with kvfuse.use_backend("reference"):
        rows.append(("reference backend", per_call_us(public, (False, True), a.calls, a.batches)))
    with kvfuse.use_backend("triton"), launches_mocked():
        rows.append(("kvfuse Python (launch a no-op)", per_call_us(public, (False, True), a.calls, a.batches)))
    rows.append(("validate + allocate + aliasing (prepare)",
                 per_call_us(lambda: gqa.prepare(*args), (False,), a.calls, a.batches)))
    rows.append(("qkv.launch_args", per_call_us(lambda: qkv.launch_args(plan), (False,), a.calls, a.batches)))
    print(f"{a.workload}, n = {a.n}, CPU tensors; us per call, median (min) over {a.batches} batches of {a.calls}")
    print(f"{'':42s} {'cache off':>18s} {'cache on':>18s}")
    for name, t in rows:
        cells = [f"{t[m][0]:8.1f} ({t[m][1]:6.1f})" if m in t else "" for m in (False, True)]
        print(f"{name:42s} {cells[0]:>18s} {cells[1]:>18s}")


if __name__ == "__main__":
    main()
