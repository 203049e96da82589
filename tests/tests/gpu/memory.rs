//! The engine's working buffers on the GPU: made when the engine starts,
//! for the largest step its scheduler may run, so a step that cannot fit
//! fails the start with a reason instead of a request while serving.

use super::{device, synthetic_bf16, synthetic_ids_n};
use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, SchedulerConfig, TenantId};

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_step_budget_the_device_cannot_hold_fails_the_start_and_says_so() {
    let (loaded, base) = synthetic_bf16();
    let config = |tokens| EngineConfig {
        scheduler: SchedulerConfig {
            max_tokens_per_step: tokens,
            ..Default::default()
        },
        ..base(device())
    };
    // 2^30 tokens of SmolLM2-135M's activations: terabytes.
    let err = Engine::new(loaded.clone(), config(1 << 30))
        .err()
        .expect("an engine whose step cannot fit the device");
    assert!(err.contains("working buffers for steps of"), "{err}");
    // A budget that fits starts, and serves a prompt of that size.
    let mut e = Engine::new(loaded.clone(), config(2048)).expect("an engine of 2048-token steps");
    let ids = synthetic_ids_n(&loaded, 2000);
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
