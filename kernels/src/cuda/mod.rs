//! The CUDA backend: the kernels of [`SOURCE`], compiled at run time by
//! NVRTC (through cudarc, which loads the CUDA libraries dynamically, so
//! this builds and links on machines without CUDA) and cached per device
//! architecture and source digest; cuBLAS for large GEMMs.
//!
//! [`Gpu::new`] fails with [`KernelError::DeviceUnavailable`] where there is
//! no usable driver, NVRTC or GPU, never with a panic.

mod act;
mod attention;
mod attention_plan;
mod backend;
mod bf16_lt;
mod cluster;
mod comm;
mod convert;
mod cublas;
mod embed;
mod fold;
mod fold_args;
mod fold_weight;
mod fp8_act;
mod fp8_fold;
mod fp8_gemm;
mod fp8_mma;
mod fp8_tune;
mod gemv;
mod graph;
mod hadamard;
mod int4;
mod int4_fold;
mod int4_rows;
mod kv;
mod kv_transfer;
mod lane;
mod launch;
mod lt;
mod meeting;
mod memory;
mod norm;
mod normed;
mod prefill;
mod quant;
mod rope;
mod rope_attention;
mod sample;
mod shape;
mod skinny;
mod source;
mod tags;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use sha2::{Digest, Sha256};

use crate::KernelError;

pub use attention::{
    AttentionBuffers, AttentionKind, AttentionPlan, AttnOut, DecodeBatch, PagedQuery,
};
pub use attention_plan::{
    FLASH_MAX_PARTITION, FLASH_PARTITION, FlashBuild, PARTITION, partition_len,
};
pub use bf16_lt::{Bf16Tuning, TUNE_KEEP_BELOW, TuneBf16};
pub use cluster::{CLUSTER_MAX_M, CLUSTER_MIN_M, ClusterMma};
pub use comm::NcclRank;
/// The CUDA driver API types device code works with.
pub use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
pub use fold::{NextNorm, NormSum, Normed};
pub use fp8_act::Fp8Input;
pub use fp8_fold::FP8_FOLD_MAX_K;
pub use fp8_gemm::{FP8_GEMV_ROWS, Fp8Out, Fp8Scratch};
pub use fp8_mma::E4M3_MMA_MAX_M;
pub use fp8_tune::{LtConfig, LtProbe, LtTiming};
pub use graph::Graph;
use int4::INT4_ONE_STRIPS;
pub use int4::{INT4_MMA_MAX_M, int4_device_bytes, int4_tiles};
pub use kv::PagedKv;
pub use lane::{Mark, Settle};
pub use lt::Bf16Out;
pub use meeting::{HostSum, Vote};
pub use norm::NormArgs;
pub use prefill::{PREFILL_HEAD_DIMS, prefill_supports, prefill_tiles};
pub use quant::{DEQUANT_CHUNK, DeviceWeight, GemmScratch};
pub use rope::{RopeArgs, RopeKv};
pub use rope_attention::Unrotated;
pub use shape::{BF16_GEMV_ROWS, GEMV_MAX_M, GemmShape, StackShape};
pub use skinny::{SKINNY_MAX_M, SKINNY_WINS_M};
use source::KERNELS;
pub use source::SOURCE;
pub use tags::TagLayout;

