//! What a pool's thread does when its engine fails, and when the server
//! closes it.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use kiln_runtime::AiError;

use super::super::engine_restarted;
use super::{Failure, Live, Msg, Out, PoolThread, Submit};
use crate::engine::{Engine, SeqId};
use crate::metrics::PoolLabels;

/// What a failed request's caller is told: no detail, since a panic's
/// message may quote another tenant's text from the same batch (the log has
/// it).
const TOLD: &str = "failed inside a step";

impl PoolThread {
    /// Replaces a failed engine: fails the requests the failure concerns,
    /// builds a new engine (on the same weights after a panic; after a
    /// device error, on weights loaded again) and queues the rest for it.
    /// `None` if the server closed the pool while no engine could be built.
    pub(super) fn restart(
        &mut self,
        old: Engine,
        failure: Failure,
        rx: &mpsc::Receiver<Msg>,
    ) -> Option<Engine> {
        let blamed: HashSet<SeqId> = if std::mem::take(&mut self.stepping) {
            old.in_step().iter().copied().collect()
        } else {
            HashSet::new()
        };
        let (why, keep_weights) = match failure {
            Failure::Panic(m) => (format!("panicked: {m}"), true),
            Failure::Error(e) => (format!("failed: {e}"), false),
        };
        // The requests to fail are failed after the restart is counted, so
        // a client that reads the metrics once its request has failed sees
        // the restart that failed it.
        let (mut failed, mut lost) = (Vec::new(), Vec::new());
        for live in std::mem::take(&mut self.admitting) {
            failed.push((None, live.tenant.clone()));
            lost.push(live);
        }
        let mut again = Vec::new();
        for (seq, mut live) in std::mem::take(&mut self.outs) {
            match live.replay.take() {
                Some((salt, ids, params)) if !blamed.contains(&seq) && live.restarts == 0 => {
                    again.push(Msg::Submit(Box::new(Submit {
                        tenant: live.tenant,
                        weight: live.weight,
                        salt,
                        ids,
                        params,
                        format: None,
                        outs: vec![live.out],
                        restarts: live.restarts + 1,
                        then: live.then,
                    })));
                }
                _ => {
                    failed.push((Some(seq), live.tenant.clone()));
                    lost.push(live);
                }
            }
        }
        tracing::error!(
            model = %self.model,
            pool = %self.pool,
            failed = ?failed,
            replayed = again.len(),
            "the engine {why}; failing the requests it concerns (sequence, tenant) and restarting it"
        );
        // Those of the failed step too: the plan made them.
        self.count_preemptions(&old);
        let labels = PoolLabels {
            model: self.model.clone(),
            pool: self.pool.clone(),
        };
        self.metrics.engine_restarts.get_or_create(&labels).inc();
        self.metrics
            .engine_replays
            .get_or_create(&labels)
            .inc_by(again.len() as u64);
        for live in lost {
            self.fail(live);
        }
        // Replays go first, in their order, before what arrived since.
        for msg in again.into_iter().rev() {
            self.inbox.push_front(msg);
        }
        if keep_weights {
            old.into_loaded();
        } else {
            drop(old);
        }
        // The new engine's cache starts empty: routing must not count on
        // the old one's pages.
        self.prefixes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.aborts_seen = 0;
        self.steps_seen = 0;
        self.step_counters.restarted();
        loop {
            match Engine::new(self.loaded.clone(), self.config.clone()) {
                Ok(engine) => {
                    tracing::info!(model = %self.model, pool = %self.pool, "engine restarted");
                    return Some(engine);
                }
                Err(e) => {
                    tracing::error!(model = %self.model, pool = %self.pool, "rebuilding the engine failed: {e}; retrying");
                    if self.refuse_waiting(rx) {
                        return None;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    }

    /// Tells a request the engine failed under it.
    fn fail(&self, live: Live) {
        let _ = live.out.send(Out::Error(engine_restarted(TOLD)));
        self.load.fetch_sub(1, Ordering::Relaxed);
    }

    /// While no engine runs, answers what is queued or arrives with an
    /// error; true if the server is closing (or has gone).
    fn refuse_waiting(&mut self, rx: &mpsc::Receiver<Msg>) -> bool {
        let mut closing = false;
        loop {
            match rx.try_recv() {
                Ok(msg) => self.inbox.push_back(msg),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    closing = true;
                    break;
                }
            }
        }
        let pending = std::mem::take(&mut self.pending).into_iter();
        let handed = pending.map(|a| Msg::Adopt(Box::new(a)));
        for msg in std::mem::take(&mut self.inbox).into_iter().chain(handed) {
            match msg {
                Msg::Submit(sub) => {
                    let e = "the model's engine is restarting; retry shortly".to_owned();
                    for out in sub.outs {
                        let _ = out.send(Out::Error(AiError::Overloaded(e.clone())));
                        self.load.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                Msg::Adopt(a) => {
                    let e = "the model's engine is restarting; retry shortly".to_owned();
                    let _ = a.out.send(Out::Error(AiError::Overloaded(e)));
                    self.load.fetch_sub(1, Ordering::Relaxed);
                }
                #[cfg(feature = "fault-injection")]
                Msg::InjectFault(_) => {}
                Msg::Close => closing = true,
            }
        }
        closing
    }

    /// Ends every request held or queued with a clean error.
    pub(super) fn close(&mut self) {
        let e = || AiError::Aborted("the server is shutting down; retry the request".into());
        let pending = std::mem::take(&mut self.pending).into_iter();
        let handed = pending.map(|a| Msg::Adopt(Box::new(a)));
        for msg in std::mem::take(&mut self.inbox).into_iter().chain(handed) {
            let outs = match msg {
                Msg::Submit(sub) => sub.outs,
                Msg::Adopt(a) => vec![a.out],
                _ => continue,
            };
            for out in outs {
                let _ = out.send(Out::Error(e()));
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
        for live in std::mem::take(&mut self.outs).into_values() {
            let _ = live.out.send(Out::Error(e()));
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
