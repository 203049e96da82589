//! The cluster GEMM for bf16 decode batches of 17 to 64 rows
//! (`cluster.cu`): tiles of 128 weight rows whose K columns are split over
//! the blocks of a thread-block cluster, each streaming its share through a
//! cp.async ring, the partial tiles summed through distributed shared
//! memory. cuBLAS leaves most SMs idle on 4096-row weights at these shapes
//! (52-63% of copy bandwidth at 64 rows on Llama-3-8B's q/k/v, o and down
//! projections; perf.md, 2026-12-02), which is most of why a 64-sequence
//! decode step is at 64% of its roofline.
//!
//! Needs thread-block clusters (sm_90 and up). Two builds of each: the
//! products on m16n8k16 MMAs from ldmatrix fragments, and on warpgroup MMAs
//! straight from shared memory (sm_90a: the H100 and H200), which the
//! engine takes where it can. The engine takes it for [`CLUSTER_MIN_M`] to
//! [`CLUSTER_MAX_M`] rows ([`Gpu::set_cluster`], `--cuda-cluster`).

use std::collections::HashMap;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PushKernelArg};
use half::bf16;

use super::launch::cfg;
use super::shape::{StackShape, check_parts};
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Fewest activation rows the engine gives the cluster GEMM (the skinny
/// GEMM takes fewer).
pub const CLUSTER_MIN_M: usize = 17;

/// Most activation rows the cluster GEMM takes.
pub const CLUSTER_MAX_M: usize = 64;

/// Weight rows a tile (`CL_ROWS` in `cluster.cu`).
const TILE: usize = 128;

/// Threads a block (`CL_THREADS`).
const THREADS: u32 = 256;

/// Stages in each block's ring (`CL_STAGES`).
const STAGES: usize = 4;

/// Largest cluster built (the portable limit).
const MAX_SPLIT: usize = 8;

/// 64-column stages each block streams at least, so the ring fills.
const MIN_STAGES_A_BLOCK: usize = 4;

/// How the cluster GEMM multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterMma {
    /// m16n8k16 MMAs on ldmatrix fragments (sm_90).
    Ldmatrix,
    /// Warpgroup MMAs from shared memory, each stage's waited for before
    /// the next (sm_90a).
    Wgmma,
    /// Warpgroup MMAs that run on while the next stage lands, one stage
    /// less loaded ahead (sm_90a).
    WgmmaOverlap,
}

impl ClusterMma {
    /// Every kind.
    pub const ALL: [ClusterMma; 3] = [Self::Ldmatrix, Self::Wgmma, Self::WgmmaOverlap];

    fn kernel(self) -> &'static str {
        match self {
            Self::Ldmatrix => "cluster",
            Self::Wgmma => "wgmma",
            Self::WgmmaOverlap => "wgmma2",
        }
    }
}

/// A build of the kernel: its MMAs, blocks of 8 activation rows, cluster
/// size.
fn kernel_name(mma: ClusterMma, nt: usize, s: usize) -> String {
    format!("gemm_bf16_{}_s{s}_nt{nt}", mma.kernel())
}

/// Every build: (name, blocks of 8 rows, cluster size).
fn builds() -> impl Iterator<Item = (String, usize, usize)> {
    ClusterMma::ALL.into_iter().flat_map(|wg| {
        [4, 8]
            .into_iter()
            .flat_map(move |nt| (1..=MAX_SPLIT).map(move |s| (kernel_name(wg, nt, s), nt, s)))
    })
}

/// The kernel names.
pub(super) fn cluster_kernels() -> impl Iterator<Item = String> {
    builds().map(|(name, ..)| name)
}

/// Dynamic shared memory of one block for `nt` blocks of 8 activation rows
/// (and 1 KiB to start the ring on the swizzle's period).
fn shared_bytes(nt: usize) -> usize {
    STAGES * (TILE + 8 * nt) * 128 + 1024
}

