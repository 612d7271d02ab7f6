"""The package's layout rules, read from the source (AST): no import cycle between kvfuse's modules
(imports inside functions included; a package's own __init__ importing its children is structure, not
a cycle), and no imports between tests/ and benchmarks/ in either direction, but for the document
generators of benchmarks/ that tests import to check them (DOCUMENT_GENERATORS)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT_GENERATORS = {"benchmarks_md", "perf_summary"}     # benchmarks/ scripts that tests may import


def _module_files(package: Path) -> dict:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict:
    """kvfuse module -> the kvfuse modules it imports (absolute and relative, at any depth in the code)."""
    mods = _module_files(ROOT / "kvfuse")
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), parent/child package edges left out."""
    def related(a, b):
        return a.startswith(b + ".") or b.startswith(a + ".")

    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if related(v, w):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_kvfuse():
    graph = import_graph()
    assert "kvfuse.kernels.gluon.indexer" in graph and "kvfuse.reference.chain" in graph
    assert "kvfuse.kernels.router" in graph["kvfuse.kernels.grouped"]              # relative imports resolved
    assert "kvfuse.kernels.gluon.common" in graph["kvfuse.kernels.gluon.indexer"]
    assert "kvfuse.kernels.router" in graph["kvfuse.dispatch"]                    # imports inside functions too
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    """Negative control: a two-module loop and a three-module loop are reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "p": {"p.q"}, "p.q": {"p"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
    return names


def test_tests_and_benchmarks_do_not_import_each_other():
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    bench_modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert DOCUMENT_GENERATORS <= bench_modules                   # the allowance names files that exist
    for path in (ROOT / "benchmarks").glob("*.py"):
        bad = _imports(path) & (test_modules | {"tests"})
        assert not bad, f"{path.name} imports {sorted(bad)} from tests/"
    for path in (ROOT / "tests").rglob("*.py"):
        bad = _imports(path) & ((bench_modules - test_modules - DOCUMENT_GENERATORS) | {"benchmarks"})
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} from benchmarks/"
