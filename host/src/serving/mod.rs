//! Serving models: each model runs on N decode pools (an [`Engine`] per
//! pool, each on its own thread); [`ServedModels`] tokenizes requests,
//! salts their prefix hashes by tenant, routes them to a pool and
//! implements the runtime's [`Inference`] over the results.
//!
//! Tenant policy is not checked here: [`policy::Gateway`] wraps this and
//! checks it first in every call.

pub mod devices;
mod engine_thread;
mod outlet;
pub mod policy;
pub mod router;
mod stream;
mod tools;
mod validate;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Instant;

use kiln_runtime::{
    AiError, Completion, Inference, ModelCall, ModelInfo, OutputFormat as Format, Prompt,
    TokenStream,
};
use rand::RngCore;

use crate::engine::{EngineConfig, Formats, OutputFormat, PAGE_SIZE, Salt, prefix};
use crate::metrics::{EngineMetrics, ModelLabels, PoolLabels, TenantModelLabels};
use crate::model::Loaded;
pub use engine_thread::MAX_HANDED_WAITING;
use engine_thread::{Msg, PoolHandle, Submit};
use router::{PoolLoad, Route};
use stream::{Submitted, collect};
use tools::Tools;
use validate::{check_prompt, generate_params};

/// A snapshot of one model's engines, summed over its pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSnapshot {
    /// KV pages an allocation can take (cached ones included).
    pub free_pages: usize,
    /// Unreferenced pages kept for the prefix cache.
    pub cached_pages: usize,
    /// All KV pages.
    pub total_pages: usize,
    /// Sequences aborted by the page-tag check.
    pub integrity_aborts: u64,
    /// Requests the engines hold (waiting or running).
    pub requests: usize,
}

/// Bytes of prompt text from which a call is prepared off the async
/// runtime's worker (`ServedModels::submit_aside`): below it, the handoff
/// costs more than the work.
const ASIDE_PROMPT_BYTES: usize = 64 << 10;

/// The most text a call's prompt, tools and output format may bring, as
/// much as an API call's body may hold: a guest's calls are not bounded by
/// a body, and templating and tokenizing cost the host memory and time
/// (many times the text) that no guest limit sees.
pub const MAX_PROMPT_BYTES: usize = 4 << 20;

/// The slots of a pool's published figures (`PoolHandle::figures`).
const FREE_PAGES: usize = 0;
const CACHED_PAGES: usize = 1;
const TOTAL_PAGES: usize = 2;
const INTEGRITY_ABORTS: usize = 3;
const RUNNING: usize = 4;

/// The published figure in `slot` summed over `pools`.
fn figure(pools: &[PoolHandle], slot: usize) -> usize {
    (pools.iter())
        .map(|p| p.figures[slot].load(Ordering::Relaxed))
        .sum()
}

/// One served model and its pools.
struct Served {
    loaded: Arc<Loaded>,
    info: ModelInfo,
    /// Its decode pools, then its prefill pool if it has one.
    pools: Vec<PoolHandle>,
    /// How many of `pools` are decode pools.
    decode: usize,
    /// Output formats compiled for its vocabulary, made at the first call
    /// that asks for one.
    formats: OnceLock<Result<Formats, String>>,
}

/// The models a server serves, by name.
pub struct ServedModels {
    models: HashMap<String, Served>,
    /// Server-side secret of the prefix-cache salts (per process: the cache
    /// lives in memory).
    secret: [u8; 32],
    metrics: EngineMetrics,
    /// Tenants' share weights from their policies (absent: 1).
    weights: RwLock<HashMap<String, u32>>,
    /// Entries a call's samples may leave unread before they are cut.
    max_unread: std::sync::atomic::AtomicUsize,
}

impl ServedModels {
    /// Starts `pools` decode pools per model on the device its config
    /// names, splitting each model's KV memory and the machine's cores
    /// between them.
    pub fn start(
        models: Vec<(Loaded, EngineConfig)>,
        pools: usize,
        metrics: EngineMetrics,
    ) -> std::io::Result<Self> {
        Self::start_on(models, &devices::Placement::pools(pools), metrics)
    }

