"""Sweep the cross-entropy kernel's settings and time the pieces of linear_cross_entropy on a GPU.

    python benchmarks/tune_loss.py [ce] [lce] [lce-chunks]

ce: cross_entropy forward with the gradient (its backward is free for an upstream
gradient of 1) at 8192 x 128256 bf16, per (block, warps), with the kernel's
registers and spills, checked against PyTorch, beside Liger in the same run
(GB/s count one read of the logits and one write; "kernels" is the GPU time alone).
lce: at the LM heads of issue 33 (8192 tokens x hidden x vocab: Qwen2-7B's, Gemma-2-2B's, Llama-3's),
each piece of a chunk (the logits GEMM, the cross-entropy kernel, dx, and dW with its accumulator
choices), then the whole op per (chunk, accum_dtype) with its peak memory, beside the three full matmuls.
lce-chunks: the whole op per chunk (bf16 accumulator) at hidden 2048 to 4096, in long runs, beside torch.compile.
"""

from __future__ import annotations

import importlib
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from onepass import ops
from onepass.bench.harness import kernel_ms, measure_ceilings

ce = importlib.import_module("onepass.ops.cross_entropy")
dispatch = importlib.import_module("onepass.ops.dispatch")
TOKENS, VOCAB = 8192, 128256  # ce
LCE_HEADS = ((8192, 4096, 151936), (8192, 2304, 256000), (8192, 4096, 128256))
# lce-chunks: hidden sizes 2048 to 4096 (the default chunk's rule is in tokens, so its cost shows where H is small)
LCE_CHUNK_HEADS = ((8192, 2048, 32000), (8192, 2048, 128256), (8192, 2304, 256000), (8192, 3584, 32000),
                   (8192, 4096, 128256))


def bench(fn):
    fn()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep_ce(copy):
    x = (torch.randn(TOKENS, VOCAB, device="cuda") * 4).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    nbytes = 2 * x.numel() * 2
    ref_loss = F.cross_entropy(x.float(), t)
    ref_grad = torch.autograd.grad(ref_loss, x)[0].float()

    def step():
        loss = ops.cross_entropy(x, t)
        loss.backward()
        x.grad = None
        return loss

    defaults, by_device = (ce.CE_MAX_BLOCK, ce.CE_MAX_WARPS), ce.CE_GRAD_BY_DEVICE
    ce.CE_GRAD_BY_DEVICE = {}  # the swept setting on every GPU
    for block, warps in ((4096, 8), (8192, 8), (4096, 4), (2048, 4), (8192, 16), (16384, 16), (32768, 32)):
        ce.CE_MAX_BLOCK, ce.CE_MAX_WARPS = block, warps
        loss = ops.cross_entropy(x, t)
        (grad,) = torch.autograd.grad(loss, x)
        compiled = [k for key, k in dispatch._compiled_kernels.items() if key[0] is ce._cross_entropy_fwd_kernel][-1]
        err = (grad.float() - ref_grad).abs().max().item()
        # a bf16 loss: within one rounding; bf16 gradients ~1e-4 at most
        ok = abs(loss.item() - ref_loss.item()) <= 2**-7 * abs(ref_loss.item()) and err < 2e-6
        ms = bench(step)
        print(f"ce block={block:<6} warps={warps:<3} regs={compiled.n_regs:<3} "
              f"spills={compiled.n_spills:<4} {ms:7.3f} ms (kernels {kernel_ms(step):.3f}) "
              f"{nbytes / ms / 1e6:6.0f} GB/s {nbytes / ms / 1e6 / copy:6.1%} {'ok' if ok else f'WRONG err={err}'}",
              flush=True)
    (ce.CE_MAX_BLOCK, ce.CE_MAX_WARPS), ce.CE_GRAD_BY_DEVICE = defaults, by_device  # (lce below: the op's own)
    try:  # last: Liger writes its gradient over the logits
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss()

        def liger_step():
            liger(x, t).backward()
            x.grad = None

        ms = bench(liger_step)
        print(f"ce liger {ms:7.3f} ms (kernels {kernel_ms(liger_step):.3f}) {nbytes / ms / 1e6:6.0f} GB/s", flush=True)
    except ImportError as err:
        print("ce liger: not importable:", err)


def step_ms_and_peak(loss_fn, leaves, timer):
    """(ms by ``timer``, GiB at the peak above the inputs) of a fwd+bwd step of ``loss_fn``."""
    def step():
        loss_fn().backward()
        for leaf in leaves:
            leaf.grad = None

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return timer(step), peak


