//! Lossless acceptance of a draft block: greedy matching and chain rejection sampling.
//!
//! Pure functions over host slices. Verify row `i` is the target's output after the anchor and
//! `drafts[..i]`, so it predicts the position of `drafts[i]`; a fully verified block of `γ`
//! drafts has `γ + 1` rows. Every function returns a [`Verdict`]: the accepted drafts followed
//! by one token the target chose (the bonus).
//!
//! **Verify-length cap** (SGLang semantics). With `verify_len = Some(w)` the accepted count is
//! capped at `w - 1`; when more drafts than that were accepted, the token emitted at row `w - 1`
//! is the accepted draft there (the target agreed with it), and `cap_trim` counts the accepted
//! drafts dropped by the cap. For the same coins, the committed tokens with a cap are a prefix
//! of those without one. Only rows `0..w` are then needed: callers that computed fewer than
//! `γ + 1` rows may pass any `r` rows with `w <= r <= γ`; `cap_trim` then counts only what those
//! rows accepted. Sampled verification stays lossless under a cap only if the cap is
//! predictable: whether row `c` is inside the window (`w > c`) may depend on the context and
//! `drafts[..c]`, never on `drafts[c]` or later drafts (a fixed `w`, or confidences computed
//! before those drafts were drawn, qualify); otherwise the emitted tokens are biased.

use crate::error::Error;
use crate::sampling::{Stream, coin, sample_weights};

/// Largest allowed `|Σ row − 1|` for a probability row (draft probabilities are often computed
/// in f32 over a large vocabulary).
pub const ROW_SUM_TOLERANCE: f64 = 1e-4;

/// Residual mass `Σ max(0, p − q)` at or below which a rejection samples `p` instead (DeepSpec's
/// threshold).
pub use dspark_kernels::accept::RESIDUAL_FLOOR;

/// The outcome of verifying one draft block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (after the verify-length cap).
    pub accepted: usize,
    /// The token emitted after the accepted drafts (correction, bonus or, when capped, the
    /// accepted draft at the capped row).
    pub bonus: u32,
    /// `drafts[..accepted]` followed by `bonus`.
    pub committed: Vec<u32>,
    /// Drafts the supplied rows accepted beyond the cap (raw accepted minus `accepted`).
    pub cap_trim: usize,
}

fn invalid(message: String) -> Error {
    Error::InvalidInput(message)
}

/// Check the verify length and the number of verify rows against the number of drafts.
fn check_rows(drafts: usize, rows: usize, verify_len: Option<usize>) -> Result<(), Error> {
    match verify_len {
        Some(0) => Err(invalid("verify_len must be at least 1 (the anchor row)".into())),
        _ if rows == drafts + 1 => Ok(()),
        Some(w) if w <= rows && rows <= drafts => Ok(()),
        _ => Err(invalid(format!(
            "{rows} verify rows for {drafts} drafts: expected {} (or, with verify_len w, w..={drafts})",
            drafts + 1
        ))),
    }
}

/// Apply the cap to a raw accepted count; `draw(row)` picks the target's token when uncapped.
fn finish(
    drafts: &[u32],
    raw: usize,
    verify_len: Option<usize>,
    draw: impl FnOnce(usize) -> Result<u32, Error>,
) -> Result<Verdict, Error> {
    let cap = verify_len.map_or(usize::MAX, |w| w - 1);
    let (accepted, bonus) = if raw > cap { (cap, drafts[cap]) } else { (raw, draw(raw)?) };
    let mut committed = drafts[..accepted].to_vec();
    committed.push(bonus);
    Ok(Verdict { accepted, bonus, committed, cap_trim: raw - accepted })
}

/// Greedy verification: accept the longest prefix where `drafts[i] == target_argmax[i]`; the
/// bonus is the target's argmax at the first unaccepted row.
///
/// `target_argmax` has `drafts.len() + 1` rows, or with `verify_len = Some(w)` at least `w`
/// of them (see the module docs for the cap).
///
/// # Errors
/// [`Error::InvalidInput`] for `verify_len = Some(0)` or a row count that does not fit.
pub fn greedy_verify(
    drafts: &[u32],
    target_argmax: &[u32],
    verify_len: Option<usize>,
) -> Result<Verdict, Error> {
    check_rows(drafts.len(), target_argmax.len(), verify_len)?;
    let raw = drafts.iter().zip(target_argmax).take_while(|(d, t)| d == t).count();
    finish(drafts, raw, verify_len, |row| Ok(target_argmax[row]))
}

