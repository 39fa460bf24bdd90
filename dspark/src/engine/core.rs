//! Engine types and the target-only mode: one target forward per generated token for every
//! live request, batched across requests. It is the baseline every speculative speed and
//! lossless comparison is measured against; the speculative mode is in `speculative.rs`.

use std::path::Path;
use std::time::Duration;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, PagedKvCache, SeqId};
use crate::model::{LoadOptions, LogitRows, Qwen3, SeqChunk};
use crate::sampling::SamplingParams;
use crate::speculator::Speculator;

/// Engine settings fixed at construction.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Bytes of device memory for the target's KV cache.
    pub kv_budget_bytes: usize,
    /// Rows per KV page.
    pub page_size: usize,
    /// How many of the draft's γ tokens each speculative round verifies.
    pub verify: VerifyPolicy,
    /// Most requests decoded together; the others wait in the queue.
    pub max_lanes: usize,
    /// Prompt rows prefilled in one step at most (one request is always admitted when it fits),
    /// which bounds the activations of a prefill.
    pub max_prefill_tokens: usize,
    /// Measured target verify and draft round times, for [`VerifyPolicy::Throughput`].
    pub cost_table: Option<std::sync::Arc<super::schedule::CostTable>>,
    /// Rounds wait on the device once where they can (on by default): when the verify width is
    /// fixed ([`VerifyPolicy::Full`] or [`VerifyPolicy::Fixed`]), every lane is greedy or the
    /// device verifies sampled lanes (CUDA), and the draft queues its round
    /// ([`crate::Speculator::propose_deferred`], a recorded DSpark round), the verify forward is
    /// queued behind the draft round and reads its tokens on the device, sampled lanes' chain
    /// acceptance reads them there too, and drafts, the target's argmax and the verdicts come
    /// back in one read. The output is the same either way; off, the engine reads the drafts
    /// before it verifies them.
    pub one_sync_rounds: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_budget_bytes: 256 << 20,
            page_size: 16,
            verify: VerifyPolicy::Full,
            max_lanes: 256,
            max_prefill_tokens: 8192,
            cost_table: None,
            one_sync_rounds: true,
        }
    }
}

/// How many draft tokens a round sends to verification. The draft always computes its native
/// γ; the choice never depends on the value of a draft it admits, so the output stays exact.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum VerifyPolicy {
    /// All γ drafts (γ + 1 verify rows).
    Full,
    /// A fixed verify width `w ∈ [1, γ + 1]` rows: the anchor and the first `w − 1` drafts.
    Fixed(usize),
    /// The drafts before the first whose confidence is below the threshold (needs a
    /// confidence head; confidence k reads h_k and the draft before it, never draft k itself).
    Threshold(f32),
    /// The throughput scheduler ([`super::schedule`]): each round's total verify rows are
    /// chosen from the [`EngineConfig::cost_table`] and the confidences of the lanes' previous
    /// rounds to maximise expected committed tokens per second, then split across lanes by this
    /// round's survival (earlier position first on ties). Needs a confidence head and a cost
    /// table. Exact: whether draft k is verified never depends on draft k's value. A lane's
    /// verify width depends on the other lanes of its round, so a seeded sampled request is
    /// reproducible for the same batch, and its distribution never depends on the batch.
    Throughput,
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Decoding settings.
    pub params: SamplingParams,
}

/// Why a request stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishReason {
    /// It emitted this stop token (included in the output).
    Stop(u32),
    /// It reached `max_new_tokens`.
    Length,
    /// [`Engine::cancel`] stopped it; the tokens generated so far are kept.
    Cancelled,
}

/// Identifies a request submitted with [`Engine::submit`].
pub type RequestId = u64;

/// Tokens newly committed for one submitted request during a [`Engine::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepEvent {
    /// The request.
    pub id: RequestId,
    /// The new tokens, in order.
    pub tokens: Vec<u32>,
    /// Set on the request's last event.
    pub finish: Option<FinishReason>,
}

