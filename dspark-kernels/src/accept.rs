//! Chain rejection sampling on the device: the rule, its host body, and the words that carry a
//! round's lanes to the kernel (see [`crate::chain_accept`]).
//!
//! A lane verifies `m` drafts `d_0 .. d_{m−1}` sampled from the proposal rows `q_0 .. q_{m−1}`
//! (`softmax(x / T)` over the whole row) against the target rows `p_0 .. p_m` (`softmax(x / T)`
//! restricted by top-k, then top-p, renormalised). Draft `j` is accepted iff
//! `u_j · q_j(d_j) < p_j(d_j)`; the first rejection at row `c` draws from the residual
//! `max(0, p_c − q_c)` with coin `v_c` (from `p_c` when the residual's mass is at most
//! [`RESIDUAL_FLOOR`]); when all `m` are accepted the bonus is drawn from `p_m` with `v_m`.
//! Draws are inverse-CDF on unnormalised weights: the first index whose running sum exceeds
//! `v · Σ` with a positive weight, the last positive weight when rounding leaves `v · Σ`
//! unreached.
//!
//! **The target's distribution, exactly.** Weights are f64 `exp((x_i − M) / T)` with `M` the
//! row's largest value, for finite `x_i` only. A row that holds `+∞`, that has no finite value, or
//! whose temperature is 0 is the one-hot of its argmax (lowest index on ties, NaN skipped).
//! Values are ranked by the order-preserving key of their f32 bits ([`key`]: NaN ranked with
//! −∞, −0 with +0):
//! - top-k (`0 < k < width`): keep keys at or above the `k`-th largest key (ties at the boundary
//!   kept);
//! - top-p (`p < 1`): among those, with `Z` the kept weights' sum, let `B` be the largest key
//!   whose kept mass at or above it reaches `p · Z` and `f` the kept mass strictly above `B`;
//!   keep every key above `B` and, of the `c_B` tokens at `B`, the
//!   `clamp(⌈(p·Z − f) / w_B⌉, 1, c_B)` lowest ids. That is the nucleus "keep a token iff the
//!   mass ranked strictly above it (by probability, then id) is below `p`" up to f64 rounding;
//! - `p_i = w_i / S` over the kept tokens, `S` their sum.
//!
//! The host body sums in index order; the kernel in a fixed order of its own. The two therefore
//! differ by f64 rounding only, and a decision can differ only where a comparison is that close.

use burn::tensor::{Int, Tensor, TensorData};

/// Residual mass `Σ max(0, p − q)` at or below which a rejection samples `p` instead.
pub const RESIDUAL_FLOOR: f64 = 1e-8;

/// Words of a lane before its per-draft entries.
pub const LANE_HEADER: usize = 6;
/// Words per draft entry: the draft, its accept coin (2 words), the row's draw coin (2 words).
pub const ENTRY_WORDS: usize = 5;

/// One lane of [`crate::chain_accept`].
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptLane {
    /// Row of the target logits `p` that verifies the first draft (`m + 1` consecutive rows).
    pub p_row: usize,
    /// Row of the proposal logits `q` the first draft was drawn from (`m` consecutive rows).
    pub q_row: usize,
    /// The drafts `d_0 .. d_{m−1}`.
    pub drafts: Vec<u32>,
    /// The lane's temperature (> 0).
    pub temperature: f32,
    /// Target top-k (0: off).
    pub top_k: usize,
    /// Target top-p (1: off).
    pub top_p: f32,
    /// `u_j`, one per draft, in `[0, 1)`.
    pub accept_coins: Vec<f64>,
    /// `v_j`, one per target row (`m + 1`), in `[0, 1)`.
    pub draw_coins: Vec<f64>,
}

/// A coin in `[0, 1)` on the 2⁻⁵³ grid as two index words (high 26, low 27 bits).
/// The packing of [`crate::reference::draw_words`], whose last two words these are.
fn coin_words(u: f64) -> [i64; 2] {
    let [_, hi, lo] = crate::reference::draw_words(1.0, u);
    [hi, lo]
}

/// The coin two words carry (see [`coin_words`]).
fn coin_of(hi: i64, lo: i64) -> f64 {
    crate::reference::draw_params([0, hi, lo]).1
}

