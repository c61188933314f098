"""Per-role SASS statistics of kernel variants, on a machine without a GPU.

Builds each variant whose name contains one of the given parts (``hopper.variants.all_variants``)
for sm_90a, assembles TileLang's CUDA with nvcc (the project's flags), disassembles the cubin with
``nvdisasm`` and splits the code at its ``USETMAXREG`` instructions: in a kernel with explicit
warpgroup roles each role starts with one, so each region is one role (region 0 holds the common
prologue and whichever role comes first in the code). Per region: instructions, spill loads and
stores (LDL / STL), MUFU.EX2, HGMMA, BAR.SYNC and mbarrier (SYNCS) instructions. Static counts:
unrolled loops count once per unrolled copy, a loop body once however often it runs.

    python3 scripts/sass_report.py forward_fused[bfloat16,float32,h0=False][K=V=128] state_output_roles
    python3 scripts/sass_report.py --source kernel.cu

``nvdisasm`` comes with a full CUDA toolkit; where only nvcc is installed (this project's CPU
machines), ``pip install nvidia-cuda-nvdisasm`` provides it (found on PATH, in $NVDISASM, or in
that wheel's ``nvidia/cu13/bin``).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

COUNTED = (("spill", re.compile(r"\b(LDL|STL)\b")), ("MUFU.EX2", re.compile(r"MUFU\.EX2")),
           ("HGMMA", re.compile(r"\bHGMMA\.")), ("BAR.SYNC", re.compile(r"\bBAR\.SYNC")),
           ("SYNCS", re.compile(r"\bSYNCS\.")))
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")


def role_regions(sass: str) -> list[dict]:
    """Split disassembled SASS at its ``USETMAXREG`` instructions; per region, the register count
    it sets (None for the first) and the counts of ``COUNTED`` and of all instructions."""
    regions = [{"setmaxnreg": None, "instructions": 0, **{name: 0 for name, _ in COUNTED}}]
    for line in sass.splitlines():
        match = INSTRUCTION.search(line)
        if match is None:
            continue
        text = match.group(1)
        if "USETMAXREG" in text:
            count = re.search(r"(0x[0-9a-f]+)\s*$", text)
            regions.append({"setmaxnreg": int(count.group(1), 16) if count else None, "instructions": 0,
                            **{name: 0 for name, _ in COUNTED}})
        region = regions[-1]
        region["instructions"] += 1
        for name, pattern in COUNTED:
            if pattern.search(text):
                region[name] += 1
    return regions


def find_nvdisasm() -> str | None:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if found:
        return found
    for root in sys.path:
        for path in glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")):
            return path
    return None


def assemble(source: str, workdir: str) -> tuple[str, str]:
    """(cubin path, ptxas's report) for TileLang-generated CUDA, with the project's nvcc flags."""
    from flash_gdn.hopper.launch import sm90_nvcc_command

    path = os.path.join(workdir, "kernel.cu")
    with open(path, "w") as f:
        f.write(source)
    cubin = os.path.join(workdir, "kernel.cubin")
    out = subprocess.run(sm90_nvcc_command(path, cubin, "-cubin", "-Xptxas", "-v"), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    report = [line.strip() for line in out.stderr.splitlines() if "spill" in line or "Used" in line
              or re.search(r"C75\d\d", line)]
    return cubin, "\n".join(report)


def report(name: str, source: str, nvdisasm: str) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        cubin, ptxas = assemble(source, workdir)
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    print(f"== {name}\n  {ptxas.replace(chr(10), chr(10) + '  ')}")
    for i, region in enumerate(role_regions(sass)):
        counts = ", ".join(f"{key} {region[key]}" for key, _ in COUNTED)
        print(f"  region {i} (setmaxnreg {region['setmaxnreg']}): {region['instructions']} instructions; {counts}")


def main(argv: list[str]) -> None:
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        sys.exit("no nvdisasm: pip install nvidia-cuda-nvdisasm, or set NVDISASM")
    if argv[:1] == ["--source"]:
        for path in argv[1:]:
            with open(path) as f:
                report(path, f.read(), nvdisasm)
        return
    from tilelang import tvm

    from flash_gdn.hopper.variants import all_variants

    for name, build in all_variants():
        if any(part in name for part in argv):
            with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
                source = build().get_kernel_source()
            report(name, source, nvdisasm)


if __name__ == "__main__":
    main(sys.argv[1:])
