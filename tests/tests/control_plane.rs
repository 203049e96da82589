//! The control plane's two databases keep the same records the same way:
//! SQLite in the data directory and PostgreSQL (a throwaway server), both
//! migrated by the same tool; and a server runs on PostgreSQL.

use kiln_host::db::{Db, DbError, FunctionRow, TenantLoad};
use kiln_tests::TestServer;
use kiln_tests::postgres::Postgres;

fn row(tenant: &str, name: &str, digest: &str) -> FunctionRow {
    FunctionRow {
        tenant: tenant.into(),
        name: name.into(),
        digest: digest.into(),
        size: 1,
        created: 1,
    }
}

/// The records' rules, whichever database holds them.
fn keeps_the_control_plane(db: &Db) {
    // A tenant's name is taken once; its key resolves to it.
    db.create_tenant("acme", "k1", b"h1").unwrap();
    assert!(matches!(
        db.create_tenant("acme", "k2", b"h"),
        Err(DbError::TenantExists(_))
    ));
    assert_eq!(db.api_key("k2").unwrap(), None);
    assert_eq!(
        db.api_key("k1").unwrap(),
        Some(("acme".into(), b"h1".to_vec()))
    );
    assert!(db.tenant_exists("acme").unwrap() && !db.tenant_exists("nobody").unwrap());

    // A redeploy replaces the row and frees the old digest. (A database
    // of several nodes keeps the bytes a row refers to: stored first.)
    db.put_component("aa", b"a").unwrap();
    db.put_component("bb", b"b").unwrap();
    let mut f = row("acme", "f", "aa");
    assert_eq!(db.upsert_function(&f, 100).unwrap(), None);
    f.digest = "bb".into();
    assert_eq!(db.upsert_function(&f, 100).unwrap(), Some("aa".into()));
    assert_eq!(db.functions(Some("acme")).unwrap(), vec![f.clone()]);
    assert_eq!(db.function("acme", "f").unwrap(), Some(f.clone()));

    // A digest two tenants share stays in use until both let go.
    db.create_tenant("beta", "k3", b"h3").unwrap();
    db.upsert_function(&row("beta", "g", "bb"), 100).unwrap();
    let (gone, shared) = db.delete_function("acme", "f").unwrap().unwrap();
    assert_eq!((gone, shared), (f, true));
    assert!(db.delete_function("acme", "f").unwrap().is_none());
    assert_eq!(db.digests().unwrap(), ["bb".to_owned()].into());
    assert_eq!(db.functions(None).unwrap().len(), 1);

    // A tenant at its cap may redeploy, but not add a name.
    assert_eq!(
        db.upsert_function(&row("beta", "g", "bb"), 1).unwrap(),
        None
    );
    assert!(matches!(
        db.upsert_function(&row("beta", "h", "bb"), 1),
        Err(DbError::FunctionsExceeded { cap: 1, .. })
    ));
    assert_eq!(db.function("beta", "h").unwrap(), None);

    // Policies are stored and replaced.
    db.set_policy("acme", "{\"weight\":2}").unwrap();
    db.set_policy("acme", "{\"weight\":3}").unwrap();
    assert_eq!(
        db.policies().unwrap(),
        vec![("acme".to_owned(), "{\"weight\":3}".to_owned())]
    );
}

#[test]
fn sqlite_and_postgres_keep_the_control_plane_alike() {
    let dir = tempfile::tempdir().unwrap();
    keeps_the_control_plane(&Db::open(&dir.path().join("kiln.db")).unwrap());
    // Opening again finds the schema migrated and the records kept.
    let again = Db::open(&dir.path().join("kiln.db")).unwrap();
    assert!(again.tenant_exists("beta").unwrap());

    let pg = Postgres::start();
    keeps_the_control_plane(&Db::connect(&pg.url).unwrap());
    let again = Db::connect(&pg.url).unwrap();
    assert!(again.tenant_exists("beta").unwrap());
}

