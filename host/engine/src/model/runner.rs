//! Where a step runs: the CPU with its KV cache, or a GPU with its weights
//! and KV pages. Both take a [`Step`] and return a [`StepOut`], on one of
//! two lanes ([`RunLane`]): a step launched on a lane is finished apart,
//! so a step on the other lane can run meanwhile (on a GPU, on another
//! stream; on the CPU, and for a step split by phase, the work is done at
//! launch).

use kiln_kernels::Device;
use kiln_kernels::kv::KvFormat;

use super::cpu_tp::rank_parts;
use super::gpu::{DevicePages, GpuKv, GpuModel, GpuRank, forward_ranks};
use super::step::{RunLane, SeqOut, Step, StepOut};
use super::{KvCache, Loaded, TpModel};

#[path = "runner_gpu.rs"]
mod gpu_place;
use gpu_place::{gpu_place, gpu_ranks};

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
    /// Tensor-parallel ranks the model is split over (1: whole). On the
    /// CPU each rank is a part of every step's work; a GPU runs one rank.
    pub ranks: usize,
    /// On CUDA: capture greedy decode steps as graphs and replay them.
    pub graphs: bool,
    /// On CUDA (sm_90 and up): graph kernels start while the one before
    /// them finishes.
    pub programmatic: bool,
    /// On CUDA: one-token steps with bf16 weights fold the norms into
    /// their GEMVs.
    pub fold: bool,
    /// On CUDA: with `fold`, one-token steps with int4 tiles fold too.
    pub fold_int4: bool,
    /// On CUDA: with `fold`, one-token steps with FP8 rows fold too.
    pub fold_fp8: bool,
    /// On CUDA: int4 products of 2 to 8 rows run in one launch.
    pub int4_rows: bool,
    /// On CUDA: decode's bf16 products run cuBLASLt's algorithms tuned at
    /// load where they beat cuBLAS's own choice.
    pub tune_bf16: bool,
    /// On CUDA: prefill chunks attend with the tensor-core prefill kernel
    /// instead of one decode-attention query per token.
    pub tensor_prefill: bool,
    /// On CUDA: bf16 products of 2-16 rows run the skinny GEMM.
    pub skinny: bool,
    /// On CUDA: bf16 products of 17-64 rows run the cluster GEMM.
    pub cluster: bool,
    /// On CUDA: decode steps' attention rotates the q/k/v rows and writes
    /// the keys and values itself.
    pub rope_in_attention: bool,
    /// On CUDA: how decode steps' attention launches run.
    pub attention: kiln_kernels::cuda::AttentionPlan,
    /// On CUDA: warps a block of prefill attention (4 or 8).
    pub prefill_warps: usize,
    /// On CUDA: prefill steps run the MLP in bf16.
    pub bf16_mlp: bool,
    /// On CUDA: with `bf16_mlp`, decode steps past 16 sequences too.
    pub bf16_mlp_decode: bool,
    /// Open the side lane (its own stream on a GPU).
    pub side_lane: bool,
    /// On CUDA: working buffers made at start for steps of up to this
    /// many tokens and sequences (the scheduler's limits) over contexts as
    /// long as a step's tokens, so the first steps wait on no allocation
    /// (a step that outgrows them in any way remakes them at its size).
    pub reserve: Reserve,
}

/// Pages' contents on their way from one runner to another.
pub enum PageBytes {
    /// On the host.
    Host(Vec<u8>),
    /// In buffers on the GPUs that read them, one a rank (one for a
    /// whole model), each rank's bytes in turn.
    Device(Vec<DevicePages>),
}

impl PageBytes {
    /// Bytes.
    pub fn len(&self) -> usize {
        match self {
            PageBytes::Host(h) => h.len(),
            PageBytes::Device(d) => d.iter().map(DevicePages::len).sum(),
        }
    }

    /// Whether it holds no page.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes on the host (downloaded from a GPU's buffer).
    fn to_host(&self) -> Result<std::borrow::Cow<'_, [u8]>, String> {
        match self {
            PageBytes::Host(h) => Ok(std::borrow::Cow::Borrowed(h)),
            PageBytes::Device(d) => {
                let mut host = Vec::with_capacity(self.len());
                for rank in d {
                    host.extend(rank.to_host().map_err(|e| e.to_string())?);
                }
                Ok(std::borrow::Cow::Owned(host))
            }
        }
    }
}

