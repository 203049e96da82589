//! Tool calls through the OpenAI-compatible API, and `kiln:ai@0.2.0`
//! features from guests (with a `kiln:ai@0.1.0` guest still served), on a
//! real server with the default model.

use kiln_host::model::DEFAULT_MODEL;
use kiln_tests::TestServer;
use serde_json::{Value, json};

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }})
}

fn ask(choice: Value) -> Value {
    json!({
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [weather_tool(), {"type": "function", "function": {"name": "get_time"}}],
        "tool_choice": choice,
        "max_tokens": 64,
        "temperature": 0,
    })
}

/// The arguments of a call, checked against the weather tool's schema.
fn weather_arguments(call: &Value) -> Value {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    assert_eq!(call["function"]["name"], "get_weather", "{call}");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {call}"));
    let city = args["city"].as_str().unwrap_or_else(|| panic!("{args}"));
    assert!(city.chars().count() <= 24, "{args}");
    assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
    assert_eq!(args.as_object().unwrap().len(), 2, "{args}");
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_tool_call_round_trips_with_its_result() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let (st, v) = s
        .openai(&key, "/v1/chat/completions", None, &ask(named))
        .await;
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let call = &choice["message"]["tool_calls"][0];
    weather_arguments(call);
    // The call and its result go back; the model answers in text.
    let mut next = ask(json!("none"));
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(choice["message"].clone());
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}));
    let (st, v) = s.openai(&key, "/v1/chat/completions", None, &next).await;
    assert_eq!(st, 200, "{v}");
    let answer = &v["choices"][0];
    assert!(answer["message"].get("tool_calls").is_none(), "{v}");
    assert!(!answer["message"]["content"].as_str().unwrap().is_empty());
    assert_ne!(answer["finish_reason"], "tool_calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_calls_stream_as_tool_call_deltas() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let mut body = ask(json!("required"));
    body["tools"] = json!([weather_tool()]);
    body["parallel_tool_calls"] = false.into();
    body["stream"] = true.into();
    let resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let content: String = (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "", "a call's text never streams as content");
    let calls: Vec<&Value> = (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(
        calls.len(),
        1,
        "one call when parallel calls are off: {text}"
    );
    assert_eq!(calls[0]["index"], 0);
    weather_arguments(calls[0]);
    let finish = chunks.last().unwrap()["choices"][0]["finish_reason"].clone();
    assert_eq!(finish, "tool_calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_requests_the_server_cannot_serve_are_400s_saying_why() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let unknown = json!({"type": "function", "function": {"name": "get_news"}});
    let (st, v) = s
        .openai(&key, "/v1/chat/completions", None, &ask(unknown))
        .await;
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("get_news"));
    let mut both = ask(json!("auto"));
    both["response_format"] = json!({"type": "json_object"});
    let (st, v) = s.openai(&key, "/v1/chat/completions", None, &both).await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = s
        .openai(
            &key,
            "/v1/chat/completions",
            None,
            &json!({"model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "hi"}], "functions": []}),
        )
        .await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("functions")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_extracts_json_its_schema_accepts() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "extract", "extract").await;
    let post = |body: String| {
        s.http
            .post(format!("{}/fn/acme/extract/", s.url))
            .body(body)
            .send()
    };
    let text = "Hi, I'm Ada Lovelace from Analytical Engines Ltd; write to ada@engines.example.";
    let resp = post(text.to_owned()).await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let data = v["data"].as_object().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(data.len(), 3, "{v}");
    assert!(data["name"].is_string(), "{v}");
    assert!(data["email"].is_string() || data["email"].is_null(), "{v}");
    // A schema of the caller's own.
    let schema = json!({"type": "object", "properties": {"count": {"type": "integer"}},
        "required": ["count"], "additionalProperties": false});
    let body = json!({"text": "three apples and two pears", "schema": schema});
    let resp = post(body.to_string()).await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert!(v["data"]["count"].is_i64(), "{v}");
    assert_eq!(v["data"].as_object().unwrap().len(), 1, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_built_for_kiln_ai_0_1_still_calls_models() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "old", "legacy").await;
    let resp = s.call("acme", "old", "/").await;
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    let parts: Vec<&str> = body.split('|').collect();
    assert_eq!(parts.len(), 7, "{body}");
    assert_eq!(parts[0], DEFAULT_MODEL);
    // Greedy: the whole reply and the streamed one agree.
    assert_eq!(
        (parts[1], parts[2], parts[3]),
        (parts[4], parts[5], parts[6])
    );
    assert!(parts[3].parse::<u32>().unwrap() >= 1, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_calls_a_tool_with_log_probabilities_and_feeds_back_its_result() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "fn", "misbehave").await;
    let resp = s.call("acme", "fn", "/tool").await;
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    let parts: Vec<&str> = body.splitn(6, '|').collect();
    assert_eq!(parts.len(), 6, "{body}");
    assert_eq!(parts[0], "get_weather");
    let args: Value = serde_json::from_str(parts[1]).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert!(args["city"].is_string(), "{body}");
    assert_eq!(parts[2], "FinishReason::ToolCalls");
    // Every generated token's figures, EOS aside.
    let (lps, tokens): (usize, usize) = (parts[3].parse().unwrap(), parts[4].parse().unwrap());
    assert!(lps >= 1 && lps <= tokens, "{body}");
    assert!(!parts[5].is_empty(), "a reply to the tool's result: {body}");
}
