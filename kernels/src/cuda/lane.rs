//! A second stream over the same GPU: [`Gpu::lane`] shares the context and
//! the compiled kernels and has its own stream, cuBLAS handle, workspaces
//! and cuBLASLt state, so work on one lane can be in flight while work on
//! another runs. A lane's working buffers stay on it; what two lanes share
//! (weights written once, KV pages each lane writes only for its own
//! sequences) passes from one to the other only after the host waited for
//! the work that wrote it, so no event is due between them. Freeing such a
//! buffer goes through [`Settle`].

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut};

use super::{BLAS_WORKSPACE, Gpu, cuda_err};
use crate::KernelError;

/// A point in a lane's queued work: done once everything queued before
/// it has run.
pub struct Mark(CudaEvent);

impl Mark {
    /// Whether the work before the mark has run; an error where that work
    /// failed (a fault is never reported as work still running).
    pub fn is_done(&self) -> Result<bool, KernelError> {
        use cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY;
        // SAFETY: the event is this mark's own, created and recorded by
        // `Gpu::mark`, and lives as long as it.
        match unsafe { cudarc::driver::result::event::query(self.0.cu_event()) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(cuda_err(e)),
        }
    }
}

/// Waits for every stream of the GPU when dropped. An owner of buffers
/// that another lane's queued work may still use holds one as its first
/// field, so they are freed only after that work (a buffer's free is
/// queued on the stream that made it alone).
pub struct Settle(Arc<CudaContext>);

impl Drop for Settle {
    fn drop(&mut self) {
        // A device that fails the wait has failed its queued work too;
        // the buffers go either way.
        let _ = self.0.synchronize();
    }
}

/// A cuBLAS handle on `stream` with a fixed workspace of its own, so its
/// GEMMs can be captured into CUDA graphs (cuBLAS allocates none itself).
pub(super) fn blas_with_workspace(
    stream: &Arc<CudaStream>,
) -> Result<(CudaBlas, CudaSlice<u8>), KernelError> {
    let blas = CudaBlas::new(stream.clone()).map_err(cuda_err)?;
    let mut ws = stream.alloc_zeros::<u8>(BLAS_WORKSPACE).map_err(cuda_err)?;
    let (ptr, guard) = ws.device_ptr_mut(stream);
    // SAFETY: a live buffer of that size, kept as long as the handle (the
    // caller stores both together).
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *blas.handle(),
            ptr as *mut std::ffi::c_void,
            BLAS_WORKSPACE,
        )
    }
    .result()
    .map_err(cuda_err)?;
    drop(guard);
    Ok((blas, ws))
}

impl Gpu {
    /// Another lane on this GPU: a stream of its own with its own cuBLAS
    /// and cuBLASLt state, the same kernels and settings. Waits for this
    /// lane's queued work first, so buffers made here are ready there.
    pub fn lane(&self) -> Result<Gpu, KernelError> {
        self.synchronize()?;
        let stream = self.ctx.new_stream().map_err(cuda_err)?;
        let (blas, ws) = blas_with_workspace(&stream)?;
        Ok(Gpu {
            ctx: self.ctx.clone(),
            stream,
            functions: self.functions.clone(),
            blas,
            _blas_workspace: Some(ws),
            name: self.name.clone(),
            _module: self._module.clone(),
            programmatic: self.programmatic,
            flash_resident: self.flash_resident.clone(),
            lt: std::sync::Mutex::new(None),
            fp8_tensor: self.fp8_tensor,
            skinny: self.skinny,
            clusters: self.clusters,
            cluster: self.cluster,
            wgmma: self.wgmma,
            cluster_mma: self.cluster_mma,
            cluster_room: self.cluster_room.clone(),
            int4_one: self.int4_one,
            int4_one_strips: self.int4_one_strips,
            int4_one_wide: self.int4_one_wide,
            int4_rows: self.int4_rows,
            int4_shared_room: self.int4_shared_room,
            sms: self.sms,
            fp8_mma: self.fp8_mma,
            prefill_warps: self.prefill_warps,
        })
    }

    /// Runs this lane's work ahead of other lanes' where both have work
    /// ready (the GPU's greatest stream priority), or at the default
    /// priority. Kernels already queued keep the priority they had; CUDA
    /// graphs launched later take the new one.
    pub fn set_urgent(&self, urgent: bool) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        let (least, greatest) = self.priorities()?;
        // SAFETY: a zeroed union then its priority field, read by the
        // driver for this attribute alone.
        let mut value: sys::CUstreamAttrValue = unsafe { std::mem::zeroed() };
        value.priority = if urgent { greatest } else { least };
        let attr = sys::CUstreamAttrID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
        // SAFETY: the lane's live stream and an initialized value.
        unsafe { sys::cuStreamSetAttribute(self.stream.cu_stream(), attr, &value) }
            .result()
            .map_err(cuda_err)
    }

    /// Whether this lane's work runs ahead of other lanes' ([`Self::set_urgent`]).
    pub fn is_urgent(&self) -> Result<bool, KernelError> {
        use cudarc::driver::sys;
        let (_, greatest) = self.priorities()?;
        // SAFETY: a zeroed union the driver fills for this attribute.
        let mut value: sys::CUstreamAttrValue = unsafe { std::mem::zeroed() };
        let attr = sys::CUstreamAttrID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
        // SAFETY: the lane's live stream and a live out-parameter.
        unsafe { sys::cuStreamGetAttribute(self.stream.cu_stream(), attr, &mut value) }
            .result()
            .map_err(cuda_err)?;
        // SAFETY: the driver wrote the priority field for this attribute.
        Ok(unsafe { value.priority } == greatest)
    }

    /// The GPU's least and greatest stream priorities.
    fn priorities(&self) -> Result<(i32, i32), KernelError> {
        let (mut least, mut greatest) = (0, 0);
        self.ctx.bind_to_thread().map_err(cuda_err)?;
        // SAFETY: two live out-parameters, on the lane's context.
        unsafe { cudarc::driver::sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(cuda_err)?;
        Ok((least, greatest))
    }

    /// A [`Settle`] for this GPU.
    pub fn settle(&self) -> Settle {
        Settle(self.ctx.clone())
    }

    /// A mark after everything queued on this lane so far.
    pub fn mark(&self) -> Result<Mark, KernelError> {
        self.stream.record_event(None).map(Mark).map_err(cuda_err)
    }
}
