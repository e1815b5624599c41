"""Attention: training/prefill (fwd, fwd+bwd) and split-KV decode, bf16, head dim 128 (the named models: theirs).

Prefill: 16384 tokens per batch (B = 16384 / S), 32 heads, S = 1024, 4096, 16384, full and
causal, against SDPA's flash (FlashAttention-2) and cuDNN backends and compiled
FlexAttention; the HF eager version (scores in HBM) only at S = 1024, where it fits.
FLOPs: 4 * B * H * S^2 * D forward (half of it causal), 3.5x that forward + backward.

Also Llama-3.2-1B's training attention: B4 S2048, 32 q / 8 kv heads of 64, causal
(grouped-query: SDPA with enable_gqa), the shape ``onepass bench train`` runs.

And the masks cuDNN's and FlashAttention-2's SDPA backends cannot take (issue 32): a causal sliding window
(Mistral's 4096 keys, head dim 128) and Gemma 2's (window 4096 with its logit softcap 50, head dim 256), against
compiled FlexAttention (a block mask, the softcap as its score_mod) and SDPA given the window as a boolean mask
(which PyTorch runs on its memory-efficient or math backend); the softcap only onepass and Flex compute.
FLOPs: 4 * B * H * D * (the keys each query sees, summed).

Decode: one new token, 32 q heads / 8 kv heads, caches of 4k, 32k, 128k positions (all
valid), batch 1 and 8, against SDPA (enable_gqa) and the HF-style eager loop; and a ragged
batch (8 caches of 16k positions, valid lengths 1 to 16k), SDPA with the padding masked.
Bytes: one read of the K and V caches' valid positions, so "% copy" is the fraction of the
copy bandwidth reached.
Each decode shape is timed twice: called from Python ("fwd", host launch cost included),
and as a generation loop runs it ("fwd, CUDA graph"): one graph replaying the decode
attention of enough layers, each with its own cache, that their caches together exceed
256 MiB (no layer's cache is still in L2 when it is read again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass import ops, reference
from onepass.bench.case import Case, fwd, fwd_bwd, variants
from onepass.ops.dispatch import cdiv

DTYPE = torch.bfloat16
TOKENS, HEADS, HEAD_DIM = 16384, 32, 128
SEQ_LENS = (1024, 4096, 16384)
EAGER_MAX_SEQ = 1024  # the eager version writes B*H*S^2 fp32 scores (and more for backward)
DECODE_BATCHES, DECODE_CACHE_LENS, DECODE_Q_HEADS, DECODE_KV_HEADS = (1, 8), (4096, 32768, 131072), 32, 8
DECODE_GRAPH_BYTES = 256 * 2**20  # the caches of one graph-replayed decode step, at least
DECODE_RAGGED = (8, 16384)  # batch, cache: lengths evenly spaced from 1 to the cache (issue 32's ragged batch)


LLAMA_1B = {"batch": 4, "seq_len": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64}  # grouped-query, causal
WINDOWED = {  # causal, grouped-query
    "Mistral": {"batch": 1, "seq_len": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "window": 4096,
                "softcap": None},
    "Gemma 2": {"batch": 2, "seq_len": 8192, "heads": 8, "kv_heads": 4, "head_dim": 256, "window": 4096,
                "softcap": 50.0},
}


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex(seq_len, visible=None, score_mod=None):
    """Compiled FlexAttention over the keys ``visible`` (a mask_mod; None: all) with ``score_mod``; called as
    (q, k, v, ...), grouped-query heads where k has fewer."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compile per case: twelve cases through one compiled function pass dynamo's
    # recompile limit (8), after which flex_attention silently runs unfused: far slower, with
    # the [S, S] scores in memory (the run that showed it is in CHANGELOG.md).
    torch._dynamo.reset()
    block_mask = None if visible is None else create_block_mask(visible, None, None, seq_len, seq_len, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v, *_: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                        enable_gqa=k.shape[1] != q.shape[1])


