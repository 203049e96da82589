//! Kiln's inference engine.
//!
//! - [`model`]: loading (GGUF, safetensors, synthetic), tokenizers and chat
//!   templates, each architecture's forward pass written once over the
//!   operations the CPU and CUDA backends implement, and the step contract.
//! - [`engine`]: continuous batching over paged KV: scheduler → KV cache
//!   manager → block pool, with page tags checked before every read.
//!
//! It knows nothing of HTTP, keys or deployments: a tenant is only the id
//! in a page tag and the salt of a prefix cache.

pub mod engine;
pub mod model;

/// Cases a property test of untrusted input runs: `default`, or
/// `PROPTEST_CASES` for a longer run.
pub fn fuzz_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}
