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
use dspark::{ComputeDtype, DeviceKind, Engine, EngineConfig, Request, SamplingParams};

const CUDA: DeviceKind = DeviceKind::Cuda(0);

#[test]
fn cuda_f32_prefill_matches_golden() {
    let d = checks::prefill_diffs(CUDA, ComputeDtype::F32);
    println!("cuda f32 prefill: {d:?}");
    assert!(d.logits_abs <= 5e-4, "{d:?}");
    assert!(d.features_rel <= 2e-5 && d.hidden_rel <= 2e-5, "{d:?}");
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
        println!("cuda {dtype}: batched == alone for {same}/{} requests", requests.len());
        if dtype == ComputeDtype::F32 {
            assert_eq!(same, requests.len());
        }
    }
}
