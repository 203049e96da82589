//! One engine step in four parts: plan (the scheduler's batch, the host's
//! tag check), build (the model's [`Step`]), run (the runner), apply (the
//! model's output to the requests).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use kiln_kernels::sample::sample;
use rand::Rng;

use super::block_pool::PageTag;
use super::kv_manager::{KvCacheManager, SeqId};
use super::lanes::Lane;
use super::request::{Logprob, Request, TokenLogprobs};
use super::scheduler::{Scheduled, StepCaps};
use super::{Engine, Event, Finish, PAGE_SIZE};
use crate::model::Tokenizer;
use crate::model::step::{Draw, RunLane, SeqOut, Step, StepOut, StepSeq, StepTags};

#[cfg(any(test, feature = "fault-injection"))]
use super::Fault;

/// A page tag as the device stores it: (generation, tenant).
pub(super) fn tag_words(t: &PageTag) -> [u64; 2] {
    [t.generation, t.tenant.0 as u64]
}

/// The device's part of the page-tag check for one step.
struct DeviceTags {
    expected: Vec<[u64; 2]>,
    changes: Vec<(u32, [u64; 2])>,
}

impl Engine {
    /// Runs one step: plan, build, run, apply; disaggregated, the two
    /// lanes' steps overlap (`overlap.rs`).
    pub fn step(&mut self) -> Result<Vec<Event>, String> {
        let start = Instant::now();
        // Set again if the main lane runs a step now.
        self.stats.last_step_device_us = 0;
        let mut events = Vec::new();
        self.release_waiting();
        let now = self.lanes.contention();
        let guarding = self.step_budget.guards(now);
        if self.lanes.disaggregated() {
            let caps = self.step_budget.caps_apart(now);
            // Decodes go first on the device while the target guards
            // streams; a lone tenant's prompts and streams share it.
            self.overlapped_step((caps, guarding), &mut events)?;
        } else {
            let caps = self.step_budget.caps(now);
            self.lane_step(Lane::Prefill, RunLane::Main, caps, &mut events)?;
        }
        // Timed whole: the streams wait for the host's part too.
        let ms = start.elapsed().as_secs_f64() * 1e3;
        self.step_budget.close(ms, guarding);
        Ok(events)
    }

    /// One scheduler's step within the engine's `caps` on runner lane
    /// `on`, launched and finished.
    pub(super) fn lane_step(
        &mut self,
        lane: Lane,
        on: RunLane,
        caps: StepCaps,
        events: &mut Vec<Event>,
    ) -> Result<(), String> {
        if let Some(run) = self.launch(lane, on, caps, events)? {
            let out = self.runner.finish(on)?;
            self.apply(&run, on, out, events);
        }
        Ok(())
    }

    /// Plans `lane`'s step and launches it on runner lane `on`: the
    /// planned batch (`None` when there is nothing to run).
    pub(super) fn launch(
        &mut self,
        lane: Lane,
        on: RunLane,
        caps: StepCaps,
        events: &mut Vec<Event>,
    ) -> Result<Option<Vec<Scheduled>>, String> {
        let run = self.plan(lane, caps, events)?;
        if run.is_empty() {
            return Ok(None);
        }
        let mut draws = self.draws(&run);
        let masks = self.device_masks(&run, &mut draws);
        let device_check = self.device_checks();
        let mut tags = DeviceTags {
            expected: Vec::new(),
            changes: self.retags_for(on),
        };
        let expected = device_check.then_some(&mut tags.expected);
        let seqs = build(&self.requests, &self.kv, &run, (&draws, &masks), expected);
        let step = Step {
            seqs,
            tags: StepTags {
                expected: &tags.expected,
                changes: &tags.changes,
            },
        };
        self.runner.launch(&self.loaded, on, &step)?;
        self.stats.steps += 1;
        if on == RunLane::Main {
            // Alongside the main lane's device time (`apply`).
            self.stats.last_step_seqs = step.seqs.len();
            self.stats.last_step_tokens = step.seqs.iter().map(|b| b.tokens.len()).sum();
        }
        Ok(Some(run))
    }

    /// The page-tag changes runner lane `on` has not yet been given. Each
    /// lane keeps its own copy of the tags, so each gets every retagged
    /// page once, with its tag as it is now (a page retagged twice since a
    /// lane's last step must not reach it with both tags: the device
    /// writes a step's changes in parallel).
    pub(super) fn retags_for(&mut self, on: RunLane) -> Vec<(u32, [u64; 2])> {
        let fresh = self.kv.take_retagged();
        if !self.lanes.disaggregated() {
            return fresh.iter().map(|(p, t)| (*p, tag_words(t))).collect();
        }
        self.retags.note(fresh.iter().map(|(p, _)| *p));
        let kv = &self.kv;
        self.retags.take(on, |p| tag_words(&kv.page_tag(p)))
    }

