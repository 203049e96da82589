//! The llama forward pass on a CUDA GPU: weights resident on the device
//! (GGUF blocks as stored, anything else as bf16), paged KV (bf16 or fp8)
//! on the device, the same [`BatchSeq`] contract as the CPU path. The
//! page-tag check runs inside the step (see [`step`]); greedy sequences get
//! their token from an argmax on the device, others their logits.
//!
//! Prefill tokens still attend through the decode attention kernel, one
//! query per token (correct, not yet flash-style).

mod fold;
mod inputs;
mod linear;
mod step;

use linear::Linear;

pub use step::{SeqOut, StepOut, StepTags};

use std::collections::{HashMap, HashSet};

use kiln_kernels::cuda::Graph;
use step::GraphKey;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{
    AttentionBuffers, CudaSlice, DeviceWeight, GemmScratch, Gpu, NormSum, PagedKv,
};
use kiln_kernels::kv::{KvFormat, KvLayout};

#[cfg(doc)]
use super::llama::BatchSeq;
use super::llama::Model;
use super::{ModelConfig, ModelError};

type R<T> = Result<T, KernelError>;

/// One block's weights on the device.
struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    /// q, k and v.
    qkv: Linear,
    wo: DeviceWeight,
    bias: Option<[CudaSlice<f32>; 3]>,
    ffn_norm: CudaSlice<f32>,
    /// gate and up.
    gate_up: Linear,
    w_down: DeviceWeight,
}

/// A model's weights on a GPU.
pub struct GpuModel {
    gpu: Gpu,
    ordinal: usize,
    config: ModelConfig,
    embed: DeviceWeight,
    layers: Vec<GpuLayer>,
    norm: CudaSlice<f32>,
    output: Option<DeviceWeight>,
    inv_freq: CudaSlice<f32>,
    /// Whether any weight is block-quantized (its GEMMs need f32 scratch).
    blocks: bool,
    /// Whether greedy decode steps are captured as CUDA graphs.
    graphs: bool,
    /// Whether one-token steps fold their norms into the GEMVs (`fold.rs`;
    /// only for a model whose weights allow it).
    fold: bool,
}

/// Every layer's KV pages on the GPU, and the step's working buffers,
/// kept across steps and grown when a step needs more.
pub struct GpuKv {
    layers: Vec<PagedKv>,
    page_size: usize,
    /// Every page's current tag, two u64 words each, as the block pool
    /// last reported it.
    tags: CudaSlice<u64>,
    work: Option<Work>,
    /// Captured decode steps; cleared whenever the working buffers they
    /// point into are replaced.
    graphs: HashMap<GraphKey, Graph>,
    /// Shapes met once (captured when they come again).
    seen: HashSet<GraphKey>,
    /// Attend prefill chunks with the flash-style prefill kernel.
    flash_prefill: bool,
}

impl GpuKv {
    /// Uses the flash-style prefill kernel for steps with prefill chunks.
    pub fn set_flash_prefill(&mut self, on: bool) {
        self.flash_prefill = on;
    }
}

/// Activation buffers for up to `tokens` tokens attending over at most
/// `max_len` positions, and results for up to `rows` sequences.
struct Work {
    /// Just allocated (graphs captured on older buffers are stale).
    fresh: bool,
    tokens: usize,
    max_len: usize,
    rows: usize,
    /// The step's inputs (32-bit words), one upload per step.
    inputs: CudaSlice<u32>,
    /// Final hidden rows of the sequences that want a result.
    last: CudaSlice<f32>,
    /// Their logits.
    logits: CudaSlice<f32>,
    /// Per sequence: its tag-check flag; then each result row's argmax.
    small: CudaSlice<u32>,
    h: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    /// q, k and v side by side per token, as one stacked GEMM writes them.
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    /// The sum of squares a folded step's products pass on (`fold.rs`).
    norm_sum: NormSum,
    scratch: GemmScratch,
    abuf: AttentionBuffers,
}

