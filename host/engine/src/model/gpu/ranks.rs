//! Tensor parallelism on GPUs: a model split into ranks
//! ([`crate::model::shard::rank_model`]), each a [`GpuModel`] of its own
//! on one GPU with its heads, its part of the MLP and KV pages of its KV
//! heads. Every rank runs the same step on its own thread; a projection
//! into the residual stream is summed over the ranks before the norm that
//! adds it ([`RankSum`]), and every rank computes the whole head from the
//! same sums, so rank 0's results are the step's. Before a step's kernels
//! the ranks agree that each got that far: NCCL's sums wait on the device
//! for every rank, so a rank that failed before launching would hang the
//! others for good. A rank that fails later ends every rank's sums
//! ([`RankSum`]'s `failed`), and the runner is remade.

use std::sync::Arc;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaSlice, Gpu, HostSum, NcclRank, Vote};

use super::{GpuKv, GpuModel, R};
use crate::model::step::{RunLane, Step, StepOut};

/// How one rank's projections become every rank's sum (shared by the
/// rank's copies of the weights where the phases have their own: each
/// copy has a stream of its own, and a pass ends in a wait for its
/// results, so their sums never overlap).
#[derive(Clone)]
pub struct RankSum {
    how: How,
    rank: usize,
    vote: Arc<Vote>,
}

#[derive(Clone)]
enum How {
    /// NCCL over ranks on different GPUs (captured in graphs).
    Nccl(Arc<NcclRank>),
    /// Through the host, for ranks that share a GPU (no graphs).
    Host(Arc<HostSum>),
}

impl RankSum {
    /// A sum through the host for each of `ranks` ranks.
    pub fn through_host(ranks: usize) -> Vec<RankSum> {
        let sum = HostSum::new(ranks);
        Self::each((0..ranks).map(|_| How::Host(Arc::clone(&sum))).collect())
    }

    /// Rank `i`'s sum by `hows[i]`, all voting together.
    fn each(hows: Vec<How>) -> Vec<RankSum> {
        let vote = Arc::new(Vote::new(hows.len()));
        (hows.into_iter().enumerate())
            .map(|(rank, how)| RankSum {
                how,
                rank,
                vote: Arc::clone(&vote),
            })
            .collect()
    }

    /// The first `n` elements of `x` summed over the ranks, in place.
    pub(super) fn all_reduce(&self, g: &Gpu, x: &mut CudaSlice<f32>, n: usize) -> R<()> {
        match &self.how {
            How::Nccl(rank) => g.all_reduce_sum(rank, x, n),
            How::Host(sum) => sum.all_reduce_sum(g, self.rank, x, n),
        }
    }

    /// This rank reached its step's kernels: fine if every rank did (the
    /// kernels run only then).
    pub(super) fn agree(&self) -> R<()> {
        // A captured graph's sums would run on aborted communicators
        // without an error: a runner whose ranks stopped must be remade.
        if let How::Nccl(rank) = &self.how
            && !rank.is_live()
        {
            return Err(KernelError::OtherRank(
                "the ranks were stopped after a failed step; the runner must be remade".into(),
            ));
        }
        self.vote.agree(self.rank)
    }

    /// This rank's step failed: it votes no if it had not voted, and every
    /// rank's sums end (waiting ones too), since the others may already
    /// have queued sums this rank will never join. The runner is remade
    /// after a failed step, so nothing is lost by ending them for good.
    fn failed(&self) {
        self.vote.failed(self.rank);
        match &self.how {
            // The step fails with this rank's own error either way.
            How::Nccl(rank) => {
                rank.stop_all();
            }
            How::Host(sum) => sum.stop(),
        }
    }
}

impl GpuModel {
    /// An NCCL sum for each of `ranks` (rank `i` is `ranks[i]`, each on a
    /// GPU of its own).
    pub fn nccl_sums(ranks: &[GpuModel]) -> R<Vec<RankSum>> {
        let gpus: Vec<&Gpu> = ranks.iter().map(|m| &m.gpu).collect();
        let comms = Gpu::nccl_ranks(&gpus)?;
        let hows = comms.into_iter().map(|c| How::Nccl(Arc::new(c))).collect();
        Ok(RankSum::each(hows))
    }

