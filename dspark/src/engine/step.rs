//! Continuous batching: the request queue, admission under the KV budgets, preemption, and the
//! target-only round. Every call of [`Engine::step`] admits what fits, then runs one round over
//! every running request; [`Engine::generate`] is a loop of steps.
//!
//! KV accounting. A round adds at most `w` rows to a lane's target cache (`w = 1` target-only,
//! `γ + 1` speculative: the verify window, truncated to the accepted rows afterwards) and at most
//! `w` rows to its draft context. Before every round the engine makes sure the free pages of both
//! pools cover every running lane's worst case, preempting the most recently admitted lanes until
//! they do; a waiting request is admitted only when its prefill and its first round fit next to
//! the running lanes' worst case. A request is refused at submission only when it could not fit
//! even alone: `prompt + max_new_tokens + w − 1` rows in either pool. So a round never runs out
//! of KV, no admitted request is ever lost, and every admission is followed by at least one round
//! of progress for the admitted request (no preemption loop).
//!
//! Preemption frees a lane's KV in both pools and puts the request back at the front of the
//! queue with the tokens generated so far; on resumption the engine prefills
//! `prompt ++ tokens[..n−1]` (with feature capture when speculating) and continues from
//! `tokens[n−1]`. Sampling coins depend only on the request's seed and the position, so a
//! resumed request draws the same coins it would have drawn without the preemption.

use std::collections::HashMap;
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};

use super::core::{
    BatchStats, Engine, FinishReason, Generation, GenerationStats, Live, Request, RequestId, StepEvent,
    StepOutput, TokenEvent, Waiting, read_f32, read_ids,
};
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, PoolState};
use crate::model::{LogitRows, SeqChunk};
use crate::sampling::{SamplingParams, Stream, coin, sample_token};

/// One token per listed logits row, as [`sample_token`] draws it: lane `i` from row `rows[i]`
/// with `params[i]` at absolute position `positions[i]` (greedy: the argmax). Where the kernels
/// run only ids leave the device: the argmax when every lane is greedy, else
/// [`dspark_kernels::chain_accept`] with no drafts (the same rule and coin, with top-k and top-p,
/// up to f64 rounding).
pub(super) fn draw_tokens(
    logits: Tensor<2>,
    rows: &[usize],
    params: &[&SamplingParams],
    positions: &[usize],
) -> Result<Vec<u32>> {
    let [count, vocab] = logits.dims();
    if dspark_kernels::kernels_available(&logits.device()) {
        if params.iter().all(|p| p.is_greedy()) {
            let ids = read_ids(dspark_kernels::argmax_rows(logits))?;
            return Ok(rows.iter().map(|&r| ids[r]).collect());
        }
        use dspark_kernels::accept::{AcceptLane, accept_words, lane_stride};
        let lanes: Vec<AcceptLane> = rows
            .iter()
            .zip(params)
            .zip(positions)
            .map(|((&p_row, p), &position)| AcceptLane {
                p_row,
                q_row: 0,
                drafts: Vec::new(),
                // Temperature 0 makes the row one-hot at its argmax.
                temperature: if p.is_greedy() { 0.0 } else { p.temperature },
                top_k: p.top_k,
                top_p: p.top_p,
                accept_coins: Vec::new(),
                draw_coins: vec![coin(p.seed, Stream::TargetSample, position)],
            })
            .collect();
        // No proposal rows are read without drafts: one target row stands in.
        let q = logits.clone().narrow(0, 0, 1);
        let (row_words, words) = accept_words(&lanes, count, 1, 0);
        let device = logits.device();
        let row_words = Tensor::<1, Int>::from_data(TensorData::new(row_words, [3 * (count + 1)]), &device);
        let words =
            Tensor::<2, Int>::from_data(TensorData::new(words, [lanes.len(), lane_stride(0)]), &device);
        let out = dspark_kernels::chain_accept(logits, q, row_words, words).reshape([2 * lanes.len()]);
        let out = read_ids(out)?;
        return Ok(out.chunks(2).map(|pair| pair[1]).collect());
    }
    let host = read_f32(logits)?;
    Ok(rows
        .iter()
        .zip(params)
        .zip(positions)
        .map(|((&r, p), &position)| sample_token(&host[r * vocab..(r + 1) * vocab], p, position))
        .collect())
}

