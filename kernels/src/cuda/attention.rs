//! Paged decode attention: the plans, the partitioning and the launch of
//! the flash (tensor-core) and shuffle kernels, with their merge.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};

use super::attention_plan::{
    FLASH_MAX_PARTITION, FLASH_THREADS, FlashBuild, PARTITION, attention_rows, build_name,
    flash_kernels, flash_shared, one_wave_of_four, partition_len, split_len,
};
use super::kv::PagedKv;
use super::kv::push_pages;
use super::launch::cfg;
use super::rope::RopeIn;
use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::{KvFormat, KvLayout};

type R<T = ()> = Result<T, KernelError>;

/// How a decode attention launch runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Tokens per partition; `None`: [`partition_len`]'s choice.
    pub part_len: Option<usize>,
    /// The kernel; `None`: the best the device and shape allow.
    pub kind: Option<AttentionKind>,
    /// The flash kernel's build, where the kernel has it (else the plain
    /// one); `None`: over fp8 pages with heads of 128, the build of four
    /// blocks an SM where the launch's blocks overflow one wave of three
    /// an SM and fit one of four, else the plain one. Other launches
    /// ignore it.
    pub build: Option<FlashBuild>,
    /// Where the flash kernel splits sequences into partitions, the block
    /// of each sequence and KV head that finishes last merges them, and no
    /// merge launch follows (the output differs from the merge launch's in
    /// the order of its sums). Other launches ignore it.
    pub fused_merge: bool,
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

/// The queries of a paged attention launch (decode or prefill) and the
/// pages each reads.
#[derive(Clone, Copy)]
pub struct PagedQuery<'a> {
    /// The queries (`queries x heads x head_dim`).
    pub q: &'a CudaSlice<f32>,
    /// Every block table the queries read, concatenated.
    pub tables: &'a CudaView<'a, i32>,
    /// Where each query's block table starts in `tables`.
    pub table_off: &'a CudaView<'a, i32>,
    /// How many keys each query attends to (from the first).
    pub lens: &'a CudaView<'a, i32>,
    /// Query heads.
    pub heads: usize,
    /// The scores' scale.
    pub scale: f32,
}

/// Where an attention launch writes its output rows (`queries x heads x
/// head_dim`).
pub enum AttnOut<'a> {
    /// f32 rows.
    F32(&'a mut CudaSlice<f32>),
    /// bf16 rows (rounded to nearest, as `to_bf16` rounds them): the
    /// activations of the GEMM that reads them next, with no conversion
    /// launch between.
    Bf16(&'a mut CudaSlice<half::bf16>),
}

impl AttnOut<'_> {
    /// Pushes the kernels' two output pointers: the one written, and null.
    pub(super) fn push<'b>(&'b mut self, b: &mut cudarc::driver::LaunchArgs<'b>, null: &'b u64) {
        match self {
            AttnOut::F32(out) => {
                b.arg(&mut **out).arg(null);
            }
            AttnOut::Bf16(out) => {
                b.arg(null).arg(&mut **out);
            }
        }
    }
}

/// A decode attention batch: one query per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeBatch {
    /// Sequences (queries).
    pub seqs: usize,
    /// The longest sequence's length: what the partitions cover.
    pub max_len: usize,
}

/// Scratch for split attention, sized for `seqs x heads x parts x head_dim`.
pub struct AttentionBuffers {
    part_out: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// A fused merge's counters, one per sequence and KV head, zero
    /// between launches (the merging block zeroes its own).
    done: CudaSlice<u32>,
    /// Partitions (of every head) it holds.
    rows: usize,
}

impl AttentionBuffers {
    /// Whether it holds attention over up to `seqs` sequences of at most
    /// `max_len`.
    pub fn holds(&self, seqs: usize, kv_heads: usize, max_len: usize) -> bool {
        self.rows >= attention_rows(seqs, kv_heads, max_len)
    }

