"""What every family's patch shares: the undo log, and the fused forwards of the parts
that look alike across families (gated MLP, rotary attention, LM head + loss, the
attention function registered with transformers).

Everything here patches *instances*: a fused ``forward`` is set as an instance attribute
(the class stays untouched, so other models in the process are unaffected), and norm
modules are swapped for ``onepass.nn`` drop-ins that share their Parameter objects
(state_dict keys and values unchanged). ``Patches`` records each change so that
``onepass.undo`` restores the model exactly.

``with_recomputed`` (the ``recompute`` switch) keeps cheap activations out of what
autograd saves for backward and recomputes them there: the norm outputs that only feed
projections and the MLP's gated product.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

import torch
from torch import Tensor, nn

from onepass import hf_attention, ops
from onepass import nn as onn
from onepass.models import distributed, projections, tied_embedding
from onepass.models.attention import eager_attention
from onepass.ops import activation, kv_cache
from onepass.ops._launch import use_triton

FUSED, UNFUSED = "fused", "unfused"
RECOMPUTED = "on"  # the status of the recompute switch when something is recomputed

# ------------------------------------------------------------------- the KV cache's keyword

CACHE_KEYWORDS = ("cache", "past_key_values")


@functools.cache
def cache_keyword() -> str:
    """The keyword transformers' forwards take the KV cache by: ``cache`` since transformers
    5.24 (its own forwards still take ``past_key_values``, deprecated), ``past_key_values``
    before. Read off the fields of its model outputs, which were renamed with it; torch.compile
    cannot trace that, so the forwards it may trace read it when they are made."""
    from dataclasses import fields

    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPast)} else "past_key_values"


def pop_cache(kwargs: dict) -> Any:
    """The KV cache a patched forward was handed, under either keyword (both are removed from
    ``kwargs``), or None: HF's callers pass ``cache_keyword()``, a user's code may pass the other."""
    found = [kwargs.pop(name, None) for name in CACHE_KEYWORDS]
    return next((c for c in found if c is not None), None)

# ---------------------------------------------------------------------------- undo log


class Patches:
    """An undo log of attribute and submodule changes, replayed backwards by ``undo``."""

    def __init__(self) -> None:
        self._log: list[tuple[Any, str, bool, Any]] = []
        self._undo_calls: list[tuple[Any, str, tuple]] = []
        self._load_calls: list[Callable[[], None]] = []

    def __setstate__(self, state: dict) -> None:
        """Unpickled with its model (``torch.load`` of an optimized model, perhaps in another
        process): the ``on_load`` calls run again."""
        self.__dict__.update(state)
        for fn in self._load_calls:
            fn()

    def on_load(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` now, and again whenever this log is unpickled: process-wide set-up the
        patched model needs (a module-level function, so that it pickles)."""
        fn()
        self._load_calls.append(fn)

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, remembering whether ``obj`` had its own attribute."""
        own = obj._modules if isinstance(obj, nn.Module) and name in obj._modules else obj.__dict__
        self._log.append((obj, name, name in own, own.get(name)))
        setattr(obj, name, value)

    def set_forward(self, module: nn.Module, make: Callable[..., Callable], *args: Any) -> None:
        """Give this instance its own ``forward``: ``make(*args)``, a function taking the module first."""
        self.set(module, "forward", InstanceForward(module, make, *args))

    def on_undo(self, obj: Any, method: str, *args: Any) -> None:
        """Call ``obj.method(*args)`` on undo. Kept as data, not a closure, so that a deepcopy of
        the model carries a log that undoes the copy, not the original."""
        self._undo_calls.append((obj, method, args))

    def undo(self) -> None:
        for obj, method, args in reversed(self._undo_calls):
            getattr(obj, method)(*args)
        for obj, name, had, old in reversed(self._log):
            if isinstance(getattr(obj, name, None), (onn.RMSNorm, onn.LayerNorm)):
                # Hand the drop-in's current parameters back (load_state_dict(assign=True)
                # may have replaced them since the swap).
                for pname, p in getattr(obj, name).named_parameters(recurse=False):
                    setattr(old, pname, p)
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._log.clear()
        self._undo_calls.clear()


class InstanceForward:
    """A module instance's own forward, ``make(*args)`` bound to the module as a method is.

    Where a bound method of a local function would not: it pickles, as the module and the
    call ``make(*args)`` that rebuilds the function (``torch.save(model)`` of an optimized
    model loads optimized; a deepcopy gets its own), and it shows the signature of the
    forward it replaces, which Hugging Face reads (Trainer keeps only the dataset columns
    the model's forward names; generate passes ``attention_mask`` and ``logits_to_keep``
    only to a forward that names them), as does the function itself. Attributes of the
    function (``takes_residual``) read through.
    """

    # a function's own attributes that callers of a bound method read through it
    # (torch.export reads forward.__code__); other dunder names (pickling, copying,
    # __wrapped__) are not passed on
    _FUNCTION_ATTRIBUTES = frozenset(("__code__", "__defaults__", "__kwdefaults__", "__globals__", "__name__",
                                      "__qualname__"))

    def __init__(self, module: nn.Module, make: Callable[..., Callable], *args: Any) -> None:
        self.__self__, self.__func__ = module, make(*args)
        self._make = (make, args)
        try:
            signature = inspect.signature(module.forward)  # the replaced forward's (self bound)
        except (TypeError, ValueError):  # a builtin or other uninspectable forward: the function's own
            return
        self.__signature__ = signature
        # and the function's, self first: a wrapper of it bound to the module (accelerate's
        # mixed-precision forward, which Trainer leaves in place) shows the same signature
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        self.__func__.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if "__func__" not in self.__dict__ or (name.startswith("__") and name not in self._FUNCTION_ATTRIBUTES):
            raise AttributeError(name)
        return getattr(self.__func__, name)

    def __reduce__(self):
        return InstanceForward, (self.__self__, self._make[0], *self._make[1])


# ------------------------------------------------------------------------------ norms


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _swap_norm(patches: Patches, parent: nn.Module, name: str, drop_in: nn.Module) -> None:
    """``parent.name = drop_in``, the drop-in sharing the replaced module's hook registries, so
    hooks registered before ``optimize`` keep firing (and their handles keep removing them)."""
    for hooks in _HOOK_DICTS:
        setattr(drop_in, hooks, getattr(getattr(parent, name), hooks))
    patches.set(parent, name, drop_in)


def swap_rms_norm(patches: Patches, parent: nn.Module, name: str, offset: float = 0.0) -> None:
    _swap_norm(patches, parent, name, onn.RMSNorm.from_hf(getattr(parent, name), offset))


def swap_layer_norm(patches: Patches, parent: nn.Module, name: str) -> None:
    _swap_norm(patches, parent, name, onn.LayerNorm.from_hf(getattr(parent, name)))


def hooked(*modules: nn.Module) -> bool:
    """Whether any of ``modules`` has forward or backward hooks, or global forward hooks are
    set: then a fused path that skips calling the module would skip the hooks."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                       for m in modules))


