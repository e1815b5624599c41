import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90_at_real_sizes():
    """The kernels the launchers pick at real sizes on a 132-SM GPU compile for sm_90 (the interpreter,
    which runs the other CPU tests, compiles nothing), and none has its tensor-core products serialized by ptxas
    (warning C7514): tests/ops/_compile_sm90.py, in a process without TRITON_INTERPRET, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("_compile_sm90.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    compiled = run.stdout.splitlines()
    for kernel in ("_norm_fwd_kernel", "_norm_bwd_kernel", "_attn_fwd_kernel", "_attn_bwd_dkdv_kernel",
                   "_attn_bwd_dq_kernel", "_attn_fwd_hopper_kernel", "_attn_dq_hopper_kernel",
                   "_attn_dkdv_hopper_kernel", "_decode_split_kernel", "_decode_merge_kernel",
                   "_decode_linear_kernel",
                   "_rope_kernel", "_rope_flat_kernel",
                   "_cross_entropy_fwd_kernel", "_act_bwd_kernel", "_softmax_bwd_kernel", "_moe_up_kernel",
                   "_moe_wgrad_kernel", "_append_kv_kernel", "_tables_kernel", "_piece_max_kernel", "_record_kernel",
                   "_cross_entropy_bwd_kernel", "_linear_jsd_kernel", "_logit_grad_kernel", "_fold_block_kernel",
                   "_block_grad_kernel"):
        assert any(line.startswith(kernel + " ") for line in compiled), (kernel, run.stdout)
