"""onepass.optimize on a Hugging Face Llama: same loss, fused kernels, undone in one line.

    python examples/optimize_llama.py    (a toy-sized model on a CPU, llama-1b's shape on a GPU)
"""

import torch

import onepass
from onepass.models.configs import build

device = "cuda" if torch.cuda.is_available() else "cpu"
name, dtype = ("llama-1b", torch.bfloat16) if device == "cuda" else ("llama-tiny", torch.float32)

torch.manual_seed(0)
model = build(name, device=device, dtype=dtype).train()
ids = torch.randint(0, model.config.vocab_size, (2, 16), device=device)

before = model(input_ids=ids, labels=ids).loss.item()
onepass.optimize(model)
after = model(input_ids=ids, labels=ids).loss  # logits are never materialised here
after.backward()
for switch, status in onepass.optimize_report(model).items():
    print(f"  {switch:<10} {status}")
onepass.undo(model)
print(f"{name} on {device}: loss {before:.5f} unfused, {after.item():.5f} with onepass")