/// A coin as the kernel sees it: on the 2⁻⁵³ grid.
pub fn grid_coin(u: f64) -> f64 {
    let [hi, lo] = coin_words(u);
    coin_of(hi, lo)
}

/// The three words of one row's distribution: temperature bits (0: one-hot argmax), top-k, top-p
/// bits.
pub fn row_words(temperature: f32, top_k: usize, top_p: f32) -> [i64; 3] {
    let t = if temperature > 0.0 { temperature.to_bits() } else { 0 };
    [i64::from(t), top_k.min(i32::MAX as usize) as i64, i64::from(top_p.to_bits())]
}

/// Words per lane for blocks of at most `gamma` drafts.
pub fn lane_stride(gamma: usize) -> usize {
    LANE_HEADER + ENTRY_WORDS * (gamma + 1)
}

/// The inputs of [`crate::chain_accept`] for `p_rows` target rows and `q_rows` proposal rows:
/// the row words `[(p_rows + q_rows)·3]` (target rows with their lane's settings, proposal rows
/// with the lane's temperature alone, rows of no lane as one-hot) and the lane words
/// `[lanes · lane_stride(gamma)]`.
///
/// # Panics
/// If a lane has more than `gamma` drafts, coins of the wrong count, or rows outside the given
/// counts.
pub fn accept_words(
    lanes: &[AcceptLane],
    p_rows: usize,
    q_rows: usize,
    gamma: usize,
) -> (Vec<i64>, Vec<i64>) {
    let mut rows = vec![0i64; 3 * (p_rows + q_rows)];
    let stride = lane_stride(gamma);
    let mut words = vec![0i64; stride * lanes.len()];
    for (l, lane) in lanes.iter().enumerate() {
        let m = lane.drafts.len();
        assert!(m <= gamma, "lane {l}: {m} drafts, at most {gamma}");
        assert_eq!(lane.accept_coins.len(), m, "lane {l}: accept coins");
        assert_eq!(lane.draw_coins.len(), m + 1, "lane {l}: draw coins");
        assert!(lane.p_row + m < p_rows && (m == 0 || lane.q_row + m <= q_rows), "lane {l}: rows");
        for j in 0..=m {
            let r = lane.p_row + j;
            rows[3 * r..3 * r + 3].copy_from_slice(&row_words(lane.temperature, lane.top_k, lane.top_p));
        }
        for j in 0..m {
            let r = p_rows + lane.q_row + j;
            rows[3 * r..3 * r + 3].copy_from_slice(&row_words(lane.temperature, 0, 1.0));
        }
        let w = &mut words[l * stride..(l + 1) * stride];
        w[..LANE_HEADER].copy_from_slice(&[
            lane.p_row as i64,
            lane.q_row as i64,
            m as i64,
            i64::from(lane.temperature.to_bits()),
            lane.top_k.min(i32::MAX as usize) as i64,
            i64::from(lane.top_p.to_bits()),
        ]);
        for j in 0..=m {
            let e = &mut w[LANE_HEADER + ENTRY_WORDS * j..LANE_HEADER + ENTRY_WORDS * (j + 1)];
            let u = if j < m { coin_words(lane.accept_coins[j]) } else { [0, 0] };
            let v = coin_words(lane.draw_coins[j]);
            e.copy_from_slice(&[if j < m { i64::from(lane.drafts[j]) } else { 0 }, u[0], u[1], v[0], v[1]]);
        }
    }
    (rows, words)
}

/// The order-preserving key of an f32: larger values have larger keys; NaN has the key of −∞
/// and −0 that of +0 (equal values, equal keys).
pub fn key(v: f32) -> u32 {
    let v = if v.is_nan() {
        f32::NEG_INFINITY
    } else if v == 0.0 {
        0.0
    } else {
        v
    };
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 }
}

