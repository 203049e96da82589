//! The listener: HTTP/1.1 and HTTP/2 (optionally over TLS), and graceful
//! shutdown with a bounded drain.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use kiln_runtime::Inference;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::app::App;
use crate::auth;
use crate::config::ServeConfig;
use crate::idle::Activity;
use crate::metrics::Metrics;

/// A server that is listening.
pub struct Server {
    /// The shared state (for in-process use such as benchmarks).
    pub app: Arc<App>,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    /// The address actually bound (useful with port 0).
    pub local_addr: SocketAddr,
    /// The admin token in force.
    pub admin_token: auth::AdminToken,
}

fn tls_acceptor(cert: &std::path::Path, key: &std::path::Path) -> anyhow::Result<TlsAcceptor> {
    use rustls_pemfile::Item;
    let certs = rustls_pemfile::certs(&mut std::io::BufReader::new(
        std::fs::File::open(cert).with_context(|| format!("opening {}", cert.display()))?,
    ))
    .collect::<Result<Vec<_>, _>>()
    .with_context(|| format!("reading certificates from {}", cert.display()))?;
    let mut key_reader = std::io::BufReader::new(
        std::fs::File::open(key).with_context(|| format!("opening {}", key.display()))?,
    );
    let key = loop {
        match rustls_pemfile::read_one(&mut key_reader)? {
            Some(Item::Pkcs1Key(k)) => break k.into(),
            Some(Item::Pkcs8Key(k)) => break k.into(),
            Some(Item::Sec1Key(k)) => break k.into(),
            Some(_) => continue,
            None => anyhow::bail!("no private key found in {}", key.display()),
        }
    };
    let mut config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("building the TLS configuration")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `$conn` until it ends. When nothing has been in flight on it for
/// `$idle`, or the server stops (`$stopping`), it is shut down gracefully
/// (GOAWAY on HTTP/2, no more keep-alive on HTTP/1), so what is in flight
/// and a client's request racing the close are not cut; one that then
/// stays idle for `$idle` more without closing (an HTTP/2 client that
/// does not answer the closing ping) is dropped. A connection whose
/// client has not taken a ready response frame for `$stall` is dropped at
/// once. (A macro: the same code as a generic function trips rustc's
/// higher-ranked `Send` check on hyper's connection.)
macro_rules! serve {
    ($conn:expr, $activity:expr, $idle:expr, $stall:expr, $stopping:expr, $peer:expr) => {{
        let (activity, idle, stall, mut stopping, peer) =
            ($activity, $idle, $stall, $stopping, $peer);
        // The handshake's time is not idleness.
        activity.touch();
        let conn = $conn;
        tokio::pin!(conn);
        // The connection first: a request it has read is served, even if
        // the server stops at the same moment.
        let close = tokio::select! {
            biased;
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(%peer, "connection error: {e}");
                }
                None
            }
            () = activity.stalled(stall) => Some(Close::Stalled),
            () = activity.idle(idle) => Some(Close::Idle),
            _ = stopping.wait_for(|s| *s) => Some(Close::Stopping),
        };
        if let Some(close) = close.filter(|c| *c != Close::Stalled) {
            conn.as_mut().graceful_shutdown();
            activity.touch();
            let ended = tokio::select! {
                biased;
                ended = conn.as_mut() => Some(ended),
                () = activity.stalled(stall) => None,
                () = activity.idle(idle), if close == Close::Idle => None,
            };
            match ended {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::debug!(%peer, "connection error: {e}"),
                None => tracing::debug!(%peer, "a closing connection did not close; dropped"),
            }
        } else if close.is_some() {
            tracing::debug!(%peer, "the client took no response data for {stall:?}; dropped");
        }
    }};
}

/// Why a connection is closed before its client closes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// Nothing in flight for the idle time.
    Idle,
    /// The server stops.
    Stopping,
    /// A response's data waited too long for the client.
    Stalled,
}

impl Server {
    /// Opens the data dir, builds the runtime and binds the listener.
    /// `admin_token` overrides the one stored in the data dir; `metrics`
    /// is shared with the engines behind `backend`.
    pub async fn bind(
        config: ServeConfig,
        admin_token: Option<String>,
        backend: Arc<dyn Inference>,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("creating data dir {}", config.data_dir.display()))?;
        let admin_token = match admin_token {
            Some(token) => auth::AdminToken {
                token,
                generated: false,
            },
            None => auth::load_or_create_admin_token(&config.data_dir)
                .context("reading or creating the admin token")?,
        };
        let tls = match &config.tls {
            Some((cert, key)) => Some(tls_acceptor(cert, key)?),
            None => None,
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let local_addr = listener.local_addr()?;
        let mut config = config;
        config.listen = local_addr;
        if config.node_name.is_empty() {
            config.node_name = format!("{}:{}", hostname(), local_addr.port());
        }
        let app = Arc::new(App::open(config, &admin_token.token, backend, metrics)?);
        Ok(Self {
            app,
            listener,
            tls,
            local_addr,
            admin_token,
        })
    }

