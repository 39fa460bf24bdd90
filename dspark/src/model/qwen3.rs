//! The Qwen3 target: loading a Hugging Face checkpoint and the batched forward.

use std::ops::Range;
use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use dspark_kernels::rms_norm_rows as rms_norm;

use super::layer::{AttnPlan, DecoderLayer, LayerShape, Proj, SeqRows};
use super::rope::Rope;
use crate::config::Qwen3Config;
use crate::device::{ComputeDtype, DeviceKind};
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvLayout, SeqId};
use crate::weights::{Checkpoint, ProgressFn};

/// How to load a checkpoint.
#[derive(Clone, Copy)]
pub struct LoadOptions<'a> {
    /// Where the weights go.
    pub device: DeviceKind,
    /// What they are converted to.
    pub dtype: ComputeDtype,
    /// Called after each tensor with `(bytes loaded, bytes in all)`.
    pub progress: Option<ProgressFn<'a>>,
}

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl Default for LoadOptions<'_> {
    fn default() -> Self {
        Self { device: DeviceKind::Cpu, dtype: ComputeDtype::F32, progress: None }
    }
}

/// Which rows of a chunk get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// None (e.g. a prompt whose continuation is not sampled yet).
    None,
    /// The last row only (decode, prefill before sampling).
    Last,
    /// Every row (verification, scoring).
    All,
}

impl LogitRows {
    fn count(self, rows: usize) -> usize {
        match self {
            LogitRows::None => 0,
            LogitRows::Last => 1.min(rows),
            LogitRows::All => rows,
        }
    }
}

/// New tokens of one sequence in a batched forward. They sit after the sequence's cached rows.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// The sequence (its cache holds the context).
    pub seq: SeqId,
    /// Token ids of the new rows, at positions `cached..cached + tokens.len()`.
    pub tokens: &'a [u32],
    /// Which rows get logits.
    pub logits: LogitRows,
}

/// What a forward returns.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `[logit rows of all chunks, vocab]`, chunk by chunk, in f32.
    pub logits: Option<Tensor<2>>,
    /// Rows of `logits` that belong to each chunk.
    pub logit_rows: Vec<Range<usize>>,
    /// Captured features `[all rows, n·hidden]` (layers in the order asked), or `None`.
    pub features: Option<Tensor<2>>,
    /// Rows of `features` that belong to each chunk.
    pub rows: Vec<Range<usize>>,
}

/// A Qwen3 causal language model.
#[derive(Debug)]
pub struct Qwen3 {
    config: Qwen3Config,
    dtype: ComputeDtype,
    device: Device,
    embed_tokens: Tensor<2>,
    layers: Vec<DecoderLayer>,
    norm: Tensor<1>,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Tensor<2>>,
    /// The LM head as a projection (on the CPU, a packed host copy).
    head: Proj,
    rope: Rope,
}

