//! Rounds that wait on the device once (`EngineConfig::one_sync_rounds`): the draft round is
//! queued, the verify window behind it reads the drafts on the device
//! (`Qwen3::forward_device_tokens`), and drafts and the target's argmax come back in one read.
//! Such rounds also extend the draft's context by the whole window ahead of the verdicts and
//! cut the rejected rows after.
//! Exercised on the CPU through the recorded path's emulation over the page-table path; both
//! switches are process-wide, so this file holds one test that runs its checks in turn.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use common::{copy_model, edit_config, golden, heldout_prompts, models, prompts};
use dspark::{
    BatchStats, DSparkDraft, DeviceTokens, DraftCacheConfig, Engine, EngineConfig, Error, Generation,
    KvCache, LoadOptions, LogitRows, PagedKvCache, ProposeLane, Qwen3, Request, SamplingParams, SeqChunk,
    Speculator, VerifyPolicy,
};

/// Generate `requests` (one batch) with a draft, one-sync rounds on or off.
fn run(
    target: &Path,
    draft: &Path,
    requests: &[Request],
    verify: VerifyPolicy,
    one_sync_rounds: bool,
) -> (Vec<Generation>, BatchStats) {
    let t = Qwen3::load(target, LoadOptions::default()).unwrap();
    let mut d = DSparkDraft::load(draft, &t, LoadOptions::default(), &DraftCacheConfig::default()).unwrap();
    assert!(d.set_device_markov(true), "the draft's head runs on the device pass");
    // A confidence head (where the draft has one) beside it: the one-sync round's single read
    // carries its logits.
    d.set_device_confidence(true);
    let config = EngineConfig { verify, one_sync_rounds, ..EngineConfig::default() };
    let mut e = Engine::with_draft(t, Box::new(d), &config).unwrap();
    let out = e.generate(requests).unwrap();
    (out, e.last_stats().clone())
}

/// One-sync and two-sync rounds give the same tokens and the same rounds, and the target's
/// own tokens; `expect_one_sync` says whether the one-sync engine took that path (`None`: it
/// may, for some rounds).
fn compare(
    what: &str,
    target: &Path,
    draft: &Path,
    requests: &[Request],
    verify: VerifyPolicy,
    expect_one_sync: Option<bool>,
) {
    let plain = Engine::new(Qwen3::load(target, LoadOptions::default()).unwrap(), &EngineConfig::default())
        .unwrap()
        .generate(requests)
        .unwrap();
    let (on, on_stats) = run(target, draft, requests, verify, true);
    let (off, off_stats) = run(target, draft, requests, verify, false);
    for (i, ((a, b), p)) in on.iter().zip(&off).zip(&plain).enumerate() {
        assert_eq!(b.tokens, a.tokens, "{what}, request {i}: one-sync tokens differ from two-sync");
        assert_eq!(a.stats.round_log, b.stats.round_log, "{what}, request {i}: the rounds differ");
        if requests[i].params.is_greedy() {
            assert_eq!(a.tokens, p.tokens, "{what}, request {i}: speculative differs from target-only");
        }
    }
    assert_eq!(off_stats.one_sync_rounds, 0, "{what}: one-sync rounds while off");
    let rounds: usize = on.iter().map(|g| g.stats.rounds).sum();
    assert!(rounds > 0, "{what}: no speculative round ran");
    match expect_one_sync {
        // The first round of each launch shape is not recorded yet and reads its drafts first.
        Some(true) => assert!(
            on_stats.one_sync_rounds > 0 && on_stats.one_sync_rounds <= on_stats.draft_passes,
            "{what}: {} one-sync rounds of {} draft passes",
            on_stats.one_sync_rounds,
            on_stats.draft_passes
        ),
        Some(false) => assert_eq!(on_stats.one_sync_rounds, 0, "{what}: a one-sync round where none applies"),
        None => {}
    }
    let generated: usize = on.iter().map(|g| g.tokens.len()).sum();
    eprintln!(
        "{what}: {rounds} lane-rounds, {} draft passes ({} one-sync), {generated} tokens",
        on_stats.draft_passes, on_stats.one_sync_rounds
    );
}

