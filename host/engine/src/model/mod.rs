//! Models: loading (GGUF, safetensors, synthetic), tokenizers and chat
//! templates, each architecture's forward pass written once over the
//! operations two backends implement (the CPU and CUDA), and the step
//! contract with the engine.

mod arch;
mod config;
mod convert;
mod cpu;
mod cpu_tp;
mod fetch;
pub mod gguf;
pub mod gpu;
pub mod int4;
mod load;
mod phase;
mod progress;
mod runner;
mod shard;
pub mod step;
mod synthetic;
mod tokenizer;

pub use config::{Arch, ModelConfig};
pub use convert::{WeightFormat, WeightPlan};
pub use cpu::{KvCache, Model};
pub use cpu_tp::TpModel;
pub use fetch::{DEFAULT_MODEL, default_cache_dir, resolve_model};
pub use load::{load, load_as};
pub use runner::{PageBytes, Reserve, Runner, RunnerOptions};
pub use tokenizer::{ChatMessage, Tokenizer};

/// Errors of loading a model or its tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("{0}")]
    Io(String),
    /// A file is malformed.
    #[error("malformed model: {0}")]
    Format(String),
    /// A valid file uses something Kiln does not support.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The default model could not be fetched.
    #[error("{0}")]
    Fetch(String),
}

/// A kernel's shape check failing while weights are built: the file's
/// tensors do not fit together.
impl From<kiln_kernels::KernelError> for ModelError {
    fn from(e: kiln_kernels::KernelError) -> Self {
        ModelError::Format(e.to_string())
    }
}

/// Weights on a GPU: its ordinal, the model's, and decode's own copy.
pub type GpuWeights = (usize, Box<gpu::GpuModel>, Option<Box<gpu::GpuModel>>);

/// A loaded model with its tokenizer.
pub struct Loaded {
    /// The name it is served under.
    pub name: String,
    /// Weights and forward pass (of prefill chunks too, where the phases
    /// run on different weights).
    pub model: Model,
    /// Decode's own copy of the weights (`--weights prefill=F,decode=F`):
    /// steps' one-token rows run on it.
    pub decode: Option<Model>,
    /// Tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// Weights an engine uploaded to a GPU and gave back when it ended,
    /// for the next engine on that GPU (benchmarks build one engine after
    /// another; a copy of an 8B model costs seconds).
    pub gpu_weights: std::sync::Mutex<Option<GpuWeights>>,
}
