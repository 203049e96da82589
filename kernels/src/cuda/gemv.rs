//! Products with weight matrices on the device, stacked or not: the GEMVs
//! of `gemv.cu` and `quant.cu` for decode batches, cuBLAS above them.
//!
//! A stacked weight holds several matrices of one input width, row blocks
//! one under the other (q, k and v; gate and up). A decode GEMV streams the
//! whole stack in one launch and sends each row block to its own output; a
//! GEMM runs once per block on that block's rows.

use cudarc::driver::{CudaSlice, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::quant::{DEQUANT_CHUNK, kernel_suffix};
use super::shape::{GEMV_MAX_M, GemmShape, OutPtrs, StackShape, check_parts};
use super::{DeviceWeight, GemmScratch, Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

const F32: cudarc::cublas::sys::cudaDataType_t = cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
const BF16: cudarc::cublas::sys::cudaDataType_t = cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;

fn no_chunk() -> KernelError {
    KernelError::Shape("no dequantization scratch for a quantized weight".into())
}

/// Weight rows (warps) per block of the bf16 GEMV.
const BF16_ROWS_PER_BLOCK: usize = 4;

impl Gpu {
    /// `outs[i] (m x parts[i]) = x (m x k) * w_i^T`, where `w` stacks the
    /// `w_i` (`parts[i] x k` each) row block after row block.
    pub fn matmul_parts(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceWeight,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
        scratch: &mut GemmScratch,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = check_parts(outs, parts, m)?;
        if x.len() < m * k || w.size_bytes() < w.row_bytes(k)? * n {
            return Err(KernelError::Shape(format!(
                "{m} x {k} times {n} stacked rows: input or weight too small"
            )));
        }
        match w {
            DeviceWeight::Bf16(wb) if !self.takes_bf16_input(w, m, k) => {
                self.gemv_bf16_parts(x, wb, outs, shape)
            }
            DeviceWeight::Bf16(_) => {
                self.to_bf16_scratch(x, &mut scratch.act, m * k)?;
                self.matmul_parts_bf16(w, outs, shape, scratch)
            }
            DeviceWeight::Fp8 { codes, scales } => {
                let fp8_scratch = scratch.fp8.as_mut().ok_or_else(no_chunk)?;
                let w = super::fp8_gemm::Fp8Rows { codes, scales };
                self.gemm_fp8_parts(x, w, outs, shape, fp8_scratch)
            }
            DeviceWeight::Blocks { dtype, bytes } => {
                if !k.is_multiple_of(32) {
                    return Err(KernelError::Shape(format!(
                        "{dtype:?} rows of {k}: a multiple of 32"
                    )));
                }
                let fp8 = *dtype == crate::quant::DType::Fp8Row;
                if m <= GEMV_MAX_M {
                    // One FP8 row has its own entry point (fewer registers,
                    // one wave).
                    let one = if fp8 && m == 1 { "_1" } else { "" };
                    let f = self.function(&format!("gemv_{}{one}", kernel_suffix(*dtype)?))?;
                    let o = self.out_ptrs(outs, parts);
                    let (mi, ki) = (m as i32, k as i32);
                    let mut b = self.stream.launch_builder(f);
                    b.arg(x).arg(bytes);
                    b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
                    b.arg(&o.n0).arg(&o.n1).arg(&mi).arg(&o.n).arg(&ki);
                    // SAFETY: one warp per stacked row, 8 per block; rows are
                    // whole blocks and every part's output is big enough
                    // (checked above).
                    unsafe { b.launch(cfg(n.div_ceil(8) as u32, 256)) }.map_err(cuda_err)?;
                    return Ok(());
                }
                let row_bytes = dtype.bytes_for(k);
                let rows_of =
                    |r0: usize, rows: usize| bytes.slice(r0 * row_bytes..(r0 + rows) * row_bytes);
                if fp8 {
                    return self.gemm_dequantized(x, outs, shape, scratch, |gpu, deq, r0, rows| {
                        gpu.dequantize_fp8_bf16(&rows_of(r0, rows), deq, rows, k)
                    });
                }
                // GGUF blocks: f32 chunks and an f32 GEMM, as the CPU computes.
                let deq = scratch.deq.as_mut().ok_or_else(no_chunk)?;
                self.gemm_chunked(x, deq, F32, outs, shape, |gpu, deq, r0, rows| {
                    gpu.dequantize_rows(*dtype, &rows_of(r0, rows), deq, rows, k)
                })
            }
            DeviceWeight::Int4 { group, rows, bytes } => {
                if *rows != n {
                    return Err(KernelError::Shape(format!(
                        "an int4 stack of {rows} rows for {n} outputs"
                    )));
                }
                if m <= super::INT4_MMA_MAX_M {
                    return self.gemv_int4(x, bytes, *group, outs, shape, scratch);
                }
                let view = bytes.slice(..);
                self.gemm_dequantized(x, outs, shape, scratch, |gpu, deq, r0, len| {
                    gpu.dequantize_int4_bf16(&view, deq, (n, k, *group), r0, len)
                })
            }
        }
    }

    /// The GEMM path of weights that dequantize to bf16: `x` to bf16 once,
    /// then [`Self::gemm_chunked`] on bf16 chunks.
    fn gemm_dequantized(
        &self,
        x: &CudaSlice<f32>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
        scratch: &mut GemmScratch,
        deq: impl FnMut(&Self, &mut CudaSlice<bf16>, usize, usize) -> R,
    ) -> R {
        self.to_bf16_scratch(x, &mut scratch.act, shape.m * shape.k)?;
        let GemmScratch { act, deq16, .. } = scratch;
        let chunk = deq16.as_mut().ok_or_else(no_chunk)?;
        self.gemm_chunked(act, chunk, BF16, outs, shape, deq)
    }

    /// For each part of a stack, chunks of its rows dequantized into
    /// `chunk` by `deq(gpu, chunk, first stack row, rows)`, each multiplied
    /// by cuBLAS with `x` (both of type `ty`). Chunks are whole strips of 16
    /// rows (int4 dequantizes by strips).
    fn gemm_chunked<T: cudarc::driver::DeviceRepr>(
        &self,
        x: &CudaSlice<T>,
        chunk: &mut CudaSlice<T>,
        ty: cudarc::cublas::sys::cudaDataType_t,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
        mut deq: impl FnMut(&Self, &mut CudaSlice<T>, usize, usize) -> R,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let rows_per_chunk = (DEQUANT_CHUNK / k / 16 * 16).max(16);
        let mut base = 0;
        for (o, &rows) in outs.iter_mut().zip(parts) {
            let mut r0 = 0;
            while r0 < rows {
                let r1 = (r0 + rows_per_chunk).min(rows);
                deq(self, chunk, base + r0, r1 - r0)?;
                self.gemm_cols(chunk, x, ty, o, GemmShape { m, n: rows, k }, r0..r1)?;
                r0 = r1;
            }
            base += rows;
        }
        Ok(())
    }

    /// `out (m x n) = x (m x k) * w^T` for any [`DeviceWeight`].
    pub fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceWeight,
        out: &mut CudaSlice<f32>,
        shape: GemmShape,
        scratch: &mut GemmScratch,
    ) -> R {
        let GemmShape { m, n, k } = shape;
        self.matmul_parts(x, w, &mut [out], StackShape { m, parts: &[n], k }, scratch)
    }

    /// The bf16 decode GEMV over a stack (`m <= 8` rows, `k` a multiple of
    /// 8): one warp per weight row, four 16-byte loads in flight per lane.
    pub fn gemv_bf16_parts(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = check_parts(outs, parts, m)?;
        if m > GEMV_MAX_M || !k.is_multiple_of(8) || x.len() < m * k || w.len() < n * k {
            return Err(KernelError::Shape(format!(
                "GEMV of {m} rows of {k} over {n} weight rows: at most {GEMV_MAX_M} rows, \
                 k a multiple of 8"
            )));
        }
        let f = self.function(&format!("gemv_bf16_{m}_u4"))?;
        let o = self.out_ptrs(outs, parts);
        let ki = k as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&o.n).arg(&ki);
        let grid = n.div_ceil(BF16_ROWS_PER_BLOCK) as u32;
        // SAFETY: one warp per weight row; sizes checked above.
        unsafe { b.launch(cfg(grid, 32 * BF16_ROWS_PER_BLOCK as u32)) }.map_err(cuda_err)?;
        Ok(())
    }

    pub(super) fn out_ptrs<T: cudarc::driver::DeviceRepr>(
        &self,
        outs: &mut [&mut CudaSlice<T>],
        parts: &[usize],
    ) -> OutPtrs {
        let mut ptrs = [0u64; 3];
        for (p, o) in ptrs.iter_mut().zip(outs.iter_mut()) {
            // The launch is queued on this same stream, so no guard is
            // needed past it.
            *p = o.device_ptr_mut(&self.stream).0;
        }
        OutPtrs {
            ptrs,
            n0: parts[0] as i32,
            n1: parts.get(1).copied().unwrap_or(0) as i32,
            n: parts.iter().sum::<usize>() as i32,
        }
    }
}
