//! Golden checks of the target, parametrised by device and dtype so the CPU suite and the GPU
//! suite run the same comparisons.

use dspark::{
    ComputeDtype, DeviceKind, Engine, EngineConfig, KvCache, LoadOptions, LogitRows, PagedKvCache, Qwen3,
    Request, SamplingParams, SeqChunk,
};

use super::*;

pub fn target_on(device: DeviceKind, dtype: ComputeDtype, sharded: bool) -> Qwen3 {
    let dir = golden().join(if sharded { "tiny-qwen3-sharded" } else { "tiny-qwen3" });
    Qwen3::load(&dir, LoadOptions { device, dtype, progress: None }).unwrap()
}

/// Largest differences over all prefill cases, each relative to the golden tensor's largest
/// absolute value (logits, draft features, hidden states of layers 1..N-1).
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefillDiffs {
    pub logits_abs: f32,
    pub logits_rel: f32,
    pub features_rel: f32,
    pub hidden_rel: f32,
}

/// Run every `target_prefill` case and return the largest differences.
pub fn prefill_diffs(device: DeviceKind, dtype: ComputeDtype) -> PrefillDiffs {
    let model = target_on(device, dtype, false);
    let layer_ids: Vec<usize> = serde_json::from_value(set()["draft"]["target_layer_ids"].clone()).unwrap();
    assert_eq!(layer_ids, vec![1, 3]);
    let n_layers = model.config().num_hidden_layers;
    let h = model.config().hidden_size;
    let mut diffs = PrefillDiffs::default();
    let rel = |a: &[f32], b: &[f32]| max_abs_diff(a, b) / b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for case in cases_of("target_prefill") {
        let tokens = ids(&case["input_ids"]);
        let t = tokens.len();
        let mut cache = PagedKvCache::new(model.kv_layout(16), 8 << 20, model.device()).unwrap();
        let seq = cache.allocate();
        // Capture the draft's layers, then every layer (to localise a bug to one layer).
        let mut capture = layer_ids.clone();
        capture.extend(0..n_layers);
        let out = model
            .forward(&[SeqChunk { seq, tokens: &tokens, logits: LogitRows::All }], &capture, &mut cache)
            .unwrap();
        let logits = out.logits.unwrap().into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let features = out.features.unwrap().into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let width = capture.len() * h;
        let (exp_logits, shape) = tensor(&case["expected"]["logits"]);
        assert_eq!(shape, vec![t, 512]);
        diffs.logits_abs = diffs.logits_abs.max(max_abs_diff(&logits, &exp_logits));
        diffs.logits_rel = diffs.logits_rel.max(rel(&logits, &exp_logits));
        let block = |slot: usize| -> Vec<f32> {
            (0..t).flat_map(|r| features[r * width + slot * h..r * width + (slot + 1) * h].to_vec()).collect()
        };
        let (exp_features, _) = tensor(&case["expected"]["features"]);
        let ours: Vec<f32> = (0..t).flat_map(|r| features[r * width..r * width + 2 * h].to_vec()).collect();
        diffs.features_rel = diffs.features_rel.max(rel(&ours, &exp_features));
        // hidden_states[l + 1] for l < N - 1 (the last entry is post-norm in HF).
        let (hidden, hshape) = tensor(&case["expected"]["hidden_states"]);
        assert_eq!(hshape, vec![n_layers + 1, t, h]);
        for l in 0..n_layers - 1 {
            let expected = &hidden[(l + 1) * t * h..(l + 2) * t * h];
            diffs.hidden_rel = diffs.hidden_rel.max(rel(&block(2 + l), expected));
        }
    }
    diffs
}

/// Greedy generation of every `target_greedy` prompt: for each, the index of the first token
/// that differs from the golden tokens (`None` when all 24 agree).
pub fn greedy_divergence(device: DeviceKind, dtype: ComputeDtype, sharded: bool) -> Vec<Option<usize>> {
    let mut engine = Engine::new(target_on(device, dtype, sharded), &EngineConfig::default()).unwrap();
    let mut result = Vec::new();
    for case in cases_of("target_greedy") {
        let prompt = ids(&case["input_ids"]);
        let expected = ids(&case["expected"]["tokens"]);
        let out =
            engine.generate(&[Request { prompt, params: SamplingParams::greedy(expected.len()) }]).unwrap();
        assert_eq!(out[0].tokens.len(), expected.len());
        result.push(out[0].tokens.iter().zip(&expected).position(|(a, b)| a != b));
    }
    assert_eq!(engine.cache().bytes_used(), 0, "every sequence is freed");
    result
}
