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

    /// Propose γ tokens for every lane, in one batched pass.
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`] or backend failures.
    fn propose(&mut self, lanes: &[ProposeLane<'_>]) -> Result<Vec<Proposal>>;

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
