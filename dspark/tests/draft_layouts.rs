//! Draft checkpoints in every supported shape, and drafts that do not fit their target.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::*;
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, Error, LoadOptions, Qwen3, Request, SamplingParams,
    Speculator, VerifyPolicy,
};

fn target() -> Qwen3 {
    Qwen3::load(&golden().join("tiny-qwen3"), LoadOptions::default()).unwrap()
}

/// Add (or replace) seeded random f32 tensors in a draft's weights file.
fn add_tensors(dir: &Path, extra: &[(&str, Vec<usize>, f32)]) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| extra.iter().all(|(e, _, _)| e != n))
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for (name, shape, scale) in extra {
        let n: usize = shape.iter().product();
        let data: Vec<u8> = (0..n)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 11) as f32 / (1u64 << 53) as f32;
                ((2.0 * u - 1.0) * scale).to_le_bytes()
            })
            .collect();
        owned.push((name.to_string(), shape.clone(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn load(dir: &Path, t: &Qwen3) -> Result<DSparkDraft, Error> {
    DSparkDraft::load(dir, t, LoadOptions::default(), &DraftCacheConfig::default())
}

/// Greedy speculative output must equal greedy target-only output, whatever the draft.
fn assert_lossless(draft: DSparkDraft, verify: VerifyPolicy) -> f64 {
    let requests: Vec<Request> =
        prompts().into_iter().map(|prompt| Request { prompt, params: SamplingParams::greedy(30) }).collect();
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let reference = plain.generate(&requests).unwrap();
    let mut e =
        Engine::with_draft(target(), Box::new(draft), &EngineConfig { verify, ..EngineConfig::default() })
            .unwrap();
    let out = e.generate(&requests).unwrap();
    for (o, r) in out.iter().zip(&reference) {
        assert_eq!(o.tokens, r.tokens);
    }
    out.iter().map(|o| o.stats.tau).sum::<f64>() / out.len() as f64
}

#[test]
fn defaulted_target_layer_ids_resolve_from_the_target_and_fc() {
    let t = target();
    let dir = copy_model("tiny-dspark");
    edit_config(dir.path(), |c| {
        c.as_object_mut().unwrap().remove("target_layer_ids");
    });
    let d = load(dir.path(), &t).unwrap();
    assert_eq!(d.layer_ids(), &[1, 3], "round(1 + i·(6−4)/(2−1))");
    assert_lossless(d, VerifyPolicy::Full);
}

#[test]
fn specforge_layout_with_block_16_and_no_confidence_head() {
    let t = target();
    let dir = copy_model("tiny-dspark-specforge");
    edit_config(dir.path(), |c| {
        c["block_size"] = 16.into();
        c["dflash_config"]["enable_confidence_head"] = false.into();
        c["dflash_config"].as_object_mut().unwrap().remove("confidence_head_with_markov");
    });
    let d = load(dir.path(), &t).unwrap();
    assert_eq!((d.block_size(), d.has_confidence()), (16, false));
    // Draft 16, verify 8: any prefix of the native block may be verified.
    assert_lossless(d, VerifyPolicy::Fixed(8));
    let d = load(dir.path(), &t).unwrap();
    let err = Engine::with_draft(
        t,
        Box::new(d),
        &EngineConfig { verify: VerifyPolicy::Threshold(0.5), ..EngineConfig::default() },
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    // The throughput scheduler reads confidences too.
    let t = target();
    let d = load(dir.path(), &t).unwrap();
    let table = dspark::engine::schedule::CostTable::new(
        Default::default(),
        vec![dspark::engine::schedule::VerifyCost::new(1, 1.0)],
        vec![dspark::engine::schedule::DraftCost { lanes: 1, ms: 1.0 }],
    )
    .unwrap();
    let config = EngineConfig {
        verify: VerifyPolicy::Throughput,
        cost_table: Some(std::sync::Arc::new(table)),
        ..EngineConfig::default()
    };
    let err = Engine::with_draft(t, Box::new(d), &config).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}

#[test]
fn gated_and_rnn_heads_and_a_confidence_head_without_markov_input() {
    let t = target();
    let dir = copy_model("tiny-dspark");
    add_tensors(
        dir.path(),
        &[("markov_head.gate_proj.weight", vec![8, 72], 0.2), ("markov_head.gate_proj.bias", vec![8], 1.0)],
    );
    edit_config(dir.path(), |c| c["markov_head_type"] = "gated".into());
    let tau_gated = assert_lossless(load(dir.path(), &t).unwrap(), VerifyPolicy::Full);

    let dir = copy_model("tiny-dspark");
    add_tensors(
        dir.path(),
        &[
            ("markov_head.joint_proj.weight", vec![24, 80], 0.2),
            ("markov_head.joint_proj.bias", vec![24], 0.1),
        ],
    );
    edit_config(dir.path(), |c| c["markov_head_type"] = "rnn".into());
    let tau_rnn = assert_lossless(load(dir.path(), &t).unwrap(), VerifyPolicy::Threshold(0.5));

    let dir = copy_model("tiny-dspark");
    add_tensors(dir.path(), &[("confidence_head.proj.weight", vec![1, 64], 0.2)]);
    edit_config(dir.path(), |c| c["confidence_head_with_markov"] = false.into());
    let tau_conf = assert_lossless(load(dir.path(), &t).unwrap(), VerifyPolicy::Threshold(0.5));
    // The same head on the device pass (the CPU body of its kernel, without the Markov term):
    // its confidences differ from the host's by f32 rounding, so the threshold keeps the same
    // drafts in every round and τ is the same.
    let mut on_device = load(dir.path(), &t).unwrap();
    assert!(on_device.set_device_markov(true) && on_device.set_device_confidence(true));
    let tau_conf_device = assert_lossless(on_device, VerifyPolicy::Threshold(0.5));
    assert_eq!(tau_conf_device, tau_conf, "the device head kept other drafts");
    eprintln!("tau: gated {tau_gated:.2}, rnn {tau_rnn:.2}, confidence without markov {tau_conf:.2}");
}

#[test]
fn a_draft_that_does_not_fit_its_target_is_refused_before_compute() {
    let t = target();
    type ConfigEdit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, ConfigEdit, &str)> = vec![
        ("hidden", Box::new(|c| c["hidden_size"] = 32.into()), "hidden_size"),
        ("vocab", Box::new(|c| c["vocab_size"] = 600.into()), "vocab_size"),
        ("last layer", Box::new(|c| c["target_layer_ids"] = serde_json::json!([1, 5])), "target_layer_id 5"),
        (
            "out of range",
            Box::new(|c| c["target_layer_ids"] = serde_json::json!([1, 9])),
            "target_layer_id 9",
        ),
        ("embedding", Box::new(|c| c["target_layer_ids"] = serde_json::json!([-1, 3])), "target_layer_id -1"),
        ("mask", Box::new(|c| c["mask_token_id"] = 512.into()), "mask_token_id"),
        ("depth", Box::new(|c| c["num_target_layers"] = 8.into()), "8-layer target"),
        (
            "block",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("block_size");
            }),
            "block_size",
        ),
        ("head", Box::new(|c| c["markov_head_type"] = "lstm".into()), "markov_head_type"),
    ];
    for (name, f, needle) in cases {
        let dir = copy_model("tiny-dspark");
        edit_config(dir.path(), f);
        let err = load(dir.path(), &t).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{name}: {err}");
        assert!(err.to_string().contains(needle), "{name}: {err}");
    }
    // A fixed width outside 1..=γ+1 is refused too.
    let d = load(&golden().join("tiny-dspark"), &t).unwrap();
    let err = Engine::with_draft(
        t,
        Box::new(d),
        &EngineConfig { verify: VerifyPolicy::Fixed(6), ..EngineConfig::default() },
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)));
    // Missing Markov tensors name the tensor.
    let dir = copy_model("tiny-dspark");
    edit_config(dir.path(), |c| c["markov_head_type"] = "gated".into());
    let err = load(dir.path(), &target()).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "markov_head.gate_proj.weight"),
        "{err}"
    );
}