    /// Starts each model's pools where `placement` says
    /// ([`devices::pool_configs`]): decode pools on each of its devices,
    /// each with its share of that device's KV memory, and a prefill pool
    /// if it names one; pools on the CPU share its cores.
    pub fn start_on(
        models: Vec<(Loaded, EngineConfig)>,
        placement: &devices::Placement,
        metrics: EngineMetrics,
    ) -> std::io::Result<Self> {
        let pools = placement.pools.max(1) * placement.devices.len().max(1)
            + usize::from(placement.prefill.is_some());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = if pools == 1 {
            0
        } else {
            (cores / pools).max(1)
        };
        let mut map = HashMap::new();
        for (loaded, config) in models {
            let loaded = Arc::new(loaded);
            let info = ModelInfo {
                id: loaded.name.clone(),
                context_length: loaded.model.config.context_length as u32,
            };
            let configs = devices::pool_configs(&config, placement);
            let decode = configs.len() - usize::from(placement.prefill.is_some());
            let mut handles = Vec::with_capacity(configs.len());
            for (i, config) in configs.into_iter().enumerate() {
                let placed = crate::metrics::PoolDeviceLabels {
                    model: info.id.clone(),
                    pool: i.to_string(),
                    device: config.device.name(),
                };
                metrics.pool_device.get_or_create(&placed).set(1);
                handles.push(engine_thread::spawn(
                    loaded.clone(),
                    config,
                    &info.id,
                    i,
                    threads,
                    metrics.clone(),
                )?);
            }
            map.insert(
                info.id.clone(),
                Served {
                    loaded,
                    info,
                    pools: handles,
                    decode,
                    formats: OnceLock::new(),
                },
            );
        }
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        Ok(Self {
            models: map,
            secret,
            metrics,
            weights: RwLock::default(),
            max_unread: outlet::MAX_UNREAD.into(),
        })
    }

    /// Sets how many entries (deltas, and the log-probabilities each
    /// carries) a call's samples may leave unread between them before the
    /// engine ends them ([`outlet::MAX_UNREAD`] unless set).
    pub fn set_max_unread(&self, entries: usize) {
        self.max_unread.store(entries, Ordering::Relaxed);
    }

