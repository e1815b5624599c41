"""Alternatives to the layer_norm and rope forward kernels, against them (bf16, `bench ops` sizes).

    python benchmarks/tune_rope_layer_norm.py [ln] [rope] [rope-dims [token-major]]

Each row: the median of a CUDA-graph replay (GPU time alone) and of ``do_bench`` (per-call
events, as `bench ops` times: launch and host time included), and the fraction of the copy
bandwidth measured in the same run. LayerNorm: the statistics in one pass (sum and sum of
squares about the row's first value, one tuple reduction) against the two reductions of
ops/norm.py, by warps and rows a program. RoPE: the production token-major grid by tile and
warps, and a head-major grid (a block of T tokens of one head a program: contiguous [T, D]
tiles, the table rows re-read from L2 by every head). Results:
benchmarks/results/h200/tune_rope_layer_norm.log.
"""
import functools
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph

from onepass import ops
from onepass.bench.harness import measure_ceilings

rope = sys.modules["onepass.ops.rope"]


def timeit(fn):
    fn()
    torch.cuda.synchronize()
    g = do_bench_cudagraph(fn, rep=100, return_mode="median")
    w = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return g, w


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def ln_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, stride, n, eps,
              BLOCK: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr, WB_FIRST: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if WB_FIRST:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        h = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        if not WB_FIRST:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            b = tl.load(b_ptr + cols, mask=mask, other=0.0)
        if ONE_PASS:
            k = tl.load(x_ptr + row * stride).to(tl.float32)
            d = tl.where(mask, h - k, 0.0)
            s1, s2 = tl.reduce((d, d * d), 0, _add2)
            m1 = s1 / n
            var = tl.maximum(s2 / n - m1 * m1, 0.0)
            mean = k + m1
            centred = h - mean
        else:
            mean = tl.sum(h, axis=0) / n
            centred = tl.where(mask, h - mean, 0.0)
            var = tl.sum(centred * centred, axis=0) / n
        rstd = 1.0 / tl.sqrt(var + eps)
        y = centred * rstd * w.to(tl.float32) + b.to(tl.float32)
        tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


