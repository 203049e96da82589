//! Output formats (OpenAI's `response_format`, tool calls): any JSON
//! object, JSON that a JSON schema accepts, or text a grammar accepts. llguidance compiles a format against the
//! model's vocabulary into a matcher; before each of the request's tokens
//! is sampled, the tokens the matcher forbids get no probability, and the
//! token drawn advances it. Once the format is complete, only EOS is left.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::model::Tokenizer;

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputFormat {
    /// Any JSON object.
    JsonObject,
    /// JSON that this JSON schema accepts.
    JsonSchema(serde_json::Value),
    /// Text that this grammar accepts, in llguidance's Lark syntax.
    Grammar(String),
}

/// The vocabulary as llguidance sees it: every token's bytes.
struct Vocabulary {
    trie: TokTrie,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// Most compiled formats kept for reuse.
const CACHED_FORMATS: usize = 64;

/// Most compiled formats kept for one tenant: a tenant that sends a new
/// format with every call pushes out only its own.
const CACHED_PER_SCOPE: usize = 8;

/// Longest format text kept for reuse: a key holds the whole text, so
/// without a bound the cache could pin 64 request bodies' worth of it.
const CACHED_FORMAT_BYTES: usize = 64 << 10;

/// Compiles output formats for one model's vocabulary, and keeps the
/// recent ones: requests of one format (an API's schema) then start from a
/// copy instead of a compile. Shared between threads: a server compiles a
/// call's format before the call reaches the engine's thread
/// ([`Engine::admit`](super::Engine::admit)), where a compile would hold
/// up every request of the pool.
pub struct Formats {
    factory: ParserFactory,
    compiled: Mutex<Kept>,
}

/// Compiled formats, each kept for the tenant (`scope`) that compiled it,
/// so that no tenant can tell from a call's speed which formats another
/// used, nor push another's out by sending many: a tenant keeps at most
/// [`CACHED_PER_SCOPE`], and past [`CACHED_FORMATS`] in all the least
/// recently used goes.
#[derive(Default)]
struct Kept {
    /// By scope and text: the scope, the matcher, when last used.
    entries: HashMap<String, (String, Matcher, u64)>,
    clock: u64,
}

impl Kept {
    fn get(&mut self, key: &str) -> Option<Matcher> {
        self.clock += 1;
        let (_, m, used) = self.entries.get_mut(key)?;
        *used = self.clock;
        Some(m.deep_clone())
    }

    fn insert(&mut self, scope: &str, key: String, m: Matcher) {
        let lru = |of: &dyn Fn(&str) -> bool| {
            (self.entries.iter())
                .filter(|(_, (s, _, _))| of(s))
                .min_by_key(|(_, (_, _, used))| *used)
                .map(|(k, _)| k.clone())
        };
        let own = (self.entries.values())
            .filter(|(s, _, _)| s == scope)
            .count();
        let out = if own >= CACHED_PER_SCOPE {
            lru(&|s| s == scope)
        } else if self.entries.len() >= CACHED_FORMATS {
            lru(&|_| true)
        } else {
            None
        };
        if let Some(k) = out {
            self.entries.remove(&k);
        }
        self.clock += 1;
        self.entries.insert(key, (scope.to_owned(), m, self.clock));
    }
}

/// An output format compiled for a model's vocabulary, at its start.
pub struct CompiledFormat(pub(super) Matcher);

impl std::fmt::Debug for CompiledFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledFormat")
    }
}

