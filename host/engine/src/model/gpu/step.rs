//! One forward step on the GPU. Everything the step needs from the host
//! (token ids, positions, block tables, KV slots, expected page tags, tag
//! changes) goes up in one copy; what comes back is one small copy (each
//! sequence's tag-check flag and the greedy tokens), plus the logits rows
//! when some sequence samples from them.
//!
//! The page-tag check is a kernel at the head of the step: a sequence whose
//! pages no longer carry the tags it recorded gets its attention lengths
//! and KV slots cleared on the device, so the rest of the step neither
//! reads nor writes its pages, and its flag tells the engine to abort it.
//!
//! With CUDA graphs on, a small greedy decode step is captured once per
//! (sequences, attention partitions, check) and replayed: its inputs sit at
//! offsets fixed by those three, in buffers that live as long as the graph.

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{PARTITION, prefill_supports, prefill_tiles};

use kiln_kernels::cuda::Gpu;

use super::inputs::{GRAPH_MAX_SEQS, Inputs, Layout, graph_bucket};
use super::lane::{Flight, GraphKey, LaneKv, Running};
use super::ops::{CudaStep, Shape};
use super::{GpuKv, GpuModel, Need, Work};
use crate::model::step::{Draw, RunLane, SeqOut, Step, StepOut, StepTags};

type R<T> = Result<T, KernelError>;

/// Captured steps kept per engine.
const MAX_GRAPHS: usize = 128;

impl GpuModel {
    /// The key to capture this step under, when it can be one: a greedy
    /// decode of at most [`GRAPH_MAX_SEQS`] sequences, with room for its
    /// tag changes.
    fn graph_key(
        &self,
        x: &Inputs,
        tags: &StepTags<'_>,
        max_len: usize,
        page_size: usize,
    ) -> Option<GraphKey> {
        let n = x.ids.len();
        let parts = max_len.div_ceil(PARTITION);
        // The tables must fit the room the key's lengths give them (a
        // table holding pages past its length takes the eager path).
        let room = n * (parts * PARTITION).div_ceil(page_size);
        (self.graphs
            && x.greedy_decode
            && n <= GRAPH_MAX_SEQS
            && tags.changes.len() <= n
            && x.tables.len() <= room)
            .then_some(GraphKey {
                seqs: n,
                parts,
                check: !tags.expected.is_empty(),
                mask_words: if x.masked() { x.mask_words } else { 0 },
            })
    }

    /// One step on `lane`, launched and finished: checks page tags, writes
    /// the new tokens' K and V into their pages and returns each result the
    /// batch asked for.
    pub fn forward(&self, kv: &mut GpuKv, lane: RunLane, step: &Step<'_>) -> R<StepOut> {
        self.launch(kv, lane, step)?;
        self.finish(kv, lane)
    }

    /// Queues a step on `lane` ([`Self::finish`] returns its results);
    /// fails if the lane has a step in flight.
    pub fn launch(&self, kv: &mut GpuKv, lane: RunLane, step: &Step<'_>) -> R<()> {
        if kv.lanes[lane.index()].flight.is_some() {
            return Err(KernelError::Shape(format!(
                "a step is already in flight on the {lane:?} lane"
            )));
        }
        let flight = self.queue(kv, lane, step)?;
        kv.lanes[lane.index()].flight = Some(flight);
        Ok(())
    }

    /// The results of `lane`'s launched step, waiting for it if it still
    /// runs.
    pub fn finish(&self, kv: &mut GpuKv, lane: RunLane) -> R<StepOut> {
        let g = self.lane_gpu(lane);
        let l = &mut kv.lanes[lane.index()];
        match l.flight.take() {
            None => Err(KernelError::Shape(format!(
                "no step in flight on the {lane:?} lane"
            ))),
            Some(Flight::Ready(out)) => Ok(out),
            Some(Flight::Running(r)) => {
                let Some(w) = l.work.as_ref() else {
                    return Err(KernelError::Shape(
                        "a step in flight without buffers".into(),
                    ));
                };
                self.download(g, w, r)
            }
        }
    }

