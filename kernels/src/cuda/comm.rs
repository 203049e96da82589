//! NCCL sums across tensor-parallel ranks, one GPU each: a rank's part of a
//! projection into the residual stream becomes every rank's sum in place
//! (an NCCL all-reduce on the rank's stream, which a CUDA graph captures
//! like any launch). NVLink multicast (NVLS) is NCCL's to choose by
//! `NCCL_NVLS_ENABLE`; the device machines set it to 0 and `scripts/gpu.sh`
//! exports it. Ranks that share a GPU cannot join one communicator: they
//! sum through the host ([`super::HostSum`]), outside graphs.
//!
//! A sum waits on the device until every rank has queued its own, so a
//! rank that fails partway through a step would leave the others' streams
//! waiting for good: [`NcclRank::stop_all`] aborts every rank's
//! communicator, which ends the sums they wait in, and the runner that
//! owned them is remade.

use std::sync::{Arc, RwLock};

use cudarc::driver::{CudaSlice, DevicePtrMut};
use cudarc::nccl::{result, sys};

use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// The communicators of one set of ranks, made together and aborted
/// together.
struct Comms {
    raw: Vec<sys::ncclComm_t>,
    /// Whether they still stand: a sum holds it read while it queues, an
    /// abort writes it, so none is aborted under a sum being queued.
    live: RwLock<bool>,
}

// SAFETY: NCCL allows a communicator's calls from any thread; `live`
// keeps an abort from running while another thread queues on one, and each
// rank queues only on its own (from the thread stepping it).
unsafe impl Send for Comms {}
// SAFETY: as above; the raw handles are only read after construction.
unsafe impl Sync for Comms {}

impl Comms {
    /// Aborts every communicator once: sums that wait on any rank's stream
    /// end, and no later sum is queued. Whether this call aborted them.
    fn abort(&self) -> R<bool> {
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        if !std::mem::replace(&mut *live, false) {
            return Ok(false);
        }
        let mut first_err = None;
        for &comm in &self.raw {
            // SAFETY: `comm` came from ncclCommInitAll and is aborted only
            // here, once (`live` was true and is now false).
            if let Err(e) = unsafe { result::comm_abort(comm) } {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(true), |e| Err(cuda_err(e)))
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        // Nothing is left to tell: the ranks are gone.
        let _ = self.abort();
    }
}

/// One rank's NCCL communicator, on its GPU's stream.
pub struct NcclRank {
    comms: Arc<Comms>,
    rank: usize,
}

impl NcclRank {
    /// Aborts every rank's communicator, for a rank that failed after the
    /// ranks agreed to launch a step: the sums the others wait in end (their
    /// results are not to be read), and every later sum fails, so the
    /// runner that owns the ranks must be remade. Whether this call
    /// aborted them (false if another rank already had).
    pub fn stop_all(&self) -> R<bool> {
        self.comms.abort()
    }
}

/// Elements of each warm-up sum: one small and one large, so the
/// connections of both NCCL protocols a step's sums choose are made before
/// the first step (made lazily, a rank's first sum would wait in the queuing
/// call for the others, where no abort may reach it).
const WARM_UP: [usize; 2] = [1, 1 << 22];

impl Gpu {
    /// A communicator for each GPU of `gpus` (rank `i` on `gpus[i]`, each a
    /// different device), made together and connected by a sum of each
    /// size a step may use.
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
        let n = gpus.len();
        let ordinals: Vec<i32> = gpus.iter().map(|g| g.ctx.ordinal() as i32).collect();
        let mut raw = vec![std::ptr::null_mut(); n];
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `raw` holds a slot for each of the `n` ordinals.
            unsafe { result::comm_init_all(raw.as_mut_ptr(), n as i32, ordinals.as_ptr()) }
        }))
        .map_err(|_| KernelError::DeviceUnavailable("NCCL could not be loaded".into()))?;
        made.map_err(|e| KernelError::DeviceUnavailable(format!("NCCL over {n} GPUs: {e:?}")))?;
        let comms = Arc::new(Comms {
            raw,
            live: RwLock::new(true),
        });
        let ranks: Vec<NcclRank> = (0..n)
            .map(|rank| NcclRank {
                comms: Arc::clone(&comms),
                rank,
            })
            .collect();
        for len in WARM_UP {
            let mut bufs = (gpus.iter())
                .map(|g| g.stream.alloc_zeros::<f32>(len).map_err(cuda_err))
                .collect::<R<Vec<_>>>()?;
            // One thread queues every rank's sum: NCCL's group makes them
            // one call, which would otherwise wait for the other ranks.
            result::group_start().map_err(cuda_err)?;
            let queued: R = (gpus.iter().zip(&ranks).zip(&mut bufs))
                .try_for_each(|((g, rank), buf)| g.all_reduce_sum(rank, buf, len));
            result::group_end().map_err(cuda_err)?;
            queued?;
            for g in gpus {
                g.stream.synchronize().map_err(cuda_err)?;
            }
        }
        Ok(ranks)
    }

    /// The first `n` elements of `x` summed over every rank of `rank`'s
    /// communicator, in place, queued on this GPU's stream.
    pub fn all_reduce_sum(&self, rank: &NcclRank, x: &mut CudaSlice<f32>, n: usize) -> R {
        let live = rank.comms.live.read().unwrap_or_else(|p| p.into_inner());
        if !*live {
            return Err(KernelError::Cuda(
                "tensor-parallel ranks: the communicators were aborted after a rank failed".into(),
            ));
        }
        let mut part = x.slice_mut(..n);
        let (ptr, _record) = part.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` is `n` f32 on this GPU, kept alive by `x` while the
        // stream uses it (`_record` marks the use); the communicator is
        // live (held read) and is this GPU's rank's.
        unsafe {
            result::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                n,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                rank.comms.raw[rank.rank],
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(cuda_err)
    }
}
