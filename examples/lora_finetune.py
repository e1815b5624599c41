"""LoRA fine-tuning with PEFT and onepass: wrap with PEFT first, then optimize; a few steps.

    python examples/lora_finetune.py    (a toy-sized model on a CPU, llama-1b's shape on a GPU)
"""

import peft
import torch

import onepass
from onepass.models.configs import build

device = "cuda" if torch.cuda.is_available() else "cpu"
name, dtype = ("llama-1b", torch.bfloat16) if device == "cuda" else ("llama-tiny", torch.float32)

torch.manual_seed(0)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = peft.get_peft_model(build(name, device=device, dtype=dtype).train(),
                            peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets))
onepass.optimize(model)  # every LoRA linear becomes one lora_linear node; the rest fused as usual
print(f"  lora: {onepass.optimize_report(model)['lora']}")

opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (2, 32 if device == "cuda" else 16), device=device)
losses = []
for _ in range(5):  # the same batch five times: its loss goes down
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
print(f"{name} on {device}, LoRA losses: " + ", ".join(f"{x:.4f}" for x in losses))
