"""Kiln's hello-world function in Python: a greeting that echoes the
request's method, path and `x-session-affinity` header."""

from kiln_guest import Handler, Request, Response


class IncomingHandler(Handler):
    def handle_request(self, req: Request) -> Response:
        return Response.text(
            200,
            "Hello from Kiln (Python)!\n"
            f"method: {req.method}\npath: {req.path}\nsession: {req.session() or 'none'}\n",
        )
