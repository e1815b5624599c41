"""The report a reader gets: the roofline plot, report.json's versions, the terminal width, the closing
summary, and an optimized model's report."""

import json
import re
import warnings
from xml.etree import ElementTree

import pytest
import torch

import onepass
from onepass.analyze import analyze
from onepass.analyze.report import SCHEMA_VERSION, fit_table, wrap
from onepass.models.configs import CONFIGS, build

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def llama_report():
    model = build("llama-tiny", "meta")
    return analyze(model, torch.randint(0, 200, (1, 32), device="meta"), use_cache=False, quiet=True)


def svg_of(report) -> ElementTree.Element:
    return ElementTree.fromstring(report.roofline_svg())  # well-formed XML


def texts(svg) -> str:
    return " ".join("".join(t.itertext()) for t in svg.iter(f"{SVG}text"))


def fake_measured(report, slower: float = 2.0) -> dict:
    """What measure.measure returns, made up: every layer and step ``slower`` times its roofline time."""
    t, f, regions = report.totals(), report.fusion, []
    for name, idx in f.regions().items():
        if name.startswith(f.trace.layer_prefix):
            nbytes = sum(report.ops[i].bytes for i in idx)
            ms = sum(f.seconds[i] for i in idx) * 1e3 * slower
            regions.append({"region": name, "kernel_ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6,
                            "fraction_of_copy": 0.5})
    return {"device": "a GPU", "idle_fraction": 0.05, "regions": regions,
            "variants": {"eager": {"step_ms": t["roofline_ms"] * slower, "kernels_per_step": 90},
                         "onepass": {"step_ms": t["fused_roofline_ms"] * slower, "kernels_per_step": 40}}}


def test_estimated_roofline_says_so_and_labels_every_point(llama_report):
    svg = svg_of(llama_report)
    words = texts(svg)
    assert "Estimated" in words and "every point sits on it" in words and "--measure" in words
    circles = svg.findall(f".//{SVG}circle")
    assert circles and all(c.find(f"{SVG}title") is not None and c.find(f"{SVG}title").text for c in circles)
    assert any(c.find(f"{SVG}title").text.startswith("aten.mm x") for c in circles)
    assert svg.findall(f".//{SVG}text[@class='label']")  # the largest points are labelled in place too


def _distance_to(polyline: str, x: float, y: float) -> float:
    pts = [tuple(map(float, p.split(","))) for p in polyline.split()]
    best = float("inf")
    for (ax, ay), (bx, by) in zip(pts, pts[1:]):
        t = max(0.0, min(1.0, ((x - ax) * (bx - ax) + (y - ay) * (by - ay)) / ((bx - ax) ** 2 + (by - ay) ** 2)))
        best = min(best, ((ax + t * (bx - ax) - x) ** 2 + (ay + t * (by - ay) - y) ** 2) ** 0.5)
    return best


def test_estimated_points_sit_on_a_roof_even_below_the_usual_axis():
    """Estimated from the roof, every op sits on one (the HBM slope or a peak), the embedding's backward
    (intensity ~0.002 FLOP/byte) too: the axis starts low enough for it."""
    from transformers import AutoModelForCausalLM

    config = CONFIGS["llama-tiny"]()
    config.vocab_size = 50000  # the embedding's backward writes a [vocab, hidden] gradient for 16 rows
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 200, (1, 16), device="meta")
    report = analyze(model, ids, mode="train", labels=ids, use_cache=False, quiet=True)
    (embedding_bwd,) = [op for op in report.ops if op.name == "aten.embedding_dense_backward"]
    assert 0 < embedding_bwd.flops / embedding_bwd.bytes < 0.01  # below the axis's usual start
    svg = svg_of(report)
    roofs = [r.get("points") for r in svg.findall(f".//{SVG}polyline[@class='roof']")]
    circles = [c for c in svg.findall(f".//{SVG}circle") if "no FLOPs" not in c.find(f"{SVG}title").text]
    assert len(roofs) == 2 and len(circles) > 10
    assert any(c.find(f"{SVG}title").text.startswith("aten.embedding_dense_backward") for c in circles)
    for c in circles:
        x, y = float(c.get("cx")), float(c.get("cy"))
        assert min(_distance_to(r, x, y) for r in roofs) < 1.5, c.find(f"{SVG}title").text


