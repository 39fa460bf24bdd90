//! Shared helpers for the golden-vector tests. Fixtures are copies of the public golden set,
//! committed under `tests/fixtures/golden`.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use serde_json::Value;

pub mod checks;
pub mod fp8_ckpt;
pub mod stats;

/// The golden fixtures; `DSPARK_GOLDEN` overrides the path (for test binaries run elsewhere,
/// e.g. on the GPU machine).
pub fn golden() -> PathBuf {
    std::env::var_os("DSPARK_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden"))
}

/// The shipped trained pair (`models/`); `DSPARK_MODELS` overrides the path.
pub fn models() -> PathBuf {
    std::env::var_os("DSPARK_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

/// The trained pair's target (`models/tiny-code-qwen3`), CPU f32.
pub fn trained_target() -> dspark::Qwen3 {
    dspark::Qwen3::load(&models().join("tiny-code-qwen3"), dspark::LoadOptions::default()).unwrap()
}

/// The trained pair's draft (`models/tiny-code-dspark`) for `target`, CPU f32.
pub fn trained_draft(target: &dspark::Qwen3) -> dspark::DSparkDraft {
    dspark::DSparkDraft::load(
        &models().join("tiny-code-dspark"),
        target,
        dspark::LoadOptions::default(),
        &dspark::DraftCacheConfig::default(),
    )
    .unwrap()
}

/// The target's feature rows of the first held-out prompt for `layers` (`[len, n·hidden]`), and
/// the prompt's last token: the context and anchor of a first proposal.
pub fn heldout_prompt_features(target: &dspark::Qwen3, layers: &[usize]) -> (burn::tensor::Tensor<2>, u32) {
    use dspark::KvCache;
    let prompt = heldout_prompts(1).remove(0);
    let mut cache = dspark::PagedKvCache::new(target.kv_layout(16), 64 << 20, target.device()).unwrap();
    let seq = cache.allocate();
    let chunk = dspark::SeqChunk { seq, tokens: &prompt, logits: dspark::LogitRows::Last };
    let out = target.forward(&[chunk], layers, &mut cache).unwrap();
    (out.features.unwrap(), *prompt.last().unwrap())
}

/// Tokens per verify round over generations: (generated − 1) / rounds, summed.
pub fn tau(out: &[dspark::Generation]) -> f64 {
    let generated: usize = out.iter().map(|g| g.tokens.len() - 1).sum();
    let rounds: usize = out.iter().map(|g| g.stats.rounds).sum();
    generated as f64 / rounds as f64
}

/// The held-out prompts of the trained pair's Rust cross-check (`models/report.json`), at most
/// `n` of them.
pub fn heldout_prompts(n: usize) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(models().join("report.json")).unwrap();
    let report: Value = serde_json::from_str(&text).unwrap();
    report["draft"]["eval"]["rust_crosscheck_T0"]
        .as_array()
        .unwrap()
        .iter()
        .take(n)
        .map(|c| serde_json::from_value(c["prompt_ids"].clone()).unwrap())
        .collect()
}

pub fn cases() -> Value {
    let text = std::fs::read_to_string(golden().join("cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The public set (the only one).
pub fn set() -> Value {
    cases()["sets"][0].clone()
}

pub fn prompts() -> Vec<Vec<u32>> {
    serde_json::from_value(set()["prompts"].clone()).unwrap()
}

pub fn cases_of(kind: &str) -> Vec<Value> {
    set()["cases"].as_array().unwrap().iter().filter(|c| c["kind"] == kind).cloned().collect()
}

pub fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// An expected tensor `{file, tensor, shape}` as (flat f32 values, shape).
pub fn tensor(reference: &Value) -> (Vec<f32>, Vec<usize>) {
    let file = golden().join(reference["file"].as_str().unwrap());
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor(reference["tensor"].as_str().unwrap()).unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    (values, view.shape().to_vec())
}

/// The expected tensor a case refers to, following `{"from": case, "tensor": name}` links.
pub fn expected(reference: &Value) -> Vec<f32> {
    if let Some(from) = reference.get("from") {
        let case = set()["cases"].as_array().unwrap().iter().find(|c| c["id"] == *from).unwrap().clone();
        return tensor(&case["expected"][reference["tensor"].as_str().unwrap()]).0;
    }
    tensor(reference).0
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn assert_close(what: &str, actual: &[f32], expected: &[f32], atol: f32) {
    let d = max_abs_diff(actual, expected);
    assert!(d <= atol, "{what}: max |diff| {d} > {atol}");
}

/// A writable copy of a golden model folder.
pub fn copy_model(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(golden().join(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

/// Rewrite a model folder's `config.json` with `edit`.
pub fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}
