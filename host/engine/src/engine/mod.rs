//! The inference engine: continuous batching over a paged KV cache with
//! per-page tags checked before every step.
//!
//! Plain synchronous code: [`Engine::step`] plans with the scheduler,
//! builds the model's [`Step`](crate::model::step::Step), runs it and
//! applies its output. Layers: scheduler → KV cache manager → block pool →
//! free queue; `model::step` holds the only types that cross to the model.

pub mod block_pool;
mod constraint;
mod drive;
#[cfg(any(test, feature = "fault-injection"))]
mod faults;
pub mod integrity;
pub mod kv_manager;
mod lanes;
mod lru;
mod overlap;
pub mod prefix;
mod request;
mod samples;
pub mod scheduler;
mod step;
pub mod step_budget;
mod text;
mod transfer;

use std::collections::HashMap;
use std::sync::Arc;

use kiln_kernels::Device;
use kiln_kernels::kv::KvFormat;

pub use block_pool::{PrefixChange, TenantId};
pub use constraint::{CompiledFormat, FORMAT_FAILED, Formats, OutputFormat};
pub use kiln_kernels::sample::MAX_TOP_LOGPROBS;
pub use kv_manager::SeqId;
pub use prefix::{PageHash, Salt};
pub use request::{Finish, GenerateParams, Logprob, TokenLogprobs, check_prompt};
pub use samples::MAX_SAMPLES;
pub use scheduler::SchedulerConfig;
pub use transfer::{SeqTransfer, Unexported};

use crate::model::{KvCache, Loaded, Reserve, Runner, RunnerOptions};
#[cfg(any(test, feature = "fault-injection"))]
pub use faults::Fault;
use integrity::{IntegrityCheck, NoCheck, TagCheck};
use kv_manager::KvCacheManager;
use lanes::Lanes;
use request::Request;

/// Tokens per KV page.
pub const PAGE_SIZE: usize = 16;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV page format.
    pub kv_format: KvFormat,
    /// Bytes of KV memory; the pool gets as many pages as fit.
    pub kv_memory: usize,
    /// Check page tags before each step.
    pub integrity: bool,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Where the forward pass runs.
    pub device: Device,
    /// On CUDA: capture greedy decode steps as graphs and replay them.
    pub cuda_graphs: bool,
    /// On CUDA (sm_90 and up): captured graphs let each kernel start while
    /// the one before it finishes (programmatic dependent launch).
    pub cuda_pdl: bool,
    /// On CUDA: steps of one token with bf16 weights fold the norms and
    /// SiLU-and-multiply into their GEMVs (no norm or SiLU launches).
    pub cuda_fold: bool,
    /// On CUDA: with `cuda_fold`, steps of one token with int4 tiles fold
    /// too.
    pub cuda_fold_int4: bool,
    /// On CUDA: with `cuda_fold`, steps of one token with FP8 rows fold
    /// too (each product quantizes its activation row itself).
    pub cuda_fold_fp8: bool,
    /// On CUDA: int4 products of 2 to 8 rows (decode of a few sequences)
    /// run in one launch with the rows in the MMAs' columns instead of a
    /// fragment launch and the GEMV.
    pub cuda_int4_rows: bool,
    /// On CUDA: time cuBLASLt's algorithms for decode's bf16 products at
    /// load and run the fastest where it beats cuBLAS's own choice.
    pub cuda_tune_bf16: bool,
    /// On CUDA: sample (temperature, top-k, top-p) on the device with the
    /// request's own draws, instead of downloading logits.
    pub device_sampling: bool,
    /// On CUDA: attend prefill chunks with the tensor-core prefill kernel
    /// instead of one decode-attention query per token.
    pub tensor_prefill: bool,
    /// On CUDA: bf16 products of 2-16 rows run the skinny GEMM instead of
    /// cuBLAS.
    pub cuda_skinny: bool,
    /// On CUDA (sm_90 and up): bf16 products of 17-64 rows run the cluster
    /// GEMM instead of cuBLAS.
    pub cuda_cluster: bool,
    /// On CUDA: decode steps' attention rotates the q/k/v rows and writes
    /// the new keys and values itself (one launch a layer fewer).
    pub cuda_rope_in_attention: bool,
    /// On CUDA: how decode steps' attention launches run (the flash
    /// kernel's build, a fused merge; the default lets each launch pick).
    pub cuda_attention: kiln_kernels::cuda::AttentionPlan,
    /// On CUDA: warps a block of prefill attention takes (4 or 8); `None`
    /// picks by page format ([`default_prefill_warps`]).
    pub prefill_warps: Option<usize>,
    /// On CUDA: prefill steps of bf16 models run the MLP in bf16 (the
    /// gate/up product rounded to bf16, as PyTorch's bf16 models do).
    pub cuda_bf16_mlp: bool,
    /// On CUDA: with `cuda_bf16_mlp`, decode steps past 16 sequences run
    /// the MLP in bf16 too (one gate/up GEMM where they run two).
    pub cuda_bf16_mlp_decode: bool,
    /// Prefill/decode disaggregation: a prefill lane and a decode lane,
    /// each with its own queue, budget and step, over one KV pool.
    pub pd: bool,
    /// Tensor-parallel ranks the model is split over (1: whole): each
    /// holds 1/R of the heads and of the MLP, and KV pages of its own KV
    /// heads at the same page numbers and tags as the others.
    pub tensor_parallel: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_format: KvFormat::Fp8,
            kv_memory: 256 << 20,
            integrity: true,
            scheduler: SchedulerConfig::default(),
            device: Device::Cpu,
            cuda_graphs: true,
            cuda_pdl: true,
            cuda_fold: true,
            cuda_fold_int4: true,
            cuda_fold_fp8: true,
            cuda_int4_rows: true,
            cuda_tune_bf16: true,
            device_sampling: true,
            tensor_prefill: true,
            cuda_skinny: true,
            cuda_cluster: false,
            cuda_rope_in_attention: true,
            cuda_attention: Default::default(),
            prefill_warps: None,
            cuda_bf16_mlp: true,
            cuda_bf16_mlp_decode: true,
            pd: false,
            tensor_parallel: 1,
        }
    }
}

