"""Generation on an optimized model: a static KV cache, each decode step one CUDA graph replay.

    python examples/generate.py        (without a GPU it decodes eagerly; TRITON_INTERPRET=1 runs the kernels)
"""

import time

import torch

import onepass
from onepass.models.configs import build

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
name, prompt, new = ("llama-1b", 128, 128) if device == "cuda" else ("llama-tiny", 8, 4)

torch.manual_seed(0)
model = onepass.optimize(build(name, device=device, dtype=dtype))  # random weights: the tokens mean nothing
input_ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device)

decoder = onepass.Decoder(model, batch_size=1, max_len=prompt + new, eos_token_id=[])  # keep it for every call
decoder.generate(input_ids, new)  # the first call warms up and captures the decode step
start = time.perf_counter()
tokens = decoder.generate(input_ids, new)
seconds = time.perf_counter() - start
sampled = onepass.generate(model, input_ids, new, do_sample=True, temperature=0.8, top_p=0.9)  # a one-off call

print(f"{device}: {name}, {tokens.shape[1] - prompt} new tokens greedily in {1e3 * seconds:.1f} ms "
      f"({new / seconds:.0f} tokens/s; CUDA graph: {decoder.graph_off or 'on'}); sampled {tuple(sampled.shape)}")
