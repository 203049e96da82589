//! Prefill pools and decode pools (`kiln serve --prefill-device`): a
//! prefill pool's thread hands each sequence whose prompt it computed,
//! with the request's channel, to the decode pool the router chose for it
//! (`Forward`); that pool's thread adopts it into its engine, on pages of
//! its own pool tagged for the tenant, and streams the rest. A sequence
//! its engine will not hand on (other samples wait on its prompt, say)
//! stays and decodes where it is; one the decode pool cannot take fails
//! with a clear error.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kiln_runtime::AiError;

use super::{Adopt, Live, Msg, Out, PoolThread};
use crate::engine::{Engine, SeqId};
use crate::metrics::PoolLabels;

impl PoolThread {
    /// In a prefill pool: hands on every sequence that has its first token.
    pub(super) fn hand_on(&mut self, engine: &mut Engine) {
        let ready: Vec<SeqId> = (self.outs.iter())
            .filter(|(_, l)| l.then.is_some() && l.sampled)
            .map(|(s, _)| *s)
            .collect();
        for seq in ready {
            let transfer = match engine.export(seq) {
                Ok(t) => t,
                Err(why) => {
                    tracing::debug!(model = %self.model, pool = %self.pool, "sequence {seq} decodes here: {why}");
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
            self.metrics
                .transfers
                .get_or_create(&PoolLabels {
                    model: self.model.clone(),
                    pool: self.pool.clone(),
                })
                .inc();
            to.load.fetch_add(1, Ordering::Relaxed);
            let adopt = Adopt {
                transfer,
                out,
                tenant,
                weight,
                restarts,
            };
            if let Err(mpsc_err) = to.tx.send(Msg::Adopt(Box::new(adopt))) {
                to.load.fetch_sub(1, Ordering::Relaxed);
                if let Msg::Adopt(a) = mpsc_err.0 {
                    let e = AiError::RuntimeError("the decode pool has stopped".into());
                    let _ = a.out.send(Out::Error(e));
                }
            }
        }
    }

    /// In a decode pool: runs a sequence a prefill pool computed the
    /// prompt of.
    pub(super) fn adopt(&mut self, engine: &mut Engine, a: Adopt) {
        let Adopt {
            mut transfer,
            out,
            tenant,
            weight,
            restarts,
        } = a;
        let id = self.tenant_id(&tenant);
        engine.set_tenant_weight(id, weight);
        transfer.set_tenant(id);
        match engine.adopt(transfer) {
            Ok(seq) => {
                let live = Live {
                    out,
                    tenant: Arc::clone(&tenant),
                    weight,
                    // Its first text may have gone out: it cannot replay.
                    replay: None,
                    restarts,
                    then: None,
                    sampled: true,
                };
                self.outs.insert(seq, live);
            }
            Err(why) => {
                let e = format!("the decode pool could not take the request: {why}; retry it");
                let _ = out.send(Out::Error(AiError::Overloaded(e)));
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
