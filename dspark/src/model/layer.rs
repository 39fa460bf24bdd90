//! One Qwen3 decoder layer: weights in Hugging Face `[out, in]` layout, forward over the rows of
//! many sequences at once.

use std::sync::Arc;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use dspark_kernels::{
    AttentionMask, Fp8Matrix, add_rms_norm, attention, linear_fp8, qk_norm_rope, rms_norm_rows, swiglu_cols,
};

use super::cpu_gemm::PackedWeight;
use crate::device::ComputeDtype;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::weights::Checkpoint;

/// Geometry shared by the layers of one model.
#[derive(Debug, Clone, Copy)]
pub struct LayerShape {
    /// Residual width.
    pub hidden: usize,
    /// MLP inner width.
    pub intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
}

/// Weights of one decoder layer. Field names follow the checkpoint.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: Tensor<1>,
    attn_in: AttnIn,
    o_proj: Proj,
    q_norm: Tensor<1>,
    k_norm: Tensor<1>,
    post_attention_layernorm: Tensor<1>,
    mlp_in: MlpIn,
    down_proj: Proj,
    shape: LayerShape,
}

/// The q/k/v projections: three weights, or (where this crate's kernels run) one `[q; k; v]`
/// weight read in one pass, whose output the fused norm + RoPE kernel reads by column offset.
// One per layer: the unused bytes of the smaller variant do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum AttnIn {
    Split { q: Proj, k: Proj, v: Proj },
    Fused(Proj),
}

/// The gate/up projections: two weights, one `[gate; up]` weight (FP8 with block scales, see
/// [`AttnIn`]), or (where the kernels run: dense bf16, or FP8 with per-row scales) one weight
/// with their rows paired by [`dspark_kernels::pair_gate_up`] or [`Fp8Matrix::pair_gate_up`],
/// whose product ends in the SwiGLU ([`dspark_kernels::linear_swiglu`],
/// [`dspark_kernels::linear_fp8_swiglu`]).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum MlpIn {
    Split { gate: Proj, up: Proj },
    Fused(Proj),
    Paired(Tensor<2>),
    PairedFp8(Fp8Matrix),
}

/// Whether projections that read the same input are stored as one weight: where the GPU
/// kernels run (one launch and one pass over the weights instead of two or three). The CPU
/// keeps them apart, so its results are those of the separate products.
fn fuse_projections(w: &Tensor<2>) -> bool {
    dspark_kernels::kernels_available(&w.device()) && w.dtype() == DType::BF16
}

/// Weights that read the same input as one weight, where [`fuse_projections`] says so (dense)
/// or where they stack ([`Fp8Matrix::cat_rows`]); `None`: keep them apart.
fn fused(parts: &[Weight]) -> Option<Proj> {
    match parts {
        [Weight::Dense(first), ..] if fuse_projections(first) => {
            let dense: Option<Vec<Tensor<2>>> = parts
                .iter()
                .map(|w| match w {
                    Weight::Dense(t) => Some(t.clone()),
                    Weight::Fp8(_) => None,
                })
                .collect();
            dense.map(|ts| {
                let device = ts[0].device();
                Proj::new(crate::device::persistent(&device, ts, |ts| Tensor::cat(ts, 0)))
            })
        }
        [Weight::Fp8(_), ..] => {
            let fp8: Option<Vec<Fp8Matrix>> = parts
                .iter()
                .map(|w| match w {
                    Weight::Fp8(m) => Some(m.clone()),
                    Weight::Dense(_) => None,
                })
                .collect();
            fp8.and_then(|ms| Fp8Matrix::cat_rows(&ms)).map(|m| Proj(ProjKind::Fp8(m)))
        }
        _ => None,
    }
}

impl AttnIn {
    fn new(q: Weight, k: Weight, v: Weight) -> Self {
        let parts = [q, k, v];
        if let Some(w) = fused(&parts) {
            return Self::Fused(w);
        }
        let [q, k, v] = parts.map(Proj::from_weight);
        Self::Split { q, k, v }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::Split { q, k, v } => q.bytes() + k.bytes() + v.bytes(),
            Self::Fused(w) => w.bytes(),
        }
    }

    fn quantized(&self) -> Result<Self> {
        Ok(match self {
            Self::Split { q, k, v } => {
                Self::Split { q: q.quantized()?, k: k.quantized()?, v: v.quantized()? }
            }
            Self::Fused(w) => Self::Fused(w.quantized()?),
        })
    }
}

impl MlpIn {
    fn new(gate: Tensor<2>, up: Tensor<2>) -> Self {
        Self::from_weights(Weight::Dense(gate), Weight::Dense(up))
    }

