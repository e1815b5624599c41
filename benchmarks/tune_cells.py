"""Launch settings of the row-wise kernels at the sweep's weakest cells, against the sweep's peers
(bf16, GPU time: the profiler's kernel sum, as `onepass bench sweep` reports it).

    python benchmarks/tune_cells.py [rms-fwd] [layer-fwd] [softmax] [rope] [swiglu] [liger-in-place]

Each study takes cells of the sweep's grid (its cases, so the same inputs and peers), times
onepass under each setting (module constants or settings functions patched for the run), each
setting checked against eager first, then every peer once. Prints one line a setting: GPU
time and its ratio to the best peer.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from onepass.bench.harness import kernel_ms, measure_ceilings
from onepass.bench.sweep import PEERS, check
from onepass.ops.dispatch import clear_cached_plans, empty_output, next_power_of_2, row_settings

STEPS = 20  # profiled steps a timing
# the modules (onepass.ops exports functions of the same names as some of them)
act, norm, rope, softmax = (importlib.import_module(f"onepass.ops.{name}")
                            for name in ("activation", "norm", "rope", "softmax"))


@dataclass
class Study:
    suite: str
    op: str
    modes: tuple[str, ...]
    cells: tuple[dict, ...]
    settings: Callable[[dict], list[tuple[str, dict]]]  # cell -> [(label, {(module, attr): value})]
    shape_has: str = ""


def _row_blocks(n: int) -> list[tuple[str, dict]]:
    """(BLOCK_N, num_warps) of a norm forward: one block by warps, and smaller looped blocks."""
    one = next_power_of_2(n)
    out = []
    for warps in (2, 4, 8, 16, 32):
        if 4 <= one // (32 * warps) <= 128:
            out.append((one, warps))
    out += [(b, w) for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)) if b < n]
    return [(f"block={b} warps={w}", {(norm, "row_settings"): lambda _n, values_per_thread=16, b_=b, w_=w: (b_, w_)})
            for b, w in out]


def _softmax_tiles(cell: dict) -> list[tuple[str, dict]]:
    block_n = row_settings(cell["seq"])[0]
    tiles = sorted({(tile // block_n, block_n, max(1, min(16, tile // (32 * per_thread))))
                    for tile, per_thread in itertools.product((1024, 2048, 4096, 8192, 16384), (4, 8, 16, 32))
                    if tile >= block_n})
    return [(f"rows={m} block={n} warps={w}", {(softmax, "_settings"): lambda _n, s_=(m, n, w): s_})
            for m, n, w in tiles]


def _rope_tiles(cell: dict) -> list[tuple[str, dict]]:
    return [(f"tile={t} warps={w}", {(rope, "TILE_ELEMENTS"): t, (rope, "NUM_WARPS"): w})
            for t, w in itertools.product((512, 1024, 2048, 4096), (1, 2, 4)) if t // (32 * w) >= 4]


def _flat_tiles(cell: dict) -> list[tuple[str, dict]]:
    return [(f"block={b} warps={w}", {(act, "TILE_FLAT"): (1, b, w), (act, "TILE_FLAT_SMALL"): (1, b, w)})
            for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))]


STUDIES = {
    "rms-fwd": Study("norm", "rms_norm", ("fwd",), tuple(
        {"rows": r, "hidden": h} for r, h in ((1024, 8192), (1024, 12288), (4096, 3072), (4096, 4096), (4096, 8192),
                                              (16384, 768), (16384, 2048), (16384, 4096), (16384, 5120),
                                              (65536, 5120))),
        lambda cell: _row_blocks(cell["hidden"])),
    "layer-fwd": Study("norm", "layer_norm", ("fwd",), tuple(
        {"rows": r, "hidden": h} for r, h in ((4096, 4096), (16384, 768), (16384, 4096), (4096, 8192))),
        lambda cell: _row_blocks(cell["hidden"])),
    "softmax": Study("softmax", "softmax", ("fwd", "fwd+bwd"), tuple(
        {"batch_heads": b, "seq": s} for b, s in ((32, 1024), (128, 1024), (32, 2048), (32, 4096))),
        _softmax_tiles, shape_has="causal"),
    "rope": Study("rope", "rope", ("fwd", "fwd+bwd"), tuple(
        {"batch": 4, "seq": s, "head_dim": d} for s, d in ((4096, 80), (16384, 80), (16384, 64), (4096, 128),
                                                           (4096, 256))),
        _rope_tiles),
    "swiglu": Study("activation", "swiglu", ("fwd", "fwd+bwd"), tuple(
        {"rows": r, "hidden": h} for r, h in ((1024, 5632), (4096, 2048), (16384, 8192))),
        _flat_tiles),
}


def _patched(patches: dict):
    """Set each (module, attribute) to its value; returns the undo. The cached launch plans are cleared
    both ways, so that a replaced setting takes effect and the original comes back."""
    saved = {key: getattr(*key) for key in patches}

    def undo():
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
        clear_cached_plans()

    for (module, attr), value in patches.items():
        setattr(module, attr, value)
    clear_cached_plans()
    return undo


def run(study: Study) -> None:
    suite = importlib.import_module(f"onepass.bench.suites.{study.suite}")
    for cell in study.cells:
        for case in suite.cases(**cell):
            if case.op != study.op or case.mode not in study.modes or study.shape_has not in case.shape:
                continue
            torch._dynamo.reset()
            thunks = case.make()
            times = {}
            for label, patches in [("current", {})] + study.settings(cell):
                undo = _patched(patches)
                try:
                    verdict = check(thunks)
                    if not verdict["passed"]:
                        times[label] = f"check failed: {verdict}"
                        continue
                    thunks["onepass"]()
                    times[label] = kernel_ms(thunks["onepass"], STEPS)
                except Exception as e:  # a setting out of resources: reported, not fatal
                    times[label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                finally:
                    undo()
            # the peers last: Liger's gated backward writes its gradients over its inputs
            peers = {}
            for name in PEERS:
                if name in thunks:
                    thunks[name]()
                    peers[name] = kernel_ms(thunks[name], STEPS)
            best, best_ms = min(peers.items(), key=lambda kv: kv[1])
            print(f"{case.op} {case.mode} {case.shape}: best peer {best} {best_ms * 1e3:.1f} us "
                  f"({', '.join(f'{k} {v * 1e3:.1f}' for k, v in peers.items())})", flush=True)
            for label, ms in times.items():
                shown = ms if isinstance(ms, str) else f"{ms * 1e3:8.1f} us  {best_ms / ms:5.2f}x best peer"
                print(f"    {label:<34} {shown}", flush=True)
            del thunks
            torch.cuda.empty_cache()


def _dx_over_dy(launcher):
    """onepass's norm backward launcher writing d(input) over the incoming gradient, as Liger's does: its
    outputs of dy's shape and dtype are dy itself."""

    def in_place(dy, *args):
        def giving_dy(like, dtype=None):
            if like.shape == dy.shape and (dtype or like.dtype) == dy.dtype and dy.is_contiguous():
                return dy
            return empty_output(like, dtype)

        norm.empty_output = giving_dy
        try:
            return launcher(dy, *args)
        finally:
            norm.empty_output = empty_output

    return in_place


