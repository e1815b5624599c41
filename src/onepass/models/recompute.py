"""The ``recompute`` switch: activations kept out of what autograd saves, rebuilt in backward.

Autograd keeps every tensor an op saves for backward until that backward runs. Some are
cheap to rebuild from tensors it keeps anyway: a norm's output from the norm's input h
(saved by the norm's own backward), the MLP's act(gate) * up from gate and up (saved by
the activation's backward). ``with_recomputed(fn, produced, recompute, inputs)`` runs
``fn(produced)`` under saved-tensor hooks: what autograd saves of ``produced`` (the
tensor or a view of it: F.linear on a 3-D input saves a 2-D view) becomes a handle, and
the first unpack in backward runs ``recompute(*inputs)``, shared by every consumer (q, k
and v projections, a LoRA adapter) until the last one has unpacked it.

Every other tensor saved inside the region is kept as autograd would, through a
detached alias (returning the tensor itself would make a node that saves its own output
reference itself: a leak), with autograd's in-place check redone by hand (autograd skips
it for tensors that went through hooks).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import Tensor, nn

from onepass.models.patches import RECOMPUTED, hooked


class _Recomputed:
    """One tensor kept out of the saved tensors: its layout, and how to rebuild it."""

    __slots__ = ("start", "end", "dtype", "device", "shape", "recompute", "inputs", "watched", "packs", "unpacks",
                 "value")

    def __init__(self, produced: Tensor, recompute: Callable[..., Tensor], inputs: tuple[Tensor, ...],
                 reads: tuple[Tensor, ...]):
        self.start = produced.data_ptr()
        self.end = self.start + produced.numel() * produced.element_size()
        self.dtype, self.device, self.shape = produced.dtype, produced.device, produced.shape
        self.recompute = recompute
        self.inputs = tuple(t.detach() for t in inputs)  # aliases: no copy, no graph
        self.watched = [(t, t._version) for t in (*self.inputs, *reads)]
        self.packs = self.unpacks = 0
        self.value: Tensor | None = None

    def holds(self, t: Tensor) -> bool:
        """Whether ``t`` is ``produced`` or a view of it (it owns its storage, so an address
        inside it is one of its elements)."""
        return (type(t) is Tensor and t.dtype == self.dtype and t.device == self.device
                and self.start <= t.data_ptr() < self.end)

    def get(self) -> Tensor:
        if self.value is None:
            for t, version in self.watched:
                if t._version != version:
                    raise RuntimeError(
                        "onepass recompute: a tensor that an activation is recomputed from in backward "
                        f"(shape {tuple(t.shape)}) was modified in place after the forward (version {t._version}, "
                        f"expected {version}); run onepass.optimize(model, recompute=False) to save the activation "
                        "instead")
            with torch.no_grad():
                value = self.recompute(*self.inputs).to(self.dtype).contiguous()
            if value.shape != self.shape:
                raise RuntimeError(f"onepass recompute: rebuilt a tensor of shape {tuple(value.shape)}, "
                                   f"expected {tuple(self.shape)}")
            self.value = value
        value = self.value
        self.unpacks += 1
        if self.unpacks == self.packs:  # the last consumer of this backward: drop the copy
            self.value, self.unpacks = None, 0
        return value


class _View:
    """A saved view of a recomputed tensor: where in it, and of which."""

    __slots__ = ("of", "shape", "stride", "offset")

    def __init__(self, of: _Recomputed, t: Tensor):
        self.of, self.shape, self.stride = of, t.shape, t.stride()
        self.offset = (t.data_ptr() - of.start) // t.element_size()

    def unpack(self) -> Tensor:
        value = self.of.get()
        return value.as_strided(self.shape, self.stride, value.storage_offset() + self.offset)


_regions = threading.local()  # .active: the _Recomputed of the regions entered on this thread


def _active() -> list[_Recomputed]:
    if not hasattr(_regions, "active"):
        _regions.active = []
    return _regions.active


def _pack(t: Tensor):
    for region in _active():
        if region.holds(t):
            region.packs += 1
            return _View(region, t)
    alias = t.detach()
    return alias, alias._version


def _unpack(packed) -> Tensor:
    if isinstance(packed, _View):
        return packed.unpack()
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor of shape {tuple(t.shape)} is at version {t._version}; expected version {version} "
            "(checked by onepass's recompute hooks; onepass.optimize(model, recompute=False) turns them off)")
    return t


def _can_recompute(produced: Tensor) -> bool:
    """Not while compiling (the partitioner decides what to recompute; no graph break),
    without autograd, inside a backward (checkpointing's recomputation), or under
    saved-tensor hooks other than ours (checkpointing, CPU offload: only the innermost
    hooks would run); only for a plain contiguous tensor owning its storage."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if (type(produced) is not Tensor or produced.layout != torch.strided or produced.device.type == "meta"
            or produced.numel() == 0 or not produced.is_contiguous() or produced.storage_offset() != 0
            or produced.untyped_storage().nbytes() != produced.numel() * produced.element_size()):
        return False
    if torch._C._current_graph_task_id() != -1 or not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is None if not _active() else top is not None and top[0] is _pack


