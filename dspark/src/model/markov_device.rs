//! The Markov pass on the device, for the vanilla head (or none): the γ sequential steps of a
//! block for every lane at once, each step a gather of `W1[prev]`, one product with `W2` over
//! the vocabulary, the add to the base logits and the choice of the token, without leaving the
//! device when every lane decodes greedily (one read of the γ tokens and confidences at the
//! end). When a lane samples, each step draws its token on the device too
//! ([`dspark_kernels::sample_rows`]: f64 weights `exp((x − max) / T)`, inverse CDF with the coin
//! the host pass would use, keyed by seed and position); the corrected rows come back once at the
//! end and the host makes each proposal `q = softmax(row / T)` in f64 from them. The device's
//! sums run in another order than the host's, so the distribution it drew from and `q` differ by
//! f64 rounding (about 1e-16 relative), far below anything a distribution test could see.
//!
//! Only this crate's kernels and data movement run here: no reduction or matmul of burn's,
//! whose autotuning would run throughput probes (a 2 GiB transient allocation on the H200) on
//! the first round. The confidence head (γ dot products per lane) is evaluated on the host from
//! the block's hidden rows, exactly as the host pass does.
//!
//! The bias `W2 · W1[prev]` is computed in the draft's dtype (f32 accumulation on the bf16
//! kernel path; for an FP8 draft, whose `W2` is e4m3 with per-row scales, on the FP8 kernel
//! path, and the host pass then uses the same dequantised `W2`) instead of the host pass's f64: the draft's choices may differ on near-ties,
//! which changes acceptance, never the output distribution.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::fp8::{QuantizedRows, per_channel_weight};
use super::layer::Weight;
use super::markov::{MarkovHead, softmax_t};
use crate::device::ComputeDtype;
use crate::engine::read_f32;
use crate::error::{Error, Result};
use crate::model::draft_config::MarkovHeadType;
use crate::sampling::{SamplingParams, Stream, coin};

/// Device copies of the Markov and confidence heads.
#[derive(Debug, Clone)]
pub(crate) struct DeviceMarkov {
    /// `markov_w1` `[V, r]` in the draft's dtype and `markov_w2` `[V, r]`, dense in the draft's
    /// dtype or, for an FP8 draft, e4m3 with per-row scales; `None` without a head.
    w: Option<(Tensor<2>, Weight)>,
    device: Device,
}

/// `x · W2ᵀ` through this crate's kernels.
fn w2_product(x: Tensor<2>, w2: &Weight) -> Tensor<2> {
    match w2 {
        Weight::Dense(w) => dspark_kernels::linear(x, w),
        Weight::Fp8(m) => dspark_kernels::linear_fp8(x, m),
    }
}

/// What the device pass chose for each lane.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeviceRound {
    /// `[lane][k]` draft tokens.
    pub tokens: Vec<Vec<u32>>,
    /// `[lane][k]` proposal distributions of sampling lanes (empty for greedy lanes, and when
    /// the rows stay on the device).
    pub q: Vec<Vec<Vec<f64>>>,
    /// The corrected rows `[lanes·γ, V]` (f32) the tokens were drawn from, when asked to keep
    /// them on the device instead of making `q`.
    pub rows: Option<Tensor<2>>,
}