def time_lce_pieces(matmul_tflops, tokens, hidden, vocab):
    print(f"lce head {tokens} x {hidden} x {vocab}", flush=True)
    dev, bf = "cuda", torch.bfloat16
    w = torch.randn(vocab, hidden, device=dev, dtype=bf) * 0.02
    h_all = torch.randn(tokens, hidden, device=dev, dtype=bf)
    full = 3 * 2 * tokens * hidden * vocab
    ms3 = (bench(lambda: h_all @ w.t()) + bench(lambda: torch.empty(tokens, vocab, device=dev, dtype=bf) @ w)
           + bench(lambda: torch.empty(vocab, tokens, device=dev, dtype=bf) @ h_all))
    print(f"lce three full matmuls {ms3:7.3f} ms ({full / ms3 / 1e9:.0f} TFLOP/s; "
          f"measured ceiling {matmul_tflops:.0f})")
    acc32 = torch.empty(vocab, hidden, device=dev, dtype=torch.float32)
    acc16 = torch.empty(vocab, hidden, device=dev, dtype=bf)
    t = torch.randint(0, vocab, (tokens,), device=dev)
    for c in (640, 1024, 2048):
        h, g = h_all[:c], torch.randn(c, vocab, device=dev, dtype=bf)
        flops = 2 * c * hidden * vocab
        rows_f32, lse_f32 = torch.empty(c, device=dev), torch.empty(c, device=dev)
        counts = torch.ones(2, device=dev, dtype=torch.int32)
        rows = [
            ("logits h@W^T", lambda: torch.mm(h, w.t(), out=g)),
            ("ce kernel", lambda: ce.ce_rows(g, t[:c], g, rows_f32, lse_f32, None, counts, None, -100, "mean", 0.0,
                                             0.0, None, False)),
            ("dx g@W", lambda: g @ w),
            ("dW bf16 beta=0", lambda: torch.mm(g.t(), h, out=acc16)),
            ("dW bf16 beta=1", lambda: acc16.addmm_(g.t(), h)),
            ("dW fp32 beta=0", lambda: torch.addmm(acc32, g.t(), h, beta=0, out_dtype=torch.float32, out=acc32)),
            ("dW fp32 beta=1", lambda: torch.addmm(acc32, g.t(), h, beta=1, out_dtype=torch.float32, out=acc32)),
        ]
        for name, fn in rows:
            ms = bench(fn)
            print(f"lce chunk={c:<5} {name:<16} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s", flush=True)
    for chunk, accum in ((2048, torch.float32), (512, bf), (640, bf), (768, bf), (1024, bf), (2048, bf)):
        hh = h_all.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)

        ms, peak = step_ms_and_peak(lambda: ops.linear_cross_entropy(hh, ww, t, chunk_size=chunk,
                                                                     accum_dtype=accum), (hh, ww), bench)
        print(f"lce op chunk={chunk:<5} accum={str(accum).split('.')[-1]:<9} {ms:7.3f} ms "
              f"({ms / ms3:.3f}x the three matmuls) peak above inputs {peak:.2f} GiB", flush=True)


def time_lce_chunks(tokens, hidden, vocab, chunks=(640, 1024, 2048, 3072)):
    """The whole op per chunk with the default (bf16) accumulator, long runs (a ~50 ms step varies
    by ~8% over do_bench's default 100 ms), beside torch.compile of the plain loss."""
    dev, bf = "cuda", torch.bfloat16
    w = (torch.randn(vocab, hidden, device=dev, dtype=bf) * 0.02).requires_grad_(True)
    h = torch.randn(tokens, hidden, device=dev, dtype=bf).requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), device=dev)
    plain = torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t))
    runs = [(f"chunk={c}", lambda c=c: ops.linear_cross_entropy(h, w, t, chunk_size=c)) for c in chunks]
    for name, fn in runs + [("torch.compile", lambda: plain(h, w, t))]:
        ms, peak = step_ms_and_peak(fn, (h, w), lambda step: do_bench(step, warmup=200, rep=1500,
                                                                      return_mode="median"))
        print(f"lce {tokens}x{hidden}x{vocab} {name:<14} {ms:7.3f} ms  peak above inputs {peak:.2f} GiB", flush=True)


def main():
    which = set(sys.argv[1:]) or {"ce", "lce"}
    ceilings = measure_ceilings()
    print(f"copy {ceilings.copy_gbps:.0f} GB/s, matmul {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    if "ce" in which:
        sweep_ce(ceilings.copy_gbps)
    if "lce" in which:
        for head in LCE_HEADS:
            time_lce_pieces(ceilings.matmul_tflops, *head)
    if "lce-chunks" in which:
        for head in LCE_CHUNK_HEADS:
            time_lce_chunks(*head)


if __name__ == "__main__":
    main()
