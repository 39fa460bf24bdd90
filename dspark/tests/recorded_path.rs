//! The recorded path of the models (the one CUDA graphs replay: every per-step value read from
//! device input buffers written in place, rotary rows picked on the device, a greedy draft round
//! from the block forward to the Markov tokens with one read), exercised on the CPU by running
//! the recorded body on every call (`dspark_kernels::set_graph_emulation`) over the page-table
//! path (`set_paged_reference`). Both switches are process-wide, so this file holds one test
//! that runs its checks in turn.
#![allow(clippy::unwrap_used)]

mod common;

use common::{checks, heldout_prompts, models};
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, Engine, EngineConfig, KvCache, LoadOptions,
    LogitRows, PagedKvCache, Qwen3, Request, SamplingParams, SeqChunk,
};

#[test]
fn recorded_forwards_read_their_inputs_from_the_device_and_change_no_token() {
    dspark_kernels::set_paged_reference(true);
    let requests: Vec<Request> = heldout_prompts(4)
        .into_iter()
        .map(|prompt| Request { prompt, params: SamplingParams::greedy(48) })
        .collect();
    let load = || Qwen3::load(&models().join("tiny-code-qwen3"), LoadOptions::default()).unwrap();
    // A draft vocabulary of 1024 tokens: the recorded round chooses draft indices and maps them
    // back on the device.
    let spec_engine_restricted = |tokens: Option<usize>| {
        let target = load();
        let mut draft = DSparkDraft::load(
            &models().join("tiny-code-dspark"),
            &target,
            LoadOptions::default(),
            &DraftCacheConfig::default(),
        )
        .unwrap();
        assert!(draft.set_device_markov(true), "the trained draft's head runs on the device pass");
        assert!(draft.set_device_confidence(true), "and its confidence head too");
        if let Some(n) = tokens {
            draft.restrict_vocab(dspark::DraftVocab::leading(n, 4096).unwrap()).unwrap();
        }
        Engine::with_draft(target, Box::new(draft), &EngineConfig::default()).unwrap()
    };
    let spec_engine = || spec_engine_restricted(None);

    // Sampled requests: the target's verify windows take the recorded path, the draft samples
    // op by op; the same seeds must give the same tokens either way.
    let sampled: Vec<Request> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| Request {
            prompt: r.prompt.clone(),
            params: SamplingParams { temperature: 0.8, seed: 11 + i as u64, ..SamplingParams::greedy(32) },
        })
        .collect();

    // 1. Op by op: target-only and speculative (device Markov pass).
    dspark_kernels::set_graph_emulation(false);
    let base = Engine::new(load(), &EngineConfig::default()).unwrap().generate(&requests).unwrap();
    let op_by_op = spec_engine().generate(&requests).unwrap();
    let sampled_op_by_op = spec_engine().generate(&sampled).unwrap();
    let restricted_op_by_op = spec_engine_restricted(Some(1024)).generate(&requests).unwrap();
    let restricted_sampled_op_by_op = spec_engine_restricted(Some(1024)).generate(&sampled).unwrap();

    // 2. Recorded: the golden target token for token, then both engines again.
    dspark_kernels::set_graph_emulation(true);
    let diverged = checks::greedy_divergence(DeviceKind::Cpu, ComputeDtype::F32, false);
    assert!(diverged.iter().all(Option::is_none), "first divergence per prompt: {diverged:?}");
    let plain = Engine::new(load(), &EngineConfig::default()).unwrap().generate(&requests).unwrap();
    let mut spec = spec_engine();
    let recorded = spec.generate(&requests).unwrap();
    let sampled_recorded = spec_engine().generate(&sampled).unwrap();
    let restricted_recorded = spec_engine_restricted(Some(1024)).generate(&requests).unwrap();
    let restricted_sampled_recorded = spec_engine_restricted(Some(1024)).generate(&sampled).unwrap();

    // 3. The recording policy: a shape is recorded the second time it is seen, at most 16 are
    //    kept, and row counts share padded shapes (1, 2, 4, 8, 16 rows here).
    let target = load();
    let mut kv = PagedKvCache::new(target.kv_layout(16), 8 << 20, target.device()).unwrap();
    let mut shapes = Vec::new();
    for rows in [1usize, 2, 3, 5, 9] {
        for logits in [LogitRows::Last, LogitRows::All] {
            for capture in [&[][..], &[0][..]] {
                shapes.push((rows, logits, capture));
            }
        }
    }
    let pass = |kv: &mut PagedKvCache| {
        for &(rows, logits, capture) in &shapes {
            let seq = kv.allocate();
            let tokens = vec![5; rows];
            target.forward(&[SeqChunk { seq, tokens: &tokens, logits }], capture, kv).unwrap();
            kv.free(seq).unwrap();
        }
    };
    // One row with its last row's logits or all rows' logits is one launch shape: those two
    // pairs are seen twice in the first pass; the other 16 shapes once.
    pass(&mut kv);
    assert_eq!(target.recorded_shapes(), 2, "only the shapes seen twice are recorded");
    pass(&mut kv);
    assert_eq!(target.recorded_shapes(), 16, "18 shapes seen twice, at most 16 recorded");
    // 4. Verify windows padded to the same row count are one shape whatever their real rows:
    //    a 3-row and a 4-row window with every row's logits make one shape seen twice.
    let target = load();
    let mut kv = PagedKvCache::new(target.kv_layout(16), 8 << 20, target.device()).unwrap();
    for rows in [3usize, 4] {
        let seq = kv.allocate();
        let tokens = vec![5; rows];
        let out = target
            .forward(&[SeqChunk { seq, tokens: &tokens, logits: LogitRows::All }], &[], &mut kv)
            .unwrap();
        assert_eq!(out.logits.map(|l| l.dims()[0]), Some(rows), "a {rows}-row window's logits");
        kv.free(seq).unwrap();
    }
    assert_eq!(target.recorded_shapes(), 1, "windows of 3 and 4 rows share the padded shape");
    dspark_kernels::set_graph_emulation(false);
    dspark_kernels::set_paged_reference(false);

    let (mut generated, mut rounds) = (0, 0);
    for (i, ((r, o), (p, b))) in recorded.iter().zip(&op_by_op).zip(plain.iter().zip(&base)).enumerate() {
        assert_eq!(p.tokens, b.tokens, "prompt {i}: recorded target-only differs from op by op");
        assert_eq!(r.tokens, b.tokens, "prompt {i}: recorded speculative differs from target-only");
        // The same proposals, so the same rounds: the recorded round is the op-by-op round.
        assert_eq!(r.stats.rounds, o.stats.rounds, "prompt {i}: rounds differ from the op-by-op round");
        generated += r.tokens.len() - 1;
        rounds += r.stats.rounds;
    }
    for (i, (r, o)) in sampled_recorded.iter().zip(&sampled_op_by_op).enumerate() {
        assert_eq!(r.tokens, o.tokens, "sampled prompt {i}: recorded differs from op by op");
    }
    for (i, ((r, o), b)) in restricted_recorded.iter().zip(&restricted_op_by_op).zip(&base).enumerate() {
        assert_eq!(
            r.tokens, b.tokens,
            "prompt {i}: recorded restricted speculative differs from target-only"
        );
        assert_eq!(r.stats.rounds, o.stats.rounds, "prompt {i}: restricted rounds differ from op by op");
    }
    for (i, (r, o)) in restricted_sampled_recorded.iter().zip(&restricted_sampled_op_by_op).enumerate() {
        assert_eq!(r.tokens, o.tokens, "sampled prompt {i}: restricted recorded differs from op by op");
    }
    eprintln!("trained pair, recorded path: tau {:.3}", generated as f64 / rounds as f64);
    assert!(rounds < generated, "the draft was accepted at least sometimes");
    let pool = spec.draft_pool();
    assert!(pool.is_some_and(|p| p.free_pages == p.total_pages), "draft pages all returned: {pool:?}");
}
