//! The speculative mode: per round, draft → choose verify width → target verify with feature
//! capture → accept → commit to both caches.
//!
//! Invariant after every round, for every live request: the target's cached length, the draft's
//! context length and the committed length `L` are equal, and the next anchor (the last
//! committed token) sits at position `L`, in no cache yet.

use std::time::Instant;

use burn::tensor::{DType, Int, Tensor, TensorData};

use super::core::{Engine, Live, RoundRecord, StepOutput, VerifyPolicy, read_f32, read_ids};
use super::schedule;
use crate::accept::{Verdict, chain_verify_seeded, greedy_verify};
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{DeviceTokens, LogitRows, SeqChunk, merge_device_tokens};
use crate::sampling::{SamplingParams, Stream, argmax, coin, target_probs, target_probs_rows};
use crate::speculator::{DeferredProposals, DeviceQ, Proposal, ProposeLane};

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

/// One sampled lane of [`dspark_kernels::chain_accept`]: its drafts verified from target row
/// `p_row`, drawn from proposal row `q_row` on, with the coins of [`chain_verify_seeded`] for a
/// window whose anchor sits at `position`.
fn accept_lane(
    p: &SamplingParams,
    p_row: usize,
    q_row: usize,
    drafts: Vec<u32>,
    position: usize,
) -> dspark_kernels::accept::AcceptLane {
    let (m, first) = (drafts.len(), position + 1);
    dspark_kernels::accept::AcceptLane {
        p_row,
        q_row,
        drafts,
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        accept_coins: (0..m).map(|s| coin(p.seed, Stream::Accept, first + s)).collect(),
        draw_coins: (0..=m).map(|c| coin(p.seed, Stream::TargetSample, first + c)).collect(),
    }
}

/// The verify chunks of a round: each running lane's window, logits of every row.
fn window_chunks<'a>(running: &'a [Live], windows: &'a [Vec<u32>]) -> Vec<SeqChunk<'a>> {
    running
        .iter()
        .zip(windows)
        .map(|(l, w)| SeqChunk { seq: l.seq, tokens: w, logits: LogitRows::All })
        .collect()
}

/// Every sampled lane's verdict from one [`dspark_kernels::chain_accept`] call (`None` for
/// greedy lanes): `logits` holds the verify rows, lane `i`'s from `first_rows[i]`; its drafts
/// are `windows[i][1..]`, drawn from its proposal's device rows. The coins are those of
/// [`chain_verify_seeded`] at the same positions, so the verdict is the host rule's up to f64
/// rounding.
fn accept_on_device(
    logits: &Tensor<2>,
    params: &[&SamplingParams],
    proposals: &[Proposal],
    windows: &[Vec<u32>],
    first_rows: &[usize],
    positions: &[usize],
    gamma: usize,
) -> Result<Vec<Option<Verdict>>> {
    use dspark_kernels::accept::{accept_words, lane_stride};
    let [p_rows, _] = logits.dims();
    let mut lanes = Vec::new();
    let mut parts = Vec::new();
    let mut owners = Vec::new();
    let mut q_rows = 0;
    for (i, p) in params.iter().enumerate() {
        if p.is_greedy() {
            continue;
        }
        let drafts = windows[i][1..].to_vec();
        let m = drafts.len();
        let rows =
            proposals[i].q_rows.as_ref().ok_or_else(|| Error::Backend("no device proposal rows".into()))?;
        if m > 0 {
            parts.push(rows.rows.clone().narrow(0, rows.first, m));
        }
        lanes.push(accept_lane(p, first_rows[i], q_rows, drafts, positions[i]));
        owners.push(i);
        q_rows += m;
    }
    // Without drafts the proposal rows are never read: one target row stands in.
    let q = if parts.is_empty() { logits.clone().narrow(0, 0, 1) } else { Tensor::cat(parts, 0) };
    let q_count = q.dims()[0];
    let (rows, words) = accept_words(&lanes, p_rows, q_count, gamma);
    let device = logits.device();
    let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [3 * (p_rows + q_count)]), &device);
    let words =
        Tensor::<2, Int>::from_data(TensorData::new(words, [lanes.len(), lane_stride(gamma)]), &device);
    let out = dspark_kernels::chain_accept(logits.clone(), q, rows, words).reshape([2 * lanes.len()]);
    let out = read_ids(out)?;
    let mut verdicts = vec![None; params.len()];
    for ((lane, &i), pair) in lanes.iter().zip(&owners).zip(out.chunks(2)) {
        verdicts[i] = Some(device_verdict(&lane.drafts, pair[0] as usize, pair[1])?);
    }
    Ok(verdicts)
}

