"""Every op over a grid of real model shapes, against its peers, in one run; and its report.

Each grid takes one suite's cases (``onepass.bench.suites.<suite>.cases(**shape)``) over two
varying dimensions: widths models use (hidden 768 to 16384 with 2304, 3584, 5120, ...;
vocabularies 32000 to 262144; intermediate sizes to 28672; head dims 64 to 256) against
token counts (or batch x heads, sequence). For each cell the sweep first checks onepass's
outputs (forward) or input gradients (forward + backward) against the eager reference at
bf16 tolerance, then times every variant with the one harness (``run_case``): wall time as an
eager caller sees it and the kernels' summed GPU time. Results go to
``<out>/<gpu>/sweep.json`` one cell at a time, so a run cut short keeps what it measured;
``write_report`` turns them into heatmaps of onepass's ratio to the best peer and a Markdown
summary (no GPU needed).
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from onepass import DISTRIBUTION
from onepass.bench.case import Case, Thunk
from onepass.bench.harness import environment, gpu_folder, measure_ceilings, run_case
from onepass.bench.suites.rope import Q_HEADS
from onepass.testing import TOLERANCE

GRID_SIZES = ("quick", "full")
PEERS = ("eager", "torch.compile", "torch", "liger")  # not onepass's own variants, not floors (three_matmuls)
# The peers that are Python too (issue 31's eager wall-time target is against these; the C++ ops'
# host cost is the separate per-call target, benchmarks/host_overhead.py)
PYTHON_PEERS = ("torch.compile", "liger")
# Where liger-kernel is not installed its rows are absent from every cell: said at the start and in the report, for a
# ratio against the other peers alone reads as one against them all
NO_LIGER = ("liger-kernel is not installed in this run: the Liger peer is left out of every cell, whose ratios are "
            "against the other peers only (pip install liger-kernel)")
BELOW = 0.97  # a ratio under this is onepass losing to a peer, past the timing noise
BIG_TENSOR = 64 * 2**20  # past this a memory-bound op's bandwidth is the chip's, not the L2's
# The eager peers hold several fp32 copies of the largest tensor (logits, scores): past 4 GiB
# of bf16 they alone would fill an 80 GB card.
MAX_TENSOR_BYTES = 4 * 2**30
BF16 = 2  # bytes an element: every grid runs in bfloat16
COMPILE_NOTE = ("torch.compile: static shapes, compiled again for every cell after torch._dynamo.reset() "
                "(the peer at its best for each shape; no automatic-dynamic recompile, no fall-back to eager "
                "past dynamo's recompile limit)")
TOKENS = (1024, 4096, 16384, 65536)
VOCABS = (32000, 50257, 128256, 151936, 256000, 262144)


@dataclass(frozen=True)
class Grid:
    suite: str  # the suite whose cases(**shape) builds the cells
    ops: tuple[str, ...]  # the ops of its cases kept
    axes: tuple[str, str]  # the two keywords of cases() that vary: the heatmaps' rows and columns
    full: tuple[tuple[int, ...], tuple[int, ...]]  # the values of each axis
    quick: tuple[tuple[int, ...], tuple[int, ...]]  # a subset of them: a few minutes for every grid
    elements: Callable[[dict], int]  # elements of the largest tensor a cell makes (all bf16)
    fixed: dict = field(default_factory=dict)  # the other keywords of cases()
    shape_has: str = ""  # keep only the cases whose shape names this


def _rows_x_width(d):
    return d["rows"] * d["hidden"]


def _logits(d):
    return d["tokens"] * d["vocab"]


GRIDS = {
    "norm": Grid("norm", ("rms_norm", "layer_norm", "add_rms_norm"), ("rows", "hidden"),
                 full=(TOKENS, (768, 1536, 2048, 2304, 3072, 3584, 4096, 5120, 6144, 8192, 12288, 16384)),
                 quick=((16384,), (2304, 5120)), elements=_rows_x_width),
    # hidden here is the MLP's intermediate size (Llama 3 1B 8192, Llama 2 7B 11008, Llama 3 8B 14336,
    # Qwen2 7B 18944, Llama 3 70B 28672)
    "activation": Grid("activation", ("swiglu", "geglu", "bias_gelu"), ("rows", "hidden"),
                       full=(TOKENS, (2048, 3072, 5632, 8192, 11008, 14336, 18944, 28672)),
                       quick=((16384,), (11008, 14336)), elements=_rows_x_width),
    "cross_entropy": Grid("loss", ("cross_entropy",), ("tokens", "vocab"), full=(TOKENS, VOCABS),
                          quick=((4096,), (32000, 151936)), elements=_logits),
    # the eager peer's [tokens, V] logits set the size; the fused loss never makes them
    "linear_cross_entropy": Grid("loss", ("linear_cross_entropy",), ("hidden", "vocab"),
                                 full=((2048, 2304, 3584, 4096, 5120, 8192), VOCABS),
                                 quick=((2304, 4096), (128256,)), elements=_logits, fixed={"tokens": 8192}),
    "softmax": Grid("softmax", ("softmax",), ("batch_heads", "seq"), full=((16, 32, 64, 128), (1024, 2048, 4096, 8192)),
                    quick=((32,), (2048, 4096)), elements=lambda d: d["batch_heads"] * d["seq"] ** 2,
                    shape_has="causal"),
    # q has 32 heads, k 8 (grouped-query), as in the suite; 4 sequences, so 1024 to 65536 tokens
    "rope": Grid("rope", ("rope",), ("seq", "head_dim"), full=((256, 1024, 4096, 16384), (64, 80, 96, 128, 256)),
                 quick=((4096,), (64, 256)), elements=lambda d: d["batch"] * Q_HEADS * d["seq"] * d["head_dim"],
                 fixed={"batch": 4}),
}


@dataclass
class Cell:
    grid: str
    axes: tuple[str, str]
    dims: dict  # every keyword the case was built with
    case: Case
    tensor_bytes: int  # the largest tensor the cell makes


def build_cells(grid: str = "quick", only: str | None = None) -> list[Cell]:
    """The cells of every grid whose op name contains ``only`` (all by default), ordered so
    that a run stopped by its time budget has measured the first shapes of every grid."""
    if grid not in GRID_SIZES:
        raise ValueError(f"grid {grid!r}: expected one of {GRID_SIZES}")
    per_grid = []
    for name, g in GRIDS.items():
        if only is not None and not any(only in op for op in g.ops):
            continue
        suite = importlib.import_module(f"onepass.bench.suites.{g.suite}")
        shapes = []
        for a, b in itertools.product(*getattr(g, grid)):
            dims = {**g.fixed, g.axes[0]: a, g.axes[1]: b}
            shapes.append([Cell(name, g.axes, dims, case, g.elements(dims) * BF16)
                           for case in suite.cases(**dims)
                           if case.op in g.ops and g.shape_has in case.shape and (only is None or only in case.op)])
        per_grid.append(shapes)
    return [cell for group in itertools.zip_longest(*per_grid, fillvalue=[]) for shape in group for cell in shape]


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` as onepass.testing measures it, but on the GPU: its float64
    copy on the host would take seconds and tens of GB at the grid's largest tensors. The
    difference is rounded once to the inputs' dtype, which moves the measure by < 1%."""
    if out.shape != ref.shape:
        return math.inf
    diff = torch.linalg.vector_norm(out.detach() - ref.detach(), dtype=torch.float32).item()
    scale = torch.linalg.vector_norm(ref.detach(), dtype=torch.float32).item()
    err = diff / scale if scale > 0 else diff
    return err if math.isfinite(err) else math.inf  # NaN never passes


