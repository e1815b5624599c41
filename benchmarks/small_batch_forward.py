"""A Llama-3.2-1B-shaped forward at batch 1 x 1024 (bf16, no grad, random weights): the latency of
eager, onepass and torch.compile (default and mode="reduce-overhead", i.e. CUDA graphs), each
with a host sync per forward. At this size the host's launch work, not the GPU, sets the time.

    python benchmarks/small_batch_forward.py

Results: benchmarks/results/h200/small_batch_forward.log."""
import copy
import statistics
import time
import warnings

import torch

import onepass
from onepass.models import configs


def latency(fn, steps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    torch.manual_seed(0)
    hf = configs.build("llama-1b", device="cuda", dtype=torch.bfloat16).eval()
    op = copy.deepcopy(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(op)
    ids = torch.randint(0, 128000, (1, 1024), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits.float()
        variants = {
            "HF eager": hf,
            "onepass": op,
            "HF torch.compile": torch.compile(hf),
            "HF torch.compile reduce-overhead": torch.compile(copy.deepcopy(hf), mode="reduce-overhead"),
            "onepass torch.compile": torch.compile(op),
            "onepass torch.compile reduce-overhead": torch.compile(copy.deepcopy(op), mode="reduce-overhead"),
        }
        for name, model in variants.items():
            t = time.perf_counter()
            try:
                out = model(ids).logits.float()
                first = time.perf_counter() - t
                err = ((out - ref).norm() / ref.norm()).item()
                ms = [latency(lambda m=model: m(ids)) for _ in range(2)]
                print(f"{name:<40} {ms[0]:7.2f} / {ms[1]:7.2f} ms a forward (synced)  first call {first:6.1f} s  "
                      f"rel. diff vs HF eager {err:.2e}", flush=True)
            except Exception as e:  # report and go on
                print(f"{name:<40} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
