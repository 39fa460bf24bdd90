//! FP8 (e4m3) drafts on the CPU reference path: FP8 checkpoints (128×128 block scales and
//! per-channel scales) written here from the golden tiny draft load to exactly the weights this
//! test computes, their Markov and confidence heads too when stored in FP8; a draft quantised at
//! load really is quantised; greedy output with an FP8 draft
//! equals target-only output and sampled output keeps the target's distribution; malformed FP8
//! checkpoints are refused naming the tensor; τ of the trained pair, FP8 vs as shipped.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::fp8_ckpt::*;
use common::*;
use safetensors::Dtype;

use dspark::model::fp8::{self, DraftQuant, Fp8Counts};
use dspark::weights::Checkpoint;
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, Error, LoadOptions, Qwen3, Request, SamplingParams,
};

#[test]
fn fp8_checkpoints_load_to_the_weights_the_test_computed() {
    let t = target();
    for layout in [Layout::Blocks, Layout::PerChannel] {
        let (fp8_dir, ref_dir, expected) = fp8_checkpoint(layout);
        let ckpt = Checkpoint::open(fp8_dir.path()).unwrap();
        for (name, want) in &expected {
            let shape = ckpt.shape(name).unwrap();
            let (got, how) = fp8::read_matrix(&ckpt, name, [shape[0], shape[1]]).unwrap();
            assert_eq!(&got, want, "{layout:?} {name}");
            let want_how = if layout == Layout::Blocks {
                fp8::Fp8Layout::BlockScaled
            } else {
                fp8::Fp8Layout::PerChannel
            };
            assert_eq!(how, Some(want_how));
        }
        // The loaded draft computes exactly what a draft with the dequantised f32 weights does.
        let mut draft = load(fp8_dir.path(), &t).unwrap();
        let counts = draft.fp8_weights();
        assert_eq!(counts.total(), 15, "{counts:?}");
        assert_eq!(counts.block_scaled, if layout == Layout::Blocks { 15 } else { 0 });
        let mut reference = load(ref_dir.path(), &t).unwrap();
        assert_eq!(reference.fp8_weights(), Fp8Counts::default());
        assert_eq!(block_outputs(&mut draft, &t), block_outputs(&mut reference, &t), "{layout:?}");
        // And not what the original draft does.
        let mut original = load(&golden().join("tiny-dspark"), &t).unwrap();
        assert_ne!(block_outputs(&mut draft, &t).1, block_outputs(&mut original, &t).1);
    }
}

#[test]
fn fp8_markov_and_confidence_heads_load_dequantised() {
    // An FP8 checkpoint whose Markov head (W1, W2) and confidence head are stored in e4m3 too:
    // they load to the dequantised values, and the draft proposes exactly what the same draft
    // with those values stored in f32 proposes (tokens and confidences, bit for bit).
    use dspark::{ProposeLane, SamplingParams, Speculator};
    let t = target();
    let heads =
        ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"];
    for layout in [Layout::Blocks, Layout::PerChannel] {
        let (fp8_dir, ref_dir, _) = fp8_checkpoint(layout);
        let (fp8_file, ref_file) =
            (fp8_dir.path().join("model.safetensors"), ref_dir.path().join("model.safetensors"));
        let (mut stored, mut reference) = (read_all(&fp8_file), read_all(&ref_file));
        let mut want = BTreeMap::new();
        for name in heads {
            let (dtype, shape, bytes) = stored[name].clone();
            assert_eq!(dtype, Dtype::F32, "{name}");
            let original = f32s(&bytes);
            let (q, scale_shape, scales, deq) = quantise(&original, shape[0], shape[1], layout);
            assert_ne!(deq, original, "{name}: quantisation changed nothing");
            stored.insert(name.to_owned(), (Dtype::F8_E4M3, shape.clone(), q));
            stored.insert(format!("{name}_scale_inv"), (Dtype::F32, scale_shape, bytes_of(&scales)));
            reference.insert(name.to_owned(), (Dtype::F32, shape, bytes_of(&deq)));
            want.insert(name, deq);
        }
        write_all(&fp8_file, &stored);
        write_all(&ref_file, &reference);
        let (mut fp8_draft, mut ref_draft) =
            (load(fp8_dir.path(), &t).unwrap(), load(ref_dir.path(), &t).unwrap());
        let markov = fp8_draft.markov().expect("a Markov head");
        assert_eq!(markov.w1, want["markov_head.markov_w1.weight"], "{layout:?}");
        assert_eq!(markov.w2, want["markov_head.markov_w2.weight"], "{layout:?}");
        let width = fp8_draft.layer_ids().len() * 64;
        let values: Vec<f32> = (0..7 * width).map(|i| (i as f32 * 0.29).cos()).collect();
        let greedy = SamplingParams::greedy(8);
        let propose = |d: &mut DSparkDraft| {
            let features = burn::tensor::Tensor::<2>::from_data(
                burn::tensor::TensorData::new(values.clone(), [7, width]),
                t.device(),
            );
            let seq = d.begin();
            d.extend_context(seq, features).unwrap();
            let p = d.propose(&[ProposeLane { seq, anchor: 11, params: &greedy }]).unwrap().remove(0);
            d.end(seq).unwrap();
            p
        };
        let (a, b) = (propose(&mut fp8_draft), propose(&mut ref_draft));
        assert_eq!(a.tokens, b.tokens, "{layout:?}");
        let bits = |c: &Option<Vec<f32>>| {
            c.as_ref().expect("confidences").iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&a.confidence), bits(&b.confidence), "{layout:?}");
    }
}