#[test]
fn a_delete_on_one_node_cannot_take_the_bytes_of_a_deploy_on_another() {
    let pg = Postgres::start();
    let (a, b) = (Db::connect(&pg.url).unwrap(), Db::connect(&pg.url).unwrap());
    a.create_tenant("acme", "k1", b"h1").unwrap();
    a.create_tenant("beta", "k2", b"h2").unwrap();
    a.put_component("xx", b"x").unwrap();
    a.upsert_function(&row("acme", "h", "xx"), 100).unwrap();
    // Node b is deploying the same bytes (stored already, so its insert
    // does nothing) when node a deletes their last user and forgets them.
    b.put_component("xx", b"x").unwrap();
    let (_, shared) = a.delete_function("acme", "h").unwrap().unwrap();
    assert!(!shared);
    a.forget_component("xx").unwrap();
    assert!(matches!(
        b.upsert_function(&row("beta", "g", "xx"), 100),
        Err(DbError::ComponentGone(_))
    ));
    assert_eq!(
        b.function("beta", "g").unwrap(),
        None,
        "no row without its bytes"
    );
    // The deploy stores them again and goes on; a forget now keeps them.
    b.put_component("xx", b"x").unwrap();
    b.upsert_function(&row("beta", "g", "xx"), 100).unwrap();
    a.forget_component("xx").unwrap();
    assert_eq!(b.component("xx").unwrap(), Some(b"x".to_vec()));
}

#[test]
fn two_nodes_adding_functions_at_once_stay_within_the_tenants_cap() {
    let pg = Postgres::start();
    let (a, b) = (Db::connect(&pg.url).unwrap(), Db::connect(&pg.url).unwrap());
    a.create_tenant("acme", "k1", b"h1").unwrap();
    a.put_component("xx", b"x").unwrap();
    for round in 1..=20u32 {
        // Each node adds a name with room for one more: one of them wins.
        let barrier = std::sync::Barrier::new(2);
        let added = std::thread::scope(|s| {
            let (barrier, a, b) = (&barrier, &a, &b);
            let add = move |db: &Db, name: String| {
                barrier.wait();
                db.upsert_function(&row("acme", &name, "xx"), round).is_ok()
            };
            let x = s.spawn(move || add(a, format!("a-{round}")));
            let y = s.spawn(move || add(b, format!("b-{round}")));
            u32::from(x.join().unwrap()) + u32::from(y.join().unwrap())
        });
        assert_eq!(added, 1, "round {round}");
        assert_eq!(a.functions(Some("acme")).unwrap().len(), round as usize);
    }
}

#[test]
fn the_quota_rows_of_a_node_gone_for_a_minute_are_cleared() {
    let pg = Postgres::start();
    let db = Db::connect(&pg.url).unwrap();
    let load = TenantLoad {
        tenant: "acme".into(),
        tokens: 10,
        inflight: 1,
    };
    db.share_load("gone", std::slice::from_ref(&load)).unwrap();
    db.share_load("alive", std::slice::from_ref(&load)).unwrap();
    // "gone" stopped (each start of a node is a new one) a minute ago.
    pg.query("UPDATE quota_load SET updated = now() - interval '2 minutes' WHERE node = 'gone'");
    db.share_load("alive", std::slice::from_ref(&load)).unwrap();
    assert_eq!(pg.query("SELECT node FROM quota_load"), "alive");
}

