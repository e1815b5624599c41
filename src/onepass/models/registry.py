"""Which patch a model gets: the generic decoder patch, unless a family registers its own.

A family whose blocks differ from what ``onepass.models.decoder`` recognises registers its
patch from its own file (``@register("gpt2")``); ``onepass.models`` imports those files.
"""

from __future__ import annotations

from typing import Callable

from onepass.models import decoder

_FAMILIES: dict[str, Callable] = {}


def register(*model_types: str) -> Callable[[Callable], Callable]:
    """Decorator: ``patch(model, patches, switches) -> status`` for these ``config.model_type``s."""

    def add(patch: Callable) -> Callable:
        for model_type in model_types:
            _FAMILIES[model_type] = patch
        return patch

    return add


def patcher(model_type: str | None) -> Callable:
    """The patch for ``model_type``: its family's, or the generic decoder patch."""
    return _FAMILIES.get(model_type, decoder.patch)
