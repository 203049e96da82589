//! Weight matrices on the device: bf16 rows, GGUF blocks or FP8 rows kept
//! as they are and dequantized inside the kernels, or int4 groups in the
//! tiles of `int4.rs`. Decode GEMVs read them directly. Larger batches
//! dequantize a bounded chunk of rows at a time: GGUF blocks into f32 for a
//! cuBLAS f32 GEMM (so a GGUF model computes what the CPU computes), FP8
//! rows and int4 into bf16 for cuBLAS on tensor cores (they are serving
//! formats, held to their accuracy against bf16 weights).

use std::borrow::Cow;

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;
use rayon::prelude::*;

use super::{Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;
use crate::matmul::Weight;
use crate::quant::{DType, fp8_rows_packed};

type R<T = ()> = Result<T, KernelError>;

/// Elements dequantized at once on the GEMM path (64 MiB of f32).
pub const DEQUANT_CHUNK: usize = 1 << 24;

/// A weight matrix (`rows x cols`, row-major) on the device.
pub enum DeviceWeight {
    /// bf16 rows (models stored in f32, f16 or bf16).
    Bf16(CudaSlice<bf16>),
    /// GGUF Q8_0, Q4_0 or Q4_1 blocks, or FP8 rows where FP8 tensor cores
    /// do not read them (before sm_90, or rows not of whole 16-byte
    /// pieces), as stored.
    Blocks {
        /// The block type.
        dtype: DType,
        /// The blocks, row after row.
        bytes: CudaSlice<u8>,
    },
    /// FP8 rows as FP8 tensor cores read them (sm_90 and up): the e4m3
    /// codes of each row, packed without their headers (cuBLASLt's FP8
    /// GEMMs ran 5-10% faster on rows that start on whole lines), and the
    /// rows' scales as one vector (as cuBLASLt takes them).
    Fp8 {
        /// `rows x k` e4m3 codes.
        codes: CudaSlice<u8>,
        /// One scale a row.
        scales: CudaSlice<f32>,
    },
    /// Int4 groups in the device's tiles ([`super::int4_tiles`]).
    Int4 {
        /// Weights per group (64 or 128).
        group: usize,
        /// Rows of the whole matrix (or stack).
        rows: usize,
        /// The tiles, then the groups' scales and offsets.
        bytes: CudaSlice<u8>,
    },
}

impl DeviceWeight {
    /// Bytes of the weight's rows on the device (what row counts divide).
    pub fn size_bytes(&self) -> usize {
        match self {
            DeviceWeight::Bf16(w) => w.len() * 2,
            DeviceWeight::Blocks { bytes, .. } | DeviceWeight::Int4 { bytes, .. } => bytes.len(),
            DeviceWeight::Fp8 { codes, scales } => codes.len() + 4 * scales.len(),
        }
    }

    /// Whether products above the decode GEMVs dequantize this weight
    /// (into the scratch's chunk buffers).
    pub fn dequantizes(&self) -> bool {
        !matches!(self, DeviceWeight::Bf16(_))
    }

    /// Bytes of one row of `cols` values.
    pub fn row_bytes(&self, cols: usize) -> R<usize> {
        match self {
            DeviceWeight::Bf16(_) => Ok(2 * cols),
            DeviceWeight::Blocks { dtype, .. } => {
                if cols.is_multiple_of(32) {
                    Ok(dtype.bytes_for(cols))
                } else {
                    Err(KernelError::Shape(format!(
                        "{dtype:?} rows of {cols}: a multiple of 32"
                    )))
                }
            }
            DeviceWeight::Int4 { group, .. } => Ok(super::int4_device_bytes(1, cols, *group)),
            // The codes and the row's scale.
            DeviceWeight::Fp8 { .. } => Ok(cols + 4),
        }
    }
}

/// Working memory of [`Gpu::matmul`]: bf16 activations for cuBLAS (or the
/// int4 kernels' activation fragments), for weights that dequantize the
/// dequantized chunk (f32 for GGUF blocks, bf16 for FP8 rows and int4), and
/// FP8 rows' quantized activations.
pub struct GemmScratch {
    pub(super) act: CudaSlice<bf16>,
    pub(super) deq: Option<CudaSlice<f32>>,
    pub(super) deq16: Option<CudaSlice<bf16>>,
    pub(super) fp8: Option<super::fp8_gemm::Fp8Scratch>,
}

impl GemmScratch {
    /// The bf16 activations the last bf16 GEMM read (or a kernel wrote for
    /// the next one).
    pub fn activations(&self) -> &CudaSlice<bf16> {
        &self.act
    }

    /// The bf16 activations, for a kernel that writes the next GEMM's
    /// input itself; at least `len` of them.
    pub fn activations_mut(&mut self, len: usize) -> Result<&mut CudaSlice<bf16>, KernelError> {
        super::cublas::room(self, len)?;
        Ok(&mut self.act)
    }

    /// Whether it holds the scratch of weights that dequantize (made with
    /// `blocks`).
    pub fn dequantizes(&self) -> bool {
        self.deq.is_some()
    }
}

pub(super) fn kernel_suffix(dtype: DType) -> R<&'static str> {
    match dtype {
        DType::Q8_0 => Ok("q8_0"),
        DType::Q4_0 => Ok("q4_0"),
        DType::Q4_1 => Ok("q4_1"),
        DType::Fp8Row => Ok("fp8row"),
        other => Err(KernelError::UnsupportedType(format!(
            "{other:?} blocks on CUDA"
        ))),
    }
}

