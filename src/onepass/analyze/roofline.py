"""The roofline plot of a report, as inline SVG (standard library only).

Without measurements every op's time is *estimated* from the roof (max of bytes over the
bandwidth and FLOPs over the peak), so every op sits on the roof: the plot shows where the
ops lie (memory- or compute-bound, how much time each kind takes), not how efficient they
are, and says so. With measurements (``measure=True``) it draws achieved points against
attainable ones in two panels side by side: the unfused model (eager, each layer and the
whole step) and onepass (each measured variant named ``onepass...``, at the bytes of the
fused chains).

- x: arithmetic intensity (FLOP/byte), y: FLOP/s, both log; a point's area ~ its time.
- Ops without FLOPs (copies, gathers, fills) have no place on a log axis: they stand in a
  column of their own left of it, one circle per op name.
- Every point has a hover title (SVG ``<title>``); the largest are labelled in place.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from onepass.analyze.fusion import pattern_of

if TYPE_CHECKING:
    from onepass.analyze.report import Report

MEMORY_BOUND, COMPUTE_BOUND = "#d62728", "#1f77b4"
VARIANT_COLORS = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")  # the onepass variants, in turn
X_DECADES = (-2, 5)  # intensity 0.01 .. 100,000 FLOP/byte: the roofs' labels stand right of the matmuls
X_LOWEST = -5  # the axis starts lower where an op's intensity is lower (down to here)
Y_FLOOR = 9  # 1 GFLOP/s; lower where an op's rate is lower, down to Y_LOWEST
Y_LOWEST = 6
ZERO_COLUMN = 56  # px left of the log axis for the ops without FLOPs
LABELLED = 4  # points labelled in place (the rest by hover title)


@dataclass
class Point:
    intensity: float  # FLOP/byte; 0: the op has no FLOPs (drawn in the zero column)
    flops_per_s: float
    seconds: float  # sets the area
    title: str  # hover text
    color: str
    hollow: bool = False
    label: str = ""  # drawn beside the point when it is among the largest
    link: Optional[int] = None  # index of the point (in the same panel) a line joins it to


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


class _Panel:
    """One roofline: the roofs of a GPU, gridlines, axes and points, at (left, top) in the SVG."""

    def __init__(self, report: Report, left: float, top: float, width: float, height: float, x0: int, y0: int):
        self.gpu = report.gpu
        self.x0, self.y0 = x0, y0
        self.left, self.top, self.width, self.height = left, top, width, height
        self.axis_left = left + ZERO_COLUMN + 44  # room for the zero column and the y labels
        self.bottom = top + height - 40
        self.y1 = math.log10(self.gpu.bf16_tflops * 1e12) + 0.5
        self.taken: list[tuple[float, float, float]] = []  # (x from, x to, y) of the labels drawn

    def xy(self, intensity: float, flops_per_s: float) -> tuple[float, float]:
        x0, x1 = self.x0, X_DECADES[1]
        li = min(max(math.log10(max(intensity, 1e-30)), x0), x1)
        lp = min(max(math.log10(max(flops_per_s, 1.0)), self.y0), self.y1)
        x = self.axis_left + (li - x0) / (x1 - x0) * (self.left + self.width - 12 - self.axis_left)
        y = self.bottom - (lp - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top - 14)
        return x, y

    def frame(self, title: str, notes: list[str]) -> list[str]:
        g, parts = self.gpu, []
        x0, x1 = self.x0, X_DECADES[1]
        right = self.left + self.width - 12
        for e in range(x0, x1 + 1):  # gridlines and tick labels
            x, _ = self.xy(10.0**e, 1.0)
            parts.append(f"<line class='grid' x1='{x:.1f}' y1='{self.top + 14:.1f}' x2='{x:.1f}' "
                         f"y2='{self.bottom:.1f}' stroke='#e5e5e5'/>"
                         f"<text x='{x:.1f}' y='{self.bottom + 14:.1f}' text-anchor='middle'>1e{e}</text>")
        for e in range(self.y0, int(self.y1) + 1):
            _, y = self.xy(1.0, 10.0**e)
            parts.append(f"<line class='grid' x1='{self.axis_left:.1f}' y1='{y:.1f}' x2='{right:.1f}' y2='{y:.1f}' "
                         f"stroke='#e5e5e5'/><text x='{self.axis_left - 4:.1f}' y='{y + 4:.1f}' "
                         f"text-anchor='end'>1e{e}</text>")
        zx = self.left + ZERO_COLUMN / 2
        parts.append(f"<line x1='{self.left + ZERO_COLUMN:.1f}' y1='{self.top + 14:.1f}' "
                     f"x2='{self.left + ZERO_COLUMN:.1f}' y2='{self.bottom:.1f}' stroke='#999' stroke-dasharray='3,3'/>"
                     f"<text x='{zx:.1f}' y='{self.bottom + 14:.1f}' text-anchor='middle'>0 FLOP</text>")
        bw = g.hbm_gbps * 1e9
        start = max(10.0**x0, 10.0**self.y0 / bw)  # where the bandwidth roof enters the plot
        for peak, label in ((g.bf16_tflops, "bf16 matmul"), (g.fp32_tflops, "fp32")):
            ridge = peak * 1e12 / bw
            (ax, ay), (bx, by), (cx, cy) = (self.xy(start, start * bw), self.xy(ridge, peak * 1e12),
                                            self.xy(10.0**x1, peak * 1e12))
            text = f"{label} {_num(peak)} TFLOP/s"
            parts.append(f"<polyline class='roof' fill='none' stroke='#444' points='{ax:.1f},{ay:.1f} "
                         f"{bx:.1f},{by:.1f} {cx:.1f},{cy:.1f}'><title>{_esc(text)}, ridge at {_num(ridge)} "
                         f"FLOP/byte</title></polyline>"
                         f"<text x='{cx - 4:.1f}' y='{cy + 13:.1f}' text-anchor='end'>{_esc(text)}</text>")
            self.taken.append((cx - 4 - 6 * len(text), cx - 4, cy + 9))
        # the bandwidth roof's value, along its slope near the left
        (sx, sy), (tx, ty) = self.xy(start, start * bw), self.xy(start * 10, start * 10 * bw)
        angle = math.degrees(math.atan2(ty - sy, tx - sx))
        parts.append(f"<text x='{sx + 4:.1f}' y='{sy + 14:.1f}' transform='rotate({angle:.1f} {sx + 4:.1f} "
                     f"{sy + 14:.1f})'>HBM {_num(g.hbm_gbps)} GB/s ({_esc(g.source)})</text>")
        parts.append(f"<text x='{self.left + self.width / 2:.1f}' y='{self.top + 2:.1f}' text-anchor='middle' "
                     f"font-weight='bold'>{_esc(title)}</text>")
        parts.append(f"<text x='{(self.axis_left + right) / 2:.1f}' y='{self.bottom + 30:.1f}' "
                     "text-anchor='middle'>arithmetic intensity (FLOP/byte)</text>")
        mid = (self.top + self.bottom) / 2
        parts.append(f"<text x='{self.left + 8:.1f}' y='{mid:.1f}' transform='rotate(-90 {self.left + 8:.1f} "
                     f"{mid:.1f})' text-anchor='middle'>FLOP/s on {_esc(g.name)}</text>")
        for i, note in enumerate(notes):  # bottom right: under the roofs, where no op of a roofline lies
            y = self.bottom - 8 - 14 * (len(notes) - 1 - i)
            parts.append(f"<text class='note' x='{right - 4:.1f}' y='{y:.1f}' text-anchor='end' "
                         f"fill='#7a4a00'>{_esc(note)}</text>")
        return parts

    def points(self, points: list[Point], total_s: float) -> list[str]:
        parts, at = [], []
        zero = sorted((p for p in points if p.intensity <= 0), key=lambda p: -p.seconds)
        stack_y = self.bottom
        for p in points:
            r = 2.5 + 18 * math.sqrt(p.seconds / total_s) if total_s > 0 else 3.0
            if p.intensity <= 0:  # the zero column, stacked from the bottom, largest first
                continue
            at.append((p, *self.xy(p.intensity, p.flops_per_s), r))
        for p in zero:
            r = min(2.5 + 18 * math.sqrt(p.seconds / total_s) if total_s > 0 else 3.0, ZERO_COLUMN / 2 - 4)
            stack_y -= r + 1
            at.append((p, self.left + ZERO_COLUMN / 2, max(stack_y, self.top + 14 + r), r))
            stack_y -= r + 1
        placed = {id(p): (x, y) for p, x, y, _ in at}
        for p, x, y, _ in at:  # lines first, under the points
            if p.link is not None:
                lx, ly = placed[id(points[p.link])]
                parts.append(f"<line x1='{lx:.1f}' y1='{ly:.1f}' x2='{x:.1f}' y2='{y:.1f}' stroke='{p.color}' "
                             "stroke-dasharray='2,2'/>")
        for p, x, y, r in sorted(at, key=lambda a: -a[3]):  # small points on top of large ones
            fill = "fill='white' fill-opacity='0'" if p.hollow else f"fill='{p.color}' fill-opacity='0.45'"
            parts.append(f"<circle class='point' cx='{x:.1f}' cy='{y:.1f}' r='{r:.1f}' {fill} stroke='{p.color}'>"
                         f"<title>{_esc(p.title)}</title></circle>")
        right, drawn = self.left + self.width - 12, 0
        for p, x, y, r in sorted((a for a in at if a[0].label and a[0].intensity > 0), key=lambda a: -a[0].seconds):
            w = 6 * len(p.label)
            free = [lx for lx in (x + r + 2, x - r - 2 - w) if self.axis_left <= lx and lx + w <= right
                    and not any(abs(y - ty) < 12 and lx < tx1 and tx0 < lx + w for tx0, tx1, ty in self.taken)
                    and not any(abs(y - 4 - cy) < cr + 6 and lx < cx + cr and cx - cr < lx + w
                                for q, cx, cy, cr in at if q is not p)]
            if not free:
                continue  # right or left of the point, it would cover another label: its hover title says it
            self.taken.append((free[0], free[0] + w, y))
            parts.append(f"<text class='label' x='{free[0]:.1f}' y='{y + 4:.1f}' font-size='10'>"
                         f"{_esc(p.label)}</text>")
            drawn += 1
            if drawn == LABELLED:
                break
        return parts


def _op_points(report: Report) -> list[Point]:
    """Every recorded op on its estimated roof, grouped by (op, module pattern, position)."""
    f = report.fusion
    groups: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0, 0])  # count, seconds, bytes, flops
    for op, s, mb in zip(report.ops, f.seconds, f.memory_bound):
        if not op.bytes or not s:
            continue
        intensity = op.flops / op.bytes
        key = (op.name, pattern_of(op.module) or "(top)", round(math.log10(intensity), 2) if op.flops else None,
               round(math.log10(op.flops / s), 2) if op.flops else None, mb)
        g = groups[key]
        g[0], g[1], g[2], g[3] = g[0] + 1, g[1] + s, g[2] + op.bytes, g[3] + op.flops
    zero: dict[str, list] = defaultdict(lambda: [0, 0.0, 0, set()])
    points = []
    for (name, where, li, lp, mb), (n, s, nbytes, flops) in groups.items():
        if li is None:
            z = zero[name]
            z[0], z[1], z[2] = z[0] + n, z[1] + s, z[2] + nbytes
            z[3].add(where)
            continue
        title = (f"{name} x{n} at {where}: {flops / nbytes:,.3g} FLOP/B, {nbytes / 1e6:,.1f} MB, "
                 f"{flops / 1e9:,.3g} GFLOP, {s * 1e3:.3g} ms estimated, "
                 f"{'memory' if mb else 'compute'}-bound")
        points.append(Point(10.0**li, 10.0**lp, s, title, MEMORY_BOUND if mb else COMPUTE_BOUND,
                            label=f"{name.removeprefix('aten.')} {where.split('.')[-1]}"))
    for name, (n, s, nbytes, wheres) in zero.items():
        title = (f"{name} x{n}: no FLOPs, {nbytes / 1e6:,.1f} MB, {s * 1e3:.3g} ms estimated "
                 f"(at {', '.join(sorted(wheres)[:3])}{', ...' if len(wheres) > 3 else ''})")
        points.append(Point(0.0, 0.0, s, title, MEMORY_BOUND, label=name.removeprefix("aten.")))
    return points


def _pair(points: list[Point], name: str, flops: float, nbytes: float, measured_s: float,
          attainable_s: float, color: str, where: str) -> None:
    """An attainable point (hollow) and the achieved one (filled) below it, joined by a line."""
    intensity = flops / max(nbytes, 1)
    points.append(Point(intensity, flops / attainable_s, attainable_s,
                        f"{name}, attainable: {attainable_s * 1e3:.3g} ms ({where}), {intensity:,.3g} FLOP/B, "
                        f"{flops / attainable_s / 1e12:,.3g} TFLOP/s", color, hollow=True))
    points.append(Point(intensity, flops / measured_s, measured_s,
                        f"{name}, achieved: {measured_s * 1e3:.3g} ms measured = {attainable_s / measured_s:.0%} of "
                        f"attainable, {flops / measured_s / 1e12:,.3g} TFLOP/s", color,
                        label=name, link=len(points) - 1))


def _measured_panels(report: Report) -> tuple[list[Point], list[Point]]:
    """(unfused, onepass) achieved-against-attainable points from the measured side."""
    f, m, t = report.fusion, report.measured, report.totals()
    unfused: list[Point] = []
    regions = f.regions()
    for r in m.get("regions", []):
        idx = [i for i in regions.get(r["region"], []) if report.ops[i].phase == "forward"]
        flops, secs = sum(report.ops[i].flops for i in idx), sum(f.seconds[i] for i in idx)
        if flops and secs and r.get("kernel_ms"):
            _pair(unfused, f"{r['region']} (forward)", flops, r["bytes"], r["kernel_ms"] * 1e-3, secs,
                  MEMORY_BOUND, "its ops' roofline times")
    variants = m.get("variants", {})
    if t["flops"] and "eager" in variants:
        _pair(unfused, "eager step", t["flops"], t["bytes"], variants["eager"]["step_ms"] * 1e-3,
              t["roofline_ms"] * 1e-3, COMPUTE_BOUND, "its ops' roofline times")
    fused: list[Point] = []
    for name, v in variants.items():
        if "onepass" in name and t["flops"]:
            _pair(fused, name, t["flops"], t["fused_bytes"], v["step_ms"] * 1e-3, t["fused_roofline_ms"] * 1e-3,
                  VARIANT_COLORS[len(fused) // 2 % len(VARIANT_COLORS)], "the fused chains' roofline time")
    return unfused, fused


def roofline_svg(report: Report, width: int = 720, height: int = 440) -> str:
    """The report's roofline: estimated op positions, or (measured) achieved against attainable."""
    measured = bool(report.measured.get("variants"))
    panels: list[tuple[str, list[str], list[Point]]]
    if measured:
        unfused, fused = _measured_panels(report)
        left = ("The model as given (optimized: its kernels ran)" if report.optimized else "Unfused (eager)")
        panels = [(f"{left}: achieved vs attainable",
                   ["filled: measured; hollow: attainable (sum of each op's roofline time)",
                    "one pair per layer's forward, and the whole step"], unfused),
                  ("onepass: achieved vs attainable",
                   ["filled: measured; hollow: attainable at the fused chains' bytes"]
                   + ([] if fused else ["no variant named onepass... was measured"]), fused)]
    else:
        panels = [(f"{report.title}: where the ops lie (estimated)",
                   ["Estimated: each op's time is taken from the roof, so every point sits on it.",
                    "This shows where the ops lie, not how efficient they are: measure on a GPU",
                    "(onepass analyze --measure) to plot achieved against attainable."], _op_points(report))]
    total_w = width * len(panels)
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{total_w}' height='{height + 20}' "
             f"font-family='sans-serif' font-size='11'><rect width='100%' height='100%' fill='white'/>"]
    drawn = [p for _, _, ps in panels for p in ps if p.intensity > 0 and p.flops_per_s > 0]
    x0 = max(min([X_DECADES[0]] + [math.floor(math.log10(p.intensity)) for p in drawn]), X_LOWEST)
    y0 = max(min([Y_FLOOR] + [math.floor(math.log10(p.flops_per_s)) for p in drawn]), Y_LOWEST)
    for i, (title, notes, points) in enumerate(panels):
        panel = _Panel(report, i * width, 14, width, height - 14, x0, y0)
        parts += panel.frame(title, notes)
        parts += panel.points(points, sum(p.seconds for p in points if not p.hollow) or 1.0)
    legend = ("red: memory-bound, blue: compute-bound; area: estimated time; 0 FLOP: copies, gathers, fills"
              if not measured else "red: a layer's forward; blue: the whole step; area: time; hover a point for "
              "its figures")
    parts.append(f"<text x='{total_w / 2:.1f}' y='{height + 12}' text-anchor='middle'>{_esc(legend)}</text></svg>")
    return "".join(parts)