/// Check one probability row: right length, finite non-negative entries, sum near 1.
fn check_dist(name: &str, index: usize, row: &[f64], vocab: usize) -> Result<(), Error> {
    if row.len() != vocab {
        return Err(invalid(format!("{name}[{index}] has {} entries, vocabulary is {vocab}", row.len())));
    }
    if let Some(bad) = row.iter().find(|x| !(x.is_finite() && **x >= 0.0)) {
        return Err(invalid(format!("{name}[{index}] holds {bad}, not a probability")));
    }
    let sum: f64 = row.iter().sum();
    if (sum - 1.0).abs() > ROW_SUM_TOLERANCE {
        return Err(invalid(format!("{name}[{index}] sums to {sum}, not 1")));
    }
    Ok(())
}

/// Draw at a rejected row from `max(0, p − q)`, or from `p` when that mass is negligible.
fn residual_draw(p: &[f64], q: &[f64], v: f64) -> Option<u32> {
    let residual: Vec<f64> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let mass: f64 = residual.iter().sum();
    sample_weights(if mass > RESIDUAL_FLOOR { &residual } else { p }, v)
}

/// Chain rejection sampling of a draft block sampled from `q` against the target's `p`.
///
/// Draft `s` is accepted iff `u[s] · q[s][d_s] < p[s][d_s]` (probability `min(1, p/q)`); the
/// first rejection at row `c` draws from the residual `max(0, p[c] − q[c])` with coin `v[c]` by
/// inverse CDF on the unnormalised weights ([`sample_weights`]). When every draft is accepted
/// the bonus is drawn from `p[drafts.len()]` with `v[drafts.len()]`. The committed tokens are
/// distributed exactly as sampling the target token by token.
///
/// Residual fallback: when `Σ max(0, p[c] − q[c]) <= RESIDUAL_FLOOR` (`1e-8`, p and q equal on
/// the support up to rounding, so a rejection is itself that unlikely) the draw samples `p[c]`
/// with `v[c]` instead, as DeepSpec does.
///
/// Shapes: `p` has `drafts.len() + 1` rows (or, with `verify_len = Some(w)`, `w..=drafts.len()`
/// rows, see the module docs), `q` and `u` have `drafts.len()` entries, `v` has
/// `drafts.len() + 1`. Rows are distributions over the same vocabulary; coins lie in `[0, 1]`.
///
/// # Errors
/// [`Error::InvalidInput`] for `verify_len = Some(0)`, mismatched lengths, rows that are not
/// distributions (negative, non-finite, or `|Σ − 1| > ROW_SUM_TOLERANCE`), a draft id outside
/// the vocabulary or with `q[s][d_s] = 0` (it cannot have been sampled from `q`), or a coin
/// outside `[0, 1]`.
pub fn chain_verify(
    drafts: &[u32],
    p: &[&[f64]],
    q: &[&[f64]],
    u: &[f64],
    v: &[f64],
    verify_len: Option<usize>,
) -> Result<Verdict, Error> {
    let n = drafts.len();
    check_rows(n, p.len(), verify_len)?;
    if q.len() != n || u.len() != n || v.len() != n + 1 {
        return Err(invalid(format!(
            "{n} drafts need {n} q rows, {n} accept coins and {} draw coins; got {}, {}, {}",
            n + 1,
            q.len(),
            u.len(),
            v.len()
        )));
    }
    if let Some(c) = u.iter().chain(v).find(|c| !(0.0..=1.0).contains(*c)) {
        return Err(invalid(format!("coin {c} is outside [0, 1]")));
    }
    let vocab = p[0].len();
    for (i, row) in p.iter().enumerate() {
        check_dist("p", i, row, vocab)?;
    }
    for (s, (row, &d)) in q.iter().zip(drafts).enumerate() {
        check_dist("q", s, row, vocab)?;
        match row.get(d as usize) {
            None => return Err(invalid(format!("draft {s} is token {d}, vocabulary is {vocab}"))),
            Some(&x) if x <= 0.0 => {
                return Err(invalid(format!("draft {s} (token {d}) has proposal probability 0")));
            }
            Some(_) => {}
        }
    }
    let checked = n.min(p.len());
    let raw = (0..checked)
        .take_while(|&s| {
            let d = drafts[s] as usize;
            u[s] * q[s][d] < p[s][d]
        })
        .count();
    finish(drafts, raw, verify_len, |row| {
        let token =
            if row < n { residual_draw(p[row], q[row], v[row]) } else { sample_weights(p[row], v[row]) };
        token.ok_or_else(|| invalid(format!("p[{row}] has no positive weight")))
    })
}

