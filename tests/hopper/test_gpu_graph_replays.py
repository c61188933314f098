"""GPU: CUDA-graph replays issued back to back, with no synchronisation between them, finish.

A graph of the context-parallel backward (two streams) at 2/4 heads x 2 x 4096 tokens hung on
its second back-to-back replay after b25's change to ``state_grads`` (reverted; replays with a
synchronisation after each one finished). Each case runs in a child process with a time limit,
so a hang fails the test instead of stalling the suite.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_CHILD = textwrap.dedent("""
    import sys, torch
    from flash_gdn import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
    from flash_gdn.bench.timing import capture_graph
    hqk, hv, lengths, mode = int(sys.argv[1]), int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")], sys.argv[4]
    t, d, dev = sum(lengths), 128, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q = torch.nn.functional.normalize(rnd(1, t, hqk, d), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(1, t, hqk, d), dim=-1).bfloat16()
    v, do = rnd(1, t, hv, d).bfloat16(), rnd(1, t, hv, d).bfloat16()
    g, beta = torch.nn.functional.logsigmoid(rnd(1, t, hv)), torch.sigmoid(rnd(1, t, hv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    if mode == "bwd":
        _, _, saved = chunk_gated_delta_rule_fwd(q, k, v, g, beta, cu_seqlens=cu)
        step = lambda: chunk_gated_delta_rule_bwd(do, None, saved)
    else:
        step = lambda: chunk_gated_delta_rule_fwd(q, k, v, g, beta, cu_seqlens=cu)[0]
    graph, out = capture_graph(step)
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    first = out[0] if mode == "bwd" else out
    assert torch.isfinite(first).all()
    print("ok")
""")


@pytest.mark.parametrize("hqk,hv,lengths,mode", [(2, 4, "4096,4096", "bwd"), (2, 4, "8192", "bwd"),
                                                 (4, 8, "4096,4096", "bwd"), (2, 8, "1000,24,900", "fwd")])
def test_back_to_back_graph_replays_finish(hqk, hv, lengths, mode):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(hqk), str(hv), lengths, mode], env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"graph replays of the {mode} at {hqk}/{hv} x {lengths} did not finish in 300 s (hang)")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
