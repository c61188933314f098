import os, time, torch
from torch.profiler import profile, ProfilerActivity
from flash_gdn import chunk_gated_delta_rule
t, hqk, hv, d = 8192, 2, 8, 128
q = torch.nn.functional.normalize(torch.randn(1, t, hqk, d, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(1, t, hqk, d, device="cuda"), dim=-1).bfloat16()
v = torch.randn(1, t, hv, d, device="cuda").bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device="cuda"))
beta = torch.rand(1, t, hv, device="cuda")
cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
for cp in ("1", "0"):
    os.environ["FLASH_GDN_CP"] = cp
    for _ in range(3): chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10): chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"CP={cp}: host per call {(t1-t0)/10*1e3:.3f} ms, wall per call {(t2-t0)/10*1e3:.3f} ms", flush=True)
os.environ["FLASH_GDN_CP"] = "1"
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5): chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
