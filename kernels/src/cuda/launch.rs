//! Launches of the device kernels on device buffers.

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use half::bf16;

use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::{KvFormat, KvLayout};

type R<T = ()> = Result<T, KernelError>;

/// Pushes a layer's pages as kernel arguments: K, V, K scales, V scales.
pub(super) fn push_pages<'a>(b: &mut LaunchArgs<'a>, kv: &'a PagedKv) {
    b.arg(&kv.k).arg(&kv.v);
    push_scales(b, kv);
}

/// Pushes the K and V scale buffers of pages with a scale per vector, and
/// two null pointers for the other formats: the fp8 kernels read a null
/// scale buffer as the static format's scale of 1.
fn push_scales<'a>(b: &mut LaunchArgs<'a>, kv: &'a PagedKv) {
    if kv.format == KvFormat::Fp8 {
        b.arg(&kv.k_scale).arg(&kv.v_scale);
    } else {
        b.arg(&NULL_SCALES).arg(&NULL_SCALES);
    }
}

/// A null device pointer, passed for the scale buffers of formats without
/// them.
pub(super) static NULL_SCALES: u64 = 0;

pub(super) fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

pub(super) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// One layer's KV pages on the GPU (same layout as [`crate::kv::KvPages`]).
pub struct PagedKv {
    /// The format.
    pub format: KvFormat,
    /// The layout.
    pub layout: KvLayout,
    /// K bytes (bf16 or e4m3).
    pub k: CudaSlice<u8>,
    /// V bytes.
    pub v: CudaSlice<u8>,
    /// K scales (fp8 only; one per vector).
    pub k_scale: CudaSlice<f32>,
    /// V scales.
    pub v_scale: CudaSlice<f32>,
}

impl PagedKv {
    /// KV heads, head size and page size, when the KV-writing kernels (a
    /// thread per element of a head's vector) can take the layout.
    pub(super) fn writable_layout(&self) -> R<(usize, usize, usize)> {
        let head_dim = self.layout.head_dim;
        if !head_dim.is_multiple_of(32) || head_dim > 1024 {
            return Err(KernelError::Shape(format!(
                "head_dim {head_dim}: a multiple of 32 up to 1024"
            )));
        }
        let l = self.layout;
        Ok((l.kv_heads, head_dim, l.page_size))
    }
}

impl Gpu {
    /// Zeroed pages.
    pub fn paged_kv(&self, format: KvFormat, layout: KvLayout, pages: usize) -> R<PagedKv> {
        let vectors = pages * layout.page_size * layout.kv_heads;
        let elem = format.elem_bytes();
        let bytes = vectors * layout.head_dim * elem;
        let scales = if format == KvFormat::Fp8 { vectors } else { 1 };
        let s = &self.stream;
        Ok(PagedKv {
            format,
            layout,
            k: s.alloc_zeros(bytes).map_err(cuda_err)?,
            v: s.alloc_zeros(bytes).map_err(cuda_err)?,
            k_scale: s.alloc_zeros(scales).map_err(cuda_err)?,
            v_scale: s.alloc_zeros(scales).map_err(cuda_err)?,
        })
    }

