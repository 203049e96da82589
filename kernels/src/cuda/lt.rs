//! cuBLASLt for the W8A8 GEMMs (`fp8_gemm.rs`) and tuned bf16 products
//! (`bf16_lt.rs`): the handle and its workspace, a GEMM's descriptors (FP8
//! codes of weights and activations, scales per row and per token or one
//! an operand, fast accumulation; or plain bf16), the algorithms cuBLASLt
//! offers for them, and a launch by one of them.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};

use super::shape::GemmShape;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Bytes of cuBLASLt's workspace.
const LT_WORKSPACE: usize = 32 << 20;

/// The output type of a tuned bf16 product (f32 accumulation either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bf16Out {
    /// f32, as most products write.
    F32,
    /// bf16, as the bf16 MLP's gate/up product writes.
    Bf16,
}

impl Bf16Out {
    /// Its type as cuBLASLt names it.
    pub(super) fn ty(self) -> sys::cudaDataType {
        match self {
            Bf16Out::F32 => sys::cudaDataType::CUDA_R_32F,
            Bf16Out::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        }
    }

    /// Its type as cuBLAS (a binding of its own) names it.
    pub(super) fn blas_ty(self) -> cudarc::cublas::sys::cudaDataType_t {
        use cudarc::cublas::sys::cudaDataType_t as T;
        match self {
            Bf16Out::F32 => T::CUDA_R_32F,
            Bf16Out::Bf16 => T::CUDA_R_16BF,
        }
    }
}

/// A tuned product's key: rows, weight rows, columns and output type.
pub(super) type TunedKey = (usize, usize, usize, Bf16Out);

/// A bf16 product's tuned algorithm with its descriptors, made once (they
/// cost host time on every launch otherwise).
pub(super) struct Tuned {
    pub(super) descs: Descs,
    pub(super) algo: sys::cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle, its workspace and the algorithm it chose per shape
/// (the heuristic query costs host time on every product otherwise).
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    pub(super) algos: HashMap<(usize, usize, usize, u32), sys::cublasLtMatmulAlgo_t>,
    /// bf16 products (m, n, k, output type) that run a tuned algorithm,
    /// not `cublasGemmEx` (`bf16_lt.rs`).
    pub(super) bf16: HashMap<TunedKey, Tuned>,
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
pub(super) struct Descs {
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

/// Device pointers of one W8A8 GEMM's operands: the first weight code, the
/// weights' leading dimension in bytes, both scales (vectors, or one f32
/// each), the activations' codes and the output.
#[derive(Clone, Copy)]
pub(super) struct W8a8Ptrs {
    pub w: u64,
    pub ldw: usize,
    pub w_scales: u64,
    pub xq: u64,
    pub x_scales: u64,
    pub out: u64,
}

impl Descs {
    /// Asks only for algorithms that keep split-K partial sums in the
    /// compute type (f32), so a bf16 output is rounded once, not once per
    /// part.
    pub(super) fn reduce_in_compute_type(&self) -> R {
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let mask = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        // SAFETY: a live preference; the attribute is a u32.
        unsafe {
            lt::set_matmul_pref_attribute(
                self.pref,
                P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &mask as *const u32 as *const c_void,
                4,
            )
        }
        .map_err(cuda_err)
    }
}

impl W8a8Ptrs {
    /// The pointers a launch takes (the scales live in the descriptors).
    pub(super) fn operands(&self) -> Operands {
        Operands {
            w: self.w,
            x: self.xq,
            out: self.out,
        }
    }
}

/// Device pointers of one launch: the first weight, the activations and
/// the output.
#[derive(Clone, Copy)]
pub(super) struct Operands {
    pub w: u64,
    pub x: u64,
    pub out: u64,
}

impl Lt {
    /// The handle (made at first use) and its workspace.
    pub(super) fn get<'a>(slot: &'a mut Option<Lt>, gpu: &Gpu) -> R<&'a mut Lt> {
        if slot.is_none() {
            let handle = lt::create_handle().map_err(cuda_err)?;
            let workspace = gpu
                .stream
                .alloc_zeros::<u8>(LT_WORKSPACE)
                .map_err(cuda_err)?;
            *slot = Some(Lt {
                handle,
                workspace,
                algos: HashMap::new(),
                bf16: HashMap::new(),
            });
        }
        slot.as_mut()
            .ok_or_else(|| KernelError::Shape("no cuBLASLt handle".into()))
    }

