//! The engine on the GPU against the engine on the CPU, with the real
//! default model. Each test needs a GPU, so each is ignored unless asked
//! for: `KILN_TEST_DEVICE=cuda` with `--include-ignored` (as
//! `scripts/gpu.sh run` does); asked for without CUDA, they fail, since on
//! the CPU they would only compare the CPU with itself.

use kiln_host::engine::{Engine, EngineConfig, Event, Finish, GenerateParams, TenantId};
use kiln_host::model::{WeightFormat, WeightPlan, load_as};
use kiln_kernels::Device;
use kiln_tests::{chat_ids, default_model};

#[path = "gpu/api_features.rs"]
mod api_features;
#[path = "gpu/devices.rs"]
mod devices;
#[path = "gpu/kernels.rs"]
mod kernels;
#[path = "gpu/lanes.rs"]
mod lanes;
#[path = "gpu/memory.rs"]
mod memory;
#[path = "shared/pools.rs"]
mod pools;
#[path = "gpu/ranks.rs"]
mod ranks;

/// Why each test here is ignored by default.
const NEEDS_GPU: &str = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored";

fn device() -> Device {
    match std::env::var("KILN_TEST_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        _ => panic!("{NEEDS_GPU} (scripts/gpu.sh run)"),
    }
}

/// bf16 KV pages: two fp8 implementations round some values to
/// neighbouring codes, noise that would hide the forward pass's own error.
fn engine(device: Device) -> Engine {
    engine_with(device, false)
}

/// As [`engine`], capturing decode steps as CUDA graphs when `graphs`.
fn engine_with(device: Device, graphs: bool) -> Engine {
    engine_config(EngineConfig {
        device,
        cuda_graphs: graphs,
        ..Default::default()
    })
}

/// An engine with `config`'s switches on the test's KV pool.
fn engine_config(config: EngineConfig) -> Engine {
    let device = config.device;
    let config = EngineConfig {
        kv_memory: 64 << 20,
        kv_format: kiln_kernels::kv::KvFormat::Bf16,
        ..config
    };
    Engine::new(default_model(), config)
        .unwrap_or_else(|e| panic!("an engine on {}: {e}", device.name()))
}

/// The shared prompts' first six.
const PROMPTS: &[&str] = kiln_tests::PROMPTS.split_at(6).0;

