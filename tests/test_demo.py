"""`kvfuse demo` (kvfuse.demo): the format explorer on a tiny batch, through the CLI entry point.

Checks the table (one row per preset, two for the 128-d formats: with/without Hadamard; sizes from
the formats; a bf16 cache is lossless with recall 1), results.csv, that the chart is a real PNG,
--input with .safetensors and .pt files, and that the explorer's read-back is exactly the
reference chain's quantize -> dequantize of the transform output it reports.
"""
import csv
import math

import pytest
import torch

from kvfuse import cli, demo
from kvfuse import formats as F
from kvfuse import reference as R

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(capsys, tmp_path, *extra):
    out = tmp_path / "out"
    rc = cli.main(["demo", "--n", "96", "--block-size", "16", "--topk", "8", "--queries", "8", "--no-progress",
                   "--out", str(out), *extra])
    text = capsys.readouterr().out
    return rc, text, out


def _rows(text):
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in F.PRESETS:
            rows[(parts[0], parts[3] == "yes")] = parts
    return rows


def _check_table(text, out):
    rows = _rows(text)
    expected = {(name, False) for name in F.PRESETS} | {(name, True) for name, f in F.PRESETS.items()
                                                        if f.head_dim == 128}
    assert set(rows) == expected
    assert len(expected) == 14
    for (name, had), parts in rows.items():
        fmt = F.PRESETS[name]
        assert parts[1] == ("token" if fmt.token_interleaved else "block")
        assert int(parts[2]) == fmt.head_dim
        assert int(parts[4]) == fmt.bytes_per_token
        assert parts[5] == f"{2 * fmt.head_dim / fmt.bytes_per_token:.2f}x"
        err = float(parts[6])
        assert math.isfinite(err) and 0 <= err < 0.5
        if fmt.head_dim == 128:
            assert 0.0 <= float(parts[7]) <= 1.0
        else:
            assert parts[7] == "-"
        if fmt.quantized:
            assert err > 0
    assert float(rows[("INDEX_BF16", False)][6]) == 0.0
    assert float(rows[("INDEX_BF16", False)][7]) == 1.0
    # FP4 loses more than FP8 on the same data
    assert float(rows[("MAIN_FP4", False)][6]) > float(rows[("MAIN_FP8", False)][6])
    png = out / demo.PNG_NAME
    assert png.exists() and png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    with open(out / demo.CSV_NAME) as fh:
        table = list(csv.reader(fh))
    assert table[0] == list(demo.COLUMNS) and len(table) == 15
    return rows


def test_demo_synthetic(capsys, tmp_path):
    rc, text, out = _run(capsys, tmp_path)
    assert rc == 0
    assert "synthetic" in text and "96 tokens" in text and "recall@8" in text
    _check_table(text, out)


def test_demo_input_safetensors(capsys, tmp_path):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "acts.safetensors"
    save_file({"kv": torch.randn(40, 576, generator=g).to(torch.bfloat16),
               "index_k": (torch.randn(40, 128, generator=g) * 3).float()}, str(path))
    rc, text, out = _run(capsys, tmp_path, "--input", str(path))
    assert rc == 0
    assert "acts.safetensors, 40 tokens" in text
    _check_table(text, out)


def test_demo_input_pt(capsys, tmp_path):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "k.pt"
    torch.save(torch.randn(30, 1, 512, generator=g).to(torch.bfloat16), str(path))   # one tensor [n, 1, 512]
    rc, text, out = _run(capsys, tmp_path, "--input", str(path))
    assert rc == 0
    assert "k.pt, 30 tokens" in text
    _check_table(text, out)


def test_demo_bad_input(capsys, tmp_path):
    rc = cli.main(["demo", "--input", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "nan.pt"
    torch.save({"k": torch.full((4, 128), float("nan"))}, str(bad))
    assert cli.main(["demo", "--input", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert cli.main(["demo", "--n", "0"]) == 2          # argparse's usage error, as an exit status
    assert "usage" in capsys.readouterr().err


def test_fit_width():
    x = torch.arange(2 * 576, dtype=torch.float32).reshape(2, 576).to(torch.bfloat16)
    assert torch.equal(demo.fit_width(x, 576), x)
    assert torch.equal(demo.fit_width(x, 512), x[:, :512])
    y = torch.arange(2 * 512, dtype=torch.float32).reshape(2, 512).to(torch.bfloat16)
    assert torch.equal(demo.fit_width(y, 128), y.reshape(8, 128))
    z = demo.fit_width(x[:, :128].contiguous(), 576)
    assert z.shape == (2, 576) and torch.equal(z[:, 128:256], x[:, :128])


@pytest.mark.parametrize("fmt,had", [(F.MAIN_FP8, False), (F.MAIN_FP4, False), (F.INDEX_NVFP4, True),
                                     (F.INDEX_FP8_FP32, False), (F.FLASHMLA_V32, False),
                                     (F.FLASHMLA_MODEL1, False)], ids=lambda v: getattr(v, "name", str(v)))
def test_read_back_is_the_reference_round_trip(fmt, had):
    """What the explorer measures is exactly quantize -> dequantize of the reported transform output."""
    x = demo.fit_width(demo.synthetic_batch(50, 3)["kv" if fmt.head_dim != 128 else "index_k"], fmt.head_dim)
    y, back = demo.write_and_read(fmt, x, had, block_size=16, seed=3)
    qd = fmt.quant_dim
    q, sf = R.quantize(y[:, :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)
    want = torch.cat([R.dequantize(q, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format), y[:, qd:]], dim=-1)
    assert torch.equal(back.view(torch.int16), want.view(torch.int16))
    assert 0 < demo.relative_error(back, y) < 0.5


def test_recall_at_k():
    s = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert demo.recall_at_k(s, s, 2) == 1.0
    assert demo.recall_at_k(s, torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0]]), 2) == 0.5
    assert demo.recall_at_k(-s, s, 2) == 0.0
