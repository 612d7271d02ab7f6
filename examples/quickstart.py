# Quick start: 8 tokens' MLA latents -> RMSNorm -> RoPE -> FP8 -> a paged MAIN_FP8 cache in one launch,
# read back, and compared byte for byte with the unfused PyTorch chain (the "reference" backend).
# GPU: python examples/quickstart.py     CPU: TRITON_INTERPRET=1 python examples/quickstart.py
import torch, kvfuse
from kvfuse import (fused_norm_rope_hadamard_cast_store_kvcache, NormArgs, RopeArgs, CastArgs,
                    KVCacheOutArgs, formats)
from kvfuse.mla import make_cos_sin_cache

kvfuse.use_backend("triton")     # the Triton kernel; on the CPU it needs TRITON_INTERPRET=1 (else a ValueError)
device = "cuda" if torch.cuda.is_available() else "cpu"
fmt = formats.MAIN_FP8                                        # 512 e4m3 + 16 UE8M0 scales + 4 reserved
n = 8                                                         # tokens of this step
x = torch.randn(n, 512, device=device, dtype=torch.bfloat16)  # their latents
weight = torch.ones(512, device=device, dtype=torch.bfloat16)  # RMSNorm weight
positions = torch.arange(n, device=device)                    # token positions
cos_sin_cache = make_cos_sin_cache(4096, 64, device=device)   # fp32 [4096, 64]: cos | sin
slot_mapping = torch.randperm(16 * 64, device=device)[:n]     # block * block_size + offset, per token

def write(cache):
    fused_norm_rope_hadamard_cast_store_kvcache(
        x,
        norm_args=NormArgs(weight, eps=1e-6),
        rope_args=RopeArgs(positions, cos_sin_cache, rotary_dim=64, is_neox=True),   # the tail 64 dims
        cast_args=CastArgs.from_cache_format(fmt),
        out_args=KVCacheOutArgs(cache, slot_mapping, layout=fmt),  # slot < 0 or >= capacity: skipped
    )
    return cache

cache = write(fmt.allocate(num_blocks=16, block_size=64, device=device))  # uint8 [16, 64, 1, 532]
k = kvfuse.load_paged_kv_cache(cache, slot_mapping, fmt)                 # bf16 [n, 1, 512], dequantized

with kvfuse.use_backend("reference"):     # the unfused PyTorch chain, inside the block only
    ref = write(fmt.allocate(num_blocks=16, block_size=64, device=device))
assert torch.equal(cache, ref)            # byte for byte
print(f"{n} records of {fmt.bytes_per_token} bytes: the Triton kernel's bytes equal the reference's")
