#!/usr/bin/env bash
# One command on a Hopper GPU host with no network (the device tool's machines), with the
# offline bundle unpacked once per machine into $SITE and put on PYTHONPATH:
#   scripts/gpu_run.sh 'python3 scripts/profile_kernels.py --bwd 4/8:8192x4'
# BUNDLE (default .gpu): site-py312-tilelang0.1.15.tar.xz and fla_core-0.6.0-py3-none-any.whl
# (scripts/make_gpu_bundle.sh). TileLang's kernel cache goes to $TILELANG_CACHE_DIR (default
# /tmp/tlc), so later calls on a still-warm machine skip compiles. Prints the GPU first.
set -uo pipefail
cmd=${1:?usage: scripts/gpu_run.sh 'COMMAND'}
cd "$(dirname "$0")/.."
bundle=${BUNDLE:-.gpu}
site=${SITE:-/tmp/flash_gdn_site}
if [ ! -d "$site/tilelang" ]; then
  mkdir -p "$site" && tar xJf "$bundle"/site-py312-tilelang*.tar.xz -C "$site" \
    && python3 -m pip install -q --no-index --no-deps --target "$site/fla" "$bundle"/fla_core-*.whl || exit 1
fi
export PYTHONPATH="$PWD:$site:$site/fla" FLA_FLASH_QLA=0 PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlc}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
bash -c "$cmd"
