//! Per-tenant policy, checked first in every model call, whether it comes
//! from a guest or from the HTTP API: the models a tenant may call, its
//! tokens-per-minute quota and its cap on calls in flight. Also gives each
//! call its own deadline.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kiln_runtime::{
    AiError, BoxFuture, Completion, Inference, ModelCall, ModelInfo, TokenStream, Usage,
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
    /// Function instances in flight at once (default: the server's share
    /// of its instance pool, `--tenant-instance-share`).
    pub max_instances: Option<u32>,
    /// Functions deployed at once (default: the server's `--max-functions`).
    pub max_functions: Option<u32>,
    /// Weight of the tenant's share of a shared GPU (running slots and
    /// prompt tokens) while tenants compete, 1 to [`MAX_WEIGHT`] (default
    /// 1): a tenant of weight 3 beside one of weight 1 gets three quarters.
    pub weight: Option<u32>,
}

/// How the error of a call stopped at its deadline begins.
pub const DEADLINE_EXCEEDED: &str = "the model call did not finish within its deadline";

/// The largest share weight a policy may give.
pub const MAX_WEIGHT: u32 = 1000;

/// A tenant's policy and what it has used.
#[derive(Debug, Default)]
struct TenantState {
    policy: RwLock<TenantPolicy>,
    quota: Mutex<Quota>,
    inflight: AtomicU32,
    /// What the tenant holds on the other nodes of a cluster: tokens
    /// (charged in the last minute plus reserved) and calls in flight.
    remote: Mutex<(u64, u32)>,
}

/// Tokens charged in the window, and tokens reserved by calls in flight.
#[derive(Debug, Default)]
struct Quota {
    /// Tokens charged, with when.
    window: VecDeque<(Instant, u64)>,
    reserved: u64,
}

impl Quota {
    /// Tokens charged in the last minute, dropping older charges.
    fn used(&mut self, now: Instant) -> u64 {
        self.prune(now);
        self.window.iter().map(|(_, n)| n).sum()
    }

    /// Drops the charges older than the window.
    fn prune(&mut self, now: Instant) {
        while self.window.front().is_some_and(|(t, _)| now - *t >= WINDOW) {
            self.window.pop_front();
        }
    }

    /// Charges `tokens` now. Older charges go as new ones come, so the
    /// window holds at most a minute's calls whether or not anything
    /// reads it (a tenant without a quota), and a call that used nothing
    /// adds nothing.
    fn charge(&mut self, tokens: u64) {
        let now = Instant::now();
        self.prune(now);
        if tokens > 0 {
            self.window.push_back((now, tokens));
        }
    }

    /// Seconds until the oldest charge leaves the window (at least one: a
    /// call blocked by reservations alone waits for calls in flight).
    fn wait(&self, now: Instant) -> u64 {
        self.window
            .front()
            .map_or(1, |(t, _)| (WINDOW - (now - *t)).as_secs() + 1)
    }
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
/// and its reservation against the quota until it is settled with what
/// the call used. Dropped unsettled, the call pays its prompt estimate.
struct Permit {
    state: Arc<TenantState>,
    tenant: String,
    model: String,
    metrics: EngineMetrics,
    cost: Cost,
    settled: bool,
    /// A later sample of a call: the first one pays the shared prompt.
    shares_prompt: bool,
}

impl Permit {
    /// Releases the reservation and charges `prompt + completion` tokens.
    fn settle(&mut self, prompt: u64, completion: u64) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let prompt = if self.shares_prompt { 0 } else { prompt };
        let mut q = self.state.quota.lock().unwrap_or_else(|p| p.into_inner());
        q.reserved = q.reserved.saturating_sub(self.cost.total());
        q.charge(prompt + completion);
        drop(q);
        // A call that used nothing adds no series: its model may be any
        // name a caller made up, and each series lives as long as the server.
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            if n == 0 {
                continue;
            }
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

