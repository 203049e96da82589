//! Sums across tensor-parallel ranks, one GPU each: a rank's part of a
//! projection into the residual stream becomes every rank's sum in place
//! (an NCCL all-reduce on the rank's stream, which a CUDA graph captures
//! like any launch; NVLink multicast is left off, NCCL's default without
//! NVLS buffers registered). Ranks that share a GPU cannot join one NCCL
//! communicator: they sum through the host ([`HostSum`]), outside graphs.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::CudaSlice;
use cudarc::nccl::{Comm, ReduceOp};

use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// One rank's NCCL communicator, on its GPU's stream.
pub struct NcclRank {
    comm: Comm,
}

// SAFETY: a communicator is used by one thread at a time (the one running
// its rank's step), which NCCL allows from any thread; Kiln never calls it
// from two threads at once.
unsafe impl Send for NcclRank {}

impl Gpu {
    /// A communicator for each GPU of `gpus` (rank `i` on `gpus[i]`, each a
    /// different device), made together.
    pub fn nccl_ranks(gpus: &[&Gpu]) -> R<Vec<NcclRank>> {
        // The loader looks for these names (not NCCL's own libnccl.so.2),
        // and panics where none loads.
        if !super::library_present(&["libnccl.so", "libnccl.so.1"]) {
            return Err(KernelError::DeviceUnavailable(
                "NCCL not found: put a libnccl.so (a link to NCCL's libnccl.so.2, e.g. from \
                 the nvidia-nccl-cu13 wheel) on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let streams: Vec<_> = gpus.iter().map(|g| g.stream.clone()).collect();
        let n = streams.len();
        let comms = std::panic::catch_unwind(move || Comm::from_devices(streams))
            .map_err(|_| KernelError::DeviceUnavailable("NCCL could not be loaded".into()))?
            .map_err(|e| KernelError::DeviceUnavailable(format!("NCCL over {n} GPUs: {e:?}")))?;
        Ok(comms.into_iter().map(|comm| NcclRank { comm }).collect())
    }

    /// The first `n` elements of `x` summed over every rank of `rank`'s
    /// communicator, in place, queued on this GPU's stream.
    pub fn all_reduce_sum(&self, rank: &NcclRank, x: &mut CudaSlice<f32>, n: usize) -> R {
        rank.comm
            .all_reduce_in_place(&mut x.slice_mut(..n), &ReduceOp::Sum)
            .map(|_| ())
            .map_err(cuda_err)
    }
}

/// Ranks' sums through the host, for ranks that share a GPU: each waits
/// for its stream, sends its part, and gets back the sum in rank order
/// (the same bytes on every rank). A rank that does not come within
/// [`HostSum::PATIENCE`] fails the others' sums instead of hanging them.
pub struct HostSum {
    ranks: usize,
    state: Mutex<Meeting>,
    turned: Condvar,
}

/// The parts sent so far and how many meetings have ended.
struct Meeting {
    parts: Vec<Vec<f32>>,
    arrived: usize,
    ended: u64,
}

impl HostSum {
    /// How long a rank waits for the others.
    pub const PATIENCE: Duration = Duration::from_secs(60);

    /// A meeting point for `ranks` ranks, each on its own thread.
    pub fn new(ranks: usize) -> Arc<Self> {
        Arc::new(Self {
            ranks,
            state: Mutex::new(Meeting {
                parts: vec![Vec::new(); ranks],
                arrived: 0,
                ended: 0,
            }),
            turned: Condvar::new(),
        })
    }

    /// Rank `rank`'s first `n` elements of `x` replaced by every rank's
    /// sum (waits for `g`'s stream and for every other rank).
    pub fn all_reduce_sum(&self, g: &Gpu, rank: usize, x: &mut CudaSlice<f32>, n: usize) -> R {
        let part = g.download_range(x, 0..n)?;
        let mut m = self.meet(|m| m.parts[rank] = part)?;
        let mut sum = m.parts[0].clone();
        for p in &m.parts[1..self.ranks] {
            sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
        }
        drop(m);
        // Nobody sends a new part before every rank has summed this one.
        m = self.meet(|_| ())?;
        drop(m);
        g.upload_into(&sum, x)
    }

    /// Applies `send` and waits until every rank has arrived.
    fn meet(&self, send: impl FnOnce(&mut Meeting)) -> R<std::sync::MutexGuard<'_, Meeting>> {
        let mut m = self.state.lock().map_err(|_| failed())?;
        send(&mut m);
        m.arrived += 1;
        let round = m.ended;
        if m.arrived == self.ranks {
            m.arrived = 0;
            m.ended += 1;
            self.turned.notify_all();
            return Ok(m);
        }
        let (m, wait) = (self.turned)
            .wait_timeout_while(m, Self::PATIENCE, |m| m.ended == round)
            .map_err(|_| failed())?;
        if wait.timed_out() {
            return Err(KernelError::Cuda(format!(
                "tensor-parallel ranks: another rank did not reach the sum within {:?}",
                Self::PATIENCE
            )));
        }
        Ok(m)
    }
}

fn failed() -> KernelError {
    KernelError::Cuda("another rank failed while summing".into())
}
