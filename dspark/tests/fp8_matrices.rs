//! FP8 weights kept as FP8 (`dspark_kernels::Fp8Matrix`, the GPU's storage) on the CPU, through
//! the plain-burn bodies (`dspark_kernels::fp8::set_fp8_reference`): FP8 checkpoints with block
//! and per-channel scales, fused and split projections, a draft quantised in place, and an FP8
//! copy of the LM head for the draft's base logits. What runs here is the model-side path the
//! CUDA kernel serves on the GPU (`gpu_golden.rs` repeats the engine checks there).
//!
//! The switch is process-wide, so every test takes one lock and sets it as it needs.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use common::fp8_ckpt::*;
use common::*;
use dspark::model::fp8::DraftQuant;
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, LoadOptions, Qwen3, Request, SamplingParams,
};

static SWITCH: Mutex<()> = Mutex::new(());

/// Hold the switch, set to `on`.
fn fp8_matrices(on: bool) -> MutexGuard<'static, ()> {
    let guard = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    dspark_kernels::fp8::set_fp8_reference(on);
    guard
}

/// Largest |a − b| relative to the largest |b|.
fn rel_max(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    max_abs_diff(a, b) / scale
}

#[test]
fn fp8_checkpoints_kept_as_fp8_compute_what_the_dequantised_draft_computes() {
    let t = target();
    for layout in [Layout::Blocks, Layout::PerChannel] {
        let (fp8_dir, _, _) = fp8_checkpoint(layout);
        let (mut dense, mut kept) = {
            let _off = fp8_matrices(false);
            let dense = load(fp8_dir.path(), &t).unwrap();
            drop(_off);
            let _on = fp8_matrices(true);
            (dense, load(fp8_dir.path(), &t).unwrap())
        };
        assert_eq!(dense.fp8_on_device(), 0, "{layout:?}: dequantised at load without the switch");
        assert_eq!(kept.fp8_on_device(), 15, "{layout:?}: every projection kept as FP8");
        assert_eq!(kept.fp8_weights(), dense.fp8_weights());
        // Same weights, summed in another order: f32 rounding apart.
        let _on = fp8_matrices(true);
        let (kh, kl) = block_outputs(&mut kept, &t);
        let (dh, dl) = block_outputs(&mut dense, &t);
        let (eh, el) = (rel_max(&kh, &dh), rel_max(&kl, &dl));
        eprintln!("{layout:?}: FP8 matrices vs dequantised weights: hidden {eh:.2e}, base logits {el:.2e}");
        assert!(eh < 1e-5 && el < 1e-5, "{layout:?}: hidden {eh:.2e}, logits {el:.2e}");
        assert!(kl.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn a_draft_quantised_in_place_equals_one_quantised_at_load() {
    let _on = fp8_matrices(true);
    let t = target();
    let dir = golden().join("tiny-dspark");
    let mut at_load = quantised(&dir, &t);
    let mut in_place = load(&dir, &t).unwrap();
    assert_eq!(in_place.fp8_on_device(), 0);
    in_place.quantize(DraftQuant::Fp8PerChannel).unwrap();
    assert_eq!(in_place.fp8_on_device(), 15);
    assert_eq!(at_load.fp8_on_device(), 15);
    assert_eq!(in_place.fp8_weights(), at_load.fp8_weights());
    // Per-channel scales of q, k and v are the same whether they are quantised apart (the CPU
    // loads them apart) or stacked (the loader stacks FP8 q/k/v): the same bytes, the same
    // weights; only the products' f32 summation order differs.
    let (ih, il) = block_outputs(&mut in_place, &t);
    let (ah, al) = block_outputs(&mut at_load, &t);
    assert!(rel_max(&ih, &ah) < 1e-5 && rel_max(&il, &al) < 1e-5);
    // Quantising again changes nothing.
    in_place.quantize(DraftQuant::Fp8PerChannel).unwrap();
    assert_eq!(block_outputs(&mut in_place, &t), (ih, il));
}

fn greedy_requests(n: usize) -> Vec<Request> {
    prompts().into_iter().map(|prompt| Request { prompt, params: SamplingParams::greedy(n) }).collect()
}

#[test]
fn an_fp8_lm_head_changes_proposals_only() {
    let _on = fp8_matrices(true);
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let reference = plain.generate(&greedy_requests(40)).unwrap();
    let (blocks, _, _) = fp8_checkpoint(Layout::Blocks);
    let t = target();
    let mut d = load(blocks.path(), &t).unwrap();
    let (_, before) = block_outputs(&mut d, &t);
    let bytes = d.quantize_lm_head().unwrap();
    assert!(d.has_fp8_lm_head());
    let [v, h] = t.lm_head().dims();
    assert_eq!(bytes, v * h + 4 * v, "one byte per weight and an f32 scale per row");
    let (_, after) = block_outputs(&mut d, &t);
    let diff = rel_max(&after, &before);
    eprintln!("FP8 LM head: base logits move by {diff:.3e} of their largest magnitude");
    assert!(diff > 0.0 && diff < 0.1, "base logits moved by {diff}");
    let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
    let out = e.generate(&greedy_requests(40)).unwrap();
    for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
        assert_eq!(o.tokens, r.tokens, "prompt {i}");
    }
}

#[test]
fn sampled_output_with_fp8_matrices_and_head_has_the_target_distribution() {
    let _on = fp8_matrices(true);
    let prompt = prompts()[0].clone();
    let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let model = target();
    let exact = stats::exact_second_token(&model, &prompt, &params, 0.0);
    let (channels, _, _) = fp8_checkpoint(Layout::PerChannel);
    let t = target();
    let mut d = load(channels.path(), &t).unwrap();
    assert_eq!(d.fp8_on_device(), 15);
    d.quantize_lm_head().unwrap();
    let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
    let counts = stats::second_token_counts(&mut e, &prompt, &params, 3000);
    let (stat, df) = stats::chi_square(&counts, &exact);
    let limit = stats::chi_square_limit(df);
    eprintln!("FP8 matrices + FP8 head, second token: chi2 {stat:.1} on {df} df (limit {limit:.1})");
    assert!(stat < limit, "chi2 {stat:.1} ≥ {limit:.1} on {df} df");
}

fn trained() -> PathBuf {
    common::models()
}

/// τ of the trained pair on its held-out prompts, greedy, with the draft as shipped, in FP8
/// (per-channel, quantised at load, kept as FP8 matrices) and in FP8 with an FP8 LM head.
#[test]
fn trained_pair_tau_with_fp8_matrices_and_an_fp8_head() {
    let _on = fp8_matrices(true);
    let requests: Vec<Request> = heldout_prompts(usize::MAX)
        .into_iter()
        .map(|prompt| Request { prompt, params: SamplingParams::greedy(64) })
        .collect();
    let target = || Qwen3::load(&trained().join("tiny-code-qwen3"), LoadOptions::default()).unwrap();
    let reference = Engine::new(target(), &EngineConfig::default()).unwrap().generate(&requests).unwrap();
    let mut taus = Vec::new();
    for (what, quant, head) in
        [("bf16 as shipped", false, false), ("fp8", true, false), ("fp8 + fp8 head", true, true)]
    {
        let t = target();
        let dir = trained().join("tiny-code-dspark");
        let cache = DraftCacheConfig::default();
        let mut d = if quant {
            DSparkDraft::load_quantized(&dir, &t, LoadOptions::default(), &cache, DraftQuant::Fp8PerChannel)
        } else {
            DSparkDraft::load(&dir, &t, LoadOptions::default(), &cache)
        }
        .unwrap();
        assert_eq!(d.fp8_on_device(), if quant { 15 } else { 0 });
        if head {
            d.quantize_lm_head().unwrap();
        }
        let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
        let out = e.generate(&requests).unwrap();
        let (mut generated, mut rounds) = (0, 0);
        for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
            assert_eq!(o.tokens, r.tokens, "{what}: prompt {i}");
            generated += o.tokens.len() - 1;
            rounds += o.stats.rounds;
        }
        let tau = generated as f64 / rounds as f64;
        eprintln!("trained pair, greedy, {} prompts × 64 tokens, draft {what}: tau {tau:.3}", requests.len());
        taus.push(tau);
    }
    assert!(taus[1] >= 2.5 && taus[2] >= 2.5, "fp8 tau below the pair's 2.5 floor: {taus:?}");
}

#[test]
fn a_random_draft_drawn_in_fp8_is_all_fp8_and_lossless() {
    let _on = fp8_matrices(true);
    let t = target();
    let config = dspark::DSparkConfig::from_dir(&golden().join("tiny-dspark")).unwrap();
    let layers = config.base.num_hidden_layers;
    let binding = dspark::TargetBinding::of(&t);
    let cache = DraftCacheConfig::default();
    let mut d =
        DSparkDraft::random_quantized(config.clone(), binding, &cache, DraftQuant::Fp8PerChannel, 3).unwrap();
    assert_eq!(d.fp8_on_device(), 7 * layers + 1);
    assert_eq!(d.fp8_weights().quantized_at_load, 7 * layers + 1);
    // Same seed, same draft; another seed, another draft.
    let again = DSparkDraft::random_quantized(
        config.clone(),
        dspark::TargetBinding::of(&t),
        &cache,
        DraftQuant::Fp8PerChannel,
        3,
    );
    let other = DSparkDraft::random_quantized(
        config,
        dspark::TargetBinding::of(&t),
        &cache,
        DraftQuant::Fp8PerChannel,
        4,
    );
    let (h, l) = block_outputs(&mut d, &t);
    assert!(l.iter().all(|v| v.is_finite()));
    assert_eq!(block_outputs(&mut again.unwrap(), &t), (h.clone(), l));
    assert_ne!(block_outputs(&mut other.unwrap(), &t).0, h);
    let reference =
        Engine::new(target(), &EngineConfig::default()).unwrap().generate(&greedy_requests(24)).unwrap();
    let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
    for (i, (o, r)) in e.generate(&greedy_requests(24)).unwrap().iter().zip(&reference).enumerate() {
        assert_eq!(o.tokens, r.tokens, "prompt {i}");
    }
}

#[test]
fn paired_fp8_gate_up_computes_what_the_stacked_one_does() {
    // `dspark_kernels::set_fp8_swiglu` (process-wide, like the FP8 switch: set under its lock;
    // on by default) pairs FP8 gate/up weights with per-row scales for the SwiGLU epilogue; on
    // the CPU the paired product runs its body. The same weights: block outputs apart by f32
    // rounding only, and greedy speculative output still equals target-only output. Block
    // scales stay stacked.
    let t = target();
    let plain =
        Engine::new(target(), &EngineConfig::default()).unwrap().generate(&greedy_requests(24)).unwrap();
    for layout in [Layout::PerChannel, Layout::Blocks] {
        let (dir, _, _) = fp8_checkpoint(layout);
        let _on = fp8_matrices(true);
        dspark_kernels::set_fp8_swiglu(false);
        let stacked = load(dir.path(), &t);
        dspark_kernels::set_fp8_swiglu(true);
        let mut stacked = stacked.unwrap();
        let mut paired = load(dir.path(), &t).unwrap();
        assert_eq!(paired.fp8_on_device(), 15, "{layout:?}: every projection still FP8");
        let layers = if layout == Layout::PerChannel { 2 } else { 0 };
        assert_eq!(paired.fp8_swiglu_layers(), layers, "{layout:?}: paired gate/up weights");
        assert_eq!(stacked.fp8_swiglu_layers(), 0);
        assert_eq!(paired.fp8_weights(), stacked.fp8_weights());
        let (ph, pl) = block_outputs(&mut paired, &t);
        let (sh, sl) = block_outputs(&mut stacked, &t);
        let (eh, el) = (rel_max(&ph, &sh), rel_max(&pl, &sl));
        eprintln!("{layout:?}: paired vs stacked gate/up: hidden {eh:.2e}, base logits {el:.2e}");
        assert!(eh < 1e-5 && el < 1e-5, "{layout:?}: hidden {eh:.2e}, logits {el:.2e}");
        let mut e = Engine::with_draft(target(), Box::new(paired), &EngineConfig::default()).unwrap();
        for (i, (o, r)) in e.generate(&greedy_requests(24)).unwrap().iter().zip(&plain).enumerate() {
            assert_eq!(o.tokens, r.tokens, "{layout:?}: prompt {i}");
        }
    }
}
