//! Measures the throughput scheduler's cost table: target verify-step time against total verify
//! rows, and draft round time against lane count; writes it as JSON for
//! `dspark::engine::schedule::CostTable::load` and prints markdown tables.
//!
//! Verify step = what the speculative engine does per round on the target: one ragged
//! `Qwen3::forward` over `[lanes × width]` rows (every row's logits, features of the draft's
//! layers captured) on top of `--context` cached rows per lane, then the logits read back to the
//! host. Every (lanes, width) pair of the grid is timed (median of `--reps` after `--warmup`
//! untimed steps; the verify rows are cut from the cache after each step), in `--passes` passes
//! over the grid of which the fastest is kept per shape (a shared machine slows some down); the
//! table keeps, for each total T, the pair with the fewest lanes (the widest windows). Draft round =
//! `DSparkDraft::propose` for that many lanes (block forward, readback, host Markov pass).
//!
//! ```text
//! bench-cost-table --out benches/results/cost-tables/cpu-tiny-code.json          # trained pair, CPU
//! bench-cost-table --device cuda --dtype bf16 --target random:qwen3-8b --draft none \
//!     --draft-ms 1=1.1,16=1.6 --out h200-qwen3-8b.json                         # random 8B target
//! ```

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::Device;
use clap::Parser;
use dspark::engine::schedule::{CostMeta, CostTable, DraftCost, VerifyCost, choose_budget};
use dspark::model::default_target_layer_ids;
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, KvCache, LoadOptions, LogitRows, PagedKvCache,
    ProposeLane, Qwen3, Qwen3Config, SamplingParams, SeqChunk, SeqId, Speculator,
};

#[derive(Parser)]
struct Args {
    /// Target checkpoint folder, or `random:qwen3-8b` / `random:tiny` (random weights).
    #[arg(long, default_value = "models/tiny-code-qwen3")]
    target: String,
    /// Draft checkpoint folder, `random` (the released DSpark shape for a `random:` target, random
    /// weights), or `none` (then `--draft-ms` gives the draft times).
    #[arg(long, default_value = "models/tiny-code-dspark")]
    draft: String,
    /// Draft round times when there is no draft to time: `lanes=ms` pairs, e.g. `1=1.1,16=1.6`.
    #[arg(long, value_delimiter = ',')]
    draft_ms: Vec<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Lane counts of the grid.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    lanes: Vec<usize>,
    /// Draft block size γ (widths 1..=γ+1); default: the draft's, else 8.
    #[arg(long)]
    gamma: Option<usize>,
    /// Cached context rows per lane under the timed steps.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Untimed steps before each timed shape.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps per shape and pass (the median is kept).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Passes over the whole grid; per shape the fastest pass's median is kept (a shared machine
    /// slows some passes down).
    #[arg(long, default_value_t = 3)]
    passes: usize,
    /// Feature layers captured during verify when there is no draft (default: 5 spread layers).
    #[arg(long, value_delimiter = ',')]
    capture: Vec<usize>,
    /// The machine, in words, for the table's metadata.
    #[arg(long, default_value = "")]
    machine: String,
    /// Where to write the cost table (JSON).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[path = "shapes.rs"]
mod shapes;

fn random_config(shape: &str) -> dspark::Result<Qwen3Config> {
    shapes::qwen3(shape).map_err(dspark::Error::InvalidInput)
}

fn sync(device: &Device) -> dspark::Result<()> {
    device.sync().map_err(|e| dspark::Error::Backend(format!("device sync: {e:?}")))
}

fn median_ms(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2] * 1e3
}

/// Deterministic token ids spread over the vocabulary.
fn tokens(n: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32).collect()
}

#[path = "clock.rs"]
mod clock;
use clock::today;

fn parse_draft_ms(pairs: &[String]) -> dspark::Result<Vec<DraftCost>> {
    pairs
        .iter()
        .map(|p| {
            let bad = || dspark::Error::InvalidInput(format!("--draft-ms entry {p:?} is not lanes=ms"));
            let (l, ms) = p.split_once('=').ok_or_else(bad)?;
            Ok(DraftCost {
                lanes: l.trim().parse().map_err(|_| bad())?,
                ms: ms.trim().parse().map_err(|_| bad())?,
            })
        })
        .collect()
}

/// One timed verify shape.
struct Shape {
    lanes: usize,
    width: usize,
    ms: f64,
}

