"""The measured side, on a CUDA GPU: kernels per step, idle gaps, bandwidth per layer, a Chrome trace.

- ceilings: copy bandwidth and matmul rates measured on the device (``gpus.measured_gpu``)
  replace the datasheet figures the roofline uses;
- kernels: ``torch.profiler`` over a few steps: device events per step, their average
  duration, and the idle time between one kernel's end and the next one's start;
- regions: CUDA events around every layer of the forward; the analyzer's byte count of
  that layer over its measured time is the bandwidth achieved, set against the copy's;
- variants: the step time (median of ``triton.testing.do_bench``) and kernels per step of
  eager and of every variant given (``{"torch.compile": compiled_fn}``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from onepass.analyze.gpus import GPU, measured_gpu
from onepass.analyze.record import Trace, loss_of

PROFILED_STEPS = 3


def _runner(fn: Callable, inputs: tuple, mode: str) -> Callable[[], None]:
    def run():
        out = fn(*inputs)
        if mode == "train":
            loss_of(out).backward()

    return run


def _kernels(run: Callable[[], None], steps: int, trace_path: Optional[str] = None) -> dict:
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    spans = sorted((e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA)
    if not spans:
        return {"kernels_per_step": 0}
    busy = sum(end - start for start, end in spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    wall = spans[-1][1] - spans[0][0]
    return {"kernels_per_step": len(spans) // steps, "avg_kernel_us": busy / len(spans) / 1e3,
            "gpu_busy_ms_per_step": busy / steps / 1e6, "idle_ms_per_step": sum(gaps) / steps / 1e6,
            "idle_fraction": 1 - busy / wall if wall else 0.0, "largest_gap_us": max(gaps, default=0) / 1e3}


def _regions(run: Callable[[], None], model: torch.nn.Module, trace: Trace, gpu: GPU) -> list[dict]:
    """Forward time of every layer from CUDA events, and the bandwidth its recorded bytes imply."""
    prefix = trace.layer_prefix
    if not prefix:
        return []
    names = [f"{prefix}{i}" for i in range(trace.layers)]
    events: dict[str, list] = {n: [] for n in names}
    hooks = []
    for name in names:
        mod = model.get_submodule(name)

        def pre(_m, _a, name=name):
            events[name].append(torch.cuda.Event(enable_timing=True))
            events[name][-1].record()

        def post(_m, _a, _o, name=name):
            events[name].append(torch.cuda.Event(enable_timing=True))
            events[name][-1].record()

        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        run()
        torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for name in names:
        ev = events[name]
        ms = sum(a.elapsed_time(b) for a, b in zip(ev[::2], ev[1::2]))
        nbytes = sum(op.bytes for op in trace.ops if op.phase == "forward"
                     and (op.module == name or op.module.startswith(name + ".")))
        gbps = nbytes / (ms * 1e-3) / 1e9 if ms else 0.0
        rows.append({"region": name, "kernel_ms": ms, "bytes": nbytes, "gbps": gbps,
                     "fraction_of_copy": gbps / gpu.hbm_gbps})
    return rows


def measure(step: Callable, inputs: tuple, trace: Trace, gpu: GPU, *, mode: str = "forward",
            model: Optional[torch.nn.Module] = None, variants: Optional[dict[str, Callable]] = None,
            trace_dir: Optional[str] = None) -> tuple[dict, GPU, str]:
    """Profile real steps; returns (measured figures, the measured GPU ceilings, the Chrome trace path)."""
    import triton.testing

    if not torch.cuda.is_available():
        raise RuntimeError("measure: needs a CUDA GPU")
    if not all(t.is_cuda for t in inputs if isinstance(t, torch.Tensor)):
        raise ValueError("measure: the example inputs must be CUDA tensors")
    ceilings = measured_gpu(gpu)
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="onepass-analyze-")
    os.makedirs(trace_dir, exist_ok=True)
    trace_path = os.path.join(trace_dir, "trace.json")
    run = _runner(step, inputs, mode)
    measured = {"device": torch.cuda.get_device_name(), "copy_gbps": round(ceilings.hbm_gbps),
                "bf16_matmul_tflops": round(ceilings.bf16_tflops, 1), "launch_us": round(ceilings.launch_us, 2)}
    measured.update(_kernels(run, PROFILED_STEPS, trace_path))
    measured["regions"] = _regions(run, model, trace, ceilings) if model is not None else []
    measured["variants"] = {}
    for name, fn in {"eager": step, **(variants or {})}.items():
        go = _runner(fn, inputs, mode)
        ms = triton.testing.do_bench(go, return_mode="median")
        measured["variants"][name] = {"step_ms": ms, **_kernels(go, 1)}
    return measured, ceilings, trace_path
