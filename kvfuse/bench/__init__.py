"""``kvfuse bench``: the fused write path against its peers, on one CUDA device.

It measures the device (copy bandwidth, the launch floor), then for every workload (a call site of
the fused operator, a GQA model's ``fused_qk_norm_rope_store_kv`` call, or a layer's calls as one
``fused_group``) and size n builds realistic inputs (decode steps up to 256 tokens, prefills above;
paged or random slots) and times the peers on the same inputs: ``reference`` (the eager reference
chain), ``compile`` (torch.compile of it), ``stages`` (kvfuse's kernels one stage per launch),
``calls`` (a group's calls one by one), ``two_launch`` (the engines' two launches for GQA models, with
kvfuse's kernels) and ``fused``. It prints a table and PASS / MISS lines against the targets and writes
JSON (+ PNG); benchmarks/ renders the documents from that JSON, and benchmarks/README.md says how to
read the output.

Effective bandwidth is the compulsory DRAM bytes of one call over its GPU time, against the copy
bandwidth; every peer of a point is charged the same bytes. Timing is injectable (``run_suite(...,
timer=...)``), so the orchestration, the byte model and the report are tested without CUDA; nothing
here needs matplotlib or tqdm at import.

One module per part, each name of the parts importable from here:

| module | what |
|---|---|
| ``workloads`` | :class:`Workload`, :data:`WORKLOADS`, the bench-only formats (:data:`RECORD_LAYOUTS`) |
| ``inputs`` | :func:`token_layout` (positions and slots), :func:`build_inputs`, :class:`Inputs` |
| ``byte_model`` | the compulsory bytes of a call: :func:`moved_bytes`, :func:`input_bytes` |
| ``peers`` | :data:`PEERS` and :func:`make_peer`: each peer as a callable on a point's inputs |
| ``timing`` | :class:`CudaTimer`, the copy bandwidth and the launch floor |
| ``records`` | :class:`Record`, its derived columns, the JSON report |
| ``targets`` | :func:`check_targets`: the project's targets against a run's records |
| ``tables`` | the printed table and summary, the PNG |
| ``run`` | :class:`Config`, :func:`run_suite`, :func:`run_on_device` |
| ``cli`` | :func:`parse_config`, :func:`main` (``kvfuse bench``, ``python -m kvfuse.bench``) |
"""
from __future__ import annotations

from .byte_model import ACCOUNTING, cos_sin_rows, input_bytes, mean_bytes, moved_bytes
from .cli import DEFAULT_SIZES, NEEDS_CUDA, QUICK_SIZES, QUICK_WORKLOADS, main, parse_config
from .inputs import (BLOCK_SIZE, COLD_L2_BYTES, DECODE_MAX_N, MAX_POSITION, PREFILL_SEQ_LEN, REGIMES, SLOT_PATTERNS,
                     Inputs, build_input_sets, build_inputs, input_regime, prefill_lengths, result_tensors,
                     slot_mapping, token_layout)
from .peers import EPS, GQA_PEERS, PEERS, V_SINK_DIM, chain_args, fused_call, make_chain, make_peer, peer_not_applicable
from .records import Record, add_speedups, build_report, finalize, write_json
from .run import MAX_X_ELEMS, OUT_NAME, Config, measure_device, measure_point, measure_pdl_pairs, run_info, \
    run_on_device, run_suite, write_outputs
from .tables import format_pdl_pairs, format_summary, format_table, plot_results
from .targets import (ENGINE_TIME_TARGETS, FLOOR_KINDS, FLOOR_SIZES, FLOOR_TARGET, PCT_COPY_N, PCT_COPY_TARGET, PCT_COPY_TARGETS,
                      TARGET_KINDS, check_targets, format_targets, pct_copy_target)
from .timing import CudaTimer, Timing, measure_copy_bandwidth, measure_launch_floor, recover_cuda
from .workloads import (MAIN_FP8_NO_RESERVED, MAIN_FP8_PAGEWISE, MAIN_FP8_RESERVED_UNWRITTEN, MAIN_FP8_SECTOR_ALIGNED, RECORD_LAYOUTS, ROTARY_DIM,
                        WORKLOADS, Workload)

__all__ = [
    "ACCOUNTING", "cos_sin_rows", "input_bytes", "mean_bytes", "moved_bytes",
    "DEFAULT_SIZES", "NEEDS_CUDA", "QUICK_SIZES", "QUICK_WORKLOADS", "main", "parse_config",
    "BLOCK_SIZE", "COLD_L2_BYTES", "DECODE_MAX_N", "MAX_POSITION", "PREFILL_SEQ_LEN", "REGIMES", "SLOT_PATTERNS",
    "Inputs", "build_input_sets", "build_inputs", "input_regime", "prefill_lengths", "result_tensors", "slot_mapping",
    "token_layout",
    "EPS", "GQA_PEERS", "PEERS", "V_SINK_DIM", "chain_args", "fused_call", "make_chain", "make_peer",
    "peer_not_applicable",
    "Record", "add_speedups", "build_report", "finalize", "write_json",
    "MAX_X_ELEMS", "OUT_NAME", "Config", "measure_device", "measure_point", "measure_pdl_pairs", "run_info",
    "run_on_device", "run_suite", "write_outputs",
    "format_pdl_pairs", "format_summary", "format_table", "plot_results",
    "ENGINE_TIME_TARGETS", "FLOOR_KINDS", "FLOOR_SIZES", "FLOOR_TARGET", "PCT_COPY_N", "PCT_COPY_TARGET", "PCT_COPY_TARGETS", "TARGET_KINDS",
    "check_targets", "format_targets", "pct_copy_target",
    "CudaTimer", "Timing", "measure_copy_bandwidth", "measure_launch_floor", "recover_cuda",
    "MAIN_FP8_NO_RESERVED", "MAIN_FP8_PAGEWISE", "MAIN_FP8_RESERVED_UNWRITTEN", "MAIN_FP8_SECTOR_ALIGNED", "RECORD_LAYOUTS", "ROTARY_DIM",
    "WORKLOADS", "Workload",
]
