//! The `kiln` server: HTTP front end, control plane, function routing and
//! the inference engine.
//!
//! [`server::Server`] binds a listener over an [`app::App`]; requests go
//! through [`api::handle`], which authenticates, routes, and runs functions
//! through `kiln-runtime`.

pub mod api;
pub mod app;
pub mod auth;
pub mod bench;
pub mod client;
pub mod components;
pub mod config;
pub mod db;
pub mod engine;
pub mod fairness;
pub mod metrics;
pub mod model;
pub mod names;
pub mod server;
pub mod serving;
/// The model backend of a server that serves none.
pub use kiln_runtime::NoModels;

/// Cases a property test of untrusted input runs: `default`, or
/// `PROPTEST_CASES` for a longer run.
#[cfg(test)]
pub(crate) fn fuzz_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}
