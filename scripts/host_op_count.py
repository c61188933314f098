"""Count the torch operators one API call dispatches on the host (kernels stubbed out).

Runs on a CPU machine: inputs on the ``meta`` device, the TileLang kernels replaced by
no-ops, so what is counted is our Python glue (validation, planning, the CP scan): each
operator listed is roughly one extra kernel launch and 5-10 us of host time on a GPU host.

    python3 scripts/host_op_count.py [--where] 2/8:1x2048 4/16:28672+4096 16/64:8192x4   # forward, then backward
    python3 scripts/host_op_count.py --new-shapes [--profile] 2/8:4096+2048   # a new total length every call

``--where`` lists each operator with the flash_gdn line that dispatched it. ``--new-shapes``
times calls whose packed length changes every call (serving, varlen training: every such call
misses the per-shape caches), forward and training forward, against repeat calls; ``--profile``
adds cProfile's top functions of the new-shape calls.
"""

import collections
import sys
import time
import traceback
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_gdn.api as api
from flash_gdn import dispatch
from flash_gdn.bench.rows import parse_lengths
from flash_gdn.hopper import backward, context_parallel, forward, prepare_wu


class Count(TorchDispatchMode):
    def __init__(self, where=False):
        super().__init__()
        self.ops = collections.Counter()
        self.sites = collections.Counter() if where else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        if self.sites is not None:  # the innermost flash_gdn line that dispatched it
            ours = [f for f in traceback.extract_stack() if "/flash_gdn/" in f.filename]
            if ours:
                self.sites[f"{name} {ours[-1].filename.split('/flash_gdn/')[-1]}:{ours[-1].lineno}"] += 1
        return func(*args, **(kwargs or {}))

    def report(self, label):
        print(f"{label} {sum(self.ops.values())} ops: {dict(self.ops.most_common())}")
        if self.sites is not None:
            print("  " + "\n  ".join(f"{n} x {site}" for site, n in sorted(self.sites.items())))


def stub(*_args, **_kw):
    return lambda *a, **k: None


def stub_kernels():
    """Start the patches that stand the meta device in for a GPU (kernels no-ops)."""
    patches = [mock.patch.object(backward, "CONCURRENT_CHUNK_STATES", False),  # no CUDA streams on meta
               mock.patch.object(dispatch, "hopper_forward_supports", lambda q, p: (True, "stub")),
               mock.patch.object(context_parallel, "num_sms", lambda i: 132),
               mock.patch.object(torch.cuda, "current_device", lambda: 0)]
    from flash_gdn.hopper import plan_kernels
    for mod in (forward, prepare_wu, backward, plan_kernels):
        for name in dir(mod):
            if name.startswith("build_"):
                patches.append(mock.patch.object(mod, name, stub))
    import flash_gdn.planning as planning
    # The meta device stands in for CUDA: take the device-planning path.
    patches.append(mock.patch.object(backward, "num_sms", lambda i: 132))
    # (through the cache of recent cu_seqlens plans, as on a GPU: the counted call is a repeat)
    patches.append(mock.patch.object(planning, "current_stream_handle", lambda d: 0))
    def meta_plan(b, t, cu, d, s=None, st=0, w=0, is_capturing=None):
        if cu is not None:
            return planning._recent_device_plan(b, t, cu, d, s, st, w)
        return planning._batch_plan(b, t, d, s, st, w)
    patches += [mock.patch.object(prepare_wu, "plan_for", meta_plan), mock.patch.object(forward, "plan_for", meta_plan),
                mock.patch.object(backward, "plan_for", meta_plan)]
    for p in patches:
        p.start()


def meta_inputs(hqk: int, hv: int, lengths):
    """q (also k), v, g (also beta) and cu_seqlens on the meta device for packed ``lengths``."""
    dev = torch.device("meta")
    t = sum(lengths)
    q = torch.empty(1, t, hqk, 128, device=dev, dtype=torch.bfloat16)
    v = torch.empty(1, t, hv, 128, device=dev, dtype=torch.bfloat16)
    g = torch.empty(1, t, hv, device=dev)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist())).to(dev)
    return q, v, g, cu


def new_shapes(specs, profile=False, calls=40):
    """Host time of calls whose packed length changes every call (each a new key for the
    forward's caches), inference and training forward, against repeat calls of one length."""
    import cProfile
    import pstats

    for spec in specs:
        heads, seqlens = spec.split(":")
        hqk, hv = (int(x) for x in heads.split("/"))
        lengths = parse_lengths(seqlens)
        for label, fwd in (("inference", api.chunk_gated_delta_rule),
                           ("training fwd", api.chunk_gated_delta_rule_fwd)):
            inputs = [meta_inputs(hqk, hv, [lengths[0] + 7 * i, *lengths[1:]]) for i in range(calls + 1)]
            q, v, g, cu = inputs[0]
            fwd(q, q, v, g, g, cu_seqlens=cu)  # (first-use work: the kernels' lookup, the imports)
            prof = cProfile.Profile() if profile else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            for q, v, g, cu in inputs[1:]:
                fwd(q, q, v, g, g, cu_seqlens=cu)
            if prof:
                prof.disable()
            new = (time.perf_counter() - t0) / calls * 1e6
            q, v, g, cu = inputs[-1]
            t0 = time.perf_counter()
            for _ in range(calls):
                fwd(q, q, v, g, g, cu_seqlens=cu)
            repeat = (time.perf_counter() - t0) / calls * 1e6
            print(f"{spec} {label}: new length each call {new:.0f} us host, repeat call {repeat:.0f} us (meta)")
            if prof:
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main(specs, backward_too=True, where=False):
    dev = torch.device("meta")
    for spec in specs:
        heads, seqlens = spec.split(":")
        hqk, hv = (int(x) for x in heads.split("/"))
        q, v, g, cu = meta_inputs(hqk, hv, parse_lengths(seqlens))
        call = lambda: api.chunk_gated_delta_rule_fwd(q, q, v, g, g, cu_seqlens=cu)  # noqa: E731
        call()
        with Count(where) as c:
            _, _, saved = call()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        host = (time.perf_counter() - t0) / 20 * 1e6
        c.report(f"{spec}: forward ({host:.0f} us host on meta)")
        if backward_too:
            do = torch.empty_like(v)
            with Count(where) as c:
                api.chunk_gated_delta_rule_bwd(do, None, saved)
            t0 = time.perf_counter()
            for _ in range(20):
                api.chunk_gated_delta_rule_bwd(do, None, saved)
            host = (time.perf_counter() - t0) / 20 * 1e6
            c.report(f"{spec}: backward ({host:.0f} us host on meta)")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    stub_kernels()
    if "--new-shapes" in sys.argv:
        new_shapes(args or ["2/8:4096+2048", "16/32:4096+4096"], profile="--profile" in sys.argv)
    else:
        main(args or ["2/8:1x2048", "4/16:28672+4096", "16/64:8192x4"], where="--where" in sys.argv)
