//! The CLI's client for a running server (`kiln tenant create`,
//! `kiln deploy`).

use anyhow::{Context, bail};

/// Talks to a running server's control API.
pub struct Client {
    http: reqwest::Client,
    server: String,
    token: String,
}

impl Client {
    /// A client for `server` (e.g. `http://127.0.0.1:8080`) using `token`.
    pub fn new(server: &str, token: &str) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder().build()?,
            server: server.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
        })
    }

    async fn check(resp: reqwest::Response) -> anyhow::Result<serde_json::Value> {
        let status = resp.status();
        let body: serde_json::Value = resp
            .json()
            .await
            .with_context(|| format!("server answered {status} with a non-JSON body"))?;
        if !status.is_success() {
            let msg = body["error"]["message"].as_str().unwrap_or("unknown error");
            bail!("server answered {status}: {msg}");
        }
        Ok(body)
    }

    /// Creates a tenant (admin token); returns `{"name", "api_key"}`.
    pub async fn create_tenant(&self, name: &str) -> anyhow::Result<serde_json::Value> {
        let resp = self
            .http
            .post(format!("{}/v1/tenants", self.server))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({ "name": name }))
            .send()
            .await
            .with_context(|| format!("connecting to {}", self.server))?;
        Self::check(resp).await
    }

    /// Deploys `bytes` as `tenant`'s function `name` (tenant API key).
    pub async fn deploy(
        &self,
        tenant: &str,
        name: &str,
        bytes: Vec<u8>,
    ) -> anyhow::Result<serde_json::Value> {
        let resp = self
            .http
            .put(format!("{}/v1/functions/{name}", self.server))
            .bearer_auth(&self.token)
            .header("kiln-tenant", tenant)
            .header("content-type", "application/wasm")
            .body(bytes)
            .send()
            .await
            .with_context(|| format!("connecting to {}", self.server))?;
        Self::check(resp).await
    }
}
