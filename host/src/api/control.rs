//! Control-plane handlers: tenants and functions.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::{Request, Response, StatusCode};

use super::{ApiError, Body, BoxError, json, require_admin, tenant_of};
use crate::app::App;
use crate::aside::aside;
use crate::db::FunctionRow;
use crate::names::Name;
use crate::serving::policy::{MAX_WEIGHT, TenantPolicy};

/// Reads a whole body, refusing more than `limit` bytes with a 413 that
/// names `flag`, the option that sets the limit if one does, and a body
/// that goes `idle` without sending a byte with a 408: a client that stalls
/// part-way holds neither its buffer nor its connection for long, while a
/// slow link that keeps sending gets its upload through.
///
/// An oversized body is still read and discarded up to twice the limit, so
/// that a client still writing it gets the 413 rather than a broken pipe;
/// only a body declared larger than that is refused unread.
pub(super) async fn read_body<B>(
    req: Request<B>,
    limit: usize,
    flag: Option<&str>,
    idle: Duration,
) -> Result<Bytes, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let drain_cap = limit.saturating_mul(2).max(limit + (1 << 20)) as u64;
    if super::declared_length(&req).is_some_and(|n| n > drain_cap) {
        return Err(ApiError::too_large(limit, flag));
    }
    let mut body = std::pin::pin!(req.into_body());
    let mut buf = BytesMut::new();
    let mut total: u64 = 0;
    loop {
        let next = tokio::time::timeout(idle, body.frame()).await;
        let Some(frame) = next.map_err(|_| ApiError::body_timeout(idle))? else {
            break;
        };
        let frame = frame.map_err(|e| {
            ApiError::bad_request(format!("reading the request body failed: {}", e.into()))
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total <= limit as u64 {
            buf.extend_from_slice(&data);
        } else if total > drain_cap {
            break;
        }
    }
    if total > limit as u64 {
        return Err(ApiError::too_large(limit, flag));
    }
    Ok(buf.freeze())
}

fn function_json(app: &App, row: &FunctionRow) -> serde_json::Value {
    let scheme = if app.config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    serde_json::json!({
        "name": row.name,
        "digest": format!("sha256:{}", row.digest),
        "size": row.size,
        "created": row.created,
        "url": format!("{scheme}://{}/fn/{}/{}/", app.config.listen, row.tenant, row.name),
    })
}

/// `POST /v1/tenants` `{"name"}` (admin) -> 201 `{"name", "api_key"}`.
pub(super) async fn create_tenant<B>(app: &App, req: Request<B>) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    require_admin(app, &req)?;
    let body = read_body(req, 64 << 10, None, app.config.net.body_read_timeout).await?;
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct NewTenant {
        name: String,
    }
    let new: NewTenant = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!("expected a JSON body {{\"name\": \"...\"}}: {e}"))
    })?;
    let key = app.create_tenant(&Name::tenant(&new.name)?)?;
    Ok(json(
        StatusCode::CREATED,
        serde_json::json!({"name": new.name, "api_key": key}),
    ))
}

/// `PUT /v1/tenants/{name}/policy` (admin) with a [`TenantPolicy`] JSON
/// body: replaces the tenant's model policy; absent fields mean defaults.
pub(super) async fn put_policy<B>(
    app: &App,
    req: Request<B>,
    tenant: &str,
) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    require_admin(app, &req)?;
    let tenant = Name::tenant(tenant)?;
    let body = read_body(req, 64 << 10, None, app.config.net.body_read_timeout).await?;
    let policy: TenantPolicy = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "expected a JSON policy {{\"allowed_models\": [..], \"tokens_per_minute\": N, \
             \"max_concurrent\": N, \"max_instances\": N, \"max_functions\": N, \"weight\": N}} (each optional): {e}"
        ))
    })?;
    if policy
        .weight
        .is_some_and(|w| !(1..=MAX_WEIGHT).contains(&w))
    {
        return Err(ApiError::bad_request(format!(
            "`weight` must be 1 to {MAX_WEIGHT} (the tenant's share of a shared GPU against \
             other tenants' weights; default 1)"
        )));
    }
    app.set_policy(&tenant, policy.clone())?;
    Ok(json(StatusCode::OK, policy_json(&tenant, &policy)))
}

/// `GET /v1/tenants/{name}/policy` (admin).
pub(super) fn get_policy<B>(
    app: &App,
    req: &Request<B>,
    tenant: &str,
) -> Result<Response<Body>, ApiError> {
    require_admin(app, req)?;
    let tenant = Name::tenant(tenant)?;
    let policy = app.policy(&tenant)?;
    Ok(json(StatusCode::OK, policy_json(&tenant, &policy)))
}

