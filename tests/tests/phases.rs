//! Phase-aware weights (`--weights prefill=F,decode=F`) on the default
//! model: a step's one-token rows run on decode's copy of the weights and
//! its prefill chunks on prefill's, two passes over the same KV pages.

use kiln_host::engine::{Engine, EngineConfig};
use kiln_host::model::{Loaded, WeightFormat, WeightPlan};
use kiln_kernels::kv::KvFormat;
use kiln_tests::{Arrivals, PROMPTS, default_model_as};

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

/// Each of four prompts' greedy tokens, one arriving every third step,
/// so most steps hold one prompt's prefill beside the others' decodes.
fn staggered(e: &mut Engine, n: usize) -> Vec<Vec<u32>> {
    let arrivals = Arrivals {
        every: 3,
        tenants: 1,
        max_tokens: n,
    };
    let runs = kiln_tests::staggered(e, &PROMPTS[..4], arrivals);
    runs.into_iter().map(|(tokens, _)| tokens).collect()
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
