//! Helpers every launcher shares: launch shapes, and the page buffers as
//! kernel arguments.

use cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg};

use super::kv::PagedKv;
use crate::kv::KvFormat;

/// Pushes a layer's pages as kernel arguments: K, V, K scales, V scales.
pub(super) fn push_pages<'a>(b: &mut LaunchArgs<'a>, kv: &'a PagedKv) {
    b.arg(&kv.k).arg(&kv.v);
    push_scales(b, kv);
}

/// Pushes the K and V scale buffers of pages with a scale per vector, and
/// two null pointers for the other formats: the fp8 kernels read a null
/// scale buffer as the static format's scale of 1.
fn push_scales<'a>(b: &mut LaunchArgs<'a>, kv: &'a PagedKv) {
    if kv.format == KvFormat::Fp8 {
        b.arg(&kv.k_scale).arg(&kv.v_scale);
    } else {
        b.arg(&NULL_SCALES).arg(&NULL_SCALES);
    }
}

/// A null device pointer, passed for the scale buffers of formats without
/// them.
pub(super) static NULL_SCALES: u64 = 0;

pub(super) fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

pub(super) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}
