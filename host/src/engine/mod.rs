//! The inference engine: continuous batching over a paged KV cache with
//! per-page tags checked before every step.
//!
//! Plain synchronous code: [`Engine::step`] runs one scheduler step and one
//! forward pass. Layers: scheduler → KV cache manager → block pool → free
//! queue; the scheduler's output is the only contract with the model.

pub mod block_pool;
mod drive;
pub mod integrity;
pub mod kv_manager;
mod lru;
pub mod prefix;
mod request;
mod runner;
pub mod scheduler;
mod text;

use std::collections::HashMap;
use std::sync::Arc;

use kiln_kernels::Device;
use kiln_kernels::kv::KvFormat;
use kiln_kernels::sample::sample;
use rand::Rng;

pub use block_pool::{PrefixChange, TenantId};
pub use kv_manager::SeqId;
pub use prefix::{PageHash, Salt};
pub use request::{Finish, GenerateParams};
pub use scheduler::SchedulerConfig;

use crate::model::gpu::{SeqOut, StepOut, StepTags};
use crate::model::{BatchSeq, Draw, KvCache, Loaded};
use integrity::{IntegrityCheck, NoCheck, TagCheck};
use kv_manager::KvCacheManager;
use request::Request;
use runner::{Runner, tag_words};
use scheduler::Scheduler;

/// Tokens per KV page.
pub const PAGE_SIZE: usize = 16;

/// Test-only: how an injected fault fails a step.
#[cfg(any(test, feature = "fault-injection"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The step panics.
    Panic,
    /// The step returns an error.
    Error,
}

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
    /// On CUDA: sample (temperature, top-k, top-p) on the device with the
    /// request's own draws, instead of downloading logits.
    pub device_sampling: bool,
    /// On CUDA: attend prefill chunks with the flash-style prefill kernel
    /// instead of one decode-attention query per token.
    pub flash_prefill: bool,
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
            device_sampling: true,
            flash_prefill: false,
        }
    }
}

/// What happened to a request during a step.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Microseconds the last step waited on the device (upload, kernels,
    /// download; on the CPU the whole forward): the rest of a step is the
    /// host's scheduling and bookkeeping, during which the device idles.
    pub last_step_device_us: u64,
}

/// One model, its KV pool and its scheduler.
pub struct Engine {
    loaded: Arc<Loaded>,
    device_sampling: bool,
    page_bytes: usize,
    runner: Runner,
    kv: KvCacheManager,
    scheduler: Scheduler,
    requests: HashMap<SeqId, Request>,
    checker: Box<dyn IntegrityCheck>,
    next_id: SeqId,
    stats: EngineStats,
    /// The sequences of the step in progress: after a failure inside a
    /// step, the requests it concerns.
    stepping: Vec<SeqId>,
    /// Test-only: the next step fails once it has its batch (a panic, or
    /// an error as a device would return).
    #[cfg(any(test, feature = "fault-injection"))]
    fault_next_step: Option<Fault>,
}

impl Engine {
    /// An engine for `loaded` with a pool sized by `config.kv_memory`, on
    /// `config.device`. Engines may share one model's weights. Fails only
    /// when the device cannot be used (no CUDA, say).
    pub fn new(loaded: impl Into<Arc<Loaded>>, config: EngineConfig) -> Result<Self, String> {
        let loaded = loaded.into();
        let page_bytes = KvCache::page_bytes(&loaded.model.config, config.kv_format, PAGE_SIZE);
        let num_pages = (config.kv_memory / page_bytes).max(1);
        let runner = Runner::new(&loaded, &config, num_pages)?;
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
            runner,
            kv,
            scheduler: Scheduler::new(config.scheduler),
            requests: HashMap::new(),
            checker,
            next_id: 1,
            stats: EngineStats::default(),
            stepping: Vec::new(),
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
        match &self.runner {
            Runner::Gpu(model, _) => model.weight_bytes(),
            Runner::Cpu(_) => self.loaded.model.weight_bytes(),
        }
    }

    /// The device's copy bandwidth in GB/s, on a GPU.
    pub fn copy_bandwidth(&self) -> Option<f64> {
        match &self.runner {
            Runner::Gpu(model, _) => model.copy_bandwidth().ok(),
            Runner::Cpu(_) => None,
        }
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
        self.stats
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
        !self.scheduler.is_empty()
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
        self.add_request(tenant, None, prompt, params)
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
        self.add_request(tenant, Some(salt), prompt, params)
    }

