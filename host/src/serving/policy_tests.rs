use super::*;
use kiln_runtime::{FinishReason, Message, Params, Prompt, Role, StreamEvent};

/// Answers every call with `tokens` completion tokens (after `gate`
/// opens, when there is one): a stream of that many one-token deltas,
/// then its end.
pub(super) struct Fixed {
    pub(super) tokens: u32,
    pub(super) gate: Option<Arc<tokio::sync::Semaphore>>,
}

/// `Fixed`'s stream.
struct Counted {
    tokens: u32,
    sent: u32,
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl TokenStream for Counted {
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(async move {
            if let Some(gate) = &self.gate {
                let _ = gate.acquire().await;
            }
            if self.sent == self.tokens {
                return Ok(StreamEvent::Done(kiln_runtime::StreamEnd {
                    finish_reason: FinishReason::Stop,
                    usage: Usage {
                        prompt_tokens: 0,
                        completion_tokens: self.tokens,
                        cached_prompt_tokens: 0,
                    },
                    tool_calls: Vec::new(),
                }));
            }
            self.sent += 1;
            Ok(StreamEvent::Delta("x".into()))
        })
    }
}

/// `backend`'s call as the engine makes it: its stream read to the end.
pub(super) fn streamed(
    backend: &dyn Inference,
    call: ModelCall,
) -> BoxFuture<'_, Result<Completion, AiError>> {
    Box::pin(async move {
        let mut s = backend.stream(call).await?;
        kiln_runtime::complete_stream(s.as_mut()).await
    })
}

impl Inference for Fixed {
    fn call(&self, call: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        streamed(self, call)
    }
    fn stream(&self, _: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        let s = Counted {
            tokens: self.tokens,
            sent: 0,
            gate: self.gate.clone(),
        };
        Box::pin(async { Ok(Box::new(s) as Box<dyn TokenStream>) })
    }
    fn list_models(&self, _: &str) -> Vec<ModelInfo> {
        [("a", 4096), ("b", 4)]
            .map(|(id, context_length)| ModelInfo {
                id: id.into(),
                context_length,
            })
            .to_vec()
    }
}

pub(super) fn req(tenant: &str, model: &str) -> ModelCall {
    ModelCall {
        tenant: tenant.into(),
        model: model.into(),
        prompt: Prompt::Chat(Vec::new()),
        params: Params::defaults(),
    }
}

pub(super) fn with_max_tokens(mut r: ModelCall, n: u32) -> ModelCall {
    r.params.max_tokens = Some(n);
    r
}

pub(super) fn quota(g: &Gateway, tenant: &str, tpm: u64) {
    g.set_policy(
        tenant,
        TenantPolicy {
            tokens_per_minute: Some(tpm),
            ..Default::default()
        },
    );
}

pub(super) fn gateway(tokens: u32, cap: u32) -> Gateway {
    Gateway::new(
        Arc::new(Fixed { tokens, gate: None }),
        Duration::from_secs(5),
        cap,
        EngineMetrics::default(),
    )
}

#[tokio::test]
async fn tokens_per_minute_quota_refuses_calls_once_used_up() {
    let g = gateway(30, 8);
    g.set_policy(
        "a",
        TenantPolicy {
            tokens_per_minute: Some(50),
            ..Default::default()
        },
    );
    let call = || with_max_tokens(req("a", "a"), 20);
    assert!(g.call(call()).await.is_ok());
    assert!(
        g.call(call()).await.is_ok(),
        "30 used + 20 reserved <= 50: admitted"
    );
    let e = g.call(call()).await.unwrap_err();
    assert!(
        matches!(&e, AiError::QuotaExceeded(m) if m.contains("tokens_per_minute")),
        "{e:?}"
    );
    assert!(
        g.call(with_max_tokens(req("b", "a"), 20)).await.is_ok(),
        "other tenants are unaffected"
    );
}

#[tokio::test]
async fn allowed_models_limit_calls_and_the_model_list() {
    let g = gateway(1, 8);
    g.set_policy(
        "a",
        TenantPolicy {
            allowed_models: Some(vec!["b".into()]),
            ..Default::default()
        },
    );
    let e = g.call(req("a", "a")).await.unwrap_err();
    assert!(matches!(e, AiError::ModelNotFound(_)));
    assert!(g.call(req("a", "b")).await.is_ok());
    let ids: Vec<String> = g.list_models("a").into_iter().map(|m| m.id).collect();
    assert_eq!(ids, vec!["b".to_owned()]);
    assert_eq!(g.list_models("c").len(), 2, "default: every model");
}

