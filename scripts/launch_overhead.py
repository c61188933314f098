"""Host time per TileLang kernel launch for each execution backend (tvm_ffi, cython)."""
import time, torch, tilelang
from flash_gdn.hopper import state_output as so
from flash_gdn.hopper import prepare_wu as pw
from flash_gdn.planning import plan_for
t, hqk, hv, d = 128, 2, 8, 128
dev = "cuda"
q = torch.randn(t, hqk, d, device=dev).bfloat16(); k = q.clone()
v = torch.randn(t, hv, d, device=dev).bfloat16()
g = -torch.rand(t, hv, device=dev); beta = torch.rand(t, hv, device=dev)
plan = plan_for(1, t, None, q.device); nc = plan.chunk_bounds.shape[0]
w = torch.empty(t, hv, d, device=dev, dtype=torch.bfloat16); u = torch.empty_like(w)
gamma = torch.empty(hv, nc, 64, device=dev); qn = torch.empty(hqk, nc, 64, device=dev); kn = torch.empty_like(qn)
o = torch.empty(t, hv, d, device=dev, dtype=torch.bfloat16); fs = torch.empty(1, hv, d, d, device=dev)
for backend in ("tvm_ffi", "cython"):
    try:
        pk = tilelang.jit(execution_backend=backend)(pw._prepare_wu_kernel.func.orig_func)(d, d, "bfloat16", "float32")
        sk = tilelang.jit(execution_backend=backend)(so._state_output_kernel.func.orig_func)(d, d, "bfloat16", False, 128, 2)
        run = lambda: (pk(k, v, g, beta, plan.chunk_bounds, w, u, gamma, q, 0, qn, kn),
                       sk(q, k, w, u, gamma, qn, kn, plan.seq_info, fs, 0.1, o, fs))
        for _ in range(5): run()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(50): run()
        t1 = time.perf_counter(); torch.cuda.synchronize()
        print(f"{backend}: host {(t1 - t0) / 100 * 1e6:.1f} us per kernel launch", flush=True)
    except Exception as e:
        print(backend, "failed:", repr(e)[:300], flush=True)
