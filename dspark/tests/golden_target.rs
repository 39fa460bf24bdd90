//! The Qwen3 target against the reference implementation's golden vectors (f32, CPU).
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use dspark::{
    ComputeDtype, DeviceKind, Engine, EngineConfig, FinishReason, KvCache, LoadOptions, LogitRows,
    PagedKvCache, Qwen3, Request, SamplingParams, SeqChunk,
};

fn target(sharded: bool) -> Qwen3 {
    let dir = golden().join(if sharded { "tiny-qwen3-sharded" } else { "tiny-qwen3" });
    Qwen3::load(&dir, LoadOptions::default()).unwrap()
}

fn cache_for(model: &Qwen3) -> PagedKvCache {
    PagedKvCache::new(model.kv_layout(16), 8 << 20, model.device()).unwrap()
}

#[test]
fn target_prefill_logits_features_and_hidden_states_match_golden() {
    // Tolerances suggested by the golden README for an f32 engine: logits atol 5e-4;
    // features and hidden states 2e-5 of the tensor's largest value.
    let d = checks::prefill_diffs(DeviceKind::Cpu, ComputeDtype::F32);
    assert!(d.logits_abs <= 5e-4, "{d:?}");
    assert!(d.features_rel <= 2e-5, "{d:?}");
    assert!(d.hidden_rel <= 2e-5, "{d:?}");
}

fn greedy_matches(sharded: bool) {
    let diverged = checks::greedy_divergence(DeviceKind::Cpu, ComputeDtype::F32, sharded);
    assert!(diverged.iter().all(Option::is_none), "first divergence per prompt: {diverged:?}");
}

#[test]
fn bf16_on_cpu_stays_within_the_stated_bf16_tolerance() {
    // bf16 weights and activations (norms and softmax in f32). The golden model's weights are
    // large (0.5·N(0,1), residual values up to ~600), so bf16 rounding compounds over 6 layers:
    // measured here ≈ 5% of the largest value for logits and hidden states. Stated bound: 8%.
    // Greedy may part ways from the f32 reference where top-2 margins are small (down to 0.025).
    let d = checks::prefill_diffs(DeviceKind::Cpu, ComputeDtype::Bf16);
    eprintln!("bf16 on cpu: {d:?}");
    assert!(d.logits_rel <= 0.08 && d.features_rel <= 0.08 && d.hidden_rel <= 0.08, "{d:?}");
    let diverged = checks::greedy_divergence(DeviceKind::Cpu, ComputeDtype::Bf16, false);
    eprintln!("bf16 on cpu, first greedy divergence per prompt: {diverged:?}");
    assert!(
        diverged.iter().all(|d| d.is_none_or(|i| i >= 1)),
        "the first greedy token must agree: {diverged:?}"
    );
}

#[test]
fn target_greedy_matches_golden_from_single_file() {
    greedy_matches(false);
}

#[test]
fn target_greedy_matches_golden_from_shards() {
    greedy_matches(true);
}

#[test]
fn batching_prompts_gives_the_same_results_as_one_at_a_time() {
    let model = target(false);
    let prompts = prompts();
    // Logits of a ragged prefill batch vs each prompt alone.
    let mut cache = cache_for(&model);
    let seqs: Vec<_> = prompts.iter().map(|_| cache.allocate()).collect();
    let chunks: Vec<SeqChunk<'_>> = prompts
        .iter()
        .zip(&seqs)
        .map(|(p, &seq)| SeqChunk { seq, tokens: p, logits: LogitRows::All })
        .collect();
    let batched = model.forward(&chunks, &[1, 3], &mut cache).unwrap();
    let all_logits = batched.logits.unwrap().into_data().try_to_vec::<f32>().unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let mut alone_cache = cache_for(&model);
        let seq = alone_cache.allocate();
        let alone = model
            .forward(&[SeqChunk { seq, tokens: p, logits: LogitRows::All }], &[1, 3], &mut alone_cache)
            .unwrap();
        let alone_logits = alone.logits.unwrap().into_data().try_to_vec::<f32>().unwrap();
        let rows = batched.logit_rows[i].clone();
        assert_close(
            &format!("prompt {i}"),
            &all_logits[rows.start * 512..rows.end * 512],
            &alone_logits,
            1e-4,
        );
    }
    // Tokens of a batched generate vs one request at a time, greedy and sampled.
    let mut engine = Engine::new(model, &EngineConfig::default()).unwrap();
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.clone(),
            params: SamplingParams {
                temperature: if i == 1 { 0.0 } else { 0.9 },
                top_k: if i == 2 { 40 } else { 0 },
                top_p: if i == 0 { 0.9 } else { 1.0 },
                seed: 1234 + i as u64,
                max_new_tokens: 10 + 3 * i,
                ..SamplingParams::default()
            },
        })
        .collect();
    let together = engine.generate(&requests).unwrap();
    for (i, r) in requests.iter().enumerate() {
        let alone = engine.generate(std::slice::from_ref(r)).unwrap();
        assert_eq!(together[i].tokens, alone[0].tokens, "request {i}");
    }
}

#[test]
fn sampling_is_reproducible_and_depends_on_the_seed() {
    let mut engine = Engine::new(target(false), &EngineConfig::default()).unwrap();
    let prompt = prompts()[0].clone();
    let run = |engine: &mut Engine, seed| {
        let params =
            SamplingParams { temperature: 1.0, seed, max_new_tokens: 16, ..SamplingParams::default() };
        engine.generate(&[Request { prompt: prompt.clone(), params }]).unwrap().remove(0).tokens
    };
    let a = run(&mut engine, 7);
    assert_eq!(a, run(&mut engine, 7));
    let others: Vec<_> = (8..12).map(|s| run(&mut engine, s)).collect();
    assert!(others.iter().any(|o| *o != a), "different seeds should not all give the same text");
}

