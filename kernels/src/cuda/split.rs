//! Split bf16 GEMMs for decode batches of 9 to 64 rows (`split.cu`): a
//! block's 8 warps take 8 strips of 16 weight rows over one slice of K, so
//! the activations come from L2 once a block (L1 serves the other warps)
//! and a few hundred blocks cover the H200's SMs even for 4096-row
//! matrices; the slices' sums meet in a workspace. cuBLAS reads 49-81% of
//! copy bandwidth on Llama-3-8B's shapes at 64 rows on the H200, the
//! skinny GEMM (one warp per K tile, every activation row block in turn)
//! 25-41% (docs/perf.md).
//!
//! Off in the engine until measured ([`Gpu::set_split`], `--cuda-split`).

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::gemv::{StackShape, row_blocks};
use super::skinny::check_strips;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Fewest activation rows the split GEMM takes (the skinny GEMM and the
/// GEMV take fewer).
pub const SPLIT_MIN_M: usize = 9;

/// Most activation rows the split GEMM takes.
pub const SPLIT_MAX_M: usize = 64;

/// Floats of the slices' workspace (16 MiB: 8 slices of 64 rows of a
/// 4096-row matrix need 2 Mi).
pub(super) const SPLIT_WORKSPACE: usize = 4 << 20;

/// Row groups (of [`GROUP_ROWS`]) the counters cover: 512 Ki rows.
pub(super) const SPLIT_GROUPS: usize = 4096;

/// Weight rows a block (8 warps of a 16-row strip each).
const GROUP_ROWS: usize = 128;

/// Most slices of K: more adds workspace traffic and a longer final sum.
const MAX_SLICES: usize = 8;

/// How to cut an `m x k` product over `n` rows on `sms` SMs: slices of K
/// (whole 64-column tiles) so that the row groups times the slices fill
/// the SMs about once, within the workspace; returns (slices, columns a
/// slice).
pub fn split_slices(m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let groups = n.div_ceil(GROUP_ROWS);
    let tiles = k / 64;
    let mut slices = (sms / groups.max(1)).clamp(1, MAX_SLICES).min(tiles.max(1));
    while slices > 1 && slices * m * n > SPLIT_WORKSPACE {
        slices -= 1;
    }
    let per = tiles.div_ceil(slices) * 64;
    (k.div_ceil(per), per)
}

/// The slices' workspace and the row groups' counters (zero between
/// launches: the last block of each group resets its own).
pub(super) struct SplitScratch {
    pub(super) sums: CudaSlice<f32>,
    pub(super) counters: CudaSlice<u32>,
}

impl Gpu {
    /// Whether bf16 products of [`SPLIT_MIN_M`] to [`SPLIT_MAX_M`] rows
    /// (k a multiple of 64, parts of whole 16-row strips) run the split
    /// GEMM instead of cuBLAS (off when a `Gpu` opens).
    pub fn set_split(&mut self, on: bool) {
        self.split = on;
    }

    /// `outs[p] = x * w_p^T` for each part `p` of a stack of bf16 weights,
    /// `x` being `m` ([`SPLIT_MIN_M`] to [`SPLIT_MAX_M`]) bf16 rows of `k`
    /// (a multiple of 64) and every part's rows a multiple of 16.
    pub fn gemm_bf16_split(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let lens = (x.len(), w.len());
        let n = check_strips(outs, shape, lens, SPLIT_MIN_M..=SPLIT_MAX_M, "split")?;
        let groups = n.div_ceil(GROUP_ROWS);
        if groups > SPLIT_GROUPS {
            return Err(KernelError::Shape(format!(
                "split GEMM over {n} rows: at most {}",
                SPLIT_GROUPS * GROUP_ROWS
            )));
        }
        let (slices, per) = split_slices(m, n, k, self.sms);
        let (blocks, _) = row_blocks(m);
        let o = self.out_ptrs(outs, parts);
        let (mi, ki, pi) = (m as i32, k as i32, per as i32);
        // The kernel writes the workspace and the counters through these
        // shared borrows: one stream runs every launch, and each launch
        // waits for the one before (PDL_ENTER), so no two touch them at once.
        let scratch = &self.split_scratch;
        let mut b = self
            .stream
            .launch_builder(self.function(&format!("gemm_bf16_split_nb{blocks}"))?);
        b.arg(x).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&mi).arg(&o.n).arg(&ki).arg(&pi);
        b.arg(&scratch.sums).arg(&scratch.counters);
        let grid = cudarc::driver::LaunchConfig {
            grid_dim: (groups as u32, slices as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per 128 rows (whole strips, checked; warps past
        // the last strip write nothing) and slice of k; reads within m x k
        // and n x k; the sums within slices x m x n <= the workspace
        // (split_slices), the counters within `groups` (checked).
        unsafe { b.launch(grid) }.map_err(cuda_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_fill_the_sms_once_and_cover_k_in_whole_tiles() {
        // Llama-3-8B at 64 rows on an H200's 132 SMs.
        assert_eq!(split_slices(64, 4096, 4096, 132), (4, 1024));
        assert_eq!(split_slices(64, 6144, 4096, 132), (2, 2048));
        assert_eq!(split_slices(64, 4096, 14336, 132), (4, 3584));
        assert_eq!(split_slices(64, 28672, 4096, 132), (1, 4096));
        // Never more slices than tiles, and the last slice may be short.
        assert_eq!(split_slices(16, 256, 128, 132), (2, 64));
        assert_eq!(split_slices(16, 128, 640, 132), (5, 128));
        assert_eq!(split_slices(16, 128, 704, 132), (6, 128));
        // The workspace bounds the slices.
        let (s, _) = split_slices(64, 32768, 4096, 132 * 64);
        assert!(s * 64 * 32768 <= SPLIT_WORKSPACE && s >= 1);
    }
}
