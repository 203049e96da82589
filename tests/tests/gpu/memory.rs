//! The engine's working buffers on the GPU: made when the engine starts,
//! for the largest step its scheduler may run, so a step that cannot fit
//! fails the start with a reason instead of a request while serving; and
//! remade only a few times, never smaller, however steps change shape.

use std::sync::Arc;

use super::{device, synthetic_bf16, synthetic_ids_n};
use kiln_host::engine::{
    Engine, EngineConfig, Event, Finish, GenerateParams, SchedulerConfig, TenantId,
};
use kiln_host::model::{WeightPlan, load_as};

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

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn steps_that_change_shape_and_phase_settle_on_one_set_of_working_buffers() {
    // A step's prompt chunk runs on bf16 weights and its decodes on FP8
    // rows, one lane's buffers for both passes: the bf16 pass's buffers
    // lack the FP8 rows' activation scratch.
    let name = "synthetic:smollm2-135m";
    let plan: WeightPlan = "prefill=bf16,decode=fp8".parse().unwrap();
    let loaded = Arc::new(load_as(name, name, plan).expect(name));
    let config = EngineConfig {
        device: device(),
        kv_memory: 64 << 20,
        kv_format: kiln_kernels::kv::KvFormat::Bf16,
        scheduler: SchedulerConfig {
            max_tokens_per_step: 256,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut e = Engine::new(loaded.clone(), config).expect("engine");
    let params = GenerateParams {
        max_tokens: 160,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    // A 300-token prompt every 16 steps: two chunks of it beside streams
    // whose contexts outgrow the chunks (to 460 tokens), then decodes.
    let (mut tokens, mut step) = (0, 0);
    while step < 6 * 16 || e.has_work() {
        if step % 16 == 0 && step < 6 * 16 {
            let ids = synthetic_ids_n(&loaded, 300);
            e.add(TenantId(0), ids, params.clone()).unwrap();
        }
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { token: Some(_), .. } => tokens += 1,
                Event::Finished { finish, .. } => assert_eq!(finish, Finish::Length),
                _ => {}
            }
        }
        step += 1;
    }
    assert_eq!(tokens, 6 * 160);
    // The first step's, the decode weights' scratch, a longer context:
    // then one set for every shape.
    let made = e.stats().buffers_made;
    assert!((1..=4).contains(&made), "working buffers made {made} times");
}
