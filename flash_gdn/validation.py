"""Argument checks of the public API. Every rule raises before any kernel launches.

Checks that need the values of ``cu_seqlens`` run only where they cost no host-device
synchronisation: when ``cu_seqlens`` lives on the CPU, or when the caller asks for them
(``FLASH_GDN_CHECK_CU_SEQLENS=1`` or ``validate_cu_seqlens=True``) outside CUDA-graph capture.

Every other rule reads only the arguments' types, shapes, dtypes and devices (and the scale),
so a call whose metadata equals that of a call that passed gets that call's ``Problem``
without running the rules again (``check_inputs``; host time is what eager calls of short
rows are made of: the full checks cost ~30 us a call on a slow host, the lookup ~5). A call
that differs from one that passed only in its token count T and sequence count N (serving and
varlen training: both change from call to call) is answered from a second memo, keyed without
them, after the few rules that read them (the five T agree, N >= 1, the initial state has N
rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .env import env_get

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Problem:
    """Sizes of one call, read off the validated arguments."""

    batch: int
    seq_len: int
    num_qk_heads: int
    num_v_heads: int
    head_k: int
    head_v: int
    num_seqs: int
    scale: float


def _require(cond: bool, message, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc`` unless ``cond``. ``message`` is a string or, for messages that format
    values, a function returning one: formatted only on failure (the checks run on every
    call, and 25 eager f-strings cost more host time than the checks themselves)."""
    if not cond:
        raise exc(message() if callable(message) else message)


def check_flag(name: str, value) -> None:
    _require(isinstance(value, bool), lambda: f"{name} must be a bool, got {type(value).__name__}", TypeError)


