//! Row-wise helpers of a step (`convert.cu`): the q/k/v biases, and the
//! rows a step keeps for its logits.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};

use super::launch::{blocks, cfg};
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
    /// `x[r] += b` for every row of `cols`.
    pub fn add_bias(
        &self,
        x: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> R {
        let f = self.function("add_bias")?;
        let (n, c) = ((rows * cols) as i64, cols as i32);
        let mut l = self.stream.launch_builder(f);
        l.arg(x).arg(b).arg(&n).arg(&c);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { l.launch(cfg((blocks(rows * cols, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out[i] = src[idx[i]]`, rows of `cols`.
    pub fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        idx: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> R {
        let f = self.function("gather_rows")?;
        let c = cols as i32;
        let mut l = self.stream.launch_builder(f);
        l.arg(src).arg(idx).arg(out).arg(&c);
        // SAFETY: indices are rows of `src`.
        unsafe { l.launch(cfg((rows as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
