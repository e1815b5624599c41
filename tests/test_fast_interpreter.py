"""tests/fast_interpreter.py: installed for the pinned Triton, and a kernel whose helpers reach
both ``tl`` and Triton's own helpers (``tl.zeros``, patched through ``tl.core``) runs right under
it, launch after launch (each launch restores the language it patched)."""

import os

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _plus_one(x):
    return x + tl.zeros_like(x) + 1.0


@triton.jit
def _plus_one_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _plus_one(tl.load(x_ptr + offs)) + tl.zeros([N], tl.float32))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton.__version__.startswith("3.6."),
                    reason="the interpreter's patch, written for the pinned Triton 3.6")
def test_installed_for_the_pinned_triton():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once_per_launch", False)


def test_kernel_with_helpers_runs_launch_after_launch(device):
    x = torch.randn(16, device=device)
    for _ in range(2):
        y = torch.full_like(x, float("nan"))
        _plus_one_kernel[(1,)](x, y, N=16)
        assert torch.equal(y, x + 1.0)
