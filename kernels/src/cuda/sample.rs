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

    /// Log-probabilities before the draw: for each row of `logits`
    /// (`rows x n`) whose slot `s` is not negative, writes at
    /// `out[s * (2 + 2 * top)]` the softmax's log denominator, then from
    /// `+ 2` the `top` most likely tokens as (id bits, log-probability)
    /// pairs, most likely first (`+ 1` is left for
    /// [`Gpu::chosen_logprobs_rows`]).
    pub fn top_logprobs_rows(
        &self,
        logits: &CudaSlice<f32>,
        (rows, n): (usize, usize),
        slot: &CudaView<'_, i32>,
        top: usize,
        out: &mut CudaSlice<f32>,
    ) -> R {
        if slot.len() < rows || logits.len() < rows * n {
            return Err(KernelError::Shape(format!(
                "log-probabilities of {rows} rows of {n}: inputs too short"
            )));
        }
        let f = self.function("top_logprobs_rows")?;
        let (ni, ti) = (n as i32, top as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(logits).arg(&ni).arg(slot).arg(&ti).arg(out);
        // SAFETY: one block per row; each slot names an entry of `out`
        // (the caller sizes it for the slots it gives), bounds checked above.
        unsafe { b.launch(cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Log-probabilities after the draw: each slotted row's drawn token
    /// (`picks`), from [`Gpu::top_logprobs_rows`]'s denominator.
    pub fn chosen_logprobs_rows(
        &self,
        logits: &CudaSlice<f32>,
        (rows, n): (usize, usize),
        picks: &CudaView<'_, u32>,
        slot: &CudaView<'_, i32>,
        top: usize,
        out: &mut CudaSlice<f32>,
    ) -> R {
        if slot.len() < rows || picks.len() < rows || logits.len() < rows * n {
            return Err(KernelError::Shape(format!(
                "drawn log-probabilities of {rows} rows: inputs too short"
            )));
        }
        let f = self.function("chosen_logprobs_rows")?;
        let (ni, ri, ti) = (n as i32, rows as i32, top as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(logits)
            .arg(&ni)
            .arg(&ri)
            .arg(picks)
            .arg(slot)
            .arg(&ti)
            .arg(out);
        // SAFETY: a thread per row, bounds checked above; picks are token
        // ids below n (the draw's).
        unsafe { b.launch(grid_1d((rows as u32).div_ceil(32), 32)) }.map_err(cuda_err)?;
        Ok(())
    }
}