#[tokio::test]
async fn concurrency_cap_counts_calls_in_flight_and_frees_on_drop() {
    let g = gateway(1, 2);
    let cost = Cost::of(0, 0, Some(1));
    let p1 = g.admit("a", "m", cost).unwrap();
    let _p2 = g.admit("a", "m", cost).unwrap();
    assert!(matches!(
        g.admit("a", "m", cost),
        Err(AiError::QuotaExceeded(_))
    ));
    drop(p1);
    assert!(g.admit("a", "m", cost).is_ok());
}

#[tokio::test]
async fn calls_in_flight_hold_their_reservation_against_the_quota() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = Arc::new(Gateway::new(
        Arc::new(Fixed {
            tokens: 30,
            gate: Some(gate.clone()),
        }),
        Duration::from_secs(5),
        8,
        EngineMetrics::default(),
    ));
    quota(&g, "a", 100);
    let first = tokio::spawn({
        let g = g.clone();
        async move { g.call(with_max_tokens(req("a", "a"), 60)).await }
    });
    while g.usage("a").calls_in_flight == 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(g.usage("a").tokens_reserved, 60);
    let e = g
        .call(with_max_tokens(req("a", "a"), 60))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AiError::QuotaExceeded(m) if m.contains("reserved 60")),
        "{e:?}"
    );
    gate.add_permits(8);
    first.await.unwrap().unwrap();
    let u = g.usage("a");
    assert_eq!(
        (u.tokens_last_minute, u.tokens_reserved),
        (30, 0),
        "settled at what it used"
    );
    assert!(g.call(with_max_tokens(req("a", "a"), 60)).await.is_ok());
}

#[tokio::test]
async fn a_call_larger_than_the_whole_quota_is_refused_naming_max_tokens() {
    let g = gateway(1, 8);
    quota(&g, "a", 100);
    let e = g.call(req("a", "a")).await.unwrap_err();
    assert!(
        matches!(&e, AiError::QuotaExceeded(m) if m.contains("max-tokens 256")),
        "{e:?}"
    );
    assert_eq!(g.usage("a").tokens_reserved, 0);
}

#[tokio::test]
async fn a_stream_dropped_early_pays_its_prompt_and_the_tokens_it_received() {
    let g = gateway(50, 8);
    let mut r = with_max_tokens(req("a", "a"), 100);
    r.prompt = Prompt::Chat(vec![Message::text(Role::User, "x".repeat(30))]);
    let prompt = Cost::of_call(&r).prompt;
    let mut s = g.stream(r).await.unwrap();
    for _ in 0..3 {
        assert!(matches!(s.next().await, Ok(StreamEvent::Delta(_))));
    }
    drop(s);
    let u = g.usage("a");
    assert_eq!(u.tokens_last_minute, prompt + 3);
    assert_eq!(u.tokens_reserved, 0);
    assert_eq!(u.calls_in_flight, 0);
    assert_eq!(u.models[0].completion_tokens, 3);
}

/// Streams that the engine refuses before their first token.
struct Refused;

impl TokenStream for Refused {
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(async { Err(AiError::InvalidInput("the schema does not compile".into())) })
    }
}

impl Inference for Refused {
    fn call(&self, _: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async { Err(AiError::InvalidInput("the schema does not compile".into())) })
    }
    fn stream(&self, _: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async { Ok(Box::new(Refused) as Box<dyn TokenStream>) })
    }
    fn list_models(&self, _: &str) -> Vec<ModelInfo> {
        Vec::new()
    }
}

#[tokio::test]
async fn a_stream_refused_before_its_first_token_is_free() {
    let g = Gateway::new(
        Arc::new(Refused),
        Duration::from_secs(5),
        8,
        EngineMetrics::default(),
    );
    quota(&g, "a", 1000);
    let mut r = with_max_tokens(req("a", "a"), 100);
    r.prompt = Prompt::Chat(vec![Message::text(Role::User, "x".repeat(30))]);
    let mut s = g.stream(r).await.unwrap();
    assert!(matches!(s.next().await, Err(AiError::InvalidInput(_))));
    drop(s);
    let u = g.usage("a");
    assert_eq!((u.tokens_last_minute, u.tokens_reserved), (0, 0));
    assert_eq!(u.calls_in_flight, 0);
}