/// One GPU with Kiln's kernels loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    blas: cudarc::cublas::CudaBlas,
    /// cuBLAS's workspace on a stream of our own: a fixed buffer, so GEMMs
    /// can be captured into CUDA graphs (cuBLAS allocates none itself).
    _blas_workspace: Option<CudaSlice<u8>>,
    name: String,
    _module: Arc<CudaModule>,
    /// Whether captured graphs join our kernels by programmatic edges
    /// (sm_90 and up; [`Gpu::set_programmatic`]).
    programmatic: bool,
    /// Resident blocks of each flash attention kernel
    /// ([`attention::flash_resident`]).
    flash_resident: HashMap<String, usize>,
    /// cuBLASLt for FP8 GEMMs, made at the first one.
    lt: std::sync::Mutex<Option<lt::Lt>>,
    /// Whether FP8 rows multiply on FP8 tensor cores with outer-vector
    /// scales (sm_90 and up); below, they dequantize to bf16 for cuBLAS.
    fp8_tensor: bool,
    /// Whether bf16 products of 2 to [`SKINNY_WINS_M`] rows take the
    /// skinny GEMM instead of cuBLAS ([`Gpu::set_skinny`]).
    skinny: bool,
    /// Whether the device runs thread-block clusters (sm_90 and up).
    clusters: bool,
    /// Whether bf16 products of [`CLUSTER_MIN_M`] to [`CLUSTER_MAX_M`]
    /// rows take the cluster GEMM instead of cuBLAS ([`Gpu::set_cluster`]).
    cluster: bool,
    /// Whether the kernels were built for sm_90a, with warpgroup MMAs.
    wgmma: bool,
    /// The cluster GEMM's MMAs in the engine's products.
    cluster_mma: ClusterMma,
    /// Clusters of each cluster GEMM build the GPU holds at once.
    cluster_room: cluster::ClusterRoom,
    /// Whether one-row int4 products take the one-launch GEMV
    /// ([`Gpu::set_int4_one`]).
    int4_one: bool,
    /// Strips of 16 rows a block of the one-launch int4 GEMV takes: `None`
    /// chooses by the row count ([`Gpu::set_int4_one_strips`]).
    int4_one_strips: Option<usize>,
    /// Grids of two-strip blocks up to this many take blocks of sixteen
    /// warps in the one-launch int4 GEMV: `None` for the SM count
    /// ([`Gpu::set_int4_one_wide`]).
    int4_one_wide: Option<usize>,
    /// Whether int4 products of 2 to [`GEMV_MAX_M`] rows run in one launch
    /// (`int4_rows.cu`, [`Gpu::set_int4_rows`]).
    int4_rows: bool,
    /// Dynamic shared memory a block of a few-row int4 build can take
    /// here.
    int4_shared_room: usize,
    /// The device's streaming multiprocessors.
    sms: usize,
    /// Whether W8A8 products of few rows take `fp8_mma.cu`
    /// ([`Gpu::set_fp8_mma`]).
    fp8_mma: bool,
    /// Warps a block of prefill attention: 4 or 8
    /// ([`Gpu::set_prefill_warps`]).
    prefill_warps: usize,
}

/// Bytes of cuBLAS workspace (NVIDIA's advice for Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

pub(crate) fn cuda_err(e: impl std::fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("{e:?}"))
}

/// A launch of `grid` blocks of `block` threads, no dynamic shared memory.
pub(crate) fn grid_1d(grid: u32, block: u32) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn unavailable(what: String) -> KernelError {
    KernelError::DeviceUnavailable(what)
}

/// Whether one of `names` can be loaded as a shared library.
fn library_present(names: &[&str]) -> bool {
    names.iter().any(|n| {
        // SAFETY: loading the CUDA driver or NVRTC runs their initializers,
        // which is what using them does anyway.
        unsafe { libloading::Library::new(n) }.is_ok()
    })
}

/// Where NVRTC finds the CUDA headers (`cuda_bf16.h`, `cuda_fp8.h`).
fn include_dir() -> String {
    std::env::var("CUDA_HOME")
        .or_else(|_| std::env::var("CUDA_PATH"))
        .map(|h| format!("{h}/include"))
        .unwrap_or_else(|_| "/usr/local/cuda/include".into())
}