    fn add_request(
        &mut self,
        tenant: TenantId,
        salt: Option<Salt>,
        prompt: Vec<u32>,
        params: GenerateParams,
    ) -> Result<SeqId, String> {
        if prompt.is_empty() {
            return Err("the prompt is empty".into());
        }
        let ctx = self.loaded.model.config.context_length;
        let limit = ctx.min(self.kv.num_pages() * PAGE_SIZE);
        if prompt.len() + 1 > limit {
            return Err(format!(
                "the prompt has {} tokens; this model and KV pool hold at most {}",
                prompt.len(),
                limit - 1
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut request = Request::new(prompt, params);
        if let Some(salt) = salt {
            prefix::extend_hashes(&mut request.hashes, &salt, &request.tokens, PAGE_SIZE);
            request.salt = Some(salt);
        }
        self.scheduler
            .add(id, tenant, request.prompt_len, request.hashes.clone());
        self.requests.insert(id, request);
        Ok(id)
    }

    /// Cancels a request; its pages are freed now.
    pub fn cancel(&mut self, seq: SeqId) -> bool {
        self.scheduler.remove(seq);
        self.kv.free(seq);
        self.requests.remove(&seq).is_some()
    }

    /// Test-only: corrupts `victim`'s mapping with one of `donor`'s pages.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_page_fault(&mut self, victim: SeqId, donor: SeqId) -> bool {
        self.kv.corrupt_mapping(victim, donor, 0)
    }

    /// Test-only: the next step fails once it has scheduled its batch, as
    /// a bug (a panic) or a device (an error) inside a step would.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_fault(&mut self, fault: Fault) {
        self.fault_next_step = Some(fault);
    }

    /// The sequences of the last step begun: after [`Engine::step`] failed
    /// or panicked, the requests the failure concerns.
    pub fn in_step(&self) -> &[SeqId] {
        &self.stepping
    }

    fn finish(&mut self, seq: SeqId, finish: Finish, events: &mut Vec<Event>) {
        self.scheduler.remove(seq);
        self.kv.free(seq);
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
        self.scheduler.running()
    }

    /// Runs one step: schedule, check page tags, forward, sample.
    pub fn step(&mut self) -> Result<Vec<Event>, String> {
        let mut events = Vec::new();
        self.stepping.clear();
        let plan = self.scheduler.schedule(&mut self.kv);
        self.stepping.extend(plan.scheduled.iter().map(|s| s.seq));
        #[cfg(any(test, feature = "fault-injection"))]
        if !self.stepping.is_empty() {
            match self.fault_next_step.take() {
                Some(Fault::Panic) => panic!("injected engine fault"),
                Some(Fault::Error) => return Err("injected device error".into()),
                None => {}
            }
        }
        self.stats.preemptions += plan.preempted.len() as u64;
        for (seq, hit) in &plan.prefix_hits {
            if let Some(r) = self.requests.get_mut(seq) {
                // The first admission counts; a readmission after
                // preemption finds its own pages, which is no saving.
                r.cached_tokens.get_or_insert(*hit);
            }
        }
        if plan.scheduled.is_empty() {
            return Ok(events);
        }
        let ids: Vec<SeqId> = plan.scheduled.iter().map(|s| s.seq).collect();
        // On a GPU the check runs inside the step; on the CPU, here.
        let device_check = self.runner.on_gpu() && self.checker.enabled();
        let ok = if device_check {
            vec![true; ids.len()]
        } else {
            self.kv.check(&ids, self.checker.as_ref())
        };
        let mut run = Vec::with_capacity(ids.len());
        for (sch, ok) in plan.scheduled.iter().zip(ok) {
            if ok {
                run.push(sch.clone());
            } else {
                self.integrity_abort(sch.seq, &mut events);
            }
        }
        let changes: Vec<(u32, [u64; 2])> = self
            .kv
            .take_retagged()
            .iter()
            .map(|(p, t)| (*p, tag_words(t)))
            .collect();
        // A device samples with the request's own next draw, so the
        // request's generator advances as it does on the host.
        let device_draws = self.runner.on_gpu() && self.device_sampling;
        let draws: Vec<Draw> = run
            .iter()
            .map(|s| match self.requests.get_mut(&s.seq) {
                Some(r) if s.sample && r.sampling().is_greedy() => Draw::Greedy,
                Some(r) if s.sample && device_draws => Draw::Sample {
                    params: r.sampling(),
                    uniform: r.rng.random::<f32>(),
                },
                _ => Draw::Logits,
            })
            .collect();
        let mut expected = Vec::new();
        let batch: Vec<BatchSeq<'_>> = run
            .iter()
            .zip(&draws)
            .map(|(s, draw)| {
                let r = &self.requests[&s.seq];
                let table = self.kv.table(s.seq);
                if device_check && let Some(t) = table {
                    expected.extend(t.expected.iter().map(tag_words));
                }
                BatchSeq {
                    tokens: &r.tokens[s.start..s.start + s.count],
                    start: s.start,
                    pages: table.map(|t| t.pages.as_slice()).unwrap_or(&[]),
                    logits: s.sample,
                    write_kv: s.write_kv,
                    draw: *draw,
                }
            })
            .collect();
        let tags = StepTags {
            expected: &expected,
            changes: &changes,
        };
        let StepOut { rows, ok, device } = self.runner.forward(&self.loaded, &batch, tags)?;
        self.stats.last_step_device_us = device.as_micros() as u64;
        self.stats.steps += 1;
        self.stats.last_step_seqs = batch.len();
        self.stats.last_step_tokens = batch.iter().map(|b| b.tokens.len()).sum();
        // Sequences the device's check stopped: their results are void.
        let mut failed = std::collections::HashSet::new();
        for (s, ok) in run.iter().zip(ok) {
            if !ok {
                failed.insert(s.seq);
                self.integrity_abort(s.seq, &mut events);
            }
        }
        // Name the pages this step filled, before any of them is released.
        for s in run.iter().filter(|s| !failed.contains(&s.seq)) {
            if let Some(r) = self.requests.get_mut(&s.seq)
                && let Some(salt) = r.salt
            {
                let computed = s.start + s.count;
                prefix::extend_hashes(&mut r.hashes, &salt, &r.tokens[..computed], PAGE_SIZE);
                self.kv.cache_pages(s.seq, &r.hashes, computed);
            }
        }
        let ctx = self
            .loaded
            .model
            .config
            .context_length
            .min(self.kv.num_pages() * PAGE_SIZE);
        let mut rows = rows.into_iter();
        for s in run.iter().filter(|s| s.sample) {
            let Some(row) = rows.next() else { break };
            if failed.contains(&s.seq) {
                continue;
            }
            let Some(r) = self.requests.get_mut(&s.seq) else {
                continue;
            };
            let token = match row {
                SeqOut::Logits(l) => sample(&l, r.sampling(), &mut r.rng),
                SeqOut::Token(t) => t,
            };
            let tokenizer = &self.loaded.tokenizer;
            let decode = |t: &[u32]| tokenizer.decode(t);
            let eos = tokenizer.is_eos(token) && !r.params.ignore_eos;
            let mut finish = None;
            if eos {
                finish = Some(Finish::Stop);
            } else {
                r.tokens.push(token);
                self.scheduler.append_token(s.seq);
                let generated = &r.tokens[r.prompt_len..];
                if r.text.push(generated, decode) {
                    finish = Some(Finish::Stop);
                } else if generated.len() >= r.params.max_tokens || r.tokens.len() >= ctx {
                    finish = Some(Finish::Length);
                }
            }
            // At the end, text held for an incomplete character is final
            // (and may still complete a stop string).
            if finish.is_some() && r.text.flush(&r.tokens[r.prompt_len..], decode) {
                finish = Some(Finish::Stop);
            }
            let text = r.text.take_delta(finish.is_some());
            if !eos {
                events.push(Event::Token {
                    seq: s.seq,
                    token: Some(token),
                    text,
                });
            } else if !text.is_empty() {
                events.push(Event::Token {
                    seq: s.seq,
                    token: None,
                    text,
                });
            }
            if let Some(f) = finish {
                self.finish(s.seq, f, &mut events);
            }
        }
        Ok(events)
    }
}
