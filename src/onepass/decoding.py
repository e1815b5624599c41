"""Generation with a static KV cache, each decode step replayed as one CUDA graph.

At small batch a decode step is a few hundred kernels of a few microseconds each. Launched
one by one from Python, the GPU waits on the host between them; captured once as a CUDA
graph and replayed, the step costs one launch and its kernels run back to back, so a step
approaches the time of reading the weights once (see ``onepass bench generate``).

    decoder = onepass.Decoder(model, batch_size=1, max_len=1024)
    tokens = decoder.generate(input_ids, max_new_tokens=256)   # [batch, prompt + new]
    tokens = onepass.generate(model, input_ids, max_new_tokens=256)   # one-off

How:
- The KV cache is transformers' ``StaticCache``: fixed addresses, and the filled length
  kept in a device tensor, so one captured step serves every position. The Decoder
  allocates it once; each call resets it. Its sliding-window layers (Gemma 2/3, Mistral with
  ``sliding_window``) are full-length layers too, indexed by position: transformers' own
  keep the last window of keys and decide where a token goes on a host integer, which a
  graph would replay frozen at its capture. Marked sliding, they get transformers' sliding
  masks, over all ``max_len`` positions; onepass attention applies the window itself. The
  cost is memory: such a layer holds ``max_len`` keys and values, not the window's.
- The prompt runs as one forward (prefill), outside the graph.
- A decode step (the model on the last token, then the next token picked, the finished
  flags and the positions advanced) reads and writes only the Decoder's own buffers, so
  its graph replays with no host work but the launch. Sampling draws by the Gumbel-max
  trick (the argmax of p / E with E ~ Exp(1) is distributed as p), graph-safe.
- The first ``WARMUP_STEPS`` steps of the first call run eagerly (Triton compiles, cuBLAS
  picks its kernels), then the step is captured; later calls replay the same graph, unless
  the model's tensors moved since (``load_state_dict(..., assign=True)``, ``model.to(dtype)``):
  then the call starts a new cache and captures the step again.
- A row is finished once it has produced an end-of-sequence token; its later tokens are
  the pad token. The host reads the flags every ``CHECK_EVERY`` steps (one sync), so up to
  that many steps may run after the last row ends; the result is cut where it ended, as
  Hugging Face's ``generate`` returns it.

It takes any transformers (v5) causal LM, optimized by onepass or not; greedy decoding
gives the tokens of ``model.generate(do_sample=False)``. The graph needs a step whose work
is decided on the GPU: a model whose cache layers still keep a window of keys (chunked
attention: Llama 4; linear-attention hybrids) decides on host integers and decodes eagerly
(same tokens, no graph; ``Decoder.graph_off`` says why). The model's mode is the caller's:
call ``model.eval()`` first, as for ``generate`` (dropout would run otherwise).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import Tensor, nn

from onepass import DISTRIBUTION
from onepass.models.attention import masks_unread
from onepass.models.cache import DECODE_LENGTHS, cache_keyword
from onepass.models.patches import FUSED
from onepass.ops.dispatch import is_int, is_number
from onepass.ops.next_token import record_next_token

WARMUP_STEPS = 2  # eager steps before the first capture
CHECK_EVERY = 16  # decode steps between reads of the finished flags (each read is a host sync)


def _check_request(input_ids: Tensor, max_new_tokens: int) -> None:
    """What any generation call needs: integer prompts [batch, length >= 1], new tokens >= 1."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise TypeError("input_ids must be an integer tensor [batch, prompt length], got "
                        + (f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
                           if isinstance(input_ids, Tensor) else type(input_ids).__name__))
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids must hold at least one prompt token a row")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def _as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


