//! Validation against arbitrary request bodies: a [`Validated`] whose
//! values are in range, or a 400 naming a field; never a panic.

use super::*;
use proptest::prelude::*;

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "prompt_cache_key",
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "echo",
    "logit_bias",
    "response_format",
    "tools",
    "role",
    "content",
    "type",
    "text",
    "include_usage",
    "x",
];

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop::sample::select(vec![-1.0, 0.0, 0.5, 1.0, 2.0, 2.5, 1e300]).prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
        prop::sample::select(vec!["system", "user", "assistant", "tool", "text"])
            .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(FIELDS), inner), 0..8).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::fuzz_cases(2000)))]

    #[test]
    fn any_json_body_validates_in_range_or_is_a_400(body in json()) {
        let bytes = serde_json::to_vec(&body).unwrap();
        for result in [chat(&bytes), completion(&bytes)] {
            match result {
                Ok(v) => {
                    let p = &v.params;
                    prop_assert!(p.temperature.is_none_or(|t| (0.0..=2.0).contains(&t)));
                    prop_assert!(p.top_p.is_none_or(|t| t > 0.0 && t <= 1.0));
                    prop_assert!(p.max_tokens.is_none_or(|n| n >= 1));
                }
                Err(e) => prop_assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST),
            }
        }
    }

    #[test]
    fn any_bytes_are_a_400_or_valid(body in prop::collection::vec(any::<u8>(), 0..64)) {
        for result in [chat(&body), completion(&body)] {
            if let Err(e) = result {
                prop_assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST);
            }
        }
    }
}
