//! FP8 W8A8 GEMMs through cuBLASLt (prefill and large batches on FP8
//! rows): activations quantized to e4m3 with a scale per token, weights the
//! FP8 rows' codes as uploaded (`DeviceWeight::Fp8`: packed rows, their
//! scales apart), f32 accumulation on tensor cores, and both scale vectors
//! applied by cuBLASLt's outer-vector scaling (sm_90, CUDA 12.9 and up).
//!
//! Products of FP8 rows with more than [`FP8_GEMV_ROWS`] activation rows
//! take this path, those of up to [`super::E4M3_MMA_MAX_M`] rows through
//! Kiln's own kernel (`fp8_mma.rs`); GPUs without FP8 tensor cores take the
//! W8A16 GEMV of `quant.cu`.

use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::fp8_act::Fp8Input;
use super::lt::{Descs, Lt, W8a8Ptrs};
use super::shape::GemmShape;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Most activation rows that go to the FP8-row GEMV rather than the W8A8
/// GEMM, as on the CPU (the GEMV streams at a third of copy bandwidth at
/// one row and worse above it; the GEMM reads each weight byte once).
pub use crate::matmul::FP8_GEMV_ROWS;

/// A stack of FP8 rows as a product reads it: `rows x k` packed e4m3
/// codes and a scale a row.
#[derive(Clone, Copy)]
pub(super) struct Fp8Rows<'a> {
    pub codes: &'a CudaSlice<u8>,
    pub scales: &'a CudaSlice<f32>,
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
        if self.fp8_mma_takes(&shape) {
            return self.gemm_fp8_mma(w, outs, shape, scratch);
        }
        let super::StackShape { m, parts, k } = shape;
        let n: usize = parts.iter().sum();
        if w.codes.len() < n * k || w.scales.len() < n {
            return Err(KernelError::Shape(format!(
                "an FP8 stack of {n} rows of {k}: codes or scales too small"
            )));
        }
        let Fp8Scratch { xq, xs, ws } = scratch;
        let mut base = 0;
        for (out, &rows) in outs.iter_mut().zip(parts) {
            let part = w.codes.slice(base * k..(base + rows) * k);
            let shape = GemmShape { m, n: rows, k };
            let scales = w.scales.slice(base..base + rows);
            // A part's scales in place where they start 16-byte aligned, as
            // cuBLASLt's vectors may need; else copied to the scratch's.
            if base.is_multiple_of(4) {
                self.gemm_fp8_rows(&part, &scales, xq, xs, *out, shape)?;
            } else {
                if ws.len() < rows {
                    return Err(KernelError::Shape(format!(
                        "an FP8 part of {rows} rows: more than the scratch's scales"
                    )));
                }
                let mut to = ws.slice_mut(..rows);
                self.stream
                    .memcpy_dtod(&scales, &mut to)
                    .map_err(cuda_err)?;
                self.gemm_fp8_rows(&part, &ws.slice(..rows), xq, xs, *out, shape)?;
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

/// How a W8A8 GEMM's weights lie: bytes before the first code, bytes from
/// one row to the next, and whether the scales are vectors (one a weight
/// row, one a token) or one f32 an operand.
#[derive(Clone, Copy)]
pub(super) struct W8a8Layout {
    pub offset: usize,
    pub ldw: usize,
    pub outer: bool,
}

impl Gpu {
    /// `out (m x n) = (xq * x_scales) (w * w_scales)^T` (f32 or bf16; f32
    /// accumulation) by cuBLASLt on FP8 tensor cores: `w` is `n` packed
    /// rows of `k` e4m3 codes (`k` a multiple of 16), `xq` `m` rows of `k`
    /// e4m3 from [`Self::quantize_rows_e4m3`].
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
        let layout = W8a8Layout {
            offset: 0,
            ldw: k,
            outer: true,
        };
        self.w8a8(
            w,
            w_scales,
            xq,
            x_scales,
            out,
            shape,
            layout,
            |lt_state, descs, p| {
                let key = (m, n, k, T::TYPE as u32);
                let algo = match lt_state.algos.get(&key) {
                    Some(algo) => *algo,
                    None => {
                        let algo = lt_state.heuristics(descs, 1)?[0].algo;
                        lt_state.algos.insert(key, algo);
                        algo
                    }
                };
                // SAFETY: `w8a8` checked the buffers' sizes and holds their
                // guards while this runs.
                unsafe { lt_state.run(descs, &algo, p.operands(), &self.stream) }
            },
        )
    }

    /// Checks a W8A8 GEMM's buffers against `shape` and `layout`, then runs
    /// `f` on the cuBLASLt handle with the GEMM's descriptors and its
    /// operands' pointers, whose guards it holds until `f` returns.
    #[allow(clippy::too_many_arguments, reason = "a GEMM's operands")]
    pub(super) fn w8a8<T: Fp8Out, V>(
        &self,
        w: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, f32>,
        xq: &CudaSlice<u8>,
        x_scales: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        shape: GemmShape,
        layout: W8a8Layout,
        f: impl FnOnce(&mut Lt, &Descs, &W8a8Ptrs) -> R<V>,
    ) -> R<V> {
        let GemmShape { m, n, k } = shape;
        let W8a8Layout { offset, ldw, outer } = layout;
        let scales = |rows: usize| if outer { rows } else { 1 };
        if !k.is_multiple_of(16)
            || ldw < k
            || !offset.is_multiple_of(16)
            || !ldw.is_multiple_of(16)
            || w.len() < offset + n.saturating_sub(1) * ldw + k
            || w_scales.len() < scales(n)
            || xq.len() < m * k
            || x_scales.len() < scales(m)
            || out.len() < m * n
        {
            return Err(KernelError::Shape(format!(
                "FP8 GEMM of {m} x {k} by {n} rows: buffers too small or rows not of whole \
                 16-byte pieces"
            )));
        }
        let mut guard = self.lt.lock().map_err(|_| super::lt::poisoned())?;
        let lt_state = Lt::get(&mut guard, self)?;
        let (wp, _rw) = w.device_ptr(&self.stream);
        let (ws, _rws) = w_scales.device_ptr(&self.stream);
        let (xp, _rx) = xq.device_ptr(&self.stream);
        let (xs, _rxs) = x_scales.device_ptr(&self.stream);
        let (op, _ro) = out.device_ptr_mut(&self.stream);
        let p = W8a8Ptrs {
            w: wp + offset as u64,
            ldw,
            w_scales: ws,
            xq: xp,
            x_scales: xs,
            out: op,
        };
        let descs = Lt::descs(shape, T::TYPE, &p, outer)?;
        f(lt_state, &descs, &p)
    }
}
