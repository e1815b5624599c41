"""Sweep attention's launch settings at the issue's shapes on a GPU, beside SDPA's cuDNN and flash backends.

    python benchmarks/tune_attention.py [--no-sweep] [preset ...] [kernel ...]
    (presets: d64 d128 d128-causal d256; kernels: fwd dkdv dv dk dq; default all)

For each preset: SDPA (flash, cuDNN) and onepass, forward and forward+backward, TFLOP/s (fwd+bwd
counted as 3.5x the forward's FLOPs); then each forward, dK/dV and dQ setting in turn (the others at
their defaults) with the time of the kernel it changes. dK/dV run as one pass ("dkdv") or two ("dv" then
"dk", see attention.dkdv_kernels): a "dkdv" setting times one pass, a "dv" or "dk" setting both passes
(the other at its default, or at its first candidate where the head dim has none); each forward and dQ
setting with K and V loaded through tensor descriptors ("tma") and as pointer tiles ("ptr"), as the
"onepass, K/V ..." rows do for the whole step; "onepass, portable kernels" keeps the tl kernels where the
Gluon ones (ops/attention_hopper.py) would run, "onepass, portable backward" the tl backward only (the sweep
times the tl kernels: portable throughout). ops/attention.py's CONFIGS, FWD_TMA_ROWS and DQ_TMA_ROWS cite the
result.
"""

import contextlib
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from onepass import ops

attention_module = sys.modules["onepass.ops.attention"]  # onepass.ops.attention is the function

# name: (batch, q heads, kv heads, sequence, head dim, causal); the rows (Llama-3.2-1B, Gemma 2, Qwen2-7B)
PRESETS = {
    "d64": (8, 32, 8, 2048, 64, True),
    "d128": (2, 32, 8, 8192, 128, False),
    "d128-causal": (1, 28, 4, 16384, 128, True),
    "d128-causal-4k": (4, 32, 8, 4096, 128, True),
    "d256": (2, 8, 4, 8192, 256, True),
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel and head dim
SETTINGS = {
    64: {
        "fwd": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)],
        "dkdv": [(32, 128, 4, 3), (32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3), (16, 128, 4, 4)],
        "dv": [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3)],
        "dk": [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3)],
        "dq": [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3)],
    },
    128: {
        "fwd": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                (64, 128, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4), (128, 128, 16, 2)],
        "dkdv": [(32, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3),
                 (32, 128, 4, 3), (16, 128, 8, 3), (64, 32, 4, 3), (32, 64, 4, 4), (128, 64, 8, 2)],
        "dv": [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)],
        "dk": [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)],
        "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 3),
               (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 4)],
    },
    256: {
        "fwd": [(64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 1),
                (64, 64, 8, 3), (128, 32, 4, 2), (64, 128, 8, 2), (128, 64, 16, 2), (128, 32, 8, 3)],
        "dkdv": [(64, 64, 8, 2), (32, 64, 8, 2), (64, 64, 8, 1)],
        "dv": [(32, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 1), (32, 64, 4, 1), (32, 64, 4, 3),
               (16, 64, 4, 2), (32, 32, 4, 2), (32, 128, 4, 2), (16, 128, 4, 2), (64, 64, 4, 2)],
        "dk": [(32, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 1), (32, 128, 8, 1), (32, 128, 8, 3), (16, 128, 8, 2),
               (32, 128, 4, 2), (32, 64, 4, 2), (16, 128, 4, 2), (32, 256, 8, 1)],
        "dq": [(64, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2),
               (32, 64, 4, 2), (128, 64, 8, 1), (128, 32, 8, 1)],
    },
}
KERNEL_NAMES = {"fwd": "attn_fwd", "dkdv": "dkdv", "dv": "dkdv", "dk": "dkdv", "dq": "dq_kernel"}


