//! The CUDA backend: weights resident on the device (GGUF blocks as
//! stored, anything else as bf16), paged KV (bf16 or fp8) on the device,
//! the operations of [`Ops`](super::arch::Ops) as kernel launches
//! ([`ops`]). The page-tag check runs inside the step (see [`step`]);
//! greedy sequences get their token from an argmax on the device, sampled
//! ones from a sampler on the device, others their logits.

mod fold;
mod inputs;
mod kv_io;
mod lane;
mod linear;
mod ops;
mod ranks;
mod step;
mod tune;

pub use fold::FoldFormats;
pub use kv_io::DevicePages;
use lane::LaneKv;
use linear::Linear;
pub use ranks::{GpuRank, RankSum, forward_ranks};

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{
    AttentionBuffers, CudaSlice, DeviceWeight, GemmScratch, Gpu, NormSum, PagedKv, Settle,
    prefill_supports,
};
use kiln_kernels::kv::{KvFormat, KvLayout};
use kiln_kernels::matmul::Weight;

use super::arch::{Backend, Convert, Decoder};
use super::cpu::{Host, Model};
use super::step::RunLane;
use super::{ModelConfig, ModelError};

type R<T> = Result<T, KernelError>;

/// Weights on a CUDA device.
pub(crate) struct Cuda;

impl Backend for Cuda {
    type Vector = CudaSlice<f32>;
    type Matrix = DeviceWeight;
    type Stack = Linear;

    fn matrix_bytes(m: &DeviceWeight) -> usize {
        m.size_bytes()
    }

    fn stack_bytes(s: &Linear) -> usize {
        s.size_bytes()
    }
}

/// Uploads host weights, noting whether any is block-quantized.
struct Upload<'a> {
    gpu: &'a Gpu,
    blocks: bool,
}

impl Upload<'_> {
    fn note(&mut self, w: &DeviceWeight) {
        self.blocks |= w.dequantizes();
    }
}

impl Convert<Host, Cuda> for Upload<'_> {
    fn vector(&mut self, v: &Vec<f32>) -> R<CudaSlice<f32>> {
        self.gpu.upload(v)
    }

    fn matrix(&mut self, m: &Weight) -> R<DeviceWeight> {
        let w = self.gpu.weight(m)?;
        self.note(&w);
        Ok(w)
    }

    fn stack(&mut self, s: &Vec<Weight>) -> R<Linear> {
        let ws: Vec<&Weight> = s.iter().collect();
        let l = Linear::upload(self.gpu, &ws)?;
        l.weights().for_each(|w| self.note(w));
        Ok(l)
    }
}

/// A model's weights on a GPU.
pub struct GpuModel {
    /// First, so its buffers outlive another lane's queued work.
    _settle: Settle,
    gpu: Gpu,
    /// The side lane's stream (`RunLane::Side`), once opened.
    side: Option<Gpu>,
    ordinal: usize,
    config: ModelConfig,
    weights: Decoder<Cuda>,
    inv_freq: CudaSlice<f32>,
    /// Whether any weight is block-quantized (its GEMMs need f32 scratch).
    blocks: bool,
    /// Whether greedy decode steps are captured as CUDA graphs.
    graphs: bool,
    /// Whether one-token steps fold their norms into the GEMVs (`fold.rs`;
    /// only for a model whose weights allow it).
    fold: bool,
    /// Whether steps of several rows run the MLP in bf16 (`ops.rs`; only
    /// for bf16 gate/up stacks and down projections).
    bf16_mlp: bool,
    /// Whether decode steps past the skinny GEMM's 16 rows run the bf16 MLP
    /// too.
    bf16_mlp_decode: bool,
    /// Whether decode steps' attention rotates the q/k/v rows and writes
    /// the keys and values itself (one launch a layer fewer).
    rope_in_attention: bool,
    /// How decode steps' attention launches run (the default: each picks).
    attention: kiln_kernels::cuda::AttentionPlan,
    /// Decode batches up to this size have their bf16 products tuned
    /// (`tune.rs`), with or without the bf16 MLP's product: weights a
    /// runner gives back keep their tuning.
    tuned: Option<(usize, bool)>,
    /// As one tensor-parallel rank: how its projections are summed over
    /// the ranks (`ranks.rs`).
    sum: Option<RankSum>,
}