    fn from_weights(gate: Weight, up: Weight) -> Self {
        if let (Weight::Dense(g), Weight::Dense(u)) = (&gate, &up)
            && fuse_projections(g)
            && g.dims() == u.dims()
            && g.dims()[0].is_multiple_of(8)
        {
            let device = g.device();
            let parts = (g.clone(), u.clone());
            return Self::Paired(crate::device::persistent(&device, parts, |(g, u)| {
                dspark_kernels::pair_gate_up(g, u)
            }));
        }
        // (FP8 matrices exist where the FP8 kernel runs, or on the CPU's reference path.)
        if let (Weight::Fp8(g), Weight::Fp8(u)) = (&gate, &up)
            && dspark_kernels::fp8_swiglu()
            && let Some(paired) = Fp8Matrix::pair_gate_up(g, u)
        {
            return Self::PairedFp8(paired);
        }
        let parts = [gate, up];
        if let Some(w) = fused(&parts) {
            return Self::Fused(w);
        }
        let [gate, up] = parts.map(Proj::from_weight);
        Self::Split { gate, up }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::Split { gate, up } => gate.bytes() + up.bytes(),
            Self::Fused(w) => w.bytes(),
            Self::Paired(w) => w.shape().num_elements() * w.dtype().size(),
            Self::PairedFp8(m) => m.bytes(),
        }
    }

    fn quantized(&self) -> Result<Self> {
        Ok(match self {
            Self::Split { gate, up } => Self::Split { gate: gate.quantized()?, up: up.quantized()? },
            Self::Fused(w) => Self::Fused(w.quantized()?),
            Self::PairedFp8(m) => Self::PairedFp8(m.clone()),
            // Back to separate gate and up rows, quantised each, then paired or stacked as FP8
            // weights are.
            Self::Paired(w) => {
                let [rows, inp] = w.dims();
                let inter = rows / 2;
                let pairs = w.clone().reshape([inter / 8, 2, 8, inp]);
                let half = |i: usize| pairs.clone().narrow(1, i, 1).reshape([inter, inp]);
                let (gate, up) = (Proj::new(half(0)).quantized()?, Proj::new(half(1)).quantized()?);
                match (gate.0, up.0) {
                    (ProjKind::Fp8(g), ProjKind::Fp8(u)) => {
                        Self::from_weights(Weight::Fp8(g), Weight::Fp8(u))
                    }
                    (g, u) => Self::Split { gate: Proj(g), up: Proj(u) },
                }
            }
        })
    }
}

/// A random `[out, in]` weight drawn on the host, quantised per channel there and kept as FP8
/// where the device runs FP8 products (else dequantised).
fn random_fp8_weight(
    [out, inp]: [usize; 2],
    draw: &mut impl FnMut() -> f32,
    dtype: ComputeDtype,
    device: &Device,
) -> Result<Weight> {
    let values: Vec<f32> = (0..out * inp).map(|_| draw()).collect();
    let q = super::fp8::quantize_per_channel(&values, out, inp)?;
    drop(values);
    super::fp8::per_channel_weight(&q, [out, inp], dtype, device, "random")
}

/// A projection weight as loaded: a dense tensor in the compute dtype, or e4m3 bytes and scales
/// kept as FP8 on a device that runs FP8 products (see [`super::fp8`]).
// Passed along at load, a few per layer: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub(crate) enum Weight {
    Dense(Tensor<2>),
    Fp8(Fp8Matrix),
}

/// The page tables of one batched forward on the device, for [`dspark_kernels::paged_attention`]:
/// every sequence's physical rows (`keys`) and, per query row, where its keys start in `keys`
/// and how many it sees (`meta`, `[rows, 2]`), and the physical rows the batch's new K/V go to
/// (`new_rows`, in row order). Built once per forward, read by every layer. `group`: rows per
/// sequence when every sequence has as many (they share a key table; see
/// [`dspark_kernels::paged_attention_grouped`]), else 1. `sync`: zeroed i32 counters for
/// [`dspark_kernels::paged_attention_synced`], and `tail_sync` for
/// [`dspark_kernels::layer_tail`] (each layer's kernels leave them zero for the next), where the
/// forward has them.
#[derive(Debug, Clone)]
pub(crate) struct AttnPlan {
    pub keys: Tensor<1, Int>,
    pub meta: Tensor<2, Int>,
    pub new_rows: Tensor<1, Int>,
    pub group: usize,
    pub sync: Option<Tensor<1, Int>>,
    pub tail_sync: Option<Tensor<1, Int>>,
}

impl AttnPlan {
    /// The tables on `device`: `keys` and `meta` as i32 (what the kernel reads), `new_rows` as
    /// burn's index type (what the K/V row assignment takes), and where the kernels run
    /// `sync_words` zeroed attention counters (none for 0) and the layer tails' counters.
    pub(crate) fn upload(
        keys: Vec<i32>,
        meta: Vec<i32>,
        new_rows: Vec<i64>,
        group: usize,
        sync_words: usize,
        device: &Device,
    ) -> Self {
        let opts = || burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(DType::I32);
        let (n, rows, new) = (keys.len(), meta.len() / 2, new_rows.len());
        let kernels = dspark_kernels::kernels_available(device);
        let sync = (sync_words > 0 && kernels).then(|| Tensor::zeros([sync_words], opts()));
        let tail_sync = kernels.then(|| Tensor::zeros([dspark_kernels::LAYER_TAIL_SYNC_WORDS], opts()));
        Self {
            keys: Tensor::from_data(TensorData::new(keys, [n]), opts()),
            meta: Tensor::from_data(TensorData::new(meta, [rows, 2]), opts()),
            new_rows: Tensor::from_data(TensorData::new(new_rows, [new]), device),
            group,
            sync,
            tail_sync,
        }
    }

    /// Attention of `q` over the pools through these tables (see
    /// [`dspark_kernels::paged_attention_grouped`]), with the counters where there are some.
    pub(crate) fn attend(&self, q: Tensor<3>, k_pool: &Tensor<3>, v_pool: &Tensor<3>) -> Tensor<3> {
        match &self.sync {
            Some(sync) => dspark_kernels::paged_attention_synced(
                q, k_pool, v_pool, &self.keys, &self.meta, self.group, sync,
            ),
            None => {
                dspark_kernels::paged_attention_grouped(q, k_pool, v_pool, &self.keys, &self.meta, self.group)
            }
        }
    }
}

/// Where one sequence's rows sit in a batched forward.
#[derive(Debug, Clone)]
pub(crate) struct SeqRows {
    pub seq: SeqId,
    /// Rows of this sequence within the batch.
    pub rows: std::ops::Range<usize>,
    /// Position of the first new row (= cached length before the forward).
    pub start: usize,
    /// Physical cache rows of positions `0..start + rows.len()` (gathered only when the forward
    /// has no [`AttnPlan`]).
    pub index: Option<Tensor<1, Int>>,
}

/// `x · Wᵀ` for a weight stored `[out, in]`.
pub(crate) fn linear(x: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    dspark_kernels::linear(x, weight)
}

