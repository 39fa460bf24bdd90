//! Qwen3 target configuration (`config.json`), deserialized verbatim and validated once.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

/// One id or a list of ids, as `eos_token_id` appears in Hugging Face configs.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// `rope_parameters` as transformers 5 writes it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct RopeParameters {
    /// RoPE base.
    pub rope_theta: Option<f64>,
    /// RoPE variant; only `default` is supported.
    pub rope_type: Option<String>,
}

/// `config.json` of a Hugging Face Qwen3 checkpoint. Keys keep their checkpoint names.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3Config {
    /// Vocabulary size (rows of the embedding and LM head).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA).
    pub num_key_value_heads: usize,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base at the top level (hub configs, SpecForge exports).
    pub rope_theta: Option<f64>,
    /// RoPE parameters (transformers 5 style).
    pub rope_parameters: Option<RopeParameters>,
    /// Legacy RoPE scaling; only `null` is supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Largest position the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Whether q/k/v/o projections carry biases (never for Qwen3).
    #[serde(default)]
    pub attention_bias: bool,
    /// MLP activation; only `silu` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Sliding-window attention switch; only `false` is supported.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence id(s).
    pub eos_token_id: Option<TokenIds>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    40960
}
fn default_act() -> String {
    "silu".to_owned()
}

impl Qwen3Config {
    /// Read and validate `config.json` from a checkpoint folder.
    ///
    /// # Errors
    /// [`Error::Io`] when the file is missing, [`Error::Json`] when it does not parse,
    /// [`Error::Config`] when values are inconsistent or unsupported.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let config: Self = read_json(&path)?;
        config.validate(&path)?;
        Ok(config)
    }

    /// Check every value once, at load.
    ///
    /// # Errors
    /// [`Error::Config`] naming `path` and the offending key.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |message: String| Error::Config { path: path.to_path_buf(), message };
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(bad(format!("{name} must be positive")));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(bad(
                "hidden_size is not divisible by num_attention_heads and head_dim is absent".into()
            ));
        }
        let head_dim = self.head_dim();
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {head_dim} must be positive and even")));
        }
        let theta = self.rope_theta_value().ok_or_else(|| {
            bad("rope_theta is missing (looked at the top level and in rope_parameters)".into())
        })?;
        if !(theta.is_finite() && theta > 1.0) {
            return Err(bad(format!("rope_theta {theta} must be a finite number > 1")));
        }
        if let Some(kind) = self.rope_parameters.as_ref().and_then(|p| p.rope_type.as_deref())
            && kind != "default"
        {
            return Err(bad(format!("rope_type {kind:?} is not supported (only \"default\")")));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad("rope_scaling is not supported (must be null)".into()));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(format!("rms_norm_eps {} must be positive", self.rms_norm_eps)));
        }
        if self.attention_bias {
            return Err(bad("attention_bias = true is not supported for Qwen3".into()));
        }
        if self.hidden_act != "silu" {
            return Err(bad(format!("hidden_act {:?} is not supported (only silu)", self.hidden_act)));
        }
        if self.use_sliding_window {
            return Err(bad("use_sliding_window = true is not supported".into()));
        }
        if u32::try_from(self.vocab_size).is_err() {
            return Err(bad("vocab_size does not fit in u32".into()));
        }
        Ok(())
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// RoPE base: top-level `rope_theta`, else `rope_parameters.rope_theta`.
    pub fn rope_theta_value(&self) -> Option<f64> {
        self.rope_theta.or_else(|| self.rope_parameters.as_ref().and_then(|p| p.rope_theta))
    }

    /// End-of-sequence ids declared by the config (may be empty).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default()
    }
}

/// Read a JSON file into `T`, with errors naming the file.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &PathBuf) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path: path.clone(), source })
}
