//! A cluster's failures as production meets them: three `kiln serve`
//! processes on one PostgreSQL behind the shipped nginx config, under
//! steady traffic; one node dies by SIGKILL, then PostgreSQL restarts.
//! No request is lost, every tenant and deployment survives, a deploy made
//! after the restart reaches the live nodes, and the killed node, started
//! again as it was, serves every function at its latest version.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_tests::nginx::Nginx;
use kiln_tests::postgres::Postgres;

mod common;

use common::{ADMIN, Answer, exchange, free_port, http, serve, variant};

const TENANTS: usize = 3;
const FUNCTIONS: [&str; 2] = ["hello", "greet"];
const CLIENTS: usize = 6;

/// One call through the gateway: the phase it was made in, its status (or
/// `None`: nothing came back) and the node that served it.
type Record = (usize, Option<u16>, String);

/// Sends calls through nginx from `CLIENTS` threads until `stop`, each with
/// its own sessions over every tenant's functions, tagged with `phase`.
fn traffic(
    gateway: u16,
    stop: Arc<AtomicBool>,
    phase: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<Record>>>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|c| {
            let (stop, phase, log) = (stop.clone(), phase.clone(), log.clone());
            std::thread::spawn(move || {
                for i in 0usize.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let tenant = (c + i) % TENANTS;
                    let function = FUNCTIONS[i % FUNCTIONS.len()];
                    let session = format!("c{c}-s{}", i % 16);
                    let path = format!("/fn/t{tenant}/{function}/{i}");
                    let at = phase.load(Ordering::Relaxed);
                    let answer = exchange(
                        gateway,
                        "GET",
                        &path,
                        &[("x-session-affinity", &session)],
                        b"",
                    );
                    let served = answer
                        .as_ref()
                        .and_then(|a| a.header("x-kiln-node"))
                        .unwrap_or_default()
                        .to_owned();
                    let status = answer.as_ref().map(|a| a.status);
                    if let Some(Answer {
                        status: 200, body, ..
                    }) = &answer
                    {
                        assert!(body.contains(&format!("session: {session}")), "{body}");
                    }
                    log.lock().unwrap().push((at, status, served));
                }
            })
        })
        .collect()
}

/// Function `name`'s digest as node `port` reports it to tenant `key`.
fn digest(port: u16, key: &str, name: &str) -> Option<String> {
    let (status, body) = http(port, "GET", &format!("/v1/functions/{name}"), key, b"")?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["digest"].as_str().map(str::to_owned)
}