/// A projection weight, loaded in the checkpoint's `[out, in]` layout.
///
/// On the CPU backend an f32 weight is copied to the host and packed for
/// [`cpu_gemm`](super::cpu_gemm), whose few-row products (decode steps, verify windows, draft
/// blocks) run several times faster than Flex's matmul (see `cpu_gemm`'s timing test). Other CPU
/// dtypes keep the weight as a burn tensor, transposed and contiguous (`[in, out]`): Flex's matmul
/// runs few-row products up to 2.3× faster that way than through a transposed view. On other
/// backends it is used as loaded.
#[derive(Debug, Clone)]
pub(crate) struct Proj(ProjKind);

// A few dozen of these per model: the unused bytes of the host variant do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum ProjKind {
    /// `[out, in]` as loaded (`transposed` false) or `[in, out]` contiguous (true).
    Burn { weight: Tensor<2>, transposed: bool },
    /// f32 on the CPU, packed on the host.
    Host(Arc<PackedWeight>),
    /// e4m3 bytes and scales on the device, multiplied by [`linear_fp8`].
    Fp8(Fp8Matrix),
}

impl Proj {
    pub(crate) fn new(weight: Tensor<2>) -> Self {
        let cpu = crate::device::DeviceKind::Cpu.device().is_ok_and(|d| d == weight.device());
        if !cpu {
            return Self(ProjKind::Burn { weight, transposed: false });
        }
        let [out, inp] = weight.dims();
        if weight.dtype() == DType::F32
            && let Ok(host) = weight.to_data().try_into_vec::<f32>()
        {
            return Self(ProjKind::Host(Arc::new(PackedWeight::from_out_in(&host, out, inp))));
        }
        let options = burn::tensor::TensorCreationOptions::new(weight.device()).with_dtype(weight.dtype());
        let weight = Tensor::from_data(weight.transpose().into_data(), options);
        Self(ProjKind::Burn { weight, transposed: true })
    }

    /// The projection of a loaded weight.
    pub(crate) fn from_weight(weight: Weight) -> Self {
        match weight {
            Weight::Dense(t) => Self::new(t),
            Weight::Fp8(m) => Self(ProjKind::Fp8(m)),
        }
    }