/// The distribution of one row under the rule of the module docs, as f64 probabilities (zeros
/// for removed tokens).
pub fn row_distribution(x: &[f32], temperature: f32, top_k: usize, top_p: f32) -> Vec<f64> {
    let mut out = vec![0.0f64; x.len()];
    if x.is_empty() {
        return out;
    }
    let (mut best, mut best_value) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    if temperature <= 0.0 || !best_value.is_finite() {
        out[best] = 1.0;
        return out;
    }
    let (m, t) = (f64::from(best_value), f64::from(temperature));
    let keys: Vec<u32> = x.iter().map(|&v| key(v)).collect();
    // top-k: the k-th largest key.
    let floor = if top_k > 0 && top_k < x.len() {
        let mut sorted = keys.clone();
        sorted.select_nth_unstable_by(top_k - 1, |a, b| b.cmp(a));
        sorted[top_k - 1]
    } else {
        0
    };
    let weight = |i: usize| {
        if x[i].is_finite() && keys[i] >= floor { ((f64::from(x[i]) - m) / t).exp() } else { 0.0 }
    };
    let w: Vec<f64> = (0..x.len()).map(weight).collect();
    let z: f64 = w.iter().sum();
    let (mut boundary, mut cutoff) = (floor, u32::MAX);
    if top_p < 1.0 {
        let goal = f64::from(top_p) * z;
        // Kept ids by key, descending; a key's group is contiguous.
        let mut ids: Vec<usize> = (0..x.len()).filter(|&i| x[i].is_finite() && keys[i] >= floor).collect();
        ids.sort_by(|a, b| keys[*b].cmp(&keys[*a]).then(a.cmp(b)));
        let (mut above, mut g) = (0.0f64, 0usize);
        let mut found = None;
        while g < ids.len() {
            let k = keys[ids[g]];
            let end = ids[g..].iter().position(|&i| keys[i] != k).map_or(ids.len(), |e| g + e);
            let mass: f64 = ids[g..end].iter().map(|&i| w[i]).sum();
            if above + mass >= goal {
                found = Some((k, g, end, above));
                break;
            }
            above += mass;
            g = end;
        }
        if let Some((k, g, end, f)) = found {
            boundary = k;
            let ties = end - g;
            let wb = w[ids[g]];
            let n = ((goal - f) / wb).ceil().clamp(1.0, ties as f64) as usize;
            if n < ties {
                cutoff = ids[g + n - 1] as u32;
            }
        }
    }
    let kept = |i: usize| {
        x[i].is_finite()
            && keys[i] >= floor
            && (keys[i] > boundary || (keys[i] == boundary && i as u32 <= cutoff))
    };
    let s: f64 = (0..x.len()).filter(|&i| kept(i)).map(|i| w[i]).sum();
    for (i, o) in out.iter_mut().enumerate() {
        if kept(i) {
            *o = w[i] / s;
        }
    }
    out
}

/// Inverse-CDF draw on unnormalised weights: the first index whose running sum exceeds
/// `v · Σ weights` with a positive weight; the last positive weight when rounding leaves `v · Σ`
/// unreached; `None` when the sum is not positive or not a number. The rule of every draw in
/// this crate and in the host passes.
pub fn draw_weights(weights: &[f64], v: f64) -> Option<u32> {
    let total: f64 = weights.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let goal = v * total;
    let (mut running, mut last) = (0.0f64, None);
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last = Some(i as u32);
        }
        running += w;
        if running > goal && w > 0.0 {
            return Some(i as u32);
        }
    }
    last
}

/// One lane's outcome: `(accepted, token)`, where `token` is the draw at the first rejection, or
/// the bonus. `p` and `q` are the rows of the whole call (`width` values each); the coins are
/// taken on the kernel's 2⁻⁵³ grid.
pub fn accept_lane(p: &[f32], q: &[f32], width: usize, lane: &AcceptLane) -> (usize, u32) {
    let m = lane.drafts.len();
    let row = |x: &[f32], r: usize| x[r * width..(r + 1) * width].to_vec();
    let target =
        |j: usize| row_distribution(&row(p, lane.p_row + j), lane.temperature, lane.top_k, lane.top_p);
    let proposal = |j: usize| row_distribution(&row(q, lane.q_row + j), lane.temperature, 0, 1.0);
    let mut c = 0;
    while c < m {
        let d = lane.drafts[c] as usize;
        let (pd, qd) = (target(c)[d], proposal(c)[d]);
        if grid_coin(lane.accept_coins[c]) * qd < pd {
            c += 1;
        } else {
            break;
        }
    }
    let pc = target(c);
    let v = grid_coin(lane.draw_coins[c]);
    let token = if c < m {
        let qc = proposal(c);
        let residual: Vec<f64> = pc.iter().zip(&qc).map(|(a, b)| (a - b).max(0.0)).collect();
        let mass: f64 = residual.iter().sum();
        draw_weights(if mass > RESIDUAL_FLOOR { &residual } else { &pc }, v)
    } else {
        draw_weights(&pc, v)
    };
    let fallback = pc.iter().position(|&x| x > 0.0).unwrap_or(0) as u32;
    (c, token.unwrap_or(fallback))
}

