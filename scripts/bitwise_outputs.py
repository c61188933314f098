"""Forward and backward outputs on fixed seeds, saved or compared bit for bit (GPU host).

For a kernel change meant to leave results unchanged (a reordering, a new schedule):

    python3 scripts/bitwise_outputs.py save /tmp/before.pt     # on the old tree
    python3 scripts/bitwise_outputs.py cmp /tmp/before.pt      # on the new tree: lists what differs

The calls: 16 seeded problems (ragged varlen with pieces of 77 and 64 tokens, one long sequence at few heads, grouped
heads, the L2 norm on and off, h0 and dht or neither); the tensors: o, the final state, and dq, dk, dv, dg, dbeta,
dh0 of the backward, and o and the final state of the inference forward (``chunk_gated_delta_rule`` without grad:
the A_g-only ``prepare_wu`` variants, which the training forward does not run). Our kernels are deterministic, so
any difference is the change's (or a race).

``--forward`` (after the mode): the forwards alone (o and the final state of both, and the training forward's kept
A_r), no backward: for a change to a forward kernel, on a cold GPU host a minute's compiles fewer.
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_kernels import row_inputs  # noqa: E402

from flash_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd  # noqa: E402

ROWS = ("16/32:1000+77+2900+64", "2/4:1x8192", "4/8:333x3", "8/32:4096x2")


def outputs(backward: bool = True) -> dict:
    out = {}
    for idx, spec in enumerate(ROWS):
        for norm in (False, True):
            for states in (False, True):
                torch.manual_seed(100 * idx + 10 * norm + states)
                x = row_inputs(spec)
                n, hv, dk = x["cu_seqlens"].numel() - 1, x["v"].shape[2], x["k"].shape[3]
                h0 = torch.randn(n, hv, dk, x["v"].shape[3], device="cuda") if states else None
                o, final, saved = chunk_gated_delta_rule_fwd(
                    **x, initial_state=h0, output_final_state=states, use_qk_l2norm_in_kernel=norm)
                do = torch.randn_like(x["v"])
                dht = torch.randn_like(final) if states else None
                # (do and dht drawn either way: the same inputs for the calls below)
                if backward:
                    more = chunk_gated_delta_rule_bwd(do, dht, saved)._asdict()
                else:
                    more = {"a_r": saved.extras.get("a_r")}
                named = {"o": o, "final_state": final, **more}
                with torch.no_grad():
                    o_inf, final_inf = chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=states,
                                                              use_qk_l2norm_in_kernel=norm)
                named |= {"inference o": o_inf, "inference final_state": final_inf}
                for name, t in named.items():
                    if t is not None:
                        out[f"{spec} norm={norm} states={states} {name}"] = t.float().cpu()
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--forward"]
    if len(args) != 2 or args[0] not in ("save", "cmp"):
        sys.exit("usage: bitwise_outputs.py save|cmp [--forward] FILE")
    mode, path = args
    out = outputs(backward="--forward" not in sys.argv)
    if mode == "save":
        torch.save(out, path)
        print(f"saved {len(out)} tensors to {path}")
        return
    ref = torch.load(path)
    differing = 0
    for key, t in out.items():
        if key not in ref:
            sys.exit(f"{key} is not in {path}: save and cmp with the same --forward setting")
        diff = (t - ref[key]).abs().max().item()
        if diff != 0 or torch.isnan(t).any():
            differing += 1
            print(f"DIFF {key}: max |new - old| {diff:.3e}")
    print(f"compared {len(out)} tensors, {differing} differing")


if __name__ == "__main__":
    main()
