"""Host (CPU) time of one call of each layer of an op, GPU work excluded where possible.

    python benchmarks/host_overhead.py

A step is host-bound when its host time exceeds its GPU time; this splits the host time
into the Triton launch, the registered op, autograd, and the autograd engine's thread, then
compares one eager call of each often-called op (forward, and forward + backward) at a size
whose GPU work is small against PyTorch's C++ op and Liger's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import onepass.ops.norm as norm
from onepass import ops
from onepass.bench.case import liger
from onepass.ops.dispatch import launch

ROWS, N = 16384, 4096


def host_us(fn, blocks=15, calls=30):
    """(host, host + GPU) us a call: each the median over blocks of calls (a shared host's
    hiccups land in a few blocks; a mean over all calls takes them in)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
        total.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(host), statistics.median(total)


class _Empty(torch.autograd.Function):
    """Autograd alone: a backward that launches nothing."""

    @staticmethod
    def forward(ctx, x, w):
        return x.detach()

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _Plain(torch.autograd.Function):
    """The same launchers under a plain autograd.Function, for comparison."""

    @staticmethod
    def forward(ctx, x, w):
        y, h, mean, rstd = norm._norm_fwd_launch(x, None, w, None, 1e-6, 0.0, 0.0, 0, True, x.dtype)
        ctx.save_for_backward(x, w, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        dx, _, dw, _ = norm._norm_bwd_launch(dy, None, x, w, 0.0, None, mean, rstd, 0.0, 0, True, x.dtype, False, False)
        return dx, dw


class _Worker:
    """A thread that times the functions given to it: one thread for all of them, as autograd keeps one."""

    def __init__(self):
        import queue
        import threading

        self.tasks, self.results = queue.Queue(), queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            self.results.put(host_us(self.tasks.get()))

    def run(self, fn):
        self.tasks.put(fn)
        return self.results.get()


def main():
    x = torch.randn(ROWS, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    xs, ws = x.detach()[:64], w.detach()
    dys = dy[:64]
    _, _, mean, rstd = norm._norm_fwd_launch(xs, None, ws, None, 1e-6, 0.0, 0.0, 0, True, xs.dtype)

    _, _, big_mean, big_rstd = norm._norm_fwd_launch(x.detach(), None, ws, None, 1e-6, 0.0, 0.0, 0, True, x.dtype)

    def manual():
        y, _, m, r = norm._norm_fwd_launch(x.detach(), None, ws, None, 1e-6, 0.0, 0.0, 0, True, x.dtype)
        norm._norm_bwd_launch(dy, None, x.detach(), ws, 0.0, None, m, r, 0.0, 0, True, x.dtype, False, False)

    worker = _Worker()

    def step(fn):
        def run():
            x.grad = w.grad = None
            fn(x, w).backward(dy)
        return run

    y = torch.empty_like(xs)
    kernel_args = (xs, xs, ws, xs, y, y, rstd, rstd, 64, N, N, N, N, N, 1e-6, 0.0, 0.0, 0)
    kernel_meta = dict(IS_RMS=True, HAS_RESIDUAL=False, HAS_DROPOUT=False, HAS_WEIGHT=True, HAS_BIAS=False,
                       BLOCK_N=N, ONE_BLOCK=True, ROWS=1, N_COLS=0, PDL=False, num_warps=4)
    rows = {
        "norm fwd kernel, kernel[grid] (64 rows)": lambda: norm._norm_fwd_kernel[(64,)](*kernel_args, **kernel_meta),
        "norm fwd kernel, onepass launch() (64 rows)": lambda: launch(norm._norm_fwd_kernel, (64,), *kernel_args,
                                                                      **kernel_meta),
        "fwd launcher (64 rows)": lambda: norm._norm_fwd_launch(xs, None, ws, None, 1e-6, 0.0, 0.0, 0, True, xs.dtype),
        "bwd launcher (64 rows)": lambda: norm._norm_bwd_launch(dys, None, xs, ws, 0.0, None, mean, rstd, 0.0, 0, True,
                                                                xs.dtype, False, False),
        "fwd custom op (64 rows)": lambda: norm._norm_fwd(xs, None, ws, None, 1e-6, 0.0, 0.0, 0, True, xs.dtype),
        "bwd custom op (64 rows)": lambda: norm._norm_bwd(dys, None, xs, ws, 0.0, None, mean, rstd, 0.0, 0, True,
                                                          xs.dtype, False, False),
        "rms_norm fwd (64 rows, no grad)": lambda: norm.rms_norm(xs, ws),
        "fwd+bwd step, public op": step(norm.rms_norm),
        "fwd+bwd step, plain autograd.Function": step(_Plain.apply),
        "fwd+bwd step, F.rms_norm": step(lambda x, w: torch.nn.functional.rms_norm(x, (N,), w, 1e-6)),
        "fwd launcher (16384 rows)": lambda: norm._norm_fwd_launch(x.detach(), None, ws, None, 1e-6, 0.0, 0.0, 0, True,
                                                                   x.dtype),
        "bwd launcher (16384 rows)": lambda: norm._norm_bwd_launch(dy, None, x.detach(), ws, 0.0, None, big_mean,
                                                                   big_rstd, 0.0, 0, True, x.dtype, False, False),
        "fwd+bwd launchers, no autograd (16384 rows)": manual,
        "fwd+bwd step, autograd.Function launching nothing": step(_Empty.apply),
    }
    try:
        from liger_kernel.transformers.functional import liger_rms_norm

        rows["fwd+bwd step, liger"] = step(lambda x, w: liger_rms_norm(x, w, 1e-6))
    except ImportError:
        pass
    for name, fn in rows.items():
        host, total = host_us(fn)
        print(f"{name:<46} host {host:7.1f} us   with GPU {total:7.1f} us")
    host, total = worker.run(manual)  # as the autograd engine's device thread runs a backward
    print(f"{'fwd+bwd launchers, a second thread':<46} host {host:7.1f} us   with GPU {total:7.1f} us")
    step_public = rows["fwd+bwd step, public op"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step_public()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
    torch.cuda.set_sync_debug_mode("warn")  # names any call that synchronizes with the GPU
    for name in ("fwd+bwd step, public op", "bwd launcher (16384 rows)"):
        print("sync check:", name)
        rows[name]()
    torch.cuda.set_sync_debug_mode(0)


def per_op(rows: int = 1024, hidden: int = 2048, vocab: int = 32000):
    """Host time a call of onepass, PyTorch's C++ op and Liger, forward and forward + backward."""
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    x, w, b, g, u, logits = leaf(rows, hidden), leaf(hidden), leaf(hidden), leaf(rows, hidden), leaf(rows, hidden), \
        leaf(rows, vocab)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    liger_rms, liger_ln = liger("liger_kernel.transformers.functional", "liger_rms_norm"), \
        liger("liger_kernel.transformers.functional", "liger_layer_norm")
    liger_swiglu, liger_ce = liger("liger_kernel.transformers.functional", "liger_swiglu"), \
        liger("liger_kernel.transformers.functional", "liger_cross_entropy")
    cases = {
        "rms_norm": ((x, w), lambda x, w: ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (hidden,), w, 1e-6),
                     liger_rms and (lambda x, w: liger_rms(x, w, 1e-6))),
        "layer_norm": ((x, w, b), lambda x, w, b: ops.layer_norm(x, w, b),
                       lambda x, w, b: F.layer_norm(x, (hidden,), w, b),
                       liger_ln and (lambda x, w, b: liger_ln(x, w, b, 1e-5))),
        "swiglu": ((g, u), ops.swiglu, lambda g, u: F.silu(g) * u, liger_swiglu),
        "cross_entropy": ((logits, target), ops.cross_entropy, F.cross_entropy, liger_ce),
    }
    print(f"\nhost us a call, {rows} rows, hidden {hidden}, vocabulary {vocab}, bf16: onepass / torch (C++) / liger")
    for name, (args, *fns) in cases.items():
        leaves = [a for a in args if a.requires_grad]
        for mode in ("fwd", "fwd+bwd"):
            cells = []
            for fn in fns:
                if fn is None:
                    cells.append("      —")
                    continue

                def call(fn=fn, mode=mode):
                    if mode == "fwd":
                        with torch.no_grad():
                            return fn(*args)
                    for t in leaves:
                        t.grad = None
                    out = fn(*args)
                    out.backward(dy if out.dim() else None)
                cells.append(f"{host_us(call)[0]:7.1f}")
            print(f"{name:<14} {mode:<8} {' / '.join(cells)}")


if __name__ == "__main__":
    main()
    per_op()
