//! Configuration of `kiln serve`: the settings struct, and the optional
//! `kiln.toml` that lists the models to serve.

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
    /// How long a deploy waits for one of its tenant's deploy slots before
    /// it is refused.
    pub deploy_wait: Duration,
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
    /// The share of the instance pool one tenant may hold unless its
    /// policy says otherwise.
    pub tenant_instance_share: f64,
    /// Functions one tenant may have deployed, unless its policy says.
    pub max_functions: u32,
    /// A token that may read `/metrics` besides the admin token.
    pub metrics_token: Option<String>,
    /// Limits of connections and request bodies.
    pub net: NetLimits,
    /// How often the status page's history samples the metrics.
    pub status_interval: Duration,
    /// How long a deployed component that failed to load keeps its error
    /// before a request tries to load it again (the failure may have
    /// passed: memory pressure, storage repaired).
    pub reload_after: Duration,
    /// This node's name in the `x-kiln-node` header of every response
    /// (empty: `HOST:PORT`).
    pub node_name: String,
    /// Where to serve the gateway's load figures (vLLM's names) without a
    /// token, if anywhere.
    pub gateway_metrics: Option<SocketAddr>,
    /// A PostgreSQL URL for the control plane; `None`: SQLite in the data
    /// directory.
    pub database: Option<String>,
}

/// Limits that keep slow or greedy clients from holding the server.
#[derive(Debug, Clone)]
pub struct NetLimits {
    /// Time a connection has to send a request's head (HTTP/1), and may
    /// stay with no request in flight (HTTP/1 and HTTP/2) before it closes.
    pub header_read_timeout: Duration,
    /// Time a TLS client has to finish its handshake.
    pub tls_handshake_timeout: Duration,
    /// How often an idle HTTP/2 connection is pinged, and how long the
    /// client has to answer before the connection is closed.
    pub keep_alive: Duration,
    /// Connections open at once; past it a new plaintext connection gets a
    /// 503 and is closed (a TLS one is closed).
    pub max_connections: usize,
    /// Largest request body a function is given; past it, 413.
    pub max_body_bytes: u64,
    /// The longest a body the server reads whole (model calls, the control
    /// plane, deploys) may go without sending a byte; past it, 408.
    pub body_read_timeout: Duration,
    /// Model calls' bodies one tenant may have arriving at once; past them
    /// a call waits briefly for one to land, then gets 429.
    pub tenant_bodies: u32,
    /// The longest a response body with data ready may wait for the client
    /// to take it (a full TCP buffer, a closed HTTP/2 window) before the
    /// connection is dropped.
    pub write_stall_timeout: Duration,
}

impl Default for NetLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            tls_handshake_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(60),
            max_connections: 10_000,
            max_body_bytes: 16 << 20,
            body_read_timeout: Duration::from_secs(60),
            tenant_bodies: 64,
            write_stall_timeout: Duration::from_secs(60),
        }
    }
}

impl ServeConfig {
    /// Defaults for a data directory: loopback:8080, 32 MiB uploads, the
    /// runtime's default limits, a 10 s drain, 120 s model calls, 32 calls
    /// and a quarter of the instance pool in flight per tenant, and the
    /// default [`NetLimits`].
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: data_dir.into(),
            tls: None,
            max_upload_bytes: 32 << 20,
            deploy_wait: Duration::from_secs(30),
            limits: Limits::default(),
            drain_timeout: Duration::from_secs(10),
            model_deadline: Duration::from_secs(120),
            max_concurrent_calls: 32,
            tenant_instance_share: 0.25,
            max_functions: 100,
            metrics_token: None,
            status_interval: Duration::from_secs(2),
            reload_after: Duration::from_secs(30),
            node_name: String::new(),
            gateway_metrics: None,
            database: None,
            net: NetLimits::default(),
        }
    }
}

/// `kiln serve`'s flags for the limits that protect the server from
/// clients and tenants.
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Seconds a connection has to send a request's head (HTTP/1); also how
    /// long a connection (HTTP/1 or HTTP/2) may stay with no request in
    /// flight before it is closed.
    #[arg(long, default_value_t = 10)]
    pub header_read_timeout_s: u64,
    /// Seconds a TLS client has to finish its handshake.
    #[arg(long, default_value_t = 10)]
    pub tls_handshake_timeout_s: u64,
    /// Seconds between pings of an idle HTTP/2 connection, and to answer one.
    #[arg(long, default_value_t = 60)]
    pub keep_alive_s: u64,
    /// Connections open at once; past it, a new plaintext connection gets a
    /// 503 and is closed (a TLS one is closed).
    #[arg(long, default_value_t = 10_000)]
    pub max_connections: usize,
    /// Largest request body a function is given (`16MiB`); past it, 413.
    #[arg(long = "max-body", alias = "max-body-bytes", default_value = "16MiB", value_parser = parse_size_u64)]
    pub max_body_bytes: u64,
    /// Seconds a body the server reads whole (a model call's, a deploy's
    /// upload) may go without sending a byte; past it, 408.
    #[arg(long, default_value_t = 60)]
    pub body_read_timeout_s: u64,
    /// Seconds a response with data ready may wait for its client to take
    /// it (a full TCP buffer, a closed HTTP/2 window); past it, the
    /// connection is dropped.
    #[arg(long, default_value_t = 60)]
    pub write_stall_timeout_s: u64,
    /// The share of --max-instances one tenant may hold at once, unless its
    /// policy sets `max_instances`; past it, that tenant gets 429.
    #[arg(long, default_value_t = 0.25)]
    pub tenant_instance_share: f64,
    /// Functions one tenant may have deployed unless its policy sets
    /// `max_functions`; past it, deploying a new name gets 403.
    #[arg(long, default_value_t = 100)]
    pub max_functions: u32,
    /// A bearer token that may read /metrics (the admin token always may).
    #[arg(long, env = "KILN_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,
}

