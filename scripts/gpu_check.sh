#!/usr/bin/env bash
# On a Hopper GPU host with no network: GPU tests, then the benchmark, a short table last.
#   scripts/gpu_check.sh [BUNDLE_DIR] [-- extra args for python -m flash_gdn.bench]
# BUNDLE_DIR (default .gpu) holds the offline bundle of scripts/make_gpu_bundle.sh:
# site-py312-tilelang0.1.15.tar.xz and fla_core-0.6.0-py3-none-any.whl.
# Env: BENCH_MODES (default "fwd bwd train"; empty: tests only), PYTEST_ARGS (extra pytest args), OUT (copy results there).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-.gpu}
shift || true
[ "${1:-}" = "--" ] && shift
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true

# Every kernel variant the tests and the benchmark launch (K = V = 128 and 64, bf16 and fp16),
# compiled side by side first: the tests would otherwise compile them one by one as they go.
python3 -c "import time, torch; from flash_gdn import warmup; t = time.time(); n = warmup(128, (torch.bfloat16, torch.float16), backward=True) + warmup(64, (torch.bfloat16,), backward=True); print(f'warmup: {len(n)} variants in {time.time() - t:.0f} s')" 2>&1 | grep -v INFO
python3 -m pytest -q -m "gpu" tests ${PYTEST_ARGS:-} 2>&1 | tee /tmp/gpu_tests.log
test_rc=${PIPESTATUS[0]}

for mode in ${BENCH_MODES-fwd bwd train}; do   # BENCH_MODES="" runs the tests only
  python3 -m flash_gdn.bench --mode "$mode" "$@" 2>&1 | tee "/tmp/bench_$mode.log"
done
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*.json benchmarks/results/*.md "$OUT"/ 2>/dev/null; fi
echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1))"
echo "| what | result |"
echo "|---|---|"
echo "| GPU tests | $(tail -n 1 /tmp/gpu_tests.log | tr -d '=') |"
for mode in ${BENCH_MODES-fwd bwd train}; do
  echo "| bench $mode | $(grep -h 'Geometric-mean' "/tmp/bench_$mode.log" 2>/dev/null | tail -n 1) |"
done
exit $test_rc
