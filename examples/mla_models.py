# A named model configuration drives kvfuse.mla's call sites: DeepSeek V3.2's main cache write, its
# indexer K write and its indexer Q quantization, each one launch; each checked against the reference.
# GPU: python examples/mla_models.py     CPU: TRITON_INTERPRET=1 python examples/mla_models.py
import torch, kvfuse
from kvfuse import mla, models

kvfuse.use_backend("triton")     # the Triton kernel; on the CPU it needs TRITON_INTERPRET=1 (else a ValueError)
device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = models.get("deepseek-v3.2")
n = 4
bf16 = dict(device=device, dtype=torch.bfloat16)
kv = torch.randn(n, 576, **bf16)                             # latent 512 | k_pe 64
k, index_q = torch.randn(n, 128, **bf16), torch.randn(n, 64, 128, **bf16)
kv_norm_weight, k_norm_weight, k_norm_bias = torch.ones(512, **bf16), torch.ones(128, **bf16), torch.zeros(128, **bf16)
positions = torch.arange(n, device=device)
cos_sin = mla.make_cos_sin_cache(4096, 64, device=device)    # fp32 [4096, 64]: cos | sin
slots = torch.arange(n, device=device)

def write():
    cache = cfg.main_format.allocate(num_blocks=2, block_size=64, device=device)          # FLASHMLA_V32
    index_cache = cfg.index_format.allocate(num_blocks=2, block_size=64, device=device)   # INDEX_FP8_FP32
    mla.write_main_cache(cfg, kv, positions, cos_sin, kv_norm_weight, cache, slots)        # kv [n, 576]
    mla.write_indexer_k(cfg, k, positions, cos_sin, k_norm_weight, index_cache, slots, norm_bias=k_norm_bias)
    q_fp8, q_scale = mla.quantize_indexer_q(cfg, index_q, positions, cos_sin)            # [n, 64, 128]
    return cache, index_cache, q_fp8, q_scale

got = write()
with kvfuse.use_backend("reference"):     # the unfused PyTorch chain, inside the block only
    want = write()
for a, b in zip(got, want):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))   # byte for byte
print(f"{cfg.name}: main cache, indexer K and indexer Q bytes equal the reference's")
