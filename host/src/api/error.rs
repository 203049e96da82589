//! The one place that maps errors to HTTP status codes and JSON bodies.

use hyper::StatusCode;
use kiln_runtime::{AiError, InvokeError, RuntimeError};

use crate::app::AppError;
use crate::db::DbError;
use crate::names::NameError;

/// An error answered as OpenAI's error object,
/// `{"error": {"message", "type", "param", "code"}}`, with a status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Machine-readable type, e.g. `not_found`.
    pub kind: &'static str,
    /// Human-readable explanation that says what to fix.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A finer machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// Names the request field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets the machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400 in OpenAI's terms: `invalid_request_error`, naming the field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).with_param(param)
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 401: missing or wrong credentials.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 403: valid credentials, wrong tenant for this request.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// 404: no such thing (or not yours: the same answer, so nothing leaks).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 405: the route exists but not with this method.
    pub fn method_not_allowed(allowed: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("method not allowed here; use {allowed}"),
        )
    }

    /// 409: already exists.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 413: the body is over the limit, which `flag` sets if one does.
    pub fn too_large(limit: usize, flag: Option<&str>) -> Self {
        let see = flag.map_or(String::new(), |f| format!(" (see {f})"));
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body exceeds the limit of {limit} bytes{see}"),
        )
    }

    /// 408: the request's body sent nothing for `idle`.
    pub fn body_timeout(idle: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "the request body sent nothing for {} s (see --body-read-timeout-s)",
                idle.as_secs_f64()
            ),
        )
    }

    /// 429: the caller is over one of its limits for now.
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
    }

    /// 413: a function's request body is over the limit.
    pub fn body_too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body exceeds the limit of {limit} bytes (see --max-body)"),
        )
    }

    /// 503: the server is at capacity.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message)
    }

    /// 500: a bug or failure on our side.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        self.json().to_string()
    }

    /// The JSON error object.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<AiError> for ApiError {
    fn from(e: AiError) -> Self {
        match e {
            AiError::ModelNotFound(m) => {
                Self::new(StatusCode::NOT_FOUND, "invalid_request_error", m)
                    .with_param("model")
                    .with_code("model_not_found")
            }
            AiError::InvalidInput(m) => {
                Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", m)
            }
            AiError::QuotaExceeded(m) => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", m)
                    .with_code("rate_limit_exceeded")
            }
            AiError::Overloaded(m) => Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", m)
                .with_code("overloaded"),
            AiError::Aborted(m) if m.starts_with(crate::serving::ENGINE_RESTARTED) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m)
                    .with_code(crate::serving::ENGINE_RESTARTED)
            }
            // The operator's bound on a call, not a fault: the gateway
            // timeout, as for a slow upstream.
            AiError::Aborted(m) if m.starts_with(crate::serving::policy::DEADLINE_EXCEEDED) => {
                Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", m)
                    .with_code("deadline_exceeded")
            }
            // A format past the grammar engine's limits shows only as the
            // tokens come: the client's to simplify.
            AiError::Aborted(m) if m.starts_with(kiln_engine::engine::FORMAT_FAILED) => {
                Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", m)
                    .with_param("response_format")
                    .with_code("output_format_failed")
            }
            AiError::Aborted(m) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m).with_code("aborted")
            }
            AiError::RuntimeError(m) => Self::internal(m),
        }
    }
}

impl From<AppError> for ApiError {
    fn from(e: AppError) -> Self {
        match e {
            AppError::NoTenant(_) => Self::not_found(e.to_string()),
            AppError::InstancesExceeded { .. } => {
                Self::too_many_requests(e.to_string()).with_code("tenant_instances_exceeded")
            }
            AppError::DeploysExceeded { .. } => {
                Self::too_many_requests(e.to_string()).with_code("tenant_deploys_exceeded")
            }
            AppError::KeyChecksBusy => Self::unavailable(e.to_string()),
            AppError::BodiesExceeded { .. } => {
                Self::too_many_requests(e.to_string()).with_code("tenant_bodies_exceeded")
            }
            AppError::Component(e) => Self::from(e),
            AppError::Db(e) => Self::from(e),
            AppError::Internal(m) => Self::internal(m),
        }
    }
}

