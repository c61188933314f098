"""The chunk and segment maps of ``planning`` built on the device in two small launches.

The torch-op version in ``planning`` (the reference, and the CPU path) dispatches 40-100
operators per varlen call; each costs host time on the hot path. Here:

1. ``sequence_prefix`` (one CTA): the segment length (``planning.balanced_segment_chunks``:
   the least s >= ``seg_chunks`` giving at most ``seg_target`` segments, from the lengths in
   ``cu``; or with ``wave_ctas``, ``planning.wave_segment_chunks``: the s >= ``seg_chunks`` of
   least modelled output time for ``wave_ctas`` CTAs a segment on ``seg_target`` SMs), per
   sequence its chunk count and segment count, and their exclusive prefix sums
   (each thread sums a run of sequences, one thread scans the runs, each thread walks its run
   again writing ``seq_info`` and ``seg_meta``), plus the totals and the segment length.
2. ``cut_pieces`` (one CTA per sequence, one more for the tail): every chunk's and segment's
   bounds; the extra CTA zeroes the slots past the totals (unused capacity: start == end).

Layouts are those of ``planning.ChunkPlan`` and ``planning.SegmentPlan``.
"""

import functools

import tilelang.language as T

from ..planning import WAVE_START_CHUNKS
from .launch import Launcher, jit

CHUNK = 64
PREFIX_THREADS = 256
CUT_THREADS = 128
# Rounds of the segment-length search: each narrows the range of candidates by PREFIX_THREADS
# (one candidate per thread), so four cover any chunk count below 256^4.
SEARCH_ROUNDS = 4


@functools.lru_cache(maxsize=None)
def build_sequence_prefix(index_dtype: str):
    return Launcher(_sequence_prefix_kernel(index_dtype))


@functools.lru_cache(maxsize=None)
def build_cut_pieces():
    return Launcher(_cut_pieces_kernel())