    /// The projection onto the output rows `ids` only (in that order): a draft's LM head for a
    /// restricted vocabulary. Each row's values are those of the full weight, so each output is
    /// the full product's value at that row.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when an id is out of range or, for an FP8 weight, when its scales
    /// are not per row or the row count does not suit the FP8 kernel.
    pub(crate) fn select_rows(&self, ids: &[u32]) -> Result<Self> {
        let out = self.out_features();
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= out) {
            return Err(Error::InvalidInput(format!("row {bad} of a projection with {out} rows")));
        }
        let index = |device: &Device| {
            let values: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
            Tensor::<1, Int>::from_data(TensorData::new(values, [ids.len()]), device)
        };
        Ok(match &self.0 {
            ProjKind::Burn { weight, transposed } => {
                let device = weight.device();
                let (dim, parts) = (usize::from(*transposed), (weight.clone(), index(&device)));
                let weight = crate::device::persistent(&device, parts, |(w, i)| w.select(dim, i));
                Self(ProjKind::Burn { weight, transposed: *transposed })
            }
            ProjKind::Host(w) => {
                let (inp, all) = (w.k(), w.to_out_in());
                let rows: Vec<f32> = ids
                    .iter()
                    .flat_map(|&i| &all[i as usize * inp..(i as usize + 1) * inp])
                    .copied()
                    .collect();
                Self(ProjKind::Host(Arc::new(PackedWeight::from_out_in(&rows, ids.len(), inp))))
            }
            ProjKind::Fp8(m) => {
                let picked = m.select_rows(index(&m.device()));
                Self(ProjKind::Fp8(picked.ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "{} rows of an FP8 weight: it needs per-row scales and a multiple of 16 rows",
                        ids.len()
                    ))
                })?))
            }
        })
    }

    /// Rows of the `[out, in]` weight.
    fn out_features(&self) -> usize {
        match &self.0 {
            ProjKind::Burn { weight, transposed } => weight.dims()[usize::from(*transposed)],
            ProjKind::Host(w) => w.n(),
            ProjKind::Fp8(m) => m.dims()[0],
        }
    }

    /// Whether the weight is kept as FP8.
    pub(crate) fn is_fp8(&self) -> bool {
        matches!(self.0, ProjKind::Fp8(_))
    }

    /// Bytes the weight occupies (FP8: one per element plus the scales).
    pub(crate) fn bytes(&self) -> usize {
        match &self.0 {
            ProjKind::Burn { weight, .. } => weight.shape().num_elements() * weight.dtype().size(),
            ProjKind::Host(w) => w.n() * w.k() * 4,
            ProjKind::Fp8(m) => m.bytes(),
        }
    }

    /// `[out, in]` values on the host as f32, with the device and dtype the weight computes in.
    fn host_values(&self) -> Result<(Vec<f32>, [usize; 2], Device, ComputeDtype)> {
        let backend = |e| Error::Backend(format!("reading a projection weight back: {e:?}"));
        match &self.0 {
            ProjKind::Burn { weight, transposed } => {
                let w = if *transposed { weight.clone().transpose() } else { weight.clone() };
                let [out, inp] = w.dims();
                let dtype = ComputeDtype::of(w.dtype())?;
                let device = w.device();
                // In row blocks of at most 64 MiB: reading a device tensor back may first copy
                // it to a contiguous buffer (an LM head's rows are stored with a padded pitch),
                // and a whole-matrix copy would stay reserved in the device pool (measured
                // +1.2 GB for a Qwen3-8B head).
                let rows = ((64usize << 20) / (inp * dtype.size()).max(1)).clamp(1, out.max(1));
                let mut values = Vec::with_capacity(out * inp);
                for start in (0..out).step_by(rows) {
                    let len = rows.min(out - start);
                    let part = w.clone().narrow(0, start, len).into_data().convert::<f32>();
                    values.extend(part.try_into_vec::<f32>().map_err(backend)?);
                }
                Ok((values, [out, inp], device, dtype))
            }
            ProjKind::Host(w) => {
                let device = crate::device::DeviceKind::Cpu.device()?;
                Ok((w.to_out_in(), [w.n(), w.k()], device, ComputeDtype::F32))
            }
            ProjKind::Fp8(_) => Err(Error::Unsupported("an FP8 weight is not quantised again".into())),
        }
    }

    /// The weight quantised to e4m3 with per-output-channel scales
    /// ([`DraftQuant::Fp8PerChannel`](super::fp8::DraftQuant)), kept as FP8 where the device runs
    /// FP8 products and dequantised elsewhere; an FP8 weight is returned as it is.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the weight holds a non-finite value.
    pub(crate) fn quantized(&self) -> Result<Self> {
        if self.is_fp8() {
            return Ok(self.clone());
        }
        let (values, [out, inp], device, dtype) = self.host_values()?;
        let q = super::fp8::quantize_per_channel(&values, out, inp)?;
        let weight = super::fp8::per_channel_weight(&q, [out, inp], dtype, &device, "projection")?;
        Ok(Self::from_weight(weight))
    }

    /// A random `[out, in]` weight drawn on the host by `draw`, quantised per channel there
    /// (see [`Proj::quantized`]): no dense copy reaches the device.
    pub(crate) fn random_fp8(
        dims: [usize; 2],
        draw: &mut impl FnMut() -> f32,
        dtype: ComputeDtype,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self::from_weight(random_fp8_weight(dims, draw, dtype, device)?))
    }

    /// `x · Wᵀ` for the `[out, in]` weight.
    pub(crate) fn apply(&self, x: Tensor<2>) -> Tensor<2> {
        match &self.0 {
            ProjKind::Fp8(m) => linear_fp8(x, m),
            ProjKind::Burn { weight, transposed: true } => x.matmul(weight.clone()),
            ProjKind::Burn { weight, transposed: false } => linear(x, weight),
            ProjKind::Host(w) => {
                let [rows, _] = x.dims();
                let device = x.device();
                let data =
                    if x.dtype() == DType::F32 { x.into_data() } else { x.into_data_dtype(DType::F32) };
                let y = match data.as_slice::<f32>() {
                    Ok(xs) => w.matmul(xs),
                    // An f32 tensor always reads back as f32.
                    Err(e) => panic!("reading an f32 activation back: {e:?}"),
                };
                Tensor::from_data(TensorData::new(y, [rows, w.n()]), &device)
            }
        }
    }

    /// The residual add of this projection and the RMSNorm after it: `(s, RMSNorm(s)·norm)` with
    /// `s = x + a·Wᵀ` (one kernel for a split product's combine, the add and the norm, where
    /// [`dspark_kernels::linear_add_rms_norm`] runs it).
    pub(crate) fn apply_add_norm(
        &self,
        x: Tensor<2>,
        a: Tensor<2>,
        norm: &Tensor<1>,
        eps: f64,
    ) -> (Tensor<2>, Tensor<2>) {
        match &self.0 {
            ProjKind::Fp8(m) => dspark_kernels::linear_fp8_add_rms_norm(x, a, m, norm, eps),
            ProjKind::Burn { weight, transposed: false } => {
                dspark_kernels::linear_add_rms_norm(x, a, weight, norm, eps)
            }
            _ => add_rms_norm(x, self.apply(a), norm, eps),
        }
    }

    /// `x · W[start..start + len]ᵀ`: the product with a range of the weight's output rows.
    pub(crate) fn apply_rows(&self, x: Tensor<2>, start: usize, len: usize) -> Tensor<2> {
        match &self.0 {
            ProjKind::Burn { weight, transposed: false } => linear(x, &weight.clone().narrow(0, start, len)),
            ProjKind::Burn { weight, transposed: true } => x.matmul(weight.clone().narrow(1, start, len)),
            ProjKind::Host(_) => self.apply(x).narrow(1, start, len),
            ProjKind::Fp8(m) => match m.narrow_rows(start, len) {
                Some(rows) => linear_fp8(x, &rows),
                None => linear_fp8(x, m).narrow(1, start, len),
            },
        }
    }
}

