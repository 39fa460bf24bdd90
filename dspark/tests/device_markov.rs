//! The device Markov pass (the one CUDA runs by default), exercised on the CPU with the trained
//! pair in f32 against the host pass: greedy speculative output still equals target-only output,
//! and with the same seeds the sampled outputs equal the host pass's (its tokens are drawn from
//! the same corrected logits with the same coins).
#![allow(clippy::unwrap_used)]

mod common;

use common::{heldout_prompts, models};
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, LoadOptions, Qwen3, Request, SamplingParams,
};

fn target() -> Qwen3 {
    Qwen3::load(&models().join("tiny-code-qwen3"), LoadOptions::default()).unwrap()
}

fn engine(device_markov: bool) -> Engine {
    let t = target();
    let mut d = DSparkDraft::load(
        &models().join("tiny-code-dspark"),
        &t,
        LoadOptions::default(),
        &DraftCacheConfig::default(),
    )
    .unwrap();
    assert_eq!(d.set_device_markov(device_markov), device_markov, "the shipped draft has a vanilla head");
    Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap()
}

fn tau(out: &[dspark::Generation]) -> f64 {
    let generated: usize = out.iter().map(|g| g.tokens.len() - 1).sum();
    let rounds: usize = out.iter().map(|g| g.stats.rounds).sum();
    generated as f64 / rounds as f64
}

#[test]
fn device_markov_pass_is_lossless_and_agrees_with_the_host_pass() {
    let prompts = heldout_prompts(4);
    let (mut on, mut off) = (engine(true), engine(false));
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();

    // Greedy: lossless, and acceptance as with the host pass.
    let greedy: Vec<Request> =
        prompts.iter().map(|p| Request { prompt: p.clone(), params: SamplingParams::greedy(64) }).collect();
    let (a, b, base) =
        (on.generate(&greedy).unwrap(), off.generate(&greedy).unwrap(), plain.generate(&greedy).unwrap());
    for (i, ((x, y), z)) in a.iter().zip(&b).zip(&base).enumerate() {
        assert_eq!(x.tokens, z.tokens, "prompt {i}: device-pass speculative differs from target-only");
        assert_eq!(y.tokens, z.tokens, "prompt {i}: host-pass speculative differs from target-only");
    }
    let (tau_on, tau_off) = (tau(&a), tau(&b));
    eprintln!("greedy tau: device pass {tau_on:.3}, host pass {tau_off:.3}");
    assert!((tau_on - tau_off).abs() <= 0.05 * tau_off, "device {tau_on} vs host {tau_off}");

    // Sampled at temperature 0.8, lanes together: the same tokens as the host pass, seed by seed.
    let sampled: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.clone(),
            params: SamplingParams { temperature: 0.8, seed: 100 + i as u64, ..SamplingParams::greedy(48) },
        })
        .collect();
    let (x, y) = (on.generate(&sampled).unwrap(), off.generate(&sampled).unwrap());
    for (i, (x, y)) in x.iter().zip(&y).enumerate() {
        assert_eq!(x.tokens, y.tokens, "seed {}: device and host Markov passes sampled differently", 100 + i);
    }
    eprintln!("sampled tau: device pass {:.3}, host pass {:.3}", tau(&x), tau(&y));
}
