//! The shapes of products with weight matrices, and the checks and launch
//! geometry every product kernel shares (the GEMVs, cuBLAS, the skinny,
//! int4 and FP8 GEMMs).

use cudarc::driver::CudaSlice;

use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Most rows of activations the decode GEMVs take in one launch.
pub const GEMV_MAX_M: usize = 8;

/// Most activation rows that go to the bf16 GEMV rather than cuBLAS.
pub const BF16_GEMV_ROWS: usize = 1;

/// The shape of a product `out (m x n) = x (m x k) * w^T`: `m` activation
/// rows of `k` times a weight of `n` rows of `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    /// Activation rows.
    pub m: usize,
    /// Weight rows: the output's columns.
    pub n: usize,
    /// The width activations and weight rows share.
    pub k: usize,
}

/// The shape of a product with a stacked weight: `m` activation rows of
/// `k` times row blocks of `parts[i]` rows of `k`, block `i` into output
/// `i` (`m x parts[i]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackShape<'a> {
    /// Activation rows.
    pub m: usize,
    /// Rows of each block of the stack, in output order.
    pub parts: &'a [usize],
    /// The width activations and weight rows share.
    pub k: usize,
}

/// Device pointers of up to three outputs and the row counts of the
/// first two, as the GEMV kernels take them (absent parts: null, 0 rows).
pub(super) struct OutPtrs {
    pub(super) ptrs: [u64; 3],
    pub(super) n0: i32,
    pub(super) n1: i32,
    pub(super) n: i32,
}

/// The tensor-core GEMMs' launch for `m` activation rows: blocks of 8
/// rows (a power of two) and strips of 16 weight rows a thread block (two
/// from 4 blocks; `STRIPS_A_BLOCK` in `gemv.cu`).
pub(super) fn row_blocks(m: usize) -> (usize, usize) {
    let blocks = m.div_ceil(8).next_power_of_two();
    (blocks, if blocks >= 4 { 2 } else { 1 })
}

/// Checks one output per part, each big enough for `m` rows of its part;
/// the stack's total rows.
pub(super) fn check_parts<T>(outs: &[&mut CudaSlice<T>], parts: &[usize], m: usize) -> R<usize> {
    if outs.len() != parts.len() || parts.is_empty() || parts.len() > 3 {
        return Err(KernelError::Shape(format!(
            "{} outputs for {} row blocks: one to three, one output each",
            outs.len(),
            parts.len()
        )));
    }
    if m == 0 {
        return Err(KernelError::Shape("a product of zero rows".into()));
    }
    for (o, rows) in outs.iter().zip(parts) {
        if o.len() < m * rows {
            return Err(KernelError::Shape(format!(
                "output of {} for {m} x {rows}",
                o.len()
            )));
        }
    }
    Ok(parts.iter().sum())
}