fn greedy(e: &mut Engine, ids: &[u32], n: usize) -> Vec<u32> {
    let params = GenerateParams {
        max_tokens: n,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    e.generate(TenantId(0), ids.to_vec(), params)
        .unwrap()
        .tokens
}

fn argmax(l: &[f32]) -> usize {
    kiln_kernels::sample::argmax(l) as usize
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn greedy_tokens_and_teacher_forced_argmax_on_the_test_device_agree_with_the_cpu() {
    let mut cpu = engine(Device::Cpu);
    let mut dev = engine(device());
    let (mut same, mut total) = (0, 0);
    let mut diverged = Vec::new();
    for p in PROMPTS {
        let ids = chat_ids(&cpu, p);
        let want = greedy(&mut cpu, &ids, 16);
        let got = greedy(&mut dev, &ids, 16);
        if got != want {
            let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            // How close the CPU's own choice was there: its top-2 margin.
            let mut prefix = ids.clone();
            prefix.extend(&want[..at]);
            let l = cpu
                .teacher_forced_logits(TenantId(0), &prefix, prefix.len())
                .unwrap();
            let mut top: Vec<f32> = l[0].clone();
            top.sort_by(|a, b| b.total_cmp(a));
            let margin = top[0] - top[1];
            diverged.push(format!(
                "{p:?} at token {at} (CPU top-2 margin {margin:.3}): {got:?} vs {want:?}"
            ));
        }
        // Teacher forcing over the CPU's continuation: next-token argmax.
        let mut seq = ids.clone();
        seq.extend(greedy(&mut cpu, &ids, 40));
        let c = cpu
            .teacher_forced_logits(TenantId(0), &seq, ids.len())
            .unwrap();
        let d = dev
            .teacher_forced_logits(TenantId(0), &seq, ids.len())
            .unwrap();
        for (a, b) in c.iter().zip(&d) {
            total += 1;
            same += usize::from(argmax(a) == argmax(b));
        }
    }
    let agree = same as f64 / total as f64;
    eprintln!(
        "{}: teacher-forced argmax agreement {same}/{total}",
        device().name()
    );
    assert!(agree >= 0.98, "agreement {agree}");
    assert!(
        diverged.is_empty(),
        "{}: greedy tokens differ: {diverged:#?}",
        device().name()
    );
}

/// Three sequences of three tenants to the end (eight tokens each), the
/// second one's mapping corrupted with the third's first page once each has
/// three tokens when `fault`: each one's tokens and finish, and the engine.
fn three_sequences(fault: bool, graphs: bool) -> (Vec<(Vec<u32>, Finish)>, Engine) {
    sequences(3, fault, graphs)
}

/// As [`three_sequences`] with `count` sequences of as many tenants (the
/// prompts repeat, numbered).
fn sequences(count: usize, fault: bool, graphs: bool) -> (Vec<(Vec<u32>, Finish)>, Engine) {
    sequences_in(engine_with(device(), graphs), count, fault)
}

/// As [`sequences`], on engine `e`.
fn sequences_in(mut e: Engine, count: usize, fault: bool) -> (Vec<(Vec<u32>, Finish)>, Engine) {
    let params = GenerateParams {
        max_tokens: 8,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let ids: Vec<_> = (0..count)
        .map(|i| chat_ids(&e, &format!("{} ({i})", PROMPTS[i % PROMPTS.len()])))
        .collect();
    let seqs: Vec<u64> = ids
        .iter()
        .enumerate()
        .map(|(t, i)| {
            e.add(TenantId(t as u32), i.clone(), params.clone())
                .unwrap()
        })
        .collect();
    let mut tokens: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut finish = std::collections::HashMap::new();
    // One step, its tokens and endings recorded; each sequence's count.
    let mut step = |e: &mut Engine| {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token {
                    seq,
                    token: Some(t),
                    ..
                } => tokens.entry(seq).or_default().push(t),
                Event::Finished { seq, finish: f, .. } => {
                    finish.insert(seq, f);
                }
                _ => {}
            }
        }
        seqs.iter()
            .map(|s| tokens.get(s).map_or(0, Vec::len))
            .min()
            .unwrap_or(0)
    };
    if fault {
        // Once every sequence has three tokens, the full batch has decoded
        // twice: with graphs, the step the fault meets is a replay.
        while step(&mut e) < 3 {}
        assert!(e.inject_page_fault(seqs[1], seqs[2]));
    }
    while e.has_work() {
        step(&mut e);
    }
    let out = seqs
        .iter()
        .map(|s| (tokens.remove(s).unwrap_or_default(), finish[s].clone()))
        .collect();
    (out, e)
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_corrupted_mapping_on_the_test_device_aborts_exactly_the_victim() {
    // With CUDA graphs the check runs inside replayed steps; eleven
    // sequences run there padded to a batch of sixteen.
    for (count, graphs) in [(3, false), (3, true), (11, true)] {
        let (clean, _) = sequences(count, false, graphs);
        let (faulty, e) = sequences(count, true, graphs);
        assert!(matches!(faulty[1].1, Finish::Aborted(_)), "{faulty:?}");
        // The others run as if nothing happened: same tokens, same ending.
        for i in (0..count).filter(|i| *i != 1) {
            assert!(!matches!(faulty[i].1, Finish::Aborted(_)), "{faulty:?}");
            assert_eq!(faulty[i], clean[i], "sequence {i}, graphs {graphs}");
        }
        assert_eq!(e.stats().integrity_aborts, 1);
        assert_eq!(e.free_pages(), e.total_pages());
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn cuda_graphs_replay_the_same_tokens_as_launching_each_kernel() {
    // On the CPU both engines are the same; on CUDA the second captures
    // its decode steps (one and three sequences) and replays them.
    let (plain, _) = three_sequences(false, false);
    let (replayed, e) = three_sequences(false, true);
    assert_eq!(plain, replayed);
    // Eleven sequences, then fewer as they finish: replayed padded to 16.
    let (plain, _) = sequences(11, false, false);
    let (replayed, e11) = sequences(11, false, true);
    assert_eq!(plain, replayed);
    assert_eq!(e11.free_pages(), e11.total_pages());
    let mut one = engine_with(device(), true);
    for p in &PROMPTS[3..] {
        let ids = chat_ids(&one, p);
        let want = greedy(&mut engine(device()), &ids, 20);
        assert_eq!(greedy(&mut one, &ids, 20), want, "{p:?}");
    }
    assert_eq!(e.free_pages(), e.total_pages());
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn tensor_core_prefill_gives_the_logits_of_one_query_per_token() {
    // On CUDA the second engine attends its prefill chunks with the
    // tensor-core kernel (the default); every later layer's KV depends on
    // it, so every row checks it.
    let mut plain = engine_config(EngineConfig {
        device: device(),
        tensor_prefill: false,
        ..Default::default()
    });
    let mut flash = engine(device());
    for p in &PROMPTS[..3] {
        let mut ids = chat_ids(&plain, p);
        ids.extend(greedy(&mut plain, &ids.clone(), 12));
        let from = ids.len() - 8;
        let a = plain
            .teacher_forced_logits(TenantId(0), &ids, from)
            .unwrap();
        let b = flash
            .teacher_forced_logits(TenantId(0), &ids, from)
            .unwrap();
        for (x, y) in a.iter().zip(&b) {
            let num: f64 = x.iter().zip(y).map(|(u, v)| ((u - v) as f64).powi(2)).sum();
            let den: f64 = x.iter().map(|u| (*u as f64).powi(2)).sum();
            let rel = (num / den).sqrt();
            // Thirty layers carry the kernels' different roundings (the
            // prefill kernel's Q and P in bf16, as FlashAttention's) to
            // the logits; the scalar flash kernel this replaced reached
            // 8.2e-3 with f32 sums alone (2026-11-29).
            assert!(rel < 2e-2, "{p:?}: logits differ by {rel}");
            assert_eq!(argmax(x), argmax(y), "{p:?}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn device_sampling_draws_what_the_host_draws_from_the_same_seed() {
    // Same device and kernels, so the same logits; only the sampler
    // differs (f32 radix select on the GPU, f64 on the host), each using
    // the request's own seeded draws.
    let params = GenerateParams {
        max_tokens: 16,
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        seed: Some(7),
        ignore_eos: true,
        ..Default::default()
    };
    let mut host = engine_config(EngineConfig {
        device: device(),
        device_sampling: false,
        ..Default::default()
    });
    let mut dev = engine_config(EngineConfig {
        device: device(),
        device_sampling: true,
        ..Default::default()
    });
    let mut differs = 0;
    for p in &PROMPTS[..3] {
        let ids = chat_ids(&host, p);
        let a = host
            .generate(TenantId(0), ids.clone(), params.clone())
            .unwrap();
        let b = dev.generate(TenantId(0), ids, params.clone()).unwrap();
        assert_eq!(b.tokens.len(), 16);
        differs += usize::from(a.tokens != b.tokens);
    }
    assert_eq!(
        differs, 0,
        "sampled sequences differ between host and device"
    );
}

/// The synthetic model with bf16 weights (SmolLM2-135M's shapes), and an
/// engine config on `device` with bf16 pages.
fn synthetic_bf16() -> (
    std::sync::Arc<kiln_host::model::Loaded>,
    impl Fn(Device) -> EngineConfig,
) {
    synthetic("synthetic:smollm2-135m")
}

/// Synthetic model `name`, and an engine config on `device` with bf16
/// pages.
fn synthetic(
    name: &str,
) -> (
    std::sync::Arc<kiln_host::model::Loaded>,
    impl Fn(Device) -> EngineConfig,
) {
    let loaded = std::sync::Arc::new(kiln_host::model::load(name, name).expect(name));
    let config = |device| EngineConfig {
        device,
        kv_memory: 64 << 20,
        kv_format: kiln_kernels::kv::KvFormat::Bf16,
        ..Default::default()
    };
    (loaded, config)
}

/// A 48-token prompt of the model's vocabulary.
fn synthetic_ids(loaded: &kiln_host::model::Loaded) -> Vec<u32> {
    synthetic_ids_n(loaded, 48)
}

/// `n` ordinary token ids of `loaded`'s vocabulary.
fn synthetic_ids_n(loaded: &kiln_host::model::Loaded, n: u32) -> Vec<u32> {
    let vocab = loaded.model.config.vocab as u32;
    (0..n).map(|i| vocab / 8 + i * 997 % (vocab / 4)).collect()
}

/// ‖x − y‖ / ‖x‖.
fn rel_diff(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x.iter().zip(y).map(|(u, v)| ((u - v) as f64).powi(2)).sum();
    let den: f64 = x.iter().map(|u| (*u as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn bf16_weights_through_cublas_give_the_cpus_logits() {
    // A synthetic model with bf16 weights: a prompt (more rows than the
    // bf16 GEMV's one) runs cuBLAS, q, k and v as one stacked GEMM whose
    // rows the fused RoPE + KV write reads in place, and every later row
    // (one token a step: the GEMVs with the norms folded in) reads the
    // pages it wrote. Random weights, so the logits (not their argmax,
    // often a near tie) are compared.
    let (loaded, config) = synthetic_bf16();
    device_matches_cpu_logits(&loaded, config);
}

/// Teacher-forced logits of a 48-token prompt from position 36, on the
/// CPU and on the test device, agree within bf16 rounding.
fn device_matches_cpu_logits(
    loaded: &std::sync::Arc<kiln_host::model::Loaded>,
    config: impl Fn(Device) -> EngineConfig,
) {
    let mut cpu = Engine::new(loaded.clone(), config(Device::Cpu)).unwrap();
    let mut dev = Engine::new(loaded.clone(), config(device())).unwrap();
    let ids = synthetic_ids(loaded);
    let a = cpu.teacher_forced_logits(TenantId(0), &ids, 36).unwrap();
    let b = dev.teacher_forced_logits(TenantId(0), &ids, 36).unwrap();
    assert_eq!(a.len(), 13, "positions 36..=48");
    let name = &loaded.name;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let rel = rel_diff(x, y);
        eprintln!(
            "{}: {name} row {i}: logits differ by {rel:.2e}",
            device().name()
        );
        // The GPU rounds the GEMMs' activations to bf16 (the CPU keeps
        // f32): relative error 2^-9 per element, carried through the layers.
        assert!(rel < 3e-2, "{name} row {i}: logits differ by {rel}");
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn qwen2_through_the_shared_forward_gives_the_cpus_logits_on_the_device() {
    // Qwen2.5-0.5B's shapes: q/k/v biases (so q, k and v run apart, with
    // the bias kernel, and nothing folds), RoPE over halves, 14 heads over
    // 2 KV heads. The CPU runs the same architecture code on its kernels.
    let (loaded, config) = synthetic("synthetic:qwen2.5-0.5b");
    assert_eq!(loaded.model.config.arch, kiln_host::model::Arch::Qwen2);
    device_matches_cpu_logits(&loaded, &config);
    let ids = synthetic_ids(&loaded);
    let mut eager = Engine::new(
        loaded.clone(),
        EngineConfig {
            cuda_graphs: false,
            ..config(device())
        },
    )
    .unwrap();
    let mut replayed = Engine::new(loaded, config(device())).unwrap();
    let want = greedy(&mut eager, &ids, 16);
    assert_eq!(greedy(&mut replayed, &ids, 16), want);
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn folded_norms_give_the_logits_of_the_separate_launches_and_replay_exactly() {
    // On CUDA, one-token steps of a model of bf16 weights (or int4 tiles,
    // with cuda_fold_int4) fold the norms and SiLU into their GEMVs; with
    // the fold off they launch them apart. Both keep f32 activations, so
    // the logits agree to f32 rounding (and differ in the last bits: other
    // kernels ran; int4's products round their sums at up to 2.3e-5 each,
    // kernels' int4_one.rs, over 30 layers); greedy decode replayed from
    // graphs gives what eager launches give. On the CPU both engines are
    // the same. An int4 head (`int4,head=int4`) runs in the fold's normed
    // int4 GEMV, and apart in the int4 product after the norm. FP8 rows
    // (with cuda_fold_fp8) are W8A8 both ways, but apart the gate/up
    // product rounds to bf16 before SiLU and quantizing, so ~2% of the
    // down projection's codes land on a neighbour: the bound is that of
    // FP8 logits against the CPU's (8e-2, tests of FP8 rows), far under
    // what a missing scale or a wrong row gives.
    let name = "synthetic:smollm2-135m";
    let int4_head: WeightPlan = "int4,head=int4".parse().unwrap();
    for (format, bound) in [
        (WeightFormat::Bf16.into(), 1e-4),
        (WeightFormat::Int4.into(), 5e-4),
        (int4_head, 5e-4),
        (WeightFormat::Fp8.into(), 8e-2),
    ] {
        let format: WeightPlan = format;
        let loaded = std::sync::Arc::new(load_as(name, name, format).expect(name));
        let (_, base) = synthetic_bf16();
        let config = |device| EngineConfig {
            cuda_fold_int4: true,
            cuda_fold_fp8: true,
            ..base(device)
        };
        let unfolded = |device| EngineConfig {
            cuda_fold: false,
            ..config(device)
        };
        let mut on = Engine::new(loaded.clone(), config(device())).unwrap();
        let mut off = Engine::new(loaded.clone(), unfolded(device())).unwrap();
        let ids = synthetic_ids(&loaded);
        let a = off.teacher_forced_logits(TenantId(0), &ids, 36).unwrap();
        let b = on.teacher_forced_logits(TenantId(0), &ids, 36).unwrap();
        let mut most = 0.0f64;
        for (i, (x, y)) in a.iter().zip(&b).enumerate().skip(1) {
            let rel = rel_diff(x, y);
            eprintln!(
                "{} {format:?}: row {i}: folded logits differ by {rel:.2e}",
                device().name()
            );
            assert!(
                rel < bound,
                "{format:?} row {i}: folded logits differ by {rel}"
            );
            most = most.max(rel);
        }
        if device() != Device::Cpu {
            assert!(
                most > 0.0,
                "{format:?}: the one-token steps ran the same kernels: no fold"
            );
        }
        let eager = EngineConfig {
            cuda_graphs: false,
            ..config(device())
        };
        let mut eager = Engine::new(loaded.clone(), eager).unwrap();
        let mut replayed = Engine::new(loaded, config(device())).unwrap();
        let want = greedy(&mut eager, &ids, 24);
        assert_eq!(greedy(&mut replayed, &ids, 24), want, "{format:?}");
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn static_fp8_pages_on_the_test_device_score_as_on_the_cpu() {
    // Rotated queries and keys and e4m3 pages without scales, on both: the
    // device's rotation, codes and attention against the CPU's. Two fp8
    // implementations round some values to neighbouring codes, and a
    // neighbouring code moves a logit row by up to 0.22 (relative) here, so
    // the bound is on the mean KL: the two implementations must differ by
    // less than the format differs from bf16 pages on the CPU (0.0081
    // nats, tests/tests/engine.rs). Rotation missing on either side scores
    // rotated keys with unrotated queries: noise, not a few flipped codes.
    let static_fp8 = |device: Device| {
        let config = EngineConfig {
            device,
            kv_memory: 64 << 20,
            kv_format: kiln_kernels::kv::KvFormat::Fp8Static,
            ..Default::default()
        };
        Engine::new(default_model(), config)
            .unwrap_or_else(|e| panic!("an engine on {}: {e}", device.name()))
    };
    let (mut cpu, mut dev) = (static_fp8(Device::Cpu), static_fp8(device()));
    let (mut same, mut total, mut worst, mut kl) = (0, 0, 0.0f64, 0.0f64);
    for p in PROMPTS {
        let ids = chat_ids(&cpu, p);
        let mut seq = ids.clone();
        seq.extend(greedy(&mut cpu, &ids, 40));
        let c = cpu
            .teacher_forced_logits(TenantId(0), &seq, ids.len())
            .unwrap();
        let d = dev
            .teacher_forced_logits(TenantId(0), &seq, ids.len())
            .unwrap();
        for (a, b) in c.iter().zip(&d) {
            total += 1;
            same += usize::from(argmax(a) == argmax(b));
            worst = worst.max(rel_diff(a, b));
            kl += kiln_tests::kl_nats(a, b);
        }
    }
    let (agree, kl) = (same as f64 / total as f64, kl / total as f64);
    eprintln!(
        "{} static fp8: teacher-forced argmax agreement {same}/{total}, mean KL {kl:.5} nats, \
         logits rel diff <= {worst:.4}",
        device().name()
    );
    assert!(agree >= 0.96, "agreement {agree}");
    assert!(kl < 0.008, "mean KL {kl}");
}