/// Every layer's KV pages on the GPU, shared by the two lanes, and each
/// lane's own state (`lane.rs`).
pub struct GpuKv {
    /// First, so the pages outlive another lane's queued work.
    _settle: Settle,
    layers: Vec<PagedKv>,
    page_size: usize,
    /// Per lane ([`RunLane::index`](crate::model::step::RunLane::index)).
    lanes: [LaneKv; 2],
    /// Attend prefill chunks with the tensor-core prefill kernel.
    tensor_prefill: bool,
}

impl GpuKv {
    /// Attends prefill chunks with the tensor-core prefill kernel instead
    /// of one decode-attention query per token.
    pub fn set_tensor_prefill(&mut self, on: bool) {
        self.tensor_prefill = on;
    }

    /// Drops every lane's captured graphs (they are captured again as
    /// their shapes come back).
    pub fn drop_graphs(&mut self) {
        for lane in &mut self.lanes {
            lane.graphs.clear();
            lane.seen.clear();
        }
    }

    /// Steps, on either lane, that found new working buffers (and so
    /// dropped the captured graphs): the first step's, then each remake's.
    pub fn buffers_made(&self) -> u64 {
        self.lanes.iter().map(|l| l.made).sum()
    }
}

/// Activation buffers for up to `tokens` tokens attending over at most
/// `max_len` positions, and results for up to `rows` sequences.
struct Work {
    /// Just allocated (graphs captured on older buffers are stale).
    fresh: bool,
    tokens: usize,
    rows: usize,
    /// The step's inputs (32-bit words), one upload per step.
    inputs: CudaSlice<u32>,
    /// The buffers the launches write.
    b: Buffers,
}

/// The buffers a step's launches write, a row per token (`h` to `up`) or
/// per result (`last`, `logits`).
pub(super) struct Buffers {
    /// Final hidden rows of the sequences that want a result.
    pub last: CudaSlice<f32>,
    /// Their logits.
    pub logits: CudaSlice<f32>,
    /// Log-probabilities of the rows that asked (see
    /// `Gpu::top_logprobs_rows`), grown when a step needs more.
    pub scores: Option<CudaSlice<f32>>,
    /// Per sequence: its tag-check flag; then each result row's token.
    pub small: CudaSlice<u32>,
    /// The residual stream.
    pub h: CudaSlice<f32>,
    /// The normed rows the next projection reads.
    pub xn: CudaSlice<f32>,
    /// Queries (after RoPE).
    pub q: CudaSlice<f32>,
    /// Keys.
    pub k: CudaSlice<f32>,
    /// Values.
    pub v: CudaSlice<f32>,
    /// q, k and v side by side per token, as one stacked GEMM writes them.
    pub qkv: CudaSlice<f32>,
    /// The attention's output.
    pub attn: CudaSlice<f32>,
    /// A projection's output, added to `h` by the next norm.
    pub proj: CudaSlice<f32>,
    /// The MLP's gate (then its activation).
    pub gate: CudaSlice<f32>,
    /// The MLP's up projection.
    pub up: CudaSlice<f32>,
    /// The sum of squares a folded step's products pass on (`fold.rs`).
    pub norm_sum: NormSum,
    /// GEMM scratch (bf16 activations, dequantized blocks).
    pub scratch: GemmScratch,
    /// The bf16 MLP's gate and up projections side by side per row (only
    /// while [`GpuModel::set_bf16_mlp`] is on).
    pub gu16: Option<CudaSlice<half::bf16>>,
    /// Attention partitions' partial results.
    pub abuf: AttentionBuffers,
}

