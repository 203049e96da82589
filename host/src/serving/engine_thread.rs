//! One decode pool: an [`Engine`] on its own thread, under supervision.
//! Requests arrive tokenized over a channel; their text goes back over a
//! per-request channel. A request whose receiver is gone (the guest dropped
//! its stream, or the caller went away) is cancelled at the next step,
//! freeing its pages.
//!
//! A panic or an error inside the engine fails only the requests of the
//! step it happened in (and any that already streamed text, which cannot be
//! replayed); the thread rebuilds the engine on the same weights and gives
//! it the other requests again, as if they had just arrived.

#[path = "engine_figures.rs"]
mod figures;

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, mpsc};
use std::time::Duration;

use kiln_runtime::AiError;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc as tmpsc;

use super::engine_restarted;
use crate::engine::TenantId;
use crate::engine::{Engine, EngineConfig, Event, Finish, GenerateParams, PageHash, Salt, SeqId};
use crate::metrics::{EngineMetrics, PoolLabels, PoolPagesLabels};
use crate::model::Loaded;

/// A tokenized request for one pool.
pub(super) struct Submit {
    pub(super) tenant: Arc<str>,
    pub(super) salt: Salt,
    pub(super) ids: Vec<u32>,
    pub(super) params: GenerateParams,
    pub(super) out: tmpsc::UnboundedSender<Out>,
}

