//! The Markov head and the confidence head, on host slices.
//!
//! They turn the draft's parallel block into sequential proposals: step k adds a bias that
//! depends on the token chosen at step k−1 (and, for the gated and rnn heads, on the block
//! hidden row h_k) to the base logits of row k, then picks (greedy) or samples the token.

use super::draft_config::MarkovHeadType;

/// Host copy of the Markov head weights (f32, row-major as in the checkpoint).
#[derive(Debug, Clone)]
pub struct MarkovHead {
    /// Variant.
    pub kind: MarkovHeadType,
    /// Rank r.
    pub rank: usize,
    /// Hidden width H (gated and rnn heads read h_k).
    pub hidden: usize,
    /// `markov_w1` `[V, r]` (embedding table).
    pub w1: Vec<f32>,
    /// `markov_w2` `[V, r]` (Linear r → V).
    pub w2: Vec<f32>,
    /// Gated: `gate_proj.weight` `[r, H + r]`, `gate_proj.bias` `[r]`.
    /// Rnn: `joint_proj.weight` `[3r, 2r + H]`, `joint_proj.bias` `[3r]`.
    pub proj: Option<(Vec<f32>, Vec<f32>)>,
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `W · x + b` for a row-major `W` `[out, in]`.
fn affine(w: &[f32], b: &[f32], x: &[f64]) -> Vec<f64> {
    let n_in = x.len();
    b.iter()
        .enumerate()
        .map(|(o, &bias)| {
            let row = &w[o * n_in..(o + 1) * n_in];
            f64::from(bias) + row.iter().zip(x).map(|(&a, &b)| f64::from(a) * b).sum::<f64>()
        })
        .collect()
}

impl MarkovHead {
    /// `W1[token]` as f64.
    pub fn embed(&self, token: u32) -> Vec<f64> {
        let r = self.rank;
        self.w1[token as usize * r..(token as usize + 1) * r].iter().map(|&v| f64::from(v)).collect()
    }

    /// Start of a block: the rnn head's state is zero.
    pub fn initial_state(&self) -> Vec<f64> {
        vec![0.0; self.rank]
    }

    /// The latent vector that `W2` maps to the vocabulary bias at one step, and the next state.
    ///
    /// `h` is the block hidden row of this step (final-normed); `state` is carried across the
    /// steps of one block (rnn only).
    pub fn latent(&self, prev: u32, h: &[f32], state: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let e = self.embed(prev);
        match (self.kind, &self.proj) {
            (MarkovHeadType::Gated, Some((w, b))) => {
                let input: Vec<f64> = h.iter().map(|&v| f64::from(v)).chain(e.iter().copied()).collect();
                let gate = affine(w, b, &input);
                (e.iter().zip(gate).map(|(x, g)| x * sigmoid(g)).collect(), state.to_vec())
            }
            (MarkovHeadType::Rnn, Some((w, b))) => {
                let r = self.rank;
                let input: Vec<f64> = state
                    .iter()
                    .copied()
                    .chain(e.iter().copied())
                    .chain(h.iter().map(|&v| f64::from(v)))
                    .collect();
                let z = affine(w, b, &input);
                let next: Vec<f64> = (0..r)
                    .map(|i| {
                        let g = sigmoid(z[i]);
                        g * state[i] + (1.0 - g) * z[r + i].tanh()
                    })
                    .collect();
                ((0..r).map(|i| z[2 * r + i].tanh()).collect(), next)
            }
            _ => (e, state.to_vec()),
        }
    }

