# GQA / MHA: Qwen3 8B's QK-norm + RoPE on q and k, q written in place, K and V scattered into vLLM's NHD
# paged caches in float8_e4m3fn with one fp32 scale each, one launch; checked against the reference.
# GPU: python examples/gqa_qwen3.py     CPU: TRITON_INTERPRET=1 python examples/gqa_qwen3.py
import torch, kvfuse
from kvfuse import models

kvfuse.use_backend("triton")     # the Triton kernel; on the CPU it needs TRITON_INTERPRET=1 (else a ValueError)
device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = models.get_gqa("qwen3-8b")                             # 32 Q heads, 8 KV heads of 128, QK-norm
n, num_blocks, block_size = 4, 8, 16
qkv = torch.randn(n, (32 + 16) * 128, device=device, dtype=torch.bfloat16)   # the packed QKV projection
q_norm_weight = torch.rand(128, device=device, dtype=torch.bfloat16) + 0.5
k_norm_weight = torch.rand(128, device=device, dtype=torch.bfloat16) + 0.5
positions = torch.arange(100, 100 + n, device=device)
cos_sin_cache = cfg.cos_sin_cache(4096, device=device)       # [max_pos, 128] fp32: cos | sin
slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:n]
k_scale = torch.tensor([0.05], device=device)                # fp32 scales of one element (stored = k / scale)
v_scale = torch.tensor([0.02], device=device)

def write():
    q, k, v = cfg.split_qkv(qkv.clone())                     # views of the projection
    k_cache = torch.zeros(num_blocks, block_size, 8, 128, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    q = kvfuse.fused_qk_norm_rope_store_kv(
        q, k, v, k_cache, v_cache, slot_mapping,
        q_norm_args=cfg.norm_args(q_norm_weight), k_norm_args=cfg.norm_args(k_norm_weight),
        rope_args=cfg.rope_args(positions, cos_sin_cache),
        k_scale=k_scale, v_scale=v_scale, layout="NHD", q_out=q)   # q_out=q: in place
    return q, k_cache, v_cache

q, k_cache, v_cache = write()
with kvfuse.use_backend("reference"):     # the unfused PyTorch chain, inside the block only
    q_ref, k_ref, v_ref = write()
for got, want in ((q, q_ref), (k_cache, k_ref), (v_cache, v_ref)):
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))   # byte for byte
print(f"q {tuple(q.shape)} and {n} tokens' K / V records: the Triton kernel's bytes equal the reference's")
