//! Clients that stall, flood or never read, and bodies past the limit: each
//! is cut off by its own timeout or cap, and the server stays up.

use std::time::Duration;

use kiln_tests::{TestServer, error_of};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
