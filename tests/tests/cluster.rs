//! A Kiln cluster on this machine: three nodes sharing a throwaway
//! PostgreSQL, behind nginx running the shipped `deploy/nginx/kiln.conf`.
//! What is made through the gateway reaches every node; a session stays
//! on one node and hits its prefix cache; streams pass through as they are
//! produced; a node stopped under traffic loses no request, its sessions
//! move, and it rejoins when it comes back.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kiln_tests::nginx::Nginx;
use kiln_tests::postgres::Postgres;
use kiln_tests::{ADMIN, TestServer};

fn addr(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

async fn node(db: &str, listen: Option<SocketAddr>) -> TestServer {
    let db = db.to_owned();
    TestServer::start_with_pools(1, move |c| {
        c.database = Some(db);
        if let Some(l) = listen {
            c.listen = l;
        }
    })
    .await
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
    assert!(
        status != 200 || body.contains(&format!("session: {session}")),
        "{body}"
    );
    (node, status)
}

/// A chat through nginx in `session`; the answer's JSON.
async fn chat(
    http: &reqwest::Client,
    nginx: &Nginx,
    key: &str,
    session: &str,
) -> serde_json::Value {
    let prompt =
        "Here is a long shared context about harbours, tides, ships and the sea. ".repeat(6);
    let resp = http
        .post(format!("{}/v1/chat/completions", nginx.url))
        .bearer_auth(key)
        .header("x-session-affinity", session)
        .json(&serde_json::json!({
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_behind_nginx_shares_state_keeps_sessions_and_survives_a_node() {
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(node(&pg.url, None).await);
    }
    let addrs: Vec<SocketAddr> = nodes.iter().map(|s| addr(&s.url)).collect();
    let ports: Vec<u16> = addrs.iter().map(SocketAddr::port).collect();
    let nginx = tokio::task::spawn_blocking(move || Nginx::start(&ports))
        .await
        .unwrap();
    let http = reqwest::Client::new();

    // A tenant and a function made through the gateway reach every node.
    let resp = http
        .post(format!("{}/v1/tenants", nginx.url))
        .bearer_auth(ADMIN)
        .json(&serde_json::json!({"name": "acme"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let key = resp.json::<serde_json::Value>().await.unwrap()["api_key"]
        .as_str()
        .unwrap()
        .to_owned();
    let bytes = std::fs::read(kiln_tests::guest("hello")).unwrap();
    let resp = http
        .put(format!("{}/v1/functions/hello", nginx.url))
        .bearer_auth(&key)
        .body(bytes)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    tokio::time::sleep(Duration::from_secs(1)).await;
    for n in &nodes {
        assert_eq!(
            n.call("acme", "hello", "/").await.status(),
            200,
            "{}",
            n.url
        );
    }

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

    // A session's second call hits its node's prefix cache.
    chat(&http, &nginx, &key, "s-1").await;
    let again = chat(&http, &nginx, &key, "s-1").await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.is_some_and(|c| c > 0), "{again}");

    // A streamed chat passes through as it is generated, not at its end.
    let resp = http
        .post(format!("{}/v1/chat/completions", nginx.url))
        .bearer_auth(&key)
        .header("x-session-affinity", "s-0")
        .json(&serde_json::json!({
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
            "max_tokens": 32, "temperature": 0, "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kiln-node"], home["s-0"].as_str());
    let mut arrivals = Vec::new();
    let mut body = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        arrivals.push(Instant::now());
    }
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let events = body.matches("data: ").count();
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(
        arrivals.len() * 2 >= events && spread >= Duration::from_millis(50),
        "{events} events in {} reads over {spread:?}: buffered?",
        arrivals.len()
    );

    // s-0's node stops while every session is being served: no request is
    // lost, its sessions move, the others stay where they were.
    let down = home["s-0"].clone();
    // A node's name is HOST:PORT.
    let port = down.rsplit(':').next().unwrap();
    let i = nodes
        .iter()
        .position(|s| s.url.ends_with(&format!(":{port}")))
        .unwrap();
    let sessions: Vec<String> = home.keys().cloned().collect();
    let traffic = {
        let (http, url) = (http.clone(), nginx.url.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for round in 0..4 {
                for s in &sessions {
                    let resp = http
                        .get(format!("{url}/fn/acme/hello/r{round}"))
                        .header("x-session-affinity", s)
                        .send()
                        .await
                        .unwrap();
                    statuses.push(resp.status().as_u16());
                }
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    nodes[i].stop().await;
    let statuses = traffic.await.unwrap();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    for (session, was) in &home {
        let (node, status) = hello(&http, &nginx, session).await;
        assert_eq!(status, 200, "{session}");
        assert_ne!(node, down, "{session} still on the stopped node");
        if *was != down {
            assert_eq!(&node, was, "{session} moved though its node is up");
        }
    }

    // The node comes back on its address and its sessions return to it
    // once nginx tries it again (fail_timeout).
    let back = node(&pg.url, Some(addrs[i])).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while hello(&http, &nginx, "s-0").await.0 != down {
        assert!(Instant::now() < deadline, "s-0 never returned to {down}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(back.call("acme", "hello", "/").await.status(), 200);
}
