//! Tenants sharing the engine: policy (quota, allowed models), session
//! affinity across decode pools, and fairness, on the real default model.

use std::time::{Duration, Instant};

use kiln_host::model::DEFAULT_MODEL;
use kiln_tests::TestServer;
use serde_json::json;

fn ask(max_tokens: u32) -> serde_json::Value {
    json!({
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_exceeded_is_429_on_the_api_and_quota_exceeded_in_a_guest() {
    let s = TestServer::start_with_models().await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    s.deploy(&a, "bad", "misbehave").await;
    s.deploy(&b, "bad", "misbehave").await;
    let resp = s.set_policy("a", json!({"tokens_per_minute": 20})).await;
    assert_eq!(resp.status(), 200);
    let policy = s.get_json(&s.admin, "/v1/tenants/a/policy").await;
    assert_eq!(policy["tokens_per_minute"], 20);
    // The first call's reservation (a prompt estimate of 11 and max_tokens
    // 2) fits; what it really uses (the chat template's ~30 prompt tokens)
    // uses up the minute.
    let (st, _) = s.openai(&a, "/v1/chat/completions", None, &ask(2)).await;
    assert_eq!(st, 200);
    let (st, e) = s.openai(&a, "/v1/chat/completions", None, &ask(2)).await;
    assert_eq!(st, 429, "{e}");
    assert_eq!(e["error"]["type"], "rate_limit_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens_per_minute")
    );
    let guest = s.call("a", "bad", "/ask").await.text().await.unwrap();
    assert!(guest.contains("QuotaExceeded"), "{guest}");
    // Tenant b has no quota.
    let other = s.call("b", "bad", "/ask").await;
    assert_eq!(other.status(), 200);
    assert!(
        s.metric(&["kiln_policy_rejections_total{", "tenant=\"a\""])
            .await
            >= 2.0
    );
    // Bad policy input, unknown tenant, no admin token.
    assert_eq!(s.set_policy("a", json!({"tpm": 5})).await.status(), 400);
    for w in [0, 1001] {
        let resp = s.set_policy("b", json!({"weight": w})).await;
        assert_eq!(resp.status(), 400, "weight {w}");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert!(
            body.to_string().contains("`weight` must be 1 to 1000"),
            "{body}"
        );
    }
    let resp = s.set_policy("b", json!({"weight": 3})).await;
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["weight"], 3, "{body}");
    assert_eq!(s.set_policy("nobody", json!({})).await.status(), 404);
    let resp = s
        .http
        .put(format!("{}/v1/tenants/a/policy", s.url))
        .bearer_auth(&a)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "a tenant key cannot set policy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_outside_a_tenants_allowed_list_are_not_found() {
    let s = TestServer::start_with_models().await;
    let a = s.tenant("a").await;
    s.deploy(&a, "bad", "misbehave").await;
    s.set_policy("a", json!({"allowed_models": ["other-model"]}))
        .await;
    let (st, e) = s.openai(&a, "/v1/chat/completions", None, &ask(1)).await;
    assert_eq!(
        (st, e["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let guest = s.call("a", "bad", "/ask").await.text().await.unwrap();
    assert!(guest.contains("ModelNotFound"), "{guest}");
    let models = s.get_json(&a, "/v1/models").await;
    assert_eq!(models["data"], json!([]));
}

/// Requests routed to pools 0 and 1.
async fn pools(s: &TestServer) -> [f64; 2] {
    [
        s.metric(&["kiln_pool_requests_total{", "pool=\"0\""]).await,
        s.metric(&["kiln_pool_requests_total{", "pool=\"1\""]).await,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_requests_with_one_session_key_land_on_one_pool() {
    let s = TestServer::start_with_pools(2, |_| {}).await;
    for pool in ["pool=\"0\"", "pool=\"1\""] {
        let placed = ["kiln_pool_device{", pool, "device=\"cpu\""];
        assert_eq!(s.metric(&placed).await, 1.0, "{pool} is on the CPU");
    }
    let a = s.tenant("a").await;
    s.deploy(&a, "bad", "misbehave").await;
    // Ten through the API, ten through a function: the header is honoured
    // on both.
    for i in 0..20 {
        if i % 2 == 0 {
            let (st, v) = s
                .openai(&a, "/v1/chat/completions", Some("session-1"), &ask(1))
                .await;
            assert_eq!(st, 200, "{v}");
        } else {
            let resp = s
                .http
                .get(format!("{}/fn/a/bad/ask", s.url))
                .header("x-session-affinity", "session-1")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
        }
    }
    let counts = pools(&s).await;
    counts
        .iter()
        .for_each(|c| assert!(*c == 0.0 || *c == 20.0, "{counts:?}"));
    assert_eq!(s.metric(&["kiln_pool_spills_total"]).await, 0.0);
    // Different sessions spread over both pools.
    for k in 0..12 {
        let key = format!("other-{k}");
        s.openai(&a, "/v1/chat/completions", Some(&key), &ask(1))
            .await;
    }
    let after = pools(&s).await;
    assert!(
        after[0] > counts[0] && after[1] > counts[1],
        "12 sessions all went to one pool: {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_flooding_model_calls_cannot_starve_another_tenants_request() {
    // Fairness is under test, not speed: on a slow, shared CI machine the
    // flood may take longer than the default 30 s wall limit.
    let s = TestServer::start_with_pools(1, |c| {
        c.limits.wall_time = Duration::from_secs(180);
    })
    .await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    s.deploy(&a, "chat", "chat").await;
    let flood: Vec<_> = (0..16)
        .map(|i| {
            let (http, url) = (s.http.clone(), format!("{}/fn/a/chat/", s.url));
            tokio::spawn(async move {
                let body = json!({
                    "messages": [{"role": "user", "content": format!("Tell story number {i}.")}],
                    "max_tokens": 24,
                    "temperature": 0,
                });
                let resp = http.post(url).json(&body).send().await.unwrap();
                (resp.status().as_u16(), resp.text().await.unwrap())
            })
        })
        .collect();
    let served = s.models.clone().unwrap();
    let start = Instant::now();
    while served.snapshot(DEFAULT_MODEL).unwrap().requests < 8 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the flood never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, v) = s.openai(&b, "/v1/chat/completions", None, &ask(8)).await;
    assert_eq!(st, 200, "{v}");
    let left = served.snapshot(DEFAULT_MODEL).unwrap().requests;
    assert!(
        left > 0,
        "tenant b's request waited for the whole flood to finish"
    );
    let mut results = Vec::new();
    for f in flood {
        results.push(f.await.unwrap());
    }
    for (status, body) in results {
        assert_eq!(status, 200, "{body}");
        assert!(
            body.ends_with("data: [DONE]\n\n"),
            "{}",
            &body[body.len().saturating_sub(400)..]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_session_key_a_request_goes_to_the_pool_holding_its_prefix() {
    let s = TestServer::start_with_pools(2, |_| {}).await;
    let a = s.tenant("a").await;
    let long = "Kiln keeps every tenant's cache apart. ".repeat(16);
    let body = json!({
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": long}],
        "max_tokens": 1,
        "temperature": 0,
    });
    let (st, first) = s.openai(&a, "/v1/chat/completions", None, &body).await;
    assert_eq!(st, 200, "{first}");
    for _ in 0..3 {
        let (_, again) = s.openai(&a, "/v1/chat/completions", None, &body).await;
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached > 0,
            "the repeat went to the pool without its prefix: {again}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_its_client_leaves_pays_the_prompt_the_model_counted() {
    use futures::StreamExt;
    let s = TestServer::start_with_models().await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    // The same prompt run whole: what the model counts (the chat
    // template's ~30 tokens, against an estimate of 11).
    let (st, whole) = s.openai(&b, "/v1/chat/completions", None, &ask(1)).await;
    assert_eq!(st, 200, "{whole}");
    let prompt = whole["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut body = ask(200);
    body["stream"] = json!(true);
    let resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth(&a)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut chunks = resp.bytes_stream();
    assert!(chunks.next().await.is_some());
    drop(chunks);
    let deadline = Instant::now() + Duration::from_secs(20);
    let usage = loop {
        let u = s.get_json(&a, "/v1/usage").await;
        if u["usage"]["calls_in_flight"] == 0 || Instant::now() > deadline {
            break u;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(usage["usage"]["calls_in_flight"], 0, "{usage}");
    let model = (usage["usage"]["models"].as_array().unwrap().iter())
        .find(|m| m["model"] == DEFAULT_MODEL)
        .cloned()
        .unwrap();
    assert_eq!(model["prompt_tokens"], prompt, "{usage}");
}
