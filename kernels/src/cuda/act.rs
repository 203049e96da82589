//! Activations written straight into a bf16 GEMM's input. From two rows up
//! a bf16 weight runs through cuBLAS on bf16 activations; the kernels that
//! make those activations (the norm before q/k/v and gate/up, SiLU-and-
//! multiply before the down projection) can round their results to bf16
//! into the GEMM's scratch themselves, so no separate f32 -> bf16 pass
//! reads and writes them again. The values are the ones the f32 kernel and
//! that pass would give, bit for bit.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::launch::{blocks, cfg};
use super::norm::NormOut;
use super::{DeviceWeight, GemmScratch, Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Checks that `scratch` holds `len` bf16 activations.
fn room(scratch: &GemmScratch, len: usize) -> R {
    if scratch.act.len() < len {
        return Err(KernelError::Shape(format!(
            "bf16 scratch of {} for {len} activations",
            scratch.act.len()
        )));
    }
    Ok(())
}

impl Gpu {
    /// Whether a product of `m` rows of `k` with `w` runs cuBLAS on bf16
    /// activations from its scratch (a bf16 weight the decode GEMV does not
    /// take), so [`Self::rmsnorm_residual_bf16`] and [`Self::silu_mul_bf16`]
    /// can feed [`Self::matmul_parts_bf16`]. [`Self::matmul_parts`] routes
    /// by it too.
    pub fn takes_bf16_input(&self, w: &DeviceWeight, m: usize, k: usize) -> bool {
        let gemv = m <= super::BF16_GEMV_ROWS && k.is_multiple_of(8);
        matches!(w, DeviceWeight::Bf16(_)) && !gemv
    }

    /// [`Self::rmsnorm_residual`] with its output rounded to bf16 into
    /// `scratch`, ready for [`Self::matmul_parts_bf16`].
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual_bf16(
        &self,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        scratch: &mut GemmScratch,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> R {
        room(scratch, rows * dim)?;
        let out = NormOut::Bf16(&mut scratch.act);
        self.rmsnorm_launch(x, residual, w, out, rows, dim, eps)
    }

    /// `silu(gate) * up` over `n` elements, rounded to bf16 into `scratch`
    /// (`gate` is left as it was).
    pub fn silu_mul_bf16(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        scratch: &mut GemmScratch,
        n: usize,
    ) -> R {
        room(scratch, n)?;
        if gate.len() < n || up.len() < n {
            return Err(KernelError::Shape(format!(
                "silu-mul of {n} elements: inputs too small"
            )));
        }
        let f = self.function("silu_mul")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(gate).arg(up).arg(&mut scratch.act).arg(&n_i);
        // SAFETY: one thread per element, bounds-checked; the kernel only
        // reads gate when it writes the scratch.
        unsafe { b.launch(cfg((blocks(n, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// As [`Self::matmul_parts`] with a bf16 weight through cuBLAS, on the
    /// `m x k` bf16 activations already in `scratch`.
    pub fn matmul_parts_bf16(
        &self,
        w: &DeviceWeight,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        m: usize,
        k: usize,
        scratch: &GemmScratch,
    ) -> R {
        let DeviceWeight::Bf16(wb) = w else {
            return Err(KernelError::Shape(
                "bf16 activations need a bf16 weight".into(),
            ));
        };
        let n = super::gemv::check_parts(outs, parts, m)?;
        room(scratch, m * k)?;
        if wb.len() < n * k {
            return Err(KernelError::Shape(format!(
                "{n} stacked rows of {k}: weight too small"
            )));
        }
        let (wp, _rw) = wb.device_ptr(&self.stream);
        let (xp, _rx) = scratch.act.device_ptr(&self.stream);
        let ty = cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
        let mut row0 = 0;
        for (o, &rows) in outs.iter_mut().zip(parts) {
            let (op, _ro) = o.device_ptr_mut(&self.stream);
            let a = wp + (row0 * k * std::mem::size_of::<bf16>()) as u64;
            // SAFETY: rows row0.. of the stack and an output of m x rows,
            // sizes checked above (guards held).
            unsafe { self.gemm(a, xp, ty, op, m, rows, k, rows) }?;
            row0 += rows;
        }
        Ok(())
    }
}