impl GpuModel {
    /// Opens GPU `ordinal` and uploads `model`'s weights (GGUF blocks as
    /// they are, other types as bf16); with `graphs`, greedy decode
    /// steps are captured as CUDA graphs and replayed.
    pub fn upload(model: &Model, ordinal: usize, graphs: bool) -> Result<Self, ModelError> {
        let e = |e: KernelError| ModelError::Unsupported(e.to_string());
        let gpu = Gpu::open(ordinal, graphs).map_err(e)?;
        let layers = model
            .layers
            .iter()
            .map(|l| -> R<GpuLayer> {
                Ok(GpuLayer {
                    attn_norm: gpu.upload(&l.attn_norm)?,
                    qkv: Linear::upload(&gpu, &[&l.wq, &l.wk, &l.wv])?,
                    wo: gpu.weight(&l.wo)?,
                    bias: match &l.bias {
                        Some([q, k, v]) => Some([gpu.upload(q)?, gpu.upload(k)?, gpu.upload(v)?]),
                        None => None,
                    },
                    ffn_norm: gpu.upload(&l.ffn_norm)?,
                    gate_up: Linear::upload(&gpu, &[&l.w_gate, &l.w_up])?,
                    w_down: gpu.weight(&l.w_down)?,
                })
            })
            .collect::<R<Vec<_>>>()
            .map_err(e)?;
        let embed = gpu.weight(&model.embed).map_err(e)?;
        let output = model
            .output
            .as_ref()
            .map(|w| gpu.weight(w))
            .transpose()
            .map_err(e)?;
        let blocks = [&embed]
            .into_iter()
            .chain(output.as_ref())
            .chain(layers.iter().flat_map(|l| {
                [&l.wo, &l.w_down]
                    .into_iter()
                    .chain(l.qkv.weights())
                    .chain(l.gate_up.weights())
            }))
            .any(|w| matches!(w, DeviceWeight::Blocks { .. }));
        let mut uploaded = Self {
            output,
            norm: gpu.upload(&model.norm).map_err(e)?,
            embed,
            inv_freq: gpu.upload(model.rope.inv_freq()).map_err(e)?,
            blocks,
            graphs,
            layers,
            config: model.config.clone(),
            gpu,
            ordinal,
            fold: false,
        };
        uploaded.fold = uploaded.foldable();
        Ok(uploaded)
    }

    /// Whether one-token steps fold their norms into the GEMVs, where the
    /// model's weights allow it (they do by default). Set it before
    /// [`Self::kv`]: a step captured as a graph keeps the path it was
    /// captured with.
    pub fn set_fold(&mut self, on: bool) {
        self.fold = on && self.foldable();
    }

    /// Whether graphs captured from now on join consecutive kernels by
    /// programmatic edges (each kernel starts while the one before it
    /// finishes; sm_90 and up).
    pub fn set_programmatic(&mut self, on: bool) {
        self.gpu.set_programmatic(on);
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
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_bytes()
                    + l.gate_up.size_bytes()
                    + l.wo.size_bytes()
                    + l.w_down.size_bytes()
            })
            .sum();
        layers + self.output.as_ref().unwrap_or(&self.embed).size_bytes()
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
        Ok(GpuKv {
            layers,
            page_size,
            tags: self.gpu.zeros(2 * num_pages)?,
            work: None,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            flash_prefill: false,
        })
    }

    /// Working buffers for `n` tokens and contexts up to `max_len`, reused
    /// when big enough (sizes round up to powers of two, so a growing
    /// batch reallocates only a few times).
    fn work(
        &self,
        slot: &mut Option<Work>,
        n: usize,
        max_len: usize,
        rows: usize,
        words: usize,
    ) -> R<Work> {
        // A buffer set too small is dropped before the bigger one is made.
        if let Some(w) = slot.take()
            && w.tokens >= n
            && w.max_len >= max_len
            && w.rows >= rows
        {
            return self.grow_inputs(w, words);
        }
        let c = &self.config;
        let g = &self.gpu;
        let n = n.next_power_of_two();
        let max_len = max_len.next_power_of_two();
        let rows = rows.next_power_of_two();
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let widest = c.hidden.max(c.ffn).max(q_dim);
        Ok(Work {
            fresh: true,
            tokens: n,
            max_len,
            rows,
            inputs: g.zeros(words.next_power_of_two())?,
            last: g.zeros(rows * c.hidden)?,
            logits: g.zeros(rows * c.vocab)?,
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
            scratch: g.gemm_scratch(n, widest, self.blocks)?,
            abuf: g.attention_buffers(n, c.heads, c.kv_heads, c.head_dim, max_len)?,
        })
    }

    /// `w` with an input buffer of at least `words`.
    fn grow_inputs(&self, mut w: Work, words: usize) -> R<Work> {
        if w.inputs.len() < words {
            w.inputs = self.gpu.zeros(words.next_power_of_two())?;
            w.fresh = true;
        }
        Ok(w)
    }
}
