"""CPU: the fused reverse pass's host side (``hopper.fused_backward``): the shapes it refuses."""

import pytest
import torch

from flash_gdn.hopper.fused_backward import fused_reverse_backward
from flash_gdn.validation import check_inputs


def test_fused_reverse_backward_refuses_other_head_sizes():
    q = k = torch.randn(1, 64, 2, 64)
    v = do = torch.randn(1, 64, 2, 64)
    g, beta = -torch.rand(1, 64, 2), torch.rand(1, 64, 2)
    problem = check_inputs(q, k, v, g, beta, None, None, None, False)
    with pytest.raises(ValueError, match="K = V = 128"):
        fused_reverse_backward(q, k, v, g, beta, do, None, problem, None, False, None)
