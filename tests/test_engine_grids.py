"""The engines' own test grids (tests/engine_grids.py) against kvfuse.engines on the CPU: every case of
every grid on the reference backend; the caches of vLLM's reshape_and_cache_flash grid hold at most 64
blocks here (its 5000-block fp32 caches are gigabytes; the GPU run, tests/gpu/test_gpu_engine_grids.py,
uses the engine's sizes), FlashInfer's RoPE-quantize grid its cases up to 19 tokens. A sample of each grid also runs the Triton kernels in the interpreter."""
import pytest
import torch

import kvfuse
from engine_grids import GRIDS, case_id

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

# FlashInfer's RoPE-quantize grid up to 19 tokens here (208 of its 624 cases; the GPU run takes all)
CPU_MAX_TOKENS = {"flashinfer_rope_quantize_fp8_append_paged_kv_cache": 19}
CASES = [(name, case) for name, (grid, _) in GRIDS.items() for case in grid
         if case.get("num_tokens", 0) <= CPU_MAX_TOKENS.get(name, 1 << 30)]


def _run(name, case, **kw):
    run = GRIDS[name][1]
    if name == "vllm_reshape_and_cache_flash":
        run(case, "cpu", max_blocks=kw.get("max_blocks", 64))
    else:
        run(case, "cpu")


@pytest.mark.parametrize("name,case", CASES, ids=[f"{n}[{case_id(c)}]" for n, c in CASES])
def test_engine_grid_reference(name, case):
    with kvfuse.use_backend("reference"):
        _run(name, case)


# every grid's first and last case, and the vLLM flash grid's fp8 per-head cases of each dtype and layout
SAMPLE = [(n, g[0]) for n, (g, _) in GRIDS.items()] + [(n, g[-1]) for n, (g, _) in GRIDS.items() if len(g) > 1] + [
    ("vllm_reshape_and_cache_flash", c) for c in GRIDS["vllm_reshape_and_cache_flash"][0]
    if c["head_size"] == 80 and c["block_size"] == 16 and c["num_blocks"] == 512 and c["kv_cache_dtype"] == "fp8"]


@pytest.mark.parametrize("name,case", SAMPLE, ids=[f"{n}[{case_id(c)}]" for n, c in SAMPLE])
def test_engine_grid_interpreter(name, case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kvfuse.use_backend("triton"):
        _run(name, case, max_blocks=16)


def test_fused_qk_norm_rope_outside_vllm_tolerance_only_where_its_reference_is_farther():
    """On this draw one element of kvfuse's fused result falls outside vLLM's test tolerance; the grid's
    check then requires kvfuse to be at least as close to an fp64 chain as vLLM's reference (it is)."""
    from engine_grids import VLLM_FUSED_QK_NORM_ROPE, run_vllm_fused_qk_norm_rope
    case = next(c for c in VLLM_FUSED_QK_NORM_ROPE if c["dtype"] == torch.bfloat16 and not c["is_neox"]
                and c["eps"] == 1e-5 and c["rotary_ratio"] == 0.25)
    with kvfuse.use_backend("reference"):
        assert run_vllm_fused_qk_norm_rope(case, "cpu", seed=0) == 1
