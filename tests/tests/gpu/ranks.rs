//! The default model split over three tensor-parallel ranks on GPUs
//! (`--tensor-parallel 3`): on three GPUs their parts are summed by NCCL,
//! in graphs; on fewer, ranks share a GPU and sum through the host. Either
//! way the ranks must compute what the whole model computes on the same
//! GPU, as the CPU's ranks do (tests/tensor_parallel.rs).

use kiln_host::engine::EngineConfig;

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn three_gpu_ranks_compute_what_the_whole_model_computes() {
    let device = super::device();
    let gpus = kiln_kernels::cuda::Gpu::count().unwrap();
    let how = if gpus >= 3 { "NCCL" } else { "the host" };
    for graphs in [false, true] {
        // Ranks never fold a one-token step's norms into its products: the
        // whole model does not either, so the two differ only in how the
        // ranks sum.
        let engine = |ranks| {
            super::engine_config(EngineConfig {
                device,
                cuda_graphs: graphs,
                cuda_fold: false,
                tensor_parallel: ranks,
                ..Default::default()
            })
        };
        let (mut whole, mut split) = (engine(1), engine(3));
        let (agree, total, kl) = kiln_tests::teacher_forced(&mut whole, &mut split, super::PROMPTS);
        eprintln!(
            "3 ranks on {gpus} GPU(s), summed through {how}, graphs {graphs}: \
             {agree}/{total} argmax agree, mean KL {kl:e} nats"
        );
        assert!(total >= 64, "{total} positions");
        assert_eq!(agree, total, "graphs {graphs}");
        assert!(kl < 1e-4, "graphs {graphs}: mean KL {kl}");
        for prompt in super::PROMPTS {
            let ids = kiln_tests::chat_ids(&whole, prompt);
            let want = super::greedy(&mut whole, &ids, 16);
            assert_eq!(super::greedy(&mut split, &ids, 16), want, "{prompt}");
        }
        assert_eq!(split.stats().integrity_aborts, 0);
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_sequence_moves_between_engines_of_three_gpu_ranks_rank_by_rank() {
    use kiln_host::engine::TenantId;
    let device = super::device();
    let engine = || {
        super::engine_config(EngineConfig {
            device,
            tensor_parallel: 3,
            ..Default::default()
        })
    };
    let mut home = engine();
    let prompt = kiln_tests::chat_ids(&home, super::PROMPTS[2]);
    let seq = home
        .add(TenantId(5), prompt.clone(), kiln_tests::greedy_to(10))
        .unwrap();
    let want = kiln_tests::tokens_of(&mut home, seq, usize::MAX).0;
    drop(home);
    let (mut prefill, mut decode) = (engine(), engine());
    let seq = prefill
        .add(TenantId(5), prompt, kiln_tests::greedy_to(10))
        .unwrap();
    let first = kiln_tests::tokens_of(&mut prefill, seq, 1).0;
    let there = decode.adopt(prefill.export(seq).unwrap()).unwrap();
    let rest = kiln_tests::tokens_of(&mut decode, there, usize::MAX).0;
    assert_eq!([first, rest].concat(), want);
    assert_eq!(decode.stats().integrity_aborts, 0);
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn three_gpu_ranks_with_weights_for_each_phase_give_the_whole_models_tokens() {
    use kiln_host::engine::Engine;
    use kiln_host::model::WeightPlan;
    let device = super::device();
    let plan: WeightPlan = "prefill=bf16,decode=int4".parse().unwrap();
    let arrivals = kiln_tests::Arrivals {
        every: 3,
        tenants: 1,
        max_tokens: 10,
    };
    // Prompts a few steps apart: steps hold a prompt's chunk (prefill's
    // weights) beside other sequences' tokens (decode's), in two passes.
    // Ranks never fold a one-token step's norms into its products, so the
    // whole model does not either: both sum in the same order but the
    // ranks' own.
    let tokens = |ranks| {
        let config = EngineConfig {
            device,
            tensor_parallel: ranks,
            cuda_fold: false,
            kv_memory: 64 << 20,
            kv_format: kiln_kernels::kv::KvFormat::Bf16,
            ..Default::default()
        };
        let mut e = Engine::new(kiln_tests::default_model_as(plan), config).unwrap();
        let runs = kiln_tests::staggered(&mut e, &super::PROMPTS[..4], arrivals);
        assert_eq!(e.stats().integrity_aborts, 0);
        runs.into_iter().map(|(t, _)| t).collect::<Vec<_>>()
    };
    let whole = tokens(1);
    assert!(whole.iter().all(|t| t.len() == 10), "{whole:?}");
    assert_eq!(tokens(3), whole);
}
