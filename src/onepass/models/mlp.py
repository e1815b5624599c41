"""MLPs recognised by their parts, run with the activation fused.

Candidates, by their linear projections (``nn.Linear`` modules, PEFT-wrapped or not):

    gated     gate_proj, up_proj, down_proj     down(act(gate(x)) * up(x))        (Llama, Qwen, Gemma, ...)
    gate_up   gate_up_proj, down_proj           the same, gate and up one weight  (Phi-3)
    plain     c_fc, c_proj (with biases)        c_proj(gelu(c_fc(x)))             (StarCoder2)

The activation module (``act_fn``, ``activation_fn`` or ``act``) is recognised by what it
computes on a probe (SiLU, GELU tanh or exact, whatever ``hidden_act`` called it); the whole
MLP is then checked on the model's probe (``onepass.models.probe``), and one that differs keeps
its forward. Mixture-of-experts blocks are not MLPs here: their shared experts are, and their
experts run through transformers' experts registry (``onepass.models.experts``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from onepass import ops
from onepass.models import probe, projections
from onepass.models.patches import FUSED, UNFUSED, Patches, call, hooked, plain
from onepass.models.recompute import after_norm, with_recomputed
from onepass.ops import activation
from onepass.ops import projections as projection_ops
from onepass.ops.dispatch import use_triton

ACT_NAMES = ("act_fn", "activation_fn", "act")
_REFERENCES = {activation.SILU: F.silu, activation.GELU_TANH: functools.partial(F.gelu, approximate="tanh"),
               activation.GELU_ERF: F.gelu}
_OP_NAMES = {activation.SILU: "swiglu", activation.GELU_TANH: "geglu (tanh)", activation.GELU_ERF: "geglu"}
_PARTS = {"gated": ("gate_proj", "up_proj", "down_proj"), "gate_up": ("gate_up_proj", "down_proj"),
          "plain": ("c_fc", "c_proj")}


def activation_of(module: nn.Module) -> int | None:
    """The id of the activation ``module``'s activation attribute computes, or None."""
    fn = next((getattr(module, n) for n in ACT_NAMES if callable(getattr(module, n, None))), None)
    if fn is None:
        return None
    x = torch.linspace(-8.0, 8.0, 161)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a probe is not recognised
        return None
    for act, ref in _REFERENCES.items():
        if isinstance(y, Tensor) and y.shape == x.shape and torch.allclose(y.float(), ref(x), rtol=1e-5, atol=1e-6):
            return act
    return None


def kind_of(mlp: nn.Module) -> str | None:
    """Which of the candidate layouts ``mlp`` has (its projections are linear modules), or None."""
    for kind, names in _PARTS.items():
        projs = [getattr(mlp, n, None) for n in names]
        if all(isinstance(p, nn.Module) and isinstance(getattr(p, "weight", None), Tensor) for p in projs):
            return kind
    return None


def _gate_up(self, kind: str, x: Tensor) -> tuple[Tensor, Tensor]:
    if kind == "gated":
        return projections.linears(x, (self.gate_proj, self.up_proj))
    (gate_up,) = projections.linears(x, (self.gate_up_proj,))
    return gate_up.chunk(2, dim=-1)


