//! Serving models to guests: each model's [`Engine`] runs on its own thread;
//! [`ServedModels`] implements the runtime's [`Inference`] over them.
//!
//! The engine thread owns all engine state; requests reach it over a
//! channel and their text comes back over a per-request channel. A request
//! whose receiver is gone (the guest dropped its stream, or the caller went
//! away) is cancelled at the next step, which frees its pages.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use kiln_runtime::{
    AiError, ChatRequest, CompleteRequest, Completion, FinishReason, Inference, ModelInfo, Params,
    StreamEnd, StreamEvent, TokenStream, Usage,
};
use tokio::sync::mpsc as tmpsc;

use crate::engine::{Engine, Event, Finish, GenerateParams, SeqId, TenantId};
use crate::model::{ChatMessage, Loaded};

/// What a request asks for, tokenized on the engine thread.
enum Prompt {
    Chat(Vec<ChatMessage>),
    Raw(String),
}

struct Submit {
    tenant: String,
    prompt: Prompt,
    params: GenerateParams,
    out: tmpsc::UnboundedSender<Out>,
}

/// Messages from the engine thread to one request.
enum Out {
    Text(String),
    Done {
        finish: Finish,
        prompt: usize,
        completion: usize,
    },
    Error(AiError),
}

/// A model's engine thread.
struct Served {
    tx: mpsc::Sender<Submit>,
    info: ModelInfo,
    gauges: Arc<Gauges>,
}

/// Engine figures the engine thread publishes after every step.
#[derive(Debug, Default)]
struct Gauges {
    free_pages: AtomicUsize,
    total_pages: AtomicUsize,
    integrity_aborts: AtomicU64,
    running: AtomicUsize,
}

/// A snapshot of one model's engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSnapshot {
    /// Free KV pages.
    pub free_pages: usize,
    /// All KV pages.
    pub total_pages: usize,
    /// Sequences aborted by the page-tag check.
    pub integrity_aborts: u64,
    /// Requests the engine holds (waiting or running).
    pub requests: usize,
}

/// The models a server serves, by name.
pub struct ServedModels {
    models: HashMap<String, Served>,
}

fn engine_thread(mut engine: Engine, rx: mpsc::Receiver<Submit>, gauges: Arc<Gauges>) {
    let mut tenants: HashMap<String, TenantId> = HashMap::new();
    let mut outs: HashMap<SeqId, tmpsc::UnboundedSender<Out>> = HashMap::new();
    gauges
        .total_pages
        .store(engine.total_pages(), Ordering::Relaxed);
    loop {
        gauges
            .free_pages
            .store(engine.free_pages(), Ordering::Relaxed);
        gauges
            .integrity_aborts
            .store(engine.stats().integrity_aborts, Ordering::Relaxed);
        gauges.running.store(outs.len(), Ordering::Relaxed);
        // Block for work when idle; otherwise take what has arrived.
        let first = if engine.has_work() {
            rx.try_recv().ok()
        } else {
            match rx.recv() {
                Ok(sub) => Some(sub),
                // Every handle is gone: the server is shutting down.
                Err(_) => return,
            }
        };
        for sub in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            let next = tenants.len() as u32;
            let tenant = *tenants.entry(sub.tenant).or_insert(TenantId(next));
            let tk = &engine.loaded().tokenizer;
            let text = match sub.prompt {
                Prompt::Chat(m) => tk.chat_prompt(&m),
                Prompt::Raw(p) => Ok(p),
            };
            let ids = text
                .and_then(|t| tk.encode(&t, true))
                .map_err(|e| AiError::InvalidInput(e.to_string()));
            match ids.and_then(|ids| {
                engine
                    .add(tenant, ids, sub.params)
                    .map_err(AiError::InvalidInput)
            }) {
                Ok(seq) => {
                    outs.insert(seq, sub.out);
                }
                Err(e) => {
                    let _ = sub.out.send(Out::Error(e));
                }
            }
        }
        // Callers that went away: cancel now, freeing their pages.
        let gone: Vec<SeqId> = outs
            .iter()
            .filter(|(_, o)| o.is_closed())
            .map(|(s, _)| *s)
            .collect();
        for seq in gone {
            engine.cancel(seq);
            outs.remove(&seq);
        }
        if !engine.has_work() {
            continue;
        }
        let events = match engine.step() {
            Ok(ev) => ev,
            Err(e) => {
                tracing::error!("engine step failed: {e}");
                for (_, o) in outs.drain() {
                    let _ = o.send(Out::Error(AiError::RuntimeError(format!(
                        "the engine failed: {e}"
                    ))));
                }
                continue;
            }
        };
        for ev in events {
            match ev {
                Event::Token { seq, text, .. } if !text.is_empty() => {
                    if let Some(o) = outs.get(&seq) {
                        let _ = o.send(Out::Text(text));
                    }
                }
                Event::Token { .. } => {}
                Event::Finished {
                    seq,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                } => {
                    if let Some(o) = outs.remove(&seq) {
                        let _ = o.send(Out::Done {
                            finish,
                            prompt: prompt_tokens,
                            completion: completion_tokens,
                        });
                    }
                }
            }
        }
    }
}

