"""The ``kvfuse`` command fails kindly: --version / --help, the demo without its optional extra
(tqdm, matplotlib, safetensors missing: simulated through sys.modules), and one-line errors with
exit status 2 for a device or an --input file it cannot use; the console script's module
(kvfuse_cli) answers --version / --help without importing torch, Triton or the package."""
import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import kvfuse
import kvfuse_cli
from kvfuse import cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--n", "16", "--block-size", "16", "--topk", "4", "--queries", "4"]


def _one_line_error(capsys, prefix="kvfuse demo: "):
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    return lines[0]


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvfuse {kvfuse.__version__}\n"
    with open(ROOT / "pyproject.toml", "rb") as fh:
        assert tomllib.load(fh)["project"]["version"] == kvfuse.__version__


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []])
def test_help_lists_the_commands(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "usage: kvfuse" in out and "--version" in out
    for name in ("demo", "bench"):
        assert f"\n  {name} " in out                      # one described line per command
    assert "format explorer" in out and "CUDA" in out


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:x",
                                    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                                  reason="CUDA present"))])
def test_demo_bad_device(device, capsys, tmp_path):
    assert cli.main(["demo", "--device", device, "--out", str(tmp_path)]) == 2
    assert device in _one_line_error(capsys)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,content", [("junk.pt", b"not a torch file\n"), ("empty.pt", b""),
                                          ("junk.safetensors", b"garbage"), ("k.npy", b"\x93NUMPY\x01\x00")])
def test_demo_input_not_a_tensor_file(name, content, capsys, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    assert cli.main(["demo", "--input", str(path), "--out", str(tmp_path / "o"), *TINY]) == 2
    assert "not a readable .pt or .safetensors file" in _one_line_error(capsys)


def test_demo_input_is_a_directory(capsys, tmp_path):
    assert cli.main(["demo", "--input", str(tmp_path), "--out", str(tmp_path / "o"), *TINY]) == 2
    _one_line_error(capsys)


def test_demo_without_the_demo_extra(monkeypatch, capsys, tmp_path):
    """No tqdm, no matplotlib: the table and the CSV all the same, no progress bar, no PNG, one note."""
    for name in ("tqdm", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)     # import fails as if it were not installed
    out = tmp_path / "o"
    assert cli.main(["demo", "--out", str(out), *TINY]) == 0
    cap = capsys.readouterr()
    note = cap.err.strip().splitlines()
    assert len(note) == 1 and "tqdm and matplotlib not installed" in note[0], cap.err
    assert "pip install 'kvfuse[demo]'" in note[0] and "no PNG chart" in note[0]
    assert "MAIN_FP8" in cap.out and "no chart: matplotlib is not installed" in cap.out
    assert sorted(p.name for p in out.iterdir()) == ["results.csv"]


def test_demo_safetensors_input_without_safetensors(monkeypatch, capsys, tmp_path):
    path = tmp_path / "k.safetensors"
    path.write_bytes(b"{}")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert cli.main(["demo", "--input", str(path), "--out", str(tmp_path / "o"), *TINY]) == 2
    assert "pip install 'kvfuse[demo]'" in _one_line_error(capsys)


def test_console_entry_point_bad_device():
    """Through a real process: one stderr line, status 2, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "kvfuse.cli", "demo", "--device", "tpu"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["kvfuse demo: --device 'tpu': expected cpu, cuda or cuda:N"]


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []])
def test_version_and_help_import_no_torch(argv):
    """The console script's entry function in a fresh interpreter: its answer, and none of torch, Triton,
    numpy or kvfuse among the modules it loaded."""
    heavy = ("torch", "triton", "numpy", "kvfuse")
    code = ("import sys, kvfuse_cli\n"
            f"rc = kvfuse_cli.main({argv!r})\n"
            f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})\n"
            "print('rc', rc, 'loaded', loaded)")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[-1] == "rc 0 loaded []", r.stdout
    assert (f"kvfuse {kvfuse.__version__}" if argv == ["--version"] else "usage: kvfuse") in r.stdout


def test_console_script_is_the_torch_free_module():
    """pyproject's console script runs kvfuse_cli.main, the wheel ships kvfuse_cli.py, and its version is
    the package's; kvfuse.cli is the same command."""
    with open(ROOT / "pyproject.toml", "rb") as fh:
        meta = tomllib.load(fh)
    assert meta["project"]["scripts"]["kvfuse"] == "kvfuse_cli:main"
    assert "kvfuse_cli" in meta["tool"]["setuptools"]["py-modules"]
    assert kvfuse_cli.__version__ == kvfuse.__version__ == meta["project"]["version"]
    assert cli.main is kvfuse_cli.main


@pytest.mark.parametrize("command", sorted(kvfuse_cli.COMMANDS))
def test_command_help_lists_its_flags(command, monkeypatch, capsys):
    """``kvfuse COMMAND --help`` through the entry function: usage and every option the command's own
    parser declares (recorded as it adds them), with status 0."""
    declared = []
    add_argument = argparse.ArgumentParser.add_argument

    def recording(self, *args, **kwargs):
        if self.prog == f"kvfuse {command}":
            declared.extend(a for a in args if a.startswith("--"))
        return add_argument(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", recording)
    assert kvfuse_cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvfuse {command}")
    assert len(set(declared) - {"--help"}) >= 5, declared      # argparse's own --help is recorded too
    missing = [flag for flag in declared if flag not in out]
    assert not missing, missing