def norm_passing_input(norm: nn.Module, h: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(h), h)`` with h handed on through the norm's node (``norm.passing_input``); a
    norm with hooks is called as HF calls it, so the hooks see h and may replace the output."""
    if hooked(norm):
        return norm(h), h
    return norm.passing_input(h)


def add_norm(norm: nn.Module, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(h + x), h + x)`` in one fused pass (``norm(x, h)``); a norm with hooks is
    called on the sum as HF calls it, so the hooks see it and may replace the output."""
    if hooked(norm):
        h = h + x
        return norm(h), h
    return norm(x, h)


def swap_decoder_rms_norms(patches: Patches, model: nn.Module, layer_fused: Callable, recompute: bool,
                           layer_norms: tuple[str, ...], offset: float = 0.0) -> None:
    """The RMSNorm families' norm swap: each layer's ``layer_norms`` (and q/k norms where the
    attention has them) become onepass RMSNorms, each layer runs ``layer_fused``, and the
    final norm is swapped too."""
    base = model.base_model
    for layer in base.layers:
        for name in layer_norms:
            swap_rms_norm(patches, layer, name, offset)
        if hasattr(layer.self_attn, "q_norm"):
            swap_rms_norm(patches, layer.self_attn, "q_norm", offset)
            swap_rms_norm(patches, layer.self_attn, "k_norm", offset)
        patches.set_forward(layer, layer_forward, layer_fused, recompute)
    swap_rms_norm(patches, base, "norm", offset)


# ------------------------------------------------------------------ decoder layers