/// Warps a block of prefill attention takes when none is asked for. fp8
/// pages gain from 8 (one block an SM hides the dequantization behind
/// twice the query rows: 190 against 142 TFLOP/s on the H200); bf16 pages
/// are even on long prompts (210 against 203) and lose on short ones,
/// whose fewer, larger blocks leave SMs idle (161 against 172), so they
/// keep 4 (docs/perf.md).
pub fn default_prefill_warps(kv_format: KvFormat) -> usize {
    match kv_format {
        KvFormat::Bf16 => 4,
        _ => 8,
    }
}

/// What happened to a request during a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token and the text it completes (may be empty); `token` is
    /// `None` for held-back text flushed when the request ends.
    Token {
        /// The request.
        seq: SeqId,
        /// The token id.
        token: Option<u32>,
        /// New text.
        text: String,
        /// The log-probabilities of the tokens whose text has now gone out
        /// (this one's, and any held with text that might have begun a
        /// stop string), when the request asked for them
        /// ([`GenerateParams::logprobs`]); a stop string's tokens never get
        /// theirs sent.
        logprobs: Vec<TokenLogprobs>,
    },
    /// The request ended.
    Finished {
        /// The request.
        seq: SeqId,
        /// Why.
        finish: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
    },
}

/// The result of [`Engine::generate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Generated token ids (EOS excluded).
    pub tokens: Vec<u32>,
    /// Their text (stop string excluded).
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
}

/// Engine counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    /// Sequences aborted by the page-tag check.
    pub integrity_aborts: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Forward steps run.
    pub steps: u64,
    /// Sequences in the last step.
    pub last_step_seqs: usize,
    /// Tokens the last step computed (equal to its sequences when it only
    /// decoded).
    pub last_step_tokens: usize,
    /// Microseconds the last step waited on the device for its main lane's
    /// step (upload, kernels, download; on the CPU the whole forward; 0 if
    /// it ran none): the rest of a step is the host's scheduling and
    /// bookkeeping, during which the device idles.
    pub last_step_device_us: u64,
    /// Sequences handed from the prefill lane to the decode lane
    /// (disaggregated only).
    pub handoffs: u64,
    /// Disaggregated: whether the decode lane's steps go ahead of the
    /// prefill lane's on the device, as they do while the step target caps
    /// them (tenants compete). Otherwise the lanes share it evenly, so one
    /// tenant's own prompts are not starved by its streams.
    pub decode_first: bool,
    /// On a GPU: steps that found new working buffers (the first step's,
    /// then one a remake; each drops the captured graphs).
    pub buffers_made: u64,
}

