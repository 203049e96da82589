//! FP8 W8A8 GEMMs through cuBLASLt (prefill and large batches on FP8
//! rows): activations quantized to e4m3 with a scale per token, weights the
//! FP8 rows as stored (the 16-byte row headers skipped by the leading
//! dimension), f32 accumulation on tensor cores, and both scale vectors
//! applied by cuBLASLt's outer-vector scaling (sm_90, CUDA 12.9 and up).
//!
//! Products of FP8 rows with more than [`FP8_GEMV_ROWS`] activation rows
//! take this path, those of up to [`super::E4M3_MMA_MAX_M`] rows through
//! Kiln's own kernel (`fp8_mma.rs`); GPUs without FP8 tensor cores take the
//! W8A16 GEMV of `quant.cu`.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::fp8_act::Fp8Input;
use super::shape::GemmShape;
use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::quant::FP8_ROW_HEADER;

type R<T = ()> = Result<T, KernelError>;

/// Bytes of cuBLASLt's workspace.
const LT_WORKSPACE: usize = 32 << 20;

/// Most activation rows that go to the FP8-row GEMV rather than the W8A8
/// GEMM, as on the CPU (the GEMV streams at a third of copy bandwidth at
/// one row and worse above it; the GEMM reads each weight byte once).
pub use crate::matmul::FP8_GEMV_ROWS;

/// A cuBLASLt handle, its workspace and the algorithm it chose per shape
/// (the heuristic query costs host time on every product otherwise).
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: HashMap<(usize, usize, usize, u32), sys::cublasLtMatmulAlgo_t>,
}

/// A stack of FP8 rows as a product reads it: the rows, and their scales
/// when gathered at upload.
#[derive(Clone, Copy)]
pub(super) struct Fp8Rows<'a> {
    pub bytes: &'a CudaSlice<u8>,
    pub scales: Option<&'a CudaSlice<f32>>,
}

/// Activations quantized for the W8A8 GEMM and the weights' scale vector.
pub struct Fp8Scratch {
    pub(super) xq: CudaSlice<u8>,
    pub(super) xs: CudaSlice<f32>,
    pub(super) ws: CudaSlice<f32>,
}

impl Gpu {
    /// Scratch for W8A8 products of up to `m x k` activations, with room
    /// for the scales of any weight of rows of at least 16 values.
    pub(super) fn fp8_scratch(&self, m: usize, k: usize) -> R<Fp8Scratch> {
        Ok(Fp8Scratch {
            xq: self.zeros(m * k)?,
            xs: self.zeros(m)?,
            ws: self.zeros(super::DEQUANT_CHUNK / 16)?,
        })
    }

    /// `outs[p] = x * w_p^T` for each part `p` of a stack of FP8 rows: `x`
    /// (f32, or the bf16 activations of a GEMM's scratch) quantized per
    /// token once, then one W8A8 GEMM per part.
    pub(super) fn gemm_fp8_parts<X: Fp8Input, T: Fp8Out>(
        &self,
        x: &CudaSlice<X>,
        w: Fp8Rows<'_>,
        outs: &mut [&mut CudaSlice<T>],
        shape: super::StackShape<'_>,
        scratch: &mut Fp8Scratch,
    ) -> R {
        self.quantize_rows_e4m3(x, &mut scratch.xq, &mut scratch.xs, shape.m, shape.k)?;
        self.gemm_fp8_quantized(w, outs, shape, scratch)
    }

    /// [`Self::gemm_fp8_parts`] on activations already quantized into
    /// `scratch` (`m x k` e4m3 codes and their row scales).
    pub(super) fn gemm_fp8_quantized<T: Fp8Out>(
        &self,
        w: Fp8Rows<'_>,
        outs: &mut [&mut CudaSlice<T>],
        shape: super::StackShape<'_>,
        scratch: &mut Fp8Scratch,
    ) -> R {
        if self.fp8_mma_takes(&w, &shape) {
            return self.gemm_fp8_mma(w, outs, shape, scratch);
        }
        let super::StackShape { m, parts, k } = shape;
        let Fp8Scratch { xq, xs, ws } = scratch;
        let stride = FP8_ROW_HEADER + k;
        let mut base = 0;
        for (out, &rows) in outs.iter_mut().zip(parts) {
            let part = w.bytes.slice(base * stride..(base + rows) * stride);
            let shape = GemmShape { m, n: rows, k };
            // A part's scales from upload where its slice starts 16-byte
            // aligned, as cuBLASLt's vectors may need.
            match w.scales {
                Some(s) if s.len() >= base + rows && base.is_multiple_of(4) => {
                    let s = s.slice(base..base + rows);
                    self.gemm_fp8_rows(&part, &s, xq, xs, *out, shape)?;
                }
                _ => {
                    if ws.len() < rows {
                        return Err(KernelError::Shape(format!(
                            "an FP8 part of {rows} rows: more than the scratch's scales"
                        )));
                    }
                    self.fp8_row_scales(&part, ws, rows, k)?;
                    self.gemm_fp8_rows(&part, &ws.slice(..), xq, xs, *out, shape)?;
                }
            }
            base += rows;
        }
        Ok(())
    }
}

/// An output type of the W8A8 GEMM: f32, or bf16 for a bf16 kernel next.
pub trait Fp8Out: DeviceRepr {
    /// cuBLASLt's name for the type.
    const TYPE: sys::cudaDataType;
    /// The suffix of Kiln's kernels that write it.
    const SUFFIX: &'static str;
}

