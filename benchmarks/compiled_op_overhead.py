"""What onepass costs the host inside a torch.compile'd graph, now that its ops are triton_ops.

    python benchmarks/compiled_op_overhead.py

1. A chain of 32 RMSNorm forwards on 64 x 2048 bf16 (host-bound): host time a call of
   ``ops.rms_norm`` compiled with Inductor (its registered op is a ``torch.library.triton_op``:
   Inductor traces the body and launches the kernel from its own generated code), against
   Inductor's own kernel (``reference.rms_norm`` compiled) and the eager calls. The GPU is kept
   busy by a sleep kernel, so only the host is timed.
2. Python frames of the onepass package run per compiled call (``sys.setprofile`` over the
   calls): 0 when Inductor launches every kernel itself, for the chain and for a compiled
   ``onepass.optimize``'d model forward (ops that are still opaque custom_ops show up there).
3. A Llama-3.2-1B-shaped forward (random weights, bf16, 1 x 1024 tokens, no grad): median ms
   (``triton.testing.do_bench``) of torch.compile of the model as built against torch.compile of
   ``onepass.optimize(model)``; default mode, no CUDA graphs.
4. linear_cross_entropy's peak memory and time, eager and compiled (its chunked logits buffer,
   reused in place by the launcher, must stay one buffer in Inductor's functional graph).

Needs a CUDA GPU; without one it only checks that it imports and stops.
Results: benchmarks/results/h200/compiled_op_overhead.log.
"""

from __future__ import annotations

import collections
import copy
import os
import sys
import time
import warnings

import torch

import onepass
from onepass import ops, reference
from onepass.models import configs

CALLS = 32
ONEPASS_DIR = os.path.dirname(onepass.__file__)


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


def onepass_frames_a_call(fn, *args, calls=10) -> float:
    """Python frames whose code lives in the onepass package, run per call of ``fn`` (after a warm-up);
    the functions they ran are printed when there are any."""
    fn(*args)
    torch.cuda.synchronize()
    frames = collections.Counter()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(ONEPASS_DIR):
            frames[f"{os.path.relpath(code.co_filename, ONEPASS_DIR)}:{code.co_firstlineno} {code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        for _ in range(calls):
            fn(*args)
    finally:
        sys.setprofile(None)
    torch.cuda.synchronize()
    for where, count in frames.most_common(8):
        print(f"    onepass frame a call: {count / calls:5.1f} x {where}", flush=True)
    return sum(frames.values()) / calls


def rms_norm_chain():
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    registered = torch.ops.onepass.norm_fwd

    def onepass_registered(x, w):
        return registered(x, None, w, None, 1e-6, 0.0, 0.0, 0, True, x.dtype)[0]

    compiled_onepass = torch.compile(_chain(lambda x, w: ops.rms_norm(x, w, 1e-6)))
    rows = {
        "eager ops.rms_norm (onepass's eager path)": _chain(lambda x, w: ops.rms_norm(x, w, 1e-6)),
        "eager registered op (triton_op)": _chain(onepass_registered),
        "compiled: Inductor's own kernel (reference)":
            torch.compile(_chain(lambda x, w: reference.rms_norm(x, w, 1e-6))),
        "compiled: ops.rms_norm (triton_op)": compiled_onepass,
    }
    with torch.no_grad():
        expected = reference.rms_norm(x, w, 1e-6).float()
        got = torch.compile(lambda a, b: ops.rms_norm(a, b, 1e-6))(x, w).float()
        print(f"compiled ops.rms_norm matches the reference: {torch.allclose(got, expected, atol=2e-2)}", flush=True)
        for name, fn in rows.items():
            print(f"{name:<46} {host_us_a_call(fn, x, w):7.1f} us of host time a call", flush=True)
        frames = onepass_frames_a_call(compiled_onepass, x, w) / CALLS
        print(f"compiled ops.rms_norm: {frames:.1f} onepass Python frames a call (target 0)", flush=True)


def llama_forward():
    from triton.testing import do_bench

    torch.manual_seed(0)
    model = configs.build("llama-1b", device="cuda", dtype=torch.bfloat16).eval()
    optimized = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(optimized)
    ids = torch.randint(0, model.config.vocab_size, (1, 1024), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        variants = {"torch.compile(model)": torch.compile(model),
                    "torch.compile(onepass.optimize(model))": torch.compile(optimized)}
        for name, compiled in variants.items():
            start = time.perf_counter()
            out = compiled(ids).logits.float()
            first = time.perf_counter() - start
            err = ((out - ref).norm() / ref.norm()).item()
            ms = do_bench(lambda m=compiled: m(ids), return_mode="median")
            frames = onepass_frames_a_call(compiled, ids)
            print(f"Llama-3.2-1B 1 x 1024 bf16 forward, {name:<40} {ms:7.3f} ms (median)  first call {first:5.1f} s  "
                  f"{frames:6.1f} onepass Python frames a forward  rel. diff vs eager {err:.1e}", flush=True)


def lce_memory():
    """linear_cross_entropy forward + backward at the Llama-3 head (8192 tokens, hidden 2048, vocabulary 128256,
    bf16), eager and with the loss compiled: peak memory above the inputs and median ms. Its launcher reuses one
    logits buffer across token chunks; the compiled graph is functional, so this peak holds only where Inductor
    writes that buffer in place again."""
    from triton.testing import do_bench

    torch.manual_seed(0)
    h = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, 128256, (8192,), device="cuda")
    for name, loss in (("eager", ops.linear_cross_entropy), ("compiled", torch.compile(ops.linear_cross_entropy))):
        def step(loss=loss):
            loss(h, w, t).backward()

        step()
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = do_bench(step, grad_to_none=[h, w], return_mode="median")
        h.grad = w.grad = None
        print(f"linear_cross_entropy 8192 x 2048 x 128256 bf16 fwd+bwd, {name:<9} {ms:7.2f} ms (median)  "
              f"peak {peak:7.0f} MiB above the inputs", flush=True)


def main():
    if not torch.cuda.is_available():
        print("compiled_op_overhead: no CUDA GPU here; imports checked, nothing measured")
        return
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rms_norm_chain()
    llama_forward()
    lce_memory()


if __name__ == "__main__":
    main()
