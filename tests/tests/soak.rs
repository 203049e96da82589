//! A bounded soak: a well-behaved tenant, a hostile one and one sending
//! random API calls and walking away from streams, all at once, for
//! `KILN_SOAK_SECS` (60 by default; the documented long run is 600).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kiln_host::model::DEFAULT_MODEL;
use kiln_tests::TestServer;
use serde_json::json;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// A cheap deterministic generator, so a failing run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[(self.next() % items.len() as u64) as usize]
    }
}

/// A chat request with random, often invalid, parameters.
fn random_request(rng: &mut Rng) -> serde_json::Value {
    let mut body = json!({
        "model": rng.pick(&[DEFAULT_MODEL, DEFAULT_MODEL, "nope"]),
        "messages": [{"role": rng.pick(&["user", "system", "robot"]),
                      "content": rng.pick(&["Hi", "é€😀 stop", "", "Count to five."])}],
    });
    let fields: [(&str, serde_json::Value); 7] = [
        ("max_tokens", json!(rng.pick(&[0, 1, 8, 24, 5000]))),
        ("temperature", json!(rng.pick(&[-1.0, 0.0, 0.7, 2.0, 9.0]))),
        ("top_p", json!(rng.pick(&[0.0, 0.5, 1.0, 1.5]))),
        ("top_k", json!(rng.pick(&[-1, 0, 1, 40]))),
        (
            "stop",
            json!(rng.pick(&[&["."][..], &["é", "😀"], &[""], &[" ", "\n", "a", "e"]])),
        ),
        ("stream", json!(rng.pick(&[true, false]))),
        ("seed", json!(rng.next() % 1000)),
    ];
    for (k, v) in fields {
        if rng.next().is_multiple_of(2) {
            body[k] = v;
        }
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_hostile_traffic_leaves_the_server_up_and_good_tenants_served() {
    let secs = std::env::var("KILN_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let s = Arc::new(
        TestServer::start_with_pools(1, |c| {
            c.limits.wall_time = Duration::from_secs(4);
            c.net.max_body_bytes = 8 << 20;
        })
        .await,
    );
    let good = s.tenant("good").await;
    let bad = s.tenant("bad").await;
    let chaos = s.tenant("chaos").await;
    s.deploy(&good, "hello", "hello").await;
    s.deploy(&bad, "bad", "misbehave").await;
    let until = Instant::now() + Duration::from_secs(secs);
    let stop = Arc::new(AtomicBool::new(false));
    let good_failures = Arc::new(AtomicU64::new(0));
    let good_ok = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();

    // The well-behaved tenant: its function, and small model calls.
    for model_calls in [false, true] {
        let (s, key, stop) = (s.clone(), good.clone(), stop.clone());
        let (failures, ok) = (good_failures.clone(), good_ok.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let status = if model_calls {
                    let ask = json!({"model": DEFAULT_MODEL, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Say hi."}]});
                    s.openai(&key, "/v1/chat/completions", None, &ask).await.0
                } else {
                    s.call("good", "hello", "/").await.status().as_u16()
                };
                if status == 200 {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    eprintln!("the good tenant got {status}");
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }
    // The hostile tenant: loops, memory bombs, sleepers and 4 MiB bodies.
    for (i, path) in ["/loop", "/grow", "/sleep", "/echo"]
        .into_iter()
        .enumerate()
    {
        let (s, stop) = (s.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let url = format!("{}/fn/bad/bad{path}", s.url);
            while !stop.load(Ordering::Relaxed) {
                let req = if path == "/echo" {
                    s.http.post(&url).body(vec![b'x'; 4 << 20])
                } else {
                    s.http.get(&url)
                };
                let _ = req.send().await.map(|r| r.status());
                tokio::time::sleep(Duration::from_millis(20 * i as u64)).await;
            }
        }));
    }
    // Random API calls; streams often dropped after their first chunk.
    for seed in [7u64, 1234567] {
        let (s, key, stop) = (s.clone(), chaos.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(seed);
            while !stop.load(Ordering::Relaxed) {
                let body = random_request(&mut rng);
                let sent = s
                    .http
                    .post(format!("{}/v1/chat/completions", s.url))
                    .bearer_auth(&key)
                    .json(&body)
                    .send()
                    .await;
                let Ok(resp) = sent else { continue };
                let status = resp.status().as_u16();
                if status == 504 {
                    // A call of 5000 tokens may outlast the model-call
                    // deadline under this load: the bound at work, said so.
                    let text = resp.text().await.unwrap_or_default();
                    assert!(text.contains("deadline_exceeded"), "504 for {body}: {text}");
                    continue;
                }
                assert!(
                    status < 500 || status == 503,
                    "{status} for {body}: {}",
                    resp.text().await.unwrap_or_default()
                );
                let mut chunks = resp.bytes_stream();
                if rng.next().is_multiple_of(2) {
                    let _ = chunks.next().await;
                    continue; // walk away mid-stream
                }
                while chunks.next().await.is_some() {}
            }
        }));
    }

    tokio::time::sleep(Duration::from_secs(secs.min(5))).await;
    let rss_start = rss_bytes();
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("a traffic task panicked");
    }
    let rss_end = rss_bytes();

    assert_eq!(
        good_failures.load(Ordering::Relaxed),
        0,
        "the good tenant saw failures"
    );
    assert!(
        good_ok.load(Ordering::Relaxed) >= secs,
        "the good tenant was barely served"
    );
    assert_eq!(s.call("good", "hello", "/").await.status(), 200);
    // Every request has left the engine and every page is back in the pool.
    let models = s.models.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let snap = models.snapshot(DEFAULT_MODEL).unwrap();
        if snap.requests == 0 && snap.free_pages == snap.total_pages {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pages or requests still held: {snap:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        rss_end < rss_start + (512 << 20),
        "resident memory grew from {} to {} MiB",
        rss_start >> 20,
        rss_end >> 20
    );
}
