"""`kvfuse demo --gqa NAME` (kvfuse.demo's GQA page): bf16 vs fp8 per-tensor K/V caches of a GQA model,
bytes per token and layer, the read-back errors (bf16 exact, fp8 small and nonzero), the CSV, the
numerics profiles' accuracy against an fp64 chain (parsed from the printed table), and the flags it refuses."""
import csv
import math

import pytest

from kvfuse import cli, models
from kvfuse.numerics_profiles import NUMERICS

ACCURACY_COLUMNS = ("q_out not rounded", "k not rounded", "fp8 codes off", "q_out max abs", "k max abs",
                    "fp8 max abs")


def accuracy_table(text: str) -> dict:
    """profile -> {column: value} of the page's accuracy table (shares as fractions)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("numerics= profiles"))
    assert lines[start + 1].split()[0] == "numerics"
    table = {}
    for line in lines[start + 3:start + 3 + len(NUMERICS)]:
        name, *cells = line.split()
        assert len(cells) == len(ACCURACY_COLUMNS), line
        values = [float(c[:-1]) / 100 if c.endswith("%") else float(c) for c in cells]
        table[name] = dict(zip(ACCURACY_COLUMNS, values))
    assert list(table) == list(NUMERICS)
    return table


@pytest.mark.parametrize("name", ["llama-3-8b", "gemma-3-12b"])
def test_gqa_page(capsys, tmp_path, name):
    cfg = models.get_gqa(name)
    rc = cli.main(["demo", "--gqa", name, "--n", "24", "--block-size", "16", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 0 and f"--gqa {name}" in text
    with open(tmp_path / "gqa_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["cache"] for r in rows] == ["bf16", "fp8 per-tensor, calibrated", "fp8 per-tensor, scale 1.0"]
    assert int(rows[0]["kv bytes/token/layer"]) == 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert int(rows[1]["kv bytes/token/layer"]) == cfg.num_kv_heads * cfg.head_dim * 2
    assert float(rows[0]["k_rel_err"]) == 0.0 and float(rows[0]["v_rel_err"]) == 0.0     # bf16 caches are exact
    for r in rows[1:]:
        assert 0.0 < float(r["k_rel_err"]) < 0.1 and 0.0 < float(r["v_rel_err"]) < 0.1
    assert float(rows[1]["k_scale"]) > 0 and rows[2]["k_scale"] == "1"
    for r in rows:
        assert r["cache"] in text


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3-8b"])
def test_gqa_page_accuracy(capsys, tmp_path, name):
    """Every profile's accuracy: shares in [0, 1], errors finite and > 0; with a QK-norm the fused profiles
    round once, so fewer q_out / k results miss the correctly rounded value than staged's; without one
    staged and fused are the same chain; fused_fp32_cast's fp8 cast reads fp32, so no more codes off."""
    cfg = models.get_gqa(name)
    assert cli.main(["demo", "--gqa", name, "--n", "8", "--block-size", "16", "--out", str(tmp_path)]) == 0
    acc = accuracy_table(capsys.readouterr().out)
    for row in acc.values():
        for col in ACCURACY_COLUMNS:
            assert math.isfinite(row[col]) and row[col] >= 0, (col, row)
            assert row[col] <= 1 or col.endswith("max abs")
        assert row["q_out max abs"] > 0 and row["k max abs"] > 0 and row["fp8 max abs"] > 0
    staged, fused, fp32_cast = acc["staged"], acc["fused"], acc["fused_fp32_cast"]
    for col in ("q_out not rounded", "k not rounded", "q_out max abs", "k max abs"):
        assert fused[col] == fp32_cast[col]              # the profiles differ only in the fp8 cast
    if cfg.qk_norm:
        assert fused["q_out not rounded"] < staged["q_out not rounded"]
        assert fused["k not rounded"] < staged["k not rounded"]
        assert staged["q_out not rounded"] > 0.05        # bf16 rounding between norm and RoPE: a large share
    else:
        assert fused == staged
    assert fp32_cast["fp8 codes off"] <= fused["fp8 codes off"] and fused["fp8 codes off"] > 0
    # the correctly rounded shares of a single rounding are small
    assert fused["q_out not rounded"] < 0.01 and fused["k not rounded"] < 0.01


def test_gqa_flags(capsys):
    assert cli.main(["demo", "--gqa", "qwen3-8b", "--model", "deepseek-v3"]) == 2
    assert cli.main(["demo", "--gqa", "qwen3-8b", "--n", "0"]) == 2
    assert cli.main(["demo", "--gqa", "llama-2"]) == 2
    assert "invalid choice" in capsys.readouterr().err
