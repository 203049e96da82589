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
    /// CPU time one request may use: the guest's code and the host's work
    /// on its behalf (time spent waiting inside host calls does not count).
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

/// How often the engine's epoch advances: how often a running guest's CPU
/// time and wall time are checked.
pub(crate) const TICK: Duration = Duration::from_millis(1);

/// Most wall time a guest runs between yields to the executor.
const YIELD_EVERY: Duration = Duration::from_millis(2);

/// CPU time this thread has used, in nanoseconds: the clock a request is
/// billed by, read around each poll of its future, so the guest's code and
/// the host's work on its behalf (a call answered at once, random bytes)
/// count, and waiting (for a model, a body, a timer) does not.
fn thread_cpu_ns() -> u64 {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec through a valid pointer.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        }
    }
    // Elsewhere, wall time inside the poll: waiting is still not billed.
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A request's CPU time so far, shared by its future ([`Metered::billed`])
/// and its store's checks.
#[derive(Debug, Default)]
pub(crate) struct CpuMeter {
    /// Nanoseconds used in polls that have ended.
    done: AtomicU64,
    /// Nanoseconds of those (and of the poll now running) spent in model
    /// calls ([`Metered::unbilled`]).
    unbilled: AtomicU64,
    /// The thread's CPU clock (nanoseconds, at least 1) when the poll now
    /// running began; 0 between polls.
    poll_start: AtomicU64,
}

impl CpuMeter {
    /// Nanoseconds taken off the bill so far.
    pub(crate) fn unbilled_ns(&self) -> u64 {
        self.unbilled.load(Ordering::Relaxed)
    }

    /// Puts `ns` taken off the bill back on it.
    pub(crate) fn bill(&self, ns: u64) {
        self.unbilled.fetch_sub(ns, Ordering::Relaxed);
    }

    /// CPU time used so far, the poll now running included (read from the
    /// thread running it, as the store's checks are).
    fn used(&self) -> Duration {
        let running = match self.poll_start.load(Ordering::Relaxed) {
            0 => 0,
            start => thread_cpu_ns().saturating_sub(start),
        };
        let spent = self.done.load(Ordering::Relaxed) + running;
        Duration::from_nanos(spent.saturating_sub(self.unbilled.load(Ordering::Relaxed)))
    }
}

/// A future whose polls are timed by the thread's CPU clock into `meter`:
/// billed (the request), or taken off the bill (a model call inside it).
pub(crate) struct Metered<F> {
    inner: std::pin::Pin<Box<F>>,
    meter: Arc<CpuMeter>,
    billed: bool,
}

impl<F: std::future::Future> Metered<F> {
    /// The request's future: its polls are its CPU time.
    pub(crate) fn billed(inner: F, meter: Arc<CpuMeter>) -> Self {
        Self {
            inner: Box::pin(inner),
            meter,
            billed: true,
        }
    }

    /// A model call inside the request, whose polls are taken off its CPU
    /// time: preparing a prompt (templating, tokenizing, compiling its
    /// format) is the model's work, bounded as an API call's is (by its
    /// size and the tenant's model calls in flight), not the guest's.
    pub(crate) fn unbilled(inner: F, meter: Arc<CpuMeter>) -> Self {
        Self {
            inner: Box::pin(inner),
            meter,
            billed: false,
        }
    }
}

impl<F: std::future::Future> std::future::Future for Metered<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let start = thread_cpu_ns().max(1);
        if self.billed {
            self.meter.poll_start.store(start, Ordering::Relaxed);
        }
        let out = self.inner.as_mut().poll(cx);
        let spent = thread_cpu_ns().saturating_sub(start);
        let meter = &self.meter;
        if self.billed {
            meter.poll_start.store(0, Ordering::Relaxed);
            meter.done.fetch_add(spent, Ordering::Relaxed);
        } else {
            meter.unbilled.fetch_add(spent, Ordering::Relaxed);
        }
        out
    }
}

/// Per-store enforcement state: the memory limiter, the CPU budget and
/// the wall-time deadline.
pub(crate) struct StoreLimits {
    memory_bytes: usize,
    cpu_budget: Duration,
    meter: Arc<CpuMeter>,
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
    /// Limits for one request, billing CPU time by `meter` (which the
    /// request's future must be [`Metered`] by).
    pub(crate) fn new(limits: &Limits, meter: Arc<CpuMeter>) -> Self {
        Self {
            memory_bytes: limits.memory_bytes,
            cpu_budget: limits.cpu_time,
            meter,
            base: Instant::now(),
            deadline: u64::try_from(limits.wall_time.as_nanos()).unwrap_or(u64::MAX),
            yielded: 0,
            exceeded: None,
        }
    }

    fn now_nanos(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Called from the epoch-deadline callback, about once per [`TICK`]
    /// while the guest runs (and at its first check after a host call that
    /// took longer): ends the request past its CPU time (the guest's code
    /// and the host's work for it) or its wall time.
    ///
    /// It also yields at least every [`YIELD_EVERY`]: a guest whose host
    /// calls never wait (each answered at once) would otherwise never give
    /// its thread back, so neither the thread's other tasks nor the
    /// wall-time timer would run.
    pub(crate) fn on_epoch(&mut self) -> wasmtime::Result<UpdateDeadline> {
        let now = self.now_nanos();
        if now >= self.deadline {
            self.exceeded = Some(LimitKind::WallTime);
            return Err(LimitKind::WallTime.into());
        }
        let used = self.meter.used();
        tracing::trace!(?used, "guest CPU");
        if used > self.cpu_budget {
            self.exceeded = Some(LimitKind::CpuTime);
            return Err(LimitKind::CpuTime.into());
        }
        if Duration::from_nanos(now.saturating_sub(self.yielded)) < YIELD_EVERY {
            return Ok(UpdateDeadline::Continue(1));
        }
        self.yielded = now;
        Ok(UpdateDeadline::YieldCustom(
            1,
            Box::pin(tokio::task::yield_now()),
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
