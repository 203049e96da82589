//! SiLU-and-multiply (`act.cu`), in place or straight into a bf16 GEMM's
//! input, from f32 or from a bf16 gate/up product, and the down projection
//! that reads it.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::cublas::room;
use super::launch::{blocks, cfg};
use super::shape::{GemmShape, StackShape};
use super::{DeviceWeight, GemmScratch, Gpu, cuda_err};
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

    /// The down projection from a gate/up product: `out (m x n) =
    /// (silu(gate) * up) * w^T`, `gu` holding `m` rows of gate then up (`k`
    /// each, bf16) as one GEMM over the stacked weights writes them, for a
    /// `w` that [takes bf16 input](Self::takes_bf16_input) at `m x k`. FP8
    /// rows get the activation as e4m3 in the same pass that makes it.
    pub fn down_from_pairs(
        &self,
        gu: &CudaSlice<bf16>,
        w: &DeviceWeight,
        out: &mut CudaSlice<f32>,
        shape: GemmShape,
        scratch: &mut GemmScratch,
    ) -> R {
        let GemmShape { m, n, k } = shape;
        let stack = StackShape { m, parts: &[n], k };
        if let Some(w8) = self.fp8_stack(w, m, k) {
            let fp8 = scratch
                .fp8
                .as_mut()
                .ok_or_else(super::cublas::no_fp8_scratch)?;
            self.silu_mul_pairs_e4m3(gu, &mut fp8.xq, &mut fp8.xs, m, k)?;
            return self.gemm_fp8_quantized(w8, &mut [out], stack, fp8);
        }
        self.silu_mul_pairs(gu, scratch, m, k)?;
        self.matmul_parts_bf16(w, &mut [out], stack, scratch)
    }
}
