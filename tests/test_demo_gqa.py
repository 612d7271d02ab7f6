"""`kvfuse demo --gqa NAME` (kvfuse.demo's GQA page): every GQA cache format of kvfuse.gqa_formats on one
model's activations (bytes per token and layer, the read-back errors against the bf16 and fp64 chains,
attention recall@k, a trivial recall flagged), the CSV and chart, the static scales, the numerics profiles'
accuracy against an fp64 chain (parsed from the printed table), and the flags it refuses."""
import csv
import math

import pytest
import torch

from kvfuse import cli, demo, models
from kvfuse import gqa_formats as GF
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


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big")


def _page(capsys, tmp_path, name, *extra):
    rc = cli.main(["demo", "--gqa", name, "--n", "24", "--block-size", "16", "--topk", "8", "--queries", "4",
                   "--out", str(tmp_path), *extra])
    text = capsys.readouterr().out
    assert rc == 0 and f"--gqa {name}" in text
    with open(tmp_path / demo.GQA_CSV_NAME) as f:
        rows = {r["format"]: r for r in csv.DictReader(f)}
    return text, rows


@pytest.mark.parametrize("name", ["llama-3-8b", "gemma-3-12b", "qwen2.5-vl-7b"])
def test_gqa_page(capsys, tmp_path, name):
    """A row for every preset of kvfuse.gqa_formats (table and CSV), bytes per token from row_bytes, "auto"
    exact against the bf16 chain, every format's error against bf16 and fp64 measured, recall@8 measured."""
    cfg = models.get_gqa(name)
    text, rows = _page(capsys, tmp_path, name)
    assert list(rows) == list(GF.PRESETS)                    # every preset, "auto" first
    table = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] and
             line.split()[0] in GF.PRESETS}
    assert set(table) == set(GF.PRESETS)
    for fname, r in rows.items():
        fmt = GF.PRESETS[fname]
        want = cfg.num_kv_heads * 2 * fmt.row_bytes(cfg.head_dim)
        assert float(r["kv bytes/token/layer"]) == want and float(table[fname][3]) == want
        assert float(r["vs_bf16"]) == pytest.approx(cfg.kv_bytes_per_token(2) / want, rel=1e-5)
        assert r["k"] == "8" and 0.0 <= float(r["recall"]) <= 1.0
        for col in ("k_err_vs_fp64", "v_err_vs_fp64", "k_err_vs_bf16", "v_err_vs_bf16"):
            assert math.isfinite(float(r[col])) and float(r[col]) < 0.3, (fname, col)
        if fmt.takes_static_scale:
            assert float(r["k_scale"]) > 0 and float(r["v_scale"]) > 0
        else:
            assert r["k_scale"] == r["v_scale"] == "-"
        if fname != "auto":
            assert float(r["k_err_vs_bf16"]) > 0 and float(r["v_err_vs_bf16"]) > 0
            assert float(r["k_err_vs_fp64"]) > float(rows["auto"]["k_err_vs_fp64"])
    auto = rows["auto"]
    assert float(auto["k_err_vs_bf16"]) == 0.0 and float(auto["v_err_vs_bf16"]) == 0.0
    assert float(auto["recall"]) == 1.0
    assert 0.0 < float(auto["k_err_vs_fp64"]) < 0.01         # bf16 rounding of the normed, rotated K
    assert float(rows["mxfp4"]["k_err_vs_bf16"]) > float(rows["fp8_e4m3"]["k_err_vs_bf16"])
    assert "static scales derived from the data: amax / qmax" in text and "trivial" not in text
    assert png_width(tmp_path / demo.GQA_PNG_NAME) > 1300   # two panels: error and recall


def test_gqa_trivial_recall_is_flagged(capsys, tmp_path):
    """k >= the keys: recall@k is 1 whatever the cache holds: 'trivial' in the table (with its footnote), the
    CSV and the chart (no recall panel), never a number."""
    text, rows = _page(capsys, tmp_path, "qwen3-8b", "--n", "16", "--topk", "64")
    assert {r["recall"] for r in rows.values()} == {"trivial"} and {r["k"] for r in rows.values()} == {"16"}
    lines = [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in GF.PRESETS]
    assert len(lines) == len(GF.PRESETS) and all(line.split()[-1] == "trivial*" for line in lines)
    assert "* trivial: recall@16 over 16 keys is 1 whatever the cache holds" in text
    assert png_width(tmp_path / demo.GQA_PNG_NAME) < 1000   # the error panel alone


def test_static_scales_come_from_the_data():
    x = torch.tensor([[-3.0, 1.5], [0.25, 2.0]])
    assert float(demo.static_scale(GF.PRESETS["fp8_e4m3"], x)) == pytest.approx(3.0 / 448)
    assert float(demo.static_scale(GF.PRESETS["fp8_e5m2"], x)) == pytest.approx(3.0 / 57344)
    assert float(demo.static_scale(GF.PRESETS["nvfp4"], x)) == pytest.approx(3.0 / (6 * 448))
    for name in ("auto", "fp8_per_token_head", "int8_per_token_head", "mxfp4"):
        assert demo.static_scale(GF.PRESETS[name], x) is None


def test_attention_recall_maps_query_heads_to_their_kv_head():
    """4 query heads on 2 kv heads: heads 0-1 read kv head 0, 2-3 kv head 1."""
    keys = torch.zeros(4, 2, 2)
    keys[:, 0, 0] = torch.tensor([4.0, 3.0, 2.0, 1.0])       # kv head 0: key 0 scores highest
    keys[:, 1, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])       # kv head 1: key 3
    q = torch.zeros(1, 4, 2)
    q[..., 0] = 1.0
    assert demo.attention_recall(q, keys, keys, 1) == 1.0
    swapped = keys.flip(1)                                   # each kv head's keys are the other's
    assert demo.attention_recall(q, swapped, keys, 1) == 0.0
    assert demo.attention_recall(q, swapped, keys, 2) == 0.0


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
