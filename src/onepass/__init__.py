"""onepass: fused single-pass Triton kernels for transformer models.

Every intermediate that is read once should never touch HBM.

The submodules load on first use, so that ``onepass``'s command line can choose
Triton's interpreter (on a machine without a GPU) before any kernel is defined.
"""

import importlib

from onepass import hf_attention as _hf_attention

__version__ = "0.1.0"
# the name pip installs it by (PyPI refuses "onepass": too close to the project "one-pass"); imported as onepass
DISTRIBUTION = "onepass-kernels"

_LAZY = {"ops": "onepass.ops", "reference": "onepass.reference", "analyze": "onepass.analyze", "optim": "onepass.optim"}
# public functions and classes -> their module (a module named like a function would shadow it once imported)
_LAZY_FUNCTIONS = {
    **dict.fromkeys(("optimize", "undo", "optimize_report", "reference_mode"), "onepass.patching"),
    **dict.fromkeys(("generate", "Decoder"), "onepass.decoding"),
}

__all__ = ["__version__", "DISTRIBUTION", *_LAZY, *_LAZY_FUNCTIONS]

_hf_attention.register_when_imported()  # attn_implementation="onepass" in transformers


def __getattr__(name):
    if name in _LAZY:  # (the analyze package is callable: onepass.analyze(model, ...) runs its analyze)
        return importlib.import_module(_LAZY[name])
    if name in _LAZY_FUNCTIONS:
        return getattr(importlib.import_module(_LAZY_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'onepass' has no attribute {name!r}")


def __dir__():  # the lazy names too, for completion
    return sorted(__all__)
