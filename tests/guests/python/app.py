"""A Python function that breaks Kiln's limits on purpose: `/loop` spins
until the CPU-time limit stops it, `/grow` allocates until the memory
limit refuses more; anything else answers 200."""

from kiln_guest import Handler, Request, Response


class IncomingHandler(Handler):
    def handle_request(self, req: Request) -> Response:
        if req.path == "/loop":
            n = 0
            while True:
                n += 1
        if req.path == "/grow":
            hoard = []
            while True:
                hoard.append(bytearray(16 << 20))
        return Response.text(200, "ok")