/// What one [`Engine::step`] produced.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Newly committed tokens, per request, in commit order.
    pub events: Vec<StepEvent>,
    /// Requests that finished in this step, with their full results.
    pub finished: Vec<(RequestId, Generation)>,
}

/// One speculative round of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundRecord {
    /// Committed length before the round (the anchor's position).
    pub position: usize,
    /// Draft tokens sent to verification.
    pub drafted: Vec<u32>,
    /// How many of them were accepted.
    pub accepted: usize,
}

/// Per-request statistics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Target forward passes after prefill that committed tokens (decode steps, or verify
    /// rounds when speculating).
    pub rounds: usize,
    /// Draft tokens sent to verification.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// τ: tokens committed per round after the first token (1 for target-only).
    pub tau: f64,
    /// Rounds in which draft k (0-based) was verified.
    pub drafted_per_position: Vec<usize>,
    /// Rounds in which draft k (0-based) was accepted.
    pub accepted_per_position: Vec<usize>,
    /// Every speculative round, in order.
    pub round_log: Vec<RoundRecord>,
}

impl GenerationStats {
    pub(crate) fn finish(&mut self, generated: usize) {
        self.generated_tokens = generated;
        self.tau =
            if self.rounds > 0 { generated.saturating_sub(1) as f64 / self.rounds as f64 } else { 0.0 };
    }
}

/// A finished request.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (a stop token included).
    pub tokens: Vec<u32>,
    /// Why it stopped; `None` when `max_new_tokens` was 0.
    pub finish: Option<FinishReason>,
    /// Statistics.
    pub stats: GenerationStats,
}

/// Statistics of one `generate` call over all its requests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchStats {
    /// Target forward passes.
    pub forward_passes: usize,
    /// Draft forward passes.
    pub draft_passes: usize,
    /// Draft tokens sent to verification.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Tokens generated by all requests.
    pub generated_tokens: usize,
    /// Time spent in the prefill forward.
    pub prefill_time: Duration,
    /// Time spent after prefill.
    pub decode_time: Duration,
    /// Of the decode time, speculative rounds only: time in the draft's proposals.
    pub draft_time: Duration,
    /// Of the decode time, speculative rounds only: time in the target's verify forwards,
    /// logits read back included.
    pub verify_time: Duration,
    /// Of the decode time, speculative rounds only: acceptance, commits and the draft's context
    /// update (the rest of a round).
    pub commit_time: Duration,
    /// Speculative rounds that waited on the device once (see [`EngineConfig::one_sync_rounds`]):
    /// their draft time is the time to queue the draft round, and the draft's device time
    /// counts in `verify_time`.
    pub one_sync_rounds: usize,
    /// Requests preempted under KV pressure (their KV freed, later resumed by recomputing it).
    pub preemptions: usize,
    /// Prompt and resumed rows recomputed by prefills.
    pub prefill_tokens: usize,
    /// Most lanes decoded together in one round.
    pub peak_lanes: usize,
}

impl BatchStats {
    /// Generated tokens per second of decode time (prefill excluded).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let secs = self.decode_time.as_secs_f64();
        if secs > 0.0 { self.generated_tokens as f64 / secs } else { 0.0 }
    }
}

/// Tokens newly committed for one request, as they are produced.
#[derive(Debug, Clone, Copy)]
pub struct TokenEvent<'a> {
    /// Index of the request in the call's slice.
    pub request: usize,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Set on the request's last event.
    pub finish: Option<FinishReason>,
}

