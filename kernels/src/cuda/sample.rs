//! Sampling on the device: temperature, top-k and top-p with the host's
//! uniform draw, and greedy argmax (see `sample.cu`), so a step need not
//! download logits.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::launch::cfg;
use super::{Gpu, cuda_err, grid_1d};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Threads per row (`SAMPLE_THREADS` in the source).
const THREADS: u32 = 1024;

impl Gpu {
    /// One token per row of `logits` (`rows x n`): `params` holds
    /// (temperature, top_p, uniform draw) per row, `top_k` one per row
    /// (0 = all); greedy rows get the argmax.
    pub fn sample_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        n: usize,
        params: &CudaView<'_, f32>,
        top_k: &CudaView<'_, i32>,
        out: &mut CudaViewMut<'_, u32>,
    ) -> Result<(), KernelError> {
        if params.len() < 3 * rows || top_k.len() < rows || logits.len() < rows * n {
            return Err(KernelError::Shape(format!(
                "sampling {rows} rows of {n}: inputs too short"
            )));
        }
        let f = self.function("sample_rows")?;
        let ni = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(logits).arg(&ni).arg(params).arg(top_k).arg(out);
        // SAFETY: one block per row, bounds checked above.
        unsafe { b.launch(grid_1d(rows as u32, THREADS)) }.map_err(cuda_err)?;
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

    /// Output formats: row `r` of `logits` (`rows x n`) keeps only the
    /// tokens mask `slot[r]` of `masks` (`words` bitmask words each, bit
    /// `v % 32` of word `v / 32` for token `v`) allows; rows whose slot is
    /// negative are left alone.
    pub fn mask_rows(
        &self,
        logits: &mut CudaSlice<f32>,
        (rows, n): (usize, usize),
        masks: &CudaView<'_, u32>,
        words: usize,
        slot: &CudaView<'_, i32>,
    ) -> R {
        if slot.len() < rows || logits.len() < rows * n || words == 0 {
            return Err(KernelError::Shape(format!(
                "masking {rows} rows of {n}: inputs too short"
            )));
        }
        let f = self.function("mask_rows")?;
        let (ni, wi) = (n as i32, words as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(logits).arg(&ni).arg(masks).arg(&wi).arg(slot);
        // SAFETY: one block per row; each slot names a mask of `words`
        // words within `masks` (the caller's layout), bounds checked above.
        unsafe { b.launch(cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
