//! Who waits on a step: the streams that decode, whether tenants compete,
//! and, when a step cannot carry every stream, whose turn it is.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::{Contention, Scheduler, TenantId, fair_shares};

/// Who works in one scheduler or several: the tenants whose streams
/// decode, the tenants with prompt tokens to compute, and the streams.
#[derive(Debug, Default, Clone)]
pub struct Activity {
    decoding: BTreeSet<TenantId>,
    prompting: BTreeSet<TenantId>,
    streams: usize,
}

impl Activity {
    /// The work of both.
    pub fn merge(mut self, other: Activity) -> Activity {
        self.decoding.extend(other.decoding);
        self.prompting.extend(other.prompting);
        self.streams += other.streams;
        self
    }

    /// A step's work would slow another tenant's streams (`competing`)
    /// when one tenant's sequences decode while a different tenant has
    /// prompt tokens to compute, or two tenants' sequences decode. A tenant
    /// alone trades its own streams' latency for its prompts' throughput;
    /// the step time target guards the others.
    pub fn contention(&self) -> Contention {
        let competing = match self.decoding.len() {
            0 => false,
            1 => self.prompting.iter().any(|t| !self.decoding.contains(t)),
            _ => true,
        };
        Contention {
            competing,
            streams: self.streams,
            prompting: !self.prompting.is_empty(),
        }
    }
}
use crate::engine::kv_manager::SeqId;

impl Scheduler {
    /// The streams that decode this step, in running order, and those
    /// that wait: all decode within `cap`, or when every tenant's streams
    /// exceed its share of `cap` (turns would then slow every stream and
    /// spare none); else `cap` (at least one a tenant) shared by weight,
    /// each tenant's longest unserved first. The tenants' order rotates
    /// each step, so an uneven split's remainder does too.
    pub(super) fn decode_turns(&self, cap: usize) -> (Vec<SeqId>, Vec<SeqId>) {
        let decoding: Vec<SeqId> = (self.running.iter())
            .copied()
            .filter(|id| self.remaining(*id) == 1)
            .collect();
        if decoding.len() <= cap {
            return (decoding, Vec::new());
        }
        let mut by_tenant: BTreeMap<TenantId, Vec<SeqId>> = BTreeMap::new();
        for id in &decoding {
            by_tenant.entry(self.seqs[id].tenant).or_default().push(*id);
        }
        let mut by_tenant: Vec<(TenantId, Vec<SeqId>)> = by_tenant.into_iter().collect();
        let turn = self.steps as usize % by_tenant.len();
        by_tenant.rotate_left(turn);
        let demands: Vec<usize> = by_tenant.iter().map(|(_, ids)| ids.len()).collect();
        let weights: Vec<usize> = by_tenant.iter().map(|(t, _)| self.weight(*t)).collect();
        let shares = fair_shares(cap.max(by_tenant.len()), &demands, &weights);
        if demands.iter().zip(&shares).all(|(d, s)| d > s) {
            return (decoding, Vec::new());
        }
        let mut chosen = HashSet::new();
        for ((_, mut ids), share) in by_tenant.into_iter().zip(shares) {
            // Stable: equal turns keep running order (oldest first).
            ids.sort_by_key(|id| self.seqs[id].decoded_at);
            chosen.extend(ids.into_iter().take(share.max(1)));
        }
        decoding.into_iter().partition(|id| chosen.contains(id))
    }

    /// What the next step's time target needs to know ([`Activity`]).
    pub fn contention(&self) -> Contention {
        self.activity().contention()
    }

    /// Who works here, in one pass over the running sequences and the
    /// queues.
    pub fn activity(&self) -> Activity {
        let mut a = Activity::default();
        for id in &self.running {
            let Some(s) = self.seqs.get(id) else { continue };
            match s.len - s.computed {
                0 => {}
                1 => {
                    a.streams += 1;
                    a.decoding.insert(s.tenant);
                }
                _ => {
                    a.prompting.insert(s.tenant);
                }
            }
        }
        let queued = self.waiting.iter().filter(|(_, q)| !q.is_empty());
        a.prompting.extend(queued.map(|(t, _)| *t));
        a
    }

    /// Whether a step's work would slow another tenant's streams
    /// ([`Contention::competing`]).
    pub fn decoding_beside_others(&self) -> bool {
        self.contention().competing
    }
}
