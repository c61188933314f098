"""Hopper backward launcher.

``backward_stages`` runs prepare_wu (W, A_g, A_r, gamma, inverse norms), ``chunk_states`` (every
chunk's start state h and V_new, forming U = A_g V), ``local_dv`` (the state-free part of dV_new),
``state_grads`` (every chunk's end-state gradient dh,
dV_new and dh0), ``wy_grads`` (dv, dbeta and half (a)'s dk and dgamma terms) and
``qk_grads`` (dq and dk summed over each group of value heads with the L2 norm's backward,
and dg). ``hopper_backward`` puts the results in the caller's dtypes and state layout.
No host synchronisation.

Context parallelism (DESIGN section 4) for the two sequential stages when sequences x heads
underfill the GPU, with the forward's segments: ``chunk_states`` runs over segments from the
scanned segment start states; ``state_grads`` is linear in its incoming gradient with the
transposed transition (dS_start = M^T dS_end + b), so a first pass over every segment from
zero gives b, a reverse scan gives each segment's dS_end, and a second pass writes dh and
dV_new.

``chunk_states`` and the state-gradient pass read none of each other's outputs (the state
gradients need Q, K, W, dO and the local dV, not h or V_new), so when the chunk states are
recomputed the two run side by side, joined before wy_grads, the first reader of h. Each
alone underfills the GPU when sequences x heads are few; together they share it. The
gradient chain (local_dv, then state_grads) runs on a second stream and chunk_states waits
for local_dv: local_dv is chunk-parallel and fills the GPU, so beside chunk_states (one
wave of CTAs or less) it ran on the SMs left over, at up to twice its time, and delayed
state_grads, the longer of the two sequential passes, by as much (docs/performance.md, s27).
The second stream is forked from and joined to the caller's, so a CUDA-graph capture
records the two branches.
"""

from __future__ import annotations

import torch

from ..planning import capturing, chunk_capacity
from ..validation import Problem
from .chunk_states import build_chunk_states
from .context_parallel import backward_segment_chunks_for, num_sms, segment_target
from .local_dv import build_local_dv
from .plan_kernels import build_cut_pieces, build_sequence_prefix
from .prebuild import build_together
from .prepare_wu import BACKWARD_FROM_INVERSE_OUTPUTS, BACKWARD_OUTPUTS, build_prepare_wu, run_prepare
from .qk_grads import build_qk_grads
from .segment_scan import build_segment_scan
from .segment_state import build_segment_state, no_truncation, transition_sources
from .state_grads import build_state_grads
from .tiles import CHUNK, TL_DTYPE, kernel_gate_dtype
from .wy_grads import build_wy_grads


CONCURRENT_CHUNK_STATES = True  # chunk_states beside the state-gradient pass (off: one stream)
_gradient_streams: dict[int, torch.cuda.Stream] = {}