def _hf_checkpoints_in_call() -> bool:
    """Older transformers checkpoint a GradientCheckpointingLayer in ``__call__``; newer ones
    (5.2x) wrap each subclass's ``forward``, which an instance ``forward`` bypasses."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in GradientCheckpointingLayer.__dict__


def layer_forward(fused: Callable, recompute: bool) -> Callable:
    """A decoder layer's forward from ``fused(self, recompute_here, *args, **kwargs)``,
    gradient-checkpointed as HF would when enabled.

    ``recompute_here`` is ``recompute`` in training, outside checkpointing (which already
    recomputes the whole layer in backward); see ``after_norm``.
    """
    checkpoints_in_call = _hf_checkpoints_in_call()

    @functools.wraps(fused)
    def forward(self, *args, **kwargs):
        checkpointing = getattr(self, "gradient_checkpointing", False) and self.training
        if checkpointing and not checkpoints_in_call:
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            pop_cache(kwargs)
            return self._gradient_checkpointing_func(functools.partial(fused, self, False, **kwargs), *args)
        return fused(self, recompute and self.training and not checkpointing, *args, **kwargs)

    return forward


# ---------------------------------------------------------- recomputation in backward
#
# Autograd keeps every tensor an op saves for backward until that backward runs. Some are
# cheap to rebuild from tensors it keeps anyway: a norm's output from the norm's input h
# (saved by the norm's own backward), the MLP's act(gate) * up from gate and up (saved by
# the activation's backward). ``with_recomputed(fn, produced, recompute, inputs)`` runs
# ``fn(produced)`` under saved-tensor hooks: what autograd saves of ``produced`` (the
# tensor or a view of it: F.linear on a 3-D input saves a 2-D view) becomes a handle, and
# the first unpack in backward runs ``recompute(*inputs)``, shared by every consumer (q, k
# and v projections, a LoRA adapter) until the last one has unpacked it.
#
# Every other tensor saved inside the region is kept as autograd would, through a
# detached alias (returning the tensor itself would make a node that saves its own output
# reference itself: a leak), with autograd's in-place check redone by hand (autograd skips
# it for tensors that went through hooks).


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


def gated_recompute_status(switches: dict[str, bool], status: dict[str, str], layers, hidden_size: int,
                           intermediate_size: int) -> str:
    """The recompute report line of the gated-MLP families (Llama, Gemma): the two norm
    outputs when the layer forward is fused; the gated product when the MLP is fused and
    some layer's MLP runs as modules (an MLP node never keeps the product, recompute or not)."""
    recomputed = []
    if switches["norm"]:
        recomputed.append(("the norm outputs feeding q/k/v and gate/up", 2 * hidden_size, "2 rms_norm"))
    if status.get("activation", "").startswith(FUSED) and not all(projections.mlp_node(layer.mlp) for layer in layers):
        recomputed.append(("the MLP's act(gate) * up", intermediate_size, "1 gated activation"))
    return recompute_status(recomputed)


# --------------------------------------------------------------------------------- MLP

# HF activation names -> the id of the activation onepass fuses into ``act(gate) * up``.
GATED = {
    "silu": activation.SILU,
    "swish": activation.SILU,
    "gelu_pytorch_tanh": activation.GELU_TANH,
    "gelu_new": activation.GELU_TANH,
    "gelu": activation.GELU_ERF,
}


def gated_mlp_forward(act: int, recompute: bool) -> Callable:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the activation and product fused.

    Plain linear projections run as one node (``projections.gated_mlp``): no gradient sum
    for gate/up, and the product never kept (its backward rebuilds it). Otherwise (PEFT LoRA
    layers, ...) the projections are called as modules, and with ``recompute``, in training,
    the product is not kept for backward but recomputed there from gate and up, which the
    activation keeps anyway. ``residual`` (from ``mlp_plus_residual``): returns residual +
    the MLP's output, the add inside the down projection's launch in a decode step.
    """

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if projections.mlp_node(self) and use_triton(x):
            return projections.gated_mlp(self, x, act, residual)
        gate, up = projections.linears(x, (self.gate_proj, self.up_proj))
        product = activation.gated(gate, up, act)
        if recompute and self.training:
            out = with_recomputed(self.down_proj, product, functools.partial(activation.gated, act=act), (gate, up))
        else:
            out = self.down_proj(product)
        return out if residual is None else residual + out

    forward.takes_residual = True
    return forward


def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``; a module running a onepass forward, with no hooks to honour,
    runs that forward's function directly: torch.compile guards a forward set on an instance
    by its identity, so calling each layer's block through the module compiles a graph per
    layer, where the function, one for every layer, compiles once."""
    forward = module.forward
    if type(forward) is InstanceForward and not hooked(module) and module._compiled_call_impl is None:
        return forward.__func__(module, *args, **kwargs)
    return module(*args, **kwargs)  # (module.compile() compiled its call)


