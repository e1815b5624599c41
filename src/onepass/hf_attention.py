"""``attn_implementation="onepass"`` in transformers, from ``import onepass`` on.

``import onepass`` registers the attention function "onepass" (``onepass.models.attention``)
with transformers' ``AttentionInterface`` and its mask function with ``AttentionMaskInterface``:
at once where transformers is imported already, else right after transformers' own import
(an import hook), so that ``import onepass`` itself stays light (no torch, no transformers:
the command line picks Triton's interpreter before any kernel is defined). Then

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="onepass")

runs ``onepass.ops.attention`` in every attention layer, as ``"flash_attention_2"`` would run
FlashAttention; ``onepass.optimize`` fuses the rest of the model around it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

NAME = "onepass"


def _attention(*args, **kwargs):
    from onepass.models.attention import onepass_attention  # the kernels are defined at first use, not here

    return onepass_attention(*args, **kwargs)


def _mask(*args, **kwargs):
    from onepass.models.attention import onepass_mask

    return onepass_mask(*args, **kwargs)


def register() -> None:
    """Register "onepass" with transformers' attention and mask registries (again is harmless)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at transformers' import it hands back transformers' own spec,
    its loader set to call ``register`` once transformers' module has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                register()
            except ImportError:  # a transformers without these registries: its own import must not fail
                pass

        spec.loader.exec_module = exec_module
        return spec


def register_when_imported() -> None:
    """``register`` now if transformers is imported, else once it is (nothing if it is not installed)."""
    if sys.modules.get("transformers") is not None:  # (None: hidden, as a test hides it)
        register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
