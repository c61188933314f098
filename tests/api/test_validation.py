"""Bad input raises a ValueError/TypeError naming the argument, before any work; inputs are untouched."""

import math

import pytest
import torch

from flash_gdn import chunk_gated_delta_rule
from tests.helpers import make_inputs, random_cu_seqlens


def _args(**overrides):
    inputs = make_inputs(seq_len=20, dtype=torch.float32, seed=0)
    inputs.update(overrides)
    return inputs


def _raises(exc, match, **kwargs):
    call = _args(**{k: v for k, v in kwargs.items() if k in ("q", "k", "v", "g", "beta", "initial_state")})
    extra = {k: v for k, v in kwargs.items() if k not in call}
    with pytest.raises(exc, match=match):
        chunk_gated_delta_rule(**call, **extra)


def test_q_wrong_rank():
    _raises(ValueError, "q must be 4-D", q=torch.randn(20, 2, 32))


def test_v_wrong_rank():
    _raises(ValueError, "v must be 4-D", v=torch.randn(1, 20, 4 * 32))


def test_g_wrong_rank():
    _raises(ValueError, "g must be 3-D", g=torch.randn(1, 20, 4, 1))


def test_k_shape_mismatch():
    _raises(ValueError, "k must have q's shape", k=torch.randn(1, 20, 2, 16))


def test_v_length_mismatch():
    _raises(ValueError, "v must be", v=torch.randn(1, 21, 4, 32))


def test_beta_shape_mismatch():
    _raises(ValueError, "beta must be", beta=torch.rand(1, 20, 3))


def test_g_shape_mismatch():
    _raises(ValueError, "g must be", g=-torch.rand(1, 20, 5))


def test_mismatched_dtypes():
    _raises(TypeError, "v must have q's dtype", v=torch.randn(1, 20, 4, 32, dtype=torch.float64))


def test_integer_input_rejected():
    _raises(TypeError, "q must be a floating tensor", q=torch.ones(1, 20, 2, 32, dtype=torch.int32))


