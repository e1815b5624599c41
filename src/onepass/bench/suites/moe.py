"""The experts of a mixture-of-experts layer, routing given: 8192 tokens, bf16.

Mixtral-8x7B (hidden 4096, 8 experts, top-2, intermediate 14336) and Qwen3-30B-A3B (hidden
2048, 128 experts, top-8, expert intermediate 768). The routing is a softmax router's top-k
over random logits (fixed seed), its weights renormalized and taking gradients (the router
learns through them), as are the hidden states and both expert weights.

Peers: transformers' experts module built from the model's config (MixtralExperts,
Qwen3MoeExperts) with experts_implementation "eager" (a Python loop over the experts hit),
torch.compile of it, transformers' "grouped_mm" implementation (torch's grouped GEMM, where
this torch has it) and torch.compile of that, and Liger-Kernel's fused MoE
(LigerFusedMoEFunction) when importable. FLOPs: the three projections' GEMMs, 2 T K H 3I
forward, three times that forward and backward. Peak memory is measured for the backward
cases (the activations each implementation keeps).
"""

from __future__ import annotations

import torch

from onepass import ops
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants

TOKENS, DTYPE, SEED = 8192, torch.bfloat16, 0
MODELS = {  # name: (hidden, experts, top_k, intermediate)
    "Mixtral-8x7B": (4096, 8, 2, 14336),
    "Qwen3-30B-A3B": (2048, 128, 8, 768),
}


def _experts_module(name: str, implementation: str):
    """transformers' experts module of ``name`` built on meta (its weights are set by the caller), or None
    when this transformers lacks it."""
    hidden, n_experts, top_k, inter = MODELS[name]
    try:
        if name.startswith("Mixtral"):
            from transformers.models.mixtral.configuration_mixtral import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts
            config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=n_experts,
                                   num_experts_per_tok=top_k, experts_implementation=implementation)
        else:
            from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
            config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=n_experts,
                                    num_experts_per_tok=top_k, experts_implementation=implementation)
    except (ImportError, TypeError, ValueError):
        return None
    with torch.device("meta"):
        return Experts(config)


def _routing(n_experts: int, top_k: int):
    """A softmax router's top-k over random logits, its weights renormalized (Mixtral's router)."""
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    logits = torch.randn(TOKENS, n_experts, device="cuda", generator=generator)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(DTYPE)


def _make(name: str, mode: str):
    hidden, n_experts, top_k, inter = MODELS[name]
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        torch.manual_seed(SEED)
        x = torch.randn(TOKENS, hidden, device="cuda", dtype=DTYPE, requires_grad=grad)
        index, weights = _routing(n_experts, top_k)
        weights.requires_grad_(grad)
        gate_up = (torch.randn(n_experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(DTYPE)
        down = (torch.randn(n_experts, hidden, inter, device="cuda") / inter**0.5).to(DTYPE)
        gate_up.requires_grad_(grad)
        down.requires_grad_(grad)

        def module(implementation, compile_it=False):
            built = _experts_module(name, implementation)
            if built is None:
                return None
            built.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=grad)
            built.down_proj = torch.nn.Parameter(down, requires_grad=grad)
            call = compiled(built) if compile_it else built
            # the shared weights passed along so that the step drops their gradients too
            return step(lambda x, w, *_: call(x, index, w), x, weights, built.gate_up_proj, built.down_proj)

        fused = liger("liger_kernel.ops", "LigerFusedMoEFunction")
        index32 = index.to(torch.int32)
        has_grouped_mm = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
        return variants(
            onepass=step(ops.moe_experts, x, index, weights, gate_up, down),
            eager=module("eager"),
            torch_compile=module("eager", compile_it=True),
            grouped_mm=module("grouped_mm") if has_grouped_mm else None,
            grouped_mm_compile=module("grouped_mm", compile_it=True) if has_grouped_mm else None,
            liger=(step(lambda x, w, gu, dn: fused.apply(x, gu, dn, index32, w), x, weights, gate_up, down)
                   if fused is not None else None),
        )

    return make


def _flops(name: str, mode: str) -> int:
    hidden, _, top_k, inter = MODELS[name]
    forward = 2 * TOKENS * top_k * hidden * 3 * inter
    return forward if mode == "fwd" else 3 * forward


def cases() -> list[Case]:
    out = []
    for name, (hidden, n_experts, top_k, inter) in MODELS.items():
        shape = f"{name} {TOKENS}x{hidden} E{n_experts} top{top_k} I{inter} bf16"
        for mode in ("fwd", "fwd+bwd"):
            out.append(Case("moe_experts", mode, shape, _make(name, mode), flops=_flops(name, mode),
                            measure_memory=mode == "fwd+bwd"))
    return out
