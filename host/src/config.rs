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
