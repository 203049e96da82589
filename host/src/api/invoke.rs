//! `ANY /fn/{tenant}/{function}/{*path}`: run a function.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, Response, Uri};
use kiln_runtime::{Invocation, InvokeError};

use super::{ApiError, Body, BoxError};
use crate::app::{App, name_error, valid_name};
use crate::metrics::{FnLabels, InvokeLabels, LimitLabels};

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
    if !valid_name(tenant) {
        return name_error("tenant", tenant).into_response();
    }
    if !valid_name(function) {
        return name_error("function", function).into_response();
    }
    let Some(route) = app.route(tenant, function) else {
        return ApiError::not_found(format!("no function `{function}` for tenant `{tenant}`"))
            .into_response();
    };
    let fn_labels = FnLabels {
        tenant: tenant.to_owned(),
        function: function.to_owned(),
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
            status: response.status().as_u16(),
        })
        .inc();
    response
}

async fn run<B>(
    app: &App,
    route: &crate::app::Route,
    req: Request<B>,
    rest: &str,
) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let deployment = app.deployment(route)?;
    let (mut parts, body) = req.into_parts();
    parts.uri = guest_uri(&parts.uri, rest)?;
    if parts.uri.authority().is_none() && !parts.headers.contains_key(hyper::header::HOST) {
        parts.headers.insert(
            hyper::header::HOST,
            hyper::header::HeaderValue::from_static("localhost"),
        );
    }
    let session = parts
        .headers
        .get("x-session-affinity")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = body.map_err(|e| {
        let e: BoxError = e.into();
        wasmtime_wasi_http_error(e)
    });
    let invocation = Invocation {
        tenant: route.row.tenant.clone(),
        function: route.row.name.clone(),
        session,
    };
    let outcome = app
        .runtime
        .invoke(&deployment, invocation, Request::from_parts(parts, body))
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