    /// Makes this model one rank of several: its projections into the
    /// residual stream are summed over the ranks by `sum` (one-token steps
    /// no longer fold their norms: the sum comes between the product and
    /// the norm).
    pub fn set_rank_sum(&mut self, sum: RankSum) {
        self.fold = false;
        self.sum = Some(sum);
    }
}

/// One tensor-parallel rank on its GPU: its part of the weights, its KV
/// pages, and its part of decode's copy of the weights where the phases
/// have their own (summed by the same [`RankSum`]).
pub struct GpuRank {
    /// The rank's part of the model (of prefill's copy, where the phases
    /// have their own).
    pub model: GpuModel,
    /// The rank's KV pages: its KV heads of every page.
    pub kv: GpuKv,
    /// The rank's part of decode's copy of the weights.
    pub decode: Option<GpuModel>,
}

impl Drop for GpuRank {
    fn drop(&mut self) {
        // Before the weights, whose sums' communicators NCCL cannot abort
        // while a captured graph holds them.
        self.kv.drop_graphs();
    }
}

impl GpuRank {
    /// The weights a pass runs on: decode's copy when `decode` and there
    /// is one.
    fn weights(&mut self, decode: bool) -> (&mut GpuModel, &mut GpuKv) {
        match (&mut self.decode, decode) {
            (Some(d), true) => (d, &mut self.kv),
            _ => (&mut self.model, &mut self.kv),
        }
    }
}

/// Runs `step` on every rank at once (on decode's copy of the weights when
/// `decode` and the ranks have one), each on its own thread (rank 0 on
/// this one): rank 0's results, or the error of the first rank that failed
/// of its own accord.
pub fn forward_ranks(ranks: &mut [GpuRank], step: &Step<'_>, decode: bool) -> R<StepOut> {
    let run = |rank: &mut GpuRank| {
        let (m, kv) = rank.weights(decode);
        if let Some(sum) = &m.sum {
            sum.vote.begin(sum.rank);
        }
        // A panic is this rank's failure too: the others must not wait
        // for its vote.
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // A rank's thread starts with no CUDA context current, and
            // not every call binds its own (cuBLAS, raw launches).
            m.gpu
                .context()
                .bind_to_thread()
                .map_err(|e| KernelError::Cuda(format!("binding rank's GPU to its thread: {e}")))?;
            m.forward(kv, RunLane::Main, step)
        }))
        .unwrap_or_else(|_| Err(KernelError::Cuda("a rank's step panicked".into())));
        if let (Err(_), Some(sum)) = (&out, &m.sum) {
            sum.failed();
        }
        out
    };
    let Some((lead, rest)) = ranks.split_first_mut() else {
        return Err(KernelError::Shape("a step over no ranks".into()));
    };
    std::thread::scope(|s| {
        let others: Vec<_> = (rest.iter_mut())
            .map(|rank| s.spawn(move || run(rank)))
            .collect();
        let out = run(lead);
        let theirs = others.into_iter().map(|h| {
            (h.join()).unwrap_or_else(|_| Err(KernelError::Cuda("a rank's step panicked".into())))
        });
        let mut errors = theirs.filter_map(Result::err).collect::<Vec<_>>();
        match out {
            Ok(out) if errors.is_empty() => Ok(out),
            Ok(_) => Err(first_cause(errors)),
            Err(e) => {
                errors.insert(0, e);
                Err(first_cause(errors))
            }
        }
    })
}

/// The error that says why a step failed: the first rank's own, not one
/// that only stopped because another rank failed.
fn first_cause(mut errors: Vec<KernelError>) -> KernelError {
    let own = errors
        .iter()
        .position(|e| !matches!(e, KernelError::OtherRank(_)));
    errors.swap_remove(own.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_step_reports_the_rank_that_failed_not_those_it_stopped() {
        let other = || KernelError::OtherRank("another rank failed".into());
        let own = KernelError::Cuda("out of memory".into());
        let e = first_cause(vec![other(), own, other()]);
        assert!(e.to_string().contains("out of memory"), "{e}");
        // Where every rank only stopped, the first says so.
        let e = first_cause(vec![other(), other()]);
        assert!(e.to_string().contains("another rank failed"), "{e}");
    }
}
