//! Decode pools on several GPUs (`kiln serve --device cuda:all`): each
//! GPU's pool serves the sessions rendezvous hashing gives it, and one
//! GPU's failing pool fails alone. On a machine of one GPU the test says
//! so and checks nothing: it needs two.

use kiln_host::engine::EngineConfig;
use kiln_host::metrics::Metrics;
use kiln_host::serving::ServedModels;
use kiln_host::serving::devices::DeviceSpec;
use kiln_kernels::Device;
use kiln_tests::default_model;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
async fn pools_on_two_gpus_serve_their_sessions_and_fail_alone() {
    super::device();
    let count = || kiln_kernels::cuda::Gpu::count().map_err(|e| e.to_string());
    let gpus = DeviceSpec::AllCuda.resolve(count).unwrap();
    if gpus.len() < 2 {
        eprintln!(
            "SKIPPED: pools across GPUs need two GPUs; this machine has {}",
            gpus.len()
        );
        return;
    }
    let config = EngineConfig {
        kv_memory: 64 << 20,
        device: Device::Cuda(0),
        ..Default::default()
    };
    let metrics = Metrics::default();
    let models = vec![(default_model(), config)];
    let served = ServedModels::start_on(models, &gpus[..2], 1, metrics.engine.clone()).unwrap();
    // Pool 0 runs on GPU 0 and pool 1 on GPU 1 (`pool_configs`).
    super::pools::one_pool_fails_alone(&served, &metrics).await;
}
