//! Weight matrices on the device: bf16 rows, or GGUF blocks kept as they
//! are and dequantized inside the kernels. A quantized model so computes
//! what the CPU computes (f32 weights, f32 sums) from a quarter of the
//! bytes: decode GEMVs read the blocks directly; larger batches dequantize
//! a bounded chunk of rows at a time into f32 for a cuBLAS f32 GEMM.

use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};
use half::bf16;
use rayon::prelude::*;

use super::{Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;
use crate::matmul::Weight;
use crate::quant::DType;

type R<T = ()> = Result<T, KernelError>;

/// Elements dequantized at once on the GEMM path (64 MiB of f32).
pub const DEQUANT_CHUNK: usize = 1 << 24;

/// A weight matrix (`rows x cols`, row-major) on the device.
pub enum DeviceWeight {
    /// bf16 rows (models stored in f32, f16 or bf16).
    Bf16(CudaSlice<bf16>),
    /// GGUF Q8_0, Q4_0 or Q4_1 blocks as stored.
    Blocks {
        /// The block type.
        dtype: DType,
        /// The blocks, row after row.
        bytes: CudaSlice<u8>,
    },
}

impl DeviceWeight {
    /// Bytes on the device.
    pub fn size_bytes(&self) -> usize {
        match self {
            DeviceWeight::Bf16(w) => w.len() * 2,
            DeviceWeight::Blocks { bytes, .. } => bytes.len(),
        }
    }
}

/// Working memory of [`Gpu::matmul`]: bf16 activations for cuBLAS and, for
/// block weights, the dequantized chunk.
pub struct GemmScratch {
    act: CudaSlice<bf16>,
    deq: Option<CudaSlice<f32>>,
}

fn kernel_suffix(dtype: DType) -> R<&'static str> {
    match dtype {
        DType::Q8_0 => Ok("q8_0"),
        DType::Q4_0 => Ok("q4_0"),
        DType::Q4_1 => Ok("q4_1"),
        other => Err(KernelError::UnsupportedType(format!(
            "{other:?} blocks on CUDA"
        ))),
    }
}

impl Gpu {
    /// Uploads `w`: block types as they are, anything else as bf16.
    pub fn weight(&self, w: &Weight) -> R<DeviceWeight> {
        if let (Ok(_), Some(bytes)) = (kernel_suffix(w.dtype()), w.bytes()) {
            return Ok(DeviceWeight::Blocks {
                dtype: w.dtype(),
                bytes: self.upload(bytes)?,
            });
        }
        let cols = w.cols();
        let mut host = vec![bf16::ZERO; w.rows() * cols];
        host.par_chunks_mut(cols).enumerate().for_each(|(r, out)| {
            let mut row = vec![0.0f32; cols];
            w.row(r, &mut row);
            out.iter_mut()
                .zip(&row)
                .for_each(|(o, v)| *o = bf16::from_f32(*v));
        });
        Ok(DeviceWeight::Bf16(self.upload(&host)?))
    }

    /// Scratch for products of up to `m x k` activations; `blocks` when
    /// any weight is block-quantized.
    pub fn gemm_scratch(&self, m: usize, k: usize, blocks: bool) -> R<GemmScratch> {
        Ok(GemmScratch {
            act: self.zeros(m * k)?,
            deq: blocks.then(|| self.zeros(DEQUANT_CHUNK)).transpose()?,
        })
    }

    /// `out (m x n) = x (m x k) * w^T` for any [`DeviceWeight`].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceWeight,
        out: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        scratch: &mut GemmScratch,
    ) -> R {
        match w {
            DeviceWeight::Bf16(w) => self.matmul_bf16(x, w, out, m, n, k, &mut scratch.act),
            DeviceWeight::Blocks { dtype, bytes } => {
                if !k.is_multiple_of(32) {
                    return Err(KernelError::Shape(format!(
                        "{dtype:?} rows of {k}: a multiple of 32"
                    )));
                }
                if m <= 8 {
                    let f = self.function(&format!("gemv_{}", kernel_suffix(*dtype)?))?;
                    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
                    let mut b = self.stream.launch_builder(f);
                    b.arg(x)
                        .arg(bytes)
                        .arg(&mut *out)
                        .arg(&mi)
                        .arg(&ni)
                        .arg(&ki);
                    // SAFETY: one warp per output row, 8 per block; rows are
                    // whole blocks (checked above).
                    unsafe { b.launch(cfg(n.div_ceil(8) as u32, 256)) }.map_err(cuda_err)?;
                    return Ok(());
                }
                let deq = scratch.deq.as_mut().ok_or_else(|| {
                    KernelError::Shape("no dequantization scratch for a block weight".into())
                })?;
                let row_bytes = dtype.bytes_for(k);
                let rows_per_chunk = (DEQUANT_CHUNK / k).max(1);
                let mut r0 = 0;
                while r0 < n {
                    let r1 = (r0 + rows_per_chunk).min(n);
                    let src = bytes.slice(r0 * row_bytes..r1 * row_bytes);
                    self.dequantize_view(*dtype, &src, deq, (r1 - r0) * k)?;
                    self.gemm_f32(x, deq, out, m, n, k, r0, r1 - r0)?;
                    r0 = r1;
                }
                Ok(())
            }
        }
    }

    /// `out[:, r0..r0 + rows] = x * w^T` with f32 `w` (`rows x k`), by
    /// cuBLAS in full f32.
    #[allow(clippy::too_many_arguments)]
    fn gemm_f32(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        r0: usize,
        rows: usize,
    ) -> R {
        let (a, _ra) = w.device_ptr(&self.stream);
        let (bp, _rb) = x.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr(&self.stream);
        // This chunk is columns r0.. of the row-major output.
        let c = c + (r0 * std::mem::size_of::<f32>()) as u64;
        let f32_ty = cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
        // SAFETY: live device buffers of the stated sizes (guards held).
        unsafe { self.gemm(a, bp, f32_ty, c, m, rows, k, n) }
    }

    /// `out[t] = table[ids[t]]`, rows of `hidden`, for any [`DeviceWeight`].
    pub fn embed_rows(
        &self,
        table: &DeviceWeight,
        ids: &cudarc::driver::CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        hidden: usize,
    ) -> R {
        let (name, src) = match table {
            DeviceWeight::Bf16(t) => return self.embed(t, ids, out, tokens, hidden),
            DeviceWeight::Blocks { dtype, bytes } => {
                (format!("embed_{}", kernel_suffix(*dtype)?), bytes)
            }
        };
        let f = self.function(&name)?;
        let h = hidden as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(src).arg(ids).arg(out).arg(&h);
        // SAFETY: ids are checked against the vocabulary by the caller.
        unsafe { b.launch(cfg(tokens as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Dequantizes `n` elements of GGUF blocks to f32.
    pub fn dequantize(
        &self,
        dtype: DType,
        src: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        n: usize,
    ) -> R {
        self.dequantize_view(dtype, &src.slice(..), out, n)
    }

    fn dequantize_view(
        &self,
        dtype: DType,
        src: &cudarc::driver::CudaView<'_, u8>,
        out: &mut CudaSlice<f32>,
        n: usize,
    ) -> R {
        if out.len() < n || src.len() < dtype.bytes_for(n) {
            return Err(KernelError::Shape(format!(
                "dequantizing {n} elements of {dtype:?}: buffers too small"
            )));
        }
        let f = self.function(&format!("dequant_{}", kernel_suffix(dtype)?))?;
        let total = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(src).arg(out).arg(&total);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { b.launch(cfg(n.div_ceil(256) as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }
}