def kernel_us(step, steps=5) -> dict[str, float]:
    """Each GPU kernel's time in one step, microseconds, by kernel name."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key] += e.device_time_total / steps
    return dict(times)


def run_preset(name):
    batch, hq, hk, seq, dim, causal = PRESETS[name]
    q = torch.randn(batch, hq, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, hk, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    g = torch.randn_like(q)
    flops = 4 * batch * hq * seq * seq * dim / (2 if causal else 1)

    def fwd_bwd(fn):
        def step():
            q.grad = k.grad = v.grad = None
            fn().backward(g)

        return step

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        return run

    def ours():
        return ops.attention(q, k, v, causal=causal)

    print(f"\n== {name}: B{batch} S{seq} {hq}/{hk} heads, head dim {dim}, {'causal' if causal else 'full'}, bf16")
    for label, fn, loads in (("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION), contextlib.nullcontext()),
                             ("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION), contextlib.nullcontext()),
                             ("onepass", ours, contextlib.nullcontext()),
                             ("onepass, portable backward", ours, portable("_hopper_backward")),
                             ("onepass, portable kernels", ours, portable()),
                             ("onepass, K/V pointer tiles", ours, kv_loads(tma=False)),
                             ("onepass, K/V descriptors", ours, kv_loads(tma=True))):
        try:
            with loads:
                fwd_ms = do_bench(fn, return_mode="median")
                both_ms = do_bench(fwd_bwd(fn), return_mode="median")
            print(f"{label:<26} fwd {fwd_ms:7.3f} ms {flops / fwd_ms / 1e9:6.0f} TFLOP/s   fwd+bwd {both_ms:7.3f} ms "
                  f"{3.5 * flops / both_ms / 1e9:6.0f} TFLOP/s", flush=True)
        except RuntimeError as e:
            print(f"{label:<26} failed: {str(e)[:100]}")
    if SWEEP:
        sweep_settings(dim, fwd_bwd(ours))


@contextlib.contextmanager
def portable(name="_on_hopper"):
    """The portable (tl) kernels where the Gluon ones (ops/attention_hopper.py) would run: the forward and the
    backward (name "_on_hopper"), or the backward only ("_hopper_backward")."""
    saved = getattr(attention_module, name)
    setattr(attention_module, name, lambda *args: False)
    try:
        yield
    finally:
        setattr(attention_module, name, saved)


@contextlib.contextmanager
def kv_loads(tma):
    """The forward's and dQ kernel's K and V loads at every head dim and size: tensor descriptors (tma) or pointer
    tiles."""
    rows = {64, 128, 256} if tma else set()
    settings = {"FWD_TMA_ROWS": rows, "DQ_TMA_ROWS": rows, "TMA_MIN_FLOPS": 0}
    saved = {name: getattr(attention_module, name) for name in settings}
    for name, value in settings.items():
        setattr(attention_module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(attention_module, name, value)


def sweep_settings(dim, step):
    configs = attention_module.CONFIGS
    for kernel, settings in SETTINGS[dim].items():
        if kernel not in KERNELS:
            continue
        saved = {name: dict(table) for name, table in configs.items()}
        default = configs[kernel].get(dim)
        if kernel in ("dv", "dk"):  # two passes: the other pass at its default or first candidate
            configs["dkdv"].pop(dim, None)
            other = "dk" if kernel == "dv" else "dv"
            configs[other].setdefault(dim, SETTINGS[dim][other][0])
        loads = (("tma", True), ("ptr", False)) if kernel in ("fwd", "dq") else (("", None),)
        for setting in settings:
            configs[kernel][dim] = setting
            for load, tma in loads:
                label = f"{kernel:<5} {load:<3} {setting}"
                try:
                    with kv_loads(tma) if tma is not None else contextlib.nullcontext(), portable():
                        us = sum(t for n, t in kernel_us(step).items() if KERNEL_NAMES[kernel] in n)
                    mark = " (default)" if setting == default else ""
                    print(f"{label}: {us:8.1f} us{mark}", flush=True)
                except Exception as e:  # over the shared-memory or register limit
                    print(f"{label}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
        for name, table in saved.items():
            configs[name].clear()
            configs[name].update(table)


SWEEP = "--no-sweep" not in sys.argv
KERNELS = [a for a in sys.argv[1:] if a in KERNEL_NAMES] or list(KERNEL_NAMES)

if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    for preset in [a for a in sys.argv[1:] if a in PRESETS] or list(PRESETS):
        run_preset(preset)
