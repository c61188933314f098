"""Forward kernel time with the fused L2 norm (``use_qk_l2norm_in_kernel=True``) per row, on a GPU
host: for A/B runs of ``prepare_wu``'s norm path (run once per tree, e.g. with an older tree first
on PYTHONPATH).

    python3 scripts/l2_forward_time.py [--plain] 32/32:8192x4 16/32:8192x4 2/8:1x8192

``--plain``: also the same rows without the norm (the variant is shared, so a change to the norm
path can move the plain forward too).
"""

import sys

import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.bench.timing import kernel_time_ms
from profile_kernels import row_inputs  # scripts/ is on sys.path when run as a script


def main(specs, plain=False):
    import flash_gdn
    print(torch.cuda.get_device_name(), flash_gdn.__file__, flush=True)
    for spec in specs:
        x = row_inputs(spec)
        for l2 in (True, False) if plain else (True,):
            def step():
                with torch.no_grad():
                    return chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=l2)
            step()
            what = "l2norm in kernel" if l2 else "no norm"
            print(f"{spec}: {kernel_time_ms(step, 20) * 1e3:.1f} us ({what})", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--plain"]
    main(args or ["32/32:8192x4", "16/32:8192x4", "2/8:1x8192"], plain="--plain" in sys.argv[1:])
