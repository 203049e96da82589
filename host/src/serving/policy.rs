//! Per-tenant policy, checked first in every model call, whether it comes
//! from a guest or from the HTTP API: the models a tenant may call, its
//! tokens-per-minute quota and its cap on calls in flight. Also gives each
//! call its own deadline.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kiln_runtime::{
    AiError, BoxFuture, ChatRequest, CompleteRequest, Completion, Inference, ModelInfo,
    StreamEvent, TokenStream, Usage,
};

use crate::metrics::{EngineMetrics, RejectLabels, TokenLabels};

/// The quota window.
const WINDOW: Duration = Duration::from_secs(60);

/// What a tenant may do with models. Every field is optional; absent means
/// the server's default.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicy {
    /// Models the tenant may call (default: every served model).
    pub allowed_models: Option<Vec<String>>,
    /// Prompt plus completion tokens per minute (default: unlimited).
    pub tokens_per_minute: Option<u64>,
    /// Model calls in flight at once (default: the server's cap).
    pub max_concurrent: Option<u32>,
}

/// A tenant's policy and what it has used.
#[derive(Debug, Default)]
struct TenantState {
    policy: RwLock<TenantPolicy>,
    /// Tokens charged, with when.
    window: Mutex<VecDeque<(Instant, u64)>>,
    inflight: AtomicU32,
}

/// Wraps a model backend with tenant policy and deadlines.
pub struct Gateway {
    inner: Arc<dyn Inference>,
    deadline: Duration,
    default_concurrency: u32,
    tenants: Mutex<HashMap<String, Arc<TenantState>>>,
    metrics: EngineMetrics,
}

/// A call admitted by policy: holds one of the tenant's in-flight slots
/// until dropped, and charges the tokens the call used.
struct Permit {
    state: Arc<TenantState>,
    tenant: String,
    model: String,
    metrics: EngineMetrics,
}