    /// Serves until `shutdown` resolves, then stops accepting and waits up
    /// to the drain timeout for connections in flight.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        // Told to every connection when the server stops accepting.
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let net = self.app.config.net.clone();
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(net.header_read_timeout);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(net.keep_alive)
            .keep_alive_timeout(net.keep_alive)
            .max_concurrent_streams(MAX_STREAMS);
        let connections = Arc::new(Semaphore::new(net.max_connections));
        if let Some(sub) = self.app.take_subscription() {
            crate::app::follow(Arc::downgrade(&self.app), sub);
        }
        if self.app.is_clustered() {
            crate::app::share_quotas(Arc::downgrade(&self.app));
        }
        let sampler = tokio::spawn(sample_status(self.app.clone()));
        let _stop_sampler = AbortOnDrop(sampler);
        let _stop_gateway_metrics = match self.app.config.gateway_metrics {
            Some(addr) => {
                let listener = TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding --gateway-metrics-listen {addr}"))?;
                Some(AbortOnDrop(tokio::spawn(gateway_metrics(
                    self.app.clone(),
                    listener,
                ))))
            }
            None => None,
        };
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        // Out of file descriptors, say: let some close.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let _ = stream.set_nodelay(true);
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                self.app.metrics.connections_refused.inc();
                if self.tls.is_none() {
                    tokio::spawn(refuse(stream));
                }
                continue;
            };
            let app = self.app.clone();
            let activity = Activity::new();
            let flights = activity.clone();
            let service = service_fn(move |req| {
                let (app, flight) = (app.clone(), flights.begin());
                async move {
                    let node = app.node.clone();
                    let mut resp = crate::api::handle(app, req).await;
                    resp.headers_mut().insert(NODE_HEADER, node);
                    Ok::<_, std::convert::Infallible>(resp.map(|b| flight.hold(b)))
                }
            });
            // A connection with nothing in flight for as long as a kept-alive
            // HTTP/1 connection may wait for its next request is closed
            // (HTTP/2 has no such timeout of its own).
            let idle = net.header_read_timeout;
            let stall = net.write_stall_timeout;
            match &self.tls {
                None => {
                    let builder = builder.clone();
                    let stopping = stopping.clone();
                    tokio::spawn(async move {
                        let _permit = permit;
                        if !first_bytes(&stream, net.header_read_timeout).await {
                            return;
                        }
                        let conn =
                            builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                        serve!(conn, &activity, idle, stall, stopping, peer);
                    });
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    let builder = builder.clone();
                    let stopping = stopping.clone();
                    tokio::spawn(async move {
                        let _permit = permit;
                        let handshake = acceptor.accept(stream);
                        let stream = match tokio::time::timeout(
                            net.tls_handshake_timeout,
                            handshake,
                        )
                        .await
                        {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, "TLS handshake failed: {e}");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return;
                            }
                        };
                        // ALPN has chosen the protocol: serving HTTP/1 as
                        // such puts it under the header timeout at once.
                        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                        let builder = if h2 {
                            builder.http2_only()
                        } else {
                            builder.http1_only()
                        };
                        let conn =
                            builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                        serve!(conn, &activity, idle, stall, stopping, peer);
                    });
                }
            }
        }
        drop(self.listener);
        let drain = self.app.config.drain_timeout;
        tracing::info!("shutting down; draining for up to {drain:?}");
        let _ = stop.send(true);
        // Each connection holds a permit until it ends: all of them back
        // means every connection has drained.
        let all = u32::try_from(net.max_connections).unwrap_or(u32::MAX);
        let drained = connections.acquire_many(all);
        tokio::pin!(drained);
        let done = tokio::time::timeout(drain, &mut drained).await.is_ok();
        if !done {
            tracing::warn!("drain timeout reached; ending the model calls still in flight");
        }
        // Model calls still running end with an error their clients see
        // (a last SSE event), and the engines free their devices on their
        // own threads before the process exits.
        close_engines(self.app.ai.clone(), CLOSE).await;
        if !done && tokio::time::timeout(FLUSH, &mut drained).await.is_err() {
            tracing::warn!("closing the connections that remain");
        }
        Ok(())
    }
}