def _results(step: Thunk) -> dict[str, torch.Tensor]:
    """One step's outputs (forward) or its inputs' gradients (forward + backward: ``fwd_bwd``'s
    steps carry their leaves). The seed makes every step draw the same upstream gradients."""
    torch.manual_seed(0)
    out = step()
    leaves = getattr(step, "leaves", None)
    if leaves is not None:
        return {f"grad {i}": t.grad for i, t in enumerate(leaves)}
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return {f"output {i}": o for i, o in enumerate(outs) if isinstance(o, torch.Tensor)}


def check(thunks: dict[str, Thunk]) -> dict:
    """onepass's step against eager's at bf16 tolerance: ``passed`` True or False, or None
    where the check itself could not run (the eager reference out of memory, say)."""
    tol = TOLERANCE[torch.bfloat16]
    try:
        ours = _results(thunks["onepass"])
        ref = _results(thunks["eager"])
        if ours.keys() != ref.keys():
            return {"passed": False, "error": f"onepass gives {sorted(ours)}, eager {sorted(ref)}"}
        errors = {name: _rel_error(ours[name], ref[name]) for name in ours}
    except Exception as e:
        return {"passed": None, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"passed": all(e <= tol for e in errors.values()), "tolerance": tol,
            "errors": {k: (v if math.isfinite(v) else "inf") for k, v in errors.items()}}