    /// Whether the page-tag check runs inside the step, on the device.
    fn device_checks(&self) -> bool {
        self.runner.on_gpu() && self.checker.enabled()
    }

    /// The scheduler's batch, less the sequences the host's tag check
    /// stops (on the CPU; a GPU checks inside the step).
    fn plan(
        &mut self,
        lane: Lane,
        caps: StepCaps,
        events: &mut Vec<Event>,
    ) -> Result<Vec<Scheduled>, String> {
        self.stepping.clear();
        let plan = self.lanes.schedule(lane, &mut self.kv, caps);
        self.stepping.extend(plan.scheduled.iter().map(|s| s.seq));
        #[cfg(any(test, feature = "fault-injection"))]
        if !self.stepping.is_empty() {
            match self.fault_next_step.take() {
                Some(Fault::Panic) => panic!("injected engine fault"),
                Some(Fault::Error) => return Err("injected device error".into()),
                None => {}
            }
        }
        // A device fault may surface in any lane's step: a step beside the
        // one in flight concerns that one's sequences too.
        if let Some(run) = &self.in_flight {
            self.stepping.extend(run.iter().map(|s| s.seq));
        }
        self.stepping.extend_from_slice(&self.decoding);
        self.stats.preemptions += plan.preempted.len() as u64;
        for (seq, hit) in &plan.prefix_hits {
            if let Some(r) = self.requests.get_mut(seq) {
                // The first admission counts; a readmission after
                // preemption finds its own pages, which is no saving.
                r.cached_tokens.get_or_insert(*hit);
            }
        }
        if plan.scheduled.is_empty() || self.device_checks() {
            return Ok(plan.scheduled);
        }
        let ids: Vec<_> = plan.scheduled.iter().map(|s| s.seq).collect();
        let ok = self.kv.check(&ids, self.checker.as_ref());
        let mut run = Vec::with_capacity(ids.len());
        for (sch, ok) in plan.scheduled.into_iter().zip(ok) {
            if ok {
                run.push(sch);
            } else {
                self.integrity_abort(sch.seq, events);
            }
        }
        Ok(run)
    }

    /// How each sequence's next token is chosen. A device samples with the
    /// request's own next draw, so its generator advances as on the host.
    /// A device draws within an output format's mask ([`Self::device_masks`]).
    fn draws(&mut self, run: &[Scheduled]) -> Vec<Draw> {
        let gpu = self.runner.on_gpu();
        let device_draws = gpu && self.device_sampling;
        run.iter()
            .map(|s| match self.requests.get_mut(&s.seq) {
                // On the CPU, log-probabilities and output formats take the
                // logits, on the host; a device computes both.
                Some(r) if !gpu && (r.params.logprobs.is_some() || r.matcher.is_some()) => {
                    Draw::Logits
                }
                Some(r) if s.sample && r.sampling().is_greedy() => Draw::Greedy,
                Some(r) if s.sample && device_draws => Draw::Sample {
                    params: r.sampling(),
                    uniform: r.rng.random::<f32>(),
                },
                _ => Draw::Logits,
            })
            .collect()
    }

    /// The masks of the rows a device draws within an output format,
    /// computed in parallel (one per row, `None` for the rest). A row
    /// whose mask cannot be computed takes the logits instead, so the host
    /// reports why.
    fn device_masks(&mut self, run: &[Scheduled], draws: &mut [Draw]) -> Vec<Option<Vec<u32>>> {
        use rayon::prelude::*;
        let mut masks = vec![None; run.len()];
        // Most steps have no constrained row: nothing more to do.
        let constrained =
            |s: &Scheduled| (self.requests.get(&s.seq)).is_some_and(|r| r.matcher.is_some());
        if !run.iter().any(constrained) {
            return masks;
        }
        let rows: HashMap<SeqId, usize> = (run.iter().enumerate())
            .filter(|(i, s)| s.sample && draws[*i] != Draw::Logits)
            .map(|(i, s)| (s.seq, i))
            .collect();
        let mut jobs: Vec<(usize, &mut llguidance::Matcher)> = (self.requests.iter_mut())
            .filter_map(|(seq, r)| Some((*rows.get(seq)?, r.matcher.as_mut()?)))
            .collect();
        if jobs.is_empty() {
            return masks;
        }
        let vocab = self.loaded.model.config.vocab;
        let done: Vec<(usize, Option<Vec<u32>>)> = jobs
            .par_iter_mut()
            .map(|(i, m)| (*i, super::constraint::mask_words(m, vocab).ok()))
            .collect();
        for (i, mask) in done {
            if mask.is_none() {
                draws[i] = Draw::Logits;
            }
            masks[i] = mask;
        }
        masks
    }

