"""The analysis as a terminal table, JSON, Markdown and a self-contained HTML page.

The roofline plot is inline SVG (``roofline.py``), so every report (HTML, or Markdown with
``roofline.svg`` beside it) needs nothing beyond the standard library. The terminal report
keeps within ``WIDTH`` columns: a cell too wide wraps onto the next lines, never cut.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import os
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from onepass.analyze.fusion import Fusion, pattern_of
from onepass.analyze.gpus import GPU
from onepass.analyze.roofline import roofline_svg

# report.json's layout; raised when a key changes meaning or goes (2: versions, notes, next_step)
SCHEMA_VERSION = 2
WIDTH = 120  # columns of the terminal report


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def versions() -> dict:
    """onepass, torch, triton and transformers versions (None: not installed)."""
    import onepass

    out = {"onepass": onepass.__version__, "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces; a longer word (a module
    path) is broken after a '.', '/', ',' or '_', and only where it has none, at the width."""
    lines = []
    for line in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]:
        while len(line) > width:
            cut = max(line.rfind(c, 0, width) for c in "./,_") + 1 or width
            lines.append(line[:cut])
            line = line[cut:]
        lines.append(line)
    return lines


def fit_table(header: list[str], rows: list[list[str]], limit: int = WIDTH) -> list[str]:
    """A fixed-width table of at most ``limit`` columns: the widest column gives way first (down
    to its header's width, or 10), and its cells wrap onto the next lines rather than being cut."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    floors = [max(len(h), 10) for h in header]
    while sum(widths) + 2 * (len(widths) - 1) > limit:
        shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()] if any(header) else []
    for r in rows:
        cells = [wrap(c, w) for c, w in zip(r, widths)]
        for k in range(max(map(len, cells))):
            lines.append("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
    return lines


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
    optimized: bool = False  # the model was optimized by onepass: recorded through onepass.reference_mode()
    device: str = "meta"  # where the step was recorded: meta, cpu, cuda

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
            key = (c.pattern, c.onepass_op, c.phase, pattern_of(c.module), c.verdict)
            row = rows.setdefault(key, {"pattern": c.pattern, "onepass_op": c.onepass_op, "phase": c.phase,
                                        "module": pattern_of(c.module), "verdict": c.verdict, "count": 0,
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

    # ------------------------------------------------------------------ words
    def notes(self) -> list[str]:
        """What a reader must know before reading the figures."""
        notes = []
        if self.optimized:
            where = {"meta": "meta tensors", "cpu": "the CPU", "cuda": "the GPU"}.get(self.device, self.device)
            notes.append(f"This model is optimized by onepass: the ops recorded (on {where}) are its PyTorch "
                         "reference path (onepass.reference_mode()), the unfused ops that its kernels replace, not "
                         "the kernels themselves. Analyze it before onepass.optimize, or after onepass.undo; a "
                         "measured run's profiled side shows its kernels.")
        if not self.measured:
            notes.append("Times are estimated from the roofline (no step was measured): each op takes "
                         f"max(bytes / bandwidth, FLOPs / peak) on {self.gpu.name}.")
        return notes

    def next_step(self) -> str:
        """The closing summary: what the report found, and what to do next."""
        t = self.totals()
        measure = "measure it on a CUDA GPU (onepass analyze --measure, or analyze(..., measure=True))"
        if self.optimized:
            return ("Next step: analyze the model before onepass.optimize (or after onepass.undo) to see what "
                    f"fusing saves, and {measure} to time its kernels against eager PyTorch and torch.compile.")
        variants = self.measured.get("variants", {})
        if "eager" in variants:
            eager = variants["eager"]["step_ms"]
            found = [f"eager {eager:.3g} ms a step ({eager / t['roofline_ms']:.2g}x its roofline time, "
                     f"{t['roofline_ms']:.3g} ms)"]
            found += [f"{name} {v['step_ms']:.3g} ms ({eager / v['step_ms']:.2f}x eager)"
                      for name, v in variants.items() if name != "eager"]
            idle = self.measured.get("idle_fraction", 0.0)
            if idle > 0.2:
                step = (f"the GPU sat idle {idle:.0%} of the eager step, waiting on the host: replay the step as "
                        "CUDA graphs (torch.compile(mode='reduce-overhead'), or onepass.Decoder for generation)")
            else:
                where = self.trace_path or "trace.json"
                step = f"open the Chrome trace ({where}) in ui.perfetto.dev to see which kernels take the time"
            return f"Measured: {', '.join(found)}. Next step: {step}."
        fuse = [c for c in self.fusion.chains if c.verdict == "fuse"]
        if not fuse:
            return (f"No chain of memory-bound ops to fuse was found. Next step: {measure} to see where the time "
                    "goes.")
        ops = sorted({c.onepass_op.removeprefix("onepass.ops.") for c in fuse if c.onepass_op})
        covered = sum(1 for c in fuse if c.onepass_op)
        rest = ", torch.compile fuses the rest" if covered < len(fuse) else ""
        text = (f"Fusing the {len(fuse)} chains found saves ~{t['saved_ms']:.3g} ms of the {t['eager_ms']:.3g} ms "
                f"eager estimate and {t['saved_launches']} launches; onepass has ops for {covered} of them "
                f"({', '.join(ops) or 'none'}){rest}. Next step: onepass.optimize(model) puts onepass's ops into a "
                "Hugging Face model of a supported family (onepass.optimize_report(model) says what it fused; in "
                f"code of your own, call the onepass.ops named above), then {measure} to see achieved against "
                "attainable time.")
        if any(fl.kind == "launch-bound" for fl in self.fusion.flags):
            text += " Regions flagged launch-bound gain more from CUDA graphs than from fusion."
        return text

    # ------------------------------------------------------------------ outputs
    def to_dict(self) -> dict:
        f = self.fusion
        return {
            "schema_version": SCHEMA_VERSION, "versions": versions(),
            "title": self.title, "mode": self.mode, "meta_tensors": self.meta, "recorded_on": self.device,
            "optimized_model": self.optimized, "times": "measured" if self.measured else "estimated",
            "notes": self.notes(), "next_step": self.next_step(), "gpu": self.gpu.to_dict(),
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
        chains = [[str(r["count"]), r["pattern"] + (" (bwd)" if r["phase"] == "backward" else "")
                   + ("" if r["verdict"] == "fuse" else f" ({r['verdict']})"), r["module"],
                   (r["onepass_op"] or "-").removeprefix("onepass.ops."),
                   f"{r['passes'][0]:.3g} -> {r['passes'][1]:.3g}",
                   _mb(r["saved_bytes"]), str(r["saved_launches"]), f"{r['saved_ms']:.3f}"]
                  for r in self.grouped_chains()[:top]]
        flags: dict[tuple, list] = {}
        for fl in self.fusion.flags:
            key = (fl.kind, pattern_of(fl.where))
            row = flags.setdefault(key, [fl.kind, pattern_of(fl.where), 0, 0.0, fl.detail])
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
             ["n", "chain", "where", "onepass.ops", "passes", "saves MB", "launches", "saves ms"], chains),
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

    def table(self, top: int = 12, width: int = WIDTH) -> str:
        """The terminal report: fixed-width tables within ``width`` columns, then the next step."""
        lines = wrap(self._heading(), width)
        for note in self.notes():
            lines += wrap(f"Note: {note}", width)
        lines.append("")
        for title, header, rows in self._sections(top):
            lines.append(title)
            lines += fit_table(header, rows, width)
            lines.append("")
        lines += ["Summary and next step"] + wrap(self.next_step(), width)
        return "\n".join(lines)

    def to_markdown(self, roofline_file: Optional[str] = "roofline.svg", top: int = 20) -> str:
        out = [f"# {self._heading()}", ""]
        out += [f"> {note}" for note in self.notes()] + ([""] if self.notes() else [])
        if roofline_file:
            out += [f"![roofline]({roofline_file})", ""]
        for title, header, rows in self._sections(top):
            out += [f"## {title}", ""]
            out.append("| " + " | ".join(h or " " for h in header) + " |")
            out.append("|" + "---|" * len(header))
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            out.append("")
        v = versions()
        out += ["## Next step", "", self.next_step(), "",
                "Versions: " + ", ".join(f"{k} {ver}" for k, ver in v.items() if ver)
                + f"; report schema {SCHEMA_VERSION}", ""]
        return "\n".join(out)

    def to_html(self, top: int = 30) -> str:
        body = [f"<h1>{html.escape(self._heading())}</h1>"]
        body += [f"<p class='note'>{html.escape(note)}</p>" for note in self.notes()]
        body.append(self.roofline_svg())
        for title, header, rows in self._sections(top):
            body.append(f"<h2>{html.escape(title)}</h2><table>")
            if any(header):
                body.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
            body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
            body.append("</table>")
        body.append(f"<h2>Next step</h2><p>{html.escape(self.next_step())}</p>")
        if self.trace_path:
            body.append(f"<p>Chrome trace: <code>{html.escape(self.trace_path)}</code> "
                        "(open in chrome://tracing or ui.perfetto.dev)</p>")
        style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1em}"
                 "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}"
                 ".note{background:#fff4e0;padding:4px 8px}")
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>onepass analyze</title>"
                f"<style>{style}</style></head><body>{''.join(body)}</body></html>")

    def roofline_svg(self, width: int = 720, height: int = 440) -> str:
        """The roofline plot (``roofline.roofline_svg``): estimated op positions, or, measured,
        achieved against attainable time, unfused and onepass side by side."""
        return roofline_svg(self, width, height)

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