/// Generation over a Qwen3 target with a paged KV cache, optionally speculating with a draft.
///
/// Two ways to drive it: [`Engine::generate`] runs a batch of requests to completion, and
/// [`Engine::submit`] / [`Engine::step`] / [`Engine::cancel`] serve requests continuously: each
/// step admits waiting requests that fit the KV budgets (prefilling them), then runs one round
/// (a decode step, or draft → verify → accept) over every running request. Requests join and
/// leave between rounds; under KV pressure the most recently admitted requests are preempted
/// (their KV freed) and resumed later by recomputing their context, so nothing admitted is lost.
pub struct Engine {
    pub(super) target: Qwen3,
    pub(super) cache: PagedKvCache,
    pub(super) draft: Option<Box<dyn Speculator + Send>>,
    pub(super) verify: VerifyPolicy,
    pub(super) one_sync_rounds: bool,
    pub(super) cost_table: Option<std::sync::Arc<super::schedule::CostTable>>,
    /// Mean confidence per draft position over the last speculative round's lanes: the prior
    /// of a lane's first round under [`VerifyPolicy::Throughput`].
    pub(super) prior_confidence: Option<Vec<f32>>,
    pub(super) max_lanes: usize,
    pub(super) max_prefill_tokens: usize,
    /// Submitted requests not running: new ones, and preempted ones (at the front).
    pub(super) waiting: std::collections::VecDeque<Waiting>,
    /// Requests holding KV, in admission order.
    pub(super) running: Vec<Live>,
    pub(super) next_id: RequestId,
    pub(super) admissions: u64,
    /// Statistics accumulated by steps since the last [`Engine::take_stats`].
    pub(super) stats: BatchStats,
    pub(super) last_stats: BatchStats,
    /// Events and results of requests not owned by the `generate` call that produced them,
    /// handed out by the next `step`.
    pub(super) parked: StepOutput,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("target", &self.target.config())
            .field("speculative", &self.draft.is_some())
            .field("verify", &self.verify)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

/// A submitted request that holds no KV: not admitted yet, or preempted.
pub(super) struct Waiting {
    pub id: RequestId,
    pub request: Request,
    /// Tokens generated before a preemption (empty for a new request).
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
}

/// A request being generated.
pub(super) struct Live {
    pub id: RequestId,
    pub request: Request,
    pub seq: SeqId,
    /// The draft's sequence, when speculating.
    pub draft_seq: Option<SeqId>,
    /// The last committed token (the next anchor / the next decode input).
    pub next: u32,
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
    /// Admission order: preemption takes the most recent first.
    pub admitted: u64,
    /// Confidences of the lane's previous speculative round.
    pub last_confidence: Option<Vec<f32>>,
}

impl Engine {
    /// An engine around a loaded target, with its KV pool allocated now.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the budget holds no KV page or `max_lanes` is 0.
    pub fn new(target: Qwen3, config: &EngineConfig) -> Result<Self> {
        if config.max_lanes == 0 {
            return Err(Error::InvalidInput("max_lanes must be at least 1".into()));
        }
        let cache =
            PagedKvCache::new(target.kv_layout(config.page_size), config.kv_budget_bytes, target.device())?;
        Ok(Self {
            target,
            cache,
            draft: None,
            verify: config.verify,
            one_sync_rounds: config.one_sync_rounds,
            cost_table: config.cost_table.clone(),
            prior_confidence: None,
            max_lanes: config.max_lanes,
            max_prefill_tokens: config.max_prefill_tokens.max(1),
            waiting: std::collections::VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            admissions: 0,
            stats: BatchStats::default(),
            last_stats: BatchStats::default(),
            parked: StepOutput::default(),
        })
    }

