//! Functions written in Python (componentize-py) and JavaScript
//! (componentize-js), built from `examples/` and `tests/guests/` with the
//! toolchains the project's script installs, served end to end: a
//! greeting, a chat streamed from the real default model, errors a model
//! call reports, and limits the host enforces.

use futures::StreamExt;
use kiln_tests::{TestServer, build_project, error_of};

/// One language's three projects: hello, chat and the limit breaker.
struct Projects {
    hello: &'static str,
    chat: &'static str,
    limits: &'static str,
    greeting: &'static str,
}

const PYTHON: Projects = Projects {
    hello: "examples/python/hello",
    chat: "examples/python/chat",
    limits: "tests/guests/python",
    greeting: "Hello from Kiln (Python)!",
};

const JS: Projects = Projects {
    hello: "examples/js/hello",
    chat: "examples/js/chat",
    limits: "tests/guests/js",
    greeting: "Hello from Kiln (JavaScript)!",
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_functions_greet_stream_the_model_and_hit_limits() {
    serve_end_to_end(&PYTHON).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn javascript_functions_greet_stream_the_model_and_hit_limits() {
    serve_end_to_end(&JS).await;
}

async fn deploy(s: &TestServer, key: &str, name: &str, project: &'static str) {
    let bytes = tokio::task::spawn_blocking(move || build_project(project))
        .await
        .unwrap();
    let resp = s.put(key, name, bytes).await;
    let status = resp.status();
    let body = resp.text().await.unwrap();
    assert_eq!(status, 201, "deploying {project}: {body}");
}

async fn serve_end_to_end(p: &Projects) {
    // CPU time counts the kernel's work for a guest too: `/grow` touches
    // every page it allocates (zeroed), and 128 MiB of them must fit in
    // the budget for the memory limit to be the one that stops it.
    let s = TestServer::start_with_pools(1, |c| {
        c.limits.cpu_time = std::time::Duration::from_millis(500)
    })
    .await;
    let key = s.tenant("acme").await;
    deploy(&s, &key, "hello", p.hello).await;
    deploy(&s, &key, "chat", p.chat).await;
    deploy(&s, &key, "limits", p.limits).await;

    // The greeting echoes method, path and session.
    let resp = s
        .http
        .get(format!("{}/fn/acme/hello/any/path?q=1", s.url))
        .header("x-session-affinity", "s1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    for part in [
        p.greeting,
        "method: GET",
        "path: /any/path?q=1",
        "session: s1",
    ] {
        assert!(text.contains(part), "no {part:?} in {text:?}");
    }

    // A chat streams server-sent events as the model decodes, and says
    // what the real model says to the same greedy request.
    let messages =
        serde_json::json!([{"role": "user", "content": "What is the capital of France?"}]);
    let resp = s
        .http
        .post(format!("{}/fn/acme/chat/", s.url))
        .json(&serde_json::json!({"messages": messages, "max_tokens": 12, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut chunks = 0;
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.unwrap());
        chunks += 1;
    }
    let body = String::from_utf8(body).unwrap();
    let events: Vec<serde_json::Value> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let streamed: String = events.iter().filter_map(|e| e["delta"].as_str()).collect();
    let deltas = events.iter().filter(|e| e["delta"].is_string()).count();
    assert!(
        deltas >= 2 && chunks >= 2,
        "{deltas} deltas in {chunks} chunks: {body}"
    );
    let done = events.last().unwrap();
    let completion_tokens = done["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(completion_tokens >= deltas as u64, "{done}");
    let (status, direct) = s
        .openai(
            &key,
            "/v1/chat/completions",
            None,
            &serde_json::json!({"model": "smollm2-135m-instruct", "messages": messages,
                                "max_tokens": 12, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{direct}");
    assert_eq!(
        streamed, direct["choices"][0]["message"]["content"],
        "{body}"
    );
    assert_eq!(done["finish_reason"], direct["choices"][0]["finish_reason"]);

    // A model call's error becomes the function's answer.
    let resp = s
        .http
        .post(format!("{}/fn/acme/chat/", s.url))
        .json(&serde_json::json!({"messages": messages, "model": "nope"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let v: serde_json::Value = resp.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("model-not-found") && msg.contains("nope"),
        "{msg}"
    );
    let resp = s
        .http
        .post(format!("{}/fn/acme/chat/", s.url))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    // The host's limits stop a runaway function; the function still serves.
    let (status, kind, msg) = error_of(s.call("acme", "limits", "/loop").await).await;
    assert_eq!(
        (status, kind.as_str()),
        (504, "cpu_time_limit_exceeded"),
        "{msg}"
    );
    let (status, kind, msg) = error_of(s.call("acme", "limits", "/grow").await).await;
    assert_eq!(
        (status, kind.as_str()),
        (500, "memory_limit_exceeded"),
        "{msg}"
    );
    let ok = s.call("acme", "limits", "/").await;
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.text().await.unwrap(), "ok");
}
