//! Where a step runs: the CPU with its KV cache, or a GPU with its weights
//! and KV pages. Both take the scheduler's batch and return one result per
//! sequence that asked, with the device check's verdicts.

use crate::model::gpu::{GpuKv, GpuModel, SeqOut, StepOut, StepTags};
use crate::model::{BatchSeq, KvCache, Loaded};
use kiln_kernels::Device;

use super::block_pool::PageTag;
use super::{EngineConfig, PAGE_SIZE};

/// Where the KV pages live and the forward pass runs.
pub(super) enum Runner {
    Cpu(KvCache),
    Gpu(Box<GpuModel>, Box<GpuKv>),
}

impl Runner {
    /// The runner `config` asks for, with `num_pages` KV pages. On a GPU
    /// it takes the weights a previous engine gave back, if they match.
    pub(super) fn new(
        loaded: &Loaded,
        config: &EngineConfig,
        num_pages: usize,
    ) -> Result<Self, String> {
        Ok(match config.device {
            Device::Cpu => Runner::Cpu(KvCache::new(
                &loaded.model.config,
                config.kv_format,
                PAGE_SIZE,
                num_pages,
            )),
            Device::Cuda(n) => {
                let kept = loaded.gpu_weights.lock().ok().and_then(|mut s| s.take());
                let graphs = config.cuda_graphs;
                let mut model = match kept {
                    Some((ordinal, model)) if ordinal == n && model.uses_graphs() == graphs => {
                        model
                    }
                    _ => Box::new(
                        GpuModel::upload(&loaded.model, n, graphs).map_err(|e| e.to_string())?,
                    ),
                };
                model.set_programmatic(config.cuda_pdl);
                model.set_fold(config.cuda_fold);
                tracing::info!(device = model.device_name(), "model weights on the GPU");
                let mut kv = model
                    .kv(config.kv_format, PAGE_SIZE, num_pages)
                    .map_err(|e| e.to_string())?;
                kv.set_flash_prefill(config.flash_prefill);
                Runner::Gpu(model, Box::new(kv))
            }
        })
    }

    /// Keeps a GPU's weights in `loaded` for the next engine.
    pub(super) fn give_back(self, loaded: &Loaded) {
        if let Runner::Gpu(model, _) = self
            && let Ok(mut slot) = loaded.gpu_weights.lock()
        {
            *slot = Some((model.ordinal(), model));
        }
    }

    pub(super) fn on_gpu(&self) -> bool {
        matches!(self, Runner::Gpu(..))
    }

    pub(super) fn forward(
        &mut self,
        loaded: &Loaded,
        batch: &[BatchSeq<'_>],
        tags: StepTags<'_>,
    ) -> Result<StepOut, String> {
        match self {
            Runner::Cpu(cache) => {
                // The CPU is the device: all of the forward is its time.
                let start = std::time::Instant::now();
                let logits = loaded
                    .model
                    .forward(cache, batch)
                    .map_err(|e| e.to_string())?;
                Ok(StepOut {
                    rows: logits.into_iter().map(SeqOut::Logits).collect(),
                    ok: vec![true; batch.len()],
                    device: start.elapsed(),
                })
            }
            Runner::Gpu(model, kv) => model.forward(kv, batch, tags).map_err(|e| e.to_string()),
        }
    }
}

pub(super) fn tag_words(t: &PageTag) -> [u64; 2] {
    [t.generation, t.tenant.0 as u64]
}