def _run_cell(case: Case, ceilings, log) -> dict:
    """The cell's check, then its timings on the same inputs (freed when this returns)."""
    torch._dynamo.reset()  # see COMPILE_NOTE
    try:
        thunks = case.make()
    except Exception as e:  # out of memory, most likely: reported, not fatal
        return {"check": {"passed": None, "error": f"{type(e).__name__}: {e}"[:300]}, "rows": []}
    verdict = check(thunks)
    log(f"    check: {verdict}")
    if verdict["passed"] is False:  # a wrong onepass is not timed: its speed would mean nothing
        return {"check": verdict, "rows": []}
    rows = run_case(replace(case, make=lambda: thunks), ceilings, log)
    return {"check": verdict, "rows": [asdict(r) for r in rows]}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def sweep_stem(grid: str, only: str | None) -> str:
    """Results file name: a quick or ``only`` run writes beside the full grid's, never over it."""
    stem = "sweep" if grid == "full" else f"sweep-{grid}"
    return stem if only is None else f"{stem}-only-{re.sub(r'[^A-Za-z0-9_.]+', '_', only)}"


BUDGET_SKIP = "time budget"


def _earlier_cells(path: Path, env: dict) -> tuple[list[dict], dict[tuple[str, str, str], dict]]:
    """For ``resume``: the runs and the cells a run of the same grid on the same GPU wrote to
    ``path``, less those it skipped for its time budget (they run now)."""
    if not path.exists():
        return [], {}
    earlier = json.loads(path.read_text())
    old_env = earlier["env"]
    if (old_env["gpu"], old_env["grid"]) != (env["gpu"], env["grid"]):
        raise ValueError(f"cannot resume {path}: it holds the {old_env['grid']} grid on {old_env['gpu']}, "
                         f"this run is the {env['grid']} grid on {env['gpu']}")
    cells = {(c["op"], c["mode"], c["shape"]): c for c in earlier["cells"]
             if not c.get("skipped", "").startswith(BUDGET_SKIP)}
    return old_env.get("runs", [_run_summary(old_env)]), cells


def _run_summary(env: dict) -> dict:
    return {k: env[k] for k in ("date", "command", "copy_GBps", "matmul_bf16_TFLOPs")}


