//! The report: speed per workload, the lossless gate, memory; markdown and JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{Value, json};

use super::child::{ChildResult, ScoredReply, WorkloadRun};
use super::setup::{Args, Plan};
use super::stats::{Estimate, judge, ratio_difference, ratio_of_means};

/// A gate row's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    /// The point estimate meets the limit but the 95% interval is wider: more samples needed.
    Inconclusive,
    NotRun,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "**FAIL**",
            Verdict::Inconclusive => "inconclusive (interval wider than the limit)",
            Verdict::NotRun => "not run",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct GateRow {
    pub check: String,
    pub value: f64,
    pub interval: Option<[f64; 2]>,
    pub limit: String,
    pub verdict: Verdict,
    pub detail: String,
}

pub const GIB: f64 = (1u64 << 30) as f64;
/// DESIGN §6 limits.
const LOGLIK_LIMIT: f64 = 0.05;
const ARGMAX_LIMIT: f64 = 0.01;
const LENGTH_LIMIT: f64 = 0.05;
const MEMORY_LIMIT_GIB: f64 = 2.0;

pub type Results = BTreeMap<(String, String), ChildResult>;

fn get<'a>(r: &'a Results, mode: &str, phase: &str) -> Option<&'a ChildResult> {
    r.get(&(mode.to_string(), phase.to_string()))
}

fn tps(w: &WorkloadRun) -> (f64, f64) {
    (w.generated_tokens as f64 / w.wall_s.max(1e-12), w.generated_tokens as f64 / w.decode_s.max(1e-12))
}

/// Share of requests with identical outputs, and of tokens in the common prefix.
fn agreement(a: &[Vec<u32>], b: &[Vec<u32>]) -> (usize, usize, usize, usize) {
    let (mut same, mut common, mut total) = (0, 0, 0);
    for (x, y) in a.iter().zip(b) {
        same += usize::from(x == y);
        common += x.iter().zip(y).take_while(|(p, q)| p == q).count();
        total += x.len().max(y.len());
    }
    (same, a.len().min(b.len()), common, total)
}

/// The speed table's row of one workload.
fn workload_json(name: &str, t: &ChildResult, s: &ChildResult, random: bool) -> Option<Value> {
    let (tw, sw) = (t.workload.as_ref()?, s.workload.as_ref()?);
    let (t_e2e, t_dec) = tps(tw);
    let (s_e2e, s_dec) = tps(sw);
    let rounds = sw.batch_rounds.max(1) as f64;
    let ms = |x: f64| x * 1e3 / rounds;
    let other = sw.decode_s - sw.draft_s - sw.verify_s - sw.commit_s;
    let t_step = tw.decode_s / tw.batch_rounds.max(1) as f64;
    let s_round = sw.decode_s / rounds;
    let tau = sw.tau_tokens as f64 / sw.request_rounds.max(1) as f64;
    let (same, n, common, total) = agreement(&tw.outputs, &sw.outputs);
    let implied: Vec<Value> = if random {
        [2.0, 3.0, 4.0, 5.0].iter().map(|&k| json!({"tau": k, "speedup": k * t_step / s_round})).collect()
    } else {
        Vec::new()
    };
    Some(json!({
        "workload": name,
        "requests": tw.requests, "lanes": tw.lanes,
        "kv_budget_bytes": tw.kv_budget_bytes, "draft_kv_budget_bytes": sw.draft_kv_budget_bytes,
        "generated_tokens": {"target_only": tw.generated_tokens, "speculative": sw.generated_tokens},
        "tokens_per_s": {"target_only": t_e2e, "speculative": s_e2e, "ratio": s_e2e / t_e2e},
        "decode_tokens_per_s": {"target_only": t_dec, "speculative": s_dec, "ratio": s_dec / t_dec},
        "tau": tau,
        "acceptance": sw.accepted as f64 / sw.drafted.max(1) as f64,
        "round_ms": {"draft": ms(sw.draft_s), "verify": ms(sw.verify_s), "accept_commit": ms(sw.commit_s),
                     "other": ms(other), "total": s_round * 1e3},
        "target_step_ms": t_step * 1e3,
        "peak_memory_bytes": {"target_only": t.memory.peak_bytes, "speculative": s.memory.peak_bytes,
                              "overhead": s.memory.peak_bytes as f64 - t.memory.peak_bytes as f64},
        "after_load_bytes": {"target_only": t.memory.after_load_bytes, "speculative": s.memory.after_load_bytes},
        "pool_in_use_reserved": {"target_only": t.memory.pool_in_use_reserved,
                                 "speculative": s.memory.pool_in_use_reserved},
        "greedy_agreement": {"requests_equal": same, "requests": n, "common_prefix_tokens": common,
                             "tokens": total},
        "implied_speedup": implied,
        "wall_s": {"target_only": tw.wall_s, "speculative": sw.wall_s},
        "warmup_s": {"target_only": tw.warmup_s, "speculative": sw.warmup_s},
    }))
}

