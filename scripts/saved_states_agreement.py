"""How closely the saved-state backward and the recomputed one agree, and each one's distance from fp64,
over fresh draws of ``test_saved_chunk_states_match_recomputed``'s inputs (7 sequences x 8 value heads,
fused L2 norm): the recomputed backward at ``state_block_v``'s block (all of V there since s66, W
formed in the sequential passes) and forced to 64 columns (W read from ``prepare_wu``, as the saved path
reads it). From the repository root on a GPU host:

    python3 scripts/saved_states_agreement.py 10
"""
import sys
sys.path[0:1] = [".", "scripts"]
import torch
from flash_gdn import chunk_gated_delta_rule
from flash_gdn.hopper import backward
from tests.hopper.test_gpu_backward_stages import LENGTHS, _backward_inputs, _naive_grads
from tests.helpers import rel_err

rule = backward.state_block_v


def grads_of(q, k, v, g, beta, h0, cu, do, dht, save, block):
    backward.state_block_v = rule if block is None else (lambda head_v, *a, **kw: min(block, head_v))
    backward.release_configs()
    leaves = {n: x.clone().requires_grad_(True) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0).items()}
    o, s = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                  initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True, save_chunk_states=save)
    torch.autograd.backward((o, s), (do.to(o.dtype), dht.float()))
    return {n: x.grad for n, x in leaves.items()}


def main(draws: int) -> None:
    try:
        for draw in range(draws):
            q, k, v, g, beta, h0, cu = _backward_inputs(LENGTHS, 2, 8, True)
            ref, do, dht = _naive_grads(q, k, v, g, beta, h0, cu, True, False)
            saved = grads_of(q, k, v, g, beta, h0, cu, do, dht, True, None)
            rec = grads_of(q, k, v, g, beta, h0, cu, do, dht, False, None)
            rec64 = grads_of(q, k, v, g, beta, h0, cu, do, dht, False, 64)
            lines = [f"{n}: agree rule {rel_err(saved[n], rec[n]):.1e} 64 {rel_err(saved[n], rec64[n]):.1e} | "
                     f"fp64 saved {rel_err(saved[n], ref[n]):.1e} rule {rel_err(rec[n], ref[n]):.1e} "
                     f"64 {rel_err(rec64[n], ref[n]):.1e}" for n in ("q", "k", "g", "beta")]
            print(f"draw {draw}: " + "\n         ".join(lines), flush=True)
    finally:
        backward.state_block_v = rule


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
