//! Kiln's hello-world function: a greeting that echoes the request's method,
//! path and `x-session-affinity` header.

use kiln_guest::{Handler, Request, Response};

/// The handler.
pub struct Hello;

impl Handler for Hello {
    fn handle(req: Request) -> Response {
        let session = req.session().unwrap_or("none");
        Response::text(
            200,
            format!(
                "Hello from Kiln!\nmethod: {}\npath: {}\nsession: {}\n",
                req.method(),
                req.path(),
                session
            ),
        )
    }
}

kiln_guest::export_handler!(Hello);
