"""kvfuse.engines on the GPU: every adapter of every engine called with CUDA tensors (the Triton kernels and
whatever Gluon fast path the dispatcher picks) writes the bytes the same call writes on the CPU with
the reference backend, on poisoned caches compared whole. The CPU tests (tests/test_engines_*.py) tie
the reference bytes to each engine's semantics; tests/gpu/test_gpu_engine_grids.py runs the engines'
own grids. Sizes cross the fast paths' launch-table boundaries (1, 24 / 256, 4096 tokens)."""
import pytest
import torch

import kvfuse
from kvfuse.engines import flashinfer, sglang, vllm
from helpers import cos_sin_cache, random_bf16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
POISON = 0xAB
SIZES = (1, 256, 4096)


def _poisoned(shape):
    return torch.full(shape, POISON, dtype=torch.uint8)


def _slots(n, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(capacity, generator=g)[:n]
    if n > 3:
        s[1] = -1
    return s


def _run_both(fn, args: dict):
    """fn(**args) on CPU copies with the reference backend and on CUDA copies with the default backend;
    every tensor argument (the caches and in-place outputs) and the result compared byte for byte."""
    def copies(device):
        return {k: (v.clone().to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}

    cpu, gpu = copies("cpu"), copies("cuda")
    with kvfuse.use_backend("reference"):
        r_cpu = fn(**cpu)
    r_gpu = fn(**gpu)
    torch.cuda.synchronize()
    for k, v in cpu.items():
        if isinstance(v, torch.Tensor):
            a, b = v.reshape(-1).view(torch.uint8), gpu[k].cpu().reshape(-1).view(torch.uint8)
            assert torch.equal(a, b), f"{fn.__name__}: {k} differs in {int((a != b).sum())} bytes"
    outs = r_cpu if isinstance(r_cpu, (tuple, list)) else [r_cpu]
    gouts = r_gpu if isinstance(r_gpu, (tuple, list)) else [r_gpu]
    for a, b in zip(outs, gouts):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)), fn.__name__


# ------------------------------------------------------------------------------------------- SGLang
SGL_PAGE = {"v4": (576 + 8, 576), "v41": (512 + 16, 512), "v41_new": (528, 528), "v41_fp4": (256 + 32, 256),
            "v41_fp4_new": (288, 288)}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", list(SGL_PAGE))
def test_sglang_fused_k_norm_rope_flashmla(layout, n):
    page_size, row, align = 64, *SGL_PAGE[layout]
    page_bytes = -(-page_size * row // align) * align
    num_pages = n // page_size + 2
    cs = cos_sin_cache(8192, 64)
    args = dict(kv=random_bf16((n, 640), seed=n)[:, 64:576], kv_weight=random_bf16((512,), seed=2, outliers=False),
                eps=1e-6, freqs_cis=torch.complex(cs[:, :32], cs[:, 32:]),
                positions=torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(n)).int(),
                out_loc=_slots(n, num_pages * page_size, n).int(), kvcache=_poisoned((num_pages, page_bytes)),
                page_size=page_size, layout=layout)
    _run_both(sglang.fused_k_norm_rope_flashmla, args)


@pytest.mark.parametrize("n", SIZES)
def test_sglang_indexer_k(n):
    page_size = 64
    num_pages = n // page_size + 2
    args = dict(k_input=random_bf16((n, 256), seed=n)[:, :128], cache=_poisoned((num_pages, 132 * page_size)),
                out_cache_loc=_slots(n, num_pages * page_size, n + 1), weight=1.0 + 0.2 * torch.randn(128),
                bias=0.1 * torch.randn(128), eps=1e-6, cos_sin_cache=cos_sin_cache(4096, 64),
                positions=torch.randint(0, 4096, (n,)), page_size=page_size)
    _run_both(sglang.fused_k_indexer_norm_rope_store, args)
    store = dict(key=args["k_input"], index_k_with_scale=args["cache"], out_cache_loc=args["out_cache_loc"])
    _run_both(sglang.fused_store_index_k_cache, store)


# ------------------------------------------------------------------------------------------- vLLM
@pytest.mark.parametrize("n", SIZES)
def test_vllm_indexer_k_quant_and_cache(n):
    block_size = 64
    blocks = n // block_size + 2
    args = dict(k=random_bf16((n, 128), seed=n), kv_cache=_poisoned((blocks, block_size, 132)),
                slot_mapping=_slots(n, blocks * block_size, n), quant_block_size=128, scale_fmt="ue8m0")
    _run_both(vllm.indexer_k_quant_and_cache, args)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_vllm_reshape_and_cache_flash(kv_cache_dtype, n):
    block_size, heads, d = 16, 8, 128
    blocks = n // block_size + 2
    qkv = random_bf16((n, 3, heads, d), seed=n + 7)     # key and value: strided views of one projection
    esize = 2 if kv_cache_dtype == "auto" else 1
    kv = _poisoned((blocks, 2, block_size, heads, d * esize))
    if kv_cache_dtype == "auto":
        kv = kv.view(torch.bfloat16)
    args = dict(key=qkv[:, 1], value=qkv[:, 2], key_cache=kv[:, 0], value_cache=kv[:, 1],
                slot_mapping=_slots(n, blocks * block_size, n), kv_cache_dtype=kv_cache_dtype,
                k_scale=torch.tensor([0.05], dtype=torch.float32), v_scale=torch.tensor([0.002], dtype=torch.float32))
    _run_both(vllm.reshape_and_cache_flash, args)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_vllm_concat_and_cache_mla(kv_cache_dtype, n):
    block_size = 64
    blocks = n // block_size + 2
    latent = random_bf16((n, 576), seed=n)              # kv_c and k_pe: views of one projection output
    record = 656 if kv_cache_dtype == "fp8_ds_mla" else 576
    cache = _poisoned((blocks, block_size, record * (2 if kv_cache_dtype == "auto" else 1)))
    if kv_cache_dtype == "auto":
        cache = cache.view(torch.bfloat16)
    args = dict(kv_c=latent[:, :512], k_pe=latent[:, 512:], kv_cache=cache,
                slot_mapping=_slots(n, blocks * block_size, n), kv_cache_dtype=kv_cache_dtype,
                scale=torch.tensor(0.05, dtype=torch.float32))
    _run_both(vllm.concat_and_cache_mla, args)


