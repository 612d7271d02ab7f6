"""GPU module for kvfuse.fused_group (kvfuse/kernels/grouped.py): an MLA layer's calls in one launch
write the bytes of the same calls made one by one (each on its own kernel: the portable one or a
Gluon fast path, both proven against the CPU reference by the GPU matrix), over whole cache
storages with guards, q in place or into a NaN-poisoned buffer, the index Q's (q, sf).

The cases come from the portable kernel's launch table (tests/group_cases.py ``gpu_cases``): every
layer at each batch size where a member's rows reach a table entry, and one below; PDL at decode
sizes. A CUDA-graph capture of a group replays to the same bytes. Run with KVFUSE_TEST_GPU=1:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_group.py
"""
import dataclasses

import pytest
import torch

import kvfuse
from group_cases import LayerCase, gpu_cases, inputs, run_layer
from helpers import assert_bytes_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")

SUMMARY = {"cases": 0, "byte_diffs": 0}
CASES = gpu_cases()


def _compare(a: dict, b: dict, what: str) -> list:
    bad = []
    if sorted(a) != sorted(b):
        return [f"{what}: outputs {sorted(a)} != {sorted(b)}"]
    for k in a:
        try:
            assert_bytes_equal(a[k], b[k], f"{what} {k}")
        except AssertionError as e:
            bad.append(str(e))
    return bad


@pytest.mark.parametrize("case,pdl", CASES, ids=[f"{c.model}-n{c.n}-{'-'.join(c.members)}"
                                                 f"{'-inplace' if c.q_in_place else ''}{'-pdl' if p else ''}"
                                                 for c, p in CASES])
def test_group_equals_its_calls(case: LayerCase, pdl: bool):
    kvfuse.set_pdl(pdl)
    try:
        one_by_one = run_layer(case, "cuda", grouped=False)
        together = run_layer(case, "cuda", grouped=True)
        again = run_layer(case, "cuda", grouped=True)       # the kernel compiled: the launch path of later calls
    finally:
        kvfuse.set_pdl(False)
    bad = _compare(together, one_by_one, "group") + _compare(again, one_by_one, "group again")
    SUMMARY["cases"] += 1
    SUMMARY["byte_diffs"] += len(bad)
    assert not bad, " | ".join(bad[:4])
    initial = inputs(case)["kv_cache"][1]
    assert not torch.equal(together["kv_storage"], initial), "the group wrote nothing into the main cache"


def test_cuda_graph_replay():
    """A group captured in a CUDA graph, replayed on new inputs copied into the captured buffers."""
    cfg = kvfuse.models.DEEPSEEK_V4
    case = LayerCase(model=cfg.name, n=9, seed=21, q_in_place=False)
    want = run_layer(case, "cuda", grouped=False)
    raw = inputs(case)
    dev = {k: v.cuda() for k, v in raw.items() if isinstance(v, torch.Tensor)}
    kv_view, kv_storage = raw["kv_cache"]
    idx_view, idx_storage = raw["index_cache"]
    kv_storage, idx_storage = kv_storage.cuda(), idx_storage.cuda()
    kv_cache = torch.as_strided(kv_storage, kv_view.shape, kv_view.stride(), kv_view.storage_offset())
    idx_cache = torch.as_strided(idx_storage, idx_view.shape, idx_view.stride(), idx_view.storage_offset())
    q_out = torch.full_like(dev["q"], float("nan"))
    kv_before, idx_before = kv_storage.clone(), idx_storage.clone()

    def step():
        return kvfuse.mla.write_layer(cfg, dev["positions"], dev["cos_sin"], q=dev["q"],
                                      q_norm_weight=dev.get("q_norm_weight"), q_out=q_out, kv=dev["kv"],
                                      kv_norm_weight=dev["kv_norm_weight"], kv_cache=kv_cache,
                                      slot_mapping=dev["slot_mapping"], index_k=dev["index_k"],
                                      index_norm_weight=dev["index_norm_weight"], index_cache=idx_cache,
                                      index_slot_mapping=dev["index_slot_mapping"], index_q=dev["index_q"])

    step()                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = step()
    kv_storage.copy_(kv_before)
    idx_storage.copy_(idx_before)
    q_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got = {"kv_storage": kv_storage.cpu(), "index_storage": idx_storage.cpu(), "q": dev["q"].cpu().view(torch.uint8),
           "q_out": q_out.cpu().view(torch.uint8), "q_result": res["q"].cpu().view(torch.uint8),
           "index_q": res["index_q"][0].cpu().view(torch.uint8), "index_sf": res["index_q"][1].cpu().view(torch.uint8)}
    want = {k: v for k, v in want.items()}
    bad = _compare({k: got[k].contiguous() for k in want}, want, "graph replay")
    assert not bad, " | ".join(bad[:4])


def test_zz_summary():
    print(f"\nGroup GPU summary: {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__}: {SUMMARY['cases']} cases (group vs its calls one by one), "
          f"{SUMMARY['byte_diffs']} outputs with differing bytes")
    assert SUMMARY["cases"] > 0 and SUMMARY["byte_diffs"] == 0
