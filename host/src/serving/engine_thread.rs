//! One decode pool: an [`Engine`] on its own thread. Requests arrive
//! tokenized over a channel; their text goes back over a per-request
//! channel. A request whose receiver is gone (the guest dropped its stream,
//! or the caller went away) is cancelled at the next step, freeing its pages.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, mpsc};

use kiln_runtime::AiError;
use tokio::sync::mpsc as tmpsc;

use crate::engine::{Engine, Event, Finish, GenerateParams, PageHash, PrefixChange, Salt, SeqId};
use crate::engine::{TenantId, scheduler::SchedulerConfig};
use prometheus_client::metrics::gauge::Gauge;

use crate::metrics::{EngineMetrics, PoolLabels, PoolPagesLabels, PrefixLabels};

/// A tokenized request for one pool.
pub(super) struct Submit {
    pub(super) tenant: Arc<str>,
    pub(super) salt: Salt,
    pub(super) ids: Vec<u32>,
    pub(super) params: GenerateParams,
    pub(super) out: tmpsc::UnboundedSender<Out>,
}

/// Messages from the engine thread to one request.
pub(super) enum Out {
    Text(String),
    Done {
        finish: Finish,
        prompt: usize,
        completion: usize,
        cached: usize,
    },
    Error(AiError),
}

/// What the rest of the server sees of a pool.
pub(super) struct PoolHandle {
    pub(super) tx: mpsc::Sender<Submit>,
    /// Requests sent and not yet finished (raised by the sender, lowered
    /// by the engine thread).
    pub(super) load: Arc<AtomicUsize>,
    /// Requests the pool runs at once before it counts as saturated.
    pub(super) capacity: usize,
    /// Page hashes the pool holds in its prefix cache, mirrored for routing.
    pub(super) prefixes: Arc<RwLock<HashSet<PageHash>>>,
    /// Free (cached included), cached and total pages, and integrity
    /// aborts, as last published.
    pub(super) figures: Arc<[AtomicUsize; 4]>,
}

impl PoolHandle {
    /// How many of `hashes`' leading pages this pool has cached.
    pub(super) fn cached_prefix(&self, hashes: &[PageHash]) -> usize {
        let set = self.prefixes.read().unwrap_or_else(|p| p.into_inner());
        hashes.iter().take_while(|h| set.contains(h)).count()
    }
}

/// Everything the engine thread owns besides the engine.
struct PoolThread {
    model: String,
    pool: String,
    metrics: EngineMetrics,
    /// This pool's `kv_pages` gauges (in use, cached, free), looked up once.
    page_gauges: [Gauge; 3],
    load: Arc<AtomicUsize>,
    prefixes: Arc<RwLock<HashSet<PageHash>>>,
    figures: Arc<[AtomicUsize; 4]>,
    tenants: HashMap<Arc<str>, TenantId>,
    outs: HashMap<SeqId, (tmpsc::UnboundedSender<Out>, Arc<str>)>,
    aborts_seen: u64,
}

/// Starts `engine` on a new thread, with `threads` compute threads of its
/// own (0: share the process-wide pool).
pub(super) fn spawn(
    engine: Engine,
    scheduler: SchedulerConfig,
    model: &str,
    index: usize,
    threads: usize,
    metrics: EngineMetrics,
) -> std::io::Result<PoolHandle> {
    let (tx, rx) = mpsc::channel();
    let handle = PoolHandle {
        tx,
        load: Arc::default(),
        capacity: scheduler.max_running,
        prefixes: Arc::default(),
        figures: Arc::default(),
    };
    let page_gauges = ["in_use", "cached", "free"].map(|state| {
        metrics
            .kv_pages
            .get_or_create(&PoolPagesLabels {
                model: model.to_owned(),
                pool: index.to_string(),
                state: state.into(),
            })
            .clone()
    });
    let mut state = PoolThread {
        model: model.to_owned(),
        pool: index.to_string(),
        metrics,
        page_gauges,
        load: handle.load.clone(),
        prefixes: handle.prefixes.clone(),
        figures: handle.figures.clone(),
        tenants: HashMap::new(),
        outs: HashMap::new(),
        aborts_seen: 0,
    };
    let compute = match threads {
        0 => None,
        n => Some(
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .thread_name(move |i| format!("kiln-pool{index}-{i}"))
                .build()
                .map_err(std::io::Error::other)?,
        ),
    };
    std::thread::Builder::new()
        .name(format!("kiln-engine-{model}-{index}"))
        .spawn(move || match compute {
            Some(c) => c.install(|| state.run(engine, rx)),
            None => state.run(engine, rx),
        })?;
    Ok(handle)
}

