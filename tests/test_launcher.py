"""kvfuse.kernels.launcher: a Launch's direct path into Triton's compiled launcher, with stand-in
kernels (no GPU here: the real launcher runs in tests/gpu, see docs/performance.md). What is checked:
the arguments the direct path passes (every parameter in order, constexprs included, Triton's hook
protocol), and every case that must fall back to Triton's own path."""
from __future__ import annotations

import types

import pytest

from kvfuse.kernels import launcher as L


class FakeTensor:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class FakeCompiled:
    """What Triton's kernel[grid](...) returns: run is the launcher (records its arguments)."""

    def __init__(self):
        self.function = "fn-handle"
        self.packed_metadata = ("meta",)
        self.runs = []
        self.metadata_calls = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls.append((grid, stream, args))
        return "launch-meta"


class FakeKernel:
    """Stands in for a JITFunction: kernel[grid](*args, **kw) records the call, returns a compiled."""

    arg_names = ["a_ptr", "n", "b_ptr", "BLOCK", "FLAG"]

    def __init__(self):
        self.compiled = FakeCompiled()
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def env(monkeypatch):
    state = types.SimpleNamespace(device=0, streams=[])
    monkeypatch.setattr(L, "_current_device", lambda: state.device)

    def stream(device):
        state.streams.append(device)
        return 1000 + device
    monkeypatch.setattr(L, "_current_stream", stream)
    knobs = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(L, "_runtime_knobs", lambda: knobs)
    state.knobs = knobs
    return state


def make_launch(kernel, allow_direct=True):
    T = L.tensor_arg
    args = (T("a"), 7, T("b"))
    options = dict(FLAG=True, BLOCK=64, num_warps=1, enable_fp_fusion=False)   # any order: by name
    ns = {"k": kernel}
    return L.Launch("k", (5,), args, options, {"a": 0, "b": 1}, 2, ns, stand_in="a", allow_direct=allow_direct), ns


def test_direct_path_passes_every_parameter_in_order(env):
    kernel = FakeKernel()
    launch, _ = make_launch(kernel)
    a, b = FakeTensor(4096), FakeTensor(8192)
    launch.run((a, b))
    assert len(kernel.calls) == 1 and kernel.compiled.runs == []       # the first launch is Triton's
    grid, args, kwargs = kernel.calls[0]
    assert grid == (5,) and args == (a, 7, b) and kwargs["BLOCK"] == 64
    a2, b2 = FakeTensor(16), FakeTensor(32)
    launch.run((a2, b2))
    assert len(kernel.calls) == 1, "the second launch must not go through Triton's binder"
    (run,) = kernel.compiled.runs
    # grid (x, y, z), stream, function, packed metadata, launch metadata, enter / exit hooks, then
    # the parameters in the kernel's order: positional ones, then constexprs (BLOCK, FLAG)
    assert run == (5, 1, 1, 1000, "fn-handle", ("meta",), None, None, None, a2, 7, b2, 64, True)
    assert env.streams == [0]


def test_launch_hooks_are_honoured(env):
    kernel = FakeKernel()
    launch, _ = make_launch(kernel)
    launch.run((FakeTensor(0), FakeTensor(0)))
    enter, leave = object(), object()
    env.knobs.launch_enter_hook, env.knobs.launch_exit_hook = enter, leave
    launch.run((FakeTensor(0), FakeTensor(16)))
    (run,) = kernel.compiled.runs
    assert run[6:9] == ("launch-meta", enter, leave)
    ((grid, stream, args),) = kernel.compiled.metadata_calls
    assert grid == (5, 1, 1) and stream == 1000 and args[-2:] == (64, True)


@pytest.mark.parametrize("ptr", [1, 2, 8, 4104])
def test_a_misaligned_pointer_takes_tritons_path(env, ptr):
    """Triton specializes pointers on 16-byte alignment: the kept kernel is only for aligned ones."""
    kernel = FakeKernel()
    launch, _ = make_launch(kernel)
    launch.run((FakeTensor(0), FakeTensor(0)))
    launch.run((FakeTensor(0), FakeTensor(ptr)))
    assert len(kernel.calls) == 2 and kernel.compiled.runs == []
    launch.run((FakeTensor(ptr), FakeTensor(0)))
    assert len(kernel.calls) == 3 and kernel.compiled.runs == []


