"""Record every aten op a step runs: bytes moved, FLOPs, module path, source line, producers.

A ``TorchDispatchMode`` sees each aten op after autograd, as a GPU would run it. Per op:

- bytes: each input and output storage counted once per op, by the elements its views
  really address (a broadcast, stride 0, touches its elements once; two slices of one
  storage touch their union, at most the storage). Views, reshapes that alias and
  allocations (``empty``) move nothing and launch nothing: they are not recorded.
- FLOPs: PyTorch's own formulas (``torch.utils.flop_counter``) for matmuls, convolutions
  and attention; one FLOP per output element for pointwise ops and per input element for
  reductions and the rest (copies, gathers: zero).
- producer of each input: the last op that wrote its storage, so a view of an
  intermediate leads back to the op that made it.

``F.scaled_dot_product_attention`` is recorded as one fused attention op (forward and
backward), which is what it runs as on a GPU, whatever backend it takes on the CPU or
on meta tensors.
"""

from __future__ import annotations

import itertools
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

aten = torch.ops.aten

# Ops that overwrite a mutated argument without reading it.
_WRITE_ONLY = {"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "exponential_", "bernoulli_"}
# Ops whose FLOPs are counted per input element (one per element reduced or combined).
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "prod", "norm",
               "linalg_vector_norm", "logsumexp", "_softmax", "_safe_softmax", "_log_softmax",
               "native_layer_norm", "_fused_rms_norm", "nll_loss_forward", "nll_loss2d_forward", "cumsum",
               "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm_backward",
               "_fused_rms_norm_backward", "nll_loss_backward", "embedding_dense_backward"}
_DATA_MOVEMENT = {"_to_copy", "clone", "copy_", "cat", "stack", "index_select", "embedding", "gather", "index",
                  "slice_scatter", "select_scatter", "index_put_", "index_put", "scatter", "scatter_add_",
                  "repeat", "constant_pad_nd", "fill_", "zero_", "zeros", "ones", "full", "zeros_like",
                  "ones_like", "full_like", "new_zeros", "new_ones", "scalar_tensor", "lift_fresh_copy",
                  "arange", "masked_fill", "where", "tril", "triu", "expand_copy"}
_GATHERS = {"embedding", "index_select", "gather", "index"}
_TORCH_DIR, _HERE, _STDLIB = os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(os.__file__)


@dataclass
class TensorUse:
    """One storage an op reads or writes."""

    storage: int  # storage identity (stable for the storage's lifetime)
    nbytes: int  # bytes the op touches in it
    shape: tuple
    dtype: str
    producer: Optional[int] = None  # index of the op that last wrote it; None: model input, weight, alloc

    @property
    def key(self) -> tuple:
        return (self.producer, self.storage)


@dataclass
class Op:
    index: int
    name: str  # "aten.mm" (overload packet)
    kind: str  # matmul | attention | pointwise | reduction | copy | other
    phase: str  # forward | backward
    module: str  # "model.layers.3.mlp" ("" at the top level)
    source: str  # "modeling_llama.py:123 (forward)"
    inputs: list[TensorUse] = field(default_factory=list)
    outputs: list[TensorUse] = field(default_factory=list)
    flops: int = 0
    dtype: str = "float32"
    launches: int = 1

    @property
    def bytes_read(self) -> int:
        return sum(u.nbytes for u in self.inputs)

    @property
    def bytes_written(self) -> int:
        return sum(u.nbytes for u in self.outputs)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class Trace:
    """What one step did: its ops in order, and which intermediates outlive it."""

    ops: list[Op]
    escaping: set  # (producer, storage) keys the caller still holds: returned, gradients, in-place on inputs
    external: dict  # storage -> name of a model input or weight
    layers: int = 0  # blocks in the model's layer list
    layer_prefix: str = ""  # "model.layers."


_storage_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> its number
_next_storage_id = itertools.count()


def _storage_id(t: torch.Tensor) -> int:
    """A number for t's storage that no other storage gets in this process. (Its address
    would: a freed storage's address is reused, and a new tensor there was taken for the
    old one, read from its writer: chains and savings varied from run to run.)"""
    storage = t.untyped_storage()
    sid = _storage_ids.get(storage)
    if sid is None:
        sid = _storage_ids[storage] = next(_next_storage_id)
    return sid


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes the elements of a view really address: a stride-0 (broadcast) dim counts once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return min(n * t.element_size(), t.untyped_storage().nbytes())


