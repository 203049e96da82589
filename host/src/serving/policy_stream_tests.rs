//! What streams that end early, or never start, pay: the engine's own
//! count where it gave one, and the prompt as the model counted it.

use super::tests::{Fixed, gateway, quota, req, streamed, with_max_tokens};
use super::*;
use kiln_runtime::StreamEvent;

/// Serves each call as an engine that ran ahead of its reader: `texts`
/// deltas waiting in the call's channel, then, if `done`, its end (12
/// prompt tokens), or if `aborted` an abort after ten more tokens that
/// made no text; its stream knows its prompt's tokens if `prompt` says.
struct RanAhead {
    texts: usize,
    done: bool,
    aborted: bool,
    prompt: Option<usize>,
}

impl Inference for RanAhead {
    fn call(&self, call: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        streamed(self, call)
    }
    fn stream(&self, _: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        use super::super::engine_thread::Out;
        use super::super::stream::Stream;
        let (mut txs, mut rxs) = super::super::outlet::outlets(1, usize::MAX);
        let (tx, rx) = (txs.remove(0), rxs.remove(0));
        for _ in 0..self.texts {
            let _ = tx.send(Out::Text("x".into(), Vec::new()));
        }
        if self.done || self.aborted {
            use kiln_engine::engine::Finish;
            let (finish, silent) = match self.aborted {
                true => (Finish::Aborted("cut".into()), 10),
                false => (Finish::Length, 0),
            };
            let (prompt, completion, cached) = (12, self.texts + silent, 0);
            let _ = tx.send(Out::Done {
                finish,
                prompt,
                completion,
                cached,
            });
        }
        let s = Stream::new(rx, false, None, self.prompt);
        Box::pin(async { Ok(Box::new(s) as Box<dyn TokenStream>) })
    }
    fn list_models(&self, _: &str) -> Vec<ModelInfo> {
        Fixed {
            tokens: 0,
            gate: None,
        }
        .list_models("")
    }
}

#[tokio::test]
async fn a_stream_dropped_unread_pays_for_every_token_the_engine_generated() {
    for done in [true, false] {
        let backend = Arc::new(RanAhead {
            texts: 40,
            done,
            aborted: false,
            prompt: None,
        });
        let g = Gateway::new(backend, Duration::from_secs(5), 8, EngineMetrics::default());
        let r = with_max_tokens(req("a", "a"), 100);
        let prompt = Cost::of_call(&r).prompt;
        let mut s = g.stream(r).await.unwrap();
        for _ in 0..2 {
            assert!(matches!(s.next().await, Ok(StreamEvent::Delta(_))));
        }
        drop(s);
        let u = g.usage("a");
        let (paid, why) = match done {
            true => (12 + 40, "the usage of the end it left unread"),
            false => (prompt + 40, "its prompt and the 2 + 38 deltas generated"),
        };
        assert_eq!(u.tokens_last_minute, paid, "{why}");
        assert_eq!((u.tokens_reserved, u.calls_in_flight), (0, 0));
    }
}

#[tokio::test]
async fn an_aborted_stream_pays_for_what_the_engine_says_it_generated() {
    let backend = Arc::new(RanAhead {
        texts: 40,
        done: false,
        aborted: true,
        prompt: None,
    });
    let g = Gateway::new(backend, Duration::from_secs(5), 8, EngineMetrics::default());
    let mut s = g.stream(with_max_tokens(req("a", "a"), 100)).await.unwrap();
    let mut deltas = 0;
    let end = loop {
        match s.next().await {
            Ok(StreamEvent::Delta(_)) => deltas += 1,
            other => break other,
        }
    };
    assert!(matches!(end, Err(AiError::Aborted(_))), "{end:?}");
    assert_eq!(deltas, 40);
    // The 40 tokens read and the 10 that made no text, and the prompt.
    assert_eq!(g.usage("a").tokens_last_minute, 12 + 50);
}

#[tokio::test]
async fn an_abort_before_any_text_pays_what_the_engine_says_it_used() {
    let backend = Arc::new(RanAhead {
        texts: 0,
        done: false,
        aborted: true,
        prompt: None,
    });
    let g = Gateway::new(backend, Duration::from_secs(5), 8, EngineMetrics::default());
    let mut s = g.stream(with_max_tokens(req("a", "a"), 100)).await.unwrap();
    let end = s.next().await;
    assert!(matches!(end, Err(AiError::Aborted(_))), "{end:?}");
    // The prompt the engine ran and the ten tokens that made no text.
    assert_eq!(g.usage("a").tokens_last_minute, 12 + 10);
}

#[tokio::test]
async fn a_stream_cut_part_way_pays_the_prompt_as_the_model_counted_it() {
    let backend = Arc::new(RanAhead {
        texts: 40,
        done: false,
        aborted: false,
        prompt: Some(30),
    });
    let g = Gateway::new(backend, Duration::from_secs(5), 8, EngineMetrics::default());
    let r = with_max_tokens(req("a", "a"), 100);
    assert_ne!(Cost::of_call(&r).prompt, 30, "the estimate differs");
    let mut s = g.stream(r).await.unwrap();
    for _ in 0..2 {
        assert!(matches!(s.next().await, Ok(StreamEvent::Delta(_))));
    }
    drop(s);
    let u = g.usage("a");
    assert_eq!(u.tokens_last_minute, 30 + 40);
    assert_eq!(u.models[0].prompt_tokens, 30);
}

#[tokio::test]
async fn samples_that_together_pass_the_whole_quota_are_refused_as_one_call() {
    let g = gateway(1, 8);
    quota(&g, "a", 100);
    // Each of three samples of 40 fits; the three do not.
    let e = g
        .stream_samples(with_max_tokens(req("a", "a"), 40), 3)
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(&e, AiError::QuotaExceeded(m) if m.contains("whole quota") && m.contains("n = 3")),
        "{e:?}"
    );
    let u = g.usage("a");
    assert_eq!((u.tokens_reserved, u.calls_in_flight), (0, 0));
    assert!(
        g.stream_samples(with_max_tokens(req("a", "a"), 30), 3)
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn a_tenant_of_no_calls_in_flight_streaming_is_refused_as_over_its_cap() {
    let g = gateway(1, 0);
    let e = g
        .stream_samples(req("a", "a"), 1)
        .await
        .err()
        .expect("refused");
    assert!(matches!(&e, AiError::QuotaExceeded(_)), "{e:?}");
    let e = g.call(req("a", "a")).await.unwrap_err();
    assert!(matches!(&e, AiError::QuotaExceeded(_)), "{e:?}");
}

#[tokio::test]
async fn samples_of_a_model_the_tenant_may_not_call_are_refused_for_that_before_the_quota() {
    let g = gateway(1, 8);
    g.set_policy(
        "a",
        TenantPolicy {
            tokens_per_minute: Some(100),
            allowed_models: Some(vec!["b".into()]),
            ..Default::default()
        },
    );
    // More samples than whole quota, or than calls in flight (8): the
    // model is what is wrong.
    for n in [3, 20] {
        let e = g
            .stream_samples(with_max_tokens(req("a", "a"), 40), n)
            .await
            .err()
            .expect("refused");
        assert!(matches!(&e, AiError::ModelNotFound(_)), "n = {n}: {e:?}");
    }
}
