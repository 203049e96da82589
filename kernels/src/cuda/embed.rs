//! Embedding: rows of the token table by id, for bf16 tables (`embed.cu`)
//! and GGUF blocks (`embed_q*` in `quant.cu`).

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use half::bf16;

use super::launch::cfg;
use super::quant::kernel_suffix;
use super::{DeviceWeight, Gpu, cuda_err, grid_1d};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
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

    /// `out[t] = table[ids[t]]`, rows of `hidden`, for any [`DeviceWeight`].
    pub fn embed_rows(
        &self,
        table: &DeviceWeight,
        ids: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        hidden: usize,
    ) -> R {
        let (name, src) = match table {
            DeviceWeight::Bf16(t) => return self.embed(t, ids, out, tokens, hidden),
            DeviceWeight::Blocks { dtype, bytes } => {
                (format!("embed_{}", kernel_suffix(*dtype)?), bytes)
            }
            DeviceWeight::Fp8 { codes, scales } => {
                let h = hidden as i32;
                let mut b = self
                    .stream
                    .launch_builder(self.function("embed_fp8_packed")?);
                b.arg(codes).arg(scales).arg(ids).arg(out).arg(&h);
                // SAFETY: ids are checked against the vocabulary by the caller.
                unsafe { b.launch(grid_1d(tokens as u32, 256)) }.map_err(cuda_err)?;
                return Ok(());
            }
            DeviceWeight::Int4 { group, rows, bytes } => {
                let (n, h, g) = (*rows as i32, hidden as i32, *group as i32);
                let mut b = self.stream.launch_builder(self.function("embed_int4")?);
                b.arg(bytes).arg(ids).arg(out).arg(&n).arg(&h).arg(&g);
                // SAFETY: ids are checked against the vocabulary by the caller.
                unsafe { b.launch(grid_1d(tokens as u32, 256)) }.map_err(cuda_err)?;
                return Ok(());
            }
        };
        let f = self.function(&name)?;
        let h = hidden as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(src).arg(ids).arg(out).arg(&h);
        // SAFETY: ids are checked against the vocabulary by the caller.
        unsafe { b.launch(grid_1d(tokens as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }
}
