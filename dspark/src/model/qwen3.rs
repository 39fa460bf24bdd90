//! The Qwen3 target: loading a Hugging Face checkpoint and the batched forward.

use std::ops::Range;
use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::graphs::{Graphs, HostInputs, Ran, ShapeKey};
use super::layer::{AttnPlan, DecoderLayer, LayerShape, Proj, SeqRows, next_norm, stack_input};
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

/// Token ids of a forward that are still on the device (the drafts of a deferred round, see
/// [`crate::Speculator::propose_deferred`]): row `rows[j].0` of the forward (counted over its
/// chunks in order) takes `values[rows[j].1]`, whatever its chunk holds there. The values are
/// not checked on the host (that would take the read this type avoids): they must be ids of the
/// target's vocabulary, as the tokens of a draft bound to this target are.
#[derive(Debug, Clone, Copy)]
pub struct DeviceTokens<'a> {
    /// f32 `[k, 1]`, exact integer ids.
    pub values: &'a Tensor<2>,
    /// `(forward row, index into values)` pairs.
    pub rows: &'a [(usize, usize)],
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
    /// Cos/sin of every position, built for the first recorded forward.
    rope_table: std::sync::OnceLock<(Tensor<2>, Tensor<2>)>,
    /// Recorded forwards (CUDA).
    graphs: Graphs,
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
        Ok(Self::assemble(config, dtype, device, embed_tokens, layers, norm, lm_head))
    }

    /// The model from its weights: the LM head as a projection, the rotary frequencies, no
    /// graphs recorded yet.
    fn assemble(
        config: Qwen3Config,
        dtype: ComputeDtype,
        device: Device,
        embed_tokens: Tensor<2>,
        layers: Vec<DecoderLayer>,
        norm: Tensor<1>,
        lm_head: Option<Tensor<2>>,
    ) -> Self {
        let rope = Rope::new(config.rope_theta_value().unwrap_or(1e6), config.head_dim());
        let head = Proj::new(lm_head.clone().unwrap_or_else(|| embed_tokens.clone()));
        // Building the weights left temporaries (f32 copies before a cast, host-to-device
        // staging) reserved in the allocator's pools; give them back before serving.
        device.memory_cleanup();
        Self {
            config,
            dtype,
            device,
            embed_tokens,
            layers,
            norm,
            lm_head,
            head,
            rope,
            rope_table: std::sync::OnceLock::new(),
            graphs: Graphs::default(),
        }
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
        let embed_tokens =
            crate::device::persistent(&device, (), |()| Tensor::random([v, h], dist, opts.clone()));
        let lm_head = (!config.tie_word_embeddings)
            .then(|| crate::device::persistent(&device, (), |()| Tensor::random([v, h], dist, opts.clone())));
        let layers = (0..config.num_hidden_layers)
            .map(|_| DecoderLayer::random(shape, dtype, &device, 0.02))
            .collect();
        let norm = crate::device::persistent(&device, (), |()| Tensor::ones([h], opts.clone()));
        Ok(Self::assemble(config, dtype, device, embed_tokens, layers, norm, lm_head))
    }

    /// Launch shapes whose forwards are recorded as graphs (for the cache used last): at most
    /// 16, each holding the device memory its launches touched (see [`crate::set_graphs_enabled`]).
    pub fn recorded_shapes(&self) -> usize {
        self.graphs.recorded()
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
        self.forward_with(chunks, capture, cache, None)
    }

    /// [`Qwen3::forward`] where some token ids are taken from the device (`device`): a verify
    /// window queued behind the draft round that proposed it, with no read in between. The
    /// chunks' tokens at those rows are ignored. The result is the forward of the tokens the
    /// device holds, bit for bit.
    ///
    /// # Errors
    /// As [`Qwen3::forward`]; [`Error::InvalidInput`] when `device` names a row or an index out
    /// of range, or `values` is not `[k, 1]`.
    pub fn forward_device_tokens(
        &self,
        chunks: &[SeqChunk<'_>],
        device: DeviceTokens<'_>,
        capture: &[usize],
        cache: &mut dyn KvCache,
    ) -> Result<ForwardOutput> {
        self.forward_with(chunks, capture, cache, Some(device))
    }

    fn forward_with(
        &self,
        chunks: &[SeqChunk<'_>],
        capture: &[usize],
        cache: &mut dyn KvCache,
        device: Option<DeviceTokens<'_>>,
    ) -> Result<ForwardOutput> {
        if chunks.is_empty() {
            return Err(Error::InvalidInput("forward over no sequence".into()));
        }
        let _span = tracing::debug_span!("target_forward").entered();
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
        // Rows whose ids come from the device: 0 on the host, `src` = index + 1 into the values.
        let mut src = Vec::new();
        if let Some(d) = &device {
            let [k, width] = d.values.dims();
            if width != 1 {
                return Err(Error::InvalidInput(format!(
                    "device tokens of shape [{k}, {width}], not [k, 1]"
                )));
            }
            src = vec![0i64; tokens.len()];
            for &(row, index) in d.rows {
                if row >= tokens.len() || index >= k {
                    return Err(Error::InvalidInput(format!(
                        "device token {index} of {k} for row {row} of a {}-row forward",
                        tokens.len()
                    )));
                }
                tokens[row] = 0;
                src[row] = index as i64 + 1;
            }
        }
        let device = device.map(|d| (d.values, src.as_slice()));
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
        // Logits for the requested rows only.
        let mut pick = Vec::new();
        let mut logit_rows = Vec::with_capacity(chunks.len());
        for (chunk, s) in chunks.iter().zip(&seqs) {
            let k = chunk.logits.count(s.rows.len());
            let first = pick.len();
            pick.extend((s.rows.end - k..s.rows.end).map(|r| r as i64));
            logit_rows.push(first..first + k);
        }
        let rows = seqs.iter().map(|s| s.rows.clone()).collect();
        let done = |(logits, features)| ForwardOutput { logits, logit_rows, features, rows };
        // The kernel reads one page table for the whole batch; without it each sequence gathers
        // its own rows.
        let plan = match self.host_plan(&seqs, cache) {
            Ok(plan) => plan,
            Err(e) => {
                self.rollback(cache, &grow, &ranges);
                return Err(e);
            }
        };
        // 2. the recorded forward of this shape, where graphs run.
        let plan = match plan {
            Some(plan) => {
                match self.forward_recorded(&tokens, &positions, plan, &pick, capture, device, cache) {
                    Recorded::Done(out) => return Ok(done(*out)),
                    Recorded::Failed(e) => {
                        self.rollback(cache, &grow, &ranges);
                        return Err(e);
                    }
                    Recorded::No(plan) => Some(plan.upload(&self.device)),
                }
            }
            None => None,
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
        // 3. op by op: embed [rows, hidden], rotary tables [rows, head_dim], the layers, logits.
        let mut ids = Tensor::<1, Int>::from_data(TensorData::new(tokens, [total]), &self.device);
        if let Some((values, src)) = device {
            let src = Tensor::<1, Int>::from_data(TensorData::new(src.to_vec(), [total]), &self.device);
            ids = merge_device_tokens(ids, src, values.clone());
        }
        let (cos, sin) = self.rope.tables(&positions, self.dtype, &self.device);
        let n = pick.len();
        let pick = (n > 0 && n < total)
            .then(|| Tensor::<1, Int>::from_data(TensorData::new(pick, [n]), &self.device));
        match self.body(ids, (&cos, &sin), &seqs, plan.as_ref(), capture, n, pick, true, cache) {
            Ok(out) => Ok(done(out)),
            Err(e) => {
                self.rollback(cache, &grow, &ranges);
                Err(e)
            }
        }
    }

    /// The device part of a forward: embedding, decoder layers (K/V written at the plan's rows,
    /// or per sequence without a plan), the captured features, and f32 logits of `picks` rows
    /// (`pick` chooses them; `None` with `picks` > 0 means every row), or with `widen` false
    /// the logits in the model's dtype (the caller widens them).
    #[allow(clippy::too_many_arguments)]
    fn body(
        &self,
        ids: Tensor<1, Int>,
        rope: (&Tensor<2>, &Tensor<2>),
        seqs: &[SeqRows],
        plan: Option<&AttnPlan>,
        capture: &[usize],
        picks: usize,
        pick: Option<Tensor<1, Int>>,
        widen: bool,
        cache: &mut dyn KvCache,
    ) -> Result<(Option<Tensor<2>>, Option<Tensor<2>>)> {
        let (layers, norm, eps) = (&self.layers, &self.norm, self.config.rms_norm_eps);
        // The residual stream and its normed copy; after the last layer, normed by the final norm.
        let mut xh = stack_input(layers, norm, self.embed_tokens.clone().select(0, ids), eps);
        let mut captured: Vec<Option<Tensor<2>>> = vec![None; capture.len()];
        for (l, layer) in layers.iter().enumerate() {
            xh = layer.forward(l, xh, rope, seqs, plan, next_norm(layers, l, norm), cache)?;
            for (slot, _) in capture.iter().enumerate().filter(|(_, id)| **id == l) {
                captured[slot] = Some(xh.0.clone());
            }
        }
        let features = if capture.is_empty() {
            None
        } else {
            Some(Tensor::cat(captured.into_iter().flatten().collect(), 1))
        };
        let logits = (picks > 0).then(|| {
            // (A row's norm does not depend on the other rows: normed, then picked.)
            let h = match pick {
                Some(pick) => xh.1.select(0, pick),
                None => xh.1,
            };
            let logits = self.head.apply(h);
            if self.dtype == ComputeDtype::F32 || !widen {
                logits
            } else {
                logits.cast(burn::tensor::DType::F32)
            }
        });
        Ok((logits, features))
    }

    /// The forward as a replay of the graph recorded for its shape (recorded now when new), on
    /// devices where graphs run and for at most [`super::graphs::MAX_GRAPH_ROWS`] rows (prefill:
    /// [`super::graphs::MAX_SPAN_ROWS`]). Its outputs equal the op-by-op forward's bit for bit:
    /// the same body, reading the same values from device buffers instead of fresh uploads.
    #[allow(clippy::too_many_arguments)]
    fn forward_recorded(
        &self,
        tokens: &[i64],
        positions: &[usize],
        plan: HostPlan,
        pick: &[i64],
        capture: &[usize],
        device: Option<(&Tensor<2>, &[i64])>,
        cache: &mut dyn KvCache,
    ) -> Recorded {
        let (real, picks) = (tokens.len(), pick.len());
        let (Some(id), Some(pool_rows)) = (cache.graph_id(), cache.pools(0).map(|(k, _)| k.dims()[0])) else {
            return Recorded::No(plan);
        };
        if !super::graphs::recording(&self.device) {
            return Recorded::No(plan);
        }
        let table_rows = self.config.max_position_embeddings;
        // Past MAX_SPAN_ROWS only windows whose every row is scored (verify windows, many-lane
        // steps) are recorded; a long prefill runs op by op.
        if positions.iter().any(|&p| p >= table_rows)
            || (real > super::graphs::MAX_SPAN_ROWS && picks != real)
        {
            return Recorded::No(plan);
        }
        let (cos_t, sin_t) =
            self.rope_table.get_or_init(|| self.rope.full_tables(table_rows, self.dtype, &self.device));
        // Padded to a few row counts (see `padded_rows`): padding rows read the scratch row
        // alone and write their K/V there; their logits and features are dropped.
        let scratch = if super::graphs::padded_rows(real) > real { cache.scratch_row() } else { None };
        let rows = scratch.map_or(real, |_| super::graphs::padded_rows(real));
        let pad_row = scratch.map_or(0, |r| r as i64);
        // Logits of every real row (a verify window): the padding rows' logits are computed too
        // and dropped below, so windows of 3 and 4 rows share one recorded shape.
        let all_rows = picks == real && rows > real;
        let (picks, pick) = if all_rows { (rows, &[][..]) } else { (picks, pick) };
        // Sections of `stride` values (aligned starts: the body's views share the buffer): ids,
        // positions, K/V rows, picked rows, device-id sources.
        let stride = super::graphs::int_section(rows);
        let mut ints = Vec::with_capacity(5 * stride);
        ints.extend_from_slice(tokens);
        ints.resize(stride, 0);
        ints.extend(positions.iter().map(|&p| p as i64));
        ints.resize(2 * stride, 0);
        ints.extend_from_slice(&plan.new_rows);
        ints.resize(2 * stride + rows, pad_row);
        ints.resize(3 * stride, 0);
        let pick_rows = picks > 0 && picks < rows;
        if pick_rows {
            ints.extend_from_slice(pick);
        }
        // Rows whose ids are on the device: their sources after the other sections (padding
        // rows keep their host id).
        let src_at = super::graphs::int_section(ints.len());
        if let Some((_, src)) = device {
            ints.resize(src_at, 0);
            ints.extend_from_slice(src);
            ints.resize(src_at + rows, 0);
        }
        // The rows' grouping is fixed in the recording (it sets the attention kernel's cubes): one
        // sequence's window is one group with its padding, so windows padded to the same row
        // count still share a shape.
        let group = if plan.group == real { rows } else { plan.group };
        let values_len = device.map_or(0, |(values, _)| values.dims()[0]);
        let mut detail = vec![values_len, picks, group];
        detail.extend_from_slice(capture);
        let key = ShapeKey { rows, ints: ints.len(), detail };
        // Logits leave the graph in the model's dtype and are widened to f32 as they are handed
        // out (see `HostInputs::widen`).
        let widen = usize::from(picks > 0);
        let floats = device.map(|(values, _)| values.clone());
        let mut host = HostInputs { ints, keys: plan.keys.clone(), meta: plan.meta.clone(), floats, widen };
        if rows > real {
            let at = host.keys.len() as i32;
            host.keys.push(pad_row as i32);
            for _ in real..rows {
                host.meta.extend([at, 1]);
            }
        }
        let ran = self.graphs.run(&self.device, id, pool_rows, key, host, |inputs| {
            let mut ids = inputs.ints(0, rows);
            if values_len > 0 {
                let values = inputs.floats(values_len, 1).ok_or_else(|| {
                    Error::InvalidInput("a recorded forward without its device tokens".into())
                })?;
                ids = merge_device_tokens(ids, inputs.ints(src_at, rows), values);
            }
            let at = inputs.ints(stride, rows);
            let (cos, sin) = (cos_t.clone().select(0, at.clone()), sin_t.clone().select(0, at));
            let plan = inputs.plan(rows, 2 * stride, group);
            let pick = pick_rows.then(|| inputs.ints(3 * stride, picks));
            let (logits, features) =
                self.body(ids, (&cos, &sin), &[], Some(&plan), capture, picks, pick, false, cache)?;
            Ok(logits.into_iter().chain(features).collect())
        });
        match ran {
            Ran::Replayed(mut outs) => {
                let features =
                    (!capture.is_empty()).then(|| outs.pop()).flatten().map(|f| f.narrow(0, 0, real));
                let logits = (picks > 0).then(|| outs.pop()).flatten();
                let logits = if all_rows { logits.map(|l| l.narrow(0, 0, real)) } else { logits };
                Recorded::Done(Box::new((logits, features)))
            }
            Ran::NotRecorded => Recorded::No(plan),
            Ran::Failed(e) => Recorded::Failed(e),
        }
    }

    /// The page tables of this forward for [`dspark_kernels::paged_attention`], on the host, when
    /// the kernels run on this device and the cache keeps a pool; `None` makes every layer
    /// attend per sequence instead. Row `i` of a sequence whose new rows start at position
    /// `start` sees positions `0..=start + i` (causal).
    fn host_plan(&self, seqs: &[SeqRows], cache: &dyn KvCache) -> Result<Option<HostPlan>> {
        let heads = self.config.num_attention_heads;
        if !cache.pools(0).is_some_and(|(k_pool, _)| dspark_kernels::paged_attention_runs(heads, &k_pool)) {
            return Ok(None);
        }
        let mut plan = HostPlan::default();
        let width = seqs.first().map_or(1, |s| s.rows.len());
        plan.group = if seqs.iter().all(|s| s.rows.len() == width) { width.max(1) } else { 1 };
        for s in seqs {
            let first = plan.keys.len();
            let rows = cache.physical_rows(s.seq, s.start + s.rows.len())?;
            plan.new_rows.extend_from_slice(&rows[s.start..]);
            plan.keys.extend(rows.into_iter().map(|r| r as i32));
            for i in 0..s.rows.len() {
                plan.meta.extend([first as i32, (s.start + i + 1) as i32]);
            }
        }
        if plan.group == 1 {
            plan.sync_words =
                dspark_kernels::attention_sync_words(plan.meta.len() / 2, self.config.num_key_value_heads);
        }
        Ok(Some(plan))
    }

    fn rollback(&self, cache: &mut dyn KvCache, grow: &[(SeqId, usize)], ranges: &[Range<usize>]) {
        for ((seq, _), range) in grow.iter().zip(ranges) {
            if let Err(e) = cache.truncate(*seq, range.start) {
                tracing::warn!(seq, error = %e, "could not roll back a failed forward");
            }
        }
    }
}

/// Page tables of one forward on the host (see [`AttnPlan`]).
#[derive(Debug, Default)]
pub(crate) struct HostPlan {
    pub keys: Vec<i32>,
    pub meta: Vec<i32>,
    pub new_rows: Vec<i64>,
    pub group: usize,
    /// Counter words the attention of one-row groups folds its merge with (see
    /// [`dspark_kernels::paged_attention_synced`]).
    pub sync_words: usize,
}

impl HostPlan {
    /// The tables on `device`, for a forward run op by op.
    pub(crate) fn upload(self, device: &Device) -> AttnPlan {
        AttnPlan::upload(self.keys, self.meta, self.new_rows, self.group, self.sync_words, device)
    }
}

/// What [`Qwen3::forward_recorded`] did.
enum Recorded {
    /// Replayed: logits and features.
    Done(Box<(Option<Tensor<2>>, Option<Tensor<2>>)>),
    /// The body failed while being recorded.
    Failed(Error),
    /// Not recorded: run op by op with this plan.
    No(HostPlan),
}

/// `ids` with the rows whose `src` is `j + 1` replaced by `values[j]` (f32 `[k, 1]` holding exact
/// integer ids; `src` 0 keeps the row's id, which the caller left 0).
pub(crate) fn merge_device_tokens(
    ids: Tensor<1, Int>,
    src: Tensor<1, Int>,
    values: Tensor<2>,
) -> Tensor<1, Int> {
    let [k, _] = values.dims();
    let values = values.reshape([k]);
    let table = Tensor::cat(vec![values.clone().narrow(0, 0, 1).zeros_like(), values], 0);
    ids + table.select(0, src).int()
}