    fn settle_usage(&mut self, u: &Usage) {
        self.settle(u64::from(u.prompt_tokens), u64::from(u.completion_tokens));
    }

    /// Settles a call that failed with `e`: refused before any work, it is
    /// free; otherwise its prompt was read.
    fn settle_error(&mut self, e: &AiError) {
        match refused_up_front(e) {
            true => self.settle(0, 0),
            false => self.settle(self.cost.prompt, 0),
        }
    }
}

/// Whether `e` refuses a call before the model does any work for it.
fn refused_up_front(e: &AiError) -> bool {
    matches!(
        e,
        AiError::ModelNotFound(_) | AiError::InvalidInput(_) | AiError::Overloaded(_)
    )
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.settle(self.cost.prompt, 0);
        self.state.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a tenant has used, as `GET /v1/usage` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TenantUsage {
    /// Tokens charged in the last minute.
    pub tokens_last_minute: u64,
    /// Tokens reserved by calls in flight.
    pub tokens_reserved: u64,
    /// The tenant's tokens-per-minute quota, if it has one.
    pub tokens_per_minute: Option<u64>,
    /// Model calls in flight.
    pub calls_in_flight: u32,
    /// Its cap on calls in flight.
    pub max_concurrent: u32,
    /// Tokens used since the server started, by model.
    pub models: Vec<ModelUsage>,
}

/// Tokens one tenant used on one model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ModelUsage {
    /// The model.
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
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
        self.inner
            .set_share_weight(tenant, policy.weight.unwrap_or(1));
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

    /// The policy check every call starts with: the model, the cap on
    /// calls in flight, then the quota, against which `cost` is reserved.
    /// Most model calls `tenant` may have in flight.
    fn concurrency_cap(&self, tenant: &str) -> u32 {
        let state = self.state(tenant);
        let policy = state.policy.read().unwrap_or_else(|p| p.into_inner());
        policy.max_concurrent.unwrap_or(self.default_concurrency)
    }

    /// Refuses a call to `model` that no quota need weigh: a name past
    /// [`MAX_MODEL_NAME`], or a model `policy` does not allow.
    fn check_model(&self, tenant: &str, model: &str, policy: &TenantPolicy) -> Result<(), AiError> {
        if model.len() > MAX_MODEL_NAME {
            let e = AiError::InvalidInput(format!(
                "the model's name is {} bytes; a model's name has at most {MAX_MODEL_NAME} \
                 (GET /v1/models lists them)",
                model.len()
            ));
            return Err(self.reject(tenant, "model_name", e));
        }
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
        Ok(())
    }

    fn admit(&self, tenant: &str, model: &str, cost: Cost) -> Result<Permit, AiError> {
        let state = self.state(tenant);
        let policy = state
            .policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        self.check_model(tenant, model, &policy)?;
        let cost = self.capped(tenant, model, cost);
        let cap = policy.max_concurrent.unwrap_or(self.default_concurrency);
        let (_, remote_inflight) = *state.remote.lock().unwrap_or_else(|p| p.into_inner());
        if state.inflight.fetch_add(1, Ordering::AcqRel) + remote_inflight >= cap {
            state.inflight.fetch_sub(1, Ordering::AcqRel);
            let e = AiError::QuotaExceeded(format!(
                "tenant `{tenant}` already has {cap} model calls in flight, its cap; wait for \
                 one to finish, or ask the operator to raise `max_concurrent` \
                 (PUT /v1/tenants/{tenant}/policy)"
            ));
            return Err(self.reject(tenant, "concurrency", e));
        }
        if let Err(e) = Self::reserve(&state, tenant, policy.tokens_per_minute, cost) {
            state.inflight.fetch_sub(1, Ordering::AcqRel);
            return Err(self.reject(tenant, "tokens_per_minute", e));
        }
        Ok(Permit {
            state,
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            metrics: self.metrics.clone(),
            cost,
            settled: false,
            shares_prompt: false,
        })
    }

    /// `cost` of a call to `model`: a call never generates past its model's
    /// context, so it reserves no more than that whatever max-tokens it
    /// gives.
    fn capped(&self, tenant: &str, model: &str, mut cost: Cost) -> Cost {
        if let Some(m) = (self.inner.list_models(tenant).iter()).find(|m| m.id == model) {
            cost.completion = cost.completion.min(u64::from(m.context_length));
        }
        cost
    }

    /// Reserves `cost`: always without a quota, and with one (`tpm`) if
    /// the tokens charged in the last minute, those reserved by calls in
    /// flight and `cost` fit in it.
    fn reserve(
        state: &TenantState,
        tenant: &str,
        tpm: Option<u64>,
        cost: Cost,
    ) -> Result<(), AiError> {
        let now = Instant::now();
        let (remote, _) = *state.remote.lock().unwrap_or_else(|p| p.into_inner());
        let mut q = state.quota.lock().unwrap_or_else(|p| p.into_inner());
        let need = cost.total();
        if let Some(tpm) = tpm {
            // Tokens other nodes charged or hold count as used here.
            let used = q.used(now) + remote;
            if let Some(e) = past_whole_quota(tenant, tpm, cost, 1) {
                return Err(e);
            }
            if used + q.reserved + need > tpm {
                return Err(AiError::QuotaExceeded(format!(
                    "tenant `{tenant}` has used {used} and reserved {} of its {tpm} tokens per \
                     minute, and this call may use {need} (prompt and max-tokens); retry in {} s, \
                     ask for fewer tokens, or ask the operator to raise `tokens_per_minute` \
                     (PUT /v1/tenants/{tenant}/policy)",
                    q.reserved,
                    q.wait(now)
                )));
            }
        }
        q.reserved += need;
        Ok(())
    }

    /// What `tenant` has used: its quota window, reservations, calls in
    /// flight and tokens by model since start.
    pub fn usage(&self, tenant: &str) -> TenantUsage {
        let state = self.state(tenant);
        let policy = self.policy(tenant);
        let (used, reserved) = {
            let mut q = state.quota.lock().unwrap_or_else(|p| p.into_inner());
            (q.used(Instant::now()), q.reserved)
        };
        let count = |model: &str, kind: &str| {
            self.metrics
                .tokens
                .get_or_create(&TokenLabels {
                    tenant: tenant.to_owned(),
                    model: model.to_owned(),
                    kind: kind.into(),
                })
                .get()
        };
        let models = self
            .list_models(tenant)
            .into_iter()
            .map(|m| ModelUsage {
                prompt_tokens: count(&m.id, "prompt"),
                completion_tokens: count(&m.id, "completion"),
                model: m.id,
            })
            .collect();
        TenantUsage {
            tokens_last_minute: used,
            tokens_reserved: reserved,
            tokens_per_minute: policy.tokens_per_minute,
            calls_in_flight: state.inflight.load(Ordering::Acquire),
            max_concurrent: policy.max_concurrent.unwrap_or(self.default_concurrency),
            models,
        }
    }

    fn deadline_error(&self) -> AiError {
        AiError::Aborted(format!(
            "{DEADLINE_EXCEEDED} of {} s; ask for fewer tokens (max-tokens), or ask the operator \
             to raise `--model-deadline-s`",
            self.deadline.as_secs_f64()
        ))
    }

    /// Starts `call` under the deadline; the stream holds `permit` and
    /// settles it when it ends.
    async fn guard(
        &self,
        mut permit: Permit,
        call: BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>>,
    ) -> Result<Box<dyn TokenStream>, AiError> {
        let until = tokio::time::Instant::now() + self.deadline;
        let inner = match tokio::time::timeout_at(until, call).await {
            Ok(Ok(inner)) => inner,
            Ok(Err(e)) => {
                permit.settle_error(&e);
                return Err(e);
            }
            Err(_) => return Err(self.deadline_error()),
        };
        Ok(self.guarded(inner, permit, until))
    }

    /// `inner` under the deadline `until`, holding `permit`.
    fn guarded(
        &self,
        inner: Box<dyn TokenStream>,
        permit: Permit,
        until: tokio::time::Instant,
    ) -> Box<dyn TokenStream> {
        Box::new(Guarded::new(inner, permit, until, self.deadline_error()))
    }
}

impl Inference for Gateway {
    fn call(&self, call: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        // As a stream read to its end, so that a call dropped part-way (its
        // client gone, its guest stopped) or cut at its deadline pays for
        // the tokens it generated, as a stream does.
        Box::pin(async move {
            let mut s = self.stream(call).await?;
            kiln_runtime::complete_stream(s.as_mut()).await
        })
    }

