"""README's "Quick start" runs as written: its first ```python block is executed on the CPU (under
the tests, "auto" picks the reference chain there) and leaves what its comments say."""
import re
from pathlib import Path

import torch

import kvfuse

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_code() -> str:
    text = README.read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no ```python block under '## Quick start' in README.md"
    return match.group(1)


def test_quick_start_runs_as_written():
    ns = {"__name__": "readme_quick_start"}
    with kvfuse.use_backend(kvfuse.current_backend()):   # the block switches backends: restore this thread's
        exec(compile(quick_start_code(), "README.md (Quick start)", "exec"), ns)
    n, fmt, cache, k, slots = ns["n"], ns["fmt"], ns["cache"], ns["k"], ns["slot_mapping"]
    assert fmt is kvfuse.formats.MAIN_FP8
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (16, 64, 1, 532)
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (n, 1, 512)
    assert torch.isfinite(k.float()).all()
    assert torch.equal(cache, ns["ref"])
    # the read-back is the input through the chain: RMSNorm (unit weight) keeps the rows near unit RMS
    rms = k.float().pow(2).mean(-1).sqrt()
    assert ((rms > 0.8) & (rms < 1.2)).all(), rms
    # only the n slots were written
    assert int((cache.view(-1, 532).any(-1)).sum()) == n == slots.numel()