impl DeviceMarkov {
    /// Upload the Markov head; `None` for the gated and rnn heads, which stay on the host pass.
    /// `w2_fp8`: the e4m3 bytes and per-row scales `markov.w2` was dequantised from (an FP8
    /// draft), kept as FP8 where the device runs FP8 products.
    ///
    /// # Errors
    /// When the FP8 copy does not upload (a shape that does not match the head).
    pub(crate) fn new(
        markov: Option<&MarkovHead>,
        w2_fp8: Option<&QuantizedRows>,
        dtype: ComputeDtype,
        device: &Device,
    ) -> Result<Option<Self>> {
        let upload = |values: &[f32], dims: [usize; 2], dtype: DType| {
            // Rounded on the host: no f32 copy on the device, which would stay reserved in the
            // persistent pool after a cast there.
            let data = TensorData::new(values.to_vec(), dims);
            let data = data.clone().try_cast(dtype).unwrap_or(data);
            let options = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype);
            crate::device::persistent(device, data, |data| Tensor::<2>::from_data(data, options.clone()))
        };
        let w = match markov {
            None => None,
            Some(m) if m.kind == MarkovHeadType::Vanilla => {
                let v = m.w1.len() / m.rank;
                let w2 = match w2_fp8 {
                    Some(q) => {
                        per_channel_weight(q, [v, m.rank], dtype, device, "markov_head.markov_w2.weight")?
                    }
                    None => Weight::Dense(upload(&m.w2, [v, m.rank], dtype.dtype())),
                };
                Some((upload(&m.w1, [v, m.rank], dtype.dtype()), w2))
            }
            Some(_) => return Ok(None),
        };
        Ok(Some(Self { w, device: device.clone() }))
    }

    /// The γ steps for every lane: `base` `[lanes·γ, V]` (f32) from the block forward; lane `i`
    /// starts from `anchors[i]`, samples with `params[i]`, and its block decides positions
    /// `positions[i] + 1 ..` (the keys of its sampling coins).
    pub(crate) fn run(
        &self,
        anchors: &[u32],
        base: Tensor<2>,
        gamma: usize,
        params: &[&SamplingParams],
        positions: &[usize],
        keep_rows: bool,
    ) -> Result<DeviceRound> {
        let lanes = anchors.len();
        let [_, v] = base.dims();
        let base = base.reshape([lanes, gamma, v]);
        let greedy = params.iter().all(|p| p.is_greedy());
        let ids =
            |values: Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(values, [lanes]), &self.device);
        let prev = ids(anchors.iter().map(|&a| i64::from(a)).collect());
        let mut round = DeviceRound {
            tokens: vec![Vec::with_capacity(gamma); lanes],
            q: vec![Vec::new(); lanes],
            rows: None,
        };
        if greedy {
            let tokens = self.greedy(prev, base, gamma).into_data().convert::<i64>();
            let tokens = tokens.try_to_vec::<i64>().map_err(|e| Error::Backend(format!("{e:?}")))?;
            for (i, row) in tokens.chunks(gamma).enumerate() {
                round.tokens[i] = row.iter().map(|&t| t as u32).collect();
            }
            return Ok(round);
        }
        // Sampling lanes draw on the device from their coins; one read of the tokens at the end,
        // and of the corrected rows, from which the host makes each q, unless they stay on the
        // device for the engine's verification there.
        let words = draw_words(params, positions, gamma);
        let draws = Tensor::<1, Int>::from_data(TensorData::new(words, [3 * lanes * gamma]), &self.device);
        let (tokens, rows) = self.sampled(prev, base, gamma, draws);
        let tokens = tokens.into_data().convert::<i64>();
        let tokens = tokens.try_to_vec::<i64>().map_err(|e| Error::Backend(format!("{e:?}")))?;
        for (i, row) in tokens.chunks(gamma).enumerate() {
            round.tokens[i] = row.iter().map(|&t| t as u32).collect();
        }
        if keep_rows {
            round.rows = Some(rows);
        } else {
            round.q = q_rows(&read_f32(rows)?, v, params, gamma);
        }
        Ok(round)
    }

    /// Step `k`'s corrected logits `base[:, k] + W2 · W1[prev]` (f32, `[lanes, V]`; `base` may
    /// be in the draft's dtype: only this step's rows are widened, exactly).
    fn corrected(&self, prev: &Tensor<1, Int>, base: &Tensor<3>, k: usize) -> Tensor<2> {
        let [lanes, _, v] = base.dims();
        let mut row = base.clone().narrow(1, k, 1).reshape([lanes, v]);
        if row.dtype() != DType::F32 {
            row = row.cast(DType::F32);
        }
        if let Some((w1, w2)) = &self.w {
            let e = w1.clone().select(0, prev.clone());
            let bias = w2_product(e, w2);
            row = row + if bias.dtype() == DType::F32 { bias } else { bias.cast(DType::F32) };
        }
        row
    }

    /// The γ steps with draws on the device: `prev` `[lanes]` holds the anchors, `base`
    /// `[lanes, γ, V]`, `draws` the words of [`draw_words`] (`[γ][lanes][3]`). Returns the tokens
    /// `[lanes, γ]` and the corrected rows `[lanes·γ, V]` (f32) they were drawn from. A greedy
    /// lane's words say "argmax": its tokens are those of [`Self::greedy`].
    pub(crate) fn sampled(
        &self,
        mut prev: Tensor<1, Int>,
        base: Tensor<3>,
        gamma: usize,
        draws: Tensor<1, Int>,
    ) -> (Tensor<2, Int>, Tensor<2>) {
        let [lanes, _, v] = base.dims();
        let mut chosen: Vec<Tensor<2, Int>> = Vec::with_capacity(gamma);
        let mut rows: Vec<Tensor<2>> = Vec::with_capacity(gamma);
        for k in 0..gamma {
            let row = self.corrected(&prev, &base, k);
            let t =
                dspark_kernels::sample_rows(row.clone(), draws.clone().narrow(0, 3 * k * lanes, 3 * lanes));
            chosen.push(t.clone().reshape([lanes, 1]));
            rows.push(row);
            prev = t;
        }
        (Tensor::cat(chosen, 1), Tensor::stack::<3>(rows, 1).reshape([lanes * gamma, v]))
    }

    /// The γ greedy steps on the device alone (no upload, no read): `prev` `[lanes]` holds the
    /// anchors, `base` `[lanes, γ, V]` (f32 or the draft's dtype); returns the tokens `[lanes, γ]`, each the lowest index
    /// of its step's maximum, as the host pass chooses.
    pub(crate) fn greedy(&self, mut prev: Tensor<1, Int>, base: Tensor<3>, gamma: usize) -> Tensor<2, Int> {
        let lanes = base.dims()[0];
        let mut chosen: Vec<Tensor<2, Int>> = Vec::with_capacity(gamma);
        for k in 0..gamma {
            // The corrected row's argmax; with a Markov head its sum is formed inside the argmax
            // (the same f32 values as `corrected`, never stored).
            let t = match &self.w {
                Some((w1, w2)) => {
                    let bias = w2_product(w1.clone().select(0, prev.clone()), w2);
                    dspark_kernels::argmax_sum_rows(base.clone(), k, bias)
                }
                None => dspark_kernels::argmax_rows(self.corrected(&prev, &base, k)),
            };
            chosen.push(t.clone().reshape([lanes, 1]));
            prev = t;
        }
        Tensor::cat(chosen, 1)
    }
}

