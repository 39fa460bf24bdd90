//! The DSpark draft and the speculative engine against the reference implementation's golden
//! vectors (f32, CPU), for both draft layouts.
#![allow(clippy::unwrap_used)]

mod common;

use burn::tensor::{Tensor, TensorData};
use common::*;
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, FinishReason, LoadOptions, Qwen3, Request,
    SamplingParams, Speculator, VerifyPolicy,
};

const LAYOUTS: [&str; 2] = ["tiny-dspark", "tiny-dspark-specforge"];

fn target() -> Qwen3 {
    Qwen3::load(&golden().join("tiny-qwen3"), LoadOptions::default()).unwrap()
}

fn draft(layout: &str, target: &Qwen3) -> DSparkDraft {
    DSparkDraft::load(&golden().join(layout), target, LoadOptions::default(), &DraftCacheConfig::default())
        .unwrap()
}

fn engine(layout: &str, verify: VerifyPolicy) -> Engine {
    let t = target();
    let d = draft(layout, &t);
    Engine::with_draft(t, Box::new(d), &EngineConfig { verify, ..EngineConfig::default() }).unwrap()
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

#[test]
fn draft_block_matches_golden_for_both_layouts() {
    let t = target();
    for layout in LAYOUTS {
        let mut d = draft(layout, &t);
        assert_eq!(d.layer_ids(), &[1, 3]);
        for case in cases_of("draft_block") {
            let id = format!("{layout} {}", case["id"]);
            let features =
                expected(&serde_json::json!({"from": case["context"]["from"], "tensor": "features"}));
            let rows = features.len() / 128;
            let features = Tensor::<2>::from_data(TensorData::new(features, [rows, 128]), t.device());
            // Context projection of the prompt's features.
            let c = host(d.context_projection(features.clone()));
            assert_close(
                &format!("{id} context_projection"),
                &c,
                &tensor(&case["expected"]["context_projection"]).0,
                2e-4,
            );
            let seq = d.begin();
            d.extend_context(seq, features).unwrap();
            assert_eq!(case["anchor_position"].as_u64().unwrap() as usize, d.context_len(seq).unwrap());
            let anchor = case["anchor"].as_u64().unwrap() as u32;
            let (hidden, base) = d.block_forward(&[(seq, anchor)]).unwrap();
            let (hidden, base) = (host(hidden), host(base));
            assert_close(
                &format!("{id} block_hidden"),
                &hidden,
                &tensor(&case["expected"]["block_hidden"]).0,
                2e-4,
            );
            assert_close(
                &format!("{id} base_logits"),
                &base,
                &tensor(&case["expected"]["base_logits"]).0,
                5e-4,
            );
            let pass = d.markov_pass(anchor, &hidden, &base, &SamplingParams::greedy(1), rows);
            assert_eq!(pass.tokens, ids(&case["expected"]["draft_tokens"]), "{id} draft tokens");
            let corrected: Vec<f32> = pass.corrected.iter().flatten().map(|&x| x as f32).collect();
            assert_close(
                &format!("{id} corrected_logits"),
                &corrected,
                &tensor(&case["expected"]["corrected_logits"]).0,
                5e-4,
            );
            let logits: Vec<f32> = pass.confidence_logits.iter().map(|&x| x as f32).collect();
            assert_close(
                &format!("{id} confidence_logits"),
                &logits,
                &tensor(&case["expected"]["confidence_logits"]).0,
                5e-5,
            );
            let sig: Vec<f32> =
                pass.confidence_logits.iter().map(|&x| (1.0 / (1.0 + (-x).exp())) as f32).collect();
            assert_close(&format!("{id} confidence"), &sig, &tensor(&case["expected"]["confidence"]).0, 2e-5);
            d.end(seq).unwrap();
        }
    }
}

#[test]
fn markov_teacher_forced_matches_golden() {
    let t = target();
    let d = draft("tiny-dspark", &t);
    let m = d.markov().unwrap();
    let case = &cases_of("markov_teacher_forced")[0];
    let base = expected(&case["inputs"]["base_logits"]);
    let hidden = expected(&case["inputs"]["block_hidden"]);
    let (v, h) = (512, 64);
    for variant in case["variants"].as_array().unwrap() {
        let prev = ids(&variant["prev_token_ids"]);
        let mut state = m.initial_state();
        let mut ours = Vec::new();
        for (k, &p) in prev.iter().enumerate() {
            let (latent, next) = m.latent(p, &hidden[k * h..(k + 1) * h], &state);
            state = next;
            let mut row: Vec<f64> = base[k * v..(k + 1) * v].iter().map(|&x| f64::from(x)).collect();
            m.add_bias(&mut row, &latent);
            ours.extend(row.iter().map(|&x| x as f32));
        }
        let exp = tensor(&variant["expected"]["corrected_logits"]).0;
        assert_close(&format!("teacher forced {}", variant["name"]), &ours, &exp, 5e-4);
    }
}

/// Compare rounds that the reference and an engine stopping at max_new_tokens both run.
fn check_rounds(id: &str, prompt_len: usize, got: &[dspark::RoundRecord], expected: &serde_json::Value) {
    let limit = prompt_len + 24 - 1;
    let exp: Vec<&serde_json::Value> = expected
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| (r["anchor_position"].as_u64().unwrap() as usize) < limit)
        .collect();
    assert!(got.len() >= exp.len(), "{id}: {} rounds, expected at least {}", got.len(), exp.len());
    for (r, e) in got.iter().zip(&exp) {
        assert_eq!(r.position, e["anchor_position"].as_u64().unwrap() as usize, "{id} round {}", e["round"]);
        assert_eq!(r.drafted, ids(&e["draft_tokens"]), "{id} round {} drafted", e["round"]);
        assert_eq!(
            r.accepted,
            e["accepted"].as_u64().unwrap() as usize,
            "{id} round {} accepted",
            e["round"]
        );
    }
}