def run_sweep(grid: str = "quick", only: str | None = None, out_dir: str | Path = "benchmarks/results",
              max_minutes: float | None = None, log=print, resume: bool = False) -> Path:
    """Check and time every cell of ``grid`` ("quick" or "full") whose op name contains
    ``only``; after ``max_minutes`` no new cell starts (the rest are recorded as skipped).
    ``resume``: keep the cells an earlier run on this GPU wrote to the same file and measure
    only those it skipped for its time budget (a grid longer than one sitting, in parts; each
    cell's ratios come from one run). Returns the JSON file, rewritten after every cell."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks need a CUDA GPU; without one, run `onepass selfcheck`")
    cells = build_cells(grid, only)
    if not cells:
        raise ValueError(f"no op of the sweep's grids contains {only!r} (ops: "
                         f"{', '.join(op for g in GRIDS.values() for op in g.ops)})")
    start = time.monotonic()
    log("measuring the copy bandwidth and the bf16 matmul rate ...")
    ceilings = measure_ceilings()
    env = {**environment(ceilings), "grid": grid, "compile": COMPILE_NOTE,
           "liger_kernel": _version("liger-kernel"), "transformers": _version("transformers")}
    log(f"{env['gpu']}: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s; "
        f"{len(cells)} cells ({grid} grid)")
    if env["liger_kernel"] is None:
        log(NO_LIGER)
    path = Path(out_dir) / gpu_folder(env["gpu"]) / f"{sweep_stem(grid, only)}.json"
    runs, earlier = _earlier_cells(path, env) if resume else ([], {})
    env["runs"] = [*runs, _run_summary(env)]
    if earlier:
        log(f"resuming {path}: {len(earlier)} cells kept, run {len(env['runs'])}")
    elif resume:
        log(f"nothing to resume in {path}: every cell runs")
    elif path.exists():  # an earlier sitting's cells: kept aside, not written over
        kept = path.with_suffix(".previous.json")
        path.replace(kept)
        log(f"{path} was an earlier run's: moved to {kept} (--resume continues a run instead)")
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {"env": env, "cells": []}
    path.write_text(json.dumps(results, indent=1))
    for k, cell in enumerate(cells, 1):
        case = cell.case
        minutes = (time.monotonic() - start) / 60
        record = {"grid": cell.grid, "op": case.op, "mode": case.mode, "shape": case.shape, "axes": list(cell.axes),
                  "dims": cell.dims, "tensor_bytes": cell.tensor_bytes, "bytes": case.bytes, "flops": case.flops}
        if (case.op, case.mode, case.shape) in earlier:
            record = earlier[case.op, case.mode, case.shape]
        elif cell.tensor_bytes > MAX_TENSOR_BYTES:
            record["skipped"] = f"largest tensor {cell.tensor_bytes / 2**30:.1f} GiB > {MAX_TENSOR_BYTES / 2**30:.0f}"
        elif max_minutes is not None and minutes > max_minutes:
            record["skipped"] = f"{BUDGET_SKIP}: {max_minutes:g} minutes spent"
        else:
            log(f"[{k}/{len(cells)}, {minutes:.1f} min] {case.op} {case.mode} {case.shape}")
            record.update(_run_cell(case, ceilings, log))
            torch.cuda.empty_cache()  # the cell's inputs, freed on return
        results["cells"].append(record)
        path.write_text(json.dumps(results, indent=1))
    skipped = sum("skipped" in r for r in results["cells"])
    log(f"{len(cells) - skipped} cells measured, {skipped} skipped, in {(time.monotonic() - start) / 60:.1f} min: "
        f"{path}")
    return path


# ---- the report: JSON -> Markdown and heatmaps, no GPU needed

TIMINGS = (("gpu_ms", "GPU"), ("ms", "wall"))


def ratio(cell: dict, key: str, among: tuple[str, ...] = PEERS) -> tuple[float, str] | None:
    """(the best peer's time over onepass's, that peer) by ``key`` ("gpu_ms" or "ms"), the peers
    ``among``, or None where onepass or every such peer has no time."""
    times = {r["variant"]: r[key] for r in cell.get("rows", ()) if r.get(key)}
    peers = {v: t for v, t in times.items() if v in among}
    if "onepass" not in times or not peers:
        return None
    best = min(peers, key=peers.get)
    return peers[best] / times["onepass"], best


def _onepass_row(cell: dict) -> dict | None:
    return next((r for r in cell.get("rows", ()) if r["variant"] == "onepass" and r.get("ms")), None)


def _groups(cells: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["op"], c["mode"]), []).append(c)
    return groups


def _table_text(text, limit: int = 120) -> str:
    """``text`` as one Markdown table cell, cut at ``limit`` characters (the JSON keeps it whole): a
    compiler error's lines joined and its pipes escaped, so the row stays one row."""
    return " ".join(str(text).split())[:limit].replace("|", "\\|")


