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
        let engine = |ranks| {
            super::engine_config(EngineConfig {
                device,
                cuda_graphs: graphs,
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
