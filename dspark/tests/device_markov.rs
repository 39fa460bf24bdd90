//! The device Markov pass (the one CUDA runs by default), exercised on the CPU with the trained
//! pair in f32 against the host pass: greedy speculative output still equals target-only output,
//! and with the same seeds the sampled outputs equal the host pass's (its tokens are drawn from
//! the same corrected logits with the same coins).
#![allow(clippy::unwrap_used)]

mod common;

use common::{heldout_prompts, tau};
use dspark::{DSparkDraft, Engine, EngineConfig, Qwen3, Request, SamplingParams};

fn target() -> Qwen3 {
    common::trained_target()
}

fn draft(target: &Qwen3) -> DSparkDraft {
    common::trained_draft(target)
}

fn engine(device_markov: bool) -> Engine {
    let t = target();
    let mut d = draft(&t);
    assert_eq!(d.set_device_markov(device_markov), device_markov, "the shipped draft has a vanilla head");
    // The confidence head with the device pass (the default where the kernels run).
    assert_eq!(d.set_device_confidence(true), device_markov);
    Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap()
}

/// The draft with `n` sequences whose context is the first held-out prompt's target features,
/// and the prompt's last token (the anchor of a first proposal).
fn draft_after_prompt(n: usize) -> (DSparkDraft, Vec<dspark::SeqId>, u32) {
    draft_after_prompt_as(n, false)
}

/// [`draft_after_prompt`], with the draft quantised to FP8 (its projections and Markov `W2`)
/// when `fp8`.
fn draft_after_prompt_as(n: usize, fp8: bool) -> (DSparkDraft, Vec<dspark::SeqId>, u32) {
    use dspark::Speculator;
    let t = target();
    let mut d = draft(&t);
    if fp8 {
        d.quantize(dspark::model::fp8::DraftQuant::Fp8PerChannel).unwrap();
        assert!(d.has_fp8_markov());
    }
    let layers = d.feature_layers().to_vec();
    let (features, anchor) = common::heldout_prompt_features(&t, &layers);
    let seqs: Vec<_> = (0..n).map(|_| d.begin()).collect();
    for &s in &seqs {
        d.extend_context(s, features.clone()).unwrap();
    }
    (d, seqs, anchor)
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

#[test]
fn device_markov_proposals_match_the_host_pass() {
    // The draft as shipped, then quantised (its W2 too: the host pass must use the same
    // dequantised W2 as the device pass).
    for fp8 in [false, true] {
        proposals_match_the_host_pass(fp8);
    }
}

fn proposals_match_the_host_pass(fp8: bool) {
    use dspark::{ProposeLane, Speculator};
    let (mut d, seqs, anchor) = draft_after_prompt_as(1, fp8);
    // With the device pass, the confidence head runs on the device too (the CPU body of its
    // kernel): its confidences against the host's f64 ones.
    d.set_device_confidence(true);
    let dseq = seqs[0];
    let greedy = SamplingParams::greedy(8);
    let sampled = SamplingParams { temperature: 0.8, seed: 3, ..SamplingParams::greedy(8) };
    for params in [&greedy, &sampled] {
        let lane = [ProposeLane { seq: dseq, anchor, params }];
        d.set_device_markov(true);
        let on = d.propose(&lane).unwrap().remove(0);
        d.set_device_markov(false);
        let off = d.propose(&lane).unwrap().remove(0);
        assert_eq!(on.tokens, off.tokens, "fp8 {fp8}, T = {}", params.temperature);
        let (c_on, c_off) = (on.confidence.unwrap(), off.confidence.unwrap());
        let dc = c_on.iter().zip(&c_off).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(dc < 1e-5, "confidence differs by {dc}: {c_on:?} vs {c_off:?}");
        if let (Some(q_on), Some(q_off)) = (&on.q, &off.q) {
            let dq = q_on
                .iter()
                .flatten()
                .zip(q_off.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(dq < 1e-6, "q differs by {dq}");
        } else {
            assert!(params.is_greedy() && on.q.is_none() && off.q.is_none());
        }
    }
}

#[test]
fn a_mixed_batch_draws_each_lane_as_alone() {
    // A greedy and a sampling lane in one proposal (the device pass draws both in one launch per
    // step, the greedy one by its argmax words): each lane's tokens are those it gets alone and
    // those of the host pass, and only the sampling lane has a q.
    use dspark::{ProposeLane, Speculator};
    let (mut d, seqs, anchor) = draft_after_prompt(2);
    let (a, b) = (seqs[0], seqs[1]);
    let greedy = SamplingParams::greedy(8);
    let sampled = SamplingParams { temperature: 1.1, seed: 21, ..SamplingParams::greedy(8) };
    let both =
        [ProposeLane { seq: a, anchor, params: &greedy }, ProposeLane { seq: b, anchor, params: &sampled }];
    d.set_device_markov(true);
    let together = d.propose(&both).unwrap();
    let alone: Vec<_> = both.iter().map(|l| d.propose(std::slice::from_ref(l)).unwrap().remove(0)).collect();
    d.set_device_markov(false);
    let host = d.propose(&both).unwrap();
    for (i, ((x, y), z)) in together.iter().zip(&alone).zip(&host).enumerate() {
        assert_eq!(x.tokens, y.tokens, "lane {i}: batched and alone differ");
        assert_eq!(x.tokens, z.tokens, "lane {i}: device and host passes differ");
        assert_eq!(x.q.is_some(), i == 1, "lane {i}: q only for the sampling lane");
    }
    let (q, q_host) = (together[1].q.as_ref().unwrap(), host[1].q.as_ref().unwrap());
    let dq = q.iter().flatten().zip(q_host.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(dq < 1e-6, "q differs from the host pass's by {dq}");
    for (k, (&x, row)) in together[1].tokens.iter().zip(q).enumerate() {
        assert!(row[x as usize] > 0.0, "step {k}: token {x} drawn outside q's support");
    }
}