/// Compiled kernels are cached under `$KILN_CACHE/cuda` (else the system
/// temp directory), named by source digest and architecture.
fn cache_path(arch: &str) -> PathBuf {
    let digest = hex_digest(SOURCE.as_bytes());
    let base = std::env::var_os("KILN_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    base.join("cuda")
        .join(format!("{}-{arch}.ptx", &digest[..16]))
}

fn hex_digest(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn compile(arch: &str) -> Result<cudarc::nvrtc::Ptx, KernelError> {
    let path = cache_path(arch);
    if let Ok(src) = std::fs::read_to_string(&path) {
        return Ok(cudarc::nvrtc::Ptx::from_src(src));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        include_paths: vec![include_dir()],
        options: vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| KernelError::Cuda(format!("NVRTC failed to compile the kernels: {e:?}")))?;
    if let Some(dir) = path.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        // A failed cache write only costs a compile next time.
        let _ = std::fs::write(&path, ptx.to_src());
    }
    Ok(ptx)
}

impl Gpu {
    /// Checks, cheaply, that GPU `ordinal` can be opened (driver, NVRTC and
    /// the device are there) without compiling anything.
    pub fn probe(ordinal: usize) -> Result<(), KernelError> {
        let count = Self::count()?;
        if ordinal >= count {
            return Err(unavailable(format!(
                "no CUDA device {ordinal}: this machine has {count}"
            )));
        }
        Ok(())
    }

    /// How many CUDA GPUs this machine has (an error where the driver or
    /// NVRTC is missing), without opening any.
    pub fn count() -> Result<usize, KernelError> {
        Self::check_libraries()?;
        let count = std::panic::catch_unwind(CudaContext::device_count)
            .map_err(|_| unavailable("the CUDA driver could not be initialized".into()))?
            .map_err(cuda_err)?;
        Ok(count.max(0) as usize)
    }

    fn check_libraries() -> Result<(), KernelError> {
        if !library_present(&["libcuda.so.1", "libcuda.so"]) {
            return Err(unavailable(
                "no CUDA driver (libcuda.so.1) on this machine; run with --device cpu".into(),
            ));
        }
        if !library_present(&["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]) {
            return Err(unavailable(
                "NVRTC (libnvrtc.so) is missing; install the CUDA toolkit or add its lib64 \
                 to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Opens GPU `ordinal`, compiles (or loads the cached) kernels and
    /// creates a cuBLAS handle; everything runs on the default stream.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        Self::open(ordinal, false)
    }

    /// As [`Self::new`]; with `own_stream`, work goes to a stream of its
    /// own, which [`Self::capture`] needs (the legacy default stream cannot
    /// be captured). Kiln uses one stream per `Gpu`, so cudarc's
    /// cross-stream event tracking is switched off first.
    pub fn open(ordinal: usize, own_stream: bool) -> Result<Self, KernelError> {
        Self::check_libraries()?;
        // cudarc panics where a symbol is missing; turn that into an error.
        let opened = std::panic::catch_unwind(|| -> Result<Self, KernelError> {
            let count = CudaContext::device_count().map_err(cuda_err)?;
            if ordinal as i32 >= count {
                return Err(unavailable(format!(
                    "no CUDA device {ordinal}: this machine has {count}"
                )));
            }
            let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
            let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
            let name = ctx.name().map_err(cuda_err)?;
            let sms = ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                )
                .map_err(cuda_err)?
                .max(1) as usize;
            // The H100 and H200 get their arch-specific features
            // (warpgroup MMAs): PTX for sm_90a runs on sm_90 alone.
            let wgmma = (major, minor) == (9, 0);
            let arch = format!("compute_{major}{minor}{}", if wgmma { "a" } else { "" });
            let module = ctx.load_module(compile(&arch)?).map_err(cuda_err)?;
            let mut functions = HashMap::new();
            let names = KERNELS.iter().map(|k| k.to_string());
            for name in names.chain(attention_plan::attention_kernels()) {
                let f = module.load_function(&name).map_err(cuda_err)?;
                functions.insert(name, f);
            }
            for name in cluster::cluster_kernels() {
                let f = module.load_function(&name).map_err(cuda_err)?;
                functions.insert(name, f);
            }
            let int4_shared_room = int4::let_int4_shared_grow(&ctx, &functions)?;
            let clusters = major >= 9;
            let flash_resident = attention::flash_resident(
                |name| {
                    functions
                        .get(name)
                        .cloned()
                        .ok_or_else(|| cuda_err(format!("kernel `{name}` is not loaded")))
                },
                sms,
            )?;
            let stream = if own_stream {
                // SAFETY: a buffer is used on the stream that made it, or
                // (KV pages and page tags shared with a second lane,
                // `lane.rs`) on another only after the host waited for the
                // work that last wrote it; so no event is due between them.
                unsafe { ctx.disable_event_tracking() };
                ctx.new_stream().map_err(cuda_err)?
            } else {
                ctx.default_stream()
            };
            let cluster_room = if clusters {
                cluster::ClusterRoom::measure(&functions, &stream)?
            } else {
                cluster::ClusterRoom::default()
            };
            let (blas, workspace) = if own_stream {
                let (blas, ws) = lane::blas_with_workspace(&stream)?;
                (blas, Some(ws))
            } else {
                let blas = cudarc::cublas::CudaBlas::new(stream.clone()).map_err(cuda_err)?;
                (blas, None)
            };
            Ok(Self {
                ctx,
                stream,
                functions,
                blas,
                _blas_workspace: workspace,
                name: format!("{name} (sm_{major}{minor})"),
                _module: module,
                programmatic: major >= 9,
                flash_resident,
                lt: std::sync::Mutex::new(None),
                fp8_tensor: major >= 9,
                skinny: false,
                clusters,
                cluster: false,
                wgmma,
                cluster_mma: if wgmma {
                    ClusterMma::Wgmma
                } else {
                    ClusterMma::Ldmatrix
                },
                cluster_room,
                int4_one: true,
                int4_one_strips: None,
                int4_one_wide: None,
                int4_rows: true,
                int4_shared_room,
                sms,
                fp8_mma: true,
                prefill_warps: prefill::DEFAULT_WARPS,
            })
        });
        opened.unwrap_or_else(|p| {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Err(unavailable(format!("CUDA could not be initialized: {why}")))
        })
    }

    /// Whether graphs captured from now on let each kernel of ours start
    /// while the one before it runs (programmatic dependent launch; on by
    /// default from sm_90, where the kernels' `griddepcontrol` waits work;
    /// a no-op below it).
    pub fn set_programmatic(&mut self, on: bool) {
        self.programmatic = on && self.programmatic_supported();
    }

    /// Whether bf16 products of 2 to [`SKINNY_WINS_M`] rows (k a multiple
    /// of 64, parts of whole 16-row strips) run the skinny GEMM instead of
    /// cuBLAS (off when a `Gpu` opens; the engine turns it on).
    pub fn set_skinny(&mut self, on: bool) {
        self.skinny = on;
    }

    /// Whether bf16 products of [`CLUSTER_MIN_M`] to [`CLUSTER_MAX_M`]
    /// rows (k a multiple of 64) run the cluster GEMM instead of cuBLAS
    /// (off when a `Gpu` opens; the engine turns it on; a no-op below
    /// sm_90).
    pub fn set_cluster(&mut self, on: bool) {
        self.cluster = on && self.clusters;
    }

    /// Whether W8A8 products of up to [`E4M3_MMA_MAX_M`] rows take Kiln's
    /// FP8 tensor-core kernel (on when a `Gpu` opens) or cuBLASLt.
    pub fn set_fp8_mma(&mut self, on: bool) {
        self.fp8_mma = on;
    }

    /// Whether one-row int4 products (decode at one sequence) run in one
    /// launch that splits the activations itself (on when a `Gpu` opens),
    /// or through `int4_xfrag` and the GEMV of up to 8 rows.
    pub fn set_int4_one(&mut self, on: bool) {
        self.int4_one = on;
    }

    /// Strips of 16 rows a block of the one-launch int4 GEMV takes (1 or
    /// 2), or `None` (as a `Gpu` opens) to choose by the row count; for
    /// tests and benchmarks of each build.
    pub fn set_int4_one_strips(&mut self, strips: Option<usize>) -> Result<(), KernelError> {
        if strips.is_some_and(|s| !INT4_ONE_STRIPS.contains(&s)) {
            return Err(KernelError::Shape(format!(
                "one-launch int4 GEMV blocks of {strips:?} strips: {INT4_ONE_STRIPS:?} are built"
            )));
        }
        self.int4_one_strips = strips;
        Ok(())
    }

    /// The largest grid of two-strip blocks that the one-launch int4 GEMV
    /// runs as blocks of sixteen warps instead of eight (`Some(0)`: eight
    /// everywhere; `None`, as a `Gpu` opens: the SM count); for tests and
    /// benchmarks of each build.
    pub fn set_int4_one_wide(&mut self, blocks: Option<usize>) {
        self.int4_one_wide = blocks;
    }

    /// Whether int4 products of 2 to [`GEMV_MAX_M`] rows (decode of a few
    /// sequences) run in one launch with the rows in the MMAs' columns
    /// (`int4_rows.cu`) instead of `int4_xfrag` and the GEMV (on as a `Gpu`
    /// opens: faster at every few-row shape, docs/perf.md).
    pub fn set_int4_rows(&mut self, on: bool) {
        self.int4_rows = on;
    }

    /// Warps a block of a one-launch int4 build (one row, a fold or a few
    /// rows) takes on a grid of `grid` blocks of `per_block` strips over
    /// rows of `groups` groups ([`int4::int4_one_warps`]).
    pub(super) fn int4_one_block_warps(
        &self,
        grid: usize,
        per_block: usize,
        groups: usize,
    ) -> usize {
        int4::int4_one_warps(
            grid,
            per_block,
            groups,
            self.int4_one_wide.unwrap_or(self.sms),
        )
    }

    /// Warps a block of prefill attention takes (4 or 8; 16 query rows
    /// each, so tiles from [`prefill_tiles`] of [`Gpu::prefill_rows`]).
    pub fn set_prefill_warps(&mut self, warps: usize) -> Result<(), KernelError> {
        if !prefill::WARPS.contains(&warps) {
            return Err(KernelError::Shape(format!(
                "prefill attention in blocks of {warps} warps: {:?} are built",
                prefill::WARPS
            )));
        }
        self.prefill_warps = warps;
        Ok(())
    }

    /// Query rows (tokens times the heads of a KV head) a block of
    /// prefill attention takes.
    pub fn prefill_rows(&self) -> usize {
        16 * self.prefill_warps
    }

    fn programmatic_supported(&self) -> bool {
        self.ctx
            .compute_capability()
            .is_ok_and(|(major, _)| major >= 9)
    }

    /// The device's name and architecture.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The stream every kernel runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.functions
            .get(name)
            .ok_or_else(|| KernelError::Cuda(format!("kernel `{name}` is not loaded")))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(cuda_err)
    }
}
