//! The scheduler: waiting and running sequences, a token budget per step,
//! chunked prefill, preemption by recompute, and fairness across tenants,
//! each weighted by its policy's share (1 unless set): decodes run before
//! prompt chunks (shared max-min fairly among the tenants with streams when
//! a step cannot carry them all), prompt tokens are shared max-min fairly
//! among the tenants with prompts, a tenant past its share of the running slots waits while
//! another tenant waits, and preemption takes from the tenant furthest
//! over its share (planning in `scheduler_plan.rs`).
//!
//! Its [`SchedulerOutput`] is the engine's plan for a step.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::block_pool::TenantId;
use super::kv_manager::{KvCacheManager, SeqId};
use super::prefix::PageHash;

/// Scheduling limits.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Most tokens computed in one step (prefill chunks + decodes).
    pub max_tokens_per_step: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// While tenants compete, a step's time at most this many lone decode
    /// steps' (prompt tokens, then decodes, cut to fit; 0 or 1: no limit
    /// but the token budget).
    pub step_target: f64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_tokens_per_step: 256,
            max_running: 64,
            step_target: 0.0,
        }
    }
}

/// What one step may carry, from the engine's step time target: decode
/// tokens (shared fairly among the tenants whose streams decode, when not
/// all fit) and prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCaps {
    /// Most decode tokens (one a stream).
    pub decodes: usize,
    /// Most prompt tokens.
    pub prompt: usize,
}

impl StepCaps {
    /// No cap but the scheduler's token budget.
    pub const NONE: Self = Self {
        decodes: usize::MAX,
        prompt: usize::MAX,
    };
}

/// Who is waiting on the next step: what the step time target needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contention {
    /// Another tenant's streams would be slowed by the step's work
    /// ([`Scheduler::contention`] says when).
    pub competing: bool,
    /// Running sequences that decode.
    pub streams: usize,
    /// Whether any sequence has prompt tokens to compute.
    pub prompting: bool,
}

/// What the scheduler tracks of a sequence.
#[derive(Debug, Clone)]
struct Seq {
    tenant: TenantId,
    /// Tokens whose KV must exist: prompt plus generated so far.
    len: usize,
    /// Tokens whose KV is in the cache.
    computed: usize,
    /// Hashes of the prompt's full pages (empty: no prefix caching).
    prefix: Vec<PageHash>,
    /// Positions below this already hold KV from the prefix cache, so a
    /// chunk inside them is computed but not written.
    present: usize,
    /// The step that last decoded it (0: none yet), so capped decodes
    /// take turns.
    decoded_at: u64,
    /// Tokens of its prompt: once they are computed it is a stream.
    prompt: usize,
    /// Whether it lost its pages once: it then waits until the free pages
    /// hold all of it, rather than start again on the few left free and
    /// lose them again to the streams that took its own, and its tenant's
    /// other sequences are preempted before it.
    preempted: bool,
}

impl Seq {
    /// The next `count` tokens of this sequence as a step's work.
    fn plan(&self, seq: SeqId, count: usize) -> Scheduled {
        Scheduled {
            seq,
            start: self.computed,
            count,
            sample: self.computed + count == self.len,
            write_kv: self.computed + count > self.present,
        }
    }
}

/// One sequence's work in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    /// The sequence.
    pub seq: SeqId,
    /// Compute positions `start..start + count`.
    pub start: usize,
    /// How many tokens.
    pub count: usize,
    /// Whether this chunk reaches the end, so the step samples a token.
    pub sample: bool,
    /// Whether to write the chunk's K and V. False only when every prompt
    /// token hit the prefix cache: the last one is recomputed for its
    /// logits, and its KV is already in a shared page.
    pub write_kv: bool,
}

/// A step's plan.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Sequences to run, in batch order.
    pub scheduled: Vec<Scheduled>,
    /// Sequences preempted this step (their KV was freed; they will be
    /// recomputed when readmitted).
    pub preempted: Vec<SeqId>,
    /// Sequences admitted this step with the prompt tokens they found in
    /// the prefix cache.
    pub prefix_hits: Vec<(SeqId, usize)>,
}

/// A tenant's sequence refused admission for pages, and the pages it waits
/// for.
#[derive(Debug, Clone, Copy)]
struct Blocked {
    tenant: TenantId,
    seq: SeqId,
    pages: usize,
}