def test_roofline_has_gridlines_and_prints_the_roofs(llama_report):
    svg = svg_of(llama_report)
    grid = svg.findall(f".//{SVG}line[@class='grid']")
    assert len(grid) >= 8 + 6  # a line a decade: intensity 1e-2..1e5, FLOP/s 1e9..1e15
    words = texts(svg)
    assert "HBM 3,350 GB/s" in words and "bf16 matmul 989 TFLOP/s" in words and "fp32 67 TFLOP/s" in words


def test_zero_flop_ops_stand_in_their_own_column_inside_the_plot(llama_report):
    zero = [op for op in llama_report.ops if op.flops == 0 and op.bytes]
    assert zero  # the embedding gather and the copies
    svg = svg_of(llama_report)
    width, height = float(svg.get("width")), float(svg.get("height"))
    circles = {c.find(f"{SVG}title").text: c for c in svg.findall(f".//{SVG}circle")}
    zero_circles = [c for title, c in circles.items() if "no FLOPs" in title]
    assert {op.name for op in zero} == {title.split(" x")[0] for title in circles if "no FLOPs" in title}
    axis_left = min(float(c.get("cx")) for title, c in circles.items() if "no FLOPs" not in title)
    for c in zero_circles:
        x, y, r = float(c.get("cx")), float(c.get("cy")), float(c.get("r"))
        assert r < x < axis_left and r < y < height - r and x + r < width  # visible, left of the log axis


def test_measured_roofline_plots_achieved_against_attainable_side_by_side(llama_report):
    report = analyze(build("llama-tiny", "meta"), torch.randint(0, 200, (1, 32), device="meta"), use_cache=False,
                     quiet=True)
    report.measured = fake_measured(report, slower=2.0)
    svg = svg_of(report)
    words = texts(svg)
    assert "Unfused (eager): achieved vs attainable" in words and "onepass: achieved vs attainable" in words
    assert "Estimated" not in words
    circles = {c.find(f"{SVG}title").text: c for c in svg.findall(f".//{SVG}circle")}
    panel_width = float(svg.get("width")) / 2
    for name in ("eager step", "onepass"):
        attainable = next(c for t, c in circles.items() if t.startswith(f"{name}, attainable"))
        achieved = next(c for t, c in circles.items() if t.startswith(f"{name}, achieved"))
        assert achieved.get("cx") == attainable.get("cx")  # the same work: the same intensity
        assert float(achieved.get("cy")) > float(attainable.get("cy")) + 10  # twice as slow: lower on the plot
        assert "50% of attainable" in next(t for t in circles if t.startswith(f"{name}, achieved"))
        side = float(achieved.get("cx")) > panel_width
        assert side == (name == "onepass")  # unfused on the left, onepass on the right
    layers = [t for t in circles if t.startswith("model.layers.") and ", achieved" in t]
    assert len(layers) == len(report.measured["regions"])
    assert "Measured: eager" in report.next_step()
    report.optimized = True  # measured as given, the "eager" step of an optimized model runs its kernels
    assert "Unfused" not in texts(svg_of(report)) and "optimized" in texts(svg_of(report))


def test_report_json_carries_versions_and_schema(llama_report, tmp_path):
    (path,) = llama_report.write(str(tmp_path / "r.json"))
    data = json.loads(open(path).read())
    assert data["schema_version"] == SCHEMA_VERSION
    versions = data["versions"]
    assert versions["onepass"] == onepass.__version__ and versions["torch"] == torch.__version__
    import transformers

    assert versions["transformers"] == transformers.__version__
    assert data["times"] == "estimated" and data["optimized_model"] is False and data["recorded_on"] == "meta"
    assert data["next_step"] == llama_report.next_step()