/// The largest step a runner's working buffers are made for at start.
#[derive(Debug, Clone, Copy)]
pub struct Reserve {
    /// Tokens in one step.
    pub tokens: usize,
    /// Sequences in one step.
    pub rows: usize,
}

/// Where the KV pages live and the forward pass runs, and the results of
/// steps done at launch that a lane has not yet finished.
pub struct Runner {
    place: Place,
    landed: [Option<StepOut>; 2],
    /// Test-only: polls after each main-lane launch that report its step
    /// still running, as a device's would (a CPU runs a step at launch).
    #[cfg(any(test, feature = "fault-injection"))]
    hold_main: (u32, std::cell::Cell<u32>),
}

/// Where the KV pages live and the forward pass runs.
enum Place {
    /// The CPU, with its KV cache.
    Cpu(KvCache),
    /// The CPU with the model split over ranks (and decode's copy where
    /// the phases have their own), each rank's KV pages.
    CpuRanks(Box<TpModel>, Option<Box<TpModel>>, Vec<KvCache>),
    /// GPUs holding ranks of the model, each with its KV pages (and its
    /// part of decode's copy where the phases have their own).
    GpuRanks(Vec<GpuRank>),
    /// A GPU, with the weights and KV pages on it, and decode's own copy
    /// of the weights where the phases run on different ones.
    Gpu(Box<GpuModel>, Box<GpuKv>, Option<Box<GpuModel>>),
}

impl Runner {
    /// The runner `o` asks for. On a GPU it takes the weights a previous
    /// runner gave back, if they match.
    pub fn new(loaded: &Loaded, o: RunnerOptions) -> Result<Self, String> {
        if o.ranks == 0 {
            return Err("tensor parallelism needs at least one rank".into());
        }
        let place = match o.device {
            Device::Cpu if o.ranks > 1 => {
                let split = |m: &super::Model| {
                    TpModel::new(m, o.ranks)
                        .map(Box::new)
                        .map_err(|e| e.to_string())
                };
                let model = split(&loaded.model)?;
                let decode = loaded.decode.as_ref().map(split).transpose()?;
                let kv = model.kv(o.kv_format, o.page_size, o.num_pages);
                Place::CpuRanks(model, decode, kv)
            }
            Device::Cuda(n) if o.ranks > 1 => Place::GpuRanks(gpu_ranks(loaded, &o, n)?),
            Device::Cpu => Place::Cpu(KvCache::new(
                &loaded.model.config,
                o.kv_format,
                o.page_size,
                o.num_pages,
            )),
            Device::Cuda(n) => gpu_place(loaded, &o, n)?,
        };
        Ok(Self {
            place,
            landed: [None, None],
            #[cfg(any(test, feature = "fault-injection"))]
            hold_main: Default::default(),
        })
    }

    /// Keeps a GPU's weights in `loaded` for the next runner.
    pub fn give_back(self, loaded: &Loaded) {
        if let Place::Gpu(model, _, decode) = self.place
            && let Ok(mut slot) = loaded.gpu_weights.lock()
        {
            *slot = Some((model.ordinal(), model, decode));
        }
    }

