//! Support for Kiln's end-to-end tests: guest components built from the
//! workspace, and a real server on 127.0.0.1:0.

pub mod forced;
pub mod nginx;
pub mod polyglot;
pub mod postgres;
pub mod staggered;
pub use forced::{Forced, kl_nats, teacher_forced};
pub use polyglot::{build_project, guest_tools};
pub use staggered::{Arrivals, PROMPTS, greedy_to, run_salted, staggered, tokens_of};

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kiln_host::config::ServeConfig;
use kiln_host::metrics::Metrics;
use kiln_host::server::Server;
use kiln_host::serving::ServedModels;
use tokio::sync::oneshot;

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// Builds the example and test guests for `wasm32-wasip2` (once per test
/// process) and returns the path of `name`'s component.
///
/// Uses its own target directory so it never waits on the lock of the
/// `cargo test` that runs it.
pub fn guest(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        let target_dir = workspace().join("target").join("guests");
        // A fresh machine may lack the target (rust-toolchain.toml lists it,
        // but rustup only adds it when it installs the toolchain itself).
        let _ = std::process::Command::new("rustup")
            .args(["target", "add", "wasm32-wasip2"])
            .output();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = std::process::Command::new(cargo)
            .current_dir(workspace())
            .args(["build", "--target", "wasm32-wasip2", "--profile", "guest"])
            .args([
                "-p",
                "hello",
                "-p",
                "chat",
                "-p",
                "summarize",
                "-p",
                "misbehave",
                "-p",
                "legacy",
                "-p",
                "extract",
                "--target-dir",
            ])
            .arg(&target_dir)
            .output()
            .map_err(|e| format!("running cargo: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(target_dir.join("wasm32-wasip2").join("guest"))
    });
    match dir {
        Ok(dir) => dir.join(format!("{name}.wasm")),
        Err(e) => panic!("building the guest components failed:\n{e}"),
    }
}

/// Runs the project's install script `scripts/NAME` (which installs a
/// tool once, then prints its path) and returns that path. Scripts run
/// one at a time (two apt-gets would fight over its lock), each once per
/// test process.
pub fn installed_by(name: &str) -> PathBuf {
    static DONE: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, path)) = done.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let path = run_install_script(name);
    done.push((name.to_owned(), path.clone()));
    path
}

fn run_install_script(name: &str) -> PathBuf {
    PathBuf::from(script_output(name).trim())
}