    /// Queues a step's upload and kernels on `lane`.
    fn queue(&self, kv: &mut GpuKv, lane: RunLane, step: &Step<'_>) -> R<Flight> {
        let (batch, tags) = (&step.seqs[..], step.tags);
        let ps = kv.page_size;
        let mut x = Inputs::gather(batch, ps, self.config.vocab)?;
        let (real_seqs, real_m) = (batch.len(), x.wanted.len());
        if self.graphs && x.greedy_decode {
            x.pad_decode(graph_bucket(x.ids.len()));
        }
        let (n, seqs, m) = (x.ids.len(), x.seq_tab.len() - 1, x.wanted.len());
        let check = !tags.expected.is_empty();
        if check && tags.expected.len() != x.tables.len() {
            return Err(KernelError::Shape(format!(
                "{} expected tags for {} block-table entries",
                tags.expected.len(),
                x.tables.len()
            )));
        }
        if n == 0 {
            return Ok(Flight::Ready(StepOut {
                rows: Vec::new(),
                ok: vec![true; seqs],
                device: Default::default(),
            }));
        }
        let mut max_len = x.lens.iter().copied().max().unwrap_or(1) as usize;
        let key = self.graph_key(&x, &tags, max_len, ps);
        let (change_cap, table_cap) = match key {
            Some(k) => {
                // Room for the longest tables the key's lengths allow.
                max_len = k.parts * PARTITION;
                (n, n * max_len.div_ceil(ps))
            }
            None => (tags.changes.len(), x.tables.len()),
        };
        // Tensor-core prefill attention when the step has a chunk of
        // several tokens (never a captured step: those decode one token a
        // sequence). The step's leading decodes still run the decode
        // kernel, which splits each sequence over the whole GPU; as tiles
        // of one token, a block would stream a whole sequence for one warp.
        let c = &self.config;
        let (mut decodes, mut decode_len) = (0, 0);
        let tiles =
            if kv.tensor_prefill && n > seqs && prefill_supports(c.heads, c.kv_heads, c.head_dim) {
                (decodes, decode_len) = x.leading_single_rows();
                let offs: Vec<i32> = x.offs[decodes..].iter().map(|o| *o as i32).collect();
                let lens: Vec<i32> = x.lens[decodes..].iter().map(|l| *l as i32).collect();
                let mut tiles = prefill_tiles(
                    &offs,
                    &lens,
                    self.config.heads / self.config.kv_heads.max(1),
                    self.lane_gpu(lane).prefill_rows(),
                );
                // Token indices of the whole step.
                tiles
                    .iter_mut()
                    .step_by(2)
                    .for_each(|t| *t += decodes as i32);
                tiles
            } else {
                Vec::new()
            };
        // A masked step has room for every result's mask, so a captured
        // one keeps its layout whichever rows are masked.
        let mask_cap = if x.masked() { m * x.mask_words } else { 0 };
        let l = Layout::new(
            n,
            seqs,
            m,
            (change_cap, table_cap),
            tiles.len() / 2,
            mask_cap,
        );
        let words = l.words(&x, &tags, &tiles);
        let g = self.lane_gpu(lane);
        let lk = &mut kv.lanes[lane.index()];
        let need = Need {
            tokens: n,
            rows: seqs,
            attend: if tiles.is_empty() {
                (n, max_len)
            } else {
                (decodes, decode_len)
            },
            words: l.total,
        };
        let mut work = self.work(g, &mut lk.work, need)?;
        let scored = x.score_slot.iter().filter(|s| **s >= 0).count();
        let want = scored * (2 + 2 * x.score_top);
        if want > 0 && work.b.scores.as_ref().is_none_or(|s| s.len() < want) {
            work.b.scores = Some(g.zeros(want.next_power_of_two())?);
        }
        if std::mem::take(&mut work.fresh) {
            // Captured steps point into the buffers just replaced.
            lk.graphs.clear();
            lk.made += 1;
        }
        let shape = Shape {
            l: &l,
            n,
            seqs,
            m,
            max_len,
            check,
            sample: x.draws.iter().any(|d| matches!(d, Draw::Sample { .. })),
            mask_words: if x.masked() { x.mask_words } else { 0 },
            score_top: x.score_top,
            tiles: tiles.len() / 2,
            decodes,
            decode_len,
        };
        let start = std::time::Instant::now();
        let result = self.run(lane, kv, &mut work, (&words, &x.masks), &shape, key);
        kv.lanes[lane.index()].work = Some(work);
        result?;
        Ok(Flight::Running(Running {
            seqs,
            m,
            real_seqs,
            real_m,
            check,
            draws: x.draws,
            scores: (x.score_slot, x.score_top),
            start,
            // With two lanes the engine works on one while the other's
            // step runs, so each step's end is marked.
            mark: self.side.is_some().then(|| g.mark()).transpose()?,
        }))
    }

    /// Uploads the inputs and queues (or replays) the step's kernels.
    fn run(
        &self,
        lane: RunLane,
        kv: &mut GpuKv,
        w: &mut Work,
        (words, masks): (&[u32], &[u32]),
        s: &Shape<'_>,
        key: Option<GraphKey>,
    ) -> R<()> {
        let g = self.lane_gpu(lane);
        g.upload_into(words, &mut w.inputs)?;
        if !masks.is_empty() {
            g.upload_at(masks, &mut w.inputs, s.l.masks)?;
        }
        let GpuKv { layers, lanes, .. } = kv;
        let lk = &mut lanes[lane.index()];
        // A shape is captured the second time it comes: one seen once (a
        // batch size passed through while sequences join or finish) would
        // pay for a capture it never replays.
        let key = key.filter(|k| lk.graphs.contains_key(k) || !lk.seen.insert(*k));
        match key {
            Some(k) => {
                if !lk.graphs.contains_key(&k) {
                    if lk.graphs.len() >= MAX_GRAPHS {
                        // Old shapes (shorter contexts, other batch sizes)
                        // are unlikely to come back.
                        lk.graphs.clear();
                        lk.seen.clear();
                    }
                    let graph = g.capture(|| self.kernels(g, layers, lk, w, s))?;
                    lk.graphs.insert(k, graph);
                }
                self.agree()?;
                g.replay(&lk.graphs[&k])?;
            }
            None => {
                self.agree()?;
                self.kernels(g, layers, lk, w, s)?
            }
        }
        Ok(())
    }

