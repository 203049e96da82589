//! Planning a step: decodes first, then prompt tokens shared fairly among
//! tenants by weight, admissions within each tenant's share of the running
//! slots.

use std::collections::{BTreeSet, HashSet, VecDeque};

use super::{Blocked, Scheduler, SchedulerOutput, StepCaps, TenantId};
use crate::engine::kv_manager::{KvCacheManager, SeqId};

impl Scheduler {
    /// Plans the next step, allocating KV pages for everything planned:
    /// running sequences' decode tokens first, so arriving prompts never
    /// stall a stream; then prompt tokens, the rest of the budget shared
    /// among the tenants with prompts to compute in proportion to their
    /// weights (what one cannot use goes to the others), admitting waiting
    /// sequences within each tenant's share of the running slots.
    ///
    /// `caps` (the engine's step time target) bounds both: when more
    /// streams decode than `caps.decodes`, the decode tokens are shared
    /// among their tenants by weight (each gets at least one) if that
    /// spares a tenant within its share, and each tenant's streams take
    /// turns, the longest unserved first.
    pub fn schedule(&mut self, kv: &mut KvCacheManager, caps: StepCaps) -> SchedulerOutput {
        self.steps += 1;
        let mut step = Planning {
            out: SchedulerOutput::default(),
            budget: self.config.max_tokens_per_step,
            planned: HashSet::new(),
            waits: HashSet::new(),
        };
        // 1. Decodes, oldest first (or the capped turns).
        let (turns, waits) = self.decode_turns(caps.decodes);
        step.waits.extend(waits);
        for id in turns {
            if step.budget == 0 {
                break;
            }
            if !step.out.preempted.contains(&id) && self.remaining(id) == 1 {
                self.run_chunk(id, 1, kv, &mut step);
            }
        }
        let prompt_cap = caps.prompt;
        // 2. Prompt tokens: each tenant's fair share of the rest, then what
        // a share left unused (a prefix hit, a full pool) to the others in
        // turn.
        let after = step.budget.saturating_sub(prompt_cap);
        step.budget -= after;
        let tenants = self.prompt_tenants(&step);
        if let Some(first) = tenants.first() {
            self.next_tenant = TenantId(first.0.wrapping_add(1));
        }
        let demands: Vec<usize> = tenants
            .iter()
            .map(|t| self.prompt_demand(*t, &step))
            .collect();
        let weights: Vec<usize> = tenants.iter().map(|t| self.weight(*t)).collect();
        let shares = fair_shares(step.budget, &demands, &weights);
        for (tenant, share) in tenants.iter().zip(shares) {
            if share > 0 {
                self.prefill(*tenant, share, kv, &mut step);
            }
        }
        for tenant in &tenants {
            if step.budget == 0 {
                break;
            }
            self.prefill(*tenant, step.budget, kv, &mut step);
        }
        step.budget += after;
        for sch in &step.out.scheduled {
            if let Some(s) = self.seqs.get_mut(&sch.seq) {
                s.computed = sch.start + sch.count;
                // A sequence's turn is its last sampled token (a stream just
                // out of its prompt goes behind those still waiting).
                if sch.sample {
                    s.decoded_at = self.steps;
                }
            }
        }
        step.out
    }

