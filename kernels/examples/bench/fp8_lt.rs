//! cuBLASLt's W8A8 algorithms one by one at prefill's products: for each
//! Llama-3-8B product at 1024-8192 rows, the algorithm Kiln takes (rank 0)
//! against the fastest of the first 16, on FP8 rows read in place with
//! their 16-byte headers (the stored format, a scale per row and per
//! token), on packed codes (as the device now uploads them), and on packed
//! codes with one scale per operand.

use cudarc::driver::CudaSlice;
use half::bf16;
use kiln_kernels::cuda::{GemmShape, Gpu, LtProbe, LtTiming};
use rand::{Rng, RngCore};

use super::E;

/// Prints one line per (rows, product, layout).
pub fn run(gpu: &Gpu, rng: &mut rand::rngs::StdRng) -> Result<(), E> {
    let s = gpu.stream().clone();
    println!(
        "{:>5} {:>11} {:>18} {:>9} {:>8} {:>13} {:>8} {:>6}",
        "rows", "n x k", "layout", "rank0 us", "TFLOP/s", "best us (rank)", "TFLOP/s", "gain"
    );
    // Finite e4m3 codes of either sign (clearing the exponent's low bit
    // leaves out 0x7f and 0xff, the NaNs), for weights and activations.
    // The gate/up stack with row headers, the largest buffer (above 8192
    // activation rows of 14336).
    let mut pool = vec![0u8; 28672 * (4096 + 16)];
    rng.fill_bytes(&mut pool);
    pool.iter_mut().for_each(|b| *b &= 0xf7);
    for (n, k) in [
        (6144usize, 4096usize),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
    ] {
        let w: CudaSlice<u8> = s.clone_htod(&pool[..n * (k + 16)])?;
        let ws: CudaSlice<f32> = s.clone_htod(
            &(0..n)
                .map(|_| rng.random_range(0.5f32..1.5))
                .collect::<Vec<_>>(),
        )?;
        for m in [1024usize, 2048, 8192] {
            let xq: CudaSlice<u8> = s.clone_htod(&pool[..m * k])?;
            let xs: CudaSlice<f32> = s.clone_htod(
                &(0..m)
                    .map(|_| rng.random_range(0.5f32..1.5))
                    .collect::<Vec<_>>(),
            )?;
            let mut out: CudaSlice<bf16> = s.alloc_zeros(m * n)?;
            let shape = GemmShape { m, n, k };
            let flops = 2.0 * (m * n * k) as f64;
            for (name, offset, ldw, outer) in [
                ("headers, per row", 16, k + 16, true),
                ("dense, per row", 0, k, true),
                ("dense, per tensor", 0, k, false),
            ] {
                let probe = LtProbe {
                    offset,
                    ldw,
                    outer,
                    count: 16,
                };
                let t = gpu.fp8_lt_timings(&w, &ws, &xq, &xs, &mut out, shape, probe)?;
                let first = t[0].us;
                let best = LtTiming::fastest(&t).ok_or("cuBLASLt offered no algorithm")?;
                println!(
                    "{m:>5} {:>11} {name:>18} {first:>9.1} {:>8.0} {:>13} {:>8.0} {:>5.2}x",
                    format!("{n}x{k}"),
                    flops / first / 1e6,
                    format!("{:.1} ({})", best.us, best.rank),
                    flops / best.us / 1e6,
                    first / best.us,
                );
            }
        }
    }
    Ok(())
}
