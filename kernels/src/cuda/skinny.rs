//! Skinny bf16 GEMMs for decode batches of 2 to 64 rows (`skinny.cu`):
//! tensor-core MMAs that stream the weights once, every lane's fragments
//! whole 32-byte pieces of a row, against cuBLAS, whose tiles leave most of
//! the H200's SMs idle at these shapes (51-80% of copy bandwidth on 4096
//! and 14336 wide rows at 64 rows).
//!
//! The engine takes it for 2 to [`SKINNY_WINS_M`] rows ([`Gpu::set_skinny`],
//! `--cuda-skinny`), where it beat or matched cuBLAS on every shape on the
//! H200.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::shape::{StackShape, check_parts, row_blocks};
use super::{Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Most activation rows the skinny GEMM takes.
pub const SKINNY_MAX_M: usize = 64;

/// Most activation rows the engine's products give the skinny GEMM: at 2
/// to 8 rows it streams 86-107% of copy bandwidth on Llama-3-8B's four
/// shapes where cuBLAS reads 39-91%, at 16 rows 75-87% against 40-88%
/// (a layer's four products 10% faster); at 32 cuBLAS is faster on three
/// of the four (perf.md, 2026-12-02).
pub const SKINNY_WINS_M: usize = 16;

/// Weight rows a strip (an MMA's 16 rows).
const STRIP: usize = 16;

/// Warps a block (`SKINNY_WARPS` in `skinny.cu`).
const WARPS: u32 = 8;

/// Checks a tensor-core GEMM's shape: `rows` activation rows of `k` (a
/// multiple of 64), parts of whole 16-row strips, and `x` and `w` (of
/// `lens`) that hold them; the stack's rows.
pub(super) fn check_strips(
    outs: &[&mut CudaSlice<f32>],
    shape: StackShape<'_>,
    (x_len, w_len): (usize, usize),
    rows: std::ops::RangeInclusive<usize>,
    what: &str,
) -> R<usize> {
    let StackShape { m, parts, k } = shape;
    let n = check_parts(outs, parts, m)?;
    let strips = parts.iter().all(|p| p.is_multiple_of(STRIP));
    if !rows.contains(&m) || !k.is_multiple_of(64) || !strips || x_len < m * k || w_len < n * k {
        return Err(KernelError::Shape(format!(
            "{what} GEMM of {m} rows of {k} over parts {parts:?}: {} to {} rows, k a multiple \
             of 64, parts whole strips of 16 rows",
            rows.start(),
            rows.end()
        )));
    }
    Ok(n)
}

impl Gpu {
    /// `outs[p] = x * w_p^T` for each part `p` of a stack of bf16 weights,
    /// `x` being `m` (2 to [`SKINNY_MAX_M`]) bf16 rows of `k` (a multiple of
    /// 64) and every part's rows a multiple of 16.
    pub fn gemm_bf16_skinny(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = check_strips(outs, shape, (x.len(), w.len()), 2..=SKINNY_MAX_M, "skinny")?;
        let (blocks, per_block) = row_blocks(m);
        let o = self.out_ptrs(outs, parts);
        let (mi, ki) = (m as i32, k as i32);
        let mut b = self
            .stream
            .launch_builder(self.function(&format!("gemm_bf16_skinny_nb{blocks}"))?);
        b.arg(x).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&mi).arg(&o.n).arg(&ki);
        let grid = (n / STRIP).div_ceil(per_block) as u32;
        // SAFETY: one block per `per_block` strips of the n rows (whole
        // strips, checked; the kernel skips strips past them); reads within
        // m x k and n x k, outputs checked above.
        unsafe { b.launch(cfg(grid, 32 * WARPS)) }.map_err(cuda_err)?;
        Ok(())
    }
}
