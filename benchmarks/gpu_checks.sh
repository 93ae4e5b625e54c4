#!/usr/bin/env bash
# The GPU checks in one command (one GPU, at most about 11 minutes): the GPU card, then the CUDA tier.
#
#   bash benchmarks/gpu_checks.sh OUTDIR
#
# Writes OUTDIR/gpu-card.json and OUTDIR/bench.log (benchmarks/bench_gpu.py), OUTDIR/tier.log (the
# CUDA tier, tests/gpu). Each part has its own time limit, so a hang ends that part, not the script.
# Then: `python benchmarks/table.py --gpu-card OUTDIR/gpu-card.json` puts the card into README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout --kill-after=20 330 python benchmarks/bench_gpu.py --out "$out/gpu-card.json" > "$out/bench.log" 2>&1
echo "bench_gpu.py: exit $?"
workers=$(python -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
# shellcheck disable=SC2086
timeout --kill-after=20 300 python -m pytest -q tests/gpu $workers -rsx -p no:cacheprovider > "$out/tier.log" 2>&1
echo "CUDA tier: exit $?"
tail -3 "$out/tier.log"
