"""model.generate with kvfuse's paged K/V write, on a tiny random Qwen3 built from a config (no download).

Runs greedy generation on a left-padded batch of two prompts with: transformers as shipped (its
DynamicCache), kvfuse's numerics with transformers' DynamicCache, and kvfuse's PagedCache in bf16 and
fp8 (scales calibrated as amax / 448 of the bf16 prefill), plus transformers' own fp8 cache
(QuantizedCache, backend "fp8") for comparison. Prints, against the stock run: the share of generated
tokens that agree, the largest logit difference over the steps before the first differing token, and
the time per generated token. CPU, well under a minute:

    python examples/generate_hf.py [--new-tokens 16] [--attn sdpa|eager] [--repeats 2]
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, QuantizedCache, Qwen3Config, Qwen3ForCausalLM

from kvfuse.integrations.transformers import PagedCache, install


def build_model(attn: str) -> Qwen3ForCausalLM:
    """2 layers, hidden 256, 4 q / 2 kv heads of 64, bf16, random weights (QK-norm weights drawn around 1)."""
    config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.05, attn_implementation=attn)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p.float()))
    return model


def compare(name: str, stock, out, seconds: float, new_tokens: int) -> None:
    """One line: token agreement with the stock run, max |logit diff| while the tokens agree, time."""
    gen_stock, gen = stock.sequences[:, -new_tokens:], out.sequences[:, -new_tokens:]
    agree = (gen_stock == gen).float().mean().item()
    steps, worst, identical = 0, 0.0, True
    for step in range(new_tokens):
        worst = max(worst, (stock.logits[step].float() - out.logits[step].float()).abs().max().item())
        identical &= torch.equal(stock.logits[step], out.logits[step])
        steps += 1
        if not torch.equal(gen_stock[:, step], gen[:, step]):
            break
    per_token = 1000 * seconds / new_tokens
    print(f"{name:<34} tokens agree {100 * agree:5.1f}%  max |logit diff| {worst:.4f} over {steps} steps"
          f"{' (identical)' if identical else ''}  {per_token:7.1f} ms/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path; the fastest one is timed")
    args = parser.parse_args()
    model = build_model(args.attn)
    torch.manual_seed(1)
    ids = torch.randint(3, 1024, (2, 12))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0                      # the second prompt is left-padded by 4
    gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
               do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)

    def run(make_cache=None):
        """The generation, its time (the fastest of --repeats runs: the CPU warms up) and its cache."""
        best = None
        for _ in range(args.repeats):
            cache = None if make_cache is None else make_cache()
            start = time.perf_counter()
            out = model.generate(ids, **gen, **({} if cache is None else {"cache": cache}))
            seconds = time.perf_counter() - start
            best = (out, seconds, cache) if best is None or seconds < best[1] else best
        return best

    blocks, block_size = 16, 8
    print(f"tiny Qwen3 ({args.attn}): 2 layers, hidden 256, 4 / 2 heads of 64, bf16; batch 2 (one left-padded), "
          f"{args.new_tokens} new tokens; paged caches of {blocks} blocks of {block_size}, shuffled")
    stock, t_stock, _ = run()
    compare("transformers DynamicCache (stock)", stock, stock, t_stock, args.new_tokens)
    fp8_hf, t, _ = run(lambda: QuantizedCache(backend="fp8", config=model.config))
    compare("transformers QuantizedCache fp8", stock, fp8_hf, t, args.new_tokens)
    with install(model):
        numerics, t, _ = run(lambda: DynamicCache(config=model.config))
        compare("kvfuse numerics, DynamicCache", stock, numerics, t, args.new_tokens)
        bf16, t, bf16_cache = run(lambda: PagedCache(model, blocks, block_size, block_shuffle_seed=0))
        compare("kvfuse paged bf16", stock, bf16, t, args.new_tokens)
        same = torch.equal(bf16.sequences, numerics.sequences) and all(
            torch.equal(a, b) for a, b in zip(bf16.logits, numerics.logits))
        print(f"  paged bf16 logits bit-identical to DynamicCache with kvfuse numerics: {'yes' if same else 'NO'}")
        prompt_len = ids.shape[1]
        scales = [max(bf16_cache.key_value(layer, b)[i][:, :prompt_len - 4 * b].float().abs().max().item()
                      for layer in range(2) for b in range(2)) / 448 for i in (0, 1)]
        fp8, t, _ = run(lambda: PagedCache(model, blocks, block_size, torch.float8_e4m3fn, scales[0], scales[1],
                                           block_shuffle_seed=0))
        compare("kvfuse paged fp8", stock, fp8, t, args.new_tokens)
        print(f"  fp8 scales (amax / 448 of the bf16 prompt): k {scales[0]:.5f}, v {scales[1]:.5f}")


if __name__ == "__main__":
    main()
