//! Sampling parameters, counter-based random coins, and the target's sampling distribution.
//!
//! Everything here works on host slices of one logits row. Coins are a pure function of
//! `(seed, stream, position)`, so a request's samples never depend on which other requests share
//! its batch or on how many rows a round computed.

use crate::error::{Error, Result};

/// Per-request decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (ties at the boundary kept); `0` disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p`; `1` disables.
    pub top_p: f32,
    /// Seed of the request's coins.
    pub seed: u64,
    /// Generation ends after any of these tokens (which is emitted).
    pub stop_token_ids: Vec<u32>,
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop_token_ids: Vec::new(),
            max_new_tokens: 64,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self { max_new_tokens, ..Self::default() }
    }

    /// Whether this request decodes greedily.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Check ranges.
    ///
    /// # Errors
    /// [`Error::InvalidSampling`] for a negative or non-finite temperature, or `top_p` outside
    /// `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::InvalidSampling(format!(
                "temperature {} must be finite and >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidSampling(format!("top_p {} must be in (0, 1]", self.top_p)));
        }
        Ok(())
    }
}

/// Independent random streams of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
#[non_exhaustive]
pub enum Stream {
    /// Drawing a token from the target's distribution.
    TargetSample = 1,
    /// The accept/reject coin of a draft token.
    Accept = 2,
    /// Drawing a draft token from the proposal.
    Draft = 3,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform coin in `[0, 1)` determined by `(seed, stream, position)` alone.
///
/// `position` is the absolute position of the token the coin decides.
pub fn coin(seed: u64, stream: Stream, position: usize) -> f64 {
    let a = splitmix64(seed ^ splitmix64(stream as u64));
    let b = splitmix64(a ^ splitmix64(position as u64).rotate_left(17));
    // 53 random bits -> [0, 1).
    (b >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Index of the largest value; the lowest index wins ties; NaN never wins.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best as u32
}

/// Inverse-CDF draw on unnormalised non-negative weights: the first index whose running sum
/// exceeds `u · Σ weights`. Falls back to the last positive weight when rounding leaves `u · Σ`
/// unreached; `None` when every weight is zero. The device kernels' host bodies use the same rule
/// ([`dspark_kernels::accept::draw_weights`]).
pub fn sample_weights(weights: &[f64], u: f64) -> Option<u32> {
    dspark_kernels::accept::draw_weights(weights, u)
}

/// The distribution the target samples from: `softmax(logits / T)` restricted by top-k, then
/// top-p (the Hugging Face order), renormalised, as f64 probabilities over the whole vocabulary
/// (zeros for removed tokens). Greedy parameters give the one-hot of the argmax.
pub fn target_probs(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let mut probs = vec![0.0f64; logits.len()];
    if logits.is_empty() {
        return probs;
    }
    if params.is_greedy() {
        probs[argmax(logits) as usize] = 1.0;
        return probs;
    }
    let inv_t = 1.0 / f64::from(params.temperature);
    // 1. top-k threshold on the raw logits (temperature preserves order).
    let mut floor = f32::NEG_INFINITY;
    if params.top_k > 0 && params.top_k < logits.len() {
        let mut copy: Vec<f32> =
            logits.iter().map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v }).collect();
        let k = params.top_k - 1;
        copy.select_nth_unstable_by(k, |a, b| b.total_cmp(a));
        floor = copy[k];
    }
    // 2. softmax over the survivors, in f64.
    let max = logits.iter().copied().filter(|v| *v >= floor).fold(f32::NEG_INFINITY, f32::max);
    let total = fill_and_sum(&mut probs, |i| {
        let l = logits[i];
        if l >= floor && l.is_finite() { ((f64::from(l) - f64::from(max)) * inv_t).exp() } else { 0.0 }
    });
    if total <= 0.0 || !total.is_finite() {
        probs.iter_mut().for_each(|p| *p = 0.0);
        probs[argmax(logits) as usize] = 1.0;
        return probs;
    }
    divide_all(&mut probs, total);
    // 3. top-p: keep a token iff the mass ranked strictly above it is below top_p.
    if params.top_p < 1.0 {
        let order = top_by_mass(&probs, f64::from(params.top_p));
        let mut keep = vec![false; probs.len()];
        let mut above = 0.0;
        for &i in &order {
            if above >= f64::from(params.top_p) {
                break;
            }
            keep[i] = true;
            above += probs[i];
        }
        let mut kept = 0.0;
        for (p, k) in probs.iter_mut().zip(&keep) {
            if *k {
                kept += *p;
            } else {
                *p = 0.0;
            }
        }
        probs.iter_mut().for_each(|p| *p /= kept);
    }
    probs
}

