"""Sweep the launch settings of the norm and activation kernels on a GPU (bf16, benchmark sizes).

    python benchmarks/tune_rowwise.py [profile] [norm] [wide] [one-wide-block] [wide-layer] [wide-fwd]
                                      [wide-fwd-operands] [wide-fwd-layer] [activation] [narrow-bwd]
                                      [narrow-bwd-layer]

Prints, per kernel, the median time and GB/s of each setting next to the copy bandwidth
measured in the same run; the chosen settings in ops/norm.py, ops/activation.py and
ops/dispatch.py cite these results.
"""

from __future__ import annotations

import functools
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

import onepass.ops.activation as act
import onepass.ops.norm as norm
from onepass.bench.harness import measure_ceilings
from onepass.ops.dispatch import clear_cached_plans

ROWS = 16384


def patch_norm(**functions):
    """Replace norm's setting functions by name; the cached launch plans are cleared so that the
    replacements take effect."""
    for name, fn in functions.items():
        setattr(norm, name, fn)
    clear_cached_plans()


def bench(fn, nbytes):
    fn()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms, nbytes / ms / 1e6


def sweep_norm(copy):
    n = 4096
    x = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    size = x.numel() * 2
    original = norm.row_settings
    for warps in (4, 8, 16):
        patch_norm(row_settings=lambda cols, values_per_thread=16, w_=warps: (4096, w_))
        for name, fn, passes in (
            ("rms fwd", lambda: norm._norm_fwd_launch(x, None, w, None, 1e-6, 0.0, 0.0, 0, True, x.dtype), 2),
            ("add_rms fwd", lambda: norm._norm_fwd_launch(x, res, w, None, 1e-6, 0.0, 0.0, 0, True, x.dtype), 4),
        ):
            ms, gbps = bench(fn, passes * size)
            print(f"norm {name:<12} warps={warps:<3} {ms:7.3f} ms {gbps:6.0f} GB/s {gbps / copy:6.1%}")
    patch_norm(row_settings=original)
    sweep_norm_bwd(copy)


def sweep_norm_bwd(copy, shapes=((8192, 2048), (8192, 4096), (16384, 4096)), per_sm_options=(2, 3, 4, 6, 8),
                   with_dh=True, is_rms=True):
    """The rms (or, not ``is_rms``, layer) norm backward by warps and programs per SM, timed by CUDA-graph
    replay (host launch time excluded): as a decoder layer runs it (``with_dh``: read dy, the stream
    gradient and h, write d(residual)), or as the plain norm's (read dy and h, write dx); the current
    setting marked."""
    original_settings, original_per_sm = norm.row_settings, norm.bwd_programs_per_sm
    kind = "rms" if is_rms else "layer"
    for rows, n in shapes:
        h = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        dy, dh = torch.randn_like(h), (torch.randn_like(h) if with_dh else None)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = None if is_rms else torch.randn_like(w)
        _, _, mean, rstd = norm._norm_fwd_launch(h, None, w, b, 1e-6, 0.0, 0.0, 0, is_rms, h.dtype)
        block, default_warps = original_settings(n)
        default_per_sm = original_per_sm(block, is_rms)
        for warps, per_sm in itertools.product(sorted({2, 4, 8, default_warps}) if n <= 2048 else (4, 8),
                                               per_sm_options):
            patch_norm(row_settings=lambda cols, values_per_thread=16, b_=block, w_=warps: (b_, w_))
            patch_norm(bwd_programs_per_sm=lambda block, is_rms, p_=per_sm: p_)
            step = functools.partial(norm._norm_bwd_launch, dy, dh, h, w, 0.0, None if is_rms else h.dtype, mean, rstd,
                                     0.0, 0, is_rms, h.dtype, with_dh, False)
            step()
            us = do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3
            gbps = (3 + with_dh) * h.numel() * 2 / us / 1e3
            mark = " (current)" if (warps, per_sm) == (default_warps, default_per_sm) else ""
            print(f"norm {kind} bwd {rows}x{n} {'dh ' if with_dh else ''}warps={warps} per_sm={per_sm} {us:7.1f} us "
                  f"{gbps / copy:6.1%}{mark}", flush=True)
    patch_norm(row_settings=original_settings, bwd_programs_per_sm=original_per_sm)