def _gradient_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of the gradient chain (one per device, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _gradient_streams:
        _gradient_streams[index] = torch.cuda.Stream(device=index)
    return _gradient_streams[index]


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
    narrows it and pays only where SMs would otherwise idle. Two refinements (b22, measured):
    where half-V CTAs of this pass alone would not fit in one wave (2 x runs x heads > SMs), all
    of V; and runs of at most ``SHORT_RUN_CHUNKS`` chunks (``run_chunks``: the average, from
    shapes) take 32 columns as long as this pass alone fits in one wave, their time being
    mostly the fill and drain of the chain.
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
    if 2 * ctas > sms:
        return head_v
    for block in STATE_BLOCKS[:-1]:
        if 2 * ctas * (head_v // block) <= sms:
            return block
    if run_chunks is not None and run_chunks <= SHORT_RUN_CHUNKS and ctas * (head_v // 32) <= sms:
        return 32
    return STATE_BLOCKS[-1]


def backward_stages(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens,
                    saved: dict | None = None, intermediates: bool = False):
    """Intermediates of the backward as a dict of device tensors (shapes in
    ``reference.chunked_backward.chunked_backward(intermediates=True)``; states in the
    ``[.., K, V]`` layout). ``saved``: the forward's ``extras``; when it holds the chunk
    states (``save_chunk_states``), prepare_wu and chunk_states are skipped. With
    ``intermediates`` (tests) every stage's outputs come back too; without, each buffer is
    dropped once its last reader has been launched (A_g, W, M^T dO, dV_new: 896 B per token
    and value head at K = V = 128 off the peak) and only the gradients come back. Where the
    forward kept its chunk inverse (``saved["a_r"]``), prepare_wu reads it instead of solving
    for it again."""
    batch, seq_len = problem.batch, problem.seq_len
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    tokens, dtype, dev = batch * seq_len, q.dtype, q.device
    tl_dtype = TL_DTYPE[dtype]
    saved = saved or {}
    max_chunks = chunk_capacity(batch, seq_len, problem.num_seqs, cu_seqlens is not None)
    seg_chunks = backward_segment_chunks_for(problem.num_seqs, hv, max_chunks, dev)
    cp, block_v = _sequential_layout(saved, seg_chunks, problem, dev)
    # Reads the chunk inverse where the forward kept it (saved["a_r"]), else solves for it.
    outputs = BACKWARD_OUTPUTS if "a_r" not in saved else BACKWARD_FROM_INVERSE_OUTPUTS
    _build_kernels(problem, tl_dtype, TL_DTYPE[kernel_gate_dtype(g, beta, dtype)], cu_seqlens, initial_state, dht,
                   cp, block_v, saved, outputs)
    # Recomputing, chunk_states and the segment transitions form U = A_g V themselves.
    prep = saved.get("prepared") or run_prepare(
        q, k, v, g, beta, problem, cu_seqlens, use_l2, seg_chunks, outputs,
        seg_target=segment_target(2 * hv, dev) if seg_chunks is not None else 0,  # two CTAs per segment and head
        a_r=saved.get("a_r"))
    qf, kf, vf, bf, w, a_u, gamma, a_r = prep.q, prep.k, prep.v, prep.beta, prep.w, prep.a_u, prep.gamma, prep.a_r
    q_norm_inv, k_norm_inv, plan = prep.q_norm_inv, prep.k_norm_inv, prep.plan
    del prep
    num_chunks = plan.chunk_bounds.shape[0]
    dof = do.reshape(tokens, hv, dv).to(dtype).contiguous()
    segs = plan.segments if cp else None
    runs = plan.seq_info if segs is None else segs.seg_info  # what the sequential stages walk
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    dht32 = None if dht is None else dht.to(torch.float32).contiguous()
    # Without CP, state_grads writes dh0 (and it stands in for absent optional arguments);
    # with CP it is gathered from the segments' start gradients.
    dh0 = torch.empty(problem.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev) if segs is None else None
    recompute = "h" not in saved
    if recompute:
        h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
        v_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    else:
        h, v_new = saved["h"], saved["v_new"]
    if segs is not None:
        capacity = segs.seg_info.shape[0]
        seg_state = torch.empty(capacity, hv, dk, dv + dk, dtype=torch.float32, device=dev)
        run_init = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev) if recompute else None
        b = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev)
        ds_end = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev)
    dv_local = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dh = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
    dv_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)

    def state_grads(info, incoming, start_grad):
        # incoming: the gradient of each run's end state (None: zero); start_grad receives
        # the gradient of each run's start state.
        build_state_grads(dk, dv, tl_dtype, incoming is not None, block_v)(
            qf, kf, w, dof, dv_local, gamma, q_norm_inv, k_norm_inv, info, start_grad if incoming is None else incoming,
            problem.scale, dh, dv_new, start_grad,
        )

    # The gradient chain on a stream of its own, the forward-state side (segment transitions,
    # segment start states, chunk states) on the caller's; the reverse scan needs only the
    # transitions and chunk_states waits for local_dv, each announced by an event. Every buffer
    # above was allocated on the caller's stream and stays referenced until the join, so the
    # allocator cannot hand its memory out early.
    main = grads = transitions_ready = local_dv_done = None
    if CONCURRENT_CHUNK_STATES and (recompute or segs is not None):
        main, grads = torch.cuda.current_stream(dev), _gradient_stream(dev)
        grads.wait_stream(main)

    def use(stream):  # set_stream rather than the torch.cuda.stream context: the same switch for less host time
        if stream is not None:
            torch.cuda.set_stream(stream)

    try:
        use(grads)
        build_local_dv(dk, dv, tl_dtype)(qf, kf, dof, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, problem.scale,
                                         dv_local)
        if grads is not None:
            local_dv_done = torch.cuda.Event()
            local_dv_done.record(grads)
        if segs is not None:
            use(main)
            _segment_transitions(kf, w, vf, a_u, gamma, k_norm_inv, segs, seg_state, recompute, problem, tl_dtype)
            if grads is not None:
                transitions_ready = torch.cuda.Event()
                transitions_ready.record(main)
            use(grads)
        if segs is None:
            state_grads(plan.seq_info, dht32, dh0)
        else:
            # dS_start = M^T dS_end + b over a segment (context_parallel.py): b from zero, a reverse
            # scan for every segment's dS_end, then the pass that writes dh and dV_new for real
            # (it overwrites the first pass's).
            state_grads(segs.seg_info, None, b)
            if transitions_ready is not None:
                grads.wait_event(transitions_ready)
            build_segment_scan(dk, dv, dht32 is not None, reverse=True)(
                seg_state, b, segs.seg_meta, ds_end if dht32 is None else dht32, no_truncation(dev)[1], ds_end
            )
            state_grads(segs.seg_info, ds_end, b)
        use(main)
        if recompute:
            if segs is not None:
                build_segment_scan(dk, dv, h0 is not None)(seg_state, seg_state, segs.seg_meta,
                                                            run_init if h0 is None else h0, no_truncation(dev)[1],
                                                            run_init)
            if local_dv_done is not None:
                main.wait_event(local_dv_done)
            init = h0 if segs is None else run_init
            # Kernels compiled without an initial state / dht do not read that argument (dh0 stands in).
            build_chunk_states(dk, dv, tl_dtype, init is not None, block_v)(
                kf, w, vf, a_u, gamma, k_norm_inv, runs, dh0 if init is None else init, h, v_new
            )
    finally:
        use(main)
    if grads is not None:
        main.wait_stream(grads)
    if segs is not None:
        # Each sequence's start-state gradient, gathered only when someone reads it (a call
        # without an initial state returns none: the gather is ~60 us of host time).
        dh0 = b.index_select(0, segs.first_seg) if h0 is not None or intermediates else None
        del b, ds_end, seg_state, run_init
    del w, dv_local, a_u

    dv_out = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dk_wy = torch.empty(tokens, hv, dk, dtype=dtype, device=dev)
    dbeta = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    dgamma_wy = torch.empty(hv, num_chunks, CHUNK, dtype=torch.float32, device=dev)
    dg = torch.empty(tokens, hv, dtype=torch.float32, device=dev)  # zeroed by wy_grads, summed by qk_grads
    build_wy_grads(dk, dv, tl_dtype, TL_DTYPE[bf.dtype])(
        kf, vf, bf, gamma, k_norm_inv, plan.chunk_bounds, a_r, h, dv_new, dv_out, dk_wy, dbeta, dgamma_wy, dg
    )
    del a_r
    if not intermediates:
        dv_new = None

    hqk = problem.num_qk_heads
    dq = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
    dk_out = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
    # <S, dS'> takes h0 and dht in fp32 where a chunk's state is one of them (qk_grads).
    absent = _state_placeholder(dev, hv, dk, dv)
    build_qk_grads(dk, dv, tl_dtype)(
        qf, kf, dof, v_new, h, dh, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, plan.chunk_seq, plan.seq_info,
        absent if h0 is None else h0, absent if dht32 is None else dht32, int(h0 is not None),
        int(dht32 is not None), dk_wy, dgamma_wy, problem.scale, int(use_l2), dq, dk_out, dg,
    )
    grads = dict(dh0_all=dh0, dv=dv_out.view(batch, seq_len, hv, dv), dbeta=dbeta.view(batch, seq_len, hv),
                 dq=dq.view(batch, seq_len, hqk, dk), dk=dk_out.view(batch, seq_len, hqk, dk),
                 dg=dg.view(batch, seq_len, hv))
    if intermediates:
        grads.update(h=h, v_new=v_new.view(batch, seq_len, hv, dv), dh=dh, dv_new=dv_new.view(batch, seq_len, hv, dv),
                     chunk_bounds=plan.chunk_bounds, dk_wy=dk_wy.view(batch, seq_len, hv, dk),
                     dgamma_wy_chunks=dgamma_wy)
    return grads


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


