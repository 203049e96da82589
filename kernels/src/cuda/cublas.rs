//! GEMMs through cuBLAS, f32 accumulation and output: bf16 weights on
//! bf16 activations (from two rows up, where the decode GEMV stops), and
//! chunks of dequantized rows (f32 from GGUF blocks, bf16 from FP8 rows and
//! int4).
//!
//! A bf16 GEMM reads its activations as bf16 from [`GemmScratch`]. The
//! kernels that make those activations (the norm before q/k/v and
//! gate/up, SiLU-and-multiply before the down projection) can round their
//! results to bf16 into the scratch themselves, so no separate f32 -> bf16
//! pass reads and writes them again. The values are the ones the f32
//! kernel and that pass would give, bit for bit. FP8 rows read the same
//! bf16 activations and quantize them per token for the W8A8 GEMM
//! (`fp8_gemm.rs`).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::launch::{blocks, cfg};
use super::shape::{GemmShape, StackShape};
use super::{Bf16Out, DeviceWeight, GemmScratch, Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

pub(super) fn no_fp8_scratch() -> KernelError {
    KernelError::Shape("no FP8 scratch for a product of FP8 rows".into())
}

/// Checks that `scratch` holds `len` bf16 activations.
pub(super) fn room(scratch: &GemmScratch, len: usize) -> R {
    if scratch.act.len() < len {
        return Err(KernelError::Shape(format!(
            "bf16 scratch of {} for {len} activations",
            scratch.act.len()
        )));
    }
    Ok(())
}

impl Gpu {
    /// Whether a product of `m` rows of `k` with `w` reads bf16
    /// activations from its scratch: a bf16 weight through cuBLAS (rows the
    /// decode GEMV does not take), or FP8 rows packed for tensor cores
    /// ([`DeviceWeight::Fp8`]) through the W8A8 GEMM, which quantizes them
    /// per token. [`Self::rmsnorm_residual_bf16`] and
    /// [`Self::silu_mul_bf16`] then feed [`Self::matmul_parts_bf16`], and
    /// [`Self::matmul_parts`] routes by it too.
    pub fn takes_bf16_input(&self, w: &DeviceWeight, m: usize, k: usize) -> bool {
        match w {
            DeviceWeight::Bf16(_) => !(m <= super::BF16_GEMV_ROWS && k.is_multiple_of(8)),
            _ => self.fp8_stack(w, m, k).is_some(),
        }
    }

    /// `w` as FP8 rows for the W8A8 GEMM at `m` rows of `k`, where it is
    /// FP8 rows packed for tensor cores and the GEMM takes that product.
    pub(super) fn fp8_stack<'a>(
        &self,
        w: &'a DeviceWeight,
        m: usize,
        k: usize,
    ) -> Option<super::fp8_gemm::Fp8Rows<'a>> {
        match w {
            DeviceWeight::Fp8 { codes, scales }
                if m > super::FP8_GEMV_ROWS && k.is_multiple_of(16) =>
            {
                Some(super::fp8_gemm::Fp8Rows { codes, scales })
            }
            _ => None,
        }
    }

    /// As [`Self::matmul_parts`] for a weight that
    /// [takes bf16 input](Self::takes_bf16_input), on the `m x k` bf16
    /// activations already in `scratch`: cuBLAS (or Kiln's skinny and
    /// cluster GEMMs) on bf16 weights, the W8A8 GEMM on FP8 rows.
    pub fn matmul_parts_bf16(
        &self,
        w: &DeviceWeight,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
        scratch: &mut GemmScratch,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = super::shape::check_parts(outs, parts, m)?;
        room(scratch, m * k)?;
        if let Some(w8) = self.fp8_stack(w, m, k) {
            let GemmScratch { act, fp8, .. } = scratch;
            let fp8 = fp8.as_mut().ok_or_else(no_fp8_scratch)?;
            return self.gemm_fp8_parts(act, w8, outs, shape, fp8);
        }
        let DeviceWeight::Bf16(wb) = w else {
            return Err(KernelError::Shape(
                "bf16 activations need a bf16 weight or FP8 rows".into(),
            ));
        };
        if wb.len() < n * k {
            return Err(KernelError::Shape(format!(
                "{n} stacked rows of {k}: weight too small"
            )));
        }
        let strips = parts.iter().all(|p| p.is_multiple_of(16));
        if self.skinny && (2..=super::SKINNY_WINS_M).contains(&m) && k.is_multiple_of(64) && strips
        {
            return self.gemm_bf16_skinny(&scratch.act, wb, outs, shape);
        }
        if self.cluster_takes(m, n, k) {
            return self.gemm_bf16_cluster(&scratch.act, wb, outs, shape);
        }
        self.gemm_bf16_cublas(&scratch.act, wb, outs, shape)
    }

    /// `outs[p] = x * w_p^T` for each part `p` of a stack of bf16 weights
    /// and `m` bf16 rows `x` of `k`, by cuBLAS, one GEMM a part: the
    /// algorithm [`Self::tune_bf16`] kept for the part's shape, else
    /// `cublasGemmEx`'s own.
    pub fn gemm_bf16_cublas(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = super::shape::check_parts(outs, parts, m)?;
        if w.len() < n * k || x.len() < m * k {
            return Err(KernelError::Shape(format!(
                "{m} rows by {n} stacked rows of {k}: weight or activations too small"
            )));
        }
        let (wp, _rw) = w.device_ptr(&self.stream);
        let (xp, _rx) = x.device_ptr(&self.stream);
        let ty = cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
        let mut row0 = 0;
        for (o, &rows) in outs.iter_mut().zip(parts) {
            let (op, _ro) = o.device_ptr_mut(&self.stream);
            let a = wp + (row0 * k * std::mem::size_of::<bf16>()) as u64;
            let part = GemmShape { m, n: rows, k };
            // SAFETY: rows row0.. of the stack and an output of m x rows,
            // sizes checked above (guards held).
            if !unsafe { self.gemm_tuned((a, xp, op), part, Bf16Out::F32) }? {
                // SAFETY: as above.
                unsafe { self.gemm(a, xp, ty, op, part, rows) }?;
            }
            row0 += rows;
        }
        Ok(())
    }

    /// `out (m x n) = x (m x k) * w^T` with bf16 `w` (`n x k`): the custom
    /// GEMV up to [`super::shape::BF16_GEMV_ROWS`] rows, cuBLAS (bf16 in,
    /// f32 accumulate and out) above.
    ///
    /// Reference path: the engine's step uses [`Self::matmul`] and
    /// [`Self::matmul_parts`]; kept for the parity tests of the bf16
    /// product.
    pub fn matmul_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        shape: GemmShape,
        scratch: &mut CudaSlice<bf16>,
    ) -> R {
        let GemmShape { m, n, k } = shape;
        if m <= super::shape::BF16_GEMV_ROWS && k.is_multiple_of(8) {
            return self.gemv_bf16_parts(x, w, &mut [out], StackShape { m, parts: &[n], k });
        }
        self.cublas_bf16(x, w, out, shape, scratch)
    }

    /// The first `len` of `x` rounded to bf16 as the activations of the
    /// next bf16 GEMM.
    ///
    /// Reference path: the engine's kernels write their products' inputs
    /// themselves; kept for the CUDA tests of those products.
    pub fn load_activations(&self, x: &CudaSlice<f32>, scratch: &mut GemmScratch, len: usize) -> R {
        self.to_bf16_scratch(x, &mut scratch.act, len)
    }

    /// The first `len` activations rounded to bf16 into `scratch`, as
    /// every bf16 engine runs a GEMM (the CPU reference keeps f32; models
    /// stored as GGUF blocks take the f32 path of `Gpu::matmul` instead).
    pub(super) fn to_bf16_scratch(
        &self,
        x: &CudaSlice<f32>,
        scratch: &mut CudaSlice<bf16>,
        len: usize,
    ) -> R {
        if scratch.len() < len || x.len() < len {
            return Err(KernelError::Shape(format!(
                "bf16 scratch of {} for {len} activations",
                scratch.len()
            )));
        }
        let total = len as i64;
        let f = self.function("to_bf16")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&mut *scratch).arg(&total);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { b.launch(cfg((blocks(len, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// The cuBLAS path of [`Self::matmul_bf16`]; `scratch` holds `m x k`
    /// bf16 activations.
    ///
    /// Reference path: the engine's step runs cuBLAS through
    /// [`Self::matmul_parts_bf16`]; kept for [`Self::matmul_bf16`] and for
    /// `cuda_bench`'s GEMV-against-cuBLAS table.
    pub fn cublas_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        shape: GemmShape,
        scratch: &mut CudaSlice<bf16>,
    ) -> R {
        use cudarc::cublas::sys::cudaDataType_t;
        let GemmShape { m, n, k } = shape;
        self.to_bf16_scratch(x, scratch, m * k)?;
        let (a, _ra) = w.device_ptr(&self.stream);
        let (bp, _rb) = scratch.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr(&self.stream);
        // SAFETY: live device buffers of the stated sizes (guards held).
        unsafe { self.gemm(a, bp, cudaDataType_t::CUDA_R_16BF, c, shape, n) }?;
        Ok(())
    }

    /// `out (m x n) = x (m x k) * w^T` in bf16 (f32 accumulation) for a
    /// `w` (`n x k`) that [takes bf16 input](Self::takes_bf16_input), on the
    /// bf16 activations in `scratch`: the product a bf16 kernel reads next,
    /// at half the bytes of f32.
    pub fn matmul_bf16_out(
        &self,
        w: &DeviceWeight,
        out: &mut CudaSlice<bf16>,
        shape: GemmShape,
        scratch: &mut GemmScratch,
    ) -> R {
        let GemmShape { m, n, k } = shape;
        room(scratch, m * k)?;
        if let Some(w8) = self.fp8_stack(w, m, k) {
            let GemmScratch { act, fp8, .. } = scratch;
            let fp8 = fp8.as_mut().ok_or_else(no_fp8_scratch)?;
            let shape = StackShape { m, parts: &[n], k };
            return self.gemm_fp8_parts(act, w8, &mut [out], shape, fp8);
        }
        let DeviceWeight::Bf16(wb) = w else {
            return Err(KernelError::Shape(
                "a bf16 product needs a bf16 weight or FP8 rows".into(),
            ));
        };
        if wb.len() < n * k || out.len() < m * n {
            return Err(KernelError::Shape(format!(
                "{m} x {n} from {k}: weight or output too small"
            )));
        }
        use cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
        let (wp, _rw) = wb.device_ptr(&self.stream);
        let (xp, _rx) = scratch.act.device_ptr(&self.stream);
        let (op, _ro) = out.device_ptr_mut(&self.stream);
        // SAFETY: sizes checked above (guards held).
        if unsafe { self.gemm_tuned((wp, xp, op), shape, Bf16Out::Bf16) }? {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe { self.gemm_into(wp, xp, CUDA_R_16BF, (op, CUDA_R_16BF), shape, n) }
    }

    /// cuBLAS, f32 accumulation and output: row-major `out (m x n)`,
    /// leading dimension `ldc`, `= x (m x k) * w^T` for `w` (`n x k`);
    /// `w` and `x` both of type `ty`.
    ///
    /// # Safety
    /// The pointers are live device buffers of those sizes.
    pub(crate) unsafe fn gemm(
        &self,
        w: u64,
        x: u64,
        ty: cudarc::cublas::sys::cudaDataType_t,
        out: u64,
        shape: GemmShape,
        ldc: usize,
    ) -> R {
        let f32_out = cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
        // SAFETY: the caller vouches for the pointers.
        unsafe { self.gemm_into(w, x, ty, (out, f32_out), shape, ldc) }
    }

    /// As [`Self::gemm`], the output of type `out.1` (f32 accumulation
    /// either way).
    ///
    /// # Safety
    /// The pointers are live device buffers of those sizes.
    pub(super) unsafe fn gemm_into(
        &self,
        w: u64,
        x: u64,
        ty: cudarc::cublas::sys::cudaDataType_t,
        (out, out_ty): (u64, cudarc::cublas::sys::cudaDataType_t),
        shape: GemmShape,
        ldc: usize,
    ) -> R {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
        let GemmShape { m, n: rows, k } = shape;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major out (m x rows) is column-major rows x m: out^T = w x^T.
        // SAFETY: the caller vouches for the pointers.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                m as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                ty,
                k as i32,
                x as *const _,
                ty,
                k as i32,
                (&beta) as *const f32 as *const _,
                out as *mut _,
                out_ty,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda_err)
    }

    /// Columns `cols` of `out` (`m x n`) `= x (m x k) * w^T` with `w`
    /// (`cols.len() x k`) and `x` both of type `ty` (f32 or bf16), by
    /// cuBLAS (f32 accumulation and output).
    pub(super) fn gemm_cols<T: cudarc::driver::DeviceRepr>(
        &self,
        w: &CudaSlice<T>,
        x: &CudaSlice<T>,
        ty: cudarc::cublas::sys::cudaDataType_t,
        out: &mut CudaSlice<f32>,
        shape: GemmShape,
        cols: std::ops::Range<usize>,
    ) -> R {
        let GemmShape { m, n, k } = shape;
        let (r0, rows) = (cols.start, cols.len());
        if w.len() < rows * k || x.len() < m * k || out.len() < m * n || cols.end > n {
            return Err(KernelError::Shape(format!(
                "columns {cols:?} of {m} x {n} from {k}: buffers too small"
            )));
        }
        let (a, _ra) = w.device_ptr(&self.stream);
        let (bp, _rb) = x.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr(&self.stream);
        // This chunk is columns r0.. of the row-major output.
        let c = c + (r0 * std::mem::size_of::<f32>()) as u64;
        // SAFETY: live device buffers of the sizes checked above (guards
        // held).
        unsafe { self.gemm(a, bp, ty, c, GemmShape { m, n: rows, k }, n) }
    }
}
