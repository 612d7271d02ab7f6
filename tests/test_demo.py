"""`kvfuse demo` (kvfuse.demo): the format explorer on a tiny batch, through the CLI entry point.

Checks the table (one row per preset, two for the 128-d formats: with/without Hadamard; sizes from
the formats; a bf16 cache is lossless with recall 1), results.csv, that the chart is a real PNG,
--input with .safetensors and .pt files (the report of the tensor used and its reshaping,
--input-key, the warnings on data that overflows bf16 or is all zeros), the recall label (the k
used; a recall with k >= the keys flagged trivial, the chart then one panel), --out checked before any work
(a file, a folder that cannot be made, a folder where an output file goes), the chart's legend naming only
drawn markers, that the explorer's read-back is exactly the reference chain's quantize -> dequantize of the transform output it reports, and ``--model NAME``
(one row per call site of a kvfuse.models configuration, through its kvfuse.mla calls).
"""
import csv
import math

import pytest
import torch

from kvfuse import cli, demo, models
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
    assert len(expected) == 15
    for (name, had), parts in rows.items():
        fmt = F.PRESETS[name]
        assert parts[1] == ("token" if fmt.token_interleaved else "block")
        assert int(parts[2]) == fmt.head_dim
        assert int(parts[4]) == fmt.bytes_per_token
        assert parts[5] == f"{2 * fmt.head_dim / fmt.bytes_per_token:.2f}x"
        err, err_q = float(parts[6]), float(parts[7])
        assert math.isfinite(err) and 0 <= err < 0.5
        if fmt.head_dim == 128:
            assert 0.0 <= float(parts[8]) <= 1.0
        else:
            assert parts[8] == "-"
        if fmt.quantized:
            assert err > 0
        if fmt.bf16_tail:       # the exact bf16 tail dilutes the whole-record error
            assert err_q > err
        else:
            assert parts[7] == parts[6]
    assert float(rows[("INDEX_BF16", False)][6]) == 0.0
    assert float(rows[("INDEX_BF16", False)][8]) == 1.0
    # FP4 loses more than FP8 on the same data
    assert float(rows[("MAIN_FP4", False)][6]) > float(rows[("MAIN_FP8", False)][6])
    png = out / demo.PNG_NAME
    assert png.exists() and png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    with open(out / demo.CSV_NAME) as fh:
        table = list(csv.reader(fh))
    assert table[0] == list(demo.COLUMNS) and len(table) == 16
    col = {name: i for i, name in enumerate(demo.COLUMNS)}
    for line in table[1:]:
        parts = rows[(line[col["format"]], line[col["hadamard"]] == "1")]
        assert float(line[col["rel_err"]]) == pytest.approx(float(parts[6]), rel=0.01)
        assert float(line[col["rel_err_q"]]) == pytest.approx(float(parts[7]), rel=0.01)
        if F.PRESETS[line[col["format"]]].head_dim == 128:
            assert f"recall@{line[col['k']]}" in text
        else:
            assert line[col["k"]] == "" and line[col["recall"]] == ""
    return rows


def test_demo_synthetic(capsys, tmp_path):
    rc, text, out = _run(capsys, tmp_path)
    assert rc == 0
    assert "synthetic" in text and "96 tokens" in text and "recall@8" in text and "asked for" not in text
    _check_table(text, out)


def test_demo_recall_label_is_the_k_used(capsys, tmp_path):
    """--topk larger than the keys: the table and the CSV say the k that was used, not the one asked for, and
    flag that recall as trivial (every key is in the top-k) instead of reporting 1; the chart has no recall panel."""
    rc, text, out = _run(capsys, tmp_path, "--topk", "100000")
    assert rc == 0
    assert "recall@96" in text and "recall@100000" not in text
    assert "--topk 100000 asked for, k = 96 used" in text
    assert "* trivial: recall@96 over 96 keys is 1 whatever the cache holds" in text
    rows = _rows(text)
    assert {parts[8] for (name, _), parts in rows.items() if F.PRESETS[name].head_dim == 128} == {"trivial*"}
    with open(out / demo.CSV_NAME) as fh:
        table = list(csv.DictReader(fh))
    assert {r["k"] for r in table if r["recall"]} == {"96"}
    assert {r["recall"] for r in table if r["k"]} == {"trivial"}
    assert png_width(out / demo.PNG_NAME) < 1000          # the error panel alone


