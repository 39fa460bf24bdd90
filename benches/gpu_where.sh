#!/usr/bin/env bash
# Where the time of one recorded target step, one 8-row verify and one FP8 + FP8-head γ = 7
# proposal goes, per kernel under Nsight Compute (graph nodes), on whatever card the call gets:
# the per-role table of benches/ncu_layer.py for the step and the verify, the per-kernel table
# of benches/ncu_summary.py for the proposal. Expects bench-draft, xz-compressed, in out/carry.
# Usage: benches/gpu_where.sh
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
ncu_step_verify
ncu_fp8h_propose ncu-fp8h.csv | tee -a "$OUT/ncu.md"
