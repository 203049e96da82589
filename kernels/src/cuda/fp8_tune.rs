//! cuBLASLt's W8A8 algorithms timed one by one on a shape, for
//! `cuda_bench fp8lt`: what its first guess leaves on the table (nothing
//! with outer-vector scales on the H200, so the engine keeps it), and what
//! the weights' layout and scales cost (rows of k + 16 bytes with headers
//! ran 5-10% slower than packed rows: `DeviceWeight::Fp8`).

use cudarc::driver::{CudaSlice, sys as drv};

use cudarc::cublaslt::sys;
use cudarc::driver::CudaStream;

use super::fp8_gemm::{Fp8Out, W8a8Layout};
use super::lt::{Descs, Lt, W8a8Ptrs};
use super::shape::GemmShape;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// How a probed GEMM holds its operands, and how many algorithms to time.
#[derive(Clone, Copy, Debug)]
pub struct LtProbe {
    /// Bytes before the first weight code (16 past a row header).
    pub offset: usize,
    /// Bytes from one weight row to the next (`k`, or `k + 16` with headers).
    pub ldw: usize,
    /// Scales per weight row and per token; else one f32 per operand.
    pub outer: bool,
    /// Algorithms to ask cuBLASLt for, its best guess first.
    pub count: usize,
}

/// One of cuBLASLt's algorithms, timed.
#[derive(Clone, Copy, Debug)]
pub struct LtTiming {
    /// Its place in cuBLASLt's order (0: the one Kiln takes).
    pub rank: usize,
    /// Microseconds a launch (the mean of 10 after 2 warm-ups); NaN where
    /// the launch failed.
    pub us: f64,
    /// Waves of blocks cuBLASLt expects it to run in.
    pub waves: f32,
    /// What the algorithm is.
    pub config: LtConfig,
}

impl LtTiming {
    /// The fastest of `timings` that ran, else the first.
    pub fn fastest(timings: &[LtTiming]) -> Option<LtTiming> {
        timings
            .iter()
            .filter(|c| c.us.is_finite())
            .min_by(|a, b| a.us.total_cmp(&b.us))
            .or(timings.first())
            .copied()
    }
}

/// An algorithm's configuration as cuBLASLt reports it (its enums' values).
#[derive(Clone, Copy, Debug, Default)]
pub struct LtConfig {
    /// The algorithm's id.
    pub id: i32,
    /// Its tile shape (`cublasLtMatmulTile_t`).
    pub tile: i32,
    /// How many parts K splits into (1: none).
    pub split_k: i32,
    /// Its pipeline's stages (`cublasLtMatmulStages_t`).
    pub stages: i32,
    /// Its thread-block cluster's shape (`cublasLtClusterShape_t`).
    pub cluster: i32,
}

impl LtConfig {
    /// The configuration of `algo` (zeros where cuBLASLt does not say).
    pub(super) fn of(algo: &sys::cublasLtMatmulAlgo_t) -> Self {
        use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
        let get = |attr: A| {
            let (mut v, mut written) = (0i32, 0usize);
            // SAFETY: a live algorithm struct; each of these attributes is
            // a 32-bit integer.
            let status = unsafe {
                sys::cublasLtMatmulAlgoConfigGetAttribute(
                    algo,
                    attr,
                    (&mut v) as *mut i32 as *mut std::ffi::c_void,
                    4,
                    &mut written,
                )
            };
            if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                v
            } else {
                0
            }
        };
        Self {
            id: get(A::CUBLASLT_ALGO_CONFIG_ID),
            tile: get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
            split_k: get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
            stages: get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            cluster: get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        }
    }
}

impl Gpu {
    /// Times each of cuBLASLt's first `probe.count` algorithms for `out (m
    /// x n) = (xq * x_scales) (w * w_scales)^T` on these buffers. Not for
    /// use while the stream is captured (it waits on events).
    #[allow(
        clippy::too_many_arguments,
        reason = "a GEMM's operands, as in gemm_fp8_rows"
    )]
    pub fn fp8_lt_timings<T: Fp8Out>(
        &self,
        w: &CudaSlice<u8>,
        w_scales: &CudaSlice<f32>,
        xq: &CudaSlice<u8>,
        x_scales: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        shape: GemmShape,
        probe: LtProbe,
    ) -> R<Vec<LtTiming>> {
        let layout = W8a8Layout {
            offset: probe.offset,
            ldw: probe.ldw,
            outer: probe.outer,
        };
        let (w, w_scales) = (w.slice(..), w_scales.slice(..));
        let timings = self.w8a8(
            &w,
            &w_scales,
            xq,
            x_scales,
            out,
            shape,
            layout,
            |lt, descs, p| {
                let candidates = lt.heuristics(descs, probe.count)?;
                let us = lt.time_algos(descs, p, &candidates, &self.stream);
                Ok(candidates
                    .iter()
                    .zip(us)
                    .enumerate()
                    .map(|(rank, (c, us))| LtTiming {
                        rank,
                        us,
                        waves: c.wavesCount,
                        config: LtConfig::of(&c.algo),
                    })
                    .collect())
            },
        )?;
        self.stream.synchronize().map_err(cuda_err)?;
        Ok(timings)
    }
}

impl Lt {
    /// Microseconds a launch of each of `candidates` on `p` (the mean of 10
    /// after 2 warm-ups; NaN where one fails). Waits on the stream.
    pub(super) fn time_algos(
        &mut self,
        d: &Descs,
        p: &W8a8Ptrs,
        candidates: &[sys::cublasLtMatmulHeuristicResult_t],
        stream: &CudaStream,
    ) -> Vec<f64> {
        let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(candidates.len());
        for c in candidates {
            let mut launch = || {
                // SAFETY: the caller's buffers, live while it holds their
                // guards (the contract of `Lt::run`).
                unsafe { self.run(d, &c.algo, p.operands(), stream) }
            };
            let us = (|| -> R<f64> {
                for _ in 0..2 {
                    launch()?;
                }
                let start = stream.record_event(timing).map_err(cuda_err)?;
                for _ in 0..10 {
                    launch()?;
                }
                let end = stream.record_event(timing).map_err(cuda_err)?;
                Ok(start.elapsed_ms(&end).map_err(cuda_err)? as f64 * 100.0)
            })();
            times.push(us.unwrap_or(f64::NAN));
        }
        times
    }
}
