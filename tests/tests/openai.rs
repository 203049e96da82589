//! The OpenAI-compatible API on a real server with the real default model.

use kiln_host::model::DEFAULT_MODEL;
use kiln_tests::TestServer;
use serde_json::{Value, json};

fn chat_body(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("usage without cached_tokens: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_long_prompt_is_cached_for_its_tenant_and_never_for_another() {
    let s = TestServer::start_with_models().await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let body = chat_body(&long, 2);
    let (st, first) = s.openai(&a, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(cached(&first), 0, "a cold prompt has nothing cached");
    let (_, second) = s.openai(&a, "/v1/chat/completions", None, &body).await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached(&second) + 16 > prompt && cached(&second) > 0,
        "every full page of the repeat hits: {second}"
    );
    assert_eq!(
        second["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    let (_, other) = s.openai(&b, "/v1/chat/completions", None, &body).await;
    assert_eq!(cached(&other), 0, "tenant b shares nothing with tenant a");
    let hit_a = [
        "kiln_prefix_cache_tokens_total{",
        "tenant=\"a\"",
        "result=\"hit\"",
    ];
    assert_eq!(s.metric(&hit_a).await, cached(&second) as f64);
    let hit_b = [
        "kiln_prefix_cache_tokens_total{",
        "tenant=\"b\"",
        "result=\"hit\"",
    ];
    assert_eq!(s.metric(&hit_b).await, 0.0);
    let in_use = s.metric(&["kiln_kv_pages{", "state=\"cached\""]).await;
    assert!(in_use > 0.0, "cached pages are exported");
    // Three calls of two tokens: at least a step each, every one timed
    // whole (wall) and on the device (on the CPU, its forward pass).
    let steps = s.metric(&["kiln_engine_steps_total{"]).await;
    let wall = ["kiln_engine_step_seconds_total{", "time=\"wall\""];
    let device = ["kiln_engine_step_seconds_total{", "time=\"device\""];
    let (wall, device) = (s.metric(&wall).await, s.metric(&device).await);
    assert!(steps >= 3.0, "{steps} steps");
    assert!(
        wall >= device && device > 0.0,
        "wall {wall} s, device {device} s"
    );
    // Each of those steps is in the wall-time histogram too, in seconds.
    let counted = s.metric(&["kiln_engine_step_wall_seconds_count{"]).await;
    let summed = s.metric(&["kiln_engine_step_wall_seconds_sum{"]).await;
    assert_eq!(counted, steps);
    assert!((summed - wall).abs() < 1e-6, "{summed} s against {wall} s");
}

/// The `data:` payloads of an SSE body.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chat_is_sse_with_the_same_text_then_usage_then_done() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let body = chat_body("Name three colors.", 12);
    let (_, plain) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    streamed["stream_options"] = json!({"include_usage": true});
    let resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth(&key)
        .json(&streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let ev = events(&resp.text().await.unwrap());
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, plain["choices"][0]["message"]["content"]);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"]["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    assert!(usage["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, &plain["choices"][0]["finish_reason"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_openai_error_objects_naming_the_problem() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&chat_body("hi", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "no key");
    let mut body = chat_body("hi", 1);
    body["model"] = "gpt-17".into();
    let (st, e) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    assert_eq!(
        (st, e["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    assert_eq!(e["error"]["param"], "model");
    for (field, value) in [
        ("n", json!(17)),
        ("functions", json!([])),
        ("frobnicate", json!(1)),
    ] {
        let mut body = chat_body("hi", 1);
        body[field] = value;
        let (st, e) = s.openai(&key, "/v1/chat/completions", None, &body).await;
        assert_eq!(st, 400, "{field}: {e}");
        assert_eq!(e["error"]["param"], field);
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert!(e["error"]["message"].as_str().unwrap().contains(field));
    }
    let (st, e) = s
        .openai(
            &key,
            "/v1/completions",
            None,
            &json!({"model": DEFAULT_MODEL}),
        )
        .await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("prompt")));
    let models = s.get_json(&key, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], DEFAULT_MODEL);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_call_that_cannot_run_is_a_400_not_a_stream() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    // Longer than the default model's 8192-token context.
    let mut body = chat_body(&"word ".repeat(10_000), 4);
    body["stream"] = true.into();
    let (st, e) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 400, "{e}");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("the prompt has"), "{message}");
    // The same as n samples, streamed or not.
    body["n"] = 2.into();
    let (st, e) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 400, "{e}");
    body["stream"] = false.into();
    let (st, e) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 400, "{e}");
    // A schema that cannot compile, streamed: refused before the stream.
    let mut body = chat_body("hi", 4);
    body["stream"] = true.into();
    body["response_format"] =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}});
    let (st, e) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 400, "{e}");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("cannot be used"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_of_one_prompt_share_its_cached_pages() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let mut body = chat_body(&long, 4);
    body["n"] = 3.into();
    body["temperature"] = 1.0.into();
    let (st, v) = s.openai(&key, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(3), "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let full = prompt / 16 * 16;
    let hit = [
        "kiln_prefix_cache_tokens_total{",
        "tenant=\"a\"",
        "result=\"hit\"",
    ];
    // The two later samples hit every full page the first computed.
    let hits = s.metric(&hit).await as u64;
    assert!(
        hits + 32 >= 2 * full && hits <= 2 * full,
        "{hits} hit of 2 x {full}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_python_client_drives_the_api() {
    let python = kiln_tests::python_with_openai();
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let script = kiln_tests::workspace()
        .join("tests")
        .join("openai_client.py");
    let base = format!("{}/v1", s.url);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .env("OPENAI_BASE_URL", base)
            .env("OPENAI_API_KEY", key)
            .env("KILN_MODEL", DEFAULT_MODEL)
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all checks passed"),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
