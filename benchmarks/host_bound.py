"""Which benchmark rows are bound by the host (Python and launch time), which by the GPU.

    python benchmarks/host_bound.py --suite norm [--suite rope ...] [--only rms]

For every variant of every case of the named suites it prints three times per step:
``bench`` as the harness measures it (``do_bench``: cache cleared, the step's host time
exposed wherever it outruns the GPU), ``gpu`` from replaying a CUDA graph of the step
(no host time at all), and ``host``, the CPU time of one step when the GPU keeps up.
A row whose bench time sits above its gpu time, with a host time near or above it, is
host-bound: faster kernels will not move it, a leaner Python path will.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph


def host_us(thunk, n=100) -> float:
    """Host time a step, over ``n`` steps issued back to back (the GPU queue absorbs the kernels)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        thunk()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="append", required=True)
    parser.add_argument("--only", default=None, help="keep the cases whose op name contains this")
    args = parser.parse_args()
    print(f"{'case':<44} {'variant':<16} {'bench ms':>9} {'gpu ms':>9} {'host ms':>9}")
    for suite in args.suite:
        for case in importlib.import_module(f"onepass.bench.suites.{suite}").cases():
            if args.only and args.only not in case.op:
                continue
            for name, thunk in case.make().items():
                thunk()
                bench = do_bench(thunk, warmup=25, rep=100, return_mode="median")
                try:
                    gpu = f"{do_bench_cudagraph(thunk, rep=100, return_mode='median'):9.4f}"
                except Exception as e:  # a step that cannot be captured still gets its other times
                    gpu = f"{type(e).__name__:>9}"
                label = f"{case.op} {case.mode}"
                print(f"{label:<44} {name:<16} {bench:9.4f} {gpu} {host_us(thunk) / 1e3:9.4f}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