    /// Descriptors of `out (m x n) = (xq * x_scales) (w * w_scales)^T`:
    /// scales per weight row and per token (`outer`), or one per operand
    /// (`p`'s scale pointers then name one f32 each).
    pub(super) fn descs(
        shape: GemmShape,
        out: sys::cudaDataType,
        p: &W8a8Ptrs,
        outer: bool,
    ) -> R<Descs> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let descs = Self::plain_descs(shape, e4m3, out, p.ldw)?;
        use sys::cublasLtMatmulMatrixScale_t as S;
        let mode = if outer {
            S::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
        } else {
            S::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
        } as i32;
        let (ws, xs) = (p.w_scales as *const c_void, p.x_scales as *const c_void);
        // SAFETY: live descriptors; attribute values of the documented types.
        unsafe {
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
            // Accumulate in the tensor cores' own registers, not promoted to
            // f32 every few k steps: the FP8 kernels' main cost on Hopper,
            // within the bound the parity test holds (a wider accumulator
            // error than f32's, far below e4m3's rounding of the inputs).
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
        }
        Ok(descs)
    }

    /// Descriptors of `out (m x n) = x w^T`, `w` and `x` of type `input`
    /// (`w` rows `ldw` elements apart), f32 accumulation, no scales: the
    /// W8A8 GEMM's base, and the whole of a bf16 one.
    pub(super) fn plain_descs(
        shape: GemmShape,
        input: sys::cudaDataType,
        out: sys::cudaDataType,
        ldw: usize,
    ) -> R<Descs> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let GemmShape { m, n, k } = shape;
        // Row-major out (m x n) is column-major n x m: out^T = W X^T, W
        // stored as k x n columns (a row of weights each) of stride `ldw`.
        let descs = Descs {
            desc: lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            )
            .map_err(cuda_err)?,
            layouts: [
                lt::create_matrix_layout(input, k as u64, n as u64, ldw as i64)
                    .map_err(cuda_err)?,
                lt::create_matrix_layout(input, k as u64, m as u64, k as i64).map_err(cuda_err)?,
                lt::create_matrix_layout(out, n as u64, m as u64, n as i64).map_err(cuda_err)?,
            ],
            pref: lt::create_matmul_pref().map_err(cuda_err)?,
        };
        // SAFETY: live descriptors; attribute values of the documented types.
        unsafe {
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
            set_desc(descs.desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
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
        }
        Ok(descs)
    }

    /// Up to `count` of cuBLASLt's algorithms for `d`, its best guess first.
    pub(super) fn heuristics(
        &self,
        d: &Descs,
        count: usize,
    ) -> R<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        let [a, b, c] = d.layouts;
        let mut found = 0i32;
        // SAFETY: a zeroed result is a valid (empty) heuristic result.
        let mut results =
            vec![unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() }; count];
        // SAFETY: live handle and descriptors; `results` holds `count`.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                d.desc,
                a,
                b,
                c,
                c,
                d.pref,
                count as i32,
                results.as_mut_ptr(),
                &mut found,
            )
        }
        .result()
        .map_err(cuda_err)?;
        results.truncate(found.max(0) as usize);
        if results.is_empty() {
            return Err(KernelError::Shape(
                "cuBLASLt has no algorithm for this GEMM".into(),
            ));
        }
        Ok(results)
    }

    /// Launches one GEMM by `algo` on `stream`.
    ///
    /// # Safety
    /// `p` points at live device buffers of the sizes `d` describes, which
    /// stay alive until the launch is done (the caller holds their guards).
    pub(super) unsafe fn run(
        &mut self,
        d: &Descs,
        algo: &sys::cublasLtMatmulAlgo_t,
        p: Operands,
        stream: &CudaStream,
    ) -> R {
        // SAFETY: the caller's contract.
        unsafe { launch(self.handle, &mut self.workspace, (d, algo), p, stream) }
    }

    /// Launches the bf16 product `key` by the algorithm tuning kept for it
    /// (`bf16_lt.rs`); `false` (nothing run) where it has none, or where
    /// cuBLASLt refuses it here (it checks before it queues anything),
    /// which drops it.
    ///
    /// # Safety
    /// As [`Self::run`].
    pub(super) unsafe fn run_tuned(
        &mut self,
        key: &TunedKey,
        p: Operands,
        stream: &CudaStream,
    ) -> bool {
        let Some(t) = self.bf16.get(key) else {
            return false;
        };
        // SAFETY: the caller's contract.
        let ran = unsafe {
            launch(
                self.handle,
                &mut self.workspace,
                (&t.descs, &t.algo),
                p,
                stream,
            )
        };
        if ran.is_err() {
            self.bf16.remove(key);
        }
        ran.is_ok()
    }
}

/// The error of a lock on a poisoned cuBLASLt handle.
pub(super) fn poisoned() -> KernelError {
    KernelError::Shape("cuBLASLt handle poisoned".into())
}

/// Launches one GEMM by `algo` on `stream` with `handle` and its
/// `workspace`.
///
/// # Safety
/// As [`Lt::run`].
unsafe fn launch(
    handle: sys::cublasLtHandle_t,
    workspace: &mut CudaSlice<u8>,
    (d, algo): (&Descs, &sys::cublasLtMatmulAlgo_t),
    p: Operands,
    stream: &CudaStream,
) -> R {
    let [a, b, c] = d.layouts;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (wsp, _rwsp) = workspace.device_ptr_mut(stream);
    // SAFETY: see the function's contract; the workspace is the handle's.
    unsafe {
        lt::matmul(
            handle,
            d.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            p.w as *const c_void,
            a,
            p.x as *const c_void,
            b,
            p.out as *const c_void,
            c,
            p.out as *mut c_void,
            c,
            algo,
            wsp as *mut c_void,
            LT_WORKSPACE,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(cuda_err)
}
