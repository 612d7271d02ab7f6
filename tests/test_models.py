"""kvfuse.models: the named configurations carry the SPEC §5 facts of each model, cite their
sources, are frozen, and are reachable by name. (tests/test_mla.py runs every configuration's
calls against the reference chain; tests/test_demo.py runs ``kvfuse demo --model``.)
"""
import dataclasses
import math
import subprocess
import sys

import pytest
import torch

import kvfuse
from kvfuse import formats as F
from kvfuse import mla
from kvfuse import models as M

V3_FAMILY = [M.DEEPSEEK_V3, M.DEEPSEEK_V32, M.DEEPSEEK_V32_UE8M0, M.DEEPSEEK_V32_SGLANG]
V4_FAMILY = [M.DEEPSEEK_V4, M.DEEPSEEK_V4_FP4, M.DEEPSEEK_V4_FLASHMLA, M.DEEPSEEK_V41]


def _name(cfg):
    return cfg.name


# --------------------------------------------------------------------------- DeepSeek V3 / V3.1
@pytest.mark.parametrize("cfg", V3_FAMILY, ids=_name)
def test_v3_mla(cfg):
    """Latent 512 with RMSNorm (eps 1e-6), RoPE 64 GPT-J style on the tail of the 576-d record and at
    offset qk_nope_head_dim = 128 of the 192-d Q heads (128 heads), FLASHMLA_V32 main cache."""
    assert isinstance(cfg, mla.MLAConfig)
    assert cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64
    assert cfg.qk_head_dim == 192 and cfg.qk_nope_head_dim == 128 and cfg.rope_offset == 128
    assert cfg.num_heads == 128
    assert cfg.rope_is_neox is False
    assert cfg.norm_eps == 1e-6 and cfg.q_norm is False
    assert cfg.main_format is F.FLASHMLA_V32 and cfg.draft_format is F.FLASHMLA_V32
    assert cfg.splits_k_pe() and cfg.main_format.head_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    rope = cfg.main_rope_args(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 64))
    assert (rope.offset, rope.rotary_dim, rope.is_neox) == (512, 64, False)
    q_rope = cfg.rope_args(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 64))
    assert (q_rope.offset, q_rope.rotary_dim, q_rope.is_neox) == (128, 64, False)
    assert cfg.compressed_format is None


def test_v3_has_no_indexer_and_v31_is_v3():
    assert M.DEEPSEEK_V3.index_format is None
    assert M.get("deepseek-v3.1") is M.DEEPSEEK_V3


# --------------------------------------------------------------------------- DeepSeek V3.2
@pytest.mark.parametrize("cfg", [M.DEEPSEEK_V32, M.DEEPSEEK_V32_UE8M0], ids=_name)
def test_v32_indexer(cfg):
    """V3 plus the lightning indexer: K LayerNorm (weight and bias), RoPE on the FIRST 64 dims (offset
    0, NEOX), Hadamard 128**-0.5, e4m3 with one fp32 scale per 128; Q 64 heads x 128, the same."""
    assert cfg.index_head_dim == 128 and cfg.index_num_heads == 64 and cfg.index_rope_head_dim == 64
    assert cfg.index_rope_offset == 0 and cfg.index_rope_is_neox is True
    assert cfg.index_norm_kind == "layer"
    assert cfg.index_hadamard and cfg.index_hadamard_args == kvfuse.HadamardArgs(1.0 / math.sqrt(128))
    # DeepSeek's hidden_size ** -0.5: the same fp32 scale (the kernel multiplies by float32(scale))
    assert torch.tensor(cfg.index_hadamard_args.scale, dtype=torch.float32) == torch.tensor(128 ** -0.5,
                                                                                          dtype=torch.float32)
    fmt = cfg.index_format
    assert (fmt.head_dim, fmt.cast_fmt, fmt.elements_per_sf, fmt.token_interleaved) == (128, "e4m3", 128, False)
    assert fmt.sf_dtype == torch.float32 and fmt.bytes_per_token == 132
    rope = cfg.index_rope_args(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 64))
    assert (rope.offset, rope.rotary_dim, rope.is_neox) == (0, 64, True)
    # the indexer K's norm object: a LayerNorm with the bias given at the call
    w, b = torch.ones(128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.bfloat16)
    n = cfg.index_norm_args(w, b)
    assert n.kind == "layer" and n.bias is b and n.weight is w and n.eps == 1e-6
    assert cfg.index_norm_args(None) is None