def sweep_layer_norm(copy):
    rows, n = 16384, 4096
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * x.numel() * 2
    ref = torch.nn.functional.layer_norm(x.float(), (n,), w.float(), b.float(), 1e-5)
    g, wall = timeit(lambda: ops.layer_norm(x, w, b))
    print(f"ln production           graph {g*1e3:6.1f} us {nbytes/g/1e6/copy:6.1%}  "
          f"wall {wall*1e3:6.1f} us {nbytes/wall/1e6/copy:6.1%}")
    y = torch.empty_like(x)
    mean = torch.empty(rows, device="cuda", dtype=torch.float32)
    rstd = torch.empty_like(mean)
    for one_pass, rows_per, warps, wb_first in itertools.product((False, True), (1, 2), (2, 4, 8), (True, False)):
        if rows_per == 1 and not wb_first:
            continue
        g, wall = timeit(functools.partial(ln_kernel[(rows // rows_per,)], x, w, b, y, mean, rstd, n, n, 1e-5,
                                           BLOCK=n, ROWS=rows_per, ONE_PASS=one_pass, WB_FIRST=wb_first,
                                           num_warps=warps))
        err = (y.float() - ref).abs().max().item()
        print(f"ln one_pass={one_pass:d} rows={rows_per} warps={warps} wb_first={wb_first:d} graph {g*1e3:6.1f} us "
              f"{nbytes/g/1e6/copy:6.1%}  wall {wall*1e3:6.1f} us  max err {err:.3g}")
    # offset data: the one-pass formula's weak spot (row mean large against its spread)
    xo = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) + 100
    xo[:, 0] = 300
    ref = torch.nn.functional.layer_norm(xo.float(), (n,), w.float(), b.float(), 1e-5)
    for one_pass in (False, True):
        ln_kernel[(rows,)](xo, w, b, y, mean, rstd, n, n, 1e-5, BLOCK=n, ROWS=1, ONE_PASS=one_pass, WB_FIRST=True,
                           num_warps=4)
        print(f"ln offset data one_pass={one_pass:d}: max err {(y.float() - ref).abs().max().item():.3g}, "
              f"production {(ops.layer_norm(xo, w, b).float() - ref).abs().max().item():.3g}")


@triton.jit
def rope_head_major(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, seq, n_q_heads, n_heads, cos_batch_stride,
                    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, T: tl.constexpr):
    """bhsd, contiguous q/k, full-width [B, S, 2*HALF] tables; program = (token block, batch x head): each
    program's q or k rows are one contiguous run of T x 2*HALF values."""
    tb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bidx = bh // n_heads
    head = bh % n_heads
    toks = tb * T + tl.arange(0, T)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (toks < seq)[:, None] & (i < HALF)
    tab = cos_ptr + bidx * cos_batch_stride + toks[:, None].to(tl.int64) * (2 * HALF) + i
    stab = sin_ptr + bidx * cos_batch_stride + toks[:, None].to(tl.int64) * (2 * HALF) + i
    c1 = tl.load(tab, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(tab + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(stab, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(stab + HALF, mask=ok, other=0.0).to(tl.float32)
    if head < n_q_heads:
        off = (bidx * n_q_heads + head) * seq * (2 * HALF)
        src = q_ptr + off
        dst = qo_ptr + off
    else:
        off = (bidx * (n_heads - n_q_heads) + head - n_q_heads) * seq * (2 * HALF)
        src = k_ptr + off
        dst = ko_ptr + off
    p = toks[:, None].to(tl.int64) * (2 * HALF) + i
    x1 = tl.load(src + p, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + p + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst + p, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + p + HALF, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=ok)


def run_head_major(q, k, qo, ko, cos, sin, t, warps):
    batch, q_heads, seq, d = q.shape
    heads = q_heads + k.shape[1]
    rope_head_major[(triton.cdiv(seq, t), batch * heads)](
        q, k, qo, ko, cos, sin, seq, q_heads, heads, cos.stride(0), HALF=d // 2,
        BLOCK_HALF=triton.next_power_of_2(d // 2), T=t, num_warps=warps)


def sweep_rope(copy):
    from onepass.bench.suites.rope import (
        BATCH,
        HEAD_DIM,
        K_HEADS,
        Q_HEADS,
        SEQ,
        _tables,
    )
    q = torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(BATCH, K_HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cos, sin = _tables(BATCH, SEQ, HEAD_DIM)
    nbytes = 2 * (q.numel() + k.numel()) * 2
    q_ref, k_ref = ops.rope(q, k, cos, sin)
    g, wall = timeit(lambda: ops.rope(q, k, cos, sin))
    print(f"rope production         graph {g*1e3:6.1f} us {nbytes/g/1e6/copy:6.1%}  "
          f"wall {wall*1e3:6.1f} us {nbytes/wall/1e6/copy:6.1%}")
    compiled = torch.compile(__import__("onepass.bench.suites.rope", fromlist=["_hf_rope"])._hf_rope())
    g, wall = timeit(lambda: compiled(q, k, cos, sin))
    print(f"rope torch.compile      graph {g*1e3:6.1f} us {nbytes/g/1e6/copy:6.1%}  "
          f"wall {wall*1e3:6.1f} us {nbytes/wall/1e6/copy:6.1%}")
    orig = rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.TOKEN_TILE
    for tile, warps, ttile in ((1024, 1, 1024), (512, 1, 1024), (1024, 1, 0), (1024, 2, 1024), (2048, 2, 1024)):
        rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.TOKEN_TILE = tile, warps, ttile
        g, wall = timeit(lambda: ops.rope(q, k, cos, sin))
        print(f"rope token-major tile={tile} warps={warps} token_tile={ttile}  graph {g*1e3:6.1f} us "
              f"{nbytes/g/1e6/copy:6.1%}  wall {wall*1e3:6.1f} us")
    rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.TOKEN_TILE = orig
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    for t, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8)):
        if t * 64 // (32 * warps) < 2:
            continue
        g, wall = timeit(functools.partial(run_head_major, q, k, qo, ko, cos, sin, t, warps))
        err = max((qo.float() - q_ref.float()).abs().max().item(), (ko.float() - k_ref.float()).abs().max().item())
        print(f"rope head-major T={t:<3} warps={warps}  graph {g*1e3:6.1f} us {nbytes/g/1e6/copy:6.1%}  "
              f"wall {wall*1e3:6.1f} us  max diff vs production {err:.3g}")


def sweep_rope_head_dims(copy):
    """The production kernel (its order named) and torch.compile at the sweep's head dims; with "token-major",
    that order by heads a program (BLOCK_H) and warps too (a head of 80 or 96 dims runs in half-blocks of 64
    lanes). Then this script's head-major grid (contiguous runs of T tokens of one head a program, a
    program's order by whole sequences), the prototype of the production head-major order."""
    from onepass.bench.suites.rope import K_HEADS, Q_HEADS, _hf_rope, _tables
    batch, seq = 4, 16384
    orig_settings, orig_warps = rope._settings, rope.NUM_WARPS
    for d in (64, 80, 96, 128):
        compiled = torch.compile(_hf_rope(), dynamic=False)  # (one compile a head dim: not a dynamic-shape kernel)
        q = torch.randn(batch, Q_HEADS, seq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, K_HEADS, seq, d, device="cuda", dtype=torch.bfloat16)
        cos, sin = _tables(batch, seq, d)
        nbytes = 2 * (q.numel() + k.numel()) * 2
        q_ref, k_ref = ops.rope(q, k, cos, sin)

        def report(label, fn):
            g, _ = timeit(fn)
            print(f"rope d={d:<3} {label:<36} graph {g*1e3:7.1f} us {nbytes/g/1e6/copy:6.1%}", flush=True)

        order = "head-major" if rope._head_major((q, k), "bhsd", seq) else "token-major"
        report(f"production ({order})", lambda: ops.rope(q, k, cos, sin))
        report("torch.compile", lambda: compiled(q, k, cos, sin))
        if "token-major" in sys.argv:  # the token-major order by heads a program and warps
            saved = rope.HEAD_MAJOR_ROW_BYTES
            rope.HEAD_MAJOR_ROW_BYTES = 0
            for block_h, warps in itertools.product((4, 8, 16, 32), (1, 2, 4)):
                rope._settings = lambda rot, head_dim, n_heads, b_=block_h: (b_, *orig_settings(rot, head_dim,
                                                                                               n_heads)[1:])
                rope.NUM_WARPS = warps
                qo, ko = ops.rope(q, k, cos, sin)
                torch.testing.assert_close((qo, ko), (q_ref, k_ref))  # (the reference is head-major at d < 128)
                report(f"block_h={block_h} warps={warps}", lambda: ops.rope(q, k, cos, sin))
            rope._settings, rope.NUM_WARPS, rope.HEAD_MAJOR_ROW_BYTES = orig_settings, orig_warps, saved
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        for t, warps in ((8, 1), (16, 2), (32, 4)):
            run_head_major(q, k, qo, ko, cos, sin, t, warps)
            diff = max((qo.float() - q_ref.float()).abs().max().item(), (ko.float() - k_ref.float()).abs().max().item())
            report(f"head-major T={t} warps={warps} (max diff {diff:.2g})",
                   functools.partial(run_head_major, q, k, qo, ko, cos, sin, t, warps))


if __name__ == "__main__":
    ceil = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceil.copy_gbps:.0f} GB/s")
    which = sys.argv[1:] or ["ln", "rope"]
    if "ln" in which:
        sweep_layer_norm(ceil.copy_gbps)
    if "rope" in which:
        sweep_rope(ceil.copy_gbps)
    if "rope-dims" in which:
        sweep_rope_head_dims(ceil.copy_gbps)
