//! Moving sequences between schedulers (prefill/decode disaggregation):
//! a lane releases a sequence's scheduling state and another adopts it,
//! while its pages, tags and request stay where they are; and what a lane
//! must know of the others (their running sequences, the pages they will
//! grow into).

use std::collections::HashMap;

use super::{Scheduler, SchedulerOutput, Seq, TenantId};
use crate::engine::kv_manager::{KvCacheManager, SeqId};

/// A sequence's scheduling state between two lanes: only
/// [`Scheduler::release`] makes one.
#[derive(Debug)]
pub struct Handoff {
    seq: Seq,
}

impl Handoff {
    /// The sequence's tenant.
    pub fn tenant(&self) -> TenantId {
        self.seq.tenant
    }

    /// Tokens whose KV is computed.
    pub fn computed(&self) -> usize {
        self.seq.computed
    }

    /// Gives the sequence to `tenant` (another engine numbers its tenants
    /// its own way).
    pub fn set_tenant(&mut self, tenant: TenantId) {
        self.seq.tenant = tenant;
    }
}

impl Scheduler {
    /// Takes `seq` out of this scheduler (running or waiting) with its
    /// state, for another lane to adopt or requeue; `None` if it is not
    /// here. Its KV pages are untouched.
    pub fn release(&mut self, seq: SeqId) -> Option<Handoff> {
        let s = self.seqs.remove(&seq)?;
        self.blocked.retain(|b| b.seq != seq);
        self.running.retain(|r| *r != seq);
        if let Some(q) = self.waiting.get_mut(&s.tenant) {
            q.retain(|w| *w != seq);
        }
        Some(Handoff { seq: s })
    }

    /// Takes a running sequence whose KV another lane computed: it runs
    /// here from the next step, its pages as they are. It has just sampled
    /// (its first token, in the other lane), so on this lane's clock its
    /// decode turn comes after the streams already waiting here.
    pub fn adopt(&mut self, seq: SeqId, mut h: Handoff) {
        h.seq.decoded_at = self.steps;
        self.seqs.insert(seq, h.seq);
        self.running.push(seq);
    }

    /// Puts a sequence that lost its pages (preempted, here or in another
    /// lane) at the front of its tenant's queue, to be recomputed from its
    /// first token.
    pub fn requeue_front(&mut self, seq: SeqId, mut h: Handoff) {
        h.seq.computed = 0;
        h.seq.present = 0;
        h.seq.preempted = true;
        let tenant = h.seq.tenant;
        self.seqs.insert(seq, h.seq);
        self.waiting.entry(tenant).or_default().push_front(seq);
    }

    /// Whether `seq` runs here with only its next token left to compute.
    pub fn runs_ready(&self, seq: SeqId) -> bool {
        self.remaining(seq) == 1 && self.running.contains(&seq)
    }

    /// Running sequences whose next token is a decode (their prompt
    /// computed), in running order.
    pub fn ready_to_decode(&self) -> Vec<SeqId> {
        (self.running.iter())
            .copied()
            .filter(|r| self.remaining(*r) == 1)
            .collect()
    }

    /// Streams whose next `horizon` tokens start a new page of
    /// `page_size` tokens: the pages another lane should leave free. A
    /// stream in a step planned and not yet applied (none left to compute
    /// until its token comes) counts from the token that step computes.
    pub fn pages_due(&self, page_size: usize, horizon: usize) -> usize {
        let ps = page_size.max(1);
        (self.running.iter())
            .filter(|r| self.remaining(**r) <= 1)
            .filter(|r| (ps - self.seqs[*r].computed % ps) % ps < horizon)
            .count()
    }

    /// Running sequences by tenant: what another lane's admissions count
    /// as running ([`Scheduler::set_elsewhere`]).
    pub fn running_by_tenant(&self) -> HashMap<TenantId, usize> {
        let mut by = HashMap::new();
        for r in &self.running {
            *by.entry(self.seqs[r].tenant).or_insert(0) += 1;
        }
        by
    }

    /// Sequences other lanes run, by tenant: admissions here count them
    /// against the running slots and each tenant's share of them, as if
    /// they ran here.
    pub fn set_elsewhere(&mut self, running: HashMap<TenantId, usize>) {
        self.elsewhere = running;
    }

    /// Pages this scheduler's allocations leave free for other lanes (the
    /// decode lane's next pages while a prefill lane admits).
    pub fn set_reserve(&mut self, pages: usize) {
        self.reserve = pages;
    }

    /// Preempts running `seq` for another lane's pages: they go, and it
    /// waits at the front of its tenant's queue to be recomputed.
    pub fn preempt_for_lane(&mut self, seq: SeqId, kv: &mut KvCacheManager) {
        self.preempt(seq, kv, &mut SchedulerOutput::default());
    }

    /// Whether another lane runs sequences (whose pages come free as they
    /// end or are preempted there).
    pub(super) fn runs_elsewhere(&self) -> bool {
        self.elsewhere.values().any(|n| *n > 0)
    }

    /// Running sequences of every lane this one knows of.
    pub(super) fn running_everywhere(&self) -> usize {
        self.running.len() + self.elsewhere.values().sum::<usize>()
    }
}
