"""CI check that every kernel variant compiles for sm_90 (on the CPU) to IEEE-exact PTX:
no fma contraction, no .approx, no div.full (SPEC traps); griddepcontrol.wait before the first load
exactly in the variants launched with programmatic dependent launch."""
import os
import subprocess
import sys
from pathlib import Path


def test_ptx_has_no_contracted_or_approximate_ops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("ptx_check.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "ptx" in ln]
    assert len(lines) == 50 and all(ln.endswith("ok") for ln in lines), proc.stdout


def test_scanner_flags_a_contracted_kernel():
    """Negative control: the same scan finds fma when fp fusion is left on."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("ptx_check.py")
    proc = subprocess.run([sys.executable, str(script), "--negative-control"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and "FOUND" in proc.stdout, proc.stdout + proc.stderr
