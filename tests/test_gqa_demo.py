"""`kvfuse demo --gqa NAME` (kvfuse.demo's GQA page): bf16 vs fp8 per-tensor K/V caches of a GQA model,
bytes per token and layer, the read-back errors (bf16 exact, fp8 small and nonzero), the CSV, and the
flags it refuses."""
import csv

import pytest

from kvfuse import cli, models


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


def test_gqa_flags(capsys):
    assert cli.main(["demo", "--gqa", "qwen3-8b", "--model", "deepseek-v3"]) == 2
    assert cli.main(["demo", "--gqa", "qwen3-8b", "--n", "0"]) == 2
    assert cli.main(["demo", "--gqa", "llama-2"]) == 2
    assert "invalid choice" in capsys.readouterr().err
