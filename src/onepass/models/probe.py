"""The check that a fused forward computes what the module it replaces computes.

Before anything is patched, ``record`` runs the model once on a few random tokens (no
gradient, eval mode, no cache) and keeps the call of the first module of each kind among
those that a patch would replace: its arguments and its output. ``differs`` then runs the
fused forward on those arguments, every onepass op as its PyTorch reference (the check is of
the structure, the kernels have tests of their own), and compares. A fused forward that
disagrees is not set: the module keeps its forward and the report says why.

The comparison is relative (‖fused − module‖ / ‖module‖) with a tolerance of the model's
precision: a residual multiplier, a norm in the wrong place or a missing scale are errors of
order one; rounding in bf16 is of order 1e-2 at most.

Weights on the meta device (a model to be materialised after sharding) cannot run: then
nothing is recorded, and patches rest on the modules' attributes alone (``record`` returns
None and the report says "not probed").
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from onepass.models.patches import HOOK_DICTS
from onepass.ops.dispatch import reference_mode

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
TOKENS = 8  # the probe's sequence: longer than the tests' sliding windows


@dataclass
class Call:
    """A recorded call of a module: its arguments and its output."""

    args: tuple
    kwargs: dict
    output: Any


def _first(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return getattr(output, "logits", None) if hasattr(output, "logits") else None


@contextlib.contextmanager
def _hooks_off(root: nn.Module) -> Iterator[None]:
    """The module hooks of ``root`` and its submodules set aside: the probe sees what the modules
    compute, and a user's hooks do not see the probe (the fused forwards honour them when run)."""
    saved = [(m, name, getattr(m, name)) for m in root.modules() for name in HOOK_DICTS]
    for m, name, _ in saved:
        setattr(m, name, OrderedDict())
    try:
        yield
    finally:
        for m, name, hooks in saved:
            setattr(m, name, hooks)


def kind(module: nn.Module) -> tuple:
    """What one probe stands for: the module's class, and its own forward if it has one."""
    return type(module), id(module.__dict__.get("forward"))


def record(model: nn.Module, modules: Iterable[nn.Module]) -> dict[int, Call] | None:
    """One forward of ``model`` (a causal LM) on ``TOKENS`` random ids, recording each call of
    ``modules`` (by ``id``; a module called twice keeps its first call); None if the weights
    are on the meta device."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return None
    calls: dict[int, Call] = {}

    def hook(module, args, kwargs, output):
        calls.setdefault(id(module), Call(args, dict(kwargs), output))

    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, TOKENS), generator=torch.Generator().manual_seed(0)).to(weight.device)
    training = model.training
    model.eval()
    try:
        with _hooks_off(model), torch.no_grad():
            for m in dict.fromkeys(modules):
                m.register_forward_hook(hook, with_kwargs=True)  # (on the set-aside registries' stand-ins)
            # an all-ones mask: HF's check of the position ids for packed sequences stays off (a host sync)
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as error:
        raise ValueError(f"onepass.optimize: {type(model).__name__}'s own forward fails on {TOKENS} random tokens "
                         f"({type(error).__name__}: {error}); onepass checks every fused part against it, so it "
                         "cannot optimize this model") from error
    finally:
        model.train(training)
    return calls


def differs(module: nn.Module, forward: Callable, call: Call | None) -> str | None:
    """None if ``forward(module, *args, **kwargs)`` gives the recorded output of ``call``
    (None: not recorded, nothing to check), else why not (a phrase for the report)."""
    if call is None:
        return None
    training = module.training
    module.eval()
    try:
        with _hooks_off(module), torch.no_grad(), reference_mode():
            out = forward(module, *call.args, **call.kwargs)
    except Exception as error:  # noqa: BLE001 - any failure means the fused forward does not fit this module
        return f"the fused forward fails on a probe ({type(error).__name__}: {error})"
    finally:
        module.train(training)
    return mismatch(_first(out), _first(call.output))


def mismatch(out: Tensor | None, ref: Tensor | None) -> str | None:
    """None if ``out`` matches ``ref`` within the tolerance of ``ref``'s dtype, else why not."""
    if out is None or ref is None or out.shape != ref.shape:
        return "the fused forward's output is not shaped as the module's on a probe"
    ref64, out64 = ref.double(), out.double()
    scale = ref64.norm().item()
    error = (out64 - ref64).norm().item() / (scale if scale > 0 else 1.0)
    if not error <= TOLERANCE.get(ref.dtype, 1e-4):  # (NaN fails)
        return f"the fused forward differs from the module's on a probe (relative error {error:.2g})"
    return None


def first_of_each_kind(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The first module of each ``kind`` (one probe a class: they share their code; a module
    with a forward of its own is a kind of its own)."""
    seen: dict[tuple, nn.Module] = {}
    for m in modules:
        seen.setdefault(kind(m), m)
    return list(seen.values())
