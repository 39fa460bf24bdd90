//! One child process: one mode (target-only or speculative) of one phase (a workload, or the
//! gate's fixed texts and sampled runs), measured alone so its peak memory is its own.

use std::time::Instant;

use burn::tensor::Tensor;
use burn::tensor::activation::log_softmax;
use dspark::{Engine, KvCache, LogitRows, PagedKvCache, Request, SamplingParams, SeqChunk};
use serde::{Deserialize, Serialize};

use super::memory::{MemoryReading, Meter};
use super::setup::{Args, BoxError, Plan, build_engine, kv_bytes};

/// Timings and outputs of one workload in one mode.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkloadRun {
    pub requests: usize,
    pub lanes: usize,
    pub kv_budget_bytes: usize,
    pub draft_kv_budget_bytes: usize,
    pub generate_calls: usize,
    pub generated_tokens: usize,
    /// Wall time of the timed generate calls (prefill included).
    pub wall_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub draft_s: f64,
    pub verify_s: f64,
    pub commit_s: f64,
    /// Batch rounds after prefill (one target forward each).
    pub batch_rounds: usize,
    /// Σ per-request rounds and Σ (generated − 1), for τ.
    pub request_rounds: usize,
    pub tau_tokens: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Greedy outputs, request by request.
    pub outputs: Vec<Vec<u32>>,
    pub warmup_s: f64,
}

/// Log-probabilities of the fixed texts as this mode's engine sees them, and as `Engine::score`
/// gives them (from the first predicted position of the steps on).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TextLogprobs {
    pub stepped: Vec<f32>,
    pub score: Vec<f32>,
}

