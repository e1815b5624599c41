"""Under torch.compile an op's kernel launches enter the graph (dispatch.launch, wrap_triton), and
torch reads from each kernel's TTIR which pointer arguments it writes: it clones those, and a
written tensor the op did not allocate is taken as a mutation (of an input; in a backward, of a
saved forward tensor, which AOTAutograd's partitioner refuses). This compiles the kernels to TTIR
for sm_90 on the CPU (no GPU: Triton needs only a target) and checks that every tensor torch's
analysis (``identify_accessed_tensors``, torch 2.13; 2.11 has ``identify_mutated_tensors``) says a
traced launch writes was allocated by its op, forward and backward. It found attention's
cu_seqlens placeholder taken as written (see attention._locate), and decode_linear's input, the
placeholder of its absent outputs (now a scratch value of its own). Skipped on a GPU, where each op's
opcheck traces the real launches."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU each op's opcheck traces the real launches")
def test_traced_launches_write_only_their_own_outputs():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, compiled to TTIR
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if "no analysis" in run.stdout:
        pytest.skip("this torch has no identify_accessed_tensors (torch 2.11 has another interface)")
    assert "checked" in run.stdout, run.stdout


def _cases():
    from onepass.ops.activation import GELU_TANH, SILU, _act_fwd
    from onepass.ops.attention import _attention_fwd
    from onepass.ops.decode_attention import _decode_attention, _decode_attention_append
    from onepass.ops.decode_linear import _decode_linear
    from onepass.ops.norm import _norm_fwd
    from onepass.ops.projections import _gated_mlp
    from onepass.ops.rope import _rope, _rope_tables
    from onepass.ops.softmax import _softmax_fwd

    q, k, v = torch.randn(1, 4, 33, 16), torch.randn(1, 2, 33, 16), torch.randn(1, 2, 33, 16)
    cu = torch.tensor([0, 7, 33], dtype=torch.int32)
    x, res, w, b = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40), torch.randn(40)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    return [
        (_attention_fwd, (q, k, v, None, 0.25, -1, 0, 0.0, "bhsd")),
        (_attention_fwd, (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, 0.25, 4, 0, 2.0,
                          "bshd")),
        (_norm_fwd, (x, res, w, b, 1e-5, 0.0, 0.0, 0, False, torch.float32)),
        (_norm_fwd, (x, None, w, None, 1e-6, 1.0, 0.0, 0, True, torch.float32)),
        (_softmax_fwd, (torch.randn(2, 3, 5, 21), torch.rand(2, 1, 5, 21) > 0.4, 1.0, False)),
        (_rope, (torch.randn(2, 3, 5, 16), torch.randn(2, 1, 5, 16), cos, sin, None, "bhsd", False, False)),
        # head-major as flat runs (a head dim no power of two, 16 tokens or more)
        (_rope, (torch.randn(1, 2, 16, 24), torch.randn(1, 1, 16, 24), torch.randn(1, 16, 24), torch.randn(1, 16, 24),
                 None, "bhsd", False, False)),
        (_act_fwd, (x, res, None, SILU)),
        (_act_fwd, (x, None, b, GELU_TANH)),
        (_gated_mlp, (x, torch.randn(24, 40), torch.randn(24, 40), torch.randn(40, 24), SILU)),
        (_rope_tables, (torch.arange(6).reshape(2, 3), torch.rand(8), 1.5, torch.bfloat16)),
        # one weight and a residual (two outputs absent), and the gated pair
        (_decode_linear, (torch.randn(2, 40), [torch.randn(24, 40)], [None], -1, torch.randn(2, 24))),
        (_decode_linear, (torch.randn(2, 40), [torch.randn(24, 40), torch.randn(24, 40)], [None, None], SILU)),
        (_decode_attention, (torch.randn(2, 4, 1, 16), k, v, torch.tensor([33, 9], dtype=torch.int32), 0.25, 0.0,
                             "bhsd", 2, 5)),
        # the append writes the caches and the count it is given (its declared mutations), nothing else
        (_decode_attention_append, (torch.randn(2, 4, 1, 16), torch.randn(2, 2, 33, 16), torch.randn(2, 2, 33, 16),
                                    torch.tensor([33, 9], dtype=torch.int32), torch.randn(2, 2, 1, 16),
                                    torch.randn(2, 2, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16),
                                    torch.zeros(1, dtype=torch.int64), 0.25, 0.0, "bhsd", 2, 0), (1, 2, 8)),
        (_decode_attention_append, (torch.randn(2, 4, 1, 16), torch.randn(2, 2, 33, 16), torch.randn(2, 2, 33, 16),
                                    torch.tensor([33, 9], dtype=torch.int32), torch.randn(2, 2, 1, 16),
                                    torch.randn(2, 2, 1, 16), None, None, None, 0.25, 0.0, "bhsd", 1, 5), (1, 2)),
    ]


class _Ctx:
    """What a registered op's setup_context and backward use of autograd's ctx."""

    def __init__(self, n_inputs):
        self.needs_input_grad = (True,) * n_inputs

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


def _main():
    try:
        from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
    except ImportError:  # torch 2.11 (identify_mutated_tensors, another interface): not checked there
        print("no analysis")
        return
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Hopper())
    from onepass.ops import activation, dispatch

    launches = []

    class Recorder:  # stands in for wrap_triton: the launch as a traced graph would hold it
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((self.kernel, args, meta))

    dispatch.tracing = lambda t: True
    sys.modules["onepass.ops.decode_linear"].tracing = dispatch.tracing  # (imported by name: its traced launch plan)
    dispatch.wrap_triton = Recorder
    activation.use_triton = lambda t: True  # (a CPU tensor otherwise takes the reference path)

    def check(op, given, start):
        """Fails on a launch since ``start`` taken to write a tensor of ``given`` (or one sharing its memory)."""
        given = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for kernel, args, meta in launches[start:]:
            named = dict(zip(kernel.arg_names, args), **{k: v for k, v in meta.items() if k in kernel.arg_names})
            for dep in identify_accessed_tensors(kernel, named, {}).read_writes.writes:
                t = named[dep.name]
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in given:
                    sys.exit(f"{op}: {kernel.fn.__name__} is taken to write {dep.name}, a tensor it was given")

    with torch.no_grad():
        for op, args, *mutated in _cases():
            first = len(launches)
            out = op._init_fn(*args)
            assert len(launches) > first, f"{op}: no forward launch recorded"
            check(op, [a for i, a in enumerate(args) if i not in (mutated or [()])[0]], first)
            if op._backward_fn is not None:  # (decode and the tables have no gradient)
                _backward(op, args, out, check, launches)
    print(f"checked {len(launches)} launches")


def _backward(op, args, out, check, launches):
    """The op's registered backward on gradients of ones; its launches may write no tensor that
    existed before it (inputs, outputs, saved tensors, gradients)."""
    outs = out if isinstance(out, tuple) else (out,)
    ctx = _Ctx(len(args))
    op._setup_context_fn(ctx, args, out)
    grads = [torch.ones_like(t) if t.is_floating_point() else None for t in outs]
    start = len(launches)
    op._backward_fn(ctx, *grads)
    assert len(launches) > start, f"{op}: no backward launch recorded"
    check(op, [*args, *outs, *grads], start)


if __name__ == "__main__":
    _main()
