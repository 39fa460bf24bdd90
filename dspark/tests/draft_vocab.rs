//! A draft restricted to a draft vocabulary (`DSparkDraft::restrict_vocab`): still lossless
//! (greedy speculative = target-only; sampled output has the target's distribution), its
//! proposals only ever hold its tokens and their `q` is zero elsewhere, the device Markov pass
//! agrees with the host pass, and the FP8 head gives the same draft whichever is done first.
#![allow(clippy::unwrap_used)]

mod common;

use common::{golden, heldout_prompts, models, prompts, stats, tau, trained_draft, trained_target};
use dspark::{
    DSparkDraft, DraftCacheConfig, DraftVocab, Engine, EngineConfig, LoadOptions, ProposeLane, Qwen3,
    Request, SamplingParams, SeqId, Speculator,
};

/// The trained pair's draft restricted to its vocabulary's first `tokens` ids.
fn restricted(target: &Qwen3, tokens: usize, device_markov: bool) -> DSparkDraft {
    let mut d = trained_draft(target);
    assert_eq!(d.set_device_markov(device_markov), device_markov);
    d.set_device_confidence(true);
    let bytes = d.restrict_vocab(DraftVocab::leading(tokens, 4096).unwrap()).unwrap();
    assert_eq!(d.draft_vocab().map(DraftVocab::len), Some(tokens));
    // f32 on the CPU: `tokens` rows of 256.
    assert_eq!(bytes, tokens * 256 * 4);
    d
}

/// The draft with one sequence whose context is the first held-out prompt's target features,
/// and the prompt's last token.
fn after_prompt(target: &Qwen3, d: &mut DSparkDraft) -> (SeqId, u32) {
    let layers = d.feature_layers().to_vec();
    let (features, anchor) = common::heldout_prompt_features(target, &layers);
    let dseq = d.begin();
    d.extend_context(dseq, features).unwrap();
    (dseq, anchor)
}

#[test]
fn a_restricted_draft_is_lossless_on_the_trained_pair() {
    let prompts = heldout_prompts(4);
    let greedy: Vec<Request> =
        prompts.iter().map(|p| Request { prompt: p.clone(), params: SamplingParams::greedy(64) }).collect();
    let base = Engine::new(trained_target(), &EngineConfig::default()).unwrap().generate(&greedy).unwrap();
    let full = {
        let t = trained_target();
        let d = trained_draft(&t);
        Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap().generate(&greedy).unwrap()
    };
    let mut taus = Vec::new();
    for tokens in [1024, 2048] {
        let mut sampled_by_pass = Vec::new();
        for device_markov in [true, false] {
            let t = trained_target();
            let d = restricted(&t, tokens, device_markov);
            let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
            let out = e.generate(&greedy).unwrap();
            for (i, (x, b)) in out.iter().zip(&base).enumerate() {
                assert_eq!(x.tokens, b.tokens, "{tokens} tokens, device pass {device_markov}, prompt {i}");
            }
            taus.push((tokens, device_markov, tau(&out)));
            let sampled: Vec<Request> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| Request {
                    prompt: p.clone(),
                    params: SamplingParams {
                        temperature: 0.8,
                        seed: 40 + i as u64,
                        ..SamplingParams::greedy(48)
                    },
                })
                .collect();
            sampled_by_pass.push(e.generate(&sampled).unwrap());
        }
        // The device pass draws with the host pass's coins from the same rows: the same tokens.
        for (i, (x, y)) in sampled_by_pass[0].iter().zip(&sampled_by_pass[1]).enumerate() {
            assert_eq!(x.tokens, y.tokens, "{tokens} tokens, seed {}: device and host passes differ", 40 + i);
        }
    }
    eprintln!("greedy tau, whole vocabulary (4096): {:.3}", tau(&full));
    for (tokens, device, tau) in &taus {
        eprintln!("greedy tau, draft vocabulary {tokens} (device pass {device}): {tau:.3}");
    }
    // The restriction only removes choices: acceptance can fall, but the draft still drafts.
    assert!(taus.iter().all(|&(_, _, t)| t > 1.5), "{taus:?}");
}