    /// As a rank: run nothing that waits on the other ranks unless every
    /// one got this far (a capture only records, so it comes before).
    fn agree(&self) -> R<()> {
        self.sum.as_ref().map_or(Ok(()), |sum| sum.agree())
    }

    /// A queued step's results: its flags and tokens (and logits rows when
    /// asked for) downloaded, which waits for its kernels.
    fn download(&self, g: &Gpu, w: &Work, r: Running) -> R<StepOut> {
        let c = &self.config;
        let Running {
            seqs,
            m,
            real_seqs,
            real_m,
            check,
            draws,
            scores: (score_slot, top),
            start,
            ..
        } = r;
        let small = g.download_range(&w.b.small, 0..seqs + m)?;
        let device = start.elapsed();
        let ok: Vec<bool> = if check {
            small[..seqs].iter().map(|f| *f == 1).collect()
        } else {
            vec![true; seqs]
        };
        // Only the rows drawn on the host come down: one copy for all
        // when most are, else a copy each.
        let wanted = draws.iter().filter(|d| **d == Draw::Logits).count();
        let all = if wanted * 2 > m {
            g.download_range(&w.b.logits, 0..m * c.vocab)?
        } else {
            Vec::new()
        };
        let v = c.vocab;
        let rows = (draws.iter().enumerate())
            .map(|(i, d)| match d {
                Draw::Logits if all.is_empty() => g
                    .download_range(&w.b.logits, i * v..(i + 1) * v)
                    .map(SeqOut::Logits),
                Draw::Logits => Ok(SeqOut::Logits(all[i * v..(i + 1) * v].to_vec())),
                Draw::Greedy | Draw::Sample { .. } => Ok(SeqOut::Token(small[seqs + i])),
            })
            .collect::<R<Vec<_>>>()?;
        let rows = scored(g, w, rows, &score_slot, top)?;
        // The padding's flags and tokens are nobody's.
        let mut out = StepOut { rows, ok, device };
        out.ok.truncate(real_seqs);
        out.rows.truncate(real_m);
        Ok(out)
    }

    /// Every launch of a step, reading its inputs from `w.inputs`: the tag
    /// scatter and check, then the architecture's forward pass. Launches
    /// only (no copy, allocation or wait), so it can be captured.
    fn kernels(
        &self,
        g: &Gpu,
        layers: &mut [kiln_kernels::cuda::PagedKv],
        lk: &mut LaneKv,
        w: &mut Work,
        s: &Shape<'_>,
    ) -> R<()> {
        let (l, seqs) = (s.l, s.seqs);
        g.tag_scatter(&w.inputs, l.changes, l.change_cap, &mut lk.tags)?;
        if s.check {
            g.tag_check(
                &mut w.inputs,
                &l.tags(true),
                &lk.tags,
                &mut w.b.small.slice_mut(..seqs),
                seqs,
            )?;
        }
        let mut ops = CudaStep::new(self, g, layers, w, s);
        self.config.arch.forward(&mut ops, &self.weights)
    }
}

/// `rows` with the log-probabilities the device computed for those that
/// asked (slot `score_slot[i]` of `w`'s scores, `top` tokens each).
fn scored(g: &Gpu, w: &Work, rows: Vec<SeqOut>, score_slot: &[i32], top: usize) -> R<Vec<SeqOut>> {
    let Some(scores) = w.b.scores.as_ref().filter(|_| top > 0) else {
        return Ok(rows);
    };
    let stride = 2 + 2 * top;
    let slots = score_slot.iter().filter(|s| **s >= 0).count();
    let got = g.download_range(scores, 0..slots * stride)?;
    Ok((rows.into_iter().zip(score_slot))
        .map(|(row, slot)| match (row, usize::try_from(*slot)) {
            (SeqOut::Token(token), Ok(s)) => {
                let o = &got[s * stride..(s + 1) * stride];
                SeqOut::Scored {
                    token,
                    logprob: o[1],
                    top: (0..top)
                        .map(|k| (o[2 + 2 * k].to_bits(), o[3 + 2 * k]))
                        .collect(),
                }
            }
            (row, _) => row,
        })
        .collect())
}
