"""Triton's interpreter, faster for these tests: triton.language patched once per launch.

Triton 3.6's interpreter patches ``triton.language`` for the interpreter (``_patch_lang``: an
``inspect.getmembers`` walk of the language modules) at every launch, and again at every call of
a ``@triton.jit`` helper inside the kernel, where the launch's patch is already in place (the
modules are the same objects) and the walk finds nothing left to patch. The helpers run per row
and per tile, so those walks were about 40% of an interpreted norm's time. Here a helper's call
inside a launch skips the walk where the launch has patched every language module the helper's
globals hold (``tl``; a helper of Triton's own, such as ``tl.zeros``, also ``tl.core``: patched
at its first call, as before); the launch patches and restores as before.
"""

from __future__ import annotations


class _Patched:
    """The scope of a helper's call inside a launch: the launch's own patch restores."""

    def restore(self) -> None:
        pass


def patch_language_once_per_launch() -> None:
    """Install the skip (idempotent); without the interpreter internals it expects, nothing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    if original is None or grid_call is None or getattr(original, "once_per_launch", False):
        return
    import inspect

    import triton.language as tl

    launches = []  # per running launch: the language modules its patches cover

    def run_launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launches and langs <= launches[-1]:
            return _Patched()
        scope = original(fn)
        if launches:
            launches[-1] |= langs
        return scope

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_launch