impl LimitArgs {
    /// Sets these limits in `config`.
    pub fn apply(&self, config: &mut ServeConfig) {
        config.net = NetLimits {
            header_read_timeout: Duration::from_secs(self.header_read_timeout_s),
            tls_handshake_timeout: Duration::from_secs(self.tls_handshake_timeout_s),
            keep_alive: Duration::from_secs(self.keep_alive_s),
            max_connections: self.max_connections,
            max_body_bytes: self.max_body_bytes,
            body_read_timeout: Duration::from_secs(self.body_read_timeout_s),
            write_stall_timeout: Duration::from_secs(self.write_stall_timeout_s),
            ..NetLimits::default()
        };
        config.tenant_instance_share = self.tenant_instance_share;
        config.max_functions = self.max_functions;
        config.metrics_token = self.metrics_token.clone().filter(|t| !t.is_empty());
    }
}

/// `kiln serve`'s flags for running as one node of several.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// This node's name, sent in every response's `x-kiln-node` header
    /// [default: HOST:PORT].
    #[arg(long, env = "KILN_NODE_NAME", help_heading = "Cluster")]
    pub node_name: Option<String>,
    /// Serve `GET /metrics` with only the Gateway API Inference Extension's
    /// load figures (`vllm:num_requests_waiting`, ...; no tenant names) on
    /// this address, without a token, for its endpoint picker.
    #[arg(long, value_name = "ADDR", help_heading = "Cluster")]
    pub gateway_metrics_listen: Option<SocketAddr>,
    /// Keep tenants, keys, functions and policies in this PostgreSQL
    /// database (`postgres://USER@HOST:PORT/DB`) instead of SQLite in
    /// --data-dir.
    #[arg(
        long,
        env = "KILN_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Cluster"
    )]
    pub database: Option<String>,
}

impl ClusterArgs {
    /// Sets these in `config`.
    pub fn apply(&self, config: &mut ServeConfig) {
        config.node_name = self.node_name.clone().unwrap_or_default();
        config.gateway_metrics = self.gateway_metrics_listen;
        config.database = self.database.clone().filter(|u| !u.is_empty());
    }
}

/// A model `kiln serve` loads: its served name and where it comes from
/// (anything `kiln run --model` takes).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The name clients and guests call it by.
    pub name: String,
    /// `smollm2-135m-instruct`, a `.gguf` file, a Hugging Face directory or
    /// `synthetic:NAME`.
    pub source: String,
}

/// The contents of a `kiln.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `[[model]]` tables, in order.
    #[serde(default)]
    pub model: Vec<ModelSpec>,
}

impl FileConfig {
    /// Parses a `kiln.toml`; the error names the problem and its place.
    pub fn parse(text: &str) -> Result<Self, String> {
        let c: Self = toml::from_str(text).map_err(|e| format!("kiln.toml: {e}"))?;
        let mut seen = std::collections::HashSet::new();
        for m in &c.model {
            if !seen.insert(m.name.as_str()) {
                return Err(format!("kiln.toml: model `{}` is listed twice", m.name));
            }
        }
        Ok(c)
    }
}

/// Parses `123`, `64KiB`, `512MiB`, `2GiB` (also KB/MB/GB as powers of 1024).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 512MiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit `{other}` (use KiB, MiB or GiB)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// [`parse_size`], as a u64.
fn parse_size_u64(s: &str) -> Result<u64, String> {
    parse_size(s).map(|n| n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_toml_lists_models_and_refuses_unknown_keys_and_duplicates() {
        let c = FileConfig::parse(
            "[[model]]\nname = \"small\"\nsource = \"smollm2-135m-instruct\"\n\n\
             [[model]]\nname = \"big\"\nsource = \"synthetic:llama-3-8b\"\n",
        )
        .unwrap();
        assert_eq!(c.model.len(), 2);
        assert_eq!(c.model[1].source, "synthetic:llama-3-8b");
        let e = FileConfig::parse("[[model]]\nname = \"a\"\npath = \"x\"\n").unwrap_err();
        assert!(e.contains("path"), "{e}");
        let e = FileConfig::parse(
            "[[model]]\nname = \"a\"\nsource = \"x\"\n[[model]]\nname = \"a\"\nsource = \"y\"\n",
        )
        .unwrap_err();
        assert!(e.contains("twice"), "{e}");
        assert_eq!(FileConfig::parse("").unwrap(), FileConfig::default());
    }
}
