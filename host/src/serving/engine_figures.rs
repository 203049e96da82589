//! What a pool's thread publishes after each step: page counts, integrity
//! aborts, preemptions, prefix-cache hits and the prefix hashes the router
//! reads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::engine::{Engine, PrefixChange};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use crate::metrics::{EngineMetrics, PoolLabels, PrefixLabels, StepTimeLabels};

use super::PoolThread;

/// One pool's step counters: steps, their wall and device seconds, and
/// their wall times' histogram.
pub(super) struct StepCounters {
    steps: Counter,
    wall: Counter<f64, AtomicU64>,
    device: Counter<f64, AtomicU64>,
    walls: Histogram,
    preemptions: Counter,
    /// The engine's preemption count at the last step counted.
    preemptions_seen: u64,
}

impl StepCounters {
    /// The counters of pool `index` of `model`.
    pub(super) fn new(metrics: &EngineMetrics, model: &str, index: usize) -> Self {
        let pool = PoolLabels {
            model: model.to_owned(),
            pool: index.to_string(),
        };
        let seconds = |time: &str| {
            let labels = StepTimeLabels {
                model: pool.model.clone(),
                pool: pool.pool.clone(),
                time: time.into(),
            };
            metrics.step_seconds.get_or_create(&labels).clone()
        };
        Self {
            steps: metrics.steps.get_or_create(&pool).clone(),
            wall: seconds("wall"),
            device: seconds("device"),
            walls: metrics.step_wall.get_or_create(&pool).clone(),
            preemptions: metrics.preemptions.get_or_create(&pool).clone(),
            preemptions_seen: 0,
        }
    }

    /// A rebuilt engine counts its preemptions from zero.
    pub(super) fn restarted(&mut self) {
        self.preemptions_seen = 0;
    }
}

impl PoolThread {
    pub(super) fn count_prefix(&self, tenant: &str, prompt: usize, cached: usize) {
        for (result, n) in [("hit", cached), ("miss", prompt.saturating_sub(cached))] {
            self.metrics
                .prefix_tokens
                .get_or_create(&PrefixLabels {
                    tenant: tenant.to_owned(),
                    model: self.model.clone(),
                    result: result.into(),
                })
                .inc_by(n as u64);
        }
    }

    /// Counts the preemptions `engine` made since the last count (a step
    /// plans them before it knows whether anything runs).
    pub(super) fn count_preemptions(&mut self, engine: &Engine) {
        let c = &mut self.step_counters;
        let now = engine.stats().preemptions;
        let seen = std::mem::replace(&mut c.preemptions_seen, now);
        c.preemptions.inc_by(now.saturating_sub(seen));
    }

    /// Counts a step's preemptions and, if it ran a forward pass, the step:
    /// its `wall` time and the device time the engine reports for it.
    pub(super) fn count_step(&mut self, engine: &Engine, wall: Duration) {
        self.count_preemptions(engine);
        let stats = engine.stats();
        if stats.steps == self.steps_seen {
            return;
        }
        self.steps_seen = stats.steps;
        let c = &self.step_counters;
        c.steps.inc();
        c.wall.inc_by(wall.as_secs_f64());
        c.walls.observe(wall.as_secs_f64());
        c.device.inc_by(stats.last_step_device_us as f64 / 1e6);
    }

    /// Publishes page counts, integrity aborts, running requests and
    /// prefix-cache changes (in the slots `super::FREE_PAGES` and on).
    pub(super) fn publish(&mut self, engine: &mut Engine) {
        let (free, cached, total) = (
            engine.free_pages(),
            engine.cached_pages(),
            engine.total_pages(),
        );
        let aborts = engine.stats().integrity_aborts;
        for (slot, v) in
            self.figures
                .iter()
                .zip([free, cached, total, aborts as usize, engine.running()])
        {
            slot.store(v, Ordering::Relaxed);
        }
        for (gauge, n) in self.page_gauges.iter().zip([
            total.saturating_sub(free),
            cached,
            free.saturating_sub(cached),
        ]) {
            gauge.set(n as i64);
        }
        if aborts > self.aborts_seen {
            self.metrics
                .integrity_aborts
                .get_or_create(&PoolLabels {
                    model: self.model.clone(),
                    pool: self.pool.clone(),
                })
                .inc_by(aborts - self.aborts_seen);
            self.aborts_seen = aborts;
        }
        let changes = engine.take_prefix_changes();
        if !changes.is_empty() {
            let mut set = self.prefixes.write().unwrap_or_else(|p| p.into_inner());
            for c in changes {
                match c {
                    PrefixChange::Added(h) => set.insert(h),
                    PrefixChange::Removed(h) => set.remove(&h),
                };
            }
        }
    }
}
