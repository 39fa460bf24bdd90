//! Models: the Qwen3 target and the pieces it is built from.

mod cpu_gemm;
mod draft_config;
mod draft_vocab;
mod dspark_draft;
pub mod fp8;
mod graphs;
mod layer;
mod markov;
mod markov_device;
mod qwen3;
mod rope;

pub use draft_config::{DSparkConfig, MarkovHeadType, default_target_layer_ids};
pub use draft_vocab::DraftVocab;
pub use dspark_draft::{DSparkDraft, DraftCacheConfig, MarkovPass, TargetBinding};
pub use markov::{ConfidenceHead, MarkovHead};

pub use layer::DecoderLayer;
pub(crate) use qwen3::merge_device_tokens;
pub use qwen3::{DeviceTokens, ForwardOutput, LoadOptions, LogitRows, Qwen3, SeqChunk};
pub use rope::Rope;
