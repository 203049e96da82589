//! The engine's schedulers. Without disaggregation one scheduler admits,
//! prefills and decodes. With it (`--pd on`) a prefill lane admits and
//! computes prompts and a decode lane runs the streams, each with its own
//! queue, token budget and step, over the one KV pool: a sequence moves to
//! the decode lane once only its next token is left to compute (normally
//! when its prompt's last chunk has sampled its first token),
//! and back to the front of the prefill queue (to be recomputed) when the
//! decode lane preempts it. Its pages, their tags and its request never
//! move, so a handoff copies nothing and the tag check guards the pages
//! that changed lanes as it guards any other.

use super::TenantId;
use super::kv_manager::{KvCacheManager, SeqId};
use super::prefix::PageHash;
use super::scheduler::{Handoff, Scheduler, SchedulerConfig, SchedulerOutput, StepCaps};

/// Decode steps a prefill step may span: the prefill lane leaves a page
/// free for each stream whose next this many tokens start a new page.
const PAGE_HORIZON: usize = 8;

/// One of the engine's schedulers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// Admits and computes prompts (and, without disaggregation, decodes).
    Prefill,
    /// Runs the streams handed over by the prefill lane.
    Decode,
}

/// The prefill lane, and the decode lane when disaggregated.
#[derive(Debug)]
pub(super) struct Lanes {
    prefill: Scheduler,
    decode: Option<Scheduler>,
    /// Sequences moved to the decode lane so far.
    handoffs: u64,
    /// The prefill lane's sequences in its last step planned, until it
    /// lands (`hand_off`): its kernels may still write their pages.
    flying: Vec<SeqId>,
}

impl Lanes {
    /// One scheduler, or two (`pd`) with the same limits each.
    pub fn new(config: SchedulerConfig, pd: bool) -> Self {
        Self {
            prefill: Scheduler::new(config),
            decode: pd.then(|| Scheduler::new(config)),
            handoffs: 0,
            flying: Vec::new(),
        }
    }

    /// Plans `lane`'s next step within the engine's `caps`. The prefill
    /// lane counts the decode lane's streams against its running slots and
    /// leaves a page free for each that will soon need one (and waits for
    /// those pages rather than preempt); the decode lane computes no prompt,
    /// picks its victims by what each tenant runs on both lanes (after
    /// landed prompts, which give their pages up first, `free_for_streams`), and
    /// what it preempts goes to the front of the prefill queue.
    pub fn schedule(
        &mut self,
        lane: Lane,
        kv: &mut KvCacheManager,
        caps: StepCaps,
    ) -> SchedulerOutput {
        let taken = match lane {
            Lane::Decode => self.free_for_streams(kv),
            Lane::Prefill => Vec::new(),
        };
        match (lane, &mut self.decode) {
            (Lane::Decode, Some(decode)) => {
                let no_prompt = StepCaps { prompt: 0, ..caps };
                decode.set_elsewhere(self.prefill.running_by_tenant());
                let mut out = decode.schedule(kv, no_prompt);
                for seq in &out.preempted {
                    if let Some(h) = decode.release(*seq) {
                        self.prefill.requeue_front(*seq, h);
                    }
                }
                out.preempted.extend(taken);
                out
            }
            (_, decode) => {
                if let Some(d) = decode {
                    self.prefill.set_elsewhere(d.running_by_tenant());
                    self.prefill
                        .set_reserve(d.pages_due(kv.page_size(), PAGE_HORIZON));
                }
                let out = self.prefill.schedule(kv, caps);
                if decode.is_some() {
                    self.flying = out.scheduled.iter().map(|s| s.seq).collect();
                }
                out
            }
        }
    }

    /// Streams due a page now that none is free for: prompts of the
    /// prefill lane outside the step in flight give theirs up first (in
    /// that lane's victim order), as they do for the pages it keeps for
    /// the streams (decode first; that reserve makes this rare), rather
    /// than a stream. The prompts preempted.
    fn free_for_streams(&mut self, kv: &mut KvCacheManager) -> Vec<SeqId> {
        let mut taken = Vec::new();
        let Some(decode) = &mut self.decode else {
            return taken;
        };
        let due = decode.pages_due(kv.page_size(), 1);
        if kv.num_free() < due {
            self.prefill.set_elsewhere(decode.running_by_tenant());
        }
        while kv.num_free() < due {
            let flying = &self.flying;
            let Some(p) = self.prefill.victim(|s| flying.contains(s)) else {
                break;
            };
            self.prefill.preempt_for_lane(p, kv);
            taken.push(p);
        }
        taken
    }