impl DecoderLayer {
    /// Load the tensors under `prefix` (e.g. `model.layers.3.`).
    ///
    /// # Errors
    /// Missing tensors or wrong shapes, naming the tensor and file.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        shape: LayerShape,
        dtype: ComputeDtype,
        device: &Device,
        loaded: impl FnMut(&str),
    ) -> Result<Self> {
        let matrix = |name: &str, dims: [usize; 2]| ckpt.load(name, dims, dtype, device).map(Weight::Dense);
        Self::load_with(ckpt, prefix, shape, dtype, device, loaded, matrix)
    }

    /// As [`DecoderLayer::load`], with the seven projection weights read by `load_matrix`
    /// (full tensor name, `[out, in]`), e.g. to dequantise FP8 weights.
    pub(crate) fn load_with(
        ckpt: &Checkpoint,
        prefix: &str,
        shape: LayerShape,
        dtype: ComputeDtype,
        device: &Device,
        mut loaded: impl FnMut(&str),
        mut load_matrix: impl FnMut(&str, [usize; 2]) -> Result<Weight>,
    ) -> Result<Self> {
        let LayerShape { hidden, intermediate, heads, kv_heads, head_dim, .. } = shape;
        let mut matrix = |name: &str, dims: [usize; 2]| -> Result<Weight> {
            let full = format!("{prefix}{name}");
            let t = load_matrix(&full, dims)?;
            loaded(&full);
            Ok(t)
        };
        let attn_in = AttnIn::new(
            matrix("self_attn.q_proj.weight", [heads * head_dim, hidden])?,
            matrix("self_attn.k_proj.weight", [kv_heads * head_dim, hidden])?,
            matrix("self_attn.v_proj.weight", [kv_heads * head_dim, hidden])?,
        );
        let o_proj = Proj::from_weight(matrix("self_attn.o_proj.weight", [hidden, heads * head_dim])?);
        let mlp_in = MlpIn::from_weights(
            matrix("mlp.gate_proj.weight", [intermediate, hidden])?,
            matrix("mlp.up_proj.weight", [intermediate, hidden])?,
        );
        let down_proj = Proj::from_weight(matrix("mlp.down_proj.weight", [hidden, intermediate])?);
        let mut vector = |name: &str, len: usize| -> Result<Tensor<1>> {
            let full = format!("{prefix}{name}");
            let t = ckpt.load(&full, [len], dtype, device)?;
            loaded(&full);
            Ok(t)
        };
        Ok(Self {
            input_layernorm: vector("input_layernorm.weight", hidden)?,
            q_norm: vector("self_attn.q_norm.weight", head_dim)?,
            k_norm: vector("self_attn.k_norm.weight", head_dim)?,
            post_attention_layernorm: vector("post_attention_layernorm.weight", hidden)?,
            attn_in,
            o_proj,
            mlp_in,
            down_proj,
            shape,
        })
    }

    /// A layer with random weights (uniform in ±`scale`, norms 1), built on `device`: for
    /// benchmarks at real shapes without a checkpoint.
    pub fn random(shape: LayerShape, dtype: ComputeDtype, device: &Device, scale: f64) -> Self {
        let opts = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
        let dist = burn::tensor::Distribution::Uniform(-scale, scale);
        let matrix = |rows: usize, cols: usize| {
            crate::device::persistent(device, (), |()| Tensor::<2>::random([rows, cols], dist, opts.clone()))
        };
        let ones =
            |len: usize| crate::device::persistent(device, (), |()| Tensor::<1>::ones([len], opts.clone()));
        let LayerShape { hidden, intermediate, heads, kv_heads, head_dim, .. } = shape;
        Self {
            input_layernorm: ones(hidden),
            attn_in: AttnIn::new(
                Weight::Dense(matrix(heads * head_dim, hidden)),
                Weight::Dense(matrix(kv_heads * head_dim, hidden)),
                Weight::Dense(matrix(kv_heads * head_dim, hidden)),
            ),
            o_proj: Proj::new(matrix(hidden, heads * head_dim)),
            q_norm: ones(head_dim),
            k_norm: ones(head_dim),
            post_attention_layernorm: ones(hidden),
            mlp_in: MlpIn::new(matrix(intermediate, hidden), matrix(intermediate, hidden)),
            down_proj: Proj::new(matrix(hidden, intermediate)),
            shape,
        }
    }

    /// As [`DecoderLayer::random`] with FP8 projections drawn on the host ([`Proj::random_fp8`];
    /// q/k/v and gate/up stacked as the loader stacks them).
    pub(crate) fn random_fp8(
        shape: LayerShape,
        dtype: ComputeDtype,
        device: &Device,
        draw: &mut impl FnMut() -> f32,
    ) -> Result<Self> {
        let opts = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
        let ones =
            |len: usize| crate::device::persistent(device, (), |()| Tensor::<1>::ones([len], opts.clone()));
        let LayerShape { hidden, intermediate, heads, kv_heads, head_dim, .. } = shape;
        let mut weight = |out: usize, inp: usize| random_fp8_weight([out, inp], draw, dtype, device);
        let q = weight(heads * head_dim, hidden)?;
        let k = weight(kv_heads * head_dim, hidden)?;
        let v = weight(kv_heads * head_dim, hidden)?;
        let o = weight(hidden, heads * head_dim)?;
        let gate = weight(intermediate, hidden)?;
        let up = weight(intermediate, hidden)?;
        let down = weight(hidden, intermediate)?;
        Ok(Self {
            input_layernorm: ones(hidden),
            attn_in: AttnIn::new(q, k, v),
            o_proj: Proj::from_weight(o),
            q_norm: ones(head_dim),
            k_norm: ones(head_dim),
            post_attention_layernorm: ones(hidden),
            mlp_in: MlpIn::from_weights(gate, up),
            down_proj: Proj::from_weight(down),
            shape,
        })
    }

    /// Bytes of this layer's weights (FP8 projections at one byte per weight plus scales).
    pub fn weight_bytes(&self) -> usize {
        let LayerShape { hidden, head_dim, .. } = self.shape;
        let norms = (2 * hidden + 2 * head_dim) * self.input_layernorm.dtype().size();
        norms + self.attn_in.bytes() + self.o_proj.bytes() + self.mlp_in.bytes() + self.down_proj.bytes()
    }

    /// This layer with its seven projections quantised to e4m3 as [`Proj::quantized`] does.
    ///
    /// # Errors
    /// As [`Proj::quantized`].
    pub(crate) fn quantized(&self) -> Result<Self> {
        Ok(Self {
            attn_in: self.attn_in.quantized()?,
            o_proj: self.o_proj.quantized()?,
            mlp_in: self.mlp_in.quantized()?,
            down_proj: self.down_proj.quantized()?,
            ..self.clone()
        })
    }

    /// Whether the FP8 gate/up weights are paired for the SwiGLU epilogue.
    pub(crate) fn fp8_swiglu(&self) -> bool {
        matches!(self.mlp_in, MlpIn::PairedFp8(_))
    }

    /// How many of this layer's weights are FP8 matrices (a fused weight counts once per part).
    pub(crate) fn fp8_projections(&self) -> usize {
        let attn = match &self.attn_in {
            AttnIn::Split { q, k, v } => [q, k, v].iter().filter(|p| p.is_fp8()).count(),
            AttnIn::Fused(w) => 3 * usize::from(w.is_fp8()),
        };
        let mlp = match &self.mlp_in {
            MlpIn::Split { gate, up } => [gate, up].iter().filter(|p| p.is_fp8()).count(),
            MlpIn::Fused(w) => 2 * usize::from(w.is_fp8()),
            MlpIn::Paired(_) => 0,
            MlpIn::PairedFp8(_) => 2,
        };
        attn + mlp + usize::from(self.o_proj.is_fp8()) + usize::from(self.down_proj.is_fp8())
    }

    /// Names of this layer's tensors under `prefix`.
    pub fn tensor_names(prefix: &str) -> impl Iterator<Item = String> + '_ {
        [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        .into_iter()
        .map(move |n| format!("{prefix}{n}"))
    }

    /// The weight of this layer's input RMSNorm (the norm the previous layer's last kernel
    /// applies, see [`DecoderLayer::forward`]).
    pub(crate) fn input_norm(&self) -> &Tensor<1> {
        &self.input_layernorm
    }

    /// One layer over the new rows of every sequence: causal attention over each sequence's
    /// cached context plus its new rows; the new rows' K/V are written to the cache first.
    ///
    /// The layer takes its input twice, as the residual stream `x` and already normed by its
    /// input norm (`h`), and hands out its output the same way, normed by `next_norm` (the next
    /// layer's input norm, or the model's final norm): the last residual add and that norm are
    /// then one kernel with the down projection's combine (see [`Proj::apply_add_norm`]).
    ///
    /// # Shapes
    /// `x`, `h`: `[rows, hidden]`, `cos`/`sin`: `[rows, head_dim]` → (`[rows, hidden]`,
    /// `[rows, hidden]`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        layer: usize,
        (x, h): (Tensor<2>, Tensor<2>),
        (cos, sin): (&Tensor<2>, &Tensor<2>),
        seqs: &[SeqRows],
        plan: Option<&AttnPlan>,
        next_norm: &Tensor<1>,
        cache: &mut dyn KvCache,
    ) -> Result<(Tensor<2>, Tensor<2>)> {
        // 1-3a. one kernel over every sequence's page table, after storing the new K/V.
        if let Some(plan) = plan {
            let q = self.qkv_store(layer, h, (cos, sin), &plan.new_rows, cache)?;
            // (The pools are looked up after the write: a live clone would make the in-place row
            // assignment copy the whole pool.)
            let (k_pool, v_pool) = cache
                .pools(layer)
                .ok_or_else(|| crate::error::Error::InvalidInput(format!("no K/V pool for layer {layer}")))?;
            let attn = plan.attend(q, &k_pool, &v_pool);
            return Ok(self.finish(x, attn, next_norm, plan.tail_sync.as_ref()));
        }
        // 1-2. projections, per-head norms, RoPE.
        let (q, k, v) = self.qkv(h, cos, sin);
        // 3b. per sequence: store new K/V, attend over the whole context.
        let mut outs = Vec::with_capacity(seqs.len());
        for s in seqs {
            let n = s.rows.len();
            let (k_new, v_new) = if seqs.len() == 1 {
                (k.clone(), v.clone())
            } else {
                (k.clone().narrow(0, s.rows.start, n), v.clone().narrow(0, s.rows.start, n))
            };
            cache.write(layer, s.seq, s.start, k_new, v_new)?;
            let index = s.index.as_ref().ok_or_else(|| {
                crate::error::Error::InvalidInput(format!("no gather index for sequence {}", s.seq))
            })?;
            let (k_all, v_all) = cache.read(layer, index);
            let q_seq = if seqs.len() == 1 { q.clone() } else { q.clone().narrow(0, s.rows.start, n) };
            outs.push(attention(q_seq, k_all, v_all, AttentionMask::Causal { first: s.start }));
        }
        let attn = if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(outs, 0) };
        // 4-5. output projection, MLP, residuals.
        Ok(self.finish(x, attn, next_norm, None))
    }

    /// q/k/v projections of the normed input `h`, per-head RMSNorm and RoPE.
    ///
    /// # Shapes
    /// `h`: `[rows, hidden]` → q `[rows, heads, hd]`, k/v `[rows, kv_heads, hd]`.
    fn qkv(&self, h: Tensor<2>, cos: &Tensor<2>, sin: &Tensor<2>) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let LayerShape { heads, kv_heads, head_dim, eps, .. } = self.shape;
        let rows = h.dims()[0];
        // Where q, k and v sit: columns of one fused output, or three outputs.
        let (q_src, k_src, v_src, k_off, v_off) = match &self.attn_in {
            AttnIn::Fused(w) => {
                let y = w.apply(h);
                (y.clone(), y.clone(), y, heads * head_dim, (heads + kv_heads) * head_dim)
            }
            AttnIn::Split { q, k, v } => (q.apply(h.clone()), k.apply(h.clone()), v.apply(h), 0, 0),
        };
        let q = qk_norm_rope(q_src, 0, heads, head_dim, &self.q_norm, cos, sin, eps);
        let k = qk_norm_rope(k_src, k_off, kv_heads, head_dim, &self.k_norm, cos, sin, eps);
        let v = v_src.narrow(1, v_off, kv_heads * head_dim).reshape([rows, kv_heads, head_dim]);
        (q, k, v)
    }

    /// [`DecoderLayer::qkv`] with the new K/V stored at the pool rows `rows` of `layer`; returns
    /// q. With one fused q/k/v weight and a pooled cache, the norms, RoPE and both stores are one
    /// kernel ([`dspark_kernels::qkv_norm_rope_store`]); the values are the same.
    fn qkv_store(
        &self,
        layer: usize,
        h: Tensor<2>,
        (cos, sin): (&Tensor<2>, &Tensor<2>),
        rows: &Tensor<1, Int>,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor<3>> {
        let LayerShape { heads, kv_heads, head_dim, eps, .. } = self.shape;
        let n = h.dims()[0];
        if let AttnIn::Fused(w) = &self.attn_in
            && rows.dims()[0] == n
            && let Some((k_pool, v_pool)) = cache.pools_mut(layer)
        {
            let y = w.apply(h);
            let shape = (heads, kv_heads, head_dim);
            let (norms, rope) = ((&self.q_norm, &self.k_norm), (cos, sin));
            return Ok(dspark_kernels::qkv_norm_rope_store(
                y, shape, norms.0, norms.1, rope, eps, rows, k_pool, v_pool,
            ));
        }
        let (q, k, v) = self.qkv(h, cos, sin);
        cache.write_rows(layer, rows, k, v)?;
        Ok(q)
    }

    /// Output projection and residual, then the MLP and its residual, normed by `next_norm`.
    ///
    /// # Shapes
    /// `x`: `[rows, hidden]`, `attn`: `[rows, heads, hd]` → (`[rows, hidden]`, `[rows, hidden]`).
    fn finish(
        &self,
        x: Tensor<2>,
        attn: Tensor<3>,
        next_norm: &Tensor<1>,
        sync: Option<&Tensor<1, Int>>,
    ) -> (Tensor<2>, Tensor<2>) {
        let LayerShape { heads, head_dim, intermediate, eps, .. } = self.shape;
        let rows = x.dims()[0];
        let attn = attn.reshape([rows, heads * head_dim]);
        // The whole tail as one launch where the kernels chain it (the same bits).
        let weights = match (&self.o_proj.0, &self.mlp_in, &self.down_proj.0) {
            (
                ProjKind::Burn { weight: o, transposed: false },
                MlpIn::Paired(gate_up),
                ProjKind::Burn { weight: down, transposed: false },
            ) => Some(dspark_kernels::TailWeights::Bf16 { o, gate_up, down }),
            (ProjKind::Fp8(o), MlpIn::PairedFp8(gate_up), ProjKind::Fp8(down)) => {
                Some(dspark_kernels::TailWeights::Fp8 { o, gate_up, down })
            }
            _ => None,
        };
        if let (Some(sync), Some(weights)) = (sync, weights) {
            let norms = (&self.post_attention_layernorm, next_norm);
            return dspark_kernels::layer_tail(x, attn, norms, weights, eps, Some(sync));
        }
        let (x, h) = self.o_proj.apply_add_norm(x, attn, &self.post_attention_layernorm, eps);
        let act = match &self.mlp_in {
            MlpIn::Fused(w) => {
                let y = w.apply(h);
                swiglu_cols(y.clone(), y, 0, intermediate, intermediate)
            }
            MlpIn::Split { gate, up } => swiglu_cols(gate.apply(h.clone()), up.apply(h), 0, 0, intermediate),
            MlpIn::Paired(w) => dspark_kernels::linear_swiglu(h, w),
            MlpIn::PairedFp8(m) => dspark_kernels::linear_fp8_swiglu(h, m),
        };
        self.down_proj.apply_add_norm(x, act, next_norm, eps)
    }
}

