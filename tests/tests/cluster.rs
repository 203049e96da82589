//! Several Kiln nodes behind nginx running the shipped
//! `deploy/nginx/kiln.conf`: a session stays on one node, each answer
//! names its node, streams pass through as they are produced, and a node
//! that goes down is routed around.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kiln_tests::TestServer;
use kiln_tests::nginx::Nginx;

fn port(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// GET hello through nginx with `session`; the serving node and status.
async fn hello(http: &reqwest::Client, nginx: &Nginx, session: &str) -> (String, u16) {
    let resp = http
        .get(format!("{}/fn/acme/hello/", nginx.url))
        .header("x-session-affinity", session)
        .send()
        .await
        .unwrap();
    let node = resp.headers()["x-kiln-node"].to_str().unwrap().to_owned();
    let status = resp.status().as_u16();
    let body = resp.text().await.unwrap();
    assert!(body.contains(&format!("session: {session}")), "{body}");
    (node, status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_keeps_sessions_on_a_node_streams_and_routes_around_a_dead_one() {
    let mut nodes = Vec::new();
    let mut keys = HashMap::new();
    for _ in 0..3 {
        let s = TestServer::start_with_models().await;
        let key = s.tenant("acme").await;
        s.deploy(&key, "hello", "hello").await;
        keys.insert(port(&s.url), key);
        nodes.push(s);
    }
    let ports: Vec<u16> = nodes.iter().map(|s| port(&s.url)).collect();
    let nginx = tokio::task::spawn_blocking(move || Nginx::start(&ports))
        .await
        .unwrap();
    let http = reqwest::Client::new();

    // Each session lands on one node, every time; sessions spread.
    let mut home = HashMap::new();
    for i in 0..24 {
        let session = format!("s-{i}");
        let (node, status) = hello(&http, &nginx, &session).await;
        assert_eq!(status, 200);
        for _ in 0..2 {
            assert_eq!(hello(&http, &nginx, &session).await.0, node, "{session}");
        }
        home.insert(session, node);
    }
    let used: HashSet<&String> = home.values().collect();
    assert!(used.len() >= 2, "24 sessions all on {used:?}");

    // A streamed chat passes through as it is generated, not at its end.
    let session = "s-0";
    let node_port = port(&home[session]);
    let resp = http
        .post(format!("{}/v1/chat/completions", nginx.url))
        .bearer_auth(&keys[&node_port])
        .header("x-session-affinity", session)
        .json(&serde_json::json!({
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
            "max_tokens": 32, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kiln-node"], home[session].as_str());
    let mut arrivals = Vec::new();
    let mut body = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        arrivals.push(Instant::now());
    }
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    // Each event in its own read, or nearly: buffering would gather them.
    let events = body.matches("data: ").count();
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(
        arrivals.len() * 2 >= events && spread >= Duration::from_millis(50),
        "{events} events in {} reads over {spread:?}: buffered?",
        arrivals.len()
    );

    // The node of session s-0 goes down: its sessions move, every request
    // still succeeds, and the other sessions stay where they were.
    let down = home["s-0"].clone();
    let i = nodes
        .iter()
        .position(|s| port(&s.url) == port(&down))
        .unwrap();
    nodes[i].stop().await;
    for (session, was) in &home {
        let (node, status) = hello(&http, &nginx, session).await;
        assert_eq!(status, 200, "{session}");
        assert_ne!(node, down, "{session} still on the stopped node");
        if *was != down {
            assert_eq!(&node, was, "{session} moved though its node is up");
        }
    }
}
