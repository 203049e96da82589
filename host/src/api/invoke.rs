//! `ANY /fn/{tenant}/{function}/{*path}`: run a function.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::{Request, Response, Uri};
use kiln_runtime::{Invocation, InvokeError, SessionAffinity};

use super::{ApiError, Body, BoxError};
use crate::app::App;
use crate::metrics::{FnLabels, InvokeLabels, LimitLabels};
use crate::names::Name;

/// Splits `/fn/{tenant}/{function}/{rest}` into its parts; `rest` keeps no
/// leading slash.
fn parse(path: &str) -> Option<(&str, &str, &str)> {
    let rest = path.strip_prefix("/fn/")?;
    let (tenant, rest) = rest.split_once('/').unwrap_or((rest, ""));
    let (function, rest) = rest.split_once('/').unwrap_or((rest, ""));
    Some((tenant, function, rest))
}

/// The URI the guest sees: `/{rest}` plus the query, keeping any authority.
fn guest_uri(uri: &Uri, rest: &str) -> Result<Uri, ApiError> {
    let mut path = format!("/{rest}");
    if let Some(q) = uri.query() {
        path.push('?');
        path.push_str(q);
    }
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(
        path.parse()
            .map_err(|e| ApiError::bad_request(format!("invalid path: {e}")))?,
    );
    Uri::from_parts(parts).map_err(|e| ApiError::bad_request(format!("invalid URI: {e}")))
}

/// Runs the function named by the route, as the tenant named by the route.
pub(super) async fn invoke<B>(app: Arc<App>, req: Request<B>) -> Response<Body>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let path = req.uri().path().to_owned();
    let Some((tenant, function, rest)) = parse(&path) else {
        return ApiError::not_found("no route").into_response();
    };
    let (tenant, function) = match (Name::tenant(tenant), Name::function(function)) {
        (Ok(tenant), Ok(function)) => (tenant, function),
        (Err(e), _) | (_, Err(e)) => return ApiError::from(e).into_response(),
    };
    let Some(route) = app.route(&tenant, &function) else {
        return ApiError::not_found(format!("no function `{function}` for tenant `{tenant}`"))
            .into_response();
    };
    let fn_labels = FnLabels {
        tenant: tenant.as_str().to_owned(),
        function: function.as_str().to_owned(),
    };
    let response = match run(&app, &route, req, rest).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    };
    app.metrics
        .requests
        .get_or_create(&InvokeLabels {
            tenant: fn_labels.tenant.clone(),
            function: fn_labels.function.clone(),
            status: InvokeLabels::status_label(response.status().as_u16()),
        })
        .inc();
    response
}

async fn run<B>(
    app: &App,
    route: &Arc<crate::app::Route>,
    req: Request<B>,
    rest: &str,
) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let limit = app.config.net.max_body_bytes;
    if super::declared_length(&req).is_some_and(|n| n > limit) {
        return Err(ApiError::body_too_large(limit));
    }
    let slot = app.instance_slot(&route.row.tenant)?;
    let deployment = app.deployment(route).await?;
    let (mut parts, body) = req.into_parts();
    parts.uri = guest_uri(&parts.uri, rest)?;
    // The guest reads the authority as text (wasi-http refuses any other).
    if (parts.headers.get(hyper::header::HOST)).is_some_and(|h| h.to_str().is_err()) {
        return Err(ApiError::bad_request(
            "the Host header is not visible ASCII",
        ));
    }
    if parts.uri.authority().is_none() && !parts.headers.contains_key(hyper::header::HOST) {
        parts.headers.insert(
            hyper::header::HOST,
            hyper::header::HeaderValue::from_static("localhost"),
        );
    }
    let session = SessionAffinity::from_headers(&parts.headers);
    let over = Arc::new(AtomicBool::new(false));
    let body = Capped {
        inner: body
            .map_err(|e| {
                let e: BoxError = e.into();
                wasmtime_wasi_http_error(e)
            })
            .boxed_unsync(),
        left: limit,
        limit,
        over: over.clone(),
    };
    let invocation = Invocation {
        tenant: route.row.tenant.clone(),
        function: route.row.name.clone(),
        session,
    };
    let outcome = app
        .runtime
        .invoke(
            &deployment,
            invocation,
            Request::from_parts(parts, body),
            slot,
        )
        .await;
    let labels = crate::metrics::FnLabels {
        tenant: route.row.tenant.clone(),
        function: route.row.name.clone(),
    };
    if let Some(d) = outcome.instantiate {
        app.metrics
            .instantiate
            .get_or_create(&labels)
            .observe(d.as_secs_f64());
    }
    app.metrics
        .handler
        .get_or_create(&labels)
        .observe(outcome.elapsed.as_secs_f64());
    if over.load(Ordering::Acquire) {
        return Err(ApiError::body_too_large(limit));
    }
    match outcome.result {
        Ok(resp) => Ok(resp.map(|b| b.map_err(|e| Box::new(e) as BoxError).boxed_unsync())),
        Err(e) => {
            if let InvokeError::Limit { kind, .. } = &e {
                app.metrics
                    .limits
                    .get_or_create(&LimitLabels {
                        kind: kind.as_str().to_owned(),
                    })
                    .inc();
            }
            tracing::info!(tenant = %route.row.tenant, function = %route.row.name, "invocation failed: {e}");
            Err(ApiError::from(&e))
        }
    }
}

fn wasmtime_wasi_http_error(e: BoxError) -> kiln_runtime::BodyError {
    kiln_runtime::BodyError::InternalError(Some(e.to_string()))
}

/// A request body that ends in an error past `limit` bytes, and says so.
/// (A guest that answers before reading all of its body has its answer
/// sent; the limit then only cuts what it reads.)
struct Capped<B> {
    inner: B,
    /// Bytes it may still pass on.
    left: u64,
    limit: u64,
    over: Arc<AtomicBool>,
}

impl<B> http_body::Body for Capped<B>
where
    B: http_body::Body<Data = Bytes, Error = kiln_runtime::BodyError> + Unpin,
{
    type Data = Bytes;
    type Error = kiln_runtime::BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(data) = f.data_ref()
        {
            let n = data.len() as u64;
            if n > self.left {
                self.over.store(true, Ordering::Release);
                let limit = Some(self.limit);
                return Poll::Ready(Some(Err(kiln_runtime::BodyError::HttpRequestBodySize(
                    limit,
                ))));
            }
            self.left -= n;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_path_splits_into_tenant_function_and_rest() {
        assert_eq!(parse("/fn/acme/hello/a/b"), Some(("acme", "hello", "a/b")));
        assert_eq!(parse("/fn/acme/hello"), Some(("acme", "hello", "")));
        assert_eq!(parse("/fn/acme"), Some(("acme", "", "")));
        assert_eq!(parse("/v1/x"), None);
    }

    #[test]
    fn guest_sees_the_rest_of_the_path_and_the_query() {
        let uri: Uri = "/fn/acme/hello/x/y?q=1".parse().unwrap();
        assert_eq!(guest_uri(&uri, "x/y").unwrap(), "/x/y?q=1");
    }
}
