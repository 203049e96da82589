//! Per-request resource limits and their enforcement inside a store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wasmtime::{ResourceLimiter, UpdateDeadline};

use crate::error::LimitKind;

/// Limits applied to every request's instance.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest linear memory one instance may grow to, in bytes.
    pub memory_bytes: usize,
    /// Guest execution time one request may use (time spent waiting inside
    /// host calls does not count).
    pub cpu_time: Duration,
    /// Wall-clock time from the start of the request until the guest has
    /// finished, response body included.
    pub wall_time: Duration,
    /// Most instances alive at once across all tenants (pool slots).
    pub max_instances: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes: 128 << 20,
            cpu_time: Duration::from_millis(50),
            wall_time: Duration::from_secs(30),
            max_instances: 1000,
        }
    }
}

/// How often the engine's epoch advances: the granularity of CPU accounting.
pub(crate) const TICK: Duration = Duration::from_millis(1);

/// Most wall time a guest runs between yields to the executor.
const YIELD_EVERY: Duration = Duration::from_millis(2);

/// A handle that restarts the CPU meter's clock: called when a host call
/// returns, so time the guest spent waiting in it is not billed.
#[derive(Clone)]
pub(crate) struct CpuMark {
    mark: Arc<AtomicU64>,
    base: Instant,
}

impl CpuMark {
    /// The guest resumes now.
    pub(crate) fn resume(&self) {
        self.mark
            .store(self.base.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Per-store enforcement state: the memory limiter and the CPU meter.
pub(crate) struct StoreLimits {
    memory_bytes: usize,
    cpu_budget: Duration,
    cpu_used: Duration,
    /// Nanoseconds since `base` at which the guest last resumed or was last
    /// charged; shared with yield futures so they can mark the resume time.
    mark: Arc<AtomicU64>,
    base: Instant,
    /// Nanoseconds since `base` past which the request is over its wall
    /// time.
    deadline: u64,
    /// Nanoseconds since `base` at which the guest last yielded.
    yielded: u64,
    /// The limit that stopped the guest, if one did.
    pub(crate) exceeded: Option<LimitKind>,
}

impl StoreLimits {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            memory_bytes: limits.memory_bytes,
            cpu_budget: limits.cpu_time,
            cpu_used: Duration::ZERO,
            mark: Arc::new(AtomicU64::new(0)),
            base: Instant::now(),
            deadline: u64::try_from(limits.wall_time.as_nanos()).unwrap_or(u64::MAX),
            yielded: 0,
            exceeded: None,
        }
    }

    /// A handle to restart the meter's clock from host calls.
    pub(crate) fn cpu_mark(&self) -> CpuMark {
        CpuMark {
            mark: self.mark.clone(),
            base: self.base,
        }
    }

    fn now_nanos(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Charges `since` (capped at two ticks: anything longer was not spent
    /// running this guest) and moves the mark to `now`.
    fn charge(&mut self, now: u64) -> wasmtime::Result<Duration> {
        let since = Duration::from_nanos(now.saturating_sub(self.mark.load(Ordering::Relaxed)));
        let charge = since.min(TICK * 2);
        self.cpu_used += charge;
        self.mark.store(now, Ordering::Relaxed);
        tracing::trace!(?charge, used = ?self.cpu_used, "guest CPU charged");
        if self.cpu_used > self.cpu_budget {
            self.exceeded = Some(LimitKind::CpuTime);
            return Err(LimitKind::CpuTime.into());
        }
        Ok(charge)
    }

    /// The guest calls into the host: bill what it ran since the last mark.
    pub(crate) fn enter_host(&mut self) -> wasmtime::Result<()> {
        self.charge(self.now_nanos()).map(|_| ())
    }

    /// A host call returns: the time it took (waiting for a body, a model,
    /// a timer) is not guest CPU, so the meter restarts now.
    pub(crate) fn leave_host(&mut self) {
        self.mark.store(self.now_nanos(), Ordering::Relaxed);
    }

    /// Called from the epoch-deadline callback, about once per [`TICK`] of
    /// guest execution. Charges the time since the last mark, capped at two
    /// ticks so that time parked in host calls or in the executor's queue is
    /// not billed as guest CPU.
    ///
    /// It also ends the request at its wall time, and yields at least
    /// every [`YIELD_EVERY`]: a guest whose host calls never wait (each
    /// answered at once) would otherwise never give its thread back, so
    /// neither the thread's other tasks nor the wall-time timer would run.
    pub(crate) fn on_epoch(&mut self) -> wasmtime::Result<UpdateDeadline> {
        let now = self.now_nanos();
        if now >= self.deadline {
            self.exceeded = Some(LimitKind::WallTime);
            return Err(LimitKind::WallTime.into());
        }
        let charge = self.charge(now)?;
        let since_yield = Duration::from_nanos(now.saturating_sub(self.yielded));
        if charge < TICK / 2 && since_yield < YIELD_EVERY {
            // Just resumed: run a slice before yielding again.
            return Ok(UpdateDeadline::Continue(1));
        }
        self.yielded = now;
        let mark = self.cpu_mark();
        Ok(UpdateDeadline::YieldCustom(
            1,
            Box::pin(async move {
                tokio::task::yield_now().await;
                mark.resume();
            }),
        ))
    }
}

impl ResourceLimiter for StoreLimits {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.exceeded = Some(LimitKind::Memory);
            return Err(LimitKind::Memory.into());
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(maximum.is_none_or(|max| desired <= max))
    }
}