def _check_tensor(name: str, x, ndim: int, layout: str) -> None:
    _require(isinstance(x, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
    _require(x.dim() == ndim, lambda: f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")
    _require(x.dtype in FLOAT_DTYPES, lambda: f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {x.dtype}", TypeError)


def _wants_value_checks(cu_seqlens: torch.Tensor, validate_cu_seqlens: bool | None) -> bool:
    if validate_cu_seqlens is False:  # (asked not to: a shape function under torch.compile has no values)
        return False
    if cu_seqlens.device.type == "cpu":
        return True
    if validate_cu_seqlens is None:
        validate_cu_seqlens = env_get("FLASH_GDN_CHECK_CU_SEQLENS", "0") == "1"
    if not validate_cu_seqlens:
        return False
    return not (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens(cu_seqlens, seq_len: int, batch: int, validate_values: bool | None = None) -> int:
    """Validate ``cu_seqlens`` and return the number of sequences N."""
    _require(isinstance(cu_seqlens, torch.Tensor), lambda: f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}", TypeError)
    _require(cu_seqlens.dim() == 1, lambda: f"cu_seqlens must be 1-D [N + 1], got shape {tuple(cu_seqlens.shape)}")
    _require(cu_seqlens.dtype in INDEX_DTYPES, lambda: f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}", TypeError)
    _require(cu_seqlens.numel() >= 2, lambda: f"cu_seqlens must hold at least 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
    _require(batch == 1, lambda: f"q must have batch size 1 when cu_seqlens is given (sequences are packed along T), got B={batch}")
    if _wants_value_checks(cu_seqlens, validate_values):
        values = cu_seqlens.detach().to("cpu", torch.int64)
        _require(int(values[0]) == 0, lambda: f"cu_seqlens must start at 0, got {int(values[0])}")
        _require(bool((values[1:] >= values[:-1]).all()), "cu_seqlens must be non-decreasing")
        _require(int(values[-1]) == seq_len, lambda: f"cu_seqlens must end at T={seq_len}, got {int(values[-1])}")
    return cu_seqlens.numel() - 1


# Metadata of calls that passed every check -> their Problem (bounded: cleared when full).
_PASSED: dict[tuple, Problem] = {}
_PASSED_LIMIT = 256


def _metadata(x) -> tuple | None:
    return None if x is None else (type(x), x.shape, x.dtype, x.device)


def _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, validate_cu_seqlens) -> tuple | None:
    """What the shape-only rules read, as a dict key; None where the rules must run (the
    values of ``cu_seqlens`` are to be checked, or an argument is not tensor-like)."""
    if validate_cu_seqlens is not None or scale == 0:  # (0.0 and -0.0 are equal keys)
        return None
    try:
        if cu_seqlens is not None and (cu_seqlens.device.type == "cpu"
                                       or env_get("FLASH_GDN_CHECK_CU_SEQLENS", "0") == "1"):
            return None
        return (_metadata(q), _metadata(k), _metadata(v), _metadata(g), _metadata(beta), type(scale), scale,
                _metadata(initial_state), _metadata(cu_seqlens), state_v_first)
    except AttributeError:
        return None


# The same without T and N -> a Problem of one call that passed with them (``_any_length_key``).
_PASSED_ANY_LENGTH: dict[tuple, Problem] = {}


def _without_dim1(x) -> tuple:
    return (type(x), x.shape[:1] + x.shape[2:], x.dtype, x.device)


def _any_length_key(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first) -> tuple | None:
    """What ``_signature`` reads without T (dim 1 of q, k, v, g, beta) and N (cu_seqlens' length,
    the initial state's first dim); None where one of these is not there to drop."""
    try:
        return (_without_dim1(q), _without_dim1(k), _without_dim1(v), _without_dim1(g), _without_dim1(beta),
                type(scale), scale,
                None if initial_state is None else (type(initial_state), initial_state.shape[1:], initial_state.dtype,
                                                    initial_state.device),
                None if cu_seqlens is None else (type(cu_seqlens), cu_seqlens.dim(), cu_seqlens.dtype,
                                                 cu_seqlens.device),
                state_v_first)
    except (AttributeError, IndexError, TypeError):
        return None


def _from_any_length(template: Problem, q, k, v, g, beta, initial_state, cu_seqlens) -> Problem | None:
    """``template``'s Problem with this call's T and N, if the rules that read them hold (else
    None: the full rules run and name what is wrong)."""
    seq_len = q.shape[1]
    if not (k.shape[1] == seq_len and v.shape[1] == seq_len and g.shape[1] == seq_len and beta.shape[1] == seq_len):
        return None
    num_seqs = template.batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if num_seqs < 1 or (initial_state is not None and initial_state.shape[0] != num_seqs):
        return None
    return Problem(template.batch, seq_len, template.num_qk_heads, template.num_v_heads, template.head_k,
                   template.head_v, num_seqs, template.scale)


def check_inputs(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first: bool, validate_cu_seqlens: bool | None = None
) -> Problem:
    """Check every argument of the forward call and return the problem sizes (the rules run
    once per distinct metadata, see the module docstring)."""
    key = _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, validate_cu_seqlens)
    problem = any_length = None
    if key is not None:
        try:
            problem = _PASSED.get(key)
        except TypeError:  # an unhashable scale: the rules below name it
            key = None
        if problem is not None:
            return problem
    if key is not None:  # (a new T or N of metadata that passed: only their rules)
        any_length = _any_length_key(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
        template = None if any_length is None else _PASSED_ANY_LENGTH.get(any_length)
        if template is not None:
            problem = _from_any_length(template, q, k, v, g, beta, initial_state, cu_seqlens)
    if problem is None:
        problem = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                                validate_cu_seqlens)
    if key is not None:
        if len(_PASSED) >= _PASSED_LIMIT:
            _PASSED.clear()
            _PASSED_ANY_LENGTH.clear()
        _PASSED[key] = problem
        if any_length is not None:
            _PASSED_ANY_LENGTH[any_length] = problem
    return problem


def _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, validate_cu_seqlens) -> Problem:
    _check_tensor("q", q, 4, "[B, T, Hqk, K]")
    _check_tensor("k", k, 4, "[B, T, Hqk, K]")
    _check_tensor("v", v, 4, "[B, T, Hv, V]")
    _check_tensor("g", g, 3, "[B, T, Hv]")
    _check_tensor("beta", beta, 3, "[B, T, Hv]")

    batch, seq_len, num_qk_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[2], v.shape[3]
    _require(k.shape == q.shape, lambda: f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    _require(v.shape[:2] == q.shape[:2], lambda: f"v must be [B, T, Hv, V] with B, T = {tuple(q.shape[:2])}, got {tuple(v.shape)}")
    _require(g.shape == v.shape[:3], lambda: f"g must be [B, T, Hv] = {tuple(v.shape[:3])}, got {tuple(g.shape)}")
    _require(beta.shape == v.shape[:3], lambda: f"beta must be [B, T, Hv] = {tuple(v.shape[:3])}, got {tuple(beta.shape)}")
    _require(k.dtype == q.dtype, lambda: f"k must have q's dtype {q.dtype}, got {k.dtype}", TypeError)
    _require(v.dtype == q.dtype, lambda: f"v must have q's dtype {q.dtype}, got {v.dtype}", TypeError)
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require(x.device == q.device, lambda: f"{name} must be on q's device {q.device}, got {x.device}")
    _require(num_qk_heads > 0 and num_v_heads % num_qk_heads == 0,
             lambda: f"v's head count Hv={num_v_heads} must be a multiple of q's head count Hqk={num_qk_heads}")
    _require(0 < head_k <= MAX_HEAD_DIM, lambda: f"q's head dimension K must be in [1, {MAX_HEAD_DIM}], got {head_k}")
    _require(0 < head_v <= MAX_HEAD_DIM, lambda: f"v's head dimension V must be in [1, {MAX_HEAD_DIM}], got {head_v}")

    if scale is None:
        scale = head_k**-0.5
    _require(isinstance(scale, (int, float)) and not isinstance(scale, bool),
             lambda: f"scale must be a Python float or None, got {type(scale).__name__}", TypeError)
    _require(math.isfinite(scale), lambda: f"scale must be finite, got {scale}")

    if cu_seqlens is not None:
        num_seqs = check_cu_seqlens(cu_seqlens, seq_len, batch, validate_cu_seqlens)
        _require(cu_seqlens.device.type == "cpu" or cu_seqlens.device == q.device,
                 f"cu_seqlens must be on q's device {q.device} or on the CPU, got {cu_seqlens.device}")
    else:
        num_seqs = batch

    if initial_state is not None:
        _require(isinstance(initial_state, torch.Tensor), "initial_state must be a torch.Tensor or None", TypeError)
        expected = (num_seqs, num_v_heads, head_v, head_k) if state_v_first else (num_seqs, num_v_heads, head_k, head_v)
        layout = "[N, Hv, V, K] (state_v_first=True)" if state_v_first else "[N, Hv, K, V]"
        _require(tuple(initial_state.shape) == expected,
                 lambda: f"initial_state must be {layout} = {expected}, got {tuple(initial_state.shape)}")
        _require(initial_state.dtype in FLOAT_DTYPES, lambda: f"initial_state must be floating, got {initial_state.dtype}", TypeError)
        _require(initial_state.device == q.device, lambda: f"initial_state must be on q's device {q.device}, got {initial_state.device}")

    return Problem(batch, seq_len, num_qk_heads, num_v_heads, head_k, head_v, num_seqs, float(scale))
