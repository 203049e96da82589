//! Guests calling the real default model through `kiln:ai`.

use kiln_tests::TestServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployed_chat_function_streams_a_completion() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "chat", "chat").await;
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0.0,
        "max_tokens": 24,
    });
    let resp = s
        .http
        .post(format!("{}/fn/acme/chat/", s.url))
        .header("x-session-affinity", "s-1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-session-affinity"], "s-1");
    let text = resp.text().await.unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let deltas: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|v| v["delta"].as_str().map(str::to_owned))
        .collect();
    assert!(deltas.len() > 2, "the reply came in pieces: {deltas:?}");
    assert!(deltas.concat().contains("Paris"), "{deltas:?}");
    let end: serde_json::Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(end["finish_reason"], "stop");
    assert!(end["usage"]["prompt_tokens"].as_u64().unwrap() > 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_is_model_not_found_in_the_guest() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let text = s.call("acme", "bad", "/ai").await.text().await.unwrap();
    assert!(
        text.contains("ModelNotFound") && text.contains("available: smollm2-135m-instruct"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_disconnects_mid_stream_gets_its_sequence_cancelled() {
    let model = kiln_host::model::DEFAULT_MODEL;
    let s = TestServer::start_with_models().await;
    let served = s.models.clone().unwrap();
    let key = s.tenant("acme").await;
    s.deploy(&key, "chat", "chat").await;
    let baseline = served.snapshot(model).unwrap();
    assert_eq!(baseline.free_pages, baseline.total_pages);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 2000,
    });
    let mut resp = s
        .http
        .post(format!("{}/fn/acme/chat/", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    // Read until the first token arrives, then hang up.
    let first = resp.chunk().await.unwrap().expect("a first chunk");
    assert!(String::from_utf8_lossy(&first).contains("delta"));
    let busy = served.snapshot(model).unwrap();
    assert!(
        busy.free_pages < busy.total_pages,
        "the sequence holds pages while it runs"
    );
    drop(resp);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let now = served.snapshot(model).unwrap();
        if now.free_pages == now.total_pages && now.requests == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the sequence was not cancelled: {now:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summarize_function_answers_json_with_summary_and_usage() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "summarize", "summarize").await;
    let text = "Kiln runs WebAssembly functions for many tenants. Each function may call \
                language models, which run on shared GPU pools with per-tenant isolation.";
    let post = |body: String| {
        s.http
            .post(format!("{}/fn/acme/summarize/", s.url))
            .header("x-session-affinity", "doc-1")
            .body(body)
            .send()
    };
    let resp = post(text.to_owned()).await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert!(!v["summary"].as_str().unwrap().is_empty(), "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 20, "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{v}"
    );
    // The same text again, as JSON: its prefix is cached now.
    let again = post(serde_json::json!({ "text": text }).to_string())
        .await
        .unwrap();
    let w: serde_json::Value = again.json().await.unwrap();
    assert_eq!(w["summary"], v["summary"], "greedy: the same summary");
    assert!(w["usage"]["cached_tokens"].as_u64().unwrap() > 0, "{w}");
    let empty = post(String::new()).await.unwrap();
    assert_eq!(empty.status(), 400);
}
