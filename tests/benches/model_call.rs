//! The overhead of calling a model from a guest against making the same
//! call on the OpenAI-style API, both through the router in process, with
//! a backend that answers at once (so only Kiln's own cost is measured):
//! `POST /v1/chat/completions` against `GET /fn/acme/bad/ask` (a guest whose
//! handler makes one `kiln:ai` chat call).
//!
//! Prints p50/p99 of each over 5,000 interleaved calls and the difference
//! of the medians, then lets criterion measure both. Run with
//! `cargo bench -p kiln-tests --bench model_call`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http_body_util::{BodyExt, Full};
use kiln_runtime::{
    AiError, BoxFuture, Completion, FinishReason, Inference, ModelCall, ModelInfo, TokenStream,
    Usage,
};
use kiln_tests::TestServer;

/// Answers every call at once; streams nothing.
struct Instant0;

impl Inference for Instant0 {
    fn call(&self, _: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async {
            Ok(Completion {
                text: "hi".into(),
                finish_reason: FinishReason::Stop,
                usage: Usage {
                    prompt_tokens: 8,
                    completion_tokens: 1,
                    cached_prompt_tokens: 0,
                },
                tool_calls: Vec::new(),
                logprobs: Vec::new(),
            })
        })
    }
    fn stream(&self, c: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        kiln_runtime::NoModels.stream(c)
    }
    fn list_models(&self, _: &str) -> Vec<ModelInfo> {
        Vec::new()
    }
}

const BODY: &str = r#"{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}"#;

async fn api(app: &Arc<kiln_host::app::App>, key: &str) {
    let req = hyper::Request::post("http://bench/v1/chat/completions")
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .expect("request");
    let resp = kiln_host::api::handle(app.clone(), req).await;
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert!(body.starts_with(b"{"));
}

async fn guest(app: &Arc<kiln_host::app::App>) {
    let req = hyper::Request::get("http://bench/fn/acme/bad/ask")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = kiln_host::api::handle(app.clone(), req).await;
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"hi");
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (server, key) = rt.block_on(async {
        let s = TestServer::start_with_backend(Arc::new(Instant0)).await;
        let key = s.tenant("acme").await;
        s.deploy(&key, "bad", "misbehave").await;
        (s, key)
    });
    let app = server.app.clone();
    let (app2, key2) = (app.clone(), key.clone());
    let (mut a, mut g) = rt
        .block_on(rt.spawn(async move {
            for _ in 0..500 {
                api(&app2, &key2).await;
                guest(&app2).await;
            }
            let (mut a, mut g) = (Vec::new(), Vec::new());
            for _ in 0..5_000 {
                let t = Instant::now();
                api(&app2, &key2).await;
                a.push(t.elapsed());
                let t = Instant::now();
                guest(&app2).await;
                g.push(t.elapsed());
            }
            (a, g)
        }))
        .expect("bench task");
    a.sort();
    g.sort();
    let (pa, pg) = (percentile(&a, 0.5), percentile(&g, 0.5));
    eprintln!(
        "API chat: p50 {pa:?} p99 {:?} | guest chat: p50 {pg:?} p99 {:?} | guest overhead at p50: {:?}",
        percentile(&a, 0.99),
        percentile(&g, 0.99),
        pg.saturating_sub(pa)
    );
    let mut group = c.benchmark_group("model_call");
    group.bench_function("api_chat", |b| {
        b.iter_custom(|iters| {
            let (app, key) = (app.clone(), key.clone());
            rt.block_on(rt.spawn(async move {
                let t = Instant::now();
                for _ in 0..iters {
                    api(&app, &key).await;
                }
                t.elapsed()
            }))
            .expect("bench task")
        });
    });
    group.bench_function("guest_chat", |b| {
        b.iter_custom(|iters| {
            let app = app.clone();
            rt.block_on(rt.spawn(async move {
                let t = Instant::now();
                for _ in 0..iters {
                    guest(&app).await;
                }
                t.elapsed()
            }))
            .expect("bench task")
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
