//! The DSpark draft: a few Qwen3-style layers fed by the target's hidden features, proposing a
//! block of γ tokens in one parallel pass, made sequential by a Markov head.

use std::path::Path;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use dspark_kernels::rms_norm_rows as rms_norm;

use super::draft_config::{DSparkConfig, MarkovHeadType, default_target_layer_ids};
use super::draft_vocab::DraftVocab;
use super::fp8::{DraftQuant, Fp8Counts, QuantizedRows, load_projection};
use super::graphs::{Graphs, HostInputs, MAX_GRAPH_ROWS, MAX_SPAN_ROWS, Ran, ShapeKey};
use super::layer::{
    AttnPlan, BlockLane, ContextRows, DecoderLayer, LayerShape, Proj, Weight, next_norm, stack_input,
};
use super::markov::{ConfidenceHead, MarkovHead, argmax_f64, softmax_t};
use super::markov_device::DeviceMarkov;
use super::qwen3::{LoadOptions, Qwen3};
use super::rope::Rope;
use crate::device::ComputeDtype;
use crate::engine::read_f32;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, PagedKvCache, SeqId};
use crate::sampling::{SamplingParams, Stream, coin, sample_weights};
use crate::speculator::{DeferredProposals, DeviceQ, Proposal, ProposeLane, Speculator};
use crate::weights::Checkpoint;

/// Draft KV settings.
#[derive(Debug, Clone)]
pub struct DraftCacheConfig {
    /// Bytes for the draft's context K/V. Where the paged attention kernel runs, a block forward
    /// also holds γ scratch rows per lane for the block's own K/V (given back after the
    /// forward); without room for them the block attends lane by lane instead.
    pub kv_budget_bytes: usize,
    /// Rows per page.
    pub page_size: usize,
}

impl Default for DraftCacheConfig {
    fn default() -> Self {
        Self { kv_budget_bytes: 64 << 20, page_size: 16 }
    }
}

/// What a draft borrows from its target: the shape facts it is checked against and the
/// embedding and LM-head weights it runs with (a DSpark draft has neither of its own).
///
/// [`TargetBinding::of`] takes them from a dspark [`Qwen3`]; [`TargetBinding::from_host`] from
/// host buffers, for a serving engine that runs its own target and uses dspark only to draft.
#[derive(Debug, Clone)]
pub struct TargetBinding {
    /// The target's decoder layers (feature layer ids are checked against it).
    pub num_hidden_layers: usize,
    /// The target's hidden size.
    pub hidden_size: usize,
    /// The target's vocabulary size.
    pub vocab_size: usize,
    /// `[vocab, hidden]`, on the draft's device, in its compute dtype.
    pub embed_tokens: Tensor<2>,
    /// `[vocab, hidden]`, on the draft's device, in its compute dtype.
    pub lm_head: Tensor<2>,
    /// Device of both tensors.
    pub device: Device,
    /// Compute dtype of both tensors (and of the draft).
    pub dtype: ComputeDtype,
}

impl TargetBinding {
    /// Borrow `target`'s embedding and LM head (cheap: tensors are reference counted).
    pub fn of(target: &Qwen3) -> Self {
        let c = target.config();
        Self {
            num_hidden_layers: c.num_hidden_layers,
            hidden_size: c.hidden_size,
            vocab_size: c.vocab_size,
            embed_tokens: target.embed_tokens().clone(),
            lm_head: target.lm_head().clone(),
            device: target.device().clone(),
            dtype: target.dtype(),
        }
    }

    /// Copy a target's embedding and LM head from host buffers of little-endian `src` values,
    /// each `[vocab_size, hidden_size]` row-major; `lm_head` `None` means tied (the embedding).
    /// They are placed on `options.device` in `options.dtype`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when a buffer's length does not match the shape;
    /// [`Error::Unsupported`] when the device is not available.
    pub fn from_host(
        embed_tokens: &[u8],
        lm_head: Option<&[u8]>,
        src: ComputeDtype,
        [vocab_size, hidden_size]: [usize; 2],
        num_hidden_layers: usize,
        options: LoadOptions<'_>,
    ) -> Result<Self> {
        let device = options.device.device()?;
        let shape = [vocab_size, hidden_size];
        let embed =
            crate::weights::host_matrix("embed_tokens", embed_tokens, src, shape, options.dtype, &device)?;
        let head = match lm_head {
            Some(bytes) => crate::weights::host_matrix("lm_head", bytes, src, shape, options.dtype, &device)?,
            None => embed.clone(),
        };
        Ok(Self {
            num_hidden_layers,
            hidden_size,
            vocab_size,
            embed_tokens: embed,
            lm_head: head,
            device,
            dtype: options.dtype,
        })
    }
}

/// A loaded DSpark draft bound to its target's embedding and LM head.
#[derive(Debug)]
pub struct DSparkDraft {
    config: DSparkConfig,
    layer_ids: Vec<usize>,
    dtype: ComputeDtype,
    device: Device,
    embed_tokens: Tensor<2>,
    /// The LM head the draft's base logits come from: the target's, or an FP8 copy of it
    /// ([`DSparkDraft::quantize_lm_head`]).
    lm_head: Proj,
    /// Whether `lm_head` is the draft's own FP8 copy.
    fp8_lm_head: bool,
    /// The tokens the draft may propose when restricted ([`DSparkDraft::restrict_vocab`]):
    /// `lm_head` then holds only their rows, and the base logits are over them.
    draft_vocab: Option<DraftVocab>,
    fc: Proj,
    hidden_norm: Tensor<1>,
    layers: Vec<DecoderLayer>,
    norm: Tensor<1>,
    markov: Option<MarkovHead>,
    /// The e4m3 bytes and per-row scales the Markov head's `w2` was dequantised from, when the
    /// draft was quantised ([`DSparkDraft::quantize`]); the device pass multiplies by them.
    markov_w2_fp8: Option<QuantizedRows>,
    confidence: Option<ConfidenceHead>,
    rope: Rope,
    cache: PagedKvCache,
    fp8: Fp8Counts,
    /// Device copies of the heads for the device Markov pass (where this crate's kernels run,
    /// or when asked for with [`DSparkDraft::set_device_markov`]); `None`: the host pass.
    device_markov: Option<DeviceMarkov>,
    /// Sampling proposals hand out their device rows instead of host `q` (see
    /// [`Speculator::set_q_on_device`]).
    q_on_device: bool,
    /// The confidence head stays on the host even where the Markov pass runs on the device (see
    /// [`DSparkDraft::set_device_confidence`]).
    host_confidence: bool,
    /// Cos/sin of every position, built for the first recorded round.
    rope_table: std::sync::OnceLock<(Tensor<2>, Tensor<2>)>,
    /// Recorded greedy rounds (CUDA); dropped whenever the weights or heads change.
    graphs: Graphs,
}

/// The draft's own weights, before they are bound to the target.
struct Parts {
    layer_ids: Vec<usize>,
    fc: Proj,
    hidden_norm: Tensor<1>,
    layers: Vec<DecoderLayer>,
    norm: Tensor<1>,
    markov: Option<MarkovHead>,
    confidence: Option<ConfidenceHead>,
    fp8: Fp8Counts,
}

impl DSparkDraft {
    /// Load a draft folder (released or SpecForge layout) for `target`. The draft's own copies
    /// of the embedding and LM head, if present, are ignored: the target's are used. Projections
    /// stored in FP8 (`F8_E4M3` with block or per-channel scales) are dequantised to the compute
    /// dtype at load (see [`super::fp8`]).
    ///
    /// # Errors
    /// [`Error::Config`] when the draft does not fit the target (hidden size, vocabulary, feature
    /// layers out of range or including the last layer, mask id outside the vocabulary), raised
    /// before any compute; missing tensors or wrong shapes, naming tensor and file; FP8 weights
    /// without a scale, with a scale of an unsupported shape or in an unsupported FP8 dtype, as
    /// [`super::fp8::read_matrix`] describes.
    pub fn load(
        dir: &Path,
        target: &Qwen3,
        options: LoadOptions<'_>,
        cache: &DraftCacheConfig,
    ) -> Result<Self> {
        Self::load_bound(dir, TargetBinding::of(target), options.progress, cache)
    }

    /// Load a draft folder for a target described by `target` (see [`TargetBinding`]); the
    /// draft runs on the binding's device in its dtype. `progress` is as in [`LoadOptions`].
    ///
    /// # Errors
    /// As [`DSparkDraft::load`].
    pub fn load_bound(
        dir: &Path,
        target: TargetBinding,
        progress: Option<crate::weights::ProgressFn<'_>>,
        cache: &DraftCacheConfig,
    ) -> Result<Self> {
        Self::load_impl(dir, target, progress, cache, None)
    }

