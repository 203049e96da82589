//! SIGTERM with model streams in flight: the server drains, ends each
//! stream with its last token or a clean error event, stops its engines and
//! exits 0.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{serve, tenant};

/// Opens a streaming chat completion; returns the connection once the
/// first token has arrived.
fn open_stream(port: u16, key: &str) -> BufReader<TcpStream> {
    let body = r#"{"model": "smollm2-135m-instruct", "stream": true, "max_tokens": 4000,
        "messages": [{"role": "user", "content": "Write a very long story."}]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !line.contains("\"content\"") {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
    }
    r
}

#[test]
fn sigterm_with_streams_in_flight_ends_them_cleanly_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let server = serve(
        dir.path(),
        port,
        &["--drain-timeout-s", "1", "--kv-memory", "64MiB"],
    );
    let key = tenant(port, "acme");
    let mut streams: Vec<_> = (0..3).map(|_| open_stream(port, &key)).collect();
    // One client goes away before the signal.
    drop(streams.pop());
    let sent = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let start = Instant::now();
    for mut s in streams {
        let mut rest = String::new();
        s.read_to_string(&mut rest).unwrap();
        let ended = rest.contains("data: [DONE]") || rest.contains("shutting down");
        assert!(ended, "the stream was cut without a last event: {rest:?}");
        assert!(
            rest.ends_with("0\r\n\r\n"),
            "the chunked body was not closed: {rest:?}"
        );
    }
    let out = server.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "kiln exited with {:?}; log:\n{}",
        out.status,
        std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default()
    );
    assert!(start.elapsed() < Duration::from_secs(20));
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(log.contains("engine stopped"), "{log}");
}
