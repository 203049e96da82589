//! Tests of request validation: fields refused by name, fields mapped
//! onto the call, log-probabilities as each endpoint spells them.

use super::*;

fn err(body: serde_json::Value) -> ApiError {
    chat(body.to_string().as_bytes()).unwrap_err()
}

#[test]
fn unsupported_fields_are_refused_naming_the_field() {
    let base = |k: &str, v: Value| {
        let mut m =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        m[k] = v;
        m
    };
    assert_eq!(err(base("n", 17.into())).param.as_deref(), Some("n"));
    assert_eq!(err(base("n", 0.into())).param.as_deref(), Some("n"));
    assert_eq!(
        err(base("best_of", 2.into())).param.as_deref(),
        Some("best_of")
    );
    assert_eq!(
        err(base("tools", serde_json::json!([{"type": "retrieval"}])))
            .param
            .as_deref(),
        Some("tools[0].type")
    );
    assert_eq!(
        err(base("frobnicate", 1.into())).param.as_deref(),
        Some("frobnicate")
    );
    assert_eq!(
        err(base("temperature", 3.into())).param.as_deref(),
        Some("temperature")
    );
    let e = err(serde_json::json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}));
    assert_eq!(e.param.as_deref(), Some("messages[0].tool_call_id"));
    let e =
        err(serde_json::json!({"model": "m", "messages": [{"role": "critic", "content": "x"}]}));
    assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    assert_eq!(
        err(serde_json::json!({"messages": []})).param.as_deref(),
        Some("messages")
    );
    // Neutral values of unsupported features pass.
    let ok = chat(base("n", 1.into()).to_string().as_bytes());
    assert!(ok.is_ok());
    let three = chat(base("n", 3.into()).to_string().as_bytes()).unwrap();
    assert_eq!(three.n, 3);
}

