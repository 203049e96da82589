//! Prometheus metrics of the HTTP front end, the runtime and the engines.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a function invocation.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvokeLabels {
    /// Owning tenant.
    pub tenant: String,
    /// Function name.
    pub function: String,
    /// HTTP status returned: the code itself for the statuses Kiln and
    /// most functions answer, its class (`2xx`, ...) for the others, so a
    /// function choosing odd codes adds a handful of series, not hundreds.
    pub status: String,
}

/// The statuses [`InvokeLabels`] names by their code.
const NAMED_STATUSES: [u16; 19] = [
    200, 201, 202, 204, 301, 302, 304, 400, 401, 403, 404, 408, 409, 413, 429, 500, 502, 503, 504,
];

impl InvokeLabels {
    /// `status` as its label: the code, or its class.
    pub fn status_label(status: u16) -> String {
        if NAMED_STATUSES.contains(&status) {
            status.to_string()
        } else {
            format!("{}xx", status / 100)
        }
    }

    /// Every label a status can have.
    fn all_status_labels() -> impl Iterator<Item = String> {
        let classes = (1..=9).map(|c| format!("{c}xx"));
        NAMED_STATUSES.iter().map(u16::to_string).chain(classes)
    }
}

/// Labels of a per-function latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FnLabels {
    /// Owning tenant.
    pub tenant: String,
    /// Function name.
    pub function: String,
}

/// Labels of a limit violation.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    /// `cpu_time`, `wall_time` or `memory`.
    pub kind: String,
}

/// Labels of prefix-cache token counts.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefixLabels {
    /// The tenant whose prompt it was.
    pub tenant: String,
    /// The model.
    pub model: String,
    /// `hit` (served from cache) or `miss` (computed).
    pub result: String,
}

/// Labels of one decode pool.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The model.
    pub model: String,
    /// The pool's index.
    pub pool: String,
}

/// Labels of one decode pool and the device it runs on.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolDeviceLabels {
    /// The model.
    pub model: String,
    /// The pool's index.
    pub pool: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
}

/// Labels of a pool's step time.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepTimeLabels {
    /// The model.
    pub model: String,
    /// The pool's index.
    pub pool: String,
    /// `wall` (a step as its streams see it) or `device` (of which the
    /// host waited on the device).
    pub time: String,
}

/// Labels of a pool's page counts.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolPagesLabels {
    /// The model.
    pub model: String,
    /// The pool's index.
    pub pool: String,
    /// `in_use`, `cached` (unreferenced, reusable) or `free`.
    pub state: String,
}

/// Labels of a model.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    /// The model.
    pub model: String,
}

/// Labels of tokens a tenant consumed.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    /// The tenant.
    pub tenant: String,
    /// The model.
    pub model: String,
    /// `prompt` or `completion`.
    pub kind: String,
}

/// Labels of a model call refused by tenant policy.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectLabels {
    /// The tenant.
    pub tenant: String,
    /// `model_not_allowed`, `tokens_per_minute` or `concurrency`.
    pub reason: String,
}

/// Labels of a tenant's calls of one model.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantModelLabels {
    /// The tenant.
    pub tenant: String,
    /// The model.
    pub model: String,
}

/// A latency histogram's constructor.
type NewHistogram = fn() -> Histogram;

