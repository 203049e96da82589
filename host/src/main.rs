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
use kiln_host::server::{Server, shutdown_signal};

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
    Serve(ServeArgs),
    /// Manage tenants on a running server (admin token).
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Deploy a component as a tenant's function on a running server.
    Deploy {
        /// The tenant that owns the function (must match the API key).
        #[arg(long)]
        tenant: String,
        /// The function's name, `[a-z0-9-]{1,63}`.
        #[arg(long)]
        name: String,
        /// The component (`.wasm`, built for wasm32-wasip2).
        file: PathBuf,
        /// The server's base URL.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        server: String,
        /// The tenant's API key.
        #[arg(long, env = "KILN_API_KEY", hide_env_values = true)]
        token: String,
    },
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
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Directory for the database, components and compiled artifacts.
    #[arg(long, default_value = "./.kiln")]
    data_dir: PathBuf,
    /// PEM certificate chain; enables TLS together with --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Largest component upload accepted, in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_upload_bytes: usize,
    /// Linear memory limit per request, in MiB.
    #[arg(long, default_value_t = 128)]
    memory_limit_mib: usize,
    /// Guest CPU time limit per request, in milliseconds.
    #[arg(long, default_value_t = 50)]
    cpu_limit_ms: u64,
    /// Wall time limit per request, in seconds.
    #[arg(long, default_value_t = 30)]
    wall_limit_s: u64,
    /// Most instances alive at once (pooling allocator slots).
    #[arg(long, default_value_t = 1000)]
    max_instances: u32,
    /// Seconds shutdown waits for requests in flight.
    #[arg(long, default_value_t = 10)]
    drain_timeout_s: u64,
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = ServeConfig::new(args.data_dir);
    config.listen = args.listen;
    config.tls = args.tls_cert.zip(args.tls_key);
    config.max_upload_bytes = args.max_upload_bytes;
    config.limits.memory_bytes = args.memory_limit_mib << 20;
    config.limits.cpu_time = Duration::from_millis(args.cpu_limit_ms);
    config.limits.wall_time = Duration::from_secs(args.wall_limit_s);
    config.limits.max_instances = args.max_instances;
    config.drain_timeout = Duration::from_secs(args.drain_timeout_s);
    let admin = std::env::var("KILN_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let server = Server::bind(config, admin, Arc::new(kiln_runtime::NoModels)).await?;
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
        Command::Serve(args) => serve(args).await,
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
        Command::Deploy {
            tenant,
            name,
            file,
            server,
            token,
        } => {
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let out = Client::new(&server, &token)?
                .deploy(&tenant, &name, bytes)
                .await?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(())
        }
    }
}
