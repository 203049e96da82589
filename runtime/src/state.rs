//! The data of one request's store: WASI, WASI-HTTP, `kiln:ai` and limits.

use std::str::FromStr;

use http::uri::Authority;
use wasmtime::StoreContextMut;
use wasmtime::component::{Linker, Resource, ResourceTable, WasmStr};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::p2::bindings::http::types::Method;
use wasmtime_wasi_http::p2::body::HostOutgoingBody;
use wasmtime_wasi_http::p2::types::{HostOutgoingRequest, HostOutgoingResponse};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use crate::ai::{AiCtx, AiView};
use crate::limits::StoreLimits;

/// Resources one instance may hold at once (header maps, requests and
/// responses, bodies, streams, model streams). Each may hold host memory
/// that the linear-memory limit does not see, so their count, with the
/// sizes below, bounds it: 1024 unsent bodies of two chunks each, or maps
/// of headers, come to about 128 MiB, as much as linear memory.
pub(crate) const MAX_RESOURCES: usize = 1024;

/// Bytes of host memory one host call may fill with what it copies in from
/// the guest (wasmtime's hostcall fuel, counted at the host's sizes). A
/// list of small records (empty messages, empty strings) costs the host
/// several times its bytes in the guest, so without this bound one call
/// over a guest's 128 MiB could take gigabytes of the host before any of
/// Kiln's own checks run. 16 MiB holds the largest prompt a model call
/// accepts (4 MiB of text) several times over.
pub(crate) const HOSTCALL_BYTES: usize = 16 << 20;

/// Bytes of names and values one map of header fields may hold.
pub(crate) const FIELD_BYTES: usize = 64 << 10;

/// The most bytes one write to a body takes; a body not yet sent buffers
/// two such writes.
pub(crate) const BODY_CHUNK: usize = 64 << 10;

/// The longest authority (host and port) a guest may set on an outgoing
/// request. WASI-HTTP checks an authority's syntax but not its length, and
/// keeps it in host memory, which the linear-memory limit does not see.
pub(crate) const AUTHORITY_BYTES: usize = 4 << 10;

/// The longest method of its own (`other`) a guest may set on an outgoing
/// request, for the same reason.
pub(crate) const METHOD_BYTES: usize = 64;

/// The WASI-HTTP interface whose setters [`bound_outgoing_requests`]
/// replaces (the version wasmtime-wasi-http defines).
const HTTP_TYPES: &str = "wasi:http/types@0.2.12";

/// Replaces WASI-HTTP's `outgoing-request.set-authority` and `set-method`
/// in `linker` with ones that refuse an authority over
/// [`AUTHORITY_BYTES`] (before copying it out of the guest's memory) or a
/// method over [`METHOD_BYTES`]: the guest sees the WIT's error, as for a
/// malformed one. And `outgoing-response.body` with one that notes which
/// body is the response's, so a guest failing later is known to have
/// finished it or not ([`State::response_unfinished`]).
pub(crate) fn bound_outgoing_requests(linker: &mut Linker<State>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let defined = define_setters(linker).and_then(|()| define_response_body(linker));
    linker.allow_shadowing(false);
    defined
}

fn define_response_body(linker: &mut Linker<State>) -> wasmtime::Result<()> {
    use wasmtime_wasi_http::p2::bindings::http::types::HostOutgoingResponse as Host;
    linker.instance(HTTP_TYPES)?.func_wrap(
        "[method]outgoing-response.body",
        |mut store: StoreContextMut<'_, State>, (resp,): (Resource<HostOutgoingResponse>,)| {
            let state = store.data_mut();
            let body = Host::body(&mut state.http(), resp)?;
            if let Ok(b) = &body {
                state.response_body = Some(b.rep());
            }
            Ok((body,))
        },
    )
}

fn define_setters(linker: &mut Linker<State>) -> wasmtime::Result<()> {
    let mut types = linker.instance(HTTP_TYPES)?;
    types.func_wrap(
        "[method]outgoing-request.set-authority",
        |mut store: StoreContextMut<'_, State>,
         (req, authority): (Resource<HostOutgoingRequest>, Option<WasmStr>)| {
            let authority = match authority {
                None => None,
                Some(a) => {
                    let a = a.to_str(&store)?;
                    if a.len() > AUTHORITY_BYTES || Authority::from_str(&a).is_err() {
                        return Ok((Err(()),));
                    }
                    Some(a.into_owned())
                }
            };
            store.data_mut().table.get_mut(&req)?.authority = authority;
            Ok((Ok(()),))
        },
    )?;
    types.func_wrap(
        "[method]outgoing-request.set-method",
        |mut store: StoreContextMut<'_, State>,
         (req, method): (Resource<HostOutgoingRequest>, Method)| {
            if let Method::Other(m) = &method
                && (m.len() > METHOD_BYTES || http::Method::from_str(m).is_err())
            {
                return Ok((Err(()),));
            }
            store.data_mut().table.get_mut(&req)?.method = method;
            Ok((Ok(()),))
        },
    )
}

/// Everything one instance can reach. Built fresh for every request.
pub(crate) struct State {
    pub(crate) table: ResourceTable,
    pub(crate) wasi: WasiCtx,
    pub(crate) http: WasiHttpCtx,
    pub(crate) hooks: DenyOutbound,
    pub(crate) ai: AiCtx,
    pub(crate) limits: StoreLimits,
    /// The resource of the last response body the guest took.
    response_body: Option<u32>,
}

impl State {
    pub(crate) fn new(ai: AiCtx, limits: StoreLimits) -> Self {
        // No preopened directories, no environment, no arguments; sockets
        // and name lookups are denied by the builder's defaults.
        let wasi = WasiCtx::builder().build();
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_RESOURCES);
        let mut http = WasiHttpCtx::new();
        http.set_field_size_limit(FIELD_BYTES);
        Self {
            table,
            wasi,
            http,
            hooks: DenyOutbound,
            ai,
            limits,
            response_body: None,
        }
    }

    /// Whether the response's body, if the guest took one, is still open:
    /// not finished (finishing takes it from the table), so a failure now
    /// cuts it short.
    pub(crate) fn response_unfinished(&self) -> bool {
        self.response_body.is_none_or(|rep| {
            let body = Resource::<HostOutgoingBody>::new_own(rep);
            self.table.get(&body).is_ok()
        })
    }

    pub(crate) fn ai(&mut self) -> AiView<'_> {
        AiView {
            ctx: &mut self.ai,
            table: &mut self.table,
        }
    }
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for State {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.hooks,
        }
    }
}

/// WASI-HTTP hooks that refuse every outbound request from guests.
pub(crate) struct DenyOutbound;

impl WasiHttpHooks for DenyOutbound {
    fn send_request(
        &mut self,
        _request: http::Request<wasmtime_wasi_http::WasiBody>,
        _options: Option<wasmtime_wasi_http::RequestOptions>,
        _fut: Box<dyn Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
    ) -> Box<
        dyn Future<
                Output = wasmtime_wasi_http::Result<(
                    http::Response<wasmtime_wasi_http::WasiBody>,
                    Box<dyn Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
                )>,
            > + Send,
    > {
        Box::new(async { Err(wasmtime_wasi_http::Error::HttpRequestDenied) })
    }

    fn p2_outgoing_body_chunk_size(&mut self) -> usize {
        BODY_CHUNK
    }
}
