//! GPU suite (feature `cuda`, run on the GPU machine, never in CI): the CPU golden checks of the
//! target, on CUDA in f32 and bf16.
//!
//! ```text
//! CUDARC_CUDA_VERSION=13000 cargo test --release --features cuda -p dspark --test gpu_golden
//! ```
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, Engine, EngineConfig, LoadOptions, Qwen3,
    Request, SamplingParams,
};

const CUDA: DeviceKind = DeviceKind::Cuda(0);

#[test]
fn cuda_f32_prefill_matches_golden() {
    // burn 0.22's CUDA matmul runs f32 through TF32 tensor cores (10-bit mantissa), measured
    // 2026-12-02 on the H200 at ≈0.36% of the largest logit (0.06 abs of 18). Stated bound: 1%.
    // Greedy tokens still match the golden ones exactly (next test).
    let d = checks::prefill_diffs(CUDA, ComputeDtype::F32);
    println!("cuda f32 prefill: {d:?}");
    assert!(d.logits_rel <= 0.01, "{d:?}");
    assert!(d.features_rel <= 0.01 && d.hidden_rel <= 0.01, "{d:?}");
}

#[test]
fn cuda_f32_greedy_matches_golden_single_and_sharded() {
    for sharded in [false, true] {
        let diverged = checks::greedy_divergence(CUDA, ComputeDtype::F32, sharded);
        println!("cuda f32 greedy (sharded={sharded}) first divergence: {diverged:?}");
        assert!(diverged.iter().all(Option::is_none), "{diverged:?}");
    }
}

#[test]
fn cuda_bf16_within_the_stated_tolerance() {
    let d = checks::prefill_diffs(CUDA, ComputeDtype::Bf16);
    println!("cuda bf16 prefill: {d:?}");
    assert!(d.logits_rel <= 0.08 && d.features_rel <= 0.08 && d.hidden_rel <= 0.08, "{d:?}");
    let diverged = checks::greedy_divergence(CUDA, ComputeDtype::Bf16, false);
    println!("cuda bf16 greedy first divergence per prompt: {diverged:?}");
    assert!(diverged.iter().all(|d| d.is_none_or(|i| i >= 1)), "{diverged:?}");
}

#[test]
fn cuda_batched_generation_equals_one_at_a_time() {
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        let mut engine =
            Engine::new(checks::target_on(CUDA, dtype, false), &EngineConfig::default()).unwrap();
        let requests: Vec<Request> = prompts()
            .into_iter()
            .enumerate()
            .map(|(i, prompt)| Request {
                prompt,
                params: SamplingParams {
                    temperature: if i == 1 { 0.0 } else { 0.9 },
                    seed: 99 + i as u64,
                    max_new_tokens: 16,
                    ..SamplingParams::default()
                },
            })
            .collect();
        let together = engine.generate(&requests).unwrap();
        let mut same = 0;
        for (i, r) in requests.iter().enumerate() {
            let alone = engine.generate(std::slice::from_ref(r)).unwrap();
            same += usize::from(alone[0].tokens == together[i].tokens);
        }
        // Stock burn kernels pick different matmul tilings for different row counts, so logits
        // are not bitwise batch-invariant on CUDA and a sampled lane can flip a near-tie. Greedy
        // lanes must agree; batch-invariant kernels are the CUDA hot-path work.
        println!("cuda {dtype}: batched == alone for {same}/{} requests", requests.len());
        let greedy = 1;
        let alone = engine.generate(std::slice::from_ref(&requests[greedy])).unwrap();
        if dtype == ComputeDtype::F32 {
            assert_eq!(alone[0].tokens, together[greedy].tokens, "greedy lane");
        }
    }
}

#[test]
fn cuda_f32_draft_block_matches_golden() {
    // Both layouts, every draft_block case: context projection, block hidden, base logits on the
    // device; Markov pass and confidence on the host from those. Same TF32 bound as the target.
    let d = checks::draft_block_diffs(CUDA, ComputeDtype::F32);
    println!("cuda f32 draft block: {d:?}");
    assert!(d.cases > 0 && d.tokens_equal, "{d:?}");
    assert!(d.context_rel <= 0.01 && d.hidden_rel <= 0.01 && d.base_rel <= 0.01, "{d:?}");
    assert!(d.corrected_rel <= 0.01 && d.confidence_abs <= 0.01, "{d:?}");
}

fn spec_engine(dtype: ComputeDtype, layout: &str, verify: dspark::VerifyPolicy) -> Engine {
    let target = checks::target_on(CUDA, dtype, false);
    let options = dspark::LoadOptions { device: CUDA, dtype, progress: None };
    let draft =
        dspark::DSparkDraft::load(&golden().join(layout), &target, options, &Default::default()).unwrap();
    let config = EngineConfig { verify, ..EngineConfig::default() };
    Engine::with_draft(target, Box::new(draft), &config).unwrap()
}

#[test]
fn cuda_f32_spec_greedy_matches_golden() {
    spec_greedy(ComputeDtype::F32, true);
}

#[test]
fn cuda_bf16_spec_greedy_behaviour() {
    spec_greedy(ComputeDtype::Bf16, false);
}

