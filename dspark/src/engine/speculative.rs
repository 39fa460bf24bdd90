//! The speculative mode: per round, draft → choose verify width → target verify with feature
//! capture → accept → commit to both caches.
//!
//! Invariant after every round, for every live request: the target's cached length, the draft's
//! context length and the committed length `L` are equal, and the next anchor (the last
//! committed token) sits at position `L`, in no cache yet.

use std::time::Instant;

use super::core::{Engine, RoundRecord, StepOutput, VerifyPolicy, read_f32, read_ids};
use super::schedule;
use crate::accept::{chain_verify_seeded, greedy_verify};
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{LogitRows, SeqChunk};
use crate::sampling::{argmax, target_probs_rows};
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
        // Decided across lanes by `Engine::throughput_counts`.
        VerifyPolicy::Throughput => gamma,
    }
}

impl Engine {
    /// One speculative round over every running lane: draft → choose verify width → target
    /// verify with feature capture → accept → commit to both caches.
    pub(super) fn speculative_round(&mut self, out: &mut StepOutput) -> Result<()> {
        let layers: Vec<usize> = self.draft.as_ref().map(|d| d.feature_layers().to_vec()).unwrap_or_default();
        let gamma = self.draft.as_ref().map_or(0, |d| d.block_size());
        let draft =
            self.draft.as_mut().ok_or_else(|| Error::Backend("speculative round without a draft".into()))?;
        let lanes: Vec<ProposeLane<'_>> = self
            .running
            .iter()
            .map(|l| ProposeLane {
                seq: l.draft_seq.unwrap_or_default(),
                anchor: l.next,
                params: &l.request.params,
            })
            .collect();
        let round_started = Instant::now();
        let proposals = draft.propose(&lanes)?;
        self.stats.draft_passes += 1;
        let drafted_at = Instant::now();
        self.stats.draft_time += drafted_at - round_started;
        let counts: Vec<usize> = if self.verify == VerifyPolicy::Throughput {
            self.throughput_counts(&proposals, gamma)?
        } else {
            proposals.iter().map(|p| verify_count(self.verify, p, gamma)).collect()
        };
        // Each lane's confidences become its "earlier round" for the next budget.
        for (l, p) in self.running.iter_mut().zip(&proposals) {
            l.last_confidence.clone_from(&p.confidence);
        }
        self.prior_confidence = mean_confidence(&proposals, gamma);
        let windows: Vec<Vec<u32>> = self
            .running
            .iter()
            .zip(&proposals)
            .zip(&counts)
            .map(|((l, p), &m)| std::iter::once(l.next).chain(p.tokens[..m].iter().copied()).collect())
            .collect();
        let positions: Vec<usize> =
            self.running.iter().map(|l| self.cache.len(l.seq)).collect::<Result<_>>()?;
        let chunks: Vec<SeqChunk<'_>> = self
            .running
            .iter()
            .zip(&windows)
            .map(|(l, w)| SeqChunk { seq: l.seq, tokens: w, logits: LogitRows::All })
            .collect();
        let output = self.target.forward(&chunks, &layers, &mut self.cache)?;
        self.stats.forward_passes += 1;
        let logits_t = output.logits.clone().ok_or_else(|| Error::Backend("no logits".into()))?;
        // Every lane greedy where the kernels run: only the target's argmax ids leave the device.
        let greedy_ids = self.running.iter().all(|l| l.request.params.is_greedy())
            && dspark_kernels::kernels_available(&logits_t.device());
        let (logits, argmax_ids) = if greedy_ids {
            (Vec::new(), read_ids(dspark_kernels::argmax_rows(logits_t))?)
        } else {
            (read_f32(logits_t)?, Vec::new())
        };
        let features =
            output.features.clone().ok_or_else(|| Error::Backend("no features captured".into()))?;
        let verified_at = Instant::now();
        self.stats.verify_time += verified_at - drafted_at;
        let vocab = self.target.vocab_size();
        let ids: Vec<_> = self.running.iter().map(|l| l.id).collect();
        let mut extend = Vec::with_capacity(ids.len());
        let mut committed = Vec::with_capacity(ids.len());
        for (i, id) in ids.into_iter().enumerate() {
            let l = self
                .running
                .iter_mut()
                .find(|l| l.id == id)
                .ok_or_else(|| Error::Backend(format!("request {id} left the round")))?;
            let params = &l.request.params;
            let (m, position) = (counts[i], positions[i]);
            let drafts = &windows[i][1..];
            let rows: Vec<&[f32]> = if greedy_ids {
                Vec::new()
            } else {
                output.logit_rows[i].clone().map(|r| &logits[r * vocab..(r + 1) * vocab]).collect()
            };
            // 4. accept: greedy prefix match, or chain rejection with the residual.
            let verdict = if params.is_greedy() {
                let target_argmax: Vec<u32> = if greedy_ids {
                    output.logit_rows[i].clone().map(|r| argmax_ids[r]).collect()
                } else {
                    rows.iter().map(|r| argmax(r)).collect()
                };
                greedy_verify(drafts, &target_argmax, None)?
            } else {
                let p = target_probs_rows(&rows, params);
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
            self.stats.drafted += m;
            self.stats.accepted += a;
            // 5. commit accepted drafts + bonus, cut by stop tokens and max_new_tokens.
            let (_, goes_on) = self.emit_to(id, &verdict.committed, out)?;
            if !goes_on {
                continue;
            }
            // 6. keep rows [anchor, d1..d_a] in the target cache; feed their features to the draft.
            let l = self
                .running
                .iter_mut()
                .find(|l| l.id == id)
                .ok_or_else(|| Error::Backend(format!("request {id} left the round")))?;
            l.next = verdict.bonus;
            let (seq, draft_seq) = (l.seq, l.draft_seq);
            self.cache.truncate(seq, position + a + 1)?;
            let lane_rows = output.rows[i].clone();
            let dseq = draft_seq.ok_or_else(|| Error::Backend("lane without a draft sequence".into()))?;
            extend.push((dseq, features.clone().narrow(0, lane_rows.start, a + 1)));
            committed.push((seq, dseq, position + a + 1));
        }
        // 7. every continuing lane's committed rows into the draft's context, in one call.
        let d = self.draft.as_mut().ok_or_else(|| Error::Backend("draft vanished".into()))?;
        d.extend_contexts(&extend)?;
        for (seq, dseq, len) in committed {
            self.check_lengths(seq, dseq, len)?;
        }
        self.stats.commit_time += verified_at.elapsed();
        Ok(())
    }

    /// Drafts verified per lane under the throughput scheduler: the budget from the lanes'
    /// previous confidences (or the last round's mean for a lane's first round; everything
    /// when the engine has no history), split by this round's survival.
    fn throughput_counts(&self, proposals: &[Proposal], gamma: usize) -> Result<Vec<usize>> {
        let table = self.cost_table.as_ref().ok_or_else(|| Error::InvalidInput("no cost table".into()))?;
        let full = vec![1.0f32; gamma];
        let earlier: Vec<&[f32]> = self
            .running
            .iter()
            .map(|l| l.last_confidence.as_deref().or(self.prior_confidence.as_deref()).unwrap_or(&full))
            .collect();
        let budget = schedule::choose_budget(table, &earlier, gamma);
        let current: Vec<&[f32]> = proposals
            .iter()
            .map(|p| {
                p.confidence.as_deref().ok_or_else(|| Error::Backend("proposal without confidence".into()))
            })
            .collect::<Result<_>>()?;
        Ok(schedule::split_budget(budget, &current, gamma))
    }

    /// Target KV, draft context and committed length must agree after every round.
    fn check_lengths(&self, seq: SeqId, draft_seq: SeqId, committed: usize) -> Result<()> {
        let target = self.cache.len(seq)?;
        let draft = match self.draft.as_ref() {
            Some(d) => d.context_len(draft_seq)?,
            None => target,
        };
        if target != committed || draft != committed {
            return Err(Error::Backend(format!(
                "cache lengths diverged: target {target}, draft {draft}, committed {committed}"
            )));
        }
        Ok(())
    }
}

/// Mean confidence per draft position over a round's proposals (`None` without confidences).
fn mean_confidence(proposals: &[Proposal], gamma: usize) -> Option<Vec<f32>> {
    let rows: Vec<&Vec<f32>> = proposals.iter().filter_map(|p| p.confidence.as_ref()).collect();
    if rows.is_empty() {
        return None;
    }
    let n = rows.len() as f32;
    Some((0..gamma).map(|k| rows.iter().map(|c| c.get(k).copied().unwrap_or(0.0)).sum::<f32>() / n).collect())
}

fn grow(v: &mut Vec<usize>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    }
}
