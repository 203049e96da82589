//! Errors of the runtime: deploy-time validation and per-request failures.

use std::fmt;

/// A limit that a guest ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitKind {
    /// Guest CPU time.
    CpuTime,
    /// Wall-clock time.
    WallTime,
    /// Linear memory size.
    Memory,
}

impl LimitKind {
    /// Stable lower-case name, used in metrics labels and error types.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::CpuTime => "cpu_time",
            LimitKind::WallTime => "wall_time",
            LimitKind::Memory => "memory",
        }
    }
}

impl fmt::Display for LimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitKind::CpuTime => "CPU time limit exceeded",
            LimitKind::WallTime => "wall time limit exceeded",
            LimitKind::Memory => "memory limit exceeded",
        })
    }
}

impl std::error::Error for LimitKind {}

/// Errors from loading or validating a component.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The bytes are not a WebAssembly component (or do not compile).
    #[error("not a valid WebAssembly component: {0}")]
    InvalidComponent(String),
    /// The component imports something Kiln does not provide.
    #[error("component imports something Kiln does not provide: {0}")]
    UnsupportedImport(String),
    /// The component does not export `wasi:http/incoming-handler`.
    #[error("component does not export wasi:http/incoming-handler@0.2.x: {0}")]
    MissingHandler(String),
    /// Setting up the engine or its cache failed.
    #[error("runtime setup failed: {0}")]
    Setup(String),
}

/// Why an invocation produced no response from the guest.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// The guest hit a resource limit.
    #[error("{kind} ({detail})")]
    Limit {
        /// Which limit.
        kind: LimitKind,
        /// The configured value, for the message.
        detail: String,
    },
    /// The guest trapped.
    #[error("guest trapped: {0}")]
    Trap(String),
    /// The guest returned without setting a response.
    #[error("guest returned without sending a response")]
    NoResponse,
    /// Every instance slot is in use.
    #[error("server at capacity: {0}")]
    Overloaded(String),
    /// The guest set an error response code instead of a response.
    #[error("guest reported an error: {0}")]
    Guest(String),
    /// Anything else (a host bug, not the guest's fault).
    #[error("internal error: {0}")]
    Internal(String),
}
