//! Output formats (OpenAI's `response_format`) on the CPU engine and the
//! default model: the output always parses, and a schema's output
//! validates against it, greedy or sampled.

use kiln_host::engine::{
    Engine, EngineConfig, Event, Finish, Formats, GenerateParams, OutputFormat, Salt, TenantId,
};
use kiln_tests::{chat_ids, default_model};
use serde_json::{Value, json};

fn engine() -> Engine {
    Engine::new(default_model(), EngineConfig::default()).expect("engine")
}

fn city_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"}
        },
        "required": ["city", "population"],
        "additionalProperties": false
    })
}

fn generate(
    e: &mut Engine,
    prompt: &str,
    format: OutputFormat,
    seed: Option<u64>,
) -> (Value, Finish) {
    let ids = chat_ids(e, prompt);
    let params = GenerateParams {
        max_tokens: 80,
        temperature: if seed.is_some() { 0.9 } else { 0.0 },
        seed,
        format: Some(format),
        ..Default::default()
    };
    let out = e.generate(TenantId(1), ids, params).unwrap();
    let v = serde_json::from_str(&out.text)
        .unwrap_or_else(|err| panic!("not JSON ({err}): {:?}", out.text));
    (v, out.finish)
}

#[test]
fn output_under_a_schema_parses_and_validates_greedy_and_sampled() {
    let mut e = engine();
    let prompt = "Name one large city and its population, as JSON.";
    for seed in [None, Some(1), Some(2), Some(3)] {
        let (v, finish) = generate(
            &mut e,
            prompt,
            OutputFormat::JsonSchema(city_schema()),
            seed,
        );
        assert_eq!(finish, Finish::Stop, "{v}");
        let obj = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {v}"));
        assert_eq!(obj.len(), 2, "{v}");
        assert!(
            obj["city"]
                .as_str()
                .is_some_and(|c| c.chars().count() <= 20),
            "{v}"
        );
        assert!(
            obj["population"].is_i64() || obj["population"].is_u64(),
            "{v}"
        );
    }
}

#[test]
fn json_object_output_is_an_object() {
    let mut e = engine();
    let prompt = "Copy this JSON object exactly: {\"ok\": true}";
    let (v, finish) = generate(&mut e, prompt, OutputFormat::JsonObject, None);
    assert_eq!(finish, Finish::Stop, "{v}");
    assert!(v.is_object(), "{v}");
}

#[test]
fn a_schema_that_cannot_be_compiled_is_refused_at_once() {
    let mut e = engine();
    let ids = chat_ids(&e, "hi");
    let params = GenerateParams {
        format: Some(OutputFormat::JsonSchema(json!({"type": "no-such-type"}))),
        ..Default::default()
    };
    let err = e.add(TenantId(1), ids, params).unwrap_err();
    assert!(err.contains("JSON schema"), "{err}");
}

#[test]
fn a_format_compiled_before_admission_is_the_one_the_engine_runs() {
    let mut e = engine();
    let loaded = e.loaded();
    let formats = Formats::new(&loaded.tokenizer, loaded.model.config.vocab).unwrap();
    let compiled = formats.compile("t", &OutputFormat::JsonObject).unwrap();
    let ids = chat_ids(&e, "Copy this JSON object exactly: {\"ok\": true}");
    // The params' own format cannot compile: the engine compiling it
    // would refuse the request, so its admission shows it used what it
    // was given, as a server's engine thread does.
    let params = GenerateParams {
        max_tokens: 40,
        temperature: 0.0,
        format: Some(OutputFormat::JsonSchema(json!({"type": "no-such-type"}))),
        ..Default::default()
    };
    let salt = Salt::derive(&[7; 32], "m", "t");
    let seqs = e
        .admit(TenantId(1), salt, ids, params, 2, Some(compiled))
        .unwrap();
    let mut texts = vec![String::new(); seqs.len()];
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Token { seq, text, .. } = ev {
                texts[seqs.iter().position(|s| *s == seq).unwrap()].push_str(&text);
            }
        }
    }
    for text in texts {
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|err| panic!("not JSON ({err}): {text:?}"));
        assert!(v.is_object(), "{v}");
    }
}
