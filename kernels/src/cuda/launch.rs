//! Launch shapes every launcher shares.

use cudarc::driver::LaunchConfig;

/// A launch of `grid` blocks of `block` threads with `shared` bytes of
/// dynamic shared memory.
pub(super) fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// Blocks of `per` that cover `n`.
pub(super) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}
