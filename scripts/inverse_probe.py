"""Probe (GPU): the warpgroup chunk inverse of ``hopper/mma_inverse`` against
``tiles.blocked_unit_lower_inverse``: error against an fp64 inverse, and the time a chunk when each
SM's one warpgroup inverts its matrix 64 times one after another (latency, as in a fused kernel's auxiliary
warpgroup). ``python3 scripts/inverse_probe.py``"""
import torch

from kernel_probe import call_time_us
from flash_gdn.hopper.mma_inverse import build_inverse_probe


def gdn_lower(n: int, decay: float, dev) -> torch.Tensor:
    """n strictly lower matrices as the forward forms them: beta_i k_i.k_j e^(gamma_i - gamma_j), unit keys."""
    k = torch.nn.functional.normalize(torch.randn(n, 64, 128, device=dev, dtype=torch.float64), dim=-1)
    beta = torch.rand(n, 64, 1, device=dev, dtype=torch.float64)
    gamma = torch.cumsum(-decay * torch.rand(n, 64, device=dev, dtype=torch.float64), dim=-1)
    a = beta * (k @ k.transpose(-1, -2)) * torch.exp(gamma[:, :, None] - gamma[:, None, :])
    return torch.tril(a, -1)


if __name__ == "__main__":
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    repeats = 64
    for decay in (0.0, 0.1, 3.0):
        l64 = gdn_lower(sms, decay, dev)
        ref = torch.linalg.inv(torch.eye(64, device=dev, dtype=torch.float64) + l64)
        l32 = l64.float().contiguous()
        for mma in (False, True):
            x = torch.full_like(l32, float("nan"))
            kernel = build_inverse_probe(mma, repeats)
            kernel(l32, x)
            torch.cuda.synchronize()
            err = (x.double() - ref).norm() / ref.norm()
            worst = (x.double() - ref).abs().max().item()
            us = call_time_us(lambda: kernel(l32, x), batches=2)
            name = "mma_inverse" if mma else "blocked (tiles)"
            # throughput: 16 CTAs per SM in the grid (as many resident as fit), each repeating
            many = l32.repeat(16, 1, 1).contiguous()
            xm = torch.empty_like(many)
            us_many = call_time_us(lambda: kernel(many, xm))
            per_sm = 16 * repeats
            print(f"decay {decay:4.1f} {name:16s} rel err {err:.2e} max abs {worst:.2e} nan {bool(x.isnan().any())}"
                  f" | latency {us / repeats:5.3f} us an inverse; throughput {us_many / per_sm:5.3f} us of SM time each", flush=True)
    # Where the mma inverse's latency goes: thread 0's clock64 at each level's end (second run a CTA).
    from flash_gdn.hopper.mma_inverse import build_inverse_stamps
    stamps = torch.zeros(sms, 6, dtype=torch.int64, device=dev)
    build_inverse_stamps()(gdn_lower(sms, 0.1, dev).float().contiguous(), stamps)
    torch.cuda.synchronize()
    steps = (stamps[:, 1:] - stamps[:, :-1]).double().median(dim=0).values.tolist()
    names = ("8x8 blocks", "8->16", "16->32", "32->64 products", "32->64 stores")
    print("mma_inverse, cycles by level (median over CTAs):",
          ", ".join(f"{n} {c:.0f}" for n, c in zip(names, steps)), f"; total {sum(steps):.0f}", flush=True)