/// Streams `deltas` one-token deltas, counting them in `sent`, then waits
/// forever.
struct Stalls {
    deltas: u32,
    sent: Arc<std::sync::atomic::AtomicU32>,
}

struct Stalled {
    left: u32,
    sent: Arc<std::sync::atomic::AtomicU32>,
}

impl TokenStream for Stalled {
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(async move {
            if self.left == 0 {
                std::future::pending::<()>().await;
            }
            self.left -= 1;
            self.sent.fetch_add(1, Ordering::AcqRel);
            Ok(StreamEvent::Delta("x".into()))
        })
    }
}

impl Inference for Stalls {
    fn call(&self, call: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        streamed(self, call)
    }
    fn stream(&self, _: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        let s = Stalled {
            left: self.deltas,
            sent: self.sent.clone(),
        };
        Box::pin(async { Ok(Box::new(s) as Box<dyn TokenStream>) })
    }
    fn list_models(&self, _: &str) -> Vec<ModelInfo> {
        Vec::new()
    }
}

/// A gateway over [`Stalls`] of three deltas, its counter, and a call of
/// a 30-character prompt with its prompt's cost.
fn stalling(
    deadline: Duration,
) -> (
    Arc<Gateway>,
    Arc<std::sync::atomic::AtomicU32>,
    ModelCall,
    u64,
) {
    let sent = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let g = Gateway::new(
        Arc::new(Stalls {
            deltas: 3,
            sent: sent.clone(),
        }),
        deadline,
        8,
        EngineMetrics::default(),
    );
    let mut r = with_max_tokens(req("a", "a"), 40);
    r.prompt = Prompt::Chat(vec![Message::text(Role::User, "x".repeat(30))]);
    let prompt = Cost::of_call(&r).prompt;
    (Arc::new(g), sent, r, prompt)
}

#[tokio::test]
async fn a_call_past_its_deadline_pays_its_prompt_and_the_tokens_it_generated() {
    let (g, _, r, prompt) = stalling(Duration::from_millis(20));
    let e = g.call(r).await.unwrap_err();
    assert!(matches!(e, AiError::Aborted(_)), "{e:?}");
    let u = g.usage("a");
    assert_eq!((u.tokens_last_minute, u.tokens_reserved), (prompt + 3, 0));
}

#[tokio::test]
async fn a_call_dropped_part_way_pays_its_prompt_and_the_tokens_it_generated() {
    let (g, sent, r, prompt) = stalling(Duration::from_secs(30));
    let call = tokio::spawn({
        let g = g.clone();
        async move { g.call(r).await }
    });
    while sent.load(Ordering::Acquire) < 3 {
        tokio::task::yield_now().await;
    }
    // Its client leaves: the handler's future is dropped.
    call.abort();
    let _ = call.await;
    let u = g.usage("a");
    assert_eq!((u.tokens_last_minute, u.tokens_reserved), (prompt + 3, 0));
    assert_eq!(u.calls_in_flight, 0);
}

/// Records the share weights it is given; serves nothing.
#[derive(Default)]
struct Weights(Mutex<Vec<(String, u32)>>);

impl Inference for Weights {
    fn call(&self, _: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async { Err(AiError::RuntimeError("no models".into())) })
    }
    fn stream(&self, _: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async { Err(AiError::RuntimeError("no models".into())) })
    }
    fn list_models(&self, _: &str) -> Vec<ModelInfo> {
        Vec::new()
    }
    fn set_share_weight(&self, tenant: &str, weight: u32) {
        self.0.lock().unwrap().push((tenant.into(), weight));
    }
}

#[test]
fn a_policys_weight_reaches_the_backend_and_an_unset_one_is_one() {
    let inner = Arc::new(Weights::default());
    let g = Gateway::new(
        inner.clone(),
        Duration::from_secs(5),
        4,
        EngineMetrics::default(),
    );
    let heavy = TenantPolicy {
        weight: Some(3),
        ..Default::default()
    };
    g.set_policy("a", heavy);
    g.set_policy("b", TenantPolicy::default());
    let seen = inner.0.lock().unwrap().clone();
    assert_eq!(seen, [("a".to_string(), 3), ("b".to_string(), 1)]);
}

