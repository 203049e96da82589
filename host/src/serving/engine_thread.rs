//! One decode pool: an [`Engine`] on its own thread, under supervision.
//! Requests arrive tokenized over a channel; their text goes back over a
//! per-request channel. A request whose receiver is gone (the guest dropped
//! its stream, or the caller went away) is cancelled at the next step,
//! freeing its pages.
//!
//! A panic or an error inside the engine fails only the requests of the
//! step it happened in, or the request being admitted (and any that already
//! streamed text, which cannot be replayed); the thread rebuilds the engine
//! (on the same weights after a panic, on weights loaded again after a
//! device error) and gives it the other requests again, as if they had just
//! arrived.

#[path = "engine_figures.rs"]
mod figures;
use figures::StepCounters;
#[path = "engine_restart.rs"]
mod restart;
#[path = "engine_transfer.rs"]
mod transfer;

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, mpsc};

use super::outlet::Outlet;
use kiln_runtime::{AiError, TokenLogprob, TopLogprob};
use prometheus_client::metrics::gauge::Gauge;

use crate::engine::{CompiledFormat, TenantId};
use crate::engine::{
    Engine, EngineConfig, Event, Finish, GenerateParams, PageHash, Salt, SeqId, SeqTransfer,
    TokenLogprobs,
};
use crate::metrics::{EngineMetrics, PoolPagesLabels};
use crate::model::Loaded;

/// A tokenized request for one pool.
pub(super) struct Submit {
    pub(super) tenant: Arc<str>,
    /// The tenant's share weight (its policy's).
    pub(super) weight: u32,
    pub(super) salt: Salt,
    pub(super) ids: Vec<u32>,
    pub(super) params: GenerateParams,
    /// The params' output format, compiled by the sender (a replay's is
    /// compiled by the engine).
    pub(super) format: Option<CompiledFormat>,
    /// One channel per sample of the prompt (usually one); sample `i`
    /// draws with the params' seed plus `i`.
    pub(super) outs: Vec<Outlet>,
    /// Engine failures the request has lived through (0 when new).
    pub(super) restarts: u32,
    /// Sent to a prefill pool: the decode pool its sequences go to once
    /// their prompts are computed.
    pub(super) then: Option<Forward>,
}

/// Where a prefill pool hands a sequence on: a decode pool's channel and
/// its count of requests.
#[derive(Clone)]
pub(super) struct Forward {
    pub(super) tx: mpsc::Sender<Msg>,
    pub(super) load: Arc<AtomicUsize>,
    /// Sequences handed to the pool and not yet adopted.
    pub(super) handed: Arc<AtomicUsize>,
}

/// Sequences a decode pool may hold handed on and not yet adopted: each
/// holds its KV outside any pool's pages (on a GPU, device memory of the
/// prefill pool's), so past these a prefill pool keeps the next ones and
/// decodes them itself, within its own pages, until the decode pool
/// takes some.
pub const MAX_HANDED_WAITING: usize = 8;

/// One sequence counted in its decode pool's `handed` while it waits there
/// (adopted, failed or dropped, it counts no more).
pub(super) struct Handed(Arc<AtomicUsize>);

impl Handed {
    /// Counts one more sequence waiting in `to`.
    pub(super) fn new(to: &Forward) -> Self {
        to.handed.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(&to.handed))
    }
}

impl Drop for Handed {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A sequence a prefill pool computed the prompt of, for a decode pool to
/// run from its next token, with the request's channel.
pub(super) struct Adopt {
    transfer: SeqTransfer,
    out: Outlet,
    tenant: Arc<str>,
    weight: u32,
    restarts: u32,
    /// Counted as waiting in the decode pool until this goes.
    handed: Handed,
}

/// Messages to a pool's thread.
pub(super) enum Msg {
    /// A new request.
    Submit(Box<Submit>),
    /// A request whose prompt a prefill pool computed.
    Adopt(Box<Adopt>),
    /// The server is shutting down: end every request and the thread, and
    /// free the engine's device state on this thread.
    Close,
    /// Test-only: the engine fails in its next step.
    #[cfg(feature = "fault-injection")]
    InjectFault(crate::engine::Fault),
}

/// Messages from the engine thread to one request.
pub(super) enum Out {
    /// New text, and the log-probabilities of the tokens behind it when
    /// the call asked for them.
    Text(String, Vec<TokenLogprob>),
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
    /// Sequences a prefill pool handed to this pool, not yet adopted.
    handed: Arc<AtomicUsize>,
    /// Page hashes the pool holds in its prefix cache, mirrored for routing.
    pub(super) prefixes: Arc<RwLock<HashSet<PageHash>>>,
    /// Free (cached included), cached and total pages, and integrity
    /// aborts, as last published.
    pub(super) figures: Arc<[AtomicUsize; 5]>,
    /// The engine's thread, until joined.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl PoolHandle {
    /// How many of `hashes`' leading pages this pool has cached.
    pub(super) fn cached_prefix(&self, hashes: &[PageHash]) -> usize {
        let set = self.prefixes.read().unwrap_or_else(|p| p.into_inner());
        hashes.iter().take_while(|h| set.contains(h)).count()
    }