impl GpuModel {
    /// Opens GPU `ordinal` and uploads `model`'s weights (GGUF blocks as
    /// they are, other types as bf16); with `graphs`, greedy decode
    /// steps are captured as CUDA graphs and replayed.
    pub fn upload(model: &Model, ordinal: usize, graphs: bool) -> Result<Self, ModelError> {
        let e = |e: KernelError| ModelError::Unsupported(e.to_string());
        let gpu = Gpu::open(ordinal, graphs).map_err(e)?;
        let mut up = Upload {
            gpu: &gpu,
            blocks: false,
        };
        let weights = model.weights.convert(&mut up).map_err(e)?;
        let blocks = up.blocks;
        let mut uploaded = Self {
            weights,
            inv_freq: gpu.upload(model.rope.inv_freq()).map_err(e)?,
            blocks,
            graphs,
            config: model.config.clone(),
            _settle: gpu.settle(),
            gpu,
            side: None,
            ordinal,
            fold: false,
            bf16_mlp: false,
            bf16_mlp_decode: false,
            rope_in_attention: false,
            attention: Default::default(),
            tuned: None,
            sum: None,
        };
        uploaded.fold = uploaded.foldable(FoldFormats::default());
        Ok(uploaded)
    }

    /// Whether one-token steps fold their norms into the GEMVs, where the
    /// model's weights allow it (bf16 weights do by default; int4 tiles
    /// and FP8 rows where `q` allows them). Set it before [`Self::kv`]: a
    /// step captured as a graph keeps the path it was captured with.
    pub fn set_fold(&mut self, on: bool, q: FoldFormats) {
        self.fold = on && self.foldable(q) && self.sum.is_none();
    }

    /// Whether graphs captured from now on join consecutive kernels by
    /// programmatic edges (each kernel starts while the one before it
    /// finishes; sm_90 and up).
    pub fn set_programmatic(&mut self, on: bool) {
        self.gpus().for_each(|g| g.set_programmatic(on));
    }

    /// Whether steps of several rows run the MLP in bf16: one GEMM over
    /// the stacked gate/up weights writes bf16 (f32 accumulation), as
    /// PyTorch's bf16 models do, and SiLU-and-multiply reads it, half the
    /// bytes of f32 (only where every block's gate/up is one stack and
    /// gate/up and down read bf16 activations: bf16 weights, or FP8 rows
    /// packed for tensor cores; set before the first step).
    /// With `decode`, decode steps past the skinny GEMM's rows run it too.
    pub fn set_bf16_mlp(&mut self, on: bool, decode: bool) {
        let c = &self.config;
        let able = c.ffn.is_multiple_of(8)
            && self.weights.blocks.iter().all(|b| {
                let stack = matches!(&b.gate_up, Linear::Stacked { w, parts }
                    if parts[..] == [c.ffn, c.ffn] && linear::gemm_input(w));
                stack && linear::gemm_input(&b.down)
            });
        self.bf16_mlp = on && able;
        self.bf16_mlp_decode = self.bf16_mlp && decode;
    }

    /// Whether decode steps' attention rotates their q/k/v rows and writes
    /// the keys and values itself, where the flash kernel attends (set
    /// before graphs are captured).
    pub fn set_rope_in_attention(&mut self, on: bool) {
        self.rope_in_attention = on;
    }

    /// How decode steps' attention launches run: the flash kernel's
    /// build, a fused merge (set before graphs are captured; its partition
    /// length and kind are each launch's own).
    pub fn set_attention(&mut self, plan: kiln_kernels::cuda::AttentionPlan) {
        self.attention = kiln_kernels::cuda::AttentionPlan {
            part_len: None,
            kind: None,
            ..plan
        };
    }

