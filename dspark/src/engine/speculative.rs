//! The speculative mode: per round, draft → choose verify width → target verify with feature
//! capture → accept → commit to both caches.
//!
//! Invariant after every round, for every live request: the target's cached length, the draft's
//! context length and the committed length `L` are equal, and the next anchor (the last
//! committed token) sits at position `L`, in no cache yet.

use std::time::Instant;

use burn::tensor::Tensor;

use super::BatchStats;
use super::core::{Engine, Live, Request, RoundRecord, TokenEvent, VerifyPolicy, prompt_chunks, read_f32};
use crate::accept::{chain_verify_seeded, greedy_verify};
use crate::engine::Generation;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{LogitRows, SeqChunk};
use crate::sampling::{argmax, target_probs};
use crate::speculator::{Proposal, ProposeLane};

/// How many of `proposal`'s drafts to verify under `policy`.
fn verify_count(policy: VerifyPolicy, proposal: &Proposal, gamma: usize) -> usize {
    match policy {
        VerifyPolicy::Full => gamma,
        VerifyPolicy::Fixed(w) => (w - 1).min(gamma),
        VerifyPolicy::Threshold(t) => match &proposal.confidence {
            // Stop at the first draft whose confidence is below t. Confidence k is computed from
            // h_k and draft k−1, so a draft's own value never decides its own admission.
            Some(c) => c.iter().position(|&x| x < t).unwrap_or(gamma),
            None => gamma,
        },
    }
}

