//! Tenants sharing one engine (the CPU engine on the default model): one
//! tenant's burst of prompts takes at most its fair share of each step, so
//! another tenant's prompt is computed at once and its stream gets a token
//! every step.

use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, SchedulerConfig, TenantId};
use kiln_kernels::kv::KvFormat;
use kiln_tests::default_model;

fn ids(len: u32, salt: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 200 + (i * 37 + salt * 101) % 20000)
        .collect()
}

fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn a_burst_of_prompts_from_one_tenant_never_delays_another_tenants_tokens() {
    let mut e = Engine::new(
        default_model(),
        EngineConfig {
            kv_format: KvFormat::Fp8,
            kv_memory: 64 << 20,
            scheduler: SchedulerConfig {
                max_tokens_per_step: 64,
                max_running: 16,
                step_target: 0.0,
            },
            ..Default::default()
        },
    )
    .expect("engine");
    // Tenant 1's burst arrives first: twelve 60-token prompts, each of
    // which alone could fill a step's 64 tokens.
    let burst: Vec<u64> = (0..12)
        .map(|i| e.add(TenantId(1), ids(60, i), params(8)).unwrap())
        .collect();
    // Tenant 2's request comes while the burst's first prompts are being
    // computed.
    e.step().unwrap();
    let b = e.add(TenantId(2), ids(30, 99), params(8)).unwrap();
    let mut b_steps = Vec::new();
    let mut steps = 1;
    while e.has_work() {
        steps += 1;
        for ev in e.step().unwrap() {
            if let Event::Token {
                seq,
                token: Some(_),
                ..
            } = ev
                && seq == b
            {
                b_steps.push(steps);
            }
        }
    }
    // Tenant 2's 30 tokens fit its half of the next step: its first token
    // comes with step 2, and a decode runs before any prompt chunk, so each
    // later step brings the next.
    assert_eq!(
        b_steps,
        (2..=9).collect::<Vec<_>>(),
        "tenant 2's tokens by step"
    );
    // The burst still ran to its end (12 prompts of 60, 8 tokens each).
    assert!(steps > 12, "the burst took {steps} steps");
    assert!(burst.iter().all(|s| *s != b));
}
