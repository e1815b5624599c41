"""The lean launch path (ops.dispatch.launch) must launch the kernel Triton would for every
specialization of the arguments: it caches compiled kernels by what the binder reports."""

import sys

import pytest
import torch
import triton
import triton.language as tl

from onepass.ops.dispatch import launch


@triton.jit
def _scaled_copy_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


@pytest.mark.gpu
def test_cached_launches_follow_the_specialization():
    """Pointers 16-byte aligned or not, n equal to 1, divisible by 16 or neither: each call
    (the first compiles, the second takes the cached path) gives the right result."""
    x = torch.randn(300, device="cuda")
    for offset in (0, 1, 4):
        for n in (1, 16, 17, 256):
            for scale in (2.0, -0.5):
                for _ in range(2):
                    out = torch.zeros(300, device="cuda")
                    launch(_scaled_copy_kernel, (triton.cdiv(n, 64),), x[offset:], out[offset:], n, scale, BLOCK=64)
                    expect = torch.zeros(300, device="cuda")
                    expect[offset:offset + n] = x[offset:offset + n] * scale
                    torch.testing.assert_close(out, expect, rtol=0, atol=0)


def test_launch_runs_through_the_interpreter_or_gpu(device):
    x = torch.arange(10, dtype=torch.float32, device=device)
    out = torch.empty_like(x)
    launch(_scaled_copy_kernel, (1,), x, out, 10, 3.0, BLOCK=16)
    torch.testing.assert_close(out, x * 3)


def test_device_setting_follows_the_gpu_name(monkeypatch):
    """A setting measured on one GPU model applies to that model's name only; every other GPU,
    the CPU and no device take the default (the cross-entropy kernel's H100 setting, here)."""
    from types import SimpleNamespace

    from onepass.ops import dispatch
    from onepass.ops.cross_entropy import CE_MAX_BLOCK, CE_MAX_WARPS, ce_settings

    cuda = torch.device("cuda", 0)
    for name, want in (("NVIDIA H100 80GB HBM3", (32768, 32)), ("NVIDIA H200", (CE_MAX_BLOCK, CE_MAX_WARPS))):
        monkeypatch.setattr(dispatch, "_cuda_properties", lambda device, n=name: SimpleNamespace(name=n))
        assert ce_settings(128256, True, cuda) == want
        assert ce_settings(128256, False, cuda) == ce_settings(128256, False)  # forward only: one setting
    assert ce_settings(128256, True, torch.device("cpu")) == ce_settings(128256) == (CE_MAX_BLOCK, CE_MAX_WARPS)


# Traces the registered RMSNorm op, forward and backward, as torch.compile's AOTAutograd does
# (functionalized, on fake tensors), and prints each graph it hands the compiler.
_TRACE_NORM = """
import torch
from torch._functorch.aot_autograd import aot_function
from torch._subclasses.fake_tensor import FakeTensorMode

import onepass.ops.norm  # noqa: F401  (registers onepass::norm_fwd and onepass::norm_bwd)

graphs = []


def capture(gm, _):
    graphs.append(gm.code)
    return gm


def norm(x, w):
    return torch.ops.onepass.norm_fwd(x, None, w, None, 1e-6, 0.0, 0.0, 0, True, x.dtype)[0]


with FakeTensorMode():
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    aot_function(norm, fw_compiler=capture, bw_compiler=capture)(x, w).sum().backward()
print("\\n#####\\n".join(graphs))
"""