class Decoder:
    """A static KV cache for ``batch_size`` sequences of up to ``max_len`` tokens (prompt and
    generated), the decoding settings, and the captured decode step.

    ``do_sample=False`` decodes greedily; otherwise tokens are drawn from the softmax of the
    logits over ``temperature``, kept to the ``top_k`` likeliest and to the smallest set whose
    probability reaches ``top_p``. ``eos_token_id`` (an id or a list) and ``pad_token_id``
    default to the model's ``generation_config``. ``cuda_graph`` defaults to True on a GPU
    where the step can be captured (``graph_off`` says why not: also set, with a warning, when
    the capture fails, e.g. a model whose forward copies a CPU tensor); True where it cannot raises.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 cuda_graph: bool | None = None) -> None:
        try:
            import transformers  # noqa: F401  (the cache is transformers')
        except ImportError as e:
            raise ImportError(f"onepass.generate needs transformers (pip install '{DISTRIBUTION}[hf]')") from e
        config = getattr(model, "config", None)
        if config is None or getattr(model, "get_output_embeddings", lambda: None)() is None:
            raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not is_int(max_len) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2 (prompt and new tokens), got {max_len!r}")
        if not (is_number(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if top_k is not None and (not is_int(top_k) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if not (is_number(top_p) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        device = next(model.parameters()).device
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
        self.model, self.batch_size, self.max_len = model, batch_size, max_len
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        head = model.get_output_embeddings()
        vocab = head.weight.shape[0] if hasattr(head, "weight") else math.inf
        outside = [i for i in (*_as_list(eos_token_id), *_as_list(pad_token_id)) if not 0 <= i < vocab]
        if outside:  # (a pad token outside the vocabulary is fed to the embedding once a row ends)
            raise ValueError(f"eos_token_id and pad_token_id must be token ids in [0, {vocab}), got {outside}")
        generation = getattr(model, "generation_config", None)
        eos = _as_list(eos_token_id if eos_token_id is not None else getattr(generation, "eos_token_id", None))
        pad = pad_token_id if pad_token_id is not None else getattr(generation, "pad_token_id", None)
        pad = pad if pad is not None else (eos[0] if eos else 0)
        self.eos_token_ids, self.pad_token_id = eos, int(pad)
        self._start_over()
        from transformers.cache_utils import StaticSlidingWindowLayer

        host_decided = any(isinstance(layer, StaticSlidingWindowLayer) for layer in self.cache.layers)
        self.graph_off = self._why_no_graph(device, cuda_graph, host_decided)
        self._graph_asked = cuda_graph is True  # else a failed capture falls back to eager steps

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self._tokens = zeros(batch_size, max_len)  # prompt and generated tokens, by cache position
        self._next = zeros(batch_size, 1)  # the token the next step reads ...
        self._position = zeros(batch_size, 1)  # ... its position id ...
        self._index = zeros(1)  # ... and its cache position (= its column in _tokens)
        self._mask = zeros(batch_size, max_len, dtype=torch.bool)  # padded prompts only
        self._finished = zeros(batch_size, dtype=torch.bool)
        self._live_steps = zeros(1)  # tokens emitted while some row was unfinished
        # each row's valid cache length in a decode step, for onepass attention (cache.DECODE_LENGTHS);
        # not where a layer keeps a window of keys (its cache is not indexed by position)
        self._lengths = None if host_decided else zeros(batch_size, dtype=torch.int32)
        self._eos = torch.tensor(eos, dtype=torch.long, device=device)
        self._pad = torch.tensor(self.pad_token_id, dtype=torch.long, device=device)

    @staticmethod
    def _why_no_graph(device: torch.device, cuda_graph: bool | None, host_decided: bool) -> str | None:
        if cuda_graph is False or (cuda_graph is None and device.type != "cuda"):
            return "cuda_graph is off" if cuda_graph is False else f"the model is on {device}, not a GPU"
        if host_decided:
            reason = ("the cache has layers that keep a window of keys (chunked attention, linear-attention "
                      "hybrids), whose update branches on a host integer: a graph would replay the branch "
                      "of its capture")
            if cuda_graph:
                raise ValueError(f"cuda_graph=True cannot hold this model's decode step: {reason}")
            return reason
        return None

    # ------------------------------------------------------------------------ the step

    def _scores(self, logits: Tensor) -> Tensor:
        """Scores whose argmax is each row's next token, from its last logits [batch, vocab]: the
        logits themselves (greedy), or a draw by the Gumbel-max trick."""
        if not self.do_sample:
            return logits
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(-1, descending=True)
            # drop a token once the likelier ones already reach top_p (the likeliest is always kept)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        return probs / torch.empty_like(probs).exponential_()

    def _emit(self, logits: Tensor, advance: bool) -> None:
        """Pick each row's token and record it at cache position ``_index`` (after advancing the
        index and positions, with ``advance``), with the finished flags and the next step's cache
        lengths: ``ops.next_token``."""
        eos = (self._eos, self._pad, self._finished, self._live_steps) if self.eos_token_ids else (None,) * 4
        record_next_token(self._scores(logits), self._tokens, self._next, self._index, self._position, advance,
                          *eos, self._lengths)

    def _step(self, padded: bool) -> None:
        """One decode step: the model on ``_next``, then the token after it."""
        if padded:
            self._mask.index_fill_(1, self._index, True)
        setattr(self.cache, DECODE_LENGTHS, None if padded else self._lengths)
        with masks_unread(not padded and self._lengths is not None and self._reads_lengths):
            out = self.model(self._next, attention_mask=self._mask if padded else None,
                             position_ids=self._position, use_cache=True, **{cache_keyword(): self.cache})
        self._emit(out.logits[:, -1], advance=True)

    def _attention_reads_lengths(self) -> bool:
        """Whether every attention layer of the model runs onepass's decode attention over the
        cache lengths (optimized, each attention block fused, attn_implementation "onepass"), so
        that no layer reads a mask in an unpadded step."""
        from onepass.patching import is_optimized, optimize_report

        if not is_optimized(self.model) or self.model.config._attn_implementation != "onepass":
            return False
        report = optimize_report(self.model)
        return report["rope"].startswith(FUSED) and report["attention"].startswith(FUSED)

    def _run_step(self, padded: bool, eager_steps: int) -> None:
        """The step as a graph replay, or eagerly (before capture, or without graphs)."""
        if self.graph_off is not None:
            self._step(padded)
            return
        graph = self._graphs.get(padded)
        if graph is None and eager_steps < WARMUP_STEPS:
            # warm-up off the default stream, as torch.cuda.graph's capture will run
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(padded)
            torch.cuda.current_stream().wait_stream(side)
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self._step(padded)
            except Exception as e:
                reason = (f"capturing the decode step as a CUDA graph failed ({type(e).__name__}: {e}): the model's "
                          "forward does something a graph cannot hold (a host sync, a CPU tensor, ...)")
                if self._graph_asked:
                    raise RuntimeError(f"{reason}; Decoder(..., cuda_graph=False) decodes eagerly") from e
                # by default a step that cannot be captured runs eagerly (the capture ran none of its work)
                warnings.warn(f"onepass.Decoder decodes without a CUDA graph: {reason}", stacklevel=3)
                self.graph_off = reason
                self._step(padded)
                return
            self._graphs[padded] = graph
        graph.replay()

    def _weights_key(self) -> tuple:
        """The address and dtype of every parameter and buffer of the model: a captured step reads
        them at the addresses it was captured with, and the cache holds the dtype it was filled in."""
        return tuple((t.data_ptr(), t.dtype) for t in (*self.model.parameters(), *self.model.buffers()))

    def _start_over(self) -> None:
        """A new cache and no captured step, made for the model's tensors as they are now."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer, get_layer_types_and_kwargs

        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        # the layer kinds StaticCache was built from (transformers 5.17 and 5.24 alike: [0] is the list)
        kinds = get_layer_types_and_kwargs(self.model.config.get_text_config(decoder=True))[0]
        for i, (kind, layer) in enumerate(zip(kinds, self.cache.layers)):
            if kind == "sliding_attention" and type(layer) is StaticSlidingWindowLayer:
                full = StaticLayer(max_cache_len=self.max_len)
                # an attribute, not a subclass: masks see a sliding layer (the window over
                # absolute positions, kv offset 0), onepass's fused cache append a StaticLayer
                full.is_sliding = True
                self.cache.layers[i] = full
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # padded prompts or not -> the captured step
        self._weights = self._weights_key()  # what the cache and the captured steps were made for

    def _follow_the_model(self) -> None:
        """After the model's tensors moved (``load_state_dict(..., assign=True)``, ``model.to(dtype)``,
        ...), capture the step again and start a new cache: a replay would read the old memory."""
        if self._weights_key() != self._weights:
            self._start_over()

    # ------------------------------------------------------------------------ the call

    def _check(self, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None) -> Tensor | None:
        """Validate a call; the prompts' boolean mask when they are (left-)padded, else None."""
        _check_request(input_ids, max_new_tokens)
        batch, length = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"input_ids has {batch} rows; this Decoder was built for batch_size={self.batch_size}")
        if input_ids.device != self._tokens.device:
            raise ValueError(f"input_ids is on {input_ids.device}, the model on {self._tokens.device}")
        if length + max_new_tokens > self.max_len:
            raise ValueError(f"prompt length {length} + max_new_tokens {max_new_tokens} must be within "
                             f"1..max_len={self.max_len} (build the Decoder with a larger max_len)")
        if attention_mask is None:
            return None
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        if bool(mask.all()):
            return None
        if not bool(mask.any(1).all()):
            raise ValueError("attention_mask has a row of zeros: a prompt with no token to start from")
        if not bool(mask[:, -1].all()):
            raise ValueError("attention_mask pads on the right; decoder-only generation needs the padding on "
                             "the left (tokenizer.padding_side = 'left'), every prompt ending at the last column")
        return mask

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None) -> Tensor:
        """The prompts ``input_ids`` [batch, length] followed by up to ``max_new_tokens`` new tokens
        each ([batch, length + new]). ``attention_mask`` marks left padding (1 = token, 0 = pad)."""
        mask = self._check(input_ids, max_new_tokens, attention_mask)
        self._follow_the_model()
        self._reads_lengths = self._attention_reads_lengths()
        padded = mask is not None
        length = input_ids.shape[1]
        self.cache.reset()
        setattr(self.cache, DECODE_LENGTHS, None)  # the prefill attends as the model does
        self._tokens[:, :length] = input_ids
        self._finished.zero_()
        self._live_steps.zero_()
        if padded:
            self._mask.zero_()
            self._mask[:, :length] = mask
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            positions = torch.arange(length, device=input_ids.device).expand(self.batch_size, length)
        out = self.model(input_ids, attention_mask=self._mask if padded else None, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{cache_keyword(): self.cache})
        self._index.fill_(length)
        self._position.copy_(positions[:, -1:] + 1)
        self._emit(out.logits[:, -1], advance=False)
        del out
        steps, eager_steps = 1, 0
        while steps < max_new_tokens:
            if self.eos_token_ids and steps % CHECK_EVERY == 0 and bool(self._finished.all()):
                break
            self._run_step(padded, eager_steps)
            eager_steps += padded not in self._graphs
            steps += 1
        if self.eos_token_ids:
            steps = int(self._live_steps)
        return self._tokens[:, :length + steps].clone()


def generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None,
             **settings) -> Tensor:
    """``Decoder(model, batch, prompt + max_new_tokens, **settings).generate(...)``, once: the
    cache and the graph are built for this call. To generate repeatedly, keep a ``Decoder``."""
    _check_request(input_ids, max_new_tokens)  # before its sizes build the Decoder
    decoder = Decoder(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, **settings)
    return decoder.generate(input_ids, max_new_tokens, attention_mask)
