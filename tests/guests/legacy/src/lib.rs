//! A function built against `kiln:ai@0.1.0`, before output formats, tools
//! and log-probabilities: it asks the first model it may use for a few
//! tokens, once whole and once streamed, and answers
//! `model|whole text|finish|tokens|streamed text|finish|tokens`.

#[allow(missing_docs, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../../wit",
        world: "kiln:ai/function@0.1.0",
        generate_all,
    });
}

use bindings::exports::wasi::http::incoming_handler::Guest;
use bindings::kiln::ai0_1_0::inference as ai;
use bindings::wasi::http::types::{
    Fields, IncomingRequest, OutgoingBody, OutgoingResponse, ResponseOutparam,
};

/// The handler.
pub struct Legacy;

fn params() -> ai::Params {
    ai::Params {
        max_tokens: Some(4),
        temperature: Some(0.0),
        top_p: None,
        top_k: None,
        seed: None,
        stop: Vec::new(),
        session: None,
    }
}

fn answer() -> Result<String, ai::Error> {
    let Some(model) = ai::list_models().into_iter().next() else {
        return Ok("no models".into());
    };
    let messages = [ai::Message {
        role: ai::Role::User,
        content: "Say hi.".into(),
    }];
    let whole = ai::chat(&model.id, &messages, &params())?;
    let stream = ai::stream_chat(&model.id, &messages, &params())?;
    let mut text = String::new();
    let end = loop {
        match stream.next()? {
            ai::StreamEvent::Delta(t) => text.push_str(&t),
            ai::StreamEvent::Done(end) => break end,
        }
    };
    Ok(format!(
        "{}|{}|{:?}|{}|{}|{:?}|{}",
        model.id,
        whole.text,
        whole.finish_reason,
        whole.usage.completion_tokens,
        text,
        end.finish_reason,
        end.usage.completion_tokens
    ))
}

impl Guest for Legacy {
    fn handle(_request: IncomingRequest, out: ResponseOutparam) {
        let (status, body) = match answer() {
            Ok(b) => (200, b),
            Err(e) => (502, format!("{e:?}")),
        };
        let response = OutgoingResponse::new(Fields::new());
        let _ = response.set_status_code(status);
        let Ok(body_out) = response.body() else {
            return;
        };
        ResponseOutparam::set(out, Ok(response));
        if let Ok(stream) = body_out.write() {
            let _ = stream.blocking_write_and_flush(body.as_bytes());
        }
        let _ = OutgoingBody::finish(body_out, None);
    }
}

#[cfg(target_arch = "wasm32")]
bindings::export!(Legacy with_types_in bindings);
