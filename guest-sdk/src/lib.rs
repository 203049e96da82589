//! Write Kiln functions in a few lines.
//!
//! A Kiln function is a WebAssembly component (`--target wasm32-wasip2`)
//! that handles HTTP requests and may call the language models its server
//! hosts. Implement [`Handler`] and export it with [`export_handler!`]:
//!
//! ```no_run
//! use kiln_guest::{Handler, Request, Response, ai};
//!
//! struct Hello;
//!
//! impl Handler for Hello {
//!     fn handle(req: Request) -> Response {
//!         let question = String::from_utf8_lossy(&req.body()).into_owned();
//!         match ai::Chat::new("smollm2-135m-instruct")
//!             .system("Answer in one sentence.")
//!             .user(question)
//!             .max_tokens(64)
//!             .send()
//!         {
//!             Ok(done) => Response::text(200, done.text),
//!             Err(e) => Response::text(502, format!("model call failed: {e}")),
//!         }
//!     }
//! }
//!
//! kiln_guest::export_handler!(Hello);
//! ```
//!
//! The crate type must be `cdylib`. Build with
//! `cargo build --target wasm32-wasip2 --release` and deploy the `.wasm`
//! with `kiln deploy`.

pub mod ai;
mod http;

pub use http::{BodyWriter, Handler, Request, Response};

/// Raw bindings of the `kiln:ai/function@0.2.0` world (wasi:http and
/// kiln:ai), for what the friendly API does not cover.
#[allow(missing_docs, clippy::all)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "kiln:ai/function@0.2.0",
        generate_all,
        pub_export_macro: true,
        default_bindings_module: "kiln_guest::bindings",
    });
}

#[doc(hidden)]
pub mod __private {
    pub use crate::http::run;
}

/// Exports a [`Handler`] as the component's `wasi:http/incoming-handler`.
///
/// On targets other than wasm32 it expands to nothing, so a guest crate
/// still builds (and lints) natively.
#[macro_export]
macro_rules! export_handler {
    ($handler:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __KilnExport;
            impl $crate::bindings::exports::wasi::http::incoming_handler::Guest for __KilnExport {
                fn handle(
                    request: $crate::bindings::wasi::http::types::IncomingRequest,
                    response_out: $crate::bindings::wasi::http::types::ResponseOutparam,
                ) {
                    $crate::__private::run::<$handler>(request, response_out)
                }
            }
    $crate::bindings::export!(__KilnExport with_types_in $crate::bindings);
        };
    };
}