def liger_in_place() -> None:
    from liger_kernel.transformers.functional import liger_rms_norm

    from onepass import ops
    from onepass.bench.case import fwd_bwd

    for rows, n in ((4096, 16384), (16384, 12288), (65536, 12288), (16384, 4096)):
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        steps = {"onepass": fwd_bwd(ops.rms_norm, x, w, 1e-6),
                 "onepass dx over dy": fwd_bwd(ops.rms_norm, x, w, 1e-6),
                 "liger in place": fwd_bwd(liger_rms_norm, x, w, 1e-6),
                 "liger out of place": fwd_bwd(liger_rms_norm, x, w, 1e-6, in_place=False)}
        gy = torch.randn_like(x)
        reference = None
        for name, step in steps.items():
            undo = _patched({(norm, "_norm_bwd_launch"): _dx_over_dy(norm._norm_bwd_launch)} if "over" in name else {})
            x.grad = w.grad = None
            fn, kwargs = (liger_rms_norm, {"in_place": "out" not in name}) if "liger" in name else (ops.rms_norm, {})
            fn(x, w, 1e-6, **kwargs).backward(gy.clone())  # the same dy for every variant: dx compared
            reference = x.grad.float() if reference is None else reference
            diff = ((x.grad.float() - reference).norm() / reference.norm()).item()
            step()
            print(f"rms_norm fwd+bwd {rows}x{n} {name:<20} {kernel_ms(step, STEPS) * 1e3:8.1f} us "
                  f"(dx against onepass's: rel. diff {diff:.1e})", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(STEPS):
                    step()
                torch.cuda.synchronize()
            for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:4]:
                print(f"    {event.key[:60]:<60} {event.device_time_total / STEPS:8.1f} us a step")
            undo()


if __name__ == "__main__":
    names = sys.argv[1:] or list(STUDIES)
    ceilings = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceilings.copy_gbps:.0f} GB/s; torch {torch.__version__}")
    for name in names:
        liger_in_place() if name == "liger-in-place" else run(STUDIES[name])