fn replies(r: &ChildResult) -> &[ScoredReply] {
    r.gate.as_ref().map_or(&[], |g| &g.replies)
}

fn gate_rows(args: &Args, results: &Results, workloads: &[Value]) -> Vec<GateRow> {
    let mut rows = Vec::new();
    let (tg, sg) = (get(results, "target", "gate"), get(results, "spec", "gate"));
    // 1. fixed texts.
    let (mut max_d, mut n_tok, mut t_score, mut s_score) = (0f64, 0usize, 0f64, 0f64);
    if let (Some(t), Some(s)) = (tg.and_then(|g| g.gate.as_ref()), sg.and_then(|g| g.gate.as_ref())) {
        for (a, b) in t.texts.iter().zip(&s.texts) {
            for (x, y) in a.stepped.iter().zip(&b.stepped) {
                max_d = max_d.max(f64::from((x - y).abs()));
                n_tok += 1;
            }
            let dev = |v: &super::child::TextLogprobs| {
                v.stepped.iter().zip(&v.score).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max)
            };
            t_score = t_score.max(dev(a));
            s_score = s_score.max(dev(b));
        }
    }
    rows.push(GateRow {
        check: "log-prob of fixed texts, max |Δ| per token (target-only steps vs speculative verify windows)"
            .into(),
        value: max_d,
        interval: None,
        limit: format!("≤ {:e}", args.logprob_limit()),
        verdict: if n_tok == 0 {
            Verdict::NotRun
        } else if max_d <= args.logprob_limit() {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        detail: format!(
            "{n_tok} tokens; bit-exact (the batch-invariance goal): {}; vs Engine::score: target-only \
             {t_score:.3e}, speculative {s_score:.3e}",
            if max_d == 0.0 { "yes" } else { "no" }
        ),
    });
    // 2. greedy agreement over every workload.
    let sum = |k: &str| workloads.iter().map(|w| w["greedy_agreement"][k].as_u64().unwrap_or(0)).sum::<u64>();
    let (same, n, common, total) =
        (sum("requests_equal"), sum("requests"), sum("common_prefix_tokens"), sum("tokens"));
    let share = same as f64 / n.max(1) as f64;
    rows.push(GateRow {
        check: "greedy agreement (share of requests with identical output)".into(),
        value: share,
        interval: None,
        limit: "= 1.000".into(),
        verdict: if n == 0 {
            Verdict::NotRun
        } else if same == n {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        detail: format!(
            "{same}/{n} requests; {common}/{total} tokens in the common prefix ({:.4})",
            common as f64 / total.max(1) as f64
        ),
    });
    // 3–5. sampled replies, unpaired (replies are the independent units).
    let (tr, sr) = (tg.map(replies).unwrap_or(&[]), sg.map(replies).unwrap_or(&[]));
    let ll = |r: &[ScoredReply]| r.iter().map(|x| (x.tokens as f64, x.loglik)).collect::<Vec<_>>();
    let am = |r: &[ScoredReply]| r.iter().map(|x| (x.tokens as f64, x.argmax as f64)).collect::<Vec<_>>();
    let len = |r: &[ScoredReply]| r.iter().map(|x| x.tokens as f64).collect::<Vec<_>>();
    let sampled = format!(
        "{} + {} replies at T = {}, {} + {} tokens",
        tr.len(),
        sr.len(),
        args.temperature,
        tr.iter().map(|r| r.tokens).sum::<usize>(),
        sr.iter().map(|r| r.tokens).sum::<usize>()
    );
    let mut interval_row = |check: &str, e: Estimate, lo: f64, hi: f64, limit: String, detail: String| {
        rows.push(GateRow {
            check: check.into(),
            value: e.value,
            interval: e.has_interval().then_some([e.lo, e.hi]),
            limit,
            verdict: if tr.is_empty() || sr.is_empty() { Verdict::NotRun } else { judge(&e, lo, hi) },
            detail,
        });
    };
    let mean_ll = |r: &[ScoredReply]| super::stats::ratio_of_sums(&ll(r)).0;
    interval_row(
        "mean log-likelihood per token of sampled replies under the target (speculative − target-only)",
        ratio_difference(&ll(tr), &ll(sr)),
        -LOGLIK_LIMIT,
        LOGLIK_LIMIT,
        format!("within ±{LOGLIK_LIMIT} at 95%"),
        format!("{sampled}; target-only {:.4}, speculative {:.4} nats/token", mean_ll(tr), mean_ll(sr)),
    );
    let share_am = |r: &[ScoredReply]| super::stats::ratio_of_sums(&am(r)).0;
    interval_row(
        "share of sampled tokens that were the target's argmax (speculative − target-only)",
        ratio_difference(&am(tr), &am(sr)),
        -ARGMAX_LIMIT,
        ARGMAX_LIMIT,
        format!("within ±{ARGMAX_LIMIT} at 95%"),
        format!("target-only {:.4}, speculative {:.4}", share_am(tr), share_am(sr)),
    );
    let ml = |r: &[ScoredReply]| len(r).iter().sum::<f64>() / r.len().max(1) as f64;
    interval_row(
        "reply length ratio (speculative / target-only)",
        ratio_of_means(&len(tr), &len(sr)),
        1.0 - LENGTH_LIMIT,
        1.0 + LENGTH_LIMIT,
        format!("1 ± {LENGTH_LIMIT} at 95%"),
        format!("mean {:.1} vs {:.1} tokens (max {})", ml(tr), ml(sr), args.max_new_tokens),
    );
    // 6. memory.
    let worst = workloads
        .iter()
        .filter_map(|w| Some((w["workload"].as_str()?, w["peak_memory_bytes"]["overhead"].as_f64()?)))
        .fold(None, |acc: Option<(&str, f64)>, (n, o)| match acc {
            Some((_, best)) if best >= o => acc,
            _ => Some((n, o)),
        });
    rows.push(GateRow {
        check: "peak memory overhead (speculative − target-only, same KV budget, worst workload)".into(),
        value: worst.map_or(f64::NAN, |w| w.1 / GIB),
        interval: None,
        limit: format!("≤ {MEMORY_LIMIT_GIB} GiB"),
        verdict: match worst {
            None => Verdict::NotRun,
            Some((_, o)) if o / GIB <= MEMORY_LIMIT_GIB => Verdict::Pass,
            _ => Verdict::Fail,
        },
        detail: worst.map_or(String::new(), |(n, o)| format!("{n}: {:.1} MiB", o / f64::from(1 << 20))),
    });
    rows
}

/// Overall: fail if any row fails; pass if every row that ran passes; otherwise inconclusive.
fn overall(rows: &[GateRow]) -> Verdict {
    if rows.iter().any(|r| r.verdict == Verdict::Fail) {
        Verdict::Fail
    } else if rows.iter().all(|r| matches!(r.verdict, Verdict::Pass | Verdict::NotRun)) {
        Verdict::Pass
    } else {
        Verdict::Inconclusive
    }
}

use crate::clock::now_utc;

pub fn command_line() -> String {
    std::env::args()
        .map(|a| if a.contains([' ', '"', '\'']) { format!("'{a}'") } else { a })
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn build(args: &Args, plan: &Plan, results: &Results) -> Value {
    let random = args.random();
    let workloads: Vec<Value> = args
        .workloads
        .iter()
        .filter_map(|w| workload_json(w, get(results, "target", w)?, get(results, "spec", w)?, random))
        .collect();
    let rows = gate_rows(args, results, &workloads);
    let verdict = overall(&rows);
    let any = results.values().next();
    let device_name = any.and_then(|r| r.memory.device_name.clone()).unwrap_or_default();
    let models = if random {
        json!({"shape": args.shape, "seed": args.seed})
    } else {
        json!({"target": args.target, "draft": args.draft})
    };
    json!({
        "date": now_utc(),
        "device": args.device, "device_name": device_name, "dtype": args.dtype,
        "command": command_line(),
        "models": models,
        "gamma": plan.gamma(), "verify": args.verify,
        "prompts": {"files": args.prompts, "count": plan.prompts.len(), "per_file": args.prompts_per_file,
                    "mean_tokens": plan.prompts.iter().map(Vec::len).sum::<usize>() as f64
                        / plan.prompts.len().max(1) as f64},
        "max_new_tokens": args.max_new_tokens, "stop_token_ids": plan.stop,
        "memory_kind": any.map(|r| r.memory.kind.clone()),
        "warmup": if args.full_warmup() { "full" } else { "short" },
        "workloads": workloads,
        "gate": {"rows": rows, "verdict": verdict},
        "load_s": results.iter().map(|((m, p), r)| (format!("{m}:{p}"), r.load_s)).collect::<BTreeMap<_, _>>(),
        "notes": plan.notes,
    })
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn mib(v: &Value) -> String {
    format!("{:.1}", f(v) / f64::from(1 << 20))
}

pub fn markdown(report: &Value) -> String {
    let mut s = String::new();
    let r = report;
    let _ = writeln!(s, "# Workload benchmark: speculative vs target-only\n");
    let _ = writeln!(s, "- date: {}", r["date"].as_str().unwrap_or(""));
    let _ = writeln!(
        s,
        "- device: `{}` ({}), dtype {}",
        r["device"].as_str().unwrap_or(""),
        r["device_name"].as_str().unwrap_or(""),
        r["dtype"].as_str().unwrap_or("")
    );
    let _ = writeln!(s, "- command: `{}`", r["command"].as_str().unwrap_or(""));
    let _ = writeln!(s, "- models: `{}`; γ = {}, verify {}", r["models"], r["gamma"], r["verify"]);
    let _ = writeln!(
        s,
        "- prompts: {} (mean {:.0} tokens, chat template applied), max_new_tokens {}, stop ids {}; \
         warm-up {}",
        r["prompts"]["count"],
        f(&r["prompts"]["mean_tokens"]),
        r["max_new_tokens"],
        r["stop_token_ids"],
        r["warmup"].as_str().unwrap_or("")
    );
    for n in r["notes"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "- note: {}", n.as_str().unwrap_or(""));
    }
    let _ = writeln!(s, "\n## Speed (greedy)\n");
    let _ = writeln!(
        s,
        "| workload | requests × lanes | KV budget MiB (target + draft) | target-only tok/s | speculative tok/s | \
         ratio | decode-only ratio | τ | accepted | round ms: draft / verify / accept+commit / other | \
         target step ms | peak MiB target-only | peak MiB speculative | overhead MiB |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for w in r["workloads"].as_array().into_iter().flatten() {
        let rm = &w["round_ms"];
        let pm = &w["peak_memory_bytes"];
        let _ = writeln!(
            s,
            "| {} | {} × {} | {} + {} | {:.1} | {:.1} | **{:.2}×** | {:.2}× | {:.2} | {:.0}% | {:.2} / {:.2} / {:.2} / {:.2} | {:.2} | {} | {} | {} |",
            w["workload"].as_str().unwrap_or(""),
            w["requests"],
            w["lanes"],
            mib(&w["kv_budget_bytes"]),
            mib(&w["draft_kv_budget_bytes"]),
            f(&w["tokens_per_s"]["target_only"]),
            f(&w["tokens_per_s"]["speculative"]),
            f(&w["tokens_per_s"]["ratio"]),
            f(&w["decode_tokens_per_s"]["ratio"]),
            f(&w["tau"]),
            100.0 * f(&w["acceptance"]),
            f(&rm["draft"]),
            f(&rm["verify"]),
            f(&rm["accept_commit"]),
            f(&rm["other"]),
            f(&w["target_step_ms"]),
            mib(&pm["target_only"]),
            mib(&pm["speculative"]),
            mib(&pm["overhead"]),
        );
    }
    let implied: Vec<&Value> = r["workloads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["implied_speedup"].as_array().is_some_and(|a| !a.is_empty()))
        .collect();
    if !implied.is_empty() {
        let _ = writeln!(
            s,
            "\nImplied speedup at stated acceptance (τ × target step / measured speculative round, rounds at full verify width):\n"
        );
        let _ = writeln!(s, "| workload | τ = 2 | τ = 3 | τ = 4 | τ = 5 |\n|---|---|---|---|---|");
        for w in implied {
            let v: Vec<String> = w["implied_speedup"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| format!("{:.2}×", f(&x["speedup"])))
                .collect();
            let _ = writeln!(s, "| {} | {} |", w["workload"].as_str().unwrap_or(""), v.join(" | "));
        }
    }
    let _ = writeln!(
        s,
        "\ntok/s: generated tokens / wall time of the generate calls (prefill included); decode-only: / decode \
         time. τ: committed tokens per verify round after the first token. Round split from the engine's \
         batch statistics, per batch round; target step: decode time / decode steps of the target-only run."
    );
    let _ = writeln!(s, "\n## Lossless gate (speculative vs target-only)\n");
    let _ =
        writeln!(s, "| check | value | 95% interval | limit | verdict | detail |\n|---|---|---|---|---|---|");
    for g in r["gate"]["rows"].as_array().into_iter().flatten() {
        let interval = g["interval"]
            .as_array()
            .map_or("—".to_string(), |a| format!("[{:.4}, {:.4}]", f(&a[0]), f(&a[1])));
        let verdict: Verdict = match g["verdict"].as_str() {
            Some("pass") => Verdict::Pass,
            Some("fail") => Verdict::Fail,
            Some("inconclusive") => Verdict::Inconclusive,
            _ => Verdict::NotRun,
        };
        let _ = writeln!(
            s,
            "| {} | {:.4e} | {} | {} | {} | {} |",
            g["check"].as_str().unwrap_or(""),
            f(&g["value"]),
            interval,
            g["limit"].as_str().unwrap_or(""),
            verdict.label(),
            g["detail"].as_str().unwrap_or("")
        );
    }
    let _ = writeln!(s, "\n**Gate: {}**", r["gate"]["verdict"].as_str().unwrap_or("").to_uppercase());
    let memory = match r["memory_kind"].as_str() {
        Some("cuda-device") => {
            "device memory in use (cuMemGetInfo total − free, sampled every 1 ms over the whole child process, \
             minus the reading right after the CUDA context was created): weights, KV pools, activations and \
             CubeCL's reserved pages; one child process per mode and workload"
        }
        _ => {
            "peak resident set (VmHWM, reset after the models were built so the checkpoint-conversion \
             transient is left out) of a child process that ran only that mode and workload: resident \
             weights, KV pools, activations, host buffers, allocator slack (on CPU the KV pools are host \
             memory)"
        }
    };
    let _ = writeln!(
        s,
        "\nMemory: {memory}. Both modes use the same KV budget in bytes for the target; the speculative mode \
         adds the draft's weights and its context KV pool (sized like the target's, for committed rows only). \
         Sampled rows: replies are the independent units (unpaired, delta method, Student's t with Welch's \
         degrees of freedom); a row passes when its whole 95% interval lies within the limit. Log-probabilities: each mode computes the same fixed texts the \
         way its engine does (target-only one row per step; speculative verify windows of γ + 1 rows with a \
         fixed pattern of accepted prefixes and rejected rows recomputed)."
    );
    s
}
