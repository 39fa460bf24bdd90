//! Models: the Qwen3 target and the pieces it is built from.

mod layer;
mod qwen3;
mod rope;

pub use layer::DecoderLayer;
pub use qwen3::{ForwardOutput, LoadOptions, LogitRows, Qwen3, SeqChunk};
pub use rope::Rope;