/// What the project's script `scripts/NAME` prints, once it has succeeded.
pub fn script_output(name: &str) -> String {
    let script = workspace().join("scripts").join(name);
    let out = std::process::Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A running server with a temporary (or given) data directory.
pub struct TestServer {
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    /// The admin token.
    pub admin: String,
    /// An HTTP client.
    pub http: reqwest::Client,
    /// The server's shared state.
    pub app: Arc<kiln_host::app::App>,
    /// The served models, when the server serves the default model.
    pub models: Option<Arc<ServedModels>>,
    data_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    stop: Option<oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// The admin token the tests use.
pub const ADMIN: &str = "test-admin-token";

impl TestServer {
    /// The server's data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Starts a server with default settings on a fresh data dir.
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// Starts a server on a fresh data dir after `tweak` edits the config.
    pub async fn start_with(tweak: impl FnOnce(&mut ServeConfig)) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut s = Self::start_in(tmp.path(), tweak).await;
        s._tmp = Some(tmp);
        s
    }

    /// Starts a server on a fresh data dir that serves the default model.
    pub async fn start_with_models() -> Self {
        Self::start_with_pools(1, |_| {}).await
    }

    /// Starts a server on a fresh data dir that serves the default model
    /// on `pools` decode pools, after `tweak` edits the config.
    pub async fn start_with_pools(pools: usize, tweak: impl FnOnce(&mut ServeConfig)) -> Self {
        let config = kiln_host::engine::EngineConfig {
            kv_memory: 64 << 20,
            ..Default::default()
        };
        let metrics = Metrics::default();
        let served = Arc::new(
            ServedModels::start(
                vec![(default_model(), config)],
                pools,
                metrics.engine.clone(),
            )
            .expect("engine threads"),
        );
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut s = Self::start_full(tmp.path(), tweak, served.clone(), metrics).await;
        s.models = Some(served);
        s._tmp = Some(tmp);
        s
    }

    /// Starts a node of a cluster: the default model on one pool, the
    /// control plane on the database at `url` (PostgreSQL).
    pub async fn start_on_database(url: &str) -> Self {
        let url = url.to_owned();
        Self::start_with_pools(1, move |c| c.database = Some(url)).await
    }

    /// Starts a server on a fresh data dir with a given model backend.
    pub async fn start_with_backend(backend: Arc<dyn kiln_runtime::Inference>) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut s = Self::start_full(tmp.path(), |_| {}, backend, Metrics::default()).await;
        s._tmp = Some(tmp);
        s
    }

    /// Starts a server on a fresh data dir with a given model backend,
    /// after `tweak` edits the config.
    pub async fn start_with_backend_config(
        backend: Arc<dyn kiln_runtime::Inference>,
        tweak: impl FnOnce(&mut ServeConfig),
    ) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut s = Self::start_full(tmp.path(), tweak, backend, Metrics::default()).await;
        s._tmp = Some(tmp);
        s
    }

    /// Starts a server on `data_dir`.
    pub async fn start_in(data_dir: &Path, tweak: impl FnOnce(&mut ServeConfig)) -> Self {
        Self::start_full(
            data_dir,
            tweak,
            Arc::new(kiln_host::NoModels),
            Metrics::default(),
        )
        .await
    }

    async fn start_full(
        data_dir: &Path,
        tweak: impl FnOnce(&mut ServeConfig),
        backend: Arc<dyn kiln_runtime::Inference>,
        metrics: Metrics,
    ) -> Self {
        let mut config = ServeConfig::new(data_dir);
        config.listen = "127.0.0.1:0".parse().expect("addr");
        config.limits.max_instances = 400;
        tweak(&mut config);
        let server = Server::bind(config, Some(ADMIN.into()), backend, metrics)
            .await
            .expect("server binds");
        let url = format!("http://{}", server.local_addr);
        let app = server.app.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let join = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        Self {
            url,
            admin: ADMIN.into(),
            http: reqwest::Client::new(),
            app,
            models: None,
            data_dir: data_dir.to_owned(),
            _tmp: None,
            stop: Some(stop),
            join: Some(join),
        }
    }

    /// Stops the server (graceful drain) and starts a new one on the same
    /// data directory.
    pub async fn restart(self) -> Self {
        self.restart_with(|_| {}).await
    }

    /// Stops the server and starts another on the same data dir after
    /// `tweak` edits the config.
    pub async fn restart_with(mut self, tweak: impl FnOnce(&mut ServeConfig)) -> Self {
        self.stop().await;
        let mut next = Self::start_in(&self.data_dir, tweak).await;
        next._tmp = self._tmp.take();
        next
    }

    /// Stops the server and waits for it to drain.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(join) = self.join.take() {
            join.await.expect("server task").expect("server ran");
        }
    }

    /// Creates a tenant; returns its API key.
    pub async fn tenant(&self, name: &str) -> String {
        let resp = self
            .http
            .post(format!("{}/v1/tenants", self.url))
            .bearer_auth(&self.admin)
            .json(&serde_json::json!({ "name": name }))
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status(), 201, "creating tenant {name}");
        let v: serde_json::Value = resp.json().await.expect("json");
        v["api_key"].as_str().expect("api_key").to_owned()
    }

    /// Uploads `bytes` as function `name` with `key`; returns the response.
    pub async fn put(&self, key: &str, name: &str, bytes: Vec<u8>) -> reqwest::Response {
        self.http
            .put(format!("{}/v1/functions/{name}", self.url))
            .bearer_auth(key)
            .body(bytes)
            .send()
            .await
            .expect("request")
    }

    /// Deploys guest `guest` as `name`, asserting success.
    pub async fn deploy(&self, key: &str, name: &str, guest_name: &str) -> serde_json::Value {
        let bytes = std::fs::read(guest(guest_name)).expect("guest component");
        let resp = self.put(key, name, bytes).await;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(status, 201, "deploy failed: {body}");
        body
    }

    /// Sets a tenant's model policy through the admin API.
    pub async fn set_policy(&self, tenant: &str, policy: serde_json::Value) -> reqwest::Response {
        self.http
            .put(format!("{}/v1/tenants/{tenant}/policy", self.url))
            .bearer_auth(&self.admin)
            .json(&policy)
            .send()
            .await
            .expect("request")
    }

    /// GETs `path` (e.g. `/v1/models`) with the bearer `token`; the JSON
    /// answer.
    pub async fn get_json(&self, token: &str, path: &str) -> serde_json::Value {
        self.http
            .get(format!("{}{path}", self.url))
            .bearer_auth(token)
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("a JSON answer")
    }

    /// POSTs `body` to the OpenAI-style endpoint `path` (e.g.
    /// `/v1/chat/completions`) with `key`; the status and the JSON answer.
    pub async fn openai(
        &self,
        key: &str,
        path: &str,
        session: Option<&str>,
        body: &serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.url))
            .bearer_auth(key)
            .json(body);
        if let Some(s) = session {
            req = req.header("x-session-affinity", s);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("a JSON answer"))
    }

    /// The value of the Prometheus sample whose line contains every one of
    /// `parts` (0 if there is none).
    pub async fn metric(&self, parts: &[&str]) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.url))
            .bearer_auth(&self.admin)
            .send()
            .await
            .expect("request")
            .text()
            .await
            .expect("text");
        text.lines()
            .filter(|l| !l.starts_with('#') && parts.iter().all(|p| l.contains(p)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// GET `/fn/{tenant}/{function}{path}`.
    pub async fn call(&self, tenant: &str, function: &str, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}/fn/{tenant}/{function}{path}", self.url))
            .send()
            .await
            .expect("request")
    }
}