/// One model, its KV pool and its schedulers.
pub struct Engine {
    loaded: Arc<Loaded>,
    device_sampling: bool,
    page_bytes: usize,
    /// Tensor-parallel ranks the runner splits the model over.
    ranks: usize,
    runner: Runner,
    kv: KvCacheManager,
    lanes: Lanes,
    /// Prompt tokens a step may carry under the step time target.
    step_budget: step_budget::StepBudget,
    requests: HashMap<SeqId, Request>,
    checker: Box<dyn IntegrityCheck>,
    next_id: SeqId,
    stats: EngineStats,
    /// The sequences of the step in progress: after a failure inside a
    /// step, the requests it concerns.
    stepping: Vec<SeqId>,
    /// Disaggregated: the prefill lane's step launched on the side lane
    /// and not yet landed.
    in_flight: Option<Vec<scheduler::Scheduled>>,
    /// Disaggregated: a prefill step ran beside the decode step under way
    /// (one may land before it ends).
    ran_beside: bool,
    /// Disaggregated: the sequences of the decode step launched and not
    /// yet finished (a failure while prefill steps land and launch beside
    /// it concerns them too).
    decoding: Vec<SeqId>,
    /// Sequences cancelled while their prefill step was in flight: their
    /// pages are freed when it lands, not while kernels may write them.
    deferred_free: Vec<SeqId>,
    /// Disaggregated: per runner lane, the pages retagged since its last
    /// step.
    retags: overlap::RetagQueues,
    /// Samples of one prompt waiting for the first to compute it.
    waiting: Vec<samples::Waiting>,
    /// Output formats' compiler for this model, made at the first request
    /// with a format.
    formats: Option<constraint::Formats>,
    /// Test-only: the next step fails once it has its batch (a panic, or
    /// an error as a device would return).
    #[cfg(any(test, feature = "fault-injection"))]
    fault_next_step: Option<Fault>,
}

impl Engine {
    /// An engine for `loaded` with a pool sized by `config.kv_memory`, on
    /// `config.device`. Engines may share one model's weights. Fails when
    /// the device cannot be used (no CUDA, say) or cannot hold the pool or
    /// the working buffers of the scheduler's largest step.
    pub fn new(loaded: impl Into<Arc<Loaded>>, config: EngineConfig) -> Result<Self, String> {
        let loaded = loaded.into();
        let page_bytes = KvCache::page_bytes(&loaded.model.config, config.kv_format, PAGE_SIZE);
        let num_pages = (config.kv_memory / page_bytes).max(1);
        let runner = Runner::new(
            &loaded,
            RunnerOptions {
                device: config.device,
                kv_format: config.kv_format,
                page_size: PAGE_SIZE,
                num_pages,
                ranks: config.tensor_parallel,
                graphs: config.cuda_graphs,
                programmatic: config.cuda_pdl,
                fold: config.cuda_fold,
                fold_int4: config.cuda_fold_int4,
                fold_fp8: config.cuda_fold_fp8,
                int4_rows: config.cuda_int4_rows,
                tune_bf16: config.cuda_tune_bf16,
                tensor_prefill: config.tensor_prefill,
                skinny: config.cuda_skinny,
                cluster: config.cuda_cluster,
                rope_in_attention: config.cuda_rope_in_attention,
                attention: config.cuda_attention,
                prefill_warps: config
                    .prefill_warps
                    .unwrap_or_else(|| default_prefill_warps(config.kv_format)),
                bf16_mlp: config.cuda_bf16_mlp,
                bf16_mlp_decode: config.cuda_bf16_mlp_decode,
                side_lane: config.pd,
                reserve: Reserve {
                    tokens: config.scheduler.max_tokens_per_step,
                    rows: config.scheduler.max_running,
                },
            },
        )?;
        let checker: Box<dyn IntegrityCheck> = if config.integrity {
            Box::new(TagCheck)
        } else {
            Box::new(NoCheck)
        };
        let mut kv = KvCacheManager::new(num_pages, PAGE_SIZE);
        if runner.on_gpu() {
            // The GPU keeps a copy of the tags for the check it runs.
            kv.track_retags();
        }
        Ok(Self {
            device_sampling: config.device_sampling,
            loaded,
            page_bytes,
            ranks: config.tensor_parallel,
            runner,
            kv,
            lanes: Lanes::new(config.scheduler, config.pd),
            step_budget: step_budget::StepBudget::new(
                config.scheduler.step_target,
                config.scheduler.max_tokens_per_step,
            ),
            requests: HashMap::new(),
            checker,
            next_id: 1,
            stats: EngineStats::default(),
            stepping: Vec::new(),
            in_flight: None,
            ran_beside: false,
            decoding: Vec::new(),
            deferred_free: Vec::new(),
            retags: Default::default(),
            waiting: Vec::new(),
            formats: None,
            #[cfg(any(test, feature = "fault-injection"))]
            fault_next_step: None,
        })
    }

