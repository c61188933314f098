"""Hopper backward launcher.

``backward_stages`` runs prepare_wu (W, A_g, A_r, gamma, inverse norms), ``chunk_states`` (every
chunk's start state h and V_new, forming U = A_g V), ``state_grads_roles`` (every chunk's
end-state gradient dh, dV_new and dh0, forming the state-free part of dV_new, M^T dO, in a
producer warpgroup; with ``FLASH_GDN_STATE_GRADS_ROLES=0`` the chunk-parallel ``local_dv`` writes
M^T dO and the pipelined ``state_grads`` reads it), ``wy_grads`` (dv, dbeta and half (a)'s dk and
dgamma terms) and ``qk_grads`` (dq and dk summed over each group of value heads with the L2
norm's backward, and dg). ``hopper_backward`` puts the results in the caller's dtypes and
state layout.
No host synchronisation. The decisions below and the kernels of a configuration are made once
(``BackwardConfig``, kept per configuration), and a small call's intermediates are kept for the
next call on its stream and thread (``_KEPT``): a repeat call is its outputs and the launches.

Context parallelism (DESIGN section 4) for the two sequential stages when sequences x heads
underfill the GPU, with the forward's segments: ``chunk_states`` runs over segments from the
scanned segment start states; ``state_grads`` is linear in its incoming gradient with the
transposed transition (dS_start = M^T dS_end + b), so a first pass over every segment from
zero gives b, a reverse scan gives each segment's dS_end, and a second pass writes dh and
dV_new. Where gates decay (``truncate_opted``), both directions truncate as the forward does:
the recomputed states' transitions at a segment's last chunks (the forward scan takes h alone),
the state gradients' at its first chunks (the first pass walks only those, the reverse scan
takes b alone); ``segment_state`` forms M only where a scan reads it (docs/performance.md s39).

``chunk_states`` and the state-gradient pass read none of each other's outputs (the state
gradients need Q, K, W, dO and, without the roles kernel, the local dV; not h or V_new), so
when the chunk states are recomputed the two run side by side, joined before wy_grads, the
first reader of h. Each alone underfills the GPU when sequences x heads are few; together they
share it (s40: on the long rows they share memory bandwidth, and side by side take about as long
as one after the other; docs/performance.md). The
gradient chain (the state-gradient passes, and local_dv before them where it runs) runs on a
second stream, and chunk_states waits for local_dv where it runs: local_dv is chunk-parallel
and fills the GPU, so beside chunk_states (one wave of CTAs or less) it ran on the SMs left
over, at up to twice its time, and delayed state_grads, the longer of the two sequential
passes, by as much (docs/performance.md, s27).
The second stream is forked from and joined to the caller's, so a CUDA-graph capture
records the two branches.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ..env import env_get
from ..planning import capturing, chunk_capacity, current_stream_handle, plan_for
from ..validation import Problem
from .chunk_states import build_chunk_states
from .context_parallel import backward_segment_chunks_for, num_sms, segment_target
from .launch import Launcher
from .local_dv import build_local_dv
from .plan_kernels import build_cut_pieces, build_sequence_prefix
from .prebuild import build_together, start_ahead
from .prepare_wu import (BACKWARD_FROM_INVERSE_OUTPUTS, BACKWARD_OUTPUTS, NO_OUTPUTS, build_prepare_wu, factors_buffer,
                         kernel_inputs, launch_prepare, prepare_buffers, token_views, with_bound, without_au,
                         without_bound, without_w)
from .qk_grads import build_qk_grads
from .segment_scan import build_segment_scan
from .segment_state import build_segment_state, no_starts, no_truncation, transition_sources
from .state_grads import build_state_grads
from .state_grads_roles import build_state_grads_roles
from .tiles import CHUNK, TL_DTYPE, kernel_gate_dtype
from .wy_grads import build_wy_grads


CONCURRENT_CHUNK_STATES = True  # chunk_states beside the state-gradient pass (off: one stream)


def truncate_opted() -> bool:
    """CP's segment passes truncated where gates decay (segment_state's windows at both ends of a
    segment); ``FLASH_GDN_CP_TRUNCATE=0``: exact transitions, every M computed and scanned."""
    return env_get("FLASH_GDN_CP_TRUNCATE", "1") != "0"


def roles_opted() -> bool:
    """The state-gradient passes form M^T dO themselves (``state_grads_roles``: a producer
    warpgroup beside the state warpgroups, no ``local_dv`` pass); ``FLASH_GDN_STATE_GRADS_ROLES=0``:
    ``local_dv`` and the pipelined ``state_grads``."""
    return env_get("FLASH_GDN_STATE_GRADS_ROLES", "1") != "0"


_gradient_streams: dict[int, torch.cuda.Stream] = {}


def _gradient_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of the gradient chain (one per device, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _gradient_streams:
        _gradient_streams[index] = torch.cuda.Stream(device=index)
    return _gradient_streams[index]


_kept_events = threading.local()


def _fork_join_events(device: torch.device, fresh: bool) -> tuple[torch.cuda.Event, ...]:
    """The four events that fork the gradient chain off the caller's stream and join it back
    (fork, local_dv done, transitions ready, join). Made once per thread and device and
    reused: a stream's wait takes the event's state when it is enqueued, so recording it again
    in a later call cannot change an earlier wait, and one thread's calls record them in
    order (each ~3 us of host time made anew, as ``Stream.wait_stream`` does). ``fresh``
    (CUDA-graph capture): new ones, so that no event recorded into a graph is kept."""
    if fresh:
        return tuple(torch.cuda.Event() for _ in range(4))
    pool = getattr(_kept_events, "by_device", None)
    if pool is None:
        pool = _kept_events.by_device = {}
    events = pool.get(device)
    if events is None:
        events = pool[device] = tuple(torch.cuda.Event() for _ in range(4))
    return events


_placeholders: dict[tuple, torch.Tensor] = {}


def _state_placeholder(device: torch.device, num_v_heads: int, head_k: int, head_v: int) -> torch.Tensor:
    """One fp32 state per value head, never read: stands in for a kernel's optional state
    argument where none was given (made once per device and shape, so no allocation on the hot
    path; the kernel's loads of it are bounds-guarded as well as skipped by its flag)."""
    key = (device, num_v_heads, head_k, head_v)
    placeholder = _placeholders.get(key)
    if placeholder is None:
        placeholder = torch.zeros(1, num_v_heads, head_k, head_v, dtype=torch.float32, device=device)
        if not capturing(device):  # (not from a graph's memory pool)
            _placeholders[key] = placeholder
    return placeholder


STATE_BLOCKS = (16, 32, 64)  # column splits of the sequential stages at V = 128, narrowest first
SHORT_RUN_CHUNKS = 32  # runs this short (chunks on average) take 32 columns a CTA where one wave holds them


def state_block_v(head_v: int, num_runs: int, num_v_heads: int, device: torch.device,
                  run_chunks: int | None = None) -> int:
    """State columns per CTA in the sequential stages (``chunk_states``, ``state_grads``; the
    columns of a state evolve independently, so any split is exact).

    At V = 128 where runs (sequences; CP takes half of V, ``_sequential_layout``) x value heads leave SMs idle: the
    narrowest block of ``STATE_BLOCKS`` with which this pass and ``chunk_states`` beside it
    (two streams) together stay within one CTA per SM, else half of V. A CTA's chunk
    step is a chain of dependent products, so a narrower block shortens it less than it
    narrows it and pays only where SMs would otherwise idle. Two refinements, measured: where
    64-column CTAs of the two passes would not fit one wave together (4 x runs x heads > SMs),
    all of V; and runs of at most ``SHORT_RUN_CHUNKS`` chunks (``run_chunks``: the average, from
    shapes) take 32 columns (this pass alone then fits one wave), their time being mostly the
    fill and drain of the chain. (b22 took all of V only where 64-column CTAs of this pass alone
    would not fit, 2 x runs x heads > SMs; s66 widened that: at 64 columns the two passes ran
    one after the other, the SMs holding the first pass's CTAs,
    at 128 side by side (H200, backward kernel time, ms, 128 / 64 columns: 16/32 x 16384x2
    2.264 / 2.354, 16/32 x 4096x2 0.589 / 0.613, 8/16 x 8192x4 1.153 / 1.178, 8/16 x 2048x4
    0.310 / 0.326, 4/8 x 4096x8 0.591 / 0.622, 4/8 x 1024x8 0.172 / 0.180; b22 had measured
    8/16 x 8192x4 the other way, 1.735 / 1.694, before W was formed in the passes at all of V).)
    Measured (H200, backward kernel time, CP off, ms, blocks of 64 / 32 / 16 columns): 8/16 x
    1x32768 2.168 / 1.890 / 2.178, 8/16 x 1x8192 0.581 / 0.516 / 0.573, 4/8 x 1x32768 1.606 /
    1.297 / 1.153, 16/32 x 1x8192 0.887 / 0.932 / 1.112, 4/8 x 8192x4 0.896 / 0.940 (128:
    1.035), 8/16 x 8192x4 1.694 / 1.850 (128: 1.735); 128 / 64 columns: 8/16 x 1024x8 0.453 /
    0.468, 16/32 x 2048x4 0.861 / 0.874; 64 / 32: 2/4 x 1024x8 0.160 / 0.147, 16/32 x 1x2048
    0.284 / 0.267, 16/32 x 1x4096 0.480 / 0.493."""
    if head_v != 128:
        return head_v
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, ctas = num_sms(index), num_runs * num_v_heads
    for block in STATE_BLOCKS[:-1]:
        if 2 * ctas * (head_v // block) <= sms:
            return block
    if 2 * ctas * (head_v // STATE_BLOCKS[-1]) > sms:
        return head_v  # (s66: the two passes side by side in one wave)
    if run_chunks is not None and run_chunks <= SHORT_RUN_CHUNKS:
        return 32  # (this pass alone fits a wave at 32 columns: 4 x runs x heads <= SMs here)
    return STATE_BLOCKS[-1]


# The sequential passes read no W where all of V is one CTA's and CP is off: there the two of them
# fill every SM side by side and are bound by memory traffic (s57, Nsight Compute, H200, 16/32 x
# 8192x4: each at 79 % of DRAM bandwidth on its own, 423 and 438 us, and 794 us side by side), so
# W's 16 KB a chunk and value head is worth more work a chunk. ``chunk_states`` forms V_new from K
# and A_g (its ``form_w``: one more product on its chain); ``state_grads_roles``' producer forms W
# from K and A_g (which ``chunk_states`` reads too) a chunk ahead, off the chain, so ``prepare_wu``
# writes no W (``without_w``). Narrower blocks are chosen where SMs would idle, i.e. where the chains set the pace.
FORM_W = True


def chunk_states_form_w(cp: bool, block_v: int, head_v: int) -> bool:
    """Whether ``chunk_states`` forms W S itself (``FORM_W``). At V = 128 only: there all of V a CTA
    means that runs x heads fill the SMs (``state_block_v``); at other V the block is always all
    of V, whatever the fill, and this has not been measured."""
    return FORM_W and not cp and head_v == 128 and block_v == head_v


def state_grads_form_w(cp: bool, block_v: int, head_v: int, roles: bool, prepare: bool) -> bool:
    """Whether the state-gradient pass forms W from K and A_g (``FORM_W``): ``state_grads_roles`` (at all
    of V = 128 a CTA, two state warpgroups), behind this backward's own ``prepare_wu`` (the
    saved-state forward keeps W)."""
    return chunk_states_form_w(cp, block_v, head_v) and roles and prepare


def backward_stages(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens,
                    saved: dict | None = None, intermediates: bool = False, release_w: bool = False):
    """Intermediates of the backward as a dict of device tensors (shapes in
    ``reference.chunked_backward.chunked_backward(intermediates=True)``; states in the
    ``[.., K, V]`` layout). ``saved``: the forward's ``extras``; when it holds the chunk
    states (``save_chunk_states``), prepare_wu and chunk_states are skipped. With
    ``intermediates`` (tests) every stage's outputs come back too; without, each buffer is
    dropped once its last reader has been launched (A_g, W, M^T dO, dV_new: 896 B per token
    and value head at K = V = 128 off the peak; M^T dO's memory holds dK_wy instead where
    the call keeps its intermediates, ``_KEPT``) and only the gradients come back. Where the
    forward kept its chunk inverse (``saved["a_r"]``), prepare_wu reads it instead of solving
    for it again. ``release_w``: the caller will not run this backward again (autograd's, without
    ``retain_graph``): the forward's W leaves ``saved`` once its last reader is launched, as the
    backward's own would, so that it is off the call's peak."""
    saved = saved or {}
    config = backward_config(q, g, beta, dht, problem, initial_state, cu_seqlens, saved)
    return config.run(q, k, v, g, beta, do, dht, initial_state, use_l2, cu_seqlens, saved, intermediates, release_w)


class BackwardKernels(NamedTuple):
    """The kernels one backward configuration launches (None: not launched)."""

    prepare: Launcher | None  # None: the forward saved what it writes (save_chunk_states, or A_g and its factors)
    local_dv: Launcher | None  # None: the state-gradient passes form M^T dO (roles_opted)
    chunk_states: Launcher | None  # None: the forward saved the chunk states
    state_grads: Launcher  # without CP the one pass; with CP the first, from a zero gradient
    state_grads_incoming: Launcher | None  # CP: the second pass, from each segment's end gradient
    transitions: Launcher | None  # CP: segment_state
    reverse_scan: Launcher | None  # CP: the segments' end gradients
    forward_scan: Launcher | None  # CP, recomputing: the segments' start states
    wy_grads: Launcher
    qk_grads: Launcher


# Configuration -> its decisions and kernels (``BackwardConfig``). A backward of a short row runs
# 150-400 us on the GPU and an eager training step issues it from Python, so a repeat call skips
# the decisions and the builders' lookups (s30). Nothing here holds device memory, so a kept
# configuration serves any stream, thread and CUDA-graph capture.
_CONFIGS: dict[tuple, "BackwardConfig"] = {}
_CONFIGS_LOCK = threading.Lock()
CONFIGS_KEPT = 16

# (configuration, stream, thread) -> the intermediates that configuration keeps (``_Kept``) for
# its next call where small. An eager backward of a short row is host-bound (~190 us of host time
# for ~110 us of kernels at 2/8 x 1x2048 on an H200 host, ~16 allocations of it), and a training
# step repeats the same layer shapes. Reuse is safe because calls with one key run in order on
# one stream (the gradient stream forks from it and joins it within the call) and nothing
# returned aliases them. Never during CUDA-graph capture, nor when the intermediates are returned
# (tests). Kept are only the buffers that live through the call's peak anyway (the chunk states,
# dh, the local dV, which then holds dK_wy, the gate and norm factors, dgamma_wy): the ones
# whose memory a call of its own frees for its outputs (W, A_g, A_r, dV_new, the CP buffers)
# are still allocated per call, so that keeping does not raise the peak (the bench's peak
# column counts the kept ones).
_KEPT: dict[tuple, "_Kept"] = {}
KEPT_WORKSPACE_BYTES = 128 << 20  # a backward's intermediates are kept only up to this size ...
KEPT_WORKSPACE_TOTAL = 256 << 20  # ... and all kept ones up to this (oldest dropped first)


def release_configs() -> None:
    """Drop the kept decisions and intermediates of recent backward calls (tests patch the rules
    they come from)."""
    with _CONFIGS_LOCK:
        _CONFIGS.clear()
        _KEPT.clear()


def backward_config(q, g, beta, dht, problem: Problem, initial_state, cu_seqlens, saved: dict) -> "BackwardConfig":
    """The ``BackwardConfig`` of this call: a kept one for its key, or a new one (kept)."""
    gate_dtype = kernel_gate_dtype(g, beta, q.dtype)
    index_dtype = None if cu_seqlens is None else cu_seqlens.dtype
    prepared = saved.get("prepared")
    # What the forward left: its chunk states (and whether its plan has CP segments), its chunk
    # inverse (and A_g with its factors), or nothing.
    source = (("states", prepared.plan.segments is not None) if prepared is not None
              else ("a_r" in saved, "a_g" in saved, "w" in saved, "log_bound" in saved))
    key = (problem, q.dtype, gate_dtype, index_dtype, initial_state is not None, dht is not None, source, q.device,
           env_get("FLASH_GDN_CP"), env_get("FLASH_GDN_CP_SEGMENT_CHUNKS"), env_get("FLASH_GDN_CP_TRUNCATE"),
           env_get("FLASH_GDN_STATE_GRADS_ROLES"))
    config = _CONFIGS.get(key)
    if config is None:
        config = BackwardConfig(problem, q.dtype, gate_dtype, index_dtype, initial_state is not None, dht is not None,
                                saved, q.device)
        with _CONFIGS_LOCK:  # (the miss path only)
            while len(_CONFIGS) >= CONFIGS_KEPT:
                dropped = _CONFIGS.pop(next(iter(_CONFIGS)))
                for kept_key in [k for k in _KEPT if k[0] is dropped]:
                    del _KEPT[kept_key]
            _CONFIGS[key] = config
    return config


def compile_ahead(problem: Problem, dtype, gate_dtype, index_dtype, has_h0: bool, dev: torch.device,
                  kept_a_g: bool = True, kept_w: bool = False, kept_bound: bool = False) -> None:
    """At a training forward's first call of a configuration: start compiling the kernels its
    backward will launch, in forked workers left running (``prebuild.start_ahead``), so that they
    compile beside the forward's own rather than after it. Predicted as the default backward
    that follows such a forward: the chunk inverse kept (and A_g where ``kept_a_g``), the states
    recomputed, no gradient of the final state (with one, ``state_grads`` differs and is compiled
    at the backward's first call; the rest comes from the cache). Workers cannot be forked from the backward itself: it
    runs on torch's autograd thread (``prebuild.autograd_threads_running``).

    On by default since s51 (``FLASH_GDN_COMPILE_AHEAD=0`` turns it off): on the H200 host, a cold
    first training step of 16/32 x 8192x4 took 29.5 and 30.4 s with it against 45.1 and 47.9 s
    without (the forward's own first call 0.3-1.3 s longer, its backward's 16-19 s shorter;
    docs/performance.md s51). Where no backward follows, the workers compile for nothing, off
    the caller's thread."""
    if env_get("FLASH_GDN_COMPILE_AHEAD", "1") == "0":
        return
    kept = {"a_r": None, "a_g": None} if kept_a_g else {"a_r": None}
    if kept_a_g and kept_w:
        kept["w"] = None
    if kept_a_g and kept_bound:
        kept["log_bound"] = None
    config = BackwardConfig(problem, dtype, gate_dtype, index_dtype, has_h0, False, kept, dev, build=False)
    start_ahead(config.builders, config.build_key)


class _Kept(NamedTuple):
    """What a backward keeps between calls (``_KEPT``): ``prepare_wu``'s gate and norm factors
    (one ``factors_buffer``; None where the forward saved them), every chunk's start state and
    V_new (None unless recomputing), dh, the local dV (dK_wy's buffer once the state
    gradients have read it: K = V; None with ``roles_opted``, where no local dV is written and
    dK_wy, allocated once W is freed, does not live through the call's peak) and dgamma_wy."""

    factors: torch.Tensor | None
    h: torch.Tensor | None
    v_new: torch.Tensor | None
    dh: torch.Tensor
    dv_local: torch.Tensor | None
    dgamma_wy: torch.Tensor


def _kept_bytes(kept: _Kept) -> int:
    return sum(t.numel() * t.element_size() for t in kept if t is not None)


def _keep(key: tuple, kept: _Kept) -> None:
    """Keep ``kept`` under ``key`` (its configuration first), dropping the oldest kept buffers while
    all of them would exceed ``KEPT_WORKSPACE_TOTAL`` (under ``_CONFIGS_LOCK``). Sizes are each
    configuration's ``kept_size`` (s52: summing the tensors of every kept entry again at each new
    shape was the forward's twin of this, ~58 us a call on a CPU host where the packed length
    changed every call)."""
    total = key[0].kept_size
    for other in _KEPT:
        total += other[0].kept_size
    for old in list(_KEPT):
        if total <= KEPT_WORKSPACE_TOTAL:
            break
        del _KEPT[old]
        total -= old[0].kept_size
    _KEPT[key] = kept


class BackwardConfig:
    """The backward of one configuration: its decisions (context parallelism and its segments,
    the state columns per CTA, the prepare_wu variant) and kernels made once; ``run`` issues
    one call. ``saved``: the first call's forward extras, read only for what the key holds
    (which of them the forward kept)."""

    def __init__(self, problem: Problem, dtype, gate_dtype, index_dtype, has_h0: bool, has_dht: bool, saved: dict,
                 dev: torch.device, build: bool = True):
        hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
        self.problem, self.dtype, self.gate_dtype, self.dev = problem, dtype, gate_dtype, dev
        self.prepare, self.recompute = "prepared" not in saved, "h" not in saved
        max_chunks = chunk_capacity(problem.batch, problem.seq_len, problem.num_seqs, index_dtype is not None)
        self.seg_chunks = backward_segment_chunks_for(problem.num_seqs, hv, max_chunks, dev)
        self.cp, self.block_v = _sequential_layout(saved, self.seg_chunks, problem, dev)
        # two CTAs per segment and head
        self.seg_target = segment_target(2 * hv, dev) if self.seg_chunks is not None else 0
        # Reads the chunk inverse where the forward kept it (saved["a_r"]), else solves for it.
        self.outputs = BACKWARD_OUTPUTS if "a_r" not in saved else BACKWARD_FROM_INVERSE_OUTPUTS
        # CP truncated where gates decay (truncate_opted; needs prepare_wu's log bounds, so not with
        # the saved chunk states, whose transitions stay exact).
        self.truncate = self.cp and self.prepare and truncate_opted()
        if self.truncate:
            self.outputs = with_bound(self.outputs)
        self.roles = roles_opted()
        self.form_w = state_grads_form_w(self.cp, self.block_v, dv, self.roles, self.prepare)
        if self.form_w:
            self.outputs = without_w(self.outputs)
        # The forward kept A_g and its factors (``forward.DefaultForward``): prepare_wu writes no A_g,
        # and where nothing else is left for it (A_r read, no W, no bounds) it does not run.
        self.kept_a_g = self.prepare and "a_g" in saved  # (handed over with A_r: the outputs read it)
        if self.kept_a_g:
            self.outputs = without_au(self.outputs)
            # and W and the log bounds where the forward wrote them too (``forward_keeps``)
            if "w" in saved:
                self.outputs = without_w(self.outputs)
            if "log_bound" in saved:
                self.outputs = without_bound(self.outputs)
        self.from_forward = self.kept_a_g and not any(self.outputs[:5])
        self.kept_size: int | None = None  # bytes of the buffers a call keeps (``kept_buffers``)
        tl_dtype, gate_tl = TL_DTYPE[dtype], TL_DTYPE[gate_dtype]
        index_tl = None if index_dtype is None else TL_DTYPE[index_dtype]
        cp, block_v, recompute = self.cp, self.block_v, self.recompute
        builders = _kernel_builders(dk, dv, tl_dtype, gate_tl, has_h0, has_dht, cp, block_v, self.prepare, recompute,
                                    self.outputs, self.truncate, self.roles, self.form_w, self.from_forward)
        # Compiled side by side at the first use (``prebuild``), with the varlen chunk map's kernels.
        key = ("backward", dk, dv, tl_dtype, gate_tl, index_tl, self.prepare, self.outputs, recompute, cp, has_h0,
               has_dht, block_v, self.roles, self.from_forward)
        plan_builders = [lambda: build_sequence_prefix(index_tl), build_cut_pieces] if self.prepare and index_tl else []
        self.build_key = key
        self.builders = [b for b in builders if b is not None] + plan_builders
        if not build:  # (``compile_ahead``: the decisions and the builders only)
            return
        build_together(key, lambda: self.builders)
        self.kernels = BackwardKernels(*(None if b is None else b() for b in builders))

    def kept_buffers(self, plan, keep: bool, capture: bool) -> _Kept | None:
        """The buffers this call takes from ``_KEPT`` (this configuration, stream and thread): the
        kept ones, new ones kept now, or None (``keep`` off, a CUDA-graph ``capture``, too large,
        or a layout in which the local dV cannot hold dK_wy)."""
        if not keep or capture or self.problem.head_k != self.problem.head_v:
            return None
        if self.kept_size is None:  # (the same for every call of the configuration: sized on the meta device)
            self.kept_size = _kept_bytes(self._allocate_kept(plan, torch.device("meta")))
        if self.kept_size > KEPT_WORKSPACE_BYTES:
            return None
        dev = self.dev
        key = (self, current_stream_handle(dev) if dev.type == "cuda" else None, threading.get_ident())
        kept = _KEPT.get(key)
        if kept is None:
            kept = self._allocate_kept(plan, dev)
            with _CONFIGS_LOCK:
                _keep(key, kept)
        return kept

    def _allocate_kept(self, plan, dev: torch.device) -> _Kept:
        p, dtype = self.problem, self.dtype
        hv, dk, dv = p.num_v_heads, p.head_k, p.head_v
        tokens, num_chunks = p.batch * p.seq_len, plan.chunk_bounds.shape[0]
        write_bound = self.outputs[4]  # (prepare_wu's outputs: see prepare_buffers)
        factors = factors_buffer(p, num_chunks, write_bound, dev) if self.prepare and not self.from_forward else None
        h = v_new = None
        if self.recompute:
            h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
            v_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
        dv_local = None if self.roles else torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
        return _Kept(factors, h, v_new, torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev), dv_local,
                     torch.empty(hv, num_chunks, CHUNK, dtype=torch.float32, device=dev))

    def run(self, q, k, v, g, beta, do, dht, initial_state, use_l2, cu_seqlens, saved: dict, intermediates: bool,
            release_w: bool = False):
        """One backward call (``backward_stages``)."""
        p, kernels, dev, dtype = self.problem, self.kernels, self.dev, self.dtype
        batch, seq_len = p.batch, p.seq_len
        hv, dk, dv = p.num_v_heads, p.head_k, p.head_v
        tokens = batch * seq_len
        if self.prepare:
            inputs = kernel_inputs(q, k, v, g, beta, self.gate_dtype)  # (the caller's [B, T, ...] tensors)
            plan = plan_for(batch, seq_len, cu_seqlens, dev, self.seg_chunks, self.seg_target)
        else:  # the forward's (save_chunk_states; A_g was not kept)
            plan = saved["prepared"].plan
        segs = plan.segments if self.cp else None
        capture = capturing(dev)
        kept = self.kept_buffers(plan, not intermediates, capture)
        num_chunks = plan.chunk_bounds.shape[0]
        if self.from_forward:  # A_g and its factors (W, bounds) as the forward wrote them (NO_OUTPUTS: nothing new)
            buffers = prepare_buffers(p, num_chunks, dtype, dev, NO_OUTPUTS, factors=saved["factors"])
            buffers = _with_kept(buffers._replace(a_u=_kept_a_g(saved, num_chunks), a_r=saved["a_r"]), saved)
        elif self.prepare:
            buffers = prepare_buffers(p, num_chunks, dtype, dev, self.outputs, saved.get("a_r"),
                                      None if kept is None else kept.factors)
            launch_prepare(kernels.prepare, inputs, plan, buffers, use_l2)
            if self.kept_a_g:  # (what is left written here, A_g and whatever else the forward kept, the forward's)
                buffers = _with_kept(buffers._replace(a_u=_kept_a_g(saved, num_chunks)), saved)
        if self.prepare:
            k4, v4 = inputs[1:3]  # (segment_state's k and v: tiles.token_rows)
            qf, kf, vf, _, bf = token_views(inputs, p)
            # (with form_w the state-gradient pass takes A_g in W's place and chunk_states reads neither)
            w = buffers.a_u if self.form_w else buffers.w
            a_u, gamma, a_r, log_bound = buffers.a_u, buffers.gamma, buffers.a_r, buffers.log_bound
            q_norm_inv, k_norm_inv = buffers.q_norm_inv, buffers.k_norm_inv
            del inputs, buffers
        else:
            prep = saved["prepared"]
            qf, kf, vf, bf, w, a_u, gamma, a_r = prep.q, prep.k, prep.v, prep.beta, prep.w, None, prep.gamma, prep.a_r
            # (the caller's layout again, for segment_state: two views, taken only where CP runs it)
            k4, v4 = ((kf.view(batch, seq_len, *kf.shape[1:]), vf.view(batch, seq_len, *vf.shape[1:])) if self.cp
                      else (None, None))
            log_bound = None
            q_norm_inv, k_norm_inv = prep.q_norm_inv, prep.k_norm_inv
            del prep
        dof = _as(do.reshape(tokens, hv, dv), dtype).contiguous()
        runs = plan.seq_info if segs is None else segs.seg_info  # what the sequential stages walk
        h0 = None if initial_state is None else _as(initial_state, torch.float32).contiguous()
        dht32 = None if dht is None else _as(dht, torch.float32).contiguous()
        # Without CP, state_grads writes dh0 (and it stands in for absent optional arguments);
        # with CP it is gathered from the segments' start gradients.
        dh0 = torch.empty(p.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev) if segs is None else None
        recompute = self.recompute
        if not recompute:
            h, v_new = saved["h"], saved["v_new"]
        elif kept is not None:
            h, v_new = kept.h, kept.v_new
        else:
            h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
            v_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
        if segs is not None:
            capacity = segs.seg_info.shape[0]
            # Recomputing, the transitions put h_s in run_init[s + 1] and keep M alone (segment_state's
            # h_ahead), and the forward scan runs there in place; else [h | M], h unread.
            seg_state = torch.empty(capacity, hv, dk, dk if recompute else dv + dk, dtype=torch.float32, device=dev)
            run_init = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev) if recompute else None
            # dS_end one slot above the first pass's b: that pass writes b_s where the reverse scan's
            # step writes dS_end[s - 1], so the scan runs in place (segment_scan's offsets_in_out) and a
            # step truncated at the segment's start (dS_end[s - 1] = b_s) is done by the pass itself.
            # (A sequence's first segment writes into the previous sequence's last slot, and the slot
            # below the first into the spare: the scan writes those last, from dht.) b then takes the
            # second pass's start gradients.
            ends = torch.empty(capacity + 1, hv, dk, dv, dtype=torch.float32, device=dev)
            first_b, ds_end = ends[:capacity], ends[1:]
            b = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev)
        unread_bound, trunc_flags = no_truncation(dev)
        if self.truncate:  # (segment_state writes every slot's flags)
            trunc_flags = torch.empty(capacity, hv, dtype=torch.int32, device=dev)
        else:
            log_bound = unread_bound
        # The local dV (M^T dO) where local_dv writes it; the roles kernels form it themselves.
        dv_local = None
        if kernels.local_dv is not None:
            dv_local = torch.empty(tokens, hv, dv, dtype=dtype, device=dev) if kept is None else kept.dv_local
        local = () if dv_local is None else (dv_local,)  # (the state-gradient kernels' extra argument)
        dh = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev) if kept is None else kept.dh
        dv_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
        scale = p.scale

        # The gradient chain on a stream of its own, the forward-state side (segment transitions,
        # segment start states, chunk states) on the caller's; the reverse scan needs only the
        # transitions and chunk_states waits for local_dv, each announced by an event. Every buffer
        # above was allocated on the caller's stream and stays referenced until the join, so the
        # allocator cannot hand its memory out early.
        main = grads = transitions_ready = local_dv_done = None
        if CONCURRENT_CHUNK_STATES and (recompute or segs is not None):
            main, grads = torch.cuda.current_stream(dev), _gradient_stream(dev)
            fork, local_dv_done, transitions_ready, join = _fork_join_events(dev, capture)
            fork.record(main)
            grads.wait_event(fork)

        def use(stream):  # set_stream rather than the torch.cuda.stream context: the same switch for less host time
            if stream is not None:
                torch.cuda.set_stream(stream)

        try:
            use(grads)
            if dv_local is not None:
                kernels.local_dv(qf, kf, dof, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, scale, dv_local)
                if grads is not None:
                    local_dv_done.record(grads)
            if segs is None:
                # (a kernel compiled without dht does not read it: dh0 stands in)
                kernels.state_grads(qf, kf, w, dof, *local, gamma, q_norm_inv, k_norm_inv, runs,
                                    dh0 if dht32 is None else dht32, scale, dh, dv_new, dh0, log_bound)
            else:
                use(main)
                _segment_transitions(kernels.transitions, k4, w, v4, a_u, gamma, k_norm_inv, segs, seg_state,
                                     recompute, log_bound, trunc_flags, run_init)
                if grads is not None:
                    transitions_ready.record(main)
                use(grads)
                # dS_start = M^T dS_end + b over a segment (context_parallel.py): b from zero, a reverse
                # scan for every segment's dS_end, then the pass that writes dh and dV_new for real
                # (it overwrites the first pass's). Truncated, b comes from a segment's leading window
                # where it has one, and the scan takes b alone there (segment_state's flags).
                kernels.state_grads(qf, kf, w, dof, *local, gamma, q_norm_inv, k_norm_inv, runs, first_b, scale, dh,
                                    dv_new, first_b, log_bound)
                if grads is not None:
                    grads.wait_event(transitions_ready)
                kernels.reverse_scan(seg_state, ds_end, segs.seg_meta, ds_end if dht32 is None else dht32,
                                     trunc_flags, ds_end)
                kernels.state_grads_incoming(qf, kf, w, dof, *local, gamma, q_norm_inv, k_norm_inv, runs, ds_end,
                                             scale, dh, dv_new, b, unread_bound)
            use(main)
            if recompute:
                if segs is not None:
                    kernels.forward_scan(seg_state, run_init, segs.seg_meta, run_init if h0 is None else h0,
                                         trunc_flags, run_init)
                if grads is not None and dv_local is not None:
                    main.wait_event(local_dv_done)
                init = h0 if segs is None else run_init
                # (where the state-gradient pass takes A_g in W's place, chunk_states forms W S too and
                # reads no W: any tensor of W's rank stands in)
                kernels.chunk_states(kf, kf if self.form_w else w, vf, a_u, gamma, k_norm_inv, runs,
                                     dh0 if init is None else init, h, v_new)
        finally:
            use(main)
        if grads is not None:
            join.record(grads)
            main.wait_event(join)
        if segs is not None:
            # Each sequence's start-state gradient, gathered only when someone reads it (a call
            # without an initial state returns none: the gather is ~60 us of host time).
            dh0 = b.index_select(0, segs.first_seg) if h0 is not None or intermediates else None
            del b, ends, first_b, ds_end, seg_state, run_init
        del w, dv_local, a_u
        if release_w:  # (read on both streams: freed after the join, as the backward's own W is)
            saved.pop("w", None)

        dv_out = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
        if kept is None or kept.dv_local is None:  # (allocated once W, A_g and the local dV are freed)
            dk_wy = torch.empty(tokens, hv, dk, dtype=dtype, device=dev)
        else:  # the local dV's buffer (read for the last time by the state gradients, joined above; K = V)
            dk_wy = kept.dv_local
        if kept is None:
            dgamma_wy = torch.empty(hv, num_chunks, CHUNK, dtype=torch.float32, device=dev)
        else:
            dgamma_wy = kept.dgamma_wy
        del kept
        dbeta = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
        dg = torch.empty(tokens, hv, dtype=torch.float32, device=dev)  # zeroed by wy_grads, summed by qk_grads
        kernels.wy_grads(kf, vf, bf, gamma, k_norm_inv, int(use_l2), plan.chunk_bounds, a_r, h, dv_new, dv_out, dk_wy,
                         dbeta, dgamma_wy, dg)
        del a_r
        if not intermediates:
            dv_new = None

        hqk = p.num_qk_heads
        dq = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
        dk_out = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
        # <S, dS'> takes h0 and dht in fp32 where a chunk's state is one of them (qk_grads).
        absent = _state_placeholder(dev, hv, dk, dv)
        kernels.qk_grads(
            qf, kf, dof, v_new, h, dh, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, plan.chunk_seq, plan.seq_info,
            absent if h0 is None else h0, absent if dht32 is None else dht32, int(h0 is not None),
            int(dht32 is not None), dk_wy, dgamma_wy, scale, int(use_l2), dq, dk_out, dg,
        )
        out = dict(dh0_all=dh0, dv=dv_out.view(batch, seq_len, hv, dv), dbeta=dbeta.view(batch, seq_len, hv),
                   dq=dq.view(batch, seq_len, hqk, dk), dk=dk_out.view(batch, seq_len, hqk, dk),
                   dg=dg.view(batch, seq_len, hv))
        if intermediates:
            out.update(h=h, v_new=v_new.view(batch, seq_len, hv, dv), dh=dh, dv_new=dv_new.view(batch, seq_len, hv, dv),
                       chunk_bounds=plan.chunk_bounds, dk_wy=dk_wy.view(batch, seq_len, hv, dk),
                       dgamma_wy_chunks=dgamma_wy)
        return out


