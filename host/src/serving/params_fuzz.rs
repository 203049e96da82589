//! The parameters a guest may pass to `kiln:ai`, any values at all: valid
//! settings the sampler takes without a panic, or an invalid-input error.

use super::*;
use kiln_kernels::sample::{SamplingParams, sample};
use kiln_runtime::Params;
use proptest::prelude::*;
use rand::SeedableRng;

fn float() -> impl Strategy<Value = Option<f32>> {
    prop::option::of(prop_oneof![
        any::<f32>(),
        prop::sample::select(vec![
            0.0,
            1e-30,
            0.5,
            1.0,
            2.0,
            f32::NAN,
            f32::INFINITY,
            -0.0
        ]),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::fuzz_cases(2000)))]

    #[test]
    fn any_guest_params_are_valid_settings_or_invalid_input(
        max_tokens in prop::option::of(any::<u32>()),
        temperature in float(),
        top_p in float(),
        top_k in prop::option::of(any::<u32>()),
        seed in prop::option::of(any::<u64>()),
        stop in prop::collection::vec(".{0,4}", 0..4),
        logits in prop::collection::vec(
            prop_oneof![-30.0f32..30.0, Just(f32::NEG_INFINITY)], 1..64),
    ) {
        let params = Params { max_tokens, temperature, top_p, top_k, seed, stop, ..Params::defaults() };
        match generate_params(params) {
            Ok(g) => {
                prop_assert!((0.0..=2.0).contains(&g.temperature));
                prop_assert!(g.top_p > 0.0 && g.top_p <= 1.0);
                prop_assert!(g.max_tokens >= 1);
                let p = SamplingParams { temperature: g.temperature, top_k: g.top_k, top_p: g.top_p };
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(g.seed.unwrap_or(0));
                let token = sample(&logits, p, &mut rng) as usize;
                prop_assert!(token < logits.len());
            }
            Err(e) => prop_assert!(matches!(e, AiError::InvalidInput(_)), "{e:?}"),
        }
    }
}
