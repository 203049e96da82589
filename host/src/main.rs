//! The `kiln` command: run the server, or talk to one.
#![allow(clippy::print_stdout, reason = "the CLI prints its results")]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kiln_host::client::Client;
use kiln_host::config::ServeConfig;
use kiln_host::engine::GenerateParams;
use kiln_host::server::{Server, shutdown_signal};

mod bench_cmd;
mod engine_args;
use bench_cmd::{BenchArgs, bench};
use engine_args::EngineArgs;

/// Kiln: serverless WebAssembly functions that call language models.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server.
    Serve(Box<ServeArgs>),
    /// Generate once from a model, without a server.
    Run(RunArgs),
    /// Measure prompt and decode throughput at several concurrencies.
    Bench(BenchArgs),
    /// Load a running server's API with several tenants and report each
    /// one's output tokens/s, time to first token and inter-token latency.
    Loadgen(kiln_host::loadgen::LoadArgs),
    /// Manage tenants on a running server (admin token).
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Make a new function project (its directory's name is the function's).
    Init {
        /// The project's directory, made here; its name is the function's.
        name: PathBuf,
        /// The language.
        #[arg(long, value_enum, default_value = "rust")]
        lang: kiln_host::project::Lang,
    },
    /// Build a function project into a component and print its path.
    Build {
        /// The project: a crate, or a directory with `app.py` or `app.js`.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Deploy a component, or a project (built first), as a tenant's
    /// function on a running server.
    Deploy {
        /// The tenant that owns the function (must match the API key).
        #[arg(long)]
        tenant: String,
        /// The function's name, `[a-z0-9-]{1,63}` (default: the project
        /// directory's or the file's name).
        #[arg(long)]
        name: Option<String>,
        /// A built component (`.wasm`) or a project directory.
        #[arg(default_value = ".")]
        file: PathBuf,
        /// The server's base URL.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        server: String,
        /// The tenant's API key.
        #[arg(long, env = "KILN_API_KEY", hide_env_values = true)]
        token: String,
    },
}