impl ServedModels {
    /// Starts one engine thread per model.
    pub fn start(models: Vec<(Loaded, crate::engine::EngineConfig)>) -> std::io::Result<Self> {
        let mut map = HashMap::new();
        for (loaded, config) in models {
            let info = ModelInfo {
                id: loaded.name.clone(),
                context_length: loaded.model.config.context_length as u32,
            };
            let engine = Engine::new(loaded, config);
            let (tx, rx) = mpsc::channel();
            let gauges = Arc::new(Gauges::default());
            let g = gauges.clone();
            std::thread::Builder::new()
                .name(format!("kiln-engine-{}", info.id))
                .spawn(move || engine_thread(engine, rx, g))?;
            map.insert(info.id.clone(), Served { tx, info, gauges });
        }
        Ok(Self { models: map })
    }

    /// The latest figures of `model`'s engine.
    pub fn snapshot(&self, model: &str) -> Option<EngineSnapshot> {
        let g = &self.models.get(model)?.gauges;
        Some(EngineSnapshot {
            free_pages: g.free_pages.load(Ordering::Relaxed),
            total_pages: g.total_pages.load(Ordering::Relaxed),
            integrity_aborts: g.integrity_aborts.load(Ordering::Relaxed),
            requests: g.running.load(Ordering::Relaxed),
        })
    }

    fn submit(
        &self,
        tenant: String,
        model: &str,
        prompt: Prompt,
        params: Params,
    ) -> Result<tmpsc::UnboundedReceiver<Out>, AiError> {
        let served = self.models.get(model).ok_or_else(|| {
            let mut names: Vec<&str> = self.models.keys().map(String::as_str).collect();
            names.sort();
            AiError::ModelNotFound(format!(
                "model `{model}` is not served here; available: {}",
                names.join(", ")
            ))
        })?;
        let params = generate_params(params)?;
        let (out, rx) = tmpsc::unbounded_channel();
        served
            .tx
            .send(Submit {
                tenant,
                prompt,
                params,
                out,
            })
            .map_err(|_| AiError::RuntimeError("the model's engine has stopped".into()))?;
        Ok(rx)
    }
}

/// The WIT params with the host's defaults, validated.
fn generate_params(p: Params) -> Result<GenerateParams, AiError> {
    let bad = |m: String| Err(AiError::InvalidInput(m));
    let temperature = p.temperature.unwrap_or(0.7);
    if !(0.0..=2.0).contains(&temperature) {
        return bad(format!(
            "temperature {temperature} is out of range: use 0 (greedy) to 2"
        ));
    }
    let top_p = p.top_p.unwrap_or(0.9);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad(format!(
            "top-p {top_p} is out of range: use a value in (0, 1]"
        ));
    }
    let max_tokens = p.max_tokens.unwrap_or(256);
    if max_tokens == 0 {
        return bad("max-tokens must be at least 1".into());
    }
    Ok(GenerateParams {
        max_tokens: max_tokens as usize,
        temperature,
        top_k: p.top_k.unwrap_or(0) as usize,
        top_p,
        seed: p.seed,
        stop: p.stop,
        ignore_eos: false,
    })
}

