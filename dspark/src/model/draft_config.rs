//! DSpark draft configuration: the released layout (draft keys at the top level of
//! `config.json`) and SpecForge's export (draft keys nested under `dflash_config`).

use std::path::Path;

use serde::Deserialize;

use crate::config::{Qwen3Config, read_json};
use crate::error::{Error, Result};

/// Which Markov head turns the parallel block into sequential proposals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MarkovHeadType {
    /// `bias = W2 · W1[prev]`.
    Vanilla,
    /// `bias = W2 · (σ(gate_proj[h; W1[prev]]) ⊙ W1[prev])`.
    Gated,
    /// A GRU-like state over the block: `[state; W1[prev]; h] → gate, candidate, output`.
    Rnn,
}

/// The draft-specific keys, wherever they were found.
#[derive(Debug, Clone, Deserialize, Default)]
struct DraftKeys {
    block_size: Option<usize>,
    target_layer_ids: Option<Vec<i64>>,
    mask_token_id: Option<i64>,
    markov_rank: Option<usize>,
    markov_head_type: Option<String>,
    enable_confidence_head: Option<bool>,
    confidence_head_with_markov: Option<bool>,
    num_target_layers: Option<usize>,
}

impl DraftKeys {
    /// `self` with gaps filled from `other`.
    fn or(self, other: DraftKeys) -> DraftKeys {
        DraftKeys {
            block_size: self.block_size.or(other.block_size),
            target_layer_ids: self.target_layer_ids.or(other.target_layer_ids),
            mask_token_id: self.mask_token_id.or(other.mask_token_id),
            markov_rank: self.markov_rank.or(other.markov_rank),
            markov_head_type: self.markov_head_type.or(other.markov_head_type),
            enable_confidence_head: self.enable_confidence_head.or(other.enable_confidence_head),
            confidence_head_with_markov: self
                .confidence_head_with_markov
                .or(other.confidence_head_with_markov),
            num_target_layers: self.num_target_layers.or(other.num_target_layers),
        }
    }
}

#[derive(Deserialize)]
struct RawDraft {
    #[serde(flatten)]
    top: DraftKeys,
    dflash_config: Option<DraftKeys>,
}

/// A validated DSpark draft configuration.
#[derive(Debug, Clone)]
pub struct DSparkConfig {
    /// The draft layers' shapes (Qwen3 keys of the draft's `config.json`).
    pub base: Qwen3Config,
    /// γ: tokens proposed per round.
    pub block_size: usize,
    /// Target layers whose residual outputs feed the draft, in order; `None` until resolved
    /// against the target (defaulted from the target's depth when absent).
    pub target_layer_ids: Option<Vec<usize>>,
    /// Id of the mask token filling the block after the anchor.
    pub mask_token_id: u32,
    /// Rank r of the Markov head; 0 means no head.
    pub markov_rank: usize,
    /// Markov head variant.
    pub markov_head_type: MarkovHeadType,
    /// Whether a confidence head is present.
    pub enable_confidence_head: bool,
    /// Whether the confidence head also reads `W1[prev]`.
    pub confidence_head_with_markov: bool,
    /// Depth of the target the draft was trained on, when recorded.
    pub num_target_layers: Option<usize>,
}

impl DSparkConfig {
    /// Read `config.json` of a draft folder in either layout.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Json`], or [`Error::Config`] naming the missing or bad key.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let raw: RawDraft = read_json(&path)?;
        let base: Qwen3Config = read_json(&path)?;
        base.validate(&path)?;
        let keys = raw.dflash_config.unwrap_or_default().or(raw.top);
        let bad = |message: String| Error::Config { path: path.clone(), message };
        let block_size = keys.block_size.ok_or_else(|| bad("block_size is missing".into()))?;
        if block_size == 0 {
            return Err(bad("block_size must be positive".into()));
        }
        let mask = keys.mask_token_id.ok_or_else(|| bad("mask_token_id is missing".into()))?;
        let mask_token_id =
            u32::try_from(mask).map_err(|_| bad(format!("mask_token_id {mask} is negative")))?;
        let markov_rank = keys.markov_rank.unwrap_or(0);
        let markov_head_type = match keys.markov_head_type.as_deref().map(str::to_ascii_lowercase).as_deref()
        {
            None | Some("vanilla") => MarkovHeadType::Vanilla,
            Some("gated") => MarkovHeadType::Gated,
            Some("rnn") => MarkovHeadType::Rnn,
            Some(other) => {
                return Err(bad(format!("markov_head_type {other:?} (expected vanilla, gated or rnn)")));
            }
        };
        let enable_confidence_head = keys.enable_confidence_head.unwrap_or(false);
        let confidence_head_with_markov =
            enable_confidence_head && keys.confidence_head_with_markov.unwrap_or(false);
        if confidence_head_with_markov && markov_rank == 0 {
            return Err(bad("confidence_head_with_markov needs a Markov head (markov_rank > 0)".into()));
        }
        let target_layer_ids = match keys.target_layer_ids {
            None => None,
            Some(ids) if ids.is_empty() => return Err(bad("target_layer_ids is empty".into())),
            Some(ids) => Some(
                ids.iter()
                    .map(|&id| {
                        usize::try_from(id).map_err(|_| {
                            bad(format!("target_layer_id {id}: embedding-output features are not supported"))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        Ok(Self {
            base,
            block_size,
            target_layer_ids,
            mask_token_id,
            markov_rank,
            markov_head_type,
            enable_confidence_head,
            confidence_head_with_markov,
            num_target_layers: keys.num_target_layers,
        })
    }
}

/// Default feature layers for `n` ids over a target of `depth` layers:
/// `round(1 + i·(depth − 4)/(n − 1))` (Python rounding, half to even), or `depth / 2` for one.
pub fn default_target_layer_ids(depth: usize, n: usize) -> Vec<usize> {
    if n <= 1 {
        return vec![depth / 2];
    }
    let span = depth as f64 - 4.0;
    (0..n).map(|i| (1.0 + i as f64 * span / (n - 1) as f64).round_ties_even().max(0.0) as usize).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_layer_ids_follow_the_reference_formula() {
        // Qwen3-8B (36 layers), 5 ids: 1 + i·32/4.
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        // half-to-even: 1 + 1·3/2 = 2.5 -> 2.
        assert_eq!(default_target_layer_ids(7, 3), vec![1, 2, 4]);
        assert_eq!(default_target_layer_ids(6, 2), vec![1, 3]);
        assert_eq!(default_target_layer_ids(6, 1), vec![3]);
    }
}
