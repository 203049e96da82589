//! A GPU model's two lanes ([`RunLane`]): the main lane runs on the
//! model's stream, the side lane (opened for prefill/decode
//! disaggregation) on a stream of its own. Each lane keeps its own copy of
//! the page tags, working buffers, captured graphs and the step it has in
//! flight; the KV pages and the weights are shared. A lane's step is
//! launched (inputs up, kernels queued, a mark after them) and finished
//! (results down) apart, so the engine can run steps on the other lane
//! meanwhile.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaSlice, Gpu, Graph, Mark};

use super::{GpuKv, GpuModel, Work};
use crate::model::step::{Draw, RunLane, StepOut};

/// What identifies a captured step: its sequences, attention partitions,
/// whether it checks page tags and whether it masks results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub seqs: usize,
    pub parts: usize,
    pub check: bool,
    /// Words of each output-format mask (0: none): the masks' stride,
    /// which a captured launch keeps.
    pub mask_words: usize,
}

/// One lane's state over the shared pages.
pub(super) struct LaneKv {
    /// Every page's current tag, two u64 words each, as the block pool
    /// last reported it to this lane.
    pub tags: CudaSlice<u64>,
    pub work: Option<Work>,
    /// Captured decode steps; cleared whenever the working buffers they
    /// point into are replaced.
    pub graphs: HashMap<GraphKey, Graph>,
    /// Shapes met once (captured when they come again).
    pub seen: HashSet<GraphKey>,
    /// The step launched and not yet finished.
    pub flight: Option<Flight>,
    /// Steps that found the working buffers new (each drops the captured
    /// graphs).
    pub made: u64,
}

impl LaneKv {
    /// A lane with no step run yet.
    pub fn new(tags: CudaSlice<u64>) -> Self {
        Self {
            tags,
            work: None,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            flight: None,
            made: 0,
        }
    }
}

/// A launched step.
pub(super) enum Flight {
    /// Nothing to wait for (an empty step).
    Ready(StepOut),
    /// Queued on the lane's stream.
    Running(Running),
}

/// What finishing a queued step needs.
pub(super) struct Running {
    /// Sequences and result rows, padding included, and without it.
    pub seqs: usize,
    pub m: usize,
    pub real_seqs: usize,
    pub real_m: usize,
    /// Whether the step checked page tags.
    pub check: bool,
    pub draws: Vec<Draw>,
    /// Each result's log-probability slot (-1: none) and the tokens a
    /// slot holds.
    pub scores: (Vec<i32>, usize),
    pub start: Instant,
    /// After the step's kernels, once the side lane is open (one lane's
    /// steps are finished at once and keep none).
    pub mark: Option<Mark>,
}

impl GpuModel {
    /// Opens the side lane: a stream of its own on the same GPU, with the
    /// main lane's settings (set them first). Idempotent.
    pub fn open_side_lane(&mut self) -> Result<(), KernelError> {
        if self.side.is_none() {
            self.side = Some(self.gpu.lane()?);
        }
        Ok(())
    }

    /// Puts `lane`'s work ahead of the other lane's where both have work
    /// ready, or level with it again.
    pub fn set_urgent(&self, lane: RunLane, urgent: bool) -> Result<(), KernelError> {
        self.lane_gpu(lane).set_urgent(urgent)
    }

    /// The stream `lane` runs on: the side lane's own once opened, else
    /// the model's.
    pub(super) fn lane_gpu(&self, lane: RunLane) -> &Gpu {
        match (lane, &self.side) {
            (RunLane::Side, Some(g)) => g,
            _ => &self.gpu,
        }
    }

    /// The model's streams, for settings that apply to both lanes.
    pub(super) fn gpus(&mut self) -> impl Iterator<Item = &mut Gpu> {
        std::iter::once(&mut self.gpu).chain(self.side.as_mut())
    }

    /// Whether `lane`'s launched step has run (or none is in flight); a
    /// step in flight without a mark (no side lane open) counts as
    /// running. An error where its work failed.
    pub fn is_done(&self, kv: &GpuKv, lane: RunLane) -> Result<bool, KernelError> {
        match &kv.lanes[lane.index()].flight {
            Some(Flight::Running(r)) => r.mark.as_ref().map_or(Ok(false), Mark::is_done),
            _ => Ok(true),
        }
    }
}
