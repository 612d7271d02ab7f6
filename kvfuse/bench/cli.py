"""``kvfuse bench``'s command line: the options into a :class:`~kvfuse.bench.run.Config`
(:func:`parse_config`), and :func:`main`, which says so and exits 0 on a machine without CUDA.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

import torch

from .inputs import DECODE_MAX_N, MAX_POSITION, PREFILL_SEQ_LEN, REGIMES, SLOT_PATTERNS
from .peers import PEERS
from .run import MAX_X_ELEMS, Config, run_on_device
from .workloads import WORKLOADS

NEEDS_CUDA = "kvfuse bench needs a CUDA device (torch.cuda.is_available() is False): nothing measured."
DEFAULT_SIZES = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
QUICK_SIZES = (1, 256, 4096, 65536, 262144)
QUICK_WORKLOADS = ("main_fp8", "index_mxfp4", "q_pre")


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_config(argv: Optional[Sequence[str]]) -> Config:
    p = argparse.ArgumentParser(prog="kvfuse bench", description="Time the fused KV write against its peers "
                                "(eager reference, torch.compile, kvfuse stage by stage) on a CUDA device.")
    p.add_argument("--workloads", default=None, help=f"comma list or 'all' (default all; --quick: "
                   f"{','.join(QUICK_WORKLOADS)}); names: {','.join(WORKLOADS)}. DeepSeek V3's main write from "
                   f"kv_c [n, 512] and k_pe [n, 64] (views of one projection output) in one launch: "
                   f"dsv3_main_kv_c_k_pe (RMSNorm over the latent only), dsv3_main_kv_c_k_pe_nonorm (kv_c "
                   f"normalized already); e.g. --workloads dsv3_main_kv_c_k_pe,dsv3_main_kv_c_k_pe_nonorm "
                   f"--n 1,256,4096,65536")
    p.add_argument("--n", default=None, help=f"comma list of sizes (default {','.join(map(str, DEFAULT_SIZES))})")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list (default {','.join(PEERS)}; a peer "
                   f"that has no meaning for a workload is recorded as skipped)")
    p.add_argument("--quick", action="store_true", help="fewer workloads, sizes and replays (~90 s)")
    p.add_argument("--out", default=None, help="directory for kvfuse_bench.{json,png,txt} (default $OUT or "
                   "./kvfuse-bench)")
    p.add_argument("--cold-l2", action="store_true", help="cycle through several input sets (>= 512 MiB in all)")
    p.add_argument("--peer-max-n", type=int, default=65536, help="skip the reference and compile peers when "
                   "n * num_heads exceeds this (default 65536)")
    p.add_argument("--budget-s", type=float, default=None, help="stop measuring new points after this many "
                   "seconds (default 330; --quick 75)")
    p.add_argument("--compile-budget-s", type=float, default=None, help="stop running the compile peer once "
                   "it has used this many seconds (default 100; --quick 25)")
    p.add_argument("--max-x-elems", type=int, default=MAX_X_ELEMS, help="skip points whose x has more elements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", choices=SLOT_PATTERNS, default="paged", help="where the tokens of a write go: "
                   "paged (default: each sequence's tokens in its own blocks), random (a random permutation of "
                   "the cache's slots, every record scattered) or contiguous (token i in slot i)")
    p.add_argument("--regime", choices=REGIMES, default="auto", help=f"the inputs' positions and sequences: "
                   f"auto (default: decode for n <= {DECODE_MAX_N}, else prefill), decode (one token per "
                   f"sequence at spread positions), prefill (sequences of {PREFILL_SEQ_LEN[0]}-{PREFILL_SEQ_LEN[1]} "
                   f"tokens at positions 0..len-1) or uniform (positions uniform in [0, {MAX_POSITION}))")
    p.add_argument("--pdl", action="store_true", help="run kvfuse with programmatic dependent launch "
                   "(kvfuse.set_pdl(True)): each call of a graph may start while the previous one finishes")
    p.add_argument("--pdl-early", action="store_true", help="with --pdl: the opt-in early reads "
                   "(kvfuse.set_pdl(True, early_reads=True)): slots and positions read before the wait")
    p.add_argument("--pdl-pairs", action="store_true", help="also time, per workload and n, a producer kernel "
                   "that writes x followed by the fused call, PDL off and on (the call's share: pair - producer)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(list(argv) if argv is not None else [])
    if a.workloads in (None, ""):
        workloads = list(QUICK_WORKLOADS if a.quick else WORKLOADS)
    elif a.workloads == "all":
        workloads = list(WORKLOADS)
    else:
        workloads = _csv(a.workloads)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise ValueError(f"--workloads: unknown {bad}; choose from {list(WORKLOADS)}")
    peers = _csv(a.peers)
    if not peers or any(x not in PEERS for x in peers):
        raise ValueError(f"--peers: expected a comma list of {PEERS}, got {a.peers!r}")
    try:
        sizes = [int(v) for v in _csv(a.n)] if a.n else list(QUICK_SIZES if a.quick else DEFAULT_SIZES)
    except ValueError:
        raise ValueError(f"--n: expected a comma list of integers, got {a.n!r}") from None
    if not sizes or any(v < 1 for v in sizes):
        raise ValueError(f"--n: sizes must be >= 1, got {sizes}")
    if a.pdl_early and not a.pdl:
        raise ValueError("--pdl-early: needs --pdl (the early reads exist only under PDL)")
    return Config(workloads=workloads, sizes=sizes, peers=[x for x in PEERS if x in peers],
                  peer_max_n=a.peer_max_n, cold_l2=a.cold_l2, out=a.out, quick=a.quick,
                  budget_s=a.budget_s if a.budget_s is not None else (75.0 if a.quick else 330.0),
                  compile_budget_s=(a.compile_budget_s if a.compile_budget_s is not None
                                    else (25.0 if a.quick else 100.0)),
                  max_x_elems=a.max_x_elems, seed=a.seed, slots=a.slots, regime=a.regime, plot=not a.no_plot,
                  progress=not a.no_progress, pdl="early" if a.pdl_early else a.pdl, pdl_pairs=a.pdl_pairs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kvfuse bench [options]``; returns the exit status (0 without CUDA: nothing to measure)."""
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        print(f"kvfuse bench: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 0
    return run_on_device(cfg)