impl From<NameError> for ApiError {
    fn from(e: NameError) -> Self {
        Self::bad_request(e.to_string())
    }
}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        match e {
            DbError::TenantExists(_) => Self::conflict(e.to_string()),
            DbError::ComponentGone(_) => Self::unavailable(e.to_string()),
            DbError::FunctionsExceeded { .. } => {
                Self::forbidden(e.to_string()).with_code("tenant_functions_exceeded")
            }
            DbError::Postgres(_) | DbError::Closed => {
                tracing::error!("{e}");
                Self::unavailable(
                    "the control-plane database is unreachable; retry shortly (see the server log)",
                )
            }
            DbError::Sqlite(_) | DbError::Migration(_) => {
                tracing::error!("{e}");
                Self::internal("the control-plane database failed; see the server log")
            }
        }
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::Setup(_) => Self::internal(e.to_string()),
            _ => Self::bad_request(e.to_string()),
        }
    }
}

impl From<&InvokeError> for ApiError {
    fn from(e: &InvokeError) -> Self {
        use kiln_runtime::LimitKind;
        let msg = e.to_string();
        match e {
            InvokeError::Limit { kind, .. } => match kind {
                LimitKind::Memory => Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "memory_limit_exceeded",
                    msg,
                ),
                LimitKind::CpuTime => {
                    Self::new(StatusCode::GATEWAY_TIMEOUT, "cpu_time_limit_exceeded", msg)
                }
                LimitKind::WallTime => {
                    Self::new(StatusCode::GATEWAY_TIMEOUT, "wall_time_limit_exceeded", msg)
                }
            },
            InvokeError::Trap(_) => Self::new(StatusCode::INTERNAL_SERVER_ERROR, "guest_trap", msg),
            InvokeError::NoResponse | InvokeError::Guest(_) => {
                Self::new(StatusCode::BAD_GATEWAY, "guest_error", msg)
            }
            InvokeError::Overloaded(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", msg)
            }
            InvokeError::Internal(_) => Self::internal(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_map_to_the_documented_statuses() {
        let e = |kind| InvokeError::Limit {
            kind,
            detail: String::new(),
        };
        use kiln_runtime::LimitKind::*;
        assert_eq!(
            ApiError::from(&e(CpuTime)).status,
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            ApiError::from(&e(WallTime)).status,
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            ApiError::from(&e(Memory)).status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn error_body_is_the_documented_json_shape() {
        let v: serde_json::Value =
            serde_json::from_str(&ApiError::not_found("no function `x`").body()).unwrap();
        assert_eq!(v["error"]["type"], "not_found");
        assert_eq!(v["error"]["message"], "no function `x`");
        assert!(v["error"]["param"].is_null() && v["error"]["code"].is_null());
    }

    #[test]
    fn app_errors_keep_their_statuses_and_codes() {
        let instances = ApiError::from(AppError::InstancesExceeded {
            tenant: "a".into(),
            cap: 2,
        });
        assert_eq!(instances.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(instances.code, Some("tenant_instances_exceeded"));
        assert_eq!(
            ApiError::from(AppError::NoTenant(crate::names::Name::tenant("a").unwrap())).status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            ApiError::from(AppError::Internal(String::new())).status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn model_errors_map_to_openai_statuses() {
        let s = |e| ApiError::from(e).status;
        assert_eq!(
            s(AiError::ModelNotFound(String::new())),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            s(AiError::QuotaExceeded(String::new())),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            s(AiError::InvalidInput(String::new())),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            s(AiError::Overloaded(String::new())),
            StatusCode::SERVICE_UNAVAILABLE
        );
        let late = format!("{} of 1 s", crate::serving::policy::DEADLINE_EXCEEDED);
        let e = ApiError::from(AiError::Aborted(late));
        assert_eq!(e.status, StatusCode::GATEWAY_TIMEOUT);
        assert!(e.body().contains("deadline_exceeded"), "{}", e.body());
        assert_eq!(
            s(AiError::Aborted("cancelled".into())),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let format = format!("{}: lexer fuel", kiln_engine::engine::FORMAT_FAILED);
        let e = ApiError::from(AiError::Aborted(format));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.body().contains("output_format_failed"), "{}", e.body());
    }
}