    /// As [`DSparkDraft::load`], with the projection weights (each layer's q/k/v/o and
    /// gate/up/down, and `fc`) and the Markov head's `W2` quantised at load as `quant` says, kept
    /// as FP8 where the device runs FP8 products and dequantised to the compute dtype elsewhere:
    /// the draft computes, and samples from, exactly the quantised model. Projections the
    /// checkpoint already stores in FP8 are used as stored. See [`super::fp8`].
    ///
    /// # Errors
    /// As [`DSparkDraft::load`]; [`Error::InvalidInput`] naming the tensor when a weight to
    /// quantise holds a non-finite value.
    pub fn load_quantized(
        dir: &Path,
        target: &Qwen3,
        options: LoadOptions<'_>,
        cache: &DraftCacheConfig,
        quant: DraftQuant,
    ) -> Result<Self> {
        Self::load_impl(dir, TargetBinding::of(target), options.progress, cache, Some(quant))
    }

    /// As [`DSparkDraft::load_bound`], quantising as [`DSparkDraft::load_quantized`] does.
    ///
    /// # Errors
    /// As [`DSparkDraft::load_quantized`].
    pub fn load_bound_quantized(
        dir: &Path,
        target: TargetBinding,
        progress: Option<crate::weights::ProgressFn<'_>>,
        cache: &DraftCacheConfig,
        quant: DraftQuant,
    ) -> Result<Self> {
        Self::load_impl(dir, target, progress, cache, Some(quant))
    }

    fn load_impl(
        dir: &Path,
        target: TargetBinding,
        progress: Option<crate::weights::ProgressFn<'_>>,
        cache: &DraftCacheConfig,
        quant: Option<DraftQuant>,
    ) -> Result<Self> {
        let config = DSparkConfig::from_dir(dir)?;
        let path = dir.join("config.json");
        let ckpt = Checkpoint::open(dir)?;
        let layer_ids = check_fit(&config, &target, Some(&ckpt), &path)?;
        let device = target.device.clone();
        let dtype = target.dtype;
        let b = &config.base;
        let (h, v, r) = (b.hidden_size, b.vocab_size, config.markov_rank);
        let shape = LayerShape {
            hidden: h,
            intermediate: b.intermediate_size,
            heads: b.num_attention_heads,
            kv_heads: b.num_key_value_heads,
            head_dim: b.head_dim(),
            eps: b.rms_norm_eps,
        };
        tracing::info!(dir = %dir.display(), block_size = config.block_size, ?layer_ids, "loading DSpark draft");
        let report = ckpt.reporter(progress);
        let mut fp8 = Fp8Counts::default();
        let mut matrix = |name: &str, dims: [usize; 2]| -> Result<Weight> {
            let (weight, layout) = load_projection(&ckpt, name, dims, dtype, &device, quant)?;
            fp8.add(layout);
            for scale in ["_scale_inv", "_scale"] {
                report(&format!("{name}{scale}"));
            }
            Ok(weight)
        };
        let fc = Proj::from_weight(matrix("fc.weight", [h, layer_ids.len() * h])?);
        let hidden_norm = ckpt.load("hidden_norm.weight", [h], dtype, &device)?;
        let norm = ckpt.load("norm.weight", [h], dtype, &device)?;
        let mut layers = Vec::with_capacity(b.num_hidden_layers);
        for i in 0..b.num_hidden_layers {
            let prefix = format!("layers.{i}.");
            layers.push(DecoderLayer::load_with(
                &ckpt,
                &prefix,
                shape,
                dtype,
                &device,
                &report,
                &mut matrix,
            )?);
        }
        if fp8.total() > 0 {
            let kept =
                layers.iter().map(DecoderLayer::fp8_projections).sum::<usize>() + usize::from(fc.is_fp8());
            tracing::info!(
                ?fp8,
                ?quant,
                kept_as_fp8 = kept,
                "draft projections in FP8 (e4m3); the rest dequantised to {dtype}"
            );
        }
        let host = |name: &str, dims: &[usize]| -> Result<Vec<f32>> {
            let data = ckpt.read(name, dims, ComputeDtype::F32)?;
            data.try_to_vec::<f32>().map_err(|e| Error::Backend(format!("{e:?}")))
        };
        // The heads' matrices as host f32: dequantised where a checkpoint stores them in FP8
        // (e4m3 with block or per-row scales, as its projections), so an FP8 checkpoint that
        // quantised its Markov or confidence head too loads as published.
        let matrix = |name: &str, dims: [usize; 2]| -> Result<Vec<f32>> {
            Ok(super::fp8::read_matrix(&ckpt, name, dims)?.0)
        };
        let markov = if r == 0 {
            None
        } else {
            let proj = match config.markov_head_type {
                MarkovHeadType::Vanilla => None,
                MarkovHeadType::Gated => Some((
                    matrix("markov_head.gate_proj.weight", [r, h + r])?,
                    host("markov_head.gate_proj.bias", &[r])?,
                )),
                MarkovHeadType::Rnn => Some((
                    matrix("markov_head.joint_proj.weight", [3 * r, 2 * r + h])?,
                    host("markov_head.joint_proj.bias", &[3 * r])?,
                )),
            };
            Some(MarkovHead {
                kind: config.markov_head_type,
                rank: r,
                hidden: h,
                w1: matrix("markov_head.markov_w1.weight", [v, r])?,
                w2: matrix("markov_head.markov_w2.weight", [v, r])?,
                proj,
            })
        };
        let confidence = if config.enable_confidence_head {
            let width = h + if config.confidence_head_with_markov { r } else { 0 };
            Some(ConfidenceHead {
                weight: matrix("confidence_head.proj.weight", [1, width])?,
                bias: host("confidence_head.proj.bias", &[1])?[0],
                with_markov: config.confidence_head_with_markov,
            })
        } else {
            None
        };
        let parts = Parts { layer_ids, fc, hidden_norm, layers, norm, markov, confidence, fp8 };
        let mut draft = Self::assemble(config, target, parts, cache)?;
        if quant.is_some() {
            draft.quantize_markov_w2()?;
        }
        Ok(draft)
    }

    /// A draft with random weights at `config`'s shape, bound to `target` (on its device, in its
    /// dtype): for benchmarks at real shapes without a checkpoint (acceptance is meaningless).
    /// Weights are uniform in ±0.02, norms 1; the Markov and confidence heads are present as
    /// configured. The projections are drawn by the device's generator (seed it for
    /// reproducibility); the Markov and confidence heads, which live on the host, by a host
    /// generator with a fixed seed (no device temporaries).
    ///
    /// # Errors
    /// [`Error::Config`] when the configuration does not fit the target (as for
    /// [`DSparkDraft::load`]) or has no `target_layer_ids`; [`Error::InvalidInput`] when the
    /// cache budget holds no page.
    pub fn random(config: DSparkConfig, target: TargetBinding, cache: &DraftCacheConfig) -> Result<Self> {
        Self::random_impl(config, target, cache, None, 0)
    }

    /// As [`DSparkDraft::random`], with every projection drawn on the host (uniform in ±0.02,
    /// generator seeded with `seed`) and quantised there as `quant` says, so no bf16 copy of the
    /// draft ever exists on the device: what loading an FP8 checkpoint costs in device memory.
    /// The projections are kept as FP8 where the device runs FP8 products.
    ///
    /// # Errors
    /// As [`DSparkDraft::random`].
    pub fn random_quantized(
        config: DSparkConfig,
        target: TargetBinding,
        cache: &DraftCacheConfig,
        quant: DraftQuant,
        seed: u64,
    ) -> Result<Self> {
        Self::random_impl(config, target, cache, Some(quant), seed)
    }