/// The draw words of a round (see [`dspark_kernels::reference::draw_words`]), `[γ][lanes][3]`:
/// lane `i` at step `k` draws with its temperature (0, the argmax, for a greedy lane) and the
/// coin keyed by its block's position `positions[i] + k + 1`, the coin the host pass uses.
pub(crate) fn draw_words(params: &[&SamplingParams], positions: &[usize], gamma: usize) -> Vec<i64> {
    let mut words = Vec::with_capacity(3 * params.len() * gamma);
    for k in 0..gamma {
        for (p, &position) in params.iter().zip(positions) {
            if p.is_greedy() {
                words.extend(dspark_kernels::reference::draw_words(0.0, 0.0));
            } else {
                let u = coin(p.seed, Stream::Draft, position + k + 1);
                words.extend(dspark_kernels::reference::draw_words(p.temperature, u));
            }
        }
    }
    words
}

/// Each sampling lane's proposal distributions from the corrected rows its tokens were drawn
/// from (`rows`: `[lanes·γ, V]` f32): `softmax(row / T)` in f64, as the host pass makes them.
/// The device drew with the same weights and sums in another order; the two differ by f64
/// rounding only. Greedy lanes get none.
pub(crate) fn q_rows(rows: &[f32], v: usize, params: &[&SamplingParams], gamma: usize) -> Vec<Vec<Vec<f64>>> {
    let wanted: Vec<(usize, &[f32])> =
        rows.chunks(v).enumerate().filter(|(r, _)| !params[r / gamma].is_greedy()).collect();
    let mut q = crate::sampling::map_rows(&wanted, wanted.len() * v, |&(r, row)| {
        let logits: Vec<f64> = row.iter().map(|&x| f64::from(x)).collect();
        (r / gamma, softmax_t(&logits, f64::from(params[r / gamma].temperature)))
    })
    .into_iter();
    let mut out = vec![Vec::new(); params.len()];
    for (i, p) in params.iter().enumerate() {
        if !p.is_greedy() {
            out[i] = q.by_ref().take(gamma).map(|(_, row)| row).collect();
        }
    }
    out
}