    /// Test-only: makes the next step of `model`'s pool `pool` panic.
    /// False if there is no such pool.
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self, model: &str, pool: usize) -> bool {
        self.inject_fault(model, pool, crate::engine::Fault::Panic)
    }

    /// Test-only: makes the next step of `model`'s pool `pool` fail with
    /// `fault`. False if there is no such pool.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self, model: &str, pool: usize, fault: crate::engine::Fault) -> bool {
        self.models
            .get(model)
            .and_then(|m| m.pools.get(pool))
            .is_some_and(|p| p.tx.send(Msg::InjectFault(fault)).is_ok())
    }

    /// The latest figures of `model`'s engines.
    pub fn snapshot(&self, model: &str) -> Option<EngineSnapshot> {
        let pools = &self.models.get(model)?.pools;
        let sum = |slot| figure(pools, slot);
        Some(EngineSnapshot {
            free_pages: sum(FREE_PAGES),
            cached_pages: sum(CACHED_PAGES),
            total_pages: sum(TOTAL_PAGES),
            integrity_aborts: sum(INTEGRITY_ABORTS) as u64,
            requests: pools.iter().map(|p| p.load.load(Ordering::Relaxed)).sum(),
        })
    }

    /// [`Self::submit`], for a long prompt or output format off the async
    /// runtime's worker (where there are several): templating, tokenizing
    /// and hashing a few megabytes of text, or compiling a large schema,
    /// takes a while, and the worker's other tasks, other tenants'
    /// handlers and streams among them, would wait for it.
    fn submit_aside(&self, call: ModelCall, n: usize) -> Result<Submitted, AiError> {
        let format = match &call.params.format {
            Some(Format::JsonSchema(text) | Format::Grammar(text)) => text.len(),
            _ => 0,
        };
        let bytes = policy::templated_bytes(&call) + format;
        if bytes > MAX_PROMPT_BYTES {
            return Err(AiError::InvalidInput(format!(
                "the call's prompt, tools and output format come to {bytes} bytes; a call may \
                 bring at most {MAX_PROMPT_BYTES} (the model reads at most its context)"
            )));
        }
        if bytes >= ASIDE_PROMPT_BYTES {
            crate::aside::aside(|| self.submit(call, n))
        } else {
            self.submit(call, n)
        }
    }

    /// Sends `n` samples of `call` to a pool: their channels, and whether
    /// their replies may be tool calls.
    fn submit(&self, call: ModelCall, n: usize) -> Result<Submitted, AiError> {
        let arrived = Instant::now();
        let ModelCall {
            tenant,
            model,
            prompt,
            params,
        } = call;
        let (tenant, model) = (tenant.as_str(), model.as_str());
        let served = self.models.get(model).ok_or_else(|| {
            let mut names: Vec<&str> = self.models.keys().map(String::as_str).collect();
            names.sort();
            AiError::ModelNotFound(format!(
                "model `{model}` is not served here; available: {}",
                names.join(", ")
            ))
        })?;
        let session = params.session.clone();
        let tools = Tools::from_params(&params)?;
        let mut generate = generate_params(params)?;
        if let Some(t) = &tools {
            generate.format = Some(OutputFormat::Grammar(t.grammar()));
        }
        let tk = &served.loaded.tokenizer;
        let text = match prompt {
            Prompt::Chat(m) => {
                let knows = tk.template_knows_tools();
                let (m, listed) = tools::chat_messages(m, tools.as_ref(), knows);
                tk.chat_prompt_with_tools(&m, listed.as_deref())
            }
            Prompt::Text(_) if tools.is_some() => {
                return Err(AiError::InvalidInput(
                    "tools need a chat: send messages, not a raw prompt".into(),
                ));
            }
            Prompt::Text(p) => Ok(p),
        };
        let ids = text
            .and_then(|t| tk.encode(&t, true))
            .map_err(|e| AiError::InvalidInput(e.to_string()))?;
        check_prompt(&ids, &served.loaded.model.config, &served.pools)?;
        let format = (generate.format.as_ref())
            .map(|f| served.compile(tenant, f))
            .transpose()?;
        let salt = Salt::derive(&self.secret, model, tenant);
        let hashes = prefix::page_hashes(&salt, &ids, PAGE_SIZE);
        let loads: Vec<PoolLoad> = served.pools[..served.decode]
            .iter()
            .map(|p| PoolLoad {
                requests: p.load.load(Ordering::Relaxed),
                capacity: p.capacity,
            })
            .collect();
        let route = router::choose(tenant, session.as_deref(), &loads, |i| {
            served.pools[i].cached_prefix(&hashes)
        });
        if let Route::Spilled(_) = route {
            self.metrics
                .pool_spills
                .get_or_create(&ModelLabels {
                    model: model.to_owned(),
                })
                .inc();
        }
        // With a prefill pool, the chosen decode pool runs the request
        // once the prefill pool has computed its prompt.
        let decode = &served.pools[route.pool()];
        let (pool, then) = match served.pools.get(served.decode) {
            Some(prefill) => (prefill, Some(decode.forward())),
            None => (decode, None),
        };
        self.metrics
            .pool_requests
            .get_or_create(&PoolLabels {
                model: model.to_owned(),
                pool: route.pool().to_string(),
            })
            .inc();
        let (outs, rxs) = outlet::outlets(n, self.max_unread.load(Ordering::Relaxed));
        pool.load.fetch_add(n, Ordering::Relaxed);
        let weight = self
            .weights
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(tenant)
            .copied()
            .unwrap_or(1);
        let prompt = ids.len();
        let sent = pool.tx.send(Msg::Submit(Box::new(Submit {
            tenant: tenant.into(),
            weight,
            salt,
            ids,
            params: generate,
            format,
            outs,
            restarts: 0,
            then,
        })));
        if sent.is_err() {
            pool.load.fetch_sub(n, Ordering::Relaxed);
            return Err(AiError::RuntimeError(
                "the model's engine has stopped".into(),
            ));
        }
        let first_token = self
            .metrics
            .first_token
            .get_or_create(&TenantModelLabels {
                tenant: tenant.to_owned(),
                model: model.to_owned(),
            })
            .clone();
        Ok(Submitted {
            rxs,
            tools: tools.is_some(),
            first_token: (first_token, arrived),
            prompt,
        })
    }
}