    /// The model and tokenizer.
    pub fn loaded(&self) -> &Loaded {
        &self.loaded
    }

    /// Gives the model back (to build another engine on it).
    pub fn into_loaded(self) -> Arc<Loaded> {
        self.runner.give_back(&self.loaded);
        self.loaded
    }

    /// Bytes of KV one token takes over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.page_bytes / PAGE_SIZE
    }

    /// Bytes of weights a decode step reads (every layer's matrices and the
    /// output head) where the forward pass runs.
    pub fn weight_bytes(&self) -> usize {
        self.runner.weight_bytes(&self.loaded)
    }

    /// The device's copy bandwidth in GB/s, on a GPU.
    pub fn copy_bandwidth(&self) -> Option<f64> {
        self.runner.copy_bandwidth()
    }

    /// Free KV pages.
    pub fn free_pages(&self) -> usize {
        self.kv.num_free()
    }

    /// All KV pages.
    pub fn total_pages(&self) -> usize {
        self.kv.num_pages()
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            handoffs: self.lanes.handoffs(),
            ..self.stats
        }
    }

    /// Unreferenced KV pages kept for the prefix cache (counted as free).
    pub fn cached_pages(&self) -> usize {
        self.kv.num_cached()
    }

    /// Changes to the prefix cache's page hashes since the last call.
    pub fn take_prefix_changes(&mut self) -> Vec<PrefixChange> {
        self.kv.take_prefix_changes()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.lanes.is_empty() || self.in_flight.is_some() || !self.waiting.is_empty()
    }

    /// Sets `tenant`'s share weight: while tenants compete for this engine,
    /// each gets running slots and prompt tokens in proportion to its
    /// weight (1 unless set).
    pub fn set_tenant_weight(&mut self, tenant: TenantId, weight: u32) {
        self.lanes.set_weight(tenant, weight);
    }

    /// Queues a request for `prompt` tokens that bypasses the prefix cache.
    /// Errors if the prompt is empty or cannot fit the model's context or
    /// the whole KV pool.
    pub fn add(
        &mut self,
        tenant: TenantId,
        prompt: Vec<u32>,
        params: GenerateParams,
    ) -> Result<SeqId, String> {
        self.add_request(tenant, None, prompt, params, None)
    }

    /// Queues a request that reuses, and adds to, the prefix cache of
    /// `salt` (derived by the server from the tenant and the model).
    pub fn add_salted(
        &mut self,
        tenant: TenantId,
        salt: Salt,
        prompt: Vec<u32>,
        params: GenerateParams,
    ) -> Result<SeqId, String> {
        self.add_request(tenant, Some(salt), prompt, params, None)
    }

    /// Queues a request; `compiled` is its output format's matcher where
    /// the caller compiled it (otherwise it is compiled here).
    pub(super) fn add_request(
        &mut self,
        tenant: TenantId,
        salt: Option<Salt>,
        prompt: Vec<u32>,
        params: GenerateParams,
        compiled: Option<llguidance::Matcher>,
    ) -> Result<SeqId, String> {
        check_prompt(&prompt, self.loaded.model.config.vocab, self.max_len())?;
        GenerateParams::check_stop(&params.stop)?;
        if params.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probabilities a token may be asked for"
            ));
        }
        let matcher = match (compiled, &params.format) {
            (Some(m), Some(_)) => Some(m),
            (_, format) => (format.as_ref())
                .map(|f| self.matcher(tenant, f))
                .transpose()?,
        };
        let id = self.next_id;
        self.next_id += 1;
        let mut request = Request::new(prompt, params);
        request.matcher = matcher;
        if let Some(salt) = salt {
            prefix::extend_hashes(&mut request.hashes, &salt, &request.tokens, PAGE_SIZE);
            request.salt = Some(salt);
        }
        self.lanes
            .add(id, tenant, request.prompt_len, request.hashes.clone());
        self.requests.insert(id, request);
        Ok(id)
    }

    /// The longest a sequence may grow: the model's context, or the whole
    /// KV pool if that holds less.
    fn max_len(&self) -> usize {
        let ctx = self.loaded.model.config.context_length;
        ctx.min(self.kv.num_pages() * PAGE_SIZE)
    }

    /// Cancels a request; its pages are freed now, or when the step in
    /// flight that may still write them lands.
    pub fn cancel(&mut self, seq: SeqId) -> bool {
        if self.cancel_waiting(seq) {
            return true;
        }
        self.lanes.remove(seq);
        self.free_pages_of(seq);
        self.requests.remove(&seq).is_some()
    }

    /// A matcher for `format` over this model's vocabulary, for `tenant`.
    fn matcher(
        &mut self,
        tenant: TenantId,
        format: &OutputFormat,
    ) -> Result<llguidance::Matcher, String> {
        let formats = match &mut self.formats {
            Some(f) => f,
            None => {
                let vocab = self.loaded.model.config.vocab;
                let f = constraint::Formats::new(&self.loaded.tokenizer, vocab)?;
                self.formats.insert(f)
            }
        };
        formats.matcher(&tenant.0.to_string(), format)
    }

    /// The sequences of the last step begun (with those of a prefill step
    /// in flight beside it): after [`Engine::step`] failed or panicked, the
    /// requests the failure concerns.
    pub fn in_step(&self) -> &[SeqId] {
        &self.stepping
    }

    /// Ends `seq` now, aborted for `why` (its caller cannot keep up): its
    /// pages go (once no step in flight writes them) and `events` gets its
    /// end, with the tokens it generated.
    pub fn abort(&mut self, seq: SeqId, why: String, events: &mut Vec<Event>) {
        self.finish(seq, Finish::Aborted(why), events);
    }

    fn finish(&mut self, seq: SeqId, finish: Finish, events: &mut Vec<Event>) {
        self.lanes.remove(seq);
        self.free_pages_of(seq);
        if let Some(r) = self.requests.remove(&seq) {
            events.push(Event::Finished {
                seq,
                finish,
                prompt_tokens: r.prompt_len,
                completion_tokens: r.generated().len(),
                cached_tokens: r.cached_tokens.unwrap_or(0),
            });
        }
    }

    /// Ends `seq` because its pages failed the tag check.
    fn integrity_abort(&mut self, seq: SeqId, events: &mut Vec<Event>) {
        self.stats.integrity_aborts += 1;
        tracing::warn!(seq, "KV page integrity check failed; aborting the sequence");
        self.finish(
            seq,
            Finish::Aborted("kv page integrity check failed".into()),
            events,
        );
    }

    /// Switches the page-tag check on or off from the next step (for
    /// benchmarks that measure what it costs).
    pub fn set_integrity(&mut self, on: bool) {
        self.checker = if on {
            Box::new(TagCheck)
        } else {
            Box::new(NoCheck)
        };
    }

    /// Sequences admitted and not finished (holding KV pages).
    pub fn running(&self) -> usize {
        self.lanes.running()
    }
}