/// A Python with the official `openai` client, in a virtual environment
/// under `target/` made on first use.
pub fn python_with_openai() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| python_venv("pyenv-openai", "import openai", &[OPENAI_CLIENT]))
        .clone()
}

/// A Python with NVIDIA's NVRTC library and CUDA headers from PyPI, which
/// compile CUDA C without a GPU or a CUDA install.
pub fn python_with_nvrtc() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        python_venv(
            "pyenv-nvrtc",
            "import nvidia.cuda_nvrtc, nvidia.cuda_runtime",
            &NVRTC_PACKAGES,
        )
    })
    .clone()
}

/// The pinned NVRTC and CUDA runtime header packages.
pub const NVRTC_PACKAGES: [&str; 2] = [
    "nvidia-cuda-nvrtc-cu12==12.9.86",
    "nvidia-cuda-runtime-cu12==12.9.79",
];

/// A Python with `packages` installed, in a virtual environment of its own
/// under `target/` (made on first use).
pub fn python_venv(name: &str, probe: &str, packages: &[&str]) -> PathBuf {
    let venv = workspace().join("target").join(name);
    let python = venv.join("bin").join("python");
    let ready = std::process::Command::new(&python)
        .args(["-c", probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if ready {
        return python;
    }
    let run = |cmd: &mut std::process::Command| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(std::process::Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv));
    run(std::process::Command::new(&python)
        .args(["-m", "pip", "install", "--quiet"])
        .args(packages));
    python
}

/// The pinned version of OpenAI's Python client the tests drive Kiln with.
pub const OPENAI_CLIENT: &str = "openai==3.57.0";

/// The `error.type` of a JSON error response, and its status.
pub async fn error_of(resp: reqwest::Response) -> (u16, String, String) {
    let status = resp.status().as_u16();
    let v: serde_json::Value = resp.json().await.expect("error body is JSON");
    (
        status,
        v["error"]["type"].as_str().unwrap_or_default().to_owned(),
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// The default model (fetched into the cache on first use), loaded once
/// per test process; each call gets its own copy of the weights.
pub fn default_model() -> kiln_host::model::Loaded {
    default_model_as(kiln_host::model::WeightFormat::Native)
}

/// The default model with its projections in `weights` (one format, or
/// one for each phase).
pub fn default_model_as(
    weights: impl Into<kiln_host::model::WeightPlan>,
) -> kiln_host::model::Loaded {
    use kiln_host::model;
    static SOURCE: OnceLock<Result<String, String>> = OnceLock::new();
    let source = SOURCE.get_or_init(|| {
        model::resolve_model(model::DEFAULT_MODEL, &model::default_cache_dir())
            .map_err(|e| e.to_string())
    });
    match source {
        Ok(s) => {
            model::load_as(model::DEFAULT_MODEL, s, weights).expect("loading the default model")
        }
        Err(e) => panic!("fetching the default model failed: {e}"),
    }
}

/// `prompt` as one user message through the engine's chat template, as
/// token ids.
pub fn chat_ids(e: &kiln_host::engine::Engine, prompt: &str) -> Vec<u32> {
    let tk = &e.loaded().tokenizer;
    let msgs = [kiln_host::model::ChatMessage::text("user", prompt)];
    tk.encode(&tk.chat_prompt(&msgs).unwrap(), true).unwrap()
}

/// Runs `work` in a task beside one that only counts its own turns: how
/// many turns that task got while `work` ran, and `work`'s output. On a
/// runtime of one worker, `work` that never waits itself gives it none
/// unless it hands the worker on (`block_in_place`).
pub async fn turns_beside<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> (u64, T) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let turns = Arc::new(AtomicU64::new(0));
    let counter = tokio::spawn({
        let turns = turns.clone();
        async move {
            loop {
                turns.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        }
    });
    let worked = tokio::spawn({
        let turns = turns.clone();
        async move {
            let before = turns.load(Ordering::Relaxed);
            let out = work.await;
            (turns.load(Ordering::Relaxed) - before, out)
        }
    })
    .await
    .expect("the work task ran to its end");
    counter.abort();
    worked
}
