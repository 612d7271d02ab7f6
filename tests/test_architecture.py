"""The shape of the code, checked from its import graph (every import statement of kvfuse/ and
benchmarks/, lazy ones included; a package's own __init__ is not counted as an edge of its modules):

- no import cycles;
- the reference chain and the kernels read validation only through the plan types
  (kvfuse.plans.types), never the rules, the plan cache or an entry point;
- the backend choice (kvfuse.backend.resolve_backend) and the route through the custom ops are
  decided in kvfuse.dispatch alone;
- the longest import chain, printed with ``-s``, stays within LONGEST_CHAIN layers, counted as the
  architecture is drawn: a subpackage (kvfuse.plans, kvfuse.kernels, kvfuse.reference, kvfuse.bench,
  ...) and the benchmarks/ scripts are one node each; the chain of single modules is printed beside it.
"""
from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LONGEST_CHAIN = 10     # nodes on the longest chain of packages and top-level modules (was 13)


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources():
    files = list((ROOT / "kvfuse").rglob("*.py")) + list((ROOT / "benchmarks").glob("*.py"))
    return {_module_name(p): p for p in files}


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)
def graph() -> dict:
    """module -> the set of project modules it imports."""
    sources = _sources()
    edges = {}
    for mod, path in sources.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                if mod.startswith("benchmarks") and prefix in {m.split(".")[-1] for m in sources if
                                                              m.startswith("benchmarks.")}:
                    prefix = "benchmarks." + prefix        # the scripts import their siblings by name
                targets = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
            for t in targets:
                hit = _resolve(t, sources)
                if hit and hit != mod:
                    found.add(hit)
        # the submodule named in `from pkg import sub` is the edge, not pkg/__init__ as well
        edges[mod] = {m for m in found if not any(o != m and o.startswith(m + ".") for o in found)} or found
    return edges


def _node(mod: str) -> str:
    """The architecture's node of a module: kvfuse.<subpackage> or benchmarks for their modules."""
    parts = mod.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks"
    if len(parts) > 2 or (len(parts) == 2 and (ROOT / "kvfuse" / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return mod


def package_graph() -> dict:
    g = {}
    for mod, deps in graph().items():
        g.setdefault(_node(mod), set()).update(_node(d) for d in deps if _node(d) != _node(mod))
    return g


def _longest_chain(g=None):
    g = graph() if g is None else g

    @functools.lru_cache(maxsize=None)
    def chain(m):
        best = ()
        for d in g[m]:
            c = chain(d)
            if len(c) > len(best):
                best = c
        return (m,) + best
    return max((chain(m) for m in g), key=len)


def test_no_import_cycles():
    g = graph()
    state = {}

    def visit(m, stack):
        state[m] = 1
        for d in g[m]:
            assert state.get(d) != 1, "import cycle: " + " -> ".join(stack + [m, d])
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m, [])


def test_backends_read_only_the_plan_types():
    for mod, deps in graph().items():
        if mod.startswith(("kvfuse.kernels", "kvfuse.reference")):
            bad = {d for d in deps if d.startswith("kvfuse.plans") and d != "kvfuse.plans.types"}
            bad |= {d for d in deps if d in ("kvfuse.api", "kvfuse.dispatch", "kvfuse.ops", "kvfuse.gqa",
                                             "kvfuse.group", "kvfuse.mla", "kvfuse.models")}
            assert not bad, f"{mod} imports {sorted(bad)}"


def test_one_room_decides_the_route():
    """resolve_backend and the custom ops (torch.ops.kvfuse) are reached from kvfuse.dispatch alone (the
    demo asks resolve_backend only to print which backend it ran)."""
    for path in (ROOT / "kvfuse").rglob("*.py"):
        text = path.read_text()
        mod = _module_name(path)
        if mod in ("kvfuse.dispatch", "kvfuse.backend") or (mod == "kvfuse.demo" and "torch.ops" not in text):
            continue
        assert "resolve_backend(" not in text, mod
        assert "torch.ops.kvfuse" not in text, mod


def test_longest_import_chain():
    modules = _longest_chain()
    print(f"\nlongest import chain of modules ({len(modules)}): " + " -> ".join(modules))
    chain = _longest_chain(package_graph())
    print(f"longest import chain of packages and modules ({len(chain)}): " + " -> ".join(chain))
    assert len(chain) <= LONGEST_CHAIN, " -> ".join(chain)
