import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close

NAMES = ("hidden", "top_k_weights", "gate_up_weight", "down_weight")


def _routing(tokens, n_experts, top_k, device, dtype=torch.float32):
    """Top-k of a softmax router over random logits, as Mixtral's router picks them."""
    probs = torch.randn(tokens, n_experts, device=device).softmax(-1)
    weights, index = probs.topk(top_k, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def _inputs(tokens, hidden, inter, n_experts, top_k, dtype, device, index=None):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    routed, weights = _routing(tokens, n_experts, top_k, device)
    gate_up = (torch.randn(n_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(n_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    return x, routed if index is None else index.to(device), weights, gate_up, down


def _leaves(x, weights, gate_up, down, cast=None, frozen=()):
    return [(t.detach().clone() if cast is None else t.detach().to(cast)).requires_grad_(name not in frozen)
            for name, t in zip(NAMES, (x, weights, gate_up, down))]


def _check(inputs, dtype, activation="silu", frozen=()):
    """Output and every gradient (random upstream gradient) against the float64 reference."""
    x, index, weights, gate_up, down = inputs
    leaves = _leaves(x, weights, gate_up, down, frozen=frozen)
    out = ops.moe_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], activation=activation)
    dout = torch.randn_like(out)
    out.backward(dout)
    doubles = _leaves(x, weights, gate_up, down, torch.float64, frozen)
    ref = reference.moe_experts(doubles[0], index, doubles[1], doubles[2], doubles[3], activation)
    ref.backward(dout.double())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, ref, dtype, "out")
    for name, t, d in zip(NAMES, leaves, doubles):
        if name in frozen:
            assert t.grad is None, name
        else:
            assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
            assert_close(t.grad, d.grad, dtype, f"d{name}")
    return leaves


# Irregular sizes (hidden 80, intermediate 40: not multiples of the tiles; several K steps and feature tiles).
# bfloat16 takes the reference under the interpreter (its tl.dot is wrong there), the kernels on a GPU.
@pytest.mark.parametrize("dtype, activation, tokens, top_k, n_experts", [
    (torch.bfloat16, "silu", 29, 2, 4),
    (torch.float32, "silu", 29, 2, 4),
    (torch.float32, "gelu_tanh", 23, 1, 3),
    (torch.float32, "gelu", 11, 8, 8),
    (torch.float16, "silu", 29, 2, 5),
    (torch.float16, "gelu", 13, 4, 6),
])
def test_matches_reference(dtype, activation, tokens, top_k, n_experts, device):
    _check(_inputs(tokens, 80, 40, n_experts, top_k, dtype, device), dtype, activation)


def test_expert_without_tokens(device):
    """Expert 2 of 4 gets no slot: its weight gradients are zero (the kernels skip it)."""
    index = torch.randint(0, 3, (30, 2))
    index[:, 1] = (index[:, 0] + 1) % 2  # experts 0, 1, 3 only; two distinct per token
    index[index == 2] = 3
    leaves = _check(_inputs(30, 48, 40, 4, 2, torch.float32, device, index), torch.float32)
    for t in leaves[2:]:
        assert torch.count_nonzero(t.grad[2]) == 0


def test_all_tokens_on_one_expert(device):
    index = torch.zeros(40, 1, dtype=torch.int64)
    leaves = _check(_inputs(40, 48, 24, 3, 1, torch.float32, device, index), torch.float32)
    for t in leaves[2:]:
        assert torch.count_nonzero(t.grad[1:]) == 0


def test_one_expert_and_int32_index(device):
    index = torch.zeros(9, 1, dtype=torch.int32)
    _check(_inputs(9, 32, 16, 1, 1, torch.float32, device, index), torch.float32)


def test_ids_outside_the_experts_count_nothing(device):
    """transformers' expert-parallel sentinel (an id >= E) and negative ids: no contribution, zero gradient."""
    x, index, weights, gate_up, down = _inputs(12, 32, 24, 4, 2, torch.float32, device)
    index[::3, 1] = 4
    index[1::5, 0] = -1
    leaves = _check((x, index, weights, gate_up, down), torch.float32)
    outside = (index < 0) | (index >= 4)
    assert torch.count_nonzero(leaves[1].grad[outside]) == 0


def test_zero_tokens(device):
    x, index, weights, gate_up, down = _inputs(0, 32, 24, 4, 2, torch.float32, device)
    x, weights, gate_up, down = _leaves(x, weights, gate_up, down)
    out = ops.moe_experts(x, index, weights, gate_up, down)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert x.grad.shape == (0, 32) and weights.grad.shape == (0, 2)
    for t in (gate_up, down):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_frozen_parts(device):
    inputs = _inputs(21, 48, 40, 4, 2, torch.float32, device)
    _check(inputs, torch.float32, frozen=("top_k_weights",))
    _check(inputs, torch.float32, frozen=("hidden", "gate_up_weight"))
    _check(inputs, torch.float32, frozen=("hidden", "gate_up_weight", "down_weight"))  # the router's weights only


def test_strided_inputs(device):
    """A non-contiguous hidden, transposed weight views (as [E, H, 2I] / [E, I, H] stored), fp32 router weights
    on fp16 experts."""
    x, index, weights, gate_up, down = _inputs(17, 48, 40, 4, 2, torch.float16, device)
    x_t = x.t().contiguous().t()
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (x_t.is_contiguous() or gate_up_t.is_contiguous() or down_t.is_contiguous())
    _check((x_t, index, weights.float(), gate_up_t, down_t), torch.float16)


def test_autocast(device):
    """fp32 tensors under fp16 autocast: the experts run in fp16, the result comes back in fp32 (as
    transformers' experts return hidden's dtype), each gradient in its leaf's dtype."""
    inputs = _inputs(15, 48, 40, 4, 2, torch.float32, device)
    x, index, weights, gate_up, down = inputs
    leaves = _leaves(x, weights, gate_up, down)
    with torch.autocast(device, dtype=torch.float16):
        out = ops.moe_experts(leaves[0], index, *leaves[1:])
    assert out.dtype == torch.float32
    out.sum().backward()
    doubles = _leaves(x, weights, gate_up, down, torch.float64)
    ref = reference.moe_experts(doubles[0], index, *doubles[1:])
    ref.sum().backward()
    assert_close(out, ref, torch.float16, "out")
    for name, t, d in zip(NAMES, leaves, doubles):
        assert t.grad.dtype == torch.float32
        assert_close(t.grad, d.grad, torch.float16, f"d{name}")


def test_inference_matches_training_and_is_deterministic(device):
    x, index, weights, gate_up, down = _inputs(25, 48, 40, 4, 2, torch.float32, device)
    with torch.no_grad():
        plain = ops.moe_experts(x, index, weights, gate_up, down)
    leaves = _leaves(x, weights, gate_up, down)
    runs = []
    for _ in range(2):
        for t in leaves:
            t.grad = None
        out = ops.moe_experts(leaves[0], index, *leaves[1:])
        out.backward(torch.ones_like(out))
        runs.append([out.detach()] + [t.grad for t in leaves])
    assert torch.equal(plain, runs[0][0])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_matches_transformers_experts_modules(family, device):
    """What transformers' experts modules return, eager and grouped_mm (the ExpertsInterface forward)."""
    if family == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts
        inter, n_experts, top_k = 40, 4, 2
        sizes = dict(intermediate_size=inter, num_local_experts=n_experts)
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
        inter, n_experts, top_k = 24, 8, 4
        sizes = dict(moe_intermediate_size=inter, num_experts=n_experts)
    x, index, weights, gate_up, down = _inputs(19, 48, inter, n_experts, top_k, torch.float32, device)
    out = ops.moe_experts(x, index, weights, gate_up, down)
    for implementation in ("eager", "grouped_mm"):
        config = Config(hidden_size=48, num_experts_per_tok=top_k, experts_implementation=implementation, **sizes)
        module = Experts(config).to(device)
        with torch.no_grad():
            module.gate_up_proj.copy_(gate_up)
            module.down_proj.copy_(down)
            assert_close(out, module(x, index, weights), torch.float32, implementation)


def test_as_a_transformers_experts_implementation(device):
    """Registered in transformers' ExpertsInterface: a MixtralExperts with experts_implementation="onepass"
    gives the eager module's output and gradients."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    def onepass_experts(self, hidden_states, top_k_index, top_k_weights):
        return ops.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    ALL_EXPERTS_FUNCTIONS["onepass"] = onepass_experts
    try:
        configs = [MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, experts_implementation=name)
                   for name in ("onepass", "eager")]
        modules = [MixtralExperts(config).to(device) for config in configs]
        x, index, weights, gate_up, down = _inputs(9, 32, 24, 4, 2, torch.float32, device)
        results = []
        for module in modules:
            with torch.no_grad():
                module.gate_up_proj.copy_(gate_up)
                module.down_proj.copy_(down)
            xs = x.clone().requires_grad_(True)
            out = module(xs, index, weights)
            out.square().sum().backward()
            results.append([out, xs.grad, module.gate_up_proj.grad, module.down_proj.grad])
        for ours, eager in zip(*results):
            assert_close(ours, eager, torch.float32)
    finally:
        del ALL_EXPERTS_FUNCTIONS["onepass"]


def test_no_second_derivative(device):
    x, index, weights, gate_up, down = _inputs(6, 32, 16, 3, 2, torch.float32, device)
    x, weights, gate_up, down = _leaves(x, weights, gate_up, down)
    out = ops.moe_experts(x, index, weights, gate_up, down)
    with pytest.raises(RuntimeError, match="onepass moe_experts: no second derivative"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


# ------------------------------------------------------------- compile and opcheck


def test_torch_compile_fullgraph(device):
    x, index, weights, gate_up, down = _inputs(13, 32, 24, 4, 2, torch.float32, device)
    leaves = _leaves(x, weights, gate_up, down)

    def step(x, w, gu, dn):
        return ops.moe_experts(x * 2.0, index, w, gu, dn, activation="gelu_tanh").square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(*leaves)
    out.backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    eager = step(*leaves)
    eager.backward()
    assert_close(out, eager, torch.float32)
    for g, t in zip(grads, leaves):
        assert_close(g, t.grad, torch.float32)


def test_opcheck(device):
    from onepass.ops.moe import _moe_bwd, _moe_fwd, moe_fwd_launch

    x, index, weights, gate_up, down = _inputs(6, 32, 16, 3, 2, torch.float32, device)
    torch.library.opcheck(_moe_fwd, (x, index, weights, gate_up, down, 0, True))
    torch.library.opcheck(_moe_fwd, (x, index, weights, gate_up, down, 2, False))
    _, gu, perm, offsets = moe_fwd_launch(x, index, weights, gate_up, down, 0, True)
    dout = torch.randn_like(x)
    for needs in ((True, True, True, True), (False, True, False, True)):
        torch.library.opcheck(_moe_bwd, (dout, x, index, weights, gate_up, down, gu, perm, offsets, 0, *needs))


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, error, words", [
    (lambda x, i, w, gu, dn: ops.moe_experts(x.tolist(), i, w, gu, dn), TypeError, "hidden"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i.tolist(), w, gu, dn), TypeError, "top_k_index"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i.float(), w, gu, dn), TypeError, "top_k_index"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w.long(), gu, dn), TypeError, "top_k_weights"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x.long(), i, w, gu, dn), TypeError, "hidden"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w, gu.half(), dn), TypeError, "gate_up_weight"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w, gu, dn.half()), TypeError, "down_weight"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x[None], i, w, gu, dn), ValueError, "hidden"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i[:3], w, gu, dn), ValueError, "top_k_index"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w[:, :1], gu, dn), ValueError, "top_k_weights"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w, gu[:, :5], dn), ValueError, "gate_up_weight"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w, gu[:2], dn), ValueError, "gate_up_weight"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w, gu, dn[:, :5]), ValueError, "down_weight"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i, w, gu, dn, activation="relu"), ValueError, "activation"),
    (lambda x, i, w, gu, dn: ops.moe_experts(x, i.to("meta"), w, gu, dn), ValueError, "top_k_index on meta"),
])
def test_bad_input_raises(call, error, words, device):
    x, index, weights, gate_up, down = _inputs(5, 16, 8, 3, 2, torch.float32, device)
    with pytest.raises(error, match=words):
        call(x, index, weights, gate_up, down)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, inter, n_experts, top_k", [
    (4096, 14336, 8, 2),  # Mixtral-8x7B
    (2048, 768, 128, 8),  # Qwen3-30B-A3B
])
def test_gpu_bf16_real_layers(hidden, inter, n_experts, top_k):
    """8192 tokens of a real layer in bf16, output and every gradient against the float64 reference."""
    _check(_inputs(8192, hidden, inter, n_experts, top_k, torch.bfloat16, "cuda"), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_bf16_imbalanced():
    """Every token on expert 0 but one slot on expert 5; the rest idle."""
    index = torch.zeros(4096, 2, dtype=torch.int64)
    index[:, 1] = 1
    index[7, 1] = 5
    _check(_inputs(4096, 1024, 512, 8, 2, torch.bfloat16, "cuda", index), torch.bfloat16)
