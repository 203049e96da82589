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
