//! A prefill pool in front of decode pools (`kiln serve --prefill-device`):
//! it computes every prompt and hands each sequence, its KV pages copied,
//! to the decode pool the router chose; what the caller gets is what
//! decode pools alone give.

use kiln_host::engine::EngineConfig;
use kiln_host::metrics::Metrics;
use kiln_host::serving::ServedModels;
use kiln_host::serving::devices::Placement;
use kiln_kernels::Device;
use kiln_runtime::{Inference, OutputFormat, StreamEvent, TokenStream};
use kiln_tests::{PROMPTS, default_model};

#[path = "shared/pools.rs"]
#[allow(dead_code)]
mod pools;
use pools::{chat, pool_count};

/// Greedy completions of six prompts, each with its own session key.
async fn answers(served: &ServedModels) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for (i, prompt) in PROMPTS[..6].iter().enumerate() {
        let mut call = chat(prompt, 12);
        call.params.session = Some(format!("s{i}"));
        let done = served.call(call).await.unwrap();
        out.push((done.text, done.usage.completion_tokens));
    }
    out
}

/// `pools` CPU decode pools of the default model behind a CPU prefill
/// pool (pool `pools`), figures to `metrics`.
fn with_prefill(config: EngineConfig, pools: usize, metrics: &Metrics) -> ServedModels {
    let placement = Placement {
        devices: vec![],
        pools,
        prefill: Some(Device::Cpu),
    };
    let models = vec![(default_model(), config)];
    ServedModels::start_on(models, &placement, metrics.engine.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_pool_hands_every_request_on_and_the_answers_stay_the_same() {
    let config = EngineConfig {
        kv_memory: 64 << 20,
        ..Default::default()
    };
    let alone = Metrics::default();
    let served = ServedModels::start(
        vec![(default_model(), config.clone())],
        2,
        alone.engine.clone(),
    );
    let want = answers(&served.unwrap()).await;
    assert!(want.iter().all(|(_, n)| *n > 0), "{want:?}");

    let metrics = Metrics::default();
    let served = with_prefill(config, 2, &metrics);
    assert_eq!(answers(&served).await, want);
    // Pools 0 and 1 decode; pool 2 prefills and hands each request on.
    let routed = [0, 1].map(|p| pool_count(&metrics.engine.pool_requests, p));
    assert_eq!(routed.iter().sum::<u64>(), 6, "{routed:?}");
    assert_eq!(pool_count(&metrics.engine.transfers, 2), 6);
    let snapshot = served.snapshot(kiln_host::model::DEFAULT_MODEL).unwrap();
    assert_eq!(snapshot.requests, 0, "every pool's count is back to 0");
}

/// Greedy completions of four prompts sent at once.
async fn at_once(served: &ServedModels) -> Vec<String> {
    let calls = PROMPTS[..4].iter().map(|p| served.call(chat(p, 8)));
    let done = futures::future::join_all(calls).await;
    done.into_iter().map(|c| c.unwrap().text).collect()
}

/// Pools of one running slot each.
fn one_slot() -> EngineConfig {
    EngineConfig {
        kv_memory: 64 << 20,
        scheduler: kiln_host::engine::SchedulerConfig {
            max_running: 1,
            ..Default::default()
        },
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_pool_takes_handed_on_requests_as_its_slots_free() {
    // One running slot a pool: the prefill pool hands on each prompt as
    // it computes it, while the decode pool's one slot is still busy.
    let config = one_slot();
    let metrics = Metrics::default();
    let models = vec![(default_model(), config.clone())];
    let want = at_once(&ServedModels::start(models, 1, metrics.engine.clone()).unwrap()).await;
    let served = with_prefill(config, 1, &metrics);
    assert_eq!(at_once(&served).await, want);
    assert_eq!(pool_count(&metrics.engine.transfers, 1), 4);
    let snapshot = served.snapshot(kiln_host::model::DEFAULT_MODEL).unwrap();
    assert_eq!(snapshot.requests, 0, "every pool's count is back to 0");
}

/// Reads `s` up to its first text.
async fn first_text(s: &mut Box<dyn TokenStream>) {
    while !matches!(s.next().await, Ok(StreamEvent::Delta(_))) {}
}

/// Polls `done` every 20 ms for up to `secs` seconds.
async fn within(secs: u64, done: impl Fn() -> bool) -> bool {
    for _ in 0..secs * 50 {
        if done() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    done()
}

/// A request that holds a decode pool's one slot for hundreds of tokens,
/// read up to its first text.
async fn holding_the_slot(served: &ServedModels) -> Box<dyn TokenStream> {
    let mut long = chat(PROMPTS[0], 4000);
    let schema = r#"{"type": "array", "minItems": 60,
        "items": {"type": "string", "minLength": 24}}"#;
    long.params.format = Some(OutputFormat::JsonSchema(schema.into()));
    let mut a = served.stream(long).await.unwrap();
    first_text(&mut a).await;
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_on_request_whose_caller_left_is_dropped_while_it_waits_for_a_slot() {
    let config = one_slot();
    let metrics = Metrics::default();
    let served = with_prefill(config, 1, &metrics);
    let requests = || {
        served
            .snapshot(kiln_host::model::DEFAULT_MODEL)
            .unwrap()
            .requests
    };
    // a holds the decode pool's one slot for hundreds of tokens.
    let a = holding_the_slot(&served).await;
    // b is handed on, and waits for that slot; then its caller leaves.
    let mut b = served.stream(chat(PROMPTS[1], 50)).await.unwrap();
    first_text(&mut b).await;
    let handed = || pool_count(&metrics.engine.transfers, 1) == 2;
    assert!(within(10, handed).await, "b was handed on");
    assert!(within(5, || requests() == 2).await, "a runs, b waits");
    drop(b);
    assert!(
        within(5, || requests() == 1).await,
        "b is forgotten while a runs: {} requests",
        requests()
    );
    drop(a);
    assert!(within(5, || requests() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_pool_keeps_what_a_full_decode_pool_has_no_room_to_wait_for() {
    let config = one_slot();
    let metrics = Metrics::default();
    let served = std::sync::Arc::new(with_prefill(config, 1, &metrics));
    // a holds the decode pool's one slot for hundreds of tokens.
    let a = holding_the_slot(&served).await;
    // Four more short requests than may wait for that slot: the prefill
    // pool hands on as many as may wait and decodes the rest itself.
    let extra = 4;
    let n = kiln_host::serving::MAX_HANDED_WAITING + extra;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let (served, done) = (served.clone(), done.clone());
            tokio::spawn(async move {
                let r = served.call(chat(PROMPTS[i % PROMPTS.len()], 6)).await;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                r
            })
        })
        .collect();
    let finished = || done.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        within(30, || finished() >= extra).await,
        "{} of {n} finished while a holds the slot",
        finished()
    );
    let handed = pool_count(&metrics.engine.transfers, 1);
    assert_eq!(handed, 1 + kiln_host::serving::MAX_HANDED_WAITING as u64);
    // Once a ends, the ones waiting run in the decode pool.
    drop(a);
    for c in calls {
        assert!(c.await.unwrap().is_ok());
    }
}