#[test]
fn a_restarted_postgres_is_reconnected_without_restarting_kiln() {
    let pg = Postgres::start();
    let db = Db::connect(&pg.url).unwrap();
    db.create_tenant("acme", "k1", b"h").unwrap();
    pg.restart();
    // The statement that finds the connection gone runs again on a new
    // one; the loop only waits out a server not yet taking connections.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match db.tenant_exists("acme") {
            Ok(found) => break assert!(found),
            Err(e) => assert!(std::time::Instant::now() < deadline, "still failing: {e}"),
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn an_unreachable_postgres_is_a_clear_error() {
    let err = Db::connect("postgres://kiln@127.0.0.1:1/postgres")
        .err()
        .unwrap();
    assert!(err.to_string().contains("database error"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_postgres_keeps_its_tenants_and_functions_across_restarts() {
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let url = pg.url.clone();
    let s = TestServer::start_with(move |c| c.database = Some(url)).await;
    let url = pg.url.clone();
    let key = s.tenant("acme").await;
    s.deploy(&key, "hello", "hello").await;
    let first = s.call("acme", "hello", "/").await;
    assert_eq!(first.status(), 200, "{:?}", first.text().await);
    let s = s.restart_with(move |c| c.database = Some(url)).await;
    assert_eq!(s.call("acme", "hello", "/").await.status(), 200);
    let listed = s.get_json(&key, "/v1/functions").await;
    assert_eq!(listed["functions"][0]["name"], "hello", "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_node_changes_another_serves_within_a_second() {
    use std::time::Duration;
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let a = TestServer::start_on_database(&pg.url).await;
    let b = TestServer::start_on_database(&pg.url).await;
    let bound = Duration::from_secs(1);

    // A tenant made on one node is known to the other.
    let key = a.tenant("acme").await;
    let listed = b.get_json(&key, "/v1/functions").await;
    assert_eq!(listed["functions"], serde_json::json!([]), "{listed}");

    // A deploy answered on A is served by B (from B's own data dir, which
    // never saw the upload) once the bound has passed.
    a.deploy(&key, "f", "hello").await;
    tokio::time::sleep(bound).await;
    let resp = b.call("acme", "f", "/").await;
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().starts_with("Hello from Kiln!"));

    // A new version replaces the old one on B too.
    let bytes = std::fs::read(kiln_tests::guest("misbehave")).unwrap();
    assert_eq!(a.put(&key, "f", bytes).await.status(), 201);
    tokio::time::sleep(bound).await;
    assert_eq!(b.call("acme", "f", "/").await.text().await.unwrap(), "ok");

    // A policy set on A holds on B.
    let resp = a
        .set_policy(
            "acme",
            serde_json::json!({"allowed_models": ["another-model"]}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    tokio::time::sleep(bound).await;
    let body = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    });
    let (status, v) = b.openai(&key, "/v1/chat/completions", None, &body).await;
    let refused = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        status == 404 && refused.contains("may not call"),
        "{status} {v}"
    );

    // A delete on A stops the function on B.
    let resp = a
        .http
        .delete(format!("{}/v1/functions/f", a.url))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    tokio::time::sleep(bound).await;
    assert_eq!(b.call("acme", "f", "/").await.status(), 404);
}

/// The components whose files `node` holds.
fn component_files(node: &TestServer) -> Vec<String> {
    let dir = node.data_dir().join("components");
    let mut names: Vec<String> = (std::fs::read_dir(dir).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".wasm"))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redeploy_on_one_node_clears_the_old_component_from_the_others() {
    use std::time::Duration;
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let a = TestServer::start_on_database(&pg.url).await;
    let b = TestServer::start_on_database(&pg.url).await;
    let key = a.tenant("acme").await;
    a.deploy(&key, "f", "misbehave").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while b.call("acme", "f", "/").await.status() != 200 {
        assert!(std::time::Instant::now() < deadline, "b never served f");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let old = component_files(&b);
    assert_eq!(old.len(), 1, "b fetched f's component: {old:?}");
    a.deploy(&key, "f", "hello").await;
    while component_files(&b) == old {
        assert!(std::time::Instant::now() < deadline, "b kept {old:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!component_files(&b).contains(&old[0]));
}

/// Calls `node`'s chat API with `key` until its quota refuses one (429);
/// how many it admitted.
async fn call_until_refused(node: &TestServer, key: &str) -> usize {
    let body = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16, "temperature": 0,
    });
    for admitted in 0..1000 {
        let (status, v) = node.openai(key, "/v1/chat/completions", None, &body).await;
        if status == 429 {
            return admitted;
        }
        assert_eq!(status, 200, "{v}");
    }
    panic!("never refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_holds_for_the_cluster_not_per_node() {
    use std::time::Duration;
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let a = TestServer::start_on_database(&pg.url).await;
    let b = TestServer::start_on_database(&pg.url).await;
    let key = a.tenant("acme").await;
    let tpm = 1500u64;
    let resp = a
        .set_policy(
            "acme",
            serde_json::json!({"tokens_per_minute": tpm, "max_concurrent": 2}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Both nodes spend the one quota at once, until each is refused.
    let (on_a, on_b) = tokio::join!(call_until_refused(&a, &key), call_until_refused(&b, &key));
    assert!(on_a > 0 && on_b > 0, "a {on_a}, b {on_b}");
    let used = |v: serde_json::Value| v["usage"]["tokens_last_minute"].as_u64().unwrap();
    let total =
        used(a.get_json(&key, "/v1/usage").await) + used(b.get_json(&key, "/v1/usage").await);
    assert!(
        total <= tpm + tpm / 10,
        "the cluster spent {total} of a {tpm}-token quota ({on_a} calls on a, {on_b} on b)"
    );

    // Calls in flight on one node count against the cap on the other.
    let c = TestServer::start_on_database(&pg.url).await;
    let key2 = c.tenant("beta").await;
    let resp = c
        .set_policy("beta", serde_json::json!({"max_concurrent": 2}))
        .await;
    assert_eq!(resp.status(), 200);
    let long = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 400, "temperature": 0.8, "stream": true,
    });
    let mut streams = Vec::new();
    for _ in 0..2 {
        let resp = c
            .http
            .post(format!("{}/v1/chat/completions", c.url))
            .bearer_auth(&key2)
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        streams.push(resp);
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let short = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    });
    let (status, v) = a.openai(&key2, "/v1/chat/completions", None, &short).await;
    assert_eq!(status, 429, "{v}");
    assert!(v.to_string().contains("in flight"), "{v}");
    drop(streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_burst_of_deploys_over_three_nodes_every_node_serves_the_last_versions() {
    use std::time::Duration;
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let mut nodes = Vec::new();
    for _ in 0..3 {
        let url = pg.url.clone();
        nodes.push(TestServer::start_with(move |c| c.database = Some(url)).await);
    }
    let key = nodes[0].tenant("acme").await;
    let versions = [
        (
            std::fs::read(kiln_tests::guest("hello")).unwrap(),
            "Hello from Kiln!",
        ),
        (std::fs::read(kiln_tests::guest("misbehave")).unwrap(), "ok"),
    ];
    // 60 functions, each deployed twice (one version, then the other),
    // the deploys spread over the nodes in turn.
    let (functions, mut last) = (60, Vec::new());
    for round in 0..2 {
        for f in 0..functions {
            let v = (f + round) % 2;
            let node = &nodes[(f + round) % 3];
            let resp = node
                .put(&key, &format!("f{f}"), versions[v].0.clone())
                .await;
            assert_eq!(resp.status(), 201);
            if round == 1 {
                last.push(versions[v].1);
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (i, n) in nodes.iter().enumerate() {
        for (f, want) in last.iter().enumerate() {
            let got = n
                .call("acme", &format!("f{f}"), "/")
                .await
                .text()
                .await
                .unwrap();
            assert!(
                got.starts_with(want),
                "node {i}, f{f}: {got:?}, not {want:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_key_check_waiting_on_postgres_leaves_the_async_worker_to_others() {
    use std::time::{Duration, Instant};
    let pg = tokio::task::spawn_blocking(Postgres::start).await.unwrap();
    let url = pg.url.clone();
    let s = TestServer::start_with(move |c| c.database = Some(url)).await;
    s.tenant("acme").await;
    // Another session holds the keys' table for two seconds, so Kiln's
    // lookup of a key it has not seen waits on the database meanwhile.
    let holder =
        pg.psql("BEGIN; LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(2); COMMIT;");
    let held = "SELECT count(*) FROM pg_locks WHERE relation = 'api_keys'::regclass \
                AND mode = 'AccessExclusiveLock' AND granted";
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg.query(held) != "1" {
        assert!(Instant::now() < deadline, "the table was never locked");
        std::thread::sleep(Duration::from_millis(20));
    }
    let app = s.app.clone();
    let unseen = format!("kiln_{}_{}", "0".repeat(12), "0".repeat(48));
    // On the runtime's one worker: the other task runs while the lookup
    // waits only if the worker was handed on.
    let (during, found) =
        kiln_tests::turns_beside(async move { app.tenant_for_key(&unseen) }).await;
    assert_eq!(found.unwrap(), None);
    assert!(during > 0, "no other task ran while the lookup waited");
    assert!(holder.wait_with_output().unwrap().status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_function_cap_may_redeploy_but_not_add_a_name() {
    let s = TestServer::start().await;
    let (a, b) = (s.tenant("acme").await, s.tenant("beta").await);
    let cap = serde_json::json!({"max_functions": 2});
    assert_eq!(s.set_policy("acme", cap).await.status(), 200);
    s.deploy(&a, "f-1", "hello").await;
    s.deploy(&a, "f-2", "hello").await;
    let other = std::fs::read(kiln_tests::guest("misbehave")).unwrap();
    let resp = s.put(&a, "f-3", other.clone()).await;
    assert_eq!(resp.status(), 403);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "tenant_functions_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_functions")
    );
    let files = std::fs::read_dir(s.data_dir().join("components")).unwrap();
    assert_eq!(files.count(), 1, "the refused upload left its bytes");
    // A redeploy of a name it has, and another tenant, are not refused.
    assert_eq!(s.put(&a, "f-2", other.clone()).await.status(), 201);
    s.deploy(&b, "f-3", "hello").await;
    let del = s.http.delete(format!("{}/v1/functions/f-1", s.url));
    assert_eq!(del.bearer_auth(&a).send().await.unwrap().status(), 204);
    assert_eq!(s.put(&a, "f-3", other).await.status(), 201);
}