def test_not_a_tensor():
    _raises(TypeError, "beta must be a torch.Tensor", beta=[0.5] * 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mismatched_devices():
    _raises(ValueError, "k must be on q's device", k=torch.randn(1, 20, 2, 32, device="cuda"))


def test_mismatched_devices_meta():
    _raises(ValueError, "g must be on q's device", g=torch.zeros(1, 20, 4, device="meta"))


def test_hv_not_multiple_of_hqk():
    _raises(ValueError, "multiple of q's head count", q=torch.randn(1, 20, 3, 32), k=torch.randn(1, 20, 3, 32))


def test_unsupported_head_dim():
    _raises(ValueError, "head dimension K", q=torch.randn(1, 20, 2, 512), k=torch.randn(1, 20, 2, 512))


def test_unsupported_value_dim():
    _raises(ValueError, "head dimension V", v=torch.randn(1, 20, 4, 300), )


def test_cu_seqlens_not_1d():
    _raises(ValueError, "cu_seqlens must be 1-D", cu_seqlens=torch.tensor([[0, 20]]))


def test_cu_seqlens_not_integer():
    _raises(TypeError, "cu_seqlens must be int32 or int64", cu_seqlens=torch.tensor([0.0, 20.0]))


def test_cu_seqlens_not_starting_at_zero():
    _raises(ValueError, "cu_seqlens must start at 0", cu_seqlens=torch.tensor([1, 20]))


def test_cu_seqlens_decreasing():
    _raises(ValueError, "non-decreasing", cu_seqlens=torch.tensor([0, 15, 10, 20]))


def test_cu_seqlens_not_ending_at_t():
    _raises(ValueError, "cu_seqlens must end at T=20", cu_seqlens=torch.tensor([0, 10, 19]))


def test_cu_seqlens_with_batch():
    inputs = make_inputs(batch=2, seq_len=10, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="batch size 1 when cu_seqlens"):
        chunk_gated_delta_rule(**inputs, cu_seqlens=random_cu_seqlens([5, 5]))


def test_initial_state_wrong_shape():
    _raises(ValueError, "initial_state must be", initial_state=torch.randn(1, 4, 16, 32))


def test_initial_state_wrong_layout():
    # [N, Hv, K, V] given where state_v_first expects [N, Hv, V, K]
    _raises(ValueError, r"initial_state must be \[N, Hv, V, K\]", initial_state=torch.randn(1, 4, 32, 16),
            v=torch.randn(1, 20, 4, 16), state_v_first=True)


def test_initial_state_wrong_n_for_varlen():
    _raises(ValueError, "initial_state must be", initial_state=torch.randn(1, 4, 32, 32),
            cu_seqlens=torch.tensor([0, 5, 20]))


@pytest.mark.parametrize("scale", [math.inf, math.nan])
def test_non_finite_scale(scale):
    _raises(ValueError, "scale must be finite", scale=scale)


def test_scale_not_a_number():
    _raises(TypeError, "scale must be a Python float", scale=torch.tensor(0.5))


def test_inputs_not_modified_in_place():
    inputs = make_inputs(seq_len=70, dtype=torch.float32, initial_state=True, normalize_k=False, seed=1)
    before = {name: t.clone() for name, t in inputs.items()}
    chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for name, t in inputs.items():
        assert torch.equal(t, before[name]), name


def test_rules_run_again_for_new_metadata_after_a_call_that_passed():
    """``check_inputs`` answers a call whose metadata matches one that passed from its memo;
    anything the rules read that differs must still be checked."""
    from flash_gdn import validation

    good = _args()
    chunk_gated_delta_rule(**good, scale=1)
    memo = dict(validation._PASSED)
    assert any(key[5] is int for key in memo)  # the passing call is remembered
    with pytest.raises(TypeError, match="scale must be a Python float"):  # True == 1, but a bool
        chunk_gated_delta_rule(**good, scale=True)
    with pytest.raises(ValueError, match="scale must be finite"):
        chunk_gated_delta_rule(**good, scale=math.nan)
    with pytest.raises(TypeError, match="scale must be a Python float"):  # unhashable
        chunk_gated_delta_rule(**good, scale=[1.0])
    with pytest.raises(TypeError, match="v must have q's dtype"):
        chunk_gated_delta_rule(**dict(good, v=good["v"].double()))
    # Values of a CPU cu_seqlens are checked on every call, also after one that passed.
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    chunk_gated_delta_rule(**good, cu_seqlens=cu)
    cu[1] = 30
    with pytest.raises(ValueError, match="non-decreasing"):
        chunk_gated_delta_rule(**good, cu_seqlens=cu)


def test_memo_gives_the_same_problem():
    from flash_gdn import validation

    good = _args()
    args = (good["q"], good["k"], good["v"], good["g"], good["beta"], 0.25, None, None, False)
    first = validation.check_inputs(*args)
    assert validation.check_inputs(*args) is first
    assert first == validation._check_inputs(*args, None)


def test_memo_of_any_length_takes_this_calls_lengths(monkeypatch):
    """A call that differs from one that passed only in T and N gets its own T and N from the
    memo keyed without them, without the full rules; where the lengths disagree the full
    rules still run and name them."""
    from flash_gdn import validation

    full_rules = []
    rules = validation._check_inputs
    monkeypatch.setattr(validation, "_check_inputs", lambda *a: full_rules.append(1) or rules(*a))

    def args(t, n=None, dev="meta", **over):
        x = dict(q=torch.empty(1, t, 2, 32, device=dev), k=torch.empty(1, t, 2, 32, device=dev),
                 v=torch.empty(1, t, 4, 32, device=dev), g=torch.empty(1, t, 4, device=dev),
                 beta=torch.empty(1, t, 4, device=dev))
        x.update(over)
        cu = None if n is None else torch.empty(n + 1, dtype=torch.int32, device=dev)
        h0 = x.pop("h0", None)
        return (x["q"], x["k"], x["v"], x["g"], x["beta"], None, h0, cu, False)

    validation.check_inputs(*args(64, 2, h0=torch.empty(2, 4, 32, 32, device="meta")))
    validation._PASSED.clear()  # (only the any-length memo can answer below)
    p = validation.check_inputs(*args(100, 3, h0=torch.empty(3, 4, 32, 32, device="meta")))
    assert len(full_rules) == 1  # (the first call's)
    assert (p.seq_len, p.num_seqs, p.num_v_heads, p.head_k) == (100, 3, 4, 32)
    assert p == rules(*args(100, 3, h0=torch.empty(3, 4, 32, 32, device="meta")), None)
    with pytest.raises(ValueError, match="initial_state must be"):
        validation.check_inputs(*args(100, 3, h0=torch.empty(2, 4, 32, 32, device="meta")))
    with pytest.raises(ValueError, match="cu_seqlens must hold at least 2"):
        validation.check_inputs(*args(100, 0, h0=torch.empty(0, 4, 32, 32, device="meta")))
    for name, x in (("k", torch.empty(1, 99, 2, 32, device="meta")), ("v", torch.empty(1, 99, 4, 32, device="meta")),
                    ("g", torch.empty(1, 99, 4, device="meta")), ("beta", torch.empty(1, 99, 4, device="meta"))):
        with pytest.raises(ValueError, match=f"{name} must"):
            validation.check_inputs(*args(100, 3, h0=torch.empty(3, 4, 32, 32, device="meta"), **{name: x}))
    # Without cu_seqlens N is the batch: a new T of a passing batch call.
    validation.check_inputs(*args(20, dev="cpu"))
    validation._PASSED.clear()
    full_rules.clear()
    p = validation.check_inputs(*args(70, dev="cpu"))
    assert not full_rules and (p.batch, p.seq_len, p.num_seqs) == (1, 70, 1)