def _inputs(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, grad: bool):
    """Random q [B, heads, S, D] and k, v [B, kv_heads, S, D] on the GPU."""
    q = torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=DTYPE, requires_grad=grad)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, device="cuda", dtype=DTYPE, requires_grad=grad)
            for _ in range(2))
    return q, k, v


def _make_prefill(seq_len: int, causal: bool, mode: str, batch: int | None = None, heads: int = HEADS,
                  kv_heads: int = HEADS, head_dim: int = HEAD_DIM):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd
    batch = batch or TOKENS // seq_len

    def make():
        from torch.nn.attention import SDPBackend

        q, k, v = _inputs(batch, heads, kv_heads, seq_len, head_dim, grad)
        grouped = kv_heads != heads
        eager = step(reference.attention, q, k, v, causal) if seq_len <= EAGER_MAX_SEQ and not grouped else None
        return variants(**{
            "onepass": step(ops.attention, q, k, v, causal),
            "sdpa-flash": step(_sdpa(SDPBackend.FLASH_ATTENTION), q, k, v, causal),
            "sdpa-cudnn": step(_sdpa(SDPBackend.CUDNN_ATTENTION), q, k, v, causal),
            "flex (compiled)": None if grouped else step(_flex(seq_len, _causal if causal else None), q, k, v, causal),
            "eager": eager,
        })

    return make