#[test]
fn a_multi_block_fp8_tensor_uses_each_blocks_scale() {
    // 200 × 300: 2 × 3 blocks, ragged at both edges; scales stored in bf16.
    let (rows, cols) = (200, 300);
    let w: Vec<f32> =
        (0..rows * cols).map(|i| ((i as f32 * 0.013).cos() * (1 + i % 7) as f32) * 0.1).collect();
    let (bytes, scale_shape, scales, _) = quantise(&w, rows, cols, Layout::Blocks);
    assert_eq!(scale_shape, [2, 3]);
    let scales_bf16: Vec<half::bf16> = scales.iter().map(|&s| half::bf16::from_f32(s)).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = BTreeMap::new();
    tensors.insert("p.weight".to_string(), (Dtype::F8_E4M3, vec![rows, cols], bytes.clone()));
    let sb: Vec<u8> = scales_bf16.iter().flat_map(|s| s.to_le_bytes()).collect();
    tensors.insert("p.weight_scale".to_string(), (Dtype::BF16, scale_shape, sb));
    write_all(&dir.path().join("model.safetensors"), &tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (got, _) = fp8::read_matrix(&ckpt, "p.weight", [rows, cols]).unwrap();
    for r in 0..rows {
        for c in 0..cols {
            let s = scales_bf16[(r / 128) * 3 + c / 128].to_f32();
            assert_eq!(got[r * cols + c], e4m3(bytes[r * cols + c]) * s, "({r}, {c})");
        }
    }
}

#[test]
fn a_draft_quantised_at_load_is_quantised_per_channel() {
    let t = target();
    let dir = golden().join("tiny-dspark");
    let mut q = quantised(&dir, &t);
    assert_eq!(q.fp8_weights(), Fp8Counts { quantized_at_load: 15, ..Fp8Counts::default() });
    // Exactly the per-channel quantisation this test computes.
    let ref_dir = copy_model("tiny-dspark");
    let file = ref_dir.path().join("model.safetensors");
    let mut tensors = read_all(&file);
    for name in projections(&tensors) {
        let (_, shape, bytes) = tensors[&name].clone();
        let (_, _, _, deq) = quantise(&f32s(&bytes), shape[0], shape[1], Layout::PerChannel);
        tensors.insert(name, (Dtype::F32, shape, bytes_of(&deq)));
    }
    write_all(&file, &tensors);
    let mut reference = load(ref_dir.path(), &t).unwrap();
    let mut plain = load(&dir, &t).unwrap();
    let (qh, ql) = block_outputs(&mut q, &t);
    assert_eq!((qh.clone(), ql.clone()), block_outputs(&mut reference, &t));
    let (_, pl) = block_outputs(&mut plain, &t);
    assert_ne!(ql, pl, "quantisation changed nothing");
    // The Markov head's W2 too, per channel, exactly as this test quantises it; W1 (a table the
    // steps gather one row from) stays.
    let (pm, qm) = (plain.markov().expect("a Markov head"), q.markov().expect("a Markov head"));
    let (_, _, _, w2) = quantise(&pm.w2, pm.w2.len() / pm.rank, pm.rank, Layout::PerChannel);
    assert_ne!(pm.w2, w2, "W2 quantisation changed nothing");
    assert_eq!(qm.w2, w2, "W2 is not the per-channel quantisation of the checkpoint's");
    assert_eq!(qm.w1, pm.w1);
    assert!(q.has_fp8_markov() && !plain.has_fp8_markov());
    let diff = max_abs_diff(&ql, &pl);
    let scale = pl.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    eprintln!("quantised vs f32 draft: max |Δ base logit| {diff:.4} (max |logit| {scale:.2})");
    assert!(diff < 0.2 * scale, "quantisation error unexpectedly large: {diff} of {scale}");
}

fn greedy_requests(n: usize) -> Vec<Request> {
    prompts().into_iter().map(|prompt| Request { prompt, params: SamplingParams::greedy(n) }).collect()
}

#[test]
fn greedy_output_with_an_fp8_draft_equals_target_only_output() {
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let reference = plain.generate(&greedy_requests(40)).unwrap();
    let (blocks, _, _) = fp8_checkpoint(Layout::Blocks);
    let (channels, _, _) = fp8_checkpoint(Layout::PerChannel);
    for what in ["blocks", "per-channel", "quantised at load"] {
        let t = target();
        let d = match what {
            "blocks" => load(blocks.path(), &t).unwrap(),
            "per-channel" => load(channels.path(), &t).unwrap(),
            _ => quantised(&golden().join("tiny-dspark"), &t),
        };
        assert_eq!(d.fp8_weights().total(), 15);
        let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
        let out = e.generate(&greedy_requests(40)).unwrap();
        let (mut drafted, mut accepted) = (0, 0);
        for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
            assert_eq!(o.tokens, r.tokens, "{what}: prompt {i}");
            drafted += o.stats.drafted;
            accepted += o.stats.accepted;
        }
        eprintln!("{what}: {accepted} of {drafted} drafts accepted");
        assert!(drafted > 0);
    }
}

