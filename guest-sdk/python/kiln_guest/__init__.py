"""Write Kiln functions in Python: a short HTTP handler API over
`wasi:http` and builders over Kiln's `kiln:ai` model API.

Built with componentize-py against the world `kiln:ai/function@0.2.0`
(the bindings, module `wit_world`, are generated from Kiln's `wit/` at
build time)::

    from kiln_guest import Handler, Request, Response

    class IncomingHandler(Handler):
        def handle_request(self, req: Request) -> Response:
            return Response.text(200, f"Hello from {req.path}\\n")
"""

from .http import Handler, Request, Response
from . import ai

__all__ = ["Handler", "Request", "Response", "ai"]