def _make_windowed(mode: str, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, window: int,
                   softcap: float | None):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        q, k, v = _inputs(batch, heads, kv_heads, seq_len, head_dim, grad)

        def visible(b, h, q_idx, kv_idx):  # the query and the window - 1 keys before it
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

        def capped(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

        positions = torch.arange(seq_len, device="cuda")
        mask = visible(None, None, positions[:, None], positions[None, :])
        return variants(**{
            "onepass": step(lambda *t: ops.attention(*t, causal=True, window=window, softcap=softcap), q, k, v),
            "flex (compiled)": step(_flex(seq_len, visible, capped if softcap else None), q, k, v),
            "sdpa (boolean mask)": None if softcap else step(
                lambda *t: F.scaled_dot_product_attention(*t, attn_mask=mask, enable_gqa=True), q, k, v),
        })

    return make


def decode_lengths(batch: int, cache_len: int, ragged: bool = False) -> torch.Tensor:
    """Valid lengths: the whole cache, or (ragged) evenly spaced from 1 to it."""
    lengths = torch.linspace(1, cache_len, batch).round() if ragged else torch.full((batch,), cache_len)
    return lengths.to(torch.int32)


def decode_kv_bytes(batch: int, cache_len: int, ragged: bool = False) -> int:
    """One layer's K and V caches (ragged: their valid positions), in bytes."""
    return 2 * DECODE_KV_HEADS * int(decode_lengths(batch, cache_len, ragged).sum()) * HEAD_DIM * DTYPE.itemsize


def decode_graph_layers(batch: int, cache_len: int, ragged: bool = False) -> int:
    """Layers a graph-replayed decode step runs: enough that the caches they read exceed DECODE_GRAPH_BYTES."""
    return cdiv(DECODE_GRAPH_BYTES, decode_kv_bytes(batch, cache_len, ragged))


def decode_inputs(batch: int, cache_len: int, layers: int, ragged: bool = False):
    """(q, [(k_cache, v_cache)] a layer, cache_seqlens) of a decode step."""
    q = torch.randn(batch, DECODE_Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
    caches = [[torch.randn(batch, DECODE_KV_HEADS, cache_len, HEAD_DIM, device="cuda", dtype=DTYPE)
               for _ in range(2)] for _ in range(layers)]
    return q, caches, decode_lengths(batch, cache_len, ragged).cuda()


def _make_decode(batch: int, cache_len: int, layers: int = 1, graph: bool = False, ragged: bool = False):
    def make():
        q, caches, seqlens = decode_inputs(batch, cache_len, layers, ragged)
        # SDPA reads the whole cache; a ragged batch's padding masked out
        mask = (torch.arange(cache_len, device="cuda") < seqlens[:, None])[:, None, None] if ragged else None

        def each_layer(fn, *args, **kwargs):
            return lambda: [fn(q, k, v, *args, **kwargs) for k, v in caches]

        return variants(**{
            "onepass": each_layer(ops.decode_attention, seqlens),
            "sdpa (enable_gqa)": each_layer(F.scaled_dot_product_attention, attn_mask=mask, enable_gqa=True),
            "eager": None if graph else each_layer(reference.decode_attention, seqlens),
        })

    return make


def cases() -> list[Case]:
    out = []
    for seq_len in SEQ_LENS:
        batch = TOKENS // seq_len
        for causal in (False, True):
            flops = 4 * batch * HEADS * seq_len * seq_len * HEAD_DIM // (2 if causal else 1)
            shape = f"B{batch} H{HEADS} S{seq_len} D{HEAD_DIM} {'causal' if causal else 'full'} bf16"
            for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                out.append(Case("attention", mode, shape, _make_prefill(seq_len, causal, mode),
                                flops=int(flops * mult), measure_memory=True))
    llama = LLAMA_1B
    flops = 4 * llama["batch"] * llama["heads"] * llama["seq_len"] ** 2 * llama["head_dim"] // 2
    shape = (f"B{llama['batch']} H{llama['heads']}/{llama['kv_heads']} S{llama['seq_len']} D{llama['head_dim']} "
             "causal bf16 (Llama-3.2-1B)")
    for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        out.append(Case("attention", mode, shape, _make_prefill(causal=True, mode=mode, **llama),
                        flops=int(flops * mult), measure_memory=True))
    for name, case in WINDOWED.items():
        seq_len, window = case["seq_len"], case["window"]
        seen = window * (window + 1) // 2 + (seq_len - window) * window  # keys each query sees, summed
        flops = 4 * case["batch"] * case["heads"] * seen * case["head_dim"]
        shape = (f"B{case['batch']} H{case['heads']}/{case['kv_heads']} S{seq_len} D{case['head_dim']} causal, window "
                 f"{window}" + (f", softcap {case['softcap']:g}" if case["softcap"] else "") + f" bf16 ({name})")
        for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            out.append(Case("attention", mode, shape, _make_windowed(mode, **case), flops=int(flops * mult),
                            measure_memory=True))
    for batch in DECODE_BATCHES:
        for cache_len in DECODE_CACHE_LENS:
            kv_bytes = decode_kv_bytes(batch, cache_len)
            flops = 4 * batch * DECODE_Q_HEADS * cache_len * HEAD_DIM
            shape = f"B{batch} Hq{DECODE_Q_HEADS} Hk{DECODE_KV_HEADS} L{cache_len} D{HEAD_DIM} bf16"
            out.append(Case("decode_attention", "fwd", shape, _make_decode(batch, cache_len), bytes=kv_bytes,
                            flops=flops))
            layers = decode_graph_layers(batch, cache_len)
            out.append(Case("decode_attention", "fwd, CUDA graph", f"{shape}, {layers} layer(s)",
                            _make_decode(batch, cache_len, layers, graph=True), bytes=layers * kv_bytes,
                            flops=layers * flops, cuda_graph=True))
    batch, cache_len = DECODE_RAGGED
    kv_bytes, layers = decode_kv_bytes(batch, cache_len, True), decode_graph_layers(batch, cache_len, True)
    positions = int(decode_lengths(batch, cache_len, True).sum())
    shape = (f"B{batch} Hq{DECODE_Q_HEADS} Hk{DECODE_KV_HEADS} L{cache_len} D{HEAD_DIM} bf16 ragged (lengths 1 to "
             f"{cache_len}), {layers} layer(s)")
    out.append(Case("decode_attention", "fwd, CUDA graph", shape, _make_decode(batch, cache_len, layers, True, True),
                    bytes=layers * kv_bytes, flops=layers * 4 * DECODE_Q_HEADS * positions * HEAD_DIM, cuda_graph=True))
    return out
