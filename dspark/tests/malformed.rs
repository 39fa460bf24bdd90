//! Bad checkpoints and bad inputs give typed errors that name the file or tensor.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::*;
use dspark::{Engine, EngineConfig, Error, KvCache, LoadOptions, Qwen3, Request, SamplingParams};

fn load(dir: &Path) -> Result<Qwen3, Error> {
    Qwen3::load(dir, LoadOptions::default())
}

#[test]
fn missing_folder_or_files_name_the_path() {
    let err = load(Path::new("/nonexistent/model")).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.ends_with("config.json")), "{err}");

    let dir = copy_model("tiny-qwen3");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.ends_with("model.safetensors")), "{err}");

    let dir = copy_model("tiny-qwen3-sharded");
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("model-00002-of-00002.safetensors"), "{err}");
}

#[test]
fn config_that_disagrees_with_the_tensors_names_the_tensor() {
    let dir = copy_model("tiny-qwen3");
    edit_config(dir.path(), |c| c["intermediate_size"] = 96.into());
    let err = load(dir.path()).unwrap_err();
    match &err {
        Error::TensorShape { tensor, expected, actual, path } => {
            assert_eq!(tensor, "model.layers.0.mlp.gate_proj.weight");
            assert_eq!((expected.as_slice(), actual.as_slice()), (&[96, 64][..], &[128, 64][..]));
            assert!(path.ends_with("model.safetensors"));
        }
        other => panic!("expected TensorShape, got {other}"),
    }
    assert!(err.to_string().contains("model.layers.0.mlp.gate_proj.weight"));
}

#[test]
fn invalid_config_values_are_refused_before_loading() {
    for (key, value, needle) in [
        ("num_key_value_heads", serde_json::json!(3), "num_key_value_heads"),
        ("rope_theta", serde_json::Value::Null, "rope_theta"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("vocab_size", serde_json::json!(0), "vocab_size"),
    ] {
        let dir = copy_model("tiny-qwen3");
        edit_config(dir.path(), |c| c[key] = value.clone());
        let err = load(dir.path()).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{key}: {err}");
        assert!(err.to_string().contains(needle), "{key}: {err}");
    }
    let dir = copy_model("tiny-qwen3");
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    assert!(matches!(load(dir.path()).unwrap_err(), Error::Json { .. }));
}

#[test]
fn rope_theta_inside_rope_parameters_loads_the_same_model() {
    let dir = copy_model("tiny-qwen3");
    edit_config(dir.path(), |c| {
        let theta = c["rope_theta"].clone();
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = serde_json::json!({ "rope_theta": theta, "rope_type": "default" });
    });
    let case = &cases_of("target_greedy")[0];
    let mut engine = Engine::new(load(dir.path()).unwrap(), &EngineConfig::default()).unwrap();
    let out = engine
        .generate(&[Request { prompt: ids(&case["input_ids"]), params: SamplingParams::greedy(24) }])
        .unwrap();
    assert_eq!(out[0].tokens, ids(&case["expected"]["tokens"]));
}

#[test]
fn truncated_or_corrupt_safetensors_names_the_file() {
    let dir = copy_model("tiny-qwen3");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::Safetensors { path, .. } if path.ends_with("model.safetensors")), "{err}");

    std::fs::write(&path, b"\x08\0\0\0\0\0\0\0garbage!").unwrap();
    assert!(matches!(load(dir.path()).unwrap_err(), Error::Safetensors { .. }));
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_model("tiny-qwen3-sharded");
    let index = dir.path().join("model.safetensors.index.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    json["weight_map"].as_object_mut().unwrap().remove("model.layers.4.self_attn.k_norm.weight");
    std::fs::write(&index, json.to_string()).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "model.layers.4.self_attn.k_norm.weight"),
        "{err}"
    );
}

#[test]
fn tied_embeddings_are_used_when_lm_head_is_absent() {
    // Rewrite the checkpoint without lm_head.weight: the head becomes the embedding.
    let dir = copy_model("tiny-qwen3");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        st.tensors().into_iter().filter(|(n, _)| n != "lm_head.weight").collect();
    safetensors::serialize_to_file(kept, None, &path).unwrap();
    edit_config(dir.path(), |c| c["tie_word_embeddings"] = true.into());
    let model = load(dir.path()).unwrap();
    let a = model.lm_head().clone().into_data().try_to_vec::<f32>().unwrap();
    let b = model.embed_tokens().clone().into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_requests_are_refused_with_typed_errors() {
    let mut engine =
        Engine::new(load(&golden().join("tiny-qwen3")).unwrap(), &EngineConfig::default()).unwrap();
    let err = engine
        .generate(&[Request { prompt: vec![1, 2, 512], params: SamplingParams::greedy(4) }])
        .unwrap_err();
    assert!(matches!(err, Error::TokenOutOfRange { token: 512, vocab: 512 }), "{err}");
    let err = engine.generate(&[Request { prompt: vec![], params: SamplingParams::greedy(4) }]).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    let params = SamplingParams { temperature: -1.0, ..SamplingParams::default() };
    let err = engine.generate(&[Request { prompt: vec![3], params }]).unwrap_err();
    assert!(matches!(err, Error::InvalidSampling(_)), "{err}");
    assert!(matches!(engine.score(&[3, 9999]).unwrap_err(), Error::TokenOutOfRange { token: 9999, .. }));
    // Nothing leaked, and the engine still works.
    assert_eq!(engine.cache().bytes_used(), 0);
    let out = engine.generate(&[Request { prompt: vec![3, 4], params: SamplingParams::greedy(0) }]).unwrap();
    assert!(out[0].tokens.is_empty() && out[0].finish.is_none());
}

#[test]
fn bf16_and_f16_checkpoints_load_into_any_compute_dtype() {
    use dspark::ComputeDtype;
    let reference = load(&golden().join("tiny-qwen3")).unwrap();
    let original = reference.embed_tokens().clone().into_data().try_to_vec::<f32>().unwrap();
    for (dtype, round) in [
        (safetensors::Dtype::BF16, (|v: f32| half::bf16::from_f32(v).to_f32()) as fn(f32) -> f32),
        (safetensors::Dtype::F16, |v: f32| half::f16::from_f32(v).to_f32()),
    ] {
        // Rewrite every tensor of the checkpoint in the 16-bit type.
        let dir = copy_model("tiny-qwen3");
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let converted: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let data = view
                    .data()
                    .chunks_exact(4)
                    .flat_map(|b| {
                        let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        match dtype {
                            safetensors::Dtype::BF16 => half::bf16::from_f32(v).to_le_bytes(),
                            _ => half::f16::from_f32(v).to_le_bytes(),
                        }
                    })
                    .collect();
                (name, view.shape().to_vec(), data)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = converted
            .iter()
            .map(|(n, s, d)| (n.clone(), safetensors::tensor::TensorView::new(dtype, s.clone(), d).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
            let model =
                Qwen3::load(dir.path(), LoadOptions { dtype: compute, ..LoadOptions::default() }).unwrap();
            let loaded =
                model.embed_tokens().clone().into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            let expected: Vec<f32> = original
                .iter()
                .map(|&v| {
                    if compute == ComputeDtype::F32 {
                        round(v)
                    } else {
                        half::bf16::from_f32(round(v)).to_f32()
                    }
                })
                .collect();
            assert_eq!(loaded, expected, "{dtype:?} checkpoint, {compute} compute");
        }
    }
}
