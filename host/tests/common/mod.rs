//! Helpers of the tests that run `kiln serve` as a process.

#![allow(dead_code, reason = "each test binary uses its own part")]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The admin token the servers run with.
pub const ADMIN: &str = "process-test-admin";

/// One HTTP/1.1 exchange on a fresh connection; the status and body, or
/// `None` if the server did not answer (it was killed, say).
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    token: &str,
    body: &[u8],
) -> Option<(u16, String)> {
    let auth = format!("Bearer {token}");
    exchange(port, method, path, &[("authorization", &auth)], body).map(|a| (a.status, a.body))
}

/// An answer read off the wire.
pub struct Answer {
    /// Its status code.
    pub status: u16,
    /// Its header lines, as sent.
    pub head: String,
    /// Its body (still chunked, when it came so).
    pub body: String,
}

impl Answer {
    /// The value of header `name` (any case), if it came.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// One HTTP/1.1 exchange on a fresh connection with `headers`; the answer,
/// or `None` if nothing came back.
pub fn exchange(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<Answer> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: x\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!(
        "content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    ));
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    Some(Answer {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    })
}

/// `component` with a custom section carrying `tag`: the same function,
/// another digest.
pub fn variant(component: &[u8], tag: u8) -> Vec<u8> {
    let name = b"kiln-crash-test";
    let payload_len = 1 + name.len() + 1;
    let mut out = component.to_vec();
    out.push(0); // custom section
    out.push(payload_len as u8);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.push(tag);
    out
}

/// Starts `kiln serve` on `dir` and `port` with `args`, its log appended
/// to `dir/server.log`; returns once it answers.
pub fn serve(dir: &std::path::Path, port: u16, args: &[&str]) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .arg("--data-dir")
        .arg(dir)
        .env("KILN_ADMIN_TOKEN", ADMIN)
        .stdout(Stdio::null())
        .stderr(log(dir))
        .spawn()
        .expect("spawning kiln serve");
    let deadline = Instant::now() + Duration::from_secs(120);
    while http(port, "GET", "/healthz", "", b"").is_none() {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

fn log(dir: &std::path::Path) -> std::fs::File {
    std::fs::create_dir_all(dir).expect("data dir");
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .expect("server log")
}

/// Creates tenant `name`; its API key.
pub fn tenant(port: u16, name: &str) -> String {
    let body = format!(r#"{{"name": "{name}"}}"#);
    let (status, answer) = http(port, "POST", "/v1/tenants", ADMIN, body.as_bytes()).unwrap();
    assert_eq!(status, 201, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    v["api_key"].as_str().unwrap().to_owned()
}

/// A port nothing listens on.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}