    /// Where a prefill pool hands this pool its sequences.
    pub(super) fn forward(&self) -> Forward {
        Forward {
            tx: self.tx.clone(),
            load: self.load.clone(),
            handed: self.handed.clone(),
        }
    }

    /// Waits for the engine's thread to end (after [`Msg::Close`]).
    pub(super) fn join(&self) {
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread
            && t.join().is_err()
        {
            tracing::error!("an engine thread ended in a panic");
        }
    }
}

/// A request the engine holds, and what it takes to give it to a rebuilt
/// engine.
struct Live {
    out: Outlet,
    tenant: Arc<str>,
    /// The tenant's share weight.
    weight: u32,
    /// The request as submitted, until its first text goes out (after
    /// that, running it again would repeat text the caller has).
    replay: Option<(Salt, Vec<u32>, GenerateParams)>,
    /// Engine failures this request has lived through.
    restarts: u32,
    /// In a prefill pool: the decode pool to hand the sequence to once it
    /// has its first token.
    then: Option<Forward>,
    /// Whether it has sampled a token (its prompt is computed).
    sampled: bool,
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
    /// This pool's step counters, looked up once.
    step_counters: StepCounters,
    load: Arc<AtomicUsize>,
    prefixes: Arc<RwLock<HashSet<PageHash>>>,
    figures: Arc<[AtomicUsize; 5]>,
    tenants: HashMap<Arc<str>, TenantId>,
    outs: HashMap<SeqId, Live>,
    aborts_seen: u64,
    /// The engine's step count when last published.
    steps_seen: u64,
    /// Messages taken from the channel and not yet handled (a failure
    /// leaves the rest here for the rebuilt engine).
    inbox: VecDeque<Msg>,
    /// In a decode pool: sequences from the prefill pool waiting for a
    /// running slot and pages (`engine_transfer.rs`).
    pending: VecDeque<Adopt>,
    /// The request being admitted (a `Live` per sample): a failure now is
    /// its doing.
    admitting: Vec<Live>,
    /// A step is running: a failure now concerns its sequences.
    stepping: bool,
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
        handed: Arc::default(),
        prefixes: Arc::default(),
        figures: Arc::default(),
        thread: Mutex::new(None),
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
    let step_counters = StepCounters::new(&metrics, model, index);
    let mut state = PoolThread {
        loaded,
        config,
        model: model.to_owned(),
        pool: index.to_string(),
        metrics,
        page_gauges,
        step_counters,
        load: handle.load.clone(),
        prefixes: handle.prefixes.clone(),
        figures: handle.figures.clone(),
        tenants: HashMap::new(),
        outs: HashMap::new(),
        aborts_seen: 0,
        steps_seen: 0,
        inbox: VecDeque::new(),
        pending: VecDeque::new(),
        admitting: Vec::new(),
        stepping: false,
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
    let thread = std::thread::Builder::new()
        .name(format!("kiln-engine-{model}-{index}"))
        .spawn(move || match compute {
            Some(c) => c.install(|| state.run(engine, rx)),
            None => state.run(engine, rx),
        })?;
    *handle.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
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
            // Block for work when idle; otherwise take what has arrived.
            if !engine.has_work() && self.inbox.is_empty() && self.pending.is_empty() {
                match rx.recv() {
                    Ok(msg) => self.inbox.push_back(msg),
                    // Every handle is gone: the server is shutting down.
                    Err(_) => return,
                }
            }
            self.inbox.extend(std::iter::from_fn(|| rx.try_recv().ok()));
            if self.inbox.iter().any(|m| matches!(m, Msg::Close)) {
                self.close();
                // The engine (and its device memory) goes with this thread.
                drop(engine);
                tracing::info!(model = %self.model, pool = %self.pool, "engine stopped");
                return;
            }
            let turn = std::panic::catch_unwind(AssertUnwindSafe(|| self.turn(&mut engine)));
            let failure = match turn {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => Failure::Error(e),
                Err(p) => Failure::Panic(panic_message(p.as_ref())),
            };
            let restarted =
                std::panic::catch_unwind(AssertUnwindSafe(|| self.restart(engine, failure, &rx)));
            match restarted {
                Ok(Some(e)) => engine = e,
                // Closed while it could not be rebuilt.
                Ok(None) => return,
                Err(p) => {
                    let m = panic_message(p.as_ref());
                    tracing::error!(model = %self.model, pool = %self.pool, "restarting the engine panicked: {m}; the pool stops");
                    self.close();
                    return;
                }
            }
        }
    }

