//! Int4 products of a few activation rows (decode of 2 to
//! [`super::GEMV_MAX_M`] sequences) in one launch (`int4_rows.cu`): the
//! one-row kernel's two-strip blocks with the rows in the MMA's columns, in
//! place of `int4_xfrag` and the GEMV whose blocks each read every row's
//! fragments from L2 (`Gpu::set_int4_rows`, on by default).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rows a tile strip holds; strips a block takes.
const STRIP: usize = 16;
const STRIPS: usize = 2;

/// The builds' row counts (`gemv_int4_rows{MR}`): one MMA a step up to 4
/// rows, two up to 8.
const BUILDS: [usize; 2] = [4, 8];

/// The build that takes `m` rows: the smallest that holds them.
fn rows_build(m: usize) -> Option<usize> {
    BUILDS.into_iter().find(|b| m <= *b)
}

/// Dynamic shared memory of a block of `warps` warps at `mr` rows of groups
/// of `group` (`INT4_ROWS_WARP_FLOATS` a warp): each warp's rows of x for
/// one group and their hi + lo fragments, four bytes an element each.
pub(super) fn int4_rows_shared(warps: usize, mr: usize, group: usize) -> u32 {
    (warps * 2 * mr * group * 4) as u32
}

impl Gpu {
    /// `m` (2 to 8) rows of `x` times a stack of int4 tiles in groups of
    /// `group`, in one launch, or `Ok(false)` where no build fits (more rows
    /// than the builds take, or shared memory the device does not give a
    /// block), for the caller's two-launch path.
    pub(super) fn gemv_int4_rows(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        group: usize,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        (m, k): (usize, usize),
    ) -> R<bool> {
        let Some(mr) = rows_build(m) else {
            return Ok(false);
        };
        if x.len() < m * k {
            return Err(KernelError::Shape(format!(
                "int4 product of {m} rows of {k}: x holds {}",
                x.len()
            )));
        }
        let n: usize = parts.iter().sum();
        let grid = (n / STRIP).div_ceil(STRIPS);
        let warps = self.int4_one_block_warps(grid, STRIPS, k / group);
        let shared = int4_rows_shared(warps, mr, group);
        if shared as usize > self.int4_shared_room {
            return Ok(false);
        }
        let o = self.out_ptrs(outs, parts);
        let (mi, ki) = (m as i32, k as i32);
        let name = format!("gemv_int4_rows{mr}_g{group}_w{warps}");
        let mut b = self.stream.launch_builder(self.function(&name)?);
        b.arg(x).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&mi).arg(&o.n).arg(&ki);
        // SAFETY: one block per two strips of 16 of the n rows (a multiple
        // of 16 by construction of the tiles; a block's strip past the last
        // is read again from the last and not written); x holds m rows of k
        // (checked above), the outputs m rows of their parts (checked by the
        // caller); the dynamic shared memory is what the kernel indexes.
        let block = 32 * warps as u32;
        unsafe { b.launch(super::launch::cfg((grid as u32, 1, 1), block, shared)) }
            .map_err(cuda_err)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_rows_take_the_smallest_build_that_holds_them() {
        assert_eq!(rows_build(2), Some(4));
        assert_eq!(rows_build(4), Some(4));
        assert_eq!(rows_build(5), Some(8));
        assert_eq!(rows_build(8), Some(8));
        assert_eq!(rows_build(9), None);
    }

    #[test]
    fn eight_rows_of_sixteen_warps_fit_a_hopper_block() {
        // The H200 gives a block at most 227 KiB; the static sums (16 KiB
        // at sixteen warps and eight rows) come off the top.
        let most = int4_rows_shared(16, 8, 128) as usize;
        assert_eq!(most, 128 << 10);
        assert!(most + (16 << 10) <= 227 << 10);
        // Two blocks of eight warps an SM (228 KiB).
        assert!(2 * (int4_rows_shared(8, 8, 128) as usize + (8 << 10)) <= 228 << 10);
    }
}
