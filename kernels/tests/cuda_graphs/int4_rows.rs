//! The one-launch int4 GEMV of a few rows (`int4_rows.cu`, 2 to 8 rows)
//! and the two-launch path it replaces (`int4_xfrag`, then the GEMV of up
//! to 8 rows) against float64 row by row, on int4_one.rs's matrices, both
//! builds (4 and 8 rows) with rows left empty and blocks of eight and
//! sixteen warps; a
//! launch writes no row past its M; and a programmatic graph whose GEMV
//! starts loading weights before the norm that writes its input has
//! finished computes exactly what eager launches compute.

use kiln_kernels::cuda::{CudaSlice, Gpu, NormArgs, StackShape};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::fold::rel;
use super::int4_one::{CASES, exact_products, random, random_int4};

/// The step's buffers: h, y (the residual added into h), xn (the norm's
/// output, the product's input) and the norm's weights.
type Bufs = (
    CudaSlice<f32>,
    CudaSlice<f32>,
    CudaSlice<f32>,
    CudaSlice<f32>,
);

/// Norm of `m` rows (which writes the GEMV's input), then the stacked int4
/// product of those rows.
fn step(
    gpu: &Gpu,
    (h, y, xn, norm): &mut Bufs,
    w: &kiln_kernels::cuda::DeviceWeight,
    outs: &mut [CudaSlice<f32>],
    (m, parts): (usize, &[usize]),
    scratch: &mut kiln_kernels::cuda::GemmScratch,
) -> Result<(), kiln_kernels::KernelError> {
    let k = norm.len();
    let args = NormArgs {
        residual: Some(&*y),
        w: &*norm,
        rows: m,
        cols: k,
        eps: 1e-5,
    };
    gpu.rmsnorm_residual(h, xn, &args)?;
    let mut refs: Vec<&mut CudaSlice<f32>> = outs.iter_mut().collect();
    gpu.matmul_parts(xn, w, &mut refs, StackShape { m, parts, k }, scratch)
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn one_launch_int4_gemv_of_a_few_rows_keeps_to_float64_as_two_launches_do_and_its_graph_repeats_it()
{
    let (mut gpu, seed) = super::device();
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    for (dtype, parts, k) in CASES {
        let (bytes, w) = random_int4(&gpu, &mut r, dtype, (parts.iter().sum(), k));
        for m in [2, 3, 4, 5, 8] {
            let mut scratch = gpu.gemm_scratch(m, k, true).unwrap();
            let (h0, y0, norm) = (
                random(&mut r, m * k, 1.0),
                random(&mut r, m * k, 1.0),
                random(&mut r, k, 1.0),
            );
            let fresh = |gpu: &Gpu| -> Bufs {
                (
                    gpu.upload(&h0).unwrap(),
                    gpu.upload(&y0).unwrap(),
                    gpu.upload(&vec![f32::NAN; m * k]).unwrap(),
                    gpu.upload(&norm).unwrap(),
                )
            };
            // One row more than the product's: it must stay as it was.
            let outs = |gpu: &Gpu| -> Vec<CudaSlice<f32>> {
                parts
                    .iter()
                    .map(|p| gpu.upload(&vec![f32::NAN; (m + 1) * p]).unwrap())
                    .collect()
            };
            // Row by row of the m rows, each part's row after the other's.
            let read = |gpu: &Gpu, o: &[CudaSlice<f32>]| -> Vec<f32> {
                let all: Vec<Vec<f32>> = o.iter().map(|b| gpu.download(b).unwrap()).collect();
                for (a, p) in all.iter().zip(parts) {
                    assert!(
                        a[m * p..].iter().all(|v| v.is_nan()),
                        "a row past {m} written"
                    );
                }
                (0..m)
                    .flat_map(|row| {
                        all.iter()
                            .zip(parts)
                            .flat_map(move |(a, p)| a[row * p..(row + 1) * p].to_vec())
                    })
                    .collect()
            };
            let what = format!("{dtype:?} {parts:?} x {k}, {m} rows");

            gpu.set_int4_rows(false);
            let (mut b, mut o) = (fresh(&gpu), outs(&gpu));
            step(&gpu, &mut b, &w, &mut o, (m, &parts), &mut scratch).unwrap();
            let two = read(&gpu, &o);
            // The products in float64 of the weights as stored and the
            // input as the norm wrote it, row by row.
            let xn = gpu.download(&b.2).unwrap();
            let exact: Vec<f32> = xn
                .chunks(k)
                .flat_map(|x| exact_products(dtype, &bytes, x))
                .collect();
            // Both round x to bf16 hi + lo alike and differ in the order of
            // their float sums (the one launch sums each group's x by an
            // MMA); int4_one.rs says why 5e-5 bounds them.
            let e_two = rel(&two, &exact);
            assert!(e_two < 5e-5, "{what}: two launches vs float64: {e_two}");
            gpu.set_int4_rows(true);
            // Blocks of eight warps, then of sixteen, then the block the
            // shape chooses, whose result the programmatic graph repeats.
            let mut one = Vec::new();
            for wide in [Some(0), Some(usize::MAX), None] {
                gpu.set_int4_one_wide(wide);
                let (mut b, mut o) = (fresh(&gpu), outs(&gpu));
                step(&gpu, &mut b, &w, &mut o, (m, &parts), &mut scratch).unwrap();
                one = read(&gpu, &o);
                // The two paths sum in other orders: equal bits everywhere
                // would mean the two-launch path ran again (the device gave
                // the build too little shared memory).
                assert!(
                    one != two,
                    "{what}, wide {wide:?}: the few-row kernel never ran"
                );
                let e_one = rel(&one, &exact);
                eprintln!(
                    "{what}, wide {wide:?}: vs float64 {e_one:.2e} (two launches {e_two:.2e})"
                );
                assert!(
                    e_one < 5e-5,
                    "{what}, wide {wide:?}: one launch vs float64: {e_one}"
                );
            }

            gpu.set_programmatic(true);
            let (mut b, mut o) = (fresh(&gpu), outs(&gpu));
            let graph = gpu
                .capture(|| step(&gpu, &mut b, &w, &mut o, (m, &parts), &mut scratch))
                .unwrap();
            gpu.replay(&graph).unwrap();
            gpu.synchronize().unwrap();
            assert!(
                read(&gpu, &o) == one,
                "{what}: the programmatic graph differs"
            );
        }
    }
}
