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

/// Largest differences of the draft's block forward over every `draft_block` case and both
/// layouts, each relative to the golden tensor's largest absolute value; `tokens_equal` says
/// whether every greedy draft token matched.
#[derive(Debug, Default, Clone, Copy)]
pub struct DraftDiffs {
    pub context_rel: f32,
    pub hidden_rel: f32,
    pub base_rel: f32,
    pub corrected_rel: f32,
    pub confidence_abs: f32,
    pub cases: usize,
    pub tokens_equal: bool,
}

pub fn draft_block_diffs(device: DeviceKind, dtype: ComputeDtype) -> DraftDiffs {
    use burn::tensor::{Tensor, TensorData};
    use dspark::{DSparkDraft, DraftCacheConfig, Speculator};

    let target = target_on(device, dtype, false);
    let options = LoadOptions { device, dtype, progress: None };
    let rel = |a: &[f32], b: &[f32]| max_abs_diff(a, b) / b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let host = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let mut diffs = DraftDiffs { tokens_equal: true, ..DraftDiffs::default() };
    for layout in ["tiny-dspark", "tiny-dspark-specforge"] {
        let mut d = DSparkDraft::load(&golden().join(layout), &target, options, &DraftCacheConfig::default())
            .unwrap();
        for case in cases_of("draft_block") {
            let features =
                expected(&serde_json::json!({"from": case["context"]["from"], "tensor": "features"}));
            let rows = features.len() / 128;
            let features = Tensor::<2>::from_data(TensorData::new(features, [rows, 128]), target.device())
                .cast(dtype.dtype());
            let c = host(d.context_projection(features.clone()));
            diffs.context_rel =
                diffs.context_rel.max(rel(&c, &tensor(&case["expected"]["context_projection"]).0));
            let seq = d.begin();
            d.extend_context(seq, features).unwrap();
            let anchor = case["anchor"].as_u64().unwrap() as u32;
            let (hidden, base) = d.block_forward(&[(seq, anchor)]).unwrap();
            let (hidden, base) = (host(hidden), host(base));
            diffs.hidden_rel =
                diffs.hidden_rel.max(rel(&hidden, &tensor(&case["expected"]["block_hidden"]).0));
            diffs.base_rel = diffs.base_rel.max(rel(&base, &tensor(&case["expected"]["base_logits"]).0));
            let pass = d.markov_pass(anchor, &hidden, &base, &SamplingParams::greedy(1), rows);
            diffs.tokens_equal &= pass.tokens == ids(&case["expected"]["draft_tokens"]);
            let corrected: Vec<f32> = pass.corrected.iter().flatten().map(|&x| x as f32).collect();
            diffs.corrected_rel =
                diffs.corrected_rel.max(rel(&corrected, &tensor(&case["expected"]["corrected_logits"]).0));
            let sig: Vec<f32> =
                pass.confidence_logits.iter().map(|&x| (1.0 / (1.0 + (-x).exp())) as f32).collect();
            diffs.confidence_abs =
                diffs.confidence_abs.max(max_abs_diff(&sig, &tensor(&case["expected"]["confidence"]).0));
            diffs.cases += 1;
            d.end(seq).unwrap();
        }
    }
    diffs
}