/// The verdict a device acceptance returned as `(accepted, bonus)` for these drafts.
fn device_verdict(drafts: &[u32], accepted: usize, bonus: u32) -> Result<Verdict> {
    if accepted > drafts.len() {
        return Err(Error::Backend(format!("device verdict accepts {accepted} of {} drafts", drafts.len())));
    }
    let mut committed = drafts[..accepted].to_vec();
    committed.push(bonus);
    Ok(Verdict { accepted, bonus, committed, cap_trim: 0 })
}

/// Whether sampled lanes are verified on the device ([`dspark_kernels::chain_accept`]): where
/// the kernels run, and on the CPU under graph emulation (which stands in for the CUDA engine's
/// path in tests).
pub(super) fn verifies_on_device(device: &burn::tensor::Device) -> bool {
    dspark_kernels::kernels_available(device) || dspark_kernels::graph_emulation()
}

/// The sampled lanes' chain acceptance of a deferred round, queued on the device: lane `i`
/// verifies its first `m` drafts, which the device fills into the lane words from
/// `deferred.tokens`, against the target rows from `first_rows[i]` and its proposal rows
/// `deferred.q_rows[i · γ ..]`. Returns the `(accepted, bonus)` pairs `[2 · lanes]` and the
/// running-lane index of each, or `None` without sampled lanes. Coins as [`accept_on_device`].
fn accept_deferred(
    logits: &Tensor<2>,
    params: &[&SamplingParams],
    deferred: &DeferredProposals,
    m: usize,
    first_rows: &[usize],
    positions: &[usize],
    gamma: usize,
) -> Result<Option<(Tensor<1, Int>, Vec<usize>)>> {
    use dspark_kernels::accept::{ENTRY_WORDS, LANE_HEADER, accept_words, lane_stride};
    if params.iter().all(|p| p.is_greedy()) {
        return Ok(None);
    }
    let q = deferred
        .q_rows
        .clone()
        .ok_or_else(|| Error::Backend("a deferred sampling round without its proposal rows".into()))?;
    let [p_rows, _] = logits.dims();
    let stride = lane_stride(gamma);
    let (mut lanes, mut owners, mut src) = (Vec::new(), Vec::new(), Vec::new());
    for (i, p) in params.iter().enumerate() {
        if p.is_greedy() {
            continue;
        }
        lanes.push(accept_lane(p, first_rows[i], i * gamma, vec![0; m], positions[i]));
        // Draft j of this lane: word `LANE_HEADER + ENTRY_WORDS · j` of its block, value
        // `tokens[i · γ + j]` (as `merge_device_tokens` reads `src`: index + 1).
        let block = owners.len() * stride;
        src.resize(block + stride, 0);
        for j in 0..m {
            src[block + LANE_HEADER + ENTRY_WORDS * j] = (i * gamma + j + 1) as i64;
        }
        owners.push(i);
    }
    let q_count = q.dims()[0];
    let (rows, words) = accept_words(&lanes, p_rows, q_count, gamma);
    let device = logits.device();
    let count = lanes.len() * stride;
    let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [3 * (p_rows + q_count)]), &device);
    let words = Tensor::<1, Int>::from_data(TensorData::new(words, [count]), &device);
    let src = Tensor::<1, Int>::from_data(TensorData::new(src, [count]), &device);
    let words = merge_device_tokens(words, src, deferred.tokens.clone()).reshape([lanes.len(), stride]);
    let pairs = dspark_kernels::chain_accept(logits.clone(), q, rows, words).reshape([2 * lanes.len()]);
    Ok(Some((pairs, owners)))
}