def test_v32_index_formats():
    """deepseek-v3.2: INDEX_FP8_FP32 (scale amax / 448); the ue8m0 variant: the same 132-byte
    record with the scale rounded up to a power of two (kvfuse's ue8m0_fp32)."""
    assert M.DEEPSEEK_V32.index_format is F.INDEX_FP8_FP32
    assert F.INDEX_FP8_FP32.sf_format == "fp32"
    u = M.DEEPSEEK_V32_UE8M0.index_format
    assert u is M.INDEX_FP8_UE8M0_FP32 and u.sf_format == "ue8m0_fp32"
    assert kvfuse.CastArgs.from_cache_format(u) == kvfuse.CastArgs("e4m3", 128, True, "ue8m0_fp32")
    assert u.bytes_per_token == F.INDEX_FP8_FP32.bytes_per_token == 132
    assert dataclasses.replace(M.DEEPSEEK_V32_UE8M0, index_format=F.INDEX_FP8_FP32, name="deepseek-v3.2",
                               source=M.DEEPSEEK_V32.source) == M.DEEPSEEK_V32
    # V3.2 keeps V3's attention path
    for f in ("kv_lora_rank", "qk_rope_head_dim", "qk_head_dim", "num_heads", "rope_is_neox", "main_format"):
        assert getattr(M.DEEPSEEK_V32, f) == getattr(M.DEEPSEEK_V3, f), f


def test_v32_as_sglang_runs_its_indexer():
    """deepseek-v3.2-sglang: V3.2 with the indexer SGLang 0.5.23's fused CUDA path runs (indexer_k.cuh):
    K LayerNorm (weight and bias), RoPE on the first 64 dims with GPT-J pairs, no Hadamard, e4m3 with
    one fp32 scale per 128 (INDEX_FP8_FP32); Q the same RoPE, no Hadamard. Nothing else differs."""
    c = M.DEEPSEEK_V32_SGLANG
    assert c.index_rope_offset == 0 and c.index_rope_is_neox is False and c.index_rope_head_dim == 64
    assert c.index_norm_kind == "layer" and c.index_hadamard is False and c.index_hadamard_args is None
    assert c.index_format is F.INDEX_FP8_FP32
    rope = c.index_rope_args(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 64))
    assert (rope.offset, rope.rotary_dim, rope.is_neox) == (0, 64, False)
    assert dataclasses.replace(c, name="deepseek-v3.2", source=M.DEEPSEEK_V32.source, index_rope_is_neox=True,
                               index_hadamard=True) == M.DEEPSEEK_V32
    assert M.get("DeepSeek-V3.2-SGLang") is c
    assert "deepseek_v32/indexer_k.cuh" in c.source and "FusedKIndexerNormRopeStoreKernel" in c.source
    assert "dsa_indexer.py" in c.source and "kHadamard=false" in c.source


# --------------------------------------------------------------------------- DeepSeek V4
@pytest.mark.parametrize("cfg", V4_FAMILY, ids=_name)
def test_v4(cfg):
    """GPT-J RoPE (is_neox=False) on the tail 64 of the 512-d latent (offset 448) and of the 512-d
    Q heads (64, weightless RMSNorm); RMSNorm; indexer K RMSNorm, tail RoPE 64 GPT-J, Hadamard."""
    assert cfg.kv_lora_rank == 512 and cfg.qk_head_dim == 512 and cfg.qk_rope_head_dim == 64
    assert cfg.rope_offset == 448 and cfg.num_heads == 64
    assert cfg.rope_is_neox is False and cfg.q_norm is True
    assert not cfg.splits_k_pe()
    rope = cfg.main_rope_args(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 64))
    assert (rope.offset, rope.is_neox) == (448, False)
    assert cfg.index_head_dim == 128 and cfg.index_rope_offset is None and cfg.index_rope_is_neox is False
    assert cfg.index_norm_kind == "rms" and cfg.index_hadamard
    assert cfg.index_format is not None and cfg.compressed_format is cfg.index_format
    assert cfg.norm_args(torch.ones(512)).kind == "rms"


def test_v4_formats():
    assert M.DEEPSEEK_V4.main_format is F.MAIN_FP8 and M.DEEPSEEK_V4.index_format is F.INDEX_MXFP8
    assert M.DEEPSEEK_V4_FP4.main_format is F.MAIN_FP4 and M.DEEPSEEK_V4_FP4.index_format is F.INDEX_MXFP4
    assert M.DEEPSEEK_V4_FLASHMLA.main_format is F.FLASHMLA_MODEL1
    assert M.DEEPSEEK_V4_FLASHMLA.index_format is F.INDEX_FP8_FP32
    assert M.DEEPSEEK_V41.main_format is F.MAIN_MXFP8 and M.DEEPSEEK_V41.draft_format is F.MAIN_MXFP8
    assert M.DEEPSEEK_V41.index_format is F.INDEX_MXFP8
    assert {c.main_format.name for c in V4_FAMILY} == {"MAIN_FP8", "MAIN_FP4", "FLASHMLA_MODEL1", "MAIN_MXFP8"}


