//! The engine's working buffers on the GPU: made when the engine starts,
//! for the largest step its scheduler may run, so a step that cannot fit
//! fails the start with a reason instead of a request while serving.

use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, SchedulerConfig, TenantId};
use kiln_tests::default_model;

use super::device;

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_step_budget_the_device_cannot_hold_fails_the_start_and_says_so() {
    let config = |tokens| EngineConfig {
        device: device(),
        kv_memory: 64 << 20,
        scheduler: SchedulerConfig {
            max_tokens_per_step: tokens,
            ..Default::default()
        },
        ..Default::default()
    };
    // 2^30 tokens of the default model's activations: hundreds of TB.
    let err = Engine::new(default_model(), config(1 << 30))
        .err()
        .expect("an engine whose step cannot fit the device");
    assert!(err.contains("working buffers for a step of"), "{err}");
    // A budget that fits starts, and serves a prompt of that size.
    let mut e = Engine::new(default_model(), config(2048)).expect("an engine of 2048-token steps");
    let ids: Vec<u32> = (0..2000).map(|i| 100 + i % 1000).collect();
    let want = 3;
    let params = GenerateParams {
        max_tokens: want,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    e.add(TenantId(0), ids, params).unwrap();
    let mut tokens = 0;
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Token { token: Some(_), .. } = ev {
                tokens += 1;
            }
        }
    }
    assert_eq!(tokens, want);
}
