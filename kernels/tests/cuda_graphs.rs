//! CUDA behaviour with no CPU counterpart: a captured step whose kernels
//! start early (programmatic edges) computes exactly what the same launches
//! compute one after another, and kernels that write a bf16 GEMM's input
//! give exactly their f32 results rounded. CUDA only: with
//! `KILN_TEST_DEVICE=cuda` (the GPU machine, where a CUDA that does not
//! work fails the tests); on the CPU there is nothing to check.

use half::bf16;
use kiln_kernels::cuda::{CudaSlice, Gpu};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DIM: usize = 4096;
const ROUNDS: usize = 6;

/// Device state of the chain: each round `h += y`, `xn = rmsnorm(h) * w`,
/// `y = W xn`, so every kernel reads what the one before it wrote (and the
/// norm overwrites the buffer the GEMV before it read).
struct Chain {
    h: CudaSlice<f32>,
    y: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    w: CudaSlice<bf16>,
    pick: CudaSlice<u32>,
}

impl Chain {
    fn new(gpu: &Gpu, rng: &mut ChaCha8Rng) -> Chain {
        let v = |n: usize, rng: &mut ChaCha8Rng| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
        };
        let w: Vec<bf16> = v(DIM * DIM, rng)
            .into_iter()
            .map(|x| bf16::from_f32(x * 0.02))
            .collect();
        Chain {
            h: gpu.upload(&v(DIM, rng)).unwrap(),
            y: gpu.upload(&v(DIM, rng)).unwrap(),
            xn: gpu.upload(&vec![f32::NAN; DIM]).unwrap(),
            norm: gpu.upload(&v(DIM, rng)).unwrap(),
            w: gpu.upload(&w).unwrap(),
            pick: gpu.upload(&[u32::MAX]).unwrap(),
        }
    }

    fn launch(&mut self, gpu: &Gpu) -> Result<(), kiln_kernels::KernelError> {
        for _ in 0..ROUNDS {
            gpu.rmsnorm_residual(
                &mut self.h,
                Some(&self.y),
                &self.norm,
                &mut self.xn,
                1,
                DIM,
                1e-5,
            )?;
            gpu.gemv_bf16_parts(&self.xn, &self.w, &mut [&mut self.y], &[DIM], 1, DIM)?;
        }
        gpu.argmax_rows(&self.y, 1, DIM, &mut self.pick.slice_mut(..))
    }

    fn results(&self, gpu: &Gpu) -> (Vec<f32>, Vec<f32>, u32) {
        let pick = gpu.download(&self.pick).unwrap()[0];
        (
            gpu.download(&self.h).unwrap(),
            gpu.download(&self.y).unwrap(),
            pick,
        )
    }
}

#[test]
fn programmatic_graph_replays_exactly_what_eager_launches_compute() {
    if std::env::var("KILN_TEST_DEVICE").as_deref() != Ok("cuda") {
        return;
    }
    let mut gpu = Gpu::open(0, true)
        .unwrap_or_else(|e| panic!("KILN_TEST_DEVICE=cuda, but CUDA does not work: {e}"));
    let seed: u64 = rand::rng().random();
    eprintln!("seed {seed}");
    let mut eager = Chain::new(&gpu, &mut ChaCha8Rng::seed_from_u64(seed));
    eager.launch(&gpu).unwrap();
    let want = eager.results(&gpu);
    assert!(want.0.iter().chain(&want.1).all(|v| v.is_finite()));
    let sm90 = gpu.name().contains("sm_9") || gpu.name().contains("sm_1");
    // A plain graph first, then one with programmatic edges.
    for programmatic in [false, true] {
        gpu.set_programmatic(programmatic);
        let mut chain = Chain::new(&gpu, &mut ChaCha8Rng::seed_from_u64(seed));
        let graph = gpu.capture(|| chain.launch(&gpu)).unwrap();
        // Every consecutive pair: ROUNDS x 2 kernels, then the argmax.
        let edges = if programmatic && sm90 { 2 * ROUNDS } else { 0 };
        assert_eq!(graph.programmatic_edges(), edges);
        gpu.replay(&graph).unwrap();
        gpu.synchronize().unwrap();
        let got = chain.results(&gpu);
        let what = if programmatic {
            "programmatic"
        } else {
            "plain"
        };
        assert_eq!(got.2, want.2, "argmax after the {what} graph");
        assert!(got.0 == want.0, "h differs after the {what} graph");
        assert!(got.1 == want.1, "y differs after the {what} graph");
    }
}

#[test]
fn bf16_activations_equal_the_f32_results_rounded() {
    if std::env::var("KILN_TEST_DEVICE").as_deref() != Ok("cuda") {
        return;
    }
    let gpu = Gpu::open(0, true)
        .unwrap_or_else(|e| panic!("KILN_TEST_DEVICE=cuda, but CUDA does not work: {e}"));
    let seed: u64 = rand::rng().random();
    eprintln!("seed {seed}");
    let rng = &mut ChaCha8Rng::seed_from_u64(seed);
    let mut v = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0..3.0)).collect() };
    let rounded =
        |x: &[f32]| -> Vec<u16> { x.iter().map(|v| bf16::from_f32(*v).to_bits()).collect() };
    let bits = |x: &[bf16], n: usize| -> Vec<u16> { x[..n].iter().map(|v| v.to_bits()).collect() };
    let mut scratch = gpu.gemm_scratch(5, 14336, false).unwrap();
    // The norm, with and without a residual, on rows of 4096 and of 102
    // (the 16-byte path and the scalar one).
    for (rows, dim) in [(5usize, 4096usize), (3, 102)] {
        for with_residual in [false, true] {
            let (x0, r, w) = (v(rows * dim), v(rows * dim), v(dim));
            let (r, w) = (gpu.upload(&r).unwrap(), gpu.upload(&w).unwrap());
            let residual = with_residual.then_some(&r);
            let mut x = gpu.upload(&x0).unwrap();
            let mut out = gpu.upload(&vec![f32::NAN; rows * dim]).unwrap();
            gpu.rmsnorm_residual(&mut x, residual, &w, &mut out, rows, dim, 1e-5)
                .unwrap();
            let want = rounded(&gpu.download(&out).unwrap());
            let mut x = gpu.upload(&x0).unwrap();
            let (s, n) = (&mut scratch, rows * dim);
            gpu.rmsnorm_residual_bf16(&mut x, residual, &w, s, rows, dim, 1e-5)
                .unwrap();
            let got = bits(&gpu.download(scratch.activations()).unwrap(), n);
            assert_eq!(
                got, want,
                "rmsnorm {rows} x {dim}, residual {with_residual}"
            );
        }
    }
    let n = 5 * 14336;
    let (g0, up) = (v(n), v(n));
    let (g, up) = (gpu.upload(&g0).unwrap(), gpu.upload(&up).unwrap());
    gpu.silu_mul_bf16(&g, &up, &mut scratch, n).unwrap();
    let got = bits(&gpu.download(scratch.activations()).unwrap(), n);
    assert_eq!(
        gpu.download(&g).unwrap(),
        g0,
        "the bf16 form leaves gate as it was"
    );
    let mut g = g;
    gpu.silu_mul(&mut g, &up, n).unwrap();
    assert_eq!(got, rounded(&gpu.download(&g).unwrap()), "silu-mul");
}
