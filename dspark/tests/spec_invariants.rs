//! Invariants of the speculative engine on the tiny golden models (f32, CPU): greedy output
//! equals target-only greedy output for every verify width, null and oracle drafts behave as
//! they must, and sampled output has the target's distribution.
#![allow(clippy::unwrap_used)]

mod common;

use burn::tensor::Tensor;
use common::*;
use std::sync::Arc;

use dspark::engine::schedule::{CostMeta, CostTable, DraftCost, VerifyCost};
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, KvCache, LoadOptions, Proposal, ProposeLane, Qwen3,
    Request, SamplingParams, SeqId, Speculator, VerifyPolicy,
};

fn target() -> Qwen3 {
    Qwen3::load(&golden().join("tiny-qwen3"), LoadOptions::default()).unwrap()
}

fn draft(target: &Qwen3) -> DSparkDraft {
    DSparkDraft::load(
        &golden().join("tiny-dspark"),
        target,
        LoadOptions::default(),
        &DraftCacheConfig::default(),
    )
    .unwrap()
}

fn spec_engine(verify: VerifyPolicy) -> Engine {
    spec_engine_with(verify, None)
}

fn spec_engine_with(verify: VerifyPolicy, cost_table: Option<CostTable>) -> Engine {
    let t = target();
    let d = draft(&t);
    let config = EngineConfig { verify, cost_table: cost_table.map(Arc::new), ..EngineConfig::default() };
    Engine::with_draft(t, Box::new(d), &config).unwrap()
}

/// A synthetic cost table: a draft round of 1 ms, a verify step of `1 + slope·T` ms for T rows.
fn cost_table(slope: f64) -> CostTable {
    let verify = vec![VerifyCost::new(1, 1.0 + slope), VerifyCost::new(4096, 1.0 + slope * 4096.0)];
    CostTable::new(CostMeta::default(), verify, vec![DraftCost { lanes: 1, ms: 1.0 }]).unwrap()
}

fn greedy_requests(n: usize) -> Vec<Request> {
    prompts().into_iter().map(|prompt| Request { prompt, params: SamplingParams::greedy(n) }).collect()
}

#[test]
fn greedy_speculative_equals_greedy_target_only_for_every_verify_width() {
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let reference = plain.generate(&greedy_requests(40)).unwrap();
    let mut policies: Vec<VerifyPolicy> = (1..=5).map(VerifyPolicy::Fixed).collect();
    policies.extend([VerifyPolicy::Full, VerifyPolicy::Threshold(0.5), VerifyPolicy::Threshold(0.9)]);
    for policy in policies {
        let mut e = spec_engine(policy);
        // All prompts in one batch: lanes verify different widths in one ragged forward.
        let out = e.generate(&greedy_requests(40)).unwrap();
        for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
            assert_eq!(o.tokens, r.tokens, "{policy:?} prompt {i}");
            // Round positions advance by exactly accepted + 1.
            for w in o.stats.round_log.windows(2) {
                assert_eq!(w[1].position, w[0].position + w[0].accepted + 1, "{policy:?}");
            }
            if let VerifyPolicy::Fixed(w) = policy {
                assert!(o.stats.round_log.iter().all(|r| r.drafted.len() == w - 1), "{policy:?}");
            }
        }
        assert_eq!(e.cache().bytes_used(), 0, "{policy:?}: target KV freed");
    }
    // The throughput scheduler, with verification priced steeply (few drafts verified) and
    // almost free (all verified).
    for slope in [2.0, 1e-6] {
        let mut e = spec_engine_with(VerifyPolicy::Throughput, Some(cost_table(slope)));
        let out = e.generate(&greedy_requests(40)).unwrap();
        for (i, (o, r)) in out.iter().zip(&reference).enumerate() {
            assert_eq!(o.tokens, r.tokens, "throughput slope {slope}, prompt {i}");
        }
        let (rounds, drafted): (usize, usize) =
            out.iter().fold((0, 0), |(r, d), o| (r + o.stats.rounds, d + o.stats.drafted));
        eprintln!("throughput slope {slope}: {drafted} drafts verified in {rounds} lane-rounds");
        if slope > 1.0 {
            assert!(drafted < rounds * 4 / 2, "a steep cost must shrink the verify budget");
        } else {
            assert_eq!(drafted, rounds * 4, "free verification verifies every draft");
        }
    }
}

#[test]
fn throughput_policy_needs_a_cost_table() {
    let t = target();
    let d = draft(&t);
    let config = EngineConfig { verify: VerifyPolicy::Throughput, ..EngineConfig::default() };
    let err = Engine::with_draft(t, Box::new(d), &config).unwrap_err();
    assert!(matches!(err, dspark::Error::InvalidInput(_)), "{err}");
}

#[test]
fn null_draft_accepts_nothing_and_tau_is_one() {
    let mut e = spec_engine(VerifyPolicy::Fixed(1));
    let out = e.generate(&greedy_requests(20)).unwrap();
    for o in &out {
        assert_eq!(o.stats.drafted, 0);
        assert_eq!(o.stats.accepted, 0);
        assert_eq!(o.stats.rounds, 19);
        assert!((o.stats.tau - 1.0).abs() < 1e-12);
    }
}

