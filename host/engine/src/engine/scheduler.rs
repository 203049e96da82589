//! The scheduler: waiting and running sequences, a token budget per step,
//! chunked prefill, preemption by recompute, and fairness across tenants.
//!
//! Its [`SchedulerOutput`] is the only contract with the model runner.

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
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_tokens_per_step: 256,
            max_running: 64,
        }
    }
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

/// Waiting queues per tenant (served round-robin) and the running set.
#[derive(Debug, Default)]
pub struct Scheduler {
    config: SchedulerConfig,
    seqs: HashMap<SeqId, Seq>,
    waiting: BTreeMap<TenantId, VecDeque<SeqId>>,
    /// Tenant served first at the next admission.
    next_tenant: TenantId,
    running: Vec<SeqId>,
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
            },
        );
        self.waiting.entry(tenant).or_default().push_back(seq);
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
        if let Some(s) = self.seqs.remove(&seq) {
            self.running.retain(|r| *r != seq);
            if let Some(q) = self.waiting.get_mut(&s.tenant) {
                q.retain(|w| *w != seq);
            }
        }
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

    /// Running sequences of `tenant`.
    fn running_of(&self, tenant: TenantId) -> usize {
        self.running
            .iter()
            .filter(|r| self.seqs[*r].tenant == tenant)
            .count()
    }

    /// The running sequence to preempt: the newest one of the tenant with
    /// the most running sequences, skipping those already in this step.
    fn victim(&self, protected: &[SeqId]) -> Option<SeqId> {
        let mut best: Option<(usize, usize)> = None; // (tenant count, index)
        for (i, r) in self.running.iter().enumerate() {
            if protected.contains(r) {
                continue;
            }
            let n = self.running_of(self.seqs[r].tenant);
            if best.is_none_or(|(bn, _)| n >= bn) {
                best = Some((n, i));
            }
        }
        best.map(|(_, i)| self.running[i])
    }

    fn preempt(&mut self, seq: SeqId, kv: &mut KvCacheManager, out: &mut SchedulerOutput) {
        kv.free(seq);
        self.running.retain(|r| *r != seq);
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.computed = 0;
            s.present = 0;
            self.waiting.entry(s.tenant).or_default().push_front(seq);
        }
        out.preempted.push(seq);
    }

    /// Plans the next step, allocating KV pages for everything planned.
    pub fn schedule(&mut self, kv: &mut KvCacheManager) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_tokens_per_step;
        let mut planned: Vec<SeqId> = Vec::new();
        // 1. Running sequences, oldest first: decodes and prefill chunks.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let s = self.seqs[&id].clone();
            let count = (s.len - s.computed).min(budget);
            if count == 0 {
                i += 1;
                continue;
            }
            let mut fits = kv.allocate(id, s.tenant, s.computed + count);
            while !fits {
                match self.victim(&planned) {
                    Some(v) if v != id => {
                        self.preempt(v, kv, &mut out);
                        fits = kv.allocate(id, s.tenant, s.computed + count);
                    }
                    _ => break,
                }
            }
            if !fits {
                // Not even alone does it fit: preempt it and move on.
                self.preempt(id, kv, &mut out);
                continue;
            }
            // Preemption may have removed sequences before `i`.
            i = self
                .running
                .iter()
                .position(|r| *r == id)
                .map_or(i, |p| p + 1);
            planned.push(id);
            out.scheduled.push(s.plan(id, count));
            budget -= count;
        }
        // 2. Admit waiting sequences, one tenant at a time in rotation, so
        // one tenant's flood cannot starve another's single request.
        while budget > 0 && self.running.len() < self.config.max_running {
            let Some(tenant) = self.next_waiting_tenant() else {
                break;
            };
            let Some(&id) = self.waiting[&tenant].front() else {
                break;
            };
            let mut s = self.seqs[&id].clone();
            let hit = kv.attach_prefix(id, s.tenant, &s.prefix) * kv.page_size();
            s.present = hit.min(s.len);
            // Every token cached: recompute the last one for its logits.
            s.computed = s.present.min(s.len - 1);
            let count = (s.len - s.computed).min(budget);
            if !kv.allocate(id, s.tenant, s.computed + count) {
                kv.free(id);
                break;
            }
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.present = s.present;
            }
            out.prefix_hits.push((id, s.computed));
            if let Some(q) = self.waiting.get_mut(&tenant) {
                q.pop_front();
            }
            self.next_tenant = TenantId(tenant.0.wrapping_add(1));
            self.running.push(id);
            out.scheduled.push(s.plan(id, count));
            budget -= count;
        }
        for sch in &out.scheduled {
            if let Some(s) = self.seqs.get_mut(&sch.seq) {
                s.computed = sch.start + sch.count;
            }
        }
        out
    }

    /// The first tenant at or after `next_tenant` (wrapping) with waiters.
    fn next_waiting_tenant(&self) -> Option<TenantId> {
        let has = |(t, q): (&TenantId, &VecDeque<SeqId>)| (!q.is_empty()).then_some(*t);
        self.waiting
            .range(self.next_tenant..)
            .find_map(has)
            .or_else(|| self.waiting.range(..self.next_tenant).find_map(has))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tokens: usize, running: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_tokens_per_step: tokens,
            max_running: running,
        }
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_then_decoded() {
        let mut kv = KvCacheManager::new(16, 16);
        let mut s = Scheduler::new(cfg(32, 8));
        s.add(1, TenantId(0), 70, Vec::new());
        let plan: Vec<_> = (0..3)
            .map(|_| s.schedule(&mut kv).scheduled[0].clone())
            .collect();
        assert_eq!(
            plan.iter()
                .map(|p| (p.start, p.count, p.sample))
                .collect::<Vec<_>>(),
            vec![(0, 32, false), (32, 32, false), (64, 6, true)]
        );
        s.append_token(1);
        let next = s.schedule(&mut kv).scheduled[0].clone();
        assert_eq!((next.start, next.count, next.sample), (70, 1, true));
    }

    #[test]
    fn flooding_tenant_cannot_starve_another_tenants_single_request() {
        let mut kv = KvCacheManager::new(64, 16);
        let mut s = Scheduler::new(cfg(64, 4));
        for i in 0..20 {
            s.add(i, TenantId(1), 16, Vec::new());
        }
        s.add(100, TenantId(2), 16, Vec::new());
        let first = s.schedule(&mut kv);
        let ids: Vec<_> = first.scheduled.iter().map(|x| x.seq).collect();
        assert!(
            ids.contains(&100),
            "tenant 2 admitted in the first step: {ids:?}"
        );
    }

    #[test]
    fn cached_prompt_pages_are_skipped_and_a_full_hit_recomputes_only_the_last_token() {
        let mut kv = KvCacheManager::new(8, 16);
        let mut s = Scheduler::new(cfg(256, 8));
        let t = TenantId(1);
        s.add(1, t, 32, vec![5, 6]);
        let first = s.schedule(&mut kv);
        assert_eq!(first.prefix_hits, vec![(1, 0)]);
        kv.cache_pages(1, &[5, 6], 32);
        s.remove(1);
        kv.free(1);
        // Same 32-token prompt: both pages hit, only position 31 is run,
        // and its KV is not rewritten into the shared page.
        s.add(2, t, 32, vec![5, 6]);
        let full = s.schedule(&mut kv);
        assert_eq!(full.prefix_hits, vec![(2, 31)]);
        assert_eq!(
            full.scheduled,
            vec![Scheduled {
                seq: 2,
                start: 31,
                count: 1,
                sample: true,
                write_kv: false
            }]
        );
        // A longer prompt sharing the first page computes from token 16.
        s.add(3, t, 40, vec![5, 9]);
        let part = s.schedule(&mut kv);
        let p = &part.scheduled[0];
        assert_eq!((p.seq, p.start, p.count, p.write_kv), (3, 16, 24, true));
    }

    #[test]
    fn pool_exhaustion_preempts_and_readmits_by_recompute() {
        let mut kv = KvCacheManager::new(2, 16);
        let mut s = Scheduler::new(cfg(64, 8));
        s.add(1, TenantId(1), 16, Vec::new());
        s.add(2, TenantId(2), 16, Vec::new());
        let out = s.schedule(&mut kv);
        assert_eq!(out.scheduled.len(), 2);
        assert_eq!(kv.num_free(), 0);
        // Both grow past their page: the newer one is preempted.
        s.append_token(1);
        s.append_token(2);
        let out = s.schedule(&mut kv);
        assert_eq!(out.preempted, vec![2]);
        assert_eq!(
            out.scheduled.iter().map(|x| x.seq).collect::<Vec<_>>(),
            vec![1]
        );
        s.remove(1);
        kv.free(1);
        let out = s.schedule(&mut kv);
        // Recompute from scratch: prompt and the generated token.
        assert_eq!(
            out.scheduled,
            vec![Scheduled {
                seq: 2,
                start: 0,
                count: 17,
                sample: true,
                write_kv: true,
            }]
        );
    }
}