/// [`chain_verify`] with the request's counter-based coins: the accept coin of draft `s` is
/// `coin(seed, Stream::Accept, first_position + s)` and the draw coin of row `c` is
/// `coin(seed, Stream::TargetSample, first_position + c)`, where `first_position` is the
/// absolute position of `drafts[0]` (the position the bonus lands on when there are no drafts).
///
/// Keying coins by absolute position rather than by batch row or round makes the result
/// independent of which other requests share the batch and of the verify width: row `c`
/// decides with the same coins whether 2 or 16 rows were verified, which is why a capped verdict
/// is a prefix of the uncapped one. With no drafts it reproduces
/// [`crate::sampling::sample_token`] at that position. Reusing positions across rounds is
/// sound: every coin that influences a round's committed tokens (and how many there are) sits at
/// a position at or before the last committed one, and the next round starts after it, so it
/// only ever sees fresh coins.
///
/// # Errors
/// As [`chain_verify`], plus [`Error::InvalidInput`] when the positions overflow `usize`.
pub fn chain_verify_seeded(
    drafts: &[u32],
    p: &[&[f64]],
    q: &[&[f64]],
    seed: u64,
    first_position: usize,
    verify_len: Option<usize>,
) -> Result<Verdict, Error> {
    if first_position.checked_add(drafts.len()).is_none() {
        return Err(invalid(format!("first position {first_position} overflows")));
    }
    let pos = |i: usize| first_position + i;
    let u: Vec<f64> = (0..drafts.len()).map(|s| coin(seed, Stream::Accept, pos(s))).collect();
    let v: Vec<f64> = (0..=drafts.len()).map(|c| coin(seed, Stream::TargetSample, pos(c))).collect();
    chain_verify(drafts, p, q, &u, &v, verify_len)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::sampling::{SamplingParams, argmax, sample_token, target_probs};
    use serde_json::Value;
    use std::collections::BTreeMap;

    /// A Markov chain over a toy vocabulary: row `prev` is the next-token distribution.
    type Chain = Vec<Vec<f64>>;
    /// A verification rule under test: `(drafts, p, q, u, v) -> verdict`.
    type Rule = dyn Fn(&[u32], &[&[f64]], &[&[f64]], &[f64], &[f64]) -> Verdict;

    /// Target chain `P` and a different draft chain `Q` over 4 tokens (zeros in both).
    fn chains4() -> (Chain, Chain) {
        let p = [[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25; 4], [0.05, 0.6, 0.3, 0.05]];
        let q = [[0.2, 0.6, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.5, 0.0]];
        (p.map(Vec::from).to_vec(), q.map(Vec::from).to_vec())
    }

    fn chains3() -> (Chain, Chain) {
        let p = [[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.0, 0.5, 0.5]];
        let q = [[0.3, 0.3, 0.4], [0.5, 0.4, 0.1], [0.2, 0.2, 0.6]];
        (p.map(Vec::from).to_vec(), q.map(Vec::from).to_vec())
    }

    fn slices(rows: &[Vec<f64>]) -> Vec<&[f64]> {
        rows.iter().map(Vec::as_slice).collect()
    }

    /// The chain's rows for verify rows `0..count` after `anchor` and `drafts`.
    fn rows<'a>(chain: &'a Chain, anchor: u32, drafts: &[u32], count: usize) -> Vec<&'a [f64]> {
        let prev = |s: usize| if s == 0 { anchor } else { drafts[s - 1] } as usize;
        (0..count).map(|s| chain[prev(s)].as_slice()).collect()
    }

    fn list<T>(value: &Value, f: impl Fn(&Value) -> T) -> Vec<T> {
        value.as_array().unwrap().iter().map(f).collect()
    }

    fn token(value: &Value) -> u32 {
        value.as_u64().unwrap() as u32
    }

    fn check_golden(got: Verdict, case: &Value) {
        let e = &case["expected"];
        let want = Verdict {
            accepted: e["accepted"].as_u64().unwrap() as usize,
            bonus: token(&e["bonus"]),
            committed: list(&e["committed"], token),
            cap_trim: e["cap_trim"].as_u64().unwrap() as usize,
        };
        assert_eq!(got, want, "case {}", case["name"]);
    }

    fn verify_len(case: &Value) -> Option<usize> {
        case["verify_len"].as_u64().map(|w| w as usize)
    }

    #[test]
    fn golden_sampled_verify_cases() {
        let golden: Value =
            serde_json::from_str(include_str!("../tests/fixtures/golden/sampled_verify.json")).unwrap();
        let dists = |key: &str| list(&golden[key], |row| list(row, |x| x.as_f64().unwrap()));
        let (p, q) = (dists("p"), dists("q"));
        let (p, q) = (slices(&p), slices(&q));
        let cases = golden["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 4);
        for case in cases {
            let coins = |key: &str| list(&case[key], |x| x.as_f64().unwrap());
            let drafts = list(&case["draft_tokens"], token);
            let got = chain_verify(&drafts, &p, &q, &coins("u"), &coins("v"), verify_len(case)).unwrap();
            check_golden(got, case);
        }
    }

    #[test]
    fn golden_greedy_verify_cases() {
        let hand: Value =
            serde_json::from_str(include_str!("../tests/fixtures/golden/hand_cases.json")).unwrap();
        let cases = hand["greedy_verify"].as_array().unwrap();
        assert_eq!(cases.len(), 4);
        for case in cases {
            let (drafts, rows) =
                (list(&case["draft_tokens"], token), list(&case["target_argmax_rows"], token));
            check_golden(greedy_verify(&drafts, &rows, verify_len(case)).unwrap(), case);
        }
    }

    /// Cells `(midpoint, width)` of `[0, 1)` cut at `points`; cuts closer than 1e-13 merge.
    fn cells(mut points: Vec<f64>) -> Vec<(f64, f64)> {
        points.retain(|x| *x > 0.0 && *x < 1.0);
        points.extend([0.0, 1.0]);
        points.sort_by(f64::total_cmp);
        points.dedup_by(|later, earlier| *later - *earlier < 1e-13);
        points.windows(2).map(|w| ((w[0] + w[1]) / 2.0, w[1] - w[0])).collect()
    }

    /// Where the inverse CDF of unnormalised `weights` changes its answer.
    fn cdf_cuts(weights: &[f64]) -> Vec<f64> {
        let total: f64 = weights.iter().sum();
        weights.iter().scan(0.0, |run, w| Some((*run += w, *run / total).1)).filter(|_| total > 0.0).collect()
    }

    /// Exact distribution of the tokens one round commits after `anchor` with `gamma` drafts
    /// from chain `qc`. Draft blocks are enumerated with their q-probability. Coins are
    /// integrated exactly: the verdict is piecewise constant in each coin, with cuts at
    /// `p/q` (accept coins, so acceptance has probability `min(1, p/q)`) and at the CDF steps of
    /// `p` and of the residual `max(0, p − q)` (draw coins), so one call per product cell,
    /// weighted by the cell's volume, integrates every coin independently.
    fn round(rule: &Rule, pc: &Chain, qc: &Chain, anchor: u32, gamma: usize) -> BTreeMap<Vec<u32>, f64> {
        let vocab = pc.len();
        let mut out = BTreeMap::new();
        for index in 0..vocab.pow(gamma as u32) {
            let drafts: Vec<u32> = (0..gamma).map(|s| (index / vocab.pow(s as u32) % vocab) as u32).collect();
            let (p, q) = (rows(pc, anchor, &drafts, gamma + 1), rows(qc, anchor, &drafts, gamma));
            let weight: f64 = drafts.iter().zip(&q).map(|(&d, row)| row[d as usize]).product();
            if weight == 0.0 {
                continue;
            }
            let ratio = |s: usize| p[s][drafts[s] as usize] / q[s][drafts[s] as usize];
            let mut axes: Vec<_> = (0..gamma).map(|s| cells(vec![ratio(s)])).collect();
            for (c, pc) in p.iter().enumerate() {
                let residual: Vec<f64> = match q.get(c) {
                    Some(q) => pc.iter().zip(*q).map(|(a, b)| (a - b).max(0.0)).collect(),
                    None => vec![],
                };
                axes.push(cells([cdf_cuts(pc), cdf_cuts(&residual)].concat()));
            }
            let mut at = vec![0usize; axes.len()];
            loop {
                let coins: Vec<f64> = at.iter().zip(&axes).map(|(&i, axis)| axis[i].0).collect();
                let volume: f64 = at.iter().zip(&axes).map(|(&i, axis)| axis[i].1).product();
                let verdict = rule(&drafts, &p, &q, &coins[..gamma], &coins[gamma..]);
                *out.entry(verdict.committed).or_insert(0.0) += weight * volume;
                let Some(k) = (0..at.len()).find(|&k| at[k] + 1 < axes[k].len()) else { break };
                at[k] += 1;
                at[..k].iter_mut().for_each(|i| *i = 0);
            }
        }
        out
    }

    /// Exact distribution of the first two committed tokens after `anchor`, as `[a * V + b]`
    /// (from a second round after `a` when the first round commits one token), and the target
    /// chain's own distribution of the same two tokens.
    fn first_two(rule: &Rule, pc: &Chain, qc: &Chain, anchor: u32, gamma: usize) -> (Vec<f64>, Vec<f64>) {
        let vocab = pc.len();
        let rounds: Vec<_> = (0..vocab).map(|x| round(rule, pc, qc, x as u32, gamma)).collect();
        let first = |r: &BTreeMap<Vec<u32>, f64>, b: usize| -> f64 {
            r.iter().filter(|(c, _)| c[0] as usize == b).map(|(_, p)| p).sum()
        };
        let mut got = vec![0.0; vocab * vocab];
        for (committed, prob) in &rounds[anchor as usize] {
            let a = committed[0] as usize;
            for b in 0..vocab {
                got[a * vocab + b] += match committed.get(1) {
                    Some(&t) => prob * f64::from(u8::from(t as usize == b)),
                    None => prob * first(&rounds[a], b),
                };
            }
        }
        let want =
            (0..vocab * vocab).map(|i| pc[anchor as usize][i / vocab] * pc[i / vocab][i % vocab]).collect();
        (got, want)
    }

    /// Largest absolute difference of the first-token marginals and of the pair distributions,
    /// and the total-variation distance of the pairs.
    fn distances(rule: &Rule, pc: &Chain, qc: &Chain, anchor: u32, gamma: usize) -> (f64, f64, f64) {
        let vocab = pc.len();
        let (got, want) = first_two(rule, pc, qc, anchor, gamma);
        let marginal = |d: &[f64], a: usize| d[a * vocab..][..vocab].iter().sum::<f64>();
        let first = (0..vocab).map(|a| (marginal(&got, a) - marginal(&want, a)).abs()).fold(0.0, f64::max);
        let diffs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).collect();
        (first, diffs.iter().copied().fold(0.0, f64::max), diffs.iter().sum::<f64>() / 2.0)
    }

    fn correct(w: Option<usize>) -> Box<Rule> {
        Box::new(move |d, p, q, u, v| chain_verify(d, p, q, u, v, w).unwrap())
    }

    /// A cap chosen from `drafts[row]`: `w = 1` when it equals `token`, else 3 (no cap at γ = 2).
    fn adaptive(row: usize, token: u32) -> Box<Rule> {
        Box::new(move |d, p, q, u, v| {
            chain_verify(d, p, q, u, v, Some(if d[row] == token { 1 } else { 3 })).unwrap()
        })
    }

    #[test]
    fn exact_distribution_equals_the_target_chain() {
        // No cap, caps 1 and 2, and a predictable adaptive cap (row 1 verified depending on drafts[0]).
        let rules = [correct(None), correct(Some(1)), correct(Some(2)), adaptive(0, 1)];
        let (pc, qc) = chains4();
        for (anchor, (i, rule)) in (0..4).flat_map(|a| rules.iter().enumerate().map(move |r| (a, r))) {
            let (first, pairs, _) = distances(rule, &pc, &qc, anchor, 2);
            assert!(first < 1e-12 && pairs < 1e-12, "anchor {anchor} rule {i}: {first:e} {pairs:e}");
        }
        let (pc, qc) = chains3();
        for anchor in 0..3 {
            let (first, pairs, _) = distances(&correct(None), &pc, &qc, anchor, 3);
            assert!(first < 1e-12 && pairs < 1e-12, "γ=3 anchor {anchor}: {first:e} {pairs:e}");
        }
    }

    #[test]
    fn exact_test_rejects_broken_rules() {
        let (pc, qc) = chains4();
        // Accept every draft without the ratio test.
        let accept_all = |d: &[u32], p: &[&[f64]], _: &[&[f64]], _: &[f64], v: &[f64]| {
            let bonus = sample_weights(p[d.len()], v[d.len()]).unwrap();
            Verdict { accepted: d.len(), bonus, committed: [d, &[bonus]].concat(), cap_trim: 0 }
        };
        // Correct acceptance, but the correction drawn from p instead of the residual.
        let from_p = |d: &[u32], p: &[&[f64]], q: &[&[f64]], u: &[f64], v: &[f64]| {
            let mut r = chain_verify(d, p, q, u, v, None).unwrap();
            if r.accepted < d.len() {
                r.bonus = sample_weights(p[r.accepted], v[r.accepted]).unwrap();
                *r.committed.last_mut().unwrap() = r.bonus;
            }
            r
        };
        // A cap that depends on the draft its own row decides (drafts[1] for row 1) is biased too.
        for rule in [&accept_all as &Rule, &from_p, &*adaptive(1, 3)] {
            let (_, _, tv) = distances(rule, &pc, &qc, 0, 2);
            assert!(tv > 0.01, "a broken rule went unnoticed: TV {tv}");
        }
    }

    /// `gamma` drafts sampled from `qc` after `anchor` with the request's draft coins.
    fn draft_block(qc: &Chain, anchor: u32, gamma: usize, seed: u64, first: usize) -> Vec<u32> {
        let mut block = vec![anchor];
        for s in 0..gamma {
            let row = &qc[block[s] as usize];
            block.push(sample_weights(row, coin(seed, Stream::Draft, first + s)).unwrap());
        }
        block.split_off(1)
    }

    fn seeded_round(pc: &Chain, qc: &Chain, anchor: u32, seed: u64, first: usize) -> Verdict {
        let drafts = draft_block(qc, anchor, 3, seed, first);
        let (p, q) = (rows(pc, anchor, &drafts, 4), rows(qc, anchor, &drafts, 3));
        chain_verify_seeded(&drafts, &p, &q, seed, first, None).unwrap()
    }

    /// Pearson χ² of `counts` against `probs`; zero-probability cells must stay empty.
    fn chi2(counts: &[u64], probs: &[f64], df: usize, threshold: f64) {
        let n = counts.iter().sum::<u64>() as f64;
        let cells = counts.iter().zip(probs);
        assert!(cells.clone().all(|(&c, &p)| p > 0.0 || c == 0), "a zero-probability token was emitted");
        let terms: Vec<f64> =
            cells.filter(|(_, p)| **p > 0.0).map(|(&c, &p)| (c as f64 - n * p).powi(2) / (n * p)).collect();
        assert_eq!(terms.len() - 1, df);
        let stat: f64 = terms.iter().sum();
        assert!(stat < threshold, "χ² {stat} >= {threshold} with {df} degrees of freedom");
    }

    /// 200k seeds, γ = 3, vocabulary 4. The first committed token must follow `P[0]` and the first
    /// two `P[0][a]·P[a][b]` (a second seeded round at the next position when a round commits one
    /// token). Thresholds are the 1 − 1e-6 quantiles of χ² (df 2: 27.631, df 10: 46.863), so a
    /// correct sampler fails with probability 1e-6 per check; the seeds are fixed, so the test is
    /// deterministic.
    #[test]
    fn monte_carlo_seeded_tokens_follow_the_target() {
        let (pc, qc) = chains4();
        let first = 100;
        let mut pairs = [0u64; 16];
        for seed in 0..200_000 {
            let r = seeded_round(&pc, &qc, 0, seed, first);
            let a = r.committed[0];
            let b = match r.committed.get(1) {
                Some(&b) => b,
                None => seeded_round(&pc, &qc, a, seed, first + 1).committed[0],
            };
            pairs[(a * 4 + b) as usize] += 1;
        }
        let firsts: Vec<u64> = pairs.chunks(4).map(|c| c.iter().sum()).collect();
        chi2(&firsts, &pc[0], 2, 27.631);
        let joint: Vec<f64> = (0..16).map(|i| pc[0][i / 4] * pc[i / 4][i % 4]).collect();
        chi2(&pairs, &joint, 10, 46.863);
    }

    /// Seeded coins are `coin(seed, stream, first_position + row)`. For one coin stream (seed,
    /// positions) and one draft block: `Some(k)` commits exactly the
    /// first `min(k, len)` tokens the uncapped verdict commits, accepts `min(raw, k − 1)` drafts
    /// and trims `raw − accepted`; supplying only the `k` rows the cap needs commits the same
    /// tokens; and verifying only `drafts[..m]` agrees with the full block on the first `m`
    /// tokens (on the whole verdict when a draft among them was rejected).
    #[test]
    fn verify_len_gives_prefixes_of_the_uncapped_verdict() {
        let (pc, qc) = chains4();
        let gamma = 4;
        for seed in 0..5000 {
            let first = 37 + seed as usize % 5;
            let drafts = draft_block(&qc, 1, gamma, seed, first);
            let (p, q) = (rows(&pc, 1, &drafts, gamma + 1), rows(&qc, 1, &drafts, gamma));
            let full = chain_verify_seeded(&drafts, &p, &q, seed, first, None).unwrap();
            let coins = |stream, n: usize| -> Vec<f64> {
                (first..first + n).map(|i| coin(seed, stream, i)).collect()
            };
            let (u, v) = (coins(Stream::Accept, gamma), coins(Stream::TargetSample, gamma + 1));
            let explicit = chain_verify(&drafts, &p, &q, &u, &v, None).unwrap();
            assert_eq!(explicit, full, "coins keyed by absolute position");
            for k in 1..=gamma + 2 {
                let capped = chain_verify_seeded(&drafts, &p, &q, seed, first, Some(k)).unwrap();
                assert_eq!(capped.committed, full.committed[..k.min(full.committed.len())]);
                assert_eq!(capped.accepted, full.accepted.min(k - 1));
                assert_eq!(capped.cap_trim, full.accepted - capped.accepted);
                assert_eq!(Some(&capped.bonus), capped.committed.last());
                if k <= gamma {
                    let partial = chain_verify_seeded(&drafts, &p[..k], &q, seed, first, Some(k)).unwrap();
                    assert_eq!(partial.committed, capped.committed);
                }
            }
            for m in 0..gamma {
                let short = chain_verify_seeded(&drafts[..m], &p[..=m], &q[..m], seed, first, None).unwrap();
                if full.accepted < m {
                    assert_eq!(short, full);
                } else {
                    assert_eq!(short.committed[..m], full.committed[..m]);
                }
            }
        }
    }

    #[test]
    fn zero_drafts_and_verify_len_one() {
        // No drafts: the bonus is p[0]'s draw, i.e. plain sampling at that position.
        let logits = [0.3f32, -1.0, 2.0, 0.5, 0.0];
        for seed in 0..300 {
            let params = SamplingParams { temperature: 0.8, top_k: 4, seed, ..SamplingParams::default() };
            let p = target_probs(&logits, &params);
            let r = chain_verify_seeded(&[], &[&p], &[], seed, 9, None).unwrap();
            let t = sample_token(&logits, &params, 9);
            assert_eq!(r, Verdict { accepted: 0, bonus: t, committed: vec![t], cap_trim: 0 });
        }
        assert_eq!(greedy_verify(&[], &[7], None).unwrap().committed, [7]);
        // verify_len = 1: only the anchor row decides; the first draft if accepted, else the residual.
        let (pc, qc) = chains4();
        let (p, q) = (rows(&pc, 0, &[1, 3], 3), rows(&qc, 0, &[1, 3], 2));
        let r = chain_verify(&[1, 3], &p, &q, &[0.4, 0.9], &[0.1, 0.5, 0.95], Some(1)).unwrap();
        assert_eq!(r, Verdict { accepted: 0, bonus: 1, committed: vec![1], cap_trim: 2 });
        let r = chain_verify(&[1, 3], &p[..1], &q, &[0.6, 0.9], &[0.1, 0.5, 0.95], Some(1)).unwrap();
        assert_eq!(r, Verdict { accepted: 0, bonus: 0, committed: vec![0], cap_trim: 0 });
        for rows in [&[5, 0, 0][..], &[5], &[11, 12, 0], &[11]] {
            let r = greedy_verify(&[11, 12], rows, Some(1)).unwrap();
            assert_eq!((r.accepted, r.committed), (0, vec![rows[0]]));
        }
        let r = greedy_verify(&[11, 12, 13, 14], &[11, 12, 13], Some(3)).unwrap();
        assert_eq!(r, Verdict { accepted: 2, bonus: 13, committed: vec![11, 12, 13], cap_trim: 1 });
    }

    #[test]
    fn greedy_equals_chain_verify_on_one_hot_rows() {
        let greedy = SamplingParams::greedy(1);
        for case in 0..500u64 {
            let draw = |stream, i: usize| (coin(case, stream, i) * 5.0) as u32;
            let drafts: Vec<u32> = (0..4).map(|s| draw(Stream::Draft, s)).collect();
            // Logits whose argmax agrees with the draft about 70% of the time.
            let agree = |s| s < 4 && coin(case, Stream::Accept, s) < 0.7;
            let top = |s| if agree(s) { drafts[s] } else { draw(Stream::TargetSample, s) };
            let logit = |s, t| if t == top(s) { 2.0 } else { t as f32 / 10.0 };
            let logits: Vec<Vec<f32>> = (0..5).map(|s| (0..5).map(|t| logit(s, t)).collect()).collect();
            let argmaxes: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
            let p: Vec<Vec<f64>> = logits.iter().map(|l| target_probs(l, &greedy)).collect();
            let q: Vec<Vec<f64>> =
                drafts.iter().map(|&d| (0..5).map(|t| f64::from(u8::from(t == d))).collect()).collect();
            let (p, q) = (slices(&p), slices(&q));
            for w in [None, Some(1), Some(2), Some(4), Some(9)] {
                let chain = chain_verify_seeded(&drafts, &p, &q, case, 3, w).unwrap();
                assert_eq!(greedy_verify(&drafts, &argmaxes, w).unwrap(), chain, "case {case} cap {w:?}");
            }
        }
    }

    #[test]
    fn accept_boundary_and_negligible_residual_fallback() {
        let q = [0.5, 0.3, 0.2];
        let accepted =
            |p: &[f64], u| chain_verify(&[1], &[p, p], &[&q], &[u], &[0.1, 0.1], None).unwrap().accepted;
        // p >= q accepts even at u = 1; u · q == p rejects (strict `u · q < p`: probability p/q).
        assert_eq!((accepted(&[0.5, 0.5, 0.0], 1.0), accepted(&[0.5, 0.15, 0.35], 0.5)), (1, 0));
        // Draft 1 is rejected (u · 0.3 > p[1]); the residual mass is 1e-10 <= RESIDUAL_FLOOR.
        let p = [0.5 + 1e-10, 0.3 - 1e-10, 0.2];
        let r = chain_verify(&[1], &[&p, &p], &[&q], &[1.0 - 1e-12], &[0.9, 0.0], None).unwrap();
        assert_eq!(r.committed, [2], "p's inverse CDF at 0.9; the residual alone would give 0");
        let p = [0.6, 0.2, 0.2];
        let r = chain_verify(&[1], &[&p, &p], &[&q], &[0.999], &[0.9, 0.0], None).unwrap();
        assert_eq!(r.committed, [0], "the residual is one-hot at token 0");
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let bad = |r: Result<Verdict, Error>| assert!(matches!(r, Err(Error::InvalidInput(_))), "{r:?}");
        bad(greedy_verify(&[1], &[1], None));
        bad(greedy_verify(&[1], &[1, 2], Some(0)));
        bad(greedy_verify(&[1, 2, 3], &[1, 2], Some(3)));
        bad(greedy_verify(&[1, 2, 3], &[1, 2, 3], None));
        let (h, one) = ([0.5, 0.5], [0.0, 1.0]);
        assert!(chain_verify(&[1], &[&h, &h], &[&h], &[0.5], &[0.5, 0.5], None).is_ok());
        bad(chain_verify(&[1], &[&h], &[&h], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[&h], &[], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[&h], &[0.5], &[0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[&h], &[0.5], &[0.5, 0.5], Some(0)));
        bad(chain_verify(&[2], &[&h, &h], &[&h], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[0], &[&h, &h], &[&one], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &[0.5, 0.6]], &[&h], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &[1.5, -0.5]], &[&h], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &[f64::NAN, 1.0]], &[&h], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[&[0.5, 0.5, 0.0]], &[0.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[&h], &[1.5], &[0.5, 0.5], None));
        bad(chain_verify(&[1], &[&h, &h], &[&h], &[0.5], &[f64::NAN, 0.5], None));
        bad(chain_verify(&[], &[&[]], &[], &[], &[0.5], None));
        bad(chain_verify_seeded(&[1], &[&h, &h], &[&h], 0, usize::MAX, None));
    }

    /// Rows for the device rule's cross-check: smooth ones, and ones on a coarse grid (ties).
    fn test_rows(seed: u64, rows: usize, width: usize, coarse: bool) -> Vec<f32> {
        (0..rows * width)
            .map(|i| {
                let u = coin(seed, Stream::Draft, i);
                let x = (u * 8.0 - 4.0) as f32;
                if coarse { (x * 2.0).round() / 2.0 } else { x }
            })
            .collect()
    }

    #[test]
    fn the_device_rule_decides_as_the_host_chain() {
        use dspark_kernels::accept::{AcceptLane, accept_lane, row_distribution};
        let width = 300;
        let (mut cases, mut rejected, mut passed) = (0, 0, 0);
        for (case, (t, top_k, top_p)) in [
            (1.0f32, 0usize, 1.0f32),
            (0.7, 0, 1.0),
            (1.3, 40, 1.0),
            (1.0, 5, 1.0),
            (1.0, 0, 0.9),
            (0.8, 0, 0.5),
            (1.0, 50, 0.8),
            (2.0, 3, 0.95),
        ]
        .into_iter()
        .enumerate()
        {
            for (trial, coarse) in [false, true, false, true].into_iter().enumerate() {
                let seed = (case * 16 + trial) as u64;
                let m = 1 + (case + trial) % 5;
                let p_rows = test_rows(seed, m + 1, width, coarse);
                // The proposal is the target's rows, perturbed: most drafts pass, some do not.
                let noise = test_rows(seed + 1000, m, width, false);
                let q_rows: Vec<f32> =
                    p_rows[..m * width].iter().zip(&noise).map(|(a, b)| a + b / 6.0).collect();
                let params =
                    SamplingParams { temperature: t, top_k, top_p, seed, ..SamplingParams::default() };
                let q_params = SamplingParams { temperature: t, ..SamplingParams::default() };
                let row = |x: &[f32], r: usize| x[r * width..(r + 1) * width].to_vec();
                let p: Vec<Vec<f64>> = (0..=m).map(|r| target_probs(&row(&p_rows, r), &params)).collect();
                let q: Vec<Vec<f64>> = (0..m).map(|r| target_probs(&row(&q_rows, r), &q_params)).collect();
                // The device's distributions are the host's, up to rounding.
                for (r, host_row) in p.iter().enumerate() {
                    let d = row_distribution(&row(&p_rows, r), t, top_k, top_p);
                    for (a, b) in d.iter().zip(host_row) {
                        assert!((a > &0.0) == (b > &0.0) && (a - b).abs() < 1e-12, "case {case}: {a} vs {b}");
                    }
                }
                // Drafts drawn from q, so that some are accepted and some not.
                let drafts: Vec<u32> = (0..m)
                    .map(|r| {
                        crate::sampling::sample_weights(&q[r], coin(seed, Stream::Draft, 10_000 + r)).unwrap()
                    })
                    .collect();
                let position = 17 + trial;
                let host =
                    chain_verify_seeded(&drafts, &slices(&p), &slices(&q), seed, position, None).unwrap();
                let lane = AcceptLane {
                    p_row: 0,
                    q_row: 0,
                    drafts: drafts.clone(),
                    temperature: t,
                    top_k,
                    top_p,
                    accept_coins: (0..m).map(|s| coin(seed, Stream::Accept, position + s)).collect(),
                    draw_coins: (0..=m).map(|c| coin(seed, Stream::TargetSample, position + c)).collect(),
                };
                let (accepted, token) = accept_lane(&p_rows, &q_rows, width, &lane);
                assert_eq!((accepted, token), (host.accepted, host.bonus), "case {case} trial {trial}");
                cases += 1;
                rejected += usize::from(accepted < m);
                passed += accepted;
            }
        }
        // Both outcomes were exercised.
        assert!(
            rejected > 3 && rejected < cases && passed > 10,
            "{rejected} of {cases} rejected, {passed} passed"
        );
    }
}