    fn random_impl(
        config: DSparkConfig,
        target: TargetBinding,
        cache: &DraftCacheConfig,
        quant: Option<DraftQuant>,
        seed: u64,
    ) -> Result<Self> {
        let path = Path::new("<random draft>");
        config.base.validate(path)?;
        let layer_ids = check_fit(&config, &target, None, path)?;
        let (device, dtype) = (target.device.clone(), target.dtype);
        let b = &config.base;
        let (h, v, r) = (b.hidden_size, b.vocab_size, config.markov_rank);
        let shape = LayerShape {
            hidden: h,
            intermediate: b.intermediate_size,
            heads: b.num_attention_heads,
            kv_heads: b.num_key_value_heads,
            head_dim: b.head_dim(),
            eps: b.rms_norm_eps,
        };
        let opts = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
        let dist = burn::tensor::Distribution::Uniform(-0.02, 0.02);
        let mut rng = HostUniform::new(seed);
        let mut fp8 = Fp8Counts::default();
        let fc_dims = [h, layer_ids.len() * h];
        let fc = match quant {
            None => Proj::new(crate::device::persistent(&device, (), |()| {
                Tensor::random(fc_dims, dist, opts.clone())
            })),
            Some(DraftQuant::Fp8PerChannel) => {
                fp8.quantized_at_load += 1;
                Proj::random_fp8(fc_dims, &mut || rng.next(0.02), dtype, &device)?
            }
        };
        let hidden_norm = crate::device::persistent(&device, (), |()| Tensor::ones([h], opts.clone()));
        let norm = crate::device::persistent(&device, (), |()| Tensor::ones([h], opts.clone()));
        let mut layers = Vec::with_capacity(b.num_hidden_layers);
        for _ in 0..b.num_hidden_layers {
            layers.push(match quant {
                None => DecoderLayer::random(shape, dtype, &device, 0.02),
                Some(DraftQuant::Fp8PerChannel) => {
                    fp8.quantized_at_load += 7;
                    DecoderLayer::random_fp8(shape, dtype, &device, &mut || rng.next(0.02))?
                }
            });
        }
        // Host heads, from a host generator (no device temporaries).
        let mut host = |len: usize| -> Result<Vec<f32>> { Ok((0..len).map(|_| rng.next(0.02)).collect()) };
        let markov = if r == 0 {
            None
        } else {
            let proj = match config.markov_head_type {
                MarkovHeadType::Vanilla => None,
                MarkovHeadType::Gated => Some((host(r * (h + r))?, host(r)?)),
                MarkovHeadType::Rnn => Some((host(3 * r * (2 * r + h))?, host(3 * r)?)),
            };
            Some(MarkovHead {
                kind: config.markov_head_type,
                rank: r,
                hidden: h,
                w1: host(v * r)?,
                w2: host(v * r)?,
                proj,
            })
        };
        let confidence = if config.enable_confidence_head {
            let width = h + if config.confidence_head_with_markov { r } else { 0 };
            Some(ConfidenceHead {
                weight: host(width)?,
                bias: 0.0,
                with_markov: config.confidence_head_with_markov,
            })
        } else {
            None
        };
        let parts = Parts { layer_ids, fc, hidden_norm, layers, norm, markov, confidence, fp8 };
        let mut draft = Self::assemble(config, target, parts, cache)?;
        if quant.is_some() {
            draft.quantize_markov_w2()?;
        }
        Ok(draft)
    }

    /// Bind loaded or generated weights to the target's embedding and LM head and allocate the
    /// context cache.
    fn assemble(
        config: DSparkConfig,
        target: TargetBinding,
        parts: Parts,
        cache: &DraftCacheConfig,
    ) -> Result<Self> {
        let b = &config.base;
        let (device, dtype) = (target.device, target.dtype);
        let layout = crate::kv_cache::KvLayout {
            layers: b.num_hidden_layers,
            kv_heads: b.num_key_value_heads,
            head_dim: b.head_dim(),
            dtype,
            page_size: cache.page_size,
        };
        let cache = PagedKvCache::new(layout, cache.kv_budget_bytes, &device)?;
        let rope = Rope::new(b.rope_theta_value().unwrap_or(1e6), b.head_dim());
        let Parts { layer_ids, fc, hidden_norm, layers, norm, markov, confidence, fp8 } = parts;
        let device_markov = if dspark_kernels::kernels_available(&device) {
            let head = confidence
                .as_ref()
                .filter(|_| dspark_kernels::confidence_kernel())
                .map(|c| (c, b.hidden_size));
            DeviceMarkov::new(markov.as_ref(), None, None, head, dtype, &device)?
        } else {
            None
        };
        // As for the target: the construction's temporaries go back to the driver.
        device.memory_cleanup();
        Ok(Self {
            device_markov,
            q_on_device: false,
            host_confidence: !dspark_kernels::confidence_kernel(),
            layer_ids,
            dtype,
            embed_tokens: target.embed_tokens,
            lm_head: Proj::new(target.lm_head),
            fp8_lm_head: false,
            draft_vocab: None,
            device,
            fc,
            hidden_norm,
            layers,
            norm,
            markov,
            markov_w2_fp8: None,
            confidence,
            rope,
            cache,
            config,
            fp8,
            rope_table: std::sync::OnceLock::new(),
            graphs: Graphs::default(),
        })
    }

    /// Run the Markov pass on the device (`true`; on by default where this crate's CUDA kernels
    /// run) or on the host in f64 (`false`). The device pass serves the vanilla head (or none);
    /// with a gated or rnn head the host pass stays. Returns whether the device pass is now on.
    pub fn set_device_markov(&mut self, on: bool) -> bool {
        self.graphs = Graphs::default();
        // The head was uploaded once already (at construction or quantisation): the same
        // shapes upload again.
        self.device_markov = if on { self.upload_markov().ok().flatten() } else { None };
        self.device_markov.is_some()
    }

    /// Evaluate the confidence head on the device with the Markov pass (`true`: a round then
    /// reads back γ logits a lane, and the host makes no dot products) or on the host in f64 from
    /// the block's hidden rows, read back (`false`). A new draft takes
    /// `dspark_kernels::confidence_kernel()`, on unless switched off. The two differ by f32
    /// rounding of the logit only. Returns whether the head now runs on the device (never
    /// without the device Markov pass or a confidence head).
    pub fn set_device_confidence(&mut self, on: bool) -> bool {
        self.host_confidence = !on;
        if self.device_markov.is_some() {
            self.graphs = Graphs::default();
            // The same shapes as the upload before this one.
            self.device_markov = self.upload_markov().ok().flatten();
        }
        self.device_markov.as_ref().is_some_and(DeviceMarkov::has_confidence)
    }

    /// The device copy of the Markov head, from the host copy (and its FP8 bytes, if any).
    fn upload_markov(&self) -> Result<Option<DeviceMarkov>> {
        DeviceMarkov::new(
            self.markov.as_ref(),
            self.markov_w2_fp8.as_ref(),
            self.draft_vocab.as_ref(),
            self.confidence
                .as_ref()
                .filter(|_| !self.host_confidence)
                .map(|c| (c, self.config.base.hidden_size)),
            self.dtype,
            &self.device,
        )
    }

    /// Quantise the Markov head's `W2` (`[V, r]`, the product of every Markov step) to e4m3
    /// with per-row scales, as the projections are: the host pass then uses the dequantised
    /// values and the device pass the FP8 bytes (on the FP8 kernel where it runs), so both
    /// compute the same head. Part of [`DSparkDraft::quantize`]; a no-op without a head or when
    /// done already.
    fn quantize_markov_w2(&mut self) -> Result<()> {
        let Some(m) = self.markov.as_mut() else { return Ok(()) };
        if self.markov_w2_fp8.is_some() || m.rank == 0 {
            return Ok(());
        }
        let rows = m.w2.len() / m.rank;
        let q = super::fp8::quantize_per_channel(&m.w2, rows, m.rank)
            .map_err(|e| Error::InvalidInput(format!("markov_head.markov_w2.weight: {e}")))?;
        m.w2 = super::fp8::dequantize_per_channel(&q.bytes, &q.scales, m.rank);
        self.markov_w2_fp8 = Some(q);
        if self.device_markov.is_some() {
            self.graphs = Graphs::default();
            self.device_markov = self.upload_markov()?;
        }
        Ok(())
    }

    /// Whether the Markov head's `W2` is quantised to e4m3 (see [`DSparkDraft::quantize`]).
    pub fn has_fp8_markov(&self) -> bool {
        self.markov_w2_fp8.is_some()
    }

    /// How many of the draft's projections are FP8 (stored or quantised at load), by layout.
    pub fn fp8_weights(&self) -> Fp8Counts {
        self.fp8
    }

    /// How many of the draft's projections are kept as FP8 on the device and multiplied by
    /// [`dspark_kernels::linear_fp8`] (the rest are dense in the compute dtype): all of
    /// [`DSparkDraft::fp8_weights`] where [`dspark_kernels::fp8::fp8_weights_run`] holds (CUDA,
    /// bf16), none on the CPU reference path. The FP8 LM head is not counted here.
    pub fn fp8_on_device(&self) -> usize {
        self.layers.iter().map(DecoderLayer::fp8_projections).sum::<usize>() + usize::from(self.fc.is_fp8())
    }

