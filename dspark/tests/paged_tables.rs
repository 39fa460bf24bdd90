//! The page-table path of the models (the one the CUDA kernels run: one table per forward, new
//! K/V stored by physical row, a draft block's K/V in scratch rows after each lane's context),
//! exercised on the CPU through the plain-burn body of the paged attention
//! (`dspark_kernels::set_paged_reference`). The switch is process-wide, so this file holds one
//! test that runs its checks in turn.
#![allow(clippy::unwrap_used)]

mod common;

use common::{checks, heldout_prompts, models};
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, Engine, EngineConfig, KvCache, LoadOptions,
    Qwen3, Request, SamplingParams,
};

#[test]
fn page_table_path_matches_golden_and_keeps_speculation_lossless() {
    dspark_kernels::set_paged_reference(true);

    // 1. The golden target, greedy, token for token.
    let diverged = checks::greedy_divergence(DeviceKind::Cpu, ComputeDtype::F32, false);
    assert!(diverged.iter().all(Option::is_none), "first divergence per prompt: {diverged:?}");

    // 2. The golden draft's block forward (scratch rows for the block) in both layouts.
    let d = checks::draft_block_diffs(DeviceKind::Cpu, ComputeDtype::F32);
    eprintln!("draft block through page tables: {d:?}");
    assert!(d.cases > 0 && d.tokens_equal, "{d:?}");
    assert!(d.hidden_rel <= 2e-5 && d.base_rel <= 2e-5 && d.corrected_rel <= 2e-5, "{d:?}");

    // 3. The trained pair: greedy speculative output equals target-only output, several lanes
    //    at once, and the draft's pool is whole again afterwards (scratch rows given back).
    let requests: Vec<Request> = heldout_prompts(4)
        .into_iter()
        .map(|prompt| Request { prompt, params: SamplingParams::greedy(48) })
        .collect();
    let load = || Qwen3::load(&models().join("tiny-code-qwen3"), LoadOptions::default()).unwrap();
    let target = load();
    let draft = DSparkDraft::load(
        &models().join("tiny-code-dspark"),
        &target,
        LoadOptions::default(),
        &DraftCacheConfig::default(),
    )
    .unwrap();
    let mut spec = Engine::with_draft(target, Box::new(draft), &EngineConfig::default()).unwrap();
    let mut plain = Engine::new(load(), &EngineConfig::default()).unwrap();
    let fast = spec.generate(&requests).unwrap();
    let base = plain.generate(&requests).unwrap();
    let (mut generated, mut rounds) = (0, 0);
    for (i, (f, b)) in fast.iter().zip(&base).enumerate() {
        assert_eq!(f.tokens, b.tokens, "prompt {i}: speculative differs from target-only");
        generated += f.tokens.len() - 1;
        rounds += f.stats.rounds;
    }
    eprintln!("trained pair through page tables: tau {:.3}", generated as f64 / rounds as f64);
    assert!(rounds < generated, "the draft was accepted at least sometimes");
    assert_eq!(spec.cache().bytes_used(), 0, "target sequences freed");
    let pool = spec.draft_pool();
    assert!(pool.is_some_and(|p| p.free_pages == p.total_pages), "draft pages all returned: {pool:?}");

    dspark_kernels::set_paged_reference(false);
}