def mlp_plus_residual(recompute: bool, mlp: nn.Module, normed: Tensor, norm: nn.Module, h: Tensor) -> Tensor:
    """``h + mlp(normed)`` (``normed`` is ``norm``'s output whose input was h, as in
    ``after_norm``). An MLP running onepass's forward without hooks (whose output would
    otherwise include h) takes h itself, so that a decode step adds it inside the down
    projection's launch instead of a separate add."""
    if not recompute and getattr(mlp.forward, "takes_residual", False) and not hooked(mlp):
        return call(mlp, normed, residual=h)
    return h + after_norm(recompute, functools.partial(call, mlp), normed, norm, h)


def patch_gated_mlps(patches: Patches, layers, act_name: str, recompute: bool) -> str:
    act = GATED.get(act_name)
    if act is None:
        return f"{UNFUSED}: activation {act_name!r} has no fused onepass op (known: {sorted(GATED)})"
    for layer in layers:
        patches.set_forward(layer.mlp, gated_mlp_forward, act, recompute)
    op = "swiglu" if act == activation.SILU else "geglu"
    return (f"{FUSED}: {op} ({act_name}); plain linear projections as one node (no gate/up gradient sum, "
            "product rebuilt in backward)")


# --------------------------------------------------------------- rotary attention


# The attribute of a KV cache through which onepass.Decoder passes, during its decode steps,
# each sequence's valid cache length (int32 [batch], a device tensor): the attention
# function "onepass" then runs decode_attention over the cache (no mask, no repeated k/v).
DECODE_LENGTHS = "onepass_decode_lengths"