fn main() -> dspark::Result<()> {
    let args = Args::parse();
    let kind: DeviceKind = args.device.parse()?;
    let dtype: ComputeDtype = args.dtype.parse()?;
    let device = kind.device()?;
    if args.reps == 0 || args.passes == 0 || args.lanes.is_empty() || args.lanes.contains(&0) {
        return Err(dspark::Error::InvalidInput("need --reps ≥ 1, --passes ≥ 1 and positive --lanes".into()));
    }
    let started = Instant::now();
    let target = match args.target.strip_prefix("random:") {
        Some(shape) => Qwen3::random(random_config(shape)?, dtype, kind)?,
        None => Qwen3::load(args.target.as_ref(), LoadOptions { device: kind, dtype, progress: None })?,
    };
    let mut draft = match args.draft.as_str() {
        "none" => None,
        // Random weights at the released draft's shape, bound to the (random) target.
        "random" => {
            let shape = args.target.strip_prefix("random:").ok_or_else(|| {
                dspark::Error::InvalidInput("--draft random needs a random:<shape> target".into())
            })?;
            let config = shapes::dspark(shape, target.config());
            let cache = DraftCacheConfig { kv_budget_bytes: 256 << 20, page_size: 16 };
            Some(DSparkDraft::random(config, dspark::TargetBinding::of(&target), &cache)?)
        }
        dir => {
            let cache = DraftCacheConfig { kv_budget_bytes: 256 << 20, page_size: 16 };
            let options = LoadOptions { device: kind, dtype, progress: None };
            Some(DSparkDraft::load(dir.as_ref(), &target, options, &cache)?)
        }
    };
    sync(&device)?;
    eprintln!("loaded models in {:.1} s", started.elapsed().as_secs_f64());
    let gamma = args.gamma.or(draft.as_ref().map(|d| d.block_size())).unwrap_or(8);
    let n_layers = target.config().num_hidden_layers;
    let capture: Vec<usize> = match &draft {
        Some(d) => d.feature_layers().to_vec(),
        None if args.capture.is_empty() => default_target_layer_ids(n_layers, 5),
        None => args.capture.clone(),
    };
    let vocab = target.vocab_size();
    let max_lanes = args.lanes.iter().copied().max().unwrap_or(1);
    // 1. context: one ragged prefill of `context` rows per lane; its features seed the draft.
    let layout = target.kv_layout(16);
    let rows = max_lanes * (args.context + gamma + 1 + 2 * layout.page_size);
    let mut cache = PagedKvCache::new(layout, rows * layout.row_bytes(), &device)?;
    let seqs: Vec<SeqId> = (0..max_lanes).map(|_| cache.allocate()).collect();
    let prompts: Vec<Vec<u32>> = (0..max_lanes).map(|i| tokens(args.context.max(1), i, vocab)).collect();
    let chunks: Vec<SeqChunk<'_>> = seqs
        .iter()
        .zip(&prompts)
        .map(|(&seq, p)| SeqChunk { seq, tokens: p, logits: LogitRows::Last })
        .collect();
    let out = target.forward(&chunks, &capture, &mut cache)?;
    let draft_seqs: Vec<SeqId> = match draft.as_mut() {
        Some(d) => {
            let features =
                out.features.clone().ok_or_else(|| dspark::Error::Backend("no features".into()))?;
            let mut list = Vec::new();
            for r in &out.rows {
                let seq = d.begin();
                d.extend_context(seq, features.clone().narrow(0, r.start, r.len()))?;
                list.push(seq);
            }
            list
        }
        None => Vec::new(),
    };
    drop(out);
    sync(&device)?;
    let context = args.context.max(1);
    // 2. verify steps over the grid; each pass times every shape, the fastest pass is kept.
    let mut grid: Vec<Shape> = Vec::new();
    for pass in 0..args.passes {
        for &lanes in &args.lanes {
            for width in 1..=gamma + 1 {
                let windows: Vec<Vec<u32>> = (0..lanes).map(|i| tokens(width, 1000 + i, vocab)).collect();
                let mut times = Vec::new();
                for rep in 0..args.warmup + args.reps {
                    let chunks: Vec<SeqChunk<'_>> = seqs[..lanes]
                        .iter()
                        .zip(&windows)
                        .map(|(&seq, w)| SeqChunk { seq, tokens: w, logits: LogitRows::All })
                        .collect();
                    sync(&device)?;
                    let t = Instant::now();
                    let out = target.forward(&chunks, &capture, &mut cache)?;
                    let logits = out.logits.ok_or_else(|| dspark::Error::Backend("no logits".into()))?;
                    let host = logits
                        .try_into_vec_as::<f32>()
                        .map_err(|e| dspark::Error::Backend(format!("logits readback: {e:?}")))?;
                    let elapsed = t.elapsed().as_secs_f64();
                    debug_assert_eq!(host.len(), lanes * width * vocab);
                    for &seq in &seqs[..lanes] {
                        cache.truncate(seq, context)?;
                    }
                    if rep >= args.warmup {
                        times.push(elapsed);
                    }
                }
                let ms = median_ms(times);
                eprintln!(
                    "pass {pass}: verify lanes {lanes:>3} width {width:>2} T {:>4}: {ms:.3} ms",
                    lanes * width
                );
                match grid.iter_mut().find(|s| (s.lanes, s.width) == (lanes, width)) {
                    Some(s) => s.ms = s.ms.min(ms),
                    None => grid.push(Shape { lanes, width, ms }),
                }
            }
        }
    }
    // 3. draft rounds per lane count.
    let params = SamplingParams::greedy(1 << 20);
    let draft_costs = match draft.as_mut() {
        Some(d) => {
            let mut costs: Vec<DraftCost> = Vec::new();
            for pass in 0..args.passes {
                for &lanes in &args.lanes {
                    let propose: Vec<ProposeLane<'_>> = draft_seqs[..lanes]
                        .iter()
                        .enumerate()
                        .map(|(i, &seq)| ProposeLane {
                            seq,
                            anchor: tokens(1, 2000 + i, vocab)[0],
                            params: &params,
                        })
                        .collect();
                    let mut times = Vec::new();
                    for rep in 0..args.warmup + args.reps {
                        sync(&device)?;
                        let t = Instant::now();
                        let proposals = d.propose(&propose)?;
                        let elapsed = t.elapsed().as_secs_f64();
                        debug_assert_eq!(proposals.len(), lanes);
                        if rep >= args.warmup {
                            times.push(elapsed);
                        }
                    }
                    let ms = median_ms(times);
                    eprintln!("pass {pass}: draft lanes {lanes:>3}: {ms:.3} ms");
                    match costs.iter_mut().find(|c| c.lanes == lanes) {
                        Some(c) => c.ms = c.ms.min(ms),
                        None => costs.push(DraftCost { lanes, ms }),
                    }
                }
            }
            costs
        }
        None => parse_draft_ms(&args.draft_ms)?,
    };
    // 4. the table: per total T, the pair with the fewest lanes.
    let mut verify: Vec<VerifyCost> = Vec::new();
    let mut by_t: Vec<&Shape> = grid.iter().collect();
    by_t.sort_by_key(|s| (s.lanes * s.width, s.lanes));
    for s in by_t {
        let tokens = s.lanes * s.width;
        if verify.last().is_none_or(|v| v.tokens < tokens) {
            verify.push(VerifyCost { tokens, ms: s.ms, lanes: Some(s.lanes), width: Some(s.width) });
        }
    }
    let mut draft_costs = draft_costs;
    draft_costs.sort_by_key(|d| d.lanes);
    let model = match &draft {
        Some(_) => format!("target {} + draft {}", args.target, args.draft),
        None => format!("target {} (draft times given on the command line)", args.target),
    };
    let meta = CostMeta {
        device: kind.to_string(),
        dtype: dtype.to_string(),
        model,
        date: today(),
        machine: args.machine.clone(),
        gamma: Some(gamma),
        context: Some(context),
        notes: format!(
            "per shape the fastest of {} passes' medians of {} timed steps after {} warm-up; verify = Qwen3::forward over \
             lanes x width rows (all logits, feature capture of layers {capture:?}) + logits readback \
             to host; per T the (lanes, width) pair with the fewest lanes; draft = {} ",
            args.passes,
            args.reps,
            args.warmup,
            if draft.is_some() {
                "DSparkDraft::propose, greedy, incl. readback and host Markov pass"
            } else {
                "given on the command line"
            }
        )
        .trim()
        .to_string(),
    };
    let table = CostTable::new(meta, verify, draft_costs)?;
    print_tables(&args, &table, &grid, gamma);
    if let Some(path) = &args.out {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| dspark::Error::Io { path: dir.into(), source: e })?;
        }
        table.save(path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn print_tables(args: &Args, table: &CostTable, grid: &[Shape], gamma: usize) {
    let m = table.meta();
    println!(
        "cost table: {} {} {}, {}; context {} rows/lane; {}",
        m.device, m.dtype, m.model, m.machine, args.context, m.date
    );
    println!();
    println!("| verify rows T | lanes × width | ms | ms per row |");
    println!("|---|---|---|---|");
    for v in table.verify_points() {
        println!(
            "| {} | {} × {} | {:.3} | {:.3} |",
            v.tokens,
            v.lanes.unwrap_or(0),
            v.width.unwrap_or(0),
            v.ms,
            v.ms / v.tokens as f64
        );
    }
    println!();
    print!("| lanes \\ width |");
    (1..=gamma + 1).for_each(|w| print!(" {w} |"));
    println!();
    println!("|---|{}", "---|".repeat(gamma + 1));
    for &lanes in &args.lanes {
        print!("| {lanes} |");
        grid.iter().filter(|s| s.lanes == lanes).for_each(|s| print!(" {:.3} |", s.ms));
        println!();
    }
    println!();
    println!("| lanes | draft ms |");
    println!("|---|---|");
    for d in table.draft_points() {
        println!("| {} | {:.3} |", d.lanes, d.ms);
    }
    println!();
    println!("budget chosen for uniform confidences c (rows per lane in brackets):");
    println!();
    println!("| lanes | c = 0.5 | c = 0.7 | c = 0.9 | c = 0.99 |");
    println!("|---|---|---|---|---|");
    for &lanes in &args.lanes {
        print!("| {lanes} |");
        for c in [0.5f32, 0.7, 0.9, 0.99] {
            let conf = vec![c; gamma];
            let earlier: Vec<&[f32]> = (0..lanes).map(|_| conf.as_slice()).collect();
            let b = choose_budget(table, &earlier, gamma);
            print!(" {b} ({:.1}) |", b as f64 / lanes as f64);
        }
        println!();
    }
}
