//! Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (one
//! entry per token, with its UTF-8 bytes and `top_logprobs`), and legacy
//! completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`
//! as objects, `text_offset`).

use kiln_runtime::{AiError, Completion, StreamEvent, TokenLogprob, TokenStream};
use serde_json::{Map, Value, json};

/// JSON has no -inf: OpenAI writes an impossible token's figure as -9999.
fn figure(lp: f32) -> f64 {
    if lp.is_finite() { lp as f64 } else { -9999.0 }
}

/// Chat's entry for one token (or one of its alternatives).
fn chat_entry(token: &str, lp: f32) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("token".into(), token.into());
    m.insert("logprob".into(), figure(lp).into());
    m.insert("bytes".into(), json!(token.as_bytes()));
    m
}

/// Chat's `logprobs` for `tokens`.
pub(super) fn chat(tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = chat_entry(&t.token, t.logprob);
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|(tok, lp)| Value::Object(chat_entry(tok, *lp)))
                .collect();
            e.insert("top_logprobs".into(), top.into());
            Value::Object(e)
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `logprobs` for `tokens`, whose text starts `offset`
/// characters into the completion; the offset after them.
pub(super) fn completion(tokens: &[TokenLogprob], mut offset: usize) -> (Value, usize) {
    let mut offsets = Vec::with_capacity(tokens.len());
    for t in tokens {
        offsets.push(offset);
        offset += t.token.chars().count();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let m: Map<String, Value> = t
                .top
                .iter()
                .map(|(tok, lp)| (tok.clone(), figure(*lp).into()))
                .collect();
            Value::Object(m)
        })
        .collect();
    let v = json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| figure(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    });
    (v, offset)
}

/// Runs `stream` to its end: the completion, and every token's
/// log-probabilities.
pub(super) async fn collect(
    mut stream: Box<dyn TokenStream>,
) -> Result<(Completion, Vec<TokenLogprob>), AiError> {
    let (mut text, mut all) = (String::new(), Vec::new());
    loop {
        match stream.next().await? {
            StreamEvent::Delta(t) => {
                text.push_str(&t);
                all.extend(stream.logprobs());
            }
            StreamEvent::Done(end) => {
                let c = Completion {
                    text,
                    finish_reason: end.finish_reason,
                    usage: end.usage,
                };
                return Ok((c, all));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(t: &str, lp: f32, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            token: t.into(),
            logprob: lp,
            top: top.iter().map(|(s, l)| (s.to_string(), *l)).collect(),
        }
    }

    #[test]
    fn chat_entries_carry_bytes_and_alternatives() {
        let v = chat(&[token("é", -0.5, &[("é", -0.5), ("e", -1.5)])]);
        let e = &v["content"][0];
        assert_eq!(e["token"], "é");
        assert_eq!(e["logprob"], -0.5);
        assert_eq!(e["bytes"], json!([0xc3, 0xa9]));
        assert_eq!(e["top_logprobs"][1]["token"], "e");
        assert_eq!(e["top_logprobs"][1]["bytes"], json!([b'e']));
        assert!(v["refusal"].is_null());
    }

    #[test]
    fn completion_lists_run_in_parallel_with_character_offsets() {
        let tokens = [
            token("Hé", -0.1, &[("Hé", -0.1)]),
            token("llo", f32::NEG_INFINITY, &[]),
        ];
        let (v, end) = completion(&tokens, 3);
        assert_eq!(v["tokens"], json!(["Hé", "llo"]));
        assert_eq!(v["token_logprobs"][1], -9999.0);
        assert_eq!(v["text_offset"], json!([3, 5]));
        assert_eq!(v["top_logprobs"][0]["Hé"].as_f64().unwrap() as f32, -0.1);
        assert_eq!(end, 8);
    }
}
