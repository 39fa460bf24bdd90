//! The Markov pass on the device, for the vanilla head (or none): the γ sequential steps of a
//! block for every lane at once, each step a gather of `W1[prev]`, one product with `W2` over
//! the vocabulary, the add to the base logits and the choice of the token, without leaving the
//! device when every lane decodes greedily (one read of the γ tokens and confidences at the
//! end; the greedy steps are [`dspark_kernels::markov_greedy`]'s, two launches a step on CUDA
//! with `dspark_kernels::set_fused_markov`). When a lane samples, each step draws its token on
//! the device too ([`dspark_kernels::sample_rows`]: f64 weights `exp((x − max) / T)`, inverse
//! CDF with the coin the host pass would use, keyed by seed and position); the corrected rows
//! come back once at the end and the host makes each proposal `q = softmax(row / T)` in f64 from
//! them. The device's
//! sums run in another order than the host's, so the distribution it drew from and `q` differ by
//! f64 rounding (about 1e-16 relative), far below anything a distribution test could see.
//!
//! Only this crate's kernels and data movement run here: no reduction or matmul of burn's,
//! whose autotuning would run throughput probes (a 2 GiB transient allocation on the H200) on
//! the first round. The confidence head (γ dot products per lane) can run here too
//! (`DSparkDraft::set_device_confidence`; [`dspark_kernels::confidence_logits`]: f32 sums from
//! the block's hidden rows and the `markov_w1` rows of the previous tokens, in the draft's
//! dtype), so a round reads back γ logits a lane instead of its γ hidden rows; the host pass
//! makes the same logits in f64, and the two confidences differ by f32 rounding (checked below
//! 1e-5). It runs here by default (`dspark_kernels::set_confidence_kernel`).
//!
//! The bias `W2 · W1[prev]` is computed in the draft's dtype (f32 accumulation on the bf16
//! kernel path; for an FP8 draft, whose `W2` is e4m3 with per-row scales, on the FP8 kernel
//! path, and the host pass then uses the same dequantised `W2`) instead of the host pass's f64:
//! the draft's choices may differ on near-ties, which changes acceptance, never the output
//! distribution.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::draft_vocab::DraftVocab;
use super::fp8::{QuantizedRows, per_channel_weight};
use super::layer::Weight;
use super::markov::{ConfidenceHead, MarkovHead, softmax_t};
use crate::device::ComputeDtype;
use crate::engine::read_f32;
use crate::error::{Error, Result};
use crate::model::draft_config::MarkovHeadType;
use crate::sampling::{SamplingParams, Stream, coin};

/// Device copies of the Markov and confidence heads.
#[derive(Debug, Clone)]
pub(crate) struct DeviceMarkov {
    /// `markov_w1` `[V, r]` in the draft's dtype and `markov_w2` `[V', r]` (`V'` the draft
    /// vocabulary: the whole one, or the rows of a [`DraftVocab`]), dense in the draft's dtype
    /// or, for an FP8 draft, e4m3 with per-row scales; `None` without a head.
    w: Option<(Tensor<2>, Weight)>,
    /// With a restricted draft vocabulary the steps choose indices into it, not token ids.
    vocab: Option<DeviceVocab>,
    /// The confidence head, evaluated on the device from the block's hidden rows.
    confidence: Option<DeviceConfidence>,
    device: Device,
}

/// A device copy of the confidence head `c_k = σ(w · [h_k ; W1[x_{k−1}]] + b)`.
#[derive(Debug, Clone)]
struct DeviceConfidence {
    /// `proj.weight` `[H (+ r)]`, f32.
    weight: Tensor<1>,
    /// `proj.bias`.
    bias: f32,
    /// Whether the logit reads `W1[x_{k−1}]` (the `markov_w1` rows held for the Markov steps,
    /// in the draft's dtype).
    with_markov: bool,
}

/// A restricted draft vocabulary on the device.
#[derive(Debug, Clone)]
struct DeviceVocab {
    /// `[V']`: the token id of each draft index.
    to_target: Tensor<1, Int>,
    /// `[V]`: each token's draft index, or `V'` (the −∞ column) when it cannot be drafted.
    to_draft: Tensor<1, Int>,
    /// `markov_w1` rows of the draft vocabulary `[V', r]`: steps after the first embed the
    /// previous step's draft index (the first embeds the anchor, a token id, from the whole
    /// table).
    w1: Option<Tensor<2>>,
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
    /// `[lane][k]` confidence logits, when the block's hidden rows were given and the confidence
    /// head runs on the device.
    pub confidence_logits: Option<Vec<Vec<f32>>>,
}