/// A draft that proposes the target's own greedy continuation (known in advance).
struct Oracle {
    gamma: usize,
    /// Full greedy sequence (prompt + continuation) per lane, by draft sequence id.
    sequences: Vec<Vec<u32>>,
    lengths: Vec<usize>,
}

impl Speculator for Oracle {
    fn block_size(&self) -> usize {
        self.gamma
    }
    fn feature_layers(&self) -> &[usize] {
        &[1, 3]
    }
    fn has_confidence(&self) -> bool {
        false
    }
    fn begin(&mut self) -> SeqId {
        self.lengths.push(0);
        (self.lengths.len() - 1) as SeqId
    }
    fn context_len(&self, seq: SeqId) -> dspark::Result<usize> {
        Ok(self.lengths[seq as usize])
    }
    fn extend_context(&mut self, seq: SeqId, features: Tensor<2>) -> dspark::Result<()> {
        self.lengths[seq as usize] += features.dims()[0];
        Ok(())
    }
    fn propose(&mut self, lanes: &[ProposeLane<'_>]) -> dspark::Result<Vec<Proposal>> {
        Ok(lanes
            .iter()
            .map(|l| {
                let s = &self.sequences[l.seq as usize];
                let at = self.lengths[l.seq as usize];
                assert_eq!(s[at], l.anchor, "the anchor is the committed token at L");
                Proposal {
                    tokens: s[at + 1..at + 1 + self.gamma].to_vec(),
                    q: None,
                    confidence: None,
                    q_rows: None,
                }
            })
            .collect())
    }
    fn end(&mut self, _seq: SeqId) -> dspark::Result<()> {
        Ok(())
    }
}

#[test]
fn oracle_draft_is_always_fully_accepted() {
    let gamma = 4;
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let long = plain.generate(&greedy_requests(24 + 2 * gamma)).unwrap();
    let sequences: Vec<Vec<u32>> =
        prompts().iter().zip(&long).map(|(p, g)| p.iter().chain(&g.tokens).copied().collect()).collect();
    for (i, seq) in sequences.iter().enumerate() {
        let oracle = Oracle { gamma, sequences: vec![seq.clone()], lengths: Vec::new() };
        let mut e = Engine::with_draft(target(), Box::new(oracle), &EngineConfig::default()).unwrap();
        let out = e
            .generate(&[Request { prompt: prompts()[i].clone(), params: SamplingParams::greedy(21) }])
            .unwrap();
        assert_eq!(out[0].tokens, long[i].tokens[..21]);
        // 1 token from prefill, then 4 rounds of γ + 1 = 5 tokens.
        assert_eq!(out[0].stats.rounds, 4);
        assert_eq!(out[0].stats.accepted, 16);
        assert_eq!(out[0].stats.accepted_per_position, vec![4; gamma]);
        assert!((out[0].stats.tau - 5.0).abs() < 1e-12);
    }
}

#[test]
fn sampled_speculative_is_reproducible_and_independent_of_the_batch() {
    let mut e = spec_engine(VerifyPolicy::Full);
    let requests: Vec<Request> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            prompt,
            params: SamplingParams {
                temperature: 0.8,
                top_k: if i == 1 { 50 } else { 0 },
                top_p: if i == 2 { 0.9 } else { 1.0 },
                seed: 17 + i as u64,
                max_new_tokens: 20,
                ..SamplingParams::default()
            },
        })
        .collect();
    let together = e.generate(&requests).unwrap();
    assert_eq!(together[0].tokens, e.generate(&requests).unwrap()[0].tokens);
    for (i, r) in requests.iter().enumerate() {
        let alone = e.generate(std::slice::from_ref(r)).unwrap();
        assert_eq!(alone[0].tokens, together[i].tokens, "request {i}");
    }
}

/// Wraps the real draft and reports a proposal distribution that makes every draft look
/// certain to be accepted (q(d) tiny): the chain rule then accepts without the ratio.
struct AlwaysAccept(DSparkDraft);

