//! Sampling on the device: temperature, top-k and top-p with the host's
//! uniform draw (see `sample.cu`), so a step need not download logits.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::{Gpu, cuda_err, grid_1d};
use crate::KernelError;

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
}