    /// How many layers hold their FP8 gate/up weights paired for the SwiGLU epilogue
    /// ([`dspark_kernels::linear_fp8_swiglu`]; `dspark_kernels::set_fp8_swiglu`, on by default).
    #[doc(hidden)]
    pub fn fp8_swiglu_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.fp8_swiglu()).count()
    }

    /// Quantise the draft's projections (each layer's q/k/v/o and gate/up/down, and `fc`) and
    /// its Markov head's `W2` to e4m3 as [`DSparkDraft::load_quantized`] does, in place: for a
    /// draft built some other way (e.g. [`DSparkDraft::random`] for benchmarks). Projections
    /// already in FP8 stay as they are. Each weight is read back to the host, quantised and
    /// replaced before the next.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when a weight holds a non-finite value.
    pub fn quantize(&mut self, quant: DraftQuant) -> Result<()> {
        let DraftQuant::Fp8PerChannel = quant;
        self.graphs = Graphs::default();
        let before = self.fp8_on_device();
        if !self.fc.is_fp8() {
            self.fc = self.fc.quantized()?;
        }
        for layer in &mut self.layers {
            *layer = layer.quantized()?;
        }
        self.quantize_markov_w2()?;
        let newly = self.layers.len() * 7 + 1 - self.fp8.total();
        self.fp8.quantized_at_load += newly;
        // The bf16 projections and the quantiser's temporaries are gone: hand their memory back
        // instead of leaving it reserved in the pools for the draft's life.
        self.device.memory_cleanup();
        tracing::info!(
            newly,
            kept_as_fp8 = self.fp8_on_device(),
            before,
            "draft projections quantised to e4m3"
        );
        Ok(())
    }

    /// Use an FP8 copy of the target's LM head (e4m3, per-row scales) for the draft's base
    /// logits. The target's own logits, and so acceptance, stay exact: only the proposal changes,
    /// and the draft samples from what it computes. On CUDA in bf16 the copy is kept as FP8
    /// (`vocab · hidden` bytes plus scales, about 0.62 GB for Qwen3-8B; it counts toward the
    /// speculative engine's memory), elsewhere dequantised. Returns the copy's bytes.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the head holds a non-finite value.
    pub fn quantize_lm_head(&mut self) -> Result<usize> {
        self.graphs = Graphs::default();
        if !self.fp8_lm_head {
            self.lm_head = self.lm_head.quantized()?;
            self.fp8_lm_head = true;
            // The quantiser's temporaries (f32 rows of a 1.2 GB head) are gone: give them back.
            self.device.memory_cleanup();
        }
        Ok(self.lm_head.bytes())
    }

    /// Whether the draft's base logits come from an FP8 copy of the LM head.
    pub fn has_fp8_lm_head(&self) -> bool {
        self.fp8_lm_head
    }

    /// Let the draft propose only the tokens of `vocab` (see [`DraftVocab`]): its base logits
    /// come from a copy of just their LM-head rows (FP8 if the head was quantised, before or
    /// after this call), and its Markov head's `W2` products cover just their rows. A round
    /// then reads `len / vocab_size` of the head's bytes (for Qwen3-8B, 32 768 tokens of
    /// 151 936: 0.13 GB instead of 0.62 GB in FP8, 0.27 instead of 1.24 in bf16).
    ///
    /// Lossless all the same: the proposal `q` is the softmax over the subset (zero elsewhere),
    /// the distribution the draft samples from, so verification keeps the target's
    /// distribution; greedy drafts are the argmax over the subset. Tokens outside it are never
    /// drafted, which costs acceptance where they are likely. Returns the bytes of the draft's
    /// copy of the head rows, which count toward the engine's memory like the FP8 head.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the draft is restricted already, or `vocab` is of another
    /// vocabulary size; [`Error::Backend`] when the head rows cannot be copied.
    pub fn restrict_vocab(&mut self, vocab: DraftVocab) -> Result<usize> {
        if self.draft_vocab.is_some() {
            return Err(Error::InvalidInput("the draft's vocabulary is restricted already".into()));
        }
        let v = self.config.base.vocab_size;
        if vocab.vocab_size() != v {
            return Err(Error::InvalidInput(format!(
                "a draft vocabulary of a {}-token vocabulary for a draft of {v}",
                vocab.vocab_size()
            )));
        }
        self.graphs = Graphs::default();
        self.lm_head = self.lm_head.select_rows(vocab.ids())?;
        self.draft_vocab = Some(vocab);
        if self.device_markov.is_some() {
            self.device_markov = self.upload_markov()?;
        }
        self.device.memory_cleanup();
        tracing::info!(
            tokens = self.draft_vocab.as_ref().map_or(v, DraftVocab::len),
            vocab = v,
            head_bytes = self.lm_head.bytes(),
            "draft vocabulary restricted"
        );
        Ok(self.lm_head.bytes())
    }

    /// The tokens the draft may propose, when restricted ([`DSparkDraft::restrict_vocab`]).
    pub fn draft_vocab(&self) -> Option<&DraftVocab> {
        self.draft_vocab.as_ref()
    }

    /// Columns of the base logits: the draft vocabulary's size, or the whole vocabulary's.
    fn draft_width(&self) -> usize {
        self.draft_vocab.as_ref().map_or(self.config.base.vocab_size, DraftVocab::len)
    }

    /// Bytes of the draft's own weights on its device (layers, `fc`, norms; its copy of the LM
    /// head, FP8 or restricted to a draft vocabulary, if it has one), not counting the target's
    /// embedding and head it borrows, the Markov and confidence heads or the KV cache.
    pub fn weight_bytes(&self) -> usize {
        let own_head = self.fp8_lm_head || self.draft_vocab.is_some();
        let head = if own_head { self.lm_head.bytes() } else { 0 };
        let norms = 2 * self.config.base.hidden_size * self.dtype.size();
        self.layers.iter().map(DecoderLayer::weight_bytes).sum::<usize>() + self.fc.bytes() + norms + head
    }

    /// The draft's configuration.
    pub fn config(&self) -> &DSparkConfig {
        &self.config
    }

    /// The Markov head (host copy), when the draft has one.
    pub fn markov(&self) -> Option<&MarkovHead> {
        self.markov.as_ref()
    }

    /// The feature layers resolved against the target.
    pub fn layer_ids(&self) -> &[usize] {
        &self.layer_ids
    }

    /// The device the draft runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The draft's compute dtype.
    pub fn dtype(&self) -> ComputeDtype {
        self.dtype
    }

    /// The draft's context cache.
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// `c = hidden_norm(fc(features))`, the one stream the context K/V are made from.
    ///
    /// # Shapes
    /// `features`: `[rows, n·hidden]` → `[rows, hidden]`.
    pub fn context_projection(&self, features: Tensor<2>) -> Tensor<2> {
        rms_norm(self.fc.apply(features), &self.hidden_norm, self.config.base.rms_norm_eps)
    }

    /// The block forward for several lanes: `[anchor, MASK × (γ−1)]` at positions `L..L+γ−1`,
    /// attending to each lane's cached context and bidirectionally within the block.
    /// Returns the final-normed block hidden `[lanes·γ, hidden]` and base logits
    /// `[lanes·γ, vocab]` (f32), over the draft vocabulary when it is restricted (then `vocab`
    /// is its size and column `i` is token `draft_vocab().ids()[i]`).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn block_forward(&mut self, lanes: &[(SeqId, u32)]) -> Result<(Tensor<2>, Tensor<2>)> {
        let gamma = self.config.block_size;
        let mut ids = Vec::with_capacity(lanes.len() * gamma);
        let mut positions = Vec::with_capacity(lanes.len() * gamma);
        let mut contexts = Vec::with_capacity(lanes.len());
        for &(seq, anchor) in lanes {
            let context = self.cache.len(seq)?;
            ids.push(i64::from(anchor));
            ids.extend(std::iter::repeat_n(i64::from(self.config.mask_token_id), gamma - 1));
            positions.extend(context..context + gamma);
            contexts.push(context);
        }
        // 1. embed with the target's table [lanes·γ, hidden]; rotary tables at block positions.
        let n = ids.len();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &self.device);
        let x = self.embed_tokens.clone().select(0, ids);
        let (cos, sin) = self.rope.tables(&positions, self.dtype, &self.device);
        let eps = self.config.base.rms_norm_eps;
        // 2. draft layers (the last one ends with the final norm): through the paged kernel
        //    where it runs, else lane by lane.
        let hidden = match self.block_plan(lanes, &contexts)? {
            Some(plan) => {
                let (layers, norm) = (&self.layers, &self.norm);
                let run = || -> Result<Tensor<2>> {
                    let mut xh = stack_input(layers, norm, x, eps);
                    for (l, layer) in layers.iter().enumerate() {
                        let next = next_norm(layers, l, norm);
                        xh = layer.forward_block_paged(l, xh, &cos, &sin, &plan, next, &mut self.cache)?;
                    }
                    Ok(xh.1)
                };
                let out = run();
                // The block's K/V rows were scratch: give them back whatever happened.
                for (&(seq, _), &context) in lanes.iter().zip(&contexts) {
                    self.cache.truncate(seq, context)?;
                }
                out?
            }
            None => {
                let mut block = Vec::with_capacity(lanes.len());
                for (i, (&(seq, _), &context)) in lanes.iter().zip(&contexts).enumerate() {
                    let index = self.cache.gather_index(seq, context)?;
                    block.push(BlockLane { rows: i * gamma..(i + 1) * gamma, index, context });
                }
                let (layers, norm) = (&self.layers, &self.norm);
                let mut xh = stack_input(layers, norm, x, eps);
                for (l, layer) in layers.iter().enumerate() {
                    xh = layer.forward_block(
                        l,
                        xh,
                        &cos,
                        &sin,
                        &block,
                        next_norm(layers, l, norm),
                        &self.cache,
                    );
                }
                xh.1
            }
        };
        // 3. target LM head.
        let logits = self.lm_head.apply(hidden.clone());
        let to32 = |t: Tensor<2>| if t.dtype() == DType::F32 { t } else { t.cast(DType::F32) };
        Ok((to32(hidden), to32(logits)))
    }

    /// Page tables for a block forward through [`dspark_kernels::paged_attention`]: each lane's
    /// context grows by γ scratch rows for the block's own K/V (the caller truncates them after
    /// the forward), and every block row sees the context and the whole block. `None` where the
    /// kernel does not run, or when the draft's pool has no room for the scratch rows (the
    /// lane-by-lane path needs none).
    fn block_plan(&mut self, lanes: &[(SeqId, u32)], contexts: &[usize]) -> Result<Option<AttnPlan>> {
        let gamma = self.config.block_size;
        let heads = self.config.base.num_attention_heads;
        if !self
            .cache
            .pools(0)
            .is_some_and(|(k_pool, _)| dspark_kernels::paged_attention_runs(heads, &k_pool))
        {
            return Ok(None);
        }
        let grow: Vec<(SeqId, usize)> = lanes.iter().map(|&(seq, _)| (seq, gamma)).collect();
        if let Err(e) = self.cache.reserve(&grow) {
            tracing::debug!(error = %e, "no room for the block's scratch K/V rows: lane-by-lane block attention");
            return Ok(None);
        }
        let mut keys: Vec<i32> = Vec::new();
        let mut meta: Vec<i32> = Vec::with_capacity(2 * lanes.len() * gamma);
        let mut new_rows: Vec<i64> = Vec::with_capacity(lanes.len() * gamma);
        for (&(seq, _), &context) in lanes.iter().zip(contexts) {
            let first = keys.len() as i32;
            let rows = self.cache.physical_rows(seq, context + gamma)?;
            new_rows.extend_from_slice(&rows[context..]);
            keys.extend(rows.into_iter().map(|r| r as i32));
            for _ in 0..gamma {
                meta.extend([first, (context + gamma) as i32]);
            }
        }
        // Blocks of γ rows: no counters (their splits are merged apart; see `paged_attention_synced`).
        Ok(Some(AttnPlan::upload(keys, meta, new_rows, gamma, 0, &self.device)))
    }

    /// Whether this draft's K/V go through the page-table path (the paged attention kernel
    /// runs, or its reference was asked for).
    fn paged(&self) -> bool {
        let heads = self.config.base.num_attention_heads;
        self.cache.pools(0).is_some_and(|(k_pool, _)| dspark_kernels::paged_attention_runs(heads, &k_pool))
    }

    /// Context extension of several lanes in one pass: one projection over all their rows, one
    /// K/V product and one row assignment per layer, whatever the number of lanes (each row's
    /// result does not depend on the rows beside it on this path). All or nothing: on an error
    /// every lane keeps its old length.
    fn extend_paged(&mut self, items: &[(SeqId, Tensor<2>)]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let _span = tracing::debug_span!("extend").entered();
        let grow: Vec<(SeqId, usize)> = items.iter().map(|(seq, f)| (*seq, f.dims()[0])).collect();
        let features = if items.len() == 1 {
            items[0].1.clone()
        } else {
            Tensor::cat(items.iter().map(|(_, f)| f.clone()).collect(), 0)
        };
        let ranges = self.cache.reserve(&grow)?;
        let result = (|| -> Result<()> {
            let mut positions = Vec::new();
            let mut physical = Vec::new();
            for (&(seq, _), range) in grow.iter().zip(&ranges) {
                positions.extend(range.clone());
                physical.extend_from_slice(&self.cache.physical_rows(seq, range.end)?[range.start..]);
            }
            if let Some(done) = self.extend_recorded(&features, &positions, &physical) {
                return done;
            }
            let c = self.context_projection(features.clone());
            let (cos, sin) = self.rope.tables(&positions, self.dtype, &self.device);
            let n = physical.len();
            let rows = Tensor::<1, Int>::from_data(TensorData::new(physical, [n]), &self.device);
            for (l, layer) in self.layers.iter().enumerate() {
                layer.write_context(
                    l,
                    c.clone(),
                    (&cos, &sin),
                    ContextRows::Physical(&rows),
                    &mut self.cache,
                )?;
            }
            Ok(())
        })();
        if result.is_err() {
            for (&(seq, _), range) in grow.iter().zip(&ranges) {
                self.cache.truncate(seq, range.start)?;
            }
        }
        result
    }

    /// A round as one replay of the graph recorded for its lane count (recorded now when new):
    /// the block forward, the LM-head rows and the device Markov steps, with one read of the
    /// tokens (and the block's hidden rows when a confidence head reads them). When a lane
    /// samples, the graph is its own shape: the steps draw on the device from coins written
    /// with the other inputs, and the corrected rows come back too, for the proposals' `q`.
    /// `None` where it does not apply (no device pass, no graphs, no room for the scratch
    /// rows): the round then runs op by op. Its proposals equal the op-by-op round's bit for bit.
    fn propose_recorded(&mut self, lanes: &[ProposeLane<'_>]) -> Option<Result<Vec<Proposal>>> {
        let launched = match self.launch_recorded(lanes, false)? {
            Ok(launched) => launched,
            Err(e) => return Some(Err(e)),
        };
        let readback = tracing::debug_span!("propose_readback").entered();
        let out = match read_f32(launched.out.clone()) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        let rows = match &launched.rows {
            Some(rows) if !launched.keep => match read_f32(rows.clone()) {
                Ok(rows) => rows,
                Err(e) => return Some(Err(e)),
            },
            _ => Vec::new(),
        };
        drop(readback);
        Some(Ok(self.finish_recorded(lanes, &launched, &out, &rows)))
    }

    /// The queued half of [`Self::propose_recorded`]: inputs written, the round's graph
    /// replayed, nothing read back. `defer` asks for a round whose results need no host rows
    /// (greedy, or sampled with the rows kept on the device); `None` where the recorded round
    /// does not apply (or, with `defer`, would need host rows).
    fn launch_recorded(&mut self, lanes: &[ProposeLane<'_>], defer: bool) -> Option<Result<Launched>> {
        let prepare = tracing::debug_span!("propose_prepare").entered();
        let gamma = self.config.block_size;
        let (h, n) = (self.config.base.hidden_size, lanes.len() * gamma);
        let table_rows = self.config.base.max_position_embeddings;
        let sampling = !lanes.iter().all(|l| l.params.is_greedy());
        let keep = sampling && self.q_on_device;
        if n > MAX_GRAPH_ROWS
            || (defer && sampling && !keep)
            || self.device_markov.is_none()
            || !super::graphs::recording(&self.device)
            || !self.paged()
        {
            return None;
        }
        let contexts = match lanes.iter().map(|l| self.cache.len(l.seq)).collect::<Result<Vec<_>>>() {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        if contexts.iter().any(|&c| c + gamma > table_rows) {
            return None;
        }
        // 1. γ scratch rows per lane for the block's own K/V (given back below).
        let grow: Vec<(SeqId, usize)> = lanes.iter().map(|l| (l.seq, gamma)).collect();
        if self.cache.reserve(&grow).is_err() {
            return None;
        }
        let mut host = HostInputs::default();
        let mut new_rows = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mask = i64::from(self.config.mask_token_id);
        for (lane, &context) in lanes.iter().zip(&contexts) {
            host.ints.push(i64::from(lane.anchor));
            host.ints.extend(std::iter::repeat_n(mask, gamma - 1));
            positions.extend((context..context + gamma).map(|p| p as i64));
            let first = host.keys.len() as i32;
            let rows = match self.cache.physical_rows(lane.seq, context + gamma) {
                Ok(rows) => rows,
                Err(e) => {
                    self.give_back_scratch(lanes, &contexts);
                    return Some(Err(e));
                }
            };
            new_rows.extend_from_slice(&rows[context..]);
            host.keys.extend(rows.into_iter().map(|r| r as i32));
            for _ in 0..gamma {
                host.meta.extend([first, (context + gamma) as i32]);
            }
        }
        // Sections of `stride` values (aligned starts: the body's views share the buffer):
        // block ids, positions, K/V rows, anchors (lanes ≤ n), draw words.
        let stride = super::graphs::int_section(n);
        host.ints.resize(stride, 0);
        host.ints.extend(positions);
        host.ints.resize(2 * stride, 0);
        host.ints.extend(new_rows);
        host.ints.resize(3 * stride, 0);
        host.ints.extend(lanes.iter().map(|l| i64::from(l.anchor)));
        if sampling {
            let params: Vec<&SamplingParams> = lanes.iter().map(|l| l.params).collect();
            host.ints.resize(4 * stride, 0);
            host.ints.extend(super::markov_device::draw_words(&params, &contexts, gamma));
        }
        // The confidence head runs on the device with the Markov steps; only a head that could
        // not be uploaded there needs the hidden rows back.
        let confidence =
            match (&self.confidence, self.device_markov.as_ref().is_some_and(DeviceMarkov::has_confidence)) {
                (None, _) => ConfidenceOut::None,
                (Some(_), true) => ConfidenceOut::Logits,
                (Some(_), false) => ConfidenceOut::Hidden,
            };
        let key = ShapeKey {
            rows: n,
            ints: host.ints.len(),
            detail: vec![lanes.len(), confidence as usize, usize::from(sampling)],
        };
        let pool_rows = self.cache.pools(0).map_or(0, |(k, _)| k.dims()[0]);
        let id = self.cache.graph_id().unwrap_or(0);
        let (cos_t, sin_t) =
            self.rope_table.get_or_init(|| self.rope.full_tables(table_rows, self.dtype, &self.device));
        let (lane_count, vocab) = (lanes.len(), self.draft_width());
        let (embed, layers, norm, lm_head) = (&self.embed_tokens, &self.layers, &self.norm, &self.lm_head);
        let (eps, cache, markov) =
            (self.config.base.rms_norm_eps, &mut self.cache, self.device_markov.as_ref());
        drop(prepare);
        // 2. the round on the device: inputs in place, one replay.
        let ran = self.graphs.run(&self.device, id, pool_rows, key, host, |inputs| {
            let at = inputs.ints(stride, n);
            let (cos, sin) = (cos_t.clone().select(0, at.clone()), sin_t.clone().select(0, at));
            let plan = inputs.plan(n, 2 * stride, gamma);
            let mut xh = stack_input(layers, norm, embed.clone().select(0, inputs.ints(0, n)), eps);
            for (l, layer) in layers.iter().enumerate() {
                xh =
                    layer.forward_block_paged(l, xh, &cos, &sin, &plan, next_norm(layers, l, norm), cache)?;
            }
            let hidden = xh.1;
            let to32 = |t: Tensor<2>| if t.dtype() == DType::F32 { t } else { t.cast(DType::F32) };
            // Base logits stay in the draft's dtype: each Markov step widens its own rows (the
            // same f32 values), so the graph holds no f32 copy of every row (34 MB at 8 lanes).
            let logits = lm_head.apply(hidden.clone()).reshape([lane_count, gamma, vocab]);
            let Some(markov) = markov else {
                return Err(Error::InvalidInput("the recorded round needs the device Markov pass".into()));
            };
            let anchors = inputs.ints(3 * stride, lane_count);
            let (tokens, rows) = if sampling {
                let draws = inputs.ints(4 * stride, 3 * n);
                let (tokens, rows) = markov.sampled(anchors.clone(), logits, gamma, draws);
                (tokens, Some(rows))
            } else {
                (markov.greedy(anchors.clone(), logits, gamma), None)
            };
            let tokens = tokens.reshape([n]);
            let as_f32 = |t: Tensor<1, Int>| t.float().cast(DType::F32);
            // The tokens as f32, then what the confidence head needs: its logits (written with
            // the tokens by one launch), the hidden rows, or nothing.
            let first = match confidence {
                ConfidenceOut::Logits => {
                    match markov.confidence_logits(hidden, anchors, tokens.clone(), true) {
                        Some(both) => both,
                        None => as_f32(tokens),
                    }
                }
                ConfidenceOut::Hidden => Tensor::cat(vec![as_f32(tokens), to32(hidden).reshape([n * h])], 0),
                ConfidenceOut::None => as_f32(tokens),
            };
            let width = first.dims()[0];
            Ok(std::iter::once(first.reshape([1, width])).chain(rows).collect())
        });
        self.give_back_scratch(lanes, &contexts);
        let mut outs = match ran {
            Ran::Replayed(outs) => outs.into_iter(),
            Ran::NotRecorded => return None,
            Ran::Failed(e) => return Some(Err(e)),
        };
        let Some(out) = outs.next() else {
            return Some(Err(Error::Backend("a recorded round returned nothing".into())));
        };
        let rows = outs.next();
        if sampling && rows.is_none() {
            return Some(Err(Error::Backend("a recorded round returned no draft rows".into())));
        }
        Some(Ok(Launched { out, confidence, rows, sampling, keep, n }))
    }

    /// The proposals of a launched round from its host values: `out` the first output (tokens,
    /// then the hidden rows when a confidence head reads them), `rows` the corrected rows when
    /// sampling lanes make their `q` on the host (empty otherwise).
    fn finish_recorded(
        &self,
        lanes: &[ProposeLane<'_>],
        launched: &Launched,
        out: &[f32],
        rows: &[f32],
    ) -> Vec<Proposal> {
        let _finish = tracing::debug_span!("propose_finish").entered();
        let (gamma, h, vocab) =
            (self.config.block_size, self.config.base.hidden_size, self.config.base.vocab_size);
        let (n, sampling, keep) = (launched.n, launched.sampling, launched.keep);
        let kept = launched.rows.as_ref().filter(|_| keep);
        let (tokens, after) = out.split_at(n.min(out.len()));
        let mut q = if sampling && !keep {
            let params: Vec<&SamplingParams> = lanes.iter().map(|l| l.params).collect();
            super::markov_device::q_rows(rows, vocab, &params, gamma)
        } else {
            Vec::new()
        }
        .into_iter();
        lanes
            .iter()
            .enumerate()
            .map(|(i, lane)| {
                let tokens: Vec<u32> = tokens[i * gamma..(i + 1) * gamma].iter().map(|&t| t as u32).collect();
                let confidence = match launched.confidence {
                    ConfidenceOut::None => None,
                    ConfidenceOut::Logits => after
                        .get(i * gamma..(i + 1) * gamma)
                        .map(|l| l.iter().map(|&x| sigmoid(f64::from(x))).collect()),
                    ConfidenceOut::Hidden => {
                        self.confidences(lane.anchor, &tokens, &after[(i * gamma * h).min(after.len())..])
                    }
                };
                let q = q.next().filter(|_| !lane.params.is_greedy());
                let q_rows = kept
                    .filter(|_| !lane.params.is_greedy())
                    .map(|rows| DeviceQ { rows: rows.clone(), first: i * gamma });
                Proposal { tokens, q, confidence, q_rows }
            })
            .collect()
    }

    /// A context extension as one replay of the graph recorded for its row count (recorded now
    /// when new): the projection `c`, and each layer's K/V of it written at `physical`. `None`
    /// where graphs do not run: the extension then runs op by op.
    fn extend_recorded(
        &mut self,
        features: &Tensor<2>,
        positions: &[usize],
        physical: &[i64],
    ) -> Option<Result<()>> {
        let [n, width] = features.dims();
        let table_rows = self.config.base.max_position_embeddings;
        if n > MAX_SPAN_ROWS
            || !super::graphs::recording(&self.device)
            || positions.iter().any(|&p| p >= table_rows)
            || features.dtype() != self.dtype.dtype()
        {
            return None;
        }
        // Many lanes extend by a different number of rows every round: padded to a few sizes,
        // a handful of graphs serve them all. Padding rows write their K/V to the scratch row.
        let (rows, pad_row) = match self.cache.scratch_row() {
            Some(row) => (super::graphs::padded_rows(n), row as i64),
            None => (n, 0),
        };
        let mut host = HostInputs { floats: Some(features.clone()), ..HostInputs::default() };
        // Two sections (aligned starts: the body's views share the buffer): positions, K/V rows.
        let stride = super::graphs::int_section(rows);
        host.ints.extend(positions.iter().map(|&p| p as i64));
        host.ints.resize(stride, 0);
        host.ints.extend_from_slice(physical);
        host.ints.resize(stride + rows, pad_row);
        // Detail 0 tells extensions from rounds (whose first detail is a lane count).
        let key = ShapeKey { rows, ints: host.ints.len(), detail: vec![0, width] };
        let n = rows;
        let pool_rows = self.cache.pools(0).map_or(0, |(k, _)| k.dims()[0]);
        let id = self.cache.graph_id().unwrap_or(0);
        let (cos_t, sin_t) =
            self.rope_table.get_or_init(|| self.rope.full_tables(table_rows, self.dtype, &self.device));
        let (fc, hidden_norm, layers) = (&self.fc, &self.hidden_norm, &self.layers);
        let (eps, cache) = (self.config.base.rms_norm_eps, &mut self.cache);
        let ran = self.graphs.run(&self.device, id, pool_rows, key, host, |inputs| {
            let features = inputs
                .floats(n, width)
                .ok_or_else(|| Error::InvalidInput("a recorded extension without its features".into()))?;
            let c = rms_norm(fc.apply(features), hidden_norm, eps);
            let at = inputs.ints(0, n);
            let (cos, sin) = (cos_t.clone().select(0, at.clone()), sin_t.clone().select(0, at));
            let rows = inputs.ints(stride, n);
            for (l, layer) in layers.iter().enumerate() {
                layer.write_context(l, c.clone(), (&cos, &sin), ContextRows::Physical(&rows), cache)?;
            }
            Ok(Vec::new())
        });
        match ran {
            Ran::Replayed(_) => Some(Ok(())),
            Ran::NotRecorded => None,
            Ran::Failed(e) => Some(Err(e)),
        }
    }

    /// Shorten each lane back to its context after a block forward's scratch rows.
    fn give_back_scratch(&mut self, lanes: &[ProposeLane<'_>], contexts: &[usize]) {
        for (lane, &context) in lanes.iter().zip(contexts) {
            if let Err(e) = self.cache.truncate(lane.seq, context) {
                tracing::warn!(seq = lane.seq, error = %e, "could not give back a block's scratch rows");
            }
        }
    }

    /// σ of the confidence head at each step of one lane's block, from the block's hidden rows
    /// (`[γ, H]` row-major, at least) and the tokens chosen; `None` without the head.
    fn confidences(&self, anchor: u32, tokens: &[u32], hidden: &[f32]) -> Option<Vec<f32>> {
        let h = self.config.base.hidden_size;
        self.confidence.as_ref().map(|c| {
            let mut prev = anchor;
            let mut out = Vec::with_capacity(tokens.len());
            for (k, &token) in tokens.iter().enumerate() {
                let h_k = &hidden[k * h..(k + 1) * h];
                let e = self.markov.as_ref().map(|m| m.embed(prev));
                let x = c.logit(h_k, e.as_deref());
                out.push(sigmoid(x));
                prev = token;
            }
            out
        })
    }

    /// The sequential Markov pass over one lane's block, on host rows: corrected logits per
    /// step, the chosen tokens, `q` when sampling, confidence per step.
    ///
    /// `hidden` is `[γ, H]`, `base` is `[γ, V]` (row-major f32); `position` is `L`, so draft k
    /// decides position `L + k + 1` (its sampling coin is keyed by that position).
    pub fn markov_pass(
        &self,
        anchor: u32,
        hidden: &[f32],
        base: &[f32],
        params: &SamplingParams,
        position: usize,
    ) -> MarkovPass {
        let gamma = self.config.block_size;
        let (h, v) = (self.config.base.hidden_size, self.config.base.vocab_size);
        let mut pass = MarkovPass::default();
        let mut prev = anchor;
        let mut state = self.markov.as_ref().map(MarkovHead::initial_state).unwrap_or_default();
        for k in 0..gamma {
            let h_k = &hidden[k * h..(k + 1) * h];
            let mut logits: Vec<f64> = base[k * v..(k + 1) * v].iter().map(|&x| f64::from(x)).collect();
            let mut prev_embedding = None;
            if let Some(m) = &self.markov {
                let (latent, next_state) = m.latent(prev, h_k, &state);
                m.add_bias(&mut logits, &latent);
                state = next_state;
                prev_embedding = Some(m.embed(prev));
            }
            if let Some(c) = &self.confidence {
                pass.confidence_logits.push(c.logit(h_k, prev_embedding.as_deref()));
            }
            let token = if params.is_greedy() {
                argmax_f64(&logits)
            } else {
                let q = softmax_t(&logits, f64::from(params.temperature));
                let u = coin(params.seed, Stream::Draft, position + k + 1);
                let t = sample_weights(&q, u).unwrap_or_else(|| argmax_f64(&logits));
                pass.q.push(q);
                t
            };
            pass.corrected.push(logits);
            pass.tokens.push(token);
            prev = token;
        }
        pass
    }
}

/// Everything the Markov pass computed for one block.
#[derive(Debug, Clone, Default)]
pub struct MarkovPass {
    /// Chosen draft tokens, γ of them.
    pub tokens: Vec<u32>,
    /// Corrected logits per step (base + Markov bias).
    pub corrected: Vec<Vec<f64>>,
    /// Proposal distributions (sampling only).
    pub q: Vec<Vec<f64>>,
    /// Confidence logits per step (empty without a confidence head).
    pub confidence_logits: Vec<f64>,
}

/// A recorded round queued on the device (see `DSparkDraft::launch_recorded`).
struct Launched {
    /// f32 `[1, n (+ n) or (+ n · hidden)]`: the tokens, then the confidence head's logits
    /// (made on the device) or the block's hidden rows (for the host's confidence head).
    out: Tensor<2>,
    /// What follows the tokens in `out`.
    confidence: ConfidenceOut,
    /// The corrected rows `[n, V]` the tokens were drawn from (sampling rounds).
    rows: Option<Tensor<2>>,
    sampling: bool,
    /// The rows stay on the device as the proposals' `q_rows`.
    keep: bool,
    /// Draft rows: lanes · γ.
    n: usize,
}

/// What a recorded round returns for the confidence head after its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConfidenceOut {
    /// No confidence head.
    None,
    /// The logits of the rows, made on the device: `n` values.
    Logits,
    /// The block's hidden rows, for the host's head: `n · hidden` values.
    Hidden,
}

/// `σ(x)`, the confidence of a logit, as the host's head makes it.
fn sigmoid(x: f64) -> f32 {
    (1.0 / (1.0 + (-x).exp())) as f32
}

/// Check the draft against its target; resolve the feature layers.
fn check_fit(
    config: &DSparkConfig,
    t: &TargetBinding,
    ckpt: Option<&Checkpoint>,
    path: &Path,
) -> Result<Vec<usize>> {
    let bad = |message: String| Error::Config { path: path.to_path_buf(), message };
    let depth = t.num_hidden_layers;
    if config.base.hidden_size != t.hidden_size {
        return Err(bad(format!(
            "draft hidden_size {} does not match the target's {}",
            config.base.hidden_size, t.hidden_size
        )));
    }
    if config.base.vocab_size != t.vocab_size {
        return Err(bad(format!(
            "draft vocab_size {} does not match the target's {}",
            config.base.vocab_size, t.vocab_size
        )));
    }
    if config.mask_token_id as usize >= t.vocab_size {
        return Err(bad(format!(
            "mask_token_id {} is outside the vocabulary ({})",
            config.mask_token_id, t.vocab_size
        )));
    }
    if let Some(n) = config.num_target_layers
        && n != depth
    {
        return Err(bad(format!("the draft was built for a {n}-layer target; this target has {depth}")));
    }
    let ids = match &config.target_layer_ids {
        Some(ids) => ids.clone(),
        None => {
            // Infer how many feature layers from fc's input width.
            let ckpt = ckpt.ok_or_else(|| bad("target_layer_ids is missing".into()))?;
            let shape = ckpt.shape("fc.weight").ok_or_else(|| Error::MissingTensor {
                dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
                tensor: "fc.weight".into(),
            })?;
            let n = shape.get(1).copied().unwrap_or(0) / t.hidden_size.max(1);
            default_target_layer_ids(depth, n)
        }
    };
    if let Some(&bad_id) = ids.iter().find(|&&l| l + 1 >= depth) {
        return Err(bad(format!(
            "target_layer_id {bad_id} is out of range: feature layers must be below the target's last layer ({})",
            depth - 1
        )));
    }
    Ok(ids)
}

impl Speculator for DSparkDraft {
    fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Taken where the Markov steps run on the device (recorded or op by op).
    fn set_q_on_device(&mut self, on: bool) {
        self.q_on_device = on;
    }

    fn feature_layers(&self) -> &[usize] {
        &self.layer_ids
    }

    fn has_confidence(&self) -> bool {
        self.confidence.is_some()
    }

    fn begin(&mut self) -> SeqId {
        self.cache.allocate()
    }

    fn context_len(&self, seq: SeqId) -> Result<usize> {
        self.cache.len(seq)
    }

    fn extend_context(&mut self, seq: SeqId, features: Tensor<2>) -> Result<()> {
        if self.paged() {
            return self.extend_paged(&[(seq, features)]);
        }
        let rows = features.dims()[0];
        let c = self.context_projection(features);
        let range = self.cache.reserve(&[(seq, rows)])?.remove(0);
        let positions: Vec<usize> = range.clone().collect();
        let (cos, sin) = self.rope.tables(&positions, self.dtype, &self.device);
        for (l, layer) in self.layers.iter().enumerate() {
            if let Err(e) = layer.write_context(
                l,
                c.clone(),
                (&cos, &sin),
                ContextRows::Sequence { seq, start: range.start },
                &mut self.cache,
            ) {
                self.cache.truncate(seq, range.start)?;
                return Err(e);
            }
        }
        Ok(())
    }

    fn extend_contexts(&mut self, items: &[(SeqId, Tensor<2>)]) -> Result<()> {
        if self.paged() {
            return self.extend_paged(items);
        }
        for (seq, features) in items {
            self.extend_context(*seq, features.clone())?;
        }
        Ok(())
    }

    fn propose(&mut self, lanes: &[ProposeLane<'_>]) -> Result<Vec<Proposal>> {
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let _span = tracing::debug_span!("propose").entered();
        let gamma = self.config.block_size;
        let (h, v) = (self.config.base.hidden_size, self.config.base.vocab_size);
        if let Some(proposals) = self.propose_recorded(lanes) {
            return proposals;
        }
        let pairs: Vec<(SeqId, u32)> = lanes.iter().map(|l| (l.seq, l.anchor)).collect();
        let (hidden, logits) = self.block_forward(&pairs)?;
        if let Some(dev) = &self.device_markov {
            let anchors: Vec<u32> = lanes.iter().map(|l| l.anchor).collect();
            let params: Vec<&SamplingParams> = lanes.iter().map(|l| l.params).collect();
            let positions = lanes.iter().map(|l| self.cache.len(l.seq)).collect::<Result<Vec<_>>>()?;
            // The confidence head runs on the device where it could be uploaded there; otherwise
            // the block's hidden rows come back for the host's (γ·H floats a lane).
            // (The rows in the draft's dtype again, exactly: the kernel reads bf16.)
            let on_device = self.confidence.is_some() && dev.has_confidence();
            let rows = on_device.then(|| hidden.clone().cast(self.dtype.dtype()));
            let round = dev.run(&anchors, logits, gamma, &params, &positions, self.q_on_device, rows)?;
            let hidden = match (&self.confidence, &round.confidence_logits) {
                (Some(_), None) => read_f32(hidden)?,
                _ => Vec::new(),
            };
            let mut proposals = Vec::with_capacity(lanes.len());
            for (i, ((tokens, q), lane)) in round.tokens.into_iter().zip(round.q).zip(lanes).enumerate() {
                let confidence = match &round.confidence_logits {
                    Some(logits) => logits.get(i).map(|l| l.iter().map(|&x| sigmoid(f64::from(x))).collect()),
                    None => {
                        self.confidences(lane.anchor, &tokens, &hidden[(i * gamma * h).min(hidden.len())..])
                    }
                };
                let sampled = !lane.params.is_greedy();
                let q_rows = round
                    .rows
                    .as_ref()
                    .filter(|_| sampled)
                    .map(|rows| DeviceQ { rows: rows.clone(), first: i * gamma });
                let q = (sampled && q_rows.is_none()).then_some(q);
                proposals.push(Proposal { tokens, q, confidence, q_rows });
            }
            return Ok(proposals);
        }
        let hidden = read_f32(hidden)?;
        let logits = match &self.draft_vocab {
            Some(d) => d.expand_rows(&read_f32(logits)?),
            None => read_f32(logits)?,
        };
        let mut out = Vec::with_capacity(lanes.len());
        for (i, lane) in lanes.iter().enumerate() {
            let position = self.cache.len(lane.seq)?;
            let pass = self.markov_pass(
                lane.anchor,
                &hidden[i * gamma * h..(i + 1) * gamma * h],
                &logits[i * gamma * v..(i + 1) * gamma * v],
                lane.params,
                position,
            );
            let confidence = (!pass.confidence_logits.is_empty())
                .then(|| pass.confidence_logits.iter().map(|&x| sigmoid(x)).collect());
            out.push(Proposal {
                tokens: pass.tokens,
                q: (!lane.params.is_greedy()).then_some(pass.q),
                confidence,
                q_rows: None,
            });
        }
        Ok(out)
    }

    fn propose_deferred(&mut self, lanes: &[ProposeLane<'_>]) -> Result<Option<DeferredProposals>> {
        if lanes.is_empty() {
            return Ok(None);
        }
        let _span = tracing::debug_span!("propose").entered();
        let Some(launched) = self.launch_recorded(lanes, true).transpose()? else {
            return Ok(None);
        };
        let tokens = launched.out.clone().narrow(1, 0, launched.n).reshape([launched.n, 1]);
        let readback = launched.out.clone();
        let q_rows = launched.rows.clone().filter(|_| launched.keep);
        Ok(Some(DeferredProposals { tokens, readback, q_rows, state: Box::new(launched) }))
    }

    fn finish_deferred(
        &mut self,
        lanes: &[ProposeLane<'_>],
        deferred: DeferredProposals,
        values: &[f32],
    ) -> Result<Vec<Proposal>> {
        let launched = deferred
            .state
            .downcast::<Launched>()
            .map_err(|_| Error::InvalidInput("deferred proposals of another draft".into()))?;
        let gamma = self.config.block_size;
        if launched.n != lanes.len() * gamma || values.len() < launched.out.dims()[1] {
            return Err(Error::InvalidInput(format!(
                "deferred proposals of {} rows finished for {} lanes with {} values",
                launched.n,
                lanes.len(),
                values.len()
            )));
        }
        Ok(self.finish_recorded(lanes, &launched, values, &[]))
    }

    fn context_pool(&self) -> Option<crate::kv_cache::PoolState> {
        Some(self.cache.pool_state())
    }

    fn can_truncate_context(&self) -> bool {
        true
    }

    fn truncate_context(&mut self, seq: SeqId, len: usize) -> Result<()> {
        self.cache.truncate(seq, len)
    }

    fn end(&mut self, seq: SeqId) -> Result<()> {
        self.cache.free(seq)
    }
}

/// Uniform draws on the host (xorshift64*): random drafts' heads and FP8 projections.
struct HostUniform(u64);

impl HostUniform {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in `±scale`.
    fn next(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Qwen3Config;
    use crate::device::DeviceKind;

    fn tiny_base(layers: usize) -> Qwen3Config {
        serde_json::from_value(serde_json::json!({
            "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": false
        }))
        .unwrap_or_else(|e| panic!("static config: {e}"))
    }

    fn draft_config(ids: Option<Vec<usize>>) -> DSparkConfig {
        DSparkConfig {
            base: tiny_base(2),
            block_size: 4,
            target_layer_ids: ids,
            mask_token_id: 95,
            markov_rank: 8,
            markov_head_type: MarkovHeadType::Vanilla,
            enable_confidence_head: true,
            confidence_head_with_markov: true,
            num_target_layers: Some(4),
        }
    }

    #[test]
    fn a_random_draft_builds_and_proposes_a_full_block() -> Result<()> {
        let target = Qwen3::random(tiny_base(4), ComputeDtype::F32, DeviceKind::Cpu)?;
        let mut draft = DSparkDraft::random(
            draft_config(Some(vec![0, 2])),
            TargetBinding::of(&target),
            &DraftCacheConfig { kv_budget_bytes: 1 << 20, page_size: 16 },
        )?;
        assert_eq!(draft.layer_ids(), &[0, 2]);
        let seq = draft.begin();
        let features =
            Tensor::<2>::random([5, 2 * 32], burn::tensor::Distribution::Uniform(-1.0, 1.0), target.device());
        draft.extend_context(seq, features)?;
        assert_eq!(draft.context_len(seq)?, 5);
        for params in
            [SamplingParams::greedy(8), SamplingParams { temperature: 1.0, ..SamplingParams::default() }]
        {
            let out = draft.propose(&[ProposeLane { seq, anchor: 7, params: &params }])?;
            assert_eq!(out[0].tokens.len(), 4);
            assert!(out[0].tokens.iter().all(|&t| t < 96));
            assert_eq!(out[0].confidence.as_ref().map(Vec::len), Some(4));
            assert_eq!(out[0].q.is_some(), !params.is_greedy());
        }
        draft.end(seq)
    }

    #[test]
    fn a_random_draft_is_checked_against_its_target() -> Result<()> {
        let target = Qwen3::random(tiny_base(4), ComputeDtype::F32, DeviceKind::Cpu)?;
        let cache = DraftCacheConfig { kv_budget_bytes: 1 << 20, page_size: 16 };
        // the last target layer is never a feature layer; ids are required without a checkpoint
        for ids in [Some(vec![1, 3]), None] {
            let err = DSparkDraft::random(draft_config(ids), TargetBinding::of(&target), &cache);
            assert!(matches!(err, Err(Error::Config { .. })), "{err:?}");
        }
        Ok(())
    }

    #[test]
    fn forwards_pad_to_a_few_row_counts() {
        let sizes: std::collections::BTreeSet<usize> =
            (1..=MAX_GRAPH_ROWS).map(crate::model::graphs::padded_rows).collect();
        assert_eq!(
            sizes.into_iter().collect::<Vec<_>>(),
            [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
        );
        for rows in 1..=MAX_GRAPH_ROWS {
            assert!(crate::model::graphs::padded_rows(rows) >= rows);
        }
    }
}
