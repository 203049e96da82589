//! No tenant, client or fault takes the server down: engines restart after a
//! panic, and metrics are for the operator; slow clients time out and
//! connections are capped (`connections`); instances are capped per tenant
//! and components that fail to load are the server's fault (`instances`).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kiln_host::engine::{EngineConfig, Fault, SchedulerConfig};
use kiln_host::metrics::Metrics;
use kiln_host::model::DEFAULT_MODEL;
use kiln_host::serving::ServedModels;
use kiln_kernels::kv::KvFormat;
use kiln_runtime::{AiError, Inference};
use kiln_tests::{PROMPTS, TestServer, default_model, error_of, turns_beside};
use serde_json::json;

#[path = "shared/pools.rs"]
mod pools;
use pools::{chat, pool_count};

#[path = "reliability/connections.rs"]
mod connections;
#[path = "reliability/instances.rs"]
mod instances;

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
async fn preemptions_are_counted_by_pool_and_every_preempted_call_completes() {
    // Twelve pages of 16 tokens for six chats of up to 40 tokens: the pool
    // must take pages back to finish them.
    let page =
        kiln_host::model::KvCache::page_bytes(&default_model().model.config, KvFormat::Fp8, 16);
    let config = EngineConfig {
        kv_format: KvFormat::Fp8,
        kv_memory: 12 * page,
        ..Default::default()
    };
    let metrics = Metrics::default();
    let served =
        ServedModels::start(vec![(default_model(), config)], 1, metrics.engine.clone()).unwrap();
    let calls = PROMPTS[..6].iter().map(|p| served.call(chat(p, 40)));
    for done in futures::future::join_all(calls).await {
        let done = done.expect("a preempted call completes");
        assert!(done.usage.completion_tokens > 0, "{done:?}");
    }
    let preempted = pool_count(&metrics.engine.preemptions, 0);
    assert!(preempted > 0, "the pool was meant to force preemption");
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