    /// Whether bf16 products of 2-16 rows run the skinny GEMM instead of
    /// cuBLAS (set before graphs are captured, like the rest).
    pub fn set_skinny(&mut self, on: bool) {
        self.gpus().for_each(|g| g.set_skinny(on));
    }

    /// Whether int4 products of 2 to 8 rows run in one launch (set before
    /// graphs are captured).
    pub fn set_int4_rows(&mut self, on: bool) {
        self.gpus().for_each(|g| g.set_int4_rows(on));
    }

    /// Whether bf16 products of 17-64 rows run the cluster GEMM instead of
    /// cuBLAS (sm_90 and up; set before graphs are captured).
    pub fn set_cluster(&mut self, on: bool) {
        self.gpus().for_each(|g| g.set_cluster(on));
    }

    /// Warps a block of prefill attention takes (4 or 8).
    pub fn set_prefill_warps(&mut self, warps: usize) -> Result<(), kiln_kernels::KernelError> {
        self.gpus().try_for_each(|g| g.set_prefill_warps(warps))
    }

    /// Whether greedy decode steps are captured as CUDA graphs.
    pub fn uses_graphs(&self) -> bool {
        self.graphs
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weights.weight_bytes()
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus written).
    pub fn copy_bandwidth(&self) -> R<f64> {
        self.gpu.copy_bandwidth()
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.gpu.name()
    }

    /// Zeroed KV pages for every layer.
    pub fn kv(&self, format: KvFormat, page_size: usize, num_pages: usize) -> R<GpuKv> {
        let layout = KvLayout {
            page_size,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
        };
        let layers = (0..self.config.layers)
            .map(|_| self.gpu.paged_kv(format, layout, num_pages))
            .collect::<R<Vec<_>>>()?;
        let lanes = [
            LaneKv::new(self.gpu.zeros(2 * num_pages)?),
            LaneKv::new(self.gpu.zeros(2 * num_pages)?),
        ];
        // Zeroed before the engine serves: the side lane reads the pages
        // and its tags from its own stream, and a first step queued behind
        // the memset of many GiB of pages would wait milliseconds for it.
        self.gpu.synchronize()?;
        Ok(GpuKv {
            _settle: self.gpu.settle(),
            layers,
            page_size,
            lanes,
            tensor_prefill: false,
        })
    }

    /// Makes `lane`'s working buffers now for steps of up to `tokens`
    /// tokens, contexts of `max_len` and `rows` sequences: made on a first
    /// step instead, they would add the allocation's wait and mapping,
    /// about a millisecond, to that step, and fail for memory only once
    /// serving.
    pub fn reserve(
        &self,
        kv: &mut GpuKv,
        lane: RunLane,
        (tokens, max_len, rows): (usize, usize, usize),
    ) -> R<()> {
        let g = self.lane_gpu(lane);
        let page_size = kv.page_size;
        let lk = &mut kv.lanes[lane.index()];
        // Room for the inputs of a step that size: a few words a token and
        // a sequence, and each sequence's table and tags (five words a
        // page).
        let words = 8 * tokens + 64 * rows + 5 * rows * max_len.div_ceil(page_size);
        // Prompt chunks on tensor cores leave the decode-attention kernel
        // the decoding sequences alone.
        let c = &self.config;
        let queries = if kv.tensor_prefill && prefill_supports(c.heads, c.kv_heads, c.head_dim) {
            rows
        } else {
            tokens
        };
        let need = Need {
            tokens,
            rows,
            attend: (queries, max_len),
            words,
        };
        let work = self.work(g, &mut lk.work, need)?;
        lk.work = Some(work);
        g.synchronize()
    }