#[test]
fn restricted_proposals_hold_only_draft_tokens_and_agree_between_passes() {
    let t = trained_target();
    let mut d = restricted(&t, 1024, true);
    let (seq, anchor) = after_prompt(&t, &mut d);
    let vocab = d.draft_vocab().unwrap().clone();
    let greedy = SamplingParams::greedy(8);
    let sampled = SamplingParams { temperature: 1.3, seed: 9, ..SamplingParams::greedy(8) };
    for params in [&greedy, &sampled] {
        let lane = [ProposeLane { seq, anchor, params }];
        d.set_device_markov(true);
        let on = d.propose(&lane).unwrap().remove(0);
        d.set_device_markov(false);
        let off = d.propose(&lane).unwrap().remove(0);
        assert_eq!(on.tokens, off.tokens, "T = {}", params.temperature);
        assert!(
            on.tokens.iter().all(|&x| vocab.contains(x)),
            "a token outside the draft vocabulary: {:?}",
            on.tokens
        );
        if let (Some(q_on), Some(q_off)) = (&on.q, &off.q) {
            for (k, (a, b)) in q_on.iter().zip(q_off).enumerate() {
                assert_eq!(a.len(), 4096, "q spans the whole vocabulary");
                let dq = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
                assert!(dq < 1e-6, "step {k}: q differs between passes by {dq}");
                let outside: f64 =
                    a.iter().enumerate().filter(|(t, _)| !vocab.contains(*t as u32)).map(|(_, p)| p).sum();
                assert_eq!(outside, 0.0, "step {k}: q puts mass outside the draft vocabulary");
                assert!((a.iter().sum::<f64>() - 1.0).abs() < 1e-9, "step {k}: q does not sum to 1");
                assert!(a[on.tokens[k] as usize] > 0.0, "step {k}: drawn outside q's support");
            }
        } else {
            assert!(params.is_greedy());
        }
    }
}

#[test]
fn the_fp8_head_and_the_restriction_commute() {
    // Per-row scales: quantising the head then keeping the draft rows gives the rows that
    // keeping them first and quantising gives, so the proposals are the same bit for bit.
    let t = trained_target();
    let vocab = DraftVocab::leading(1024, 4096).unwrap();
    let mut a = trained_draft(&t);
    a.quantize_lm_head().unwrap();
    a.restrict_vocab(vocab.clone()).unwrap();
    let mut b = trained_draft(&t);
    b.restrict_vocab(vocab).unwrap();
    b.quantize_lm_head().unwrap();
    assert!(a.has_fp8_lm_head() && b.has_fp8_lm_head());
    let params = SamplingParams { temperature: 0.9, seed: 5, ..SamplingParams::greedy(8) };
    let (sa, anchor) = after_prompt(&t, &mut a);
    let (sb, _) = after_prompt(&t, &mut b);
    let pa = a.propose(&[ProposeLane { seq: sa, anchor, params: &params }]).unwrap().remove(0);
    let pb = b.propose(&[ProposeLane { seq: sb, anchor, params: &params }]).unwrap().remove(0);
    assert_eq!(pa.tokens, pb.tokens);
    assert_eq!(pa.q, pb.q);
}

#[test]
fn bad_restrictions_are_errors() {
    let t = trained_target();
    let mut d = trained_draft(&t);
    let err = d.restrict_vocab(DraftVocab::leading(64, 512).unwrap()).unwrap_err();
    assert!(err.to_string().contains("512"), "{err}");
    assert!(d.draft_vocab().is_none(), "a refused restriction changes nothing");
    d.restrict_vocab(DraftVocab::leading(128, 4096).unwrap()).unwrap();
    let err = d.restrict_vocab(DraftVocab::leading(256, 4096).unwrap()).unwrap_err();
    assert!(err.to_string().contains("already"), "{err}");
    assert_eq!(d.draft_vocab().map(DraftVocab::len), Some(128));
}