def test_compiled_graph_launches_the_kernels_itself():
    """Under torch.compile a registered op is traced into (a triton_op): the graphs AOTAutograd
    hands Inductor hold the norm's kernel launches, not an opaque onepass.norm_fwd / norm_bwd
    whose Python launcher would run at every call. Run without Triton's interpreter (a child
    process), whose kernels no graph can hold: only tracing happens, on fake tensors, so no GPU
    is needed (Triton's analysis of what the kernels write then assumes every argument)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _TRACE_NORM], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    graphs = run.stdout.split("#####")
    assert len(graphs) == 2, run.stdout  # the forward and the backward
    for graph in graphs:
        assert "triton_kernel_wrapper" in graph, graph
        assert "onepass" not in graph, graph


# Compiles each kernel that launches as a programmatic dependent for sm_90 (no GPU needed) and
# prints, per kernel: whether its PTX waits for the kernel before ahead of its first global memory
# access, and whether it lets the next kernel launch. (It compiles them too, which the interpreter does
# not: a kernel that runs there can still fail to compile; so each of their paths has a line.)
_PDL_PTX = """
import re
import sys

import importlib

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TYPES = {"part_ptr": "*fp32", "count_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
         "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "best_ptr": "*fp32", "where_ptr": "*i64", "tokens_ptr": "*i64",
         "next_ptr": "*i64", "index_ptr": "*i64", "position_ptr": "*i64", "eos_ptr": "*i64", "pad_ptr": "*i64",
         "finished_ptr": "*i1", "live_ptr": "*i64", "lengths_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32",
         "scaling": "fp32",
         "seqlens_ptr": "*i32", "length_ptr": "*i64", "scale": "fp32", "softcap": "fp32", "eps": "fp32",
         "dropout_p": "fp32"}
KERNELS = [  # module, kernel, constexprs
    ("decode_linear", "_decode_linear_kernel", dict(GATED=True, ACT=0, HAS_BIAS=True, HAS_RESIDUAL=False,
     PRECISION="ieee", SPLIT_K=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)),
    ("decode_linear", "_decode_linear_kernel", dict(GATED=False, ACT=0, HAS_BIAS=False, HAS_RESIDUAL=True,
     PRECISION="ieee", SPLIT_K=1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512)),
    ("decode_linear", "_decode_linear_kernel", dict(GATED=False, ACT=0, HAS_BIAS=False, HAS_RESIDUAL=True,
     PRECISION="ieee", SPLIT_K=4, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)),
    ("decode_attention", "_decode_split_kernel", dict(WINDOW=True, SOFTCAP=False, HEAD_DIM=64, BLOCK_M=16,
     BLOCK_N=64, BLOCK_D=64, BLOCK_B=8, LONG=False, PRECISION="ieee", SHARED=True, DIRECT=False, APPEND=False,
     ROPE=False, COUNT=False)),
    ("decode_attention", "_decode_split_kernel", dict(WINDOW=False, SOFTCAP=True, HEAD_DIM=128, BLOCK_M=16,
     BLOCK_N=64, BLOCK_D=128, BLOCK_B=1, LONG=False, PRECISION="ieee", SHARED=False, DIRECT=True, APPEND=False,
     ROPE=False, COUNT=False)),
    # a decode step's append (with RoPE and the count) in the split launch: its stores after the wait too
    ("decode_attention", "_decode_split_kernel", dict(WINDOW=False, SOFTCAP=False, HEAD_DIM=64, BLOCK_M=16,
     BLOCK_N=64, BLOCK_D=64, BLOCK_B=1, LONG=False, PRECISION="ieee", SHARED=False, DIRECT=False, APPEND=True,
     ROPE=True, COUNT=True)),
    ("decode_attention", "_decode_merge_kernel", dict(WINDOW=True, HEAD_DIM=64, BLOCK_S=4, BLOCK_D=64, BLOCK_B=8,
     SHARED=True)),
    ("kv_cache", "_append_kv_kernel", dict(ROPE=True, BLOCK_ROWS=16, BLOCK_D=64)),
    ("next_token", "_piece_max_kernel", dict(BLOCK=1024)),
    ("next_token", "_record_kernel", dict(ADVANCE=True, EOS=True, LENGTHS=True, BLOCK_B=8, BLOCK_P=64, BLOCK_E=2)),
    ("rope", "_tables_kernel", dict(BLOCK_T=32, BLOCK_F=64)),
    ("norm", "_norm_fwd_kernel", dict(IS_RMS=True, HAS_RESIDUAL=True, HAS_DROPOUT=False, HAS_WEIGHT=True,
     HAS_BIAS=False, BLOCK_N=2048, ONE_BLOCK=True, ROWS=1, N_COLS=0)),
    ("norm", "_norm_fwd_kernel", dict(IS_RMS=False, HAS_RESIDUAL=False, HAS_DROPOUT=False, HAS_WEIGHT=True,
     HAS_BIAS=True, BLOCK_N=1024, ONE_BLOCK=True, ROWS=2, N_COLS=1000)),
]
for module, name, constexprs in KERNELS:
    importlib.import_module("onepass.ops." + module)
    fn = getattr(sys.modules["onepass.ops." + module], name)  # (onepass.ops.decode_linear is the function)
    constexprs = {**constexprs, "PDL": True}
    signature = {a: "constexpr" if a in constexprs else TYPES.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    memory = [m.start() for m in re.finditer(r"(ld|st|atom|red)\\.global|cp\\.async", ptx)]
    print(name, 0 <= wait < min(memory), "griddepcontrol.launch_dependents" in ptx)
"""


def test_dependent_kernels_wait_before_touching_memory():
    """Each kernel launched as a programmatic dependent waits for the kernel before it ahead of
    every global load, store or atomic (one before the wait could read a value that kernel has not
    written yet, or overwrite one it still reads) and lets the next kernel launch. Read off the
    kernels' PTX for sm_90, compiled in a child process without Triton's interpreter (no GPU needed)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PDL_PTX], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split("\n")[:-1]
    assert len(lines) == 13 and all(line.endswith(" True True") for line in lines), run.stdout