#[test]
fn sampled_output_with_an_fp8_draft_has_the_target_distribution() {
    let prompt = prompts()[0].clone();
    let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let model = target();
    let exact = stats::exact_second_token(&model, &prompt, &params, 0.0);
    let (blocks, _, _) = fp8_checkpoint(Layout::Blocks);
    let t = target();
    let d = load(blocks.path(), &t).unwrap();
    let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
    let counts = stats::second_token_counts(&mut e, &prompt, &params, 3000);
    let (stat, df) = stats::chi_square(&counts, &exact);
    let limit = stats::chi_square_limit(df);
    eprintln!("fp8 draft, T=1: chi2 {stat:.1} on {df} df (limit {limit:.1})");
    assert!(stat < limit, "speculative sampling with an FP8 draft deviates: chi2 {stat:.1} > {limit:.1}");
    assert!(e.last_stats().drafted > 0);
}

/// A copy of the block-scaled FP8 draft with `edit` applied to its tensors.
fn malformed(edit: impl FnOnce(&mut BTreeMap<String, Stored>)) -> tempfile::TempDir {
    let (dir, _, _) = fp8_checkpoint(Layout::Blocks);
    let file = dir.path().join("model.safetensors");
    let mut tensors = read_all(&file);
    edit(&mut tensors);
    write_all(&file, &tensors);
    dir
}