    /// The step's output: aborts for failed tag checks, the prefix cache's
    /// new pages, and each sampled sequence's token, text and end. The
    /// step time model learns from the main lane's steps only (a side
    /// lane's step is timed from launch to finish, other steps between).
    pub(super) fn apply(
        &mut self,
        run: &[Scheduled],
        on: RunLane,
        out: StepOut,
        events: &mut Vec<Event>,
    ) {
        let StepOut { rows, ok, device } = out;
        self.stats.buffers_made = self.runner.buffers_made();
        if on == RunLane::Main {
            self.stats.last_step_device_us = device.as_micros() as u64;
            let decodes = run.iter().filter(|s| s.count == 1).count();
            let prompt: usize = run.iter().filter(|s| s.count > 1).map(|s| s.count).sum();
            let landed_beside = std::mem::take(&mut self.ran_beside);
            let beside =
                (self.lanes.disaggregated()).then_some(self.in_flight.is_some() || landed_beside);
            self.step_budget.carried(decodes, prompt, beside);
        }
        // Sequences the device's check stopped: their results are void.
        let mut failed = HashSet::new();
        for (s, ok) in run.iter().zip(ok) {
            if !ok {
                failed.insert(s.seq);
                self.integrity_abort(s.seq, events);
            }
        }
        // Name the pages this step filled, before any of them is released.
        for s in run.iter().filter(|s| !failed.contains(&s.seq)) {
            if let Some(r) = self.requests.get_mut(&s.seq)
                && let Some(salt) = r.salt
            {
                let computed = s.start + s.count;
                super::prefix::extend_hashes(
                    &mut r.hashes,
                    &salt,
                    &r.tokens[..computed],
                    PAGE_SIZE,
                );
                self.kv.cache_pages(s.seq, &r.hashes, computed);
            }
        }
        let max_len = self.max_len();
        let mut rows = rows.into_iter();
        for s in run.iter().filter(|s| s.sample) {
            let Some(row) = rows.next() else { break };
            if !failed.contains(&s.seq) {
                self.take_token(s.seq, row, max_len, events);
            }
        }
    }

    /// Appends the token `row` gives `seq`, with its text, and ends the
    /// request at EOS, a stop string, its `max_tokens` or `max_len`.
    fn take_token(&mut self, seq: SeqId, row: SeqOut, max_len: usize, events: &mut Vec<Event>) {
        // Sampled, so its prompt is computed: samples waiting for it may
        // start, whether this token ends it (EOS, a format's end) or not.
        self.prompt_computed(seq);
        let Some(r) = self.requests.get_mut(&seq) else {
            return;
        };
        let tokenizer = &self.loaded.tokenizer;
        let picked = match row {
            SeqOut::Logits(mut l) => pick(r, &mut l, tokenizer),
            SeqOut::Token(t) => advance(r, t).map(|()| (t, None)),
            SeqOut::Scored {
                token,
                logprob,
                top,
            } => advance(r, token).map(|()| {
                let n = r.params.logprobs.unwrap_or(0);
                let top = top.into_iter().take(n).collect();
                (token, Some(with_texts(tokenizer, (token, logprob), top)))
            }),
        };
        let (token, logprobs) = match picked {
            Ok(p) => p,
            Err(e) => {
                self.finish(seq, Finish::Aborted(e), events);
                return;
            }
        };
        let decode = |t: &[u32]| tokenizer.decode(t);
        let eos = tokenizer.is_eos(token) && !r.params.ignore_eos;
        let mut finish = None;
        if eos {
            finish = Some(Finish::Stop);
        } else {
            r.tokens.push(token);
            self.lanes.append_token(seq);
            let generated = &r.tokens[r.prompt_len..];
            if r.text.push(generated, decode) {
                finish = Some(Finish::Stop);
            } else if generated.len() >= r.params.max_tokens || r.tokens.len() >= max_len {
                finish = Some(Finish::Length);
            }
        }
        // At the end, text held for an incomplete character is final (and
        // may still complete a stop string).
        if finish.is_some() && r.text.flush(&r.tokens[r.prompt_len..], decode) {
            finish = Some(Finish::Stop);
        }
        let text = r.text.take_delta(finish.is_some());
        // A token's log-probabilities go out with its text: held while the
        // text might begin a stop string, dropped if it did.
        if let Some(lp) = logprobs.filter(|_| !eos) {
            r.held_logprobs.push((r.text.decoded(), lp));
        }
        let out = r.text.emitted();
        let ready = (r.held_logprobs.iter())
            .take_while(|(end, _)| *end <= out)
            .count();
        let logprobs: Vec<_> = r.held_logprobs.drain(..ready).map(|(_, l)| l).collect();
        if !eos || !text.is_empty() || !logprobs.is_empty() {
            events.push(Event::Token {
                seq,
                token: (!eos).then_some(token),
                text,
                logprobs,
            });
        }
        if let Some(f) = finish {
            self.finish(seq, f, events);
        }
    }
}

