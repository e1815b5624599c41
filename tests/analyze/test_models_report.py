"""Built-in models on meta and real tensors, report files, the command line, and the GPU side."""

import json
import os
from xml.etree import ElementTree

import pytest
import torch

from onepass.analyze import analyze
from onepass.analyze.cli import main
from onepass.models.configs import CONFIGS, build


def key_figures(report):
    ops = [(op.name, op.phase, op.module, op.bytes_read, op.bytes_written, op.flops) for op in report.ops]
    chains = [(c.pattern, c.module, c.unfused_bytes, c.fused_bytes) for c in report.fusion.chains]
    return ops, chains


def test_llama_1b_on_meta_tensors():
    model = build("llama-1b")  # meta: nothing allocated
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.236e9, rel=1e-3)
    ids = torch.randint(0, 128256, (1, 2048), device="meta")
    report = analyze(model, ids, gpu="H100", use_cache=False, quiet=True)
    assert report.meta and report.record_seconds < 60
    (lm_head,) = [op for op in report.ops if op.module == "lm_head"]
    assert lm_head.flops == 2 * 2048 * 2048 * 128256
    assert lm_head.bytes_read == (2048 * 2048 + 128256 * 2048) * 2  # tied table, bf16, read once
    ops = {c.onepass_op for c in report.fusion.chains}
    assert {"onepass.ops.add_rms_norm", "onepass.ops.rms_norm", "onepass.ops.rope", "onepass.ops.swiglu"} <= ops
    assert sum(c.pattern == "residual add + RMSNorm" for c in report.fusion.chains) == 2 * 16
    assert sum(op.kind == "attention" for op in report.ops) == 16
    t = report.totals()
    assert 0 < t["saved_ms"] < t["memory_bound_ms"] < t["roofline_ms"]


@pytest.mark.parametrize("name,mode", [("llama-tiny", "train"), ("gpt2-tiny", "forward")])
def test_meta_run_matches_a_real_run(name, mode):
    torch.manual_seed(0)
    real = build(name, "cpu", torch.float32)
    meta = build(name, "meta", torch.float32)
    ids = torch.randint(0, 200, (2, 24))
    figures = []
    for model, x in ((real, ids), (meta, ids.to("meta"))):
        kwargs = {"use_cache": False, **({"labels": x} if mode == "train" else {})}
        figures.append(key_figures(analyze(model, x, mode=mode, quiet=True, **kwargs)))
    assert figures[0] == figures[1]
    # meta=True turns a real model's step into a meta one without touching its weights
    kwargs = {"use_cache": False, **({"labels": ids} if mode == "train" else {})}
    converted = analyze(real, ids, mode=mode, meta=True, quiet=True, **kwargs)
    assert key_figures(converted)[1] == figures[0][1] and not next(real.parameters()).is_meta


def test_train_mode_finds_the_loss_and_backward_chains():
    model = build("gpt2-tiny", "meta", torch.float32)
    ids = torch.randint(0, 200, (2, 16), device="meta")
    report = analyze(model, ids, mode="train", labels=ids, use_cache=False, quiet=True)
    found = {(c.onepass_op, c.phase) for c in report.fusion.chains}
    assert ("onepass.ops.linear_cross_entropy", "forward") in found
    assert ("onepass.ops.bias_gelu", "backward") in found
    assert ("onepass.ops.add_layer_norm", "forward") in found
    assert model.training is False  # restored


def test_report_files(tmp_path):
    model = build("llama-tiny", "meta")
    report = analyze(model, torch.randint(0, 200, (1, 32), device="meta"), use_cache=False, quiet=True)
    paths = report.write(str(tmp_path / "rep"))
    assert sorted(os.path.basename(p) for p in paths) == ["report.html", "report.json", "report.md", "roofline.svg"]
    data = json.loads(open(tmp_path / "rep" / "report.json").read())
    assert data["totals"]["bytes"] == sum(op["bytes_read"] + op["bytes_written"] for op in data["ops"])
    assert data["chains"] and data["layers"] and data["gpu"]["name"] == "H100"
    html = open(tmp_path / "rep" / "report.html").read()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and html.rstrip().endswith("</html>")
    md = open(tmp_path / "rep" / "report.md").read()
    assert "![roofline](roofline.svg)" in md and "| region |" in md
    svg = ElementTree.fromstring(open(tmp_path / "rep" / "roofline.svg").read())  # well-formed XML
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}circle")) > 0
    (single,) = report.write(str(tmp_path / "one.json"))
    assert json.loads(open(single).read())["title"] == data["title"]
    assert "Fusion opportunities" in report.table()