fn spec_greedy(dtype: ComputeDtype, strict: bool) {
    let mut plain = Engine::new(checks::target_on(CUDA, dtype, false), &EngineConfig::default()).unwrap();
    // Target-only output per prompt, generated once: on CUDA every new shape pays NVRTC
    // compilation, so the suite avoids repeating work.
    let mut target_only_of = std::collections::HashMap::<Vec<u32>, Vec<u32>>::new();
    for layout in ["tiny-dspark", "tiny-dspark-specforge"] {
        for (kind, verify) in [
            ("spec_greedy", dspark::VerifyPolicy::Full),
            ("spec_greedy_threshold", dspark::VerifyPolicy::Threshold(0.5)),
        ] {
            let mut e = spec_engine(dtype, layout, verify);
            for case in cases_of(kind) {
                let prompt = ids(&case["input_ids"]);
                let request = Request { prompt, params: SamplingParams::greedy(24) };
                let spec = e.generate(std::slice::from_ref(&request)).unwrap().remove(0);
                let target_only = target_only_of.entry(request.prompt.clone()).or_insert_with(|| {
                    plain.generate(std::slice::from_ref(&request)).unwrap().remove(0).tokens
                });
                let golden_tokens = ids(&case["expected"]["output_tokens"]);
                let vs_golden = spec.tokens.iter().zip(&golden_tokens).position(|(a, b)| a != b);
                let vs_target = spec.tokens.iter().zip(target_only.iter()).position(|(a, b)| a != b);
                let rounds: Vec<usize> = spec.stats.round_log.iter().map(|r| r.accepted).collect();
                println!(
                    "cuda {dtype} {layout} {}: first divergence vs golden {vs_golden:?}, vs target-only {vs_target:?}, accepted per round {rounds:?}",
                    case["id"]
                );
                // Always: a full generation whose rounds advance by accepted + 1.
                assert_eq!(spec.tokens.len(), 24);
                for w in spec.stats.round_log.windows(2) {
                    assert_eq!(w[1].position, w[0].position + w[0].accepted + 1);
                }
                // bf16 is reported, not held to the f32 golden tokens: verify (many rows) and
                // decode (one row) round differently with stock kernels, which can flip a
                // near-tie between speculative and target-only output.
                if strict {
                    assert_eq!(vs_golden, None, "{}", case["id"]);
                    let limit = request.prompt.len() + 23;
                    let exp: Vec<(usize, usize)> = case["expected"]["rounds"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|r| {
                            (
                                r["anchor_position"].as_u64().unwrap() as usize,
                                r["accepted"].as_u64().unwrap() as usize,
                            )
                        })
                        .filter(|(pos, _)| *pos < limit)
                        .collect();
                    let ours: Vec<(usize, usize)> = spec
                        .stats
                        .round_log
                        .iter()
                        .map(|r| (r.position, r.accepted))
                        .take(exp.len())
                        .collect();
                    assert_eq!(ours, exp, "{}", case["id"]);
                }
            }
        }
    }
}

/// The trained pair of `models/` (`DSPARK_MODELS` overrides the path, for binaries run on the
/// GPU machine).
fn models() -> std::path::PathBuf {
    std::env::var_os("DSPARK_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

#[test]
fn cuda_bf16_trained_pair_greedy_speculative_equals_target_only() {
    // bf16 on CUDA runs the skinny GEMM (every projection and the LM head) and the paged
    // attention kernel (head_dim 64): both reduce a row in an order that does not depend on how
    // many rows share the call, so a verify window reproduces one-row decoding bit for bit and
    // greedy speculative output must equal target-only output token for token, as in f32.
    let opts = || LoadOptions { device: CUDA, dtype: ComputeDtype::Bf16, progress: None };
    let target = || Qwen3::load(&models().join("tiny-code-qwen3"), opts()).unwrap();
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let t = target();
    let draft =
        DSparkDraft::load(&models().join("tiny-code-dspark"), &t, opts(), &DraftCacheConfig::default())
            .unwrap();
    let mut spec = Engine::with_draft(t, Box::new(draft), &EngineConfig::default()).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(models().join("report.json")).unwrap()).unwrap();
    let cases = report["draft"]["eval"]["rust_crosscheck_T0"].as_array().unwrap().clone();
    let requests: Vec<Request> = cases
        .iter()
        .take(4)
        .map(|c| Request {
            prompt: serde_json::from_value(c["prompt_ids"].clone()).unwrap(),
            params: SamplingParams::greedy(96),
        })
        .collect();
    let (mut accepted, mut rounds) = (0usize, 0usize);
    for (i, request) in requests.iter().enumerate() {
        let a = plain.generate(std::slice::from_ref(request)).unwrap().remove(0);
        let b = spec.generate(std::slice::from_ref(request)).unwrap().remove(0);
        accepted += b.stats.round_log.iter().map(|r| r.accepted).sum::<usize>();
        rounds += b.stats.round_log.len();
        let first = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y);
        println!(
            "cuda bf16 trained pair, prompt {i}: first divergence {first:?}, {} rounds",
            b.stats.round_log.len()
        );
        assert_eq!(first, None, "prompt {i}: speculative and target-only greedy outputs differ");
        assert_eq!(a.tokens.len(), b.tokens.len());
    }
    println!("cuda bf16 trained pair: tau {:.3}", (accepted + rounds) as f64 / rounds as f64);
}
