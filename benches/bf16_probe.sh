#!/usr/bin/env bash
# Expects the CUDA build of the CLI, xz-compressed, at out/carry2/dspark.xz (see gpu_run.sh for the build).
# bf16 speculative greedy on CUDA with the golden tiny pair, timed per phase.
G=dspark/tests/fixtures/golden
xz -dc out/carry2/dspark.xz > /tmp/dspark && chmod +x /tmp/dspark
P0=37,35,253,491,331
P2=220,79,107,117,73,108,120,305,339,317,82,20,217,295,28,93,138,23,426,120,60,309,169,123,386,347,357,203,163,113,281,376,339,73,439,161,430,29,207,316
for dtype in bf16; do
  for p in $P0 $P2; do
    for draft in "" "--draft $G/tiny-dspark"; do
      s=$SECONDS
      timeout 200 /tmp/dspark generate --target $G/tiny-qwen3 $draft --device cuda --dtype $dtype --prompt-ids $p --max-new-tokens 24 --ignore-eos --json 2>&1 | tail -2 | cut -c1-600
      echo "[$dtype draft='${draft:+yes}' prompt ${p:0:10}: rc ${PIPESTATUS[0]}, $((SECONDS - s)) s]"
    done
  done
done
