#!/usr/bin/env bash
# Builds the offline bundle for a CPython 3.12 x86-64 Hopper host that has torch and CUDA but
# no package index: tilelang and its runtime deps unpacked into one site folder (xz), and the
# FLA baseline wheel. Run on a machine with network:   scripts/make_gpu_bundle.sh [OUT_DIR]
set -euo pipefail
out=${1:-gpu-bundle}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$work/wheels" \
  tilelang==0.1.15 apache-tvm-ffi==0.1.12 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5
mkdir -p "$work/site"
for whl in "$work"/wheels/*.whl; do python3 -m zipfile -e "$whl" "$work/site"; done
tar -C "$work/site" -cf - . | xz -9 -T0 > "$out/site-py312-tilelang0.1.15.tar.xz"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$out" fla-core==0.6.0
ls -l "$out"
