"""Compiles, for sm_90, the kernels onepass's launchers pick at real GPU sizes, without a GPU.

Triton's interpreter (how the CPU tests run the kernels) does not compile them, so a kernel can pass
every CPU test and still fail to compile on a GPU (a loop-carried value that changes type, a
constexpr misused). Here each launcher runs on CPU tensors of real shapes with the GPU's settings
(the interpreter's small blocks off, 132 SMs), its launches recorded instead of run, and each
distinct specialization is compiled for sm_90 (PTX and cubin: Triton's own compiler, no device). The
specializations are made by Triton's own binder, as on the GPU: with the 16-byte alignment and
divisibility hints, so the vectorized code a GPU runs is what compiles here.
Run by tests/ops/test_compile_sm90.py in a process without TRITON_INTERPRET; prints one line a
compiled specialization, raises on the first that does not compile or whose wgmma ptxas serializes.
"""

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

import onepass.ops

SMS = 132
TARGET = GPUTarget("cuda", 90, 32)

calls = []


def _record(kernel, grid, *args, **meta):
    calls.append((kernel, args, meta))


for info in pkgutil.iter_modules(onepass.ops.__path__):
    module = importlib.import_module("onepass.ops." + info.name)
    for name, fake in (("interpreting", lambda: False), ("num_programs_for", lambda device: SMS),
                       ("launch", _record)):
        if hasattr(module, name):
            setattr(module, name, fake)


def ops(name):
    return sys.modules["onepass.ops." + name]