def png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big")


def _forbid_work(monkeypatch):
    """Every function that starts the demo's work fails the test if called."""
    def fail(*args, **kwargs):
        raise AssertionError("the demo started work before checking --out")
    for name in ("synthetic_batch", "prepare_input", "explore", "explore_model", "gqa_page", "gqa_accuracy"):
        monkeypatch.setattr(demo, name, fail)


@pytest.mark.parametrize("page", [(), ("--gqa", "qwen3-8b")], ids=["mla", "gqa"])
def test_demo_out_checked_before_work(capsys, tmp_path, monkeypatch, page):
    """--out that cannot take the output: a one-line error naming --out, exit status 2, no work done."""
    _forbid_work(monkeypatch)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    blocked = tmp_path / "blocked"
    for name in (demo.GQA_CSV_NAME, demo.GQA_PNG_NAME) if page else (demo.CSV_NAME, demo.PNG_NAME):
        (blocked / name).mkdir(parents=True)
    cases = [(str(a_file), "is a file, not a folder"),
             (str(a_file / "sub"), "cannot create the folder"),
             ("/proc/kvfuse_demo_out", "cannot create the folder"),
             (str(blocked), "is a folder, where the demo writes its file")]
    for path, what in cases:
        assert cli.main(["demo", *page, "--out", path]) == 2, path
        err = capsys.readouterr().err
        assert f"kvfuse demo: --out {path!r}" in err and what in err, err
    assert a_file.read_text() == "x"


def test_demo_out_created(capsys, tmp_path):
    out = tmp_path / "a" / "b"
    rc = cli.main(["demo", "--n", "32", "--block-size", "16", "--topk", "8", "--queries", "4", "--no-progress",
                   "--out", str(out)])
    assert rc == 0 and (out / demo.CSV_NAME).is_file() and (out / demo.PNG_NAME).is_file()


def test_relative_error_of_nothing_is_not_zero():
    z = torch.zeros(4, 8)
    assert math.isnan(demo.relative_error(z, z))
    assert math.isnan(demo.relative_error(z, torch.full((4, 8), float("inf"))))
    assert demo.relative_error(torch.ones(4, 8), torch.ones(4, 8)) == 0.0


def test_demo_input_safetensors(capsys, tmp_path):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "acts.safetensors"
    save_file({"kv": torch.randn(40, 576, generator=g).to(torch.bfloat16),
               "index_k": (torch.randn(40, 128, generator=g) * 3).float()}, str(path))
    rc, text, out = _run(capsys, tmp_path, "--input", str(path))
    assert rc == 0
    assert "acts.safetensors, 40 tokens" in text
    assert "main = 'kv' [40, 576] bfloat16 (by name): -> 512: first 512 of 576 columns, 40 rows; -> 576: as is" in text
    assert "index = 'index_k' [40, 128] float32 (by name): -> 128: as is, 40 rows" in text
    _check_table(text, out)


def test_demo_input_pt(capsys, tmp_path):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "k.pt"
    torch.save(torch.randn(30, 1, 512, generator=g).to(torch.bfloat16), str(path))   # one tensor [n, 1, 512]
    rc, text, out = _run(capsys, tmp_path, "--input", str(path))
    assert rc == 0
    assert "k.pt, 30 tokens" in text
    assert "main = 'k' [30, 1, 512] bfloat16 (the only tensor) as [30, 512]: -> 512: as is, 30 rows" in text
    assert "-> 128: each row split into 4, 96 rows" in text      # --n 96 of the 120
    _check_table(text, out)


def _run_input(capsys, tmp_path, obj, *extra):
    path = tmp_path / "x.pt"
    torch.save(obj, str(path))
    out = tmp_path / "out"
    rc = cli.main(["demo", "--n", "32", "--block-size", "16", "--topk", "8", "--queries", "4", "--no-progress",
                   "--out", str(out), "--input", str(path), *extra])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err, out


def _input_line(text):
    return next(line for line in text.splitlines() if line.startswith("input x.pt: "))


