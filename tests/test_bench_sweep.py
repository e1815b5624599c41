"""The shape sweep: its grids, its check of onepass against eager, its budget, its report and its command."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from onepass import reference
from onepass.bench import sweep
from onepass.bench.case import fwd, fwd_bwd
from onepass.bench.harness import Ceilings
from onepass.cli import main

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6.0", "date": "2026-11-26 10:00 UTC",
       "command": "onepass bench sweep", "copy_GBps": 3000.0, "matmul_bf16_TFLOPs": 700.0, "grid": "quick",
       "compile": sweep.COMPILE_NOTE, "liger_kernel": "0.8.5", "transformers": None}


def _key(cell):
    return cell.grid, cell.case.op, cell.case.mode, tuple(sorted(cell.dims.items()))


def test_quick_is_a_subset_of_full_and_both_cover_every_op_and_mode():
    quick, full = sweep.build_cells("quick"), sweep.build_cells("full")
    assert {_key(c) for c in quick} < {_key(c) for c in full}
    ops = {(c.case.op, c.case.mode) for c in quick}
    assert ops == {(c.case.op, c.case.mode) for c in full}
    assert len(ops) == 19 and ("linear_cross_entropy", "fwd+bwd") in ops and ("softmax", "fwd") in ops
    assert len(quick) == 38 and len(full) == 636  # the quick grid's running time is estimated from its size
    # the odd widths models use, the ranges
    norm_widths = {c.dims["hidden"] for c in full if c.grid == "norm"}
    assert {768, 1536, 2304, 3072, 3584, 5120, 6144, 12288, 16384} <= norm_widths
    assert {c.dims["rows"] for c in full if c.grid == "norm"} == {1024, 4096, 16384, 65536}
    assert {c.dims["vocab"] for c in full if c.grid == "cross_entropy"} >= {32000, 262144}
    assert max(c.dims["hidden"] for c in full if c.grid == "activation") == 28672
    assert {c.dims["head_dim"] for c in full if c.grid == "rope"} >= {64, 256}
    assert all("causal" in c.case.shape for c in full if c.grid == "softmax")  # one softmax per shape and mode


def test_cells_carry_their_shape_and_largest_tensor():
    cells = {_key(c): c for c in sweep.build_cells("full")}
    ce = cells["cross_entropy", "cross_entropy", "fwd", (("tokens", 65536), ("vocab", 262144))]
    assert ce.case.shape == "65536x262144 bf16" and ce.tensor_bytes == 65536 * 262144 * 2 > sweep.MAX_TENSOR_BYTES
    norm = cells["norm", "add_rms_norm", "fwd+bwd", (("hidden", 2304), ("rows", 4096))]
    assert norm.case.bytes == 9 * 4096 * 2304 * 2 and norm.tensor_bytes == 4096 * 2304 * 2
    lce = cells["linear_cross_entropy", "linear_cross_entropy", "fwd+bwd",
                (("hidden", 3584), ("tokens", 8192), ("vocab", 151936))]
    assert lce.case.flops == 6 * 8192 * 3584 * 151936


def test_a_budget_cut_leaves_every_grid_measured_at_its_first_shape():
    cells = sweep.build_cells("full")
    first = cells[:19]  # one shape of each grid's ops, before any grid's second shape
    assert {c.grid for c in first} == set(sweep.GRIDS) and len({(c.case.op, c.case.mode) for c in first}) == 19


def test_the_op_filter_keeps_the_ops_whose_name_contains_it():
    assert {c.case.op for c in sweep.build_cells("quick", only="rms_norm")} == {"rms_norm", "add_rms_norm"}
    assert {c.case.op for c in sweep.build_cells("full", only="cross_entropy")} == {
        "cross_entropy", "linear_cross_entropy"}
    assert sweep.build_cells("quick", only="attention") == []
    with pytest.raises(ValueError, match="grid 'huge'"):
        sweep.build_cells("huge")


def test_results_of_a_subset_go_beside_the_full_grids():
    assert sweep.sweep_stem("full", None) == "sweep"
    assert sweep.sweep_stem("quick", None) == "sweep-quick"
    assert sweep.sweep_stem("full", "rms norm") == "sweep-only-rms_norm"


def test_the_check_compares_outputs_and_every_gradient_against_eager():
    x = torch.randn(64, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True)

    def wrong(x, w, eps):  # right output, a weight gradient 10% too large
        return reference.rms_norm(x, w * (1 + 0.1 * (w - w.detach())), eps)

    same = sweep.check({"onepass": fwd(reference.rms_norm, x, w, 1e-6), "eager": fwd(reference.rms_norm, x, w, 1e-6)})
    assert same["passed"] is True and list(same["errors"]) == ["output 0"] and same["errors"]["output 0"] == 0.0
    # the two steps draw their random upstream gradients from one seed: equal gradients pass
    grads = sweep.check({"onepass": fwd_bwd(reference.rms_norm, x, w, 1e-6),
                         "eager": fwd_bwd(reference.rms_norm, x, w, 1e-6)})
    assert grads["passed"] is True and list(grads["errors"]) == ["grad 0", "grad 1"]
    bad = sweep.check({"onepass": fwd_bwd(wrong, x, w, 1e-6), "eager": fwd_bwd(reference.rms_norm, x, w, 1e-6)})
    assert bad["passed"] is False and bad["errors"]["grad 0"] < 1e-6 < 0.02 < bad["errors"]["grad 1"]
    nan = sweep.check({"onepass": fwd(lambda x: x * torch.nan, x), "eager": fwd(lambda x: x, x)})
    assert nan["passed"] is False and nan["errors"]["output 0"] == "inf"
    broken = sweep.check({"onepass": fwd(reference.rms_norm, x, w), "eager": fwd(lambda x, w: 1 / 0, x, w)})
    assert broken["passed"] is None and broken["error"].startswith("ZeroDivisionError")


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sweep, "measure_ceilings", lambda: Ceilings(3000.0, 700.0))
    monkeypatch.setattr(sweep, "environment", lambda ceilings: dict(ENV))


def test_the_sweep_writes_every_cell_and_skips_the_too_large_and_those_past_its_budget(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch)
    ran, written_before = [], []

    def run_cell(case, ceilings, log):
        ran.append(case.shape)
        written = json.loads((tmp_path / "h100-80gb-hbm3" / "sweep-only-cross_entropy.json").read_text())
        written_before.append(len(written["cells"]))
        return {"check": {"passed": True}, "rows": []}

    monkeypatch.setattr(sweep, "_run_cell", run_cell)
    path = sweep.run_sweep("full", "cross_entropy", tmp_path, log=lambda line: None)
    cells = json.loads(path.read_text())["cells"]
    too_large = [c for c in cells if "skipped" in c]
    assert len(cells) == 2 * 24 + 36 and len(ran) == len(cells) - len(too_large) > 0
    assert {c["shape"] for c in too_large} >= {"65536x262144 bf16", "16384x151936 bf16"}
    assert all(c["tensor_bytes"] > sweep.MAX_TENSOR_BYTES for c in too_large)
    # a cell at a time: a run cut short keeps what it measured
    assert written_before[0] == 0 and all(a < b for a, b in zip(written_before, written_before[1:]))

    ran.clear()
    path = sweep.run_sweep("quick", "rope", tmp_path, max_minutes=0, log=lambda line: None)
    cells = json.loads(path.read_text())["cells"]
    assert path.name == "sweep-quick-only-rope.json" and not ran
    assert [c["skipped"] for c in cells] == ["time budget: 0 minutes spent"] * 4
    # a new run without --resume keeps the earlier one's file aside rather than writing over it
    said, earlier = [], path.read_text()
    monkeypatch.setattr(sweep, "_version", lambda dist: None)  # as where liger-kernel is not installed
    sweep.run_sweep("quick", "rope", tmp_path, max_minutes=0, log=said.append)
    assert path.with_suffix(".previous.json").read_text() == earlier and any("moved to" in line for line in said)
    assert sweep.NO_LIGER in said  # a ratio against fewer peers is said to be one


def test_a_resumed_sweep_measures_only_what_the_budget_skipped(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch)
    ran = []
    monkeypatch.setattr(sweep, "_run_cell", lambda case, ceilings, log: ran.append((case.mode, case.shape)) or {
        "check": {"passed": True}, "rows": [{"variant": "onepass", "run": len(ran)}]})
    clock = iter(range(0, 10**6, 60))  # a minute a cell
    monkeypatch.setattr(sweep.time, "monotonic", lambda: next(clock))
    first = sweep.run_sweep("quick", "rope", tmp_path, max_minutes=1.5, log=lambda line: None)
    measured = [(c["mode"], c["shape"]) for c in json.loads(first.read_text())["cells"] if "skipped" not in c]
    assert 0 < len(measured) < 4 and ran == measured
    said, ran[:] = [], []
    again = sweep.run_sweep("quick", "rope", tmp_path, resume=True, log=said.append)
    data = json.loads(again.read_text())
    assert again == first and len(ran) == 4 - len(measured) and not set(ran) & set(measured)
    assert all("skipped" not in c for c in data["cells"]) and len(data["cells"]) == 4
    kept = [c for c in data["cells"] if (c["mode"], c["shape"]) in measured]
    assert all(c["rows"][0]["run"] <= len(measured) for c in kept)  # the first run's numbers, not remeasured
    assert len(data["env"]["runs"]) == 2 and f"resuming {first}: {len(measured)} cells kept, run 2" in said
    assert "Measured in 2 runs (`--resume`)" in sweep.to_markdown(data)
    # another GPU's or grid's file is not resumed
    monkeypatch.setattr(sweep, "environment", lambda ceilings: {**ENV, "gpu": "NVIDIA H200"})
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "sweep-quick-only-rope.json").write_text(again.read_text())
    with pytest.raises(ValueError, match="cannot resume .* on NVIDIA H100 80GB HBM3, this run is the quick grid "
                                         "on NVIDIA H200"):
        sweep.run_sweep("quick", "rope", tmp_path, resume=True, log=lambda line: None)


def _cell(op, mode, dims, times, passed=True, bytes_=0, tensor_bytes=2**28, **extra):
    """A cell as the sweep writes it; ``times``: {variant: (wall ms, GPU ms)}."""
    rows = [{"variant": v, "ms": ms, "gpu_ms": gpu, "frac_copy": bytes_ / ms / 1e6 / 3000 if ms else None}
            for v, (ms, gpu) in times.items()]
    return {"grid": op, "op": op, "mode": mode, "shape": "x".join(map(str, dims.values())) + " bf16",
            "axes": list(dims), "dims": dims, "tensor_bytes": tensor_bytes, "bytes": bytes_, "flops": 0,
            "check": {"passed": passed}, "rows": rows, **extra}


def _synthetic(tmp_path):
    cells = [
        _cell("rms_norm", "fwd", {"rows": 4096, "hidden": 2304},
              {"onepass": (0.10, 0.09), "eager": (1.0, 1.0), "torch.compile": (0.12, 0.08), "liger": (0.2, 0.1)},
              bytes_=2 * 4096 * 2304 * 2, tensor_bytes=4096 * 2304 * 2),
        _cell("rms_norm", "fwd", {"rows": 4096, "hidden": 5120},
              {"onepass": (0.10, 0.10), "eager": (1.0, 1.0), "torch": (0.2, 0.2)}, bytes_=2 * 4096 * 5120 * 2,
              tensor_bytes=2**30),
        _cell("rms_norm", "fwd", {"rows": 65536, "hidden": 2304}, {}, passed=False,
              check={"passed": False, "errors": {"output 0": 0.5}}),
        _cell("rms_norm", "fwd", {"rows": 65536, "hidden": 5120}, {}, skipped="time budget: 5 minutes spent"),
        _cell("linear_cross_entropy", "fwd+bwd", {"hidden": 4096, "vocab": 128256},
              {"onepass": (20.0, 19.0), "onepass_fp32_accum": (10.0, 9.0), "three_matmuls": (15.0, 15.0),
               "eager": (40.0, 39.0)}),
    ]
    path = tmp_path / "sweep-quick.json"
    path.write_text(json.dumps({"env": ENV, "cells": cells}))
    return path


def test_the_ratio_is_the_best_peers_time_over_onepasss_and_ignores_its_own_variants_and_floors(tmp_path):
    cells = json.loads(_synthetic(tmp_path).read_text())["cells"]
    assert sweep.ratio(cells[0], "gpu_ms") == pytest.approx((0.08 / 0.09, "torch.compile"))
    assert sweep.ratio(cells[0], "ms") == pytest.approx((0.12 / 0.10, "torch.compile"))
    assert sweep.ratio(cells[4], "ms") == (2.0, "eager")  # not onepass_fp32_accum, not the three matmuls
    assert sweep.ratio(cells[2], "ms") is None


def test_the_report_without_matplotlib_is_markdown_only(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    said = []
    written = sweep.write_report(_synthetic(tmp_path), tmp_path / "report", log=said.append)
    assert written == [tmp_path / "report" / "sweep-quick.md"] and "no heatmaps" in said[0]
    text = written[0].read_text()
    assert text.startswith("# onepass sweep (quick grid) on NVIDIA H100 80GB HBM3")
    assert "Liger peer is left out" not in text
    assert "| rms_norm | fwd | 4 | 1 | 1 | 0.89 / 2.00 | 1.20 / 2.00 |" in text  # min / median over 2 cells
    assert "| linear_cross_entropy | fwd+bwd | 1 | 0 | 0 | 2.05 / 2.05 | 2.00 / 2.00 |" in text
    below = text.split("## Below 0.97x of the best peer")[1].split("##")[0]
    assert below.count("| rms_norm") == 1
    assert "| rms_norm | fwd | 4096x2304 bf16 | GPU | 0.090 | torch.compile | 0.080 | 0.89 |" in below
    assert "| rms_norm | fwd | 65536x2304 bf16 | {'output 0': 0.5} |" in text  # the failed check
    assert "| rms_norm | fwd | 65536x5120 bf16 | time budget: 5 minutes spent |" in text
    # bandwidth only for memory-bound cells past 64 MiB: 4096x2304 is 18 MiB
    bandwidth = text.split("copy bandwidth: memory-bound")[1].split("##")[0]
    assert "4096x5120" in bandwidth and "4096x2304" not in bandwidth and "linear" not in bandwidth
    assert f"| {2 * 4096 * 5120 * 2 / 0.1 / 1e6:.0f} | " in bandwidth


def test_a_cell_that_could_not_run_keeps_its_error_on_one_table_row(tmp_path):
    data = json.loads(_synthetic(tmp_path).read_text())
    error = "CompilationError: at 68:8:\n    d = tl.where(m, h - shift, 0.0)\n    acc |= d"
    data["cells"].append(_cell("rms_norm", "fwd", {"rows": 1024, "hidden": 12288}, {},
                               check={"passed": None, "error": error}))
    unchecked = sweep.to_markdown(data).split("## Not checked")[1].split("##")[0].strip().splitlines()
    assert unchecked[2:] == ["| rms_norm | fwd | 1024x12288 bf16 | CompilationError: at 68:8: "
                             "d = tl.where(m, h - shift, 0.0) acc \\|= d |"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_the_report_draws_one_heatmap_per_op_and_mode(tmp_path):
    written = sweep.write_report(_synthetic(tmp_path))
    pngs = [p.name for p in written if p.suffix == ".png"]
    assert pngs == ["sweep-quick-rms_norm-fwd.png", "sweep-quick-linear_cross_entropy-fwd_bwd.png"]
    assert all((tmp_path / p).read_bytes().startswith(b"\x89PNG") for p in pngs)


def test_the_commands(tmp_path, capsys, monkeypatch):
    if not torch.cuda.is_available():
        assert main(["bench", "sweep"]) == 2
        assert "need a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert main(["bench", "sweep-report", str(_synthetic(tmp_path))]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "sweep-quick.md")]
    assert main(["bench", "sweep-report", str(tmp_path / "nosuch.json")]) == 2
    assert "no file" in capsys.readouterr().err
    for text in ("{not json", '{"cells": []}'):  # (the second: analyze's report, say: no env)
        (tmp_path / "other.json").write_text(text)
        assert main(["bench", "sweep-report", str(tmp_path / "other.json")]) == 2
        assert "is not a sweep's JSON" in capsys.readouterr().err
    _fake_gpu(monkeypatch)
    assert main(["bench", "sweep", "--only", "attention", "--out", str(tmp_path)]) == 2
    assert "no op of the sweep's grids contains 'attention'" in capsys.readouterr().err


def test_a_report_without_liger_says_its_ratios_leave_that_peer_out(tmp_path):
    data = json.loads(_synthetic(tmp_path).read_text())
    data["env"]["liger_kernel"] = None
    assert f"**{sweep.NO_LIGER}.**" in sweep.to_markdown(data)