def _uses(tensors: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """(storage, bytes touched, first tensor) per storage: distinct views add up, capped at the storage."""
    views: dict[int, dict[tuple, int]] = {}
    first: dict[int, torch.Tensor] = {}
    for t in tensors:
        s = _storage_id(t)
        first.setdefault(s, t)
        views.setdefault(s, {})[(t.storage_offset(), tuple(t.shape), tuple(t.stride()))] = touched_bytes(t)
    return [(s, min(sum(v.values()), first[s].untyped_storage().nbytes()), first[s]) for s, v in views.items()]


def _kind(packet_name: str, func) -> str:
    if func.overloadpacket in flop_registry:
        return "matmul"
    if packet_name in _DATA_MOVEMENT:
        return "copy"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    if packet_name in _REDUCTIONS:
        return "reduction"
    return "other"


def _flops(func, kind, args, kwargs, out, in_tensors, out_tensors) -> int:
    if kind == "matmul":
        return int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
    if kind == "pointwise":
        return sum(t.numel() for t in out_tensors)
    if kind == "copy":
        return 0
    return max((t.numel() for t in in_tensors), default=0)


def _is_user_code(path: str) -> bool:
    """Not torch, not this recorder, not the standard library (installed packages are user code)."""
    if path.startswith(("<", _TORCH_DIR, _HERE)):
        return False
    return not path.startswith(_STDLIB) or "-packages" in path


def _source_line() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        if _is_user_code(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return ""


class _Progress:
    """A per-layer counter on stderr, silent when stderr is not a terminal or when quiet."""

    def __init__(self, layers: int, quiet: bool):
        self.layers = layers
        self.on = layers > 0 and not quiet and sys.stderr.isatty()
        self.last = None

    def update(self, phase: str, layer: Optional[int]):
        if self.on and layer is not None and (phase, layer) != self.last:
            self.last = (phase, layer)
            sys.stderr.write(f"\ronepass analyze: {phase} layer {layer + 1}/{self.layers}   ")
            sys.stderr.flush()

    def close(self):
        if self.on and self.last is not None:
            sys.stderr.write("\n")


class Recorder(TorchDispatchMode):
    """Records the aten ops run under it into ``self.ops``."""

    def __init__(self, external: dict[int, str], module_names: Callable[[], str], layer_prefix: str,
                 progress: _Progress):
        super().__init__()
        self.ops: list[Op] = []
        self.writer: dict[int, int] = {}  # storage -> index of the op that wrote it last
        self.external = external
        self.module_names = module_names
        self.layer_prefix = layer_prefix
        self.progress = progress
        self.phase = "forward"
        self.suppressed = 0  # > 0 inside a region recorded as one op (attention)

    # -- bookkeeping shared by aten ops and the fused attention op
    def use(self, storage: int, nbytes: int, t: torch.Tensor) -> TensorUse:
        return TensorUse(storage, nbytes, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                         self.writer.get(storage))

    def add(self, name, kind, reads, writes, flops, dtype) -> Op:
        module = self.module_names()
        op = Op(len(self.ops), name, kind, self.phase, module,
                _source_line() if self.phase == "forward" else "autograd",
                [self.use(s, n, t) for s, n, t in _uses(reads)], [], int(flops), dtype)
        op.outputs = [TensorUse(s, n, tuple(t.shape), str(t.dtype).replace("torch.", ""), op.index)
                      for s, n, t in _uses(writes)]
        for u in op.outputs:
            self.writer[u.storage] = op.index
        self.ops.append(op)
        if self.layer_prefix and module.startswith(self.layer_prefix):
            self.progress.update(self.phase, int(module[len(self.layer_prefix):].split(".")[0]))
        return op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) and args[0].is_meta:
            # Meta tensors hold no values. A yes/no check (models test "is this mask trivial?")
            # takes the common answer, True; a number cannot be made up.
            if args[0].dtype == torch.bool:
                return True
            raise RuntimeError("analyze: the model reads a value out of a tensor (.item()), which meta tensors "
                               "do not have; run it on real tensors (meta=False)")
        out = func(*args, **kwargs)
        if self.suppressed:
            return out
        schema = func._schema
        arg_values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        reads, writes = [], []
        packet = func.overloadpacket.__name__
        for a, v in zip(schema.arguments, arg_values):
            tensors = [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
            mutated = a.alias_info is not None and a.alias_info.is_write
            if mutated:
                writes += tensors
            if not (mutated and (a.is_out or packet in _WRITE_ONLY)):
                reads += tensors
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_storages = {_storage_id(t) for t in reads + writes}
        fresh = [t for t in outs if _storage_id(t) not in in_storages]
        writes += fresh
        if func.is_view or not writes or packet in ("empty", "empty_like", "empty_strided", "new_empty",
                                                     "new_empty_strided", "detach", "alias", "lift_fresh"):
            # Moves nothing, launches nothing; a fresh allocation forgets who wrote there before.
            for t in fresh:
                self.writer.pop(_storage_id(t), None)
            return out
        kind = _kind(packet, func)
        floating = [t for t in reads + writes if t.is_floating_point()]
        dtype = str((floating[0] if floating else (reads + writes)[0]).dtype).replace("torch.", "")
        op = self.add(f"aten.{packet}", kind, reads, writes,
                      _flops(func, kind, args, kwargs, out, reads, writes), dtype)
        if packet in _GATHERS:  # a lookup reads the rows it gathers, not the whole table
            table = op.inputs[0]
            table.nbytes = min(table.nbytes, op.bytes_written)
        return out


def _heads_of(q: torch.Tensor, t: torch.Tensor) -> tuple:
    """k or v's shape with q's head count: grouped-query attention does the FLOPs of its
    repeated heads (PyTorch's FLOP formulas reject unequal head counts)."""
    return (*t.shape[:-3], q.shape[-3], *t.shape[-2:])


class _Attention(torch.autograd.Function):
    """SDPA recorded as one fused kernel each way (flash / memory-efficient on a GPU)."""

    @staticmethod
    def forward(ctx, recorder, q, k, v, mask, kwargs):
        recorder.suppressed += 1
        try:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
            if out.dim() == 4:  # the layout flash attention writes, (batch, seq, heads, dim) in memory
                out = out.transpose(1, 2).contiguous().transpose(1, 2)
        finally:
            recorder.suppressed -= 1
        flops = sdpa_flop_count(q.shape, _heads_of(q, k), _heads_of(q, v)) * (0.5 if kwargs.get("is_causal") else 1.0)
        dtype = str(q.dtype).replace("torch.", "")
        reads = [q, k, v] + ([mask] if mask is not None else [])
        recorder.add("aten._scaled_dot_product_flash_attention", "attention", reads, [out], flops, dtype)
        ctx.recorder, ctx.kwargs = recorder, kwargs
        ctx.save_for_backward(q, k, v, mask, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        recorder, kwargs = ctx.recorder, ctx.kwargs
        q, k, v, mask, out = ctx.saved_tensors
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        recorder.suppressed += 1
        try:
            with torch.enable_grad():
                o = F.scaled_dot_product_attention(*inputs, attn_mask=mask, **kwargs)
                grads = torch.autograd.grad(o, inputs, dout)
            # flash attention writes each gradient in the layout of its input
            grads = [torch.empty_like(x).copy_(g) for x, g in zip((q, k, v), grads)]
        finally:
            recorder.suppressed -= 1
        flops = sdpa_backward_flop_count(dout.shape, q.shape, _heads_of(q, k), _heads_of(q, v))
        flops *= 0.5 if kwargs.get("is_causal") else 1.0
        reads = [q, k, v, out, dout] + ([mask] if mask is not None else [])
        recorder.add("aten._scaled_dot_product_flash_attention_backward", "attention", reads, list(grads), flops,
                     str(q.dtype).replace("torch.", ""))
        return (None, *grads, None, None)


class _FusedAttention(TorchFunctionMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.recorder.suppressed:
            q, k, v, *rest = args
            mask = rest[0] if rest else kwargs.pop("attn_mask", None)
            options = dict(zip(("dropout_p", "is_causal", "scale", "enable_gqa"), rest[1:]))
            options.update(kwargs)
            return _Attention.apply(self.recorder, q, k, v, mask, options)
        return func(*args, **kwargs)


class _NodeModules(TorchFunctionMode):
    """In forward, each autograd node a call makes (its outputs' and the untagged ones behind
    them) tagged with the module running it, for the backward's ops: the module tracker's
    view during backward held stale modules and put ops in other layers and modules."""

    def __init__(self, module_names: Callable[[], str]):
        super().__init__()
        self.module_names = module_names
        self.modules: dict = {}  # autograd node -> module path (the nodes are held: their ids stay theirs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            nodes = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
            if nodes:
                module = self.module_names()
                while nodes:
                    node = nodes.pop()
                    if node is not None and node not in self.modules:
                        self.modules[node] = module
                        nodes.extend(n for n, _ in node.next_functions)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        value = value.to_tuple()
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = _tensors(out)
    if not tensors:
        what = "None" if out is None else f"a {type(out).__name__}"
        raise TypeError("mode='train' runs the backward of the step's loss: the step must return a loss tensor "
                        f"(or an output with a .loss tensor, or tensors, the first of them summed); it returned "
                        f"{what}, with no tensor in it")
    first = tensors[0]
    return first if first.numel() == 1 else first.float().sum()


def _layer_list(model: Optional[torch.nn.Module]) -> tuple[str, int]:
    """The prefix of the model's largest ModuleList of blocks ("model.layers.") and its length."""
    best = ("", 0)
    if model is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.ModuleList) and len(mod) > best[1]:
                best = (f"{name}.", len(mod))
    return best


def record(fn: Callable, inputs: tuple, *, model: Optional[torch.nn.Module] = None,
           weights: Optional[dict[str, torch.Tensor]] = None, mode: str = "forward", quiet: bool = False) -> Trace:
    """Run ``fn(*inputs)`` (forward, or forward + backward of its loss for mode="train") and record it.

    ``model`` gives module paths and the layer counter; ``weights`` (default: the model's
    parameters and buffers) are the tensors ``fn`` uses besides ``inputs``.
    """
    if mode not in ("forward", "train"):
        raise ValueError(f"mode: expected 'forward' or 'train', got {mode!r}")
    if weights is None:
        weights = dict(model.named_parameters()) | dict(model.named_buffers()) if model is not None else {}
    external = {}
    for name, t in weights.items():
        external.setdefault(_storage_id(t), name)
    for i, t in enumerate(_tensors(inputs)):
        external.setdefault(_storage_id(t), f"input{i}")
    prefix, layers = _layer_list(model)
    progress = _Progress(layers, quiet)
    tracker = ModuleTracker()
    root = type(model).__name__ + "." if model is not None else ""

    def module_names() -> str:
        if recorder.phase == "backward":  # the module whose forward made the running autograd node
            name = node_modules.modules.get(torch._C._current_autograd_node())
            if name is not None:
                return name
        deepest = max((p for p in tracker.parents if p != "Global"), key=len, default="")  # (the tracker's top)
        return deepest[len(root):] if deepest.startswith(root) else ""

    recorder = Recorder(external, module_names, prefix, progress)
    node_modules = _NodeModules(module_names)
    try:
        with torch.set_grad_enabled(mode == "train"), tracker, recorder, _FusedAttention(recorder), node_modules:
            out = fn(*inputs)
            results = [loss_of(out)] if mode == "train" else _tensors(out)
            if mode == "train":
                recorder.phase = "backward"
                results[0].backward()
    finally:
        progress.close()
    held = [_storage_id(t) for t in results]
    if mode == "train":
        held += [_storage_id(w.grad) for w in weights.values() if w.grad is not None]
        held += [_storage_id(t.grad) for t in _tensors(inputs) if t.grad is not None]
    held += [s for s in external if s in recorder.writer]  # in-place updates of inputs, weights, buffers
    escaping = {(recorder.writer.get(s), s) for s in held}
    return Trace(recorder.ops, escaping, external, layers, prefix)