    /// Moves every prefill-lane sequence whose prompt is computed (its next
    /// token is a decode) to the decode lane, when there is one; the
    /// prefill step in flight has landed.
    pub fn hand_off(&mut self) {
        self.flying.clear();
        let Some(decode) = &mut self.decode else {
            return;
        };
        for seq in self.prefill.ready_to_decode() {
            if let Some(h) = self.prefill.release(seq) {
                decode.adopt(seq, h);
                self.handoffs += 1;
            }
        }
    }

    /// Takes `seq` out of whichever lane runs it, if only its next token
    /// is left to compute (for another engine to decode).
    pub fn release_ready(&mut self, seq: SeqId) -> Option<Handoff> {
        for lane in std::iter::once(&mut self.prefill).chain(self.decode.as_mut()) {
            if lane.runs_ready(seq) {
                return lane.release(seq);
            }
        }
        None
    }

    /// Runs a sequence whose prompt is computed: on the decode lane, or
    /// the one lane.
    pub fn adopt_running(&mut self, seq: SeqId, h: Handoff) {
        self.decode
            .as_mut()
            .unwrap_or(&mut self.prefill)
            .adopt(seq, h);
    }

    /// Whether there are two lanes.
    pub fn disaggregated(&self) -> bool {
        self.decode.is_some()
    }

    /// Whether the decode lane has streams to run.
    pub fn decoding(&self) -> bool {
        self.decode.as_ref().is_some_and(|d| d.running() > 0)
    }

    /// Sequences moved to the decode lane so far.
    pub fn handoffs(&self) -> u64 {
        self.handoffs
    }

    /// Sequences waiting on every lane (queued, or preempted to be
    /// recomputed).
    pub fn waiting(&self) -> usize {
        self.all().map(|s| s.len() - s.running()).sum()
    }

    fn all(&self) -> impl Iterator<Item = &Scheduler> {
        std::iter::once(&self.prefill).chain(self.decode.as_ref())
    }

    fn all_mut(&mut self) -> impl Iterator<Item = &mut Scheduler> {
        std::iter::once(&mut self.prefill).chain(self.decode.as_mut())
    }

    /// Queues a new sequence (always on the prefill lane).
    pub fn add(&mut self, seq: SeqId, tenant: TenantId, prompt_len: usize, prefix: Vec<PageHash>) {
        self.prefill.add(seq, tenant, prompt_len, prefix);
    }

    /// Sets `tenant`'s share weight on every lane.
    pub fn set_weight(&mut self, tenant: TenantId, weight: u32) {
        self.all_mut().for_each(|s| s.set_weight(tenant, weight));
    }

    /// Records a sampled token on the lane that holds `seq`.
    pub fn append_token(&mut self, seq: SeqId) {
        self.all_mut().for_each(|s| s.append_token(seq));
    }

    /// Forgets `seq` wherever it is.
    pub fn remove(&mut self, seq: SeqId) {
        self.all_mut().for_each(|s| s.remove(seq));
    }

    /// Sequences running on every lane.
    pub fn running(&self) -> usize {
        self.all().map(Scheduler::running).sum()
    }

    /// Sequences running on every lane, by tenant.
    pub fn running_by_tenant(&self) -> std::collections::HashMap<TenantId, usize> {
        let mut by = std::collections::HashMap::new();
        for (tenant, n) in self.all().flat_map(Scheduler::running_by_tenant) {
            *by.entry(tenant).or_insert(0) += n;
        }
        by
    }

    /// Whether nothing waits or runs on any lane.
    pub fn is_empty(&self) -> bool {
        self.all().all(Scheduler::is_empty)
    }

    /// Who waits on the next step, over every lane.
    pub fn contention(&self) -> super::scheduler::Contention {
        let activity = self.all().map(Scheduler::activity);
        activity
            .reduce(|a, b| a.merge(b))
            .unwrap_or_default()
            .contention()
    }
}

#[cfg(test)]
#[path = "lanes_tests.rs"]
mod tests;
