//! Launches of the device kernels on device buffers.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::{KvFormat, KvLayout};

type R<T = ()> = Result<T, KernelError>;

fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// One layer's KV pages on the GPU (same layout as [`crate::kv::KvPages`]).
pub struct PagedKv {
    /// The format.
    pub format: KvFormat,
    /// The layout.
    pub layout: KvLayout,
    /// K bytes (bf16 or e4m3).
    pub k: CudaSlice<u8>,
    /// V bytes.
    pub v: CudaSlice<u8>,
    /// K scales (fp8 only; one per vector).
    pub k_scale: CudaSlice<f32>,
    /// V scales.
    pub v_scale: CudaSlice<f32>,
}

/// How a decode attention launch runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Tokens per partition; `None`: [`partition_len`]'s choice.
    pub part_len: Option<usize>,
    /// The kernel; `None`: the best the device and shape allow.
    pub kind: Option<AttentionKind>,
}

/// The decode attention kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// One pass per warp on tensor cores (scores, online softmax, values in
    /// registers). Head sizes 64 and 128, pages of a power of two of at
    /// least 16 tokens.
    Flash,
    /// Scores and values summed by warp shuffles on CUDA cores (any head
    /// size and page size).
    Shuffle,
}

/// Scratch for split attention, sized for `seqs x heads x parts x head_dim`.
pub struct AttentionBuffers {
    part_out: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

/// Most tokens per attention partition (`PART` in the source).
pub const PARTITION: usize = 256;

/// Threads of a decode attention block (`ATT_THREADS` in the source).
const ATT_THREADS: usize = 128;

/// Slots of its cp.async ring per thread (`ATT_STAGES`).
const ATT_STAGES: usize = 4;

/// Threads of a flash attention block (`FLASH_WARPS` warps).
const FLASH_THREADS: usize = 128;

/// Every flash attention kernel, per format, group size and head size.
pub(crate) fn attention_kernels() -> Vec<String> {
    let mut names = Vec::new();
    for fmt in ["bf16", "fp8"] {
        for g in 1..=8 {
            for d in [64, 128] {
                names.push(format!("attention_flash_{fmt}_g{g}_d{d}"));
            }
        }
    }
    names
}

/// Shared memory of a flash launch, as attention_flash.cu lays it out.
fn flash_shared(group: usize, hd: usize, page_size: usize, part: usize) -> usize {
    let red = (FLASH_THREADS / 32) * (group * hd + 2 * group);
    hd * 32 + red * 4 + (part / page_size + 1) * 4
}

/// Fewest tokens per partition (a few rounds of the block's token lanes).
const MIN_PARTITION: usize = 32;

/// Blocks a decode attention launch aims for (two per SM of an H100 or
/// H200): below this, partitions shrink so a small batch still spreads
/// its reads over the whole GPU instead of queueing them in a few blocks.
const TARGET_BLOCKS: usize = 264;

/// Tokens per attention partition for `seqs` sequences of up to `max_len`
/// over `kv_heads`: [`PARTITION`], halved while the launch would have
/// fewer than [`TARGET_BLOCKS`] blocks, down to 32.
pub fn partition_len(seqs: usize, kv_heads: usize, max_len: usize) -> usize {
    let mut len = PARTITION;
    while len > MIN_PARTITION && seqs * kv_heads * max_len.div_ceil(len) < TARGET_BLOCKS {
        len /= 2;
    }
    len
}

impl Gpu {
    /// Zeroed pages.
    pub fn paged_kv(&self, format: KvFormat, layout: KvLayout, pages: usize) -> R<PagedKv> {
        let vectors = pages * layout.page_size * layout.kv_heads;
        let elem = if format == KvFormat::Bf16 { 2 } else { 1 };
        let bytes = vectors * layout.head_dim * elem;
        let scales = if format == KvFormat::Fp8 { vectors } else { 1 };
        let s = &self.stream;
        Ok(PagedKv {
            format,
            layout,
            k: s.alloc_zeros(bytes).map_err(cuda_err)?,
            v: s.alloc_zeros(bytes).map_err(cuda_err)?,
            k_scale: s.alloc_zeros(scales).map_err(cuda_err)?,
            v_scale: s.alloc_zeros(scales).map_err(cuda_err)?,
        })
    }

