//! One invocation of `examples/hello` through the router, in process (no
//! TCP): a fresh instance from the pooling allocator per request.
//!
//! Prints p50/p99 over 20,000 sequential calls, then lets criterion measure
//! the same call. Run with `cargo bench -p kiln-tests --bench invoke`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http_body_util::{BodyExt, Full};
use kiln_tests::TestServer;

async fn call(app: &std::sync::Arc<kiln_host::app::App>) {
    let req = hyper::Request::get("http://bench/fn/acme/hello/bench")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = kiln_host::api::handle(app.clone(), req).await;
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert!(body.starts_with(b"Hello"));
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
    let server = rt.block_on(async {
        let s = TestServer::start().await;
        let key = s.tenant("acme").await;
        s.deploy(&key, "hello", "hello").await;
        s
    });
    let app = server.app.clone();

    // Run the loop on a worker, as a server's connection task would be, so
    // the guest task spawned per request starts on the same thread.
    let app2 = app.clone();
    let samples = rt.block_on(rt.spawn(async move {
        let app = app2;
        for _ in 0..2_000 {
            call(&app).await;
        }
        let mut samples = Vec::with_capacity(20_000);
        for _ in 0..20_000 {
            let t = Instant::now();
            call(&app).await;
            samples.push(t.elapsed());
        }
        samples
    }));
    let mut samples = samples.expect("bench task");
    samples.sort();
    eprintln!(
        "hello via router: p50 {:?}  p99 {:?}  (n = {})",
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples.len()
    );

    c.bench_function("invoke_hello_in_process", |b| {
        // Time the whole batch inside one worker task (see above).
        b.iter_custom(|iters| {
            let app = app.clone();
            rt.block_on(rt.spawn(async move {
                let t = Instant::now();
                for _ in 0..iters {
                    call(&app).await;
                }
                t.elapsed()
            }))
            .expect("bench task")
        });
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
