"""Sweep of moe_experts' launch settings at the Mixtral-8x7B and Qwen3-30B-A3B layers (8192
tokens, bf16), one kernel group at a time, the others at the rule's settings:

    up        BLOCK_M x the gated tile (block_n, warps, stages), forward time
    down      the plain grouped GEMM's tile, forward time
    act_bwd   the dh~ GEMM with the activation backward, forward + backward time
    wgrad     the weight gradients' tile, forward + backward time

Prints one line a setting (median ms of triton.testing.do_bench) and the best of each group.

    python benchmarks/tune_moe.py > benchmarks/results/<gpu>/tune_moe.log
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton

from onepass import ops
from onepass.ops import moe

MODELS = {"Mixtral-8x7B": (4096, 8, 2, 14336), "Qwen3-30B-A3B": (2048, 128, 8, 768)}
TOKENS = 8192


def _inputs(hidden, n_experts, top_k, inter, grad):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)
    weights, index = torch.randn(TOKENS, n_experts, device="cuda", generator=g).softmax(-1).topk(top_k)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16().requires_grad_(grad)
    gate_up = (torch.randn(n_experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(n_experts, hidden, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    return x, index, weights, gate_up.requires_grad_(grad), down.requires_grad_(grad)


def _time(args, grad):
    x, index, weights, gate_up, down = args

    def step():
        out = ops.moe_experts(x, index, weights, gate_up, down)
        if grad:
            out.backward(torch.ones_like(out))

    return triton.testing.do_bench(step, warmup=5, rep=40)


def _candidates(base: moe.MoeSettings, group: str):
    tiles = [moe.Tile(n, w, s) for n, w, s in itertools.product((64, 128, 256), (4, 8), (3, 4))]
    if group == "up":
        for block_m, tile in itertools.product((64, 128), tiles):
            if tile.block_n <= 128:
                yield dataclasses.replace(base, block_m=block_m, up=tile)
    elif group == "down":
        for tile in tiles:
            yield dataclasses.replace(base, down=tile)
    elif group == "act_bwd":
        for tile in tiles:
            yield dataclasses.replace(base, act_bwd=tile)
    else:
        for bm, bn, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4)):
            yield dataclasses.replace(base, wgrad=(bm, bn, 64, w, s))


def main() -> None:
    rule = moe.moe_settings
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for name, (hidden, n_experts, top_k, inter) in MODELS.items():
        base = rule(TOKENS * top_k, n_experts, torch.device("cuda"))
        for group in ("up", "down", "act_bwd", "wgrad"):
            grad = group in ("act_bwd", "wgrad")
            args = _inputs(hidden, n_experts, top_k, inter, grad)
            results = []
            for settings in _candidates(base, group):
                moe.moe_settings = lambda *a, _s=settings, **k: _s
                try:
                    ms = _time(args, grad)
                except Exception as error:  # noqa: BLE001 - out of resources: a setting that does not fit
                    print(f"{name} {group} {settings}: {type(error).__name__}", flush=True)
                    continue
                results.append((ms, settings))
                print(f"{name} {group} {ms:.3f} ms {settings}", flush=True)
            moe.moe_settings = rule
            ms, best = min(results, key=lambda r: r[0])
            print(f"BEST {name} {group} {ms:.3f} ms (rule: {_time(args, grad):.3f} ms) {best}", flush=True)
            base = best


if __name__ == "__main__":
    main()
