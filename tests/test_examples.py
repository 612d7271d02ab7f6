"""examples/: each script the README quotes runs on the CPU (the Triton kernel in Triton's interpreter,
checked byte for byte against the reference inside the script), and every ```python block of README.md
is the whole text of one of them, so the README cannot drift from what runs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README_EXAMPLES = ("quickstart.py", "gqa_qwen3.py", "mla_models.py")


def readme_blocks():
    """(language, text) of every fenced code block of README.md."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)


def run_example(name, interpret):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVFUSE_BACKEND")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("name", README_EXAMPLES)
def test_example_runs_under_the_interpreter(name):
    done = run_example(name, interpret=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "equal the reference's" in done.stdout, done.stdout


def test_example_refuses_the_cpu_without_the_interpreter():
    # what the README says: "triton" on CPU tensors without TRITON_INTERPRET=1 is a ValueError, so the
    # scripts never pass by comparing the reference with itself
    done = run_example("quickstart.py", interpret=False)
    assert done.returncode != 0
    assert "ValueError: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1" in done.stderr, done.stderr[-2000:]


def test_every_readme_python_block_is_an_example():
    texts = {name: (EXAMPLES / name).read_text() for name in README_EXAMPLES}
    quoted = []
    for language, block in readme_blocks():
        if language != "python":
            continue
        match = [name for name, text in texts.items() if text.rstrip("\n") == block.rstrip("\n")]
        assert match, f"README.md python block starting {block[:80]!r} is not the text of an example"
        quoted += match
    assert sorted(quoted) == sorted(README_EXAMPLES)


def test_readme_shell_blocks_are_single_commands():
    # the other blocks are the install and set-up lines, one command each (.ci/run greps '# tests')
    shell = [block for language, block in readme_blocks() if language != "python"]
    assert shell and all(block.count("\n") == 1 for block in shell), shell
    assert sum(block.rstrip().endswith("# tests") for block in shell) == 1
    assert sum(block.rstrip().endswith("# main job") for block in shell) == 1
