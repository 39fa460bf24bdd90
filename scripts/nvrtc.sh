#!/usr/bin/env bash
# Installs NVRTC and the CUDA headers from PyPI into DIR (default target/nvrtc), for compiling
# the CUDA kernels without a GPU (dspark-kernels' `offline_kernels` test), and prints the two
# variables that test reads, for `eval`:
#
#   eval "$(bash scripts/nvrtc.sh target/nvrtc)"
#
# CUDA 13.0, the H200 machine's toolkit. Nothing is downloaded when DIR already holds them.
set -euo pipefail
dir=${1:-target/nvrtc}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
root="$dir/nvidia/cu13"
if [ ! -e "$root/lib/libnvrtc.so.13" ] || [ ! -e "$root/include/cuda_bf16.h" ]; then
    python3 -m pip install -q --no-deps --target "$dir" \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
fi
echo "export LD_LIBRARY_PATH=\"$root/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export DSPARK_CUDA_INCLUDE=\"$root/include\""