fn policy_json(tenant: &Name, p: &TenantPolicy) -> serde_json::Value {
    serde_json::json!({
        "tenant": tenant.as_str(),
        "allowed_models": p.allowed_models,
        "tokens_per_minute": p.tokens_per_minute,
        "max_concurrent": p.max_concurrent,
        "max_instances": p.max_instances,
        "max_functions": p.max_functions,
        "weight": p.weight,
    })
}

/// `PUT /v1/functions/{name}` (tenant key, body = component) -> 201.
pub(super) async fn deploy<B>(
    app: &Arc<App>,
    req: Request<B>,
    name: &str,
) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let tenant = tenant_of(app, &req)?;
    let name = Name::function(name)?;
    if let Some(claimed) = req.headers().get("kiln-tenant")
        && claimed.as_bytes() != tenant.as_bytes()
    {
        return Err(ApiError::forbidden(
            "the API key does not belong to the tenant named in `kiln-tenant`",
        ));
    }
    // Taken before the upload is read: it bounds the uploads held too.
    let slot = app.deploy_slot(&tenant).await?;
    let bytes = read_body(
        req,
        app.config.max_upload_bytes,
        Some("--max-upload"),
        app.config.net.body_read_timeout,
    )
    .await?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "empty upload: send the component's bytes as the request body",
        ));
    }
    // Compiling a component takes a while: keep it off the I/O threads.
    let (app2, name2) = (app.clone(), name.clone());
    // The slot goes with the work, which runs on if the client leaves.
    let row = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        app2.deploy(&tenant, &name2, &bytes)
    })
    .await
    .map_err(|e| ApiError::internal(format!("deploy task failed: {e}")))??;
    Ok(json(StatusCode::CREATED, function_json(app, &row)))
}

/// `GET /v1/functions` -> the caller's functions.
pub(super) fn list_functions<B>(app: &App, req: &Request<B>) -> Result<Response<Body>, ApiError> {
    let tenant = tenant_of(app, req)?;
    let rows = aside(|| app.db.functions(Some(&tenant)))?;
    let list: Vec<_> = rows.iter().map(|r| function_json(app, r)).collect();
    Ok(json(StatusCode::OK, serde_json::json!({"functions": list})))
}

fn not_found(name: &Name) -> ApiError {
    ApiError::not_found(format!("no function named `{name}`"))
}

/// `GET /v1/functions/{name}`.
pub(super) fn get_function<B>(
    app: &App,
    req: &Request<B>,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    let tenant = tenant_of(app, req)?;
    let name = Name::function(name)?;
    let row = aside(|| app.db.function(&tenant, name.as_str()))?.ok_or_else(|| not_found(&name))?;
    Ok(json(StatusCode::OK, function_json(app, &row)))
}

/// `DELETE /v1/functions/{name}` -> 204.
pub(super) fn delete_function<B>(
    app: &App,
    req: &Request<B>,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    let tenant = tenant_of(app, req)?;
    let name = Name::function(name)?;
    if !app.delete(&tenant, &name)? {
        return Err(not_found(&name));
    }
    let mut resp = super::full(StatusCode::NO_CONTENT, "application/json", Bytes::new());
    resp.headers_mut().remove(hyper::header::CONTENT_TYPE);
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A body of `left` two-byte frames, `gap` apart.
    struct Trickle {
        left: u32,
        gap: Duration,
        wait: Pin<Box<tokio::time::Sleep>>,
    }

    impl Trickle {
        fn new(left: u32, gap: Duration) -> Self {
            let wait = Box::pin(tokio::time::sleep(gap));
            Self { left, gap, wait }
        }
    }

    impl http_body::Body for Trickle {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            if self.wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.left -= 1;
            let next = tokio::time::Instant::now() + self.gap;
            self.wait.as_mut().reset(next);
            Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(b"ab")))))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_sending_is_read_and_one_that_stops_gets_408() {
        let idle = Duration::from_secs(60);
        let slow = Request::new(Trickle::new(3, Duration::from_secs(40)));
        let read = read_body(slow, 1 << 10, None, idle).await.unwrap();
        assert_eq!(
            &read[..],
            b"ababab",
            "two minutes in all, never a minute idle"
        );
        let stalled = Request::new(Trickle::new(3, Duration::from_secs(70)));
        let e = read_body(stalled, 1 << 10, None, idle).await.unwrap_err();
        assert_eq!(e.status, StatusCode::REQUEST_TIMEOUT);
    }
}
