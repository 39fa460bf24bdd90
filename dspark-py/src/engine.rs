//! `dspark.Engine`: a Qwen3 target, optionally with a DSpark draft, and the tokenizer of its
//! folder. Every call releases the GIL while it works; calls on one engine are serialised by a
//! lock (a running `stream` holds it until its generation ends).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dspark::text::{ChatMessage, ChatOptions, StreamDecoder, Tokenizer};
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, EngineConfig, Error, LoadOptions, Qwen3,
    Request, VerifyPolicy,
};
use pyo3::prelude::*;

use crate::errors::{Failure, Kind, guarded, lock, new_err};
use crate::prompts::{Prompt, messages, parse_params, parse_prompt, parse_prompts, token_ids};
use crate::results::{BatchStats, Generation, StreamChunk, finish_fields};
use crate::stream::TokenStream;

/// Run `body` with the GIL released and panics caught; raise its failure as a Python exception.
pub(crate) fn run<T: Send>(py: Python<'_>, body: impl FnOnce() -> Result<T, Failure> + Send) -> PyResult<T> {
    py.detach(|| guarded(body)).map_err(|f| f.into_py(py))
}

/// A Qwen3 target checkpoint, optionally with a DSpark draft (speculative decoding: same
/// outputs when greedy, the same distribution when sampling), and the tokenizer of its folder.
///
/// Args:
///     target: Hugging Face Qwen3 folder (`config.json`, `model.safetensors` or shards with
///         `model.safetensors.index.json`, optionally `tokenizer.json`,
///         `tokenizer_config.json`, `generation_config.json`).
///     draft: DSpark draft folder; `None` runs target-only.
///     device: `"cpu"`, `"cuda"` or `"cuda:N"`.
///     dtype: compute dtype, `"f32"`, `"bf16"` or `"f16"`.
///     kv_budget_bytes: bytes of device memory for the target's KV cache (default: the Rust
///         `EngineConfig` default).
///     page_size: rows per KV page (default: the Rust default).
///     verify_width: verify the anchor and the first `verify_width - 1` drafts each round
///         (`1..=γ+1`); default: all γ drafts. Needs `draft`.
///     confidence_threshold: verify the drafts before the first whose confidence is below this
///         value (needs a draft with a confidence head). Needs `draft`; not with `verify_width`.
///     draft_kv_budget_bytes: bytes for the draft's context K/V (default: the Rust
///         `DraftCacheConfig` default).
///     draft_page_size: rows per page of the draft's cache (default: the Rust default).
///     draft_fp8: quantise the draft's projections to FP8 (e4m3, one scale per output row) at
///         load; projections the checkpoint stores in FP8 are used as stored. On CUDA in bf16
///         they stay FP8 on the device (half the bytes per round). Outputs keep the target's
///         distribution; acceptance may drop a little. Needs `draft`.
///     draft_fp8_head: also give the draft an FP8 copy of the LM head for its base logits (the
///         target's logits stay exact). Needs `draft_fp8`.
///     one_sync_rounds: let fixed-width rounds wait on the device once (drafts merged into the
///         verify on the device; CUDA with recorded graphs); `False` reads the drafts before
///         the verify. Outputs are the same either way.
///     tokenizer: folder with `tokenizer.json` (and its configs); default: `target`, where a
///         missing `tokenizer.json` leaves the engine without a tokenizer (token ids only).
///     progress: called as `progress(bytes_loaded, bytes_total)` while weights load.
///
/// Raises:
///     UnsupportedError: an unknown device or dtype, or a device this build lacks.
///     IoError, CheckpointError: a folder or file is missing or malformed.
///     InvalidInputError: the verify options do not fit the draft, or the KV budget holds no
///         page.
///     TextError: the tokenizer files are malformed.
#[pyclass(module = "dspark", frozen)]
#[derive(Debug)]
pub struct Engine {
    inner: Arc<Mutex<dspark::Engine>>,
    tokenizer: Option<Tokenizer>,
    /// Where the tokenizer was looked for.
    tokenizer_dir: PathBuf,
    eos: Vec<u32>,
    vocab: usize,
    device: DeviceKind,
    dtype: ComputeDtype,
    speculative: bool,
    /// Requests of the serving calls (`submit` / `step`), by id, with their text decoders.
    served: Mutex<HashMap<u64, Served>>,
}

