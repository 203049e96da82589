//! Each request's limits, end to end: guest CPU time (and what is not
//! billed as such), linear memory, wall time, traps and outbound HTTP.

use kiln_tests::{TestServer, error_of};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_whose_host_calls_never_wait_is_stopped_at_its_wall_time() {
    let s = TestServer::start_with(|c| {
        c.limits.wall_time = std::time::Duration::from_secs(1);
        c.limits.cpu_time = std::time::Duration::from_secs(5);
    })
    .await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    // Its calls bill it microseconds each: the wall time must end it, long
    // before its CPU time would.
    let (status, kind, msg) = error_of(s.call("acme", "bad", "/hog").await).await;
    assert_eq!(
        (status, kind.as_str()),
        (504, "wall_time_limit_exceeded"),
        "{msg}"
    );
}