def sweep_norm_bwd_wide(copy):
    """rms and layer norm backward of wide rows (12288, 16384: the sweep's cliff) by the widest block
    held at once (norm.bwd_max_block), timed by CUDA-graph replay."""
    original = norm.bwd_max_block
    for is_rms, rows, n in itertools.product((True, False), (1024, 8192), (8192, 12288, 16384)):
        h = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(h)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _, _, mean, rstd = norm._norm_fwd_launch(h, None, w, b, 1e-6, 0.0, 0.0, 0, is_rms, h.dtype)
        for cap in (2048, 4096, 8192, 16384):
            patch_norm(bwd_max_block=lambda n_cols, c_=cap: c_)
            step = functools.partial(norm._norm_bwd_launch, dy, None, h, w, 0.0, None if is_rms else h.dtype,
                                     None if is_rms else mean, rstd, 0.0, 0, is_rms, h.dtype, False, (True, True))
            step()
            us = do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3
            gbps = 3 * h.numel() * 2 / us / 1e3
            print(f"norm {'rms' if is_rms else 'layer'} bwd {rows}x{n} max_block={cap:<5} {us:8.1f} us "
                  f"{gbps / copy:6.1%}")
    patch_norm(bwd_max_block=original)


def sweep_norm_bwd_one_wide_block(copy):
    """Norm backward of wide rows as one block (norm.bwd_one_wide_block) by warps, against blocks of
    bwd_max_block, timed by CUDA-graph replay: the plain RMSNorm, LayerNorm, and
    the residual form (a decoder layer's: the stream's gradient read too, d(residual) written)."""
    saved = norm.bwd_one_wide_block, norm.row_settings
    kinds = (("rms", True, False), ("layer", False, False), ("add_rms", True, True))
    for (kind, is_rms, residual), rows, n in itertools.product(kinds, (2048, 8192), (12288, 16384)):
        h = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(h)
        dh_out = torch.randn_like(h) if residual else None
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _, _, mean, rstd = norm._norm_fwd_launch(h, None, w, b, 1e-6, 0.0, 0.0, 0, is_rms, h.dtype)
        step = functools.partial(norm._norm_bwd_launch, dy, dh_out, h, w, 0.0, None if is_rms else h.dtype,
                                 None if is_rms else mean, rstd, 0.0, 0, is_rms, h.dtype, residual,
                                 False if residual else (True, True))
        blocks, one = (lambda *a: False), (lambda *a: True)
        patch_norm(bwd_one_wide_block=blocks)
        ref = step()[0].float()
        variants = [("blocks of bwd_max_block", (blocks, saved[1]))]
        variants += [(f"one block, {warps} warps", (one, lambda cols, values_per_thread=16, w_=warps: (
            saved[1](cols)[0], w_))) for warps in (8, 16, 32)]
        for name, (one_wide, settings) in variants:
            patch_norm(bwd_one_wide_block=one_wide, row_settings=settings)
            err = ((step()[0].float() - ref).norm() / ref.norm()).item()
            us = do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3
            gbps = (4 if residual else 3) * h.numel() * 2 / us / 1e3
            print(f"norm {kind} bwd {rows}x{n} {name:<26} {us:8.1f} us {gbps / copy:6.1%} (rel. diff {err:.1e})",
                  flush=True)
        patch_norm(bwd_one_wide_block=saved[0], row_settings=saved[1])


def sweep_layer_norm_bwd_wide(copy):
    """LayerNorm backward of wide rows split by column blocks (the path of rows past MAX_ROW_BLOCK;
    at 12288-16384 one block read twice is faster: sweep_norm_bwd_one_wide_block) by the block and
    programs an SM, timed by CUDA-graph replay (the row sums' pass included)."""
    saved = norm.bwd_programs_per_sm, norm.bwd_max_block
    for rows, n in itertools.product((2048, 8192), (12288, 16384)):
        h = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(h)
        w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        _, _, mean, rstd = norm._norm_fwd_launch(h, None, w, b, 1e-6, 0.0, 0.0, 0, False, h.dtype)
        step = functools.partial(norm._norm_bwd_launch, dy, None, h, w, 0.0, h.dtype, mean, rstd, 0.0, 0, False,
                                 h.dtype, False, (True, True))
        ref = step()[0].float()
        for cap, per_sm in itertools.product((4096, 8192), (1, 2, 4)):
            patch_norm(bwd_max_block=lambda n_cols, c_=cap: c_)
            patch_norm(bwd_programs_per_sm=lambda block, is_rms, p_=per_sm: p_)
            err = ((step()[0].float() - ref).norm() / ref.norm()).item()
            us = do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3
            gbps = 3 * h.numel() * 2 / us / 1e3
            print(f"norm layer bwd {rows}x{n} block={cap} per_sm={per_sm} {us:8.1f} us {gbps / copy:6.1%} "
                  f"(rel. diff {err:.1e})", flush=True)
    patch_norm(bwd_programs_per_sm=saved[0], bwd_max_block=saved[1])


