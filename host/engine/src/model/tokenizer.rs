//! Tokenizers (Hugging Face `tokenizers`, built from `tokenizer.json` or
//! from GGUF metadata) and chat templates (minijinja).

use std::path::Path;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::ModelError;
use super::gguf::Gguf;

/// Instructions a chat template may run for one prompt: far more than
/// any real template needs for a long conversation.
const TEMPLATE_FUEL: u64 = 10_000_000;

/// One chat message, as templates see it (Hugging Face's shape).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant message's tool calls:
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool message: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn text(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

enum Inner {
    Hf(Box<tokenizers::Tokenizer>),
    /// One token per byte (synthetic models).
    Bytes,
}

/// A model's tokenizer, special tokens and chat template.
pub struct Tokenizer {
    inner: Inner,
    eos: Vec<u32>,
    bos: Option<u32>,
    add_bos: bool,
    template: Option<String>,
    bos_text: String,
    eos_text: String,
    /// Every token's bytes, made when first asked for.
    pieces: std::sync::OnceLock<Vec<Vec<u8>>>,
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split(pattern: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let s = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tok_err)?;
    Ok(s.into())
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes (gpt2-style BPE).
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let kind = g.str("tokenizer.ggml.model").unwrap_or("?");
        if kind != "gpt2" {
            return Err(ModelError::Unsupported(format!(
                "GGUF tokenizer `{kind}`: Kiln builds gpt2-style BPE tokenizers from GGUF; \
                 for SentencePiece models pass the Hugging Face directory (with tokenizer.json) to --model"
            )));
        }
        let tokens = g
            .strings("tokenizer.ggml.tokens")
            .ok_or_else(|| tok_err("GGUF lacks tokenizer.ggml.tokens"))?;
        let merges = g
            .strings("tokenizer.ggml.merges")
            .ok_or_else(|| tok_err("GGUF lacks tokenizer.ggml.merges"))?;
        let types = g.ints("tokenizer.ggml.token_type").unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
            .collect();
        let pre = g.str("tokenizer.ggml.pre").unwrap_or("default");
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.starts_with("llama"))
            .build()
            .map_err(tok_err)?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        let byte_level =
            |regex: bool| PreTokenizerWrapper::from(ByteLevel::new(false, false, regex));
        let pre_tok: PreTokenizerWrapper = match pre {
            "gpt2" | "default" | "gpt-2" => byte_level(true),
            "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
            "llama3" | "llama-bpe" | "llama-v3" => {
                Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false)]).into()
            }
            "qwen2" => Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false)]).into(),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF pre-tokenizer `{other}` (supported: gpt2, smollm, llama3/llama-bpe, qwen2)"
                )));
            }
        };
        tk.with_pre_tokenizer(Some(pre_tok));
        tk.with_decoder(Some(ByteLevel::default()));
        // Control (3) and user-defined (4) tokens are matched whole in text.
        let specials: Vec<AddedToken> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(i, _)| AddedToken::from(tokens[i].to_string(), true))
            .collect();
        tk.add_special_tokens(&specials);
        let id = |k: &str| g.int(k).map(|v| v as u32);
        let bos = id("tokenizer.ggml.bos_token_id");
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        eos.extend(id("tokenizer.ggml.eot_token_id"));
        let text = |i: Option<u32>| {
            i.and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string())
                .unwrap_or_default()
        };
        Ok(Self {
            inner: Inner::Hf(Box::new(tk)),
            bos_text: text(bos),
            eos_text: text(eos.first().copied()),
            eos,
            bos,
            add_bos: matches!(
                g.meta.get("tokenizer.ggml.add_bos_token"),
                Some(super::gguf::Value::Bool(true))
            ),
            template: g.str("tokenizer.chat_template").map(str::to_owned),
            pieces: Default::default(),
        })
    }

    /// Loads `tokenizer.json` (+ `tokenizer_config.json`, `config.json` for
    /// special tokens and the template) from a Hugging Face directory.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let tk = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(tok_err)?;
        let json = |name: &str| -> serde_json::Value {
            std::fs::read(dir.join(name))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default()
        };
        let tc = json("tokenizer_config.json");
        let cfg = json("config.json");
        let token_text = |v: &serde_json::Value| {
            v.as_str()
                .or_else(|| v["content"].as_str())
                .map(str::to_owned)
        };
        let bos_text = token_text(&tc["bos_token"]).unwrap_or_default();
        let eos_text = token_text(&tc["eos_token"]).unwrap_or_default();
        let mut eos: Vec<u32> = match &cfg["eos_token_id"] {
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            v => v.as_u64().map(|v| v as u32).into_iter().collect(),
        };
        eos.extend(tk.token_to_id(&eos_text));
        let bos = tk.token_to_id(&bos_text);
        Ok(Self {
            add_bos: tc["add_bos_token"].as_bool().unwrap_or(false) && bos.is_some(),
            template: tc["chat_template"].as_str().map(str::to_owned),
            inner: Inner::Hf(Box::new(tk)),
            eos,
            bos,
            bos_text,
            eos_text,
            pieces: Default::default(),
        })
    }

    /// A byte tokenizer for synthetic models: token = byte value; ids past
    /// 255 (most of a synthetic vocabulary) write one printable character.
    pub fn bytes(_vocab: usize) -> Self {
        Self {
            inner: Inner::Bytes,
            eos: Vec::new(),
            bos: None,
            add_bos: false,
            template: None,
            bos_text: String::new(),
            eos_text: String::new(),
            pieces: Default::default(),
        }
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json` (not for
    /// the byte tokenizer of synthetic models).
    pub fn save_json(&self, path: &Path) -> Result<(), ModelError> {
        match &self.inner {
            Inner::Hf(tk) => tk.save(path, false).map_err(tok_err),
            Inner::Bytes => Err(tok_err("the byte tokenizer has no tokenizer.json form")),
        }
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.template.as_deref()
    }

    /// Token ids of `text`; special tokens written in the text are matched.
    /// Adds the BOS token when the model asks for it and `add_bos` is set.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, ModelError> {
        let mut ids = match &self.inner {
            Inner::Hf(tk) => tk.encode(text, false).map_err(tok_err)?.get_ids().to_vec(),
            Inner::Bytes => text.bytes().map(u32::from).collect(),
        };
        if add_bos
            && self.add_bos
            && let Some(b) = self.bos
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner {
            Inner::Hf(tk) => tk.decode(ids, true).unwrap_or_default(),
            Inner::Bytes => {
                String::from_utf8_lossy(&ids.iter().map(|i| byte_token(*i)).collect::<Vec<_>>())
                    .into_owned()
            }
        }
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// The tokens that end generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Every token's bytes, by id, as the model writes them (special
    /// tokens as their text): what a grammar engine matches output against.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>, String> {
        match &self.inner {
            Inner::Hf(tk) => {
                let json = tk.to_string(false).map_err(|e| e.to_string())?;
                let value: serde_json::Value =
                    serde_json::from_str(&json).map_err(|e| e.to_string())?;
                llguidance::token_bytes_from_tokenizer_json(&value).map_err(|e| e.to_string())
            }
            Inner::Bytes => Ok((0..=255u8).map(|b| vec![b]).collect()),
        }
    }

    /// One token's bytes as the model writes them (its text's when the
    /// vocabulary's bytes cannot be read).
    pub fn token_piece(&self, id: u32) -> Vec<u8> {
        let all = self
            .pieces
            .get_or_init(|| self.token_bytes().unwrap_or_default());
        match all.get(id as usize).map(Vec::as_slice) {
            // llguidance marks a special token's text with a leading 0xFF.
            Some([0xFF, text @ ..]) => text.to_vec(),
            Some(b) if !b.is_empty() => b.to_vec(),
            _ => self.decode(&[id]).into_bytes(),
        }
    }

    /// The prompt for a conversation, rendered with the model's chat
    /// template and ending where the assistant's reply begins.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, ModelError> {
        self.chat_prompt_with_tools(messages, None)
    }

    /// Whether the chat template shows the model a request's tools (it
    /// reads the `tools` variable).
    pub fn template_knows_tools(&self) -> bool {
        self.template
            .as_deref()
            .is_some_and(|t| t.contains("tools"))
    }

    /// [`Self::chat_prompt`] with `tools` (OpenAI's
    /// `{"type": "function", "function": {...}}` objects) for the template.
    pub fn chat_prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, ModelError> {
        let Some(template) = &self.template else {
            // No template: a plain transcript.
            let mut s: String = messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content))
                .collect();
            s.push_str("assistant:");
            return Ok(s);
        };
        let mut env = minijinja::Environment::new();
        // A template that loops without end (or for very long) fails
        // instead of holding the request's thread.
        env.set_fuel(Some(TEMPLATE_FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template).map_err(tok_err)?;
        let tmpl = env.get_template("chat").map_err(tok_err)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
        })
        .map_err(tok_err)
    }
}

#[cfg(test)]
#[path = "template_fuzz.rs"]
mod fuzz;

/// A byte tokenizer's text for `id`: its byte below 256; above, a
/// printable ASCII character, so a random model's tokens are whole
/// characters as a real tokenizer's mostly are (a byte of 0x80 or more is
/// half a character, held back until the next token: streams would carry
/// two tokens a chunk).
fn byte_token(id: u32) -> u8 {
    match u8::try_from(id) {
        Ok(b) => b,
        Err(_) => b' ' + (id % 95) as u8,
    }
}

#[cfg(test)]
mod tests {
    use super::Tokenizer;

    #[test]
    fn a_synthetic_vocabularys_tokens_past_a_byte_decode_to_whole_characters() {
        let t = Tokenizer::bytes(128_256);
        assert_eq!(t.decode(&t.encode("hi {", false).unwrap()), "hi {");
        for id in [256, 383, 40_000, 128_255] {
            let text = t.decode(&[id]);
            assert_eq!(text.chars().count(), 1, "{id}: {text:?}");
            assert!(!text.contains('\u{FFFD}'), "{id}: {text:?}");
        }
        // A byte below 256 is still that byte: half a character alone.
        assert!(t.decode(&[0xC3]).contains('\u{FFFD}'));
    }
}
