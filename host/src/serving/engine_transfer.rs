//! Prefill pools and decode pools (`kiln serve --prefill-device`): a
//! prefill pool's thread hands each sequence whose prompt it computed,
//! with the request's channel, to the decode pool the router chose for it
//! (`Forward`); that pool's thread adopts it into its engine, on pages of
//! its own pool tagged for the tenant, and streams the rest. A sequence
//! its engine cannot hand on yet (in a step in flight, preempted, or other
//! samples about to start from its prompt) is tried again after the next
//! step; one it never will (pages that fail their tags) stays, and its
//! next step's tag check aborts it. A decode pool takes what it is handed
//! as it would admit a request: while a running slot and the pages are
//! free, the rest waiting, fairly among tenants; one it still cannot take
//! fails with a clear error.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kiln_runtime::AiError;

use super::{Adopt, Handed, Live, MAX_HANDED_WAITING, Msg, Out, PoolThread};
use crate::engine::{Engine, SeqId, TenantId};
use crate::metrics::PoolLabels;

impl PoolThread {
    /// In a prefill pool: hands on every sequence that has its first token,
    /// while its decode pool holds fewer than `MAX_HANDED_WAITING` not yet
    /// adopted (the others stay and decode here, tried again after the
    /// next step).
    pub(super) fn hand_on(&mut self, engine: &mut Engine) {
        let ready: Vec<SeqId> = (self.outs.iter())
            .filter(|(_, l)| l.then.is_some() && l.sampled)
            .map(|(s, _)| *s)
            .collect();
        for seq in ready {
            let full = (self.outs.get(&seq))
                .and_then(|l| l.then.as_ref())
                .is_some_and(|to| to.handed.load(Ordering::Relaxed) >= MAX_HANDED_WAITING);
            if full {
                continue;
            }
            let transfer = match engine.export(seq) {
                Ok(t) => t,
                // Preempted, or in a step in flight: after a later step.
                Err(e) if e.later => continue,
                Err(e) => {
                    tracing::debug!(model = %self.model, pool = %self.pool, "sequence {seq} decodes here: {e}");
                    if let Some(live) = self.outs.get_mut(&seq) {
                        live.then = None;
                    }
                    continue;
                }
            };
            let Some(Live {
                out,
                tenant,
                weight,
                restarts,
                then: Some(to),
                ..
            }) = self.leave(seq)
            else {
                continue;
            };
            to.load.fetch_add(1, Ordering::Relaxed);
            let adopt = Adopt {
                transfer,
                out,
                tenant,
                weight,
                restarts,
                handed: Handed::new(&to),
            };
            match to.tx.send(Msg::Adopt(Box::new(adopt))) {
                Ok(()) => {
                    let labels = PoolLabels {
                        model: self.model.clone(),
                        pool: self.pool.clone(),
                    };
                    self.metrics.transfers.get_or_create(&labels).inc();
                }
                Err(mpsc_err) => {
                    to.load.fetch_sub(1, Ordering::Relaxed);
                    if let Msg::Adopt(a) = mpsc_err.0 {
                        let e = AiError::RuntimeError("the decode pool has stopped".into());
                        let _ = a.out.send(Out::Error(e));
                    }
                }
            }
        }
    }

    /// In a decode pool: forgets the sequences handed on whose callers left
    /// while they waited for a slot (and the KV they carry), so that they
    /// hold no memory, count in no load and are never run.
    pub(super) fn drop_abandoned(&mut self) {
        let before = self.pending.len();
        self.pending.retain(|a| !a.out.is_closed());
        self.load
            .fetch_sub(before - self.pending.len(), Ordering::Relaxed);
    }

    /// In a decode pool: runs the sequences the prefill pool handed on
    /// while a running slot and their pages are free (as admission would
    /// ask of a new request) and none of its own waits (`room_to_adopt`),
    /// the next always of the tenant running the fewest here for its
    /// weight (in order within a tenant); with nothing running or waiting,
    /// that one runs or fails at once.
    pub(super) fn adopt_pending(&mut self, engine: &mut Engine) {
        let tenants: Vec<(Arc<str>, u32)> = (self.pending.iter())
            .map(|a| (Arc::clone(&a.tenant), a.weight))
            .collect();
        let mut waiting: Vec<(TenantId, u32)> = (tenants.iter())
            .map(|(t, w)| (self.tenant_id(t), *w))
            .collect();
        while let Some(next) = engine.next_to_adopt(&waiting) {
            let pages = self.pending[next].transfer.pages();
            if !engine.room_to_adopt(pages, self.config.scheduler.max_running) {
                return;
            }
            waiting.remove(next);
            if let Some(a) = self.pending.remove(next) {
                self.adopt(engine, a);
            }
        }
    }

    /// Runs one sequence the prefill pool computed the prompt of. Its
    /// `Live` waits in `admitting` meanwhile, so a panic fails it as one
    /// being admitted.
    fn adopt(&mut self, engine: &mut Engine, a: Adopt) {
        let Adopt {
            mut transfer,
            out,
            tenant,
            weight,
            restarts,
            handed,
        } = a;
        // No longer waiting: the next may be handed on.
        drop(handed);
        let id = self.tenant_id(&tenant);
        self.admitting = vec![Live {
            out,
            tenant: Arc::clone(&tenant),
            weight,
            // Its first text may have gone out: it cannot replay.
            replay: None,
            restarts,
            then: None,
            sampled: true,
        }];
        engine.set_tenant_weight(id, weight);
        transfer.set_tenant(id);
        let adopted = engine.adopt(transfer);
        let Some(live) = std::mem::take(&mut self.admitting).pop() else {
            return;
        };
        match adopted {
            Ok(seq) => {
                self.outs.insert(seq, live);
            }
            Err(why) => {
                let e = format!("the decode pool could not take the request: {why}; retry it");
                let _ = live.out.send(Out::Error(AiError::Overloaded(e)));
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
