//! Models: loading (GGUF, safetensors, synthetic), tokenizers and chat
//! templates, and the llama-family forward pass over paged KV.

mod config;
mod fetch;
pub mod gguf;
pub mod gpu;
mod llama;
mod load;
mod tokenizer;

pub use config::{Arch, ModelConfig};
pub use fetch::{DEFAULT_MODEL, default_cache_dir, resolve_model};
pub use llama::{BatchSeq, Draw, KvCache, Model};
pub use load::load;
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

/// A loaded model with its tokenizer.
pub struct Loaded {
    /// The name it is served under.
    pub name: String,
    /// Weights and forward pass.
    pub model: Model,
    /// Tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// Weights an engine uploaded to a GPU and gave back when it ended,
    /// for the next engine on that GPU (benchmarks build one engine after
    /// another; a copy of an 8B model costs seconds).
    pub gpu_weights: std::sync::Mutex<Option<(usize, Box<gpu::GpuModel>)>>,
}