    /// Tokens `id` has left to compute.
    pub(super) fn remaining(&self, id: SeqId) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.len - s.computed)
    }

    /// Whether `id` is the next of its tenant's waiting sequences (one
    /// requeued in front of it goes first).
    fn heads_its_queue(&self, id: SeqId) -> bool {
        (self.seqs.get(&id))
            .and_then(|s| self.waiting.get(&s.tenant))
            .is_some_and(|q| q.front() == Some(&id))
    }

    /// Whether blocked sequence `id` holds pages back from others' admissions:
    /// while it heads its queue and its tenant may take a slot (one over
    /// its share would hold them for nothing).
    fn holds_pages(&self, id: SeqId) -> bool {
        self.heads_its_queue(id) && self.may_admit(self.seqs[&id].tenant)
    }

    /// Pages `id`'s admission leaves free for a sequence refused before:
    /// the first blocked one (in the order tenants were refused) that
    /// holds pages back, unless `id`'s own tenant was refused before it.
    /// First come, first served among the tenants refused, so each gets
    /// its pages in turn; a tenant at its share is passed over until it is
    /// under it again, without losing its place.
    fn held_back(&self, id: SeqId) -> usize {
        let tenant = self.seqs[&id].tenant;
        (self.blocked.iter())
            .take_while(|b| b.tenant != tenant)
            .find(|b| self.holds_pages(b.seq))
            .map_or(0, |b| b.pages)
    }

    /// Records `tenant`'s sequence `id` refused for want of `pages` pages.
    /// A tenant keeps its place in line while its head changes (one
    /// requeued in front of it), and loses none while at its share: it
    /// holds nothing back then, and takes its place again below it.
    fn block(&mut self, tenant: TenantId, id: SeqId, pages: usize) {
        let entry = Blocked {
            tenant,
            seq: id,
            pages,
        };
        match self.blocked.iter_mut().find(|b| b.tenant == tenant) {
            Some(b) => *b = entry,
            None => self.blocked.push(entry),
        }
    }

    /// Whether `id` is a stream: its prompt computed, its next token to
    /// decode (a prompt's last token is not one, though it too is left
    /// alone).
    fn is_stream(&self, id: SeqId) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| s.len - s.computed == 1 && s.computed >= s.prompt)
    }

    /// Up to `allowance` prompt tokens of `tenant`: its running prompts,
    /// oldest first, then admissions from its queue.
    fn prefill(
        &mut self,
        tenant: TenantId,
        allowance: usize,
        kv: &mut KvCacheManager,
        step: &mut Planning,
    ) {
        let start = step.budget;
        let used = |step: &Planning| start - step.budget;
        let running: Vec<SeqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs[id].tenant == tenant && step.open(id))
            .collect();
        for id in running {
            let left = allowance - used(step);
            if left == 0 {
                return;
            }
            if !step.out.preempted.contains(&id) && self.remaining(id) > 0 {
                let count = self.remaining(id).min(left);
                self.run_chunk(id, count, kv, step);
            }
        }
        while used(step) < allowance && self.may_admit(tenant) {
            if !self.admit(tenant, allowance - used(step), kv, step) {
                return;
            }
        }
    }

    /// Plans `count` tokens of running sequence `id`, preempting others as
    /// `victim` orders them (the busiest tenant's, those that never lost
    /// their pages first, then the newest) if its pages do not fit, until
    /// `id` itself comes up or none is left: then a stream gives its own
    /// pages up and a prompt runs what fits. Unless pages are kept for another
    /// lane's streams: then it runs what fits above them, and prompts give
    /// their pages up while the streams are short of theirs.
    fn run_chunk(&mut self, id: SeqId, count: usize, kv: &mut KvCacheManager, step: &mut Planning) {
        let s = self.seqs[&id].clone();
        let mut count = count;
        // Preempt for pages that are missing. While another lane's streams
        // are due pages (`reserve`), a chunk runs as far as the pages above
        // the reserve take it and waits for the rest: the kept pages are not
        // its to take, and preempting for the rest could discard other
        // prompts' work for a chunk that still does not fit.
        if self.reserve > 0 {
            count = count.min(
                kv.tokens_leaving(id, self.reserve)
                    .saturating_sub(s.computed),
            );
            if count == 0 {
                // Decode first: while the streams are due more pages than
                // are free, prompts not in this step give theirs up (in
                // `victim`'s order).
                while kv.num_free() < self.reserve {
                    let spare = |v: &SeqId| step.planned.contains(v) || self.is_stream(*v);
                    match self.victim(spare) {
                        Some(v) => self.preempt(v, kv, &mut step.out),
                        None => break,
                    }
                }
                return;
            }
        } else {
            let tokens = s.computed + count;
            while !kv.fits(id, tokens) {
                // Streams waiting for their decode turn may go: fairness,
                // not the turn, says whose pages are taken.
                match self.victim(|id| step.planned.contains(id)) {
                    Some(v) if v != id => self.preempt(v, kv, &mut step.out),
                    _ => break,
                }
            }
            // Short still: a smaller chunk takes what is free. With no page
            // free, a prompt waits, keeping its pages, while the step or
            // another lane has other work (which frees pages as it ends or
            // is preempted, or takes these as a victim); otherwise, and for
            // a stream, it gives its own up.
            let fit = kv.tokens_leaving(id, 0).saturating_sub(s.computed);
            if fit == 0 {
                let others = !step.planned.is_empty() || self.runs_elsewhere();
                if self.is_stream(id) || !others {
                    self.preempt(id, kv, &mut step.out);
                }
                return;
            }
            count = count.min(fit);
        }
        let tokens = s.computed + count;
        if !kv.allocate_leaving(id, s.tenant, tokens, self.reserve) {
            return;
        }
        step.planned.insert(id);
        step.out.scheduled.push(s.plan(id, count));
        step.budget -= count;
    }

    /// Admits the head of `tenant`'s queue with up to `allowance` tokens of
    /// its prompt (after the prefix cache's hit); false when it does not
    /// fit the pool. A tenant with nothing running takes what the free
    /// pages hold, so a tenant whose chunk is larger than the pages others
    /// free one by one is not left waiting while they take each. A
    /// sequence preempted once lost its pages to the pool's streams: it
    /// waits until the free pages hold all it has to recompute, rather
    /// than start again on a chunk's worth and lose them again part-way
    /// (each restart throws away what it computed) while the streams are
    /// still there. It takes them chunk by chunk as any prompt, leaving
    /// the other lane's reserve. A sequence refused is `blocked` (one a
    /// tenant, in the order tenants were refused): admissions after it
    /// leave the pages it waits for while it holds them back.
    fn admit(
        &mut self,
        tenant: TenantId,
        allowance: usize,
        kv: &mut KvCacheManager,
        step: &mut Planning,
    ) -> bool {
        let Some(&id) = self.waiting.get(&tenant).and_then(VecDeque::front) else {
            return false;
        };
        // Preempted in this step: not back before the next.
        if step.out.preempted.contains(&id) {
            return false;
        }
        let mut s = self.seqs[&id].clone();
        let hit = kv.attach_prefix(id, s.tenant, &s.prefix) * kv.page_size();
        s.present = hit.min(s.len);
        // Every token cached: recompute the last one for its logits.
        s.computed = s.present.min(s.len - 1);
        let mut count = (s.len - s.computed).min(allowance);
        // What it waits for: its chunk, or all it must recompute.
        let wants = if s.preempted {
            s.len
        } else {
            s.computed + count
        };
        let wanted_pages = wants.div_ceil(kv.page_size());
        let leave = self.reserve + self.held_back(id);
        if !s.preempted && self.running_of(tenant) == 0 {
            let fit = kv.tokens_leaving(id, leave).saturating_sub(s.computed);
            count = count.min(fit);
        }
        let room = !s.preempted || kv.tokens_leaving(id, leave) >= wants;
        if count == 0 || !room || !kv.allocate_leaving(id, s.tenant, s.computed + count, leave) {
            kv.free(id);
            self.block(tenant, id, wanted_pages);
            return false;
        }
        self.blocked.retain(|b| b.seq != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.present = s.present;
        }
        step.out.prefix_hits.push((id, s.computed));
        if let Some(q) = self.waiting.get_mut(&tenant) {
            q.pop_front();
        }
        self.running.push(id);
        step.planned.insert(id);
        step.out.scheduled.push(s.plan(id, count));
        step.budget -= count;
        true
    }

    /// Whether `tenant` may take a running slot: one is free, and the
    /// tenant holds fewer than its share of them (by weight, among the
    /// tenants running or waiting) or no other tenant is waiting.
    fn may_admit(&self, tenant: TenantId) -> bool {
        if self.running_everywhere() >= self.config.max_running {
            return false;
        }
        if self.waiting.get(&tenant).is_none_or(|q| q.is_empty()) {
            return false;
        }
        let others_wait = self
            .waiting
            .iter()
            .any(|(t, q)| *t != tenant && !q.is_empty());
        let active: BTreeSet<TenantId> = (self.running.iter())
            .map(|r| self.seqs[r].tenant)
            .chain(
                self.elsewhere
                    .iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(t, _)| *t),
            )
            .chain(
                self.waiting
                    .iter()
                    .filter(|(_, q)| !q.is_empty())
                    .map(|(t, _)| *t),
            )
            .collect();
        let total: usize = active.iter().map(|t| self.weight(*t)).sum();
        let share = (self.config.max_running * self.weight(tenant)).div_ceil(total.max(1));
        !others_wait || self.running_of(tenant) < share
    }

    /// Prompt tokens `tenant` could use this step: what its running
    /// sequences not yet planned have left, and its waiting prompts (before
    /// any prefix-cache hit).
    fn prompt_demand(&self, tenant: TenantId, step: &Planning) -> usize {
        let running: usize = self
            .running
            .iter()
            .filter(|r| self.seqs[*r].tenant == tenant && step.open(r))
            .map(|r| self.remaining(*r))
            .sum();
        let waiting: usize = self
            .waiting
            .get(&tenant)
            .map_or(0, |q| q.iter().map(|w| self.seqs[w].len).sum());
        running + waiting
    }

    /// Tenants with prompt tokens to compute (a running sequence not yet
    /// planned this step, or a waiting one), starting from the one whose
    /// turn it is.
    fn prompt_tenants(&self, step: &Planning) -> Vec<TenantId> {
        let mut tenants: BTreeSet<TenantId> = self
            .waiting
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(t, _)| *t)
            .collect();
        for r in &self.running {
            if step.open(r) && self.remaining(*r) > 0 {
                tenants.insert(self.seqs[r].tenant);
            }
        }
        let (before, from): (Vec<TenantId>, Vec<TenantId>) =
            tenants.into_iter().partition(|t| *t < self.next_tenant);
        from.into_iter().chain(before).collect()
    }
}