    /// Partitions (of every head) it holds.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Threads of a decode attention block (`ATT_THREADS` in the source).
const ATT_THREADS: usize = 128;

/// Slots of its cp.async ring per thread (`ATT_STAGES`).
const ATT_STAGES: usize = 4;

/// Blocks of each flash kernel the device runs at once (blocks per SM, as
/// the driver computes it for the kernel's registers and the shared memory
/// of its longest partitions, times `sms`): what [`partition_len`] fills
/// whole waves of.
pub(super) fn flash_resident(
    function: impl Fn(&str) -> R<cudarc::driver::CudaFunction>,
    sms: usize,
) -> R<std::collections::HashMap<String, usize>> {
    let mut resident = std::collections::HashMap::new();
    for k in flash_kernels() {
        let shared = flash_shared(k.group, k.hd, 16, FLASH_MAX_PARTITION);
        let f = function(&k.name)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(FLASH_THREADS as u32, shared, None)
            .map_err(cuda_err)?;
        resident.insert(k.name, per_sm.max(1) as usize * sms);
    }
    Ok(resident)
}

/// Shared memory of a shuffle launch, as attention.cu lays it out: the
/// cp.async ring (16-byte pieces and their f32 scales), then the queries,
/// scores, softmax pieces, per-warp sums and pages. Errors for head sizes
/// and groups it cannot take.
fn shuffle_shared(format: KvFormat, group: usize, head_dim: usize, page_size: usize) -> R<usize> {
    // Elements per 16-byte piece (8 for fp8 groups above 4), as in
    // attention.cu; the threads of one vector must divide a warp.
    let piece = if format.is_fp8() && group <= 4 { 16 } else { 8 };
    let tpv = head_dim / piece;
    if !head_dim.is_multiple_of(piece) || tpv == 0 || !32usize.is_multiple_of(tpv) {
        return Err(KernelError::Shape(format!(
            "head_dim {head_dim}: paged attention supports 64, 128 and 256"
        )));
    }
    let pages_per_part = PARTITION.div_ceil(page_size) + 1;
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
    Ok(shared)
}

impl Gpu {
    /// Scratch for attention over up to `seqs` sequences of at most
    /// `max_len` (for every batch size up to `seqs`: smaller batches split
    /// into more partitions), and at least `at_least` partitions (what
    /// [`AttentionBuffers::rows`] of buffers it replaces held).
    pub fn attention_buffers(
        &self,
        (seqs, max_len): (usize, usize),
        (heads, kv_heads, hd): (usize, usize, usize),
        at_least: usize,
    ) -> R<AttentionBuffers> {
        let rows = attention_rows(seqs, kv_heads, max_len).max(at_least);
        let s = &self.stream;
        Ok(AttentionBuffers {
            part_out: s.alloc_zeros(rows * heads * hd).map_err(cuda_err)?,
            part_ml: s.alloc_zeros(rows * heads * 2).map_err(cuda_err)?,
            done: s.alloc_zeros(rows * kv_heads).map_err(cuda_err)?,
            rows,
        })
    }

    /// Decode attention of one query token per sequence over its pages:
    /// `query.q` is `seqs x heads x head_dim`; sequence `s`'s block table
    /// is `tables[table_off[s]..]`, its length `lens[s]` (at most
    /// `max_len`). `plan` says how to split and which kernel runs (the
    /// default: partitions sized for the batch, the flash kernel where the
    /// shape allows it).
    pub fn paged_attention(
        &self,
        kv: &PagedKv,
        query: &PagedQuery<'_>,
        batch: DecodeBatch,
        plan: AttentionPlan,
        scratch: &mut AttentionBuffers,
        out: &mut CudaSlice<f32>,
    ) -> R {
        self.paged_attention_to(kv, query, batch, plan, scratch, AttnOut::F32(out))
    }

    /// As [`Self::paged_attention`], writing `out` (f32 or bf16 rows).
    pub fn paged_attention_to(
        &self,
        kv: &PagedKv,
        query: &PagedQuery<'_>,
        batch: DecodeBatch,
        plan: AttentionPlan,
        scratch: &mut AttentionBuffers,
        out: AttnOut<'_>,
    ) -> R {
        // SAFETY: no rows to rotate: the kernels read only `query`.
        unsafe { self.attention_launch(kv, query, batch, plan, scratch, out, RopeIn::default()) }
    }

    /// Which build of flash kernel `name` a launch of `blocks` blocks runs
    /// (see [`AttentionPlan::build`]).
    fn flash_build(&self, name: String, plan: AttentionPlan, blocks: usize) -> String {
        let build = plan.build.unwrap_or_else(|| {
            let resident = |n: Option<String>| {
                n.and_then(|n| self.flash_resident.get(&n).copied())
                    .unwrap_or(0)
            };
            let four = resident(build_name(&name, FlashBuild::FourAnSm));
            if one_wave_of_four(blocks, resident(Some(name.clone())), four) {
                FlashBuild::FourAnSm
            } else {
                FlashBuild::Plain
            }
        });
        build_name(&name, build).unwrap_or(name)
    }

