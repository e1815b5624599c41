"""The one benchmark harness: ceilings first, then every variant of every case in one run.

For each case it times each variant with ``triton.testing.do_bench`` (median; cases marked
``cuda_graph`` by replaying a CUDA graph of the step, ``do_bench_cudagraph``), and beside
it the step's kernel time, the sum of its kernels' durations from torch.profiler (where the
two differ, the row waited on the Python and launch time of the step), derives
GB/s from the case's minimum bytes and TFLOP/s from its FLOPs, the fraction of the copy
bandwidth and matmul rate measured in the same run, and each peer's time over onepass's.
Results go to ``<out>/<gpu>/<suite>.json`` and a Markdown table beside it.
"""

from __future__ import annotations

import importlib
import json
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from onepass.bench.case import Case

SUITES = ["norm", "activation", "loss", "softmax", "rope", "attention", "decode_linear", "optim", "lora", "moe",
          "post_training", "distillation", "lm_head"]


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written
    matmul_tflops: float  # bf16 8192^3 on random data


@dataclass
class Row:
    op: str
    mode: str
    shape: str
    variant: str
    ms: float | None = None
    gpu_ms: float | None = None  # the step's kernels alone: the sum of their durations (torch.profiler)
    gbps: float | None = None
    tflops: float | None = None
    frac_copy: float | None = None
    frac_matmul: float | None = None
    peak_mib: float | None = None
    error: str | None = None
    onepass_speedup: float | None = None  # this variant's ms / onepass's ms (>1: onepass faster)


def _copy_gbps() -> float:
    n = 1 << 29  # 1 GiB of bf16: far past L2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def measure_ceilings() -> Ceilings:
    copy = _copy_gbps()  # (its 2 GiB freed before the matmuls)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return Ceilings(copy_gbps=copy, matmul_tflops=2 * 8192**3 / ms / 1e9)


def _peak_mib(thunk) -> float:
    """Peak memory of one step above what is allocated before it, the last step's gradients freed."""
    for t in getattr(thunk, "leaves", ()):
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    thunk()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_ms(thunk, steps: int = 5) -> float:
    """The summed durations of one step's GPU work (kernels, copies, fills), from torch.profiler.

    Not a CUDA graph replay: a step that cannot be captured (one that synchronises with the
    host, as some peers do) would leave torch's CUDA generator in capture mode for the rest
    of the run."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            thunk()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / steps / 1e3


def run_case(case: Case, ceilings: Ceilings, log=print) -> list[Row]:
    rows = []
    try:
        thunks = case.make()
    except Exception as e:  # a case that cannot build (e.g. out of memory) is reported, not fatal
        return [Row(case.op, case.mode, case.shape, "onepass", error=f"{type(e).__name__}: {e}"[:300])]
    for name, thunk in thunks.items():
        row = Row(case.op, case.mode, case.shape, name)
        try:
            thunk()  # compile / autotune outside the timed region
            if case.cuda_graph:
                row.ms = row.gpu_ms = do_bench_cudagraph(thunk, rep=100, return_mode="median")
            else:
                row.ms = do_bench(thunk, warmup=25, rep=100, return_mode="median")
                row.gpu_ms = kernel_ms(thunk)
            if case.bytes:
                row.gbps = case.bytes / row.ms / 1e6
                row.frac_copy = row.gbps / ceilings.copy_gbps
            if case.flops:
                row.tflops = case.flops / row.ms / 1e9
                row.frac_matmul = row.tflops / ceilings.matmul_tflops
            if case.measure_memory:
                row.peak_mib = _peak_mib(thunk)
        except Exception as e:
            row.error = f"{type(e).__name__}: {e}"[:300]
        log(f"    {name:<16} " + (f"{row.ms:8.3f} ms" if row.ms else f"failed: {row.error}")
            + (f" (kernels {row.gpu_ms:.3f})" if row.gpu_ms else "")
            + (f"  {row.gbps:7.0f} GB/s" if row.gbps else "") + (f"  {row.tflops:6.1f} TFLOP/s" if row.tflops else ""))
        rows.append(row)
    del thunks
    torch.cuda.empty_cache()
    ours = next((r.ms for r in rows if r.variant == "onepass" and r.ms), None)
    for r in rows:
        if ours and r.ms:
            r.onepass_speedup = r.ms / ours
    return rows


def environment(ceilings: Ceilings) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "copy_GBps": round(ceilings.copy_gbps, 1),
        "matmul_bf16_TFLOPs": round(ceilings.matmul_tflops, 1),
    }


def gpu_folder(name: str) -> str:
    return name.replace("NVIDIA ", "").replace(" ", "-").lower()


def to_markdown(suite: str, env: dict, rows: list[Row]) -> str:
    lines = [f"# {suite} on {env['gpu']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['date']}; "
             f"copy bandwidth {env['copy_GBps']:.0f} GB/s, bf16 matmul {env['matmul_bf16_TFLOPs']:.0f} TFLOP/s "
             "(measured in this run).", "", f"Command: `{env['command']}`", "",
             "\"GPU ms\": the summed durations of the step's kernels (torch.profiler; a CUDA graph replay for "
             "decode); \"ms\" is above it by the gaps between them, mostly host time the GPU waited for.", "",
             "| op | mode | shape | variant | ms | GPU ms | GB/s | % copy | TFLOP/s | peak MiB | its ms / onepass ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(v, spec):
        return format(v, spec) if v is not None else "—"

    for r in rows:
        lines.append(f"| {r.op} | {r.mode} | {r.shape} | {r.variant} | "
                     + (fmt(r.ms, '.3f') if r.error is None else f"failed: {r.error[:60]}")
                     + f" | {fmt(r.gpu_ms, '.3f')} | {fmt(r.gbps, '.0f')} | "
                     f"{fmt(r.frac_copy and 100 * r.frac_copy, '.1f')} | "
                     f"{fmt(r.tflops, '.1f')} | {fmt(r.peak_mib, '.0f')} | {fmt(r.onepass_speedup, '.2f')} |")
    return "\n".join(lines) + "\n"


def run_suites(names: list[str] | None = None, out_dir: str | Path = "benchmarks/results",
               only: str | None = None, log=print) -> dict[str, list[Row]]:
    """Run the named suites (all by default) on the current GPU and write their results.

    ``only`` keeps the cases whose op name contains it; their results go beside the full
    ones (``<suite>-only-<only>.json``), which stay as they were, and a suite with no such
    case writes nothing.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks need a CUDA GPU; without one, run `onepass selfcheck`")
    log("measuring the copy bandwidth and the bf16 matmul rate ...")
    ceilings = measure_ceilings()
    env = environment(ceilings)
    log(f"{env['gpu']}: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    folder = Path(out_dir) / gpu_folder(env["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for suite in names or SUITES:
        module = importlib.import_module(f"onepass.bench.suites.{suite}")
        cases = [c for c in module.cases() if only is None or only in c.op]
        if not cases:
            log(f"[{suite}] no case's op name contains {only!r}: nothing written")
            results[suite] = []
            continue
        stem = suite if only is None else f"{suite}-only-{re.sub(r'[^A-Za-z0-9_.]+', '_', only)}"
        rows: list[Row] = []
        for i, case in enumerate(cases, 1):
            log(f"[{suite} {i}/{len(cases)}] {case.op} {case.mode} {case.shape}")
            rows += run_case(case, ceilings, log)
        (folder / f"{stem}.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1))
        (folder / f"{stem}.md").write_text(to_markdown(suite, env, rows))
        results[suite] = rows
    return results
