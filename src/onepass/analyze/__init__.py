"""The fusion analyzer: where a model's HBM traffic and kernel launches go, and what fusing would save.

    from onepass.analyze import analyze
    report = analyze(model, input_ids, gpu="H100", mode="forward", meta=True)
    print(report.table()); report.write("out/")

Pipeline: ``record`` (every aten op, its bytes, FLOPs, module, producers) -> ``fusion``
(roofline per op, chains and the design test) -> ``report`` (table, JSON, Markdown,
HTML). On a CUDA GPU, ``measure=True`` adds ``measure`` (profiled kernels, gaps, a Chrome
trace, measured ceilings). Nothing here imports the private names of the rest of onepass:
the onepass ops a report names are names; an optimized model is told by
``onepass.patching.is_optimized`` and recorded under ``onepass.reference_mode()``.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
import warnings
from typing import Any, Callable, Optional, Union

import torch

from onepass.analyze.fusion import Fusion
from onepass.analyze.gpus import GPU, GPUS, get_gpu
from onepass.analyze.record import record
from onepass.analyze.report import Report

__all__ = ["analyze", "Report", "GPU", "GPUS"]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta").requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def analyze(model_or_fn: Union[torch.nn.Module, Callable], *example_inputs, gpu: Union[str, GPU] = "H100",
            mode: str = "forward", meta: Optional[bool] = None, measure: bool = False,
            variants: Optional[dict[str, Callable]] = None, quiet: bool = False, title: Optional[str] = None,
            trace_dir: Optional[str] = None, **kwargs) -> Report:
    """Record one step of ``model_or_fn(*example_inputs, **kwargs)`` and find what fusing would save.

    gpu: a name from ``GPUS`` (datasheet ceilings) or a ``GPU``; with ``measure`` on a CUDA
        device the ceilings measured there replace it.
    mode: "forward", or "train" (forward, then backward of the output's ``.loss`` or of its
        first tensor summed; an nn.Module is put in train mode for the step).
    meta: True runs on meta tensors (weights and inputs are not allocated: a 1B model in
        seconds); None keeps the tensors as given.
    measure: also profile real steps on the GPU (inputs must be CUDA tensors, meta False):
        kernels per step, idle gaps, achieved bandwidth per layer, a Chrome trace in
        ``trace_dir``; ``variants`` ({"torch.compile": fn, ...}) are timed beside eager.
    quiet: no per-layer progress on stderr (it is shown only on a terminal anyway).
    """
    if not callable(model_or_fn):
        hint = (" (a built-in configuration: onepass.models.configs.build(name), or onepass analyze --model "
                f"{model_or_fn})") if isinstance(model_or_fn, str) else ""
        raise TypeError(f"analyze takes a model or a function to run, got {type(model_or_fn).__name__}{hint}")
    if mode not in ("forward", "train"):
        raise ValueError(f"mode: expected 'forward' or 'train', got {mode!r}")
    if measure and meta:
        raise ValueError("measure: needs real CUDA tensors; it cannot run with meta=True")
    spec = get_gpu(gpu)
    model = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else None
    optimized = model is not None and _is_optimized(model)
    if optimized:
        warnings.warn("analyze: this model is optimized by onepass: its ops are recorded through "
                      "onepass.reference_mode(), the unfused PyTorch ops that its kernels replace, not the kernels; "
                      "analyze the model before onepass.optimize, or after onepass.undo; measure=True's profiled "
                      "side does show its kernels", stacklevel=2)
    inputs, weights = example_inputs, None
    if meta:
        inputs, kwargs = _to_meta(example_inputs), _to_meta(kwargs)
        if model is not None:
            weights = {n: _to_meta(t) for n, t in list(model.named_parameters()) + list(model.named_buffers())}

    def step(*args):
        if weights is not None:
            return torch.func.functional_call(model, weights, args, kwargs)
        return model_or_fn(*args, **kwargs)

    was_training = model.training if model is not None else None
    grads = {p: p.grad for p in model.parameters()} if model is not None else {}  # a train step's backward sets them
    if model is not None:
        model.train(mode == "train")
    try:
        start = time.perf_counter()
        with _reference_mode() if optimized else contextlib.nullcontext():
            trace = record(step, inputs, model=model, weights=weights, mode=mode, quiet=quiet)
        seconds = time.perf_counter() - start
        measured, trace_path = {}, None
        if measure:
            from onepass.analyze.measure import measure as run_measure

            measured, spec, trace_path = run_measure(step, inputs, trace, spec, mode=mode, model=model,
                                                     variants=variants, trace_dir=trace_dir)
    finally:
        if model is not None:
            model.train(was_training)
        for p, grad in grads.items():
            p.grad = grad
    name = title or (type(model).__name__ if model is not None else getattr(model_or_fn, "__name__", "function"))
    shapes = ", ".join("x".join(map(str, t.shape)) for t in example_inputs if isinstance(t, torch.Tensor))
    on_meta = bool(meta) or any(isinstance(t, torch.Tensor) and t.is_meta for t in example_inputs)
    device = "meta" if on_meta else next((t.device.type for t in _tensors_in((example_inputs, kwargs))), "cpu")
    report = Report(f"{name}, {mode}" + (f", inputs {shapes}" if shapes else ""), mode, spec, Fusion(trace, spec),
                    on_meta, seconds, measured, trace_path, optimized=optimized, device=device)
    return report


def _tensors_in(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_optimized(model: torch.nn.Module) -> bool:
    from onepass.patching import is_optimized  # (imported here: it loads the ops)

    return is_optimized(model)


def _reference_mode() -> contextlib.AbstractContextManager:
    from onepass.patching import reference_mode

    return reference_mode()


class _CallableModule(types.ModuleType):
    """Once imported, ``onepass.analyze`` is this package (Python sets the attribute on import),
    so the package calls ``analyze``: ``onepass.analyze(model, ...)`` works either way."""

    def __call__(self, *args, **kwargs) -> Report:
        return analyze(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
