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
}

impl ServeConfig {
    /// Defaults for a data directory: loopback:8080, 32 MiB uploads, the
    /// runtime's default limits, a 10 s drain.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: data_dir.into(),
            tls: None,
            max_upload_bytes: 32 << 20,
            limits: Limits::default(),
            drain_timeout: Duration::from_secs(10),
        }
    }
}