def _kept_a_g(saved: dict, num_chunks: int) -> torch.Tensor:
    """The forward's A_g, checked against the backward's plan (chunks are numbered by sequence
    alone, so both plans number them alike; a mismatch is a caller's mix-up of saved extras)."""
    a_g = saved["a_g"]
    if a_g.shape[0] != num_chunks:
        raise ValueError(f"the forward's A_g has {a_g.shape[0]} chunks, the backward's plan {num_chunks}")
    return a_g


def _with_kept(buffers, saved: dict):
    """``buffers`` with the W and log bounds a training forward kept (``forward_keeps``), where it did."""
    if "w" in saved:
        buffers = buffers._replace(w=saved["w"])
    if "log_bound" in saved:
        buffers = buffers._replace(log_bound=saved["log_bound"])
    return buffers


def forward_keeps(problem: Problem, dtype, gate_dtype, index_dtype, has_h0: bool, dev: torch.device) -> tuple[bool, bool]:
    """(W, the log bounds): what a training forward that keeps A_g should also write for the backward
    that follows it, so that this backward runs no ``prepare_wu`` at all: W where the state passes
    read it (not where they form it themselves, ``state_grads_form_w``), the bounds where CP
    truncates (``truncate_opted``). Decided from shapes, as the backward decides (its
    ``BackwardConfig`` for such a forward); ``FLASH_GDN_KEEP_W=0``: neither (the backward forms them).
    W costs 2 K bytes per token and value head between the forward and the backward (256 at K =
    128: A_r and A_g together take as much); docs/performance.md s70."""
    if env_get("FLASH_GDN_KEEP_W", "1") == "0":
        return False, False
    config = BackwardConfig(problem, dtype, gate_dtype, index_dtype, has_h0, False, {"a_r": None, "a_g": None}, dev,
                            build=False)
    return config.outputs[3], config.outputs[4]


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (``.to`` only where it converts: a no-op ``.to`` still costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def _sequential_layout(saved: dict, seg_chunks: int | None, problem: Problem, dev: torch.device) -> tuple[bool, int]:
    """(context parallelism on, state columns per CTA) of the sequential stages, from shapes.

    Context parallelism (as in the forward) when ``seg_chunks`` asks for it; with the forward's
    saved plan, only if that plan has segments (CP off in the forward: the backward runs
    without). CP segments are sized for two CTAs of half of V per segment and head
    (``context_parallel.backward_segment_chunks_for``); without CP, ``state_block_v``."""
    cp = seg_chunks is not None and ("prepared" not in saved or saved["prepared"].plan.segments is not None)
    if cp:
        return cp, min(problem.head_v, STATE_BLOCKS[-1])
    # the average sequence's chunks
    run_chunks = -(-problem.batch * problem.seq_len // (CHUNK * max(1, problem.num_seqs)))
    return cp, state_block_v(problem.head_v, problem.num_seqs, problem.num_v_heads, dev, run_chunks)


def _kernel_builders(dk, dv, tl_dtype, gate_dtype, has_h0, has_dht, cp, block_v, prepare, recompute,
                     outputs, truncate=False, roles=True, form_w=False, from_forward=False) -> BackwardKernels:
    """``BackwardKernels`` of zero-argument builders (None: not launched): the one place that
    picks the backward's variants. ``outputs``: the prepare_wu variant; ``truncate``: CP's
    transitions, scans and first state-gradient pass truncated where gates decay; ``roles``: the
    state-gradient passes form M^T dO (``state_grads_roles``, no ``local_dv``); ``form_w``: the
    state-gradient pass forms W from K and A_g (``state_grads_form_w``); ``from_forward``: the forward
    kept all that ``prepare_wu`` would write (it is not launched)."""
    grads = build_state_grads_roles if roles else build_state_grads
    grads_options = dict(form_w=True) if form_w else {}
    return BackwardKernels(
        prepare=(lambda: build_prepare_wu(dk, dv, tl_dtype, gate_dtype, *outputs)) if prepare and not from_forward else None,
        local_dv=None if roles else (lambda: build_local_dv(dk, dv, tl_dtype)),
        # Kernels compiled without an initial state / dht do not read that argument.
        chunk_states=((lambda: build_chunk_states(dk, dv, tl_dtype, has_h0 or cp, block_v,
                                                  form_w=chunk_states_form_w(cp, block_v, dv))) if recompute else None),
        state_grads=lambda: grads(dk, dv, tl_dtype, has_dht and not cp, block_v, window=truncate, **grads_options),
        state_grads_incoming=(lambda: grads(dk, dv, tl_dtype, True, block_v)) if cp else None,
        # The scans run in place (offsets_in_out): the transitions put each h_s where the forward scan
        # writes S_start[s + 1] (h_ahead, recomputing), the first state-gradient pass each b_s where the
        # reverse scan writes dS_end[s - 1] (its buffers: hopper backward).
        transitions=((lambda: build_segment_state(dk, dv, tl_dtype, recompute, truncate=truncate,
                                                  reverse_window=truncate, h_ahead=recompute)) if cp else None),
        reverse_scan=((lambda: build_segment_scan(dk, dv, has_dht, reverse=True, truncated=truncate,
                                                  offsets_in_out=True, m_alone=recompute)) if cp else None),
        forward_scan=((lambda: build_segment_scan(dk, dv, has_h0, truncated=truncate, offsets_in_out=True,
                                                  m_alone=True)) if cp and recompute else None),
        wy_grads=lambda: build_wy_grads(dk, dv, tl_dtype, gate_dtype),
        qk_grads=lambda: build_qk_grads(dk, dv, tl_dtype),
    )


def _segment_transitions(kernel: Launcher, k, w, v, a_u, gamma, k_norm_inv, segs, seg_state, recompute, log_bound,
                         trunc_flags, run_init):
    """Every segment's M into ``seg_state`` (the reverse scan needs each M but the first's;
    truncated, only those the scans read, and ``trunc_flags`` says which) and, recomputing, its h
    into ``run_init``'s next slot (``segment_state``'s ``h_ahead``), U = A_g V formed in the kernel.
    With saved chunk states only M is needed and A_g was not kept: the variant that reads U runs
    with W (same shape, K = V) in its place, and the h columns of ``seg_state`` come out
    meaningless and unread."""
    sources = transition_sources(v=v, a_u=a_u) if recompute else transition_sources(u=w)
    starts = run_init if recompute else no_starts(k.device)
    kernel(k, w, *sources, gamma, k_norm_inv, segs.seg_info, log_bound, seg_state, trunc_flags, starts)


def hopper_backward(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens, state_v_first,
                    saved: dict | None = None, release_w: bool = False):
    """(dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes; states in the caller's layout
    (``release_w``: ``backward_stages``')."""
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    if dht is not None and state_v_first:
        dht = dht.transpose(-1, -2)
    out = backward_stages(q, k, v, g, beta, do, dht, problem, h0, use_l2, cu_seqlens, saved, release_w=release_w)
    dh0 = None
    if initial_state is not None:
        dh0 = out["dh0_all"].transpose(-1, -2) if state_v_first else out["dh0_all"]
        dh0 = _as(dh0, initial_state.dtype)
    return (out["dq"], out["dk"], _as(out["dv"], v.dtype), _as(out["dg"], g.dtype), _as(out["dbeta"], beta.dtype), dh0)