    /// Admits what arrived, cancels requests whose callers left, and runs
    /// a step if there is work.
    fn turn(&mut self, engine: &mut Engine) -> Result<(), String> {
        while let Some(msg) = self.inbox.pop_front() {
            match msg {
                Msg::Submit(sub) => self.admit(engine, *sub),
                Msg::Adopt(a) => self.pending.push_back(*a),
                #[cfg(feature = "fault-injection")]
                Msg::InjectFault(f) => engine.inject_fault(f),
                Msg::Close => {}
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
        self.cut_unread(engine);
        self.drop_abandoned();
        self.adopt_pending(engine);
        if engine.has_work() {
            // Left set by a failure, for `restart` to read.
            self.stepping = true;
            self.step(engine)?;
            self.stepping = false;
        }
        // Figures before the thread may block waiting for work.
        self.publish(engine);
        Ok(())
    }

    fn tenant_id(&mut self, tenant: &Arc<str>) -> TenantId {
        let next = TenantId(self.tenants.len() as u32);
        *self.tenants.entry(tenant.clone()).or_insert(next)
    }

    fn admit(&mut self, engine: &mut Engine, sub: Submit) {
        let tenant = self.tenant_id(&sub.tenant);
        engine.set_tenant_weight(tenant, sub.weight);
        let n = sub.outs.len();
        // Each sample replays alone, with its own seed.
        self.admitting = (sub.outs.into_iter().enumerate())
            .map(|(i, out)| {
                let seed = sub.params.seed.map(|s| s.wrapping_add(i as u64));
                let params = GenerateParams {
                    seed,
                    ..sub.params.clone()
                };
                Live {
                    out,
                    tenant: sub.tenant.clone(),
                    weight: sub.weight,
                    replay: Some((sub.salt, sub.ids.clone(), params)),
                    restarts: sub.restarts,
                    then: sub.then.clone(),
                    sampled: false,
                }
            })
            .collect();
        let added = engine.admit(tenant, sub.salt, sub.ids, sub.params, n, sub.format);
        let lives = std::mem::take(&mut self.admitting);
        match added {
            Ok(seqs) => self.outs.extend(seqs.into_iter().zip(lives)),
            Err(e) => {
                for live in lives {
                    let _ = live.out.send(Out::Error(AiError::InvalidInput(e.clone())));
                    self.load.fetch_sub(1, Ordering::Relaxed);
                }
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
        let start = std::time::Instant::now();
        let events = engine.step()?;
        self.count_step(engine, start.elapsed());
        // Figures first, so that anyone who sees this step's tokens also
        // sees the pages it holds.
        self.publish(engine);
        self.deliver(engine, events);
        Ok(())
    }

    /// Sends each event to its request and hands on what a decode pool
    /// takes from here.
    fn deliver(&mut self, engine: &mut Engine, events: Vec<Event>) {
        for ev in events {
            match ev {
                Event::Token {
                    seq,
                    text,
                    logprobs,
                    token,
                } => {
                    let Some(live) = self.outs.get_mut(&seq) else {
                        continue;
                    };
                    live.sampled |= token.is_some();
                    if !text.is_empty() || !logprobs.is_empty() {
                        live.replay = None;
                        let lp = logprobs.into_iter().map(token_logprob).collect();
                        let _ = live.out.send(Out::Text(text, lp));
                    }
                }
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
        self.hand_on(engine);
    }

    /// Ends the samples whose callers have left more unread than their
    /// share of the call's bound: the engine
    /// would otherwise keep generating into memory for a caller that does
    /// not read, until its deadline. What they generated is still theirs
    /// to read, and to pay for.
    fn cut_unread(&mut self, engine: &mut Engine) {
        let overdue: Vec<SeqId> = (self.outs.iter())
            .filter(|(_, l)| l.out.overdue())
            .map(|(s, _)| *s)
            .collect();
        if overdue.is_empty() {
            return;
        }
        let mut events = Vec::new();
        for seq in overdue {
            let why = "the caller left too much of this answer unread (its log-probabilities \
                       above all); read the stream as it comes, or ask for fewer tokens, \
                       samples or top_logprobs";
            engine.abort(seq, why.into(), &mut events);
        }
        self.publish(engine);
        self.deliver(engine, events);
    }
}

/// The engine's log-probabilities of a token as the runtime passes them on.
fn token_logprob(lp: TokenLogprobs) -> TokenLogprob {
    TokenLogprob {
        token: lp.chosen.text,
        bytes: lp.chosen.bytes,
        logprob: lp.chosen.logprob,
        top: lp
            .top
            .into_iter()
            .map(|t| TopLogprob {
                token: t.text,
                bytes: t.bytes,
                logprob: t.logprob,
            })
            .collect(),
    }
}
