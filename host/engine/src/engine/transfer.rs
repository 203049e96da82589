//! Moving a sequence between engines of one model (prefill on one GPU,
//! decode on another: issue 22's disaggregation across devices). Once its
//! prompt is computed, [`Engine::export`] takes the sequence out of its
//! engine with its request, its scheduling state and its pages' contents,
//! and frees its pages there; [`Engine::adopt`] gives it pages of the
//! other engine's pool, tagged for its tenant by that pool as any page it
//! hands out, writes their contents, and decodes it from the next step.
//! Between two GPUs the pages' contents stay on the devices (a peer copy,
//! `PageBytes::Device`); on the CPU they are host bytes
//! (docs/architecture.md).

use super::kv_manager::SeqId;
use super::request::Request;
use super::scheduler::Handoff;
use super::{Engine, PAGE_SIZE, TenantId};
use crate::model::PageBytes;

/// What a moved sequence's pages are laid out as: the model and the bytes
/// of a page across its layers (format, heads and page size in one).
#[derive(Debug, Clone, PartialEq, Eq)]
struct KvShape {
    model: String,
    page_bytes: usize,
    /// Tensor-parallel ranks: the pages' bytes are each rank's in turn.
    ranks: usize,
}

/// A sequence whose prompt one engine computed, with its pages' contents,
/// for another engine of the same model to decode: only [`Engine::export`]
/// makes one.
pub struct SeqTransfer {
    handoff: Handoff,
    request: Request,
    pages: usize,
    kv: PageBytes,
    shape: KvShape,
}

impl std::fmt::Debug for SeqTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqTransfer")
            .field("tenant", &self.handoff.tenant())
            .field("tokens", &self.handoff.computed())
            .field("pages", &self.pages)
            .finish()
    }
}

impl SeqTransfer {
    /// The sequence's tenant.
    pub fn tenant(&self) -> TenantId {
        self.handoff.tenant()
    }

    /// Gives it to `tenant` as the adopting engine numbers its tenants
    /// (each engine has its own numbering; the pages it gets there are
    /// tagged for this one).
    pub fn set_tenant(&mut self, tenant: TenantId) {
        self.handoff.set_tenant(tenant);
    }

    /// Pages it carries.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Bytes of KV it carries.
    pub fn kv_bytes(&self) -> usize {
        self.kv.len()
    }
}

/// Why [`Engine::export`] left a sequence where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unexported {
    /// What stands in the way.
    pub why: String,
    /// Whether it may move after a later step (it is in a step in flight,
    /// preempted and not yet recomputed, or samples wait to start from its
    /// prompt); if not, it stays for good (its pages fail their tags or
    /// cannot be read out).
    pub later: bool,
}

impl std::fmt::Display for Unexported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl Engine {
    fn kv_shape(&self) -> KvShape {
        KvShape {
            model: self.loaded.name.clone(),
            page_bytes: self.page_bytes,
            ranks: self.ranks,
        }
    }

    /// Takes `seq` out of this engine once only its next token is left to
    /// compute, with its pages' contents; its pages here are freed (those
    /// the prefix cache names stay cached). Fails, leaving it here, when it
    /// is not such a sequence (yet), is in a step in flight, or other
    /// samples wait on its prompt.
    pub fn export(&mut self, seq: SeqId) -> Result<SeqTransfer, Unexported> {
        let later = |why| Unexported { why, later: true };
        // Between steps only the prefill lane's launched step (`--pd on`
        // on a GPU) may still be computing.
        if self.in_flight.iter().flatten().any(|s| s.seq == seq) {
            return Err(later(format!("sequence {seq} is in a step in flight")));
        }
        // Samples start from its prompt's pages at the next step.
        if self.waiting.iter().any(|w| w.waits_on(seq)) {
            return Err(later(format!(
                "other samples wait on sequence {seq}'s prompt"
            )));
        }
        let handoff = (self.lanes.release_ready(seq)).ok_or_else(|| {
            later(format!(
                "sequence {seq} is not running with its prompt computed"
            ))
        })?;
        let pages = handoff.computed().div_ceil(PAGE_SIZE);
        let table: Vec<u32> = (self.kv.table(seq))
            .map(|t| t.pages.iter().take(pages).copied().collect())
            .unwrap_or_default();
        // The pages go out as the tenant's own KV: a mapping that fails its
        // tags (the next step aborts the sequence) must not be read.
        let read = if !self.kv.check(&[seq], self.checker.as_ref())[0] {
            Err(format!("sequence {seq}'s pages fail their tag check"))
        } else if table.len() == pages {
            self.runner.read_pages(&table)
        } else {
            Err(format!(
                "sequence {seq} holds {} of its {pages} pages",
                table.len()
            ))
        };
        let (kv, request) = match (read, self.requests.remove(&seq)) {
            (Ok(kv), Some(request)) => (kv, request),
            (read, request) => {
                if let Some(r) = request {
                    self.requests.insert(seq, r);
                }
                self.lanes.adopt_running(seq, handoff);
                return Err(Unexported {
                    why: (read.err()).unwrap_or(format!("sequence {seq} has no request")),
                    later: false,
                });
            }
        };
        self.kv.free(seq);
        Ok(SeqTransfer {
            handoff,
            request,
            pages,
            kv,
            shape: self.kv_shape(),
        })
    }

