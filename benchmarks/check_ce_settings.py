"""cross_entropy fwd+bwd on this GPU with its looked-up setting against the default, per vocabulary.

    python benchmarks/check_ce_settings.py

For each vocabulary (Llama 3's 128256, GPT-2's 50257, whose rows take the kernel's unaligned
split and with it the default setting, and 32000), 8192 rows in bf16: the gradient checked against
PyTorch's in fp32, the kernel's registers and spills, and the median step time, with
``CE_GRAD_BY_DEVICE`` as shipped and emptied.
"""

import importlib

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from onepass import ops
from onepass.ops import dispatch

ce = importlib.import_module("onepass.ops.cross_entropy")


def main():
    print(torch.cuda.get_device_name(), "looked-up setting:", ce.ce_settings(128256, True, torch.device("cuda")))
    shipped = ce.CE_GRAD_BY_DEVICE
    for vocab in (128256, 50257, 32000):
        x = (torch.randn(8192, vocab, device="cuda") * 4).to(torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, vocab, (8192,), device="cuda")
        ref = F.cross_entropy(x.float(), t)
        (ref_grad,) = torch.autograd.grad(ref, x)
        for name, table in (("default", {}), ("looked up", shipped)):
            ce.CE_GRAD_BY_DEVICE = table
            loss = ops.cross_entropy(x, t)
            (grad,) = torch.autograd.grad(loss, x)
            kernel = [k for key, k in dispatch._compiled_kernels.items() if key[0] is ce._cross_entropy_fwd_kernel][-1]

            def step():
                ops.cross_entropy(x, t).backward()
                x.grad = None

            ms = do_bench(step, warmup=25, rep=100, return_mode="median")
            print(f"vocab {vocab:<6} {name:<9} {ms:6.3f} ms  regs {kernel.n_regs} spills {kernel.n_spills}  "
                  f"loss err {abs(loss.item() - ref.item()):.1e}  grad max err "
                  f"{(grad.float() - ref_grad.float()).abs().max().item():.1e}", flush=True)
    ce.CE_GRAD_BY_DEVICE = shipped


if __name__ == "__main__":
    main()