@jit
def _sequence_prefix_kernel(index_dtype, threads=PREFIX_THREADS):
    num_offsets = T.dynamic("num_offsets")
    num_seqs = T.dynamic("num_seqs")

    @T.prim_func
    def sequence_prefix(
        cu: T.Tensor((num_offsets,), index_dtype),
        seg_chunks: T.int32,
        seg_target: T.int32,
        wave_ctas: T.int32,
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        seg_meta: T.Tensor((num_seqs, 3), "int32"),
        totals: T.Tensor((3,), "int32"),
    ):
        with T.Kernel(1, threads=threads):
            tx = T.get_thread_binding()
            runs = T.alloc_shared((2, threads), "int32")
            seg_len = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            step = T.alloc_var("int32")
            candidate = T.alloc_var("int32")
            count = T.alloc_var("int32")
            failing = T.alloc_var("int32")
            base = T.alloc_var("int32")
            chunks_acc = T.alloc_var("int32")
            segs_acc = T.alloc_var("int32")
            length = T.alloc_var("int32")
            n_chunks = T.alloc_var("int32")
            n_segs = T.alloc_var("int32")
            carry_c = T.alloc_var("int32")
            carry_s = T.alloc_var("int32")
            longest = T.alloc_var("int32")
            cost = T.alloc_var("int64")
            best_cost = T.alloc_var("int64")
            best_len = T.alloc_var("int32")
            best_costs = T.alloc_shared((threads,), "int64")
            per_thread = T.ceildiv(num_seqs, threads)

            # The segment length: the least s in [seg_chunks, hi] with at most seg_target
            # segments (at hi, the whole row's chunks, every sequence is one segment, so the
            # search runs only when that is within the target). The segment count falls as s
            # grows, so thread t tries lo + t * step and the failing candidates are a prefix:
            # their count (syncthreads_count) brackets the answer for the next round.
            seg_len = seg_chunks
            if seg_target >= num_seqs and wave_ctas == 0:
                lo = seg_chunks
                hi = T.max(seg_chunks, T.ceildiv(T.cast(cu[num_seqs] - cu[0], "int32"), CHUNK))
                for _ in T.serial(SEARCH_ROUNDS):
                    step = T.ceildiv(hi - lo, threads)
                    candidate = T.min(lo + tx * step, hi)
                    count = 0
                    for n in T.serial(num_seqs):
                        count += T.max(1, T.ceildiv(T.ceildiv(T.cast(cu[n + 1] - cu[n], "int32"), CHUNK), candidate))
                    failing = T.syncthreads_count(count > seg_target)
                    # Candidate `failing` passes (hi if every candidate failed: hi passes), the one
                    # before it fails (and lies below hi, since hi passes).
                    base = lo
                    if failing < threads:
                        hi = T.min(base + failing * step, hi)
                    if failing > 0:
                        lo = base + (failing - 1) * step + 1
                seg_len = hi
            if wave_ctas > 0 and seg_target > 0:
                # planning.wave_segment_chunks: every s in [seg_chunks, longest] is a candidate
                # (the segment count does not fall steadily with s, so no bisection), thread t
                # taking every threads-th one; then the least cost, the longest s on ties, over
                # the threads. The longest sequence first: each thread's run, then all runs.
                # (Each candidate walks every sequence: the forward asks for this with one or
                # two, context_parallel.forward_segments.)
                longest = 0
                for i in T.serial(per_thread):
                    n = tx * per_thread + i
                    if n < num_seqs:
                        longest = T.max(longest, T.ceildiv(T.cast(cu[n + 1] - cu[n], "int32"), CHUNK))
                runs[0, tx] = longest
                T.sync_threads()
                for t in T.serial(threads):
                    longest = T.max(longest, runs[0, t])
                lo = seg_chunks
                hi = T.max(seg_chunks, longest)
                best_cost = -1
                best_len = lo
                for r in T.serial(T.ceildiv(hi - lo + 1, threads)):
                    candidate = lo + r * threads + tx
                    if candidate <= hi:
                        count = 0
                        for n in T.serial(num_seqs):
                            count += T.max(1, T.ceildiv(T.ceildiv(T.cast(cu[n + 1] - cu[n], "int32"), CHUNK), candidate))
                        cost = (T.ceildiv(T.cast(wave_ctas, "int64") * T.cast(count, "int64"), T.cast(seg_target, "int64"))
                                * T.cast(T.min(candidate, longest) + WAVE_START_CHUNKS, "int64"))
                        if best_cost < 0 or cost <= best_cost:  # this thread's candidates rise
                            best_cost = cost
                            best_len = candidate
                best_costs[tx] = best_cost
                runs[1, tx] = best_len
                T.sync_threads()
                best_cost = -1
                seg_len = lo
                for t in T.serial(threads):
                    if best_costs[t] >= 0 and (best_cost < 0 or best_costs[t] < best_cost
                                               or (best_costs[t] == best_cost and runs[1, t] > seg_len)):
                        best_cost = best_costs[t]
                        seg_len = runs[1, t]
                T.sync_threads()  # every thread has read the runs before they are written again

            chunks_acc = 0
            segs_acc = 0
            for i in T.serial(per_thread):
                n = tx * per_thread + i
                if n < num_seqs:
                    length = T.cast(cu[n + 1] - cu[n], "int32")
                    n_chunks = T.ceildiv(length, CHUNK)
                    chunks_acc += n_chunks
                    segs_acc += T.max(1, T.ceildiv(n_chunks, seg_len))
            runs[0, tx] = chunks_acc
            runs[1, tx] = segs_acc
            T.sync_threads()
            if tx == 0:  # exclusive scan of the runs' sums
                carry_c = 0
                carry_s = 0
                for t in T.serial(threads):
                    n_chunks = runs[0, t]
                    n_segs = runs[1, t]
                    runs[0, t] = carry_c
                    runs[1, t] = carry_s
                    carry_c += n_chunks
                    carry_s += n_segs
                totals[0] = carry_c
                totals[1] = carry_s
                totals[2] = seg_len
            T.sync_threads()
            chunks_acc = runs[0, tx]
            segs_acc = runs[1, tx]
            for i in T.serial(per_thread):
                n = tx * per_thread + i
                if n < num_seqs:
                    length = T.cast(cu[n + 1] - cu[n], "int32")
                    n_chunks = T.ceildiv(length, CHUNK)
                    n_segs = T.max(1, T.ceildiv(n_chunks, seg_len))
                    seq_info[n, 0] = T.cast(cu[n], "int32")
                    seq_info[n, 1] = T.cast(cu[n + 1], "int32")
                    seq_info[n, 2] = chunks_acc
                    seg_meta[n, 0] = segs_acc
                    seg_meta[n, 1] = n_segs
                    seg_meta[n, 2] = segs_acc + n_segs - 1
                    chunks_acc += n_chunks
                    segs_acc += n_segs

    return sequence_prefix


