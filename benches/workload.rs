//! Workload benchmark with the lossless gate (issue 6 item 5, DESIGN §6): speculative vs
//! target-only in the same engine, on the same device, in one command.
//!
//! Workloads: *solo* (one request at a time), *team* (`--team-lanes` concurrent requests per
//! generate call), *busy* (`--busy-lanes` concurrent requests whose longest possible rows fill
//! `--busy-fill` of a KV pool sized for them). For each: tokens/s of both modes and their ratio,
//! τ, the per-round split (draft / verify / accept+commit / other) and the peak memory of each
//! mode. The gate compares the modes: log-probabilities of fixed texts, greedy agreement, and
//! for sampled replies (same seeds in both modes) the mean log-likelihood under the target, the
//! share of target-argmax tokens and the length ratio, with 95% intervals; and the memory
//! overhead. Each mode of each phase runs in a child process of this binary (hidden `--child`),
//! so every peak-memory reading belongs to that mode alone (see `workload/memory.rs`).
//!
//! ```text
//! # CPU, the trained pair (what benches/results/2026-12-02-cpu-workload.md was made with):
//! bench-workload --target models/tiny-code-qwen3 --draft models/tiny-code-dspark \
//!     --prompts /work/shared/prompts --prompts-per-file 16 --max-new-tokens 128 \
//!     --out-md benches/results/2026-12-02-cpu-workload.md --out-json out/cpu-workload.json
//!
//! # GPU (build: CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches
//! #  --bin bench-workload), run from the repository root; the trained pair:
//! bench-workload --device cuda --dtype bf16 --target models/tiny-code-qwen3 \
//!     --draft models/tiny-code-dspark --prompts ../shared/prompts --prompts-per-file 8 \
//!     --max-new-tokens 128 --out-md benches/results/DATE-h200-workload-pair.md
//! # Qwen3-8B shapes, random bf16 weights (τ meaningless; the report adds implied speedups):
//! bench-workload --device cuda --dtype bf16 --shape qwen3-8b --prompts ../shared/prompts \
//!     --prompts-per-file 4 --max-new-tokens 32 --solo-requests 2 --team-lanes 16 \
//!     --team-requests 16 --busy-lanes 32 --sample-seeds 1 --sample-prompts 4 --gate-texts 2 \
//!     --out-md benches/results/DATE-h200-workload-8b.md --out-json out/h200-workload-8b.json
//! ```
//! Full warm-up (every workload run once untimed) is the default on CUDA, so every kernel shape
//! is compiled before timing; expect the first CUDA pass to be compile-bound.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use clap::Parser;

#[path = "workload/child.rs"]
mod child;
#[path = "clock.rs"]
mod clock;
#[path = "workload/memory.rs"]
mod memory;
#[path = "workload/report.rs"]
mod report;
#[path = "workload/setup.rs"]
mod setup;
#[path = "shapes.rs"]
mod shapes;
#[path = "workload/stats.rs"]
mod stats;

use setup::{Args, BoxError};

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.child {
        Some(spec) => run_child(&args, spec),
        None => run_parent(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench-workload: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_child(args: &Args, spec: &str) -> Result<ExitCode, BoxError> {
    let plan = setup::plan(args)?;
    let result = child::run(args, &plan, spec)?;
    let out = args.child_out.as_ref().ok_or("--child-out is required")?;
    std::fs::write(out, serde_json::to_vec(&result)?).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(ExitCode::SUCCESS)
}

fn run_parent(args: &Args) -> Result<ExitCode, BoxError> {
    args.validate()?;
    let mut plan = setup::plan(args)?;
    if args.in_process {
        plan.notes.push(
            "run with --in-process: all phases in one process (compiled kernels shared); the peak-memory \
             columns include earlier phases' pools and are not comparable between modes"
                .into(),
        );
    }
    eprintln!(
        "bench-workload: {} prompts, γ = {}, workloads {:?}, {} + gate phases per mode",
        plan.prompts.len(),
        plan.gamma(),
        args.workloads,
        args.workloads.len()
    );
    let exe = std::env::current_exe()?;
    let dir = std::env::temp_dir().join(format!("bench-workload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let forwarded: Vec<String> = std::env::args().skip(1).collect();
    let mut results = report::Results::new();
    let phases: Vec<String> = args.workloads.iter().cloned().chain(["gate".to_string()]).collect();
    let outcome = (|| -> Result<(), BoxError> {
        for phase in &phases {
            for mode in ["target", "spec"] {
                if args.in_process {
                    let result = child::run(args, &plan, &format!("{mode}:{phase}"))?;
                    let value = serde_json::from_slice(&serde_json::to_vec(&result)?)?;
                    results.insert((mode.to_string(), phase.clone()), value);
                    continue;
                }
                let out: PathBuf = dir.join(format!("{mode}-{phase}.json"));
                let status = Command::new(&exe)
                    .args(&forwarded)
                    .arg("--child")
                    .arg(format!("{mode}:{phase}"))
                    .arg("--child-out")
                    .arg(&out)
                    .status()
                    .map_err(|e| format!("starting {}: {e}", exe.display()))?;
                if !status.success() {
                    return Err(format!(
                        "the {mode} run of {phase} failed ({status}); see its messages above"
                    )
                    .into());
                }
                let text = std::fs::read(&out).map_err(|e| format!("{}: {e}", out.display()))?;
                results.insert((mode.to_string(), phase.clone()), serde_json::from_slice(&text)?);
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    outcome?;
    let report = report::build(args, &plan, &results);
    let md = report::markdown(&report);
    print!("{md}");
    if let Some(p) = &args.out_md {
        std::fs::write(p, &md).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = &args.out_json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(if report["gate"]["verdict"] == "fail" { ExitCode::from(2) } else { ExitCode::SUCCESS })
}
