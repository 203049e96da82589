//! Prefill/decode disaggregation (`--pd on`) on the default model: a
//! prefill lane and a decode lane over one KV pool give the tokens one
//! scheduler gives, hand over every sequence at its first token, send
//! what the decode lane preempts back to be recomputed, and keep the
//! page-tag check on pages that changed lanes.

use std::collections::HashMap;

use kiln_host::engine::{
    Engine, EngineConfig, Event, Finish, GenerateParams, SchedulerConfig, TenantId,
};
use kiln_host::model::KvCache;
use kiln_kernels::kv::KvFormat;
use kiln_tests::{Arrivals, PROMPTS, chat_ids, default_model, staggered};

/// Six prompts, one every other step, of three tenants.
fn run(e: &mut Engine, max_tokens: usize) -> Vec<(Vec<u32>, Finish)> {
    let arrivals = Arrivals {
        every: 2,
        tenants: 3,
        max_tokens,
    };
    staggered(e, &PROMPTS[..6], arrivals)
}

/// An engine with `pages` KV pages and steps of at most 32 tokens (so
/// prompts take several chunks).
fn engine(pd: bool, pages: usize) -> Engine {
    engine_aiming(pd, pages, 0.0)
}

/// [`engine`] with a step time target.
fn engine_aiming(pd: bool, pages: usize, step_target: f64) -> Engine {
    let page = KvCache::page_bytes(&default_model().model.config, KvFormat::Fp8, 16);
    Engine::new(
        default_model(),
        EngineConfig {
            kv_format: KvFormat::Fp8,
            kv_memory: pages * page,
            scheduler: SchedulerConfig {
                max_tokens_per_step: 32,
                step_target,
                ..Default::default()
            },
            pd,
            ..Default::default()
        },
    )
    .expect("engine")
}

#[test]
fn disaggregated_lanes_give_the_tokens_of_one_scheduler() {
    let mut one = engine(false, 256);
    let mut two = engine(true, 256);
    let want = run(&mut one, 12);
    assert!(
        want.iter()
            .all(|(t, f)| t.len() == 12 && *f == Finish::Length),
        "{want:?}"
    );
    assert_eq!(run(&mut two, 12), want);
    assert_eq!(one.stats().handoffs, 0);
    assert_eq!(two.stats().handoffs, 6, "one handoff a sequence");
}

#[test]
fn what_the_decode_lane_preempts_is_recomputed_to_the_same_tokens_and_every_page_returns() {
    // 14 pages for six chats of ~40 tokens that grow by 40: the decode
    // lane runs out and preempts.
    let want = run(&mut engine(false, 256), 40);
    let mut e = engine(true, 14);
    let start = e.free_pages();
    assert_eq!(run(&mut e, 40), want);
    assert!(
        e.stats().preemptions > 0,
        "the pool was meant to force preemption"
    );
    assert!(
        e.stats().handoffs > 6,
        "a preempted sequence is handed over again"
    );
    assert_eq!(e.free_pages(), start);
}

#[test]
fn a_corrupted_mapping_after_the_handoff_aborts_exactly_the_victim() {
    let mut e = engine(true, 256);
    let params = GenerateParams {
        max_tokens: 8,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let victim = e
        .add(TenantId(1), chat_ids(&e, PROMPTS[0]), params.clone())
        .unwrap();
    let donor = e
        .add(TenantId(2), chat_ids(&e, PROMPTS[1]), params)
        .unwrap();
    while e.stats().handoffs < 2 {
        e.step().unwrap();
    }
    assert!(e.inject_page_fault(victim, donor));
    let mut finished = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Finished { seq, finish, .. } = ev {
                finished.insert(seq, finish);
            }
        }
    }
    assert!(
        matches!(finished[&victim], Finish::Aborted(_)),
        "{finished:?}"
    );
    assert_eq!(finished[&donor], Finish::Length);
    assert_eq!(e.stats().integrity_aborts, 1);
}