/// The engines' metrics; cheap to clone (every family is shared).
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    /// Time from a model call's arrival to its first token, by tenant.
    pub first_token: Family<TenantModelLabels, Histogram, NewHistogram>,
    /// Prompt tokens served from the prefix cache or computed, by tenant.
    pub prefix_tokens: Family<PrefixLabels, Counter>,
    /// KV pages by pool and state.
    pub kv_pages: Family<PoolPagesLabels, Gauge>,
    /// Sequences aborted by the page-tag check, by pool.
    pub integrity_aborts: Family<PoolLabels, Counter>,
    /// Requests routed to each pool.
    pub pool_requests: Family<PoolLabels, Counter>,
    /// Sequences a prefill pool handed to a decode pool, by prefill pool.
    pub transfers: Family<PoolLabels, Counter>,
    /// 1 for each pool, labelled with its device.
    pub pool_device: Family<PoolDeviceLabels, Gauge>,
    /// Session requests that spilled from their saturated pool.
    pub pool_spills: Family<ModelLabels, Counter>,
    /// Tokens consumed, by tenant, model and kind.
    pub tokens: Family<TokenLabels, Counter>,
    /// Model calls refused by tenant policy.
    pub policy_rejections: Family<RejectLabels, Counter>,
    /// Engines rebuilt after a failure inside a step, by pool.
    pub engine_restarts: Family<PoolLabels, Counter>,
    /// Requests given to a rebuilt engine after a failure, by pool.
    pub engine_replays: Family<PoolLabels, Counter>,
    /// Engine steps that ran a forward pass, by pool.
    pub steps: Family<PoolLabels, Counter>,
    /// Those steps' seconds, wall and device, by pool.
    pub step_seconds: Family<StepTimeLabels, Counter<f64, AtomicU64>>,
    /// Those steps' wall times, by pool: what the step time target holds
    /// (a stream's inter-token latency is a step).
    pub step_wall: Family<PoolLabels, Histogram, NewHistogram>,
    /// Sequences preempted (their pages taken back, their work to be
    /// recomputed), by pool.
    pub preemptions: Family<PoolLabels, Counter>,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            first_token: Family::new_with_constructor(latency as NewHistogram),
            prefix_tokens: Family::default(),
            kv_pages: Family::default(),
            integrity_aborts: Family::default(),
            pool_requests: Family::default(),
            pool_device: Family::default(),
            transfers: Family::default(),
            pool_spills: Family::default(),
            tokens: Family::default(),
            policy_rejections: Family::default(),
            engine_restarts: Family::default(),
            engine_replays: Family::default(),
            steps: Family::default(),
            step_seconds: Family::default(),
            step_wall: Family::new_with_constructor(step_wall as NewHistogram),
            preemptions: Family::default(),
        }
    }
}

impl EngineMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "model_first_token_seconds",
            "Time from a model call's arrival to its first token, by tenant and model",
            self.first_token.clone(),
        );
        r.register(
            "prefix_cache_tokens",
            "Prompt tokens served from the prefix cache (hit) or computed (miss), by tenant",
            self.prefix_tokens.clone(),
        );
        r.register(
            "kv_pages",
            "KV pages by pool and state (in_use, cached, free)",
            self.kv_pages.clone(),
        );
        r.register(
            "kv_integrity_aborts",
            "Sequences aborted because a KV page tag did not match",
            self.integrity_aborts.clone(),
        );
        r.register(
            "pool_requests",
            "Model requests routed to each decode pool",
            self.pool_requests.clone(),
        );
        r.register(
            "pool_transfers",
            "Sequences a prefill pool handed to a decode pool once their prompts were computed",
            self.transfers.clone(),
        );
        r.register(
            "pool_device",
            "1 for each pool (decode pools, then any prefill pool), labelled with its device (cpu, cuda:N)",
            self.pool_device.clone(),
        );
        r.register(
            "pool_spills",
            "Session requests sent elsewhere because their pool was saturated",
            self.pool_spills.clone(),
        );
        r.register(
            "model_tokens",
            "Tokens consumed by tenant, model and kind",
            self.tokens.clone(),
        );
        r.register(
            "policy_rejections",
            "Model calls refused by tenant policy, by reason",
            self.policy_rejections.clone(),
        );
        r.register(
            "engine_restarts",
            "Engines rebuilt after a panic or error inside a step, by pool",
            self.engine_restarts.clone(),
        );
        r.register(
            "engine_replays",
            "Requests given to a rebuilt engine after a failure, by pool",
            self.engine_replays.clone(),
        );
        r.register(
            "engine_steps",
            "Engine steps that ran a forward pass, by pool",
            self.steps.clone(),
        );
        r.register(
            "engine_step_seconds",
            "Seconds of engine steps by pool: wall (as streams see them) and device (the host waiting on the device)",
            self.step_seconds.clone(),
        );
        r.register(
            "engine_step_wall_seconds",
            "Wall time of engine steps that ran a forward pass, by pool",
            self.step_wall.clone(),
        );
        r.register(
            "engine_preemptions",
            "Sequences preempted (pages taken back, work to recompute), by pool",
            self.preemptions.clone(),
        );
    }
}

