//! Model shapes of the random-weight benchmarks, shared by the bench binaries (`#[path]`).

use dspark::model::{MarkovHeadType, default_target_layer_ids};
use dspark::{DSparkConfig, Qwen3Config};

/// `qwen3-8b` (36 layers, hidden 4096, 32/8 heads of 128, FFN 12288, vocab 151936) or `tiny`.
pub fn qwen3(shape: &str) -> Result<Qwen3Config, String> {
    let (v, h, i, l, heads, kv, hd) = match shape {
        "tiny" => (512, 64, 128, 6, 4, 2, 16),
        "qwen3-8b" => (151_936, 4096, 12_288, 36, 32, 8, 128),
        other => return Err(format!("unknown shape {other:?} (qwen3-8b or tiny)")),
    };
    serde_json::from_value(serde_json::json!({
        "vocab_size": v, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": l,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 40960,
        "tie_word_embeddings": false
    }))
    .map_err(|e| format!("shape {shape}: {e}"))
}

/// The released DSpark draft shape for Qwen3-8B (5 layers, block 7, features of layers
/// 1, 9, 17, 25, 33, vanilla Markov head of rank 256, confidence head reading it), or a small
/// one (2 layers, block 4) for the tiny target.
pub fn dspark(shape: &str, target: &Qwen3Config) -> DSparkConfig {
    let tiny = shape == "tiny";
    let mut base = target.clone();
    base.num_hidden_layers = if tiny { 2 } else { 5 };
    let depth = target.num_hidden_layers;
    DSparkConfig {
        base,
        block_size: if tiny { 4 } else { 7 },
        target_layer_ids: Some(default_target_layer_ids(depth, if tiny { 2 } else { 5 })),
        mask_token_id: if tiny { 511 } else { 151_669 },
        markov_rank: if tiny { 8 } else { 256 },
        markov_head_type: MarkovHeadType::Vanilla,
        enable_confidence_head: true,
        confidence_head_with_markov: true,
        num_target_layers: Some(depth),
    }
}