/// `w` as blocks a kernel reads: GGUF blocks and FP8 rows as stored, int4
/// groups whose shape does not tile repacked as Q4_1 blocks of the same
/// values (5 bits a weight); `None` for float types.
fn device_blocks(w: &Weight) -> Option<(DType, Cow<'_, [u8]>)> {
    let bytes = w.bytes()?;
    if let Some(q41) = crate::quant::int4_as_q4_1(w.dtype(), bytes) {
        return Some((DType::Q4_1, Cow::Owned(q41)));
    }
    kernel_suffix(w.dtype())
        .ok()
        .map(|_| (w.dtype(), Cow::Borrowed(bytes)))
}

/// `w`'s values rounded to bf16, row-major.
fn bf16_rows(w: &Weight) -> Vec<bf16> {
    if let (DType::BF16, Some(bytes)) = (w.dtype(), w.bytes()) {
        return bytes
            .par_chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
            .collect();
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
    host
}

impl Gpu {
    /// Int4 rows `bytes` (`rows x cols`) in the device's tiles, when their
    /// shape tiles.
    fn int4_weight(
        &self,
        dtype: DType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> R<Option<DeviceWeight>> {
        let (Some(group), Some(tiles)) = (
            dtype.int4_group(),
            super::int4_tiles(dtype, bytes, rows, cols),
        ) else {
            return Ok(None);
        };
        Ok(Some(DeviceWeight::Int4 {
            group,
            rows,
            bytes: self.upload(&tiles)?,
        }))
    }

    /// `rows` rows of `k` of block type `dtype` on the device: FP8 rows
    /// split into codes and scales where FP8 tensor cores will read them,
    /// anything else as stored.
    fn blocks(&self, dtype: DType, host: &[u8], rows: usize, k: usize) -> R<DeviceWeight> {
        if dtype != DType::Fp8Row || !self.fp8_tensor || !k.is_multiple_of(16) {
            return Ok(DeviceWeight::Blocks {
                dtype,
                bytes: self.upload(host)?,
            });
        }
        let (codes, scales) = fp8_rows_packed(host, k)
            .filter(|(_, s)| s.len() == rows)
            .ok_or_else(|| {
                KernelError::Shape(format!(
                    "{} bytes of FP8 rows are not {rows} rows of {k}",
                    host.len()
                ))
            })?;
        Ok(DeviceWeight::Fp8 {
            codes: self.upload(&codes)?,
            scales: self.upload(&scales)?,
        })
    }

    /// Uploads `w`: int4 in tiles where its shape tiles, other block types
    /// as they are, anything else as bf16.
    pub fn weight(&self, w: &Weight) -> R<DeviceWeight> {
        if let Some(bytes) = w.bytes()
            && let Some(dw) = self.int4_weight(w.dtype(), bytes, w.rows(), w.cols())?
        {
            return Ok(dw);
        }
        if let Some((dtype, bytes)) = device_blocks(w) {
            return self.blocks(dtype, &bytes, w.rows(), w.cols());
        }
        Ok(DeviceWeight::Bf16(self.upload(&bf16_rows(w))?))
    }

    /// Uploads `ws` stacked row block after row block, for
    /// [`Gpu::matmul_parts`]: blocks as they are when all share one block
    /// type, bf16 when none is a block type; `None` when they mix types or
    /// widths (the caller keeps them apart then).
    pub fn weight_stack(&self, ws: &[&Weight]) -> R<Option<DeviceWeight>> {
        let Some(first) = ws.first() else {
            return Ok(None);
        };
        if ws.iter().any(|w| w.cols() != first.cols()) {
            return Ok(None);
        }
        // Int4 tiles when every part is whole strips of 16 rows (the GEMM
        // path dequantizes strips).
        let strips = ws.iter().all(|w| w.rows().is_multiple_of(16));
        let int4 = first.dtype().int4_group().is_some();
        if strips && int4 && ws.iter().all(|w| w.dtype() == first.dtype()) {
            let bytes: Vec<u8> = ws
                .iter()
                .flat_map(|w| w.bytes().unwrap_or(&[]).iter().copied())
                .collect();
            let rows = ws.iter().map(|w| w.rows()).sum();
            if let Some(dw) = self.int4_weight(first.dtype(), &bytes, rows, first.cols())? {
                return Ok(Some(dw));
            }
        }
        let blocks: Vec<Option<(DType, Cow<'_, [u8]>)>> =
            ws.iter().map(|w| device_blocks(w)).collect();
        if blocks.iter().all(Option::is_some) {
            let dtype = blocks[0].as_ref().map(|b| b.0);
            if blocks.iter().any(|b| b.as_ref().map(|b| b.0) != dtype) {
                return Ok(None);
            }
            let bytes: Vec<u8> = blocks
                .iter()
                .flatten()
                .flat_map(|(_, b)| b.iter().copied())
                .collect();
            let rows = ws.iter().map(|w| w.rows()).sum();
            let dtype = dtype.unwrap_or(first.dtype());
            return self.blocks(dtype, &bytes, rows, first.cols()).map(Some);
        }
        if blocks.iter().any(Option::is_some) {
            return Ok(None);
        }
        let host: Vec<bf16> = ws.iter().flat_map(|w| bf16_rows(w)).collect();
        Ok(Some(DeviceWeight::Bf16(self.upload(&host)?)))
    }

    /// Scratch for products of up to `m x k` activations (and the int4
    /// kernels' fragments of up to 64 rows); `blocks` when any weight
    /// [dequantizes](DeviceWeight::dequantizes).
    pub fn gemm_scratch(&self, m: usize, k: usize, blocks: bool) -> R<GemmScratch> {
        // The int4 kernels' fragments: 2 m k bf16 and the groups' f32 sums.
        let frag = m.clamp(super::GEMV_MAX_M, super::INT4_MMA_MAX_M);
        let act = (m * k).max(2 * frag * k + 2 * frag * k.div_ceil(64));
        Ok(GemmScratch {
            act: self.zeros(act)?,
            deq: blocks.then(|| self.zeros(DEQUANT_CHUNK)).transpose()?,
            deq16: blocks.then(|| self.zeros(DEQUANT_CHUNK)).transpose()?,
            fp8: blocks.then(|| self.fp8_scratch(m, k)).transpose()?,
        })
    }

    /// Dequantizes `n` elements of GGUF blocks to f32.
    ///
    /// Reference path: the engine's step dequantizes inside
    /// [`Self::matmul_parts`]; kept for the parity tests of the block
    /// formats.
    pub fn dequantize(
        &self,
        dtype: DType,
        src: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        n: usize,
    ) -> R {
        self.dequantize_rows(dtype, &src.slice(..), out, 1, n)
    }

    /// Dequantizes `rows` FP8 rows of `k` (a multiple of 16) to bf16, a
    /// thread per 16 weights.
    pub(super) fn dequantize_fp8_bf16(
        &self,
        src: &cudarc::driver::CudaView<'_, u8>,
        out: &mut CudaSlice<bf16>,
        rows: usize,
        k: usize,
    ) -> R {
        let n = rows * k;
        if out.len() < n || src.len() < rows * DType::Fp8Row.bytes_for(k) || !k.is_multiple_of(16) {
            return Err(KernelError::Shape(format!(
                "dequantizing {rows} FP8 rows of {k}: buffers too small or k not a multiple of 16"
            )));
        }
        let pieces = n / 16;
        let (total, ki) = (pieces as i64, k as i32);
        let mut b = self
            .stream
            .launch_builder(self.function("dequant_fp8row_bf16")?);
        b.arg(src).arg(out).arg(&total).arg(&ki);
        // SAFETY: one thread per 16 weights, bounds-checked.
        unsafe { b.launch(cfg(pieces.div_ceil(256) as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Dequantizes `rows` rows of `k` elements of `dtype` to f32, one
    /// thread an element (the kernels of FP8 rows need the row length to
    /// find each row's scale; those of blocks do not use it).
    pub(super) fn dequantize_rows(
        &self,
        dtype: DType,
        src: &cudarc::driver::CudaView<'_, u8>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        k: usize,
    ) -> R {
        let n = rows * k;
        if out.len() < n || src.len() < rows * dtype.bytes_for(k) {
            return Err(KernelError::Shape(format!(
                "dequantizing {rows} rows of {k} of {dtype:?}: buffers too small"
            )));
        }
        let f = self.function(&format!("dequant_{}", kernel_suffix(dtype)?))?;
        let (total, ki) = (n as i64, k as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(src).arg(out).arg(&total).arg(&ki);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { b.launch(cfg(n.div_ceil(256) as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }
}