def _node_weights(self, kind: str, x: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(W_gate, W_up, W_down) where the MLP runs as one node here: bias-free plain linears on
    the Triton path; else None. Phi-3's one gate_up weight is split as views."""
    projs = tuple(getattr(self, n) for n in _PARTS[kind])
    if not (projections.fusable(x, projs) and all(p.bias is None for p in projs)):
        return None
    if kind == "gated":
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
    gate, up = self.gate_up_proj.weight.chunk(2, dim=0)
    return gate, up, self.down_proj.weight


def gated_mlp_forward(kind: str, act: int, recompute: bool) -> Callable:
    """``down(act(gate(x)) * up(x))`` with the activation and product fused.

    Plain linear projections run as one node (``ops.projections.gated_mlp``): no gradient
    sum for gate/up, and the product never kept (its backward rebuilds it). Otherwise (PEFT
    LoRA layers, ...) the projections are called as modules, and with ``recompute``, in
    training, the product is not kept for backward but recomputed there from gate and up,
    which the activation keeps anyway. ``residual`` (from ``mlp_plus_residual``): returns
    residual + the MLP's output, the add inside the down projection's launch in a decode step.
    """

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        weights = _node_weights(self, kind, x) if use_triton(x) else None
        if weights is not None:
            return projection_ops.gated_mlp(x, *weights, act, residual)
        gate, up = (t.contiguous() for t in _gate_up(self, kind, x))  # (Phi-3's halves of one output)
        product = activation.gated(gate, up, act)
        if recompute and self.training:
            out = with_recomputed(self.down_proj, product, functools.partial(activation.gated, act=act), (gate, up))
        else:
            out = self.down_proj(product)
        return out if residual is None else residual + out

    forward.takes_residual = True
    return forward


def plain_mlp_forward(approximate: str, recompute: bool) -> Callable:
    """``c_proj(gelu(c_fc(x)))`` with c_fc's bias add in the GELU pass (``bias_gelu``), then
    the MLP's output dropout (StarCoder2's ``residual_dropout``) in training."""
    gelu = functools.partial(ops.bias_gelu, approximate=approximate)

    def forward(self, x: Tensor) -> Tensor:
        pre = F.linear(x, self.c_fc.weight)
        hidden = gelu(pre, self.c_fc.bias)
        if recompute and self.training:  # bias_gelu's backward keeps pre (and the bias) anyway
            out = with_recomputed(self.c_proj, hidden, gelu, (pre, self.c_fc.bias))
        else:
            out = self.c_proj(hidden)
        return F.dropout(out, p=getattr(self, "residual_dropout", 0.0), training=self.training)

    return forward


def _forward_for(mlp: nn.Module, recompute: bool) -> tuple[Callable, tuple, str] | str:
    """(factory, its arguments, the op's name) of ``mlp``'s fused forward, or why there is none."""
    kind = kind_of(mlp)
    if kind is None:
        return "not an MLP of known parts"
    act = activation_of(mlp)
    if act is None:
        return "an activation with no fused onepass op (known: SiLU, GELU tanh, GELU)"
    if kind == "plain":
        if act == activation.SILU or type(mlp.c_fc) is not nn.Linear or mlp.c_fc.bias is None:
            return "a plain MLP other than bias + GELU on a plain c_fc linear"
        approximate = "tanh" if act == activation.GELU_TANH else "none"
        return plain_mlp_forward, (approximate, recompute), f"bias_gelu ({approximate})"
    return gated_mlp_forward, (kind, act, recompute), _OP_NAMES[act]


def patch_mlps(patches: Patches, layers, calls: dict | None, recompute: bool) -> str:
    """Give every recognised MLP inside ``layers`` (shared experts included) the fused forward."""
    modules = [m for layer in layers for m in layer.modules() if kind_of(m) is not None]
    if not modules:
        return "n/a: no MLP of known parts (gate/up/down, gate_up/down, c_fc/c_proj)"
    chosen, left = {}, {}
    for mlp in probe.first_of_each_kind(modules):
        found = _forward_for(mlp, False)
        why = found if isinstance(found, str) else probe.differs(mlp, found[0](*found[1]), (calls or {}).get(id(mlp)))
        if why is None:
            chosen[probe.kind(mlp)] = found
        else:
            left[type(mlp).__name__] = why
    ops_used = set()
    for mlp in modules:
        if probe.kind(mlp) in chosen:
            make, args, name = _forward_for(mlp, recompute)
            patches.set_forward(mlp, make, *args)
            ops_used.add(name)
    if left:
        listing = "; ".join(f"{name}: {why}" for name, why in left.items())
        return f"{UNFUSED}: {listing}" + (f" ({', '.join(sorted(ops_used))} elsewhere)" if ops_used else "")
    nodes = ("; a gated MLP of bias-free linears as one node (no gate/up gradient sum, product rebuilt in backward)"
             if any(name != "bias_gelu" and not name.startswith("bias_gelu") for name in ops_used) else "")
    return f"{FUSED}: {', '.join(sorted(ops_used))}{nodes}"


def recomputed_products(layers) -> list[tuple[str, int, str]]:
    """The ``recompute`` report's entries for the fused MLPs in ``layers``: the product of a gated
    MLP whose projections run as modules (one run as a node never keeps it), the GELU output of
    a plain MLP; (what, values a token a layer, the pass that rebuilds it)."""
    found = {}
    for m in (m for layer in layers for m in layer.modules()):
        make = getattr(m.__dict__.get("forward"), "_make", (None,))[0]
        if make is plain_mlp_forward:
            found["the GELU output"] = (m.c_proj.weight.shape[1], "1 bias_gelu")
        elif make is gated_mlp_forward:
            projs = tuple(getattr(m, n) for n in _PARTS[kind_of(m)])
            if not (plain(projs) and all(p.bias is None for p in projs)):
                found["the MLP's act(gate) * up"] = (m.down_proj.weight.shape[1], "1 gated activation")
    return [(what, values, cost) for what, (values, cost) in found.items()]


def mlp_plus_residual(recompute: bool, mlp: nn.Module, normed: Tensor, norm: nn.Module, h: Tensor) -> Tensor:
    """``h + mlp(normed)`` (``normed`` is ``norm``'s output whose input was h, as in
    ``after_norm``). An MLP running onepass's forward without hooks (whose output would
    otherwise include h) takes h itself, so that a decode step adds it inside the down
    projection's launch instead of a separate add."""
    if not recompute and getattr(mlp.forward, "takes_residual", False) and not hooked(mlp):
        return call(mlp, normed, residual=h)
    return h + after_norm(recompute, functools.partial(call, mlp), normed, norm, h)
