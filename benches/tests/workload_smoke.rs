//! CPU smoke test of `bench-workload` on the trained pair (`models/`): three short prompts of
//! our own, few tokens, every workload and the gate; the report must carry its fields, greedy
//! speculative output must equal target-only output, and no gate row may fail.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn workload_benchmark_reports_every_workload_and_a_passing_gate_on_the_trained_pair() {
    let out = std::env::temp_dir().join(format!("workload-smoke-{}.json", std::process::id()));
    let md = out.with_extension("md");
    let status = Command::new(env!("CARGO_BIN_EXE_bench-workload"))
        .current_dir(repo())
        .args(["--target", "models/tiny-code-qwen3", "--draft", "models/tiny-code-dspark"])
        .args(["--prompts", "benches/tests/fixtures/workload_prompts.jsonl"])
        .args(["--max-new-tokens", "12", "--solo-requests", "2", "--team-lanes", "2", "--busy-lanes", "3"])
        .args(["--sample-seeds", "2", "--sample-prompts", "2", "--gate-texts", "2"])
        .arg("--out-json")
        .arg(&out)
        .arg("--out-md")
        .arg(&md)
        .status()
        .unwrap();
    assert!(status.success(), "bench-workload exited with {status}");
    let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let markdown = std::fs::read_to_string(&md).unwrap();
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&md);

    for key in ["date", "device", "dtype", "command", "models", "gamma", "prompts", "workloads", "gate"] {
        assert!(!report[key].is_null(), "report lacks {key}");
    }
    assert_eq!(report["gamma"], 8);
    assert_eq!(report["prompts"]["count"], 3);
    let workloads = report["workloads"].as_array().unwrap();
    let names: Vec<&str> = workloads.iter().map(|w| w["workload"].as_str().unwrap()).collect();
    assert_eq!(names, ["solo", "team", "busy"]);
    for w in workloads {
        let name = w["workload"].as_str().unwrap();
        for mode in ["target_only", "speculative"] {
            assert!(w["tokens_per_s"][mode].as_f64().unwrap() > 0.0, "{name}: {mode} tok/s");
            assert!(w["peak_memory_bytes"][mode].as_u64().unwrap() > 0, "{name}: {mode} memory");
        }
        let tau = w["tau"].as_f64().unwrap();
        assert!((1.0..=9.0).contains(&tau), "{name}: tau {tau}");
        for part in ["draft", "verify", "accept_commit", "other", "total"] {
            assert!(w["round_ms"][part].is_number(), "{name}: round_ms.{part}");
        }
        let g = &w["greedy_agreement"];
        assert_eq!(g["requests_equal"], g["requests"], "{name}: greedy outputs differ");
        assert!(g["requests"].as_u64().unwrap() > 0);
    }
    let busy = &workloads[2];
    assert_eq!(busy["lanes"], 3);

    let rows = report["gate"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6);
    let row = |prefix: &str| rows.iter().find(|r| r["check"].as_str().unwrap().starts_with(prefix)).unwrap();
    assert_eq!(row("greedy agreement")["value"].as_f64(), Some(1.0));
    assert_eq!(row("greedy agreement")["verdict"], "pass");
    assert_eq!(row("log-prob of fixed texts")["verdict"], "pass");
    assert_eq!(row("peak memory overhead")["verdict"], "pass");
    for check in ["mean log-likelihood", "share of sampled tokens", "reply length ratio"] {
        let r = row(check);
        assert!(r["value"].as_f64().unwrap().is_finite(), "{check}: no value");
        assert!(r["interval"].is_array(), "{check}: no interval");
    }
    // A handful of sampled replies cannot narrow the intervals to the limits, so those rows may
    // be inconclusive; nothing may fail.
    for r in rows {
        assert_ne!(r["verdict"], "fail", "{}", r["check"]);
    }
    assert_ne!(report["gate"]["verdict"], "fail");
    assert!(markdown.contains("## Lossless gate") && markdown.contains("| solo |"));
}