/// The input of the first of `layers` for the residual stream `x`: `(x, RMSNorm(x))` with the
/// first layer's input norm (with no layers, `last`).
pub(crate) fn stack_input(
    layers: &[DecoderLayer],
    last: &Tensor<1>,
    x: Tensor<2>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    let norm = layers.first().map_or(last, DecoderLayer::input_norm);
    let h = rms_norm_rows(x.clone(), norm, eps);
    (x, h)
}

/// The norm layer `l` of `layers` applies to its output: the next layer's input norm, or after
/// the last layer `last` (the model's final norm).
pub(crate) fn next_norm<'a>(layers: &'a [DecoderLayer], l: usize, last: &'a Tensor<1>) -> &'a Tensor<1> {
    layers.get(l + 1).map_or(last, DecoderLayer::input_norm)
}

/// One lane of a draft block forward.
#[derive(Debug, Clone)]
pub(crate) struct BlockLane {
    /// Rows of this lane's block within the batch.
    pub rows: std::ops::Range<usize>,
    /// Physical cache rows of the lane's context positions `0..L`.
    pub index: Tensor<1, Int>,
    /// Context length `L`.
    pub context: usize,
}

/// Where [`DecoderLayer::write_context`] stores its rows.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ContextRows<'a> {
    /// Pool rows, one per new row (possibly of several sequences): one row assignment whose
    /// kernel does not depend on where the rows sit.
    Physical(&'a Tensor<1, Int>),
    /// Positions `start..` of one sequence.
    Sequence { seq: SeqId, start: usize },
}

