"""onepass.testing, the comparison every test uses."""

import pytest
import torch

from onepass.testing import assert_close, rel_error


def test_assert_close_takes_equal_infinities():
    a = torch.tensor([float("-inf"), 1.0, 2.0, float("inf")])
    assert rel_error(a, a.clone()) == 0.0  # was nan, so assert_close failed on identical tensors
    assert rel_error(torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([1.0, 2.0, 3.0])) == float("inf")
    with pytest.raises(ValueError, match="tolerance"):
        assert_close(a, a, torch.int32)