/// Clusters of each build the GPU holds at once, counted at load.
#[derive(Clone, Debug, Default)]
pub(super) struct ClusterRoom(HashMap<String, usize>);

impl ClusterRoom {
    /// Lets each build take its ring (above the 48 KiB default) and counts
    /// its resident clusters.
    pub(super) fn measure(
        functions: &HashMap<String, CudaFunction>,
        stream: &CudaStream,
    ) -> R<Self> {
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SHARED;
        let mut room = HashMap::new();
        for (name, nt, s) in builds() {
            let f = functions
                .get(&name)
                .ok_or_else(|| cuda_err(format!("kernel `{name}` is not loaded")))?;
            let bytes = shared_bytes(nt) as u32;
            f.set_attribute(MAX_SHARED, bytes as i32)
                .map_err(cuda_err)?;
            let config = cfg((s as u32, 1, 1), THREADS, bytes);
            let n = f
                .occupancy_max_active_clusters(config, stream)
                .map_err(cuda_err)?;
            room.insert(name, n as usize);
        }
        Ok(Self(room))
    }

    /// Clusters of a build the GPU holds at once (0 for one not counted).
    fn clusters(&self, mma: ClusterMma, nt: usize, s: usize) -> usize {
        self.0.get(&kernel_name(mma, nt, s)).copied().unwrap_or(0)
    }
}

/// What a block costs beyond its stages, in stages: filling the ring and
/// meeting the cluster.
const BLOCK_COST: usize = 4;

/// Blocks a tile's K columns split over, given the clusters of each size
/// the GPU holds at once (`room`): the fewest waves times (stages a block
/// plus [`BLOCK_COST`]), each block streaming at least
/// [`MIN_STAGES_A_BLOCK`] stages where it splits; the smaller split on a
/// tie.
pub(super) fn split(n: usize, k: usize, room: impl Fn(usize) -> usize) -> usize {
    let tiles = n.div_ceil(TILE).max(1);
    let chunks = (k / 64).max(1);
    let cost = |s: usize| tiles.div_ceil(room(s).max(1)) * (chunks.div_ceil(s) + BLOCK_COST);
    (1..=MAX_SPLIT)
        .filter(|&s| s == 1 || chunks / s >= MIN_STAGES_A_BLOCK)
        .min_by_key(|&s| (cost(s), s))
        .unwrap_or(1)
}

/// Stages a block streams at least where the cluster GEMM takes products
/// of more than 32 rows: below, its blocks' fixed costs lose to cuBLAS (on
/// the H200, 4096x4096 and 6144x4096 at 64 rows; perf.md, 2026-12-02).
const WIDE_MIN_STAGES: usize = 16;

impl Gpu {
    /// Whether the engine's bf16 product of `m` rows over `n x k` takes the
    /// cluster GEMM ([`Gpu::set_cluster`]).
    pub(super) fn cluster_takes(&self, m: usize, n: usize, k: usize) -> bool {
        let rows = (CLUSTER_MIN_M..=CLUSTER_MAX_M).contains(&m);
        if !self.cluster || !rows || !k.is_multiple_of(64) {
            return false;
        }
        let room = |s| self.cluster_room.clusters(self.cluster_mma, 8, s);
        // More tiles than one wave (the lm_head's 1002) stream as well
        // through cuBLAS's tiles (86-92% of copy bandwidth).
        if n.div_ceil(TILE) > room(1) {
            return false;
        }
        let s = split(n, k, room);
        m <= 32 || k / 64 / s >= WIDE_MIN_STAGES
    }

    /// Clusters of `s` blocks (1 to 8) of the cluster GEMM for `nt` (4 or
    /// 8) blocks of 8 activation rows the GPU holds at once, as counted at
    /// load (0 below sm_90).
    pub fn cluster_room(&self, mma: ClusterMma, nt: usize, s: usize) -> usize {
        self.cluster_room.clusters(mma, nt, s)
    }