impl DecoderLayer {
    /// Draft-context K/V of new context rows: `K = RoPE(k_norm(k_proj c))`, `V = v_proj c` (no
    /// input norm: `c` is already the normed projection of the target features), stored at `at`.
    ///
    /// # Shapes
    /// `c`: `[rows, hidden]`, `cos`/`sin`: `[rows, head_dim]`.
    pub(crate) fn write_context(
        &self,
        layer: usize,
        c: Tensor<2>,
        (cos, sin): (&Tensor<2>, &Tensor<2>),
        at: ContextRows<'_>,
        cache: &mut dyn KvCache,
    ) -> Result<()> {
        let LayerShape { heads, kv_heads, head_dim, eps, .. } = self.shape;
        let rows = c.dims()[0];
        // Pool rows of a fused weight's k/v output: norm, RoPE and both stores in one kernel.
        if let (AttnIn::Fused(w), ContextRows::Physical(at)) = (&self.attn_in, at)
            && at.dims()[0] == rows
            && let Some((k_pool, v_pool)) = cache.pools_mut(layer)
        {
            let y = w.apply_rows(c, heads * head_dim, 2 * kv_heads * head_dim);
            let (rope, shape) = ((cos, sin), (kv_heads, head_dim));
            dspark_kernels::kv_norm_rope_store(y, shape, &self.k_norm, rope, eps, at, k_pool, v_pool);
            return Ok(());
        }
        let (k_src, v_src, v_off) = match &self.attn_in {
            // The k and v rows of the fused weight (a view: they are contiguous rows).
            AttnIn::Fused(w) => {
                let y = w.apply_rows(c, heads * head_dim, 2 * kv_heads * head_dim);
                (y.clone(), y, kv_heads * head_dim)
            }
            AttnIn::Split { k, v, .. } => (k.apply(c.clone()), v.apply(c), 0),
        };
        let k = qk_norm_rope(k_src, 0, kv_heads, head_dim, &self.k_norm, cos, sin, eps);
        let v = v_src.narrow(1, v_off, kv_heads * head_dim).reshape([rows, kv_heads, head_dim]);
        match at {
            ContextRows::Physical(rows) => cache.write_rows(layer, rows, k, v),
            ContextRows::Sequence { seq, start } => cache.write(layer, seq, start, k, v),
        }
    }

