//! Instances: a tenant's cap on the shared pool, held for as long as its
//! instances run, and components that no longer load answered as the
//! server's fault.

use std::time::Duration;

use kiln_tests::TestServer;
use serde_json::json;

/// A server of 8 instance slots, half of them a tenant's at most, and a
/// wall time of 3 s.
async fn small_pool() -> TestServer {
    TestServer::start_with(|c| {
        c.limits.max_instances = 8;
        c.limits.wall_time = Duration::from_secs(3);
        c.tenant_instance_share = 0.5;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_one_tenants_slow_function_leaves_other_tenants_answered() {
    let s = small_pool().await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    s.deploy(&a, "slow", "misbehave").await;
    s.deploy(&b, "hello", "hello").await;
    let flood: Vec<_> = (0..12)
        .map(|_| {
            let http = s.http.clone();
            let url = format!("{}/fn/a/slow/sleep", s.url);
            tokio::spawn(async move { http.get(url).send().await.unwrap() })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..5 {
        assert_eq!(s.call("b", "hello", "/").await.status(), 200);
    }
    let mut refused = 0;
    for r in flood {
        let r = r.await.unwrap();
        if r.status() == 429 {
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "tenant_instances_exceeded", "{v}");
            refused += 1;
        } else {
            assert_eq!(r.status(), 504, "the rest sleep into the wall-time limit");
        }
    }
    assert_eq!(
        refused, 8,
        "a holds 4 of 8 slots; its other 8 requests are refused"
    );
    // A policy override sets one tenant's cap (here to a single instance).
    let set = s.set_policy("a", json!({"max_instances": 1})).await;
    assert_eq!(set.status(), 200);
    let one = s.call("a", "slow", "/sleep");
    let two = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.call("a", "slow", "/sleep").await
    };
    let (one, two) = tokio::join!(one, two);
    assert_eq!((one.status().as_u16(), two.status().as_u16()), (504, 429));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_whose_clients_left_still_count_against_their_tenant() {
    let s = small_pool().await;
    let a = s.tenant("a").await;
    s.deploy(&a, "slow", "misbehave").await;
    // Four sleeping instances (a's cap) whose clients give up at once.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let left: Vec<_> = (0..4)
        .map(|_| http.get(format!("{}/fn/a/slow/sleep", s.url)).send())
        .collect();
    for r in futures::future::join_all(left).await {
        assert!(r.is_err(), "the client should have timed out: {r:?}");
    }
    // The instances sleep on into the wall-time limit, and hold a's slots.
    let r = s.call("a", "slow", "/sleep").await;
    assert_eq!(
        r.status(),
        429,
        "a fifth instance of a's while four still run"
    );
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "tenant_instances_exceeded", "{v}");
}

/// A server whose tenant `acme` deployed `hello`, restarted (after
/// `tweak`) with that component's file damaged and no compiled code left;
/// and the file's path and good bytes.
async fn acme_hello_damaged(
    tweak: impl FnOnce(&mut kiln_host::config::ServeConfig),
) -> (TestServer, (std::path::PathBuf, Vec<u8>)) {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    let row = s.deploy(&key, "hello", "hello").await;
    let digest = row["digest"]
        .as_str()
        .and_then(|d| d.strip_prefix("sha256:"))
        .unwrap();
    let file = s
        .data_dir()
        .join("components")
        .join(format!("{digest}.wasm"));
    let good = std::fs::read(&file).unwrap();
    std::fs::write(&file, b"not a component").unwrap();
    std::fs::remove_dir_all(s.data_dir().join("cache")).unwrap();
    (s.restart_with(tweak).await, (file, good))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployed_component_that_no_longer_loads_is_the_servers_500() {
    let (s, _) = acme_hello_damaged(|_| {}).await;
    for _ in 0..3 {
        let resp = s.call("acme", "hello", "/").await;
        assert_eq!(resp.status(), 500);
        let body = resp.text().await.unwrap();
        assert!(body.contains("redeploy"), "{body}");
    }
    // Tried once: each call does not compile it again.
    assert_eq!(s.metric(&["kiln_component_loads_total"]).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_component_that_failed_to_load_is_loaded_again_after_a_while() {
    let reload_after = Duration::from_secs(1);
    let (s, (file, good)) = acme_hello_damaged(|c| c.reload_after = reload_after).await;
    assert_eq!(s.call("acme", "hello", "/").await.status(), 500);
    // The failure passes (storage repaired): within `reload_after` the
    // error stands, after it the next call loads the component again.
    std::fs::write(&file, &good).unwrap();
    assert_eq!(s.call("acme", "hello", "/").await.status(), 500);
    tokio::time::sleep(reload_after).await;
    assert_eq!(s.call("acme", "hello", "/").await.status(), 200);
    assert_eq!(s.call("acme", "hello", "/").await.status(), 200);
    assert_eq!(s.metric(&["kiln_component_loads_total"]).await, 2.0);
}
