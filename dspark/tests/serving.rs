//! Continuous batching on the CPU: requests joining and leaving between rounds, cancellation,
//! KV pressure (queueing, preemption and resumption), and refusal of requests that can never
//! fit — for the target-only and the speculative engine. Every multi-request run is checked
//! against the same requests generated one at a time in a roomy engine.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::*;
use dspark::{
    DSparkDraft, DraftCacheConfig, Engine, EngineConfig, FinishReason, Generation, KvCache, LoadOptions,
    Qwen3, Request, RequestId, SamplingParams,
};

const PAGE: usize = 4;

fn target() -> Qwen3 {
    Qwen3::load(&golden().join("tiny-qwen3"), LoadOptions::default()).unwrap()
}

/// Target KV budget of `pages` pages of `PAGE` rows.
fn target_budget(pages: usize) -> usize {
    pages * target().kv_layout(PAGE).page_bytes()
}

/// An engine whose target pool has `target_pages` pages; speculative (golden tiny draft, γ = 4)
/// with a draft pool of `draft_pages` pages when given.
fn engine(target_pages: usize, draft_pages: Option<usize>, max_lanes: usize) -> Engine {
    let t = target();
    let config = EngineConfig {
        kv_budget_bytes: target_budget(target_pages),
        page_size: PAGE,
        max_lanes,
        ..EngineConfig::default()
    };
    match draft_pages {
        None => Engine::new(t, &config).unwrap(),
        Some(pages) => {
            let dir = golden().join("tiny-dspark");
            let probe =
                DSparkDraft::load(&dir, &t, LoadOptions::default(), &DraftCacheConfig::default()).unwrap();
            let page_bytes =
                probe.cache().pool_state().page_bytes / DraftCacheConfig::default().page_size * PAGE;
            let cache = DraftCacheConfig { kv_budget_bytes: pages * page_bytes, page_size: PAGE };
            let d = DSparkDraft::load(&dir, &t, LoadOptions::default(), &cache).unwrap();
            assert_eq!(d.cache().pool_state().total_pages, pages);
            Engine::with_draft(t, Box::new(d), &config).unwrap()
        }
    }
}

/// Six requests: the golden prompts and slices of them, greedy and seeded sampling mixed.
fn requests(max_new: usize) -> Vec<Request> {
    let p = prompts();
    let mut prompts = p.clone();
    prompts.push(p[2][..9].to_vec());
    prompts.push(p[0][3..].to_vec());
    prompts.push(p[1][..5].to_vec());
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            prompt,
            params: SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
                top_k: if i == 3 { 20 } else { 0 },
                seed: 1000 + i as u64,
                max_new_tokens: max_new + i,
                ..SamplingParams::default()
            },
        })
        .collect()
}

/// Each request generated alone in a roomy engine of the same kind.
fn alone(speculative: bool, requests: &[Request]) -> Vec<Vec<u32>> {
    let mut e = engine(4096, speculative.then_some(4096), 256);
    requests.iter().map(|r| e.generate(std::slice::from_ref(r)).unwrap().remove(0).tokens).collect()
}

/// Run submitted requests to the end with `step`, checking after every step that events add
/// up to the results and that an idle engine holds no KV.
fn drain(
    e: &mut Engine,
    ids: &[RequestId],
    mut streamed: HashMap<RequestId, Vec<u32>>,
) -> HashMap<RequestId, Generation> {
    let mut done = HashMap::new();
    let mut steps = 0;
    while !e.is_idle() {
        let out = e.step().unwrap();
        for ev in out.events {
            streamed.entry(ev.id).or_default().extend(ev.tokens);
        }
        for (id, g) in out.finished {
            assert_eq!(streamed.get(&id).cloned().unwrap_or_default(), g.tokens, "stream of {id}");
            assert!(done.insert(id, g).is_none(), "request {id} finished twice");
        }
        steps += 1;
        assert!(steps < 10_000, "no progress");
    }
    assert_eq!(e.cache().bytes_used(), 0, "an idle engine holds no KV");
    for id in ids {
        assert!(done.contains_key(id), "request {id} lost");
    }
    done
}

#[test]
fn requests_join_and_leave_between_rounds() {
    for speculative in [false, true] {
        let reqs = requests(12);
        let expected = alone(speculative, &reqs);
        let mut e = engine(4096, speculative.then_some(4096), 256);
        // Two requests start; the others join one by one after a few rounds each.
        let mut ids: Vec<RequestId> = reqs[..2].iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        let mut early = HashMap::new();
        let mut streamed: HashMap<RequestId, Vec<u32>> = HashMap::new();
        for r in &reqs[2..] {
            for _ in 0..2 {
                let out = e.step().unwrap();
                out.events.into_iter().for_each(|ev| streamed.entry(ev.id).or_default().extend(ev.tokens));
                early.extend(out.finished);
            }
            ids.push(e.submit(r.clone()).unwrap());
        }
        assert!(e.num_running() + e.num_waiting() > 1);
        let pending: Vec<RequestId> = ids.iter().copied().filter(|id| !early.contains_key(id)).collect();
        let mut done = drain(&mut e, &pending, streamed);
        done.extend(early);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(done[id].tokens, expected[i], "speculative={speculative}, request {i}");
        }
    }
}