/// The host body of [`crate::chain_accept`]: everything is read back and each lane decided by
/// [`accept_lane`] (the row words are implied by the lanes).
///
/// # Panics
/// If a tensor cannot be read back (a device error) or the words are malformed.
pub fn chain_accept(p: Tensor<2>, q: Tensor<2>, lanes: Tensor<2, Int>) -> Tensor<2, Int> {
    let width = p.dims()[1];
    let device = p.device();
    let read = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 rows");
    let (p, q) = (read(p), read(q));
    let [count, stride] = lanes.dims();
    let words = lanes.into_data().convert::<i64>().try_to_vec::<i64>().expect("lane words");
    let out: Vec<i64> = words
        .chunks(stride.max(1))
        .take(count)
        .flat_map(|w| {
            let m = w[2] as usize;
            let entry = |j: usize| &w[LANE_HEADER + ENTRY_WORDS * j..LANE_HEADER + ENTRY_WORDS * (j + 1)];
            let lane = AcceptLane {
                p_row: w[0] as usize,
                q_row: w[1] as usize,
                drafts: (0..m).map(|j| entry(j)[0] as u32).collect(),
                temperature: f32::from_bits(w[3] as u32),
                top_k: w[4] as usize,
                top_p: f32::from_bits(w[5] as u32),
                accept_coins: (0..m).map(|j| coin_of(entry(j)[1], entry(j)[2])).collect(),
                draw_coins: (0..=m).map(|j| coin_of(entry(j)[3], entry(j)[4])).collect(),
            };
            let (c, token) = accept_lane(&p, &q, width, &lane);
            [c as i64, i64::from(token)]
        })
        .collect();
    Tensor::from_data(TensorData::new(out, [count, 2]), &device)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keys_order_values() {
        let values = [f32::NEG_INFINITY, -3.5, -1e-30, 0.0, 1e-30, 2.0, f32::MAX, f32::INFINITY];
        for w in values.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{w:?}");
        }
        assert_eq!(key(f32::NAN), key(f32::NEG_INFINITY));
        assert_eq!(key(-0.0), key(0.0));
    }

    #[test]
    fn distributions_by_hand() {
        // weights 1, 1, 2, 1 at T = 1.
        let x = [0.0f32, 0.0, 2.0f32.ln(), 0.0];
        let d = row_distribution(&x, 1.0, 0, 1.0);
        assert!(d.iter().zip([0.2, 0.2, 0.4, 0.2]).all(|(a, b)| (a - b).abs() < 1e-7), "{d:?}");
        // top-k 2 keeps the ties at the boundary: all four.
        assert!(row_distribution(&x, 1.0, 2, 1.0).iter().all(|&p| p > 0.0));
        let d = row_distribution(&[3.0, 1.0, 2.0, 2.0, 0.0], 1.0, 2, 1.0);
        assert!(d[0] > 0.0 && d[2] > 0.0 && d[3] > 0.0 && d[1] == 0.0 && d[4] == 0.0);
        // top-p over probabilities 0.5, 0.3, 0.15, 0.05.
        let x: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let d = row_distribution(&x, 1.0, 0, 0.75);
        assert!((d[0] - 0.625).abs() < 1e-6 && (d[1] - 0.375).abs() < 1e-6 && d[2] == 0.0 && d[3] == 0.0);
        assert!(row_distribution(&x, 1.0, 0, 0.85)[2] > 0.0);
        // Ties at the top-p boundary: four equal tokens, p = 0.6 keeps the three lowest ids
        // (mass above the third is 0.5 < 0.6, above the fourth 0.75).
        let d = row_distribution(&[1.0; 4], 1.0, 0, 0.6);
        assert!(d[..3].iter().all(|&p| (p - 1.0 / 3.0).abs() < 1e-12) && d[3] == 0.0, "{d:?}");
        // p = 0.5 exactly: mass above the third tie is 0.5, not below: two kept.
        let d = row_distribution(&[1.0; 4], 1.0, 0, 0.5);
        assert_eq!(d.iter().filter(|&&p| p > 0.0).count(), 2);
        // One-hot rows: T = 0, +∞, nothing finite.
        assert_eq!(row_distribution(&[1.0, 3.0, 3.0], 0.0, 0, 1.0), vec![0.0, 1.0, 0.0]);
        assert_eq!(row_distribution(&[1.0, f32::INFINITY, 2.0], 1.0, 0, 1.0), vec![0.0, 1.0, 0.0]);
        assert_eq!(row_distribution(&[f32::NAN, f32::NEG_INFINITY], 1.0, 0, 1.0), vec![1.0, 0.0]);
        // −∞ and NaN are never kept.
        let d = row_distribution(&[0.0, f32::NEG_INFINITY, f32::NAN, 0.0], 1.0, 0, 1.0);
        assert_eq!(d, vec![0.5, 0.0, 0.0, 0.5]);
    }

    #[test]
    fn a_lane_by_hand() {
        // p: 0.5, 0.5, 0; q: 0.25, 0.25, 0.5 (as logits at T = 1).
        let ln = |v: f64| if v > 0.0 { v.ln() as f32 } else { f32::NEG_INFINITY };
        let p: Vec<f32> = [0.5, 0.5, 0.0, 0.0, 0.0, 1.0].map(ln).to_vec();
        let q: Vec<f32> = [0.25, 0.25, 0.5].map(ln).to_vec();
        let lane = |draft: u32, u: f64, v: [f64; 2]| AcceptLane {
            p_row: 0,
            q_row: 0,
            drafts: vec![draft],
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            accept_coins: vec![u],
            draw_coins: v.to_vec(),
        };
        // p/q = 2 at token 0: accepted whatever the coin; the bonus from row 1 is token 2.
        assert_eq!(accept_lane(&p, &q, 3, &lane(0, 0.999, [0.3, 0.7])), (1, 2));
        // Token 2 has p = 0: rejected; the residual (0.25, 0.25, 0) at v = 0.6 is token 1.
        assert_eq!(accept_lane(&p, &q, 3, &lane(2, 0.0, [0.6, 0.1])), (0, 1));
        assert_eq!(accept_lane(&p, &q, 3, &lane(2, 0.0, [0.4, 0.1])), (0, 0));
    }

    #[test]
    fn the_host_body_reads_the_words_back() {
        let device = Default::default();
        let width = 50;
        let p: Vec<f32> = (0..4 * width).map(|i| ((i * 7919) % 97) as f32 / 13.0).collect();
        let q: Vec<f32> = (0..3 * width).map(|i| ((i * 104_729) % 89) as f32 / 11.0).collect();
        let lanes = [
            AcceptLane {
                p_row: 0,
                q_row: 0,
                drafts: vec![3, 7],
                temperature: 0.9,
                top_k: 10,
                top_p: 0.8,
                accept_coins: vec![0.2, 0.9],
                draw_coins: vec![0.1, 0.5, 0.7],
            },
            AcceptLane {
                p_row: 3,
                q_row: 2,
                drafts: vec![],
                temperature: 1.1,
                top_k: 0,
                top_p: 1.0,
                accept_coins: vec![],
                draw_coins: vec![0.45],
            },
        ];
        let (rows, words) = accept_words(&lanes, 4, 3, 3);
        assert_eq!((rows.len(), words.len()), (3 * 7, 2 * lane_stride(3)));
        let pt = Tensor::<2>::from_data(TensorData::new(p.clone(), [4, width]), &device);
        let qt = Tensor::<2>::from_data(TensorData::new(q.clone(), [3, width]), &device);
        let rt = Tensor::<1, Int>::from_data(TensorData::new(rows, [21]), &device);
        let wt = Tensor::<2, Int>::from_data(TensorData::new(words, [2, lane_stride(3)]), &device);
        let out =
            crate::chain_accept(pt, qt, rt, wt).into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        let expect: Vec<i64> = lanes
            .iter()
            .flat_map(|l| {
                let (c, t) = accept_lane(&p, &q, width, l);
                [c as i64, i64::from(t)]
            })
            .collect();
        assert_eq!(out, expect);
        assert_eq!(out[2], 0, "a lane without drafts accepts none");
    }
}