def sweep_norm_fwd_wide(copy):
    """RMSNorm, LayerNorm and add_rms_norm forwards of wide rows by the block held at once and warps
    (a block narrower than the row runs the two-pass kernel, re-reading the row from L2), beside the
    launcher's own choice and torch.compile, timed by CUDA-graph replay. The H200's full sweep
    (results/h200/sweep.md) had both norms at 0.81-0.92x torch.compile at 8192-16384."""
    saved = norm.fwd_settings
    for form, rows, n in itertools.product(("rms", "layer", "add_rms"), (4096, 16384), (8192, 12288, 16384)):
        is_rms = form != "layer"
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        residual = torch.randn_like(x) if form == "add_rms" else None
        bias = None if is_rms else b
        step = functools.partial(norm._norm_fwd_launch, x, residual, w, bias, 1e-5, 0.0, 0.0, 0, is_rms, x.dtype)
        ref = step()[0].float()
        moved = (4 if residual is not None else 2) * x.numel() * 2

        def report(label, us, err=None):
            print(f"norm {form} fwd {rows}x{n} {label:<22} {us:8.1f} us {moved / us / 1e3 / copy:6.1%}"
                  + ("" if err is None else f" (rel. diff {err:.1e})"), flush=True)

        report(f"launcher {saved(n, rows, is_rms, residual is not None, 132)[:2]}",
               do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3)
        for block, warps in itertools.product((4096, 8192, 16384), (4, 8, 16)):
            if block > 2 * n:
                continue
            patch_norm(fwd_settings=lambda *_, b_=block, w_=warps: (b_, w_, 1))
            err = ((step()[0].float() - ref).norm() / ref.norm()).item()
            report(f"block={block} warps={warps}", do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3, err)
        patch_norm(fwd_settings=saved)
        f = torch.nn.functional
        if form == "rms":
            compiled = torch.compile(lambda x: f.rms_norm(x, (n,), w, 1e-5))
        elif form == "add_rms":
            compiled = torch.compile(lambda x: (f.rms_norm(x + residual, (n,), w, 1e-5), x + residual))
        else:
            compiled = torch.compile(lambda x: f.layer_norm(x, (n,), w, b, 1e-5))
        compiled(x)
        report("torch.compile", do_bench_cudagraph(lambda: compiled(x), rep=100, return_mode="median") * 1e3)


def sweep_norm_fwd_operands(copy):
    """The wide forward at 4096 x 4 and 16 warps with and without its weight and bias: how much of
    LayerNorm's shortfall against RMSNorm is pass 2's re-reads of w and b, how much its statistics."""
    saved = norm.fwd_settings
    for rows, n in ((16384, 12288), (16384, 16384)):
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for is_rms, label, weight, bias in ((False, "layer w+b", w, b), (False, "layer w", w, None),
                                            (False, "layer none", None, None), (True, "rms w", w, None),
                                            (True, "rms none", None, None)):
            for warps in (4, 16):
                patch_norm(fwd_settings=lambda *_, w_=warps: (4096, w_, 1))
                step = functools.partial(norm._norm_fwd_launch, x, None, weight, bias, 1e-5, 0.0, 0.0, 0, is_rms,
                                         x.dtype)
                us = do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3
                print(f"{rows}x{n} {label:<12} warps={warps:<3} {us:7.1f} us {4 * x.numel() / us / 1e3 / copy:6.1%}",
                      flush=True)
    patch_norm(fwd_settings=saved)


def sweep_layer_norm_fwd_wide(copy):
    """LayerNorm and add_layer_norm forwards of wide rows by block (4096, 8192) and warps, beside the launcher
    and the sweep's torch.compile peer (reference.layer_norm compiled, plain LayerNorm only), by CUDA-graph
    replay. (Run 8 of results/h200/tune_norm_wide_fwd.log had 4096 only: 16384 features at 0.92x the peer.)"""
    from onepass import reference

    saved = norm.fwd_settings
    for rows, n in itertools.product((4096, 16384, 65536), (12288, 16384)):
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
        w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def report(form, label, fn, passes):
            us = do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            gbps = passes * x.numel() * 2 / us / 1e3
            print(f"norm {form} fwd {rows}x{n} {label:<22} {us:8.1f} us {gbps / copy:6.1%}", flush=True)

        for form in ("layer", "add_layer"):
            residual = torch.randn_like(x) if form == "add_layer" else None
            step = functools.partial(norm._norm_fwd_launch, x, residual, w, b, 1e-5, 0.0, 0.0, 0, False, x.dtype)
            passes = 4 if residual is not None else 2
            report(form, f"launcher {saved(n, rows, False, residual is not None, 132)[:2]}", step, passes)
            for block, warps in itertools.product((4096, 8192), (4, 8, 16)):
                patch_norm(fwd_settings=lambda *_, b_=block, w_=warps: (b_, w_, 1))
                step()
                report(form, f"block={block} warps={warps}", step, passes)
            patch_norm(fwd_settings=saved)
        compiled = torch.compile(reference.layer_norm, dynamic=False)
        compiled(x, w, b, 1e-5)
        report("layer", "torch.compile", lambda: compiled(x, w, b, 1e-5), 2)
        torch._dynamo.reset()