def test_the_alignment_check_reads_the_tensors_the_launch_passes(env):
    """A field the call lacks gets the stand-in's tensor (two parameters, one pointer, read once); a tensor of
    the call that the launch does not pass does not keep it off the direct path."""
    kernel = FakeKernel()
    T = L.tensor_arg
    launch = L.Launch("k", (5,), (T("a"), 7, T("absent")), dict(FLAG=True, BLOCK=64), {"a": 0, "b": 1}, 2,
                      {"k": kernel}, stand_in="a", allow_direct=True)
    assert launch.aligned_at == (0,)
    launch.run((FakeTensor(0), FakeTensor(0)))
    a = FakeTensor(32)
    launch.run((a, FakeTensor(8)))                   # b, misaligned, is not passed
    assert len(kernel.calls) == 1 and kernel.compiled.runs[-1][9:] == (a, 7, a, 64, True)
    launch.run((FakeTensor(8), FakeTensor(0)))       # the stand-in misaligned: Triton's path
    assert len(kernel.calls) == 2


def test_first_launch_misaligned_keeps_no_kernel(env):
    kernel = FakeKernel()
    launch, _ = make_launch(kernel)
    launch.run((FakeTensor(8), FakeTensor(0)))       # compiled for a misaligned pointer
    assert launch.direct is None
    launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(kernel.calls) == 2 and launch.direct is not None
    launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(kernel.calls) == 2 and len(kernel.compiled.runs) == 1


def test_another_device_or_kernel_object_takes_tritons_path(env):
    kernel = FakeKernel()
    launch, ns = make_launch(kernel)
    launch.run((FakeTensor(0), FakeTensor(0)))
    env.device = 1
    launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(kernel.calls) == 2 and kernel.compiled.runs == []
    env.device = 0
    swapped = FakeKernel()
    ns["k"] = swapped                                  # tests and benchmarks swap kernel objects
    launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(swapped.calls) == 1 and kernel.compiled.runs == [] and swapped.compiled.runs == []


def test_without_allow_direct_every_launch_is_tritons(env):
    kernel = FakeKernel()
    launch, _ = make_launch(kernel, allow_direct=False)
    for _ in range(3):
        launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(kernel.calls) == 3 and kernel.compiled.runs == []


def test_a_parameter_not_given_by_name_disables_the_direct_path(env):
    kernel = FakeKernel()
    kernel.arg_names = ["a_ptr", "n", "b_ptr", "BLOCK", "FLAG", "EXTRA"]   # EXTRA: not in the options
    launch, _ = make_launch(kernel)
    launch.run((FakeTensor(0), FakeTensor(0)))
    launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(kernel.calls) == 2 and launch.direct is None


def test_an_object_without_the_launcher_convention_disables_it(env):
    kernel = FakeKernel()
    kernel.compiled = None                             # e.g. the interpreter's kernel[grid](...) returns None
    launch, _ = make_launch(kernel)
    launch.run((FakeTensor(0), FakeTensor(0)))
    launch.run((FakeTensor(0), FakeTensor(0)))
    assert len(kernel.calls) == 2 and launch.direct is None


def test_direct_launch_supported(monkeypatch):
    monkeypatch.delenv("KVFUSE_DIRECT_LAUNCH", raising=False)
    monkeypatch.setattr(L.triton, "__version__", "3.6.0")
    assert L.direct_launch_supported(interpret=False)
    assert not L.direct_launch_supported(interpret=True)
    monkeypatch.setenv("KVFUSE_DIRECT_LAUNCH", "0")
    assert not L.direct_launch_supported(interpret=False)
    monkeypatch.delenv("KVFUSE_DIRECT_LAUNCH")
    monkeypatch.setattr(L.triton, "__version__", "4.0.0")   # an unchecked launcher convention
    assert not L.direct_launch_supported(interpret=False)


def test_the_interpreter_never_launches_directly():
    from kvfuse.kernels import config
    if config.INTERPRET:
        assert config.DIRECT_LAUNCH is False


def test_guard_is_checked_only_off_the_direct_path(env):
    """A fast path's 4-byte-word guard: a call it rejects launches nothing and says so (the caller
    runs the plain kernel); the direct path (every pointer 16-byte aligned) implies it."""
    kernel = FakeKernel()
    launch, _ = make_launch(kernel)
    calls = []

    def word_aligned(a, b):
        calls.append((a.ptr, b.ptr))
        return not ((a.ptr | b.ptr) & 3)
    launch.guard = (word_aligned, (0, 1))
    assert launch.run((FakeTensor(0), FakeTensor(0))) is True       # through Triton: guard checked
    assert len(calls) == 1 and len(kernel.calls) == 1
    assert launch.run((FakeTensor(16), FakeTensor(32))) is True     # direct: guard not needed
    assert len(calls) == 1 and len(kernel.compiled.runs) == 1
    assert launch.run((FakeTensor(2), FakeTensor(0))) is False      # rejected: nothing launched
    assert len(kernel.calls) == 1 and len(kernel.compiled.runs) == 1
    assert launch.run((FakeTensor(4), FakeTensor(0))) is True       # 4-aligned, not 16: Triton's path
    assert len(kernel.calls) == 2
