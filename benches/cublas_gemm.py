"""cuBLAS (through PyTorch) on the shapes of `bench-kernels`: the yardstick for the skinny GEMM.

Times `x @ W.T` in bf16 with CUDA events over rotating weight copies (more than 2x the L2
cache), median of 5 windows of `iters` calls, and prints the same columns as bench-kernels.

    python3 benches/cublas_gemm.py --rows 1,2,4,8,16,32,64
"""
import argparse
import statistics

import torch

MATRICES = [
    ("q/o proj", 4096, 4096),
    ("k/v proj", 4096, 1024),
    ("qkv fused", 4096, 6144),
    ("gate/up", 4096, 12288),
    ("gate+up fused", 4096, 24576),
    ("down", 12288, 4096),
    ("draft fc (5 layers)", 20480, 4096),
    ("lm_head", 4096, 151936),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rotate-bytes", type=int, default=100 << 20)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda")
    print(f"# cuBLAS via PyTorch {torch.__version__}, {torch.cuda.get_device_name()}\n")
    print("| matrix | in | out | MB | rows | cuBLAS us | cuBLAS TB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, inp, out in MATRICES:
        nbytes = inp * out * 2
        copies = max(1, min(16, -(-args.rotate_bytes // nbytes)))
        ws = [torch.randn(out, inp, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, inp, device=dev, dtype=torch.bfloat16)
            for w in ws[:2]:
                torch.matmul(x, w.T)
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(args.iters):
                    torch.matmul(x, ws[i % copies].T)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / args.iters)
            t = statistics.median(times)
            print(f"| {name} | {inp} | {out} | {nbytes / 1e6:.1f} | {rows} | {t * 1e6:.1f} | {nbytes / t / 1e12:.2f} |")
        del ws


if __name__ == "__main__":
    main()