def sweep_activation(copy):
    n = 8192
    g = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
    u = torch.randn_like(g)
    dy = torch.randn_like(g)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    size = g.numel() * 2
    for block, warps in itertools.product((1024, 2048, 4096, 8192), (2, 4, 8, 16)):
        act.TILE_FLAT = act.TILE_FLAT_SMALL = (1, block, warps)  # (the forward's, whatever its size)
        fwd_ms, fwd_gbps = bench(lambda: act._act_fwd(g, u, None, act.SILU), 3 * size)
        bwd_ms, bwd_gbps = bench(lambda: act._act_bwd(dy, g, u, None, act.SILU), 5 * size)
        print(f"swiglu flat block={block} warps={warps:<3} fwd {fwd_ms:7.3f} ms {fwd_gbps / copy:6.1%} | "
              f"bwd {bwd_ms:7.3f} ms {bwd_gbps / copy:6.1%}")
    tiles = [(1, 4096), (2, 2048), (4, 1024), (8, 512), (16, 256), (32, 128), (8, 1024), (16, 512), (32, 256)]
    for (bm, bn), warps in itertools.product(tiles, (4, 8)):
        act.TILE_BIAS = (bm, bn, warps)
        fwd_ms, fwd_gbps = bench(lambda: act._act_fwd(g, None, b, act.GELU_TANH), 2 * size)
        print(f"bias_gelu fwd tile={bm}x{bn} warps={warps} {fwd_ms:7.3f} ms {fwd_gbps / copy:6.1%}")
    bwd_tiles = [(4, 2048, 8), (2, 2048, 4), (2, 4096, 8), (4, 4096, 16), (8, 2048, 8), (4, 1024, 4), (16, 512, 4)]
    for (bm, bn, warps), per_sm in itertools.product(bwd_tiles, (2, 4, 8)):
        act.TILE_BIAS_BWD, act.BIAS_BWD_PROGRAMS_PER_SM = (bm, bn, warps), per_sm
        bwd_ms, bwd_gbps = bench(lambda: act._act_bwd(dy, g, None, b, act.GELU_TANH), 3 * size)
        print(f"bias_gelu bwd tile={bm}x{bn} warps={warps} per_sm={per_sm} {bwd_ms:7.3f} ms {bwd_gbps / copy:6.1%}")


def profile_step():
    """Host time of one rms_norm forward+backward, and where it goes (torch.profiler)."""
    import time

    from onepass import ops

    x = torch.randn(ROWS, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        x.grad = w.grad = None
        ops.rms_norm(x, w).backward(gy)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        step()
    host = (time.perf_counter() - t) / 50 * 1e3
    torch.cuda.synchronize()
    print(f"rms_norm fwd+bwd: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms a step with sync, host {host:.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    import sys

    parts = sys.argv[1:] or ["profile", "norm", "wide", "activation"]  # any of these, in this order
    ceilings = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceilings.copy_gbps:.0f} GB/s")
    if "profile" in parts:
        profile_step()
    if "norm" in parts:
        sweep_norm(ceilings.copy_gbps)
    if "wide" in parts:
        sweep_norm_bwd_wide(ceilings.copy_gbps)
    if "one-wide-block" in parts:
        sweep_norm_bwd_one_wide_block(ceilings.copy_gbps)
    if "wide-fwd" in parts:
        sweep_norm_fwd_wide(ceilings.copy_gbps)
    if "wide-fwd-operands" in parts:
        sweep_norm_fwd_operands(ceilings.copy_gbps)
    if "wide-fwd-layer" in parts:
        sweep_layer_norm_fwd_wide(ceilings.copy_gbps)
    if "wide-layer" in parts:
        sweep_layer_norm_bwd_wide(ceilings.copy_gbps)
    if "activation" in parts:
        sweep_activation(ceilings.copy_gbps)
    narrow = ((16384, 768), (65536, 768), (65536, 1024), (65536, 1536), (16384, 2048))
    if "narrow-bwd" in parts:  # plain RMSNorm's backward at narrow rows, more programs an SM
        sweep_norm_bwd(ceilings.copy_gbps, narrow, (4, 6, 8, 12, 16), with_dh=False)
    if "narrow-bwd-layer" in parts:  # plain LayerNorm's
        sweep_norm_bwd(ceilings.copy_gbps, narrow, (4, 6, 8, 12, 16), with_dh=False, is_rms=False)
