//! A test guest that misbehaves on request, chosen by path:
//! `/loop` spins forever, `/grow` allocates without bound, `/trap` hits
//! `unreachable`, `/sleep` blocks in a host call for a minute (`/nap`: half a
//! second), `/fetch` tries
//! an outbound HTTP request, `/echo`
//! returns the request body, `/ai` calls a model and reports the error,
//! `/ask` asks the default model for a few tokens and reports the text or
//! the error, `/stream` counts the chunks of a streaming chat with the model
//! `slow` (and reports the error that ended it, if one did).

use kiln_guest::{Handler, Request, Response, ai};

/// The handler.
pub struct Misbehave;

impl Handler for Misbehave {
    fn handle(req: Request) -> Response {
        match req.path() {
            "/loop" => {
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            "/grow" => {
                // Reserve 16 MiB at a time without touching it: memory grows
                // fast and the memory limit, not the CPU limit, must stop it.
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(std::hint::black_box(Vec::with_capacity(16 << 20)));
                }
            }
            "/trap" => std::process::abort(),
            "/sleep" => {
                std::thread::sleep(std::time::Duration::from_secs(60));
                Response::text(200, "woke up")
            }
            "/nap" => {
                std::thread::sleep(std::time::Duration::from_millis(500));
                Response::text(200, "rested")
            }
            "/fetch" => Response::text(200, fetch()),
            "/echo" => Response::new(200, req.body()),
            "/stream" => match ai::Chat::new("slow").user("hi").stream() {
                Ok(s) => {
                    let mut n = 0;
                    for chunk in s {
                        match chunk {
                            Ok(_) => n += 1,
                            Err(e) => {
                                return Response::text(200, format!("{n} chunks, then {e:?}"));
                            }
                        }
                    }
                    Response::text(200, format!("{n} chunks"))
                }
                Err(e) => Response::text(502, format!("{e:?}")),
            },
            "/ask" => match ai::Chat::new("smollm2-135m-instruct")
                .user("Say hi.")
                .max_tokens(4)
                .send()
            {
                Ok(c) => Response::text(200, c.text),
                Err(e) => Response::text(502, format!("{e:?}")),
            },
            "/ai" => match ai::Chat::new("no-such-model").user("hi").send() {
                Ok(c) => Response::text(200, c.text),
                Err(e) => Response::text(502, format!("{e:?}")),
            },
            _ => Response::text(200, "ok"),
        }
    }
}

kiln_guest::export_handler!(Misbehave);

/// Tries an outbound request (to a closed loopback port) and describes the
/// outcome.
fn fetch() -> String {
    use kiln_guest::bindings::wasi::http::{outgoing_handler, types};
    let req = types::OutgoingRequest::new(types::Fields::new());
    let _ = req.set_scheme(Some(&types::Scheme::Http));
    let _ = req.set_authority(Some("127.0.0.1:9"));
    let _ = req.set_path_with_query(Some("/"));
    let fut = match outgoing_handler::handle(req, None) {
        Ok(f) => f,
        Err(code) => return format!("refused: {code:?}"),
    };
    fut.subscribe().block();
    match fut.get() {
        Some(Ok(Ok(_))) => "sent".into(),
        Some(Ok(Err(code))) => format!("refused: {code:?}"),
        other => format!("unexpected: {other:?}"),
    }
}
