"""Host time of an onepass op called inside a torch.compile'd graph, by how it is registered.

    python benchmarks/compiled_op_overhead.py

A chain of 32 RMSNorm forwards on 64 x 2048 bf16 (host-bound), compiled with Inductor:
onepass's op as registered now (an opaque ``torch.library.custom_op``, whose Python launcher
runs at every call), the same kernel registered as a ``torch.library.triton_op`` (Inductor
traces the body and launches the kernel itself), Inductor's own kernel for the reference, and
the eager calls for comparison. The GPU is kept busy by a sleep kernel, so only the host is
timed. Results: benchmarks/results/h200/compiled_op_overhead.log.
"""

from __future__ import annotations

import time

import torch
from torch.library import triton_op, wrap_triton

from onepass import ops, reference
from onepass.ops import norm
from onepass.ops.dispatch import row_settings

CALLS = 32


@triton_op("onepass_bench::rms_norm", mutates_args=())
def _rms_norm_traceable(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block, num_warps = row_settings(n, values_per_thread=16)
    wrap_triton(norm._norm_fwd_kernel)[(x2.shape[0],)](
        x2, x2, weight, x2, y, y, rstd, rstd, x2.stride(0), x2.stride(0), y.stride(0), y.stride(0),
        n, eps, 0.0, 0, IS_RMS=True, HAS_RESIDUAL=False, HAS_DROPOUT=False, HAS_WEIGHT=True, HAS_BIAS=False,
        BLOCK_N=block, ONE_BLOCK=n <= block, num_warps=num_warps)
    return y.view(x.shape)


def _chain(op):
    def run(x, w):
        for _ in range(CALLS):
            x = op(x, w)
        return x

    return run


def host_us_a_call(fn, x, w, repeats=30) -> float:
    for _ in range(3):
        fn(x, w)
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)  # the GPU busy: the loop below is the host's time alone
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x, w)
    us = (time.perf_counter() - start) / repeats / CALLS * 1e6
    torch.cuda.synchronize()
    return us


def main():
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    registered = torch.ops.onepass.norm_fwd

    def onepass_registered(x, w):
        return registered(x, None, w, None, 1e-6, 0.0, 0, True, x.dtype)[0]

    rows = {
        "eager ops.rms_norm (onepass's eager path)": _chain(lambda x, w: ops.rms_norm(x, w, 1e-6)),
        "eager registered op (custom_op)": _chain(onepass_registered),
        "eager triton_op": _chain(lambda x, w: _rms_norm_traceable(x, w, 1e-6)),
        "compiled: Inductor's own kernel (reference)":
            torch.compile(_chain(lambda x, w: reference.rms_norm(x, w, 1e-6))),
        "compiled: ops.rms_norm (custom_op, now)": torch.compile(_chain(lambda x, w: ops.rms_norm(x, w, 1e-6))),
        "compiled: triton_op": torch.compile(_chain(lambda x, w: _rms_norm_traceable(x, w, 1e-6))),
    }
    with torch.no_grad():
        expected = reference.rms_norm(x, w, 1e-6).float()
        got = torch.compile(lambda a, b: _rms_norm_traceable(a, b, 1e-6))(x, w).float()
        print(f"{torch.cuda.get_device_name()}; compiled triton_op matches the reference: "
              f"{torch.allclose(got, expected, atol=2e-2)}")
        for name, fn in rows.items():
            print(f"{name:<46} {host_us_a_call(fn, x, w):7.1f} us of host time a call")


if __name__ == "__main__":
    main()