/// Stops `ai`'s engines, waiting for them up to `within`. They stop on a
/// thread of their own, outside the runtime's blocking pool: an engine
/// that never stops (a wedged device) must not hold the process when the
/// runtime, which waits for its blocking pool's threads, is dropped.
async fn close_engines(ai: Arc<dyn Inference>, within: Duration) {
    let (done, stopped) = tokio::sync::oneshot::channel();
    let closer = std::thread::Builder::new()
        .name("kiln-close".into())
        .spawn(move || {
            ai.close();
            let _ = done.send(());
        });
    if let Err(e) = closer {
        tracing::error!("stopping the engines failed: {e}");
        return;
    }
    match tokio::time::timeout(within, stopped).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => tracing::error!("stopping the engines panicked"),
        Err(_) => tracing::error!("the engines did not stop within {within:?}; exiting anyway"),
    }
}

/// How long connections get to send their last bytes once the engines
/// have ended their calls.
const FLUSH: Duration = Duration::from_secs(2);

/// How long the engines get to finish their step and free their devices.
const CLOSE: Duration = Duration::from_secs(30);

/// Streams one HTTP/2 connection may have open at once.
const MAX_STREAMS: u32 = 256;

/// The HTTP/2 connection preface, which a client may send in pieces.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits, up to `timeout`, until the client has sent enough to tell its
/// protocol: one byte that is not the HTTP/2 preface's, or all of the
/// preface. (Telling them apart otherwise waits for the client without a
/// deadline; after this, hyper's header timeout takes over.)
async fn first_bytes(stream: &TcpStream, timeout: Duration) -> bool {
    let settled = async {
        let mut buf = [0u8; H2_PREFACE.len()];
        loop {
            match stream.peek(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) if n == buf.len() || buf[..n] != H2_PREFACE[..n] => return true,
                // A piece of the preface: wait for more.
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    tokio::time::timeout(timeout, settled)
        .await
        .unwrap_or(false)
}

/// Answers a connection over the limit with a 503 and closes it.
async fn refuse(mut stream: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Take what the client has sent already: closing a socket with unread
    // bytes resets it, and the client would see that instead of the 503.
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(50), stream.read(&mut sink)).await;
    let body = crate::api::ApiError::unavailable(
        "the server has as many connections open as it allows (--max-connections); retry shortly",
    )
    .body();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The header naming the node that served a response.
pub const NODE_HEADER: &str = "x-kiln-node";

/// This machine's host name (or `kiln`).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kiln".into())
}

/// Serves the gateway's load figures on their own listener: `GET` of any
/// path answers them, with no token (they name models, not tenants).
async fn gateway_metrics(app: Arc<App>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let app = app.clone();
        let service = service_fn(move |_req| {
            let text = crate::gateway_metrics::render(&app.ai.load());
            async move {
                let mut resp =
                    hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from(text)));
                resp.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                Ok::<_, std::convert::Infallible>(resp)
            }
        });
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(Duration::from_secs(30), conn).await;
        });
    }
}

/// Samples the metrics into the status page's history, forever.
async fn sample_status(app: Arc<App>) {
    let mut every = tokio::time::interval(app.config.status_interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        app.sample_status();
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_runtime::{AiError, BoxFuture, Completion, ModelCall, ModelInfo, TokenStream};

    /// A backend whose engines never stop.
    struct Wedged;

    impl Inference for Wedged {
        fn call(&self, _: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
            Box::pin(async { Err(AiError::ModelNotFound("none".into())) })
        }
        fn stream(&self, _: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
            Box::pin(async { Err(AiError::ModelNotFound("none".into())) })
        }
        fn list_models(&self, _: &str) -> Vec<ModelInfo> {
            Vec::new()
        }
        fn close(&self) {
            loop {
                std::thread::park();
            }
        }
    }

    #[test]
    fn engines_that_never_stop_do_not_hold_the_process_past_the_close_timeout() {
        let (exited, wait) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(close_engines(Arc::new(Wedged), Duration::from_millis(100)));
            // What `main` does when `serve` returns.
            drop(rt);
            let _ = exited.send(());
        });
        assert!(
            wait.recv_timeout(Duration::from_secs(10)).is_ok(),
            "the runtime waited for the wedged engines"
        );
    }
}