#[test]
fn stop_tokens_end_generation_and_streaming_reports_every_token() {
    let mut engine = Engine::new(target(false), &EngineConfig::default()).unwrap();
    let case = &cases_of("target_greedy")[1];
    let prompt = ids(&case["input_ids"]);
    let expected = ids(&case["expected"]["tokens"]);
    let stop = expected[5];
    let first = expected.iter().position(|&t| t == stop).unwrap();
    let params = SamplingParams { stop_token_ids: vec![stop], ..SamplingParams::greedy(24) };
    let mut streamed = Vec::new();
    let mut finishes = Vec::new();
    let out = engine
        .generate_stream(&[Request { prompt, params }], &mut |ev| {
            streamed.extend_from_slice(ev.tokens);
            finishes.push(ev.finish);
        })
        .unwrap();
    assert_eq!(out[0].tokens, expected[..=first]);
    assert_eq!(out[0].finish, Some(FinishReason::Stop(stop)));
    assert_eq!(streamed, out[0].tokens);
    assert_eq!(finishes.last().copied().flatten(), Some(FinishReason::Stop(stop)));
    assert_eq!(finishes.iter().filter(|f| f.is_some()).count(), 1);
}

#[test]
fn score_returns_the_log_probability_of_every_next_token() {
    let mut engine = Engine::new(target(false), &EngineConfig::default()).unwrap();
    for case in cases_of("target_prefill") {
        let tokens = ids(&case["input_ids"]);
        let scores = engine.score(&tokens).unwrap();
        assert_eq!(scores.len(), tokens.len() - 1);
        let (logits, _) = tensor(&case["expected"]["logits"]);
        for (i, s) in scores.iter().enumerate() {
            let row = &logits[i * 512..(i + 1) * 512];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let expected = row[tokens[i + 1] as usize] as f64 - lse;
            assert!((*s as f64 - expected).abs() < 5e-4, "{} row {i}: {s} vs {expected}", case["id"]);
        }
    }
    assert!(engine.score(&[5]).is_err());
}

#[test]
fn kv_budget_exhaustion_is_a_typed_error_and_leaves_other_sequences_intact() {
    let model = target(false);
    let layout = model.kv_layout(4);
    // Room for 16 pages of 4 rows = 64 rows.
    let mut cache = PagedKvCache::new(layout, 16 * layout.page_bytes() + 7, model.device()).unwrap();
    assert_eq!(cache.total_pages(), 16);
    let prompts = prompts();
    let a = cache.allocate();
    let out_a = model
        .forward(&[SeqChunk { seq: a, tokens: &prompts[1], logits: LogitRows::All }], &[], &mut cache)
        .unwrap();
    let before = out_a.logits.unwrap().into_data().try_to_vec::<f32>().unwrap();
    let used = cache.bytes_used();
    assert_eq!(used, 5 * layout.page_bytes(), "17 rows take 5 pages of 4");
    assert_eq!(cache.bytes_in_rows(), 17 * layout.row_bytes());
    // 40 + 17 rows need 10 + 5 pages; asking for 57 more in a second sequence fails.
    let b = cache.allocate();
    let long: Vec<u32> = prompts[2].iter().chain(&prompts[1]).copied().collect();
    let err = model
        .forward(&[SeqChunk { seq: b, tokens: &long, logits: LogitRows::Last }], &[], &mut cache)
        .unwrap_err();
    assert!(matches!(err, dspark::Error::KvCacheFull { needed_pages: 4, free_pages: 11, .. }), "{err}");
    assert_eq!(cache.bytes_used(), used, "a failed reserve takes nothing");
    assert_eq!(cache.len(b).unwrap(), 0);
    // Sequence a still decodes exactly as if nothing happened.
    let last_logits = |tokens: &[u32], seq, cache: &mut PagedKvCache| {
        let out = model.forward(&[SeqChunk { seq, tokens, logits: LogitRows::Last }], &[], cache).unwrap();
        out.logits.unwrap().into_data().try_to_vec::<f32>().unwrap()
    };
    let mut fresh = cache_for(&model);
    let f = fresh.allocate();
    let both: Vec<u32> = prompts[1].iter().chain(&[42]).copied().collect();
    let reference = last_logits(&both, f, &mut fresh);
    let step = last_logits(&[42], a, &mut cache);
    assert_close("decode after a failed reserve", &step, &reference, 1e-4);
    assert_eq!(before.len(), 17 * 512);
    // Through the engine: the error comes back and the engine stays usable.
    let mut engine = Engine::new(
        model,
        &EngineConfig { kv_budget_bytes: 16 * layout.page_bytes(), page_size: 4, ..EngineConfig::default() },
    )
    .unwrap();
    let err =
        engine.generate(&[Request { prompt: long.clone(), params: SamplingParams::greedy(24) }]).unwrap_err();
    assert!(matches!(err, dspark::Error::KvCacheFull { .. }));
    assert_eq!(engine.cache().bytes_used(), 0);
    let case = &cases_of("target_greedy")[0];
    let out = engine
        .generate(&[Request { prompt: ids(&case["input_ids"]), params: SamplingParams::greedy(24) }])
        .unwrap();
    assert_eq!(out[0].tokens, ids(&case["expected"]["tokens"]));
}
