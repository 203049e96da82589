//! Disaggregated steps that overlap: the prefill lane's step is launched on
//! the runner's side lane (on a GPU, a stream of its own) and lands later,
//! while the decode lane's steps run on the main lane in between. A
//! sequence in a step in flight stays on the prefill lane until the step
//! lands (it is handed to the decode lane only once its prompt's KV is
//! written), and its pages are freed only then, even if it is cancelled
//! meanwhile, since the step's kernels may still write them.

use std::collections::BTreeSet;

use super::lanes::Lane;
use super::scheduler::StepCaps;
use super::{Engine, Event, SeqId};
use crate::model::step::RunLane;

impl Engine {
    /// One disaggregated step: the prefill step in flight lands once it has
    /// run (or at once when no stream would decode beside it), its
    /// finished prompts move to the decode lane, the decode lane runs a
    /// step, and, with none in flight and none owed to the step target
    /// (`StepBudget::prefill_due`), the prefill lane launches its next.
    /// While the decode step runs on the device, a prefill step that
    /// lands is followed by the next at once ([`Self::prefill_beside`]).
    pub(super) fn overlapped_step(
        &mut self,
        (caps, first): (StepCaps, bool),
        events: &mut Vec<Event>,
    ) -> Result<(), String> {
        if first != self.stats.decode_first {
            // A priority the driver refuses costs the neighbour some ITL,
            // never a step.
            if let Err(e) = self.runner.set_urgent(RunLane::Main, first) {
                tracing::warn!("decode lane priority not changed: {e}");
            }
            self.stats.decode_first = first;
        }
        if self.in_flight.is_some()
            && (!self.lanes.decoding() || self.runner.is_done(RunLane::Side)?)
        {
            self.land_prefill(events)?;
        }
        // The cap on streams is the decode lane's; the prefill lane hands
        // every stream over before it plans.
        let prefill = StepCaps {
            decodes: usize::MAX,
            ..caps
        };
        if let Some(run) = self.launch(Lane::Decode, RunLane::Main, caps, events)? {
            self.ran_beside = self.in_flight.is_some();
            self.decoding = run.iter().map(|s| s.seq).collect();
            self.prefill_beside(prefill, events)?;
            self.stepping = std::mem::take(&mut self.decoding);
            self.stepping
                .extend(self.in_flight.iter().flatten().map(|s| s.seq));
            let out = self.runner.finish(RunLane::Main)?;
            self.apply(&run, RunLane::Main, out, events);
        }
        if self.in_flight.is_none() && self.step_budget.prefill_due() {
            self.in_flight = self.launch(Lane::Prefill, RunLane::Side, prefill, events)?;
        }
        Ok(())
    }

    /// Until the decode step launched on the main lane has run: each
    /// prefill step that has run lands and the next is launched at once,
    /// so the prefill lane never waits for the decode step to end (at
    /// hundreds of streams a decode step takes a third of a prefill step).
    /// Where the step target holds prompts back it waits as before.
    fn prefill_beside(&mut self, caps: StepCaps, events: &mut Vec<Event>) -> Result<(), String> {
        // Planned once a wait: a lane with nothing to launch stays so
        // until a step lands.
        let mut planned = self.in_flight.is_some();
        while !self.runner.is_done(RunLane::Main)? {
            let due = self.step_budget.prefill_due();
            if due && self.in_flight.is_some() && self.runner.is_done(RunLane::Side)? {
                self.land_prefill(events)?;
                self.ran_beside = true;
                planned = false;
            }
            if due && !planned {
                self.in_flight = self.launch(Lane::Prefill, RunLane::Side, caps, events)?;
                planned = true;
                continue;
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Finishes the prefill step in flight: frees the pages of sequences
    /// cancelled meanwhile, applies its results and hands the sequences
    /// whose prompts are done to the decode lane.
    fn land_prefill(&mut self, events: &mut Vec<Event>) -> Result<(), String> {
        let Some(run) = self.in_flight.take() else {
            return Ok(());
        };
        self.stepping.clear();
        self.stepping.extend(run.iter().map(|s| s.seq));
        self.stepping.extend_from_slice(&self.decoding);
        let out = self.runner.finish(RunLane::Side);
        for seq in std::mem::take(&mut self.deferred_free) {
            self.kv.free(seq);
        }
        self.apply(&run, RunLane::Side, out?, events);
        self.lanes.hand_off();
        Ok(())
    }

    /// Drops `seq`'s pages now, or when the step in flight that may write
    /// them lands.
    pub(super) fn free_pages_of(&mut self, seq: SeqId) {
        let flying = (self.in_flight.as_ref()).is_some_and(|run| run.iter().any(|s| s.seq == seq));
        if flying {
            self.deferred_free.push(seq);
        } else {
            self.kv.free(seq);
        }
    }
}

/// Per runner lane, the pages retagged since its last step: each lane
/// keeps its own copy of the tags, so each gets every retagged page, once,
/// with the tag it has when the lane takes it.
#[derive(Debug, Default)]
pub(super) struct RetagQueues([BTreeSet<u32>; 2]);

impl RetagQueues {
    /// Notes retagged pages for both lanes.
    pub fn note(&mut self, pages: impl Iterator<Item = u32> + Clone) {
        for queue in &mut self.0 {
            queue.extend(pages.clone());
        }
    }

    /// `lane`'s pages retagged since it last took them, each with its tag
    /// now (`tag`).
    pub fn take(&mut self, lane: RunLane, tag: impl Fn(u32) -> [u64; 2]) -> Vec<(u32, [u64; 2])> {
        let pages = std::mem::take(&mut self.0[lane.index()]);
        pages.into_iter().map(|p| (p, tag(p))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_lane_gets_every_retagged_page_once_with_its_tag_now() {
        let mut q = RetagQueues::default();
        let now = |p: u32| [u64::from(p) + 100, 7];
        q.note([3, 5].into_iter());
        // The main lane takes them; page 3 is retagged again before the
        // side lane's next step.
        assert_eq!(q.take(RunLane::Main, now), vec![(3, now(3)), (5, now(5))]);
        q.note([3].into_iter());
        assert_eq!(q.take(RunLane::Side, now), vec![(3, now(3)), (5, now(5))]);
        assert_eq!(q.take(RunLane::Main, now), vec![(3, now(3))]);
        assert!(q.take(RunLane::Side, now).is_empty());
    }
}
