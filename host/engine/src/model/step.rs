//! The step contract: the only types that cross between the engine and a
//! model. The engine's scheduler says what to compute ([`Step`]: which
//! sequences, which tokens, over which pages, with which expected page
//! tags); the model answers with a [`StepOut`] (tokens or logits, and the
//! sequences whose pages failed the tag check).

use kiln_kernels::sample::SamplingParams;

/// One step's work: every sequence's part, and the page tags to check.
#[derive(Debug, Clone, Default)]
pub struct Step<'a> {
    /// The sequences, in batch order.
    pub seqs: Vec<StepSeq<'a>>,
    /// The page tags a device checks before it reads a page.
    pub tags: StepTags<'a>,
}

/// One sequence's part of a step: tokens to feed at positions
/// `start..start + tokens.len()`, its block table, and whether the result
/// of its last token is wanted.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// New tokens.
    pub tokens: &'a [u32],
    /// Position of the first new token.
    pub start: usize,
    /// Page ids covering positions `0..start + tokens.len()`.
    pub pages: &'a [u32],
    /// Whether to return a result for the last token.
    pub logits: bool,
    /// Whether to write the new tokens' K and V; false when the pages
    /// already hold them (a prefix-cache hit recomputed for its logits).
    pub write_kv: bool,
    /// How its next token is chosen, as far as a device may choose it.
    pub draw: Draw,
    /// With a device draw: the tokens its output format allows (bit
    /// `v % 32` of word `v / 32` for token `v`), taken out of the logits
    /// before the draw.
    pub mask: Option<&'a [u32]>,
    /// With a device draw: return the drawn token's log-probability and
    /// this many of the most likely tokens' ([`SeqOut::Scored`]).
    pub scores: Option<usize>,
}

/// How a sequence's next token is chosen, as far as a device may do it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Draw {
    /// The logits go back to the host (teacher forcing, host sampling).
    Logits,
    /// The argmax: a device may return it instead of the logits.
    Greedy,
    /// Temperature / top-k / top-p sampling with this uniform draw, made by
    /// the host from the request's seeded generator: a device may sample.
    Sample {
        /// The sampling parameters.
        params: SamplingParams,
        /// The draw in `[0, 1)`.
        uniform: f32,
    },
}

/// Page tags for one step, each tag as (generation, tenant). Empty when
/// the check runs on the host (the CPU) or is off.
#[derive(Debug, Default, Clone, Copy)]
pub struct StepTags<'a> {
    /// The tag each block-table entry expects, sequences in batch order.
    pub expected: &'a [[u64; 2]],
    /// Pages given new tags since the last step.
    pub changes: &'a [(u32, [u64; 2])],
}

/// One sequence's result.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqOut {
    /// Its logits, to sample from.
    Logits(Vec<f32>),
    /// Its token, chosen on the device.
    Token(u32),
    /// Its token, chosen on the device, with log-probabilities under the
    /// model's logits (before any mask), as the step asked
    /// ([`StepSeq::scores`]).
    Scored {
        /// The token.
        token: u32,
        /// Its log-probability.
        logprob: f32,
        /// The most likely tokens and theirs, most likely first.
        top: Vec<(u32, f32)>,
    },
}

/// What a step returns.
#[derive(Debug, Clone, Default)]
pub struct StepOut {
    /// One result per sequence that asked for one, in batch order.
    pub rows: Vec<SeqOut>,
    /// Per sequence of the batch: whether its pages passed the tag check.
    pub ok: Vec<bool>,
    /// How long the host waited on the device: on a GPU the inputs'
    /// upload, the kernels and the results' download; on the CPU the
    /// whole forward pass.
    pub device: std::time::Duration,
}

/// Which of a runner's two lanes a step runs on. Each has its own stream,
/// working buffers, captured graphs and copy of the page tags, over the
/// same weights and pages, so a step on one can be in flight while steps
/// run on the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunLane {
    /// Every step without disaggregation; the decode lane's with it.
    Main,
    /// The prefill lane's steps, with disaggregation.
    Side,
}

impl RunLane {
    /// Its index among a runner's per-lane state.
    pub fn index(self) -> usize {
        self as usize
    }
}
