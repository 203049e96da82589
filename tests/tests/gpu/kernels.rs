//! Kernels that replace others on the device (the skinny and cluster GEMMs
//! for cuBLAS,
//! the bf16 MLP for the f32 one, the decode kernel for a mixed step's
//! decode rows, the W8A8 GEMM on bf16 activations for the CPU's FP8
//! rows, int4 products of a few rows in one launch for the fragment launch
//! and the GEMV, attention that rotates and writes the step's keys for
//! the launch that did, attention that merges its own partitions for the
//! merge launch) give the engine's logits within rounding, or its
//! tokens.

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, Event, Finish, GenerateParams, TenantId};
use kiln_host::model::{WeightFormat, load_as};
use kiln_kernels::Device;
use kiln_tests::chat_ids;

use super::{device, engine_config, rel_diff, sequences_in, synthetic_bf16, synthetic_ids_n};

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
    // A prefill of 8 rows (then of 16, the most the engine gives it), then
    // 4 one-token steps over the KV it wrote:
    // every bf16 projection of the prefill runs the skinny GEMM in the
    // second engine and cuBLAS in the first, on the same bf16 activations,
    // so only the order of f32 sums differs. Each layer rounds its
    // activations to bf16, which can turn that into steps of 2^-8, so the
    // bound is a few flipped roundings (a layout error reads ~1); the H200
    // read 3.7e-3 on a 48-row prefill.
    for shape in [(12, 8), (20, 16)] {
        kernels_agree(
            |c| EngineConfig {
                cuda_skinny: false,
                ..c
            },
            |c| EngineConfig {
                cuda_skinny: true,
                ..c
            },
            shape,
            1e-2,
        );
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn the_cluster_gemm_gives_the_logits_of_cublas() {
    // Prefills of 24 and 32 rows, then one-token steps: every bf16
    // projection of the prefill runs the cluster GEMM in the second engine
    // and cuBLAS in the first (above 32 rows the engine keeps cuBLAS for
    // this model's short rows; the kernel's own tests cover 64); the bound
    // is the skinny GEMM's.
    for shape in [(28, 24), (36, 32)] {
        kernels_agree(
            |c| EngineConfig {
                cuda_cluster: false,
                ..c
            },
            |c| EngineConfig {
                cuda_cluster: true,
                ..c
            },
            shape,
            1e-2,
        );
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn attention_that_rotates_the_keys_itself_gives_the_same_tokens_and_aborts() {
    // Eleven sequences decode stacked q/k/v rows (replayed, padded to 16);
    // one alone decodes the folded GEMVs' separate rows. The attention
    // writes what the launch it replaces writes, bit for bit, so the tokens
    // are the same; and a corrupted mapping still aborts only its victim.
    let with = |graphs, tensor_prefill, rope| {
        engine_config(EngineConfig {
            device: device(),
            cuda_graphs: graphs,
            tensor_prefill,
            cuda_rope_in_attention: rope,
            ..Default::default()
        })
    };
    let roped = |graphs| with(graphs, true, true);
    let apart = |graphs| with(graphs, true, false);
    for (count, graphs) in [(11, true), (3, false), (1, true)] {
        let (plain, _) = sequences_in(apart(graphs), count, false);
        let (got, e) = sequences_in(roped(graphs), count, false);
        assert_eq!(got, plain, "{count} sequences, graphs {graphs}");
        assert_eq!(e.free_pages(), e.total_pages());
    }
    let (clean, _) = sequences_in(apart(true), 3, false);
    let (faulty, e) = sequences_in(roped(true), 3, true);
    assert!(matches!(faulty[1].1, Finish::Aborted(_)), "{faulty:?}");
    for i in [0, 2] {
        assert_eq!(faulty[i], clean[i], "sequence {i}");
    }
    assert_eq!(e.stats().integrity_aborts, 1);
    // Prompts attended a query per token (`--tensor-prefill off`) keep the
    // separate launch: each of a prompt's rows reads keys the others write.
    let (plain, _) = sequences_in(with(false, false, false), 3, false);
    let (got, _) = sequences_in(with(false, false, true), 3, false);
    assert_eq!(got, plain, "prompts without tensor-core prefill");
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn attention_merged_by_its_last_block_gives_the_logits_of_the_merge_launch() {
    // A prefill of 280 rows, then 20 one-token steps: one sequence of
    // 281-300 tokens splits into five partitions of 64 (to fill the GPU),
    // which the merge launch sums four at a time and the fused merge one by
    // one, so the order of the sums differs and nothing else does.
    let merged = |on| {
        move |c| EngineConfig {
            cuda_attention: kiln_kernels::cuda::AttentionPlan {
                fused_merge: on,
                ..Default::default()
            },
            ..c
        }
    };
    kernels_agree(merged(false), merged(true), (300, 280), 1e-2);
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

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn decodes_beside_a_prompt_chunk_give_the_tokens_they_give_alone() {
    // B's prompt arrives while A decodes: the step that runs B's prompt
    // holds A's decode row too, which the decode kernel attends (the
    // prompt's rows take the prefill kernel), as every step of A alone.
    let (a_ids, b_ids) = {
        let e = super::engine(device());
        (
            chat_ids(&e, super::PROMPTS[0]),
            chat_ids(&e, super::PROMPTS[1]),
        )
    };
    let want_a = super::greedy(&mut super::engine(device()), &a_ids, 12);
    let want_b = super::greedy(&mut super::engine(device()), &b_ids, 12);
    let params = GenerateParams {
        max_tokens: 12,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = super::engine(device());
    let a = e.add(TenantId(0), a_ids, params.clone()).unwrap();
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut b = None;
    let mut mixed = 0;
    while e.has_work() {
        let mut got = Vec::new();
        for ev in e.step().unwrap() {
            if let Event::Token {
                seq,
                token: Some(t),
                ..
            } = ev
            {
                tokens.entry(seq).or_default().push(t);
                got.push(seq);
            }
        }
        // B's first token comes from the step of its prompt's last chunk.
        if b.is_some_and(|b| tokens.get(&b).map(Vec::len) == Some(1)) && got.contains(&a) {
            mixed += 1;
        }
        if b.is_none() && tokens.get(&a).map_or(0, Vec::len) == 3 {
            b = Some(e.add(TenantId(1), b_ids.clone(), params.clone()).unwrap());
        }
    }
    assert_eq!(mixed, 1, "B's prompt never ran beside A's decode");
    assert_eq!(tokens[&a], want_a);
    assert_eq!(tokens[&b.unwrap()], want_b);
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn fp8_weights_on_the_test_device_give_the_cpus_logits() {
    // FP8 rows as W8A8 on both sides: the CPU rounds each f32 row of
    // activations to e4m3 with its own scale; the device rounds the bf16
    // rows a bf16 GEMM would read (one GEMM for q/k/v and one for
    // gate/up, the MLP in bf16, cuBLASLt's fast accumulation). A prefill
    // of 80 rows, then 16 one-token steps (Kiln's FP8 tensor-core kernel,
    // W8A8 like the CPU). A value near the midpoint of two e4m3 codes may
    // round either way on either side, a step of up to 2^-3 of it, so the
    // bound is wider than bf16 weights' 3e-2 (the H200 read 5.9e-2 to
    // 6.5e-2 on every row); a wrong layout, scale or stride reads ~1.
    let name = "synthetic:smollm2-135m";
    let loaded = std::sync::Arc::new(load_as(name, name, WeightFormat::Fp8).expect(name));
    let config = |device| EngineConfig {
        device,
        kv_memory: 64 << 20,
        kv_format: kiln_kernels::kv::KvFormat::Bf16,
        ..Default::default()
    };
    let mut cpu = Engine::new(loaded.clone(), config(Device::Cpu)).unwrap();
    let mut dev = Engine::new(loaded.clone(), config(device())).unwrap();
    let ids = synthetic_ids_n(&loaded, 96);
    let a = cpu.teacher_forced_logits(TenantId(0), &ids, 80).unwrap();
    let b = dev.teacher_forced_logits(TenantId(0), &ids, 80).unwrap();
    assert_eq!(a.len(), 17, "positions 80..=96");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let rel = rel_diff(x, y);
        eprintln!("FP8 weights, row {i}: device and CPU logits differ by {rel:.2e}");
        assert!(rel < 8e-2, "row {i}: logits differ by {rel}");
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn int4_products_of_a_few_rows_in_one_launch_give_the_logits_of_two_launches() {
    // Prefills of 2 to 8 tokens (each a product of that many rows) on int4
    // tiles, then one-token steps, with the few-row kernel (int4_rows.cu)
    // and with int4_xfrag and the GEMV. Both split f32 activations into
    // bf16 hi + lo and keep to float64 within 1e-5 (the kernels' test), but
    // a prefill rounds each layer's activations to bf16 (its attention, the
    // pages), which turns that into steps of 2^-8: the bound is the skinny
    // GEMM's (a layout error reads ~1; the H100 read 2.9e-3 on a prefill of
    // two).
    let name = "synthetic:smollm2-135m";
    let loaded = std::sync::Arc::new(load_as(name, name, WeightFormat::Int4).expect(name));
    let (_, config) = synthetic_bf16();
    let ids = synthetic_ids_n(&loaded, 12);
    for from in [2, 3, 5, 8] {
        let (two, one) = (
            EngineConfig {
                cuda_int4_rows: false,
                ..config(device())
            },
            EngineConfig {
                cuda_int4_rows: true,
                ..config(device())
            },
        );
        let mut a = Engine::new(loaded.clone(), two).unwrap();
        let mut b = Engine::new(loaded.clone(), one).unwrap();
        let x = a.teacher_forced_logits(TenantId(0), &ids, from).unwrap();
        let y = b.teacher_forced_logits(TenantId(0), &ids, from).unwrap();
        let mut most = 0.0f64;
        for (i, (x, y)) in x.iter().zip(&y).enumerate() {
            let rel = rel_diff(x, y);
            eprintln!("int4, a prefill of {from}: row {i}: logits differ by {rel:.2e}");
            assert!(
                rel < 1e-2,
                "prefill of {from}, row {i}: logits differ by {rel}"
            );
            most = most.max(rel);
        }
        assert!(
            most > 0.0,
            "prefill of {from}: the few-row kernel never ran"
        );
    }
}
