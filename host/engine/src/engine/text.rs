//! A generation's text as it streams out: incremental detokenization and
//! stop strings.
//!
//! The text only ever grows, so what has been handed out never changes.
//! Tokens are decoded in a short window that starts a little before the
//! newest ones (the earlier tokens give the decoder its context, such as a
//! word's leading space), and the window's new text is appended only when it
//! does not end in U+FFFD: a byte-level token may carry half a character,
//! and its text is final only when the rest arrives. Decoding a window, not
//! the whole generation, also keeps each token's cost constant.
//!
//! Stop strings are searched only where a new match can be: near the end.
//! Text that might begin a stop string is held back until the match is
//! settled, so a stop string never goes out, not even in part.

/// Tokens held back for an incomplete character before their text is
/// taken as final, U+FFFD and all: a character is at most four bytes, so
/// a run this long is invalid bytes (a character that completes right
/// after it goes out as U+FFFD too). It bounds the decode window, so each
/// token's cost stays constant in any output.
const MAX_PENDING: usize = 64;

/// The streaming text of one generation.
#[derive(Debug, Clone, Default)]
pub(crate) struct TextStream {
    /// Where the decode window starts (context for the tokenizer).
    prefix: usize,
    /// Tokens whose text is in `text`.
    read: usize,
    /// Final text so far; cut before a stop string once one is found.
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    /// The non-empty stop strings.
    stop: Vec<String>,
    /// Length of the longest stop string.
    longest: usize,
    /// A stop string was found.
    stopped: bool,
    /// Bytes of text decoded so far, a stop string and what follows it
    /// included: where the newest token's text ends.
    decoded: usize,
}

impl TextStream {
    /// A stream that ends before any of `stop` (empty strings are ignored).
    pub(crate) fn new(stop: &[String]) -> Self {
        let stop: Vec<String> = stop.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest = stop.iter().map(String::len).max().unwrap_or(0);
        Self {
            stop,
            longest,
            ..Self::default()
        }
    }

    /// Where the newest token's text ends, in bytes of the text decoded so
    /// far (a stop string and what follows it included).
    pub(crate) fn decoded(&self) -> usize {
        self.decoded
    }

    /// Bytes of text handed out so far.
    pub(crate) fn emitted(&self) -> usize {
        self.emitted
    }

    /// All the final text so far.
    #[cfg(test)]
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// Takes `tokens`, the whole generation so far, after a token was
    /// added; `decode` turns tokens into text. Returns whether a stop
    /// string has ended the text.
    pub(crate) fn push(&mut self, tokens: &[u32], decode: impl Fn(&[u32]) -> String) -> bool {
        self.advance(tokens, decode, false)
    }

    /// Ends the stream: text held back for an incomplete character is final
    /// now (a U+FFFD stays). Returns whether a stop string has ended it.
    pub(crate) fn flush(&mut self, tokens: &[u32], decode: impl Fn(&[u32]) -> String) -> bool {
        self.advance(tokens, decode, true)
    }

    fn advance(&mut self, tokens: &[u32], decode: impl Fn(&[u32]) -> String, last: bool) -> bool {
        if self.stopped || tokens.len() <= self.read {
            return self.stopped;
        }
        // Past MAX_PENDING held-back tokens the text is final: waiting on
        // would grow the window (and its cost) with every token.
        let last = last || tokens.len() - self.read > MAX_PENDING;
        let before = decode(&tokens[self.prefix..self.read]);
        let now = decode(&tokens[self.prefix..]);
        if !last && now.ends_with('\u{FFFD}') {
            return false;
        }
        let at = before.len().min(now.len());
        let new = match now.get(at..) {
            Some(new) => new,
            // The decoder rewrote the window's start: wait, unless this is
            // the end, where the new text starts at the next character.
            None if !last => return false,
            None => {
                let at = (at..now.len())
                    .find(|&i| now.is_char_boundary(i))
                    .unwrap_or(now.len());
                &now[at..]
            }
        };
        self.prefix = self.read;
        self.read = tokens.len();
        self.append(new)
    }

    fn append(&mut self, new: &str) -> bool {
        // A match not found before must end in `new`, so it starts at most
        // `longest - 1` bytes before it, and never before `emitted`.
        let mut from = self
            .text
            .len()
            .saturating_sub(self.longest.saturating_sub(1))
            .max(self.emitted);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(new);
        self.decoded += new.len();
        let hit = self
            .stop
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()))
            .min();
        if let Some(at) = hit {
            self.text.truncate(from + at);
            self.stopped = true;
        }
        self.stopped
    }

    /// Text that can go out now: everything new, less a tail that might
    /// start a stop string (unless the stream has `finished`).
    pub(crate) fn take_delta(&mut self, finished: bool) -> String {
        let mut end = self.text.len();
        if !finished && !self.stopped {
            for s in &self.stop {
                // The longest proper prefix of `s` that `text` ends with.
                let tail = (1..s.len())
                    .rev()
                    .find(|&k| s.is_char_boundary(k) && self.text.ends_with(&s[..k]));
                if let Some(k) = tail {
                    end = end.min(self.text.len() - k);
                }
            }
        }
        if end <= self.emitted {
            return String::new();
        }
        let delta = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        delta
    }
}

#[cfg(test)]
#[path = "text_tests.rs"]
mod tests;
