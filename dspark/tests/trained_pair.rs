//! The small trained pair shipped in `models/` (see `models/README.md`): greedy speculative
//! output equals target-only output on held-out code and the PyTorch simulation it was
//! measured with, τ stays above a floor, and sampling at temperature 0.8 keeps the target's
//! distribution (f32, CPU).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::stats;
use dspark::text::Tokenizer;
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, LoadOptions, Qwen3, Request, SamplingParams,
};

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn target() -> Qwen3 {
    Qwen3::load(&models().join("tiny-code-qwen3"), LoadOptions::default()).unwrap()
}

fn spec_engine() -> Engine {
    spec_engine_with(&EngineConfig::default())
}

fn spec_engine_with(config: &EngineConfig) -> Engine {
    let t = target();
    let d = DSparkDraft::load(
        &models().join("tiny-code-dspark"),
        &t,
        LoadOptions::default(),
        &DraftCacheConfig::default(),
    )
    .unwrap();
    Engine::with_draft(t, Box::new(d), config).unwrap()
}

/// The held-out prompts of the shipped run's Rust cross-check, with the simulation's greedy
/// tokens and per-round accepted counts (`models/report.json`).
fn heldout() -> Vec<(Vec<u32>, Vec<u32>, Vec<usize>)> {
    let text = std::fs::read_to_string(models().join("report.json")).unwrap();
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    report["draft"]["eval"]["rust_crosscheck_T0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                serde_json::from_value(c["prompt_ids"].clone()).unwrap(),
                serde_json::from_value(c["tokens"].clone()).unwrap(),
                serde_json::from_value(c["accepted"].clone()).unwrap(),
            )
        })
        .collect()
}

/// One greedy request per held-out case, as long as the simulation's output.
fn greedy_requests(cases: &[(Vec<u32>, Vec<u32>, Vec<usize>)]) -> Vec<Request> {
    cases
        .iter()
        .map(|(prompt, tokens, _)| Request {
            prompt: prompt.clone(),
            params: SamplingParams::greedy(tokens.len()),
        })
        .collect()
}

#[test]
fn greedy_speculative_equals_target_only_and_the_simulation_on_heldout_code_with_a_tau_floor() {
    let cases = heldout();
    assert!(cases.len() >= 8);
    let requests = greedy_requests(&cases);
    let mut spec = spec_engine();
    let mut plain = Engine::new(target(), &EngineConfig::default()).unwrap();
    let fast = spec.generate(&requests).unwrap();
    let base = plain.generate(&requests).unwrap();
    let (mut generated, mut rounds) = (0, 0);
    for (i, ((f, b), (_, sim_tokens, sim_accepted))) in fast.iter().zip(&base).zip(&cases).enumerate() {
        assert_eq!(f.tokens, b.tokens, "prompt {i}: speculative differs from target-only");
        assert_eq!(&f.tokens, sim_tokens, "prompt {i}: differs from the PyTorch simulation");
        let accepted: Vec<usize> = f.stats.round_log.iter().map(|r| r.accepted).collect();
        assert_eq!(&accepted, sim_accepted, "prompt {i}: accepted per round");
        generated += f.tokens.len() - 1;
        rounds += f.stats.rounds;
    }
    let tau = generated as f64 / rounds as f64;
    eprintln!("trained pair, greedy, {} held-out prompts: tau {tau:.3}", cases.len());
    // Measured 3.236 on these prompts when the pair was shipped; the target is 2.5.
    assert!(tau >= 2.5, "tau {tau:.3} fell below the 2.5 floor");
}

#[test]
fn under_kv_pressure_and_the_throughput_scheduler_output_is_unchanged() {
    // The held-out requests through a speculative engine whose target pool is three pages larger
    // than the largest request needs alone (so lanes are queued, preempted and resumed), once
    // with full-width verification and once with the throughput scheduler on the committed CPU
    // cost table: every output equals the roomy run's, token for token.
    let cases = heldout();
    let requests = greedy_requests(&cases);
    let expected = spec_engine().generate(&requests).unwrap();
    let table = dspark::engine::schedule::CostTable::load(
        &models().join("../benches/results/cost-tables/cpu-tiny-code.json"),
    )
    .unwrap();
    let layout = target().kv_layout(16);
    let window = 9;
    let need = requests.iter().map(|r| (r.prompt.len() + r.params.max_new_tokens - 1 + window).div_ceil(16));
    let pages = need.max().unwrap() + 3;
    for verify in [dspark::VerifyPolicy::Full, dspark::VerifyPolicy::Throughput] {
        let config = EngineConfig {
            kv_budget_bytes: pages * layout.page_bytes(),
            page_size: 16,
            verify,
            cost_table: Some(std::sync::Arc::new(table.clone())),
            ..EngineConfig::default()
        };
        let mut e = spec_engine_with(&config);
        let out = e.generate(&requests).unwrap();
        for (i, (o, x)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(o.tokens, x.tokens, "{verify:?}, prompt {i}");
        }
        let s = e.last_stats();
        eprintln!(
            "{verify:?} in {pages} pages: {} preemptions, peak {} lanes, τ {:.2}",
            s.preemptions,
            s.peak_lanes,
            (s.generated_tokens - requests.len()) as f64
                / out.iter().map(|o| o.stats.rounds).sum::<usize>() as f64
        );
        assert!(s.preemptions > 0, "{verify:?}: the budget was meant to force preemption");
    }
}

#[test]
fn sampling_at_temperature_0_8_keeps_the_target_distribution() {
    // A held-out prompt, text through the shipped tokenizer.
    let tok = Tokenizer::from_dir(&models().join("tiny-code-qwen3")).unwrap();
    let prompt = tok.encode("def read_config(path):\n    with open(path) as f:\n        ", false).unwrap();
    let params = SamplingParams { temperature: 0.8, ..SamplingParams::default() };
    let model = target();
    // First tokens carrying all but 1e-6 of the mass: at most 0.003 expected samples unaccounted.
    let exact = stats::exact_second_token(&model, &prompt, &params, 1e-6);
    let n = 3000u64;
    let mut engine = spec_engine();
    let mut counts = vec![0usize; model.vocab_size()];
    let (mut drafted, mut accepted) = (0, 0);
    for batch in (0..n).collect::<Vec<_>>().chunks(500) {
        let requests: Vec<Request> = batch
            .iter()
            .map(|&seed| Request {
                prompt: prompt.clone(),
                params: SamplingParams { seed, max_new_tokens: 2, ..params.clone() },
            })
            .collect();
        for g in engine.generate(&requests).unwrap() {
            counts[g.tokens[1] as usize] += 1;
        }
        drafted += engine.last_stats().drafted;
        accepted += engine.last_stats().accepted;
    }
    let (stat, df) = stats::chi_square(&counts, &exact);
    let limit = stats::chi_square_limit(df);
    eprintln!(
        "trained pair, T=0.8: chi2 {stat:.1} on {df} df (limit {limit:.1}); {accepted} of {drafted} drafts accepted"
    );
    assert!(df >= 3, "too few bins for a meaningful test ({df} df)");
    assert!(accepted > 0 && accepted < drafted, "the acceptance rule was not exercised");
    assert!(stat < limit, "speculative sampling deviates from the target: chi2 {stat:.1} > {limit:.1}");
}