#[test]
fn malformed_fp8_checkpoints_are_refused_naming_the_tensor() {
    let t = target();
    // A missing scale.
    let dir = malformed(|m| {
        m.remove("layers.0.mlp.up_proj.weight_scale_inv");
    });
    match load(dir.path(), &t) {
        Err(Error::MissingTensor { tensor, .. }) => {
            assert!(tensor.contains("layers.0.mlp.up_proj.weight_scale_inv"), "{tensor}")
        }
        other => panic!("missing scale: {other:?}"),
    }
    // A scale of neither block nor per-channel shape.
    let dir = malformed(|m| {
        m.insert("fc.weight_scale_inv".into(), (Dtype::F32, vec![2, 1], bytes_of(&[1.0, 1.0])));
    });
    match load(dir.path(), &t) {
        Err(Error::TensorShape { tensor, actual, .. }) => {
            assert_eq!(tensor, "fc.weight_scale_inv");
            assert_eq!(actual, [2, 1]);
        }
        other => panic!("wrong scale shape: {other:?}"),
    }
    // An FP8 flavour other than e4m3fn.
    let dir = malformed(|m| {
        m.get_mut("layers.1.self_attn.k_proj.weight").unwrap().0 = Dtype::F8_E5M2;
    });
    match load(dir.path(), &t) {
        Err(Error::TensorDtype { tensor, path, dtype }) => {
            assert_eq!(tensor, "layers.1.self_attn.k_proj.weight");
            assert!(dtype.contains("E5M2") && path.ends_with("model.safetensors"), "{dtype}");
        }
        other => panic!("unsupported dtype: {other:?}"),
    }
    // A scale in an FP8 dtype.
    let dir = malformed(|m| {
        let n = 1;
        m.insert("fc.weight_scale_inv".into(), (Dtype::F8_E4M3, vec![1, 1], vec![0x38; n]));
    });
    match load(dir.path(), &t) {
        Err(Error::TensorDtype { tensor, .. }) => assert_eq!(tensor, "fc.weight_scale_inv"),
        other => panic!("fp8 scale: {other:?}"),
    }
    // NaN weights (0x7F).
    let dir = malformed(|m| {
        m.get_mut("layers.0.self_attn.o_proj.weight").unwrap().2[3] = 0x7F;
    });
    match load(dir.path(), &t) {
        Err(Error::Safetensors { message, .. }) => {
            assert!(message.contains("layers.0.self_attn.o_proj.weight"), "{message}")
        }
        other => panic!("NaN weight: {other:?}"),
    }
    // The weight itself of the wrong shape.
    let dir = malformed(|m| {
        m.get_mut("fc.weight").unwrap().1 = vec![128, 64];
    });
    match load(dir.path(), &t) {
        Err(Error::TensorShape { tensor, .. }) => assert_eq!(tensor, "fc.weight"),
        other => panic!("wrong weight shape: {other:?}"),
    }
    // A Markov W2 stored in e4m3 without its scale.
    let dir = malformed(|m| {
        let w2 = m.get_mut("markov_head.markov_w2.weight").unwrap();
        let n = w2.1.iter().product();
        *w2 = (Dtype::F8_E4M3, w2.1.clone(), vec![0x38; n]);
    });
    match load(dir.path(), &t) {
        Err(Error::MissingTensor { tensor, .. }) => {
            assert!(tensor.contains("markov_head.markov_w2.weight_scale_inv"), "{tensor}")
        }
        other => panic!("FP8 W2 without a scale: {other:?}"),
    }
}

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// The held-out prompts and output lengths of `trained_pair.rs` (`models/report.json`).
fn heldout() -> Vec<Request> {
    let text = std::fs::read_to_string(models().join("report.json")).unwrap();
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    report["draft"]["eval"]["rust_crosscheck_T0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let prompt: Vec<u32> = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
            let tokens: Vec<u32> = serde_json::from_value(c["tokens"].clone()).unwrap();
            Request { prompt, params: SamplingParams::greedy(tokens.len()) }
        })
        .collect()
}

#[test]
fn trained_pair_tau_with_an_fp8_draft() {
    let requests = heldout();
    let target = || Qwen3::load(&models().join("tiny-code-qwen3"), LoadOptions::default()).unwrap();
    let reference = Engine::new(target(), &EngineConfig::default()).unwrap().generate(&requests).unwrap();
    let mut taus = Vec::new();
    for quant in [None, Some(DraftQuant::Fp8PerChannel)] {
        let t = target();
        let dir = models().join("tiny-code-dspark");
        let cache = DraftCacheConfig::default();
        let d = match quant {
            None => DSparkDraft::load(&dir, &t, LoadOptions::default(), &cache),
            Some(q) => DSparkDraft::load_quantized(&dir, &t, LoadOptions::default(), &cache, q),
        }
        .unwrap();
        let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
        let out = e.generate(&requests).unwrap();
        let (mut generated, mut rounds) = (0, 0);
        for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
            assert_eq!(o.tokens, r.tokens, "{quant:?}: prompt {i}");
            generated += o.tokens.len() - 1;
            rounds += o.stats.rounds;
        }
        let tau = generated as f64 / rounds as f64;
        eprintln!(
            "trained pair, greedy, {} held-out prompts, draft {}: tau {tau:.3} ({generated} tokens after the first in {rounds} rounds)",
            requests.len(),
            if quant.is_some() { "fp8 e4m3 per-channel (quantised at load)" } else { "as shipped (bf16)" }
        );
        taus.push(tau);
    }
    // Quantisation may lower acceptance a little; the floor for the pair is 2.5.
    assert!(taus[1] >= 2.5, "fp8 tau {:.3} below the 2.5 floor (bf16 {:.3})", taus[1], taus[0]);
}