/// What `Engine.step` returns: the step's chunks, and the requests that finished in it.
type StepResult = (Vec<StreamChunk>, Vec<(u64, Generation)>);

/// A request submitted with `Engine.submit`.
#[derive(Debug)]
struct Served {
    request: Request,
    decoder: Option<StreamDecoder>,
}

/// The prepared requests of a call: token ids and Rust sampling parameters.
pub(crate) type Requests = Vec<Request>;

impl Engine {
    fn no_tokenizer(&self) -> Failure {
        Error::InvalidInput(format!(
            "text and chat prompts need a tokenizer, and {} has no tokenizer.json; pass token ids, \
             or tokenizer= a folder with tokenizer.json",
            self.tokenizer_dir.display()
        ))
        .into()
    }

    fn tokenizer(&self) -> Result<&Tokenizer, Failure> {
        self.tokenizer.as_ref().ok_or_else(|| self.no_tokenizer())
    }

    /// Token ids of one prompt (text: no special tokens added; chat: rendered with the chat
    /// template and the assistant's header).
    fn prompt_ids(&self, prompt: Prompt, enable_thinking: Option<bool>) -> Result<Vec<u32>, Failure> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => Ok(self.tokenizer()?.encode(&text, false)?),
            Prompt::Chat(messages) => {
                let tok = self.tokenizer()?;
                let opts = ChatOptions { add_generation_prompt: true, enable_thinking };
                Ok(tok.encode(&tok.apply_chat_template(&messages, &opts)?, false)?)
            }
        }
    }

    /// Parse `prompts` and `params` (with the GIL) and tokenize (without it).
    fn requests(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        enable_thinking: Option<bool>,
    ) -> PyResult<(Requests, bool)> {
        let (prompts, single) = parse_prompts(prompts, self.vocab)?;
        let params = parse_params(params, prompts.len())?;
        let requests = run(py, || {
            prompts
                .into_iter()
                .zip(params)
                .map(|(prompt, p)| {
                    Ok(Request {
                        prompt: self.prompt_ids(prompt, enable_thinking)?,
                        params: p.to_rust(&self.eos),
                    })
                })
                .collect::<Result<Vec<_>, Failure>>()
        })?;
        Ok((requests, single))
    }
}

/// The Python result of a finished request.
pub(crate) fn generation(
    tokenizer: Option<&Tokenizer>,
    request: &Request,
    g: dspark::Generation,
) -> Result<Generation, Failure> {
    let text = tokenizer.map(|t| t.decode(&g.tokens, true)).transpose()?;
    let (finish_reason, stop_token_id) = finish_fields(g.finish);
    Ok(Generation {
        prompt_token_ids: request.prompt.clone(),
        token_ids: g.tokens,
        text,
        finish_reason,
        stop_token_id,
        stats: g.stats.into(),
    })
}

/// One result for one prompt, a list for a list.
fn one_or_many(py: Python<'_>, mut results: Vec<Generation>, single: bool) -> PyResult<Py<PyAny>> {
    match (single, results.pop()) {
        (true, Some(g)) => Ok(Py::new(py, g)?.into_any()),
        (_, last) => {
            results.extend(last);
            Ok(results.into_pyobject(py)?.into_any().unbind())
        }
    }
}