    /// Working buffers for a step that needs `need`, reused when they hold
    /// it. Remade, they are never smaller than before in any way (and sizes
    /// round up to powers of two): steps that alternate shapes, and the
    /// phases' two models on one lane, settle on one set after a remake or
    /// two instead of remaking it, and dropping the captured graphs, at
    /// every switch.
    fn work(&self, g: &Gpu, slot: &mut Option<Work>, need: Need) -> R<Work> {
        let c = &self.config;
        let (a_seqs, a_len) = need.attend;
        let old = slot.take();
        let fits = old.as_ref().is_some_and(|w| {
            w.tokens >= need.tokens
                && w.rows >= need.rows
                && w.b.abuf.holds(a_seqs, c.kv_heads, a_len)
                && (!self.bf16_mlp || w.b.gu16.is_some())
                && (!self.blocks || w.b.scratch.dequantizes())
        });
        if fits && let Some(w) = old {
            return grow_inputs(g, w, need.words);
        }
        // What the old set held, kept; the set itself is dropped before the
        // bigger one is made.
        let kept = old.map(|w| Kept {
            tokens: w.tokens,
            rows: w.rows,
            words: w.inputs.len(),
            attention: w.b.abuf.rows(),
            bf16_mlp: w.b.gu16.is_some(),
            blocks: w.b.scratch.dequantizes(),
        });
        let k = kept.unwrap_or_default();
        let n = need.tokens.max(k.tokens).next_power_of_two();
        let rows = need.rows.max(k.rows).next_power_of_two();
        let attend = (a_seqs.next_power_of_two(), a_len.next_power_of_two());
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let widest = c.hidden.max(c.ffn).max(q_dim);
        let blocks = self.blocks || k.blocks;
        let gu16 = self.bf16_mlp || k.bf16_mlp;
        let heads = (c.heads, c.kv_heads, c.head_dim);
        Ok(Work {
            fresh: true,
            tokens: n,
            rows,
            inputs: g.zeros(need.words.max(k.words).next_power_of_two())?,
            b: Buffers {
                last: g.zeros(rows * c.hidden)?,
                logits: g.zeros(rows * c.vocab)?,
                scores: None,
                small: g.zeros(2 * rows)?,
                h: g.zeros(n * c.hidden)?,
                xn: g.zeros(n * c.hidden)?,
                q: g.zeros(n * q_dim)?,
                k: g.zeros(n * kv_dim)?,
                v: g.zeros(n * kv_dim)?,
                qkv: g.zeros(n * (q_dim + 2 * kv_dim))?,
                attn: g.zeros(n * q_dim)?,
                proj: g.zeros(n * c.hidden)?,
                gate: g.zeros(n * c.ffn)?,
                up: g.zeros(n * c.ffn)?,
                norm_sum: g.norm_sum(c.hidden)?,
                scratch: g.gemm_scratch(n, widest, blocks)?,
                gu16: gu16.then(|| g.zeros(n * 2 * c.ffn)).transpose()?,
                abuf: g.attention_buffers(attend, heads, k.attention)?,
            },
        })
    }
}

/// What a step's working buffers must hold.
#[derive(Debug, Clone, Copy)]
pub(super) struct Need {
    /// Tokens in the step.
    pub tokens: usize,
    /// Sequences in the step (rows of results).
    pub rows: usize,
    /// Queries of the decode-attention kernel (a token each, or only the
    /// decoding sequences' where prompt chunks attend on tensor cores)
    /// and their longest context.
    pub attend: (usize, usize),
    /// 32-bit words of the step's inputs.
    pub words: usize,
}

/// What working buffers about to be replaced held.
#[derive(Debug, Default)]
struct Kept {
    tokens: usize,
    rows: usize,
    /// Words of the inputs.
    words: usize,
    /// Attention partitions.
    attention: usize,
    bf16_mlp: bool,
    /// The dequantizing weights' scratch.
    blocks: bool,
}

/// `w` with an input buffer of at least `words`, made on `g`'s lane.
fn grow_inputs(g: &Gpu, mut w: Work, words: usize) -> R<Work> {
    if w.inputs.len() < words {
        w.inputs = g.zeros(words.next_power_of_two())?;
        w.fresh = true;
    }
    Ok(w)
}
