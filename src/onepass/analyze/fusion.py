"""The design test: which chains of ops should be one kernel, and what that would save.

Each recorded op is placed on the roofline of a GPU: intensity = FLOPs / bytes against
the ridge point (peak FLOP/s / HBM bandwidth); its time is max(bytes / bandwidth,
FLOPs / peak). Then:

- **fuse**: memory-bound ops (not matmuls) joined through intermediates that only the
  chain reads, never returned or read by anything outside it. A fused chain reads its
  outside inputs once and writes only what outlives it; the bytes and the launches
  between are saved. Several readers inside the chain are fine (a norm reads its input
  for the statistics and again to scale it: one kernel holds the row). The chain must be
  one kernel: no path may leave it and come back (through a matmul, say).
  In training, an intermediate read only by the backward is recomputed there from the
  chain's inputs, as onepass's ops do, so the forward chain need not store it.
- **reused intermediate**: an intermediate also read outside the chain (after a matmul,
  by a compute-bound op) is not fused across; it must be written anyway. The one
  exception is an op of onepass built to write it as a second output: the residual add
  before a norm (``add_rms_norm`` writes the stream ``h`` and the normalised ``y``).
- **across a matmul**: only where onepass has the op that tiles it: scores -> softmax ->
  @V (``attention``), and the LM head matmul -> cross-entropy (``linear_cross_entropy``).
- **too big for on-chip memory**: a chain that reduces rows longer than one SM's shared
  memory holds (in fp32) must read the row twice; that read is charged back, and a
  chain that then saves nothing is not proposed.
- **compute-bound**: ops above the ridge point gain nothing from fusion.
- **launch-bound**: a region whose kernels take less GPU time than eager PyTorch needs to
  launch them: CUDA graphs (``torch.compile(mode="reduce-overhead")``) help more.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from onepass.analyze.gpus import GPU
from onepass.analyze.record import Op, Trace

# Rows whose length is reduced in one pass (softmax, norms, cross-entropy): the input's last dim.
_ROW_REDUCTIONS = {"aten._softmax", "aten._safe_softmax", "aten._log_softmax", "aten.native_layer_norm",
                   "aten.mean", "aten.sum", "aten.amax", "aten.logsumexp", "aten.var_mean", "aten._fused_rms_norm"}
_MATMULS = {"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul"}


def pattern_of(module: str) -> str:
    """model.layers.3.mlp -> model.layers.*.mlp: one name for what every layer repeats."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", module)


def op_seconds(op: Op, gpu: GPU) -> float:
    matmul = op.kind in ("matmul", "attention")
    return max(op.bytes / (gpu.hbm_gbps * 1e9), op.flops / gpu.peak_flops(op.dtype, matmul))


def memory_bound(op: Op, gpu: GPU) -> bool:
    matmul = op.kind in ("matmul", "attention")
    return op.flops < gpu.ridge(op.dtype, matmul) * max(op.bytes, 1)


@dataclass
class Chain:
    """A group of ops that one kernel could do, with what it would save."""

    ops: list[int]
    names: list[str]
    pattern: str  # "residual add + RMSNorm", "elementwise chain", ...
    onepass_op: Optional[str]  # "onepass.ops.add_rms_norm"; None: no onepass op does it yet
    phase: str
    module: str
    source: str
    unfused_bytes: int
    fused_bytes: int
    unit_bytes: int  # one pass over the chain's largest tensor
    unfused_s: float
    fused_s: float
    launches: int
    verdict: str = "fuse"  # fuse | don't fuse
    notes: list[str] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return self.unfused_bytes - self.fused_bytes

    @property
    def saved_s(self) -> float:
        return self.unfused_s - self.fused_s

    @property
    def passes(self) -> tuple[float, float]:
        """(unfused, fused) traffic in passes over the chain's largest tensor."""
        unit = max(self.unit_bytes, 1)
        return self.unfused_bytes / unit, self.fused_bytes / unit

    def describe(self, gpu_name: str) -> str:
        before, after = self.passes
        use = f"use {self.onepass_op}" if self.onepass_op else "no onepass op yet (torch.compile fuses it)"
        where = f" at {self.module}" if self.module else ""
        phase = " (backward)" if self.phase == "backward" else ""
        return (f"{self.pattern}{phase}{where}: {use}; saves {before - after:.3g} of {before:.3g} tensor passes "
                f"and {self.launches - 1} launches, ~{self.saved_s * 1e3:.3g} ms on {gpu_name}")

    def to_dict(self, gpu_name: str) -> dict:
        return {"pattern": self.pattern, "onepass_op": self.onepass_op, "verdict": self.verdict,
                "phase": self.phase, "module": self.module, "source": self.source, "ops": self.ops,
                "op_names": self.names, "unfused_bytes": self.unfused_bytes, "fused_bytes": self.fused_bytes,
                "saved_bytes": self.saved_bytes, "passes": list(self.passes), "launches": self.launches,
                "saved_launches": self.launches - 1, "unfused_ms": self.unfused_s * 1e3,
                "fused_ms": self.fused_s * 1e3, "saved_ms": self.saved_s * 1e3, "notes": self.notes,
                "summary": self.describe(gpu_name)}


