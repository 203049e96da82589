"""What FP8 tensor cores give over bf16 on this GPU for the Llama-3-8B
prefill products, through PyTorch: bf16 `x @ W.T` (cuBLAS) against
torch._scaled_mm on e4m3 with one scale per tensor (cuBLASLt) and with a
scale per token and per output channel (rowwise, as Kiln's W8A8 scales).
CUDA-event timed, median of 20 after warm-up. Prints us and TFLOP/s per
(rows, out x in) and each FP8 form's ratio to bf16: the ceiling for
`--weights fp8` prefill (issue 18 asks 1.5x bf16).

    python3 scripts/torch_fp8_gemm.py --rows 1024,2048,4096
"""

import argparse
import statistics

import torch

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def timed(fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1024,2048,4096")
    args = p.parse_args()
    dev = "cuda"
    e4m3 = torch.float8_e4m3fn
    print(f"{'rows':>5} {'out x in':>12} {'bf16 us':>9} {'tensor us':>10} {'rowwise us':>11}"
          f" {'bf16 TF':>8} {'tensor x':>9} {'rowwise x':>10}")
    for m in [int(r) for r in args.rows.split(",")]:
        for n, k in SHAPES:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            xq, wq = x.to(e4m3), w.to(e4m3)
            one = torch.ones((), device=dev)
            sx = torch.rand(m, 1, device=dev) + 0.5
            sw = torch.rand(1, n, device=dev) + 0.5
            t_bf16 = timed(lambda: x @ w.T)
            t_tensor = timed(lambda: torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16))
            try:
                t_row = timed(lambda: torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw,
                                                       out_dtype=torch.bfloat16))
            except RuntimeError as e:
                print(f"rowwise: {e}")
                t_row = float("nan")
            tf = 2 * m * n * k / t_bf16 / 1e6
            print(f"{m:>5} {f'{n}x{k}':>12} {t_bf16:>9.1f} {t_tensor:>10.1f} {t_row:>11.1f}"
                  f" {tf:>8.0f} {t_bf16 / t_tensor:>9.2f} {t_bf16 / t_row:>10.2f}")


if __name__ == "__main__":
    main()
