//! SIGKILL in the middle of concurrent deploys and deletes: after a restart
//! every acknowledged function answers, every deleted one is gone, and the
//! component files match the database's rows exactly.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::{http, serve, variant};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Deploy,
    Delete,
}

/// Writers at once, and how many of them run a short script and stop.
const WRITERS: usize = 100;
const SCRIPTED: usize = 24;

/// A writer's operations in order, each with the status it got, if any.
type Log = Arc<Mutex<Vec<(Op, Option<u16>)>>>;

#[test]
fn sigkill_amid_deploys_and_deletes_keeps_every_acknowledged_change_and_no_orphan() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let mut server = serve(dir.path(), port, &["--no-models"]);
    let hello = std::fs::read(kiln_tests::guest("hello")).unwrap();
    let variants: Arc<Vec<Vec<u8>>> = Arc::new((0..3).map(|t| variant(&hello, t)).collect());
    let keys: Vec<String> = (0..3)
        .map(|t| common::tenant(port, &format!("t{t}")))
        .collect();
    // Compiled once up front (kept as functions of their own): the writers
    // then race on files and rows, not on the compiler.
    for (i, bytes) in variants.iter().enumerate() {
        let (status, answer) = http(
            port,
            "PUT",
            &format!("/v1/functions/warm{i}"),
            &keys[0],
            bytes,
        )
        .expect("the server answers");
        assert_eq!(status, 201, "{answer}");
    }
    // 100 writers at once, each the only one to change its own function, so its
    // operations have an order; the digests are shared across tenants.
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicUsize::new(0));
    let logs: Vec<Log> = (0..WRITERS).map(|_| Log::default()).collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (stop, acked, log) = (stop.clone(), acked.clone(), logs[w].clone());
            let (variants, key) = (variants.clone(), keys[w % 3].clone());
            std::thread::spawn(move || {
                let path = format!("/v1/functions/f{w}");
                // The first SCRIPTED run a short script and stop (a settled
                // state to check); the rest run until the server dies.
                let script: &[Op] = match w {
                    0..SCRIPTED if w % 2 == 0 => &[Op::Deploy, Op::Deploy, Op::Delete, Op::Deploy],
                    0..SCRIPTED => &[Op::Deploy, Op::Delete],
                    _ => &[],
                };
                for k in 0.. {
                    if stop.load(Ordering::Relaxed) || (!script.is_empty() && k == script.len()) {
                        break;
                    }
                    let op = match script.get(k) {
                        Some(op) => *op,
                        None if k % 3 == 2 => Op::Delete,
                        None => Op::Deploy,
                    };
                    log.lock().unwrap().push((op, None));
                    let answer = match op {
                        Op::Deploy => {
                            let bytes = &variants[(w + k) % 3];
                            http(port, "PUT", &path, &key, bytes)
                        }
                        Op::Delete => http(port, "DELETE", &path, &key, b""),
                    };
                    let Some((status, _)) = answer else { break };
                    log.lock().unwrap().last_mut().unwrap().1 = Some(status);
                    acked.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let scripted: usize = (0..SCRIPTED).map(|w| if w % 2 == 0 { 4 } else { 2 }).sum();
    let settled = || {
        logs[..SCRIPTED]
            .iter()
            .map(|l| {
                l.lock()
                    .unwrap()
                    .iter()
                    .filter(|(_, s)| s.is_some())
                    .count()
            })
            .sum::<usize>()
    };
    while acked.load(Ordering::Relaxed) < 2 * WRITERS || settled() < scripted {
        assert!(
            Instant::now() < deadline,
            "the writers made no progress: {} acked; {:?}; log:\n{}",
            acked.load(Ordering::Relaxed),
            logs.iter()
                .map(|l| l.lock().unwrap().clone())
                .collect::<Vec<_>>(),
            std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    server.kill().unwrap(); // SIGKILL
    server.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }

    let mut server = serve(dir.path(), port, &["--no-models"]);
    let (mut present, mut absent) = (0, 0);
    for (w, log) in logs.iter().enumerate() {
        let log = log.lock().unwrap();
        let Some(last) = log.iter().rposition(|(_, s)| s.is_some()) else {
            continue;
        };
        let (op, status) = log[last];
        let status = status.unwrap();
        // An operation sent but unanswered may or may not have happened.
        let pending = log.get(last + 1).map(|(op, _)| *op);
        let path = format!("/fn/t{}/f{w}/", w % 3);
        let (now, body) = http(port, "GET", &path, "", b"").unwrap();
        match op {
            Op::Deploy if pending != Some(Op::Delete) => {
                assert_eq!(status, 201, "writer {w}'s deploy");
                assert_eq!(now, 200, "acknowledged f{w} of t{} is lost: {body}", w % 3);
                present += 1;
            }
            Op::Delete if pending != Some(Op::Deploy) && status == 204 => {
                assert_eq!(now, 404, "deleted f{w} of t{} is back: {body}", w % 3);
                absent += 1;
            }
            _ => {}
        }
    }
    assert!(
        present + absent >= 10,
        "too few functions settled: {present} + {absent}"
    );

    // Every row's file is there, and every file belongs to a row.
    let db = kiln_host::db::Db::open(&dir.path().join("kiln.db")).unwrap();
    let digests = db.digests().unwrap();
    let mut files: Vec<String> = std::fs::read_dir(dir.path().join("components"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let mut expected: Vec<String> = digests.iter().map(|d| format!("{d}.wasm")).collect();
    expected.sort();
    assert_eq!(files, expected);
    server.kill().unwrap();
    server.wait().unwrap();
}