    /// Add `W2 · latent` to `logits` (one vocabulary row).
    pub fn add_bias(&self, logits: &mut [f64], latent: &[f64]) {
        let r = self.rank;
        for (v, l) in logits.iter_mut().enumerate() {
            let row = &self.w2[v * r..(v + 1) * r];
            *l += row.iter().zip(latent).map(|(&a, &b)| f64::from(a) * b).sum::<f64>();
        }
    }
}

/// The confidence head: `c_k = σ(w · [h_k ; W1[x_{k−1}]] + b)` (or `σ(w · h_k + b)`).
#[derive(Debug, Clone)]
pub struct ConfidenceHead {
    /// `proj.weight` `[H (+ r)]`.
    pub weight: Vec<f32>,
    /// `proj.bias`.
    pub bias: f32,
    /// Whether the head reads the Markov embedding of the previous token.
    pub with_markov: bool,
}

impl ConfidenceHead {
    /// The pre-sigmoid logit for one step.
    pub fn logit(&self, h: &[f32], prev_embedding: Option<&[f64]>) -> f64 {
        let mut acc = f64::from(self.bias);
        acc += dot(&self.weight, h);
        if let (true, Some(e)) = (self.with_markov, prev_embedding) {
            acc += dot(&self.weight[h.len()..], e);
        }
        acc
    }
}

/// `Σ w_i · x_i` in f64 over the shorter of the two, in eight interleaved partial sums (element
/// `i` goes to sum `i mod 8`) added in order at the end. A single running sum is one dependent
/// add per element: 4096 of them took about 4 µs a step, most of the host's work after a
/// proposal's readback. The order depends on the length alone, so the value is deterministic.
fn dot<T: Copy + Into<f64>>(w: &[f32], x: &[T]) -> f64 {
    let n = w.len().min(x.len());
    let (w, x) = (&w[..n], &x[..n]);
    let mut sums = [0.0f64; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for j in 0..8 {
            sums[j] += f64::from(a[j]) * b[j].into();
        }
    }
    for (j, (&a, &b)) in wr.iter().zip(xr).enumerate() {
        sums[j] += f64::from(a) * b.into();
    }
    sums.iter().sum()
}

/// Probabilities `softmax(logits / temperature)` in f64 (the sum over chunks of the row, see
/// [`crate::sampling::fill_and_sum`]: over threads for a long row, the same values whatever
/// their number).
pub fn softmax_t(logits: &[f64], temperature: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut p = vec![0.0f64; logits.len()];
    let total = crate::sampling::fill_and_sum(&mut p, |i| ((logits[i] - max) / temperature).exp());
    crate::sampling::divide_all(&mut p, total);
    p
}

/// Index of the largest value; lowest index on ties.
pub fn argmax_f64(values: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Run the sequential greedy pass of `head` over `base` rows from `anchor`.
    fn greedy(m: &MarkovHead, base: &[Vec<f64>], hidden: &[f32], anchor: u32) -> (Vec<Vec<f64>>, Vec<u32>) {
        let (mut prev, mut state) = (anchor, m.initial_state());
        let (mut rows, mut tokens) = (Vec::new(), Vec::new());
        for (k, row) in base.iter().enumerate() {
            let (latent, next) = m.latent(prev, &hidden[k * m.hidden..(k + 1) * m.hidden], &state);
            state = next;
            let mut row = row.clone();
            m.add_bias(&mut row, &latent);
            prev = argmax_f64(&row);
            tokens.push(prev);
            rows.push(row);
        }
        (rows, tokens)
    }

    #[test]
    fn vanilla_head_matches_the_hand_computed_case() {
        let json: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/fixtures/golden/hand_cases.json")).unwrap();
        let case = &json["vanilla_markov"];
        let flat = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
                .collect()
        };
        let m = MarkovHead {
            kind: MarkovHeadType::Vanilla,
            rank: 2,
            hidden: 1,
            w1: flat(&case["markov_w1_weight"]),
            w2: flat(&case["markov_w2_weight"]),
            proj: None,
        };
        let base: Vec<Vec<f64>> = serde_json::from_value(case["base_logits"].clone()).unwrap();
        let (rows, tokens) = greedy(&m, &base, &[0.0; 3], case["anchor"].as_u64().unwrap() as u32);
        let expected: Vec<Vec<f64>> =
            serde_json::from_value(case["expected"]["corrected_logits"].clone()).unwrap();
        for (r, e) in rows.iter().zip(&expected) {
            for (a, b) in r.iter().zip(e) {
                assert!((a - b).abs() < 1e-12, "{rows:?}");
            }
        }
        let want: Vec<u32> = serde_json::from_value(case["expected"]["draft_tokens"].clone()).unwrap();
        assert_eq!(tokens, want);
    }

