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
//! owned them is remade. NCCL finishes an abort only once no CUDA graph
//! holds a sum of the communicator, so the abort runs on a thread of its
//! own (the failing rank returns at once) and whoever owns the ranks drops
//! their graphs before their communicators (`GpuRank`'s drop in the
//! engine).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, mpsc};
use std::thread::JoinHandle;

use cudarc::driver::{CudaSlice, DevicePtrMut};
use cudarc::nccl::{result, sys};

use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// An NCCL error with NCCL's own name for it (cudarc's `Debug` prints
/// none).
fn nccl_err(e: result::NcclError) -> KernelError {
    KernelError::Cuda(format!("NCCL: {:?}", e.0))
}

/// A communicator handle, to move to the thread that aborts it.
#[derive(Clone, Copy)]
struct Handle(sys::ncclComm_t);

// SAFETY: NCCL allows a communicator's calls from any thread; Kiln queues
// on each from one thread at a time (the one stepping its rank), and
// aborts them only once none is queuing (`Comms::queuing`).
unsafe impl Send for Handle {}
// SAFETY: as above; the handle itself is never written after it is made.
unsafe impl Sync for Handle {}

/// The communicators of one set of ranks, made together and aborted
/// together, once, by a thread of their own that waits from the start
/// (so a failing rank never needs a thread it might not get).
struct Comms {
    raw: Vec<Handle>,
    /// Held read by a sum while it queues and write by the abort before
    /// it begins, so no communicator is aborted under a sum being queued.
    queuing: Arc<RwLock<()>>,
    /// Whether a rank has stopped them: no sum is queued from then on.
    stopped: AtomicBool,
    /// Wakes the aborter: a message, or its end when the ranks are dropped.
    wake: Option<mpsc::Sender<()>>,
    aborter: Option<JoinHandle<()>>,
}

impl Comms {
    /// Communicators `raw`, with their aborter waiting.
    fn new(raw: Vec<Handle>) -> R<Comms> {
        let queuing = Arc::new(RwLock::new(()));
        let (wake, woken) = mpsc::channel::<()>();
        let (handles, lock) = (raw.clone(), Arc::clone(&queuing));
        let aborter = std::thread::Builder::new()
            .name("kiln-nccl-abort".into())
            .spawn(move || {
                // A stop, or the ranks dropped: either way, abort.
                let _ = woken.recv();
                abort(&handles, &lock);
            })
            .map_err(|e| {
                // Nothing is waiting to abort them: abort here, with no
                // sum queued or captured yet.
                abort(&raw, &queuing);
                KernelError::DeviceUnavailable(format!(
                    "no thread to abort NCCL's communicators with: {e}"
                ))
            })?;
        Ok(Comms {
            raw,
            queuing,
            stopped: AtomicBool::new(false),
            wake: Some(wake),
            aborter: Some(aborter),
        })
    }

    /// Wakes the aborter, once: whether this call did.
    fn stop(&self) -> bool {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return false;
        }
        if let Some(wake) = &self.wake {
            let _ = wake.send(());
        }
        true
    }
}

/// Aborts `raw` once no sum is being queued on them (later ones see the
/// stop and queue nothing): sums waiting on any rank's stream end at once;
/// the call returns once no captured graph holds them.
fn abort(raw: &[Handle], queuing: &RwLock<()>) {
    drop(queuing.write().unwrap_or_else(|p| p.into_inner()));
    for comm in raw {
        // SAFETY: made by ncclCommInitAll and aborted only here, by the
        // one aborter (or, where none could start, by `Comms::new` in its
        // stead), with no call queuing on it (`queuing`). An error leaves
        // nothing Kiln could do: the ranks are remade.
        let _ = unsafe { result::comm_abort(comm.0) };
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        // The aborter wakes as its channel closes, if no rank stopped them.
        drop(self.wake.take());
        if let Some(h) = self.aborter.take() {
            let _ = h.join();
        }
    }
}

/// One rank's NCCL communicator, on its GPU's stream.
pub struct NcclRank {
    comms: Arc<Comms>,
    rank: usize,
}

impl NcclRank {
    /// Aborts every rank's communicator, for a rank whose step failed:
    /// the sums the others wait in end (their results are not to be read)
    /// and every later sum fails, so the runner that owns the ranks must be
    /// remade, dropping their graphs first. Returns at once; whether this
    /// call stopped them (false if another rank already had).
    pub fn stop_all(&self) -> bool {
        self.comms.stop()
    }

    /// Whether sums may still be queued (no rank has stopped the ranks).
    pub fn is_live(&self) -> bool {
        !self.comms.stopped.load(Ordering::SeqCst)
    }
}

/// The largest warm-up sum, in elements (every power of two up to it is
/// summed once): NCCL connects an algorithm's channels at its first sum,
/// in the queuing call, which waits there for the other ranks, where no
/// abort reaches it. Summing every size class at start connects each
/// algorithm NCCL picks for the sums a step makes; `NCCL_RUNTIME_CONNECT=0`
/// connects them all at init instead (the README suggests it).
const WARM_UP_MAX: usize = 1 << 24;

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
        made.map_err(|e| KernelError::DeviceUnavailable(format!("NCCL over {n} GPUs: {:?}", e.0)))?;
        let comms = Arc::new(Comms::new(raw.into_iter().map(Handle).collect())?);
        let ranks: Vec<NcclRank> = (0..n)
            .map(|rank| NcclRank {
                comms: Arc::clone(&comms),
                rank,
            })
            .collect();
        let mut bufs = (gpus.iter())
            .map(|g| g.stream.alloc_zeros::<f32>(WARM_UP_MAX).map_err(cuda_err))
            .collect::<R<Vec<_>>>()?;
        for len in (0..=WARM_UP_MAX.ilog2()).map(|i| 1usize << i) {
            // One thread queues every rank's sum: NCCL's group makes them
            // one call, which would otherwise wait for the other ranks.
            result::group_start().map_err(nccl_err)?;
            let queued: R = (gpus.iter().zip(&ranks).zip(&mut bufs))
                .try_for_each(|((g, rank), buf)| g.all_reduce_sum(rank, buf, len));
            let ended = result::group_end();
            queued?;
            ended.map_err(nccl_err)?;
        }
        for g in gpus {
            g.stream.synchronize().map_err(cuda_err)?;
        }
        Ok(ranks)
    }

    /// The first `n` elements of `x` summed over every rank of `rank`'s
    /// communicator, in place, queued on this GPU's stream.
    pub fn all_reduce_sum(&self, rank: &NcclRank, x: &mut CudaSlice<f32>, n: usize) -> R {
        let _queuing = rank.comms.queuing.read().unwrap_or_else(|p| p.into_inner());
        if !rank.is_live() {
            return Err(KernelError::OtherRank(
                "the communicators were aborted after a rank failed".into(),
            ));
        }
        let mut part = x.slice_mut(..n);
        let (ptr, _record) = part.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` is `n` f32 on this GPU, kept alive by `x` while the
        // stream uses it (`_record` marks the use); the communicator is
        // this GPU's rank's, not stopped, and no abort begins while
        // `_queuing` is held.
        unsafe {
            result::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                n,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                rank.comms.raw[rank.rank].0,
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(nccl_err)
    }
}
