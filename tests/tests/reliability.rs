//! No tenant, client or fault takes the server down: engines restart after a
//! panic, slow clients time out, connections and instances are capped, and
//! metrics are for the operator.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kiln_host::engine::{EngineConfig, Fault, SchedulerConfig};
use kiln_host::metrics::Metrics;
use kiln_host::model::DEFAULT_MODEL;
use kiln_host::serving::ServedModels;
use kiln_runtime::{AiError, Inference};
use kiln_tests::{TestServer, default_model, error_of, turns_beside};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "shared/pools.rs"]
mod pools;
use pools::{chat, pool_count};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_fails_the_step_it_hit_and_replays_requests_still_waiting() {
    // One sequence at a time: the second request waits, outside the step.
    let config = EngineConfig {
        kv_memory: 32 << 20,
        scheduler: SchedulerConfig {
            max_running: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let metrics = Metrics::default();
    let served = Arc::new(
        ServedModels::start(vec![(default_model(), config)], 1, metrics.engine.clone()).unwrap(),
    );
    let mut running = served
        .stream(chat("Count from 1 to 100.", 200))
        .await
        .unwrap();
    // Its first text has gone out, so it cannot be replayed.
    assert!(running.next().await.is_ok());
    // The call submits at once (its future only collects the answer), so
    // the pool gets it before the fault.
    let waiting = served.call(chat("Say hi.", 4));
    assert!(served.inject_panic(DEFAULT_MODEL, 0));
    let failed = loop {
        match running.next().await {
            Ok(kiln_runtime::StreamEvent::Delta(_)) => continue,
            other => break other,
        }
    };
    match failed {
        Err(AiError::Aborted(m)) => assert!(m.starts_with("engine_restarted"), "{m}"),
        other => panic!("the running request should fail with engine_restarted: {other:?}"),
    }
    let replayed = waiting
        .await
        .expect("the waiting request runs on the new engine");
    assert!(!replayed.text.is_empty());
    let after = served.call(chat("Say hi.", 4)).await;
    assert!(after.is_ok(), "{after:?}");
    let restarts = pool_count(&metrics.engine.engine_restarts, 0);
    let replays = pool_count(&metrics.engine.engine_replays, 0);
    assert_eq!(restarts, 1);
    assert_eq!(replays, 1, "the waiting request was replayed");
    assert_eq!(served.snapshot(DEFAULT_MODEL).unwrap().requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_in_one_pool_leaves_the_other_pools_streams_running() {
    let config = EngineConfig {
        kv_memory: 64 << 20,
        ..Default::default()
    };
    let metrics = Metrics::default();
    let served = Arc::new(
        ServedModels::start(vec![(default_model(), config)], 2, metrics.engine.clone()).unwrap(),
    );
    pools::one_pool_fails_alone(&served, &metrics).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_left_unread_is_ended_rather_than_piled_up() {
    let metrics = Metrics::default();
    let config = EngineConfig {
        kv_memory: 32 << 20,
        ..Default::default()
    };
    let served =
        ServedModels::start(vec![(default_model(), config)], 1, metrics.engine.clone()).unwrap();
    // Six entries a token (the token and its five likeliest): about 20
    // tokens may wait unread.
    served.set_max_unread(120);
    let mut call = chat("Count from 1 to 100.", 200);
    call.params.logprobs = Some(5);
    let mut stream = served.stream(call).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut deltas = 0;
    let end = loop {
        match stream.next().await {
            Ok(kiln_runtime::StreamEvent::Delta(_)) => deltas += 1,
            other => break other,
        }
    };
    match end {
        Err(AiError::Aborted(m)) => assert!(m.contains("unread"), "{m}"),
        other => panic!("the unread stream should be ended: {other:?} after {deltas} deltas"),
    }
    assert!(deltas <= 40, "{deltas} deltas piled up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_that_returns_an_error_fails_the_requests_in_it() {
    // Prefill in chunks of 8 tokens: the fault lands before the request's
    // first token, when it could still be replayed, but it was in the step.
    let config = EngineConfig {
        kv_memory: 32 << 20,
        scheduler: SchedulerConfig {
            max_running: 1,
            max_tokens_per_step: 8,
            ..Default::default()
        },
        ..Default::default()
    };
    let metrics = Metrics::default();
    let served =
        ServedModels::start(vec![(default_model(), config)], 1, metrics.engine.clone()).unwrap();
    let call = served.call(chat("Count from 1 to 100.", 8));
    assert!(served.inject_fault(DEFAULT_MODEL, 0, Fault::Error));
    match call.await {
        Err(AiError::Aborted(m)) => assert!(m.starts_with("engine_restarted"), "{m}"),
        other => panic!("the request in the failed step should fail: {other:?}"),
    }
    assert_eq!(pool_count(&metrics.engine.engine_restarts, 0), 1);
    assert_eq!(pool_count(&metrics.engine.engine_replays, 0), 0);
    let after = served.call(chat("Say hi.", 4)).await;
    assert!(after.is_ok(), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_is_a_500_engine_restarted_and_the_model_keeps_serving() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("a").await;
    let resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth(&key)
        .json(&json!({
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "Count from 1 to 100."}],
            "max_tokens": 200, "temperature": 0, "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\"content\"") {
        seen += &String::from_utf8_lossy(&body.next().await.unwrap().unwrap());
    }
    assert!(s.models.as_ref().unwrap().inject_panic(DEFAULT_MODEL, 0));
    while let Some(chunk) = body.next().await {
        seen += &String::from_utf8_lossy(&chunk.unwrap());
    }
    assert!(seen.contains("\"code\":\"engine_restarted\""), "{seen}");
    let ask = json!({
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
    });
    let (status, answer) = s.openai(&key, "/v1/chat/completions", None, &ask).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(s.metric(&["kiln_engine_restarts_total{"]).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_huge_prompt_is_prepared_off_the_worker_other_tasks_run_on() {
    let metrics = Metrics::default();
    let served = Arc::new(
        ServedModels::start(
            vec![(default_model(), EngineConfig::default())],
            1,
            metrics.engine.clone(),
        )
        .unwrap(),
    );
    // On the runtime's one worker: while the call templates and tokenizes
    // its megabytes (it is refused at once after), the other task runs only
    // if the worker was handed on.
    let (during, result) =
        turns_beside(async move { served.call(chat(&"word ".repeat(400_000), 4)).await }).await;
    assert!(
        during > 0,
        "no other task ran while the prompt was prepared"
    );
    match result {
        Err(AiError::InvalidInput(m)) => assert!(m.contains("the prompt has"), "{m}"),
        other => panic!("a prompt past the context should be refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_four_mebibytes_is_refused_before_it_is_tokenized() {
    let served = ServedModels::start(
        vec![(default_model(), EngineConfig::default())],
        1,
        Metrics::default().engine,
    )
    .unwrap();
    // A guest's call has no request body to bound it.
    let big = "word ".repeat(1 << 20);
    match served.call(chat(&big, 4)).await {
        Err(AiError::InvalidInput(m)) => assert!(m.contains("at most 4194304"), "{m}"),
        other => panic!("a 5 MiB prompt should be refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_functions_metric_series_go_with_it() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    let metrics = || async {
        let resp = s
            .http
            .get(format!("{}/metrics", s.url))
            .bearer_auth(&s.admin);
        resp.send().await.unwrap().text().await.unwrap()
    };
    for name in ["f-1", "f-2"] {
        s.deploy(&key, name, "misbehave").await;
        assert_eq!(s.call("acme", name, "/").await.status(), 200);
    }
    assert!(metrics().await.contains(r#"function="f-1""#));
    let del = s
        .http
        .delete(format!("{}/v1/functions/f-1", s.url))
        .bearer_auth(&key);
    assert_eq!(del.send().await.unwrap().status(), 204);
    let text = metrics().await;
    assert!(!text.contains(r#"function="f-1""#), "{text}");
    assert!(text.contains(r#"function="f-2",status="200""#), "{text}");
}

/// Reads from `stream` until the server closes it; what it sent.
async fn read_to_close(stream: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let _ = stream.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_time_out_and_connections_past_the_cap_get_503() {
    let s = TestServer::start_with(|c| {
        // Long enough that every slow connection is still held when the
        // one past the cap arrives, even on a busy machine.
        c.net.header_read_timeout = Duration::from_secs(5);
        c.net.max_connections = 8;
    })
    .await;
    let addr = s.url.trim_start_matches("http://").to_owned();
    let mut slow = Vec::new();
    for prefix in [&b"GET /healthz HT"[..], b"PRI * HTTP/2"] {
        for _ in 0..4 {
            let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
            c.write_all(prefix).await.unwrap();
            slow.push(c);
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut extra = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(5), read_to_close(&mut extra))
        .await
        .expect("the server answers at once");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("--max-connections"), "{refused}");
    // Every half-sent request is dropped within its header timeout.
    for mut c in slow {
        tokio::time::timeout(Duration::from_secs(15), read_to_close(&mut c))
            .await
            .expect("a stalled connection is closed by the server");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ok = s
        .http
        .get(format!("{}/healthz", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(s.metric(&["kiln_connections_refused_total"]).await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_with_nothing_in_flight_is_closed_and_a_busy_one_kept() {
    let s =
        TestServer::start_with(|c| c.net.header_read_timeout = Duration::from_millis(300)).await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    // A request that takes longer than the idle time is not cut.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let nap = h2
        .get(format!("{}/fn/acme/bad/nap", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(nap.version(), reqwest::Version::HTTP_2);
    assert_eq!(nap.text().await.unwrap(), "rested");
    // A client that opens HTTP/2 and sends no request is let go.
    let addr = s.url.trim_start_matches("http://").to_owned();
    let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), read_to_close(&mut c))
        .await
        .expect("an idle HTTP/2 connection is closed by the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_no_response_data_is_dropped_after_the_stall_time() {
    let s =
        TestServer::start_with(|c| c.net.write_stall_timeout = Duration::from_millis(500)).await;
    let addr = s.url.trim_start_matches("http://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // HTTP/2 with a window of nothing: the response's head comes, its
    // body never can.
    let (mut send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(0)
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = hyper::Request::get(format!("{}/healthz", s.url))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    // In flight, so never idle: only the stall time lets it go.
    let ended = tokio::time::timeout(Duration::from_secs(8), conn).await;
    assert!(ended.is_ok(), "the stalled connection was kept");
    drop(resp);
}

/// Opens a connection that sends a model call's head and the first bytes
/// of its 1000-byte body with `key`, then stalls.
async fn stalled_call(addr: &str, key: &str) -> tokio::net::TcpStream {
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\": "
    );
    c.write_all(head.as_bytes()).await.unwrap();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_request_bodies_time_out_and_hold_only_their_tenants_slots() {
    let s = TestServer::start_with(|c| {
        c.net.body_read_timeout = Duration::from_secs(6);
        c.net.tenant_bodies = 2;
    })
    .await;
    let (a, b) = (s.tenant("a").await, s.tenant("b").await);
    let addr = s.url.trim_start_matches("http://").to_owned();
    let mut stalled = vec![stalled_call(&addr, &a).await, stalled_call(&addr, &a).await];
    tokio::time::sleep(Duration::from_millis(300)).await;
    let call = |key: &str| {
        s.http
            .post(format!("{}/v1/chat/completions", s.url))
            .bearer_auth(key)
            .json(&json!({"model": "none", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
    };
    // Another tenant's call is read at once (no model: 404).
    let other = call(&b).await.unwrap();
    assert_eq!(other.status(), 404);
    // a's third call waits for a slot, then is refused, naming the cap.
    let third = call(&a).await.unwrap();
    assert_eq!(third.status(), 429);
    let v: serde_json::Value = third.json().await.unwrap();
    assert_eq!(v["error"]["code"], "tenant_bodies_exceeded", "{v}");
    // The stalled bodies are cut at their deadline.
    for c in &mut stalled {
        let answer = tokio::time::timeout(Duration::from_secs(15), read_to_close(c))
            .await
            .expect("a stalled body is answered");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("--body-read-timeout-s"), "{answer}");
    }
    assert_eq!(
        call(&a).await.unwrap().status(),
        404,
        "a's slots are free again"
    );
}

/// A server of 8 instance slots, half of them a tenant's at most, and a
/// wall time of 3 s.
async fn small_pool() -> TestServer {
    TestServer::start_with(|c| {
        c.limits.max_instances = 8;
        c.limits.wall_time = Duration::from_secs(3);
        c.tenant_instance_share = 0.5;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_one_tenants_slow_function_leaves_other_tenants_answered() {
    let s = small_pool().await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    s.deploy(&a, "slow", "misbehave").await;
    s.deploy(&b, "hello", "hello").await;
    let flood: Vec<_> = (0..12)
        .map(|_| {
            let http = s.http.clone();
            let url = format!("{}/fn/a/slow/sleep", s.url);
            tokio::spawn(async move { http.get(url).send().await.unwrap() })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..5 {
        assert_eq!(s.call("b", "hello", "/").await.status(), 200);
    }
    let mut refused = 0;
    for r in flood {
        let r = r.await.unwrap();
        if r.status() == 429 {
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "tenant_instances_exceeded", "{v}");
            refused += 1;
        } else {
            assert_eq!(r.status(), 504, "the rest sleep into the wall-time limit");
        }
    }
    assert_eq!(
        refused, 8,
        "a holds 4 of 8 slots; its other 8 requests are refused"
    );
    // A policy override sets one tenant's cap (here to a single instance).
    let set = s.set_policy("a", json!({"max_instances": 1})).await;
    assert_eq!(set.status(), 200);
    let one = s.call("a", "slow", "/sleep");
    let two = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.call("a", "slow", "/sleep").await
    };
    let (one, two) = tokio::join!(one, two);
    assert_eq!((one.status().as_u16(), two.status().as_u16()), (504, 429));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_whose_clients_left_still_count_against_their_tenant() {
    let s = small_pool().await;
    let a = s.tenant("a").await;
    s.deploy(&a, "slow", "misbehave").await;
    // Four sleeping instances (a's cap) whose clients give up at once.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let left: Vec<_> = (0..4)
        .map(|_| http.get(format!("{}/fn/a/slow/sleep", s.url)).send())
        .collect();
    for r in futures::future::join_all(left).await {
        assert!(r.is_err(), "the client should have timed out: {r:?}");
    }
    // The instances sleep on into the wall-time limit, and hold a's slots.
    let r = s.call("a", "slow", "/sleep").await;
    assert_eq!(
        r.status(),
        429,
        "a fifth instance of a's while four still run"
    );
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "tenant_instances_exceeded", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_for_the_operator_and_a_tenant_reads_its_own_usage() {
    let s = TestServer::start_with(|c| c.metrics_token = Some("scrape-me".into())).await;
    let key = s.tenant("acme").await;
    let get = |token: Option<&str>| {
        let mut r = s.http.get(format!("{}/metrics", s.url));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    let (status, _, msg) = error_of(get(None).await.unwrap()).await;
    assert_eq!(status, 401);
    assert!(msg.contains("--metrics-token"), "{msg}");
    assert_eq!(get(Some(&key)).await.unwrap().status(), 401);
    assert_eq!(get(Some("scrape-me")).await.unwrap().status(), 200);
    assert_eq!(get(Some(&s.admin)).await.unwrap().status(), 200);
    let usage = s.get_json(&key, "/v1/usage").await;
    assert_eq!(usage["tenant"], "acme");
    assert_eq!(usage["usage"]["tokens_last_minute"], 0);
    let anon = s
        .http
        .get(format!("{}/v1/usage", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(anon.status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_body_over_the_limit_gets_413_declared_or_streamed() {
    let s = TestServer::start_with(|c| c.net.max_body_bytes = 1024).await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "echo", "misbehave").await;
    let url = format!("{}/fn/acme/echo/echo", s.url);
    let small = s
        .http
        .post(&url)
        .body(vec![b'x'; 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 200);
    assert_eq!(small.bytes().await.unwrap().len(), 1024);
    let declared = s
        .http
        .post(&url)
        .body(vec![b'x'; 4096])
        .send()
        .await
        .unwrap();
    assert_eq!(declared.status(), 413);
    let chunks = futures::stream::iter(
        (0..8).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'y'; 512]))),
    );
    let streamed = s
        .http
        .post(&url)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    let (status, kind, msg) = error_of(streamed).await;
    assert_eq!((status, kind.as_str()), (413, "payload_too_large"), "{msg}");
}

/// A server whose tenant `acme` deployed `hello`, restarted (after
/// `tweak`) with that component's file damaged and no compiled code left;
/// and the file's path and good bytes.
async fn acme_hello_damaged(
    tweak: impl FnOnce(&mut kiln_host::config::ServeConfig),
) -> (TestServer, (std::path::PathBuf, Vec<u8>)) {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    let row = s.deploy(&key, "hello", "hello").await;
    let digest = row["digest"]
        .as_str()
        .and_then(|d| d.strip_prefix("sha256:"))
        .unwrap();
    let file = s
        .data_dir()
        .join("components")
        .join(format!("{digest}.wasm"));
    let good = std::fs::read(&file).unwrap();
    std::fs::write(&file, b"not a component").unwrap();
    std::fs::remove_dir_all(s.data_dir().join("cache")).unwrap();
    (s.restart_with(tweak).await, (file, good))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployed_component_that_no_longer_loads_is_the_servers_500() {
    let (s, _) = acme_hello_damaged(|_| {}).await;
    for _ in 0..3 {
        let resp = s.call("acme", "hello", "/").await;
        assert_eq!(resp.status(), 500);
        let body = resp.text().await.unwrap();
        assert!(body.contains("redeploy"), "{body}");
    }
    // Tried once: each call does not compile it again.
    assert_eq!(s.metric(&["kiln_component_loads_total"]).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_component_that_failed_to_load_is_loaded_again_after_a_while() {
    let reload_after = Duration::from_secs(1);
    let (s, (file, good)) = acme_hello_damaged(|c| c.reload_after = reload_after).await;
    assert_eq!(s.call("acme", "hello", "/").await.status(), 500);
    // The failure passes (storage repaired): within `reload_after` the
    // error stands, after it the next call loads the component again.
    std::fs::write(&file, &good).unwrap();
    assert_eq!(s.call("acme", "hello", "/").await.status(), 500);
    tokio::time::sleep(reload_after).await;
    assert_eq!(s.call("acme", "hello", "/").await.status(), 200);
    assert_eq!(s.call("acme", "hello", "/").await.status(), 200);
    assert_eq!(s.metric(&["kiln_component_loads_total"]).await, 2.0);
}
