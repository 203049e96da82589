//! The folded products (fold_args.rs) on int4 tiles: the one-launch GEMV
//! of `int4_one.cu` with the fold's ending (`gemv_int4_fold_g{G}`, two
//! strips a block), so a layer of int4 weights runs no norm and no SiLU
//! kernel, as a bf16 one does.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fold_args::{FoldKernel, FoldLaunch};
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rows a strip of the tiles holds, and strips a block takes.
const STRIP: usize = 16;
const STRIPS: usize = 2;

/// An int4 matrix of tiles as the fold's kernels take it: the bytes, the
/// group and the rows of the whole stack.
#[derive(Clone, Copy)]
pub(super) struct Int4Tiles<'a> {
    pub(super) bytes: &'a CudaSlice<u8>,
    pub(super) group: usize,
    pub(super) rows: usize,
}

impl FoldKernel for Int4Tiles<'_> {
    const NAME: &'static str = "int4";

    /// The tiles hold `n` rows of `k` and `x` holds `k`.
    fn check(&self, x: &CudaSlice<f32>, n: usize, k: usize) -> R {
        let whole = n.is_multiple_of(STRIP) && k.is_multiple_of(self.group);
        let bytes = super::int4_device_bytes(n, k, self.group);
        if self.rows != n || !whole || x.len() < k || self.bytes.len() < bytes {
            return Err(KernelError::Shape(format!(
                "folded int4 product of {k} over {n} rows: the tiles hold {} rows, x {}; \
                 rows in strips of {STRIP} and k in groups of {}",
                self.rows,
                x.len(),
                self.group
            )));
        }
        Ok(())
    }

    fn grid(n: usize) -> usize {
        n.div_ceil(STRIP * STRIPS)
    }

    /// `gemv_int4_fold_g{G}`, in blocks of 8 or 16 warps as the grid
    /// allows (`int4_one_block_warps`).
    fn launch(&self, gpu: &Gpu, x: &CudaSlice<f32>, args: FoldLaunch, grid: usize) -> R {
        let warps = gpu.int4_one_block_warps(grid, STRIPS, args.k() / self.group);
        let func = gpu.function(&format!("gemv_int4_fold_g{}_w{warps}", self.group))?;
        let mut b = gpu.stream.launch_builder(func);
        b.arg(x).arg(self.bytes);
        args.push(&mut b);
        // SAFETY: two strips of 16 of the n rows a block (or a gate strip
        // and its up strip: f / 16 blocks), x of k, the outputs, norm
        // buffers and partial sums checked by the callers.
        unsafe {
            b.launch(super::launch::cfg(
                (grid as u32, 1, 1),
                32 * warps as u32,
                0,
            ))
        }
        .map_err(cuda_err)?;
        Ok(())
    }
}
