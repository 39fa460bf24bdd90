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
        acc += self.weight.iter().zip(h).map(|(&w, &x)| f64::from(w) * f64::from(x)).sum::<f64>();
        if let (true, Some(e)) = (self.with_markov, prev_embedding) {
            acc += self.weight[h.len()..].iter().zip(e).map(|(&w, &x)| f64::from(w) * x).sum::<f64>();
        }
        acc
    }
}

/// Probabilities `softmax(logits / temperature)` in f64.
pub fn softmax_t(logits: &[f64], temperature: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut p: Vec<f64> = logits.iter().map(|&l| ((l - max) / temperature).exp()).collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
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
