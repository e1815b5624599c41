"""onepass.nn modules beside the torch modules they replace: initialisation and from_hf."""

import pytest
import torch
import torch.nn.functional as F

from onepass import nn as onn
from onepass.testing import assert_close


def test_reset_parameters_as_torch_modules():
    """Meta-device initialisation (to_empty, then reset_parameters, FSDP's way) needs them."""
    for module, expected in ((onn.RMSNorm(8), 1.0), (onn.RMSNorm(8, offset=1.0), 0.0), (onn.LayerNorm(8), 1.0)):
        with torch.device("meta"):
            empty = type(module)(8, offset=module.offset) if isinstance(module, onn.RMSNorm) else type(module)(8)
        empty = empty.to_empty(device="cpu")
        empty.reset_parameters()
        assert torch.equal(empty.weight, torch.full((8,), expected))
        assert torch.equal(module.weight, empty.weight)
    assert torch.equal(onn.LayerNorm(8).bias, torch.zeros(8))


def test_from_torch_rms_norm_with_its_default_eps(device):
    """torch.nn.RMSNorm's eps=None is the input dtype's machine epsilon (it was refused as
    having no eps attribute)."""
    ref = torch.nn.RMSNorm(16, device=device)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16, device=device) * 1e-4  # small enough for eps to matter
    drop_in = onn.RMSNorm.from_hf(ref)
    assert drop_in.weight is ref.weight
    assert_close(drop_in(x), F.rms_norm(x, (16,), ref.weight, None), torch.float32)
    with pytest.raises(ValueError, match="last dim"):  # a norm over two dims failed only in forward
        onn.RMSNorm.from_hf(torch.nn.RMSNorm((5, 16)))

