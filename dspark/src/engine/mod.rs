//! The generation engine: target-only (the baseline) and speculative, behind one API.

mod core;
pub mod schedule;
mod speculative;
mod step;

pub(crate) use self::core::read_f32;
pub use self::core::{
    BatchStats, Engine, EngineConfig, FinishReason, Generation, GenerationStats, Request, RequestId,
    RoundRecord, StepEvent, StepOutput, TokenEvent, VerifyPolicy,
};
pub use self::schedule::{CostMeta, CostTable, DraftCost, VerifyCost};
