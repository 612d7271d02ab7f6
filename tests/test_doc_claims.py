"""What the documents cite exists: the repository files named in README.md, BENCHMARKS.md, docs/*.md
and the comments and docstrings of kvfuse/, the SPEC sections (§N) cited anywhere in the repository, and
every figure of README.md's performance summary in the result it quotes (the newest full bench run).
Paths of other projects' repositories (FlashMLA's ``csrc/...``, vLLM's ``tests/...``) are cited as
theirs: a path whose owner is named just before it is not this repository's."""
import ast
import io
import json
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import perf_summary  # noqa: E402

DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = sorted((ROOT / "kvfuse").rglob("*.py"))
# first components of this repository's paths; a citation starting with one is checked
TOP = ("kvfuse", "tests", "docs", "benchmarks", "examples", "scripts", ".ci")
TOP_FILES = ("README.md", "BENCHMARKS.md", "LICENSE", "pyproject.toml", "constraints.txt")
# projects whose files the documents cite by their own paths (tests/..., csrc/..., inference/...)
OTHERS = ("FlashMLA", "vLLM", "vllm", "SGLang", "sglang", "sgl", "FlashInfer", "flashinfer", "DeepGEMM",
          "DeepSeek", "DeepInfer", "transformers", "Triton", "triton", "TileLang", "PyTorch", "torch", "quack")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w.*/{},-]*[\w*}]|(?:%s))(?![\w/])" %
                  ("|".join(re.escape(t) for t in TOP), "|".join(re.escape(f) for f in TOP_FILES)))
SECTION = re.compile(r"§\s*(\d+)")


def comment_and_docstring_text(path: Path) -> str:
    """A module's comments and docstrings, one after another (code and other strings left out)."""
    source = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def owned_by_another_project(text: str, start: int) -> bool:
    """The 150 characters before a citation name another project (``FlashMLA's `tests/quant.py```)."""
    before = text[max(0, start - 150):start]
    before = before.rsplit(".\n", 1)[-1].rsplit(". ", 1)[-1]      # within the citation's sentence
    return any(re.search(r"(?<!\w)%s(?!\w)" % re.escape(name), before) for name in OTHERS)


def expand_braces(cited: str):
    """``a_{x,y}.{json,txt}`` -> a_x.json, a_x.txt, a_y.json, a_y.txt."""
    brace = re.search(r"\{([^{}]*)\}", cited)
    if not brace:
        return [cited]
    return [p for alt in brace.group(1).split(",") for p in expand_braces(cited[:brace.start()] + alt + cited[brace.end():])]


def exists(cited: str) -> bool:
    return all(any(ROOT.glob(p.rstrip("/"))) if "*" in p else (ROOT / p).exists()
               for p in expand_braces(cited.rstrip(".,")))


def dangling_paths(text: str):
    return sorted({m.group(1) for m in PATH.finditer(text)
                   if not exists(m.group(1)) and not owned_by_another_project(text, m.start())})


def spec_sections():
    return {int(n) for n in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "SPEC.md").read_text(), re.M)}


def citing_files():
    """Every text file of the repository that may cite a SPEC section, with its text."""
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if path.is_file() and path.suffix in (".py", ".md", ".txt") and rel.parts[0] in TOP + TOP_FILES:
            if rel.parts[0] != "benchmarks" or rel.parts[1:2] != ("results",):   # recorded runs keep their words
                yield rel, path.read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_cite_files_that_exist(doc):
    assert dangling_paths(doc.read_text()) == []


def test_code_comments_cite_files_that_exist():
    dangling = {str(p.relative_to(ROOT)): d for p in CODE if (d := dangling_paths(comment_and_docstring_text(p)))}
    assert dangling == {}


def test_spec_sections_cited_exist():
    sections = spec_sections()
    assert sections, "docs/SPEC.md has no '## N. ' headings"
    dangling = {}
    for rel, text in citing_files():
        missing = sorted({int(n) for n in SECTION.findall(text)} - sections)
        if missing:
            dangling[str(rel)] = missing
    assert dangling == {}, f"SPEC has sections {sorted(sections)}"


def test_the_checks_catch_what_they_look_for():
    # the rules themselves: a missing file of ours is caught, another project's is not, a glob and a
    # brace list resolve against the tree
    assert dangling_paths("see `tests/quant.py`") == ["tests/quant.py"]
    assert dangling_paths("FlashMLA's own rule (`tests/quant.py`)") == []
    assert dangling_paths("`kvfuse/kernels/gluon/*.py`, `kvfuse/{api,args}.py`, `docs/SPEC.md`") == []
    assert dangling_paths("`kvfuse/kernels/{api,nothing}.py`") == ["kvfuse/kernels/{api,nothing}.py"]
    assert SECTION.findall("SPEC \u00a72 and \u00a711") == ["2", "11"]   # escaped: not a citation of this file


def newest_full_bench() -> str:
    runs = sorted(p.name for p in (ROOT / "benchmarks" / "results").glob("*_full_bench.json"))
    return f"benchmarks/results/{runs[-1]}"


def measured_figures(report: dict) -> set:
    """Every figure a rendering of ``report`` may quote, as the summary formats it."""
    figures = {f"{report['device']['copy_GBps'] / 1e3:.2f}", f"{report['device']['floor_us']:.2f}"}
    for r in report["results"]:
        if r.get("gpu_us") is not None:
            figures.add(f"{r['gpu_us']:.2f}")
        if r.get("pct_copy") is not None:
            figures.add(f"{r['pct_copy']:.1f}")
    return figures


def summary_figures(block: str):
    """The measured figures of the summary block: the table's us and % cells, and the header's TB/s and us."""
    figures = re.findall(r"(\d+\.\d+) (?:TB/s|us)\b", block.split("\n", 2)[1])
    for row in block.split("\n"):
        cells = row.split(" | ")
        if row.startswith("| ") and len(cells) == 4 and not set(cells[2]) <= set("-| "):
            figures += re.findall(r"\d+\.\d+", cells[2]) + re.findall(r"(\d+\.\d+)%", cells[3])
    return figures


def test_readme_summary_quotes_the_newest_result():
    readme = (ROOT / "README.md").read_text()
    block = perf_summary.readme_block(readme)
    assert perf_summary.SOURCE == newest_full_bench()
    assert f"`{newest_full_bench()}`" in block
    figures = summary_figures(block)
    assert len(figures) > 20, figures            # the table was parsed
    report = json.loads((ROOT / perf_summary.SOURCE).read_text())
    assert sorted(set(figures) - measured_figures(report)) == []


def test_readme_states_no_figure_outside_its_summary():
    # figures elsewhere in the README would not be re-rendered when a new run lands
    readme = (ROOT / "README.md").read_text()
    rest = readme.replace(perf_summary.readme_block(readme), "")
    assert re.findall(r"\d+(?:\.\d+)? ?(?:us|GB/s|TB/s|%)(?!\w)", rest) == []