    /// A speculative engine: `draft` proposes, the target verifies; same API as target-only.
    ///
    /// # Errors
    /// As [`Engine::new`], and [`Error::InvalidInput`] when the verify policy does not fit the
    /// draft (a fixed width outside `1..=γ+1`, a threshold without a confidence head, or a
    /// threshold outside `[0, 1]`).
    pub fn with_draft(
        target: Qwen3,
        draft: Box<dyn Speculator + Send>,
        config: &EngineConfig,
    ) -> Result<Self> {
        let gamma = draft.block_size();
        match config.verify {
            VerifyPolicy::Fixed(w) if w == 0 || w > gamma + 1 => {
                return Err(Error::InvalidInput(format!("verify width {w} outside 1..={}", gamma + 1)));
            }
            VerifyPolicy::Threshold(_) if !draft.has_confidence() => {
                return Err(Error::InvalidInput(
                    "a confidence threshold needs a draft with a confidence head".into(),
                ));
            }
            VerifyPolicy::Threshold(t) if !(0.0..=1.0).contains(&t) => {
                return Err(Error::InvalidInput(format!("confidence threshold {t} outside [0, 1]")));
            }
            VerifyPolicy::Throughput if !draft.has_confidence() => {
                return Err(Error::InvalidInput(
                    "the throughput scheduler needs a draft with a confidence head".into(),
                ));
            }
            VerifyPolicy::Throughput if config.cost_table.is_none() => {
                return Err(Error::InvalidInput("the throughput scheduler needs a cost table".into()));
            }
            _ => {}
        }
        let mut draft = draft;
        // Sampled rounds verify on the device where the kernels run: proposals keep their rows
        // there.
        draft.set_q_on_device(super::speculative::verifies_on_device(target.device()));
        let mut engine = Self::new(target, config)?;
        engine.draft = Some(draft);
        Ok(engine)
    }

    /// Whether this engine speculates.
    pub fn is_speculative(&self) -> bool {
        self.draft.is_some()
    }

    /// Load a target checkpoint folder and build the engine.
    ///
    /// # Errors
    /// As [`Qwen3::load`] and [`Engine::new`].
    pub fn load(dir: &Path, options: LoadOptions<'_>, config: &EngineConfig) -> Result<Self> {
        Self::new(Qwen3::load(dir, options)?, config)
    }

    /// The target model.
    pub fn target(&self) -> &Qwen3 {
        &self.target
    }

    /// The target's KV cache.
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// The draft's context pool (pages free and held), for a speculative engine whose draft
    /// keeps one.
    pub fn draft_pool(&self) -> Option<crate::kv_cache::PoolState> {
        self.draft.as_ref().and_then(|d| d.context_pool())
    }

    /// Statistics of the last `generate` call.
    pub fn last_stats(&self) -> &BatchStats {
        &self.last_stats
    }

    /// Log-probability of every token of `tokens` after the first, given the tokens before it
    /// (raw target distribution: temperature 1, no filtering).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for fewer than two tokens, [`Error::TokenOutOfRange`],
    /// [`Error::KvCacheFull`].
    pub fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Err(Error::InvalidInput("score needs at least two tokens".into()));
        }
        self.target.check_tokens(tokens)?;
        let seq = self.cache.allocate();
        let result = self.target.forward(
            &[SeqChunk { seq, tokens: &tokens[..tokens.len() - 1], logits: LogitRows::All }],
            &[],
            &mut self.cache,
        );
        let freed = self.cache.free(seq);
        let logits = result?.logits.ok_or_else(|| Error::Backend("forward returned no logits".into()))?;
        freed?;
        let n = tokens.len() - 1;
        let next: Vec<i64> = tokens[1..].iter().map(|&t| i64::from(t)).collect();
        let index = Tensor::<2, Int>::from_data(TensorData::new(next, [n, 1]), &logits.device());
        read_f32(log_softmax(logits, 1).gather(1, index))
    }
}

/// Copy token ids (any integer dtype) to the host.
pub(crate) fn read_ids(t: Tensor<1, Int>) -> Result<Vec<u32>> {
    let ids = t.into_data().convert::<i64>();
    let ids = ids.try_to_vec::<i64>().map_err(|e| Error::Backend(format!("{e:?}")))?;
    Ok(ids.into_iter().map(|i| i as u32).collect())
}

/// Copy a float tensor to the host as f32.
pub(crate) fn read_f32<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>> {
    t.try_into_vec_as::<f32>().map_err(|e| Error::Backend(format!("{e:?}")))
}