#[test]
fn one_sync_rounds_change_no_token_and_no_round() {
    dspark_kernels::set_paged_reference(true);
    dspark_kernels::set_graph_emulation(true);
    let (pair_t, pair_d) = (models().join("tiny-code-qwen3"), models().join("tiny-code-dspark"));
    let greedy: Vec<Request> = heldout_prompts(4)
        .into_iter()
        .map(|prompt| Request { prompt, params: SamplingParams::greedy(40) })
        .collect();

    // 1. The trained pair (confidence head): four lanes in one batch, and one lane alone, all
    //    γ drafts and a fixed width.
    compare("pair, 4 lanes, full", &pair_t, &pair_d, &greedy, VerifyPolicy::Full, Some(true));
    compare("pair, 1 lane, full", &pair_t, &pair_d, &greedy[..1], VerifyPolicy::Full, Some(true));
    compare("pair, 4 lanes, fixed 4", &pair_t, &pair_d, &greedy, VerifyPolicy::Fixed(4), Some(true));

    // 2. Sampling lanes, alone or beside a greedy one: their drafts go into the acceptance
    //    words on the device, and the verdicts come back with the drafts. A confidence
    //    threshold keeps the round that reads the drafts first.
    let sampled: Vec<Request> = greedy
        .iter()
        .enumerate()
        .map(|(i, r)| Request {
            prompt: r.prompt.clone(),
            params: SamplingParams {
                temperature: if i == 0 { 0.0 } else { 0.8 },
                seed: 5 + i as u64,
                ..SamplingParams::greedy(24)
            },
        })
        .collect();
    compare("pair, sampled", &pair_t, &pair_d, &sampled[1..], VerifyPolicy::Full, Some(true));
    compare("pair, greedy beside sampled", &pair_t, &pair_d, &sampled, VerifyPolicy::Fixed(3), Some(true));
    compare("pair, threshold", &pair_t, &pair_d, &greedy[..2], VerifyPolicy::Threshold(0.5), Some(false));

    // 3. The SpecForge layout without a confidence head, several lanes: the round reads back
    //    tokens only.
    let specforge = copy_model("tiny-dspark-specforge");
    edit_config(specforge.path(), |c| c["dflash_config"]["enable_confidence_head"] = false.into());
    let golden_prompts: Vec<Request> =
        prompts().into_iter().map(|prompt| Request { prompt, params: SamplingParams::greedy(24) }).collect();
    let tiny = golden().join("tiny-qwen3");
    compare(
        "specforge, no confidence",
        &tiny,
        specforge.path(),
        &golden_prompts,
        VerifyPolicy::Full,
        Some(true),
    );

    // 4. The target's forward with device tokens equals the forward of the same tokens from
    //    the host, recorded (emulated) and op by op; bad device rows are refused.
    let t = Qwen3::load(&tiny, LoadOptions::default()).unwrap();
    let windows: [&[u32]; 2] = [&[7, 31, 2, 400], &[9, 18, 77]];
    // Drafts 31, 2, 400 of lane 0 and 18, 77 of lane 1 sit at indices 0..3 and 4..6 (3 unused).
    let values =
        Tensor::<2>::from_data(TensorData::new(vec![31f32, 2., 400., 5., 18., 77.], [6, 1]), t.device());
    let slots = [(1, 0), (2, 1), (3, 2), (5, 4), (6, 5)];
    let logits = |device: bool, kv: &mut PagedKvCache| {
        let seqs = [kv.allocate(), kv.allocate()];
        let blank: Vec<Vec<u32>> =
            windows.iter().map(|w| std::iter::once(w[0]).chain(w[1..].iter().map(|_| 0)).collect()).collect();
        let chunks: Vec<SeqChunk<'_>> = seqs
            .iter()
            .zip(if device { blank.iter().map(Vec::as_slice).collect::<Vec<_>>() } else { windows.to_vec() })
            .map(|(&seq, tokens)| SeqChunk { seq, tokens, logits: LogitRows::All })
            .collect();
        let out = if device {
            t.forward_device_tokens(&chunks, DeviceTokens { values: &values, rows: &slots }, &[1], kv)
                .unwrap()
        } else {
            t.forward(&chunks, &[1], kv).unwrap()
        };
        for seq in seqs {
            kv.free(seq).unwrap();
        }
        let logits = out.logits.unwrap().into_data().try_to_vec::<f32>().unwrap();
        let features = out.features.unwrap().into_data().try_to_vec::<f32>().unwrap();
        (logits, features)
    };
    for recorded in [true, false] {
        dspark_kernels::set_graph_emulation(recorded);
        let mut kv = PagedKvCache::new(t.kv_layout(16), 8 << 20, t.device()).unwrap();
        // Twice each: the second call of a shape is the recorded one.
        for _ in 0..2 {
            assert_eq!(logits(true, &mut kv), logits(false, &mut kv), "device tokens (recorded: {recorded})");
        }
    }
    let mut kv = PagedKvCache::new(t.kv_layout(16), 8 << 20, t.device()).unwrap();
    let seq = kv.allocate();
    let chunk = [SeqChunk { seq, tokens: &[7, 0], logits: LogitRows::All }];
    for (rows, why) in [(&[(2usize, 0usize)][..], "row out of range"), (&[(1, 6)][..], "index out of range")]
    {
        let err = t
            .forward_device_tokens(&chunk, DeviceTokens { values: &values, rows }, &[], &mut kv)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{why}: {err}");
    }
    let flat = values.clone().reshape([1, 6]);
    let err = t
        .forward_device_tokens(&chunk, DeviceTokens { values: &flat, rows: &[(1, 0)] }, &[], &mut kv)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "values not [k, 1]: {err}");
    assert_eq!(kv.len(seq).unwrap(), 0, "a refused forward reserves nothing");

    // 5. The engine extends a lane's draft context by its whole window before the verdicts and
    //    cuts the rejected rows after: a context cut back proposes exactly what a context
    //    extended by the kept rows alone does, recorded (emulated) and op by op.
    let t = Qwen3::load(&pair_t, LoadOptions::default()).unwrap();
    for recorded in [true, false] {
        dspark_kernels::set_graph_emulation(recorded);
        let mut d =
            DSparkDraft::load(&pair_d, &t, LoadOptions::default(), &DraftCacheConfig::default()).unwrap();
        assert!(d.set_device_markov(true) && d.can_truncate_context());
        let width = d.feature_layers().len() * t.config().hidden_size;
        let values: Vec<f32> = (0..9 * width).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let features = Tensor::<2>::from_data(TensorData::new(values, [9, width]), t.device());
        let params = SamplingParams::greedy(8);
        let mut proposals = Vec::new();
        // Twice each: the second extension and round of a shape are the recorded ones.
        for _ in 0..2 {
            let (cut, kept) = (d.begin(), d.begin());
            d.extend_contexts(&[(cut, features.clone()), (kept, features.clone().narrow(0, 0, 5))]).unwrap();
            d.truncate_context(cut, 5).unwrap();
            assert_eq!(d.context_len(cut).unwrap(), 5);
            let err = d.truncate_context(cut, 6).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "a cut past the context: {err}");
            for seq in [cut, kept] {
                let lane = ProposeLane { seq, anchor: 17, params: &params };
                let p = d.propose(&[lane]).unwrap().remove(0);
                proposals.push((p.tokens, p.confidence));
                d.end(seq).unwrap();
            }
        }
        for pair in proposals.chunks(2) {
            assert_eq!(pair[0], pair[1], "a cut context proposes otherwise (recorded: {recorded})");
        }
    }

    dspark_kernels::set_graph_emulation(false);
    dspark_kernels::set_paged_reference(false);
}