impl Engine {
    /// Queue a request; it starts at a later [`Engine::step`] when it fits the KV budgets.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty prompt, [`Error::TokenOutOfRange`],
    /// [`Error::InvalidSampling`], and [`Error::KvCacheFull`] when the request could never fit
    /// the target's or the draft's KV pool, even alone (nothing is queued then).
    pub fn submit(&mut self, request: Request) -> Result<RequestId> {
        self.check_request(&request)?;
        let id = self.next_id;
        self.next_id += 1;
        let stats = GenerationStats { prompt_tokens: request.prompt.len(), ..GenerationStats::default() };
        self.waiting.push_back(Waiting { id, request, tokens: Vec::new(), stats });
        Ok(id)
    }

    /// Stop a submitted request now, freeing its KV at once. Returns what it generated so far,
    /// with [`FinishReason::Cancelled`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when no unfinished request has this id.
    pub fn cancel(&mut self, id: RequestId) -> Result<Generation> {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            let w = self.waiting.remove(i).ok_or_else(|| Error::Backend("queue index".into()))?;
            return Ok(finished(w.tokens, Some(FinishReason::Cancelled), w.stats, w.request.prompt.len()));
        }
        let i = self
            .running
            .iter()
            .position(|l| l.id == id)
            .ok_or_else(|| Error::InvalidInput(format!("no unfinished request with id {id}")))?;
        let l = self.running.remove(i);
        self.release(&l)?;
        Ok(finished(l.tokens, Some(FinishReason::Cancelled), l.stats, l.request.prompt.len()))
    }

    /// Requests running now (holding KV).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no submitted request is unfinished.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Statistics accumulated by steps since the last call, and reset them.
    pub fn take_stats(&mut self) -> BatchStats {
        std::mem::take(&mut self.stats)
    }

    /// Admit waiting requests that fit, then run one round over every running request.
    ///
    /// # Errors
    /// Backend failures. After an error every unfinished request is dropped (its KV freed) and
    /// the engine is idle and usable.
    pub fn step(&mut self) -> Result<StepOutput> {
        let mut out = std::mem::take(&mut self.parked);
        match self.step_inner(&mut out) {
            Ok(()) => Ok(out),
            Err(e) => {
                self.abort_all();
                Err(e)
            }
        }
    }

    fn step_inner(&mut self, out: &mut StepOutput) -> Result<()> {
        self.admit(out)?;
        if self.running.is_empty() {
            return Ok(());
        }
        self.make_room()?;
        self.stats.peak_lanes = self.stats.peak_lanes.max(self.running.len());
        let started = Instant::now();
        if self.draft.is_some() {
            self.speculative_round(out)?;
        } else {
            self.decode_round(out)?;
        }
        self.stats.decode_time += started.elapsed();
        Ok(())
    }

    /// Generate for every request at once.
    ///
    /// # Errors
    /// As [`Engine::generate_stream`].
    pub fn generate(&mut self, requests: &[Request]) -> Result<Vec<Generation>> {
        self.generate_stream(requests, &mut |_| {})
    }

    /// Generate for every request, calling `on_tokens` as tokens are committed. Requests that do
    /// not fit the KV budgets together wait for room (see [`Engine::step`]); statistics of the
    /// call are in [`Engine::last_stats`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty prompt, [`Error::TokenOutOfRange`],
    /// [`Error::InvalidSampling`], [`Error::KvCacheFull`] when a request could never fit the KV
    /// budget even alone (checked for every request before any work), and backend failures.
    pub fn generate_stream(
        &mut self,
        requests: &[Request],
        on_tokens: &mut dyn FnMut(TokenEvent<'_>),
    ) -> Result<Vec<Generation>> {
        for r in requests {
            self.check_request(r)?;
        }
        let outer = std::mem::take(&mut self.stats);
        let mut index = HashMap::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            index.insert(self.submit(r.clone())?, i);
        }
        let mut results: Vec<Option<Generation>> = vec![None; requests.len()];
        let mut remaining = requests.len();
        let mut foreign = StepOutput::default();
        let outcome = loop {
            if remaining == 0 {
                break Ok(());
            }
            let step = match self.step() {
                Ok(step) => step,
                Err(e) => break Err(e),
            };
            for ev in step.events {
                match index.get(&ev.id) {
                    Some(&i) => on_tokens(TokenEvent { request: i, tokens: &ev.tokens, finish: ev.finish }),
                    None => foreign.events.push(ev),
                }
            }
            for (id, g) in step.finished {
                match index.get(&id) {
                    Some(&i) => {
                        results[i] = Some(g);
                        remaining -= 1;
                    }
                    None => foreign.finished.push((id, g)),
                }
            }
        };
        self.parked.events.extend(foreign.events);
        self.parked.finished.extend(foreign.finished);
        self.last_stats = std::mem::replace(&mut self.stats, outer);
        outcome?;
        results
            .into_iter()
            .map(|g| g.ok_or_else(|| Error::Backend("a request finished without a result".into())))
            .collect()
    }

    /// Validate a request and refuse one that could never fit a KV pool.
    fn check_request(&self, r: &Request) -> Result<()> {
        if r.prompt.is_empty() {
            return Err(Error::InvalidInput("empty prompt".into()));
        }
        self.target.check_tokens(&r.prompt)?;
        r.params.validate()?;
        if r.params.max_new_tokens == 0 {
            return Ok(());
        }
        // Largest footprint: committed rows before the last round plus that round's window.
        let rows = r.prompt.len() + r.params.max_new_tokens - 1 + self.round_rows();
        for pool in self.pools() {
            let need = pool.pages_for(rows);
            if need > pool.total_pages {
                return Err(Error::KvCacheFull {
                    needed_pages: need - pool.total_pages,
                    free_pages: pool.free_pages,
                    total_pages: pool.total_pages,
                    page_bytes: pool.page_bytes,
                    budget_bytes: pool.budget_bytes,
                });
            }
        }
        Ok(())
    }

    /// Rows one round adds to a lane's caches at most.
    pub(super) fn round_rows(&self) -> usize {
        self.draft.as_ref().map_or(1, |d| d.block_size() + 1)
    }

    /// The target's pool, and the draft's when it has one.
    fn pools(&self) -> Vec<PoolState> {
        let mut pools = vec![self.cache.pool_state()];
        if let Some(p) = self.draft.as_ref().and_then(|d| d.context_pool()) {
            pools.push(p);
        }
        pools
    }

    /// Cached rows of a lane in the target and in the draft.
    fn lane_rows(&self, l: &Live) -> Result<(usize, usize)> {
        let target = self.cache.len(l.seq)?;
        let draft = match (self.draft.as_ref(), l.draft_seq) {
            (Some(d), Some(seq)) => d.context_len(seq)?,
            _ => 0,
        };
        Ok((target, draft))
    }

    /// Pages the running lanes' next round may take beyond what they hold, per pool.
    fn round_need(&self) -> Result<Vec<usize>> {
        let pools = self.pools();
        let w = self.round_rows();
        let mut need = vec![0; pools.len()];
        for l in &self.running {
            let (t, d) = self.lane_rows(l)?;
            for (k, (pool, rows)) in pools.iter().zip([t, d]).enumerate() {
                need[k] += pool.pages_for(rows + w) - pool.pages_for(rows);
            }
        }
        Ok(need)
    }

    /// Preempt the most recently admitted lanes until every running lane's next round fits.
    fn make_room(&mut self) -> Result<()> {
        loop {
            let need = self.round_need()?;
            let fits = self.pools().iter().zip(&need).all(|(p, &n)| n <= p.free_pages);
            if fits || self.running.len() <= 1 {
                // One lane alone always fits: `check_request` refused anything larger.
                return Ok(());
            }
            let victim = self
                .running
                .iter()
                .enumerate()
                .max_by_key(|(_, l)| l.admitted)
                .map(|(i, _)| i)
                .ok_or_else(|| Error::Backend("no lane to preempt".into()))?;
            let l = self.running.remove(victim);
            self.release(&l)?;
            tracing::debug!(request = l.id, generated = l.tokens.len(), "preempted under KV pressure");
            self.stats.preemptions += 1;
            self.waiting.push_front(Waiting {
                id: l.id,
                request: l.request,
                tokens: l.tokens,
                stats: l.stats,
            });
        }
    }

    /// Free a lane's KV in both pools.
    fn release(&mut self, l: &Live) -> Result<()> {
        self.cache.free(l.seq)?;
        if let (Some(d), Some(seq)) = (self.draft.as_mut(), l.draft_seq) {
            d.end(seq)?;
        }
        Ok(())
    }

    /// Drop every unfinished request after a failure, freeing what it holds.
    fn abort_all(&mut self) {
        for l in std::mem::take(&mut self.running) {
            let _ = self.release(&l);
        }
        self.waiting.clear();
    }

    /// Admit waiting requests in order while they fit, prefill them in one ragged forward, and
    /// emit the first token of new ones.
    fn admit(&mut self, out: &mut StepOutput) -> Result<()> {
        let pools = self.pools();
        let mut free: Vec<usize> = pools.iter().map(|p| p.free_pages).collect();
        for (f, n) in free.iter_mut().zip(self.round_need()?) {
            *f = f.saturating_sub(n);
        }
        let w = self.round_rows();
        let mut admitted: Vec<Waiting> = Vec::new();
        let mut prefill_rows = 0;
        while let Some(front) = self.waiting.front() {
            if front.request.params.max_new_tokens == 0 {
                let w = self.waiting.pop_front().ok_or_else(|| Error::Backend("queue".into()))?;
                out.finished.push((w.id, finished(Vec::new(), None, w.stats, w.request.prompt.len())));
                continue;
            }
            if self.running.len() + admitted.len() >= self.max_lanes {
                break;
            }
            let rows = context_rows(front);
            if !admitted.is_empty() && prefill_rows + rows > self.max_prefill_tokens {
                break;
            }
            let need: Vec<usize> = pools.iter().map(|p| p.pages_for(rows + w)).collect();
            if need.iter().zip(&free).any(|(n, f)| n > f) {
                break;
            }
            for (f, n) in free.iter_mut().zip(need) {
                *f -= n;
            }
            prefill_rows += rows;
            admitted.push(self.waiting.pop_front().ok_or_else(|| Error::Backend("queue".into()))?);
        }
        if admitted.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let result = self.prefill(admitted, out);
        self.stats.prefill_time += started.elapsed();
        self.stats.prefill_tokens += prefill_rows;
        result
    }

    /// Prefill admitted requests: new ones get their prompt and a first sampled token; resumed
    /// ones get their prompt and generated tokens but the last, which becomes the next input.
    fn prefill(&mut self, admitted: Vec<Waiting>, out: &mut StepOutput) -> Result<()> {
        let layers: Vec<usize> = self.draft.as_ref().map(|d| d.feature_layers().to_vec()).unwrap_or_default();
        let mut lanes = Vec::with_capacity(admitted.len());
        let mut contexts = Vec::with_capacity(admitted.len());
        for w in admitted {
            let seq = self.cache.allocate();
            let draft_seq = self.draft.as_mut().map(|d| d.begin());
            let mut context = w.request.prompt.clone();
            if let Some((_, before)) = w.tokens.split_last() {
                context.extend_from_slice(before);
            }
            contexts.push(context);
            self.admissions += 1;
            lanes.push(Live {
                id: w.id,
                next: w.tokens.last().copied().unwrap_or(0),
                request: w.request,
                seq,
                draft_seq,
                tokens: w.tokens,
                stats: w.stats,
                admitted: self.admissions,
                last_confidence: None,
            });
        }
        let chunks: Vec<SeqChunk<'_>> = lanes
            .iter()
            .zip(&contexts)
            .map(|(l, c)| SeqChunk {
                seq: l.seq,
                tokens: c,
                logits: if l.tokens.is_empty() { LogitRows::Last } else { LogitRows::None },
            })
            .collect();
        let forward = self.target.forward(&chunks, &layers, &mut self.cache);
        let output = match forward {
            Ok(o) => o,
            Err(e) => {
                for l in &lanes {
                    let _ = self.release(l);
                }
                return Err(e);
            }
        };
        self.stats.forward_passes += 1;
        // Admitted lanes are running from here on: `abort_all` frees them on any error below.
        let first = self.running.len();
        self.running.extend(lanes);
        if let Some(features) = &output.features {
            let mut items = Vec::with_capacity(output.rows.len());
            for (i, rows) in output.rows.iter().enumerate() {
                let l = &self.running[first + i];
                let seq =
                    l.draft_seq.ok_or_else(|| Error::Backend("lane without a draft sequence".into()))?;
                items.push((seq, features.clone().narrow(0, rows.start, rows.len())));
            }
            let d = self.draft.as_mut().ok_or_else(|| Error::Backend("features without a draft".into()))?;
            d.extend_contexts(&items)?;
        } else if self.draft.is_some() {
            return Err(Error::Backend("no features captured".into()));
        }
        // Lanes whose prompt ends here draw their first token from their last row.
        let drawing: Vec<(usize, usize)> = output
            .logit_rows
            .iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(i, rows)| (first + i, rows.start))
            .collect();
        let tokens = match output.logits {
            Some(logits) if !drawing.is_empty() => {
                let params: Vec<&SamplingParams> =
                    drawing.iter().map(|&(lane, _)| &self.running[lane].request.params).collect();
                let positions: Vec<usize> =
                    drawing.iter().map(|&(lane, _)| self.running[lane].request.prompt.len()).collect();
                let rows: Vec<usize> = drawing.iter().map(|&(_, row)| row).collect();
                draw_tokens(logits, &rows, &params, &positions)?
            }
            _ => Vec::new(),
        };
        let mut emits = Vec::new();
        for (&(lane, _), &token) in drawing.iter().zip(&tokens) {
            let l = &mut self.running[lane];
            l.next = token;
            emits.push((l.id, l.next));
        }
        for (id, token) in emits {
            self.emit_to(id, &[token], out)?;
        }
        Ok(())
    }

    /// One target-only decode step over every running lane.
    fn decode_round(&mut self, out: &mut StepOutput) -> Result<()> {
        let steps: Vec<[u32; 1]> = self.running.iter().map(|l| [l.next]).collect();
        let chunks: Vec<SeqChunk<'_>> = self
            .running
            .iter()
            .zip(&steps)
            .map(|(l, t)| SeqChunk { seq: l.seq, tokens: t, logits: LogitRows::Last })
            .collect();
        let output = self.target.forward(&chunks, &[], &mut self.cache)?;
        self.stats.forward_passes += 1;
        let logits = output.logits.ok_or_else(|| Error::Backend("forward returned no logits".into()))?;
        let params: Vec<&SamplingParams> = self.running.iter().map(|l| &l.request.params).collect();
        let positions: Vec<usize> =
            self.running.iter().map(|l| l.request.prompt.len() + l.tokens.len()).collect();
        let rows: Vec<usize> = (0..self.running.len()).collect();
        let tokens = draw_tokens(logits, &rows, &params, &positions)?;
        let mut emits = Vec::with_capacity(self.running.len());
        for (l, token) in self.running.iter_mut().zip(tokens) {
            l.next = token;
            l.stats.rounds += 1;
            emits.push((l.id, l.next));
        }
        for (id, token) in emits {
            self.emit_to(id, &[token], out)?;
        }
        Ok(())
    }

    /// Commit `tokens` to the running request `id`, record the event, and retire the request
    /// (freeing its KV) when it finished. Returns how many tokens were committed and whether the
    /// request goes on.
    pub(super) fn emit_to(
        &mut self,
        id: RequestId,
        tokens: &[u32],
        out: &mut StepOutput,
    ) -> Result<(usize, bool)> {
        let i = self
            .running
            .iter()
            .position(|l| l.id == id)
            .ok_or_else(|| Error::Backend(format!("request {id} is not running")))?;
        let lane = &mut self.running[i];
        let (emitted, finish) = commit(&mut lane.tokens, tokens, &lane.request.params);
        self.stats.generated_tokens += emitted;
        out.events.push(StepEvent { id, tokens: tokens[..emitted].to_vec(), finish });
        match finish {
            Some(reason) => {
                let l = self.running.remove(i);
                self.release(&l)?;
                out.finished.push((id, finished(l.tokens, Some(reason), l.stats, l.request.prompt.len())));
                Ok((emitted, false))
            }
            None => Ok((emitted, true)),
        }
    }
}

/// Rows a waiting request prefills: its prompt, plus its generated tokens but the last.
fn context_rows(w: &Waiting) -> usize {
    w.request.prompt.len() + w.tokens.len().saturating_sub(1)
}

/// Append `tokens` in order, stopping after a stop token (kept, nothing after it) or at
/// `max_new_tokens`. Returns how many were appended and why the request finished.
pub(super) fn commit(
    out: &mut Vec<u32>,
    tokens: &[u32],
    params: &SamplingParams,
) -> (usize, Option<FinishReason>) {
    for (i, &t) in tokens.iter().enumerate() {
        out.push(t);
        if params.stop_token_ids.contains(&t) {
            return (i + 1, Some(FinishReason::Stop(t)));
        }
        if out.len() >= params.max_new_tokens {
            return (i + 1, Some(FinishReason::Length));
        }
    }
    (tokens.len(), None)
}

/// A finished request's result.
fn finished(
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    mut stats: GenerationStats,
    prompt_tokens: usize,
) -> Generation {
    stats.prompt_tokens = prompt_tokens;
    stats.finish(tokens.len());
    Generation { tokens, finish, stats }
}
