#!/usr/bin/env bash
# Device calls for three draft-round changes (issues 4 and 8), staged off until these checks
# passed (H100, 2026-12-06: benches/results/2026-12-06-h100-staged.md) and on by default since;
# the phases still check and time them against the paths they replaced:
# - the confidence head on the device (`dspark_kernels::confidence_logits`,
#   `set_confidence_kernel`): a round reads back γ confidence logits a lane instead of its γ
#   hidden rows, and the host makes no dot products after the read;
# - the FP8 gate/up SwiGLU epilogue (`linear_fp8_swiglu`, `set_fp8_swiglu`): an FP8 draft
#   layer's gate/up product and SwiGLU in one launch;
# - the parallel draw walk (`set_parallel_draws`): a sampled Markov step's draw makes its segment
#   weights one thread each and walks the chosen thread's values on that thread, instead of
#   thread 0 making some 2·segments + 17 f64 exponentials alone; the same draws.
# Expects prebuilt binaries, xz-compressed, in out/carry (see benches/gpu_round.sh for the
# build): gpu_kernels and gpu_golden for `check` and `check8b`, bench-draft for `bench`.
#   check: gpu_kernels `confidence_logits_match_reference` (the kernel against its body and
#          f64: DSpark widths, 1–4 lanes of γ 7 and 16, with and without the Markov term) and
#          `linear_fp8_swiglu_matches_reference` (bit for bit against the product + the SwiGLU
#          kernel, and against f64) and `sample_rows_parallel_walk_matches_serial` (the same draws
#          bit for bit, inverse-CDF draws); gpu_golden with the switches on: the trained pair's
#          greedy speculative = target-only (bf16 and FP8 drafts: τ must equal the unswitched
#          runs'), the FP8 draft's sampled distribution (χ²), the device acceptance, target-only
#          sampled tokens drawn on the device = the host rule.
#   base: the trained pair's FP8-draft test with the three switches off, for the τ `check`
#          repeats.
#   check8b: gpu_golden at Qwen3-8B shapes with the switches on: recorded draft rounds = op by
#          op (confidences bit for bit; the host head's within 1e-5, the same drafts), the FP8
#          draft lossless on 4 lanes.
#   bench: bench-draft γ = 7c, FP8 + FP8 head, the head on the device against the host and the
#          FP8 epilogue off against on, 30 repetitions, one process for the whole vocabulary and
#          one for 16 384 ids; then the host spans of one proposal each way (`propose_finish` is
#          the host's work after the read).
#   quick: what one short call can hold (about two minutes): the three gpu_kernels checks of
#          `check`, then one bench-draft process, γ = 7c FP8 + FP8 head over 16 384 ids, all
#          eight combinations of the three switches (two drafts built: the epilogue is chosen
#          when a draft's layers are; the other two switch on a built draft), 20 repetitions.
#   golden: the gpu_golden half of `check` alone (after `quick`, which ran its kernel checks).
# Usage: benches/gpu_staged.sh check|golden|base|check8b|bench|bench2|quick
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"
export DSPARK_GPU_SWITCHES=confidence-kernel,fp8-swiglu,parallel-draws

case "$PHASE" in
check)
    timeout 120 out/bin/gpu_kernels --test-threads=1 --nocapture confidence_logits_match_reference \
        linear_fp8_swiglu_matches_reference sample_rows_parallel_walk_matches_serial \
        > "$OUT/gpu_kernels-staged.log" 2>&1
    echo "gpu_kernels exit $?"
    grep -E "^test |test result|panicked|linear_fp8_swiglu 4096->12288 rows (1|8):|parallel walk" "$OUT/gpu_kernels-staged.log" \
        | cut -c1-200
    ;&
golden)
    timeout 420 out/bin/gpu_golden --test-threads=1 --nocapture trained_pair fp8_draft_sampled device_acceptance \
        target_only_sampled \
        > "$OUT/gpu_golden-staged.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|kernel switch|tau|chi2|differ" "$OUT/gpu_golden-staged.log" | cut -c1-200
    ;;
base)
    # The trained pair's FP8 draft with the three switches off: its τ is what `check` must repeat
    # exactly (the changes give the same bits).
    DSPARK_GPU_SWITCHES=no-confidence-kernel,no-fp8-swiglu,serial-draws timeout 300 out/bin/gpu_golden --test-threads=1 --nocapture trained_pair_fp8 \
        > "$OUT/gpu_golden-unstaged.log" 2>&1
    echo "gpu_golden (switches off) exit $?"
    grep -E "test result|panicked|tau" "$OUT/gpu_golden-unstaged.log" | cut -c1-200
    ;;
check8b)
    timeout 500 out/bin/gpu_golden --test-threads=1 --nocapture qwen3_8b_shapes_recorded qwen3_8b_shapes_fp8 \
        > "$OUT/gpu_golden-staged-8b.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|kernel switch|differ|lossless|confidences" "$OUT/gpu_golden-staged-8b.log" \
        | cut -c1-200
    ;;
bench)
    unset DSPARK_GPU_SWITCHES
    for vocab in 0 16384; do
        timeout 200 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab "$vocab" \
            --confidence device,host --fp8-swiglu off,on --reps 30 --context 512 \
            > "$OUT/bench_draft-staged-vocab$vocab.md" 2> "$OUT/bench_draft-staged-vocab$vocab.log"
        echo "bench-draft vocab $vocab exit $?"
        grep "| cuda" "$OUT/bench_draft-staged-vocab$vocab.md" | cut -d'|' -f4,6,8,9,10,13,22-
    done
    timeout 150 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab 16384 --confidence device,host \
        --reps 20 --context 512 --spans > "$OUT/bench_draft-staged-spans.md" 2> "$OUT/bench_draft-staged-spans.log"
    echo "bench-draft --spans exit $?"
    grep -E "span: propose \(|propose_finish|propose_readback|wall" "$OUT/bench_draft-staged-spans.md" | head -16
    ;;
bench2)
    unset DSPARK_GPU_SWITCHES
    for vocab in 0 16384; do
        for walk in off on; do
            timeout 140 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab "$vocab" --confidence device \
                --fp8-swiglu on --parallel-draws "$walk" --reps 30 --context 512 \
                > "$OUT/bench_draft-draws-$walk-vocab$vocab.md" 2> "$OUT/bench_draft-draws-$walk-vocab$vocab.log"
            echo "bench-draft vocab $vocab parallel draws $walk exit $?"
            grep "| cuda" "$OUT/bench_draft-draws-$walk-vocab$vocab.md" | cut -d'|' -f6,7,13,14,15,21
        done
    done
    ;;
quick)
    timeout 75 out/bin/gpu_kernels --test-threads=1 --nocapture confidence_logits_match_reference \
        linear_fp8_swiglu_matches_reference sample_rows_parallel_walk_matches_serial \
        > "$OUT/gpu_kernels-staged.log" 2>&1
    echo "gpu_kernels exit $?"
    grep -E "^test |test result|panicked|parallel walk" "$OUT/gpu_kernels-staged.log" | cut -c1-160
    unset DSPARK_GPU_SWITCHES
    timeout 150 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab 16384 --confidence host,device \
        --fp8-swiglu off,on --parallel-draws off,on --reps 20 --context 512 \
        > "$OUT/bench_draft-staged-quick.md" 2> "$OUT/bench_draft-staged-quick.log"
    echo "bench-draft exit $?"
    grep "| cuda" "$OUT/bench_draft-staged-quick.md" | cut -d'|' -f6,9,13,14,15,20,21,24,27,28
    ;;
esac
