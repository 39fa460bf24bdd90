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
    DSparkConfig, DSparkDraft, DraftCacheConfig, ForwardOutput, LoadOptions, LogitRows, Qwen3, SeqChunk,
    TargetBinding,
};
pub use sampling::SamplingParams;
pub use speculator::{Proposal, ProposeLane, Speculator};
