//! Several samples of one prompt (OpenAI's `n`) that share its pages. The
//! first sample runs at once; the others wait until its prompt has been
//! computed and named in the tenant's prefix cache, then join: every full
//! page of the prompt is a cache hit they share (reference counted, never
//! written again), and only the last, partial page is computed again for
//! each, which is the copy of that page each sample writes its own tokens
//! into. Each sample draws from its own seeded stream.

use super::prefix::{self, Salt};
use super::request::Request;
use super::{Engine, GenerateParams, PAGE_SIZE, SeqId, TenantId};

/// Most samples one prompt may ask for.
pub const MAX_SAMPLES: usize = 16;

/// Samples waiting for their first sample's prompt.
pub(super) struct Waiting {
    /// The first sample.
    leader: SeqId,
    tenant: TenantId,
    /// The others, in order, with their ids already given out.
    rest: Vec<(SeqId, Request)>,
    /// The first sample finished after computing the prompt (its first
    /// token its last): every other may go.
    computed: bool,
}

impl Waiting {
    /// Whether these samples wait on `seq`'s prompt.
    pub(super) fn waits_on(&self, seq: SeqId) -> bool {
        self.leader == seq
    }
}

impl Engine {
    /// Queues `n` (1 to [`MAX_SAMPLES`]) samples of `prompt` for `tenant`,
    /// salted as [`Engine::add_salted`], sharing the prompt's pages; their
    /// ids in order. Sample `i` draws with seed `seed + i` (each its own
    /// random seed when `params` has none), so sample 0 is what one request
    /// with `params` gives. With `format`, `params`' output format compiled
    /// by the caller ([`super::Formats::compile`]), so no compile holds up
    /// the engine's thread.
    pub fn admit(
        &mut self,
        tenant: TenantId,
        salt: Salt,
        prompt: Vec<u32>,
        params: GenerateParams,
        n: usize,
        format: Option<super::CompiledFormat>,
    ) -> Result<Vec<SeqId>, String> {
        if !(1..=MAX_SAMPLES).contains(&n) {
            return Err(format!(
                "{n} samples of one prompt: ask for 1 to {MAX_SAMPLES}"
            ));
        }
        let compiled = format.map(|f| f.0);
        if n == 1 {
            return Ok(vec![self.add_request(
                tenant,
                Some(salt),
                prompt,
                params,
                compiled,
            )?]);
        }
        let leader =
            self.add_request(tenant, Some(salt), prompt.clone(), params.clone(), compiled)?;
        // Every sample starts its output format where the first does.
        let matcher = self.requests[&leader].matcher.as_ref();
        let matcher = matcher.map(llguidance::Matcher::deep_clone);
        let mut ids = vec![leader];
        let mut rest = Vec::with_capacity(n - 1);
        for i in 1..n as u64 {
            let id = self.next_id;
            self.next_id += 1;
            let p = GenerateParams {
                seed: params.seed.map(|s| s.wrapping_add(i)),
                ..params.clone()
            };
            let mut request = Request::new(prompt.clone(), p);
            request.matcher = matcher.as_ref().map(llguidance::Matcher::deep_clone);
            prefix::extend_hashes(&mut request.hashes, &salt, &request.tokens, PAGE_SIZE);
            request.salt = Some(salt);
            rest.push((id, request));
            ids.push(id);
        }
        if !rest.is_empty() {
            self.waiting.push(Waiting {
                leader,
                tenant,
                rest,
                computed: false,
            });
        }
        Ok(ids)
    }

    /// Queues the samples whose first sample has computed its prompt (or
    /// finished after it). When the first has gone before that
    /// (cancelled), the next one takes its place and the rest wait for it
    /// instead.
    pub(super) fn release_waiting(&mut self) {
        let mut still = Vec::new();
        for mut w in std::mem::take(&mut self.waiting) {
            let release = match self.requests.get(&w.leader) {
                Some(r) if r.tokens.len() > r.prompt_len => std::mem::take(&mut w.rest),
                Some(_) => Vec::new(),
                None if w.computed => std::mem::take(&mut w.rest),
                None => {
                    let next = w.rest.remove(0);
                    w.leader = next.0;
                    vec![next]
                }
            };
            for (id, request) in release {
                self.lanes
                    .add(id, w.tenant, request.prompt_len, request.hashes.clone());
                self.requests.insert(id, request);
            }
            if !w.rest.is_empty() {
                still.push(w);
            }
        }
        self.waiting = still;
    }

    /// Notes that `seq` finished after computing its prompt: samples that
    /// wait on it all go at the next step (the prompt's pages stay cached),
    /// not one at a time.
    pub(super) fn prompt_computed(&mut self, seq: SeqId) {
        for w in self.waiting.iter_mut().filter(|w| w.leader == seq) {
            w.computed = true;
        }
    }

    /// Drops a sample still waiting; whether `seq` was one.
    pub(super) fn cancel_waiting(&mut self, seq: SeqId) -> bool {
        let mut found = false;
        for w in &mut self.waiting {
            let before = w.rest.len();
            w.rest.retain(|(id, _)| *id != seq);
            found |= w.rest.len() < before;
        }
        self.waiting.retain(|w| !w.rest.is_empty());
        found
    }
}
