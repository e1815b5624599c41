"""linear_cross_entropy with the cross-entropy kernel on a second stream, against the op as it is.

    python benchmarks/tune_lce_overlap.py

The op's chunk loop runs four launches one after another: the logits GEMM, the
cross-entropy kernel (memory-bound, ~0.3 ms a 2048-token chunk at Llama-3.2-1B's shape),
the dx GEMM and the dW GEMM. Here each chunk's logits GEMM and dx GEMM run in ``split``
row pieces on the main stream, and the cross-entropy of each piece runs on a side stream
as soon as its logits are written, beside the next piece's GEMM: no more memory (the same
buffer), the same arithmetic. Whether the two kernels share the GPU depends on cuBLAS's
grid (a persistent GEMM keeps every SM until it ends), so the GEMMs' grids are printed
too. Each variant is checked against the op's own gradients and timed by do_bench
(median) and by the summed kernel time, at 8192 tokens x 2048 x 128256, bf16.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile

import torch
from triton.testing import do_bench

from onepass.bench.harness import kernel_ms, measure_ceilings
from onepass.ops.cross_entropy import ce_rows, count_targets
from onepass.ops.gemm import accumulate_mm

lce = importlib.import_module("onepass.ops.linear_cross_entropy")  # (the package exports the function by that name)
TOKENS, HIDDEN, VOCAB, CHUNK = 8192, 2048, 128256, 2048


def pipelined(h2, w, t, split: int, side: torch.cuda.Stream):
    """(loss, d_hidden, d_weight) as the op computes them for reduction "mean", the
    cross-entropy of each of a chunk's ``split`` row pieces on ``side``."""
    n, (vocab, hidden) = t.numel(), w.shape
    dev, main = h2.device, torch.cuda.current_stream()
    counts = count_targets(t, vocab, -100)
    loss_rows = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    d_hidden = torch.empty(n, hidden, dtype=h2.dtype, device=dev)
    d_weight = torch.empty(vocab, hidden, dtype=torch.float32, device=dev)
    scale = torch.ones((), dtype=torch.float32, device=dev)
    buf = torch.empty(CHUNK, vocab, dtype=h2.dtype, device=dev)
    for start in range(0, n, CHUNK):
        end = min(start + CHUNK, n)
        z, h_c = buf[: end - start], h2[start:end]
        step = -(-(end - start) // split)
        pieces = [(a, min(a + step, end - start)) for a in range(0, end - start, step)]
        done = []
        for a, b in pieces:
            torch.mm(h_c[a:b], w.t(), out=z[a:b])
            side.wait_stream(main)
            with torch.cuda.stream(side):
                ce_rows(z[a:b], t[start + a:start + b], z[a:b], loss_rows[start + a:start + b],
                        lse[start + a:start + b], None, counts, scale, -100, "mean", 0.0, 0.0, None, False)
                ev = torch.cuda.Event()
                ev.record(side)
            done.append(ev)
        for (a, b), ev in zip(pieces, done):
            main.wait_event(ev)
            torch.mm(z[a:b], w, out=d_hidden[start + a:start + b])
        accumulate_mm(d_weight, z.t(), h_c, beta=int(start > 0))
    return loss_rows.mean(), d_hidden, d_weight.to(w.dtype)  # (mean: no target is ignored here)


def production(h2, w, t):
    out = lce._lce_launch(h2, w, t, None, None, -100, "mean", 0.0, 0.0, None, True, True, False, False, False,
                          CHUNK, torch.float32, h2.dtype)
    return out[0], out[3], out[4]


def gemm_grids(fn) -> list[str]:
    """Name and grid of each distinct GEMM kernel one call of ``fn`` launches (torch.profiler trace)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    seen = {}
    for e in json.load(open(path))["traceEvents"]:
        if e.get("cat") == "kernel" and ("gemm" in e["name"].lower() or "sm90" in e["name"]):
            seen.setdefault((e["name"][:90], str(e["args"].get("grid"))), e["dur"])
    return [f"{name} grid={grid} {dur} us" for (name, grid), dur in seen.items()]


def main():
    ceilings = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceilings.copy_gbps:.0f} GB/s, "
          f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    torch.manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    h2 = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    want = production(h2, w, t)
    for line in gemm_grids(lambda: production(h2, w, t)):
        print("  gemm", line)
    flops = 3 * 2 * TOKENS * HIDDEN * VOCAB
    variants = {"production": lambda: production(h2, w, t)}
    lo, hi = torch.cuda.Stream.priority_range()
    for split in (2, 4):
        for name, priority in (("default", 0), ("high", hi)):
            side = torch.cuda.Stream(priority=priority)
            variants[f"split={split} side priority {name}"] = lambda s=split, st=side: pipelined(h2, w, t, s, st)
    for rnd in range(2):
        for name, fn in variants.items():
            got = fn()
            errs = [((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, want)]
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(f"round {rnd} {name:<32} {ms:7.3f} ms (kernels {kernel_ms(fn):7.3f}) "
                  f"{flops / ms / 1e9:4.0f} TFLOP/s  rel err loss/dh/dW {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