    /// One draft layer over the block rows of every lane: each block row attends, without a
    /// mask, to the lane's cached context keys and to all block keys of the lane. Block K/V are
    /// not stored. Input and output as [`DecoderLayer::forward`]: the residual stream and its
    /// normed copy.
    ///
    /// # Shapes
    /// `x`, `h`: `[rows, hidden]`, `cos`/`sin`: `[rows, head_dim]` → (`[rows, hidden]`,
    /// `[rows, hidden]`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_block(
        &self,
        layer: usize,
        (x, h): (Tensor<2>, Tensor<2>),
        cos: &Tensor<2>,
        sin: &Tensor<2>,
        lanes: &[BlockLane],
        next_norm: &Tensor<1>,
        cache: &dyn KvCache,
    ) -> (Tensor<2>, Tensor<2>) {
        // 1. projections, per-head norms, RoPE at the block positions.
        let (q, k, v) = self.qkv(h, cos, sin);
        // 2. per lane: keys = [context; block], bidirectional.
        let mut outs = Vec::with_capacity(lanes.len());
        for lane in lanes {
            let n = lane.rows.len();
            let k_blk = k.clone().narrow(0, lane.rows.start, n);
            let v_blk = v.clone().narrow(0, lane.rows.start, n);
            let (k_all, v_all) = if lane.context == 0 {
                (k_blk, v_blk)
            } else {
                let (kc, vc) = cache.read(layer, &lane.index);
                (Tensor::cat(vec![kc, k_blk], 0), Tensor::cat(vec![vc, v_blk], 0))
            };
            let q_lane = q.clone().narrow(0, lane.rows.start, n);
            outs.push(attention(q_lane, k_all, v_all, AttentionMask::Full));
        }
        let attn = if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(outs, 0) };
        // 3. output projection, MLP, residuals.
        self.finish(x, attn, next_norm, None)
    }

    /// [`DecoderLayer::forward_block`] through the paged kernel: the block's K/V go to the
    /// scratch rows `plan.new_rows` the caller reserved after each lane's context, and every
    /// block row attends to the keys `plan` lists for it (context and whole block).
    ///
    /// # Shapes
    /// `x`, `h`: `[rows, hidden]`, `cos`/`sin`: `[rows, head_dim]` → (`[rows, hidden]`,
    /// `[rows, hidden]`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_block_paged(
        &self,
        layer: usize,
        (x, h): (Tensor<2>, Tensor<2>),
        cos: &Tensor<2>,
        sin: &Tensor<2>,
        plan: &AttnPlan,
        next_norm: &Tensor<1>,
        cache: &mut dyn KvCache,
    ) -> Result<(Tensor<2>, Tensor<2>)> {
        let q = self.qkv_store(layer, h, (cos, sin), &plan.new_rows, cache)?;
        let (k_pool, v_pool) = cache
            .pools(layer)
            .ok_or_else(|| crate::error::Error::InvalidInput(format!("no K/V pool for layer {layer}")))?;
        let attn = plan.attend(q, &k_pool, &v_pool);
        Ok(self.finish(x, attn, next_norm, plan.tail_sync.as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    #[test]
    fn cpu_projection_matches_burn_matmul_within_f32_rounding() {
        let device = crate::device::DeviceKind::Cpu.device().expect("CPU backend");
        let uniform = Distribution::Uniform(-1.0, 1.0);
        for &(out, inp) in &[(1, 1), (33, 37), (95, 67), (200, 13), (768, 256), (256, 768)] {
            let w = Tensor::<2>::random([out, inp], uniform, &device);
            let proj = Proj::new(w.clone());
            assert!(matches!(proj.0, ProjKind::Host(_)), "f32 on the CPU takes the host path");
            for rows in [1, 2, 3, 7, 8, 9, 12, 13, 16, 17, 64] {
                let x = Tensor::<2>::random([rows, inp], uniform, &device);
                let got = proj.apply(x.clone());
                assert_eq!(got.dims(), [rows, out]);
                let want = x.clone().matmul(w.clone().transpose());
                // Each side's summation error is at most inp·ε·Σ|x·w|.
                let scale = x.abs().matmul(w.clone().abs().transpose());
                let [got, want, scale] =
                    [got, want, scale].map(|t| t.into_data().try_to_vec::<f32>().expect("f32 data"));
                for (i, ((g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                    let bound = 2.0 * inp as f32 * f32::EPSILON * s;
                    assert!(
                        (g - w).abs() <= bound,
                        "[{out}x{inp}] rows {rows} at {i}: {g} vs {w} (bound {bound})"
                    );
                }
            }
        }
    }
}
