"""Registers and spills of the kernels onepass compiles for the sweep's quick grid and the suites'
cases (one onepass step each, forward and forward+backward), on a GPU: the kernels whose live values
overflow the register file into local memory, worst first.

    python benchmarks/kernel_spills.py [suite ...]   (default: the quick grid, then every suite)

Only launches through ``dispatch.launch`` are listed (the compiled kernels it keeps); a spill found
here is a lead, to be confirmed by timing the kernel without it.
"""

from __future__ import annotations

import importlib
import sys

import torch

from onepass.bench.sweep import build_cells
from onepass.ops import dispatch

SUITES = ("attention", "decode_linear", "distillation", "lm_head", "lora", "loss", "moe", "optim", "post_training")


def _steps(names):
    if not names:
        for cell in build_cells("quick"):
            yield f"{cell.case.op} {cell.case.mode} {cell.case.shape}", cell.case
    for suite in names or SUITES:
        for case in importlib.import_module(f"onepass.bench.suites.{suite}").cases():
            yield f"{suite}: {case.op} {case.mode} {case.shape}", case


def main(names):
    for label, case in _steps(names):
        try:
            thunks = case.make()
            thunks["onepass"]()
            del thunks
        except Exception as e:  # a case that cannot run here (memory, a missing peer): reported, not fatal
            print(f"{label}: {type(e).__name__}: {str(e)[:100]}")
        torch.cuda.empty_cache()
    rows = []
    for (kernel, *_), compiled in dispatch._compiled_kernels.items():
        compiled._init_handles()
        arg_names = kernel.arg_names
        constants = {arg_names[k[0]] if isinstance(k, tuple) else k: v for k, v in compiled.src.constants.items()
                     if isinstance(v, (bool, int)) and (not isinstance(k, tuple) or arg_names[k[0]].isupper())}
        rows.append((compiled.n_spills, compiled.n_regs, compiled.metadata.num_warps, kernel.fn.__name__,
                     str(constants)[:150]))
    print(f"{torch.cuda.get_device_name()}: {len(rows)} compiled kernels; spills (bytes), registers, warps")
    for spills, regs, warps, name, constants in sorted(rows, key=lambda r: (-r[0], r[3])):
        print(f"{spills:6} {regs:4} {warps:3}  {name:<32} {constants}")


if __name__ == "__main__":
    main(sys.argv[1:])