/// The proposal distributions `softmax(row / T)` of `m` device rows, made on the host (for a
/// sampled lane verified on the host whose draft left its rows on the device).
fn host_q(rows: &DeviceQ, m: usize, temperature: f32) -> Result<Vec<Vec<f64>>> {
    if m == 0 {
        return Ok(Vec::new());
    }
    let [_, v] = rows.rows.dims();
    let values = read_f32(rows.rows.clone().narrow(0, rows.first, m))?;
    let softmax = SamplingParams { temperature, ..SamplingParams::default() };
    Ok(values.chunks(v).map(|r| target_probs(r, &softmax)).collect())
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
        // A round that waits on the device once: the draft round is queued, the verify window
        // queued behind it reads the drafts on the device, and drafts and the target's argmax
        // come back in one read.
        let all_greedy = self.running.iter().all(|l| l.request.params.is_greedy());
        let fixed_width = match self.verify {
            VerifyPolicy::Full => Some(gamma),
            VerifyPolicy::Fixed(w) => Some((w - 1).min(gamma)),
            _ => None,
        };
        // Sampled lanes need their proposal rows on the device (the draft defers only then) and
        // the device's acceptance.
        let device_verify = all_greedy || verifies_on_device(self.target.device());
        let deferred = match fixed_width {
            Some(_) if self.one_sync_rounds && device_verify => draft.propose_deferred(&lanes)?,
            _ => None,
        };
        // Each lane's committed length: its window's anchor position.
        let positions: Vec<usize> =
            self.running.iter().map(|l| self.cache.len(l.seq)).collect::<Result<_>>()?;
        // Set when the draft's contexts already hold every lane's whole window (see below).
        let mut extended_ahead = false;
        let (proposals, counts, windows, output, logits, argmax_ids, device_verdicts, host_logits) =
            if let Some(deferred) = deferred {
                let m = fixed_width.unwrap_or(gamma);
                self.stats.draft_passes += 1;
                self.stats.one_sync_rounds += 1;
                let drafted_at = Instant::now();
                self.stats.draft_time += drafted_at - round_started;
                // Each window: the anchor, then m drafts that the device fills in.
                let mut slots = Vec::with_capacity(lanes.len() * m);
                for i in 0..lanes.len() {
                    let first = i * (m + 1);
                    slots.extend((0..m).map(|k| (first + 1 + k, i * gamma + k)));
                }
                let placeholders: Vec<Vec<u32>> = self
                    .running
                    .iter()
                    .map(|l| std::iter::once(l.next).chain(std::iter::repeat_n(0, m)).collect())
                    .collect();
                let chunks = window_chunks(&self.running, &placeholders);
                let tokens = DeviceTokens { values: &deferred.tokens, rows: &slots };
                let output = self.target.forward_device_tokens(&chunks, tokens, &layers, &mut self.cache)?;
                self.stats.forward_passes += 1;
                // The draft's context takes each lane's whole window now, queued behind the
                // verify, so no extension waits for the host after the read; the rows of the
                // drafts the verdicts reject are cut afterwards. Each row's K/V is the same
                // whatever the rows beside it, so the kept rows equal a later extension's.
                if draft.can_truncate_context() {
                    let features = output
                        .features
                        .clone()
                        .ok_or_else(|| Error::Backend("no features captured".into()))?;
                    let items: Vec<(SeqId, Tensor<2>)> = lanes
                        .iter()
                        .zip(&output.rows)
                        .map(|(lane, rows)| (lane.seq, features.clone().narrow(0, rows.start, m + 1)))
                        .collect();
                    draft.extend_contexts(&items)?;
                    extended_ahead = true;
                }
                let logits_t = output.logits.clone().ok_or_else(|| Error::Backend("no logits".into()))?;
                // One read: the draft's values, the target's argmax (greedy lanes), the verdict
                // pairs of the sampled lanes (accepted, bonus), decided on the device.
                let params: Vec<&SamplingParams> = self.running.iter().map(|l| &l.request.params).collect();
                let mut parts = vec![deferred.readback.clone()];
                let any_greedy = params.iter().any(|p| p.is_greedy());
                if any_greedy {
                    let ids = dspark_kernels::argmax_rows(logits_t.clone());
                    let rows = ids.dims()[0];
                    parts.push(ids.float().cast(DType::F32).reshape([1, rows]));
                }
                let first_rows: Vec<usize> = output.logit_rows.iter().map(|r| r.start).collect();
                let sampled =
                    accept_deferred(&logits_t, &params, &deferred, m, &first_rows, &positions, gamma)?;
                if let Some((pairs, _)) = &sampled {
                    let n = pairs.dims()[0];
                    parts.push(pairs.clone().float().cast(DType::F32).reshape([1, n]));
                }
                drop(params);
                let widths: Vec<usize> = parts.iter().map(|t| t.dims()[1]).collect();
                let values = read_f32(Tensor::cat(parts, 1))?;
                if values.len() != widths.iter().sum::<usize>() {
                    return Err(Error::Backend("a one-sync round read back the wrong length".into()));
                }
                let (draft_values, rest) = values.split_at(widths[0]);
                let proposals = draft.finish_deferred(&lanes, deferred, draft_values)?;
                let (ids, pairs) = rest.split_at(if any_greedy { widths[1] } else { 0 });
                let argmax_ids: Vec<u32> = ids.iter().map(|&v| v as u32).collect();
                let mut device_verdicts = vec![None; lanes.len()];
                if let Some((_, owners)) = sampled {
                    for (&i, pair) in owners.iter().zip(pairs.chunks(2)) {
                        let drafts = &proposals[i].tokens[..m];
                        device_verdicts[i] = Some(device_verdict(drafts, pair[0] as usize, pair[1] as u32)?);
                    }
                }
                let windows: Vec<Vec<u32>> = self
                    .running
                    .iter()
                    .zip(&proposals)
                    .map(|(l, p)| std::iter::once(l.next).chain(p.tokens[..m].iter().copied()).collect())
                    .collect();
                let counts = vec![m; lanes.len()];
                self.stats.verify_time += drafted_at.elapsed();
                (proposals, counts, windows, output, Vec::new(), argmax_ids, device_verdicts, false)
            } else {
                let proposals = draft.propose(&lanes)?;
                self.stats.draft_passes += 1;
                let drafted_at = Instant::now();
                self.stats.draft_time += drafted_at - round_started;
                let counts: Vec<usize> = if self.verify == VerifyPolicy::Throughput {
                    self.throughput_counts(&proposals, gamma)?
                } else {
                    proposals.iter().map(|p| verify_count(self.verify, p, gamma)).collect()
                };
                let windows: Vec<Vec<u32>> = self
                    .running
                    .iter()
                    .zip(&proposals)
                    .zip(&counts)
                    .map(|((l, p), &m)| {
                        std::iter::once(l.next).chain(p.tokens[..m].iter().copied()).collect()
                    })
                    .collect();
                let chunks = window_chunks(&self.running, &windows);
                let output = self.target.forward(&chunks, &layers, &mut self.cache)?;
                self.stats.forward_passes += 1;
                let logits_t = output.logits.clone().ok_or_else(|| Error::Backend("no logits".into()))?;
                // Where the kernels run, only ids leave the device: the target's argmax for greedy lanes,
                // and for sampled lanes whose proposal rows are on the device, their verdicts.
                let on_kernels = verifies_on_device(&logits_t.device());
                let params: Vec<&SamplingParams> = self.running.iter().map(|l| &l.request.params).collect();
                let any_greedy = params.iter().any(|p| p.is_greedy());
                let any_sampled = params.iter().any(|p| !p.is_greedy());
                let sampled_on_device = on_kernels
                    && params.iter().zip(&proposals).any(|(p, x)| !p.is_greedy() && x.q_rows.is_some())
                    && params.iter().zip(&proposals).all(|(p, x)| p.is_greedy() || x.q_rows.is_some());
                let host_logits = !on_kernels || (any_sampled && !sampled_on_device);
                let (logits, argmax_ids, device_verdicts) = if host_logits {
                    (read_f32(logits_t)?, Vec::new(), Vec::new())
                } else {
                    let ids = if any_greedy {
                        read_ids(dspark_kernels::argmax_rows(logits_t.clone()))?
                    } else {
                        Vec::new()
                    };
                    let verdicts = if sampled_on_device {
                        let rows: Vec<usize> = output.logit_rows.iter().map(|r| r.start).collect();
                        accept_on_device(&logits_t, &params, &proposals, &windows, &rows, &positions, gamma)?
                    } else {
                        Vec::new()
                    };
                    (Vec::new(), ids, verdicts)
                };
                self.stats.verify_time += drafted_at.elapsed();
                (proposals, counts, windows, output, logits, argmax_ids, device_verdicts, host_logits)
            };
        // Each lane's confidences become its "earlier round" for the next budget (after this
        // round's widths were chosen from the earlier ones).
        for (l, p) in self.running.iter_mut().zip(&proposals) {
            l.last_confidence.clone_from(&p.confidence);
        }
        self.prior_confidence = mean_confidence(&proposals, gamma);
        let verified_at = Instant::now();
        let features =
            output.features.clone().ok_or_else(|| Error::Backend("no features captured".into()))?;
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
            let rows: Vec<&[f32]> = if host_logits {
                output.logit_rows[i].clone().map(|r| &logits[r * vocab..(r + 1) * vocab]).collect()
            } else {
                Vec::new()
            };
            // 4. accept: greedy prefix match, or chain rejection with the residual.
            let verdict = if params.is_greedy() {
                let target_argmax: Vec<u32> = if host_logits {
                    rows.iter().map(|r| argmax(r)).collect()
                } else {
                    output.logit_rows[i].clone().map(|r| argmax_ids[r]).collect()
                };
                greedy_verify(drafts, &target_argmax, None)?
            } else if let Some(Some(verdict)) = device_verdicts.get(i) {
                verdict.clone()
            } else {
                let p = target_probs_rows(&rows, params);
                let q = match (&proposals[i].q, &proposals[i].q_rows) {
                    (Some(q), _) => q[..m].to_vec(),
                    (None, Some(rows)) => host_q(rows, m, params.temperature)?,
                    (None, None) => return Err(Error::Backend("sampling proposal without q".into())),
                };
                let p_rows: Vec<&[f64]> = p.iter().map(Vec::as_slice).collect();
                let q_rows: Vec<&[f64]> = q.iter().map(Vec::as_slice).collect();
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
            if !extended_ahead {
                extend.push((dseq, features.clone().narrow(0, lane_rows.start, a + 1)));
            }
            committed.push((seq, dseq, position + a + 1));
        }
        // 7. every continuing lane's committed rows into the draft's context, in one call (or,
        // extended ahead, the rejected drafts' rows cut).
        let d = self.draft.as_mut().ok_or_else(|| Error::Backend("draft vanished".into()))?;
        if extended_ahead {
            for &(_, dseq, len) in &committed {
                d.truncate_context(dseq, len)?;
            }
        } else {
            d.extend_contexts(&extend)?;
        }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Values in [−4, 4) from a seed (a fixed pseudo-random row set).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        (0..n).map(|i| (coin(seed, Stream::Draft, i) * 8.0 - 4.0) as f32).collect()
    }

    #[test]
    fn device_verdicts_are_the_host_chain_lane_by_lane() {
        // Three lanes in one verify: sampled with 3 drafts (top-k and top-p), greedy with 1,
        // sampled with none. The device call (its host body here) decides each sampled lane as
        // `chain_verify_seeded` does with host p and q, at the same rows, drafts and positions.
        let device = Default::default();
        let (v, gamma) = (64usize, 4usize);
        let params = [
            SamplingParams { temperature: 0.9, top_k: 10, top_p: 0.9, seed: 5, ..SamplingParams::default() },
            SamplingParams::greedy(8),
            SamplingParams { temperature: 0.7, seed: 9, ..SamplingParams::default() },
        ];
        let counts = [3usize, 1, 0];
        let first_rows = [0usize, 4, 6];
        let positions = [11usize, 30, 7];
        let p_host = values(1, 7 * v);
        // The proposal rows: the target's, perturbed, at each lane's γ-row block.
        let noise = values(2, 3 * gamma * v);
        let q_host: Vec<f32> = (0..3 * gamma * v).map(|i| p_host[i % (7 * v)] + noise[i] / 5.0).collect();
        let q_tensor = Tensor::<2>::from_data(TensorData::new(q_host.clone(), [3 * gamma, v]), &device);
        let row = |x: &[f32], r: usize| x[r * v..(r + 1) * v].to_vec();
        let q_dist = |lane: usize, k: usize| {
            let softmax =
                SamplingParams { temperature: params[lane].temperature, ..SamplingParams::default() };
            target_probs(&row(&q_host, lane * gamma + k), &softmax)
        };
        let mut windows = Vec::new();
        let mut proposals = Vec::new();
        for lane in 0..3 {
            let drafts: Vec<u32> = (0..counts[lane])
                .map(|k| {
                    let u = coin(3, Stream::Draft, 100 * lane + k);
                    crate::sampling::sample_weights(&q_dist(lane, k), u).unwrap()
                })
                .collect();
            windows.push(std::iter::once(1u32).chain(drafts.iter().copied()).collect::<Vec<_>>());
            let q_rows =
                (!params[lane].is_greedy()).then(|| DeviceQ { rows: q_tensor.clone(), first: lane * gamma });
            proposals.push(Proposal { tokens: drafts, q: None, confidence: None, q_rows });
        }
        let logits = Tensor::<2>::from_data(TensorData::new(p_host.clone(), [7, v]), &device);
        let refs: Vec<&SamplingParams> = params.iter().collect();
        let verdicts =
            accept_on_device(&logits, &refs, &proposals, &windows, &first_rows, &positions, gamma).unwrap();
        assert!(verdicts[1].is_none(), "the greedy lane is not decided here");
        for lane in [0, 2] {
            let m = counts[lane];
            let p: Vec<Vec<f64>> =
                (0..=m).map(|r| target_probs(&row(&p_host, first_rows[lane] + r), &params[lane])).collect();
            let q: Vec<Vec<f64>> = (0..m).map(|k| q_dist(lane, k)).collect();
            let p_rows: Vec<&[f64]> = p.iter().map(Vec::as_slice).collect();
            let q_rows: Vec<&[f64]> = q.iter().map(Vec::as_slice).collect();
            let host = chain_verify_seeded(
                &windows[lane][1..],
                &p_rows,
                &q_rows,
                params[lane].seed,
                positions[lane] + 1,
                None,
            )
            .unwrap();
            assert_eq!(verdicts[lane].as_ref(), Some(&host), "lane {lane}");
            // The host fallback makes the same q from the device rows.
            let fallback =
                host_q(proposals[lane].q_rows.as_ref().unwrap(), m, params[lane].temperature).unwrap();
            assert_eq!(fallback, q, "lane {lane}");
        }
    }
}
