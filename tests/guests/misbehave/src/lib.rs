//! A test guest that misbehaves on request, chosen by path:
//! `/loop` spins forever, `/grow` allocates without bound, `/trap` hits
//! `unreachable`, `/sleep` blocks in a host call for a minute (`/nap`: half a
//! second), `/fetch` tries
//! an outbound HTTP request, `/echo`
//! returns the request body, `/ai` calls a model and reports the error,
//! `/ask` asks the default model for a few tokens and reports the text or
//! the error, `/stream` counts the chunks of a streaming chat with the model
//! `slow` (and reports the error that ended it, if one did), `/tool` makes
//! the default model call a tool (`kiln:ai@0.2.0`), with log-probabilities,
//! and feeds the result back, `/bodies` fills response bodies it never
//! sends (host memory, not its own), `/authority` sets a short and a 1 MiB
//! authority, then method, on an outgoing request and reports which the
//! host took, `/partial` streams a few bytes and then spins, `/random`
//! asks the host for random bytes without end, `/longask` sends the
//! default model a 2 MB prompt (past its context) and reports the error,
//! `/late-trap` answers `ok`, finishes its body, and then traps,
//! `/manymessages` calls the model with half a million empty messages.

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
            "/longask" => match ai::Chat::new("smollm2-135m-instruct")
                .user("word ".repeat(400_000))
                .max_tokens(1)
                .send()
            {
                Ok(c) => Response::text(200, c.text),
                Err(e) => Response::text(502, format!("{e:?}")),
            },
            "/manymessages" => {
                // Half a million empty messages: a few MiB here, far more
                // on the host once copied in.
                let mut chat = ai::Chat::new("smollm2-135m-instruct").max_tokens(1);
                for _ in 0..500_000 {
                    chat = chat.user("");
                }
                match chat.send() {
                    Ok(c) => Response::text(200, c.text),
                    Err(e) => Response::text(502, format!("{e:?}")),
                }
            }
            "/tool" => match tool_round_trip() {
                Ok(report) => Response::text(200, report),
                Err(e) => Response::text(502, format!("{e:?}")),
            },
            "/hog" => loop {
                // Host calls answered at once: the guest never waits.
                let _ = ai::Chat::new("no-such-model").user("hi").send();
            },
            "/random" => loop {
                // Host work for the guest: 8 MiB of random bytes a call.
                let bytes = kiln_guest::bindings::wasi::random::random::get_random_bytes(8 << 20);
                std::hint::black_box(bytes);
            },
            "/bodies" => Response::text(200, hoard_bodies()),
            "/authority" => Response::text(200, authorities()),
            "/partial" => Response::stream(200, |w| {
                w.write(b"partial");
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }),
            "/ai" => match ai::Chat::new("no-such-model").user("hi").send() {
                Ok(c) => Response::text(200, c.text),
                Err(e) => Response::text(502, format!("{e:?}")),
            },
            _ => Response::text(200, "ok"),
        }
    }
}

/// The SDK's export, but `/late-trap` traps after the response is whole.
#[cfg(target_arch = "wasm32")]
mod export {
    use kiln_guest::bindings::exports::wasi::http::incoming_handler::Guest;
    use kiln_guest::bindings::wasi::http::types::{IncomingRequest, ResponseOutparam};

    struct Export;

    impl Guest for Export {
        fn handle(request: IncomingRequest, out: ResponseOutparam) {
            let late = request.path_with_query().as_deref() == Some("/late-trap");
            kiln_guest::__private::run::<super::Misbehave>(request, out);
            if late {
                std::process::abort();
            }
        }
    }

    kiln_guest::bindings::export!(Export with_types_in kiln_guest::bindings);
}

/// A tool call and its answer: `name|arguments|finish|logprobs|tokens`
/// of the call, then `|` and the reply to its result.
fn tool_round_trip() -> Result<String, ai::Error> {
    let schema = r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": false}"#;
    let chat = ai::Chat::new("smollm2-135m-instruct")
        .user("What is the weather in Paris?")
        .tool("get_weather", "The weather in a city today.", schema)
        .temperature(0.0)
        .max_tokens(48);
    let called = chat
        .clone()
        .tool_choice(ai::ToolChoice::Required)
        .parallel_tool_calls(false)
        .logprobs(2)
        .send()?;
    let Some(call) = called.tool_calls.first().cloned() else {
        return Ok(format!("no call: {}", called.text));
    };
    let answer = chat
        .assistant_calls(called.tool_calls.clone())
        .tool_result(call.id.clone(), "Sunny, 21 C")
        .tool_choice(ai::ToolChoice::None)
        .max_tokens(12)
        .send()?;
    Ok(format!(
        "{}|{}|{:?}|{}|{}|{}",
        call.name,
        call.arguments,
        called.finish_reason,
        called.logprobs.len(),
        called.usage.completion_tokens,
        answer.text
    ))
}

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

/// Writes 1 MiB chunks into up to 2048 response bodies it keeps and never
/// sends, so that only the host's buffers hold them; reports how far it got.
fn hoard_bodies() -> String {
    use kiln_guest::bindings::wasi::http::types;
    let chunk = vec![7u8; 1 << 20];
    let mut kept = Vec::new();
    let mut written = 0usize;
    while kept.len() < 2048 {
        let resp = types::OutgoingResponse::new(types::Fields::new());
        let Ok(body) = resp.body() else { break };
        let Ok(out) = body.write() else { break };
        while let Ok(n) = out.check_write() {
            let n = (n as usize).min(chunk.len());
            if n == 0 || out.write(&chunk[..n]).is_err() {
                break;
            }
            written += n;
        }
        kept.push((resp, body, out));
    }
    format!("{written} bytes in {} bodies", kept.len())
}

/// Sets a plain authority, then one of 1 MiB, and a method of its own,
/// then one of 1 MiB, on a request it never sends; reports whether each
/// was taken and the lengths the request kept.
fn authorities() -> String {
    use kiln_guest::bindings::wasi::http::types;
    let req = types::OutgoingRequest::new(types::Fields::new());
    let short = req.set_authority(Some("example.com:443")).is_ok();
    let long = req.set_authority(Some(&"a".repeat(1 << 20))).is_ok();
    let kept = req.authority().map_or(0, |a| a.len());
    let purge = types::Method::Other("PURGE".into());
    let method = req.set_method(&purge).is_ok();
    let huge = types::Method::Other("A".repeat(1 << 20));
    let huge = req.set_method(&huge).is_ok();
    let kept_method = match req.method() {
        types::Method::Other(m) => m.len(),
        _ => 0,
    };
    format!(
        "short {short}, long {long}, kept {kept}; method {method}, huge {huge}, kept {kept_method}"
    )
}