/// The code that starts the message of a call failed by an engine restart
/// (the API answers it as its error code).
pub const ENGINE_RESTARTED: &str = "engine_restarted";

/// The error of a request failed by a panic or error inside its engine's
/// step; the engine was rebuilt and takes new requests.
fn engine_restarted(why: &str) -> AiError {
    AiError::Aborted(format!(
        "{ENGINE_RESTARTED}: the model's engine {why}; it has been restarted and this request \
         was stopped. Retry it; if it fails again, report it to the operator"
    ))
}

type Fut<'a, T> = kiln_runtime::BoxFuture<'a, Result<T, AiError>>;

impl Inference for ServedModels {
    fn call(&self, call: ModelCall) -> Fut<'_, Completion> {
        let sent = self.submit_aside(call, 1);
        Box::pin(async move { collect(sent?.one()?).await })
    }

    fn stream(&self, call: ModelCall) -> Fut<'_, Box<dyn TokenStream>> {
        let sent = self.submit_aside(call, 1);
        Box::pin(async move { Ok(Box::new(sent?.one()?) as Box<dyn TokenStream>) })
    }

    fn stream_samples(&self, call: ModelCall, n: usize) -> Fut<'_, Vec<Box<dyn TokenStream>>> {
        let sent = self.submit_aside(call, n);
        Box::pin(async move {
            let streams = sent?.streams();
            Ok(streams
                .map(|s| Box::new(s) as Box<dyn TokenStream>)
                .collect())
        })
    }

    fn load(&self) -> Vec<kiln_runtime::ModelLoad> {
        let mut loads: Vec<kiln_runtime::ModelLoad> = (self.models.iter())
            .map(|(name, served)| {
                let sum = |slot| figure(&served.pools, slot);
                let held: usize = (served.pools.iter())
                    .map(|p| p.load.load(Ordering::Relaxed))
                    .sum();
                let running = sum(RUNNING);
                kiln_runtime::ModelLoad {
                    model: name.clone(),
                    running,
                    waiting: held.saturating_sub(running),
                    kv_pages: sum(TOTAL_PAGES),
                    kv_pages_free: sum(FREE_PAGES),
                    page_tokens: PAGE_SIZE,
                }
            })
            .collect();
        loads.sort_by(|a, b| a.model.cmp(&b.model));
        loads
    }

    fn set_share_weight(&self, tenant: &str, weight: u32) {
        let mut w = self.weights.write().unwrap_or_else(|p| p.into_inner());
        w.insert(tenant.to_owned(), weight);
    }

    fn close(&self) {
        for pool in self.models.values().flat_map(|m| &m.pools) {
            let _ = pool.tx.send(Msg::Close);
        }
        for pool in self.models.values().flat_map(|m| &m.pools) {
            pool.join();
        }
    }

    fn list_models(&self, _tenant: &str) -> Vec<ModelInfo> {
        let mut v: Vec<ModelInfo> = self.models.values().map(|s| s.info.clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }
}

#[cfg(test)]
#[path = "params_fuzz.rs"]
mod fuzz;