/// `kiln run`: generate once, without a server.
#[derive(clap::Args)]
struct RunArgs {
    /// Model: `smollm2-135m-instruct` (fetched on first use), a .gguf file,
    /// a Hugging Face directory, or `synthetic:NAME`.
    #[arg(long, default_value = kiln_host::model::DEFAULT_MODEL)]
    model: String,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Treat the prompt as a user message and apply the chat template.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = GenerateParams::DEFAULT_MAX_TOKENS)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = GenerateParams::DEFAULT_TEMPERATURE)]
    temperature: f32,
    /// Nucleus-sampling threshold.
    #[arg(long, default_value_t = GenerateParams::DEFAULT_TOP_P)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sampling seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    engine: EngineArgs,
    /// Print one JSON object: text, token_ids, prompt_tokens, completion_tokens.
    #[arg(long)]
    json: bool,
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    use kiln_host::engine::{Engine, TenantId};
    use kiln_host::model::{self, ChatMessage};
    let config = args.engine.config()?;
    let source = model::resolve_model(&args.model, &model::default_cache_dir())?;
    let loaded = model::load_as(&args.model, &source, args.engine.weights)?;
    let prompt = if args.chat {
        let msgs = [ChatMessage::text("user", args.prompt.clone())];
        loaded.tokenizer.chat_prompt(&msgs)?
    } else {
        args.prompt.clone()
    };
    let ids = loaded.tokenizer.encode(&prompt, true)?;
    let mut engine = Engine::new(loaded, config).map_err(anyhow::Error::msg)?;
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        stop: args.stop,
        ignore_eos: false,
        logprobs: None,
        format: None,
    };
    let out = engine
        .generate(TenantId(0), ids, params)
        .map_err(anyhow::Error::msg)?;
    if args.json {
        let v = serde_json::json!({
            "text": out.text,
            "token_ids": out.tokens,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.tokens.len(),
        });
        println!("{v}");
    } else {
        println!("{}", out.text);
    }
    Ok(())
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant and print its API key.
    Create {
        /// The tenant's name, `[a-z0-9-]{1,63}`.
        name: String,
        /// The server's base URL.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        server: String,
        /// The admin token (else read from ./.kiln/admin-token).
        #[arg(long, env = "KILN_ADMIN_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080", help_heading = "Listening")]
    listen: SocketAddr,
    /// Directory for the database, components and compiled artifacts.
    #[arg(long, default_value = "./.kiln", help_heading = "Listening")]
    data_dir: PathBuf,
    /// PEM certificate chain; enables TLS together with --tls-key.
    #[arg(long, requires = "tls_key", help_heading = "Listening")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert", help_heading = "Listening")]
    tls_key: Option<PathBuf>,
    /// Largest component upload accepted (`32MiB`, or bytes).
    #[arg(long = "max-upload", alias = "max-upload-bytes", default_value = "32MiB",
          value_parser = kiln_host::config::parse_size, help_heading = "Tenants and limits")]
    max_upload_bytes: usize,
    /// Linear memory limit per request (`128MiB`, or bytes).
    #[arg(long, default_value = "128MiB", value_parser = kiln_host::config::parse_size,
          help_heading = "Tenants and limits")]
    memory_limit: usize,
    /// The same in MiB (the older flag).
    #[arg(long, hide = true, conflicts_with = "memory_limit")]
    memory_limit_mib: Option<usize>,
    /// Guest CPU time limit per request, in milliseconds.
    #[arg(long, default_value_t = 50, help_heading = "Tenants and limits")]
    cpu_limit_ms: u64,
    /// Wall time limit per request, in seconds.
    #[arg(long, default_value_t = 30, help_heading = "Tenants and limits")]
    wall_limit_s: u64,
    /// Most instances alive at once (pooling allocator slots).
    #[arg(long, default_value_t = 1000, help_heading = "Tenants and limits")]
    max_instances: u32,
    /// Seconds shutdown waits for requests in flight.
    #[arg(long, default_value_t = 10, help_heading = "Listening")]
    drain_timeout_s: u64,
    /// A model to serve, as NAME=SOURCE (SOURCE as for `kiln run --model`);
    /// repeatable. Without it, the models of --config, else the default
    /// model.
    #[arg(long = "model", value_name = "NAME=SOURCE", help_heading = "Models")]
    models: Vec<String>,
    /// A `kiln.toml` listing models as `[[model]]` tables with `name` and
    /// `source` (default: ./kiln.toml when it exists).
    #[arg(long, help_heading = "Models")]
    config: Option<PathBuf>,
    /// Serve functions only, no models.
    #[arg(long, conflicts_with = "models", help_heading = "Models")]
    no_models: bool,
    /// Decode pools per model on each device; sessions stick to one by
    /// rendezvous hashing. Each pool gets an equal share of its device's
    /// --kv-memory, and on the CPU of the cores.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64), help_heading = "Models")]
    decode_pools: u32,
    /// A prefill pool on this device (`cpu`, `cuda:N`) computes every
    /// prompt and hands each sequence, its KV pages copied, to the decode
    /// pool its session picks (default: decode pools compute their own).
    #[arg(long, value_name = "DEVICE", help_heading = "Models")]
    prefill_device: Option<kiln_kernels::Device>,
    /// Deadline of one model call, in seconds (guest calls are also bounded
    /// by --wall-limit-s).
    #[arg(long, default_value_t = 120, help_heading = "Tenants and limits")]
    model_deadline_s: u64,
    /// Model calls a tenant may have in flight unless its policy says
    /// otherwise.
    #[arg(long, default_value_t = 32, help_heading = "Tenants and limits")]
    max_concurrent_calls: u32,
    #[command(flatten, next_help_heading = "Connections")]
    limits: kiln_host::config::LimitArgs,
    #[command(flatten, next_help_heading = "Cluster")]
    cluster: kiln_host::config::ClusterArgs,
    #[command(flatten, next_help_heading = "Engine")]
    engine: EngineArgs,
}