impl Qwen3 {
    /// Load a Hugging Face Qwen3 checkpoint folder unchanged.
    ///
    /// # Errors
    /// Missing or malformed `config.json`, missing/truncated weight files, tensors with the wrong
    /// shape or dtype (each error names the file and tensor), or a device this build lacks.
    pub fn load(dir: &Path, options: LoadOptions<'_>) -> Result<Self> {
        let config = Qwen3Config::from_dir(dir)?;
        let device = options.device.device()?;
        let ckpt = Checkpoint::open(dir)?;
        let dtype = options.dtype;
        let tied = !ckpt.contains("lm_head.weight");
        let (v, h) = (config.vocab_size, config.hidden_size);
        let shape = LayerShape {
            hidden: h,
            intermediate: config.intermediate_size,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim(),
            eps: config.rms_norm_eps,
        };
        let report = ckpt.reporter(options.progress);
        tracing::info!(dir = %dir.display(), layers = config.num_hidden_layers, %dtype, device = %options.device, tied, "loading Qwen3 target");
        let embed_tokens = ckpt.load("model.embed_tokens.weight", [v, h], dtype, &device)?;
        report("model.embed_tokens.weight");
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let prefix = format!("model.layers.{i}.");
            layers.push(DecoderLayer::load(&ckpt, &prefix, shape, dtype, &device, &report)?);
        }
        let norm = ckpt.load("model.norm.weight", [h], dtype, &device)?;
        report("model.norm.weight");
        let lm_head = if tied {
            None
        } else {
            let t = ckpt.load("lm_head.weight", [v, h], dtype, &device)?;
            report("lm_head.weight");
            Some(t)
        };
        let theta = config.rope_theta_value().unwrap_or(1e6);
        let rope = Rope::new(theta, config.head_dim());
        let head = Proj::new(lm_head.clone().unwrap_or_else(|| embed_tokens.clone()));
        Ok(Self { config, dtype, device, embed_tokens, layers, norm, lm_head, head, rope })
    }

    /// A model with random weights at the shapes of `config` (validated), built directly on the
    /// device: for benchmarks at real sizes where no checkpoint is available.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid config, [`Error::Unsupported`] for a device this build
    /// lacks.
    pub fn random(config: Qwen3Config, dtype: ComputeDtype, device: DeviceKind) -> Result<Self> {
        config.validate(Path::new("<random>"))?;
        let device = device.device()?;
        let shape = LayerShape {
            hidden: config.hidden_size,
            intermediate: config.intermediate_size,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim(),
            eps: config.rms_norm_eps,
        };
        let opts = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
        let dist = burn::tensor::Distribution::Uniform(-0.02, 0.02);
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed_tokens = Tensor::random([v, h], dist, opts.clone());
        let lm_head = (!config.tie_word_embeddings).then(|| Tensor::random([v, h], dist, opts.clone()));
        let layers = (0..config.num_hidden_layers)
            .map(|_| DecoderLayer::random(shape, dtype, &device, 0.02))
            .collect();
        let norm = Tensor::ones([h], opts);
        let rope = Rope::new(config.rope_theta_value().unwrap_or(1e6), config.head_dim());
        let head = Proj::new(lm_head.clone().unwrap_or_else(|| embed_tokens.clone()));
        Ok(Self { config, dtype, device, embed_tokens, layers, norm, lm_head, head, rope })
    }

    /// Bytes of weights one decode step streams: every layer plus the LM head.
    pub fn step_weight_bytes(&self) -> usize {
        let head = self.config.vocab_size * self.config.hidden_size * self.dtype.size();
        self.layers.iter().map(DecoderLayer::weight_bytes).sum::<usize>()
            + head
            + self.config.hidden_size * self.dtype.size()
    }

    /// The checkpoint's configuration.
    pub fn config(&self) -> &Qwen3Config {
        &self.config
    }

    /// Compute dtype.
    pub fn dtype(&self) -> ComputeDtype {
        self.dtype
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// The input embedding `[vocab, hidden]` (a draft borrows it).
    pub fn embed_tokens(&self) -> &Tensor<2> {
        &self.embed_tokens
    }

    /// The output head `[vocab, hidden]` (the embedding when tied; a draft borrows it).
    pub fn lm_head(&self) -> &Tensor<2> {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The KV layout this model needs, with `page_size` rows per page.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        KvLayout {
            layers: self.config.num_hidden_layers,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim(),
            dtype: self.dtype,
            page_size,
        }
    }

    /// Check every token id against the vocabulary.
    ///
    /// # Errors
    /// [`Error::TokenOutOfRange`] for the first bad id.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&token) => Err(Error::TokenOutOfRange { token, vocab }),
            None => Ok(()),
        }
    }

    /// One forward over new rows of several sequences (prefill, decode or verification).
    ///
    /// Each chunk's tokens are appended to its sequence in `cache` (rows reserved all or
    /// nothing before compute). Returns f32 logits for the requested rows and, when
    /// `capture` is not empty, the residual output of each listed layer (Hugging Face
    /// `hidden_states[l + 1]`), concatenated in list order.
    ///
    /// # Shapes
    /// logits `[Σ requested rows, vocab]`, features `[Σ rows, capture.len()·hidden]`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty chunk or a capture id out of range,
    /// [`Error::TokenOutOfRange`], [`Error::KvCacheFull`], [`Error::UnknownSequence`].
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        capture: &[usize],
        cache: &mut dyn KvCache,
    ) -> Result<ForwardOutput> {
        if chunks.is_empty() {
            return Err(Error::InvalidInput("forward over no sequence".into()));
        }
        let n_layers = self.layers.len();
        if let Some(&bad) = capture.iter().find(|&&l| l >= n_layers) {
            return Err(Error::InvalidInput(format!(
                "capture layer {bad} out of range (model has {n_layers})"
            )));
        }
        let mut tokens = Vec::new();
        for chunk in chunks {
            if chunk.tokens.is_empty() {
                return Err(Error::InvalidInput(format!("empty chunk for sequence {}", chunk.seq)));
            }
            self.check_tokens(chunk.tokens)?;
            tokens.extend(chunk.tokens.iter().map(|&t| i64::from(t)));
        }
        // 1. reserve cache rows for every chunk (all or nothing), then build per-sequence views.
        let grow: Vec<(SeqId, usize)> = chunks.iter().map(|c| (c.seq, c.tokens.len())).collect();
        let ranges = cache.reserve(&grow)?;
        let mut seqs = Vec::with_capacity(chunks.len());
        let mut positions = Vec::with_capacity(tokens.len());
        let mut offset = 0;
        for (chunk, pos) in chunks.iter().zip(&ranges) {
            let n = chunk.tokens.len();
            seqs.push(SeqRows { seq: chunk.seq, rows: offset..offset + n, start: pos.start, index: None });
            positions.extend(pos.clone());
            offset += n;
        }
        let total = tokens.len();
        // The kernel reads one page table for the whole batch; without it each sequence gathers
        // its own rows.
        let plan = match self.attention_plan(&seqs, cache) {
            Ok(plan) => plan,
            Err(e) => {
                self.rollback(cache, &grow, &ranges);
                return Err(e);
            }
        };
        if plan.is_none() {
            for (s, pos) in seqs.iter_mut().zip(&ranges) {
                match cache.gather_index(s.seq, pos.end) {
                    Ok(index) => s.index = Some(index),
                    Err(e) => {
                        self.rollback(cache, &grow, &ranges);
                        return Err(e);
                    }
                }
            }
        }
        // 2. embed [rows, hidden]; rotary tables [rows, head_dim].
        let ids = Tensor::<1, Int>::from_data(TensorData::new(tokens, [total]), &self.device);
        let mut x = self.embed_tokens.clone().select(0, ids);
        let (cos, sin) = self.rope.tables(&positions, self.dtype, &self.device);
        // 3. decoder layers, keeping the captured residual outputs.
        let mut captured: Vec<Option<Tensor<2>>> = vec![None; capture.len()];
        for (l, layer) in self.layers.iter().enumerate() {
            x = match layer.forward(l, x, (&cos, &sin), &seqs, plan.as_ref(), cache) {
                Ok(x) => x,
                Err(e) => {
                    self.rollback(cache, &grow, &ranges);
                    return Err(e);
                }
            };
            for (slot, _) in capture.iter().enumerate().filter(|(_, id)| **id == l) {
                captured[slot] = Some(x.clone());
            }
        }
        let features = if capture.is_empty() {
            None
        } else {
            Some(Tensor::cat(captured.into_iter().flatten().collect(), 1))
        };
        // 4. logits for the requested rows only: final norm, LM head, f32.
        let mut pick = Vec::new();
        let mut logit_rows = Vec::with_capacity(chunks.len());
        for (chunk, s) in chunks.iter().zip(&seqs) {
            let k = chunk.logits.count(s.rows.len());
            let first = pick.len();
            pick.extend((s.rows.end - k..s.rows.end).map(|r| r as i64));
            logit_rows.push(first..first + k);
        }
        let logits = if pick.is_empty() {
            None
        } else {
            let n = pick.len();
            let rows = if n == total {
                x
            } else {
                x.select(0, Tensor::<1, Int>::from_data(TensorData::new(pick, [n]), &self.device))
            };
            let h = rms_norm(rows, &self.norm, self.config.rms_norm_eps);
            let logits = self.head.apply(h);
            Some(if self.dtype == ComputeDtype::F32 { logits } else { logits.cast(burn::tensor::DType::F32) })
        };
        Ok(ForwardOutput {
            logits,
            logit_rows,
            features,
            rows: seqs.iter().map(|s| s.rows.clone()).collect(),
        })
    }

    /// The page tables of this forward for [`dspark_kernels::paged_attention`], when the kernels
    /// run on this device and the cache keeps a pool; `None` makes every layer attend per
    /// sequence instead. Row `i` of a sequence whose new rows start at position `start` sees
    /// positions `0..=start + i` (causal).
    fn attention_plan(&self, seqs: &[SeqRows], cache: &dyn KvCache) -> Result<Option<AttnPlan>> {
        let heads = self.config.num_attention_heads;
        if !cache.pools(0).is_some_and(|(k_pool, _)| dspark_kernels::paged_attention_runs(heads, &k_pool)) {
            return Ok(None);
        }
        let mut keys: Vec<i32> = Vec::new();
        let mut meta: Vec<i32> = Vec::new();
        let mut new_rows: Vec<i64> = Vec::new();
        for s in seqs {
            let first = keys.len();
            let rows = cache.physical_rows(s.seq, s.start + s.rows.len())?;
            new_rows.extend_from_slice(&rows[s.start..]);
            keys.extend(rows.into_iter().map(|r| r as i32));
            for i in 0..s.rows.len() {
                meta.extend([first as i32, (s.start + i + 1) as i32]);
            }
        }
        Ok(Some(AttnPlan::upload(keys, meta, new_rows, &self.device)))
    }

    fn rollback(&self, cache: &mut dyn KvCache, grow: &[(SeqId, usize)], ranges: &[Range<usize>]) {
        for ((seq, _), range) in grow.iter().zip(ranges) {
            if let Err(e) = cache.truncate(*seq, range.start) {
                tracing::warn!(seq, error = %e, "could not roll back a failed forward");
            }
        }
    }
}
