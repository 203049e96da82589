//! Phase-aware weights (`--weights prefill=F,decode=F`) on the default
//! model: a step's one-token rows run on decode's copy of the weights and
//! its prefill chunks on prefill's, two passes over the same KV pages.

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, TenantId};
use kiln_host::model::{Loaded, WeightFormat, WeightPlan};
use kiln_kernels::kv::KvFormat;
use kiln_tests::{chat_ids, default_model_as};

const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
];

fn engine(loaded: Loaded) -> Engine {
    Engine::new(
        loaded,
        EngineConfig {
            kv_format: KvFormat::Bf16,
            kv_memory: 64 << 20,
            ..Default::default()
        },
    )
    .expect("engine")
}

/// Each prompt's greedy tokens, the prompts arriving one every third step,
/// so most steps hold one prompt's prefill beside the others' decodes.
fn staggered(e: &mut Engine, n: usize) -> Vec<Vec<u32>> {
    let params = GenerateParams {
        max_tokens: n,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let (mut seqs, mut tokens) = (Vec::new(), HashMap::new());
    let mut step = 0;
    while seqs.len() < PROMPTS.len() || e.has_work() {
        if step % 3 == 0 && seqs.len() < PROMPTS.len() {
            let ids = chat_ids(e, PROMPTS[seqs.len()]);
            seqs.push(e.add(TenantId(0), ids, params.clone()).unwrap());
        }
        for ev in e.step().unwrap() {
            if let Event::Token {
                seq,
                token: Some(t),
                ..
            } = ev
            {
                tokens.entry(seq).or_insert_with(Vec::new).push(t);
            }
        }
        step += 1;
    }
    seqs.iter()
        .map(|s| tokens.remove(s).unwrap_or_default())
        .collect()
}

#[test]
fn phases_on_two_copies_of_the_same_weights_give_the_tokens_of_one() {
    let mut one = engine(default_model_as(WeightFormat::Int4));
    let split = default_model_as(WeightFormat::Int4)
        .with_decode_weights(WeightFormat::Native)
        .unwrap();
    let mut two = engine(split);
    let want = staggered(&mut one, 10);
    assert!(want.iter().all(|t| t.len() == 10), "{want:?}");
    assert_eq!(staggered(&mut two, 10), want);
}

#[test]
fn prefill_picks_the_first_token_and_decode_weights_the_rest() {
    let plan: WeightPlan = "prefill=bf16,decode=int4".parse().unwrap();
    let mut bf16 = engine(default_model_as(WeightFormat::Bf16));
    let mut int4 = engine(default_model_as(WeightFormat::Int4));
    let mut phased = engine(default_model_as(plan));
    let (b, i, p) = (
        staggered(&mut bf16, 10),
        staggered(&mut int4, 10),
        staggered(&mut phased, 10),
    );
    // The first token comes from the prompt's prefill pass: bf16's.
    for (p, b) in p.iter().zip(&b) {
        assert_eq!(p[0], b[0], "{p:?} vs bf16 {b:?}");
    }
    // Later tokens come from int4 weights: somewhere they leave bf16's.
    assert_ne!(p, b, "int4 decode never changed a token");
    assert_ne!(p, i, "the prefill weights never changed a token");
}
