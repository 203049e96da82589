//! SiLU-and-multiply (`act.cu`), in place or straight into a bf16 GEMM's
//! input, from f32 or from a bf16 gate/up product.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::cublas::room;
use super::launch::{blocks, cfg};
use super::{GemmScratch, Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
    /// `gate = silu(gate) * up` over `n` elements.
    pub fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) -> R {
        let f = self.function("silu_mul")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(gate).arg(up).arg(&null).arg(&n_i);
        // SAFETY: one thread per four elements, bounds-checked.
        unsafe { b.launch(cfg((blocks(n.div_ceil(4), 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `silu(gate) * up` over `n` elements, rounded to bf16 into `scratch`
    /// (`gate` is left as it was).
    pub fn silu_mul_bf16(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        scratch: &mut GemmScratch,
        n: usize,
    ) -> R {
        room(scratch, n)?;
        if gate.len() < n || up.len() < n {
            return Err(KernelError::Shape(format!(
                "silu-mul of {n} elements: inputs too small"
            )));
        }
        let f = self.function("silu_mul")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(gate).arg(up).arg(&mut scratch.act).arg(&n_i);
        // SAFETY: one thread per four elements, bounds-checked; the kernel
        // only reads gate when it writes the scratch.
        unsafe { b.launch(cfg((blocks(n.div_ceil(4), 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `silu(gate) * up` into `scratch` as bf16 (the down projection's
    /// input) from `gu`: `rows` rows of `2 f` bf16, the gate's `f` columns
    /// then the up projection's, as one GEMM over the stacked gate/up
    /// weights writes them. `f` must be a multiple of 8.
    pub fn silu_mul_pairs(
        &self,
        gu: &CudaSlice<bf16>,
        scratch: &mut GemmScratch,
        rows: usize,
        f: usize,
    ) -> R {
        let n = rows * f;
        room(scratch, n)?;
        if !f.is_multiple_of(8) || gu.len() < 2 * n {
            return Err(KernelError::Shape(format!(
                "silu-mul pairs of {rows} rows of 2 x {f}: widths of whole 8s and a product that \
                 holds them"
            )));
        }
        let func = self.function("silu_mul_pairs")?;
        let (rows_i, f_i) = (rows as i32, f as i32);
        let mut b = self.stream.launch_builder(func);
        b.arg(gu).arg(&mut scratch.act).arg(&rows_i).arg(&f_i);
        // SAFETY: eight elements a thread, bounds-checked against rows x f
        // (a multiple of 8), reading rows x 2f.
        unsafe { b.launch(cfg((blocks(n / 8, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