#[test]
fn spec_greedy_matches_golden_round_by_round_for_both_layouts_and_the_threshold() {
    for layout in LAYOUTS {
        for (kind, verify) in
            [("spec_greedy", VerifyPolicy::Full), ("spec_greedy_threshold", VerifyPolicy::Threshold(0.5))]
        {
            let mut e = engine(layout, verify);
            for case in cases_of(kind) {
                let id = format!("{layout} {}", case["id"]);
                let prompt = ids(&case["input_ids"]);
                let out = e
                    .generate(&[Request { prompt: prompt.clone(), params: SamplingParams::greedy(24) }])
                    .unwrap();
                assert_eq!(out[0].tokens, ids(&case["expected"]["output_tokens"]), "{id}");
                check_rounds(&id, prompt.len(), &out[0].stats.round_log, &case["expected"]["rounds"]);
            }
        }
    }
}

#[test]
fn stop_tokens_cut_the_commit_as_the_reference_does() {
    let mut e = engine("tiny-dspark", VerifyPolicy::Full);
    for case in cases_of("spec_greedy_stop") {
        let prompt = ids(&case["input_ids"]);
        let stop = ids(&case["stop_token_ids"]);
        let params = SamplingParams { stop_token_ids: stop.clone(), ..SamplingParams::greedy(24) };
        let out = e.generate(&[Request { prompt, params }]).unwrap();
        let expected = ids(&case["expected"]["output_tokens"]);
        assert_eq!(out[0].tokens, expected, "{}", case["id"]);
        assert_eq!(out[0].finish, Some(FinishReason::Stop(*expected.last().unwrap())));
        assert_eq!(
            out[0].stats.rounds,
            case["expected"]["rounds"].as_array().unwrap().len(),
            "{}",
            case["id"]
        );
    }
}

/// The device-parametrised check that the GPU suite runs, held here on CPU to the f32 bounds.
#[test]
fn draft_block_check_used_by_the_gpu_suite_holds_on_cpu() {
    let d = checks::draft_block_diffs(dspark::DeviceKind::Cpu, dspark::ComputeDtype::F32);
    assert_eq!(d.cases, 2 * cases_of("draft_block").len());
    assert!(d.tokens_equal, "{d:?}");
    assert!(d.context_rel < 1e-5 && d.hidden_rel < 1e-5 && d.base_rel < 1e-5, "{d:?}");
    assert!(d.corrected_rel < 1e-5 && d.confidence_abs < 2e-5, "{d:?}");
}

/// bf16 behaviour, stated: on CPU, bf16 speculative greedy output equals bf16 target-only output
/// for every prompt (the verify rows and the one-row decode steps round alike); both drift from
/// the f32 reference tokens where bf16 rounding flips a choice (measured: at generated token 4
/// of p0 and 9 of p2, never on p1).
#[test]
fn bf16_speculative_greedy_equals_bf16_target_only() {
    let bf16 = LoadOptions { dtype: dspark::ComputeDtype::Bf16, ..LoadOptions::default() };
    let load = || Qwen3::load(&golden().join("tiny-qwen3"), bf16).unwrap();
    let mut plain = Engine::new(load(), &EngineConfig::default()).unwrap();
    let t = load();
    let d = DSparkDraft::load(&golden().join("tiny-dspark"), &t, bf16, &DraftCacheConfig::default()).unwrap();
    let mut spec = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
    let mut drift = Vec::new();
    for case in cases_of("spec_greedy") {
        let request = Request { prompt: ids(&case["input_ids"]), params: SamplingParams::greedy(24) };
        let s = spec.generate(std::slice::from_ref(&request)).unwrap().remove(0);
        let p = plain.generate(std::slice::from_ref(&request)).unwrap().remove(0);
        assert_eq!(s.tokens, p.tokens, "{}", case["id"]);
        let golden_tokens = ids(&case["expected"]["output_tokens"]);
        drift.push(s.tokens.iter().zip(&golden_tokens).position(|(a, b)| a != b));
    }
    eprintln!("bf16 first divergence from the f32 reference per prompt: {drift:?}");
    assert!(drift.iter().all(|d| d.is_none_or(|i| i >= 1)), "{drift:?}");
}
