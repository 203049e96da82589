//! Activations for the FP8 W8A8 GEMM (`fp8_act.cu`): rows quantized to
//! e4m3 with a scale per row, from f32 or from the bf16 activations a bf16
//! GEMM would read, and straight from the norm and SiLU-and-multiply.

use cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
use half::bf16;

use super::{Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// An activation type the quantizer reads: f32, or bf16 from a GEMM's
/// scratch.
pub trait Fp8Input: DeviceRepr {
    /// The kernel that quantizes rows of this type.
    const KERNEL: &'static str;
}

impl Fp8Input for f32 {
    const KERNEL: &'static str = "quant_rows_e4m3";
}

impl Fp8Input for bf16 {
    const KERNEL: &'static str = "quant_rows_e4m3_bf16";
}

impl Gpu {
    /// Quantizes `m` rows of `k` activations to e4m3 with a scale per row
    /// (what `fp8::encode` does to each row, after widening bf16 to f32).
    pub fn quantize_rows_e4m3<T: Fp8Input>(
        &self,
        x: &CudaSlice<T>,
        q: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<f32>,
        m: usize,
        k: usize,
    ) -> R {
        if x.len() < m * k || q.len() < m * k || scales.len() < m {
            return Err(KernelError::Shape(format!(
                "quantizing {m} rows of {k}: buffers too small"
            )));
        }
        let ki = k as i32;
        let mut b = self.stream.launch_builder(self.function(T::KERNEL)?);
        b.arg(x).arg(q).arg(scales).arg(&ki);
        // SAFETY: one block per row, sizes checked above.
        unsafe { b.launch(cfg(m as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `silu(gate) * up` of `rows` rows of a gate/up product `gu` (`2 f`
    /// bf16 each, gate then up) as e4m3 codes with a scale per row: the
    /// codes [`Self::silu_mul_pairs`] then [`Self::quantize_rows_e4m3`]
    /// give, without the bf16 rows between them (`f` a multiple of 8).
    pub fn silu_mul_pairs_e4m3(
        &self,
        gu: &CudaSlice<bf16>,
        q: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<f32>,
        rows: usize,
        f: usize,
    ) -> R {
        if !f.is_multiple_of(8)
            || gu.len() < 2 * rows * f
            || q.len() < rows * f
            || scales.len() < rows
        {
            return Err(KernelError::Shape(format!(
                "silu-mul pairs of {rows} rows of 2 x {f} into e4m3: widths of whole 8s and \
                 buffers that hold them"
            )));
        }
        let fi = f as i32;
        let mut b = self
            .stream
            .launch_builder(self.function("silu_mul_pairs_e4m3")?);
        b.arg(gu).arg(q).arg(scales).arg(&fi);
        // A few rows (decode) are the whole launch: twice the threads a row.
        let threads = if rows <= super::E4M3_MMA_MAX_M {
            512
        } else {
            256
        };
        // SAFETY: one block per row (of at most 512 threads, the kernel's
        // bound), sizes checked above.
        unsafe { b.launch(cfg(rows as u32, threads)) }.map_err(cuda_err)?;
        Ok(())
    }
}