impl Fp8Out for f32 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_32F;
    const SUFFIX: &'static str = "f32";
}

impl Fp8Out for bf16 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_16BF;
    const SUFFIX: &'static str = "bf16";
}

// SAFETY: the handle is used only under the `Mutex` that holds it, on the
// stream of the `Gpu` that owns it.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Sets one attribute of a matmul descriptor from a plain value.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> R {
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            v as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(cuda_err)
}

/// Descriptors of one GEMM, destroyed when dropped.
struct Descs {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    pref: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each created once below and destroyed once here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_pref(self.pref);
        }
    }
}

impl Gpu {
    /// `out (m x n) = (xq * x_scales) (w * w_scales)^T` (f32 or bf16; f32
    /// accumulation) by cuBLASLt on
    /// FP8 tensor cores: `w` is `n` FP8 rows of `k` (`k` a multiple of 16),
    /// `xq` `m` rows of `k` e4m3 from [`Self::quantize_rows_e4m3`].
    pub fn gemm_fp8_rows<T: Fp8Out>(
        &self,
        w: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, f32>,
        xq: &CudaSlice<u8>,
        x_scales: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        shape: GemmShape,
    ) -> R {
        let GemmShape { m, n, k } = shape;
        let stride = FP8_ROW_HEADER + k;
        if !k.is_multiple_of(16)
            || w.len() < n * stride
            || w_scales.len() < n
            || xq.len() < m * k
            || x_scales.len() < m
            || out.len() < m * n
        {
            return Err(KernelError::Shape(format!(
                "FP8 GEMM of {m} x {k} by {n} rows: buffers too small or k not a multiple of 16"
            )));
        }
        let mut guard = self
            .lt
            .lock()
            .map_err(|_| KernelError::Shape("cuBLASLt handle poisoned".into()))?;
        if guard.is_none() {
            let handle = lt::create_handle().map_err(cuda_err)?;
            let workspace = self
                .stream
                .alloc_zeros::<u8>(LT_WORKSPACE)
                .map_err(cuda_err)?;
            *guard = Some(Lt {
                handle,
                workspace,
                algos: HashMap::new(),
            });
        }
        let Some(lt_state) = guard.as_mut() else {
            return Err(KernelError::Shape("no cuBLASLt handle".into()));
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let f32_ty = sys::cudaDataType::CUDA_R_32F;
        // Row-major out (m x n) is column-major n x m: out^T = W X^T, W
        // stored as k x n columns (a row of weights each) of stride k + 16.
        let descs = Descs {
            desc: lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32_ty)
                .map_err(cuda_err)?,
            layouts: [
                lt::create_matrix_layout(e4m3, k as u64, n as u64, stride as i64)
                    .map_err(cuda_err)?,
                lt::create_matrix_layout(e4m3, k as u64, m as u64, k as i64).map_err(cuda_err)?,
                lt::create_matrix_layout(T::TYPE, n as u64, m as u64, n as i64)
                    .map_err(cuda_err)?,
            ],
            pref: lt::create_matmul_pref().map_err(cuda_err)?,
        };
        let (wp, _rw) = w.device_ptr(&self.stream);
        let (ws, _rws) = w_scales.device_ptr(&self.stream);
        let (xp, _rx) = xq.device_ptr(&self.stream);
        let (xs, _rxs) = x_scales.device_ptr(&self.stream);
        let (op, _ro) = out.device_ptr_mut(&self.stream);
        let (wsp, _rwsp) = lt_state.workspace.device_ptr_mut(&self.stream);
        let outer =
            sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
        let (ws_ptr, xs_ptr) = (ws as *const c_void, xs as *const c_void);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: live descriptors; attribute values of the documented
        // types; pointers to live device buffers of the sizes checked above
        // (guards held); the weights start past their first row header and
        // stay 16-byte aligned (k a multiple of 16).
        unsafe {
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws_ptr)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs_ptr)?;
            // Accumulate in the tensor cores' own registers, not promoted to
            // f32 every few k steps: the FP8 kernels' main cost on Hopper,
            // within the bound the parity test holds (a wider accumulator
            // error than f32's, far below e4m3's rounding of the inputs).
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let size = LT_WORKSPACE as u64;
            lt::set_matmul_pref_attribute(
                descs.pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &size as *const u64 as *const c_void,
                8,
            )
            .map_err(cuda_err)?;
            let align = 16u32;
            lt::set_matmul_pref_attribute(
                descs.pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                &align as *const u32 as *const c_void,
                4,
            )
            .map_err(cuda_err)?;
            let [a, b, c] = descs.layouts;
            let handle = lt_state.handle;
            let algo = match lt_state.algos.get(&(m, n, k, T::TYPE as u32)) {
                Some(algo) => *algo,
                None => {
                    let heur =
                        lt::get_matmul_algo_heuristic(handle, descs.desc, a, b, c, c, descs.pref)
                            .map_err(cuda_err)?;
                    lt_state.algos.insert((m, n, k, T::TYPE as u32), heur.algo);
                    heur.algo
                }
            };
            lt::matmul(
                handle,
                descs.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                (wp + FP8_ROW_HEADER as u64) as *const c_void,
                a,
                xp as *const c_void,
                b,
                op as *const c_void,
                c,
                op as *mut c_void,
                c,
                &algo,
                wsp as *mut c_void,
                LT_WORKSPACE,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
            .map_err(cuda_err)
        }
    }
}
