"""Input factories and error metrics shared by the tests."""

import torch
import torch.nn.functional as F


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make_inputs(
    batch=1, seq_len=100, hqk=2, hv=4, dk=32, dv=32, dtype=torch.float64, device="cpu",
    gate_range=(0.0, 3.0), normalize_k=True, initial_state=False, num_seqs=None, state_v_first=False,
    zero_decay_heads=0, seed=None, requires_grad=False,
):
    """Random GDN inputs. ``gate_range`` (lo, hi): per-token -g drawn uniformly in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q = rnd(batch, seq_len, hqk, dk)
    k = rnd(batch, seq_len, hqk, dk)
    if normalize_k:
        k = F.normalize(k, dim=-1)
    v = rnd(batch, seq_len, hv, dv)
    lo, hi = gate_range
    g = -(lo + (hi - lo) * torch.rand(batch, seq_len, hv, generator=gen, dtype=torch.float64))
    if zero_decay_heads:
        g[..., :zero_decay_heads] = 0.0
    beta = torch.rand(batch, seq_len, hv, generator=gen, dtype=torch.float64)
    n = num_seqs if num_seqs is not None else batch
    h0 = None
    if initial_state:
        shape = (n, hv, dv, dk) if state_v_first else (n, hv, dk, dv)
        h0 = rnd(*shape)
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, initial_state=h0)
    out = {name: (t.to(device) if t is not None else None) for name, t in out.items()}
    if requires_grad:
        for t in out.values():
            if t is not None:
                t.requires_grad_(True)
    return out


def random_cu_seqlens(lengths, device="cpu", dtype=torch.int64):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype, device=device)


def run_fresh_interpreter(script: str, cache_dir, *args: str, **env_vars: str) -> dict:
    """Run ``script`` in a new Python process with TileLang's cache at ``cache_dir`` (and the
    compile-worker and kernel-index switches at their defaults unless given) and return the
    JSON object it prints last. A fresh interpreter: TileLang's in-memory caches in this one
    (kernels built by earlier tests) would hide what the disk cache and the index hold."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TILELANG_CACHE_DIR=str(cache_dir))
    for name in ("FLASH_GDN_BUILD_WORKERS", "FLASH_GDN_KERNEL_INDEX"):
        env.pop(name, None)
    env.update(env_vars)
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