fn finish_reason(f: &Finish) -> Result<FinishReason, AiError> {
    match f {
        Finish::Stop => Ok(FinishReason::Stop),
        Finish::Length => Ok(FinishReason::Length),
        Finish::Aborted(why) => Err(AiError::Aborted(why.clone())),
    }
}

/// Usage of a finished request (no prefix cache yet: nothing cached).
fn usage(prompt: usize, completion: usize) -> Usage {
    Usage {
        prompt_tokens: prompt as u32,
        completion_tokens: completion as u32,
        cached_prompt_tokens: 0,
    }
}

async fn collect(mut rx: tmpsc::UnboundedReceiver<Out>) -> Result<Completion, AiError> {
    let mut text = String::new();
    while let Some(out) = rx.recv().await {
        match out {
            Out::Text(t) => text.push_str(&t),
            Out::Error(e) => return Err(e),
            Out::Done {
                finish,
                prompt,
                completion,
            } => {
                let usage = usage(prompt, completion);
                return Ok(Completion {
                    text,
                    finish_reason: finish_reason(&finish)?,
                    usage,
                });
            }
        }
    }
    Err(AiError::RuntimeError(
        "the engine dropped the request".into(),
    ))
}

struct Stream(tmpsc::UnboundedReceiver<Out>);

impl TokenStream for Stream {
    fn next(&mut self) -> kiln_runtime::BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(async move {
            match self.0.recv().await {
                Some(Out::Text(t)) => Ok(StreamEvent::Delta(t)),
                Some(Out::Error(e)) => Err(e),
                Some(Out::Done {
                    finish,
                    prompt,
                    completion,
                }) => Ok(StreamEvent::Done(StreamEnd {
                    finish_reason: finish_reason(&finish)?,
                    usage: usage(prompt, completion),
                })),
                None => Err(AiError::RuntimeError(
                    "the engine dropped the request".into(),
                )),
            }
        })
    }
}

fn messages(m: Vec<kiln_runtime::Message>) -> Vec<ChatMessage> {
    m.into_iter()
        .map(|m| ChatMessage {
            role: match m.role {
                kiln_runtime::Role::System => "system",
                kiln_runtime::Role::User => "user",
                kiln_runtime::Role::Assistant => "assistant",
            }
            .into(),
            content: m.content,
        })
        .collect()
}

impl Inference for ServedModels {
    fn chat(&self, req: ChatRequest) -> kiln_runtime::BoxFuture<'_, Result<Completion, AiError>> {
        let rx = self.submit(
            req.tenant,
            &req.model,
            Prompt::Chat(messages(req.messages)),
            req.params,
        );
        Box::pin(async move { collect(rx?).await })
    }

    fn stream_chat(
        &self,
        req: ChatRequest,
    ) -> kiln_runtime::BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        let rx = self.submit(
            req.tenant,
            &req.model,
            Prompt::Chat(messages(req.messages)),
            req.params,
        );
        Box::pin(async move { Ok(Box::new(Stream(rx?)) as Box<dyn TokenStream>) })
    }

    fn complete(
        &self,
        req: CompleteRequest,
    ) -> kiln_runtime::BoxFuture<'_, Result<Completion, AiError>> {
        let rx = self.submit(req.tenant, &req.model, Prompt::Raw(req.prompt), req.params);
        Box::pin(async move { collect(rx?).await })
    }

    fn list_models(&self, _tenant: &str) -> Vec<ModelInfo> {
        let mut v: Vec<ModelInfo> = self.models.values().map(|s| s.info.clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }
}