/// One sampled reply scored under the target (raw distribution, temperature 1).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScoredReply {
    pub prompt: usize,
    pub seed: u64,
    pub tokens: usize,
    pub loglik: f64,
    pub argmax: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GateRun {
    pub texts: Vec<TextLogprobs>,
    pub replies: Vec<ScoredReply>,
    pub sampled_wall_s: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ChildResult {
    pub mode: String,
    pub phase: String,
    pub load_s: f64,
    pub memory: MemoryReading,
    pub workload: Option<WorkloadRun>,
    pub gate: Option<GateRun>,
}

/// The requests of a workload and how many go into one generate call.
pub fn workload_requests(args: &Args, plan: &Plan, name: &str) -> (Vec<Vec<u32>>, usize) {
    let (count, lanes) = match name {
        "solo" => (args.solo_requests, 1),
        "team" => (args.team_requests(), args.team_lanes),
        _ => (args.busy_lanes(), args.busy_lanes()),
    };
    let prompts = (0..count).map(|i| plan.prompts[i % plan.prompts.len()].clone()).collect();
    (prompts, lanes)
}

/// KV budgets of a phase, equal for both modes: the busy workload nearly fills its pool; the
/// others get room for `team_lanes` of the longest prompts (or `--kv-budget-mib`).
pub fn budgets(args: &Args, plan: &Plan, phase: &str) -> Result<(usize, usize), BoxError> {
    if phase == "busy" {
        let (prompts, _) = workload_requests(args, plan, "busy");
        return kv_bytes(plan, args, &prompts.iter().collect::<Vec<_>>(), args.busy_fill);
    }
    let mut longest: Vec<&Vec<u32>> = plan.prompts.iter().collect();
    longest.sort_by_key(|p| std::cmp::Reverse(p.len()));
    longest.truncate(args.team_lanes.max(1));
    let (t, d) = kv_bytes(plan, args, &longest, 1.0)?;
    let (t_page, d_page) = {
        let (tl, dl) = super::setup::layouts(plan, args.dtype.parse()?, args.page_size);
        (tl.page_bytes(), dl.page_bytes())
    };
    let t = args.kv_budget_mib.map_or(t + args.team_lanes * t_page, |m| m << 20);
    let d = d + args.team_lanes * d_page;
    // The gate measures outputs, not memory: its sampled speculative runs get twice the room
    // (on 2026-12-02 they overran the team budget on CPU, which the greedy runs never did).
    Ok(if phase == "gate" { (2 * t, 2 * d) } else { (t, d) })
}

pub fn run(args: &Args, plan: &Plan, spec: &str) -> Result<ChildResult, BoxError> {
    let (mode, phase) = spec.split_once(':').ok_or("--child MODE:PHASE")?;
    let speculative = match mode {
        "target" => false,
        "spec" => true,
        m => return Err(format!("unknown mode {m}").into()),
    };
    let mut meter = Meter::start(&args.device)?;
    let (kv, draft_kv) = budgets(args, plan, phase)?;
    let started = Instant::now();
    let mut engine = build_engine(args, plan, speculative, kv, draft_kv)?;
    let device = engine.target().device().clone();
    device.sync().map_err(|e| format!("device sync: {e:?}"))?;
    let load_s = started.elapsed().as_secs_f64();
    let after_load = meter.loaded();
    eprintln!("[{spec}] built in {load_s:.1} s");
    let mut result = ChildResult { mode: mode.into(), phase: phase.into(), load_s, ..ChildResult::default() };
    if phase == "gate" {
        result.gate = Some(gate(args, plan, &mut engine, speculative)?);
    } else {
        let mut w = workload(args, plan, &mut engine, phase, spec)?;
        w.kv_budget_bytes = kv;
        w.draft_kv_budget_bytes = if speculative { draft_kv } else { 0 };
        result.workload = Some(w);
    }
    device.sync().map_err(|e| format!("device sync: {e:?}"))?;
    result.memory = meter.finish(after_load, &device);
    Ok(result)
}

/// Greedy requests of `max_new_tokens` with the plan's stop tokens.
fn params(plan: &Plan, max_new_tokens: usize) -> SamplingParams {
    SamplingParams { max_new_tokens, stop_token_ids: plan.stop.clone(), ..SamplingParams::default() }
}

fn workload(
    args: &Args,
    plan: &Plan,
    engine: &mut Engine,
    name: &str,
    label: &str,
) -> Result<WorkloadRun, BoxError> {
    let (prompts, lanes) = workload_requests(args, plan, name);
    let make = |ps: &[Vec<u32>], n: usize| -> Vec<Request> {
        ps.iter().map(|p| Request { prompt: p.clone(), params: params(plan, n) }).collect()
    };
    let groups: Vec<&[Vec<u32>]> = prompts.chunks(lanes).collect();
    // 1. warm-up: the whole workload once (every shape compiled), or one short request.
    let warm = Instant::now();
    if args.full_warmup() {
        for g in &groups {
            engine.generate(&make(g, args.max_new_tokens))?;
        }
    } else {
        engine.generate(&make(&prompts[..1], 8.min(args.max_new_tokens)))?;
    }
    let mut run = WorkloadRun {
        requests: prompts.len(),
        lanes,
        warmup_s: warm.elapsed().as_secs_f64(),
        ..WorkloadRun::default()
    };
    // 2. timed calls.
    for (i, g) in groups.iter().enumerate() {
        let t = Instant::now();
        let out = engine.generate(&make(g, args.max_new_tokens))?;
        run.wall_s += t.elapsed().as_secs_f64();
        let s = engine.last_stats();
        run.generate_calls += 1;
        run.generated_tokens += s.generated_tokens;
        run.prefill_s += s.prefill_time.as_secs_f64();
        run.decode_s += s.decode_time.as_secs_f64();
        run.draft_s += s.draft_time.as_secs_f64();
        run.verify_s += s.verify_time.as_secs_f64();
        run.commit_s += s.commit_time.as_secs_f64();
        run.batch_rounds += s.forward_passes.saturating_sub(1);
        run.drafted += s.drafted;
        run.accepted += s.accepted;
        for g in out {
            run.request_rounds += g.stats.rounds;
            run.tau_tokens += g.tokens.len().saturating_sub(1);
            run.outputs.push(g.tokens);
        }
        eprintln!(
            "[{label}] call {}/{}: {} tokens in {:.2} s",
            i + 1,
            groups.len(),
            s.generated_tokens,
            run.wall_s
        );
    }
    Ok(run)
}

/// Log-probabilities from rows of logits `[rows, vocab]`: of `next[i]` in row i, and whether
/// it is the row's argmax.
fn row_logprobs(logits: Tensor<2>, next: &[u32]) -> Result<Vec<(f32, bool)>, BoxError> {
    let vocab = logits.dims()[1];
    let lp: Vec<f32> = log_softmax(logits, 1).try_into_vec_as::<f32>().map_err(|e| format!("{e:?}"))?;
    Ok(next
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let row = &lp[i * vocab..(i + 1) * vocab];
            (row[t as usize], dspark::sampling::argmax(row) == t)
        })
        .collect())
}