/// The most likely token ids in descending probability (ties: lower id first), enough of them
/// to reach `mass`. Grows a partial selection instead of sorting the whole vocabulary.
fn top_by_mass(probs: &[f64], mass: f64) -> Vec<usize> {
    let by_rank = |a: &usize, b: &usize| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b));
    let mut m = 64.min(probs.len());
    loop {
        let mut ids: Vec<usize> = (0..probs.len()).collect();
        if m < ids.len() {
            ids.select_nth_unstable_by(m - 1, by_rank);
            ids.truncate(m);
        }
        ids.sort_unstable_by(by_rank);
        let covered: f64 = ids.iter().map(|&i| probs[i]).sum();
        if covered >= mass || m == probs.len() {
            return ids;
        }
        m = (m * 4).min(probs.len());
    }
}

/// [`target_probs`] of several rows (a verify window's), the rows spread over threads when they
/// are long (`map_rows`): the result is the sequential map's, bit for bit. A 151 936-wide row
/// takes about a millisecond on one core, and a sampled verify window has γ + 1 of them.
pub fn target_probs_rows(rows: &[&[f32]], params: &SamplingParams) -> Vec<Vec<f64>> {
    if params.is_greedy() {
        return rows.iter().map(|r| target_probs(r, params)).collect();
    }
    let elements = rows.iter().map(|r| r.len()).sum();
    map_rows(rows, elements, |r| target_probs(r, params))
}

/// `items.iter().map(f)`, spread over threads when the work (`elements` values in all) is large
/// enough to pay for them; each item is computed exactly as alone, so the result does not
/// depend on the number of threads.
pub(crate) fn map_rows<T: Sync, R: Send>(items: &[T], elements: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    use rayon::prelude::*;
    if items.len() < 2 || elements < PARALLEL_ELEMENTS {
        return items.iter().map(f).collect();
    }
    items.par_iter().map(&f).collect()
}

/// Values below which threads cost more than they save.
const PARALLEL_ELEMENTS: usize = 1 << 16;
/// Values of a row per chunk of [`fill_and_sum`]: its sum is made chunk by chunk, then over the
/// chunks in order, so it does not depend on the number of threads (and a row of at most this
/// many values is summed in plain index order).
const SUM_CHUNK: usize = 8192;

/// `out[i] = f(i)` for every `i`, returning `Σ out` (each chunk of [`SUM_CHUNK`] values in index
/// order, then the chunks' sums in order); chunks run over threads for long rows. A 151 936-wide
/// f64 softmax takes about 2.6 ms on one core.
pub(crate) fn fill_and_sum(out: &mut [f64], f: impl Fn(usize) -> f64 + Sync) -> f64 {
    use rayon::prelude::*;
    let chunk_sum = |(c, chunk): (usize, &mut [f64])| {
        let mut sum = 0.0;
        for (j, o) in chunk.iter_mut().enumerate() {
            *o = f(c * SUM_CHUNK + j);
            sum += *o;
        }
        sum
    };
    let sums: Vec<f64> = if out.len() < PARALLEL_ELEMENTS {
        out.chunks_mut(SUM_CHUNK).enumerate().map(chunk_sum).collect()
    } else {
        out.par_chunks_mut(SUM_CHUNK).enumerate().map(chunk_sum).collect()
    };
    sums.iter().sum()
}

/// `x /= total` for every value (over threads for long rows).
pub(crate) fn divide_all(values: &mut [f64], total: f64) {
    use rayon::prelude::*;
    if values.len() < PARALLEL_ELEMENTS {
        values.iter_mut().for_each(|x| *x /= total);
    } else {
        values.par_chunks_mut(SUM_CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x /= total));
    }
}