def empty(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


def cases():
    """Each case calls launchers at one real size (what their kernels compute is not looked at)."""
    norm = ops("norm")
    for rows, n in ((16384, 768), (16384, 4096), (512, 10240), (512, 12288), (64, 65536)):
        x, w = empty(rows, n), empty(n)
        for is_rms, residual, dropout in ((True, None, 0.0), (False, None, 0.0), (True, x, 0.1), (False, x, 0.0),
                                          (False, x, 0.1)):
            y, h, mean, rstd = norm._norm_fwd_launch(x, residual, w, None if is_rms else w, 1e-5, 0.0, dropout, 0,
                                                     is_rms, x.dtype)
            norm._norm_bwd_launch(x, None, x, w, 0.0, None if is_rms else x.dtype, mean, rstd, dropout, 0, is_rms,
                                  x.dtype, residual is not None, False)
    act = ops("activation")
    x = empty(16384, 8192)
    for up, bias in ((x, None), (None, empty(8192))):
        for a in (0, 1, 2):
            act._act_fwd_launch(x, up, bias, a)
            act._act_bwd_launch(x, x, up, bias, a, up is not None)
    small = empty(1024, 2048)  # the forward's small tile (TILE_FLAT_SMALL)
    act._act_fwd_launch(small, small, None, 0)
    softmax = ops("softmax")
    s = empty(4, 16, 2048, 2048)
    softmax._softmax_bwd_launch(s, softmax._softmax_fwd_launch(s, None, 0.125, True), 0.125, True)
    ce = ops("cross_entropy")
    count_targets = ce.count_targets

    def counted(target, n_cols, ignore_index):  # the launch recorded; its host check read counts never computed
        try:
            count_targets(target, n_cols, ignore_index)
        except ValueError:
            pass
        return torch.zeros(2, dtype=torch.int32)

    ce.count_targets = counted
    logits, target = empty(4096, 128256), torch.zeros(4096, dtype=torch.int64)
    ce._cross_entropy_fwd_launch(logits, target, -100, "mean", 0.1, 1e-4, 30.0, True, True, False)
    ce.scale_rows_(logits, torch.ones(4096))
    rows, counts = torch.empty(64), torch.ones(2, dtype=torch.int32)  # LM-head losses' per-row kernels
    z = empty(64, 151936)
    for teacher in (None, z):
        ops("distillation").jsd_rows(z, teacher, target[:64], rows, counts, True, 0.5, 0.5, 0.5, -100, 2.0)
    ops("sequence_loss")._logit_grad(z, target[:64], rows, rows, -100)
    low = ops("linear_cross_entropy_low")
    low.count_targets = counted
    hidden, head = empty(64, 256), empty(32000, 256)
    loss, lse, _, _ = low._low_fwd(hidden, head, target[:64], None, -100, 0.0, 0.0, None, True)
    low._low_bwd(torch.ones(64), hidden, head, target[:64], None, lse, 0.0, 0.0, 30.0, True, True, False)
    attention = ops("attention")
    attention.TMA_MIN_FLOPS = 0  # the tensor-descriptor kernels too, at these shapes below their threshold
    for d, causal in ((64, True), (128, False), (256, True)):
        q, k = empty(1, 32, 2048, d), empty(1, 8, 2048, d)
        o, lse = attention._attention_fwd_launch(q, k, k, None, d ** -0.5, -1, 0 if causal else -1, None, "bhsd")
        attention._attention_bwd_launch(q, q, k, k, o, lse, None, None, d ** -0.5, -1, 0 if causal else -1, None,
                                        "bhsd")
    hopper = ops("attention_hopper")  # the Gluon forward and backward, bhsd and bshd memory, causal windows
    for d, causal, before, softcap, layout in ((64, False, -1, 0.0, "bhsd"), (64, True, -1, 0.0, "bhsd"),
                                               (64, True, 400, 0.0, "bhsd"), (128, True, -1, 0.0, "bhsd"),
                                               (128, False, -1, 0.0, "bshd"), (128, True, 400, 0.0, "bhsd"),
                                               (128, True, 4095, 50.0, "bhsd"), (128, False, -1, 30.0, "bhsd")):
        q, k = empty(1, 32, 2048, d), empty(1, 8, 2048, d)
        if layout == "bshd":
            q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
        lse = torch.empty(1, 32, 2048)
        assert hopper.forward((q, k, k), torch.empty_like(q), lse, d ** -0.5, causal, before, softcap)
        if (d, causal) in hopper.GLUON_BWD or d in hopper.SMALL_GRID_BWD:  # (8 kv heads x 16 blocks: a small grid)
            assert hopper.backward((q, k, k, q, q, q, k, k), lse, lse, lse, d ** -0.5, causal, before, softcap)
    assert hopper.backward((q, k, k, q, q, q, k, k), lse, None, lse, 0.088, True, -1, 0.0)  # causal, no dLSE
    q, k, cu = empty(4096, 32, 128), empty(4096, 8, 128), torch.tensor([0, 1000, 4096], dtype=torch.int32)
    o, lse = attention._attention_fwd_launch(q, k, k, cu, 0.088, -1, 0, None, "bshd")  # varlen, causal
    attention._attention_bwd_launch(q, q, k, k, o, lse, None, cu, 0.088, -1, 0, None, "bshd")
    decode = ops("decode_attention")
    for batch, cache, window in ((1, 576, None), (8, 16384, None), (64, 4096, None), (4, 32768, 4096)):
        q, kv = empty(batch, 32, 1, 128), empty(batch, 8, cache, 128)
        decode._decode_launch(q, kv, kv, torch.full((batch,), cache, dtype=torch.int32), 0.088, 0.0, "bhsd", 0,
                              window or 0)
    q, kv, new = empty(1, 32, 1, 64), empty(1, 8, 576, 64), empty(1, 8, 1, 64)  # the append, with RoPE and without
    for tables in ((empty(1, 1, 64), empty(1, 1, 64), torch.zeros(1, dtype=torch.int64)), (None, None, None)):
        decode._decode_launch(q, kv, kv, torch.full((1,), 576, dtype=torch.int32), 0.125, 0.0, "bhsd", 0, 0, new,
                              new, *tables)
    linear = ops("decode_linear")
    for n_in, outs, act_id in ((2048, (2048, 512, 512), -1), (8192, (2048,), -1), (2048, (8192, 8192), 0)):
        x = empty(1, n_in)
        linear._decode_linear_launch(x, [empty(n, n_in) for n in outs], [None] * len(outs), act_id,
                                     empty(1, outs[0]) if len(outs) == 1 else None)
    rope = ops("rope")
    q, k, cos = empty(2, 32, 4096, 128), empty(2, 8, 4096, 128), empty(2, 4096, 128)
    for backward in (False, True):
        rope._rope_launch(q, k, cos, cos, None, "bhsd", False, backward, q, k)
    q, k = empty(2, 4096, 32, 80), empty(2, 4096, 8, 80)  # a padded half (40 of 64 lanes), HF's bshd memory
    positions = torch.zeros(2, 4096, dtype=torch.int64)
    for rotary, interleaved, pos in ((80, False, positions), (80, True, None), (32, False, None)):
        table = empty(1, 8192 if pos is not None else 4096, rotary)
        rope._rope_launch(q, k, table, table, pos, "bshd", interleaved, False, empty(*q.shape), empty(*k.shape))
    # contiguous bhsd, head-major: one tile of tokens, and two (n_tiles not 1); at d 80 as flat runs, forward and
    # backward, at d 64 in pairs of half-rows
    for seq, d, backward in ((4096, 80, False), (20000, 80, False), (4096, 80, True), (4096, 64, False)):
        q, k, table = empty(1, 32, seq, d), empty(1, 8, seq, d), empty(1, seq, d)
        rope._rope_launch(q, k, table, table, None, "bhsd", False, backward, empty(*q.shape), empty(*k.shape))
    rope._tables_launch(positions, empty(64, dtype=torch.float32), 1.0, torch.bfloat16)
    cache, new = empty(8, 8, 4096, 128), empty(8, 8, 1, 128)  # a decode step's append, with and without RoPE
    length = torch.zeros(1, dtype=torch.int64)
    ops("kv_cache").append_to_cache(cache, cache, length, new, new)
    ops("kv_cache").append_to_cache(cache, cache, length, new, new, empty(8, 32, 1, 128), empty(8, 1, 128),
                                    empty(8, 1, 128))
    tokens = torch.zeros(8, 512, dtype=torch.int64)
    one = torch.zeros(1, dtype=torch.int64)
    ops("next_token").use_triton = lambda scores: True  # (CPU tensors take its reference path)
    for eos in (None, torch.zeros(2, dtype=torch.int64)):
        ops("next_token").record_next_token(empty(8, 128256), tokens, tokens[:, :1], one, tokens[:, :1], True, eos,
                                            None if eos is None else one,
                                            None if eos is None else torch.zeros(8, dtype=torch.bool),
                                            None if eos is None else one, torch.zeros(8, dtype=torch.int32))
    moe = ops("moe")  # a Qwen3-30B-A3B layer's shapes: 128 experts, top 8, hidden 2048, 768 a expert
    x, top_k = empty(4096, 2048), torch.zeros(4096, 8, dtype=torch.int64)
    gate_up, down = empty(128, 1536, 2048), empty(128, 2048, 768)
    out, gu, perm, offsets = moe.moe_fwd_launch(x, top_k, empty(4096, 8), gate_up, down, 0, True)
    moe.moe_bwd_launch(out, x, top_k, empty(4096, 8), gate_up, down, gu, perm, offsets, 0, True, True, True, True)
    params = [empty(4096, 4096, dtype=torch.float32), empty(4096, dtype=torch.float32)]
    ops("adamw")._adamw_launch(params, params, params, params, 1e-3, 0.9, 0.999, 1e-8, 0.01, 10)


def _no_serialized_wgmma(name: str, ptx: str) -> None:
    """Raise where ptxas serializes a kernel's wgmma (its warning C7514: a register of an accumulator read while
    the wgmma writing it may still run, or a wgmma in flight across a branch): every tensor-core product of the
    kernel then waits for the one before, which the compile itself does not report (a Gluon forward so built ran
    15-20% slower: results/h200/attention_gluon_fwd.log, runs 11-12)."""
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        run = subprocess.run([knobs.nvidia.ptxas.path, f"--gpu-name=sm_{TARGET.arch}a", source, "-o",
                              os.path.join(folder, "kernel.cubin")], capture_output=True, text=True, check=True)
    if "C7514" in run.stderr:
        raise RuntimeError(f"{name}: ptxas serializes its wgmma: {run.stderr.strip()}")


def compile_recorded():
    """Each recorded launch specialized by Triton's own binder (dtypes, 16-byte alignment, integers
    divisible by 16 or equal to 1), as a launch on the GPU does, then compiled once a specialization."""
    backend = make_backend(TARGET)
    seen = set()
    for kernel, args, meta in calls:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **meta)
        options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
        key = (kernel.__name__, str(signature), str(constexprs), str(attrs), options.hash())
        if key in seen:
            continue
        seen.add(key)
        source = GluonASTSource if kernel.is_gluon() else ASTSource
        compiled = triton.compile(source(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        if "wgmma.mma_async" in compiled.asm["ptx"]:
            _no_serialized_wgmma(kernel.__name__, compiled.asm["ptx"])
        shown = {kernel.arg_names[path[0]]: v for path, v in constexprs.items() if kernel.arg_names[path[0]].isupper()}
        print(kernel.__name__, shown, {"num_warps": options.num_warps, "num_stages": options.num_stages}, flush=True)


if __name__ == "__main__":
    cases()
    compile_recorded()
