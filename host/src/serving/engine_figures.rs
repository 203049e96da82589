//! What a pool's thread publishes after each step: page counts, integrity
//! aborts, prefix-cache hits and the prefix hashes the router reads.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::engine::{Engine, PrefixChange};
use crate::metrics::{PoolLabels, PrefixLabels, StepTimeLabels};

use super::PoolThread;

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

    /// Counts a step that ran a forward pass: its `wall` time and the
    /// device time the engine reports for it.
    pub(super) fn count_step(&mut self, engine: &Engine, wall: Duration) {
        let stats = engine.stats();
        if stats.steps == self.steps_seen {
            return;
        }
        self.steps_seen = stats.steps;
        let pool = PoolLabels {
            model: self.model.clone(),
            pool: self.pool.clone(),
        };
        self.metrics.steps.get_or_create(&pool).inc();
        let device = Duration::from_micros(stats.last_step_device_us);
        for (time, d) in [("wall", wall), ("device", device)] {
            let labels = StepTimeLabels {
                model: pool.model.clone(),
                pool: pool.pool.clone(),
                time: time.into(),
            };
            let counter = self.metrics.step_seconds.get_or_create(&labels);
            counter.inc_by(d.as_secs_f64());
        }
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