    /// The decode attention launches; a flash launch rotates and writes
    /// what `rope` points at first (see [`RopeIn`]).
    ///
    /// # Safety
    /// A `rope` with rows must point at the step's stacked q/k/v rows,
    /// positions, frequencies and slots as [`RopeIn`] says, each as long as
    /// the batch needs, and `kv` must be the pages its slots name.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn attention_launch(
        &self,
        kv: &PagedKv,
        query: &PagedQuery<'_>,
        batch: DecodeBatch,
        plan: AttentionPlan,
        scratch: &mut AttentionBuffers,
        mut out: AttnOut<'_>,
        rope: RopeIn,
    ) -> R {
        let PagedQuery {
            q,
            tables,
            table_off,
            lens,
            heads,
            scale,
        } = *query;
        let DecodeBatch { seqs, max_len } = batch;
        let KvLayout {
            kv_heads,
            head_dim,
            page_size,
        } = kv.layout;
        let group = heads / kv_heads.max(1);
        if group == 0 || group > 8 || !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::Shape(format!(
                "{heads} query heads over {kv_heads} KV heads: groups of 1 to 8 are supported"
            )));
        }
        // Flash: head sizes 64 and 128, and a chunk of 16 tokens lies in
        // one page; its partitions, multiples of 16.
        let flash_shape =
            matches!(head_dim, 64 | 128) && page_size.is_power_of_two() && page_size >= 16;
        let flash_len = |len: usize| flash_shape && len.is_multiple_of(16);
        let kind = match (plan.kind, plan.part_len) {
            (Some(k), _) => k,
            (None, Some(len)) if !flash_len(len) => AttentionKind::Shuffle,
            (None, _) if flash_shape => AttentionKind::Flash,
            (None, _) => AttentionKind::Shuffle,
        };
        let fmt = match kv.format {
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8 | KvFormat::Fp8Static => "fp8",
        };
        let flash_name = format!("attention_flash_{fmt}_g{group}_d{head_dim}");
        let (part_len, most) = match kind {
            AttentionKind::Flash => {
                let resident = self.flash_resident.get(&flash_name).copied();
                let len = plan.part_len.unwrap_or_else(|| {
                    partition_len(seqs, kv_heads, max_len, resident.unwrap_or(1))
                });
                (len, FLASH_MAX_PARTITION)
            }
            AttentionKind::Shuffle => (
                plan.part_len
                    .unwrap_or_else(|| split_len(seqs, kv_heads, max_len, PARTITION)),
                PARTITION,
            ),
        };
        if !(1..=most).contains(&part_len) {
            return Err(KernelError::Shape(format!(
                "{kind:?} attention takes partitions of 1 to {most} tokens, not {part_len}"
            )));
        }
        if kind == AttentionKind::Flash && !flash_len(part_len) {
            return Err(KernelError::Shape(format!(
                "flash attention needs head_dim 64 or 128, pages of a power of two of at least \
                 16 tokens and partitions of a multiple of 16 (head_dim {head_dim}, pages of \
                 {page_size}, partitions of {part_len})"
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
        // The merge keeps a weight per partition in shared memory.
        let merge_shared = parts * 4;
        if merge_shared > 48 << 10 {
            return Err(KernelError::Shape(format!(
                "{parts} attention partitions: the merge takes at most {}",
                (48 << 10) / 4
            )));
        }
        let (name, threads, shared) = match kind {
            AttentionKind::Flash => {
                let name = self.flash_build(flash_name, plan, kv_heads * seqs * parts);
                let shared = flash_shared(group, head_dim, page_size, part_len);
                (name, FLASH_THREADS, shared)
            }
            AttentionKind::Shuffle => (
                format!("attention_part_{fmt}_g{group}"),
                ATT_THREADS,
                shuffle_shared(kv.format, group, head_dim, page_size)?,
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
        b.arg(q);
        push_pages(&mut b, kv);
        b.arg(tables).arg(table_off).arg(lens);
        b.arg(&mut scratch.part_out).arg(&mut scratch.part_ml);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&scale);
        // One flash partition: the kernel normalizes its output itself; or
        // several, merged by each sequence's last block.
        let direct = kind == AttentionKind::Flash && parts == 1;
        let fused = kind == AttentionKind::Flash && parts > 1 && plan.fused_merge;
        if fused && scratch.done.len() < seqs * kv_heads {
            return Err(KernelError::Shape(format!(
                "attention scratch holds the merge counters of {} sequences, not {seqs}",
                scratch.done.len() / kv_heads.max(1)
            )));
        }
        let null = 0u64;
        if direct || fused {
            out.push(&mut b, &null);
        } else if kind == AttentionKind::Flash {
            b.arg(&null).arg(&null);
        }
        if kind == AttentionKind::Flash {
            if fused {
                b.arg(&mut scratch.done);
            } else {
                b.arg(&null);
            }
            b.arg(&rope);
        } else if rope.rotates() {
            return Err(KernelError::Shape(
                "only the flash kernel rotates and writes a step's keys itself".into(),
            ));
        }
        let grid = (kv_heads as u32, seqs as u32, parts as u32);
        // SAFETY: shared memory as each kernel lays it out, sized above.
        unsafe { b.launch(cfg(grid, threads as u32, shared as u32)) }.map_err(cuda_err)?;
        if direct || fused {
            return Ok(());
        }
        let f = self.function("attention_merge")?;
        let (p, d) = (parts as i32, head_dim as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&scratch.part_out).arg(&scratch.part_ml);
        out.push(&mut b, &null);
        b.arg(&p).arg(&d);
        // SAFETY: one block per (sequence, head), its weights in shared
        // memory sized above.
        unsafe {
            b.launch(cfg(
                ((seqs * heads) as u32, 1, 1),
                // Whole warps: the merge reduces over the block.
                head_dim.next_multiple_of(32).min(1024) as u32,
                merge_shared as u32,
            ))
        }
        .map_err(cuda_err)?;
        Ok(())
    }
}
