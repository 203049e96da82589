//! A small request/response API over `wasi:http`.

use crate::bindings::wasi::http::types::{
    Fields, IncomingBody, IncomingRequest, Method, OutgoingBody, OutgoingResponse, ResponseOutparam,
};
use crate::bindings::wasi::io::streams::{OutputStream, StreamError};

/// An HTTP handler: one call per request, in a fresh instance.
pub trait Handler {
    /// Answers one request.
    fn handle(req: Request) -> Response;
}

/// An incoming request. The body is read on demand.
pub struct Request {
    inner: IncomingRequest,
    method: String,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
}

impl Request {
    fn new(inner: IncomingRequest) -> Self {
        let method = match inner.method() {
            Method::Get => "GET".into(),
            Method::Head => "HEAD".into(),
            Method::Post => "POST".into(),
            Method::Put => "PUT".into(),
            Method::Delete => "DELETE".into(),
            Method::Connect => "CONNECT".into(),
            Method::Options => "OPTIONS".into(),
            Method::Trace => "TRACE".into(),
            Method::Patch => "PATCH".into(),
            Method::Other(m) => m,
        };
        let path = inner.path_with_query().unwrap_or_else(|| "/".into());
        let headers = inner.headers().entries();
        Self {
            inner,
            method,
            path,
            headers,
        }
    }

    /// The method, upper case (`GET`, `POST`, ...).
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The path and query as the function sees them: the part of the URL
    /// after `/fn/{tenant}/{function}`, always starting with `/`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// All headers, names lower case.
    pub fn headers(&self) -> &[(String, Vec<u8>)] {
        &self.headers
    }

    /// The first value of header `name` (case-insensitive), if it is UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// The `x-session-affinity` header, if present.
    pub fn session(&self) -> Option<&str> {
        self.header("x-session-affinity")
    }

    /// Reads the whole body. Empty if it was already read or cannot be read.
    pub fn body(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let Ok(body) = self.inner.consume() else {
            return out;
        };
        if let Ok(stream) = body.stream() {
            loop {
                match stream.blocking_read(64 * 1024) {
                    Ok(chunk) => out.extend_from_slice(&chunk),
                    Err(StreamError::Closed) => break,
                    Err(StreamError::LastOperationFailed(_)) => break,
                }
            }
        }
        let _ = IncomingBody::finish(body);
        out
    }
}

/// What a handler answers.
pub struct Response {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Body,
}

enum Body {
    Bytes(Vec<u8>),
    Stream(Box<dyn FnOnce(&mut BodyWriter)>),
}

impl Response {
    /// A response with `status` and a body of bytes.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Body::Bytes(body.into()),
        }
    }

    /// A `text/plain; charset=utf-8` response.
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self::new(status, body.into()).header("content-type", "text/plain; charset=utf-8")
    }

    /// An `application/json` response with a body already serialized.
    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Self::new(status, body.into()).header("content-type", "application/json")
    }

    /// A response whose body is written by `write` after the head has been
    /// sent, so the caller sees each chunk as soon as it is flushed.
    pub fn stream(status: u16, write: impl FnOnce(&mut BodyWriter) + 'static) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Body::Stream(Box::new(write)),
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_owned(), value.as_ref().to_vec()));
        self
    }
}

/// Writes a streaming response body.
pub struct BodyWriter {
    stream: OutputStream,
    failed: bool,
}

impl BodyWriter {
    /// Writes and flushes `data`. Returns false once the client has gone
    /// away; further writes are ignored.
    pub fn write(&mut self, data: &[u8]) -> bool {
        if self.failed {
            return false;
        }
        // blocking_write_and_flush takes at most 4096 bytes per call.
        for chunk in data.chunks(4096) {
            if self.stream.blocking_write_and_flush(chunk).is_err() {
                self.failed = true;
                return false;
            }
        }
        true
    }
}

/// Runs `H` for one request: the body of the exported `handle`.
pub fn run<H: Handler>(request: IncomingRequest, out: ResponseOutparam) {
    let resp = H::handle(Request::new(request));
    let headers = Fields::new();
    for (name, value) in &resp.headers {
        // Invalid or forbidden headers are dropped rather than failing the
        // whole response.
        let _ = headers.append(name, value);
    }
    let outgoing = OutgoingResponse::new(headers);
    let _ = outgoing.set_status_code(resp.status);
    let Ok(body) = outgoing.body() else {
        return;
    };
    ResponseOutparam::set(out, Ok(outgoing));
    let Ok(stream) = body.write() else {
        return;
    };
    let mut writer = BodyWriter {
        stream,
        failed: false,
    };
    match resp.body {
        Body::Bytes(bytes) => {
            writer.write(&bytes);
        }
        Body::Stream(write) => write(&mut writer),
    }
    drop(writer);
    let _ = OutgoingBody::finish(body, None);
}
