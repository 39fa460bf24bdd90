#!/usr/bin/env bash
# Run a stage of scripts/pair/train.py on the GPU machine and copy what should come back into
# $OUT (at most 8 files): the log, the target's config/weights/generation config, the draft's
# config/weights, and report.json. Tokenizer files are not copied: they are in the corpus.
#
# Usage (from the repo root): bash scripts/pair/gpu_run.sh [all|target|draft] [train.py args...]
# Reads the corpus from out/pair/corpus and writes the run to out/pair/run (both git-ignored).
set -uo pipefail
stage=${1:-all}
shift || true
run=out/pair/run
dest=${OUT:-out/pair/export}
mkdir -p "$dest" "$run"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python3 scripts/pair/train.py --corpus out/pair/corpus --out "$run" --stage "$stage" "$@" 2>&1 \
    | grep --line-buffered -v -E "Warning|warnings.warn" | tee "$dest/train-$stage.log"
rc=${PIPESTATUS[0]}
if [ -f "$run/target/model.safetensors" ]; then
    mkdir -p "$dest/target"
    cp "$run"/target/{config.json,model.safetensors,generation_config.json} "$dest/target/"
fi
if [ "$stage" != target ] && [ -f "$run/draft/model.safetensors" ]; then
    mkdir -p "$dest/draft"
    cp "$run"/draft/{config.json,model.safetensors} "$dest/draft/"
fi
[ -f "$run/report.json" ] && cp "$run/report.json" "$dest/"
ls -la "$dest" "$dest"/* 2>/dev/null
exit "$rc"