def test_cli(tmp_path, capsys):
    assert main(["--model", "gpt2-tiny", "--seq", "16", "--mode", "train", "--gpu", "a100", "--quiet",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "A100" in out and "report.html" in out
    assert json.loads((tmp_path / "report.json").read_text())["mode"] == "train"
    assert main(["--model", "gpt2-tiny", "--seq", "0"]) == 2
    assert main(["--model", "gpt2-tiny", "--seq", "257"]) == 2  # past its 256 positions
    assert "256 positions" in capsys.readouterr().err
    assert main(["--model", "gpt2-tiny", "--quiet"]) == 0  # the default seq: its 256 positions, not 2048
    assert "seq 256" in capsys.readouterr().out
    assert main(["--model", "gpt2-tiny", "--top", "0"]) == 2
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["--model", "gpt2-tiny", "--out", str(tmp_path / "notes.txt")]) == 2  # a file, not a folder
    assert "not a folder" in capsys.readouterr().err
    assert main(["--model", "gpt2-tiny", "--quiet", "--out", str(tmp_path / "report.json")]) == 0  # one report file
    capsys.readouterr()
    assert main(["--model", "gpt2-tiny", "--quiet", "--out", str(tmp_path / "notes.txt" / "sub")]) == 2
    assert "cannot write" in capsys.readouterr().err  # said before the analysis, in one line
    (tmp_path / "old.json").mkdir()
    assert main(["--model", "gpt2-tiny", "--quiet", "--out", str(tmp_path / "old.json")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"onepass analyze: --out {tmp_path / 'old.json'} is a folder, not a report file (a folder for every report "
        "file: name it without the suffix)"]
    assert main(["--model", "gpt2-tiny", "--quiet", "--out", str(tmp_path / "report.txt")]) == 0
    assert "report.txt is taken as a folder (one-file reports end in .json, .md, .html)" in capsys.readouterr().err
    assert (tmp_path / "report.txt" / "report.json").is_file()


def test_cli_takes_a_config_json(tmp_path, capsys):
    """--model takes a local config.json, or its folder: the same report as the built-in name it was saved from;
    a name that is neither is refused in one line naming the built-in names, before --out is made."""
    CONFIGS["llama-tiny"]().save_pretrained(tmp_path / "tiny")  # writes tiny/config.json, no weights
    reports = {}
    for model in ("llama-tiny", str(tmp_path / "tiny" / "config.json"), str(tmp_path / "tiny")):
        out = tmp_path / f"out{len(reports)}"
        assert main(["--model", model, "--seq", "16", "--mode", "train", "--quiet", "--out", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["title"].startswith(f"{model} batch 1 x seq 16")
        reports[model] = {key: report[key] for key in ("totals", "chains", "ops")}
    built_in, from_file, from_folder = reports.values()
    assert built_in["ops"] and from_file == built_in and from_folder == built_in
    capsys.readouterr()

    for bad in ("llama-70b", str(tmp_path / "missing" / "config.json"), str(tmp_path / "out0")):  # out0: no config
        assert main(["--model", bad, "--out", str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and bad in err and "llama-1b" in err and "config.json" in err
    assert not (tmp_path / "never").exists()
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["--model", str(tmp_path / "broken.json"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot build a causal LM" in err


def test_bad_names():
    with pytest.raises(ValueError, match="model"):
        build("llama-70b")
    with pytest.raises(ValueError, match="mode"):
        analyze(torch.relu, torch.randn(2), mode="inference")
    assert {"llama-1b", "gpt2"} <= set(CONFIGS)


@pytest.mark.gpu
def test_measured_side_on_gpu(tmp_path):
    torch.manual_seed(0)
    model = build("llama-1b", "cuda", torch.bfloat16)
    ids = torch.randint(0, 128256, (1, 2048), device="cuda")
    report = analyze(model, ids, measure=True, variants={"torch.compile": torch.compile(model)},
                     trace_dir=str(tmp_path), use_cache=False, quiet=True)
    m = report.measured
    assert report.gpu.source == "measured" and report.gpu.hbm_gbps > 500
    assert m["kernels_per_step"] > 100 and 0 <= m["idle_fraction"] < 1
    assert len(m["regions"]) == 16 and all(r["gbps"] > 0 for r in m["regions"])
    assert {"eager", "torch.compile"} <= set(m["variants"])
    assert m["variants"]["torch.compile"]["kernels_per_step"] < m["variants"]["eager"]["kernels_per_step"]
    assert os.path.getsize(tmp_path / "trace.json") > 0
    paths = report.write(str(tmp_path / "rep"))
    assert "Measured on" in open(paths[1]).read()


def test_onepass_analyze_stays_callable_and_leaves_no_gradients():
    """``onepass.analyze`` is the package once imported: calling it still runs ``analyze``;
    a train step's backward leaves the model's .grad as it found them."""
    import onepass

    model = build("llama-tiny", "cpu", torch.float32)
    ids = torch.randint(0, 200, (1, 8))
    for _ in range(2):
        assert onepass.analyze(model, ids, labels=ids, mode="train").mode == "train"
    assert all(p.grad is None for p in model.parameters())
