"""nn.Module drop-ins over the onepass ops, parameter-compatible with Hugging Face's.

Each module keeps the parameter names of the module it replaces (``weight``, ``bias``), so
a state_dict saved from one loads into the other unchanged. ``from_hf`` builds a drop-in
that shares the original module's Parameter objects: an optimizer, a PEFT wrapper or a
tied weight that holds them keeps working after ``onepass.optimize`` swaps the module.

The norms also take the residual stream: ``norm(x, residual)`` returns
``(norm(residual + x), residual + x)`` from one fused pass (``add_rms_norm`` /
``add_layer_norm``), which is how the patched decoder layers carry the stream; and
``norm.passing_input(h)`` returns ``(norm(h), h)`` with h handed on through the norm's
node, so the stream's gradient is added inside the norm's backward (a layer's first norm).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from onepass import ops
from onepass.ops.norm import norm_passing_input


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    ``offset=0`` is Llama's RMSNorm (weight initialised to ones); ``offset=1`` is Gemma's,
    which stores ``scale - 1`` (weight initialised to zeros) and scales in fp32. ``eps=None``
    (``torch.nn.RMSNorm``'s default) is the input dtype's machine epsilon.
    """

    def __init__(self, hidden_size: int, eps: float | None = 1e-6, offset: float = 0.0, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.offset = offset
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The weight of an identity scale: ones, or zeros with Gemma's offset (as the modules replaced)."""
        (nn.init.ones_ if self.offset == 0 else nn.init.zeros_)(self.weight)

    @classmethod
    def from_hf(cls, module: nn.Module, offset: float = 0.0) -> "RMSNorm":
        """A drop-in sharing ``module.weight`` (eps read from ``variance_epsilon`` or ``eps``)."""
        if not hasattr(module, "variance_epsilon") and not hasattr(module, "eps"):
            raise ValueError(f"{type(module).__name__} has no variance_epsilon or eps attribute")
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"only RMSNorms over the last dim with a weight are supported, got {module}")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight, new.eps, new.offset = weight, None if eps is None else float(eps), offset
        return new

    def _eps(self, x: Tensor) -> float:
        return torch.finfo(x.dtype).eps if self.eps is None else self.eps

    # Gemma's offset is added in fp32 inside the kernels (HF: ``1.0 + weight.float()``): two small
    # kernels a call where the scale was made apart (four a Gemma 2 layer's decode step)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self._eps(x), offset=self.offset)
        return ops.add_rms_norm(x, residual, self.weight, self._eps(x), offset=self.offset)

    def passing_input(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(self(x), x)``, x handed on through this norm (see ``ops.norm.norm_passing_input``)."""
        return norm_passing_input(x, self.weight, None, self._eps(x), True, self.offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, onepass"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, the parameters of ``nn.LayerNorm`` (``weight``, ``bias``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Ones and zeros, as ``nn.LayerNorm``'s."""
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_hf(cls, module: nn.Module, eps: float | None = None) -> "LayerNorm":
        """A drop-in sharing the ``weight`` (and ``bias``, if any) of a LayerNorm over the last dim:
        an ``nn.LayerNorm`` or a module computing the same (Cohere's has no bias and names its eps
        ``variance_epsilon``: pass ``eps``)."""
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"only LayerNorms over the last dim with a weight are supported, got {module}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps = tuple(weight.shape), float(module.eps if eps is None else eps)
        new.weight, new.bias = weight, getattr(module, "bias", None)
        return new

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return ops.layer_norm(x, self.weight, self.bias, self.eps)
        return ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)

    def passing_input(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(self(x), x)``, x handed on through this norm (see ``ops.norm.norm_passing_input``)."""
        return norm_passing_input(x, self.weight, self.bias, self.eps, False)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, onepass"