impl DeviceMarkov {
    /// Upload the Markov head; `None` for the gated and rnn heads, which stay on the host pass.
    /// `w2_fp8`: the e4m3 bytes and per-row scales `markov.w2` was dequantised from (an FP8
    /// draft), kept as FP8 where the device runs FP8 products. `vocab`: the draft vocabulary
    /// when restricted (only its rows of `W2` are uploaded). `confidence`: the confidence head
    /// and the hidden width, when the draft has one.
    ///
    /// # Errors
    /// When the FP8 copy does not upload (a shape that does not match the head).
    pub(crate) fn new(
        markov: Option<&MarkovHead>,
        w2_fp8: Option<&QuantizedRows>,
        vocab: Option<&DraftVocab>,
        confidence: Option<(&ConfidenceHead, usize)>,
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
        // The rows of a `[V, cols]` row-major matrix the draft vocabulary keeps.
        let pick = |values: &[f32], cols: usize| -> Vec<f32> {
            match vocab {
                Some(d) => {
                    d.ids().iter().flat_map(|&t| &values[t as usize * cols..][..cols]).copied().collect()
                }
                None => values.to_vec(),
            }
        };
        let w = match markov {
            None => None,
            Some(m) if m.kind == MarkovHeadType::Vanilla => {
                let (v, r) = (m.w1.len() / m.rank, m.rank);
                let rows = vocab.map_or(v, DraftVocab::len);
                let w2 = match w2_fp8 {
                    Some(q) => {
                        let q = QuantizedRows {
                            bytes: match vocab {
                                Some(d) => d
                                    .ids()
                                    .iter()
                                    .flat_map(|&t| &q.bytes[t as usize * r..][..r])
                                    .copied()
                                    .collect(),
                                None => q.bytes.clone(),
                            },
                            scales: match vocab {
                                Some(d) => d.ids().iter().map(|&t| q.scales[t as usize]).collect(),
                                None => q.scales.clone(),
                            },
                        };
                        per_channel_weight(&q, [rows, r], dtype, device, "markov_head.markov_w2.weight")?
                    }
                    None => Weight::Dense(upload(&pick(&m.w2, r), [rows, r], dtype.dtype())),
                };
                Some((upload(&m.w1, [v, r], dtype.dtype()), w2))
            }
            Some(_) => return Ok(None),
        };
        let vocab = vocab.map(|d| {
            let ints = |values: Vec<i64>| {
                let n = values.len();
                Tensor::<1, Int>::from_data(TensorData::new(values, [n]), device)
            };
            DeviceVocab {
                to_target: ints(d.ids().iter().map(|&t| i64::from(t)).collect()),
                to_draft: ints(d.target_to_draft()),
                w1: markov
                    .filter(|m| m.kind == MarkovHeadType::Vanilla)
                    .map(|m| upload(&pick(&m.w1, m.rank), [d.len(), m.rank], dtype.dtype())),
            }
        });
        // The confidence head reads `W1[x_{k−1}]` from the Markov steps' table when it reads the
        // Markov embedding at all (as the host head does when the draft has a Markov head). A head
        // whose weights do not cover the embedding (the loader refuses those) stays on the host.
        let confidence = confidence.and_then(|(c, hidden)| {
            let rank = w.as_ref().map_or(0, |(w1, _)| w1.dims()[1]);
            let with_markov = c.with_markov && rank > 0;
            if c.weight.len() < hidden + if with_markov { rank } else { 0 } {
                return None;
            }
            let n = c.weight.len();
            let options = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(DType::F32);
            let weight = crate::device::persistent(device, TensorData::new(c.weight.clone(), [n]), |data| {
                Tensor::<1>::from_data(data, options.clone())
            });
            Some(DeviceConfidence { weight, bias: c.bias, with_markov })
        });
        Ok(Some(Self { w, vocab, confidence, device: device.clone() }))
    }

    /// Whether the confidence head runs here (see [`Self::confidence_logits`]).
    pub(crate) fn has_confidence(&self) -> bool {
        self.confidence.is_some()
    }

