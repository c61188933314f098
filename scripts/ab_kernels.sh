#!/usr/bin/env bash
# A/B per-kernel GPU time in one process family on one GPU: this tree's Hopper kernels, then the
# same rows with baseline versions of some modules swapped in (restored afterwards).
#
#   scripts/ab_kernels.sh --prepare REV DIR   # on a machine with git: DIR gets REV's version of
#                                             # every flash_gdn/hopper module that differs from the tree
#   scripts/ab_kernels.sh DIR                 # on the GPU host: profile, swap DIR in, profile, restore
#
# Env: ROWS_F / ROWS_B (scripts/profile_kernels.py row specs for forward / backward; empty: that part
# is skipped), PROFILE_ARGS (e.g. --save), PROFILE_ARGS_F (forward only, e.g. --infer: the inference
# forward), OUT (folder for the raw profiles; default /tmp/ab). Prints new | old side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  rev=$2 dir=$3
  mkdir -p "$dir"
  for f in $(git diff --name-only "$rev" -- flash_gdn/hopper/); do
    git show "$rev:$f" > "$dir/$(basename "$f")" 2>/dev/null || rm -f "$dir/$(basename "$f")"
  done
  ls "$dir"
  exit 0
fi
old=${1:?usage: scripts/ab_kernels.sh DIR}
out=${OUT:-/tmp/ab}
mkdir -p "$out"
rows_f=${ROWS_F-"16/64:8192x4 2/8:1x32768 16/64:1x32768"}
rows_b=${ROWS_B-"16/32:1x8192 2/4:1x32768"}
backup=$(mktemp -d)
cp flash_gdn/hopper/*.py "$backup"/
trap 'cp "$backup"/*.py flash_gdn/hopper/' EXIT
run() {  # $1: tag
  : > "$out/$1_fwd.txt"; : > "$out/$1_bwd.txt"
  [ -n "$rows_f" ] && python3 scripts/profile_kernels.py ${PROFILE_ARGS:-} ${PROFILE_ARGS_F:-} $rows_f 2>&1 | grep -v INFO > "$out/$1_fwd.txt"
  [ -n "$rows_b" ] && python3 scripts/profile_kernels.py --bwd ${PROFILE_ARGS:-} $rows_b 2>&1 | grep -v INFO > "$out/$1_bwd.txt"
}
run new
cp "$old"/*.py flash_gdn/hopper/
run old
keep='==|_kernel|total'
for part in fwd bwd; do
  paste -d'|' <(grep -E "$keep" "$out/new_$part.txt") <(grep -E "$keep" "$out/old_$part.txt") | cut -c1-200
done