def rotary_attention_forward(rope: Callable, passes_softcap: bool) -> Callable:
    """The attention block of the rotary families with RoPE done by ``rope`` on the
    [batch, seq, heads, dim] projections (no transposed copies); q/k norms (Qwen3, Gemma 3)
    are applied per head first. Plain linear q/k/v projections run as one node whose
    backward adds their input gradients inside its matmuls (``projections.linears``).
    Attention itself goes through transformers' registry, so
    ``config._attn_implementation`` (sdpa, flash, onepass, ...) picks the kernel. In a decode
    step of ``onepass.Decoder`` k and v go to the static cache in one launch that also applies
    RoPE to q and k (``kv_cache.append_to_cache``), so rope runs no launch of its own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = projections.linears(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        lengths = getattr(cache, DECODE_LENGTHS, None)
        if lengths is not None:
            kwargs["cache_seqlens"] = lengths
        layer = _static_layer(cache, self.layer_idx, k, v) if lengths is not None else None
        rope_in_append = layer is not None and _whole_head_tables(cos, sin, k)
        if not rope_in_append:
            q, k = rope(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if layer is not None:  # one launch; with the tables, k stored rotated and q rotated into a new tensor
            tables = (q, cos, sin) if rope_in_append else ()
            rotated = kv_cache.append_to_cache(layer.keys, layer.values, layer.cumulative_length, k, v, *tables)
            q, k, v = (rotated if rope_in_append else q), layer.keys, layer.values
        elif cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        extra = {"softcap": self.attn_logit_softcapping} if passes_softcap else {}
        out, weights = attention(
            self, q, k, v, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)),
            **extra, **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward


def _static_layer(cache, layer_idx: int, k: Tensor, v: Tensor):
    """In a decode step of ``onepass.Decoder``: the transformers ``StaticLayer`` that takes k
    [B, T, Hk, D] and v [B, Hk, T, D] in one launch (``kv_cache.append_to_cache``, instead of
    ``cache.update``'s five kernels), or None if the cache's layer is not one ready for them."""
    from transformers.cache_utils import StaticLayer

    layer = cache.layers[layer_idx]
    k = k.transpose(1, 2)
    if (type(layer) is not StaticLayer or not layer.is_initialized or not projections.nodes_run(k)
            or k.dtype != layer.keys.dtype or v.dtype != layer.values.dtype
            or k.shape[:2] + k.shape[3:] != layer.keys.shape[:2] + layer.keys.shape[3:] or v.shape != k.shape
            or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    return layer


def _whole_head_tables(cos: Tensor, sin: Tensor, k: Tensor) -> bool:
    """Whether HF's rotary tables for k [B, T, Hk, D] are [B or 1, T, D] over the whole head
    (no partial rotary) with unit last strides: what ``append_to_cache`` applies itself."""
    batch, n_new, _, head_dim = k.shape
    return (cos.dim() == 3 and cos.shape == sin.shape and cos.shape[1:] == (n_new, head_dim)
            and cos.shape[0] in (1, batch) and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.is_floating_point() and sin.is_floating_point() and cos.device == sin.device == k.device)


def patch_rotary_attention(patches: Patches, layers, passes_softcap: bool = False) -> str:
    rope = getattr(ops, "rope", None)
    if rope is None:
        return f"{UNFUSED}: onepass.ops.rope is not in this build"
    for layer in layers:
        patches.set_forward(layer.self_attn, rotary_attention_forward, functools.partial(rope, layout="bshd"),
                            passes_softcap)
    return f"{FUSED}: rope on q and k in one pass, [batch, seq, heads, dim] layout"


# ------------------------------------------------------------ attention (registry)
def use_onepass_attention(patches: Patches, model: nn.Module) -> str:
    if getattr(ops, "attention", None) is None:
        return f"{UNFUSED}: onepass.ops.attention is not in this build"
    patches.on_load(hf_attention.register)
    previous = model.config._attn_implementation
    model.set_attn_implementation("onepass")
    patches.on_undo(model, "set_attn_implementation", previous)
    return f"{FUSED}: attn_implementation 'onepass' (was {previous!r}); padding masks and decode use SDPA"


# --------------------------------------------------------------------- LM head + loss


@functools.cache
def _unfilled_cache_type() -> type:
    from transformers import DynamicCache

    class UnfilledCache(DynamicCache):
        """A training forward's KV cache that is never filled: ``update`` hands k and v back,
        as an empty cache returns them, without HF's copy of every layer's k and v (32
        copies, ~1.0 ms a step, in a profile of Llama-3.2-1B at 4 x 2048 on an H200)."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return key_states, value_states

    return UnfilledCache


def _fused_keywords(model_class: type) -> frozenset[str]:
    """The keywords the fused path takes: those the class's own forward names, transformers'
    attention and loss keywords (``TransformersKwargs``) and the loss's own. Any other belongs
    to a forward another library set on the instance before ``optimize`` (TRL's SFTTrainer
    passes ``fused_lm_head=True`` to the head it put there), which then runs as it is."""
    from transformers.utils.generic import TransformersKwargs

    named = [name for name, p in inspect.signature(model_class.forward).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return frozenset((*named, *TransformersKwargs.__annotations__, *CACHE_KEYWORDS, "return_dict", "shift_labels",
                      "ignore_index"))


def causal_lm_forward(original: Callable, softcap: float | None, fused_keywords: frozenset[str]) -> Callable:
    """With labels in training: the base model, then the LM head and the shifted
    cross-entropy in one ``linear_cross_entropy`` (logits never materialised; the output's
    ``logits`` is None). Otherwise (inference, generate, no labels) the original forward
    (``original``: a function taking the model first, see ``_unbound_forward``).
    A head weight tied to the input embedding gets one gradient, the embedding's token rows
    added into the head's (``tied_embedding``), not two [V, H] gradients summed by autograd.

    No KV cache is filled unless asked for (``use_cache=True`` or a cache passed), yet
    the base model gets an (unfilled) cache: without one, HF checks the position ids for
    packed sequences, a host sync every forward (so the host cannot queue the step ahead of
    the GPU), and under torch.compile that check builds a full mask instead (the compiled
    step took 140.9 ms against 124.0, H200). Where HF would make that check (the cache off,
    by argument or config, position ids given and no attention mask: the padding-free
    batches of ``DataCollatorWithFlattening``, whose documents must not attend to each
    other) the base model gets no cache, as from HF. Under gradient checkpointing, whose
    layers drop any cache with a warning, the base model runs with ``use_cache=False``."""
    unfilled_cache = _unfilled_cache_type()
    cache_name = cache_keyword()

    def forward(self, input_ids=None, *args, labels=None, **kwargs):
        # (positional arguments: labels may be among them; a head wrapped since optimize, e.g. by a PEFT
        # adapter, or with hooks is called as HF calls it; so is a keyword of another forward, see _fused_keywords)
        if (labels is None or not self.training or args or not fused_keywords.issuperset(kwargs)
                or not _fusable_head(self.lm_head)):
            if labels is not None:
                kwargs["labels"] = labels
            return original(self, input_ids, *args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        return_dict = kwargs.pop("return_dict", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        cache = pop_cache(kwargs)
        if cache is not None:
            kwargs[cache_name] = cache
        unfilled = not kwargs.get("use_cache") and cache is None
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(self.config, "use_cache", False) if use_cache is None else use_cache  # HF's default
        maybe_packed = not use_cache and kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None
        if unfilled and (maybe_packed or getattr(self.base_model, "gradient_checkpointing", False)):
            kwargs["use_cache"] = False
        elif unfilled:
            kwargs[cache_name] = unfilled_cache(config=self.config)
        input_ids, head_weight = tied_embedding.tie(self, input_ids, kwargs)
        out = self.base_model(input_ids, **kwargs)
        hidden = out[0]
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = self.lm_head(  # through the module: an FSDP2 unit gathers its weight
            hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device), weight=head_weight,
            ignore_index=ignore_index, reduction="mean" if num_items is None else "sum", softcap=softcap,
            loss_dtype=torch.float32,
        )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        result = CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            **{cache_name: None if unfilled else getattr(out, cache_name, None)},
        )
        # as HF's tuple, (loss, logits, ...): the logits' place kept (None), the rest as to_tuple gives it
        return (loss, None, *result.to_tuple()[1:]) if return_dict is False else result

    return forward


def _fusable_head(head: nn.Module) -> bool:
    """Whether the LM head runs the fused loss: a plain ``nn.Linear`` without hooks, or one
    that FSDP2 made a unit of its own with only FSDP's hooks (which gather its weight around
    the call, whatever the call computes)."""
    if type(head) is nn.Linear:
        return not hooked(head)
    return type(head).__bases__[1:] == (nn.Linear,) and not hooked() and distributed.fsdp_hooks_only(head)


def lm_head_forward() -> Callable:
    """The LM head's forward: ``nn.Linear``'s, or with ``targets`` the fused loss of its logits
    (``linear_cross_entropy``; ``weight`` stands in for the module's own where a tied input
    embedding hands it on), so that the loss runs inside the module's call."""

    def forward(self, input: Tensor, targets: Tensor | None = None, *, weight: Tensor | None = None,
                **loss_kwargs) -> Tensor:
        if targets is None:
            return nn.functional.linear(input, self.weight, self.bias)
        return ops.linear_cross_entropy(input, self.weight if weight is None else weight, targets, bias=self.bias,
                                        **loss_kwargs)

    return forward


def _unbound_forward(model: nn.Module) -> Callable:
    """The model's current forward as a function of the model: its method's function when
    bound to the model (so a deepcopy of the optimized model runs its own weights), else a
    call of whatever callable the instance holds."""
    bound = model.forward
    if getattr(bound, "__self__", None) is model:
        return bound.__func__
    return lambda _model, *args, **kwargs: bound(*args, **kwargs)


def patch_lm_loss(patches: Patches, model: nn.Module, softcap: float | None = None) -> str:
    head = getattr(model, "lm_head", None)
    if head is None:
        return f"{UNFUSED}: {type(model).__name__} has no lm_head (not a causal LM)"
    if type(head) is not nn.Linear:
        return f"{UNFUSED}: lm_head is a {type(head).__name__}, not a plain nn.Linear"
    if getattr(ops, "linear_cross_entropy", None) is None:
        return f"{UNFUSED}: onepass.ops.linear_cross_entropy is not in this build"
    patches.set_forward(model, causal_lm_forward, _unbound_forward(model), softcap, _fused_keywords(type(model)))
    patches.set_forward(head, lm_head_forward)
    status = f"{FUSED}: lm_head + cross-entropy in linear_cross_entropy when labels are given in training"
    embed = model.get_input_embeddings()
    if embed is not None and getattr(embed, "weight", None) is head.weight:
        status += "; the tied input embedding's token rows are added into the head's weight gradient"
    return status