    /// `out[t] = table[ids[t]]` for bf16 rows of `hidden`.
    pub fn embed(
        &self,
        table: &CudaSlice<bf16>,
        ids: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        hidden: usize,
    ) -> R {
        let f = self.function("embed_bf16")?;
        let h = hidden as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(table).arg(ids).arg(out).arg(&h);
        // SAFETY: ids are checked against the vocabulary by the caller.
        unsafe { b.launch(cfg((tokens as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Writes `tokens` K and V rows (`kv_heads x head_dim` each) at slots
    /// `page * page_size + slot` (each head's vector where
    /// [`crate::kv`]'s layout puts it); a negative slot writes nothing.
    pub fn kv_write(
        &self,
        kv: &mut PagedKv,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &CudaView<'_, i32>,
        tokens: usize,
    ) -> R {
        let (kv_heads, head_dim, page_size) = kv.writable_layout()?;
        let (h, d, ps) = (kv_heads as i32, head_dim as i32, page_size as i32);
        let grid = (tokens as u32, kv_heads as u32, 1);
        match kv.format {
            KvFormat::Bf16 => {
                let f = self.function("kv_write_bf16")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(k)
                    .arg(v)
                    .arg(slots)
                    .arg(&mut kv.k)
                    .arg(&mut kv.v)
                    .arg(&h)
                    .arg(&d)
                    .arg(&ps);
                // SAFETY: slots index vectors inside the pages.
                unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
            }
            KvFormat::Fp8 | KvFormat::Fp8Static => {
                let f = self.function("kv_write_fp8")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(k).arg(v).arg(slots).arg(&mut kv.k).arg(&mut kv.v);
                if kv.format == KvFormat::Fp8 {
                    b.arg(&mut kv.k_scale).arg(&mut kv.v_scale);
                } else {
                    b.arg(&NULL_SCALES).arg(&NULL_SCALES);
                }
                b.arg(&h).arg(&d).arg(&ps);
                // SAFETY: as above.
                unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
            }
        }
        Ok(())
    }

    /// The index of each row's largest value.
    pub fn argmax_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        n: usize,
        out: &mut CudaViewMut<'_, u32>,
    ) -> R {
        let f = self.function("argmax_rows")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&n_i).arg(out);
        // SAFETY: one block per row of n (a vocabulary: 1024 threads).
        unsafe { b.launch(cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out (m x n) = x (m x k) * w^T` with bf16 `w` (`n x k`): the custom
    /// GEMV up to [`super::gemv::BF16_GEMV_ROWS`] rows, cuBLAS (bf16 in,
    /// f32 accumulate and out) above.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        scratch: &mut CudaSlice<bf16>,
    ) -> R {
        if m <= super::gemv::BF16_GEMV_ROWS && k.is_multiple_of(8) {
            return self.gemv_bf16_parts(x, w, &mut [out], &[n], m, k);
        }
        self.cublas_bf16(x, w, out, m, n, k, scratch)
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
    #[allow(clippy::too_many_arguments)]
    pub fn cublas_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        scratch: &mut CudaSlice<bf16>,
    ) -> R {
        use cudarc::cublas::sys::cudaDataType_t;
        self.to_bf16_scratch(x, scratch, m * k)?;
        let (a, _ra) = w.device_ptr(&self.stream);
        let (bp, _rb) = scratch.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr(&self.stream);
        // SAFETY: live device buffers of the stated sizes (guards held).
        unsafe { self.gemm(a, bp, cudaDataType_t::CUDA_R_16BF, c, m, n, k, n) }?;
        Ok(())
    }

    /// cuBLAS, f32 accumulation and output: row-major `out (m x rows)`,
    /// leading dimension `ldc`, `= x (m x k) * w^T` for `w` (`rows x k`);
    /// `w` and `x` both of type `ty`.
    ///
    /// # Safety
    /// The pointers are live device buffers of those sizes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
        &self,
        w: u64,
        x: u64,
        ty: cudarc::cublas::sys::cudaDataType_t,
        out: u64,
        m: usize,
        rows: usize,
        k: usize,
        ldc: usize,
    ) -> R {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
        };
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
                cudaDataType_t::CUDA_R_32F,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda_err)
    }

    /// `x[r] += b` for every row of `cols`.
    pub fn add_bias(
        &self,
        x: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> R {
        let f = self.function("add_bias")?;
        let (n, c) = ((rows * cols) as i64, cols as i32);
        let mut l = self.stream.launch_builder(f);
        l.arg(x).arg(b).arg(&n).arg(&c);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { l.launch(cfg((blocks(rows * cols, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out[i] = src[idx[i]]`, rows of `cols`.
    pub fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        idx: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> R {
        let f = self.function("gather_rows")?;
        let c = cols as i32;
        let mut l = self.stream.launch_builder(f);
        l.arg(src).arg(idx).arg(out).arg(&c);
        // SAFETY: indices are rows of `src`.
        unsafe { l.launch(cfg((rows as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