    #[test]
    fn gated_head_scales_the_embedding_by_the_gate() {
        // V = 2, r = 1, H = 1. gate = σ(0.5·h + 1·e + 0); bias = W2 · (gate · e).
        let m = MarkovHead {
            kind: MarkovHeadType::Gated,
            rank: 1,
            hidden: 1,
            w1: vec![1.0, 2.0],
            w2: vec![1.0, -1.0],
            proj: Some((vec![0.5, 1.0], vec![0.0])),
        };
        let (latent, _) = m.latent(1, &[2.0], &[]);
        let gate = sigmoid(0.5 * 2.0 + 2.0);
        assert!((latent[0] - gate * 2.0).abs() < 1e-12);
        let mut row = vec![0.0, 0.0];
        m.add_bias(&mut row, &latent);
        assert!((row[0] - gate * 2.0).abs() < 1e-12 && (row[1] + gate * 2.0).abs() < 1e-12);
    }

    #[test]
    fn rnn_head_carries_its_state_across_steps() {
        // V = 2, r = 1, H = 1; input [s; e; h] -> [gate; candidate; output].
        let w = vec![
            0.0, 0.0, 0.0, // gate row: gate = σ(0) = 0.5
            0.0, 1.0, 0.0, // candidate row: tanh(e)
            1.0, 0.0, 1.0, // output row: tanh(s + h)
        ];
        let m = MarkovHead {
            kind: MarkovHeadType::Rnn,
            rank: 1,
            hidden: 1,
            w1: vec![0.5, 1.5],
            w2: vec![2.0, 0.0],
            proj: Some((w, vec![0.0, 0.0, 0.0])),
        };
        // Step 1 from the zero state: new state 0.5·0 + 0.5·tanh(e); output tanh(0 + h).
        let (out1, s1) = m.latent(1, &[0.25], &m.initial_state());
        assert!((s1[0] - 0.5 * 1.5f64.tanh()).abs() < 1e-12);
        assert!((out1[0] - 0.25f64.tanh()).abs() < 1e-12, "the output reads the old state");
        // Step 2 reads the carried state.
        let (out2, s2) = m.latent(0, &[0.0], &s1);
        assert!((out2[0] - s1[0].tanh()).abs() < 1e-12);
        assert!((s2[0] - (0.5 * s1[0] + 0.5 * 0.5f64.tanh())).abs() < 1e-12);
    }

    #[test]
    fn confidence_reads_the_previous_embedding_only_when_asked() {
        let c = ConfidenceHead { weight: vec![1.0, 2.0, 3.0], bias: 0.5, with_markov: true };
        assert!((c.logit(&[1.0, 1.0], Some(&[2.0])) - (0.5 + 3.0 + 6.0)).abs() < 1e-12);
        let c = ConfidenceHead { weight: vec![1.0, 2.0], bias: 0.5, with_markov: false };
        assert!((c.logit(&[1.0, 1.0], Some(&[2.0])) - 3.5).abs() < 1e-12);
    }

    #[test]
    fn softmax_with_temperature_by_hand() {
        let p = softmax_t(&[0.0, 2.0f64.ln()], 0.5);
        assert!((p[1] - 0.8).abs() < 1e-12);
    }

    #[test]
    fn confidence_logit_is_the_dot_product() {
        // Widths with and without a remainder of the eight partial sums, with and without the
        // Markov embedding: the plain f64 sum up to rounding.
        for (h, r) in [(64usize, 8usize), (13, 5), (4096, 256), (7, 0)] {
            let weight: Vec<f32> = (0..h + r).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect();
            let hid: Vec<f32> = (0..h).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.1).collect();
            let e: Vec<f64> = (0..r).map(|i| (i as f64 - 2.5) * 0.3).collect();
            for with_markov in [false, true] {
                let c = ConfidenceHead { weight: weight.clone(), bias: 0.25, with_markov };
                let mut want = 0.25f64;
                for i in 0..h {
                    want += f64::from(weight[i]) * f64::from(hid[i]);
                }
                if with_markov {
                    for i in 0..r {
                        want += f64::from(weight[h + i]) * e[i];
                    }
                }
                let got = c.logit(&hid, Some(&e));
                assert!((got - want).abs() <= 1e-12 * want.abs().max(1.0), "h {h} r {r}: {got} vs {want}");
            }
        }
    }
}