impl Permit {
    fn charge(&self, prompt: u64, completion: u64) {
        let mut w = self.state.window.lock().unwrap_or_else(|p| p.into_inner());
        w.push_back((Instant::now(), prompt + completion));
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            self.metrics
                .tokens
                .get_or_create(&TokenLabels {
                    tenant: self.tenant.clone(),
                    model: self.model.clone(),
                    kind: kind.into(),
                })
                .inc_by(n);
        }
    }

    fn charge_usage(&self, u: &Usage) {
        self.charge(u64::from(u.prompt_tokens), u64::from(u.completion_tokens));
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.state.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gateway {
    /// Wraps `inner`; each call gets `deadline`, and a tenant without its
    /// own cap may have `default_concurrency` calls in flight.
    pub fn new(
        inner: Arc<dyn Inference>,
        deadline: Duration,
        default_concurrency: u32,
        metrics: EngineMetrics,
    ) -> Self {
        Self {
            inner,
            deadline,
            default_concurrency,
            tenants: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    fn state(&self, tenant: &str) -> Arc<TenantState> {
        let mut map = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(tenant.to_owned()).or_default().clone()
    }

    /// Replaces `tenant`'s policy.
    pub fn set_policy(&self, tenant: &str, policy: TenantPolicy) {
        let state = self.state(tenant);
        *state.policy.write().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    /// `tenant`'s policy.
    pub fn policy(&self, tenant: &str) -> TenantPolicy {
        let state = self.state(tenant);
        let p = state.policy.read().unwrap_or_else(|p| p.into_inner());
        p.clone()
    }

    fn reject(&self, tenant: &str, reason: &str, e: AiError) -> AiError {
        self.metrics
            .policy_rejections
            .get_or_create(&RejectLabels {
                tenant: tenant.to_owned(),
                reason: reason.into(),
            })
            .inc();
        e
    }

    /// The policy check every call starts with.
    fn admit(&self, tenant: &str, model: &str) -> Result<Permit, AiError> {
        let state = self.state(tenant);
        let policy = state
            .policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(allowed) = &policy.allowed_models
            && !allowed.iter().any(|m| m == model)
        {
            let e = AiError::ModelNotFound(format!(
                "tenant `{tenant}` may not call model `{model}`; its allowed models are: {} \
                 (the operator sets them with PUT /v1/tenants/{tenant}/policy)",
                allowed.join(", ")
            ));
            return Err(self.reject(tenant, "model_not_allowed", e));
        }
        if let Some(tpm) = policy.tokens_per_minute {
            let now = Instant::now();
            let mut w = state.window.lock().unwrap_or_else(|p| p.into_inner());
            while w.front().is_some_and(|(t, _)| now - *t >= WINDOW) {
                w.pop_front();
            }
            let used: u64 = w.iter().map(|(_, n)| n).sum();
            if used >= tpm {
                let wait = w
                    .front()
                    .map_or(0, |(t, _)| (WINDOW - (now - *t)).as_secs() + 1);
                let e = AiError::QuotaExceeded(format!(
                    "tenant `{tenant}` has used {used} of its {tpm} tokens per minute; retry in \
                     {wait} s, or ask the operator to raise `tokens_per_minute` \
                     (PUT /v1/tenants/{tenant}/policy)"
                ));
                return Err(self.reject(tenant, "tokens_per_minute", e));
            }
        }
        let cap = policy.max_concurrent.unwrap_or(self.default_concurrency);
        let before = state.inflight.fetch_add(1, Ordering::AcqRel);
        let permit = Permit {
            state,
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            metrics: self.metrics.clone(),
        };
        if before >= cap {
            drop(permit);
            let e = AiError::QuotaExceeded(format!(
                "tenant `{tenant}` already has {cap} model calls in flight, its cap; wait for \
                 one to finish, or ask the operator to raise `max_concurrent` \
                 (PUT /v1/tenants/{tenant}/policy)"
            ));
            return Err(self.reject(tenant, "concurrency", e));
        }
        Ok(permit)
    }

    fn deadline_error(&self) -> AiError {
        AiError::Aborted(format!(
            "the model call did not finish within its deadline of {} s; ask for fewer tokens \
             (max-tokens), or ask the operator to raise `--model-deadline-s`",
            self.deadline.as_secs_f64()
        ))
    }

    async fn finish(
        &self,
        permit: Permit,
        call: BoxFuture<'_, Result<Completion, AiError>>,
    ) -> Result<Completion, AiError> {
        let out = tokio::time::timeout(self.deadline, call)
            .await
            .map_err(|_| self.deadline_error())?;
        if let Ok(c) = &out {
            permit.charge_usage(&c.usage);
        }
        out
    }

    async fn stream(
        &self,
        permit: Permit,
        call: BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>>,
    ) -> Result<Box<dyn TokenStream>, AiError> {
        let until = tokio::time::Instant::now() + self.deadline;
        let inner = tokio::time::timeout_at(until, call)
            .await
            .map_err(|_| self.deadline_error())??;
        Ok(Box::new(Guarded {
            inner,
            permit,
            until,
            expired: self.deadline_error(),
            deltas: 0,
            charged: false,
        }))
    }
}

/// A stream under its call's deadline, holding the call's permit.
struct Guarded {
    inner: Box<dyn TokenStream>,
    permit: Permit,
    until: tokio::time::Instant,
    expired: AiError,
    /// Deltas seen: the charge if the stream is dropped before its end.
    deltas: u64,
    charged: bool,
}

impl TokenStream for Guarded {
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(async move {
            let ev = tokio::time::timeout_at(self.until, self.inner.next())
                .await
                .map_err(|_| self.expired.clone())?;
            match &ev {
                Ok(StreamEvent::Delta(_)) => self.deltas += 1,
                Ok(StreamEvent::Done(end)) if !self.charged => {
                    self.charged = true;
                    self.permit.charge_usage(&end.usage);
                }
                _ => {}
            }
            ev
        })
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if !self.charged {
            // Ended early: charge the tokens that were generated.
            self.permit.charge(0, self.deltas);
        }
    }
}

impl Inference for Gateway {
    fn chat(&self, req: ChatRequest) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async move {
            let permit = self.admit(&req.tenant, &req.model)?;
            self.finish(permit, self.inner.chat(req)).await
        })
    }

    fn stream_chat(
        &self,
        req: ChatRequest,
    ) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async move {
            let permit = self.admit(&req.tenant, &req.model)?;
            self.stream(permit, self.inner.stream_chat(req)).await
        })
    }

    fn complete(&self, req: CompleteRequest) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async move {
            let permit = self.admit(&req.tenant, &req.model)?;
            self.finish(permit, self.inner.complete(req)).await
        })
    }

    fn stream_complete(
        &self,
        req: CompleteRequest,
    ) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async move {
            let permit = self.admit(&req.tenant, &req.model)?;
            self.stream(permit, self.inner.stream_complete(req)).await
        })
    }

    fn list_models(&self, tenant: &str) -> Vec<ModelInfo> {
        let policy = self.policy(tenant);
        let mut all = self.inner.list_models(tenant);
        if let Some(allowed) = policy.allowed_models {
            all.retain(|m| allowed.contains(&m.id));
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_runtime::{FinishReason, NoModels, Params};

    /// Answers every call with `tokens` completion tokens.
    struct Fixed(u32);

    impl Inference for Fixed {
        fn chat(&self, _: ChatRequest) -> BoxFuture<'_, Result<Completion, AiError>> {
            let n = self.0;
            Box::pin(async move {
                Ok(Completion {
                    text: "ok".into(),
                    finish_reason: FinishReason::Stop,
                    usage: Usage {
                        prompt_tokens: 0,
                        completion_tokens: n,
                        cached_prompt_tokens: 0,
                    },
                })
            })
        }
        fn stream_chat(
            &self,
            r: ChatRequest,
        ) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
            NoModels.stream_chat(r)
        }
        fn complete(&self, r: CompleteRequest) -> BoxFuture<'_, Result<Completion, AiError>> {
            NoModels.complete(r)
        }
        fn list_models(&self, _: &str) -> Vec<ModelInfo> {
            ["a", "b"]
                .map(|id| ModelInfo {
                    id: id.into(),
                    context_length: 1,
                })
                .to_vec()
        }
    }

    fn req(tenant: &str, model: &str) -> ChatRequest {
        ChatRequest {
            tenant: tenant.into(),
            model: model.into(),
            messages: Vec::new(),
            params: Params {
                max_tokens: None,
                temperature: None,
                top_p: None,
                top_k: None,
                seed: None,
                stop: Vec::new(),
                session: None,
            },
        }
    }

    fn gateway(tokens: u32, cap: u32) -> Gateway {
        Gateway::new(
            Arc::new(Fixed(tokens)),
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
        assert!(g.chat(req("a", "a")).await.is_ok());
        assert!(g.chat(req("a", "a")).await.is_ok(), "30 < 50: admitted");
        let e = g.chat(req("a", "a")).await.unwrap_err();
        assert!(
            matches!(&e, AiError::QuotaExceeded(m) if m.contains("tokens_per_minute")),
            "{e:?}"
        );
        assert!(
            g.chat(req("b", "a")).await.is_ok(),
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
        let e = g.chat(req("a", "a")).await.unwrap_err();
        assert!(matches!(e, AiError::ModelNotFound(_)));
        assert!(g.chat(req("a", "b")).await.is_ok());
        let ids: Vec<String> = g.list_models("a").into_iter().map(|m| m.id).collect();
        assert_eq!(ids, vec!["b".to_owned()]);
        assert_eq!(g.list_models("c").len(), 2, "default: every model");
    }

    #[tokio::test]
    async fn concurrency_cap_counts_calls_in_flight_and_frees_on_drop() {
        let g = gateway(1, 2);
        let p1 = g.admit("a", "m").unwrap();
        let _p2 = g.admit("a", "m").unwrap();
        assert!(matches!(g.admit("a", "m"), Err(AiError::QuotaExceeded(_))));
        drop(p1);
        assert!(g.admit("a", "m").is_ok());
    }
}