#[test]
fn a_node_killed_and_postgresql_restarted_under_traffic_lose_no_request_and_no_deployment() {
    let pg = Postgres::start();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let args = ["--no-models", "--database", pg.url.as_str()];
    let mut nodes: Vec<_> = (0..3)
        .map(|i| serve(dirs[i].path(), ports[i], &args))
        .collect();
    let nginx = Nginx::start(&ports);
    let gateway: u16 = nginx.url.rsplit(':').next().unwrap().parse().unwrap();

    // Tenants and their functions, made through the gateway.
    let hello = std::fs::read(kiln_tests::guest("hello")).unwrap();
    let keys: Vec<String> = (0..TENANTS)
        .map(|t| common::tenant(gateway, &format!("t{t}")))
        .collect();
    let mut first = String::new();
    for key in &keys {
        for f in FUNCTIONS {
            let (status, body) =
                http(gateway, "PUT", &format!("/v1/functions/{f}"), key, &hello).unwrap();
            assert_eq!(status, 201, "{body}");
            first = serde_json::from_str::<serde_json::Value>(&body).unwrap()["digest"]
                .as_str()
                .unwrap()
                .to_owned();
        }
    }
    std::thread::sleep(Duration::from_secs(1));

    let stop = Arc::new(AtomicBool::new(false));
    let phase = Arc::new(AtomicUsize::new(0));
    let log = Arc::new(Mutex::new(Vec::new()));
    let clients = traffic(gateway, stop.clone(), phase.clone(), log.clone());
    std::thread::sleep(Duration::from_secs(1));

    // Phase 1: the node that served most calls so far dies without warning.
    let mut served: HashMap<String, usize> = HashMap::new();
    for (_, _, node) in log.lock().unwrap().iter() {
        *served.entry(node.clone()).or_default() += 1;
    }
    let busiest = served.iter().max_by_key(|(_, n)| **n).unwrap().0.clone();
    let dead = ports
        .iter()
        .position(|p| busiest.ends_with(&format!(":{p}")))
        .unwrap_or_else(|| panic!("{busiest} is none of {ports:?}"));
    phase.store(1, Ordering::Relaxed);
    nodes[dead].kill().unwrap(); // SIGKILL
    nodes[dead].wait().unwrap();
    std::thread::sleep(Duration::from_secs(2));

    // Phase 2: PostgreSQL restarts, dropping every node's connections.
    phase.store(2, Ordering::Relaxed);
    pg.restart();

    // Phase 3: a deploy on one live node as soon as PostgreSQL is back
    // answers 201 and reaches the other live node within a second.
    phase.store(3, Ordering::Relaxed);
    let live: Vec<usize> = (0..3).filter(|&i| i != dead).collect();
    let new = variant(&hello, 1);
    let (status, body) = http(ports[live[0]], "PUT", "/v1/functions/hello", &keys[0], &new)
        .expect("a live node answers");
    assert_eq!(status, 201, "{body}");
    let latest: serde_json::Value = serde_json::from_str(&body).unwrap();
    let latest = latest["digest"].as_str().unwrap().to_owned();
    let acked = Instant::now();
    while digest(ports[live[1]], &keys[0], "hello").as_ref() != Some(&latest) {
        assert!(
            acked.elapsed() < Duration::from_secs(1),
            "the deploy has not reached node {} a second after its 201",
            ports[live[1]]
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }

    // No call was lost in any phase, and the dead node served none after
    // its death was noticed.
    let log = log.lock().unwrap();
    let per_phase = |p: usize| log.iter().filter(|r| r.0 == p).count();
    for p in 0..4 {
        assert!(per_phase(p) >= 10, "phase {p}: only {} calls", per_phase(p));
    }
    let failed: Vec<&Record> = log.iter().filter(|r| r.1 != Some(200)).collect();
    assert!(
        failed.is_empty(),
        "{} of {} calls failed: {:?}",
        failed.len(),
        log.len(),
        &failed[..failed.len().min(20)]
    );
    let dead_name = format!(":{}", ports[dead]);
    assert!(
        log.iter()
            .filter(|r| r.0 >= 2)
            .all(|r| !r.2.ends_with(&dead_name)),
        "a call after the kill was served by the dead node"
    );

    // The killed node, started again as it was, serves every function at
    // its latest version; every node holds every tenant and deployment.
    nodes[dead] = serve(dirs[dead].path(), ports[dead], &args);
    for &port in &ports {
        for (t, key) in keys.iter().enumerate() {
            for f in FUNCTIONS {
                let want = if (t, f) == (0, "hello") {
                    latest.clone()
                } else {
                    first.clone()
                };
                assert_eq!(digest(port, key, f), Some(want), "node {port}: t{t}/{f}");
                let (status, body) = http(port, "GET", &format!("/fn/t{t}/{f}/"), "", b"")
                    .expect("the node answers");
                assert_eq!(status, 200, "node {port}: t{t}/{f}: {body}");
            }
        }
        let (status, _) = http(port, "POST", "/v1/tenants", ADMIN, br#"{"name": "t0"}"#).unwrap();
        assert_eq!(status, 409, "node {port} does not know tenant t0");
    }
    for mut n in nodes {
        let _ = n.kill();
        let _ = n.wait();
    }
}
