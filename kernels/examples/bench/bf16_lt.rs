//! cuBLASLt's bf16 algorithms one by one at decode's products (16-256
//! rows), each launch reading its weights from memory (copies that
//! together overflow L2): `cublasGemmEx`, which the engine runs, against
//! cuBLASLt's first guess and the fastest of its first 32.

use cudarc::driver::CudaSlice;
use half::bf16;
use kiln_kernels::cuda::{GemmShape, Gpu, LtTiming};
use rand::Rng;

use super::E;

/// Bytes of weight copies a product rotates over (L2 is 50-60 MB).
const ROTATION_BYTES: usize = 256 << 20;

/// Prints one line per (rows, product).
pub fn run(gpu: &Gpu, rng: &mut rand::rngs::StdRng, copy: f64) -> Result<(), E> {
    let s = gpu.stream().clone();
    println!(
        "{:>4} {:>11} {:>15} {:>15} {:>15} {:>6} {:>30}",
        "rows",
        "n x k",
        "gemmex us (%)",
        "lt rank0 us",
        "best us (%)",
        "gain",
        "best: rank id tile split stages cluster"
    );
    let host: Vec<bf16> = (0..28672 * 4096)
        .map(|_| bf16::from_f32(rng.random_range(-0.05..0.05)))
        .collect();
    for (n, k) in [
        (6144usize, 4096usize),
        (4096, 4096),
        (14336, 4096),
        (28672, 4096),
        (4096, 14336),
    ] {
        let one = s.clone_htod(&host[..n * k])?;
        let bytes = n * k * 2;
        let copies = ROTATION_BYTES.div_ceil(bytes).max(2);
        let mut weights = vec![];
        for _ in 0..copies {
            let mut w: CudaSlice<bf16> = s.alloc_zeros(n * k)?;
            s.memcpy_dtod(&one, &mut w)?;
            weights.push(w);
        }
        drop(one);
        for m in [16usize, 32, 64, 128, 256] {
            let x: CudaSlice<bf16> = s.clone_htod(&host[..m * k])?;
            let mut out: CudaSlice<f32> = s.alloc_zeros(m * n)?;
            let shape = GemmShape { m, n, k };
            let (ex, t) = gpu.bf16_lt_timings(&weights, &x, &mut out, shape, 32)?;
            let pct = |us: f64| 100.0 * bytes as f64 / us / 1e3 / copy;
            let best = LtTiming::fastest(&t).ok_or("cuBLASLt offered no algorithm")?;
            let c = best.config;
            println!(
                "{m:>4} {:>11} {:>15} {:>15.1} {:>15} {:>5.2}x {:>30}",
                format!("{n}x{k}"),
                format!("{ex:.1} ({:.0})", pct(ex)),
                t[0].us,
                format!("{:.1} ({:.0})", best.us, pct(best.us)),
                ex / best.us,
                format!(
                    "{} {} {} {} {} {} ({:.1} waves)",
                    best.rank, c.id, c.tile, c.split_k, c.stages, c.cluster, best.waves
                ),
            );
        }
    }
    Ok(())
}