impl Formats {
    /// The compiler for `tokenizer`'s `vocab` tokens (ids past the
    /// tokenizer's own are never allowed).
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Self, String> {
        let mut words = tokenizer.token_bytes()?;
        words.resize(vocab.max(words.len()), Vec::new());
        let eos = tokenizer.eos_ids().first().copied().unwrap_or(0);
        let info = TokRxInfo::new(words.len() as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        // A vocabulary without EOS (synthetic models' bytes) ends a
        // complete format with token 0, as `info` says.
        if !tokenizer.eos_ids().is_empty() {
            trie = trie.with_eos_tokens(tokenizer.eos_ids());
        }
        let env: TokEnv = Arc::new(Vocabulary { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self {
            factory,
            compiled: Default::default(),
        })
    }

    /// `format` compiled for a call of the tenant `scope` names, or why it
    /// cannot be.
    pub fn compile(&self, scope: &str, format: &OutputFormat) -> Result<CompiledFormat, String> {
        self.matcher(scope, format).map(CompiledFormat)
    }

    /// A matcher for `format` at its start, compiled or reused within
    /// `scope` (a tenant), or why it cannot be compiled.
    pub(super) fn matcher(&self, scope: &str, format: &OutputFormat) -> Result<Matcher, String> {
        let key = match format {
            OutputFormat::JsonObject => format!("{scope}\0object"),
            OutputFormat::JsonSchema(s) => format!("{scope}\0schema:{s}"),
            OutputFormat::Grammar(g) => format!("{scope}\0lark:{g}"),
        };
        let cached = |key: &str| {
            let mut compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
            compiled.get(key)
        };
        if let Some(m) = cached(&key) {
            return Ok(m);
        }
        // Compiled outside the lock: other formats' lookups go on.
        let m = self.compile_matcher(format)?;
        if key.len() > CACHED_FORMAT_BYTES {
            return Ok(m);
        }
        let mut compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        compiled.insert(scope, key, m.deep_clone());
        Ok(m)
    }

    fn compile_matcher(&self, format: &OutputFormat) -> Result<Matcher, String> {
        let (grammar, what) = match format {
            OutputFormat::JsonObject => (
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
                "JSON schema",
            ),
            OutputFormat::JsonSchema(s) => {
                (TopLevelGrammar::from_json_schema(s.clone()), "JSON schema")
            }
            OutputFormat::Grammar(g) => (TopLevelGrammar::from_lark(g.clone()), "grammar"),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| format!("the {what} cannot be used: {e}"))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(format!("the {what} cannot be used: {e}")),
            None => Ok(m),
        }
    }
}

/// How the error of a request whose output format failed mid-generation
/// begins (a grammar past the matcher's limits, say): the client's format
/// to simplify, not a fault of the server.
pub const FORMAT_FAILED: &str = "the output format failed";

/// Takes every token `matcher` forbids next out of `logits`.
pub(super) fn mask(matcher: &mut Matcher, logits: &mut [f32]) -> Result<(), String> {
    let allowed = matcher
        .compute_mask_or_eos()
        .map_err(|e| format!("{FORMAT_FAILED}: {e}"))?;
    kiln_kernels::sample::mask_logits(logits, allowed.as_slice());
    Ok(())
}

/// The tokens `matcher` allows next, as bits (`v % 32` of word `v / 32`)
/// over a vocabulary of `vocab`, without the trailing words that allow
/// nothing (a device reads missing words as zeros): what a device masks
/// its logits with.
pub(super) fn mask_words(matcher: &mut Matcher, vocab: usize) -> Result<Vec<u32>, String> {
    let allowed = matcher
        .compute_mask_or_eos()
        .map_err(|e| format!("{FORMAT_FAILED}: {e}"))?;
    let words = allowed.as_slice();
    let words = &words[..words.len().min(vocab.div_ceil(32))];
    let used = words.iter().rposition(|w| *w != 0).map_or(1, |i| i + 1);
    Ok(words[..used.min(words.len())].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_vocabulary_without_eos_compiles_formats_and_masks_them() {
        // Synthetic models: one token per byte, ids past 255 empty.
        let formats = Formats::new(&Tokenizer::bytes(300), 300).unwrap();
        let mut m = formats.matcher("t", &OutputFormat::JsonObject).unwrap();
        let words = mask_words(&mut m, 300).unwrap();
        // Bytes only: the words past 255 allow nothing and are left out.
        assert!(words.len() <= 8, "{}", words.len());
        let allowed: Vec<usize> = (0..300)
            .filter(|v| words.get(v / 32).is_some_and(|w| w >> (v % 32) & 1 == 1))
            .collect();
        // An object starts with `{` (or JSON's leading whitespace).
        assert!(allowed.contains(&(b'{' as usize)), "{allowed:?}");
        assert!(!allowed.contains(&(b'a' as usize)), "{allowed:?}");
        assert!(allowed.iter().all(|v| *v < 256), "{allowed:?}");
        let grammar = OutputFormat::Grammar("start: \"yes\" | \"no\"".into());
        let mut g = formats.matcher("t", &grammar).unwrap();
        let mut logits = vec![0.0f32; 300];
        mask(&mut g, &mut logits).unwrap();
        let open: Vec<usize> = (0..300).filter(|v| logits[*v] == 0.0).collect();
        assert_eq!(open, [b'n' as usize, b'y' as usize]);
        // A second matcher of a format starts where the first started.
        g.consume_token(b'y' as u32).unwrap();
        let mut again = formats.matcher("t", &grammar).unwrap();
        let mut logits = vec![0.0f32; 300];
        mask(&mut again, &mut logits).unwrap();
        assert_eq!(logits.iter().filter(|l| **l == 0.0).count(), 2);
        let bad = OutputFormat::Grammar("start: undefined_rule".into());
        let Err(e) = formats.matcher("t", &bad) else {
            panic!("an undefined rule compiled")
        };
        assert!(e.contains("grammar"), "{e}");
    }

    #[test]
    fn a_tenants_formats_are_its_own_and_its_flood_pushes_out_only_its_own() {
        let formats = Formats::new(&Tokenizer::bytes(300), 300).unwrap();
        let kept = || formats.compiled.lock().unwrap().entries.len();
        let object = OutputFormat::JsonObject;
        formats.matcher("a", &object).unwrap();
        formats.matcher("a", &object).unwrap();
        assert_eq!(kept(), 1, "a's second call reuses its format");
        formats.matcher("b", &object).unwrap();
        assert_eq!(kept(), 2, "b's call compiles its own");
        for i in 0..20 {
            let g = OutputFormat::Grammar(format!("start: \"{i}\""));
            formats.matcher("c", &g).unwrap();
        }
        assert_eq!(kept(), 2 + CACHED_PER_SCOPE);
        let entries = &formats.compiled.lock().unwrap().entries;
        for t in ["a", "b"] {
            assert!(
                entries.contains_key(&format!("{t}\0object")),
                "{t}'s was pushed out"
            );
        }
    }

    #[test]
    fn formats_are_kept_for_reuse_unless_their_text_is_long() {
        let formats = Formats::new(&Tokenizer::bytes(300), 300).unwrap();
        let kept = || formats.compiled.lock().unwrap().entries.len();
        formats.matcher("t", &OutputFormat::JsonObject).unwrap();
        assert_eq!(kept(), 1);
        let long = format!("start: \"{}\"", "a".repeat(CACHED_FORMAT_BYTES));
        formats.matcher("t", &OutputFormat::Grammar(long)).unwrap();
        assert_eq!(kept(), 1, "a long format's text was kept");
    }
}
