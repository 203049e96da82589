//! Each request's limits, end to end: guest CPU time (and what is not
//! billed as such), linear memory, wall time, traps, outbound HTTP, and a
//! tenant's deploys in flight.

use std::time::{Duration, Instant};

use kiln_tests::{TestServer, error_of, guest};
use tokio::io::AsyncWriteExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infinite_loop_is_stopped_by_cpu_limit_while_others_succeed() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    s.deploy(&key, "hello", "hello").await;

    let looping = s.call("acme", "bad", "/loop");
    let others = futures::future::join_all((0..20).map(|_| s.call("acme", "hello", "/")));
    let (looping, others) = tokio::join!(looping, others);
    for r in others {
        assert_eq!(r.status(), 200);
    }
    let (status, kind, msg) = error_of(looping).await;
    assert_eq!(status, 504);
    assert_eq!(kind, "cpu_time_limit_exceeded");
    assert!(msg.contains("CPU time limit"), "{msg}");
    // The server keeps serving.
    assert_eq!(s.call("acme", "bad", "/").await.status(), 200);

    let metrics = s
        .http
        .get(format!("{}/metrics", s.url))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    let text = metrics.text().await.unwrap();
    assert!(
        text.contains(r#"kiln_limit_violations_total{kind="cpu_time"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"kiln_function_requests_total{tenant="acme",function="bad",status="504"} 1"#
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unbounded_memory_growth_is_stopped_by_the_memory_limit() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let (status, kind, msg) = error_of(s.call("acme", "bad", "/grow").await).await;
    assert_eq!(
        (status, kind.as_str()),
        (500, "memory_limit_exceeded"),
        "{msg}"
    );
    assert!(msg.contains("128 MiB"), "{msg}");
    assert_eq!(s.call("acme", "bad", "/").await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_failing_after_it_finished_its_body_sends_the_body_whole() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    for _ in 0..5 {
        let resp = s.call("acme", "bad", "/late-trap").await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.text().await.expect("a whole body"), "ok");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_call_copying_in_more_than_its_bound_traps_before_the_host_holds_it() {
    // CPU enough to build the messages.
    let s = TestServer::start_with(|c| c.limits.cpu_time = Duration::from_secs(5)).await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    // Half a million empty messages are ~16 MB in the guest and ~40 MB as
    // the host's messages: refused while being copied in.
    let (status, kind, msg) = error_of(s.call("acme", "bad", "/manymessages").await).await;
    assert_eq!((status, kind.as_str()), (500, "guest_trap"), "{msg}");
    assert!(msg.contains("too much data"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trap_and_wall_limit_are_reported_and_outbound_http_is_denied() {
    let s =
        TestServer::start_with(|c| c.limits.wall_time = std::time::Duration::from_secs(1)).await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;

    let (status, kind, msg) = error_of(s.call("acme", "bad", "/trap").await).await;
    assert_eq!((status, kind.as_str()), (500, "guest_trap"));
    assert!(msg.contains("unreachable"), "{msg}");

    let (status, kind, _) = error_of(s.call("acme", "bad", "/sleep").await).await;
    assert_eq!((status, kind.as_str()), (504, "wall_time_limit_exceeded"));

    let text = s.call("acme", "bad", "/fetch").await.text().await.unwrap();
    assert!(text.contains("HttpRequestDenied"), "{text}");

    let text = s.call("acme", "bad", "/ai").await.text().await.unwrap();
    assert!(
        text.contains("ModelNotFound") && text.contains("serves no models"),
        "{text}"
    );
}

/// The limit that stops misbehave's `path` under `wall` and `cpu`.
async fn stopped_by(path: &str, wall: Duration, cpu: Duration) -> String {
    let s = TestServer::start_with(|c| {
        c.limits.wall_time = wall;
        c.limits.cpu_time = cpu;
    })
    .await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let (status, kind, msg) = error_of(s.call("acme", "bad", path).await).await;
    assert_eq!(status, 504, "{msg}");
    kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_whose_host_calls_never_wait_is_stopped_at_its_wall_time() {
    // `/hog` calls a model in a loop, each call answered at once: the wall
    // time must end it, though its calls never wait.
    let kind = stopped_by("/hog", Duration::from_secs(1), Duration::from_secs(5)).await;
    assert_eq!(kind, "wall_time_limit_exceeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_work_done_for_a_guest_counts_against_its_cpu_time() {
    // Its loop is nearly all the host's work (random bytes): the guest's
    // to pay, so its CPU time ends it, not the wall time.
    let kind = stopped_by(
        "/random",
        Duration::from_secs(10),
        Duration::from_millis(50),
    )
    .await;
    assert_eq!(kind, "cpu_time_limit_exceeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_model_calls_preparation_is_the_guests_cpu_time() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    // Templating and tokenizing 2 MB takes the host far more than the
    // guest's 50 ms, and the model refuses the prompt: that work was for
    // nothing the model does, so the guest pays for it (or a loop of such
    // calls would spin the host's CPU for free).
    let resp = s.call("acme", "bad", "/longask").await;
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("cpu_time_limit_exceeded"), "{text}");
}

/// A deploy of `name` whose upload never ends: its headers and the
/// component's first bytes, on a connection the caller holds.
async fn unfinished_deploy(s: &TestServer, key: &str, name: &str) -> tokio::net::TcpStream {
    let addr = s.url.trim_start_matches("http://");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "PUT /v1/functions/{name} HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer {key}\r\n\
         Content-Length: 1000000\r\n\r\n\0asm"
    );
    c.write_all(head.as_bytes()).await.unwrap();
    c
}

/// Waits until tenant `a` of `s` has `n` deploys in flight.
async fn deploys_reach(s: &TestServer, n: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.app.deploys_in_flight("a") != n {
        assert!(
            Instant::now() < deadline,
            "tenant a never had {n} deploys in flight"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_has_two_deploys_in_flight_at_most_while_others_deploy() {
    let s = TestServer::start_with(|c| c.deploy_wait = Duration::from_secs(2)).await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    let hello = || std::fs::read(guest("hello")).unwrap();
    let held = [
        unfinished_deploy(&s, &a, "one").await,
        unfinished_deploy(&s, &a, "two").await,
    ];
    deploys_reach(&s, 2).await;
    // Refused before its body is read, so the body need not be valid.
    let third = s.put(&a, "three", b"\0asm".to_vec()).await;
    let (status, _, msg) = error_of(third).await;
    assert_eq!(status, 429);
    assert!(msg.contains("2 deploys in flight"), "{msg}");
    assert_eq!(s.put(&b, "three", hello()).await.status(), 201);
    // A deploy waiting its turn takes the slot of a client that leaves
    // mid-upload.
    let waiting = s.put(&a, "three", hello());
    let leave = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
    };
    let (waited, ()) = tokio::join!(waiting, leave);
    assert_eq!(waited.status(), 201);
    deploys_reach(&s, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_functions_first_load_takes_one_of_its_tenants_deploy_slots() {
    let s = TestServer::start().await;
    let a = s.tenant("a").await;
    s.deploy(&a, "greet", "hello").await;
    // After a restart the function's component loads on its first call.
    let s = s
        .restart_with(|c| c.deploy_wait = Duration::from_millis(500))
        .await;
    let held = [
        unfinished_deploy(&s, &a, "one").await,
        unfinished_deploy(&s, &a, "two").await,
    ];
    deploys_reach(&s, 2).await;
    let (status, _, msg) = error_of(s.call("a", "greet", "/").await).await;
    assert_eq!(status, 429);
    assert!(msg.contains("first loads"), "{msg}");
    drop(held);
    deploys_reach(&s, 0).await;
    assert_eq!(s.call("a", "greet", "/").await.status(), 200);
}

/// Starts the process's peak resident memory again from what it holds now.
fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

/// The process's peak resident memory, bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_cannot_hoard_host_memory_in_bodies_it_never_sends() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    reset_peak_rss();
    let before = peak_rss();
    let resp = s.call("acme", "bad", "/bodies").await;
    let status = resp.status();
    let text = resp.text().await.unwrap();
    let grown = peak_rss().saturating_sub(before);
    // Unbounded, its 2048 bodies would hold 2 MiB each (4 GiB); bounded,
    // the resource table fills first (about 43 MiB of bodies), which traps
    // the guest. The margin is for the other tests of this binary.
    assert!(
        grown < 512 << 20,
        "peak memory grew {} MiB: {status} {text}",
        grown >> 20
    );
    assert_ne!(status, 200, "{text}");
    assert_eq!(s.call("acme", "bad", "/").await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_cannot_park_a_megabyte_authority_or_method_in_host_memory() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let resp = s.call("acme", "bad", "/authority").await;
    assert_eq!(resp.status(), 200);
    // The long ones are refused as malformed ones would be; the request
    // keeps the short ones.
    assert_eq!(
        resp.text().await.unwrap(),
        "short true, long false, kept 15; method true, huge false, kept 5"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_body_cut_by_a_limit_ends_in_an_error_not_as_a_whole_one() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let resp = s.call("acme", "bad", "/partial").await;
    assert_eq!(resp.status(), 200, "the head went out before the spin");
    let body = resp.bytes().await;
    assert!(body.is_err(), "a cut body read as whole: {body:?}");
    assert_eq!(s.call("acme", "bad", "/").await.status(), 200);
}
