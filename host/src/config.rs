//! Configuration of `kiln serve`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kiln_runtime::Limits;

/// Everything `kiln serve` can be told.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Directory for the database, components and compiled artifacts.
    pub data_dir: PathBuf,
    /// PEM certificate chain and key; TLS is on when both are set.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Largest component upload accepted, in bytes.
    pub max_upload_bytes: usize,
    /// Limits of every request's instance.
    pub limits: Limits,
    /// How long shutdown waits for requests in flight.
    pub drain_timeout: Duration,
    /// Deadline of one model call, from a guest or the API (a guest's call
    /// is also bounded by its invocation's wall-time limit).
    pub model_deadline: Duration,
    /// Model calls a tenant may have in flight unless its policy says
    /// otherwise.
    pub max_concurrent_calls: u32,
}

impl ServeConfig {
    /// Defaults for a data directory: loopback:8080, 32 MiB uploads, the
    /// runtime's default limits, a 10 s drain, 120 s model calls, 32 calls
    /// in flight per tenant.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: data_dir.into(),
            tls: None,
            max_upload_bytes: 32 << 20,
            limits: Limits::default(),
            drain_timeout: Duration::from_secs(10),
            model_deadline: Duration::from_secs(120),
            max_concurrent_calls: 32,
        }
    }
}