/// Draws `r`'s next token from `logits` within its output format, if it
/// has one; with the token's log-probabilities if it asked (the model's,
/// before the format's mask).
fn pick(
    r: &mut Request,
    logits: &mut [f32],
    tokenizer: &Tokenizer,
) -> Result<(u32, Option<TokenLogprobs>), String> {
    let raw = r
        .params
        .logprobs
        .filter(|_| r.matcher.is_some())
        .map(|_| logits.to_vec());
    if let Some(m) = &mut r.matcher {
        super::constraint::mask(m, logits)?;
    }
    let token = sample(logits, r.sampling(), &mut r.rng);
    advance(r, token)?;
    let lp = r.params.logprobs.map(|n| {
        let l = raw.as_deref().unwrap_or(logits);
        token_logprobs(l, token, n, tokenizer)
    });
    Ok((token, lp))
}

/// Moves `r`'s output format past `token` (a complete format allows only
/// EOS, which it does not consume).
fn advance(r: &mut Request, token: u32) -> Result<(), String> {
    match r.matcher.as_mut().filter(|m| !m.is_stopped()) {
        Some(m) => m
            .consume_token(token)
            // The token was drawn under the format's own mask: its refusal
            // is the engine's fault, not the request's format.
            .map_err(|e| format!("a token drawn under the output format's mask was refused: {e}")),
        None => Ok(()),
    }
}

/// `token`'s log-probability under `logits` and the `top` most likely
/// tokens', with their texts.
fn token_logprobs(logits: &[f32], token: u32, top: usize, tokenizer: &Tokenizer) -> TokenLogprobs {
    let (lp, best) = kiln_kernels::sample::logprobs(logits, token, top);
    with_texts(tokenizer, (token, lp), best)
}

/// A token's log-probability and the most likely tokens', with their texts
/// and bytes.
fn with_texts(
    tokenizer: &Tokenizer,
    (token, lp): (u32, f32),
    best: Vec<(u32, f32)>,
) -> TokenLogprobs {
    let piece = |id: u32, logprob: f32| Logprob {
        id,
        text: tokenizer.decode(&[id]),
        bytes: tokenizer.token_piece(id),
        logprob,
    };
    TokenLogprobs {
        chosen: piece(token, lp),
        top: best.into_iter().map(|(id, lp)| piece(id, lp)).collect(),
    }
}

/// The model's view of each scheduled sequence; with `expected`, each
/// block-table entry's tag for the device's check.
fn build<'a>(
    requests: &'a HashMap<SeqId, Request>,
    kv: &'a KvCacheManager,
    run: &[Scheduled],
    (draws, masks): (&[Draw], &'a [Option<Vec<u32>>]),
    mut expected: Option<&mut Vec<[u64; 2]>>,
) -> Vec<StepSeq<'a>> {
    run.iter()
        .zip(draws.iter().zip(masks))
        .map(|(s, (draw, mask))| {
            let r = &requests[&s.seq];
            let table = kv.table(s.seq);
            if let (Some(e), Some(t)) = (expected.as_deref_mut(), table) {
                e.extend(t.expected.iter().map(tag_words));
            }
            StepSeq {
                tokens: &r.tokens[s.start..s.start + s.count],
                start: s.start,
                pages: table.map(|t| t.pages.as_slice()).unwrap_or(&[]),
                logits: s.sample,
                write_kv: s.write_kv,
                draw: *draw,
                mask: mask.as_deref(),
                // A device draw returns the figures the request asked for.
                scores: (s.sample && *draw != Draw::Logits)
                    .then_some(r.params.logprobs)
                    .flatten(),
            }
        })
        .collect()
}
