"""The direct launch's cheapest path (kvfuse/kernels/launcher.py), with stand-in kernels: no launch hook
registered passes none (and builds no launch metadata), a registered one is honoured; on Triton 3.6 a kernel
without scratch memory goes to the C launcher itself, with the arguments CudaLauncher.__call__ would give it;
and the installed Triton's launcher still has the convention the direct path assumes (read from its source)."""
from __future__ import annotations

import inspect
import types

import pytest
import triton

from kvfuse.kernels import launcher as L
from test_launcher import FakeKernel, FakeTensor, make_launch


class HookChain:
    """Triton's hook chain as the launcher sees it: a list of calls, called in turn."""

    def __init__(self, *calls):
        self.calls = list(calls)

    def __call__(self, *args):
        for c in self.calls:
            c(*args)


class FakeCudaLauncher:
    """Triton 3.6's CudaLauncher: the C launcher and the attributes its __call__ reads."""

    def __init__(self, global_scratch=0, profile_scratch=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch, profile_scratch
        self.launch_cooperative_grid, self.launch_pdl = 0, 1
        self.c_calls, self.py_calls = [], []

    def launch(self, *args):
        self.c_calls.append(args)

    def __call__(self, *args):
        self.py_calls.append(args)


@pytest.fixture
def env(monkeypatch):
    state = types.SimpleNamespace(device=0)
    monkeypatch.setattr(L, "_current_device", lambda: state.device)
    monkeypatch.setattr(L, "_current_stream", lambda device: 1000 + device)
    state.knobs = types.SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain())
    monkeypatch.setattr(L, "_runtime_knobs", lambda: state.knobs)
    return state


def launched_twice(kernel):
    launch, _ = make_launch(kernel)
    launch.run((FakeTensor(0), FakeTensor(16)))        # Triton's path: compiles, keeps the kernel
    a, b = FakeTensor(32), FakeTensor(48)
    launch.run((a, b))
    return a, b


def test_empty_hook_chains_pass_no_hooks_and_build_no_metadata(env, monkeypatch):
    monkeypatch.setattr(L.triton, "__version__", "3.9.0")
    kernel = FakeKernel()
    a, b = launched_twice(kernel)
    (run,) = kernel.compiled.runs
    assert run == (5, 1, 1, 1000, "fn-handle", ("meta",), None, None, None, a, 7, b, 64, True)
    assert kernel.compiled.metadata_calls == []


@pytest.mark.parametrize("which", ["enter", "exit"])
def test_a_registered_hook_gets_tritons_protocol(env, monkeypatch, which):
    monkeypatch.setattr(L.triton, "__version__", "3.6.0")
    seen = []
    chain = env.knobs.launch_enter_hook if which == "enter" else env.knobs.launch_exit_hook
    chain.calls.append(seen.append)
    kernel = FakeKernel()
    a, b = launched_twice(kernel)
    (run,) = kernel.compiled.runs      # not the C launcher: hooks go through Triton's own wrapper
    assert run[6:9] == ("launch-meta", env.knobs.launch_enter_hook, env.knobs.launch_exit_hook)
    assert run[9:] == (a, 7, b, 64, True)
    assert len(kernel.compiled.metadata_calls) == 1


def test_triton_36_without_scratch_calls_the_c_launcher(env, monkeypatch):
    monkeypatch.setattr(L.triton, "__version__", "3.6.0")
    kernel = FakeKernel()
    cuda = kernel.compiled.run = FakeCudaLauncher()
    a, b = launched_twice(kernel)
    assert cuda.py_calls == []
    # grid, stream, function, cooperative grid, pdl, the two scratch buffers (none), packed metadata,
    # launch metadata and hooks (none), then every parameter in the kernel's order
    assert cuda.c_calls == [(5, 1, 1, 1000, "fn-handle", 0, 1, None, None, ("meta",), None, None, None,
                             a, 7, b, 64, True)]


@pytest.mark.parametrize("scratch", [(256, 0), (0, 64)])
def test_a_kernel_with_scratch_memory_keeps_tritons_wrapper(env, monkeypatch, scratch):
    monkeypatch.setattr(L.triton, "__version__", "3.6.0")
    kernel = FakeKernel()
    cuda = kernel.compiled.run = FakeCudaLauncher(*scratch)
    a, b = launched_twice(kernel)
    assert cuda.c_calls == []
    assert cuda.py_calls == [(5, 1, 1, 1000, "fn-handle", ("meta",), None, None, None, a, 7, b, 64, True)]


def test_other_versions_keep_tritons_wrapper(env, monkeypatch):
    monkeypatch.setattr(L.triton, "__version__", "3.9.0")
    kernel = FakeKernel()
    cuda = kernel.compiled.run = FakeCudaLauncher()
    launched_twice(kernel)
    assert cuda.c_calls == [] and len(cuda.py_calls) == 1


def test_installed_tritons_launcher_convention():
    """What DirectLaunch passes is what Triton's own launch passes, on the Triton installed here."""
    if not triton.__version__.startswith(L.DIRECT_LAUNCH_VERSIONS):
        pytest.skip(f"no direct launch on triton {triton.__version__}")
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.jit import JITFunction
    jit_run = inspect.getsource(JITFunction.run).replace(" ", "").replace("\n", "")
    assert ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
            "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())") in jit_run
    params = list(inspect.signature(CudaLauncher.__call__).parameters)
    call = inspect.getsource(CudaLauncher.__call__).replace(" ", "").replace("\n", "")
    if triton.__version__.startswith(L.C_LAUNCH_VERSIONS):
        assert params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
        assert ("self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,"
                "global_scratch,profile_scratch,*args)") in call
    else:
        assert params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
                          "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args"]
