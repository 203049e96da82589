//! Prometheus metrics of the HTTP front end and the runtime.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a function invocation.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvokeLabels {
    /// Owning tenant.
    pub tenant: String,
    /// Function name.
    pub function: String,
    /// HTTP status returned.
    pub status: u16,
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
        Self {
            registry,
            requests,
            instantiate,
            handler,
            limits,
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
