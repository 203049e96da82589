"""HTTP for Kiln functions: a request read whole, a response that is
bytes or a stream of chunks, and the `wasi:http/incoming-handler` export
that ties them together."""

from typing import Dict, Iterable, List, Optional, Tuple, Union

from componentize_py_types import Err, Ok
from wit_world import exports
from wit_world.imports import streams, types

# `blocking-write-and-flush` takes at most 4096 bytes per call.
_CHUNK = 4096

Chunk = Union[bytes, str]


class Request:
    """An incoming request: method, path, headers and (on demand) body."""

    def __init__(self, incoming: types.IncomingRequest) -> None:
        self._incoming = incoming
        self.method: str = _method_name(incoming.method())
        self.path: str = incoming.path_with_query() or "/"
        # The headers are a child resource of the request: copy them out
        # and drop the handle at once so the request can be consumed.
        with incoming.headers() as fields:
            self.headers: List[Tuple[str, bytes]] = fields.entries()
        self._body: Optional[bytes] = None

    def header(self, name: str) -> Optional[str]:
        """The first value of header `name` (any case), as text."""
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value.decode("utf-8", "replace")
        return None

    def session(self) -> Optional[str]:
        """The request's `x-session-affinity` key, if it has one."""
        return self.header("x-session-affinity")

    def body(self) -> bytes:
        """The whole request body (read once, then kept)."""
        if self._body is None:
            parts = []
            with self._incoming.consume() as body:
                with body.stream() as stream:
                    while True:
                        try:
                            parts.append(stream.blocking_read(65536))
                        except Err as e:
                            if isinstance(e.value, streams.StreamError_Closed):
                                break
                            raise
            self._body = b"".join(parts)
        return self._body

    def text(self) -> str:
        """The body as UTF-8 text."""
        return self.body().decode("utf-8", "replace")


class Response:
    """A response: a status, headers and a body of bytes or of chunks
    produced while the response is being sent."""

    def __init__(self, status: int, body: Union[Chunk, Iterable[Chunk]] = b"",
                 headers: Optional[Dict[str, str]] = None) -> None:
        self.status = status
        self.headers: List[Tuple[str, bytes]] = [
            (k, v.encode()) for k, v in (headers or {}).items()]
        self.body = body

    @classmethod
    def text(cls, status: int, body: str) -> "Response":
        """A `text/plain` response."""
        return cls(status, body, {"content-type": "text/plain; charset=utf-8"})

    @classmethod
    def json(cls, status: int, value: object) -> "Response":
        """A JSON response of `value`."""
        import json
        return cls(status, json.dumps(value), {"content-type": "application/json"})

    @classmethod
    def stream(cls, status: int, chunks: Iterable[Chunk]) -> "Response":
        """A response whose body is written chunk by chunk as `chunks`
        yields them. If the client goes away the generator is closed
        (`GeneratorExit` at its `yield`), so a model stream it holds in a
        `with` block is cancelled."""
        return cls(status, chunks)

    def header(self, name: str, value: str) -> "Response":
        """Adds a header; returns the response for chaining."""
        self.headers.append((name, value.encode()))
        return self


class Handler(exports.IncomingHandler):
    """Subclass this as `IncomingHandler` in your app module and
    implement `handle_request`."""

    def handle_request(self, req: Request) -> Response:
        """Answers one request."""
        raise NotImplementedError

    def handle(self, request: types.IncomingRequest,
               response_out: types.ResponseOutparam) -> None:
        try:
            resp = self.handle_request(Request(request))
        except Exception as e:  # noqa: BLE001 - the client gets a 500, not a trap
            resp = Response.json(500, {"error": {"message": f"{type(e).__name__}: {e}"}})
        _send(resp, response_out)


def _send(resp: Response, out: types.ResponseOutparam) -> None:
    fields = types.Fields()
    for name, value in resp.headers:
        try:
            fields.append(name, value)
        except Err:
            pass  # an invalid or forbidden header is dropped, not fatal
    outgoing = types.OutgoingResponse(fields)
    outgoing.set_status_code(resp.status)
    body = outgoing.body()
    types.ResponseOutparam.set(out, Ok(outgoing))
    chunks = resp.body
    if isinstance(chunks, (bytes, str)):
        chunks = [chunks]
    with body.write() as stream:
        for chunk in chunks:
            if isinstance(chunk, str):
                chunk = chunk.encode()
            if not _write(stream, chunk):
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
                break
    types.OutgoingBody.finish(body, None)


def _write(stream: streams.OutputStream, data: bytes) -> bool:
    for i in range(0, len(data), _CHUNK):
        try:
            stream.blocking_write_and_flush(data[i:i + _CHUNK])
        except Err:
            return False
    return True


def _method_name(method: types.Method) -> str:
    if isinstance(method, types.Method_Other):
        return method.value
    return type(method).__name__[len("Method_"):].upper()