    /// The confidence head's logits of the blocks' rows, on the device
    /// ([`dspark_kernels::confidence_logits`]): `hidden` `[lanes·γ, H]`, `anchors` `[lanes]`,
    /// `tokens` `[lanes·γ]` (token ids, the drafts of the rows). `None` without a head.
    ///
    /// With `with_tokens`, the logits come after the tokens as f32, in one buffer `[2·lanes·γ]`
    /// (a recorded round's readback; [`dspark_kernels::tokens_and_confidence_logits`]).
    pub(crate) fn confidence_logits(
        &self,
        hidden: Tensor<2>,
        anchors: Tensor<1, Int>,
        tokens: Tensor<1, Int>,
        with_tokens: bool,
    ) -> Option<Tensor<1>> {
        let c = self.confidence.as_ref()?;
        let table = self.w.as_ref().map(|(w1, _)| w1).filter(|_| c.with_markov);
        let logits = if with_tokens {
            dspark_kernels::tokens_and_confidence_logits
        } else {
            dspark_kernels::confidence_logits
        };
        Some(logits(hidden, table, anchors, tokens, &c.weight, c.bias))
    }

    /// `W1[prev]` at step `k`: `prev` holds token ids at the first step (the anchors) and, with a
    /// restricted draft vocabulary, draft indices after it.
    fn embed(&self, w1: &Tensor<2>, prev: &Tensor<1, Int>, k: usize) -> Tensor<2> {
        let table = match &self.vocab {
            Some(DeviceVocab { w1: Some(sub), .. }) if k > 0 => sub,
            _ => w1,
        };
        table.clone().select(0, prev.clone())
    }

    /// The chosen draft indices `[lanes, γ]` as token ids.
    fn to_tokens(&self, chosen: Tensor<2, Int>) -> Tensor<2, Int> {
        match &self.vocab {
            Some(v) => {
                let [lanes, gamma] = chosen.dims();
                v.to_target.clone().select(0, chosen.reshape([lanes * gamma])).reshape([lanes, gamma])
            }
            None => chosen,
        }
    }

    /// Rows over the draft vocabulary `[n, V']` spread over the whole one `[n, V]`, −∞ where
    /// the draft cannot propose (zero in the proposal `q`).
    fn to_target_rows(&self, rows: Tensor<2>) -> Tensor<2> {
        match &self.vocab {
            Some(v) => {
                let n = rows.dims()[0];
                let options =
                    burn::tensor::TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
                let minus_inf = Tensor::<2>::full([n, 1], f32::NEG_INFINITY, options);
                Tensor::cat(vec![rows, minus_inf], 1).select(1, v.to_draft.clone())
            }
            None => rows,
        }
    }

