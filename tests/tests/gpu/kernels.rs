//! Kernels that replace others on the device (the skinny and split GEMMs
//! for cuBLAS, the bf16 MLP for the f32 one) give the engine's logits
//! within rounding.

use kiln_host::engine::{Engine, EngineConfig, TenantId};

use super::{device, rel_diff, synthetic_bf16, synthetic_ids_n};

/// Holds the teacher-forced logits of `tokens` synthetic ids from position
/// `from`, on the synthetic bf16 model, under `other` to those under `base`
/// (each applied to the device's config): every row within `bound`, and
/// some row different (else the kernel under test never ran).
fn kernels_agree(
    base: impl Fn(EngineConfig) -> EngineConfig,
    other: impl Fn(EngineConfig) -> EngineConfig,
    (tokens, from): (u32, usize),
    bound: f64,
) {
    let (loaded, config) = synthetic_bf16();
    let mut a = Engine::new(loaded.clone(), base(config(device()))).unwrap();
    let mut b = Engine::new(loaded.clone(), other(config(device()))).unwrap();
    let ids = synthetic_ids_n(&loaded, tokens);
    let x = a.teacher_forced_logits(TenantId(0), &ids, from).unwrap();
    let y = b.teacher_forced_logits(TenantId(0), &ids, from).unwrap();
    assert_eq!(x.len(), tokens as usize - from + 1);
    let mut most = 0.0f64;
    for (i, (x, y)) in x.iter().zip(&y).enumerate() {
        let rel = rel_diff(x, y);
        eprintln!("row {i}: logits differ by {rel:.2e}");
        assert!(rel < bound, "row {i}: logits differ by {rel}");
        most = most.max(rel);
    }
    assert!(
        most > 0.0,
        "identical logits: the kernel under test never ran"
    );
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn the_skinny_gemm_gives_the_logits_of_cublas() {
    // A prefill of 8 rows, then 4 one-token steps over the KV it wrote:
    // every bf16 projection of the prefill runs the skinny GEMM in the
    // second engine and cuBLAS in the first, on the same bf16 activations,
    // so only the order of f32 sums differs. Each layer rounds its
    // activations to bf16, which can turn that into steps of 2^-8, so the
    // bound is a few flipped roundings (a layout error reads ~1); the H200
    // read 3.7e-3 on a 48-row prefill.
    kernels_agree(
        |c| EngineConfig {
            cuda_skinny: false,
            ..c
        },
        |c| EngineConfig {
            cuda_skinny: true,
            ..c
        },
        (12, 8),
        1e-2,
    );
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn the_split_gemm_gives_the_logits_of_cublas() {
    // As the skinny GEMM's test, with a prefill of 40 rows (five blocks of
    // 8 activation rows, the split GEMM's widest) then 4 one-token steps.
    kernels_agree(
        |c| EngineConfig {
            cuda_split: false,
            ..c
        },
        |c| EngineConfig {
            cuda_split: true,
            ..c
        },
        (44, 40),
        1e-2,
    );
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn the_bf16_mlp_gives_the_logits_of_the_f32_mlp() {
    // A prefill of 80 rows (past the decode batches, so the bf16 MLP runs
    // in every layer), then 16 one-token steps over the KV it wrote. The
    // gate/up product rounded to bf16 is one more rounding a layer; the
    // bound is the skinny GEMM's.
    kernels_agree(
        |c| EngineConfig {
            cuda_bf16_mlp: false,
            ..c
        },
        |c| EngineConfig {
            cuda_bf16_mlp: true,
            ..c
        },
        (96, 80),
        1e-2,
    );
}