#[tokio::test]
async fn samples_of_one_call_hold_a_slot_each_and_reserve_their_prompt_once() {
    let g = gateway(1, 3);
    let mut r = with_max_tokens(req("a", "a"), 10);
    r.prompt = Prompt::Chat(vec![Message::text(Role::User, "x".repeat(30))]);
    let prompt = Cost::of_call(&r).prompt;
    let e = g.stream_samples(r.clone(), 4).await.err().unwrap();
    assert!(
        matches!(&e, AiError::InvalidInput(m) if m.contains("at most 3")),
        "{e:?}"
    );
    assert_eq!(g.usage("a").calls_in_flight, 0, "nothing admitted");
    let streams = g.stream_samples(r, 3).await.unwrap();
    let u = g.usage("a");
    assert_eq!(u.calls_in_flight, 3);
    assert_eq!(u.tokens_reserved, prompt + 3 * 10);
    // Dropped after nothing arrived: the prompt is paid once.
    drop(streams);
    let u = g.usage("a");
    assert_eq!((u.tokens_last_minute, u.tokens_reserved), (prompt, 0));
}

#[tokio::test]
async fn calls_to_models_nobody_serves_leave_no_metric_series() {
    let metrics = crate::metrics::Metrics::default();
    let g = Gateway::new(
        Arc::new(kiln_runtime::NoModels),
        Duration::from_secs(5),
        8,
        metrics.engine.clone(),
    );
    for i in 0..20 {
        let e = g.call(req("a", &format!("made-up-{i}"))).await.unwrap_err();
        assert!(matches!(e, AiError::ModelNotFound(_)), "{e:?}");
    }
    let long = "m".repeat(MAX_MODEL_NAME + 1);
    match g.call(req("a", &long)).await {
        Err(AiError::InvalidInput(m)) => assert!(m.contains("at most 256"), "{m}"),
        other => panic!("a model name past the limit must be refused: {other:?}"),
    }
    let text = metrics.encode();
    assert!(!text.contains("made-up"), "{text}");
    assert!(!text.contains(&long));
}

#[tokio::test]
async fn samples_of_a_call_dropped_part_way_pay_for_every_samples_tokens() {
    let (g, sent, r, prompt) = stalling(Duration::from_secs(30));
    let call = tokio::spawn({
        let g = g.clone();
        async move {
            let streams = g.stream_samples(r, 2).await?;
            kiln_runtime::complete_samples(streams).await
        }
    });
    // Both samples' three tokens are read before either sample ends.
    let both = tokio::time::timeout(Duration::from_secs(5), async {
        while sent.load(Ordering::Acquire) < 6 {
            tokio::task::yield_now().await;
        }
    });
    assert!(
        both.await.is_ok(),
        "read {} tokens",
        sent.load(Ordering::Acquire)
    );
    call.abort();
    let _ = call.await;
    let u = g.usage("a");
    assert_eq!((u.tokens_last_minute, u.tokens_reserved), (prompt + 6, 0));
    assert_eq!(u.calls_in_flight, 0);
}

#[tokio::test]
async fn a_call_reserves_no_more_than_its_models_context_whatever_its_max_tokens() {
    // Fixed's model `b` has a context of four tokens.
    let g = gateway(1, 8);
    quota(&g, "a", 100);
    let r = with_max_tokens(req("a", "b"), u32::MAX);
    let c = g.call(r).await.unwrap();
    assert_eq!(c.usage.completion_tokens, 1);
    assert_eq!(g.usage("a").tokens_last_minute, 1);
}

#[tokio::test]
async fn calls_that_use_nothing_leave_no_charge_behind_without_a_quota() {
    // A tenant without a quota never has its window read at admission: a
    // loop of calls that use nothing must not grow it.
    let g = gateway(0, 8);
    for _ in 0..1000 {
        assert!(g.call(req("a", "a")).await.is_ok());
    }
    let charges = g.state("a").quota.lock().unwrap().window.len();
    assert_eq!(charges, 0);
}
