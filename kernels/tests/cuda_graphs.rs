//! CUDA behaviour with no CPU counterpart: a captured step whose kernels
//! start early (programmatic edges) computes exactly what the same launches
//! compute one after another, and kernels that write a bf16 GEMM's input
//! give exactly their f32 results rounded, fused launches write exactly
//! what the launches they replace write, and the one-launch one-row int4
//! GEMV, and the one-launch GEMV of a few rows, sum what the two-launch
//! path sums, and a graph replayed as its
//! lane's priority changes computes the same. CUDA only, so ignored
//! unless asked for: `KILN_TEST_DEVICE=cuda` with `--include-ignored` (the
//! GPU machine, where a CUDA that does not work fails the tests).

use half::bf16;
use kiln_kernels::cuda::{CudaSlice, Gpu, NormArgs, RopeArgs, RopeKv, StackShape};
use kiln_kernels::kv::{KvFormat, KvLayout};
use kiln_kernels::ops::{Rope, RopeStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "cuda_graphs/attention_out.rs"]
mod attention_out;
#[path = "cuda_graphs/fold.rs"]
mod fold;
#[path = "cuda_graphs/int4_one.rs"]
mod int4_one;
#[path = "cuda_graphs/int4_rows.rs"]
mod int4_rows;
#[path = "cuda_graphs/rope_attention.rs"]
mod rope_attention;

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
        let shape = StackShape {
            m: 1,
            parts: &[DIM],
            k: DIM,
        };
        for _ in 0..ROUNDS {
            let norm = NormArgs {
                residual: Some(&self.y),
                w: &self.norm,
                rows: 1,
                cols: DIM,
                eps: 1e-5,
            };
            gpu.rmsnorm_residual(&mut self.h, &mut self.xn, &norm)?;
            gpu.gemv_bf16_parts(&self.xn, &self.w, &mut [&mut self.y], shape)?;
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

/// The GPU and a fresh seed (printed). The tests here are ignored unless
/// asked for (`KILN_TEST_DEVICE=cuda`, `--include-ignored`): there is
/// nothing to check on the CPU, so asked for without CUDA they fail.
fn device() -> (Gpu, u64) {
    if std::env::var("KILN_TEST_DEVICE").as_deref() != Ok("cuda") {
        panic!("needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored (scripts/gpu.sh run)");
    }
    let gpu = Gpu::open(0, true)
        .unwrap_or_else(|e| panic!("KILN_TEST_DEVICE=cuda, but CUDA does not work: {e}"));
    // KILN_TEST_SEED replays a failing run's values.
    let seed: u64 = std::env::var("KILN_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("seed {seed} (KILN_TEST_SEED replays it)");
    (gpu, seed)
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn programmatic_graph_replays_exactly_what_eager_launches_compute() {
    let (mut gpu, seed) = device();
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
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn bf16_activations_equal_the_f32_results_rounded() {
    let (gpu, seed) = device();
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
            let norm = NormArgs {
                residual: with_residual.then_some(&r),
                w: &w,
                rows,
                cols: dim,
                eps: 1e-5,
            };
            let mut x = gpu.upload(&x0).unwrap();
            let mut out = gpu.upload(&vec![f32::NAN; rows * dim]).unwrap();
            gpu.rmsnorm_residual(&mut x, &mut out, &norm).unwrap();
            let want = rounded(&gpu.download(&out).unwrap());
            let mut x = gpu.upload(&x0).unwrap();
            let (s, n) = (&mut scratch, rows * dim);
            gpu.rmsnorm_residual_bf16(&mut x, s, &norm).unwrap();
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

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn attention_writes_exactly_its_f32_rows_rounded_as_the_next_gemms_input() {
    let (gpu, seed) = device();
    attention_out::check(&gpu, seed);
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn attention_that_rotates_and_writes_the_step_s_keys_matches_the_launch_it_replaces() {
    let (gpu, seed) = device();
    rope_attention::check(&gpu, seed);
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn fused_rope_and_kv_write_write_what_the_two_launches_write_from_separate_or_stacked_rows() {
    let (gpu, seed) = device();
    let rng = &mut ChaCha8Rng::seed_from_u64(seed);
    let (tokens, heads, kv_heads, pages) = (6usize, 8usize, 2usize, 4usize);
    for hd in [64usize, 128, 256] {
        let layout = KvLayout {
            page_size: 16,
            kv_heads,
            head_dim: hd,
        };
        for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
            for style in [RopeStyle::Interleaved, RopeStyle::Half] {
                let mut v = |n: usize| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(-4.0..4.0)).collect()
                };
                let (q0, k0, v0) = (
                    v(tokens * heads * hd),
                    v(tokens * kv_heads * hd),
                    v(tokens * kv_heads * hd),
                );
                let pos: Vec<i32> = (0..tokens as i32).map(|t| 37 * t + 1000).collect();
                // Distinct slots across the pages; the tag check's cleared
                // slot (-1) writes nothing.
                let mut slots: Vec<i32> = (0..tokens as i32).map(|t| 11 * t + 3).collect();
                slots[2] = -1;
                let freq = Rope::new(hd, 500000.0, None, style).inv_freq().to_vec();
                let il = style == RopeStyle::Interleaved;
                let (dpos, dslots) = (gpu.upload(&pos).unwrap(), gpu.upload(&slots).unwrap());
                let dfreq = gpu.upload(&freq).unwrap();
                // How: 0 two launches, 1 fused, 2 fused over stacked rows.
                let run = |how: u8| {
                    let mut kv = gpu.paged_kv(format, layout, pages).unwrap();
                    let (mut q, mut k) = (gpu.upload(&q0).unwrap(), gpu.upload(&k0).unwrap());
                    let vv = gpu.upload(&v0).unwrap();
                    let (s, p) = (dslots.slice(..), dpos.slice(..));
                    let at = RopeKv {
                        slots: &s,
                        pos: &p,
                        inv_freq: &dfreq,
                        tokens,
                        heads,
                        interleaved: il,
                    };
                    let bits = |x: &[f32]| -> Vec<u32> { x.iter().map(|v| v.to_bits()).collect() };
                    let (qd, kd) = (heads * hd, kv_heads * hd);
                    let (q_out, k_out) = match how {
                        0 => {
                            let rope = RopeArgs {
                                pos: &p,
                                inv_freq: &dfreq,
                                tokens,
                                heads,
                                dim: hd,
                                interleaved: il,
                            };
                            gpu.rope_qk(&mut q, &mut k, kv_heads, &rope).unwrap();
                            if format.rotates() {
                                gpu.hadamard_rows(&mut q, tokens * heads, hd).unwrap();
                                gpu.hadamard_rows(&mut k, tokens * kv_heads, hd).unwrap();
                            }
                            gpu.kv_write(&mut kv, &k, &vv, &s, tokens).unwrap();
                            (gpu.download(&q).unwrap(), gpu.download(&k).unwrap())
                        }
                        1 => {
                            gpu.rope_kv_write(&mut kv, &mut q, &mut k, &vv, &at)
                                .unwrap();
                            (gpu.download(&q).unwrap(), gpu.download(&k).unwrap())
                        }
                        _ => {
                            // Row t: token t's q, k and v side by side.
                            let rows: Vec<f32> = (0..tokens)
                                .flat_map(|t| {
                                    let q = &q0[t * qd..(t + 1) * qd];
                                    let k = &k0[t * kd..(t + 1) * kd];
                                    let v = &v0[t * kd..(t + 1) * kd];
                                    [q, k, v].concat()
                                })
                                .collect();
                            let mut qkv = gpu.upload(&rows).unwrap();
                            let mut out = gpu.upload(&vec![f32::NAN; tokens * qd]).unwrap();
                            gpu.rope_kv_write_stacked(&mut kv, &mut qkv, &mut out, &at)
                                .unwrap();
                            let rows = gpu.download(&qkv).unwrap();
                            let ld = qd + 2 * kd;
                            let keys = (0..tokens)
                                .flat_map(|t| rows[t * ld + qd..t * ld + qd + kd].to_vec())
                                .collect();
                            (gpu.download(&out).unwrap(), keys)
                        }
                    };
                    (
                        bits(&q_out),
                        bits(&k_out),
                        gpu.download(&kv.k).unwrap(),
                        gpu.download(&kv.v).unwrap(),
                        bits(&gpu.download(&kv.k_scale).unwrap()),
                        bits(&gpu.download(&kv.v_scale).unwrap()),
                    )
                };
                let want = run(0);
                for (how, got) in [(1, run(1)), (2, run(2))] {
                    let what = format!("{format:?}, {style:?}, head_dim {hd}, launch {how}");
                    assert!(got.0 == want.0, "queries differ: {what}");
                    assert!(got.1 == want.1, "keys differ: {what}");
                    assert!(got.2 == want.2, "K pages differ: {what}");
                    assert!(got.3 == want.3, "V pages differ: {what}");
                    assert!(got.4 == want.4 && got.5 == want.5, "scales differ: {what}");
                }
                let what = format!("{format:?}, {style:?}, head_dim {hd}");
                // The CPU's rope (and rotation) of the queries, which the
                // model's forward pass applies.
                let rope = Rope::new(hd, 500000.0, None, style);
                let mut cpu_q = q0.clone();
                for (t, row) in cpu_q.chunks_exact_mut(heads * hd).enumerate() {
                    rope.apply(row, pos[t] as usize);
                    if format.rotates() {
                        kiln_kernels::hadamard::rotate_heads(row, hd);
                    }
                }
                let err = want
                    .0
                    .iter()
                    .zip(&cpu_q)
                    .map(|(a, b)| (f32::from_bits(*a) - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-2, "queries against the CPU's, {what}: {err}");
                assert!(
                    want.2.iter().any(|b| *b != 0),
                    "something was written: {what}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_graph_replayed_on_a_lane_whose_priority_changes_computes_what_eager_launches_compute() {
    let (gpu, seed) = device();
    let lane = gpu.lane().unwrap();
    assert!(!lane.is_urgent().unwrap(), "a new lane is level");
    let mut eager = Chain::new(&gpu, &mut ChaCha8Rng::seed_from_u64(seed));
    let mut chain = Chain::new(&lane, &mut ChaCha8Rng::seed_from_u64(seed));
    // Captured once, replayed as the priority flips, as the engine does:
    // each replay continues from the last, as each eager round does.
    let graph = lane.capture(|| chain.launch(&lane)).unwrap();
    for urgent in [true, false, true] {
        lane.set_urgent(urgent).unwrap();
        assert_eq!(lane.is_urgent().unwrap(), urgent);
        eager.launch(&gpu).unwrap();
        let want = eager.results(&gpu);
        lane.replay(&graph).unwrap();
        lane.synchronize().unwrap();
        let got = chain.results(&lane);
        assert_eq!(got.2, want.2, "argmax, urgent {urgent}");
        assert!(got.0 == want.0 && got.1 == want.1, "urgent {urgent}");
    }
}
