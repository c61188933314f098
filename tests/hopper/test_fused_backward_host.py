"""CPU: the fused reverse pass's host side (``hopper.fused_backward``): per-chunk rows back to tokens,
the L2 norm's backward from inverse norms, and the shapes it refuses."""

import pytest
import torch

from flash_gdn.hopper.fused_backward import _rows_of_chunks, fused_reverse_backward, l2_norm_backward_rows
from flash_gdn.reference.chunked_backward import l2_norm_backward
from flash_gdn.validation import check_inputs


def test_rows_of_chunks_puts_each_chunk_row_at_its_token():
    # chunks: [0, 64), [64, 100), an unused slot (0, 0), [100, 103)
    bounds = torch.tensor([[0, 64], [64, 100], [0, 0], [100, 103]], dtype=torch.int32)
    per_chunk = torch.randn(3, 4, 64)
    per_chunk[:, 2] = float("nan")  # the unused slot must not land anywhere
    rows = _rows_of_chunks(per_chunk, bounds, 103)
    assert rows.shape == (103, 3)
    assert torch.equal(rows[:64], per_chunk[:, 0].T)
    assert torch.equal(rows[64:100], per_chunk[:, 1, :36].T)
    assert torch.equal(rows[100:], per_chunk[:, 3, :3].T)


def test_l2_norm_backward_rows_matches_the_reference():
    x, dy = torch.randn(50, 2, 16, dtype=torch.float64), torch.randn(50, 2, 16, dtype=torch.float64)
    inv = torch.rsqrt((x * x).sum(-1) + 1e-6)
    assert torch.allclose(l2_norm_backward_rows(x, inv, dy), l2_norm_backward(x, dy))


def test_fused_reverse_backward_refuses_other_head_sizes():
    q = k = torch.randn(1, 64, 2, 64)
    v = do = torch.randn(1, 64, 2, 64)
    g, beta = -torch.rand(1, 64, 2), torch.rand(1, 64, 2)
    problem = check_inputs(q, k, v, g, beta, None, None, None, False)
    with pytest.raises(ValueError, match="K = V = 128"):
        fused_reverse_backward(q, k, v, g, beta, do, None, problem, None, False, None)