@dataclass
class Flag:
    """A case of the design test that is not "fuse": why, where, and how much time it covers."""

    kind: str  # compute-bound | reused intermediate | too big for on-chip memory | launch-bound
    where: str
    detail: str
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "detail": self.detail, "ms": self.seconds * 1e3}


def _pattern(names: set[str], has_residual_add: bool) -> tuple[str, Optional[str]]:
    n = {x.removeprefix("aten.") for x in names}
    if {"_log_softmax", "nll_loss_forward"} <= n or {"_log_softmax_backward_data", "nll_loss_backward"} <= n:
        return "cross-entropy", "cross_entropy"
    if n & {"_softmax", "_safe_softmax", "_softmax_backward_data"}:
        return "softmax", "softmax"
    if n & {"native_layer_norm", "native_layer_norm_backward"}:
        return ("residual add + LayerNorm", "add_layer_norm") if has_residual_add else ("LayerNorm", "layer_norm")
    rms_norm = {"pow", "mean", "rsqrt"} <= n or n & {"_fused_rms_norm", "_fused_rms_norm_backward"}
    rope = {"neg", "cat", "mul", "add"} <= n
    if rms_norm and rope:  # Qwen3's and Gemma 3's q/k norms, then RoPE: its last add is not a residual add
        return "RMSNorm + RoPE", None
    if rms_norm:
        return ("residual add + RMSNorm", "add_rms_norm") if has_residual_add else ("RMSNorm", "rms_norm")
    if rope:
        return "RoPE", "rope"
    if n & {"silu", "silu_backward"}:
        return "SwiGLU", "swiglu"
    if n & {"gelu", "gelu_backward"} and "mul" in n:
        return "GEGLU", "geglu"
    if n & {"gelu", "gelu_backward"} or {"tanh", "pow"} <= n:
        return "bias + GELU", "bias_gelu"
    return "elementwise chain", None


def _is_residual_add(op: Op) -> bool:
    """An add of two tensors of the output's size (not a bias, not ``variance + eps``)."""
    return (op.name == "aten.add" and len(op.inputs) == 2 and len(op.outputs) == 1
            and all(u.nbytes == op.outputs[0].nbytes for u in op.inputs))