#[test]
fn a_sequence_cancelled_while_its_prefill_is_in_flight_frees_its_pages_when_the_step_lands() {
    let mut e = engine(true, 256);
    let start = e.free_pages();
    let params = GenerateParams {
        max_tokens: 8,
        ..Default::default()
    };
    let seq = e
        .add(TenantId(1), chat_ids(&e, PROMPTS[0]), params)
        .unwrap();
    // The first step launches the prompt's first chunk on the side lane.
    assert!(e.step().unwrap().is_empty());
    assert!(e.free_pages() < start, "the chunk holds pages");
    assert!(e.cancel(seq));
    assert!(
        e.free_pages() < start,
        "freed while the step may still write them"
    );
    assert!(e.has_work(), "the step in flight is still to land");
    let events = e.step().unwrap();
    assert!(
        events.is_empty(),
        "a cancelled request reports nothing: {events:?}"
    );
    assert_eq!(e.free_pages(), start);
    assert!(!e.has_work());
}

#[test]
fn decodes_go_first_on_the_device_only_while_tenants_compete_under_the_step_target() {
    let params = GenerateParams {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let first_while = |e: &mut Engine, steps: usize| {
        (0..steps).any(|_| {
            e.step().unwrap();
            e.stats().decode_first
        })
    };
    for (target, competing_first) in [(1.3, true), (0.0, false)] {
        let mut e = engine_aiming(true, 256, target);
        let ids = chat_ids(&e, PROMPTS[0]);
        e.add(TenantId(1), ids, params.clone()).unwrap();
        // One tenant alone: its own prompts are never held behind its
        // streams.
        assert!(!first_while(&mut e, 12), "target {target}: alone");
        let ids = chat_ids(&e, PROMPTS[1]);
        e.add(TenantId(2), ids, params.clone()).unwrap();
        assert_eq!(first_while(&mut e, 16), competing_first, "target {target}");
        while e.has_work() {
            e.step().unwrap();
        }
        e.step().unwrap();
        assert!(!e.stats().decode_first, "target {target}: idle");
    }
}

/// Engine steps until `e` has handed `handoffs` sequences to the decode
/// lane, and every sequence's tokens once all have finished.
fn steps_to_hand_off(e: &mut Engine, handoffs: u64) -> (usize, HashMap<u64, Vec<u32>>) {
    let mut steps = 0;
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut take = |events: Vec<Event>| {
        for ev in events {
            if let Event::Token { seq, token, .. } = ev {
                tokens.entry(seq).or_default().extend(token);
            }
        }
    };
    while e.stats().handoffs < handoffs {
        take(e.step().unwrap());
        steps += 1;
    }
    while e.has_work() {
        take(e.step().unwrap());
    }
    (steps, tokens)
}

#[test]
fn prefill_steps_follow_each_other_while_a_decode_step_runs() {
    // A stream decodes while a prompt of several 32-token chunks arrives.
    // Each decode step is reported running for three checks, as a
    // device's would be: each prefill chunk that lands meanwhile is
    // followed by the next at once, not after the decode step.
    let run = |hold: u32| {
        let mut e = engine(true, 256);
        e.hold_decode_steps(hold);
        let params = GenerateParams {
            max_tokens: 48,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        };
        let stream = chat_ids(&e, PROMPTS[0]);
        e.add(TenantId(1), stream, params.clone()).unwrap();
        while e.stats().handoffs < 1 {
            e.step().unwrap();
        }
        let long = chat_ids(&e, &PROMPTS[1..].join(" ").repeat(2));
        assert!(long.len() > 4 * 32, "{} tokens", long.len());
        e.add(TenantId(2), long, params).unwrap();
        steps_to_hand_off(&mut e, 2)
    };
    let (alone, want) = run(0);
    let (held, got) = run(3);
    assert_eq!(got, want, "the same tokens");
    assert!(
        held * 2 <= alone,
        "{held} steps with the decode step running, {alone} without"
    );
}