def _build_kernels(problem, tl_dtype, gate_dtype, cu_seqlens, h0, dht, cp, block_v, saved, outputs):
    """Compile the kernels this call launches side by side at their first use (``prebuild``;
    a kernel left out here is still compiled when it first launches). ``outputs``: the
    prepare_wu variant the call runs."""
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    index_dtype = None if cu_seqlens is None else TL_DTYPE[cu_seqlens.dtype]
    prepare, recompute = "prepared" not in saved, "h" not in saved
    has_h0, has_dht = h0 is not None, dht is not None
    key = ("backward", dk, dv, tl_dtype, gate_dtype, index_dtype, prepare, outputs, recompute, cp, has_h0, has_dht,
           block_v)

    def builders():
        kernels = [lambda: build_local_dv(dk, dv, tl_dtype), lambda: build_wy_grads(dk, dv, tl_dtype, gate_dtype),
                   lambda: build_qk_grads(dk, dv, tl_dtype)]
        if prepare:
            kernels.append(lambda: build_prepare_wu(dk, dv, tl_dtype, gate_dtype, *outputs))
            if index_dtype is not None:
                kernels += [lambda: build_sequence_prefix(index_dtype), build_cut_pieces]
        if recompute:
            kernels.append(lambda: build_chunk_states(dk, dv, tl_dtype, has_h0 or cp, block_v))
        if cp:
            kernels += [lambda: build_segment_state(dk, dv, tl_dtype, recompute),
                        lambda: build_segment_scan(dk, dv, has_dht, reverse=True),
                        lambda: build_state_grads(dk, dv, tl_dtype, False, block_v),
                        lambda: build_state_grads(dk, dv, tl_dtype, True, block_v)]
            if recompute:
                kernels.append(lambda: build_segment_scan(dk, dv, has_h0))
        else:
            kernels.append(lambda: build_state_grads(dk, dv, tl_dtype, has_dht, block_v))
        return kernels

    build_together(key, builders)