    /// Test-only: each main-lane step reports itself still running to the
    /// first `polls` of [`Self::is_done`] after its launch.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn hold_main(&mut self, polls: u32) {
        self.hold_main.0 = polls;
    }

    /// Whether it runs on a GPU (which checks page tags inside the step).
    pub fn on_gpu(&self) -> bool {
        matches!(self.place, Place::Gpu(..) | Place::GpuRanks(_))
    }

    /// Bytes of weights a decode step reads where the forward pass runs.
    pub fn weight_bytes(&self, loaded: &Loaded) -> usize {
        match &self.place {
            Place::Gpu(_, _, Some(decode)) => decode.weight_bytes(),
            Place::Gpu(model, ..) => model.weight_bytes(),
            // Ranks read their parts at once, each from its own GPU.
            Place::GpuRanks(ranks) => ranks
                .first()
                .map_or(0, |r| r.decode.as_ref().unwrap_or(&r.model).weight_bytes()),
            Place::CpuRanks(model, decode, _) => decode.as_ref().unwrap_or(model).weight_bytes(),
            Place::Cpu(_) => loaded
                .decode
                .as_ref()
                .unwrap_or(&loaded.model)
                .weight_bytes(),
        }
    }

    /// The device's copy bandwidth in GB/s, on a GPU.
    pub fn copy_bandwidth(&self) -> Option<f64> {
        match &self.place {
            Place::Gpu(model, ..) => model.copy_bandwidth().ok(),
            Place::GpuRanks(ranks) => ranks.first().and_then(|r| r.model.copy_bandwidth().ok()),
            Place::Cpu(_) | Place::CpuRanks(..) => None,
        }
    }

    /// Puts `lane`'s steps ahead of the other lane's on a GPU, or level
    /// with them again (on the CPU a step runs at launch: nothing to do).
    pub fn set_urgent(&mut self, lane: RunLane, urgent: bool) -> Result<(), String> {
        if let Place::Gpu(model, _, decode) = &self.place {
            for m in std::iter::once(model).chain(decode) {
                m.set_urgent(lane, urgent).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// `pages`' contents, each page's layers in turn, for another runner's
    /// [`Self::write_pages`]: on a GPU, gathered in a buffer there (call it
    /// with no step in flight that writes them).
    pub fn read_pages(&self, pages: &[u32]) -> Result<PageBytes, String> {
        match &self.place {
            Place::Cpu(kv) => Ok(PageBytes::Host(kv.read_pages(pages))),
            Place::CpuRanks(_, _, kv) => Ok(PageBytes::Host(TpModel::read_pages(kv, pages))),
            Place::Gpu(model, kv, _) => (model.export_kv_pages(kv, pages))
                .map(|d| PageBytes::Device(vec![d]))
                .map_err(|e| e.to_string()),
            Place::GpuRanks(ranks) => (ranks.iter())
                .map(|r| r.model.export_kv_pages(&r.kv, pages))
                .collect::<Result<Vec<_>, _>>()
                .map(PageBytes::Device)
                .map_err(|e| e.to_string()),
        }
    }

    /// Overwrites `pages` with another runner's [`Self::read_pages`] of as
    /// many pages of the same format and layout (from another GPU by one
    /// peer copy).
    pub fn write_pages(&mut self, pages: &[u32], bytes: &PageBytes) -> Result<(), String> {
        match &mut self.place {
            Place::Cpu(kv) => kv.write_pages(pages, &bytes.to_host()?),
            Place::CpuRanks(_, _, kv) => TpModel::write_pages(kv, pages, &bytes.to_host()?),
            Place::GpuRanks(ranks) => match bytes {
                PageBytes::Device(d) if d.len() == ranks.len() => (ranks.iter_mut().zip(d))
                    .try_for_each(|(r, d)| r.model.import_kv_pages(&mut r.kv, pages, d))
                    .map_err(|e| e.to_string()),
                _ => {
                    let host = bytes.to_host()?;
                    let parts = rank_parts(&host, ranks.len())?;
                    (ranks.iter_mut().zip(parts))
                        .try_for_each(|(r, part)| r.model.write_kv_pages(&mut r.kv, pages, part))
                        .map_err(|e| e.to_string())
                }
            },
            Place::Gpu(model, kv, _) => match bytes {
                PageBytes::Device(d) if d.len() == 1 => {
                    (model.import_kv_pages(kv, pages, &d[0])).map_err(|e| e.to_string())
                }
                _ => {
                    (model.write_kv_pages(kv, pages, &bytes.to_host()?)).map_err(|e| e.to_string())
                }
            },
        }
    }

    /// Steps that found new working buffers on a GPU (0 on the CPU).
    pub fn buffers_made(&self) -> u64 {
        match &self.place {
            Place::Gpu(_, kv, _) => kv.buffers_made(),
            Place::GpuRanks(ranks) => ranks.first().map_or(0, |r| r.kv.buffers_made()),
            Place::Cpu(_) | Place::CpuRanks(..) => 0,
        }
    }

    /// Runs one step on the main lane, launched and finished.
    pub fn forward(&mut self, loaded: &Loaded, step: &Step<'_>) -> Result<StepOut, String> {
        self.launch(loaded, RunLane::Main, step)?;
        self.finish(RunLane::Main)
    }

    /// Starts one step on `lane` ([`Self::finish`] returns its results).
    /// On a GPU with one copy of the weights the step is queued on the
    /// lane's stream; otherwise it runs now.
    pub fn launch(
        &mut self,
        loaded: &Loaded,
        lane: RunLane,
        step: &Step<'_>,
    ) -> Result<(), String> {
        if self.landed[lane.index()].is_some() {
            return Err(format!("a step is already in flight on the {lane:?} lane"));
        }
        #[cfg(any(test, feature = "fault-injection"))]
        if lane == RunLane::Main {
            self.hold_main.1.set(self.hold_main.0);
        }
        if let Place::Gpu(model, kv, None) = &mut self.place {
            return model.launch(kv, lane, step).map_err(|e| e.to_string());
        }
        let out = self.forward_now(loaded, lane, step)?;
        self.landed[lane.index()] = Some(out);
        Ok(())
    }

    /// Whether `lane`'s launched step has run; an error where the device
    /// failed it (the step's [`Self::finish`] would fail too).
    pub fn is_done(&self, lane: RunLane) -> Result<bool, String> {
        #[cfg(any(test, feature = "fault-injection"))]
        if lane == RunLane::Main && self.hold_main.1.get() > 0 {
            self.hold_main.1.set(self.hold_main.1.get() - 1);
            return Ok(false);
        }
        match &self.place {
            Place::Gpu(model, kv, None) if self.landed[lane.index()].is_none() => {
                model.is_done(kv, lane).map_err(|e| e.to_string())
            }
            _ => Ok(true),
        }
    }

    /// The results of `lane`'s launched step, waiting for it if need be.
    pub fn finish(&mut self, lane: RunLane) -> Result<StepOut, String> {
        if let Some(out) = self.landed[lane.index()].take() {
            return Ok(out);
        }
        match &mut self.place {
            Place::Gpu(model, kv, None) => model.finish(kv, lane).map_err(|e| e.to_string()),
            _ => Err(format!("no step in flight on the {lane:?} lane")),
        }
    }

    /// Runs one step now; where the phases have their own weights, its
    /// one-token rows on decode's and the rest on prefill's, as two passes.
    fn forward_now(
        &mut self,
        loaded: &Loaded,
        lane: RunLane,
        step: &Step<'_>,
    ) -> Result<StepOut, String> {
        let phased = match &self.place {
            Place::Gpu(_, _, decode) => decode.is_some(),
            Place::CpuRanks(_, decode, _) => decode.is_some(),
            Place::GpuRanks(ranks) => ranks.first().is_some_and(|r| r.decode.is_some()),
            Place::Cpu(_) => loaded.decode.is_some(),
        };
        if !phased {
            return self.pass(loaded, lane, step, false);
        }
        match super::phase::split(step) {
            Err(all_decode) => self.pass(loaded, lane, step, all_decode),
            Ok(split) => {
                let (prefill, decode) = split.steps(step);
                let p = self.pass(loaded, lane, &prefill, false)?;
                let d = self.pass(loaded, lane, &decode, true)?;
                Ok(super::phase::merge(step, &split.is_decode, p, d))
            }
        }
    }

    /// One forward pass on `lane`, on decode's weights when `decode` and it
    /// has its own.
    fn pass(
        &mut self,
        loaded: &Loaded,
        lane: RunLane,
        step: &Step<'_>,
        decode: bool,
    ) -> Result<StepOut, String> {
        match &mut self.place {
            Place::Cpu(cache) => {
                let model = match (&loaded.decode, decode) {
                    (Some(d), true) => d,
                    _ => &loaded.model,
                };
                // The CPU is the device: all of the forward is its time.
                let start = std::time::Instant::now();
                let logits = model.forward(cache, &step.seqs);
                cpu_out(step, logits, start)
            }
            Place::CpuRanks(model, phase, kv) => {
                let model = match (phase, decode) {
                    (Some(d), true) => d,
                    _ => model,
                };
                let start = std::time::Instant::now();
                let logits = model.forward(kv, &step.seqs);
                cpu_out(step, logits, start)
            }
            Place::GpuRanks(ranks) => forward_ranks(ranks, step, decode).map_err(|e| e.to_string()),
            Place::Gpu(model, kv, phase) => match (phase, decode) {
                (Some(d), true) => d.forward(kv, lane, step),
                _ => model.forward(kv, lane, step),
            }
            .map_err(|e| e.to_string()),
        }
    }
}

/// A step the CPU ran since `start`: its logits, or why it failed.
fn cpu_out(
    step: &Step<'_>,
    logits: Result<Vec<Vec<f32>>, kiln_kernels::KernelError>,
    start: std::time::Instant,
) -> Result<StepOut, String> {
    Ok(StepOut {
        rows: logits
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(SeqOut::Logits)
            .collect(),
        ok: vec![true; step.seqs.len()],
        device: start.elapsed(),
    })
}
