//! The Markov pass on the device, for the vanilla head (or none): the γ sequential steps of a
//! block for every lane at once, each step a gather of `W1[prev]`, one product with `W2` over
//! the vocabulary, the add to the base logits and the choice of the token, without leaving the
//! device when every lane decodes greedily (one read of the γ tokens and confidences at the
//! end). When a lane samples, each step's corrected logits are read back and the token is drawn
//! on the host exactly as [`super::dspark_draft::DSparkDraft::markov_pass`] draws it (f64
//! softmax, the same coin), so the proposal `q` is the distribution actually sampled from.
//!
//! Only this crate's kernels and data movement run here: no reduction or matmul of burn's,
//! whose autotuning would run throughput probes (a 2 GiB transient allocation on the H200) on
//! the first round. The confidence head (γ dot products per lane) is evaluated on the host from
//! the block's hidden rows, exactly as the host pass does.
//!
//! The bias `W2 · W1[prev]` is computed in the draft's dtype (f32 accumulation on the bf16
//! kernel path) instead of the host pass's f64: the draft's choices may differ on near-ties,
//! which changes acceptance, never the output distribution.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::markov::{MarkovHead, argmax_f64, softmax_t};
use crate::device::ComputeDtype;
use crate::engine::read_f32;
use crate::error::{Error, Result};
use crate::model::draft_config::MarkovHeadType;
use crate::sampling::{SamplingParams, Stream, coin, sample_weights};

/// Device copies of the Markov and confidence heads.
#[derive(Debug, Clone)]
pub(crate) struct DeviceMarkov {
    /// `markov_w1` `[V, r]` and `markov_w2` `[V, r]` in the draft's dtype; `None` without a head.
    w: Option<(Tensor<2>, Tensor<2>)>,
    device: Device,
}

/// What the device pass chose for each lane.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeviceRound {
    /// `[lane][k]` draft tokens.
    pub tokens: Vec<Vec<u32>>,
    /// `[lane][k]` proposal distributions of sampling lanes (empty for greedy lanes).
    pub q: Vec<Vec<Vec<f64>>>,
}

impl DeviceMarkov {
    /// Upload the Markov head; `None` for the gated and rnn heads, which stay on the host pass.
    pub(crate) fn new(markov: Option<&MarkovHead>, dtype: ComputeDtype, device: &Device) -> Option<Self> {
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
                Some((upload(&m.w1, [v, m.rank], dtype.dtype()), upload(&m.w2, [v, m.rank], dtype.dtype())))
            }
            Some(_) => return None,
        };
        Some(Self { w, device: device.clone() })
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
    ) -> Result<DeviceRound> {
        let lanes = anchors.len();
        let [_, v] = base.dims();
        let base = base.reshape([lanes, gamma, v]);
        let greedy = params.iter().all(|p| p.is_greedy());
        let ids =
            |values: Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(values, [lanes]), &self.device);
        let mut prev = ids(anchors.iter().map(|&a| i64::from(a)).collect());
        let mut round =
            DeviceRound { tokens: vec![Vec::with_capacity(gamma); lanes], q: vec![Vec::new(); lanes] };
        if greedy {
            let tokens = self.greedy(prev, base, gamma).into_data().convert::<i64>();
            let tokens = tokens.try_to_vec::<i64>().map_err(|e| Error::Backend(format!("{e:?}")))?;
            for (i, row) in tokens.chunks(gamma).enumerate() {
                round.tokens[i] = row.iter().map(|&t| t as u32).collect();
            }
            return Ok(round);
        }
        for k in 0..gamma {
            let row = self.corrected(&prev, &base, k);
            // The token, drawn on the host.
            let host = read_f32(row)?;
            // Lanes draw independently: over threads when the rows are long (the same draws).
            let rows: Vec<(usize, &[f32])> = host.chunks(v).enumerate().collect();
            let drawn = crate::sampling::map_rows(&rows, host.len(), |&(i, logits)| {
                let logits: Vec<f64> = logits.iter().map(|&x| f64::from(x)).collect();
                let p = params[i];
                if p.is_greedy() {
                    (argmax_f64(&logits), None)
                } else {
                    let q = softmax_t(&logits, f64::from(p.temperature));
                    let u = coin(p.seed, Stream::Draft, positions[i] + k + 1);
                    (sample_weights(&q, u).unwrap_or_else(|| argmax_f64(&logits)), Some(q))
                }
            });
            let mut next = Vec::with_capacity(lanes);
            for (i, (token, q)) in drawn.into_iter().enumerate() {
                if let Some(q) = q {
                    round.q[i].push(q);
                }
                round.tokens[i].push(token);
                next.push(i64::from(token));
            }
            prev = ids(next);
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
            let bias = dspark_kernels::linear(e, w2);
            row = row + if bias.dtype() == DType::F32 { bias } else { bias.cast(DType::F32) };
        }
        row
    }

    /// The γ greedy steps on the device alone (no upload, no read): `prev` `[lanes]` holds the
    /// anchors, `base` `[lanes, γ, V]` (f32 or the draft's dtype); returns the tokens `[lanes, γ]`, each the lowest index
    /// of its step's maximum, as the host pass chooses.
    pub(crate) fn greedy(&self, mut prev: Tensor<1, Int>, base: Tensor<3>, gamma: usize) -> Tensor<2, Int> {
        let lanes = base.dims()[0];
        let mut chosen: Vec<Tensor<2, Int>> = Vec::with_capacity(gamma);
        for k in 0..gamma {
            let t = dspark_kernels::argmax_rows(self.corrected(&prev, &base, k));
            chosen.push(t.clone().reshape([lanes, 1]));
            prev = t;
        }
        Tensor::cat(chosen, 1)
    }
}