def test_no_dependent_launch_off_a_gpu_or_while_traced():
    """The interpreter and CPU tensors never take programmatic dependent launch (the kernels' PDL
    step is inline PTX); nor does a traced call, whose kernel Inductor launches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from onepass.ops.dispatch import dependent_launch

    assert not dependent_launch(torch.ones(2))
    with FakeTensorMode():
        assert not dependent_launch(torch.ones(2))


@pytest.mark.gpu
def test_dependent_launches_in_a_graph_give_the_results_of_plain_launches(monkeypatch):
    """A chain of decode-step kernels, each reading the one before's output, replayed as a CUDA
    graph: bit for bit the results of the same chain launched without PDL (a kernel that read
    before its wait would see stale values), and each launched as a dependent on sm_90."""
    from onepass import ops
    from onepass.ops import dispatch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    # one tiling with and without PDL: the projection's K split in both (its last split's sums in a graph)
    monkeypatch.setattr(sys.modules["onepass.ops.decode_linear"], "SPLIT_K_MIN_INPUTS", (1024, 1024))
    # this chain's kernels alone in the cache checked below (other tests in the process compile the same
    # kernels for more rows than SMs, which launch without PDL)
    monkeypatch.setattr(dispatch, "_compiled_kernels", {})
    torch.manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45 for _ in range(3)]
    norm_w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain():
        h = x
        for _ in range(8):
            (y,) = ops.decode_linear(ops.rms_norm(h, norm_w), [w[0]])
            h = ops.decode_gated_linear(y, w[1], w[2])
        return h

    counters = sys.modules["onepass.ops.decode_linear"]._split_counts

    def replayed():
        with torch.no_grad():
            chain()  # compiles outside the capture, and makes the split-K counters there
            made = len(counters)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain()
            assert len(counters) == made  # none zero-filled inside the graph
            graph.replay()
            torch.cuda.synchronize()
            return out.clone()

    with_pdl = replayed()
    launched = {c.metadata.launch_pdl for (k, *_), c in dispatch._compiled_kernels.items()
                if k.fn.__name__ in ("_decode_linear_kernel", "_norm_fwd_kernel")}
    assert launched == {True}
    monkeypatch.setattr(dispatch, "_PDL_OFF", True)
    torch.testing.assert_close(with_pdl, replayed(), rtol=0, atol=0)
