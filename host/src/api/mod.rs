//! The HTTP API: routing, authentication, and the handlers.

mod control;
mod error;
mod invoke;
mod openai;

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Response, StatusCode, header};

pub use error::ApiError;

use crate::app::App;

/// A boxed error of a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body of every response.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A response with a full body.
pub(crate) fn full(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(body.into())
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    if let Ok(v) = header::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    resp
}

/// A JSON response.
pub(crate) fn json(status: StatusCode, value: serde_json::Value) -> Response<Body> {
    full(status, "application/json", value.to_string())
}

impl ApiError {
    /// This error as a response.
    pub fn into_response(self) -> Response<Body> {
        full(self.status, "application/json", self.body())
    }
}

/// The body length a request declares, if it declares one.
fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The bearer token of a request, if any.
fn bearer<B>(req: &Request<B>) -> Option<&str> {
    let v = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Requires a tenant API key; returns the tenant it belongs to.
fn tenant_of<B>(app: &App, req: &Request<B>) -> Result<String, ApiError> {
    let token = bearer(req).ok_or_else(|| {
        ApiError::unauthorized("missing API key: send `Authorization: Bearer <tenant API key>`")
    })?;
    app.tenant_for_key(token)?
        .ok_or_else(|| ApiError::unauthorized("invalid API key"))
}

/// Requires the admin token.
fn require_admin<B>(app: &App, req: &Request<B>) -> Result<(), ApiError> {
    match bearer(req) {
        Some(t) if app.is_admin(t) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("invalid admin token")),
        None => Err(ApiError::unauthorized(
            "missing admin token: send `Authorization: Bearer <admin token>` \
             (KILN_ADMIN_TOKEN or <data-dir>/admin-token)",
        )),
    }
}

/// Requires the admin token or the metrics token: metrics name every
/// tenant and function, so they are for the operator only.
fn require_metrics_reader<B>(app: &App, req: &Request<B>) -> Result<(), ApiError> {
    match bearer(req) {
        Some(t) if app.is_admin(t) || app.is_metrics_reader(t) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("invalid metrics token")),
        None => Err(ApiError::unauthorized(
            "missing token: /metrics needs `Authorization: Bearer <token>` with the admin \
             token or the --metrics-token (Prometheus: `authorization: {credentials: ...}`)",
        )),
    }
}

/// Kiln's metrics, then the gateway's load figures (before the
/// exposition's closing `# EOF`).
fn metrics_text(app: &App) -> String {
    use kiln_runtime::Inference;
    let own = app.metrics.encode();
    let gateway = crate::gateway_metrics::render(&app.ai.load());
    match own.strip_suffix("# EOF\n") {
        Some(body) => format!("{body}{gateway}# EOF\n"),
        None => own + &gateway,
    }
}

/// Routes one request. Every failure becomes a JSON error response; this
/// never panics on bad input.
pub async fn handle<B>(app: Arc<App>, req: Request<B>) -> Response<Body>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').splitn(4, '/').collect();
    let method = req.method().clone();
    let may_leave_body_unread =
        req.version() <= hyper::Version::HTTP_11 && !req.body().is_end_stream();
    let result = match (segments.as_slice(), &method) {
        (["fn", ..], _) => return invoke::invoke(app, req).await,
        (["healthz"], &Method::GET) => {
            Ok(json(StatusCode::OK, serde_json::json!({"status": "ok"})))
        }
        (["metrics"], &Method::GET) => require_metrics_reader(&app, &req).map(|()| {
            full(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                metrics_text(&app),
            )
        }),
        (["status"], &Method::GET) => Ok(full(
            StatusCode::OK,
            "text/html; charset=utf-8",
            crate::status::PAGE,
        )),
        (["v1", "status"], &Method::GET) => require_metrics_reader(&app, &req).map(|()| {
            json(
                StatusCode::OK,
                crate::status::snapshot(&app.metrics.encode(), &app.status),
            )
        }),
        (["v1", "usage"], &Method::GET) => tenant_of(&app, &req).map(|tenant| {
            let usage = app.ai.usage(&tenant);
            json(
                StatusCode::OK,
                serde_json::json!({"tenant": tenant, "usage": usage}),
            )
        }),
        (["v1", "tenants"], &Method::POST) => control::create_tenant(&app, req).await,
        (["v1", "tenants", tenant, "policy"], &Method::PUT) => {
            let tenant = tenant.to_string();
            control::put_policy(&app, req, &tenant).await
        }
        (["v1", "tenants", tenant, "policy"], &Method::GET) => {
            control::get_policy(&app, &req, tenant)
        }
        (["v1", "models"], &Method::GET) => openai::models(&app, &req),
        (["v1", "chat", "completions"], &Method::POST) => openai::chat(app.clone(), req).await,
        (["v1", "completions"], &Method::POST) => openai::completions(app.clone(), req).await,
        (["v1", "functions"], &Method::GET) => control::list_functions(&app, &req),
        (["v1", "functions", name], &Method::GET) => control::get_function(&app, &req, name),
        (["v1", "functions", name], &Method::PUT) => {
            let name = name.to_string();
            control::deploy(&app, req, &name).await
        }
        (["v1", "functions", name], &Method::DELETE) => control::delete_function(&app, &req, name),
        (["healthz"] | ["metrics"] | ["status"] | ["v1", "status"], _)
        | (["v1", "functions"] | ["v1", "usage"], _) => Err(ApiError::method_not_allowed("GET")),
        (["v1", "tenants"] | ["v1", "chat", "completions"] | ["v1", "completions"], _) => {
            Err(ApiError::method_not_allowed("POST"))
        }
        (["v1", "tenants", _, "policy"], _) => Err(ApiError::method_not_allowed("GET or PUT")),
        (["v1", "models"], _) => Err(ApiError::method_not_allowed("GET")),
        (["v1", "functions", _], _) => Err(ApiError::method_not_allowed("GET, PUT or DELETE")),
        _ => Err(ApiError::not_found(format!("no route for {method} {path}"))),
    };
    result.unwrap_or_else(|e| {
        let mut resp = e.into_response();
        if may_leave_body_unread {
            // An early rejection leaves the upload unread, and hyper will
            // close the connection: say so, or a client may reuse it.
            resp.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        resp
    })
}