/// Log-probabilities of `text[p0..]` computed the way this mode's engine computes them: the
/// prefix in one prefill (last row), then one row per step (target-only) or verify windows of
/// up to γ + 1 rows with a fixed pattern of accepted prefixes, rejected rows truncated and
/// recomputed in the next window (speculative).
fn stepped_logprobs(
    engine: &Engine,
    cache: &mut PagedKvCache,
    text: &[u32],
    p0: usize,
    window: Option<usize>,
) -> Result<Vec<f32>, BoxError> {
    let target = engine.target();
    let seq = cache.allocate();
    let mut out = Vec::new();
    let result = (|| -> Result<(), BoxError> {
        let o =
            target.forward(&[SeqChunk { seq, tokens: &text[..p0], logits: LogitRows::Last }], &[], cache)?;
        out.push(row_logprobs(o.logits.ok_or("no logits")?, &text[p0..=p0])?[0].0);
        let (mut i, mut round) = (p0, 0usize);
        while i + 1 < text.len() {
            let w = window.unwrap_or(1).min(text.len() - 1 - i);
            let o = target.forward(
                &[SeqChunk { seq, tokens: &text[i..i + w], logits: LogitRows::All }],
                &[],
                cache,
            )?;
            let rows = row_logprobs(o.logits.ok_or("no logits")?, &text[i + 1..=i + w])?;
            // accepted drafts this round: a fixed, varied pattern 1, 4, 7, 2, 5, ... (mod w)
            let keep = if window.is_some() { (round * 3 + 1) % w + 1 } else { w };
            out.extend(rows[..keep].iter().map(|r| r.0));
            cache.truncate(seq, i + keep)?;
            i += keep;
            round += 1;
        }
        Ok(())
    })();
    cache.free(seq)?;
    result.map(|()| out)
}

fn gate(args: &Args, plan: &Plan, engine: &mut Engine, speculative: bool) -> Result<GateRun, BoxError> {
    let target_layout = engine.target().kv_layout(args.page_size);
    let longest = plan.prompts.iter().map(Vec::len).max().unwrap_or(1) + args.max_new_tokens + 64;
    let mut cache = PagedKvCache::new(
        target_layout,
        (longest.div_ceil(args.page_size) + 2) * target_layout.page_bytes(),
        engine.target().device(),
    )?;
    let mut run = GateRun::default();
    // 1. fixed texts.
    for text in plan.prompts.iter().filter(|p| p.len() >= 8).take(args.gate_texts) {
        let text = &text[..text.len().min(args.gate_text_tokens)];
        let p0 = (text.len() / 4).max(1);
        let window = speculative.then_some(plan.gamma() + 1);
        let stepped = stepped_logprobs(engine, &mut cache, text, p0, window)?;
        let score = engine.score(text)?[p0 - 1..].to_vec();
        run.texts.push(TextLogprobs { stepped, score });
    }
    // 2. sampled replies: the same (prompt, seed) list in both modes, team_lanes per call.
    if args.sample_seeds > 0 {
        let mut requests = Vec::new();
        let mut keys = Vec::new();
        for (i, p) in plan.prompts.iter().take(args.sample_prompts).enumerate() {
            for k in 0..args.sample_seeds as u64 {
                let seed = 1000 + 7919 * k + i as u64;
                let mut params = params(plan, args.max_new_tokens);
                params.temperature = args.temperature;
                params.seed = seed;
                requests.push(Request { prompt: p.clone(), params });
                keys.push((i, seed));
            }
        }
        let t = Instant::now();
        let mut replies = Vec::new();
        for chunk in requests.chunks(args.team_lanes) {
            replies.extend(engine.generate(chunk)?);
        }
        run.sampled_wall_s = t.elapsed().as_secs_f64();
        // 3. score every reply under the target: prompt prefix, then the reply rows.
        for ((r, g), (prompt, seed)) in requests.iter().zip(&replies).zip(keys) {
            let n = g.tokens.len();
            if n == 0 {
                continue;
            }
            let seq = cache.allocate();
            let scored = (|| -> Result<Vec<(f32, bool)>, BoxError> {
                let p = &r.prompt;
                let target = engine.target();
                if p.len() > 1 {
                    let pre = SeqChunk { seq, tokens: &p[..p.len() - 1], logits: LogitRows::None };
                    target.forward(&[pre], &[], &mut cache)?;
                }
                let rest: Vec<u32> = p[p.len() - 1..].iter().chain(&g.tokens[..n - 1]).copied().collect();
                let o = target.forward(
                    &[SeqChunk { seq, tokens: &rest, logits: LogitRows::All }],
                    &[],
                    &mut cache,
                )?;
                row_logprobs(o.logits.ok_or("no logits")?, &g.tokens)
            })();
            cache.free(seq)?;
            let scored = scored?;
            run.replies.push(ScoredReply {
                prompt,
                seed,
                tokens: n,
                loglik: scored.iter().map(|s| f64::from(s.0)).sum(),
                argmax: scored.iter().filter(|s| s.1).count(),
            });
        }
    }
    Ok(run)
}