#[test]
fn fields_map_onto_params() {
    let v = chat(
        serde_json::json!({
            "model": "m",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                         {"role": "user", "content": "hi"}],
            "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3,
            "seed": 9, "stop": "END", "stream": true,
            "stream_options": {"include_usage": true}, "user": "u1", "prompt_cache_key": "s"
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(v.params.max_tokens, Some(7));
    assert_eq!(v.params.top_k, Some(3));
    assert_eq!(v.params.stop, vec!["END".to_owned()]);
    assert_eq!(v.params.session.as_deref(), Some("s"));
    assert!(v.stream && v.include_usage);
    let Prompt::Chat(m) = v.input else { panic!() };
    assert_eq!(m[0].role, Role::System);
    assert_eq!(m[0].content, "be brief");
    let c = completion(br#"{"model": "m", "prompt": ["once upon"]}"#).unwrap();
    assert!(matches!(c.input, Prompt::Text(p) if p == "once upon"));
    assert!(completion(br#"{"model": "m", "messages": []}"#).is_err());
}

#[test]
fn every_documented_field_kiln_lacks_is_refused_by_name() {
    let lacking = [
        ("functions", serde_json::json!([])),
        ("function_call", "auto".into()),
        ("audio", serde_json::json!({})),
        ("modalities", serde_json::json!(["text"])),
        ("prediction", serde_json::json!({})),
        ("reasoning_effort", "low".into()),
        ("verbosity", "low".into()),
        ("web_search_options", serde_json::json!({})),
        ("metadata", serde_json::json!({})),
        ("store", false.into()),
        ("service_tier", "auto".into()),
        ("safety_identifier", "x".into()),
        ("presence_penalty", 1.into()),
        ("logit_bias", serde_json::json!({"1": 5})),
    ];
    for (k, v) in lacking {
        let mut m =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        m[k] = v;
        assert_eq!(err(m).param.as_deref(), Some(k), "{k}");
    }
}

#[test]
fn response_formats_map_onto_the_call_and_bad_ones_name_their_field() {
    let with = |rf: Value| {
        let mut m =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        m["response_format"] = rf;
        chat(m.to_string().as_bytes())
    };
    assert_eq!(
        with(serde_json::json!({"type": "text"}))
            .unwrap()
            .params
            .format,
        None
    );
    assert_eq!(
        with(serde_json::json!({"type": "json_object"}))
            .unwrap()
            .params
            .format,
        Some(OutputFormat::JsonObject)
    );
    let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let spec = serde_json::json!({"type": "json_schema",
        "json_schema": {"name": "x", "strict": true, "schema": schema}});
    let Some(OutputFormat::JsonSchema(text)) = with(spec).unwrap().params.format else {
        panic!("no schema")
    };
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), schema);
    let param = |rf: Value| with(rf).unwrap_err().param;
    assert_eq!(
        param(serde_json::json!({"type": "xml"})).as_deref(),
        Some("response_format.type")
    );
    assert_eq!(
        param(serde_json::json!({"type": "json_schema", "json_schema": {"name": "x"}})).as_deref(),
        Some("response_format.json_schema.schema")
    );
    assert_eq!(
        param(serde_json::json!({"type": "json_schema", "json_schema": {"schema": 3}})).as_deref(),
        Some("response_format.json_schema.schema")
    );
}

#[test]
fn log_probabilities_are_asked_for_as_each_endpoint_spells_it() {
    let chat_with = |extra: Value| {
        let mut m =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            m[k] = v.clone();
        }
        chat(m.to_string().as_bytes())
    };
    let lp = |r: Result<Validated, ApiError>| r.unwrap().params.logprobs;
    assert_eq!(lp(chat_with(serde_json::json!({}))), None);
    assert_eq!(lp(chat_with(serde_json::json!({"logprobs": false}))), None);
    assert_eq!(
        lp(chat_with(serde_json::json!({"logprobs": true}))),
        Some(0)
    );
    let both = serde_json::json!({"logprobs": true, "top_logprobs": 20});
    assert_eq!(lp(chat_with(both)), Some(20));
    let e = chat_with(serde_json::json!({"top_logprobs": 3})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    let e = chat_with(serde_json::json!({"logprobs": true, "top_logprobs": 21})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    let e = chat_with(serde_json::json!({"logprobs": 3})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("logprobs"));
    let c = |body: &str| completion(body.as_bytes());
    assert_eq!(
        lp(c(r#"{"model": "m", "prompt": "a", "logprobs": 3}"#)),
        Some(3)
    );
    assert_eq!(
        lp(c(r#"{"model": "m", "prompt": "a", "logprobs": 0}"#)),
        Some(0)
    );
    assert_eq!(
        lp(c(r#"{"model": "m", "prompt": "a", "logprobs": false}"#)),
        None
    );
    let e = c(r#"{"model": "m", "prompt": "a", "logprobs": true}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("logprobs"));
    let e = c(r#"{"model": "m", "prompt": "a", "top_logprobs": 2}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("top_logprobs"));
}

#[test]
fn an_answer_without_streaming_holds_a_bounded_number_of_log_probabilities() {
    let ask = |n: u32, max: u32, stream: bool| {
        let m = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "logprobs": true, "top_logprobs": 20, "n": n, "max_tokens": max, "stream": stream});
        chat(m.to_string().as_bytes())
    };
    // 16 x 780 x 21 fits; 16 x 8192 x 21 (2.75 million) does not, unless
    // streamed.
    assert!(ask(16, 780, false).is_ok());
    let e = ask(16, 8192, false).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    assert!(e.message.contains("stream: true"), "{}", e.message);
    assert!(ask(16, 8192, true).is_ok());
}

#[test]
fn tools_choices_and_tool_messages_map_onto_the_call() {
    let v = chat(
        serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
            ],
            "tools": [{"type": "function", "function": {"name": "weather",
                "description": "today's weather", "strict": true,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            "parallel_tool_calls": false
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let t = &v.params.tools[0];
    assert_eq!(t.name, "weather");
    assert_eq!(t.description.as_deref(), Some("today's weather"));
    let schema: Value = serde_json::from_str(t.parameters.as_deref().unwrap()).unwrap();
    assert_eq!(schema["properties"]["city"]["type"], "string");
    assert_eq!(
        v.params.tool_choice,
        Some(ToolChoice::Function("weather".into()))
    );
    assert_eq!(v.params.parallel_tool_calls, Some(false));
    let Prompt::Chat(m) = v.input else { panic!() };
    assert_eq!(m[1].tool_calls[0].name, "weather");
    assert_eq!(m[1].tool_calls[0].arguments, r#"{"city": "Paris"}"#);
    assert_eq!(m[1].content, "");
    assert_eq!(m[2].role, Role::Tool);
    assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
    // Bad choices name their field; an assistant message needs text or calls.
    let e = err(serde_json::json!({"model": "m", "tool_choice": "sometimes",
        "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    let e = err(serde_json::json!({"model": "m",
        "messages": [{"role": "assistant", "content": null}]}));
    assert_eq!(e.param.as_deref(), Some("messages[0].content"));
    let c = completion(br#"{"model": "m", "prompt": "a", "tools": []}"#).unwrap_err();
    assert_eq!(c.param.as_deref(), Some("tools"));
}

#[test]
fn stop_strings_too_many_or_too_long_are_refused_naming_stop() {
    let with = |stop: Value| serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": stop});
    let long = "a".repeat(GenerateParams::MAX_STOP_BYTES + 1);
    for stop in [
        serde_json::json!(long),
        serde_json::json!(["END", long]),
        serde_json::json!(["a", "b", "c", "d", "e"]),
    ] {
        let e = err(with(stop.clone()));
        assert_eq!(e.param.as_deref(), Some("stop"), "{stop}");
    }
    let fine = "a".repeat(GenerateParams::MAX_STOP_BYTES);
    assert!(
        chat(
            with(serde_json::json!(["END", fine]))
                .to_string()
                .as_bytes()
        )
        .is_ok()
    );
}
