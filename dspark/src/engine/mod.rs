//! The generation engine: target-only (the baseline) and speculative, behind one API.

mod core;
mod speculative;

pub(crate) use self::core::read_f32;
pub use self::core::{
    BatchStats, Engine, EngineConfig, FinishReason, Generation, GenerationStats, Request, RoundRecord,
    TokenEvent, VerifyPolicy,
};