impl Engine {
    pub(super) fn run_speculative(
        &mut self,
        requests: &[Request],
        on_tokens: &mut dyn FnMut(TokenEvent<'_>),
        seqs: &mut Vec<SeqId>,
        draft_seqs: &mut Vec<SeqId>,
    ) -> Result<Vec<Generation>> {
        let mut stats = BatchStats::default();
        let mut out = Self::empty_results(requests);
        let layers: Vec<usize> = self.draft.as_ref().map(|d| d.feature_layers().to_vec()).unwrap_or_default();
        let gamma = self.draft.as_ref().map_or(0, |d| d.block_size());
        let started = Instant::now();
        // 1. prefill with feature capture; the prompt's features become the draft's context.
        let mut live = self.start_lanes(requests, seqs, Some(draft_seqs))?;
        if !live.is_empty() {
            let chunks = prompt_chunks(requests, &live);
            let output = self.target.forward(&chunks, &layers, &mut self.cache)?;
            stats.forward_passes += 1;
            let features =
                output.features.clone().ok_or_else(|| Error::Backend("no features captured".into()))?;
            for (l, rows) in live.iter().zip(&output.rows) {
                self.extend_draft(l, features.clone().narrow(0, rows.start, rows.len()))?;
            }
            self.sample_rows(output.logits, requests, &mut live)?;
        }
        stats.prefill_time = started.elapsed();
        // 2. the first token comes from the prefill, as in target-only decoding.
        let decode_started = Instant::now();
        let mut still = Vec::with_capacity(live.len());
        for l in live {
            let token = l.next;
            still.extend(self.emit(l, &[token], requests, &mut out, &mut stats, on_tokens)?);
        }
        live = still;
        // 3. speculative rounds.
        while !live.is_empty() {
            let draft = self
                .draft
                .as_mut()
                .ok_or_else(|| Error::Backend("speculative run without a draft".into()))?;
            let lanes: Vec<ProposeLane<'_>> = live
                .iter()
                .map(|l| ProposeLane {
                    seq: l.draft_seq.unwrap_or_default(),
                    anchor: l.next,
                    params: &requests[l.request].params,
                })
                .collect();
            let round_started = Instant::now();
            let proposals = draft.propose(&lanes)?;
            stats.draft_passes += 1;
            let drafted_at = Instant::now();
            stats.draft_time += drafted_at - round_started;
            let counts: Vec<usize> = proposals.iter().map(|p| verify_count(self.verify, p, gamma)).collect();
            let windows: Vec<Vec<u32>> = live
                .iter()
                .zip(&proposals)
                .zip(&counts)
                .map(|((l, p), &m)| std::iter::once(l.next).chain(p.tokens[..m].iter().copied()).collect())
                .collect();
            let positions: Vec<usize> = live.iter().map(|l| self.cache.len(l.seq)).collect::<Result<_>>()?;
            let chunks: Vec<SeqChunk<'_>> = live
                .iter()
                .zip(&windows)
                .map(|(l, w)| SeqChunk { seq: l.seq, tokens: w, logits: LogitRows::All })
                .collect();
            let output = self.target.forward(&chunks, &layers, &mut self.cache)?;
            stats.forward_passes += 1;
            let logits = read_f32(output.logits.clone().ok_or_else(|| Error::Backend("no logits".into()))?)?;
            let features =
                output.features.clone().ok_or_else(|| Error::Backend("no features captured".into()))?;
            let verified_at = Instant::now();
            stats.verify_time += verified_at - drafted_at;
            let vocab = self.target.vocab_size();
            let mut still = Vec::with_capacity(live.len());
            for (i, mut l) in live.into_iter().enumerate() {
                let params = &requests[l.request].params;
                let (m, position) = (counts[i], positions[i]);
                let drafts = &windows[i][1..];
                let rows: Vec<&[f32]> =
                    output.logit_rows[i].clone().map(|r| &logits[r * vocab..(r + 1) * vocab]).collect();
                // 4. accept: greedy prefix match, or chain rejection with the residual.
                let verdict = if params.is_greedy() {
                    let target_argmax: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
                    greedy_verify(drafts, &target_argmax, None)?
                } else {
                    let p: Vec<Vec<f64>> = rows.iter().map(|r| target_probs(r, params)).collect();
                    let q = proposals[i]
                        .q
                        .as_ref()
                        .ok_or_else(|| Error::Backend("sampling proposal without q".into()))?;
                    let p_rows: Vec<&[f64]> = p.iter().map(Vec::as_slice).collect();
                    let q_rows: Vec<&[f64]> = q[..m].iter().map(Vec::as_slice).collect();
                    chain_verify_seeded(drafts, &p_rows, &q_rows, params.seed, position + 1, None)?
                };
                let a = verdict.accepted;
                l.stats.rounds += 1;
                l.stats.drafted += m;
                l.stats.accepted += a;
                grow(&mut l.stats.drafted_per_position, gamma);
                grow(&mut l.stats.accepted_per_position, gamma);
                (0..m).for_each(|k| l.stats.drafted_per_position[k] += 1);
                (0..a).for_each(|k| l.stats.accepted_per_position[k] += 1);
                l.stats.round_log.push(RoundRecord { position, drafted: drafts.to_vec(), accepted: a });
                stats.drafted += m;
                stats.accepted += a;
                // 5. commit accepted drafts + bonus, cut by stop tokens and max_new_tokens.
                let Some(mut l) =
                    self.emit(l, &verdict.committed, requests, &mut out, &mut stats, on_tokens)?
                else {
                    continue;
                };
                // 6. keep rows [anchor, d1..d_a] in the target cache; feed their features to the draft.
                self.cache.truncate(l.seq, position + a + 1)?;
                let lane_rows = output.rows[i].clone();
                self.extend_draft(&l, features.clone().narrow(0, lane_rows.start, a + 1))?;
                self.check_lengths(&l, position + a + 1)?;
                l.next = verdict.bonus;
                still.push(l);
            }
            live = still;
            stats.commit_time += verified_at.elapsed();
        }
        stats.decode_time = decode_started.elapsed();
        self.last_stats = stats;
        Ok(out)
    }

    fn extend_draft(&mut self, l: &Live, features: Tensor<2>) -> Result<()> {
        match (self.draft.as_mut(), l.draft_seq) {
            (Some(d), Some(seq)) => d.extend_context(seq, features),
            _ => Err(Error::Backend("speculative lane without a draft sequence".into())),
        }
    }

    /// Target KV, draft context and committed length must agree after every round.
    fn check_lengths(&self, l: &Live, committed: usize) -> Result<()> {
        let target = self.cache.len(l.seq)?;
        let draft = match (self.draft.as_ref(), l.draft_seq) {
            (Some(d), Some(seq)) => d.context_len(seq)?,
            _ => target,
        };
        if target != committed || draft != committed {
            return Err(Error::Backend(format!(
                "cache lengths diverged: target {target}, draft {draft}, committed {committed}"
            )));
        }
        Ok(())
    }
}

fn grow(v: &mut Vec<usize>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    }
}