/// Waiting queues per tenant (served round-robin) and the running set.
#[derive(Debug, Default)]
pub struct Scheduler {
    config: SchedulerConfig,
    seqs: HashMap<SeqId, Seq>,
    waiting: BTreeMap<TenantId, VecDeque<SeqId>>,
    /// Tenant served first at the next admission.
    next_tenant: TenantId,
    running: Vec<SeqId>,
    /// Tenants' share weights (absent: 1).
    weights: HashMap<TenantId, u32>,
    /// Steps planned so far.
    steps: u64,
    /// Sequences other lanes run, by tenant (counted as running here).
    elsewhere: HashMap<TenantId, usize>,
    /// Pages allocations leave free for other lanes.
    reserve: usize,
    /// Sequences refused admission for pages, one a tenant, in the order
    /// their tenants were first refused: the first that holds pages back
    /// (`holds_pages`) has the pages it waits for left free by admissions
    /// after it, so requests arriving later cannot take each page as it
    /// frees.
    blocked: Vec<Blocked>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            config,
            ..Default::default()
        }
    }

    /// Queues a sequence of `prompt_len` tokens whose full prompt pages
    /// hash to `prefix` (empty to bypass the prefix cache).
    pub fn add(&mut self, seq: SeqId, tenant: TenantId, prompt_len: usize, prefix: Vec<PageHash>) {
        self.seqs.insert(
            seq,
            Seq {
                tenant,
                len: prompt_len,
                computed: 0,
                prefix,
                present: 0,
                decoded_at: 0,
                prompt: prompt_len,
                preempted: false,
            },
        );
        self.waiting.entry(tenant).or_default().push_back(seq);
    }

    /// Sets `tenant`'s share weight: when tenants compete, each gets slots
    /// and prompt tokens in proportion to its weight (0 counts as 1).
    pub fn set_weight(&mut self, tenant: TenantId, weight: u32) {
        if weight <= 1 {
            self.weights.remove(&tenant);
        } else {
            self.weights.insert(tenant, weight);
        }
    }

    /// `tenant`'s share weight.
    fn weight(&self, tenant: TenantId) -> usize {
        self.weights.get(&tenant).map_or(1, |w| *w as usize)
    }

    /// Records a sampled token (the sequence grew by one).
    pub fn append_token(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len += 1;
        }
    }

    /// Forgets a sequence (finished, aborted or cancelled). The caller frees
    /// its KV.
    pub fn remove(&mut self, seq: SeqId) {
        self.release(seq);
    }

    /// Sequences running (admitted, holding pages).
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Sequences known (waiting or running).
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether nothing is waiting or running.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Running sequences of `tenant`, here and in the other lanes.
    fn running_of(&self, tenant: TenantId) -> usize {
        let here = (self.running.iter())
            .filter(|r| self.seqs[*r].tenant == tenant)
            .count();
        here + self.elsewhere.get(&tenant).copied().unwrap_or(0)
    }

    /// The running sequence to preempt: one of the tenant with the most
    /// running sequences for its weight, the newest of those that never
    /// lost their pages before (a sequence preempted again would throw
    /// away its recomputation too), skipping the `protected` (those
    /// already in this step, or, for another lane short of pages, those
    /// its step in flight still writes).
    pub(in crate::engine) fn victim(&self, protected: impl Fn(&SeqId) -> bool) -> Option<SeqId> {
        // (running, weight, never preempted, index): n / w compared as
        // n * bw against bn * w; at equal shares the fresh, then the newest.
        let mut best: Option<(usize, usize, bool, usize)> = None;
        for (i, r) in self.running.iter().enumerate() {
            if protected(r) {
                continue;
            }
            let seq = &self.seqs[r];
            let (n, w) = (self.running_of(seq.tenant), self.weight(seq.tenant));
            let fresh = !seq.preempted;
            let better = best.is_none_or(|(bn, bw, bfresh, _)| {
                (n * bw).cmp(&(bn * w)).then(fresh.cmp(&bfresh)).is_ge()
            });
            if better {
                best = Some((n, w, fresh, i));
            }
        }
        best.map(|(_, _, _, i)| self.running[i])
    }

    fn preempt(&mut self, seq: SeqId, kv: &mut KvCacheManager, out: &mut SchedulerOutput) {
        kv.free(seq);
        if let Some(h) = self.release(seq) {
            self.requeue_front(seq, h);
        }
        out.preempted.push(seq);
    }
}

#[path = "scheduler_handoff.rs"]
mod handoff;
#[path = "scheduler_plan.rs"]
mod plan;
#[path = "scheduler_turns.rs"]
mod turns;
pub use handoff::Handoff;
pub use plan::fair_shares;
pub use turns::Activity;

#[cfg(test)]
#[path = "scheduler_pages_tests.rs"]
mod pages_tests;
#[cfg(test)]
#[path = "scheduler_tests.rs"]
pub(super) mod tests;
#[cfg(test)]
#[path = "scheduler_turns_tests.rs"]
mod turns_tests;