#[test]
fn kv_pressure_queues_and_preempts_without_losing_or_changing_requests() {
    // A pool (the target's, or the draft's) three pages larger than the largest request needs
    // alone: a few requests run at once, lanes are preempted as they grow, and resume by
    // recomputing their context.
    for (speculative, pressure_on_draft) in [(false, false), (true, false), (true, true)] {
        let reqs = requests(20);
        let expected = alone(speculative, &reqs);
        let window = if speculative { 5 } else { 1 };
        let need =
            reqs.iter().map(|r| (r.prompt.len() + r.params.max_new_tokens - 1 + window).div_ceil(PAGE));
        let tight = need.max().unwrap() + 3;
        let (target_pages, draft_pages) = match (speculative, pressure_on_draft) {
            (false, _) => (tight, None),
            (true, false) => (tight, Some(4096)),
            (true, true) => (4096, Some(tight)),
        };
        let mut e = engine(target_pages, draft_pages, 256);
        let ids: Vec<RequestId> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        let done = drain(&mut e, &ids, HashMap::new());
        let stats = e.take_stats();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(
                done[id].tokens, expected[i],
                "speculative={speculative} draft={draft_pages:?} request {i}"
            );
            assert_eq!(done[id].finish, Some(FinishReason::Length));
        }
        println!("speculative={speculative} draft pages {draft_pages:?}: {stats:?}");
        assert!(stats.preemptions > 0, "the budget was meant to force preemption: {stats:?}");
        assert!(stats.peak_lanes < reqs.len());
        // generate() over the same pressure returns every result in order.
        let mut e = engine(target_pages, draft_pages, 256);
        let out = e.generate(&reqs).unwrap();
        for (i, g) in out.iter().enumerate() {
            assert_eq!(g.tokens, expected[i], "generate, request {i}");
        }
        assert!(e.last_stats().preemptions > 0);
    }
}

#[test]
fn requests_that_can_never_fit_are_refused_before_any_work() {
    // 14 target pages hold 56 rows; prompt 17 + 40 new + a verify window does not fit.
    let long = Request { prompt: prompts()[1].clone(), params: SamplingParams::greedy(40) };
    for (speculative, target_pages, draft_pages) in
        [(false, 14, None), (true, 14, Some(4096)), (true, 4096, Some(14))]
    {
        let mut e = engine(target_pages, draft_pages, 256);
        let err = e.submit(long.clone()).unwrap_err();
        assert!(matches!(err, dspark::Error::KvCacheFull { total_pages: 14, .. }), "{err}");
        assert!(e.is_idle(), "nothing queued");
        let err = e.generate(&[requests(4)[0].clone(), long.clone()]).unwrap_err();
        assert!(matches!(err, dspark::Error::KvCacheFull { .. }), "{err}");
        assert!(e.is_idle() && e.cache().bytes_used() == 0, "a refused batch starts nothing");
        // The engine stays usable; a request that fits alone runs.
        let ok = e.generate(&requests(4)[..1]).unwrap();
        assert_eq!(ok[0].tokens.len(), 4, "speculative={speculative}");
    }
}

#[test]
fn cancel_frees_kv_at_once_and_leaves_the_others_unchanged() {
    for speculative in [false, true] {
        let reqs = requests(16);
        let expected = alone(speculative, &reqs);
        let mut e = engine(4096, speculative.then_some(4096), 2);
        let ids: Vec<RequestId> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        let mut partial: HashMap<RequestId, Vec<u32>> = HashMap::new();
        for _ in 0..3 {
            let out = e.step().unwrap();
            assert!(out.finished.is_empty());
            out.events.into_iter().for_each(|ev| partial.entry(ev.id).or_default().extend(ev.tokens));
        }
        assert_eq!(e.num_running(), 2, "max_lanes caps the batch");
        let used = e.cache().bytes_used();
        let running = ids[0];
        let g = e.cancel(running).unwrap();
        assert_eq!(g.finish, Some(FinishReason::Cancelled));
        assert_eq!(g.tokens, partial[&running]);
        assert_eq!(g.tokens[..], expected[0][..g.tokens.len()]);
        assert!(e.cache().bytes_used() < used, "cancelling frees the lane's KV at once");
        let queued = ids[5];
        let g = e.cancel(queued).unwrap();
        assert!(g.tokens.is_empty() && g.finish == Some(FinishReason::Cancelled));
        assert!(matches!(e.cancel(queued), Err(dspark::Error::InvalidInput(_))), "already cancelled");
        assert!(matches!(e.cancel(9999), Err(dspark::Error::InvalidInput(_))));
        let done = drain(&mut e, &ids[1..5], partial);
        for i in 1..5 {
            assert_eq!(done[&ids[i]].tokens, expected[i], "speculative={speculative} request {i}");
        }
        assert!(e.take_stats().peak_lanes <= 2);
    }
}

#[test]
fn generate_hands_other_requests_results_to_the_next_step() {
    let reqs = requests(6);
    let mut e = engine(4096, Some(4096), 256);
    let mine = e.submit(reqs[0].clone()).unwrap();
    let out = e.generate(&reqs[1..3]).unwrap();
    assert_eq!(out.len(), 2);
    // The request submitted before the call progressed too; its result is not lost.
    let mut done = HashMap::new();
    loop {
        done.extend(e.step().unwrap().finished);
        if e.is_idle() {
            break;
        }
    }
    assert_eq!(done[&mine].tokens, alone(true, &reqs[..1])[0]);
}