    /// Scratch for attention over up to `seqs` sequences of at most
    /// `max_len` (for every batch size up to `seqs`: smaller batches split
    /// into more partitions).
    pub fn attention_buffers(
        &self,
        seqs: usize,
        heads: usize,
        kv_heads: usize,
        hd: usize,
        max_len: usize,
    ) -> R<AttentionBuffers> {
        let rows = (1..=seqs.max(1))
            .map(|b| b * max_len.div_ceil(partition_len(b, kv_heads, max_len)).max(1))
            .max()
            .unwrap_or(1);
        let s = &self.stream;
        Ok(AttentionBuffers {
            part_out: s.alloc_zeros(rows * heads * hd).map_err(cuda_err)?,
            part_ml: s.alloc_zeros(rows * heads * 2).map_err(cuda_err)?,
        })
    }

    /// `x += residual` (if given), then `out = rmsnorm(x) * w`, per row.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual(
        &self,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> R {
        let f = self.function("rmsnorm_residual")?;
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        let dim_i = dim as i32;
        b.arg(w).arg(out).arg(&dim_i).arg(&eps);
        // SAFETY: the kernel reads and writes `rows x dim` of each buffer.
        unsafe { b.launch(cfg((rows as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Rotates `x` (`tokens x heads x dim`) at `pos` with `inv_freq`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        pos: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        tokens: usize,
        heads: usize,
        dim: usize,
        interleaved: bool,
    ) -> R {
        let f = self.function("rope")?;
        let (h, d, il) = (heads as i32, dim as i32, interleaved as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(pos).arg(inv_freq).arg(&h).arg(&d).arg(&il);
        let threads = (dim / 2).clamp(32, 256) as u32;
        // SAFETY: grid covers tokens x heads rows of `dim`.
        unsafe { b.launch(cfg((tokens as u32, heads as u32, 1), threads, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `gate = silu(gate) * up` over `n` elements.
    pub fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) -> R {
        let f = self.function("silu_mul")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(gate).arg(up).arg(&n_i);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { b.launch(cfg((blocks(n, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out[t] = table[ids[t]]` for bf16 rows of `hidden`.
    pub fn embed(
        &self,
        table: &CudaSlice<bf16>,
        ids: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        hidden: usize,
    ) -> R {
        let f = self.function("embed_bf16")?;
        let h = hidden as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(table).arg(ids).arg(out).arg(&h);
        // SAFETY: ids are checked against the vocabulary by the caller.
        unsafe { b.launch(cfg((tokens as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Writes `tokens` K and V rows (`kv_heads x head_dim` each) at slots
    /// `page * page_size + slot` (each head's vector where
    /// [`crate::kv`]'s layout puts it); a negative slot writes nothing.
    pub fn kv_write(
        &self,
        kv: &mut PagedKv,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &CudaView<'_, i32>,
        tokens: usize,
    ) -> R {
        let KvLayout {
            kv_heads,
            head_dim,
            page_size,
        } = kv.layout;
        if !head_dim.is_multiple_of(32) || head_dim > 1024 {
            return Err(KernelError::Shape(format!(
                "head_dim {head_dim}: a multiple of 32 up to 1024"
            )));
        }
        let (h, d, ps) = (kv_heads as i32, head_dim as i32, page_size as i32);
        let grid = (tokens as u32, kv_heads as u32, 1);
        match kv.format {
            KvFormat::Bf16 => {
                let f = self.function("kv_write_bf16")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(k)
                    .arg(v)
                    .arg(slots)
                    .arg(&mut kv.k)
                    .arg(&mut kv.v)
                    .arg(&h)
                    .arg(&d)
                    .arg(&ps);
                // SAFETY: slots index vectors inside the pages.
                unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
            }
            KvFormat::Fp8 => {
                let f = self.function("kv_write_fp8")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(k).arg(v).arg(slots).arg(&mut kv.k).arg(&mut kv.v);
                b.arg(&mut kv.k_scale)
                    .arg(&mut kv.v_scale)
                    .arg(&h)
                    .arg(&d)
                    .arg(&ps);
                // SAFETY: as above.
                unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
            }
        }
        Ok(())
    }

    /// Decode attention of one query token per sequence over its pages:
    /// `q` is `seqs x heads x head_dim`; sequence `s`'s block table is
    /// `tables[table_off[s]..]`, its length `lens[s]` (at most `max_len`).
    /// `plan` says how to split and which kernel runs (the default:
    /// partitions sized for the batch, the flash kernel where the shape
    /// allows it).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        kv: &PagedKv,
        q: &CudaSlice<f32>,
        tables: &CudaView<'_, i32>,
        table_off: &CudaView<'_, i32>,
        lens: &CudaView<'_, i32>,
        scratch: &mut AttentionBuffers,
        out: &mut CudaSlice<f32>,
        seqs: usize,
        heads: usize,
        max_len: usize,
        scale: f32,
        plan: AttentionPlan,
    ) -> R {
        let KvLayout {
            kv_heads,
            head_dim,
            page_size,
        } = kv.layout;
        let part_len = plan
            .part_len
            .unwrap_or_else(|| partition_len(seqs, kv_heads, max_len));
        if !(1..=PARTITION).contains(&part_len) {
            return Err(KernelError::Shape(format!(
                "attention partitions of {part_len} tokens: 1 to {PARTITION}"
            )));
        }
        let group = heads / kv_heads.max(1);
        if group == 0 || group > 8 || !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::Shape(format!(
                "{heads} query heads over {kv_heads} KV heads: groups of 1 to 8 are supported"
            )));
        }
        // Elements per 16-byte piece (8 for fp8 groups above 4), as in
        // attention.cu; the threads of one vector must divide a warp.
        let piece = if kv.format == KvFormat::Fp8 && group <= 4 {
            16
        } else {
            8
        };
        let tpv = head_dim / piece;
        if !head_dim.is_multiple_of(piece) || tpv == 0 || !32usize.is_multiple_of(tpv) {
            return Err(KernelError::Shape(format!(
                "head_dim {head_dim}: paged attention supports 64, 128 and 256"
            )));
        }
        let pages_per_part = PARTITION.div_ceil(page_size) + 1;
        // The cp.async ring (16-byte pieces and their f32 scales), then
        // the queries, scores, softmax pieces, per-warp sums and pages.
        let ring = ATT_STAGES * ATT_THREADS * (16 + 4);
        let shared = ring
            + (group * head_dim
                + group * PARTITION
                + 2 * group
                + (ATT_THREADS / 32) * group * head_dim
                + pages_per_part)
                * 4;
        if shared > 48 << 10 {
            return Err(KernelError::Shape(format!(
                "{group} query heads per KV head of {head_dim} need {shared} bytes of shared memory"
            )));
        }
        let parts = max_len.div_ceil(part_len).max(1);
        if scratch.part_ml.len() < seqs * heads * parts * 2
            || scratch.part_out.len() < seqs * heads * parts * head_dim
        {
            return Err(KernelError::Shape(format!(
                "attention scratch too small for {seqs} sequences in {parts} partitions"
            )));
        }
        let fmt = match kv.format {
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8 => "fp8",
        };
        // Flash: a chunk of 16 tokens lies in one page.
        let flash_ok = matches!(head_dim, 64 | 128)
            && page_size.is_power_of_two()
            && page_size >= 16
            && part_len.is_multiple_of(16);
        let kind = match plan.kind {
            None if flash_ok => AttentionKind::Flash,
            None => AttentionKind::Shuffle,
            Some(AttentionKind::Flash) if !flash_ok => {
                return Err(KernelError::Shape(format!(
                    "flash attention needs head_dim 64 or 128, pages of a power of two of at least \
                     16 tokens and partitions of a multiple of 16 (head_dim {head_dim}, pages of \
                     {page_size}, partitions of {part_len})"
                )));
            }
            Some(k) => k,
        };
        let (name, threads, shared) = match kind {
            AttentionKind::Flash => (
                format!("attention_flash_{fmt}_g{group}_d{head_dim}"),
                FLASH_THREADS,
                flash_shared(group, head_dim, page_size, part_len),
            ),
            AttentionKind::Shuffle => (
                format!("attention_part_{fmt}_g{group}"),
                ATT_THREADS,
                shared,
            ),
        };
        let f = self.function(&name)?;
        let ints = [
            heads as i32,
            kv_heads as i32,
            head_dim as i32,
            page_size as i32,
            parts as i32,
            part_len as i32,
        ];
        let mut b = self.stream.launch_builder(f);
        b.arg(q)
            .arg(&kv.k)
            .arg(&kv.v)
            .arg(&kv.k_scale)
            .arg(&kv.v_scale);
        b.arg(tables).arg(table_off).arg(lens);
        b.arg(&mut scratch.part_out).arg(&mut scratch.part_ml);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&scale);
        let grid = (kv_heads as u32, seqs as u32, parts as u32);
        // SAFETY: shared memory as each kernel lays it out, sized above.
        unsafe { b.launch(cfg(grid, threads as u32, shared as u32)) }.map_err(cuda_err)?;
        let f = self.function("attention_merge")?;
        let (p, d) = (parts as i32, head_dim as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&scratch.part_out)
            .arg(&scratch.part_ml)
            .arg(out)
            .arg(&p)
            .arg(&d);
        // SAFETY: one block per (sequence, head).
        unsafe {
            b.launch(cfg(
                ((seqs * heads) as u32, 1, 1),
                head_dim.min(1024) as u32,
                0,
            ))
        }
        .map_err(cuda_err)?;
        Ok(())
    }

    /// The index of each row's largest value.
    pub fn argmax_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        n: usize,
        out: &mut CudaViewMut<'_, u32>,
    ) -> R {
        let f = self.function("argmax_rows")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&n_i).arg(out);
        // SAFETY: one block per row of n.
        unsafe { b.launch(cfg((rows as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out (m x n) = x (m x k) * w^T` with bf16 `w` (`n x k`): the custom
    /// GEMV up to [`super::gemv::BF16_GEMV_ROWS`] rows, cuBLAS (bf16 in,
    /// f32 accumulate and out) above.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        scratch: &mut CudaSlice<bf16>,
    ) -> R {
        if m <= super::gemv::BF16_GEMV_ROWS && k.is_multiple_of(8) {
            return self.gemv_bf16_parts(x, w, &mut [out], &[n], m, k);
        }
        self.cublas_bf16(x, w, out, m, n, k, scratch)
    }

    /// The first `len` activations rounded to bf16 into `scratch`, as
    /// every bf16 engine runs a GEMM (the CPU reference keeps f32; models
    /// stored as GGUF blocks take the f32 path of `Gpu::matmul` instead).
    pub(super) fn to_bf16_scratch(
        &self,
        x: &CudaSlice<f32>,
        scratch: &mut CudaSlice<bf16>,
        len: usize,
    ) -> R {
        if scratch.len() < len || x.len() < len {
            return Err(KernelError::Shape(format!(
                "bf16 scratch of {} for {len} activations",
                scratch.len()
            )));
        }
        let total = len as i64;
        let f = self.function("to_bf16")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&mut *scratch).arg(&total);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { b.launch(cfg((blocks(len, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// The cuBLAS path of [`Self::matmul_bf16`]; `scratch` holds `m x k`
    /// bf16 activations.
    #[allow(clippy::too_many_arguments)]
    pub fn cublas_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        scratch: &mut CudaSlice<bf16>,
    ) -> R {
        use cudarc::cublas::sys::cudaDataType_t;
        self.to_bf16_scratch(x, scratch, m * k)?;
        let (a, _ra) = w.device_ptr(&self.stream);
        let (bp, _rb) = scratch.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr(&self.stream);
        // SAFETY: live device buffers of the stated sizes (guards held).
        unsafe { self.gemm(a, bp, cudaDataType_t::CUDA_R_16BF, c, m, n, k, n) }?;
        Ok(())
    }

    /// cuBLAS, f32 accumulation and output: row-major `out (m x rows)`,
    /// leading dimension `ldc`, `= x (m x k) * w^T` for `w` (`rows x k`);
    /// `w` and `x` both of type `ty`.
    ///
    /// # Safety
    /// The pointers are live device buffers of those sizes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
        &self,
        w: u64,
        x: u64,
        ty: cudarc::cublas::sys::cudaDataType_t,
        out: u64,
        m: usize,
        rows: usize,
        k: usize,
        ldc: usize,
    ) -> R {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major out (m x rows) is column-major rows x m: out^T = w x^T.
        // SAFETY: the caller vouches for the pointers.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                m as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                ty,
                k as i32,
                x as *const _,
                ty,
                k as i32,
                (&beta) as *const f32 as *const _,
                out as *mut _,
                cudaDataType_t::CUDA_R_32F,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda_err)
    }

    /// `x[r] += b` for every row of `cols`.
    pub fn add_bias(
        &self,
        x: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> R {
        let f = self.function("add_bias")?;
        let (n, c) = ((rows * cols) as i64, cols as i32);
        let mut l = self.stream.launch_builder(f);
        l.arg(x).arg(b).arg(&n).arg(&c);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { l.launch(cfg((blocks(rows * cols, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out[i] = src[idx[i]]`, rows of `cols`.
    pub fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        idx: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> R {
        let f = self.function("gather_rows")?;
        let c = cols as i32;
        let mut l = self.stream.launch_builder(f);
        l.arg(src).arg(idx).arg(out).arg(&c);
        // SAFETY: indices are rows of `src`.
        unsafe { l.launch(cfg((rows as u32, 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