/// Messages to a pool's thread.
pub(super) enum Msg {
    /// A new request.
    Submit(Submit),
    /// Test-only: the engine panics in its next step.
    #[cfg(feature = "fault-injection")]
    InjectPanic,
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
    pub(super) tx: mpsc::Sender<Msg>,
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

/// A request the engine holds, and what it takes to give it to a rebuilt
/// engine.
struct Live {
    out: tmpsc::UnboundedSender<Out>,
    tenant: Arc<str>,
    /// The request as submitted, until its first text goes out (after
    /// that, running it again would repeat text the caller has).
    replay: Option<(Salt, Vec<u32>, GenerateParams)>,
    /// Engine failures this request has lived through.
    restarts: u32,
}

/// Everything the engine thread owns besides the engine.
struct PoolThread {
    loaded: Arc<Loaded>,
    config: EngineConfig,
    model: String,
    pool: String,
    metrics: EngineMetrics,
    /// This pool's `kv_pages` gauges (in use, cached, free), looked up once.
    page_gauges: [Gauge; 3],
    load: Arc<AtomicUsize>,
    prefixes: Arc<RwLock<HashSet<PageHash>>>,
    figures: Arc<[AtomicUsize; 4]>,
    tenants: HashMap<Arc<str>, TenantId>,
    outs: HashMap<SeqId, Live>,
    aborts_seen: u64,
}

/// Why an engine is rebuilt.
enum Failure {
    Panic(String),
    Error(String),
}

/// Starts an engine for `loaded` on a new thread, with `threads` compute
/// threads of its own (0: share the process-wide pool).
pub(super) fn spawn(
    loaded: Arc<Loaded>,
    config: EngineConfig,
    model: &str,
    index: usize,
    threads: usize,
    metrics: EngineMetrics,
) -> std::io::Result<PoolHandle> {
    let engine = Engine::new(loaded.clone(), config.clone()).map_err(std::io::Error::other)?;
    let (tx, rx) = mpsc::channel();
    let handle = PoolHandle {
        tx,
        load: Arc::default(),
        capacity: config.scheduler.max_running,
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
        loaded,
        config,
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

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

impl PoolThread {
    fn run(&mut self, mut engine: Engine, rx: mpsc::Receiver<Msg>) {
        loop {
            self.publish(&mut engine);
            // Block for work when idle; otherwise take what has arrived.
            let first = if engine.has_work() {
                rx.try_recv().ok()
            } else {
                match rx.recv() {
                    Ok(msg) => Some(msg),
                    // Every handle is gone: the server is shutting down.
                    Err(_) => return,
                }
            };
            let msgs: Vec<Msg> = first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
                .collect();
            let turn = std::panic::catch_unwind(AssertUnwindSafe(|| self.turn(&mut engine, msgs)));
            let failure = match turn {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => Failure::Error(e),
                Err(p) => Failure::Panic(panic_message(p.as_ref())),
            };
            engine = self.restart(engine, failure, &rx);
        }
    }

    /// Admits what arrived, cancels requests whose callers left, and runs
    /// a step if there is work.
    fn turn(&mut self, engine: &mut Engine, msgs: Vec<Msg>) -> Result<(), String> {
        for msg in msgs {
            match msg {
                Msg::Submit(sub) => self.admit(engine, sub),
                #[cfg(feature = "fault-injection")]
                Msg::InjectPanic => engine.inject_panic(),
            }
        }
        let gone: Vec<SeqId> = self
            .outs
            .iter()
            .filter(|(_, l)| l.out.is_closed())
            .map(|(s, _)| *s)
            .collect();
        for seq in gone {
            engine.cancel(seq);
            self.leave(seq);
        }
        if engine.has_work() {
            self.step(engine)?;
        }
        Ok(())
    }

    fn tenant_id(&mut self, tenant: &Arc<str>) -> TenantId {
        let next = TenantId(self.tenants.len() as u32);
        *self.tenants.entry(tenant.clone()).or_insert(next)
    }

    fn admit(&mut self, engine: &mut Engine, sub: Submit) {
        let live = Live {
            out: sub.out,
            tenant: sub.tenant,
            replay: Some((sub.salt, sub.ids.clone(), sub.params.clone())),
            restarts: 0,
        };
        self.readmit(engine, live, sub.salt, sub.ids, sub.params);
    }

    fn readmit(
        &mut self,
        engine: &mut Engine,
        live: Live,
        salt: Salt,
        ids: Vec<u32>,
        params: GenerateParams,
    ) {
        let tenant = self.tenant_id(&live.tenant);
        match engine.add_salted(tenant, salt, ids, params) {
            Ok(seq) => {
                self.outs.insert(seq, live);
            }
            Err(e) => {
                let _ = live.out.send(Out::Error(AiError::InvalidInput(e)));
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// A request left the engine.
    fn leave(&mut self, seq: SeqId) -> Option<Live> {
        let live = self.outs.remove(&seq);
        if live.is_some() {
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
        live
    }

    fn step(&mut self, engine: &mut Engine) -> Result<(), String> {
        let events = engine.step()?;
        // Figures first, so that anyone who sees this step's tokens also
        // sees the pages it holds.
        self.publish(engine);
        for ev in events {
            match ev {
                Event::Token { seq, text, .. } if !text.is_empty() => {
                    if let Some(live) = self.outs.get_mut(&seq) {
                        live.replay = None;
                        let _ = live.out.send(Out::Text(text));
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
                    let Some(live) = self.leave(seq) else {
                        continue;
                    };
                    self.count_prefix(&live.tenant, prompt_tokens, cached_tokens);
                    let _ = live.out.send(Out::Done {
                        finish,
                        prompt: prompt_tokens,
                        completion: completion_tokens,
                        cached: cached_tokens,
                    });
                }
            }
        }
        Ok(())
    }

    /// Replaces a failed engine: fails the requests the failure concerns,
    /// builds a new engine (on the same weights after a panic; after a
    /// device error, on weights loaded again) and gives it the rest.
    fn restart(&mut self, old: Engine, failure: Failure, rx: &mpsc::Receiver<Msg>) -> Engine {
        let blamed: HashSet<SeqId> = old.in_step().iter().copied().collect();
        let (why, keep_weights) = match failure {
            Failure::Panic(m) => (format!("panicked: {m}"), true),
            Failure::Error(e) => (format!("failed: {e}"), false),
        };
        let mut failed = Vec::new();
        let mut again = Vec::new();
        // The caller hears no detail: a panic's message may quote another
        // tenant's text from the same batch. The log has it.
        let told = "failed inside a step";
        for (seq, mut live) in std::mem::take(&mut self.outs) {
            match live.replay.take() {
                Some(replay) if !blamed.contains(&seq) && live.restarts == 0 => {
                    live.restarts += 1;
                    again.push((live, replay));
                }
                _ => {
                    failed.push((seq, live.tenant.clone()));
                    let _ = live.out.send(Out::Error(engine_restarted(told)));
                    self.load.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        tracing::error!(
            model = %self.model,
            pool = %self.pool,
            failed = ?failed,
            replayed = again.len(),
            "the engine {why}; failing the requests of its step (sequence, tenant) and restarting it"
        );
        self.metrics
            .engine_restarts
            .get_or_create(&PoolLabels {
                model: self.model.clone(),
                pool: self.pool.clone(),
            })
            .inc();
        if keep_weights {
            old.into_loaded();
        } else {
            drop(old);
        }
        let mut engine = loop {
            match Engine::new(self.loaded.clone(), self.config.clone()) {
                Ok(e) => break e,
                Err(e) => {
                    tracing::error!(model = %self.model, pool = %self.pool, "rebuilding the engine failed: {e}; retrying");
                    self.refuse_waiting(rx);
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        };
        self.aborts_seen = 0;
        for (live, (salt, ids, params)) in again {
            self.readmit(&mut engine, live, salt, ids, params);
        }
        tracing::info!(model = %self.model, pool = %self.pool, "engine restarted");
        engine
    }

    /// While no engine runs, answers what arrives with an error.
    fn refuse_waiting(&mut self, rx: &mpsc::Receiver<Msg>) {
        for msg in std::iter::from_fn(|| rx.try_recv().ok()) {
            match msg {
                Msg::Submit(sub) => {
                    let e = "the model's engine is restarting; retry shortly".to_owned();
                    let _ = sub.out.send(Out::Error(AiError::Overloaded(e)));
                    self.load.fetch_sub(1, Ordering::Relaxed);
                }
                #[cfg(feature = "fault-injection")]
                Msg::InjectPanic => {}
            }
        }
    }
}