def test_v41_sources():
    """V4.1's record is cited from its readers: FlashMLA's V41 format and SGLang's V41 store."""
    s = M.DEEPSEEK_V41.source
    assert "kv_cache_format.h" in s and "KVCacheFormat<V41>" in s
    assert "kv_layout.cuh" in s and "V41_NEW" in s and "store_row_fp8" in s and "fused_k_norm_rope_flashmla_v41" in s
    # with_main_format / with_index_format: the same model, another cache
    c = M.DEEPSEEK_V4.with_main_format(F.FLASHMLA_MODEL1)
    assert c.main_format is F.FLASHMLA_MODEL1 and c.name == "deepseek-v4" and c.rope_is_neox is False
    assert M.DEEPSEEK_V4.main_format is F.MAIN_FP8                                   # unchanged (frozen)
    assert M.DEEPSEEK_V4.with_index_format(F.INDEX_NVFP4, name="x").index_format is F.INDEX_NVFP4
    with pytest.raises(ValueError, match="main_format"):
        M.DEEPSEEK_V3.with_main_format(F.MAIN_FP8)        # 512 is neither V3's Q head (192) nor 576


# --------------------------------------------------------------------------- registry, sources, frozen
def test_registry():
    assert set(M.MODELS) == {"deepseek-v3", "deepseek-v3.2", "deepseek-v3.2-ue8m0", "deepseek-v3.2-sglang",
                             "deepseek-v4", "deepseek-v4-fp4", "deepseek-v4-flashmla", "deepseek-v4.1"}
    for name, cfg in M.MODELS.items():
        assert cfg.name == name and M.get(name) is cfg
    assert M.get("DeepSeek-V3.2") is M.DEEPSEEK_V32
    assert M.names()[:len(M.MODELS)] == list(M.MODELS) and "deepseek-v3.1" in M.names()
    with pytest.raises(ValueError, match=r"name: unknown model configuration 'llama-3'.*deepseek-v3"):
        M.get("llama-3")
    with pytest.raises(TypeError, match="name"):
        M.get(3)


@pytest.mark.parametrize("cfg", list(M.MODELS.values()), ids=_name)
def test_sources_cited(cfg):
    """Every configuration names the public code it follows: a file and a function."""
    s = cfg.source
    assert s and (".py" in s or ".cuh" in s)
    if cfg in V3_FAMILY:
        assert "DeepSeek-V3 inference/model.py" in s and "apply_rotary_emb" in s
        assert "vllm/model_executor/models/deepseek_v2.py" in s and "is_neox_style=False" in s
    if cfg in (M.DEEPSEEK_V32, M.DEEPSEEK_V32_UE8M0):
        assert "DeepSeek-V3.2-Exp inference/model.py" in s and "Indexer" in s and "LayerNorm" in s
        assert "rotate_activation" in s and "act_quant" in s
    if cfg in V4_FAMILY:
        assert "deepseek_v4/main_norm_rope.cuh" in s and "FusedKNormRopeFlashMLAKernel" in s
        assert "DeepInfer" in s
    assert cfg.source not in repr(cfg)        # kept out of the repr


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        M.DEEPSEEK_V3.rope_is_neox = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        M.DEEPSEEK_V32.index_rope_offset = 64


def test_config_validation():
    with pytest.raises(ValueError, match="index_norm_kind"):
        mla.MLAConfig(index_norm_kind="batch")
    with pytest.raises(ValueError, match="index_format"):
        dataclasses.replace(M.DEEPSEEK_V32, index_head_dim=64)
    # a [latent | k_pe] record is accepted next to the article's defaults
    c = mla.MLAConfig(main_format=F.FLASHMLA_V32)
    assert c.splits_k_pe() and not c.splits_k_pe(F.MAIN_FP8)
    assert mla.MLAConfig(index_format=None, compressed_format=None).index_hadamard_args is not None


@pytest.mark.parametrize("shape", [(3, 5), (3, 6145), (3, 6143), (6144,), (1, 3, 6144)])
def test_gqa_split_qkv_wrong_shape(shape):
    """Qwen3 8B packs q 32 x 128 + k 8 x 128 + v 8 x 128 = 6144 columns: any other shape names them all."""
    cfg = M.QWEN3_8B
    expected = (r"qkv of qwen3-8b: expected \[n, 6144\] \(q 4096 \+ k 1024 \+ v 1024 columns\), "
                rf"got \[{', '.join(map(str, shape))}\]")
    with pytest.raises(ValueError, match=expected):
        cfg.split_qkv(torch.zeros(shape, dtype=torch.bfloat16))


def test_gqa_split_qkv_not_a_tensor():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        M.QWEN3_8B.split_qkv([[0.0] * 6144])


def test_bare_import():
    """``import kvfuse`` alone reaches kvfuse.mla and kvfuse.models (no import cycle)."""
    code = ("import kvfuse; assert kvfuse.models.get('deepseek-v4').main_format is kvfuse.formats.MAIN_FP8; "
            "assert isinstance(kvfuse.models.DEEPSEEK_V3, kvfuse.mla.MLAConfig)")
    subprocess.run([sys.executable, "-c", code], check=True)
