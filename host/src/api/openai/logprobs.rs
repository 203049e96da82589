//! Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (one
//! entry per token, with its UTF-8 bytes and `top_logprobs`), and legacy
//! completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`
//! as objects, `text_offset`).

use kiln_runtime::TokenLogprob;
use serde_json::{Map, Value, json};

/// JSON has no -inf: OpenAI writes an impossible token's figure as -9999.
fn figure(lp: f32) -> f64 {
    if lp.is_finite() { lp as f64 } else { -9999.0 }
}

/// Chat's entry for one token (or one of its alternatives).
fn chat_entry(token: &str, bytes: &[u8], lp: f32) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("token".into(), token.into());
    m.insert("logprob".into(), figure(lp).into());
    m.insert("bytes".into(), json!(bytes));
    m
}

/// Chat's `logprobs` for `tokens`.
pub(super) fn chat(tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = chat_entry(&t.token, &t.bytes, t.logprob);
            let top: Vec<Value> = (t.top.iter())
                .map(|a| Value::Object(chat_entry(&a.token, &a.bytes, a.logprob)))
                .collect();
            e.insert("top_logprobs".into(), top.into());
            Value::Object(e)
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Where the next token starts in a completion's text, in characters: a
/// token that ends inside a character starts no new one.
#[derive(Debug, Default)]
pub(super) struct Offset {
    chars: usize,
    /// Bytes of a character not yet complete.
    tail: Vec<u8>,
}

impl Offset {
    /// Where a token of `bytes` starts; moves past it.
    fn advance(&mut self, bytes: &[u8]) -> usize {
        let at = self.chars;
        self.tail.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.tail) {
                Ok(s) => {
                    self.chars += s.chars().count();
                    self.tail.clear();
                    return at;
                }
                Err(e) => {
                    let ok = e.valid_up_to();
                    // Valid up to `ok`; then a bad byte run (one U+FFFD
                    // in the text), or a character still to come.
                    let valid = std::str::from_utf8(&self.tail[..ok]).unwrap_or("");
                    self.chars += valid.chars().count();
                    match e.error_len() {
                        Some(bad) => {
                            self.chars += 1;
                            self.tail.drain(..ok + bad);
                        }
                        None => {
                            self.tail.drain(..ok);
                            return at;
                        }
                    }
                }
            }
        }
    }
}

/// Completions' `logprobs` for `tokens`, placed in the text from `offset`
/// on.
pub(super) fn completion(tokens: &[TokenLogprob], offset: &mut Offset) -> Value {
    let offsets: Vec<usize> = tokens.iter().map(|t| offset.advance(&t.bytes)).collect();
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let m: Map<String, Value> = (t.top.iter())
                .map(|a| (a.token.clone(), figure(a.logprob).into()))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| figure(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use kiln_runtime::TopLogprob;

    fn token(t: &str, lp: f32, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            token: t.into(),
            bytes: t.as_bytes().to_vec(),
            logprob: lp,
            top: (top.iter())
                .map(|(s, l)| TopLogprob {
                    token: s.to_string(),
                    bytes: s.as_bytes().to_vec(),
                    logprob: *l,
                })
                .collect(),
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
        let mut at = Offset {
            chars: 3,
            tail: Vec::new(),
        };
        let v = completion(&tokens, &mut at);
        assert_eq!(v["tokens"], json!(["Hé", "llo"]));
        assert_eq!(v["token_logprobs"][1], -9999.0);
        assert_eq!(v["text_offset"], json!([3, 5]));
        assert_eq!(v["top_logprobs"][0]["Hé"].as_f64().unwrap() as f32, -0.1);
        assert_eq!(at.chars, 8);
    }

    #[test]
    fn a_character_split_over_tokens_is_counted_once() {
        // "é" (c3 a9) in two tokens, then "x", then a stray byte.
        let mut at = Offset::default();
        assert_eq!(at.advance(&[0xc3]), 0);
        assert_eq!(at.advance(&[0xa9]), 0);
        assert_eq!(at.advance(b"x"), 1);
        assert_eq!(at.advance(&[0xff]), 2);
        assert_eq!(at.advance(b"y"), 3);
        assert_eq!(at.chars, 4);
    }
}
