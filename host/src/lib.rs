//! The `kiln` server: HTTP front end, control plane, function routing and
//! the inference engine.
//!
//! [`server::Server`] binds a listener over an [`app::App`]; requests go
//! through [`api::handle`], which authenticates, routes, and runs functions
//! through `kiln-runtime`.

pub mod api;
pub mod app;
pub mod aside;
pub mod auth;
pub mod bench;
pub mod bench_plot;
pub mod client;
pub mod components;
pub mod config;
pub mod db;
pub mod fairness;
pub mod gateway_metrics;
pub mod idle;
pub mod loadgen;
pub mod metrics;
pub mod names;
pub mod project;
pub mod server;
pub mod serving;
pub mod status;
pub use kiln_engine::{engine, model};
/// The model backend of a server that serves none.
pub use kiln_runtime::NoModels;

#[cfg(test)]
pub(crate) use kiln_engine::fuzz_cases;