@jit
def _cut_pieces_kernel(threads=CUT_THREADS):
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    num_segs = T.dynamic("num_segs")

    @T.prim_func
    def cut_pieces(
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        seg_meta: T.Tensor((num_seqs, 3), "int32"),
        totals: T.Tensor((3,), "int32"),
        with_segments: T.int32,
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),
        chunk_seq: T.Tensor((num_chunks,), "int32"),
        seg_info: T.Tensor((num_segs, 3), "int32"),
        transition_info: T.Tensor((num_segs, 3), "int32"),
    ):
        with T.Kernel(num_seqs + 1, threads=threads) as seq:
            tx = T.get_thread_binding()
            start = T.alloc_var("int32")
            end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            first_seg = T.alloc_var("int32")
            count = T.alloc_var("int32")
            seg_start = T.alloc_var("int32")
            seg_end = T.alloc_var("int32")
            seg_chunks = T.alloc_var("int32")
            seg_chunks = totals[2]  # chunks per segment (sequence_prefix's choice)
            seg_tokens = seg_chunks * CHUNK
            if seq < num_seqs:
                start = seq_info[seq, 0]
                end = seq_info[seq, 1]
                first_chunk = seq_info[seq, 2]
                count = T.ceildiv(end - start, CHUNK)
                for r in T.serial(T.ceildiv(count, threads)):
                    c = r * threads + tx
                    if c < count:
                        chunk_bounds[first_chunk + c, 0] = start + c * CHUNK
                        chunk_bounds[first_chunk + c, 1] = T.min(start + (c + 1) * CHUNK, end)
                        chunk_seq[first_chunk + c] = seq
                if with_segments != 0:
                    first_seg = seg_meta[seq, 0]
                    count = seg_meta[seq, 1]
                    for r in T.serial(T.ceildiv(count, threads)):
                        j = r * threads + tx
                        if j < count:
                            seg_start = T.min(start + j * seg_tokens, end)
                            seg_end = T.min(seg_start + seg_tokens, end)
                            seg_info[first_seg + j, 0] = seg_start
                            seg_info[first_seg + j, 1] = seg_end
                            seg_info[first_seg + j, 2] = first_chunk + j * seg_chunks
                            # The transition pass skips a sequence's last segment (nothing follows it).
                            transition_info[first_seg + j, 0] = seg_start
                            transition_info[first_seg + j, 1] = T.if_then_else(j == count - 1, seg_start, seg_end)
                            transition_info[first_seg + j, 2] = first_chunk + j * seg_chunks
            else:  # unused capacity: empty pieces (start == end == 0)
                first_chunk = totals[0]
                for r in T.serial(T.ceildiv(T.max(num_chunks - first_chunk, 0), threads)):
                    c = first_chunk + r * threads + tx
                    if c < num_chunks:
                        chunk_bounds[c, 0] = 0
                        chunk_bounds[c, 1] = 0
                        chunk_seq[c] = 0
                if with_segments != 0:
                    first_seg = totals[1]
                    for r in T.serial(T.ceildiv(T.max(num_segs - first_seg, 0), threads)):
                        j = first_seg + r * threads + tx
                        if j < num_segs:
                            for col in T.serial(3):
                                seg_info[j, col] = 0
                                transition_info[j, col] = 0

    return cut_pieces
