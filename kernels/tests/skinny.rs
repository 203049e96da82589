//! The skinny and cluster bf16 GEMMs, and cuBLAS by the algorithms tuning
//! keeps, against float64 over the same bf16 values, for every block count
//! of activation rows, stacked parts, tail strips and tiles, and every
//! cluster size the Llama-3-8B shapes take.
//! CUDA only, so ignored unless asked
//! for: `KILN_TEST_DEVICE=cuda` with `--include-ignored`.

use cudarc::driver::CudaSlice;
use half::bf16;
use kiln_kernels::cuda::{Bf16Out, ClusterMma, GemmShape, Gpu, StackShape, TuneBf16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn skinny_bf16_gemm_matches_float64_for_every_part_and_row_count() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // q, k and v of a grouped-query layer: 13 strips, so the last block
    // of two strips has one past the end; then one part of 4 tiles, fewer
    // than a block's warps.
    for (parts, k) in [(&[144usize, 32, 32][..], 640usize), (&[256][..], 256)] {
        let rows = [2usize, 8, 13, 16, 27, 40, 64];
        check(&gpu, &mut rng, parts, k, &rows, Gpu::gemm_bf16_skinny);
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn cluster_bf16_gemm_matches_float64_for_every_part_row_count_and_cluster_size() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    // Ragged parts over two tiles (a cluster of 2, the last tile mostly
    // past the end); 3 tiles split 8 ways; 48 tiles split 5 ways (the
    // q/k/v split on 132 SMs), uneven stages a block.
    let rows = [1usize, 17, 31, 32, 33, 64];
    for (parts, k) in [
        (&[144usize, 32, 32][..], 640usize),
        (&[256, 128][..], 4096),
        (&[4096, 1024, 1024][..], 1344),
    ] {
        check(&gpu, &mut rng, parts, k, &rows, |g, x, w, o, s| {
            g.gemm_bf16_cluster_on(ClusterMma::Ldmatrix, x, w, o, s)
        });
        check(&gpu, &mut rng, parts, k, &rows, |g, x, w, o, s| {
            g.gemm_bf16_cluster_on(ClusterMma::Wgmma, x, w, o, s)
        });
        check(&gpu, &mut rng, parts, k, &rows, |g, x, w, o, s| {
            g.gemm_bf16_cluster_on(ClusterMma::WgmmaOverlap, x, w, o, s)
        });
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn tuned_cublas_algorithms_match_float64_for_every_part_and_row_count() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    // Each part's shape tuned with its fastest algorithm kept whatever
    // cublasGemmEx does, so every product below runs a tuned one.
    let rows = [17usize, 24, 40, 64, 256];
    for (parts, k) in [(&[144usize, 32, 32][..], 640usize), (&[4096][..], 1024)] {
        let n: usize = parts.iter().sum();
        let w = s.alloc_zeros::<bf16>(n * k).unwrap();
        let mut row0 = 0;
        for &p in parts {
            let tune = TuneBf16 {
                rows: &rows,
                candidates: 8,
                keep_below: f64::INFINITY,
                out: Bf16Out::F32,
            };
            let shape = GemmShape { m: 0, n: p, k };
            let found = gpu.tune_bf16(&w, row0, shape, tune).unwrap();
            assert_eq!(found.len(), rows.len(), "part of {p}: a row count untuned");
            for t in &found {
                assert!(t.kept, "{:?}: fastest algorithm not kept", t.shape);
                eprintln!(
                    "{:?}: cublasGemmEx {:.1} us, cuBLASLt rank {} {:.1} us",
                    t.shape, t.gemmex_us, t.best.rank, t.best.us
                );
            }
            row0 += p;
        }
        check(&gpu, &mut rng, parts, k, &rows, Gpu::gemm_bf16_cublas);
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn cluster_bf16_gemm_gives_the_same_bits_every_run() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (m, n, k) = (64usize, 512usize, 4096usize);
    let x: Vec<bf16> = (0..m * k)
        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
        .collect();
    let w: Vec<bf16> = (0..n * k)
        .map(|_| bf16::from_f32(rng.random_range(-0.5..0.5)))
        .collect();
    let (x, w) = (s.clone_htod(&x).unwrap(), s.clone_htod(&w).unwrap());
    let shape = StackShape { m, parts: &[n], k };
    for mma in ClusterMma::ALL {
        let mut runs = Vec::new();
        for _ in 0..3 {
            let mut out = s.alloc_zeros::<f32>(m * n).unwrap();
            gpu.gemm_bf16_cluster_on(mma, &x, &w, &mut [&mut out], shape)
                .unwrap();
            runs.push(s.clone_dtoh(&out).unwrap());
        }
        let same = runs.iter().all(|r| r == &runs[0]);
        assert!(same, "{mma:?}: the partial sums met in another order");
    }
}

/// A bf16 product of bf16 activations and a stack of bf16 weights.
type Gemm = fn(
    &Gpu,
    &CudaSlice<bf16>,
    &CudaSlice<bf16>,
    &mut [&mut CudaSlice<f32>],
    StackShape<'_>,
) -> Result<(), kiln_kernels::KernelError>;

/// `gemm` over `parts` of rows of `k` for each count of activation rows
/// in `ms`, against float64.
fn check(gpu: &Gpu, rng: &mut ChaCha8Rng, parts: &[usize], k: usize, ms: &[usize], gemm: Gemm) {
    let s = gpu.stream().clone();
    let n: usize = parts.iter().sum();
    let round = |v: f32| bf16::from_f32(v);
    let w: Vec<bf16> = (0..n * k)
        .map(|_| round(rng.random_range(-0.5..0.5)))
        .collect();
    let wd = s.clone_htod(&w).unwrap();
    for &m in ms {
        let x: Vec<bf16> = (0..m * k)
            .map(|_| round(rng.random_range(-2.0..2.0)))
            .collect();
        let xd = s.clone_htod(&x).unwrap();
        let mut outs: Vec<_> = parts
            .iter()
            .map(|p| s.alloc_zeros::<f32>(m * p).unwrap())
            .collect();
        let mut refs: Vec<_> = outs.iter_mut().collect();
        let shape = StackShape { m, parts, k };
        gemm(gpu, &xd, &wd, &mut refs, shape).unwrap();
        let mut base = 0;
        for (out, &rows) in outs.iter().zip(parts) {
            let got = s.clone_dtoh(out).unwrap();
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for i in 0..m {
                for r in 0..rows {
                    let want: f64 = (0..k)
                        .map(|c| x[i * k + c].to_f64() * w[(base + r) * k + c].to_f64())
                        .sum();
                    num += (got[i * rows + r] as f64 - want).powi(2);
                    den += want * want;
                }
            }
            let rel = (num / den).sqrt();
            // Exact bf16 products summed in f32.
            assert!(rel < 1e-5, "m={m}, k={k}, part of {rows}: rel err {rel}");
            base += rows;
        }
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn skinny_bf16_gemm_refuses_shapes_it_cannot_tile() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let x = s.alloc_zeros::<bf16>(65 * 128).unwrap();
    let w = s.alloc_zeros::<bf16>(40 * 128).unwrap();
    let mut out = s.alloc_zeros::<f32>(65 * 40).unwrap();
    for (m, rows, k) in [(1, 32, 128), (65, 32, 128), (8, 40, 128), (8, 32, 96)] {
        let shape = StackShape {
            m,
            parts: &[rows],
            k,
        };
        assert!(
            gpu.gemm_bf16_skinny(&x, &w, &mut [&mut out], shape)
                .is_err(),
            "{m} x {k} by {rows}"
        );
    }
}