/// Loads the models `kiln serve` was asked for and starts their engines.
fn model_backend(
    args: &ServeArgs,
    metrics: &kiln_host::metrics::Metrics,
) -> anyhow::Result<Arc<dyn kiln_runtime::Inference>> {
    use kiln_host::model;
    if args.no_models {
        return Ok(Arc::new(kiln_runtime::NoModels));
    }
    let file = match &args.config {
        Some(path) => Some(
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        ),
        None => std::fs::read_to_string("kiln.toml").ok(),
    };
    let listed = match file {
        Some(text) => {
            kiln_host::config::FileConfig::parse(&text)
                .map_err(anyhow::Error::msg)?
                .model
        }
        None => Vec::new(),
    };
    let specs: Vec<(String, String)> = if !args.models.is_empty() {
        args.models
            .iter()
            .map(|m| {
                m.split_once('=')
                    .map(|(n, s)| (n.to_owned(), s.to_owned()))
                    .ok_or_else(|| anyhow::anyhow!("--model wants NAME=SOURCE, got `{m}`"))
            })
            .collect::<Result<_, _>>()?
    } else if !listed.is_empty() {
        listed.into_iter().map(|m| (m.name, m.source)).collect()
    } else {
        vec![(
            model::DEFAULT_MODEL.to_owned(),
            model::DEFAULT_MODEL.to_owned(),
        )]
    };
    let (devices, config) = args.engine.devices(args.prefill_device.is_some())?;
    if let Some(kiln_kernels::Device::Cuda(n)) = args.prefill_device {
        kiln_kernels::cuda::Gpu::probe(n)?;
    }
    let mut engines = Vec::new();
    for (name, spec) in specs {
        let source = model::resolve_model(&spec, &model::default_cache_dir())?;
        let loaded = model::load_as(&name, &source, args.engine.weights)?;
        tracing::info!(model = %name, "loaded {} parameters", loaded.model.config.parameters());
        engines.push((loaded, config.clone()));
    }
    let placement = kiln_host::serving::devices::Placement {
        devices,
        pools: args.decode_pools as usize,
        prefill: args.prefill_device,
    };
    Ok(Arc::new(kiln_host::serving::ServedModels::start_on(
        engines,
        &placement,
        metrics.engine.clone(),
    )?))
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = ServeConfig::new(args.data_dir.clone());
    config.listen = args.listen;
    config.tls = args.tls_cert.clone().zip(args.tls_key.clone());
    config.max_upload_bytes = args.max_upload_bytes;
    config.limits.memory_bytes = args.memory_limit_mib.map_or(args.memory_limit, |m| m << 20);
    config.limits.cpu_time = Duration::from_millis(args.cpu_limit_ms);
    config.limits.wall_time = Duration::from_secs(args.wall_limit_s);
    config.limits.max_instances = args.max_instances;
    config.drain_timeout = Duration::from_secs(args.drain_timeout_s);
    config.model_deadline = Duration::from_secs(args.model_deadline_s);
    config.max_concurrent_calls = args.max_concurrent_calls;
    args.limits.apply(&mut config);
    args.cluster.apply(&mut config);
    let admin = std::env::var("KILN_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let metrics = kiln_host::metrics::Metrics::default();
    let backend = tokio::task::block_in_place(|| model_backend(&args, &metrics))?;
    let server = Server::bind(config, admin, backend, metrics).await?;
    if server.admin_token.generated {
        eprintln!(
            "Generated the admin token (stored in <data-dir>/admin-token; shown once):\n  {}",
            server.admin_token.token
        );
    }
    tracing::info!("kiln listening on {scheme}://{}", server.local_addr);
    server.run(shutdown_signal()).await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Run(args) => tokio::task::spawn_blocking(move || run(args)).await?,
        Command::Bench(args) => tokio::task::spawn_blocking(move || bench(args)).await?,
        Command::Loadgen(mut args) => {
            let run = (args.prompt_run)
                .get_or_insert_with(kiln_host::loadgen::fresh_prompt_run)
                .clone();
            println!("prompt run {run} (--prompt-run {run} sends these prompts again)");
            if args.warmup_s > 0.0 {
                println!("the first {} s not counted", args.warmup_s);
            }
            let reports = kiln_host::loadgen::run(args).await?;
            print!("{}", kiln_host::loadgen::table(&reports));
            Ok(())
        }
        Command::Tenant {
            command:
                TenantCommand::Create {
                    name,
                    server,
                    token,
                },
        } => {
            let token = match token {
                Some(t) => t,
                None => std::fs::read_to_string(".kiln/admin-token")
                    .map(|t| t.trim().to_owned())
                    .context("no admin token: pass --token or set KILN_ADMIN_TOKEN")?,
            };
            let out = Client::new(&server, &token)?.create_tenant(&name).await?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(())
        }
        Command::Init { name, lang } => {
            print!("{}", kiln_host::project::init(&name, lang)?);
            Ok(())
        }
        Command::Build { dir } => {
            let wasm =
                tokio::task::spawn_blocking(move || kiln_host::project::build(&dir)).await??;
            println!("{}", wasm.display());
            Ok(())
        }
        Command::Deploy {
            tenant,
            name,
            file,
            server,
            token,
        } => {
            let (name, wasm) = component_of(file, name).await?;
            let bytes =
                std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
            let out = Client::new(&server, &token)?
                .deploy(&tenant, &name, bytes)
                .await?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(())
        }
    }
}