    fn stream(&self, call: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async move {
            let permit = self.admit(&call.tenant, &call.model, Cost::of_call(&call))?;
            self.guard(permit, self.inner.stream(call)).await
        })
    }

    fn stream_samples(
        &self,
        call: ModelCall,
        n: usize,
    ) -> BoxFuture<'_, Result<Vec<Box<dyn TokenStream>>, AiError>> {
        Box::pin(async move {
            // Each sample holds a slot of the tenant's calls in flight (so
            // more samples than slots can never run), and the first pays
            // the prompt they share.
            let policy = self.policy(&call.tenant);
            self.check_model(&call.tenant, &call.model, &policy)?;
            let cap = self.concurrency_cap(&call.tenant);
            // A tenant of no calls in flight (suspended) is refused as a
            // single call is, by `admit`.
            if cap > 0 && n > cap as usize {
                return Err(AiError::InvalidInput(format!(
                    "n = {n} samples need {n} model calls in flight, and tenant `{}` may have \
                     {cap}: ask for at most {cap}",
                    call.tenant
                )));
            }
            // The samples together must fit the whole quota: one by one,
            // the last would be told to retry a call that never fits.
            let whole = self.capped(&call.tenant, &call.model, Cost::of_call(&call));
            let tpm = policy.tokens_per_minute;
            if let Some(e) = tpm.and_then(|tpm| past_whole_quota(&call.tenant, tpm, whole, n)) {
                return Err(self.reject(&call.tenant, "tokens_per_minute", e));
            }
            let mut permits = Vec::with_capacity(n);
            for i in 0..n {
                let mut cost = Cost::of_call(&call);
                if i > 0 {
                    cost.prompt = 0;
                }
                match self.admit(&call.tenant, &call.model, cost) {
                    Ok(mut p) => {
                        p.shares_prompt = i > 0;
                        permits.push(p)
                    }
                    Err(e) => {
                        permits.iter_mut().for_each(|p| p.settle(0, 0));
                        return Err(e);
                    }
                }
            }
            let until = tokio::time::Instant::now() + self.deadline;
            let streams =
                match tokio::time::timeout_at(until, self.inner.stream_samples(call, n)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        permits.iter_mut().for_each(|p| p.settle_error(&e));
                        return Err(e);
                    }
                    Err(_) => return Err(self.deadline_error()),
                };
            let guarded = streams.into_iter().zip(permits);
            Ok(guarded.map(|(s, p)| self.guarded(s, p, until)).collect())
        })
    }

    fn set_share_weight(&self, tenant: &str, weight: u32) {
        self.inner.set_share_weight(tenant, weight);
    }

    fn close(&self) {
        self.inner.close();
    }

    fn load(&self) -> Vec<kiln_runtime::ModelLoad> {
        self.inner.load()
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

/// The longest model name a call may give.
pub const MAX_MODEL_NAME: usize = 256;

#[path = "policy_cluster.rs"]
mod cluster;
#[path = "policy_cost.rs"]
mod cost;
use cost::{Cost, past_whole_quota};
#[path = "policy_guard.rs"]
mod guard;
pub(super) use cost::templated_bytes;
use guard::Guarded;

#[cfg(test)]
#[path = "policy_stream_tests.rs"]
mod stream_tests;
#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