class Fusion:
    """Groups a trace's ops into chains and flags, for one GPU."""

    def __init__(self, trace: Trace, gpu: GPU):
        self.trace, self.gpu, self.ops = trace, gpu, trace.ops
        n = len(self.ops)
        self.seconds = [op_seconds(op, gpu) for op in self.ops]
        self.memory_bound = [memory_bound(op, gpu) for op in self.ops]
        self.fusible = [mb and op.kind not in ("matmul", "attention") for op, mb in zip(self.ops, self.memory_bound)]
        self.consumers: dict[tuple, list[int]] = defaultdict(list)
        self.succ: list[set[int]] = [set() for _ in range(n)]
        for op in self.ops:
            for u in op.inputs:
                if u.producer is not None:
                    if op.index not in self.consumers[u.key]:
                        self.consumers[u.key].append(op.index)
                    self.succ[u.producer].add(op.index)
        self.group = list(range(n))
        self.members: dict[int, list[int]] = {i: [i] for i in range(n)}
        self.flags: list[Flag] = []
        self._reused: dict[tuple, Flag] = {}
        self._group()
        self.chains = self._chains()
        self._flag_compute_bound()
        self._flag_launch_bound()

    # ------------------------------------------------------------------ grouping
    def _convex(self, members: set[int]) -> bool:
        """No path leaves ``members`` and comes back (ops are in topological order)."""
        hi = max(members)
        todo = [s for m in members for s in self.succ[m] if s not in members and s < hi]
        seen: set[int] = set()
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            for s in self.succ[x]:
                if s in members:
                    return False
                if s < hi:
                    todo.append(s)
        return True

    def _merge(self, groups: set[int]) -> None:
        root = min(groups)
        for g in groups - {root}:
            for m in self.members.pop(g):
                self.group[m] = root
                self.members[root].append(m)
        self.members[root].sort()

    def _readers(self, key: tuple, phase: str) -> list[int]:
        return [c for c in self.consumers.get(key, []) if self.ops[c].phase == phase]

    def _group(self) -> None:
        # Latest producer first: when an op is reached, every chain below it is already
        # grown, so a diamond (a norm reading its input twice) closes into one group.
        for p in reversed(self.ops):
            if not self.fusible[p.index]:
                continue
            for out in p.outputs:
                key = (p.index, out.storage)
                readers = self._readers(key, p.phase)
                if not readers or key in self.trace.escaping:
                    continue
                groups = {self.group[p.index]} | {self.group[c] for c in readers}
                candidate = {m for g in groups for m in self.members[g]}
                if all(self.fusible[c] for c in readers) and self._convex(candidate):
                    self._merge(groups)
                elif len(readers) > 1 and any(self.fusible[c] for c in readers):
                    self._note_reuse(p, readers)

    def _note_reuse(self, p: Op, readers: list[int]) -> None:
        where = f"{p.module or '(top)'}: {p.name}"
        flag = self._reused.get((p.module, p.name, p.phase))
        if flag is None:
            others = sorted({self.ops[c].name for c in readers})
            flag = Flag("reused intermediate", where,
                        f"output of {p.name} ({p.source}) is read by {len(readers)} ops ({', '.join(others)}) "
                        "that cannot be one kernel: it is written once and not fused across")
            self._reused[(p.module, p.name, p.phase)] = flag
            self.flags.append(flag)
        flag.seconds += self.seconds[p.index]

    # ------------------------------------------------------------------ costing
    def _written(self, key: tuple, members: set[int], phase: str) -> bool:
        return key in self.trace.escaping or any(c not in members for c in self._readers(key, phase))

    def _chain(self, members: list[int], pattern: tuple[str, Optional[str]]) -> Chain:
        ms = set(members)
        ops = [self.ops[i] for i in members]
        reads: dict[tuple, int] = {}
        for op in ops:
            for u in op.inputs:
                if u.producer not in ms:
                    reads[u.key] = max(reads.get(u.key, 0), u.nbytes)
        writes = [u.nbytes for op in ops for u in op.outputs if self._written((op.index, u.storage), ms, op.phase)]
        fused = sum(reads.values()) + sum(writes)
        unit = max(list(reads.values()) + writes + [0])
        notes = []
        rows = [op.inputs[0].shape[-1] for op in ops
                if op.name in _ROW_REDUCTIONS and op.inputs and op.inputs[0].shape]
        if rows and max(rows) * 4 > self.gpu.onchip_bytes:
            fused += max(reads.values(), default=0)
            notes.append(f"rows of {max(rows)} elements exceed {self.gpu.smem_kb:g} KB of shared memory in fp32: "
                         "the fused kernel reads its input twice")
        flops_s = sum(op.flops / self.gpu.peak_flops(op.dtype, op.kind in ("matmul", "attention")) for op in ops)
        fused_s = max(fused / (self.gpu.hbm_gbps * 1e9), flops_s)
        unfused = sum(op.bytes for op in ops)
        chain = Chain(members, [op.name for op in ops], pattern[0],
                      f"onepass.ops.{pattern[1]}" if pattern[1] else None, ops[0].phase, ops[-1].module,
                      ops[0].source, unfused, fused, unit, sum(self.seconds[i] for i in members), fused_s,
                      sum(op.launches for op in ops), notes=notes)
        if chain.saved_bytes <= 0:
            chain.verdict = "don't fuse"
            if notes:
                self.flags.append(Flag("too big for on-chip memory", chain.module or "(top)",
                                       f"{chain.pattern}: {notes[0]}; fusing saves nothing", chain.unfused_s))
        if flops_s * self.gpu.hbm_gbps * 1e9 > fused:
            chain.notes.append("compute-bound once fused: the saving is capped by the FLOPs")
        return chain

    # ------------------------------------------------------------------ patterns
    def _chains(self) -> list[Chain]:
        groups = {g: m for g, m in self.members.items() if self.fusible[m[0]]}
        patterns = {}
        for g, m in groups.items():
            names = {self.ops[i].name for i in m}
            patterns[g] = _pattern(names, any(_is_residual_add(self.ops[i]) for i in m))
        self._absorb_residual_adds(groups, patterns)
        # A backward chain with no name of its own takes its module's forward pattern.
        forward_names = {self.ops[i].module: patterns[g] for g, m in groups.items() for i in m
                         if self.ops[i].phase == "forward" and patterns[g][1]}
        chains = []
        used: set[int] = set()
        for g, m in sorted(groups.items()):
            pattern = patterns[g]
            if pattern[1] is None and self.ops[m[0]].phase == "backward":
                pattern = next((forward_names[self.ops[i].module] for i in m
                                if self.ops[i].module in forward_names), pattern)
            members = self._across_matmul(m, pattern)
            if members is not None:
                pattern = ("scores -> softmax -> @V", "attention") if pattern[1] == "softmax" else \
                    ("LM head + cross-entropy", "linear_cross_entropy")
            if len(members or m) < 2 or used & set(members or m):
                continue
            used |= set(members or m)
            chains.append(self._chain(members or m, pattern))
        chains.sort(key=lambda c: -c.saved_s)
        return chains

    def _absorb_residual_adds(self, groups: dict, patterns: dict) -> None:
        """Residual add + norm: the add's output is read again later, and the fused op writes it."""
        for g in sorted(groups):
            if g not in groups or patterns[g][1] not in ("rms_norm", "layer_norm"):
                continue
            ms = set(groups[g])
            for i in groups[g]:
                for u in self.ops[i].inputs:
                    p = u.producer
                    if p is None or p in ms or not _is_residual_add(self.ops[p]) or self.group[p] not in groups:
                        continue
                    pg = self.group[p]
                    if not self._convex(ms | set(self.members[pg])):
                        continue
                    label, name = patterns[g]
                    self._merge({g, pg})
                    for k in (g, pg):
                        groups.pop(k, None)
                        patterns.pop(k, None)
                    root = self.group[p]
                    groups[root], patterns[root] = self.members[root], (f"residual add + {label}", f"add_{name}")
                    self._reused.pop((self.ops[p].module, self.ops[p].name, self.ops[p].phase), None)
                    break
                else:
                    continue
                break
        kept = {id(f) for f in self._reused.values()}
        self.flags = [f for f in self.flags if f.kind != "reused intermediate" or id(f) in kept]

    def _across_matmul(self, members: list[int], pattern: tuple) -> Optional[list[int]]:
        """The matmul(s) around a softmax (attention) or before a cross-entropy, when only the chain reads them."""
        if pattern[1] not in ("softmax", "cross_entropy") or self.ops[members[0]].phase != "forward":
            return None
        ms = set(members)
        before = {u.producer for i in members for u in self.ops[i].inputs
                  if u.producer is not None and u.producer not in ms and self.ops[u.producer].name in _MATMULS}
        before = [p for p in before
                  if all(c in ms for o in self.ops[p].outputs for c in self._readers((p, o.storage), "forward"))
                  and not any((p, o.storage) in self.trace.escaping for o in self.ops[p].outputs)]
        if len(before) != 1:
            return None
        if pattern[1] == "cross_entropy":
            return sorted(ms | set(before))
        after = {c for i in members for o in self.ops[i].outputs
                 if self._written((i, o.storage), ms, "forward") for c in self._readers((i, o.storage), "forward")}
        if len(after) != 1 or self.ops[next(iter(after))].name not in _MATMULS:
            return None
        return sorted(ms | set(before) | after)

    # ------------------------------------------------------------------ flags
    def _flag_compute_bound(self) -> None:
        by_module: dict[str, list[int]] = defaultdict(list)
        for op, mb in zip(self.ops, self.memory_bound):
            if not mb:
                by_module[op.module.split(".")[-1] or "(top)"].append(op.index)
        for name, idx in sorted(by_module.items(), key=lambda kv: -sum(self.seconds[i] for i in kv[1])):
            kinds = sorted({self.ops[i].name for i in idx})
            self.flags.append(Flag("compute-bound", name,
                                   f"{len(idx)} ops ({', '.join(kinds)}) above the ridge point: fusion cannot help",
                                   sum(self.seconds[i] for i in idx)))

    def region(self, op: Op) -> str:
        """The layer an op belongs to ("model.layers.3"), or its top-level module."""
        prefix = self.trace.layer_prefix
        if prefix and op.module.startswith(prefix):
            return prefix + op.module[len(prefix):].split(".")[0]
        return op.module.split(".")[0] if op.module else "(top)"

    def regions(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = defaultdict(list)
        for op in self.ops:
            out[self.region(op)].append(op.index)
        return dict(out)

    def _flag_launch_bound(self) -> None:
        launch_s = self.gpu.launch_us * 1e-6
        for name, idx in self.regions().items():
            gpu_s = sum(self.seconds[i] for i in idx)
            launches = sum(self.ops[i].launches for i in idx)
            if launches * launch_s > gpu_s:
                self.flags.append(Flag("launch-bound", name,
                                       f"{launches} launches need ~{launches * launch_s * 1e3:.3g} ms of eager "
                                       f"overhead for ~{gpu_s * 1e3:.3g} ms of GPU work: CUDA graphs "
                                       "(torch.compile mode='reduce-overhead') help more than fusion", gpu_s))
