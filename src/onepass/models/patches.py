"""The undo log and the instance forwards every patch is made of, and the tests of whether a
module may be bypassed (its hooks honoured otherwise).

Everything onepass changes in a model is per *instance*: a fused ``forward`` is set as an
instance attribute (the class stays untouched, so other models in the process are
unaffected), and norm modules are swapped for ``onepass.nn`` drop-ins that share their
Parameter objects (state_dict keys and values unchanged). ``Patches`` records each change so
that ``onepass.undo`` restores the model exactly.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from onepass import nn as onn
from onepass.ops.dispatch import use_triton

FUSED, UNFUSED = "fused", "unfused"
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
RECOMPUTED = "on"  # the status of the recompute switch when something is recomputed


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
    function (``takes_residual``) are this object's too.
    """

    # a function's own attributes that callers of a bound method read through it
    # (torch.export reads forward.__code__); other dunder names (pickling, copying,
    # __wrapped__) are not passed on
    _FUNCTION_ATTRIBUTES = frozenset(("__code__", "__defaults__", "__kwdefaults__", "__globals__", "__name__",
                                      "__qualname__"))

    def __init__(self, module: nn.Module, make: Callable[..., Callable], *args: Any) -> None:
        self.__self__, self.__func__ = module, make(*args)
        self._make = (make, args)
        # the function's own attributes (takes_residual) as this object's: read through __getattr__, each
        # read is a Python frame, which a compiled model's guards ran every call, once a layer
        self.__dict__.update((k, v) for k, v in vars(self.__func__).items() if not k.startswith("__"))
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


def hooked(*modules: nn.Module) -> bool:
    """Whether any of ``modules`` has forward or backward hooks, or global forward hooks are
    set: then a fused path that skips calling the module would skip the hooks."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                       for m in modules))


def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``; a module running a onepass forward, with no hooks to honour,
    runs that forward's function directly: torch.compile guards a forward set on an instance
    by its identity, so calling each layer's block through the module compiles a graph per
    layer, where the function, one for every layer, compiles once."""
    forward = module.forward
    if type(forward) is InstanceForward and not hooked(module) and module._compiled_call_impl is None:
        return forward.__func__(module, *args, **kwargs)
    return module(*args, **kwargs)  # (module.compile() compiled its call)


def unhooked(module: nn.Module) -> bool:
    """Whether ``module`` has no module hooks or replaced forward to honour, so that calling
    its computation directly, not the module, changes nothing."""
    return not module._forward_hooks and not module._forward_pre_hooks and "forward" not in module.__dict__


def plain(modules: tuple[nn.Module, ...]) -> bool:
    """Whether ``modules`` are plain linears: no module hooks or replaced forwards to honour."""
    return all(type(m) is nn.Linear and unhooked(m) for m in modules)


def nodes_run(x: torch.Tensor) -> bool:
    """Whether onepass's ``autograd.Function`` nodes (LoRA's shared node) run for input ``x``:
    the Triton path (not the reference), not under torch.compile."""
    return use_triton(x) and not torch.compiler.is_compiling()
