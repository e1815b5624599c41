"""The cells of issue 31's table, each through the sweep's harness (checked against eager, then
GPU time and wall time of onepass and every peer), to tell a slow kernel from a slow host.

    python benchmarks/issue31_cells.py
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from onepass.bench.harness import measure_ceilings, run_case
from onepass.bench.sweep import check

CELLS = (  # (suite, op, mode, the shape's keywords), as the issue lists them
    ("norm", "layer_norm", "fwd+bwd", {"rows": 16384, "hidden": 5120}),
    ("activation", "bias_gelu", "fwd+bwd", {"rows": 32768, "hidden": 3072}),
    ("norm", "rms_norm", "fwd+bwd", {"rows": 2048, "hidden": 16384}),
    ("norm", "rms_norm", "fwd+bwd", {"rows": 8192, "hidden": 2048}),
    ("norm", "rms_norm", "fwd", {"rows": 8192, "hidden": 2048}),
    ("loss", "cross_entropy", "fwd+bwd", {"tokens": 4096, "vocab": 32000}),
    ("norm", "rms_norm", "fwd+bwd", {"rows": 16384, "hidden": 5120}),
    ("loss", "cross_entropy", "fwd+bwd", {"tokens": 8192, "vocab": 151936}),
)


def main():
    ceilings = measure_ceilings()
    print(f"copy {ceilings.copy_gbps:.0f} GB/s")
    for suite, op, mode, dims in CELLS:
        case = next(c for c in importlib.import_module(f"onepass.bench.suites.{suite}").cases(**dims)
                    if c.op == op and c.mode == mode)
        thunks = case.make()
        print(f"{op} {mode} {case.shape}: check {check(thunks)['passed']}", flush=True)
        for row in run_case(replace(case, make=lambda: thunks), ceilings, log=lambda *_: None):
            if row.ms:
                print(f"    {row.variant:<16} wall {row.ms:7.3f} ms   GPU {row.gpu_ms or 0:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
