import pytest
import torch

from onepass.ops.partials import sum_partials


# more partial rows than one step of the tile at both settings (256 rows up to 2048 columns, 64 past them)
@pytest.mark.parametrize("n_parts, n_cols", [(300, 40), (70, 2100), (0, 8)])
def test_sums_two_buffers_in_their_dtypes(n_parts, n_cols, device):
    a, b = (torch.randn(n_parts, n_cols, device=device) for _ in range(2))
    dw, db = sum_partials((a, torch.bfloat16), (b, torch.float32))
    assert (dw.dtype, db.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(dw, a.sum(0).to(torch.bfloat16))
    torch.testing.assert_close(db, b.sum(0), rtol=1e-5, atol=1e-4)


def test_more_than_two_buffers_or_two_shapes_raise(device):
    a = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="at most two"):
        sum_partials((a, a.dtype), (a, a.dtype), (a, a.dtype))
    with pytest.raises(ValueError, match="one shape"):
        sum_partials((a, a.dtype), (torch.zeros(4, 9, device=device), a.dtype))