fn step_wall() -> Histogram {
    // Half a millisecond apart where decode steps fall, then coarser.
    const MS: [f64; 24] = [
        1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 9.0, 10.0, 12.0, 15.0,
        20.0, 30.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
    ];
    Histogram::new(MS.iter().map(|ms| ms / 1e3))
}

fn latency() -> Histogram {
    // 10 µs .. ~20 s.
    Histogram::new(exponential_buckets(1e-5, 2.5, 16))
}

/// All metrics, registered in one registry.
pub struct Metrics {
    registry: Registry,
    /// Invocations by tenant, function and status.
    pub requests: Family<InvokeLabels, Counter>,
    /// Time to instantiate a fresh instance.
    pub instantiate: Family<FnLabels, Histogram, fn() -> Histogram>,
    /// Time from request to response head.
    pub handler: Family<FnLabels, Histogram, fn() -> Histogram>,
    /// Limit violations by kind.
    pub limits: Family<LimitLabels, Counter>,
    /// Connections refused because --max-connections were open.
    pub connections_refused: Counter,
    /// Components compiled or read from the artifact cache for a route.
    pub component_loads: Counter,
    /// The engines' metrics (shared with the engine threads).
    pub engine: EngineMetrics,
}

impl Metrics {
    /// Drops the series of `tenant`'s function `function` (deleted): a
    /// tenant deploying, calling and deleting made-up functions would
    /// otherwise grow the metrics for the server's life.
    pub fn forget_function(&self, tenant: &str, function: &str) {
        let labels = FnLabels {
            tenant: tenant.to_owned(),
            function: function.to_owned(),
        };
        self.instantiate.remove(&labels);
        self.handler.remove(&labels);
        for status in InvokeLabels::all_status_labels() {
            self.requests.remove(&InvokeLabels {
                tenant: tenant.to_owned(),
                function: function.to_owned(),
                status,
            });
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kiln");
        let requests = Family::<InvokeLabels, Counter>::default();
        let instantiate = Family::new_with_constructor(latency as fn() -> Histogram);
        let handler = Family::new_with_constructor(latency as fn() -> Histogram);
        let limits = Family::<LimitLabels, Counter>::default();
        registry.register(
            "function_requests",
            "Function invocations by tenant, function and HTTP status",
            requests.clone(),
        );
        registry.register(
            "function_instantiate_seconds",
            "Time to create a fresh instance for a request",
            instantiate.clone(),
        );
        registry.register(
            "function_handler_seconds",
            "Time from request arrival to the guest's response head",
            handler.clone(),
        );
        registry.register(
            "limit_violations",
            "Requests stopped by a resource limit, by kind",
            limits.clone(),
        );
        let connections_refused = Counter::default();
        registry.register(
            "connections_refused",
            "Connections refused because the server had --max-connections open",
            connections_refused.clone(),
        );
        let component_loads = Counter::default();
        registry.register(
            "component_loads",
            "Components compiled, or read from the artifact cache, on a route's first use",
            component_loads.clone(),
        );
        let engine = EngineMetrics::default();
        engine.register(&mut registry);
        Self {
            registry,
            requests,
            instantiate,
            handler,
            limits,
            connections_refused,
            component_loads,
            engine,
        }
    }
}

impl Metrics {
    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_statuses_are_labelled_by_code_and_the_rest_by_class() {
        assert_eq!(InvokeLabels::status_label(200), "200");
        assert_eq!(InvokeLabels::status_label(504), "504");
        assert_eq!(InvokeLabels::status_label(299), "2xx");
        assert_eq!(InvokeLabels::status_label(999), "9xx");
        let all: Vec<String> = InvokeLabels::all_status_labels().collect();
        for code in 100..1000 {
            assert!(all.contains(&InvokeLabels::status_label(code)), "{code}");
        }
    }
}
