//! Where a step runs: the CPU with its KV cache, or a GPU with its weights
//! and KV pages. Both take a [`Step`] and return a [`StepOut`].

use kiln_kernels::Device;
use kiln_kernels::kv::KvFormat;

use super::gpu::{GpuKv, GpuModel};
use super::step::{SeqOut, Step, StepOut};
use super::{KvCache, Loaded};

/// How a runner uses its device.
#[derive(Debug, Clone, Copy)]
pub struct RunnerOptions {
    /// Where the forward pass runs.
    pub device: Device,
    /// KV page format.
    pub kv_format: KvFormat,
    /// Tokens per page.
    pub page_size: usize,
    /// Pages in the pool.
    pub num_pages: usize,
    /// On CUDA: capture greedy decode steps as graphs and replay them.
    pub graphs: bool,
    /// On CUDA (sm_90 and up): graph kernels start while the one before
    /// them finishes.
    pub programmatic: bool,
    /// On CUDA: one-token steps with bf16 weights fold the norms into
    /// their GEMVs.
    pub fold: bool,
    /// On CUDA: prefill chunks attend with the tensor-core prefill kernel
    /// instead of one decode-attention query per token.
    pub tensor_prefill: bool,
    /// On CUDA: bf16 products of 2-16 rows run the skinny GEMM.
    pub skinny: bool,
    /// On CUDA: warps a block of prefill attention (4 or 8).
    pub prefill_warps: usize,
    /// On CUDA: prefill steps run the MLP in bf16.
    pub bf16_mlp: bool,
}

/// Where the KV pages live and the forward pass runs.
pub enum Runner {
    /// The CPU, with its KV cache.
    Cpu(KvCache),
    /// A GPU, with the weights and KV pages on it, and decode's own copy
    /// of the weights where the phases run on different ones.
    Gpu(Box<GpuModel>, Box<GpuKv>, Option<Box<GpuModel>>),
}

impl Runner {
    /// The runner `o` asks for. On a GPU it takes the weights a previous
    /// runner gave back, if they match.
    pub fn new(loaded: &Loaded, o: RunnerOptions) -> Result<Self, String> {
        Ok(match o.device {
            Device::Cpu => Runner::Cpu(KvCache::new(
                &loaded.model.config,
                o.kv_format,
                o.page_size,
                o.num_pages,
            )),
            Device::Cuda(n) => {
                let kept = loaded.gpu_weights.lock().ok().and_then(|mut s| s.take());
                let upload = |m: &super::Model| GpuModel::upload(m, n, o.graphs).map(Box::new);
                let (model, mut decode) = match kept {
                    Some((ordinal, model, decode))
                        if ordinal == n && model.uses_graphs() == o.graphs =>
                    {
                        (Ok(model), decode)
                    }
                    _ => {
                        let decode = loaded.decode.as_ref().map(upload).transpose();
                        (upload(&loaded.model), decode.map_err(|e| e.to_string())?)
                    }
                };
                let mut model = model.map_err(|e| e.to_string())?;
                for m in std::iter::once(&mut model).chain(decode.as_mut()) {
                    m.set_programmatic(o.programmatic);
                    m.set_fold(o.fold);
                    m.set_skinny(o.skinny);
                    m.set_bf16_mlp(o.bf16_mlp);
                    m.set_prefill_warps(o.prefill_warps)
                        .map_err(|e| e.to_string())?;
                }
                tracing::info!(device = model.device_name(), "model weights on the GPU");
                let mut kv = model
                    .kv(o.kv_format, o.page_size, o.num_pages)
                    .map_err(|e| e.to_string())?;
                kv.set_tensor_prefill(o.tensor_prefill);
                Runner::Gpu(model, Box::new(kv), decode)
            }
        })
    }

    /// Keeps a GPU's weights in `loaded` for the next runner.
    pub fn give_back(self, loaded: &Loaded) {
        if let Runner::Gpu(model, _, decode) = self
            && let Ok(mut slot) = loaded.gpu_weights.lock()
        {
            *slot = Some((model.ordinal(), model, decode));
        }
    }

    /// Whether it runs on a GPU (which checks page tags inside the step).
    pub fn on_gpu(&self) -> bool {
        matches!(self, Runner::Gpu(..))
    }

    /// Bytes of weights a decode step reads where the forward pass runs.
    pub fn weight_bytes(&self, loaded: &Loaded) -> usize {
        match self {
            Runner::Gpu(_, _, Some(decode)) => decode.weight_bytes(),
            Runner::Gpu(model, ..) => model.weight_bytes(),
            Runner::Cpu(_) => loaded
                .decode
                .as_ref()
                .unwrap_or(&loaded.model)
                .weight_bytes(),
        }
    }

    /// The device's copy bandwidth in GB/s, on a GPU.
    pub fn copy_bandwidth(&self) -> Option<f64> {
        match self {
            Runner::Gpu(model, ..) => model.copy_bandwidth().ok(),
            Runner::Cpu(_) => None,
        }
    }

    /// Runs one step; where the phases have their own weights, its
    /// one-token rows on decode's and the rest on prefill's, as two passes.
    pub fn forward(&mut self, loaded: &Loaded, step: &Step<'_>) -> Result<StepOut, String> {
        let phased = match self {
            Runner::Gpu(_, _, decode) => decode.is_some(),
            Runner::Cpu(_) => loaded.decode.is_some(),
        };
        if !phased {
            return self.pass(loaded, step, false);
        }
        match super::phase::split(step) {
            Err(all_decode) => self.pass(loaded, step, all_decode),
            Ok(split) => {
                let (prefill, decode) = split.steps(step);
                let p = self.pass(loaded, &prefill, false)?;
                let d = self.pass(loaded, &decode, true)?;
                Ok(super::phase::merge(step, &split.is_decode, p, d))
            }
        }
    }

    /// One forward pass, on decode's weights when `decode` and it has its
    /// own.
    fn pass(&mut self, loaded: &Loaded, step: &Step<'_>, decode: bool) -> Result<StepOut, String> {
        match self {
            Runner::Cpu(cache) => {
                let model = match (&loaded.decode, decode) {
                    (Some(d), true) => d,
                    _ => &loaded.model,
                };
                // The CPU is the device: all of the forward is its time.
                let start = std::time::Instant::now();
                let logits = model
                    .forward(cache, &step.seqs)
                    .map_err(|e| e.to_string())?;
                Ok(StepOut {
                    rows: logits.into_iter().map(SeqOut::Logits).collect(),
                    ok: vec![true; step.seqs.len()],
                    device: start.elapsed(),
                })
            }
            Runner::Gpu(model, kv, phase) => match (phase, decode) {
                (Some(d), true) => d.forward(kv, step),
                _ => model.forward(kv, step),
            }
            .map_err(|e| e.to_string()),
        }
    }
}