def with_recomputed(fn: Callable[[Tensor], Any], produced: Tensor, recompute: Callable[..., Tensor],
                    inputs: tuple[Tensor, ...], reads: tuple[Tensor, ...] = ()) -> Any:
    """``fn(produced)``, with ``produced`` not kept for backward: ``recompute(*inputs)``
    (cast to its dtype) rebuilds it there, once however many ops saved it.

    ``recompute`` must give ``produced``'s values from ``inputs`` (tensors autograd keeps
    anyway, or the saving is lost) and the tensors in ``reads`` (parameters it reads):
    if any of them is modified in place before backward, backward raises rather than
    recompute something else. Where recomputing does not apply (see ``_can_recompute``)
    this is ``fn(produced)``.
    """
    if not _can_recompute(produced):
        return fn(produced)
    active = _active()
    version = produced._version
    active.append(_Recomputed(produced, recompute, inputs, reads))
    try:
        if len(active) == 1:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                out = fn(produced)
        else:
            out = fn(produced)
    finally:
        active.pop()
    if produced._version != version:
        raise RuntimeError("onepass recompute: an activation that backward recomputes was modified in place during "
                           "the forward; run onepass.optimize(model, recompute=False)")
    return out


def after_norm(recompute: bool, fn: Callable[[Tensor], Any], normed: Tensor, norm: nn.Module, h: Tensor) -> Any:
    """``fn(normed)`` where ``normed`` is ``norm(h)``, or the first output of
    ``norm(x, residual)`` whose second is ``h``; with ``recompute``, normed is rebuilt in
    backward by ``norm.forward(h)``: the same kernel on the same stored h (the fused add
    normalises h as stored, rounded to its dtype), so the same values. Not when the norm has
    hooks, which may have replaced its output."""
    if not recompute or hooked(norm):
        return fn(normed)
    return with_recomputed(fn, normed, norm.forward, (h,), tuple(norm.parameters(recurse=False)))


def recompute_status(recomputed: list[tuple[str, int, str]]) -> str:
    """The report line of the ``recompute`` switch, from (what, values a token a layer, the
    forward pass that rebuilds it) for each recomputed activation."""
    if not recomputed:
        return "n/a: nothing to recompute (the norm and activation switches are off or unfused)"
    what = " and ".join(w for w, _, _ in recomputed)
    values = sum(v for _, v, _ in recomputed)
    cost = " + ".join(c for _, _, c in recomputed)
    return (f"{RECOMPUTED}: in training, backward recomputes {what} instead of keeping them: {values} values "
            f"a token a layer less activation memory, for {cost} forward a layer in backward")

