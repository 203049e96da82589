//! What a gateway in front of Kiln reads: the Inference Extension's load
//! figures on their own tokenless listener, and the node that served each
//! answer.

use futures::StreamExt;
use kiln_tests::TestServer;

async fn scrape(http: &reqwest::Client, addr: std::net::SocketAddr) -> String {
    let resp = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap()
}

fn value(text: &str, key: &str) -> Option<f64> {
    kiln_host::status::parse(text)
        .into_iter()
        .find(|s| s.key == key)
        .map(|s| s.value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_picker_reads_queue_and_kv_load_without_a_token() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let s = TestServer::start_with_pools(1, |c| {
        c.gateway_metrics = Some(addr);
        c.node_name = "node-a".into();
    })
    .await;
    let key = s.tenant("acme").await;
    let running = "vllm:num_requests_running{model_name=\"smollm2-135m-instruct\"}";
    let usage = "vllm:kv_cache_usage_perc{model_name=\"smollm2-135m-instruct\"}";
    let idle = scrape(&s.http, addr).await;
    assert_eq!(value(&idle, running), Some(0.0), "{idle}");
    assert_eq!(value(&idle, usage), Some(0.0), "{idle}");
    assert!(!idle.contains("acme"), "tenant names leak: {idle}");
    // The page count it reports is the engine's.
    let info = kiln_host::status::parse(&idle)
        .into_iter()
        .find(|s| s.name == "vllm:cache_config_info")
        .expect("cache_config_info");
    assert_eq!(info.labels["block_size"], "16");
    let mut pages = 0.0;
    for state in ["in_use", "cached", "free"] {
        pages += s
            .metric(&["kiln_kv_pages{", &format!("state=\"{state}\"")])
            .await;
    }
    assert_eq!(info.labels["num_gpu_blocks"], format!("{pages}"));

    // While a stream decodes, it runs and holds pages.
    let resp = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth(&key)
        .json(&serde_json::json!({
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "Write a long story about the sea."}],
            "max_tokens": 200, "stream": true, "temperature": 0.8,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-kiln-node"], "node-a");
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    stream.next().await.unwrap().unwrap();
    let busy = scrape(&s.http, addr).await;
    assert_eq!(value(&busy, running), Some(1.0), "{busy}");
    assert!(value(&busy, usage).unwrap() > 0.0, "{busy}");
    drop(stream);

    // The same figures are in the token-protected /metrics.
    assert!(s.metric(&["vllm:cache_config_info{"]).await == 1.0);
    let health = s
        .http
        .get(format!("{}/healthz", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.headers()["x-kiln-node"], "node-a");
}
