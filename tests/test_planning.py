"""The device-side chunk map: every token in exactly one chunk, chunks aligned to their sequence."""

import torch

from flash_gdn.planning import chunk_capacity, plan_for


def test_varlen_chunks_cover_every_token_once():
    lengths = [5, 0, 195, 64, 1, 128]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    plan = plan_for(1, int(cu[-1]), cu, torch.device("cpu"))
    assert plan.chunk_bounds.shape[0] == chunk_capacity(1, int(cu[-1]), len(lengths), True)
    covered = torch.zeros(int(cu[-1]), dtype=torch.int64)
    for start, end in plan.chunk_bounds.tolist():
        assert 0 <= end - start <= 64
        covered[start:end] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    for n, (start, end, first) in enumerate(plan.seq_info.tolist()):
        assert (start, end) == (int(cu[n]), int(cu[n + 1]))
        for c in range(-(-(end - start) // 64)):
            assert plan.chunk_bounds[first + c].tolist() == [start + 64 * c, min(start + 64 * (c + 1), end)]


def test_fixed_length_batch_is_exact():
    plan = plan_for(3, 100, None, torch.device("cpu"))
    assert plan.chunk_bounds.tolist() == [[0, 64], [64, 100], [100, 164], [164, 200], [200, 264], [264, 300]]
    assert plan.seq_info[:, 2].tolist() == [0, 2, 4]
