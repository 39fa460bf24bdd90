# Shared setup of the device scripts (sourced, not run): unpack the carried binaries into out/bin,
# the environment every device run uses, and the GPU's name beside the results. Expects OUT set.
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do xz -dc "$f" > "out/bin/$(basename "$f" .xz)"; chmod +x "out/bin/$(basename "$f" .xz)"; done
export CUBECL_AUTOTUNE_LEVEL=minimal RUST_LOG=warn
export DSPARK_MODELS=$PWD/models DSPARK_GOLDEN=$PWD/dspark/tests/fixtures/golden
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# Each kernel of one FP8 + FP8-head γ = 7 proposal under Nsight Compute (graph nodes), listed by
# benches/ncu_summary.py. $1: the CSV file under $OUT.
ncu_fp8h_propose() {
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 150 "$ncu" --clock-control none --profile-from-start off --graph-profiling node \
        --metrics gpu__time_duration.sum,launch__registers_per_thread --csv --print-units base \
        --log-file "$OUT/$1" out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c \
        --weights fp8h --reps 2 --warmup 3 --profile propose > /dev/null 2>&1
    echo "ncu exit $?"; python3 benches/ncu_summary.py "$OUT/$1" "fp8h propose" | head -30
}