#[test]
fn sampled_output_of_a_restricted_draft_has_the_target_distribution() {
    // The golden pair (vocabulary 512) with the draft restricted to 64 tokens: the 24 likeliest
    // second tokens at T = 1 (ranked as counts of traffic would rank them) and the lowest ids.
    // Much of the target's mass lies outside, so acceptances, rejections and corrections
    // outside the draft vocabulary all happen; the output must still follow the target exactly.
    let target = || Qwen3::load(&golden().join("tiny-qwen3"), LoadOptions::default()).unwrap();
    let prompt = prompts()[0].clone();
    let model = target();
    let t = target();
    let mut d = DSparkDraft::load(
        &golden().join("tiny-dspark"),
        &t,
        LoadOptions::default(),
        &DraftCacheConfig::default(),
    )
    .unwrap();
    let ranking = stats::exact_second_token(&model, &prompt, &SamplingParams::default(), 0.0);
    let counts: Vec<u64> = ranking.iter().map(|p| (p * 1e9) as u64).collect();
    let vocab = DraftVocab::most_frequent(&counts, 24).unwrap();
    assert_eq!(vocab.len(), 64);
    d.restrict_vocab(vocab.clone()).unwrap();
    let mut e = Engine::with_draft(t, Box::new(d), &EngineConfig::default()).unwrap();
    for params in [
        SamplingParams { temperature: 1.0, ..SamplingParams::default() },
        SamplingParams { temperature: 0.7, top_k: 20, ..SamplingParams::default() },
    ] {
        let exact = stats::exact_second_token(&model, &prompt, &params, 0.0);
        let outside: f64 =
            exact.iter().enumerate().filter(|(t, _)| !vocab.contains(*t as u32)).map(|(_, p)| p).sum();
        let counts = stats::second_token_counts(&mut e, &prompt, &params, 3000);
        let (stat, df) = stats::chi_square(&counts, &exact);
        let limit = stats::chi_square_limit(df);
        eprintln!(
            "restricted draft {params:?}: chi2 {stat:.1} on {df} df (limit {limit:.1}); target mass outside the draft vocabulary {outside:.3}"
        );
        assert!(stat < limit, "restricted draft: chi2 {stat:.1} > {limit:.1} ({df} df)");
        assert!(outside > 0.05, "the restriction must matter for this test: {outside}");
        let s = e.last_stats();
        assert!(s.accepted > 0 && s.accepted < s.drafted, "the acceptance rule was not exercised: {s:?}");
    }
}

#[test]
fn restricted_base_logits_are_the_whole_vocabulary_columns() {
    // The block's base logits over a draft vocabulary are the whole vocabulary's logits at its
    // tokens, for each way the CPU holds the LM head (packed f32 rows; bf16 through burn).
    let dir = models();
    for dtype in [dspark::ComputeDtype::F32, dspark::ComputeDtype::Bf16] {
        let opts = || LoadOptions { dtype, ..LoadOptions::default() };
        let t = Qwen3::load(&dir.join("tiny-code-qwen3"), opts()).unwrap();
        let load = || {
            DSparkDraft::load(&dir.join("tiny-code-dspark"), &t, opts(), &DraftCacheConfig::default())
                .unwrap()
        };
        let (mut full, mut part) = (load(), load());
        let vocab = DraftVocab::new((0..4096).filter(|t| t % 3 == 1), 4096).unwrap();
        part.restrict_vocab(vocab.clone()).unwrap();
        let (sf, anchor) = after_prompt(&t, &mut full);
        let (sp, _) = after_prompt(&t, &mut part);
        let (_, lf) = full.block_forward(&[(sf, anchor)]).unwrap();
        let (_, lp) = part.block_forward(&[(sp, anchor)]).unwrap();
        assert_eq!(lp.dims(), [8, vocab.len()], "{dtype:?}");
        let read = |t: burn::tensor::Tensor<2>| t.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
        let (lf, lp) = (read(lf), read(lp));
        let mut worst = 0.0f32;
        for r in 0..8 {
            for (i, &tok) in vocab.ids().iter().enumerate() {
                let (a, b) = (lf[r * 4096 + tok as usize], lp[r * vocab.len() + i]);
                worst = worst.max((a - b).abs() / a.abs().max(1.0));
            }
        }
        eprintln!("{dtype:?}: restricted base logits within {worst:e} of the whole vocabulary's");
        assert!(worst < 1e-2, "{dtype:?}: {worst}");
    }
}
