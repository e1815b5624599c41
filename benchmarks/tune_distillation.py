"""Sweep the distillation row kernel's launch settings on a GPU (onepass.ops.distillation.distill_settings).

    python benchmarks/tune_distillation.py [out.json]

Per vocabulary (32000, 128256, 151936, 262144), per divergence (beta 0: two passes; 0.5: three)
and per (max block, values a thread a row), times ``jsd_rows`` with the gradient on a chunk of
2048 rows of bf16 student and teacher logits (temperature 2, hard loss on), checks its losses
against the float32 definition once, and prints the time beside the copy bandwidth. GB/s count
the fused minimum: read both rows once, write the gradient (3 x 2 bytes an element). The
default setting is marked; paste the table into results/<gpu>/tune_distillation.log.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

import onepass.ops.distillation as distillation
from onepass import reference
from onepass.bench.harness import measure_ceilings

ROWS = 2048
VOCABS = (32000, 128256, 151936, 262144)
SETTINGS = ((2048, 8), (4096, 8), (4096, 4), (8192, 8), (8192, 16), (2048, 4), (16384, 16))
OPTIONS = dict(weight_hard=0.5, weight_soft=0.5, ignore_index=-100, temperature=2.0)


def check(z, y, target, beta) -> float:
    """Relative error of the kernel's summed loss against the float32 definition."""
    loss = torch.empty(ROWS, dtype=torch.float32, device="cuda")
    counts = torch.tensor([ROWS], dtype=torch.int32, device="cuda")
    zc = z.clone()
    distillation.jsd_rows(zc, y, target, loss, counts, True, beta=beta, **OPTIONS)
    soft = reference.generalized_jsd(z.float(), y.float(), beta, OPTIONS["temperature"]).sum()
    hard = torch.nn.functional.cross_entropy(z.float(), target, reduction="sum")
    ref = (OPTIONS["weight_soft"] * soft + OPTIONS["weight_hard"] * hard) / ROWS
    return abs(loss.sum().item() - ref.item()) / abs(ref.item())


def main(out: str | None) -> None:
    ceilings = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceilings.copy_gbps:.0f} GB/s")
    default = (distillation.DISTILL_MAX_BLOCK, distillation.DISTILL_VALUES_PER_THREAD)
    rows = []
    for vocab in VOCABS:
        z = (torch.randn(ROWS, vocab, device="cuda") * 3).to(torch.bfloat16)
        y = (torch.randn(ROWS, vocab, device="cuda") * 3).to(torch.bfloat16)
        target = torch.randint(0, vocab, (ROWS,), device="cuda")
        nbytes = 3 * ROWS * vocab * 2
        for beta in (0.0, 0.5):
            for block, per_thread in SETTINGS:
                distillation.DISTILL_MAX_BLOCK, distillation.DISTILL_VALUES_PER_THREAD = block, per_thread
                err = check(z, y, target, beta)
                loss = torch.empty(ROWS, dtype=torch.float32, device="cuda")
                counts = torch.tensor([ROWS], dtype=torch.int32, device="cuda")
                work = z.clone()  # (the gradient overwrites it; the kernel's work does not depend on the values)
                ms = do_bench(lambda: distillation.jsd_rows(work, y, target, loss, counts, True, beta=beta,
                                                            **OPTIONS), warmup=25, rep=100, return_mode="median")
                gbps = nbytes / ms / 1e6
                mark = " (default)" if (block, per_thread) == default else ""
                print(f"V={vocab:<7} beta={beta:<4} block={block:<6} values/thread={per_thread:<3} "
                      f"warps={distillation.distill_settings(vocab)[1]:<3} {ms:8.3f} ms {gbps:6.0f} GB/s "
                      f"({gbps / ceilings.copy_gbps:.0%} of copy) loss err {err:.1e}{mark}")
                rows.append(dict(vocab=vocab, beta=beta, block=block, values_per_thread=per_thread, ms=ms,
                                 gbps=gbps, loss_rel_err=err))
            distillation.DISTILL_MAX_BLOCK, distillation.DISTILL_VALUES_PER_THREAD = default
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": ceilings.copy_gbps, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
