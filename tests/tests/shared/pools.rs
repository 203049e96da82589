//! What the reliability tests and the GPU tests share about decode pools:
//! counting what reached a pool, and one pool failing beside another.

use kiln_host::metrics::{Metrics, PoolLabels};
use kiln_host::model::DEFAULT_MODEL;
use kiln_host::serving::ServedModels;
use kiln_runtime::{AiError, Inference, Message, ModelCall, Params, Prompt, Role};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// The default model's counter `family` for `pool`.
pub fn pool_count(family: &Family<PoolLabels, Counter>, pool: usize) -> u64 {
    let labels = PoolLabels {
        model: DEFAULT_MODEL.into(),
        pool: pool.to_string(),
    };
    family.get_or_create(&labels).get()
}

/// A greedy chat call of tenant `t` to the default model.
pub fn chat(content: &str, max_tokens: u32) -> ModelCall {
    ModelCall {
        tenant: "t".into(),
        model: DEFAULT_MODEL.into(),
        prompt: Prompt::Chat(vec![Message::text(Role::User, content)]),
        params: Params {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ..Params::defaults()
        },
    }
}

/// Two decode pools of the default model in `served` (whose figures go to
/// `metrics`): a session key is found for each, a stream runs on pool 0,
/// pool 1's engine panics, and the stream runs on to its end while pool
/// 1's request fails as restarted and pool 1 serves again after.
pub async fn one_pool_fails_alone(served: &ServedModels, metrics: &Metrics) {
    let routed = |pool: usize| pool_count(&metrics.engine.pool_requests, pool);
    let with_session = |content: &str, max_tokens: u32, session: &str| {
        let mut r = chat(content, max_tokens);
        r.params.session = Some(session.into());
        r
    };
    // A session key for each pool, found by where one-token calls land.
    let mut sessions: [Option<String>; 2] = [None, None];
    for i in 0..64 {
        let key = format!("s{i}");
        let before = [routed(0), routed(1)];
        served.call(with_session("Hi", 1, &key)).await.unwrap();
        let pool = usize::from(routed(1) > before[1]);
        sessions[pool].get_or_insert(key);
        if sessions.iter().all(Option::is_some) {
            break;
        }
    }
    let [Some(calm), Some(failing)] = sessions else {
        panic!("no session key reached both pools: {sessions:?}");
    };
    let mut stream = served
        .stream(with_session("Count from 1 to 100.", 200, &calm))
        .await
        .unwrap();
    assert!(stream.next().await.is_ok());
    assert!(served.inject_panic(DEFAULT_MODEL, 1));
    let hit = served.call(with_session("Say hi.", 4, &failing)).await;
    assert!(
        matches!(&hit, Err(AiError::Aborted(m)) if m.starts_with("engine_restarted")),
        "{hit:?}"
    );
    // The other pool's stream runs on, to its end.
    let mut later = 0;
    loop {
        match stream.next().await {
            Ok(kiln_runtime::StreamEvent::Delta(_)) => later += 1,
            Ok(kiln_runtime::StreamEvent::Done(_)) => break,
            Err(e) => panic!("pool 0's stream failed: {e:?}"),
        }
    }
    assert!(later > 1, "pool 0's stream had ended before pool 1 failed");
    let after = served.call(with_session("Say hi.", 4, &failing)).await;
    assert!(after.is_ok(), "{after:?}");
    let restarts = |pool| pool_count(&metrics.engine.engine_restarts, pool);
    assert_eq!((restarts(0), restarts(1)), (0, 1));
}
