use super::*;
use proptest::prelude::*;

/// A toy byte-level vocabulary: token `i` is `VOCAB[i]`'s bytes, pieces of
/// multibyte characters and invalid bytes among them.
const VOCAB: &[&[u8]] = &[
    b"a",
    b"b",
    b"c",
    b" ",
    b"ab",
    b"END",
    b"\n",
    "é".as_bytes(),
    &[0xC3],       // first half of é
    &[0xA9],       // second half of é
    &[0xE2, 0x82], // first two bytes of €
    &[0xAC],       // last byte of €
    &[0xF0, 0x9F], // first half of 😀
    &[0x98, 0x80], // second half of 😀
    "€".as_bytes(),
    &[0xFF], // never valid
    &[0x80], // a stray continuation byte
    "x€y".as_bytes(),
];

fn bytes_of(tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .flat_map(|&t| VOCAB[t as usize].iter().copied())
        .collect()
}

/// Byte-level decoding, as a GPT-2 style tokenizer does it; with `strip`,
/// also drops one leading space, as SentencePiece decoders do at a text's
/// start (which is why windows keep earlier tokens as context).
fn decoder(strip: bool) -> impl Fn(&[u32]) -> String {
    move |tokens: &[u32]| {
        let s = String::from_utf8_lossy(&bytes_of(tokens)).into_owned();
        match s.strip_prefix(' ') {
            Some(rest) if strip => rest.to_owned(),
            _ => s,
        }
    }
}

/// Streams `tokens` one at a time as the engine does; returns the text
/// handed out, whether a stop string ended it and how many tokens it took.
fn stream(tokens: &[u32], stop: &[String], strip: bool) -> (String, bool, usize) {
    let decode = decoder(strip);
    let mut s = TextStream::new(stop);
    let mut out = String::new();
    for i in 1..=tokens.len() {
        let stopped = s.push(&tokens[..i], &decode);
        if stopped {
            out += &s.take_delta(true);
            assert_eq!(s.text(), out, "everything final went out");
            return (out, true, i);
        }
        out += &s.take_delta(false);
        assert!(
            !out.ends_with('\u{FFFD}') || decode(&tokens[..i]).contains('\u{FFFD}'),
            "a replacement character went out for a character that may complete"
        );
    }
    let stopped = s.flush(tokens, &decode);
    out += &s.take_delta(true);
    (out, stopped, tokens.len())
}

fn stops() -> impl Strategy<Value = Vec<String>> {
    let piece = prop::sample::select(vec![
        "a", "b", "ab", "ba", "END", "é", "€", "😀", "\u{FFFD}", " ", "\n", "x€", "€y", "bé",
    ]);
    prop::collection::vec(prop::collection::vec(piece, 0..4), 0..4)
        .prop_map(|v| v.into_iter().map(|p| p.concat()).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::fuzz_cases(2000)))]

    /// Against the plain reference (decode everything at once): the text
    /// streamed out is the reference's prefix, ends exactly where a stop
    /// string starts (or is all of it), holds no stop string, and stopped
    /// no later than the first token whose text completed one.
    #[test]
    fn streamed_text_is_the_reference_cut_at_the_first_stop_string(
        tokens in prop::collection::vec(0..VOCAB.len() as u32, 0..40),
        stop in stops(),
        strip in any::<bool>(),
    ) {
        let decode = decoder(strip);
        let (out, stopped, used) = stream(&tokens, &stop, strip);
        let reference = decode(&tokens);
        let live: Vec<&String> = stop.iter().filter(|s| !s.is_empty()).collect();
        prop_assert!(reference.starts_with(&out), "{out:?} is not a prefix of {reference:?}");
        for s in &live {
            prop_assert!(!out.contains(s.as_str()), "{out:?} holds stop {s:?}");
        }
        let rest = &reference[out.len()..];
        if stopped {
            prop_assert!(live.iter().any(|s| rest.starts_with(s.as_str())), "cut at {rest:?}");
            // The text final before the last token (that of the longest
            // run of tokens whose text does not end in U+FFFD, which may
            // still complete) held no stop string.
            let settled = (0..used)
                .rev()
                .map(|j| decode(&tokens[..j]))
                .find(|t| !t.ends_with('\u{FFFD}'))
                .unwrap_or_default();
            prop_assert!(!live.iter().any(|s| settled.contains(s.as_str())), "stopped late");
        } else {
            prop_assert_eq!(&out, &reference);
        }
    }
}

fn bytes_decode(tokens: &[u32]) -> String {
    String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned()
}

/// Feeds `bytes` one byte a token; returns each push's delta.
fn deltas(bytes: &[u8], stop: &[&str]) -> Vec<String> {
    let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
    let tokens: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
    let mut s = TextStream::new(&stop);
    let mut out = Vec::new();
    for i in 1..=tokens.len() {
        let stopped = s.push(&tokens[..i], bytes_decode);
        out.push(s.take_delta(stopped));
        if stopped {
            break;
        }
    }
    out
}

#[test]
fn a_character_split_over_tokens_goes_out_whole() {
    assert_eq!(deltas("é!".as_bytes(), &[]), ["", "é", "!"]);
}

#[test]
fn text_that_may_start_a_stop_string_is_held_until_settled() {
    assert_eq!(
        deltas(b"hello ENx", &["END"]),
        ["h", "e", "l", "l", "o", " ", "", "", "ENx"]
    );
    assert_eq!(deltas(b"hi END", &["END"]), ["h", "i", " ", "", "", ""]);
}

#[test]
fn a_multibyte_stop_prefix_after_an_incomplete_character_does_not_split_it() {
    // The text `xxAé` then half of a character, with a stop string whose
    // first three characters end the text: the held-back tail must start
    // on a character boundary.
    let mut bytes = b"xxA".to_vec();
    bytes.extend("é".as_bytes());
    bytes.push(0xE2);
    let out: String = deltas(&bytes, &["xAéq"]).concat();
    assert_eq!(out, "x");
}

#[test]
fn the_earliest_stop_string_wins_and_empty_ones_are_ignored() {
    let out: String = deltas(b"abcdef", &["", "de", "cd"]).concat();
    assert_eq!(out, "ab");
}

#[test]
fn a_long_run_of_invalid_bytes_costs_each_token_a_bounded_window() {
    use std::cell::Cell;
    let decoded = Cell::new(0usize);
    let decode = |tokens: &[u32]| {
        decoded.set(decoded.get() + tokens.len());
        bytes_decode(tokens)
    };
    let n = 2000;
    let tokens = vec![0xFF_u32; n];
    let mut s = TextStream::new(&[]);
    let mut out = String::new();
    for i in 1..=n {
        assert!(!s.push(&tokens[..i], decode));
        out += &s.take_delta(false);
    }
    // Each push decodes two windows of at most MAX_PENDING + 1 tokens
    // past the last text taken as final.
    assert!(
        decoded.get() <= n * 2 * (2 * MAX_PENDING + 2),
        "{} tokens decoded",
        decoded.get()
    );
    // The text went out as it came, not all at the end.
    assert!(out.chars().count() >= n - MAX_PENDING - 1, "{}", out.len());
    assert!(out.chars().all(|c| c == '\u{FFFD}'));
    s.flush(&tokens, decode);
    out += &s.take_delta(true);
    assert_eq!(out, bytes_decode(&tokens));
}
