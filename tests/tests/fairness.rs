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

/// The default model's CPU engine: 64 tokens a step, 16 sequences.
fn engine() -> Engine {
    Engine::new(
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
    .expect("engine")
}

#[test]
fn a_burst_of_prompts_from_one_tenant_never_delays_another_tenants_tokens() {
    let mut e = engine();
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

/// The step in which each tenant's first request got its first token,
/// tenant 1 weighing `weight` against tenant 2's 1, both with a burst of
/// 48-token prompts and 64 tokens a step.
fn first_tokens_by_weight(weight: u32) -> (usize, usize) {
    let mut e = engine();
    e.set_tenant_weight(TenantId(1), weight);
    // Four prompts each, in turn: tenant 1's first, tenant 2's first, ...
    let firsts: Vec<u64> = (0..4)
        .flat_map(|i| [TenantId(1), TenantId(2)].map(|t| (t, i)))
        .map(|(t, i)| e.add(t, ids(48, i * 2 + t.0), params(2)).unwrap())
        .collect();
    let (mut a, mut b) = (None, None);
    let mut step = 0;
    while e.has_work() && (a.is_none() || b.is_none()) {
        step += 1;
        for ev in e.step().unwrap() {
            if let Event::Token { seq, .. } = ev {
                if seq == firsts[0] {
                    a.get_or_insert(step);
                } else if seq == firsts[1] {
                    b.get_or_insert(step);
                }
            }
        }
    }
    (a.unwrap(), b.unwrap())
}

#[test]
fn a_tenant_with_three_times_the_weight_gets_three_quarters_of_the_prompt_tokens() {
    // Even weights: 32 tokens each a step, so each 48-token prompt needs
    // two steps.
    assert_eq!(first_tokens_by_weight(1), (2, 2));
    // Weight 3 against 1: 48 and 16 a step. Tenant 1's prompt is done in
    // one step; tenant 2's needs three (a little less each step once
    // tenant 1's stream decodes first).
    let (a, b) = first_tokens_by_weight(3);
    assert_eq!(a, 1);
    assert!(b >= 3, "tenant 2's first token in step {b}");
}
