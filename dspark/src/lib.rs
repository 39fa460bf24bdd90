//! # dspark
//!
//! Lossless speculative decoding for Qwen3 models with DSpark block drafts, on burn.
//!
//! This crate holds the models, the paged KV cache, sampling and the generation engine. The
//! target-only [`Engine`] is the baseline every speculative comparison is measured against.
//!
//! ```no_run
//! use dspark::{Engine, EngineConfig, LoadOptions, Request, SamplingParams};
//! # fn main() -> dspark::Result<()> {
//! let mut engine = Engine::load("path/to/Qwen3".as_ref(), LoadOptions::default(), &EngineConfig::default())?;
//! let out = engine.generate(&[Request { prompt: vec![9707, 11, 1879], params: SamplingParams::greedy(16) }])?;
//! println!("{:?}", out[0].tokens);
//! # Ok(())
//! # }
//! ```

pub mod accept;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod kv_cache;
pub mod model;
pub mod sampling;
pub mod speculator;
pub mod text;
pub mod weights;

pub use config::Qwen3Config;
pub use device::{ComputeDtype, DeviceKind};
pub use engine::{
    BatchStats, Engine, EngineConfig, FinishReason, Generation, GenerationStats, Request, RequestId,
    RoundRecord, StepEvent, StepOutput, TokenEvent, VerifyPolicy,
};
pub use error::{Error, Result};
pub use kv_cache::{KvCache, KvLayout, PagedKvCache, PoolState, SeqId};
pub use model::{
    DSparkConfig, DSparkDraft, DeviceTokens, DraftCacheConfig, DraftVocab, ForwardOutput, LoadOptions,
    LogitRows, Qwen3, SeqChunk, TargetBinding,
};
pub use sampling::SamplingParams;

/// Record forwards as CUDA graphs and replay them (on by default; CUDA only): target steps and
/// verify windows of up to 64 rows, greedy draft rounds and draft context extensions. Off, every
/// forward runs op by op. Outputs are the same bits either way; graphs cut the host's launch
/// cost (a Qwen3-8B step from 10.5 to 6.1 ms on an H200) and keep up to 16 recorded shapes per
/// model, each holding tens of MiB of device memory. Process-wide; takes effect at the next
/// forward.
pub fn set_graphs_enabled(enabled: bool) {
    dspark_kernels::set_graphs_enabled(enabled);
}

/// Whether forwards are recorded as graphs (see [`set_graphs_enabled`]).
pub fn graphs_enabled() -> bool {
    dspark_kernels::graph::graphs_enabled()
}
pub use speculator::{DeferredProposals, DeviceQ, Proposal, ProposeLane, Speculator};
