"""The analysis as a terminal table, JSON, Markdown and a self-contained HTML page.

The roofline plot is inline SVG drawn here, so every report (HTML, or Markdown with
``roofline.svg`` beside it) needs nothing beyond the standard library.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from onepass.analyze.fusion import Fusion
from onepass.analyze.gpus import GPU


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _pattern_of(module: str) -> str:
    """model.layers.3.mlp -> model.layers.*.mlp: one row for what every layer repeats."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", module)


# a path ending so is one report file (``Report.write``); any other is a folder of them
ONE_FILE_SUFFIXES = (".json", ".md", ".html")


@dataclass
class Report:
    title: str  # "llama-1b, forward, batch 1 x seq 2048"
    mode: str
    gpu: GPU
    fusion: Fusion
    meta: bool  # analysed on meta tensors (no weights allocated)
    record_seconds: float
    measured: dict = field(default_factory=dict)  # filled by measure.measure on a GPU
    trace_path: Optional[str] = None

    # ------------------------------------------------------------------ numbers
    @property
    def ops(self):
        return self.fusion.ops

    def totals(self) -> dict:
        f, launch_s = self.fusion, self.gpu.launch_us * 1e-6
        fuse = [c for c in f.chains if c.verdict == "fuse"]
        bytes_, flops = sum(op.bytes for op in self.ops), sum(op.flops for op in self.ops)
        launches = sum(op.launches for op in self.ops)
        gpu_s = sum(f.seconds)
        saved_b, saved_l = sum(c.saved_bytes for c in fuse), sum(c.launches - 1 for c in fuse)
        saved_s = sum(c.saved_s for c in fuse)
        return {
            "ops": len(self.ops), "launches": launches, "bytes": bytes_, "flops": flops,
            "roofline_ms": gpu_s * 1e3,
            # Eager PyTorch cannot issue kernels faster than one per launch overhead.
            "eager_ms": sum(max(s, launch_s) for s, op in zip(f.seconds, self.ops) if op.launches) * 1e3,
            "memory_bound_ms": sum(s for s, mb in zip(f.seconds, f.memory_bound) if mb) * 1e3,
            "fused_bytes": bytes_ - saved_b, "fused_launches": launches - saved_l,
            "fused_roofline_ms": (gpu_s - saved_s) * 1e3,
            "saved_bytes": saved_b, "saved_launches": saved_l, "saved_ms": saved_s * 1e3,
        }

    def grouped_chains(self) -> list[dict]:
        """Chains that every layer repeats, summed: one row per (pattern, module pattern, phase)."""
        rows: dict[tuple, dict] = {}
        for c in self.fusion.chains:
            key = (c.pattern, c.onepass_op, c.phase, _pattern_of(c.module), c.verdict)
            row = rows.setdefault(key, {"pattern": c.pattern, "onepass_op": c.onepass_op, "phase": c.phase,
                                        "module": _pattern_of(c.module), "verdict": c.verdict, "count": 0,
                                        "saved_bytes": 0, "saved_launches": 0, "saved_ms": 0.0,
                                        "passes": c.passes, "example": c.describe(self.gpu.name),
                                        "notes": c.notes})
            row["count"] += 1
            row["saved_bytes"] += c.saved_bytes
            row["saved_launches"] += c.launches - 1
            row["saved_ms"] += c.saved_s * 1e3
        return sorted(rows.values(), key=lambda r: -r["saved_ms"])

    def layers(self) -> list[dict]:
        f = self.fusion
        saved: dict[str, float] = defaultdict(float)
        for c in f.chains:
            if c.verdict == "fuse":
                saved[f.region(self.ops[c.ops[-1]])] += c.saved_s * 1e3
        rows = []
        for name, idx in f.regions().items():
            rows.append({"region": name, "ops": len(idx), "launches": sum(self.ops[i].launches for i in idx),
                         "bytes": sum(self.ops[i].bytes for i in idx), "flops": sum(self.ops[i].flops for i in idx),
                         "roofline_ms": sum(f.seconds[i] for i in idx) * 1e3,
                         "memory_bound_ms": sum(f.seconds[i] for i in idx if f.memory_bound[i]) * 1e3,
                         "fusion_saves_ms": saved.get(name, 0.0)})
        return rows

    def variants(self) -> list[dict]:
        t = self.totals()
        rows = [{"variant": "eager (recorded)", "bytes": t["bytes"], "launches": t["launches"],
                 "ms": t["eager_ms"], "source": "roofline + launch overhead"},
                {"variant": "chains fused (projected)", "bytes": t["fused_bytes"], "launches": t["fused_launches"],
                 "ms": max(t["eager_ms"] - t["saved_ms"] - t["saved_launches"] * self.gpu.launch_us * 1e-3,
                           t["fused_roofline_ms"]),
                 "source": "roofline + launch overhead"}]
        for name, m in self.measured.get("variants", {}).items():
            rows.append({"variant": f"{name} (measured)", "bytes": None, "launches": m["kernels_per_step"],
                         "ms": m["step_ms"], "source": self.measured.get("device", "GPU")})
        return rows

    # ------------------------------------------------------------------ outputs
    def to_dict(self) -> dict:
        f = self.fusion
        return {
            "title": self.title, "mode": self.mode, "meta_tensors": self.meta, "gpu": self.gpu.to_dict(),
            "record_seconds": self.record_seconds, "totals": self.totals(), "variants": self.variants(),
            "chains": [c.to_dict(self.gpu.name) for c in f.chains], "grouped_chains": self.grouped_chains(),
            "flags": [fl.to_dict() for fl in f.flags], "layers": self.layers(), "measured": self.measured,
            "ops": [{"index": op.index, "name": op.name, "kind": op.kind, "phase": op.phase, "module": op.module,
                     "source": op.source, "bytes_read": op.bytes_read, "bytes_written": op.bytes_written,
                     "flops": op.flops, "dtype": op.dtype, "launches": op.launches,
                     "producers": [u.producer for u in op.inputs], "est_ms": s * 1e3,
                     "bound": "memory" if mb else "compute"}
                    for op, s, mb in zip(self.ops, f.seconds, f.memory_bound)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def _sections(self, top: int) -> list[tuple[str, list[str], list[list[str]]]]:
        """(title, header, rows) of every table, shared by the terminal, Markdown and HTML outputs."""
        t = self.totals()
        summary = [["ops / launches", f"{t['ops']} / {t['launches']}"],
                   ["HBM traffic", f"{_mb(t['bytes'])} MB"], ["FLOPs", f"{t['flops'] / 1e9:,.1f} G"],
                   ["roofline time", f"{t['roofline_ms']:.3f} ms ({t['memory_bound_ms']:.3f} ms memory-bound)"],
                   ["eager estimate (with launch overhead)", f"{t['eager_ms']:.3f} ms"],
                   ["fusing the chains below saves",
                    f"{_mb(t['saved_bytes'])} MB, {t['saved_launches']} launches, {t['saved_ms']:.3f} ms"]]
        chains = [[str(r["count"]), r["pattern"] + (" (bwd)" if r["phase"] == "backward" else ""), r["module"],
                   r["onepass_op"] or "-", f"{r['passes'][0]:.3g} -> {r['passes'][1]:.3g}",
                   _mb(r["saved_bytes"]), str(r["saved_launches"]), f"{r['saved_ms']:.3f}", r["verdict"]]
                  for r in self.grouped_chains()[:top]]
        flags: dict[tuple, list] = {}
        for fl in self.fusion.flags:
            key = (fl.kind, _pattern_of(fl.where))
            row = flags.setdefault(key, [fl.kind, _pattern_of(fl.where), 0, 0.0, fl.detail])
            row[2] += 1
            row[3] += fl.seconds * 1e3
        flag_rows = [[k, w, str(n), f"{ms:.3f}", d] for k, w, n, ms, d in
                     sorted(flags.values(), key=lambda r: -r[3])[:top]]
        layer_rows = [[r["region"], str(r["ops"]), str(r["launches"]), _mb(r["bytes"]), f"{r['flops'] / 1e9:,.2f}",
                       f"{r['roofline_ms']:.3f}", f"{r['memory_bound_ms']:.3f}", f"{r['fusion_saves_ms']:.3f}"]
                      for r in self.layers()]
        variant_rows = [[r["variant"], "-" if r["bytes"] is None else _mb(r["bytes"]), str(r["launches"]),
                         f"{r['ms']:.3f}", r["source"]] for r in self.variants()]
        sections = [
            ("Summary", ["", ""], summary),
            ("Fusion opportunities (ranked by time saved)",
             ["n", "chain", "where", "onepass op", "passes", "saves MB", "launches", "saves ms", "verdict"], chains),
            ("Design test: do not fuse / fuse something else",
             ["case", "where", "n", "ms", "why"], flag_rows),
            ("Variants", ["variant", "MB", "launches", "ms", "from"], variant_rows),
            ("Per layer", ["region", "ops", "launches", "MB", "GFLOP", "roofline ms", "memory-bound ms",
                           "fusion saves ms"], layer_rows),
        ]
        if self.measured:
            m = self.measured
            sections.insert(4, ("Measured on " + m.get("device", "GPU"), ["", ""],
                                [[k, str(v)] for k, v in m.items() if k not in ("variants", "regions", "device")]
                                + [[f"region {r['region']}", f"{r['kernel_ms']:.3f} ms, {r['gbps']:.0f} GB/s "
                                    f"({r['fraction_of_copy']:.0%} of copy)"] for r in m.get("regions", [])]))
        return sections

    def _heading(self) -> str:
        where = "meta tensors (no weights allocated)" if self.meta else "real tensors"
        return f"onepass analyze: {self.title} on {self.gpu.name} ({self.gpu.source} ceilings), {where}"

    def table(self, top: int = 12) -> str:
        """The terminal report: fixed-width tables."""
        lines = [self._heading(), ""]
        for title, header, rows in self._sections(top):
            lines.append(title)
            widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
            widths[-1] = min(widths[-1], 100)
            if any(header):
                lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
            for r in rows:
                lines.append("  ".join((c if len(c) <= 100 else c[:99] + "…").ljust(w)
                                       for c, w in zip(r, widths)).rstrip())
            lines.append("")
        lines += [c.describe(self.gpu.name) for c in self.fusion.chains[:3]]
        return "\n".join(lines)

    def to_markdown(self, roofline_file: Optional[str] = "roofline.svg", top: int = 20) -> str:
        out = [f"# {self._heading()}", ""]
        if roofline_file:
            out += [f"![roofline]({roofline_file})", ""]
        for title, header, rows in self._sections(top):
            out += [f"## {title}", ""]
            out.append("| " + " | ".join(h or " " for h in header) + " |")
            out.append("|" + "---|" * len(header))
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            out.append("")
        return "\n".join(out)

    def to_html(self, top: int = 30) -> str:
        body = [f"<h1>{html.escape(self._heading())}</h1>", self.roofline_svg()]
        for title, header, rows in self._sections(top):
            body.append(f"<h2>{html.escape(title)}</h2><table>")
            if any(header):
                body.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
            body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
            body.append("</table>")
        if self.trace_path:
            body.append(f"<p>Chrome trace: <code>{html.escape(self.trace_path)}</code> "
                        "(open in chrome://tracing or ui.perfetto.dev)</p>")
        style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1em}"
                 "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}")
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>onepass analyze</title>"
                f"<style>{style}</style></head><body>{''.join(body)}</body></html>")

    def roofline_svg(self, width: int = 640, height: int = 400) -> str:
        """Ops on the roofline of the GPU: x intensity, y attainable FLOP/s, area ~ estimated time."""
        g, f = self.gpu, self.fusion
        x0, x1, y0, y1 = -2.0, 4.0, 9.0, math.log10(g.bf16_tflops * 1e12) + 0.5
        pad = 50

        def px(i, p):
            x = pad + (math.log10(max(i, 10**x0)) - x0) / (x1 - x0) * (width - 2 * pad)
            y = height - pad - (math.log10(max(p, 10**y0)) - y0) / (y1 - y0) * (height - 2 * pad)
            return x, y

        parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
                 f"font-family='sans-serif' font-size='11'><rect width='100%' height='100%' fill='white'/>"]
        for peak, label in ((g.bf16_tflops, "bf16 tensor cores"), (g.fp32_tflops, "fp32")):
            ridge = peak * 1e12 / (g.hbm_gbps * 1e9)
            (ax, ay), (bx, by), (cx, cy) = px(10**x0, 10**x0 * g.hbm_gbps * 1e9), px(ridge, peak * 1e12), \
                px(10**x1, peak * 1e12)
            parts.append(f"<polyline fill='none' stroke='#444' points='{ax:.1f},{ay:.1f} {bx:.1f},{by:.1f} "
                         f"{cx:.1f},{cy:.1f}'/><text x='{cx - 90:.1f}' y='{cy - 4:.1f}'>{label}</text>")
        total = sum(f.seconds) or 1.0
        points: dict[tuple, float] = defaultdict(float)
        for op, s, mb in zip(self.ops, f.seconds, f.memory_bound):
            if op.bytes and s:
                points[(round(math.log10(max(op.flops / op.bytes, 1e-2)), 2), round(math.log10(op.flops / s + 1), 2),
                        mb)] += s
        for (li, lp, mb), s in points.items():
            x, y = px(10**li, 10**lp)
            r = 2 + 20 * math.sqrt(s / total)
            parts.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{r:.1f}' fill='{'#d62728' if mb else '#1f77b4'}' "
                         "fill-opacity='0.45'/>")
        for e in range(int(x0), int(x1) + 1):
            x, _ = px(10**e, 1)
            parts.append(f"<text x='{x:.1f}' y='{height - pad + 15}' text-anchor='middle'>1e{e}</text>")
        for e in range(int(math.ceil(y0)), int(y1) + 1):
            _, y = px(1, 10**e)
            parts.append(f"<text x='{pad - 5}' y='{y:.1f}' text-anchor='end'>1e{e}</text>")
        parts.append(f"<text x='{width / 2}' y='{height - 10}' text-anchor='middle'>arithmetic intensity "
                     f"(FLOP/byte); red: memory-bound, blue: compute-bound; area: estimated time</text>"
                     f"<text x='12' y='{height / 2}' transform='rotate(-90 12 {height / 2})' "
                     f"text-anchor='middle'>FLOP/s on {html.escape(g.name)}</text></svg>")
        return "".join(parts)

    def write(self, path: str) -> list[str]:
        """Write the report. A directory gets report.json, report.md, roofline.svg and report.html;
        a path ending in .json, .md or .html gets that one file. Returns the paths written."""
        ext = os.path.splitext(path)[1].lower()
        if ext in ONE_FILE_SUFFIXES:
            text = {".json": self.to_json, ".md": lambda: self.to_markdown(roofline_file=None),
                    ".html": self.to_html}[ext]()
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)
            return [path]
        os.makedirs(path, exist_ok=True)
        files = {"report.json": self.to_json(), "report.md": self.to_markdown(), "roofline.svg": self.roofline_svg(),
                 "report.html": self.to_html()}
        for name, text in files.items():
            with open(os.path.join(path, name), "w") as fh:
                fh.write(text)
        return [os.path.join(path, n) for n in files]