# ------------------------------------------------------------------------------------------- FlashInfer
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("inplace", [False, True])
def test_flashinfer_apply_rope_with_cos_sin_cache(inplace, n):
    qkv = random_bf16((n, (32 + 2 * 8) * 128), seed=n)
    fn = flashinfer.apply_rope_with_cos_sin_cache_inplace if inplace else flashinfer.apply_rope_with_cos_sin_cache
    args = dict(positions=torch.randint(0, 4096, (n,)), query=qkv[:, :32 * 128], key=qkv[:, 32 * 128:40 * 128],
                head_size=128, cos_sin_cache=cos_sin_cache(4096, 128), is_neox=True)
    _run_both(fn, args)


# ------------------------------------------------------------------------------ FlashInfer RoPE-quantize
_RQ_SHAPES = {"gqa": (32, 8, 64, 64), "gqa_rope_only": (32, 8, 128, 0), "mla": (128, 1, 64, 512)}


def _rq_inputs(kind, n, seed=3):
    hq, hkv, rope_dim, nope = _RQ_SHAPES[kind]
    mla = kind == "mla"
    q_rope = random_bf16((n, hq, rope_dim), seed)
    k_rope = random_bf16((n, rope_dim) if mla else (n, hkv, rope_dim), seed + 1)
    q_nope = random_bf16((n, hq, nope), seed + 2) if nope else None
    k_nope = (random_bf16((n, nope) if mla else (n, hkv, nope), seed + 3)) if nope else None
    v = None if mla else random_bf16((n, hkv, rope_dim + nope), seed + 4)
    return q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache(max(n, 2), rope_dim), torch.randperm(max(n, 2))[:n]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", list(_RQ_SHAPES))
def test_flashinfer_rope_quantize_fp8_append_paged_kv_cache(kind, n):
    q_rope, k_rope, q_nope, k_nope, v, table, pos = _rq_inputs(kind, n)
    hq, hkv, rope_dim, nope = _RQ_SHAPES[kind]
    page_size = 16
    pages = n // page_size + 3
    kv_indices = torch.randperm(pages, dtype=torch.int32)
    kv_indptr = torch.tensor([0, pages], dtype=torch.int32)
    batch_indices = torch.zeros(n, dtype=torch.int32)
    batch_indices[1::5] = -1                       # padding tokens write no entry
    positions = torch.arange(n, dtype=torch.int32)
    mla = kind == "mla"
    shapes = ((pages, page_size, nope), (pages, page_size, rope_dim)) if mla else \
        ((pages, page_size, hkv, rope_dim + nope),) * 2

    def rope_quantize_fp8_append_paged_kv_cache(c0, c1, q_rope_out, q_nope_out, **kw):
        return flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            paged_kv_cache=(c0.view(torch.float8_e4m3fn), c1.view(torch.float8_e4m3fn)),
            q_rope_out=q_rope_out.view(torch.float8_e4m3fn), q_nope_out=q_nope_out.view(torch.float8_e4m3fn), **kw)

    _run_both(rope_quantize_fp8_append_paged_kv_cache, dict(
        c0=_poisoned(shapes[0]), c1=_poisoned(shapes[1]), q_rope_out=_poisoned((n, hq, rope_dim)),
        q_nope_out=_poisoned((n, hq, nope)), q_rope=q_rope, k_rope=k_rope, q_nope=q_nope, k_nope=k_nope, v=v,
        cos_sin_cache=table, pos_ids=pos, kv_indices=kv_indices, kv_indptr=kv_indptr, batch_indices=batch_indices,
        positions=positions, is_neox=kind != "mla", quant_scale_q=0.75, quant_scale_kv=1.5, page_size=page_size))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", list(_RQ_SHAPES))
def test_flashinfer_rope_quantize_fp8(kind, n):
    q_rope, k_rope, q_nope, k_nope, _, table, pos = _rq_inputs(kind, n, seed=9)
    hq, hkv, rope_dim, nope = _RQ_SHAPES[kind]

    k_rope_shape, k_nope_shape = tuple(k_rope.shape), tuple(k_rope.shape[:-1]) + (nope,)

    def call(q_rope_out, k_rope_out, q_nope_out, k_nope_out, **kw):
        f8 = torch.float8_e4m3fn
        return flashinfer.rope_quantize_fp8(q_rope_out=q_rope_out.view(f8), k_rope_out=k_rope_out.view(f8),
                                            q_nope_out=q_nope_out.view(f8), k_nope_out=k_nope_out.view(f8), **kw)

    call.__name__ = "rope_quantize_fp8"
    _run_both(call, dict(q_rope_out=_poisoned((n, hq, rope_dim)), k_rope_out=_poisoned(k_rope_shape),
                         q_nope_out=_poisoned((n, hq, nope)), k_nope_out=_poisoned(k_nope_shape), q_rope=q_rope,
                         k_rope=k_rope, q_nope=q_nope, k_nope=k_nope, cos_sin_cache=table, pos_ids=pos,
                         is_neox=kind == "mla", quant_scale_q=3.0, quant_scale_kv=0.25))
