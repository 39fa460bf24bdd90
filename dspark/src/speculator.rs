//! The draft side of speculative decoding, as the engine sees it.

use burn::tensor::Tensor;

use crate::error::Result;
use crate::kv_cache::{PoolState, SeqId};
use crate::sampling::SamplingParams;

/// One lane asking for a proposal.
#[derive(Debug, Clone, Copy)]
pub struct ProposeLane<'a> {
    /// The lane's draft sequence; its context length is the committed length `L`.
    pub seq: SeqId,
    /// The last committed token (not yet in any cache), at position `L`.
    pub anchor: u32,
    /// The request's sampling settings (temperature and seed drive the draft's own sampling).
    pub params: &'a SamplingParams,
}

/// γ proposed tokens for one lane.
#[derive(Debug, Clone)]
pub struct Proposal {
    /// Draft tokens for positions `L+1 ..= L+γ`.
    pub tokens: Vec<u32>,
    /// When sampling: the distribution each token was drawn from (full vocabulary).
    pub q: Option<Vec<Vec<f64>>>,
    /// Per-position acceptance estimates in `[0, 1]`, when the draft has a confidence head.
    pub confidence: Option<Vec<f32>>,
    /// When sampling, in place of `q` (see [`Speculator::set_q_on_device`]): the device rows
    /// each token was drawn from, as `softmax(row / T)` over the whole vocabulary.
    pub q_rows: Option<DeviceQ>,
}

/// A lane's proposal rows left on the device: token `k` was drawn from
/// `softmax(rows[first + k] / T)` (f32 `[·, V]` rows, usually shared by every lane of a round).
#[derive(Debug, Clone)]
pub struct DeviceQ {
    /// The rows of the round.
    pub rows: Tensor<2>,
    /// The lane's first row.
    pub first: usize,
}

/// A round's proposals still on the device (see [`Speculator::propose_deferred`]): the engine
/// hands [`DeferredProposals::tokens`] to the verify forward on the device and reads
/// [`DeferredProposals::readback`] back together with the verify's result, so a round waits
/// on the device once.
pub struct DeferredProposals {
    /// f32 `[lanes · γ, 1]`: lane `i`'s draft `k` at row `i · γ + k` (exact integers).
    pub tokens: Tensor<2>,
    /// f32 `[1, len]`: what [`Speculator::finish_deferred`] needs back on the host.
    pub readback: Tensor<2>,
    /// When a lane samples: the round's proposal rows `[lanes · γ, V]` (f32), lane `i`'s draft
    /// `k` drawn from `softmax(row[i · γ + k] / T)` (what its [`Proposal::q_rows`] will hold).
    pub q_rows: Option<Tensor<2>>,
    /// The draft's own bookkeeping between the two calls.
    pub state: Box<dyn std::any::Any>,
}

impl std::fmt::Debug for DeferredProposals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredProposals")
            .field("tokens", &self.tokens.dims())
            .field("readback", &self.readback.dims())
            .finish_non_exhaustive()
    }
}

/// A draft model that proposes blocks of tokens from the target's hidden features.
pub trait Speculator {
    /// γ, the tokens proposed per round.
    fn block_size(&self) -> usize;

    /// Target layers whose residual outputs the draft reads, in order.
    fn feature_layers(&self) -> &[usize];

    /// Whether proposals carry confidences.
    fn has_confidence(&self) -> bool;

    /// Start an empty draft sequence.
    fn begin(&mut self) -> SeqId;

    /// Committed length of a draft sequence.
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`].
    fn context_len(&self, seq: SeqId) -> Result<usize>;

    /// Append the target features of newly committed rows to a sequence's context.
    ///
    /// # Shapes
    /// `features`: `[rows, feature_layers().len() · hidden]`.
    ///
    /// # Errors
    /// [`crate::Error::KvCacheFull`], [`crate::Error::UnknownSequence`].
    fn extend_context(&mut self, seq: SeqId, features: Tensor<2>) -> Result<()>;

    /// [`Speculator::extend_context`] for several lanes at once (each sequence once). The
    /// default extends them one by one; a draft that can do them in one pass overrides it.
    ///
    /// # Errors
    /// As [`Speculator::extend_context`].
    fn extend_contexts(&mut self, items: &[(SeqId, Tensor<2>)]) -> Result<()> {
        for (seq, features) in items {
            self.extend_context(*seq, features.clone())?;
        }
        Ok(())
    }

    /// Hand sampling proposals' distributions out as device rows ([`Proposal::q_rows`], with
    /// `q` left `None`) instead of host rows, where the draft samples on the device: the engine
    /// asks for it when it can verify there (`dspark_kernels::chain_accept`), which saves
    /// reading γ vocabulary rows back per lane and making them on the host. Off by default; a
    /// draft that cannot keeps host rows.
    fn set_q_on_device(&mut self, on: bool) {
        let _ = on;
    }

    /// Propose γ tokens for every lane, in one batched pass.
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`] or backend failures.
    fn propose(&mut self, lanes: &[ProposeLane<'_>]) -> Result<Vec<Proposal>>;

    /// [`Speculator::propose`] without waiting for the device: the round is queued, and its
    /// tokens stay on the device for a verify forward queued behind it. `Ok(None)` where the
    /// draft cannot (the default; the engine then calls [`Speculator::propose`]). Sampling
    /// lanes' distributions stay on the device ([`Proposal::q_rows`]) when deferred.
    ///
    /// # Errors
    /// As [`Speculator::propose`].
    fn propose_deferred(&mut self, lanes: &[ProposeLane<'_>]) -> Result<Option<DeferredProposals>> {
        let _ = lanes;
        Ok(None)
    }

    /// The proposals of a [`Speculator::propose_deferred`] round for the same `lanes`, from
    /// `values`, the host copy of its [`DeferredProposals::readback`].
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] when `deferred` is not this draft's or `values` is short.
    fn finish_deferred(
        &mut self,
        lanes: &[ProposeLane<'_>],
        deferred: DeferredProposals,
        values: &[f32],
    ) -> Result<Vec<Proposal>> {
        let _ = (lanes, deferred, values);
        Err(crate::Error::InvalidInput("this draft does not defer its proposals".into()))
    }

    /// Whether [`Speculator::truncate_context`] works, so the engine may extend a lane's
    /// context by its whole verify window before the verdicts are known and cut the rejected
    /// rows afterwards: the extension then queues on the device behind the verify, ahead of the
    /// round's one read, instead of waiting for the host after it. Off by default.
    fn can_truncate_context(&self) -> bool {
        false
    }

    /// Cut a sequence's context back to its first `len` rows.
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`]; [`crate::Error::InvalidInput`] when `len` exceeds the
    /// context, or the draft cannot (the default; see [`Speculator::can_truncate_context`]).
    fn truncate_context(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let _ = (seq, len);
        Err(crate::Error::InvalidInput("this draft cannot cut its context".into()))
    }

    /// Occupancy of the draft's context cache, for admission control and preemption; `None`
    /// when the draft's context is not bounded by a page pool.
    fn context_pool(&self) -> Option<PoolState> {
        None
    }

    /// Drop a sequence and its context.
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`].
    fn end(&mut self, seq: SeqId) -> Result<()>;
}