impl PoolThread {
    fn run(&mut self, mut engine: Engine, rx: mpsc::Receiver<Submit>) {
        loop {
            self.publish(&mut engine);
            // Block for work when idle; otherwise take what has arrived.
            let first = if engine.has_work() {
                rx.try_recv().ok()
            } else {
                match rx.recv() {
                    Ok(sub) => Some(sub),
                    // Every handle is gone: the server is shutting down.
                    Err(_) => return,
                }
            };
            for sub in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                self.admit(&mut engine, sub);
            }
            // Callers that went away: cancel now, freeing their pages.
            let gone: Vec<SeqId> = self
                .outs
                .iter()
                .filter(|(_, (o, _))| o.is_closed())
                .map(|(s, _)| *s)
                .collect();
            for seq in gone {
                engine.cancel(seq);
                self.leave(seq);
            }
            if engine.has_work() {
                self.step(&mut engine);
            }
        }
    }

    fn admit(&mut self, engine: &mut Engine, sub: Submit) {
        let next = TenantId(self.tenants.len() as u32);
        let tenant = *self.tenants.entry(sub.tenant.clone()).or_insert(next);
        match engine.add_salted(tenant, sub.salt, sub.ids, sub.params) {
            Ok(seq) => {
                self.outs.insert(seq, (sub.out, sub.tenant));
            }
            Err(e) => {
                let _ = sub.out.send(Out::Error(AiError::InvalidInput(e)));
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// A request left the engine.
    fn leave(&mut self, seq: SeqId) -> Option<(tmpsc::UnboundedSender<Out>, Arc<str>)> {
        let out = self.outs.remove(&seq);
        if out.is_some() {
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
        out
    }

    fn step(&mut self, engine: &mut Engine) {
        let events = match engine.step() {
            Ok(ev) => ev,
            Err(e) => {
                tracing::error!("engine step failed: {e}");
                let seqs: Vec<SeqId> = self.outs.keys().copied().collect();
                for seq in seqs {
                    engine.cancel(seq);
                    if let Some((o, _)) = self.leave(seq) {
                        let msg = format!("the engine failed: {e}");
                        let _ = o.send(Out::Error(AiError::RuntimeError(msg)));
                    }
                }
                return;
            }
        };
        // Figures first, so that anyone who sees this step's tokens also
        // sees the pages it holds.
        self.publish(engine);
        for ev in events {
            match ev {
                Event::Token { seq, text, .. } if !text.is_empty() => {
                    if let Some((o, _)) = self.outs.get(&seq) {
                        let _ = o.send(Out::Text(text));
                    }
                }
                Event::Token { .. } => {}
                Event::Finished {
                    seq,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                } => {
                    let Some((o, tenant)) = self.leave(seq) else {
                        continue;
                    };
                    self.count_prefix(&tenant, prompt_tokens, cached_tokens);
                    let _ = o.send(Out::Done {
                        finish,
                        prompt: prompt_tokens,
                        completion: completion_tokens,
                        cached: cached_tokens,
                    });
                }
            }
        }
    }

    fn count_prefix(&self, tenant: &str, prompt: usize, cached: usize) {
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

    /// Publishes page counts, integrity aborts and prefix-cache changes.
    fn publish(&mut self, engine: &mut Engine) {
        let (free, cached, total) = (
            engine.free_pages(),
            engine.cached_pages(),
            engine.total_pages(),
        );
        let aborts = engine.stats().integrity_aborts;
        for (slot, v) in self
            .figures
            .iter()
            .zip([free, cached, total, aborts as usize])
        {
            slot.store(v, Ordering::Relaxed);
        }
        for (gauge, n) in self
            .page_gauges
            .iter()
            .zip([total - free, cached, free - cached])
        {
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
