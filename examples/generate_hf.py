"""model.generate with kvfuse's paged K/V write, on a tiny random Qwen3 built from a config (no download).

Greedy generation on a batch of four prompts (two left-padded) with: transformers as shipped (its
DynamicCache), transformers' fp8 cache (QuantizedCache, backend "fp8"), kvfuse's numerics with
transformers' DynamicCache, and kvfuse's PagedCache in bf16 and in fp8 (scales: amax / 448 of the bf16
prompt's K and V). Prints for each, against the stock run: the share of greedy tokens that agree (free
running: after a first difference the contexts differ), the share of steps whose top token agrees and the
largest logit difference when every run is fed the stock run's tokens (teacher forcing: the same context
at every step), and the CPU time per generated token (one thread). CPU, well under a minute:

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


def forced_logits(model, ids, mask, tokens, cache):
    """[steps, batch, vocab] last-position logits when the prompt is followed by ``tokens`` (teacher forcing)."""
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = []
    with torch.no_grad():
        steps.append(model(ids, attention_mask=mask, position_ids=position, cache=cache).logits[:, -1])
        for i in range(tokens.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = position[:, -1:] + 1
            steps.append(model(tokens[:, i:i + 1], attention_mask=mask, position_ids=position,
                               cache=cache).logits[:, -1])
    return torch.stack(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path; the fastest one is timed")
    args = parser.parse_args()
    torch.set_num_threads(1)        # one thread, timed in CPU seconds: steadier than wall time on a shared CPU
    model = build_model(args.attn)
    torch.manual_seed(1)
    ids = torch.randint(3, 1024, (4, 12))
    mask = torch.ones_like(ids)
    pads = [0, 4, 0, 7]                                     # left padding of each prompt
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
               do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    new = args.new_tokens
    block_size = 8
    blocks = len(pads) * -(-(ids.shape[1] + new) // block_size) + 2    # room for every sequence, and spare
    print(f"tiny Qwen3 ({args.attn}): 2 layers, hidden 256, 4 / 2 heads of 64, bf16; 4 prompts of 12 (two "
          f"left-padded), {new} new tokens; paged caches of {blocks} blocks of {block_size}, shuffled")
    print(f"{'path':<34} {'greedy agree':>12} {'forced top-1':>12} {'max |dlogit|':>12} {'CPU ms/token':>13}")
    stock_tokens = stock_logits = None

    def report(name, make_cache=None):
        """Generate (timed in CPU time: the fastest of --repeats runs), then the teacher-forced logits; one line."""
        nonlocal stock_tokens, stock_logits
        seconds = []
        for _ in range(args.repeats):
            cache = None if make_cache is None else make_cache()
            start = time.process_time()
            out = model.generate(ids, **gen, **({} if cache is None else {"cache": cache}))
            seconds.append(time.process_time() - start)
        tokens = out.sequences[:, -new:]
        if stock_tokens is None:
            stock_tokens = tokens
        cache = DynamicCache(config=model.config) if make_cache is None else make_cache()
        logits = forced_logits(model, ids, mask, stock_tokens, cache)
        if stock_logits is None:
            stock_logits = logits
        greedy = (tokens == stock_tokens).float().mean().item()
        top1 = (logits.argmax(-1) == stock_tokens.T).float().mean().item()
        worst = (logits.float() - stock_logits.float()).abs().max().item()
        print(f"{name:<34} {100 * greedy:11.1f}% {100 * top1:11.1f}% {worst:12.4f} {1000 * min(seconds) / new:13.1f}")
        return logits, cache

    report("transformers DynamicCache (stock)")
    report("transformers QuantizedCache fp8", lambda: QuantizedCache(backend="fp8", config=model.config))
    with install(model):
        numerics, _ = report("kvfuse numerics, DynamicCache", lambda: DynamicCache(config=model.config))
        paged, bf16_cache = report("kvfuse paged bf16",
                                   lambda: PagedCache(model, blocks, block_size, block_shuffle_seed=0))
        same = torch.equal(paged, numerics)
        print(f"  paged bf16 logits bit-identical to DynamicCache with kvfuse numerics: {'yes' if same else 'NO'}")
        prompt = ids.shape[1]
        scales = [max(bf16_cache.key_value(layer, row)[i][:, :prompt - pad].float().abs().max().item()
                      for layer in range(2) for row, pad in enumerate(pads)) / 448 for i in (0, 1)]
        report("kvfuse paged fp8", lambda: PagedCache(model, blocks, block_size, torch.float8_e4m3fn, scales[0],
                                                      scales[1], block_shuffle_seed=0))
        print(f"  fp8 scales (amax / 448 of the bf16 prompt's K and V): k {scales[0]:.5f}, v {scales[1]:.5f}")


if __name__ == "__main__":
    main()
