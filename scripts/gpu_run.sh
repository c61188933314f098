#!/usr/bin/env bash
# One command on a Hopper GPU host with no network (the device tool's machines), with the
# offline bundle unpacked once per machine and put on PYTHONPATH (scripts/gpu_env.sh):
#   scripts/gpu_run.sh 'python3 scripts/profile_kernels.py --bwd 4/8:8192x4'
# BUNDLE: the bundle's folder (default .gpu). TileLang's kernel cache goes to $TILELANG_CACHE_DIR (default
# /tmp/tlc), so later calls on a still-warm machine skip compiles. Prints the GPU first.
set -uo pipefail
cmd=${1:?usage: scripts/gpu_run.sh 'COMMAND'}
cd "$(dirname "$0")/.."
bundle=${BUNDLE:-.gpu}
source scripts/gpu_env.sh || exit 1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlc}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
bash -c "$cmd"