/// `Engine(draft_vocab=...)`: a size (the most frequent tokens of `draft_vocab_corpus`, else
/// the first ids) or the token ids themselves.
#[derive(FromPyObject)]
enum DraftVocabArg {
    Size(usize),
    Ids(Vec<u32>),
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        target, draft=None, *, device="cpu", dtype="f32", kv_budget_bytes=None, page_size=None,
        verify_width=None, confidence_threshold=None, draft_kv_budget_bytes=None, draft_page_size=None,
        draft_fp8=false, draft_fp8_head=false, draft_vocab=None, draft_vocab_corpus=None,
        one_sync_rounds=true, tokenizer=None, progress=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        target: PathBuf,
        draft: Option<PathBuf>,
        device: &str,
        dtype: &str,
        kv_budget_bytes: Option<usize>,
        page_size: Option<usize>,
        verify_width: Option<usize>,
        confidence_threshold: Option<f32>,
        draft_kv_budget_bytes: Option<usize>,
        draft_page_size: Option<usize>,
        draft_fp8: bool,
        draft_fp8_head: bool,
        draft_vocab: Option<DraftVocabArg>,
        draft_vocab_corpus: Option<PathBuf>,
        one_sync_rounds: bool,
        tokenizer: Option<PathBuf>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let invalid = |m: &str| new_err(py, Kind::InvalidInput, m, &[]);
        if (draft_fp8 || draft_fp8_head) && draft.is_none() {
            return Err(invalid("draft_fp8 and draft_fp8_head need a draft"));
        }
        if draft_fp8_head && !draft_fp8 {
            return Err(invalid("draft_fp8_head needs draft_fp8"));
        }
        if draft_vocab.is_some() && draft.is_none() {
            return Err(invalid("draft_vocab needs a draft"));
        }
        if draft_vocab_corpus.is_some() && !matches!(draft_vocab, Some(DraftVocabArg::Size(_))) {
            return Err(invalid("draft_vocab_corpus needs draft_vocab as a number of tokens"));
        }
        let device: DeviceKind = device.parse().map_err(|e| Failure::from(e).into_py(py))?;
        let dtype: ComputeDtype = dtype.parse().map_err(|e| Failure::from(e).into_py(py))?;
        let verify = match (verify_width, confidence_threshold) {
            (Some(_), Some(_)) => return Err(invalid("give verify_width or confidence_threshold, not both")),
            (Some(_), _) | (_, Some(_)) if draft.is_none() => {
                return Err(invalid("verify_width and confidence_threshold need a draft"));
            }
            (Some(w), None) => VerifyPolicy::Fixed(w),
            (None, Some(t)) => VerifyPolicy::Threshold(t),
            (None, None) => VerifyPolicy::Full,
        };
        let defaults = EngineConfig::default();
        let config = EngineConfig {
            kv_budget_bytes: kv_budget_bytes.unwrap_or(defaults.kv_budget_bytes),
            page_size: page_size.unwrap_or(defaults.page_size),
            verify,
            one_sync_rounds,
            ..defaults
        };
        let draft_defaults = DraftCacheConfig::default();
        let draft_cache = DraftCacheConfig {
            kv_budget_bytes: draft_kv_budget_bytes.unwrap_or(draft_defaults.kv_budget_bytes),
            page_size: draft_page_size.unwrap_or(draft_defaults.page_size),
        };
        let report = |done: u64, total: u64| {
            if let Some(callback) = &progress {
                Python::attach(|py| {
                    if let Err(e) = callback.call1(py, (done, total)) {
                        e.write_unraisable(py, Some(callback.bind(py)));
                    }
                });
            }
        };
        let options = LoadOptions { device, dtype, progress: Some(&report) };
        let tokenizer_dir = tokenizer.clone().unwrap_or_else(|| target.clone());
        run(py, || {
            let tok = match &tokenizer {
                Some(dir) => Some(Tokenizer::from_dir(dir)?),
                None if target.join("tokenizer.json").exists() => Some(Tokenizer::from_dir(&target)?),
                None => None,
            };
            let model = Qwen3::load(&target, options)?;
            let engine = match &draft {
                None => dspark::Engine::new(model, &config)?,
                Some(dir) => {
                    let mut d = if draft_fp8 {
                        let fp8 = dspark::model::fp8::DraftQuant::Fp8PerChannel;
                        DSparkDraft::load_quantized(dir, &model, options, &draft_cache, fp8)?
                    } else {
                        DSparkDraft::load(dir, &model, options, &draft_cache)?
                    };
                    if draft_fp8_head {
                        d.quantize_lm_head()?;
                    }
                    if let Some(arg) = &draft_vocab {
                        let v = model.config().vocab_size;
                        let vocab = match (arg, &draft_vocab_corpus, &tok) {
                            (DraftVocabArg::Ids(ids), _, _) => {
                                dspark::DraftVocab::new(ids.iter().copied(), v)?
                            }
                            (DraftVocabArg::Size(k), None, _) => dspark::DraftVocab::leading(*k, v)?,
                            (DraftVocabArg::Size(k), Some(corpus), Some(t)) => {
                                dspark::DraftVocab::most_frequent(&t.corpus_counts(corpus, v)?.0, *k)?
                            }
                            (DraftVocabArg::Size(_), Some(_), None) => {
                                return Err(dspark::Error::InvalidInput(
                                    "draft_vocab_corpus needs the target's tokenizer".into(),
                                )
                                .into());
                            }
                        };
                        d.restrict_vocab(vocab)?;
                    }
                    dspark::Engine::with_draft(model, Box::new(d), &config)?
                }
            };
            let mut eos = engine.target().config().eos_ids();
            for &t in tok.as_ref().map(Tokenizer::eos_token_ids).unwrap_or_default() {
                if !eos.contains(&t) {
                    eos.push(t);
                }
            }
            Ok(Self {
                vocab: engine.target().vocab_size(),
                speculative: engine.is_speculative(),
                inner: Arc::new(Mutex::new(engine)),
                tokenizer: tok,
                tokenizer_dir,
                eos,
                device,
                dtype,
                served: Mutex::new(HashMap::new()),
            })
        })
    }

    /// Generate continuations.
    ///
    /// Args:
    ///     prompts: one prompt or a list of prompts, generated together. A prompt is a str
    ///         (tokenized without special tokens), a list of token ids, or a list of chat
    ///         messages `{"role": ..., "content": ...}` (rendered with the checkpoint's chat
    ///         template and the assistant's header). Text needs a tokenizer.
    ///     params: one `SamplingParams` for every prompt, a list with one per prompt, or `None`
    ///         for the defaults.
    ///     enable_thinking: for chat prompts, Qwen3's thinking switch (`False` renders the empty
    ///         think block); left to the template when `None`.
    ///
    /// Returns:
    ///     A `Generation` for one prompt, a list of them (in order) for a list.
    ///
    /// Raises:
    ///     InvalidInputError: an empty prompt, text without a tokenizer, mismatched params.
    ///     TokenOutOfRangeError: a token id outside the vocabulary.
    ///     InvalidSamplingError: out-of-range sampling parameters.
    ///     KvCacheFullError: a request could never fit the KV budget, even alone (requests that
    ///         fit alone but not together wait for room).
    ///     TextError: tokenization or the chat template failed.
    #[pyo3(signature = (prompts, params=None, *, enable_thinking=None))]
    fn generate(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        enable_thinking: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let (requests, single) = self.requests(py, prompts, params, enable_thinking)?;
        let results = run(py, || {
            let out = lock(&self.inner)?.generate(&requests)?;
            requests.iter().zip(out).map(|(r, g)| generation(self.tokenizer.as_ref(), r, g)).collect()
        })?;
        one_or_many(py, results, single)
    }

    /// Generate as `generate` does, yielding tokens as they are committed.
    ///
    /// Generation runs on a background thread; iterating waits (with the GIL released) for the
    /// next `StreamChunk`. After the last chunk, `TokenStream.results` holds the `Generation`s.
    /// Errors of the generation itself are raised by the iteration. Dropping or closing the
    /// stream early is safe: the engine finishes the call in the background (its lock is held
    /// until then).
    ///
    /// Args:
    ///     prompts: as for `generate`.
    ///     params: as for `generate`.
    ///     enable_thinking: as for `generate`.
    ///
    /// Raises:
    ///     InvalidInputError, TextError, TokenOutOfRangeError: when the prompts cannot be
    ///         prepared (at once; later errors come from the iteration).
    #[pyo3(signature = (prompts, params=None, *, enable_thinking=None))]
    fn stream(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        enable_thinking: Option<bool>,
    ) -> PyResult<TokenStream> {
        let (requests, _) = self.requests(py, prompts, params, enable_thinking)?;
        TokenStream::start(self.inner.clone(), self.tokenizer.clone(), requests)
            .map_err(|e| new_err(py, Kind::Internal, format!("cannot start the stream thread: {e}"), &[]))
    }

    /// Log-probability of every token after the first, given the tokens before it (raw target
    /// distribution: temperature 1, no filtering).
    ///
    /// Args:
    ///     tokens: token ids, or a str (tokenized without special tokens; needs a tokenizer).
    ///
    /// Returns:
    ///     `len(tokens) - 1` floats.
    ///
    /// Raises:
    ///     InvalidInputError: fewer than two tokens.
    ///     TokenOutOfRangeError: a token id outside the vocabulary.
    ///     KvCacheFullError: the sequence does not fit the KV budget.
    fn score(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
        let prompt = match parse_prompt(tokens, self.vocab)? {
            Prompt::Chat(_) => {
                return Err(new_err(py, Kind::InvalidInput, "score takes token ids or a str", &[]));
            }
            p => p,
        };
        run(py, || {
            let ids = self.prompt_ids(prompt, None)?;
            Ok(lock(&self.inner)?.score(&ids)?)
        })
    }

    /// Queue one request for the serving calls; it starts at a later `step` when it fits the KV
    /// budgets. Returns its id.
    ///
    /// Args:
    ///     prompt: one prompt, as for `generate`.
    ///     params: a `SamplingParams`, or `None` for the defaults.
    ///     enable_thinking: as for `generate`.
    ///
    /// Raises:
    ///     InvalidInputError, TokenOutOfRangeError, InvalidSamplingError, TextError: as for
    ///         `generate`.
    ///     KvCacheFullError: the request could never fit the KV budget, even alone.
    #[pyo3(signature = (prompt, params=None, *, enable_thinking=None))]
    fn submit(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        enable_thinking: Option<bool>,
    ) -> PyResult<u64> {
        let (mut requests, single) = self.requests(py, prompt, params, enable_thinking)?;
        if !single || requests.len() != 1 {
            return Err(new_err(py, Kind::InvalidInput, "submit takes one prompt", &[]));
        }
        let request = requests.remove(0);
        run(py, || {
            let id = lock(&self.inner)?.submit(request.clone())?;
            let decoder = self.tokenizer.as_ref().map(|t| t.stream_decoder(true));
            lock(&self.served)?.insert(id, Served { request, decoder });
            Ok(id)
        })
    }

    /// One serving step: admit queued requests that fit the KV budgets, then run one round (a
    /// decode step, or draft → verify → accept) over every running request. Requests join and
    /// leave between steps; under KV pressure the engine preempts and later resumes requests
    /// without changing their output.
    ///
    /// Returns:
    ///     `(chunks, finished)`: the `StreamChunk`s of this step (their `request` is the id from
    ///     `submit`), and `(id, Generation)` for every request that finished in it.
    ///
    /// Raises:
    ///     BackendError: a device failure; every unfinished request is then dropped.
    fn step(&self, py: Python<'_>) -> PyResult<StepResult> {
        run(py, || {
            let out = lock(&self.inner)?.step()?;
            let mut served = lock(&self.served)?;
            let mut chunks = Vec::with_capacity(out.events.len());
            for ev in out.events {
                let Some(s) = served.get_mut(&ev.id) else { continue };
                let text = match s.decoder.as_mut() {
                    Some(d) => {
                        let mut text = d.extend(&ev.tokens)?;
                        if ev.finish.is_some() {
                            text.extend(d.flush()?);
                        }
                        Some(text)
                    }
                    None => None,
                };
                let (finish_reason, stop_token_id) = finish_fields(ev.finish);
                chunks.push(StreamChunk {
                    request: ev.id as usize,
                    token_ids: ev.tokens,
                    text,
                    finish_reason,
                    stop_token_id,
                });
            }
            let mut finished = Vec::with_capacity(out.finished.len());
            for (id, g) in out.finished {
                if let Some(s) = served.remove(&id) {
                    finished.push((id, generation(self.tokenizer.as_ref(), &s.request, g)?));
                }
            }
            Ok((chunks, finished))
        })
    }

    /// Stop a submitted request now, freeing its KV at once.
    ///
    /// Returns:
    ///     Its `Generation` so far, with `finish_reason` `"cancelled"`.
    ///
    /// Raises:
    ///     InvalidInputError: no unfinished submitted request has this id.
    fn cancel(&self, py: Python<'_>, id: u64) -> PyResult<Generation> {
        run(py, || {
            let g = lock(&self.inner)?.cancel(id)?;
            let s = lock(&self.served)?.remove(&id);
            match s {
                Some(s) => generation(self.tokenizer.as_ref(), &s.request, g),
                None => Err(Error::InvalidInput(format!("request {id} was not submitted here")).into()),
            }
        })
    }

    /// Requests running now (holding KV), and waiting for admission: `(running, waiting)`.
    fn pending(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        run(py, || {
            let e = lock(&self.inner)?;
            Ok((e.num_running(), e.num_waiting()))
        })
    }

    /// Token ids of `text` (no special tokens added; special tokens written in the text, such
    /// as `<|im_start|>`, become their ids).
    ///
    /// Raises:
    ///     InvalidInputError: the engine has no tokenizer.
    ///     TextError: encoding failed.
    fn encode(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        run(py, || Ok(self.tokenizer()?.encode(text, false)?))
    }

    /// Text of `token_ids`, leaving out special tokens when `skip_special_tokens`.
    ///
    /// Raises:
    ///     InvalidInputError: the engine has no tokenizer.
    ///     TextError: an id is not in the tokenizer's vocabulary, or decoding failed.
    #[pyo3(signature = (token_ids, skip_special_tokens=true))]
    fn decode(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        skip_special_tokens: bool,
    ) -> PyResult<String> {
        let ids = self::token_ids(token_ids, self.vocab)?;
        run(py, || Ok(self.tokenizer()?.decode(&ids, skip_special_tokens)?))
    }

    /// Render a conversation with the checkpoint's chat template, as
    /// `apply_chat_template(messages, tokenize=False, ...)` in `transformers`.
    ///
    /// Args:
    ///     messages: `[{"role": ..., "content": ...}, ...]`.
    ///     add_generation_prompt: append the header that opens the assistant's turn.
    ///     enable_thinking: Qwen3's thinking switch; left undefined when `None`.
    ///
    /// Raises:
    ///     InvalidInputError: the engine has no tokenizer, or a message is malformed.
    ///     TextError: the folder has no chat template, or rendering failed.
    #[pyo3(signature = (messages, add_generation_prompt=true, enable_thinking=None))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> PyResult<String> {
        let messages: Vec<ChatMessage> = self::messages(messages)?;
        let opts = ChatOptions { add_generation_prompt, enable_thinking };
        run(py, || Ok(self.tokenizer()?.apply_chat_template(&messages, &opts)?))
    }

    /// Whether this engine speculates (was given a draft).
    #[getter]
    fn is_speculative(&self) -> bool {
        self.speculative
    }

    /// The target's vocabulary size (rows of its embedding).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The device, as `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
    }

    /// The compute dtype, as `"f32"`, `"bf16"` or `"f16"`.
    #[getter]
    fn dtype(&self) -> String {
        self.dtype.to_string()
    }

    /// Whether a tokenizer is loaded (text and chat prompts, `text` in results).
    #[getter]
    fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// The checkpoint's end-of-sequence ids (`config.json`, then the tokenizer's
    /// `eos_token` and `generation_config.json`), which end generation unless
    /// `SamplingParams.ignore_eos`.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// Statistics of the last `generate` (or finished `stream`) call.
    #[getter]
    fn last_stats(&self, py: Python<'_>) -> PyResult<BatchStats> {
        run(py, || Ok(BatchStats::from(lock(&self.inner)?.last_stats())))
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(device={:?}, dtype={:?}, speculative={}, vocab_size={}, tokenizer={})",
            self.device.to_string(),
            self.dtype.to_string(),
            if self.speculative { "True" } else { "False" },
            self.vocab,
            if self.tokenizer.is_some() {
                format!("{:?}", self.tokenizer_dir.display().to_string())
            } else {
                "None".into()
            }
        )
    }
}
