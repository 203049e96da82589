//! The folded one-row GEMVs (norm and SiLU-and-multiply inside the
//! products) in a chain as a decode step runs them: the same results as
//! the separate norm, GEMV and SiLU launches they replace (to rounding),
//! and bit for bit the same whether launched one by one, replayed from a
//! plain graph or from one with programmatic edges, replay after replay
//! (each product after the norm reads the partial sums of squares the
//! product before it wrote, while that one may still be finishing).

use half::bf16;
use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaSlice, Gpu, NextNorm, NormArgs, NormSum, Normed, StackShape};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::device;

/// Hidden width, and the FFN's.
const DIM: usize = 4096;
const FFN: usize = 1536;
const ROUNDS: usize = 4;
const EPS: f32 = 1e-5;

/// Device state of a chain whose rounds are a layer's FFN half:
/// `h += down u`, then `u = silu(gate) * up` of `rmsnorm(h) * g`.
struct Chain {
    h: CudaSlice<f32>,
    u: CudaSlice<f32>,
    g: CudaSlice<f32>,
    down: CudaSlice<bf16>,
    gate_up: CudaSlice<bf16>,
    // Folded: the row times g and its sum of squares.
    gh: CudaSlice<f32>,
    sum: NormSum,
    // Apart: the down product, the norm's output, gate and up.
    p: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
}

impl Chain {
    fn new(gpu: &Gpu, seed: u64) -> Chain {
        let rng = &mut ChaCha8Rng::seed_from_u64(seed);
        let mut v =
            |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| rng.random_range(-s..s)).collect() };
        let bf = |x: Vec<f32>| -> Vec<bf16> { x.into_iter().map(bf16::from_f32).collect() };
        let nan = |n: usize| gpu.upload(&vec![f32::NAN; n]).unwrap();
        Chain {
            h: gpu.upload(&v(DIM, 1.0)).unwrap(),
            u: gpu.upload(&v(FFN, 1.0)).unwrap(),
            g: gpu.upload(&v(DIM, 2.0)).unwrap(),
            down: gpu.upload(&bf(v(DIM * FFN, 0.05))).unwrap(),
            gate_up: gpu.upload(&bf(v(2 * FFN * DIM, 0.05))).unwrap(),
            gh: nan(DIM),
            sum: gpu.norm_sum(DIM).unwrap(),
            p: nan(DIM),
            xn: nan(DIM),
            gate: nan(FFN),
            up: nan(FFN),
        }
    }

    fn folded(&mut self, gpu: &Gpu) -> Result<(), KernelError> {
        for _ in 0..ROUNDS {
            let c = &mut *self;
            let next = NextNorm {
                g: &c.g,
                gh: &mut c.gh,
                sum: &mut c.sum,
            };
            gpu.gemv_bf16_resid(&c.u, &c.down, &mut c.h, next, DIM, FFN)?;
            let normed = Normed {
                gh: &c.gh,
                sum: &c.sum,
                eps: EPS,
            };
            gpu.gemv_bf16_normed_silu(&normed, &c.gate_up, &mut c.u, FFN, DIM)?;
        }
        Ok(())
    }

    fn apart(&mut self, gpu: &Gpu) -> Result<(), KernelError> {
        for _ in 0..ROUNDS {
            let c = &mut *self;
            let down = StackShape {
                m: 1,
                parts: &[DIM],
                k: FFN,
            };
            gpu.gemv_bf16_parts(&c.u, &c.down, &mut [&mut c.p], down)?;
            let norm = NormArgs {
                residual: Some(&c.p),
                w: &c.g,
                rows: 1,
                cols: DIM,
                eps: EPS,
            };
            gpu.rmsnorm_residual(&mut c.h, &mut c.xn, &norm)?;
            let outs = &mut [&mut c.gate, &mut c.up];
            let gate_up = StackShape {
                m: 1,
                parts: &[FFN, FFN],
                k: DIM,
            };
            gpu.gemv_bf16_parts(&c.xn, &c.gate_up, outs, gate_up)?;
            gpu.silu_mul(&mut c.gate, &c.up, FFN)?;
            std::mem::swap(&mut c.u, &mut c.gate);
        }
        Ok(())
    }

    fn results(&self, gpu: &Gpu) -> (Vec<f32>, Vec<f32>) {
        (
            gpu.download(&self.h).unwrap(),
            gpu.download(&self.u).unwrap(),
        )
    }
}

pub(super) fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn folded_norm_gemvs_match_the_launches_they_replace_and_replay_exactly() {
    let (mut gpu, seed) = device();
    let mut apart = Chain::new(&gpu, seed);
    apart.apart(&gpu).unwrap();
    let want = apart.results(&gpu);
    // Launched one by one, twice (the second pass starts where the first
    // ended).
    let mut eager = Chain::new(&gpu, seed);
    eager.folded(&gpu).unwrap();
    let once = eager.results(&gpu);
    assert!(once.0.iter().chain(&once.1).all(|v| v.is_finite()));
    let e = (rel(&once.0, &want.0), rel(&once.1, &want.1));
    eprintln!("folded against apart: h {:.2e}, u {:.2e}", e.0, e.1);
    assert!(e.0 < 1e-4 && e.1 < 1e-4, "folded chain differs: {e:?}");
    eager.folded(&gpu).unwrap();
    let twice = eager.results(&gpu);
    let mut apart2 = Chain::new(&gpu, seed);
    apart2.apart(&gpu).unwrap();
    apart2.apart(&gpu).unwrap();
    let want2 = apart2.results(&gpu);
    let e2 = (rel(&twice.0, &want2.0), rel(&twice.1, &want2.1));
    assert!(
        e2.0 < 1e-4 && e2.1 < 1e-4,
        "second folded pass differs: {e2:?}"
    );
    for programmatic in [false, true] {
        gpu.set_programmatic(programmatic);
        let mut chain = Chain::new(&gpu, seed);
        let graph = gpu.capture(|| chain.folded(&gpu)).unwrap();
        gpu.replay(&graph).unwrap();
        gpu.synchronize().unwrap();
        assert!(
            chain.results(&gpu) == once,
            "graph (programmatic {programmatic}), replay 1"
        );
        gpu.replay(&graph).unwrap();
        gpu.synchronize().unwrap();
        assert!(
            chain.results(&gpu) == twice,
            "graph (programmatic {programmatic}), replay 2"
        );
    }
}