def test_demo_input_several_tensors(capsys, tmp_path):
    """No conventional name: the choice is reported, --input-key makes another."""
    g = torch.Generator().manual_seed(2)
    obj = {"b": torch.randn(20, 128, generator=g), "a": torch.randn(20, 512, generator=g), "c": torch.randn(20, 64)}
    rc, text, _, _ = _run_input(capsys, tmp_path, obj)
    line = _input_line(text)
    assert rc == 0
    assert "main = 'a' [20, 512] float32 (first by name of 3" in line and "--input-key NAME picks another" in line
    assert "index = 'a'" in line and "unused: 'b', 'c'" in line
    rc, text, _, _ = _run_input(capsys, tmp_path, obj, "--input-key", "main=a", "--input-key", "index=b")
    line = _input_line(text)
    assert rc == 0
    assert "main = 'a' [20, 512] float32 (--input-key)" in line and "index = 'b' [20, 128] float32 (--input-key)" in line
    assert "unused: 'c'" in line
    rc, _, err, _ = _run_input(capsys, tmp_path, obj, "--input-key", "zz")
    assert rc == 2 and "no tensor 'zz'" in err and "'a', 'b', 'c'" in err
    assert cli.main(["demo", "--input-key", "a", "--out", str(tmp_path / "o")]) == 2
    assert "--input-key needs --input" in capsys.readouterr().err


def test_demo_input_narrow_tensor_is_tiled(capsys, tmp_path):
    rc, text, err, _ = _run_input(capsys, tmp_path, {"k": torch.randn(24, 128)})
    line = _input_line(text)
    assert rc == 0 and err.count("warning") == 0
    assert "main = 'k' [24, 128] float32 (the only tensor): -> 512: columns tiled 4x, 24 rows; " \
           "-> 576: columns tiled 5x and cut to 576, 24 rows" in line
    assert "index = 'k' [24, 128] float32 (the main tensor): -> 128: as is, 24 rows" in line


@pytest.mark.parametrize("values,what", [(torch.full((16, 128), 1e39, dtype=torch.float64), "beyond bf16's max"),
                                         (torch.full((16, 128), 1e39, dtype=torch.float64).float(),
                                          "already inf in the file"),
                                         (torch.zeros(16, 128), "all zeros"),
                                         (torch.full((16, 128), 1e-60, dtype=torch.float64), "underflow")],
                         ids=["overflow-f64", "inf-f32", "zeros", "underflow"])
def test_demo_input_overflow_or_zeros_warns(capsys, tmp_path, values, what):
    """Data that becomes inf or 0 in bf16: one warning line, NaN errors, never "lossless"."""
    rc, text, err, out = _run_input(capsys, tmp_path, {"k": values})
    assert rc == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and what in warnings[0] and "'k'" in warnings[0]
    rows = _rows(text)
    assert rows and all(parts[6] == "nan" and parts[7] == "nan" for parts in rows.values())
    assert "lossless" not in text
    with open(out / demo.CSV_NAME) as fh:
        assert all(r["rel_err"] == "nan" for r in csv.DictReader(fh))
    assert (out / demo.PNG_NAME).read_bytes()[:8] == PNG_MAGIC


def test_demo_says_the_backend(capsys, tmp_path):
    rc, text, _, _ = _run_input(capsys, tmp_path, {"k": torch.randn(24, 128)})
    assert rc == 0 and "device cpu, backend reference" in text
    assert "TRITON_INTERPRET=1 kvfuse demo --backend triton" in text


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
    q, sf = R.quantize(y[:, :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    want = torch.cat([R.dequantize(q, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor), y[:, qd:]], dim=-1)
    assert torch.equal(back.view(torch.int16), want.view(torch.int16))
    assert 0 < demo.relative_error(back, y) < 0.5


def test_recall_at_k():
    s = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert demo.recall_at_k(s, s, 2) == 1.0
    assert demo.recall_at_k(s, torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0]]), 2) == 0.5
    assert demo.recall_at_k(-s, s, 2) == 0.0


# --------------------------------------------------------------------------- --model
def _model_rows(text):
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and ":" in parts[0] and parts[0].split(":")[0] in ("main", "index", "compressed"):
            rows[parts[0]] = parts
    return rows


