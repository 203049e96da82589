//! End-to-end tests of the platform foundation: a real server on
//! 127.0.0.1:0 running real components built from examples/ and the test
//! guests.

use kiln_tests::{TestServer, error_of, guest, turns_beside};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployed_hello_echoes_method_path_and_session() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    let deployed = s.deploy(&key, "hello", "hello").await;
    assert_eq!(deployed["name"], "hello");
    assert!(deployed["digest"].as_str().unwrap().starts_with("sha256:"));
    assert!(
        deployed["url"]
            .as_str()
            .unwrap()
            .ends_with("/fn/acme/hello/")
    );

    let resp = s
        .http
        .post(format!("{}/fn/acme/hello/a/b?x=1", s.url))
        .header("x-session-affinity", "sess-42")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.contains("Hello from Kiln!"), "{text}");
    assert!(text.contains("method: POST"), "{text}");
    assert!(text.contains("path: /a/b?x=1"), "{text}");
    assert!(text.contains("session: sess-42"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_tenant_cannot_list_invoke_redeploy_or_delete() {
    let s = TestServer::start().await;
    let a = s.tenant("acme").await;
    let b = s.tenant("bravo").await;
    let deployed = s.deploy(&a, "hello", "hello").await;

    // B lists only its own (none).
    let list: serde_json::Value = s
        .http
        .get(format!("{}/v1/functions", s.url))
        .bearer_auth(&b)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["functions"], serde_json::json!([]));

    // A's function looks exactly like a missing one to B.
    let get = |key: String, name: &'static str| {
        let req = s
            .http
            .get(format!("{}/v1/functions/{name}", s.url))
            .bearer_auth(key);
        async move { error_of(req.send().await.unwrap()).await }
    };
    let (st_a, ty_a, msg_a) = get(b.clone(), "hello").await;
    let (st_m, ty_m, msg_m) = get(b.clone(), "nothing").await;
    assert_eq!((st_a, ty_a.as_str()), (404, "not_found"));
    assert_eq!((st_m, ty_m.as_str()), (404, "not_found"));
    assert_eq!(msg_a.replace("hello", "X"), msg_m.replace("nothing", "X"));

    // B cannot delete it.
    let del = s
        .http
        .delete(format!("{}/v1/functions/hello", s.url))
        .bearer_auth(&b)
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(del).await.0, 404);

    // B cannot invoke it as its own: B's route has no such function.
    assert_eq!(error_of(s.call("bravo", "hello", "/").await).await.0, 404);

    // B "redeploying" hello creates B's own function; A's is untouched.
    s.deploy(&b, "hello", "misbehave").await;
    let mine: serde_json::Value = s
        .http
        .get(format!("{}/v1/functions/hello", s.url))
        .bearer_auth(&a)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(mine["digest"], deployed["digest"]);
    let text = s.call("acme", "hello", "/").await.text().await.unwrap();
    assert!(text.contains("Hello from Kiln!"), "{text}");
    assert_eq!(
        s.call("bravo", "hello", "/").await.text().await.unwrap(),
        "ok"
    );

    // And B's key cannot claim to deploy as A.
    let resp = s
        .http
        .put(format!("{}/v1/functions/x", s.url))
        .bearer_auth(&b)
        .header("kiln-tenant", "acme")
        .body(std::fs::read(guest("hello")).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_uploads_are_rejected() {
    let s = TestServer::start_with(|c| c.max_upload_bytes = 1 << 20).await;
    let key = s.tenant("acme").await;

    let not_wasm = s.put(&key, "f", b"hello world".to_vec()).await;
    let (status, kind, msg) = error_of(not_wasm).await;
    assert_eq!((status, kind.as_str()), (400, "invalid_request"));
    assert!(msg.contains("not a WebAssembly component"), "{msg}");

    let core_module = wat::parse_str("(module)").unwrap();
    let (status, _, msg) = error_of(s.put(&key, "f", core_module).await).await;
    assert_eq!(status, 400);
    assert!(msg.contains("wasm32-wasip2"), "{msg}");

    let no_handler = wat::parse_str("(component)").unwrap();
    let (status, _, msg) = error_of(s.put(&key, "f", no_handler).await).await;
    assert_eq!(status, 400);
    assert!(msg.contains("incoming-handler"), "{msg}");

    let foreign = wat::parse_str(
        r#"(component (import "evil:net/sockets" (instance (export "connect" (func)))))"#,
    )
    .unwrap();
    let (status, _, msg) = error_of(s.put(&key, "f", foreign).await).await;
    assert_eq!(status, 400);
    assert!(msg.contains("does not provide"), "{msg}");

    let truncated = std::fs::read(guest("hello")).unwrap()[..4000].to_vec();
    assert_eq!(error_of(s.put(&key, "f", truncated).await).await.0, 400);

    // More core instances than one instance's share of the pool.
    let many = format!(
        "(component (core module $m) {})",
        "(core instance (instantiate $m))".repeat(17)
    );
    let many = wat::parse_str(many).unwrap();
    let (status, _, msg) = error_of(s.put(&key, "f", many).await).await;
    assert_eq!(status, 400);
    assert!(msg.contains("17 core module instances"), "{msg}");
    // Refused uploads leave no compiled artifact behind.
    assert_eq!(artifacts(&s), Vec::<String>::new());

    let (status, kind, msg) = error_of(s.put(&key, "f", vec![0u8; 2 << 20]).await).await;
    assert_eq!((status, kind.as_str()), (413, "payload_too_large"));
    assert!(
        msg.contains("--max-upload"),
        "names the flag that sets it: {msg}"
    );

    // Nothing was stored.
    let list: serde_json::Value = s
        .http
        .get(format!("{}/v1/functions", s.url))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["functions"], serde_json::json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_names_and_credentials_get_clear_errors() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;

    let bad_tenant = s
        .http
        .post(format!("{}/v1/tenants", s.url))
        .bearer_auth(&s.admin)
        .json(&serde_json::json!({"name": "Not_OK"}))
        .send()
        .await
        .unwrap();
    let (status, _, msg) = error_of(bad_tenant).await;
    assert_eq!(status, 400);
    assert!(msg.contains("[a-z0-9-]{1,63}"), "{msg}");

    let dup = s
        .http
        .post(format!("{}/v1/tenants", s.url))
        .bearer_auth(&s.admin)
        .json(&serde_json::json!({"name": "acme"}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(dup).await.0, 409);

    let not_admin = s
        .http
        .post(format!("{}/v1/tenants", s.url))
        .bearer_auth(&key)
        .json(&serde_json::json!({"name": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(not_admin).await.0, 401);

    let bytes = std::fs::read(guest("hello")).unwrap();
    let (status, _, msg) = error_of(s.put(&key, "Bad.Name", bytes.clone()).await).await;
    assert_eq!(status, 400);
    assert!(msg.contains("function name"), "{msg}");
    assert_eq!(
        error_of(s.put("kiln_000000000000_00", "f", bytes.clone()).await)
            .await
            .0,
        401
    );
    let last = if key.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{last}", &key[..key.len() - 1]);
    assert_eq!(error_of(s.put(&forged, "f", bytes).await).await.0, 401);
    let anon = s
        .http
        .get(format!("{}/v1/functions", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(anon).await.0, 401);

    assert_eq!(error_of(s.call("acme", "missing", "/").await).await.0, 404);
    assert_eq!(error_of(s.call("ACME", "x", "/").await).await.0, 400);
    let health = s
        .http
        .get(format!("{}/healthz", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_first_call_compiles_its_component_aside_from_the_worker() {
    use kiln_host::names::Name;
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "hello", "hello").await;
    // Restarted without compiled artifacts: the first use compiles.
    std::fs::remove_dir_all(s.data_dir().join("cache")).unwrap();
    let s = s.restart().await;
    let app = s.app.clone();
    let route = (app.route(
        &Name::tenant("acme").unwrap(),
        &Name::function("hello").unwrap(),
    ))
    .expect("the function is routed");
    // On the runtime's one worker: the other task runs during the compile
    // only if the worker was handed on.
    let (during, ()) = turns_beside(async move {
        app.deployment(&route)
            .await
            .expect("the component compiles");
    })
    .await;
    assert!(during > 0, "no other task ran while the component compiled");
    assert!(!artifacts(&s).is_empty(), "the compile left its artifact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_arriving_during_a_first_compile_wait_for_that_one_load() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "hello", "hello").await;
    std::fs::remove_dir_all(s.data_dir().join("cache")).unwrap();
    let s = s.restart().await;
    let calls = (0..8).map(|_| s.call("acme", "hello", "/"));
    for resp in futures::future::join_all(calls).await {
        assert_eq!(resp.status(), 200);
    }
    let metrics = s.http.get(format!("{}/metrics", s.url));
    let text = metrics.bearer_auth(&s.admin).send().await.unwrap();
    let text = text.text().await.unwrap();
    assert!(
        text.contains("kiln_component_loads_total 1\n"),
        "each waiting request loaded the component again: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_header_that_is_not_ascii_is_a_400() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "hello", "hello").await;
    let addr = s.url.trim_start_matches("http://");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET /fn/acme/hello/ HTTP/1.1\r\nHost: caf\xe9\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut reply = Vec::new();
    c.read_to_end(&mut reply).await.unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    assert!(reply.contains("Host header"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_tenants_and_functions_and_deletes_drop_their_artifacts() {
    let s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "hello", "hello").await;
    let s = s.restart().await;
    let resp = s.call("acme", "hello", "/again").await;
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("path: /again"));
    // The key still works, and redeploy and delete still work.
    s.deploy(&key, "hello", "misbehave").await;
    assert_eq!(
        s.call("acme", "hello", "/").await.text().await.unwrap(),
        "ok"
    );
    let del = s
        .http
        .delete(format!("{}/v1/functions/hello", s.url))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), 204);
    assert_eq!(error_of(s.call("acme", "hello", "/").await).await.0, 404);
    // Neither component is used any more: their compiled artifacts went
    // with them (the replaced one at the redeploy).
    assert_eq!(artifacts(&s), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_invocations_across_two_tenants_succeed() {
    let s = TestServer::start().await;
    let a = s.tenant("acme").await;
    let b = s.tenant("bravo").await;
    s.deploy(&a, "hello", "hello").await;
    s.deploy(&b, "echo", "misbehave").await;
    let calls = (0..200).map(|i| {
        let s = &s;
        async move {
            if i % 2 == 0 {
                let r = s.call("acme", "hello", &format!("/{i}")).await;
                assert_eq!(r.status(), 200);
                assert!(r.text().await.unwrap().contains(&format!("path: /{i}")));
            } else {
                let body = format!("payload {i}");
                let r = s
                    .http
                    .post(format!("{}/fn/bravo/echo/echo", s.url))
                    .body(body.clone())
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                assert_eq!(r.text().await.unwrap(), body);
            }
        }
    });
    futures::future::join_all(calls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_client_creates_tenants_and_deploys() {
    let s = TestServer::start().await;
    let admin = kiln_host::client::Client::new(&s.url, &s.admin).unwrap();
    let created = admin.create_tenant("acme").await.unwrap();
    let key = created["api_key"].as_str().unwrap().to_owned();
    let err = admin.create_tenant("acme").await.unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");

    let tenant = kiln_host::client::Client::new(&s.url, &key).unwrap();
    let bytes = std::fs::read(guest("hello")).unwrap();
    let out = tenant.deploy("acme", "hello", bytes.clone()).await.unwrap();
    assert!(out["url"].as_str().unwrap().ends_with("/fn/acme/hello/"));
    let err = tenant.deploy("other", "hello", bytes).await.unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
    assert_eq!(s.call("acme", "hello", "/").await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_requests_in_flight_finish() {
    let mut s = TestServer::start().await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let url = format!("{}/fn/acme/bad/nap", s.url);
    let http = s.http.clone();
    let in_flight = tokio::spawn(async move { http.get(url).send().await });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    s.stop().await;
    let resp = in_flight
        .await
        .unwrap()
        .expect("in-flight request completed");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "rested");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_https_with_the_given_certificate() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let s = TestServer::start_with(|c| c.tls = Some((cert_path, key_path))).await;
    let port = s.url.rsplit(':').next().unwrap().to_owned();
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap())
        .resolve("localhost", format!("127.0.0.1:{port}").parse().unwrap())
        .build()
        .unwrap();
    let resp = client
        .get(format!("https://localhost:{port}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
}

/// A model backend whose stream yields 100 chunks, 5 ms apart.
struct SlowModel;

struct SlowStream(u32);

impl kiln_runtime::TokenStream for SlowStream {
    fn next(
        &mut self,
    ) -> kiln_runtime::BoxFuture<'_, Result<kiln_runtime::StreamEvent, kiln_runtime::AiError>> {
        Box::pin(async move {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            self.0 += 1;
            Ok(if self.0 <= 100 {
                kiln_runtime::StreamEvent::Delta(format!("t{}", self.0).as_str().into())
            } else {
                kiln_runtime::StreamEvent::Done(kiln_runtime::StreamEnd {
                    finish_reason: kiln_runtime::FinishReason::Stop,
                    usage: kiln_runtime::Usage {
                        prompt_tokens: 1,
                        completion_tokens: 100,
                        cached_prompt_tokens: 0,
                    },
                    tool_calls: Vec::new(),
                })
            })
        })
    }
}

impl kiln_runtime::Inference for SlowModel {
    fn call(
        &self,
        _: kiln_runtime::ModelCall,
    ) -> kiln_runtime::BoxFuture<'_, Result<kiln_runtime::Completion, kiln_runtime::AiError>> {
        Box::pin(async { Err(kiln_runtime::AiError::RuntimeError("only streams".into())) })
    }
    fn stream(
        &self,
        _: kiln_runtime::ModelCall,
    ) -> kiln_runtime::BoxFuture<
        '_,
        Result<Box<dyn kiln_runtime::TokenStream>, kiln_runtime::AiError>,
    > {
        Box::pin(async { Ok(Box::new(SlowStream(0)) as Box<dyn kiln_runtime::TokenStream>) })
    }
    fn list_models(&self, _: &str) -> Vec<kiln_runtime::ModelInfo> {
        Vec::new()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_the_model_is_not_billed_as_guest_cpu() {
    // 100 chunks x 5 ms = 0.5 s inside host calls, against a 50 ms CPU limit.
    let s = TestServer::start_with_backend(std::sync::Arc::new(SlowModel)).await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let resp = s.call("acme", "bad", "/stream").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "100 chunks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_call_past_its_deadline_is_aborted() {
    // 100 chunks x 5 ms against a 100 ms model-call deadline.
    let s = TestServer::start_with_backend_config(std::sync::Arc::new(SlowModel), |c| {
        c.model_deadline = std::time::Duration::from_millis(100);
    })
    .await;
    let key = s.tenant("acme").await;
    s.deploy(&key, "bad", "misbehave").await;
    let text = s.call("acme", "bad", "/stream").await.text().await.unwrap();
    let (n, why) = text.split_once(" chunks, then ").expect(&text);
    assert!(n.parse::<u32>().unwrap() < 100, "{text}");
    assert!(
        why.contains("Aborted") && why.contains("deadline"),
        "{text}"
    );
}

/// A model backend whose streams never yield, and which records when one
/// is dropped (cancelled).
struct Stalled(std::sync::Arc<std::sync::atomic::AtomicBool>);

struct StalledStream(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for StalledStream {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl kiln_runtime::TokenStream for StalledStream {
    fn next(
        &mut self,
    ) -> kiln_runtime::BoxFuture<'_, Result<kiln_runtime::StreamEvent, kiln_runtime::AiError>> {
        Box::pin(std::future::pending())
    }
}

impl kiln_runtime::Inference for Stalled {
    fn call(
        &self,
        _: kiln_runtime::ModelCall,
    ) -> kiln_runtime::BoxFuture<'_, Result<kiln_runtime::Completion, kiln_runtime::AiError>> {
        Box::pin(std::future::pending())
    }
    fn stream(
        &self,
        _: kiln_runtime::ModelCall,
    ) -> kiln_runtime::BoxFuture<
        '_,
        Result<Box<dyn kiln_runtime::TokenStream>, kiln_runtime::AiError>,
    > {
        let s = StalledStream(self.0.clone());
        Box::pin(async { Ok(Box::new(s) as Box<dyn kiln_runtime::TokenStream>) })
    }
    fn list_models(&self, _: &str) -> Vec<kiln_runtime::ModelInfo> {
        Vec::new()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_a_quiet_stream_cancels_its_generation() {
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = TestServer::start_with_backend(std::sync::Arc::new(Stalled(dropped.clone()))).await;
    let key = s.tenant("acme").await;
    let body = serde_json::json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let mut resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The role chunk arrives; then nothing, and the client goes away.
    assert!(resp.chunk().await.unwrap().is_some());
    drop(resp);
    let t = std::time::Instant::now();
    while !dropped.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "the generation outlived its client"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The compiled artifacts in the server's cache.
fn artifacts(s: &TestServer) -> Vec<String> {
    (std::fs::read_dir(s.data_dir().join("cache"))
        .unwrap()
        .flatten())
    .map(|e| e.file_name().to_string_lossy().into_owned())
    .collect()
}
