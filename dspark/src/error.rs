//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong in dspark, as structured variants.
///
/// Errors that concern a file name the file; errors that concern a tensor name the tensor.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is malformed or misses required keys.
    #[error("invalid JSON in {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid config {path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A safetensors file is truncated, corrupt or unreadable.
    #[error("invalid safetensors file {path}: {message}")]
    Safetensors {
        /// The weights file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor the model needs is absent from the checkpoint.
    #[error("tensor {tensor} not found in checkpoint {dir}")]
    MissingTensor {
        /// The checkpoint folder.
        dir: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor has a shape other than the config implies.
    #[error("tensor {tensor} in {path} has shape {actual:?}, config implies {expected:?}")]
    TensorShape {
        /// The file that holds the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape found in the file.
        actual: Vec<usize>,
    },
    /// A tensor has a dtype dspark cannot load.
    #[error("tensor {tensor} in {path} has unsupported dtype {dtype}")]
    TensorDtype {
        /// The file that holds the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype found.
        dtype: String,
    },
    /// A token id is not in the vocabulary.
    #[error("token id {token} is out of range (vocabulary size {vocab})")]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// An input is empty or malformed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Sampling parameters are out of range.
    #[error("invalid sampling parameters: {0}")]
    InvalidSampling(String),
    /// The KV cache budget cannot hold the requested rows.
    #[error(
        "KV cache budget exhausted: need {needed_pages} more page(s) of {page_bytes} bytes, \
         {free_pages} free of {total_pages} (budget {budget_bytes} bytes)"
    )]
    KvCacheFull {
        /// Pages the request needs beyond what is free.
        needed_pages: usize,
        /// Pages free now.
        free_pages: usize,
        /// Pages in the pool.
        total_pages: usize,
        /// Bytes per page (all layers, K and V).
        page_bytes: usize,
        /// The byte budget fixed at construction.
        budget_bytes: usize,
    },
    /// A sequence id is unknown to the cache (never allocated, or freed).
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    /// A device or dtype name is not recognised, or the build lacks its backend.
    #[error("unsupported device or dtype: {0}")]
    Unsupported(String),
    /// Tokenizer or chat template failure.
    #[error(transparent)]
    Text(#[from] crate::text::TextError),
    /// The backend failed while executing or reading back a tensor.
    #[error("backend error: {0}")]
    Backend(String),
}

/// Result alias for dspark.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
