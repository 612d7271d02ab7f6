"""kvfuse.numerics_accuracy: the ulp measure (correctly rounded values at most 0.5 ulp, a neighbour more)
and the fp64 chain (the reference chain's fp32 result on fp32 inputs lies within a few fp32 ulps of it)."""
import torch

from kvfuse import models as M
from kvfuse import reference as R
from kvfuse.numerics_accuracy import accuracy_inputs, exact_chain, ulp_error


def test_ulp_error_of_correct_rounding_and_of_a_neighbour():
    # fp32 values: torch's fp64 -> fp16 conversion goes through fp32 (a double rounding)
    exact = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100).double()
    for fmt in (torch.bfloat16, torch.float16):
        rounded = exact.to(fmt)
        assert ulp_error(rounded, exact, fmt).max() <= 0.5
        bits = rounded.view(torch.int16)
        neighbour = (bits + 1).view(fmt)           # one step away from zero: the other side or further
        far = ulp_error(neighbour, exact, fmt)
        assert (far >= 0.5).all() and (far > 0.5).float().mean() > 0.99   # 0.5 only at an exact tie
    codes = (exact / 100 * 30).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    assert ulp_error(codes, exact / 100 * 30, torch.float8_e4m3fn).max() <= 0.5


def test_exact_chain_matches_the_reference_chain_in_fp32():
    cfg = M.get_gqa("qwen3-8b")
    x, (wq, _), pos, cs = accuracy_inputs(cfg, 16, 3)
    q, _, _ = cfg.split_qkv(x)
    exact = exact_chain(q, wq, cfg.norm_eps, pos, cs, cfg)
    got = R.qk_norm_rope(q.float(), wq.float(), cfg.norm_eps, pos, cs, cfg.rotary_dim, 0, cfg.rope_is_neox)
    scale = exact.abs().amax(-1, keepdim=True)          # RoPE's cancellations: compare to the head's size
    assert ((got.double() - exact).abs() / scale).max() < 1e-6