def _segment_transitions(kf, w, vf, a_u, gamma, k_norm_inv, segs, seg_state, recompute, problem, tl_dtype):
    """[h | M] of every segment into ``seg_state`` (all of them: the reverse scan needs each M
    but the first's). Recomputing, U = A_g V is formed in the kernel. With saved chunk states
    only M is needed and A_g was not kept: the variant that reads U runs with W (same shape,
    K = V) in its place, and the h columns come out meaningless and unread."""
    sources = transition_sources(v=vf, a_u=a_u) if recompute else transition_sources(u=w)
    log_bound, trunc_flags = no_truncation(kf.device)  # exact transitions: the reverse scan needs every M
    build_segment_state(problem.head_k, problem.head_v, tl_dtype, recompute)(
        kf, w, *sources, gamma, k_norm_inv, segs.seg_info, log_bound, seg_state, trunc_flags
    )


def hopper_backward(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens, state_v_first,
                    saved: dict | None = None):
    """(dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes; states in the caller's layout."""
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    if dht is not None and state_v_first:
        dht = dht.transpose(-1, -2)
    out = backward_stages(q, k, v, g, beta, do, dht, problem, h0, use_l2, cu_seqlens, saved)
    dh0 = None
    if initial_state is not None:
        dh0 = out["dh0_all"].transpose(-1, -2) if state_v_first else out["dh0_all"]
        dh0 = dh0.to(initial_state.dtype)
    return (out["dq"], out["dk"], out["dv"].to(v.dtype), out["dg"].to(g.dtype),
            out["dbeta"].to(beta.dtype), dh0)