@pytest.mark.parametrize("name", list(models.MODELS), ids=str)
def test_demo_model(capsys, tmp_path, name):
    """``kvfuse demo --model NAME``: one row per call site of the configuration, in its formats."""
    cfg = models.get(name)
    rc, text, out = _run(capsys, tmp_path, "--model", name.upper())       # names are case-insensitive
    assert rc == 0
    assert "96 tokens" in text and f"model {name}: " in text
    assert ("GPT-J at 128" if cfg.qk_head_dim == 192 else "GPT-J at 448") in text
    rows = _model_rows(text)
    expected = {f"{site}:{fmt.name}": (fmt, had) for site, fmt, had in demo.model_sites(cfg)}
    assert set(rows) == set(expected) and f"main:{cfg.main_format.name}" in rows
    for label, (fmt, had) in expected.items():
        parts = rows[label]
        assert int(parts[2]) == fmt.head_dim and int(parts[4]) == fmt.bytes_per_token
        assert parts[3] == ("yes" if had else "no")
        assert 0 < float(parts[6]) < 0.5 and float(parts[7]) >= float(parts[6])
        if label.startswith("index:"):
            assert 0.0 <= float(parts[8]) <= 1.0
        else:
            assert parts[8] == "-"
    if cfg.index_format is not None and cfg.index_norm_kind == "layer":
        style = "NEOX" if cfg.index_rope_is_neox else "GPT-J"
        assert f"LayerNorm, RoPE 64 {style} at 0{', Hadamard' if cfg.index_hadamard else ')'}" in text
    # two panels where the model has an index call site (its recall), the error panel alone otherwise
    assert (png_width(out / demo.PNG_NAME) > 1300) == (cfg.index_format is not None)
    with open(out / demo.CSV_NAME) as fh:
        table = list(csv.reader(fh))
    assert table[0] == list(demo.COLUMNS) and [r[0] for r in table[1:]] == list(expected)


def test_demo_unknown_model(capsys, tmp_path):
    assert cli.main(["demo", "--model", "llama-3", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "argument --model: invalid choice: 'llama-3'" in err and "deepseek-v3.2" in err


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v4-fp4"], ids=str)
def test_model_main_site_is_the_reference_chain(name):
    """The main row of --model runs the model's real call: V3 normalizes the 512-d latent only and
    rotates the tail 64 GPT-J style; V4 normalizes the whole 512 and rotates its tail 64 GPT-J style."""
    cfg = models.get(name)
    fmt = cfg.main_format
    x = demo.fit_width(demo.synthetic_batch(40, 5)["kv"], fmt.head_dim)
    y, back, _ = demo.model_write_and_read(cfg, "main", x, block_size=16, seed=5)
    pos, cs, w, _ = demo._model_inputs(cfg, "main", fmt, x, 5)
    if cfg.splits_k_pe():
        want = torch.cat([R.rmsnorm(x[:, :512], w, cfg.norm_eps), x[:, 512:]], dim=-1)
    else:
        want = R.rmsnorm(x, w, cfg.norm_eps)
    want = R.rope(want, pos, cs, 64, False, offset=fmt.head_dim - 64)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    qd = fmt.quant_dim
    q, sf = R.quantize(y[:, :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    deq = torch.cat([R.dequantize(q, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor), y[:, qd:]], dim=-1)
    assert torch.equal(back.view(torch.int16), deq.view(torch.int16))


def test_plot_legend_names_only_drawn_markers(tmp_path, monkeypatch):
    """A model without an index call site: its legend names the main marker (and the bf16 tail's where drawn),
    not the index ones; a chart with every kind names them all."""
    import matplotlib.figure
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: figures.append(fig))

    def legend(rows):
        demo.plot(rows, str(tmp_path / "x.png"), "t")
        return [t.get_text() for t in figures.pop().axes[0].get_legend().get_texts()]

    x = demo.fit_width(demo.synthetic_batch(40, 1)["kv"], 576)
    y, back, _ = demo.model_write_and_read(models.get("deepseek-v3"), "main", x, block_size=16, seed=1)
    main_only = [demo.score("main:FLASHMLA_V32", F.FLASHMLA_V32, False, y, back)]
    assert legend(main_only) == ["main / FlashMLA (512, 576)", "quantized dims only (without the bf16 tail)"]
    rows = demo.explore(demo.synthetic_batch(40, 1), 40, 16, 1, 8, 4, torch.device("cpu"), progress=False)
    assert legend(rows) == ["main / FlashMLA (512, 576)", "index (128)", "index (128) + Hadamard",
                            "quantized dims only (without the bf16 tail)", "lossless (0 error), on the bottom edge"]
