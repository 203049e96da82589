//! The Walsh-Hadamard rotation of heads on the device (`hadamard.cu`).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::launch::cfg;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
    /// Rotates each of `rows` rows of `head_dim` (a power of two up to
    /// 1024) of `x` in place by the orthonormal Walsh-Hadamard transform,
    /// in [`crate::hadamard::rotate`]'s order and with the device function
    /// `rope_kv_write` uses for static fp8 pages.
    ///
    /// Reference path: the engine's step rotates inside
    /// [`Self::rope_kv_write`]; kept for the test of that rotation.
    pub fn hadamard_rows(&self, x: &mut CudaSlice<f32>, rows: usize, head_dim: usize) -> R {
        if !head_dim.is_power_of_two() || head_dim > 1024 || x.len() < rows * head_dim {
            return Err(KernelError::Shape(format!(
                "hadamard over {rows} rows of {head_dim}: a power of two up to 1024, in a buffer \
                 of {}",
                x.len()
            )));
        }
        let f = self.function("hadamard_rows")?;
        let d = head_dim as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&d);
        // SAFETY: rows x head_dim floats (checked above), a thread each.
        unsafe { b.launch(cfg((rows as u32, 1, 1), head_dim as u32, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
