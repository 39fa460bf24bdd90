# Shared setup of the device scripts (sourced, not run): unpack the carried binaries into out/bin,
# the environment every device run uses, and the GPU's name beside the results. Expects OUT set.
# A carried `*.tar.xz` holds several binaries: the binaries share most of their code, so one
# archive of five is about half the size of five compressed alone (the call's 64 MiB carry).
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do
    case "$f" in
    *.tar.xz) xz -dc "$f" | tar x -C out/bin ;;
    *) xz -dc "$f" > "out/bin/$(basename "$f" .xz)" ;;
    esac
done
chmod +x out/bin/*
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

# Each launch of one recorded bf16 target step and one 8-row verify under Nsight Compute (graph
# nodes), named by role (benches/ncu_layer.py) and appended to $OUT/ncu.md.
ncu_step_verify() {
    local ncu phase
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    for phase in step verify; do
        timeout 200 "$ncu" --clock-control none --cache-control none --profile-from-start off --graph-profiling node \
            --metrics gpu__time_duration.sum --csv --print-units base --log-file "$OUT/ncu-$phase.csv" \
            out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights bf16 --reps 2 --warmup 3 \
            --context 512 --profile "$phase" > /dev/null 2> "$OUT/ncu-$phase.log"
        echo "ncu $phase exit $?"; python3 benches/ncu_layer.py "$OUT/ncu-$phase.csv" "$phase" | tee -a "$OUT/ncu.md"
    done
}

# Runs a carried test binary ($1) on one thread with the given test filters ($4 …) under a time
# limit ($2 s), its output in $OUT/$3, and prints its exit status and the lines that say what
# happened (tests, results, panics, errors, τ, divergences).
gpu_test() {
    local bin=$1 limit=$2 log=$3
    shift 3
    timeout "$limit" "out/bin/$bin" --test-threads=1 --nocapture "$@" > "$OUT/$log" 2>&1
    echo "$bin exit $?"
    grep -E "^test |test result|panicked|rel err|tau|differ|lossless|divergence" "$OUT/$log" | cut -c1-200
}

# Runs a carried bench binary ($1) with its arguments ($3 …) under a time limit ($2 s), its table
# in $OUT/N-$1.md (N counts the runs of the calling script, so interleaved runs keep their
# order) and its log beside it, and prints its exit status and the table's rows.
gpu_bench() {
    local bin=$1 limit=$2
    shift 2
    GPU_BENCH_RUNS=$((${GPU_BENCH_RUNS:-0} + 1))
    timeout "$limit" "out/bin/$bin" "$@" > "$OUT/$GPU_BENCH_RUNS-$bin.md" 2> "$OUT/$GPU_BENCH_RUNS-$bin.log"
    echo "$bin exit $?"
    grep -E "^\| cuda" "$OUT/$GPU_BENCH_RUNS-$bin.md" | cut -c1-260
}
