"""GPU: the fused reverse pass (``hopper.fused_backward``, step 1: serial) against the fp64 chunked
backward, on ragged varlen batches with empty and one-token sequences, grouped heads, the fused
L2 norm, an initial state and a final-state gradient, and gates up to -20 a token; outputs
poisoned first, and two runs compared bit for bit (a race would move them)."""

import pytest
import torch

from flash_gdn.hopper.fused_backward import fused_reverse_backward
from flash_gdn.hopper.group_grads import build_group_grads
from flash_gdn.reference.chunked_backward import chunked_backward, l2_norm_backward
from flash_gdn.validation import check_inputs
from tests.gpu_helpers import backward_inputs, poisoned
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0_all")


def _inputs(lengths, hqk, hv, l2, gate, seed):
    torch.manual_seed(seed)
    return backward_inputs(lengths, hqk, hv, 128, l2, gate=gate)


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("hqk,hv", [(2, 2), (1, 4)])
@pytest.mark.parametrize("gate", [(0.0, 3.0), (0.0, 20.0)])
def test_fused_reverse_pass_matches_reference(l2, hqk, hv, gate):
    q, k, v, g, beta, do, init, dht, cu = _inputs([1, 0, 64, 300, 5, 129, 1000], hqk, hv, l2, gate, seed=hqk + hv)
    problem = check_inputs(q, k, v, g, beta, None, init, cu, False)
    runs = []
    for _ in range(2):
        with poisoned():
            got = fused_reverse_backward(q, k, v, g, beta, do, dht, problem, init, l2, cu)
        torch.cuda.synchronize()
        runs.append(got)
    ref = chunked_backward(q, k, v, g, beta, do, dht=dht, initial_state=init, cu_seqlens=cu.cpu(),
                           use_qk_l2norm_in_kernel=l2)
    for name, want in zip(NAMES, ref):
        out = runs[0][name]
        assert torch.isfinite(out).all(), name
        assert rel_err(out, want) <= TOL, (name, rel_err(out, want))
        assert torch.equal(out, runs[1][name]), f"{name}: two runs differ (a race)"


def test_fused_reverse_pass_without_states():
    """No initial state and no final-state gradient (dS starts at zero)."""
    q, k, v, g, beta, do, _, _, cu = _inputs([200, 77], 2, 4, False, (0.0, 3.0), seed=7)
    problem = check_inputs(q, k, v, g, beta, None, None, cu, False)
    with poisoned():
        got = fused_reverse_backward(q, k, v, g, beta, do, None, problem, None, False, cu)
    ref = chunked_backward(q, k, v, g, beta, do, cu_seqlens=cu.cpu())
    for name, want in zip(NAMES[:5], ref[:5]):
        assert rel_err(got[name], want) <= TOL, (name, rel_err(got[name], want))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("hqk,hv,tokens", [(2, 2, 1), (1, 4, 77), (2, 8, 300)])
def test_group_grads_matches_torch(normalize, hqk, hv, tokens):
    """The group sum and the L2 norm's backward alone, against fp64 torch: token counts off the
    kernel's 32-row blocks, group sizes 1, 4 and 4 over two q/k heads; outputs NaN first."""
    torch.manual_seed(tokens + hv)
    q, k = (torch.randn(tokens, hqk, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    dq_v, dk_v = (torch.randn(tokens, hv, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    dq, dk = (torch.full((tokens, hqk, 128), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    build_group_grads(128, "bfloat16")(q, k, dq_v, dk_v, int(normalize), dq, dk)
    for x, x_v, out in ((q, dq_v, dq), (k, dk_v, dk)):
        want = x_v.double().view(tokens, hqk, hv // hqk, 128).sum(2)
        if normalize:
            want = l2_norm_backward(x.double(), want)
        assert torch.isfinite(out).all()
        assert rel_err(out, want) <= TOL, rel_err(out, want)