@pytest.mark.parametrize("name,mode", [("llama-1b", "forward"), ("gpt2-tiny", "train")])
def test_terminal_lines_fit_120_columns_and_advice_is_whole(name, mode):
    model = build(name, "meta")
    ids = torch.randint(0, 200, (1, 256), device="meta")
    report = analyze(model, ids, mode=mode, use_cache=False, quiet=True, **({"labels": ids} if mode == "train" else {}))
    text = report.table(top=30)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "…" not in text
    lines = text.splitlines()
    start = lines.index("Design test: do not fuse / fuse something else")
    header, body = lines[start + 1], lines[start + 2:lines.index("", start)]
    column = header.index("why")
    rows = []  # the "why" cells, their wrapped lines joined again
    for line in body:
        if not line.startswith(" "):
            rows.append([])
        rows[-1].append(line[column:].strip())
    details = {flag.detail for flag in report.fusion.flags}
    assert rows and all(" ".join(r) in details for r in rows)  # every piece of advice whole, none cut
    assert re.sub(r"\s+", " ", report.next_step()) in re.sub(r"\s+", " ", text)


def test_wrap_and_fit_table_never_cut():
    assert wrap("model.layers.*.post_attention_layernorm", 20) == ["model.layers.*.post_", "attention_layernorm"]
    assert all(len(line) <= 12 for line in wrap("a" * 30, 12)) and "".join(wrap("a" * 30, 12)) == "a" * 30
    rows = [["compute-bound", "x" * 10, "because " * 30]]
    lines = fit_table(["case", "where", "why"], rows, limit=60)
    assert max(map(len, lines)) <= 60 and len(lines) > 2
    assert " ".join(line[27:].strip() for line in lines[1:]) == ("because " * 30).strip()


def test_closing_summary_names_the_next_step(llama_report):
    last = llama_report.table().rstrip().splitlines()
    tail = " ".join(last[last.index("Summary and next step"):])
    assert "Next step: onepass.optimize(model)" in tail and "--measure" in tail
    assert "## Next step" in llama_report.to_markdown() and "<h2>Next step</h2>" in llama_report.to_html()


def test_an_optimized_model_is_recorded_through_the_reference_path_and_says_so():
    model = build("llama-tiny", "cpu", torch.float32)
    ids = torch.randint(0, 200, (1, 16))
    plain = analyze(model, ids, use_cache=False, quiet=True)
    assert not plain.optimized and "optimized" not in plain.table().split("Summary")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optimize's warning about a CPU model
        onepass.optimize(model)
    try:
        with pytest.warns(UserWarning, match="reference_mode"):
            report = analyze(model, ids, use_cache=False, quiet=True)
    finally:
        onepass.undo(model)
    assert report.optimized and report.device == "cpu"
    heading = report.table().split("Summary")[0]
    assert "optimized by onepass" in heading and "reference path" in heading and "the CPU" in heading
    data = report.to_dict()
    assert data["optimized_model"] is True and data["recorded_on"] == "cpu"
    assert "before onepass.optimize" in data["next_step"]
    # the reference path is the unfused ops: the norms' pow/mean/rsqrt chains are there to see
    assert {"aten.rsqrt", "aten.mean"} <= {op.name for op in report.ops}


def test_analyze_imports_no_private_name_of_the_rest_of_onepass():
    """analyze/ looks at onepass from outside: its imports of the rest of onepass are public names."""
    import ast
    import pathlib

    import onepass.analyze.report as report_module

    folder = pathlib.Path(report_module.__file__).parent
    checked = 0
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onepass") \
                    and not node.module.startswith("onepass.analyze"):
                checked += 1
                assert not any(part.startswith("_") for part in node.module.split(".")), (path.name, node.module)
                assert not any(alias.name.startswith("_") for alias in node.names), (path.name, node.module)
    assert checked  # the test sees the imports it guards (patching's is_optimized and reference_mode)
