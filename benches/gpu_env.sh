# Shared setup of the device scripts (sourced, not run): unpack the carried binaries into out/bin,
# the environment every device run uses, and the GPU's name beside the results. Expects OUT set.
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do xz -dc "$f" > "out/bin/$(basename "$f" .xz)"; chmod +x "out/bin/$(basename "$f" .xz)"; done
export CUBECL_AUTOTUNE_LEVEL=minimal RUST_LOG=warn
export DSPARK_MODELS=$PWD/models DSPARK_GOLDEN=$PWD/dspark/tests/fixtures/golden
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