/// Draw the next token from one logits row at absolute `position`.
pub fn sample_token(logits: &[f32], params: &SamplingParams, position: usize) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    let probs = target_probs(logits, params);
    let u = coin(params.seed, Stream::TargetSample, position);
    sample_weights(&probs, u).unwrap_or_else(|| argmax(logits))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, ..SamplingParams::default() }
    }

    #[test]
    fn rows_spread_over_threads_equal_the_sequential_map() {
        let width = 40_000;
        let rows: Vec<Vec<f32>> = (0..5)
            .map(|r| (0..width).map(|i| ((i * 7919 + r * 104_729) % 1013) as f32 / 97.0 - 5.0).collect())
            .collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        for params in [sampled(0.7, 0, 1.0), sampled(1.0, 50, 0.9), SamplingParams::greedy(4)] {
            let seq: Vec<Vec<f64>> = refs.iter().map(|r| target_probs(r, &params)).collect();
            assert_eq!(target_probs_rows(&refs, &params), seq);
        }
        assert!(target_probs_rows(&[], &sampled(1.0, 0, 1.0)).is_empty());
    }

    #[test]
    fn long_rows_are_summed_chunk_by_chunk_whatever_the_threads() {
        let f = |i: usize| ((i * 7919 % 10_007) as f64 / 1000.0 - 5.0).exp();
        for len in [5usize, SUM_CHUNK, 3 * SUM_CHUNK + 17, 151_936] {
            let mut out = vec![0.0; len];
            let total = fill_and_sum(&mut out, f);
            // The same order by hand: each chunk in index order, then the chunks in order.
            let chunks: Vec<f64> = (0..len)
                .collect::<Vec<_>>()
                .chunks(SUM_CHUNK)
                .map(|c| c.iter().fold(0.0, |s, &i| s + f(i)))
                .collect();
            assert_eq!(total.to_bits(), chunks.iter().sum::<f64>().to_bits(), "len {len}");
            assert!(out.iter().enumerate().all(|(i, &v)| v == f(i)), "len {len}");
            if len <= SUM_CHUNK {
                assert_eq!(total, (0..len).map(f).sum::<f64>(), "a short row is summed in index order");
            }
            divide_all(&mut out, total);
            assert!((out.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        }
    }

    #[test]
    fn argmax_prefers_lowest_index_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
    }

    #[test]
    fn coins_are_uniform_enough_and_independent_of_call_order() {
        let n = 20000;
        let mean: f64 = (0..n).map(|p| coin(7, Stream::TargetSample, p)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert_eq!(coin(7, Stream::Accept, 11), coin(7, Stream::Accept, 11));
        assert_ne!(coin(7, Stream::Accept, 11), coin(7, Stream::Draft, 11));
        assert_ne!(coin(7, Stream::Accept, 11), coin(8, Stream::Accept, 11));
        assert!((0..n).all(|p| (0.0..1.0).contains(&coin(3, Stream::Draft, p))));
    }

    #[test]
    fn inverse_cdf_matches_the_golden_convention() {
        let w = [0.5, 0.3, 0.2, 0.0];
        assert_eq!(sample_weights(&w, 0.1), Some(0));
        assert_eq!(sample_weights(&w, 0.5), Some(1));
        assert_eq!(sample_weights(&w, 0.95), Some(2));
        assert_eq!(sample_weights(&[0.0, 0.0], 0.3), None);
        // Never lands on a zero-weight token, even at u just below 1.
        assert_eq!(sample_weights(&w, 0.999_999_999), Some(2));
    }

    #[test]
    fn temperature_softmax_by_hand() {
        let p = target_probs(&[0.0, 1.0_f32.ln(), 2.0_f32.ln(), 1.0_f32.ln()], &sampled(1.0, 0, 1.0));
        // weights 1, 1, 2, 1 -> /5
        let expected = [0.2, 0.2, 0.4, 0.2];
        for (a, b) in p.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{p:?}");
        }
        let p = target_probs(&[0.0, 2.0_f32.ln()], &sampled(0.5, 0, 1.0));
        // logits / 0.5 -> weights 1, 4
        assert!((p[1] - 0.8).abs() < 1e-6);
    }

    #[test]
    fn top_k_keeps_ties_at_the_boundary() {
        let p = target_probs(&[3.0, 1.0, 2.0, 2.0, 0.0], &sampled(1.0, 2, 1.0));
        assert!(p[0] > 0.0 && p[2] > 0.0 && p[3] > 0.0);
        assert_eq!((p[1], p[4]), (0.0, 0.0));
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // probs 0.5, 0.3, 0.15, 0.05
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let p = target_probs(&logits, &sampled(1.0, 0, 0.75));
        // mass above token 1 is 0.5 < 0.75: kept; above token 2 is 0.8: removed.
        assert!((p[0] - 0.5 / 0.8).abs() < 1e-6 && (p[1] - 0.3 / 0.8).abs() < 1e-6);
        assert_eq!((p[2], p[3]), (0.0, 0.0));
        let p = target_probs(&logits, &sampled(1.0, 0, 0.85));
        assert!(p[2] > 0.0 && p[3] == 0.0);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_needs_no_full_sort_but_agrees_with_one() {
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 1000) as f32 / 97.0).collect();
        let params = sampled(0.7, 0, 0.9);
        let p = target_probs(&logits, &params);
        // Reference: full sort.
        let full = target_probs(&logits, &sampled(0.7, 0, 1.0));
        let mut ids: Vec<usize> = (0..full.len()).collect();
        ids.sort_by(|a, b| full[*b].total_cmp(&full[*a]).then(a.cmp(b)));
        let mut above = 0.0;
        let mut kept = vec![false; full.len()];
        for i in ids {
            if above >= 0.9 {
                break;
            }
            kept[i] = true;
            above += full[i];
        }
        for i in 0..p.len() {
            assert_eq!(p[i] > 0.0, kept[i], "token {i}");
        }
    }

    #[test]
    fn validation_rejects_bad_ranges() {
        assert!(sampled(-1.0, 0, 1.0).validate().is_err());
        assert!(sampled(f32::NAN, 0, 1.0).validate().is_err());
        assert!(sampled(1.0, 0, 0.0).validate().is_err());
        assert!(sampled(1.0, 0, 1.5).validate().is_err());
        assert!(sampled(1.0, 5, 0.9).validate().is_ok());
    }
}