/// The function name and component for `kiln deploy PATH`: a project
/// directory is built first; the name defaults to the directory's or the
/// file's.
async fn component_of(path: PathBuf, name: Option<String>) -> anyhow::Result<(String, PathBuf)> {
    let full = std::path::absolute(&path)?;
    let stem = if path.is_dir() {
        full.file_name()
    } else {
        full.file_stem()
    }
    .map(|s| s.to_string_lossy().replace('_', "-"));
    let name = name.or(stem).context("no function name: pass --name")?;
    let wasm = if path.is_dir() {
        kiln_host::project::detect(&path)?;
        eprintln!("building {} ...", path.display());
        tokio::task::spawn_blocking(move || kiln_host::project::build(&path)).await??
    } else {
        path
    };
    Ok((name, wasm))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    #[test]
    fn serve_help_is_grouped_and_leaves_the_engines_ab_switches_out() {
        let mut cli = super::Cli::command();
        let serve = cli.find_subcommand_mut("serve").expect("serve");
        let help = serve.render_help().to_string();
        for heading in [
            "Listening:",
            "Tenants and limits:",
            "Models:",
            "Connections:",
            "Engine:",
        ] {
            assert!(help.contains(heading), "no {heading} in\n{help}");
        }
        assert!(help.contains("--kv-memory") && help.contains("--weights"));
        for hidden in [
            "--cuda-graphs",
            "--cuda-pdl",
            "--cuda-fold",
            "--device-sampling",
        ] {
            assert!(!help.contains(hidden), "{hidden} in\n{help}");
        }
        // Still accepted.
        let args = ["kiln", "serve", "--cuda-graphs", "off", "--no-models"];
        assert!(super::Cli::try_parse_from(args).is_ok());
        assert!(help.contains("--prefill-device"), "{help}");
        let args = [
            "kiln",
            "serve",
            "--prefill-device",
            "cuda:1",
            "--device",
            "cuda:0",
        ];
        let super::Command::Serve(a) = super::Cli::try_parse_from(args).unwrap().command else {
            panic!("not serve")
        };
        assert_eq!(a.prefill_device, Some(kiln_kernels::Device::Cuda(1)));
        // Sizes in one style, the older flags still taken.
        let sizes = [
            "--memory-limit",
            "64MiB",
            "--max-upload",
            "1MiB",
            "--max-body",
            "2MiB",
        ];
        let parsed = super::Cli::try_parse_from(["kiln", "serve"].into_iter().chain(sizes));
        let super::Command::Serve(a) = parsed.unwrap().command else {
            panic!("not serve")
        };
        assert_eq!((a.memory_limit, a.max_upload_bytes), (64 << 20, 1 << 20));
        assert_eq!(a.limits.max_body_bytes, 2 << 20);
        for old in [
            ["--memory-limit-mib", "64"],
            ["--max-upload-bytes", "1048576"],
        ] {
            let args = ["kiln", "serve"].into_iter().chain(old);
            assert!(super::Cli::try_parse_from(args).is_ok(), "{old:?}");
        }
        assert!(help.contains("--max-upload <MAX_UPLOAD_BYTES>"), "{help}");
        assert!(!help.contains("--memory-limit-mib"));
    }
}