/// `budget` shared among claims of `demands` tokens with `weights`:
/// weighted max-min fair (a claim below its weight's share of the rest
/// gets all it asks; the others split what is left in proportion to their
/// weights), the remainder of an uneven split to the first in order.
pub fn fair_shares(budget: usize, demands: &[usize], weights: &[usize]) -> Vec<usize> {
    let n = demands.len();
    let w = |i: usize| weights.get(i).copied().unwrap_or(1).max(1);
    // By demand per unit of weight: d_i / w_i < d_j / w_j as d_i w_j < d_j w_i.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|a, b| (demands[*a] * w(*b)).cmp(&(demands[*b] * w(*a))));
    let mut shares = vec![0; n];
    let mut left = budget;
    let mut rest: usize = (0..n).map(w).sum();
    // Claims that fit under the water level get what they ask; the rest
    // get the level times their weight.
    let mut k = 0;
    while k < n && demands[order[k]].saturating_mul(rest) <= left.saturating_mul(w(order[k])) {
        shares[order[k]] = demands[order[k]];
        left -= demands[order[k]];
        rest -= w(order[k]);
        k += 1;
    }
    if k < n {
        let pool = left;
        for i in &order[k..] {
            shares[*i] = pool * w(*i) / rest;
            left -= shares[*i];
        }
    }
    for (share, demand) in shares.iter_mut().zip(demands) {
        let extra = (demand - *share).min(left);
        *share += extra;
        left -= extra;
    }
    shares
}

/// A step being planned.
struct Planning {
    out: SchedulerOutput,
    budget: usize,
    /// Sequences in the step so far (never preempted by it).
    planned: HashSet<SeqId>,
    /// Streams the decode cap left for a later turn (no prompt share
    /// takes them either).
    waits: HashSet<SeqId>,
}

impl Planning {
    /// Whether running sequence `id` may still take prompt tokens.
    fn open(&self, id: &SeqId) -> bool {
        !self.planned.contains(id) && !self.waits.contains(id)
    }
}