    /// The γ steps for every lane: `base` `[lanes·γ, V]` (f32) from the block forward; lane `i`
    /// starts from `anchors[i]`, samples with `params[i]`, and its block decides positions
    /// `positions[i] + 1 ..` (the keys of its sampling coins). With the block's `hidden` rows
    /// `[lanes·γ, H]` and a confidence head here, the confidence logits come back in the same
    /// read as the tokens.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        anchors: &[u32],
        base: Tensor<2>,
        gamma: usize,
        params: &[&SamplingParams],
        positions: &[usize],
        keep_rows: bool,
        hidden: Option<Tensor<2>>,
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
            confidence_logits: None,
        };
        let anchors = prev.clone();
        if greedy {
            let tokens = self.greedy(prev, base, gamma);
            self.read_tokens(&mut round, tokens, hidden, anchors)?;
            return Ok(round);
        }
        // Sampling lanes draw on the device from their coins; one read of the tokens at the end,
        // and of the corrected rows, from which the host makes each q, unless they stay on the
        // device for the engine's verification there.
        let words = draw_words(params, positions, gamma);
        let draws = Tensor::<1, Int>::from_data(TensorData::new(words, [3 * lanes * gamma]), &self.device);
        let (tokens, rows) = self.sampled(prev, base, gamma, draws);
        self.read_tokens(&mut round, tokens, hidden, anchors)?;
        if keep_rows {
            round.rows = Some(rows);
        } else {
            let width = rows.dims()[1];
            round.q = q_rows(&read_f32(rows)?, width, params, gamma);
        }
        Ok(round)
    }

    /// Reads the chosen tokens `[lanes, γ]` into `round`, with their rows' confidence logits in
    /// the same read when `hidden` is given and the head runs here (token ids are below 2²⁴, so
    /// exact as f32).
    fn read_tokens(
        &self,
        round: &mut DeviceRound,
        tokens: Tensor<2, Int>,
        hidden: Option<Tensor<2>>,
        anchors: Tensor<1, Int>,
    ) -> Result<()> {
        let [lanes, gamma] = tokens.dims();
        let n = lanes * gamma;
        let flat = tokens.reshape([n]);
        let (ids, logits): (Vec<i64>, Option<Vec<f32>>) =
            match hidden.and_then(|h| self.confidence_logits(h, anchors, flat.clone(), false)) {
                Some(conf) => {
                    let values = read_f32(Tensor::cat(vec![flat.float().cast(DType::F32), conf], 0))?;
                    (values[..n].iter().map(|&t| t as i64).collect(), Some(values[n..].to_vec()))
                }
                None => {
                    let data = flat.into_data().convert::<i64>();
                    (data.try_to_vec::<i64>().map_err(|e| Error::Backend(format!("{e:?}")))?, None)
                }
            };
        for (i, row) in ids.chunks(gamma).enumerate() {
            round.tokens[i] = row.iter().map(|&t| t as u32).collect();
        }
        round.confidence_logits = logits.map(|l| l.chunks(gamma).map(<[f32]>::to_vec).collect());
        Ok(())
    }

    /// Step `k`'s corrected logits `base[:, k] + W2 · W1[prev]` (f32, `[lanes, V']`; `base` may
    /// be in the draft's dtype: only this step's rows are widened, exactly).
    fn corrected(&self, prev: &Tensor<1, Int>, base: &Tensor<3>, k: usize) -> Tensor<2> {
        let [lanes, _, v] = base.dims();
        let mut row = base.clone().narrow(1, k, 1).reshape([lanes, v]);
        if row.dtype() != DType::F32 {
            row = row.cast(DType::F32);
        }
        if let Some((w1, w2)) = &self.w {
            let bias = w2_product(self.embed(w1, prev, k), w2);
            row = row + if bias.dtype() == DType::F32 { bias } else { bias.cast(DType::F32) };
        }
        row
    }

    /// The γ steps with draws on the device: `prev` `[lanes]` holds the anchors, `base`
    /// `[lanes, γ, V']` (over the draft vocabulary), `draws` the words of [`draw_words`]
    /// (`[γ][lanes][3]`). Returns the tokens `[lanes, γ]` and the corrected rows `[lanes·γ, V]`
    /// (f32, −∞ outside the draft vocabulary) they were drawn from. A greedy lane's words say
    /// "argmax": its tokens are those of [`Self::greedy`].
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
        let rows = Tensor::stack::<3>(rows, 1).reshape([lanes * gamma, v]);
        (self.to_tokens(Tensor::cat(chosen, 1)), self.to_target_rows(rows))
    }

    /// The γ greedy steps on the device alone (no upload, no read): `prev` `[lanes]` holds the
    /// anchors, `base` `[lanes, γ, V']` (f32 or the draft's dtype, over the draft vocabulary);
    /// returns the tokens `[lanes, γ]`, each the lowest index of its step's maximum, as the host
    /// pass chooses (the draft vocabulary is sorted: the lowest index is the lowest token id).
    pub(crate) fn greedy(&self, mut prev: Tensor<1, Int>, base: Tensor<3>, gamma: usize) -> Tensor<2, Int> {
        let lanes = base.dims()[0];
        if let Some((w1, w2)) = &self.w {
            // The Markov steps as `dspark_kernels::markov_greedy` runs them (on CUDA two launches
            // a step): step 0 embeds the anchors from the whole table, later steps the previous
            // choice from the table of the draft vocabulary; choices map to token ids at the end.
            let table = match &self.vocab {
                Some(DeviceVocab { w1: Some(sub), .. }) => sub,
                _ => w1,
            };
            let w2 = match w2 {
                Weight::Dense(w) => dspark_kernels::MarkovW2::Dense(w),
                Weight::Fp8(m) => dspark_kernels::MarkovW2::Fp8(m),
            };
            let to_target = self.vocab.as_ref().map(|v| &v.to_target);
            return dspark_kernels::markov_greedy(prev, w1, base, w2, table, to_target);
        }
        let mut chosen: Vec<Tensor<2, Int>> = Vec::with_capacity(gamma);
        for k in 0..gamma {
            let t = dspark_kernels::argmax_rows(self.corrected(&prev, &base, k));
            chosen.push(t.clone().reshape([lanes, 1]));
            prev = t;
        }
        self.to_tokens(Tensor::cat(chosen, 1))
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