def to_markdown(data: dict) -> str:
    env, cells = data["env"], data["cells"]
    lines = [f"# onepass sweep ({env['grid']} grid) on {env['gpu']}", "",
             f"torch {env['torch']}, triton {env['triton']}, liger-kernel {env.get('liger_kernel') or '—'}, "
             f"transformers {env.get('transformers') or '—'}, {env['date']}; copy bandwidth {env['copy_GBps']:.0f} "
             f"GB/s, bf16 matmul {env['matmul_bf16_TFLOPs']:.0f} TFLOP/s (measured in this run).", "",
             f"Command: `{env['command']}`", ""]
    if not env.get("liger_kernel"):
        lines += [f"**{NO_LIGER}.**", ""]
    runs = env.get("runs", [])
    if len(runs) > 1:  # a resumed sweep: each cell was measured whole in one of these
        lines += [f"Measured in {len(runs)} runs (`--resume`), each cell within one: "
                  + "; ".join(f"{r['date']} (copy {r['copy_GBps']:.0f} GB/s)" for r in runs) + ".", ""]
    lines += [env["compile"] + ".", "",
              f"Ratio: the best peer's time ({', '.join(PEERS)}) over onepass's; below 1 a peer is faster. "
              "GPU: the step's kernels summed (torch.profiler); wall: the do_bench median, as an eager caller "
              f"sees it. Every cell's onepass output (or gradients) checked against eager first, relative error "
              f"at most {TOLERANCE[torch.bfloat16]} (bf16); the last column counts the Python peers only "
              f"({', '.join(PYTHON_PEERS)}).", "",
              "| op | mode | cells | check failed | skipped | GPU ratio min / median | wall ratio min / median | "
              "wall ratio, Python peers |", "|---|---|---|---|---|---|---|---|"]

    def spread(values):
        values = sorted(values)
        return f"{values[0]:.2f} / {values[len(values) // 2]:.2f}" if values else "—"

    for (op, mode), group in _groups(cells).items():
        spreads = [spread([r[0] for c in group if (r := ratio(c, key))]) for key, _ in TIMINGS]
        spreads.append(spread([r[0] for c in group if (r := ratio(c, "ms", PYTHON_PEERS))]))
        failed = sum(c.get("check", {}).get("passed") is False for c in group)
        lines.append(f"| {op} | {mode} | {len(group)} | {failed} | {sum('skipped' in c for c in group)} | "
                     f"{' | '.join(spreads)} |")

    failed = [c for c in cells if c.get("check", {}).get("passed") is False]
    if failed:
        lines += ["", "## Check failed (not timed)", "", "| op | mode | shape | relative errors |", "|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['mode']} | {c['shape']} | "
                  f"{_table_text(c['check'].get('errors') or c['check'].get('error'), 300)} |" for c in failed]
    unchecked = [c for c in cells if "check" in c and c["check"]["passed"] is None]
    if unchecked:
        lines += ["", "## Not checked", "", "| op | mode | shape | why |", "|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['mode']} | {c['shape']} | {_table_text(c['check']['error'])} |" for c in unchecked]

    lines += ["", f"## Below {BELOW}x of the best peer", "", "| op | mode | shape | time | onepass ms | best peer | "
              "its ms | ratio |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for key, label in TIMINGS:
            r = ratio(c, key)
            if r and r[0] < BELOW:
                ours = _onepass_row(c)[key]
                lines.append(f"| {c['op']} | {c['mode']} | {c['shape']} | {label} | {ours:.3f} | {r[1]} | "
                             f"{r[0] * ours:.3f} | {r[0]:.2f} |")

    lines += ["", f"## onepass against the copy bandwidth: memory-bound ops, tensors past {BIG_TENSOR // 2**20} MiB",
              "", "| op | mode | shape | GB/s (GPU) | % copy (GPU) | % copy (wall) |", "|---|---|---|---|---|---|"]
    for c in cells:
        row = _onepass_row(c)
        if row and c["bytes"] and not c["flops"] and c["tensor_bytes"] > BIG_TENSOR and row.get("gpu_ms"):
            gbps = c["bytes"] / row["gpu_ms"] / 1e6
            lines.append(f"| {c['op']} | {c['mode']} | {c['shape']} | {gbps:.0f} | "
                         f"{100 * gbps / env['copy_GBps']:.1f} | {100 * (row.get('frac_copy') or 0):.1f} |")

    skipped = [c for c in cells if "skipped" in c]
    if skipped:
        lines += ["", "## Skipped", "", "| op | mode | shape | why |", "|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['mode']} | {c['shape']} | {_table_text(c['skipped'])} |" for c in skipped]
    return "\n".join(lines) + "\n"


def _heatmap(op: str, mode: str, group: list[dict], path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    axes = group[0]["axes"]
    values = [sorted({c["dims"][a] for c in group}) for a in axes]
    fig, panels = plt.subplots(1, 2, figsize=(4 + 1.3 * len(values[1]) * 2, 1.5 + 0.6 * len(values[0])),
                               squeeze=False)
    for panel, (key, label) in zip(panels[0], TIMINGS):
        grid = [[math.nan] * len(values[1]) for _ in values[0]]
        notes = [[""] * len(values[1]) for _ in values[0]]
        for c in group:
            i, j = values[0].index(c["dims"][axes[0]]), values[1].index(c["dims"][axes[1]])
            r = ratio(c, key)
            if r:
                grid[i][j], notes[i][j] = r[0], f"{r[0]:.2f}\n{r[1]}"
            if "skipped" in c:
                notes[i][j] = "skipped"
            elif c.get("check", {}).get("passed") is False:
                notes[i][j] = "check\nfailed"
        finite = [v for row in grid for v in row if not math.isnan(v)] or [1.0]
        span = max(max(finite), 1 / min(finite), 1.1)  # as red at 1/2 as green at 2
        image = panel.imshow(grid, cmap="RdYlGn", aspect="auto", norm=TwoSlopeNorm(1.0, 1 / span, span))
        for i, j in itertools.product(range(len(values[0])), range(len(values[1]))):
            low = grid[i][j] < BELOW
            panel.text(j, i, notes[i][j], ha="center", va="center", fontsize=7, fontweight="bold" if low else None)
            if low:
                panel.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
        panel.set_xticks(range(len(values[1])), [str(v) for v in values[1]], rotation=45)
        panel.set_yticks(range(len(values[0])), [str(v) for v in values[0]])
        panel.set_xlabel(axes[1])
        panel.set_ylabel(axes[0])
        panel.set_title(f"{label} time: best peer / onepass")
        fig.colorbar(image, ax=panel)
    fig.suptitle(f"{op} {mode}, {env['gpu']} (boxed: below {BELOW}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(json_path: str | Path, out_dir: str | Path | None = None, log=print) -> list[Path]:
    """``<stem>.md`` beside the JSON (or in ``out_dir``) and, where matplotlib is installed,
    one heatmap PNG per op and mode; returns the files written."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    folder = Path(out_dir) if out_dir is not None else json_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    md = folder / f"{json_path.stem}.md"
    md.write_text(to_markdown(data))
    written = [md]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log(f"matplotlib is not installed: {md} only, no heatmaps (pip install '{DISTRIBUTION}[plots]')")
        return written
    for (op, mode), group in _groups(data["cells"]).items():
        png = folder / f"{json_path.stem}-{op}-{mode.replace('+', '_')}.png"
        _heatmap(op, mode, group, png, data["env"])
        written.append(png)
    return written