    /// Takes a sequence another engine of the same model and KV format
    /// exported: it gets pages of this pool (tagged for its tenant), their
    /// contents, and decodes from the next step. Its id here.
    pub fn adopt(&mut self, t: SeqTransfer) -> Result<SeqId, String> {
        let here = self.kv_shape();
        if t.shape != here {
            return Err(format!(
                "a sequence of {} with pages of {} bytes over {} ranks: this engine runs {} \
                 with pages of {} over {}",
                t.shape.model,
                t.shape.page_bytes,
                t.shape.ranks,
                here.model,
                here.page_bytes,
                here.ranks
            ));
        }
        let id = self.next_id;
        let tokens = t.handoff.computed();
        if tokens + 1 > self.max_len() || !self.kv.allocate(id, t.tenant(), tokens) {
            return Err(format!(
                "no room for a sequence of {tokens} tokens ({} pages; {} free)",
                t.pages,
                self.kv.num_free()
            ));
        }
        let table: Vec<u32> = (self.kv.table(id))
            .map(|b| b.pages.iter().take(t.pages).copied().collect())
            .unwrap_or_default();
        if let Err(e) = self.runner.write_pages(&table, &t.kv) {
            self.kv.free(id);
            return Err(e);
        }
        self.next_id += 1;
        self.lanes.adopt_running(id, t.handoff);
        self.requests.insert(id, t.request);
        Ok(id)
    }

    /// Whether a sequence of `pages` pages handed on from another engine
    /// may be adopted now, as admission would take a request with
    /// `max_running` slots: none of this engine's own sequences waits (in a
    /// decode pool, a stream it preempted, whose text has gone out: it goes
    /// first), and a running slot and the pages are free; or nothing runs
    /// or waits here (then it runs, or fails at once).
    pub fn room_to_adopt(&self, pages: usize, max_running: usize) -> bool {
        if self.lanes.waiting() > 0 {
            return false;
        }
        let running = self.running();
        running == 0 || (running < max_running && self.free_pages() > pages)
    }

    /// Of sequences waiting to be adopted (each given as its tenant here
    /// and that tenant's share weight, in arrival order), the one to adopt
    /// next: the first of the tenant running the fewest sequences here for
    /// its weight, so a tenant's burst handed on at once takes running
    /// slots as admission would give them, not ahead of other tenants.
    pub fn next_to_adopt(&self, waiting: &[(TenantId, u32)]) -> Option<usize> {
        let running = self.lanes.running_by_tenant();
        fairest(waiting, |t| running.get(&t).copied().unwrap_or(0))
    }
}

/// The first entry of the tenant with the fewest `running` per weight
/// (ties to the earliest).
fn fairest(waiting: &[(TenantId, u32)], running: impl Fn(TenantId) -> usize) -> Option<usize> {
    let load = |(t, w): (TenantId, u32)| (running(t) as u128, u128::from(w.max(1)));
    let mut best: Option<(usize, (u128, u128))> = None;
    for (i, entry) in waiting.iter().enumerate() {
        let (r, w) = load(*entry);
        // r / w < br / bw without division.
        if best.is_none_or(|(_, (br, bw))| r * bw < br * w) {
            best = Some((i, (r, w)));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_running_fewest_is_adopted_first() {
        let (a, b) = (TenantId(0), TenantId(1));
        let running = |t: TenantId| if t == a { 3 } else { 1 };
        assert_eq!(fairest(&[(a, 1), (a, 1), (b, 1)], running), Some(2));
        assert_eq!(fairest(&[(b, 1), (a, 1)], running), Some(0));
    }

    #[test]
    fn ties_and_a_lone_tenant_keep_arrival_order() {
        let (a, b) = (TenantId(0), TenantId(1));
        assert_eq!(fairest(&[(a, 1), (b, 1)], |_| 2), Some(0));
        assert_eq!(fairest(&[(a, 1), (a, 1)], |_| 5), Some(0));
        assert_eq!(fairest(&[], |_| 0), None);
    }

    #[test]
    fn a_heavier_tenant_may_run_more_before_yielding() {
        let (a, b) = (TenantId(0), TenantId(1));
        // a (weight 3) runs 2, b (weight 1) runs 1: 2/3 < 1/1, so a first.
        let running = |t: TenantId| if t == a { 2 } else { 1 };
        assert_eq!(fairest(&[(b, 1), (a, 3)], running), Some(1));
        // a at 3/3 ties b at 1/1: arrival order.
        let running = |t: TenantId| if t == a { 3 } else { 1 };
        assert_eq!(fairest(&[(b, 1), (a, 3)], running), Some(0));
    }
}