impl Speculator for AlwaysAccept {
    fn block_size(&self) -> usize {
        self.0.block_size()
    }
    fn feature_layers(&self) -> &[usize] {
        self.0.feature_layers()
    }
    fn has_confidence(&self) -> bool {
        self.0.has_confidence()
    }
    fn begin(&mut self) -> SeqId {
        self.0.begin()
    }
    fn context_len(&self, seq: SeqId) -> dspark::Result<usize> {
        self.0.context_len(seq)
    }
    fn extend_context(&mut self, seq: SeqId, features: Tensor<2>) -> dspark::Result<()> {
        self.0.extend_context(seq, features)
    }
    fn propose(&mut self, lanes: &[ProposeLane<'_>]) -> dspark::Result<Vec<Proposal>> {
        let mut out = self.0.propose(lanes)?;
        for p in &mut out {
            if let Some(q) = p.q.as_mut() {
                for (row, &d) in q.iter_mut().zip(&p.tokens) {
                    let rest = (1.0 - 1e-12) / (row.len() - 1) as f64;
                    row.iter_mut().for_each(|x| *x = rest);
                    row[d as usize] = 1e-12;
                }
            }
        }
        Ok(out)
    }
    fn end(&mut self, seq: SeqId) -> dspark::Result<()> {
        self.0.end(seq)
    }
}

#[test]
fn sampled_speculative_output_has_the_target_distribution_and_a_broken_rule_is_caught() {
    let prompt = prompts()[0].clone();
    let n = 3000;
    let settings = [
        SamplingParams { temperature: 1.0, ..SamplingParams::default() },
        SamplingParams { temperature: 0.7, top_k: 20, ..SamplingParams::default() },
        SamplingParams { temperature: 1.0, top_p: 0.8, ..SamplingParams::default() },
    ];
    let model = target();
    let mut e = spec_engine(VerifyPolicy::Full);
    for params in &settings {
        let exact = stats::exact_second_token(&model, &prompt, params, 0.0);
        let counts = stats::second_token_counts(&mut e, &prompt, params, n);
        let (stat, df) = stats::chi_square(&counts, &exact);
        let limit = stats::chi_square_limit(df);
        eprintln!("spec {params:?}: chi2 {stat:.1} on {df} df (limit {limit:.1})");
        assert!(
            stat < limit,
            "speculative sampling deviates from the target: chi2 {stat:.1} > {limit:.1} ({df} df)"
        );
        assert!(e.last_stats().drafted > 0);
    }
    // Under the throughput scheduler with a binding budget: the engine first runs a round so
    // every later lane's first round has a prior, and 250 lanes share each round's budget.
    let mut e = spec_engine_with(VerifyPolicy::Throughput, Some(cost_table(0.02)));
    e.generate(&greedy_requests(8)).unwrap();
    for params in &settings[..2] {
        let exact = stats::exact_second_token(&model, &prompt, params, 0.0);
        let counts = stats::second_token_counts(&mut e, &prompt, params, n);
        let (stat, df) = stats::chi_square(&counts, &exact);
        let limit = stats::chi_square_limit(df);
        let s = e.last_stats();
        eprintln!(
            "throughput {params:?}: chi2 {stat:.1} on {df} df (limit {limit:.1}); {} drafts verified of {}",
            s.drafted,
            s.draft_passes * 250 * 4
        );
        assert!(stat < limit, "throughput scheduler: chi2 {stat:.1} > {limit:.1} ({df} df)");
        assert!(s.drafted > 0 && s.drafted < s.draft_passes * 250 * 4, "the budget must bind: {s:?}");
    }
    // The same test must reject an engine whose acceptance ignores the ratio.
    let t = target();
    let d = draft(&t);
    let mut broken = Engine::with_draft(t, Box::new(AlwaysAccept(d)), &EngineConfig::default()).unwrap();
    let params = &settings[0];
    let exact = stats::exact_second_token(&model, &prompt, params, 0.0);
    let counts = stats::second_token_counts(&mut broken, &prompt, params, n);
    let (stat, df) = stats::chi_square(&counts, &exact);
    eprintln!("broken rule: chi2 {stat:.1} on {df} df (limit {:.1})", stats::chi_square_limit(df));
    assert!(stat > stats::chi_square_limit(df), "the test failed to catch a broken acceptance rule");
}

#[test]
fn sampled_tokens_past_the_first_round_have_the_target_distribution() {
    // The second-token tests above see only a round's first position. The third generated token
    // is the block's second draft, a bonus token or a later round's token depending on the
    // round; its exact marginal (every two-token prefix down to probability 1e-7, 0.9995 of the
    // mass for the golden pair) against 10 000 speculative samples.
    let prompt = prompts()[0].clone();
    let model = target();
    let mut e = spec_engine(VerifyPolicy::Full);
    for params in [
        SamplingParams { temperature: 1.0, ..SamplingParams::default() },
        SamplingParams { temperature: 0.7, top_k: 20, ..SamplingParams::default() },
    ] {
        let (exact, kept) = stats::exact_token_marginal(&model, &prompt, &params, 2, 1e-7);
        assert!(kept > 0.999, "{params:?}: exact marginal keeps only {kept}");
        let counts = stats::token_counts(&mut e, &prompt, &params, 10_000, 2);
        let (stat, df) = stats::chi_square(&counts, &exact);
        let limit = stats::chi_square_limit(df);
        eprintln!(
            "third token {params:?}: chi2 {stat:.1} on {df} df (limit {limit:.1}), mass kept {kept:.5}"
        );
        assert!(stat < limit, "third token deviates from the target: chi2 {stat:.1} > {limit:.1} ({df} df)");
        let s = e.last_stats();
        assert!(s.accepted > 0 && s.accepted < s.drafted, "the acceptance rule was not exercised: {s:?}");
    }
}