    /// `outs[p] = x * w_p^T` for each part `p` of a stack of bf16 weights,
    /// `x` being `m` (1 to [`CLUSTER_MAX_M`]) bf16 rows of `k` (a multiple
    /// of 64); parts of any row count. sm_90 and up.
    pub fn gemm_bf16_cluster(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
    ) -> R {
        self.gemm_bf16_cluster_on(self.cluster_mma, x, w, outs, shape)
    }

    /// As [`Self::gemm_bf16_cluster`], on the MMAs of `mma` (warpgroup
    /// MMAs on sm_90a only).
    pub fn gemm_bf16_cluster_on(
        &self,
        mma: ClusterMma,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = check_parts(outs, parts, m)?;
        if mma != ClusterMma::Ldmatrix && !self.wgmma {
            return Err(KernelError::Shape(format!(
                "warpgroup MMAs need sm_90a (an H100 or H200): {}",
                self.name
            )));
        }
        if !self.clusters {
            return Err(KernelError::Shape(format!(
                "the cluster GEMM needs sm_90 or newer: {}",
                self.name
            )));
        }
        if m > CLUSTER_MAX_M || !k.is_multiple_of(64) || x.len() < m * k || w.len() < n * k {
            return Err(KernelError::Shape(format!(
                "cluster GEMM of {m} rows of {k} over parts {parts:?}: 1 to {CLUSTER_MAX_M} \
                 rows, k a multiple of 64"
            )));
        }
        let nt = if m <= 32 { 4 } else { 8 };
        let s = split(n, k, |s| self.cluster_room.clusters(mma, nt, s));
        let o = self.out_ptrs(outs, parts);
        let (mi, ki) = (m as i32, k as i32);
        let mut b = self
            .stream
            .launch_builder(self.function(&kernel_name(mma, nt, s))?);
        b.arg(x).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&mi).arg(&o.n).arg(&ki);
        let grid = (n.div_ceil(TILE) * s) as u32;
        // SAFETY: `s` blocks (one cluster, the kernel's compile-time size)
        // per 128-row tile of the n rows (rows past n read as zeros and are
        // not written); reads within m x k and n x k, outputs checked above;
        // the shared memory is the kernel's ring, allowed at load.
        unsafe { b.launch(cfg((grid, 1, 1), THREADS, shared_bytes(nt) as u32)) }
            .map_err(cuda_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two blocks an SM on 132 SMs, every cluster fitting.
    fn h200(s: usize) -> usize {
        2 * 132 / s
    }

    #[test]
    fn the_split_fills_the_h200_on_llama_3_8b_shapes() {
        // q/k/v, o, down, gate alone and gate/up stacked.
        assert_eq!(split(6144, 4096, h200), 5);
        assert_eq!(split(4096, 4096, h200), 8);
        assert_eq!(split(4096, 14336, h200), 8);
        assert_eq!(split(14336, 4096, h200), 2);
        assert_eq!(split(28672, 4096, h200), 1);
    }

    #[test]
    fn a_split_whose_clusters_do_not_fit_at_once_loses_to_one_that_does() {
        // 32 tiles of 64 stages: 24 clusters of 8 take two waves of 8
        // stages (16), as many as one wave of 4 ways; 7 ways fit in one.
        let room = |s: usize| if s == 8 { 24 } else { 2 * 132 / s };
        assert_eq!(split(4096, 4096, room), 7);
        let room = |s: usize| if s >= 5 { 24 } else { 2 * 132 / s };
        assert_eq!(split(4096, 4096, room), 4);
    }

    #[test]
    fn every_block_streams_enough_stages_to_fill_its_ring() {
        // The default model's 576-wide layers: 9 stages, so two blocks.
        assert_eq!(split(576, 576, h200), 2);
        assert_eq!(split(64, 64, h200), 1);
        for (n, k) in [(576, 1536), (1536, 576), (4096, 256)] {
            let s = split(n, k, h200);
            assert!(s == 1 || k / 64 / s >= MIN_STAGES_A_BLOCK, "{n}x{k}: {s}");
        }
    }
}
