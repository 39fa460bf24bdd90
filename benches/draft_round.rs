//! Draft-round benchmark at real shapes with random weights (issue 4 item 3): a Qwen3-8B-shaped
//! target and DSpark-shaped drafts (γ = 7 with the confidence head, as released; γ = 16
//! without, as SpecForge exports), built on the device. For each layout, in one run:
//!
//! - the target's one-row decode step and its verify step of γ + 1 rows (logits of every row,
//!   argmax, readback);
//! - the draft's context extension by 4 committed rows (fc, hidden norm, K/V of every draft
//!   layer), and a full proposal — block forward, LM-head rows, Markov loop, confidence, and `q`
//!   when sampling — greedy and at temperature 1 (with `q` made on the host, and with its rows
//!   left on the device as the engine asks where it verifies there);
//! - chain acceptance of one lane's γ drafts on the device (`dspark_kernels::chain_accept`,
//!   random rows, T = 1, plain and with top-k 50 / top-p 0.9), with the verdict read back, and
//!   the host path it replaces (rows read back, `target_probs_rows`, `chain_verify`);
//! - with `--graphs on,off`, all of it with recorded CUDA graphs and op by op;
//! - a greedy round's proposal and verify back to back, as the engine runs them: the drafts
//!   read back before the verify (two reads), and, with graphs on, the whole round in one read
//!   (`EngineConfig::one_sync_rounds`): the verify queued behind the draft round, reading its
//!   drafts on the device, and the draft's context extended by the whole window behind it;
//! - the speedup over target-only these times imply at acceptance τ:
//!   `τ · step / (extend + propose + verify)`, and with the one-read round `τ · step / round`.
//!
//! Medians of `--reps` runs after `--warmup` untimed ones. Prints a markdown table.
//!
//! ```text
//! bench-draft --device cuda --dtype bf16 --layouts 7c,16 --reps 20
//! bench-draft --device cpu --dtype f32 --shape tiny --reps 3          # smoke test
//! bench-draft --device cpu --dtype f32 --shape tiny --reps 3 --emulate-graphs  # recorded paths
//! ```

// Only the meter is used here.
#[allow(dead_code)]
#[path = "workload/memory.rs"]
mod memory;
#[path = "profile.rs"]
mod profile;
#[path = "shapes.rs"]
mod shapes;
#[path = "spans.rs"]
mod spans;

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorCreationOptions, TensorData};
use clap::Parser;
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DeviceTokens, DraftCacheConfig, KvCache, LogitRows, PagedKvCache,
    ProposeLane, Qwen3, SamplingParams, SeqChunk, SeqId, Speculator, TargetBinding,
};

#[derive(Parser)]
struct Args {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// qwen3-8b or tiny.
    #[arg(long, default_value = "qwen3-8b")]
    shape: String,
    /// Draft layouts: γ, with a `c` suffix for the confidence head (`7c`: released; `16`:
    /// SpecForge export).
    #[arg(long, value_delimiter = ',', default_value = "7c,16")]
    layouts: Vec<String>,
    /// Context rows before timing (target and draft).
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Untimed repetitions before timing.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed repetitions (medians are reported).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Draft weights to time, each a table row per layout: `bf16` (as built), `fp8` (projections
    /// quantised to e4m3, per-channel scales) or `fp8h` (also an FP8 copy of the LM head for the
    /// base logits).
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    weights: Vec<String>,
    /// Draft vocabularies to time, each a table row per layout and weights: `0` the whole
    /// vocabulary, `K` its first K ids (`DSparkDraft::restrict_vocab` with
    /// `DraftVocab::leading`; the weights column then reads e.g. `fp8h, vocab 32768`). The
    /// implied speedups assume the same τ: a restricted draft's τ is to be measured apart.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    draft_vocab: Vec<usize>,
    /// Where a `c` layout's confidence head runs, each a table row per layout and weights:
    /// `device` (with the device Markov pass: γ logits a lane read back;
    /// `DSparkDraft::set_device_confidence(true)`) or `host` (the block's hidden rows read back,
    /// f64 dot products on the host: the path `dspark_kernels::set_confidence_kernel(false)`
    /// leaves; the weights column then reads e.g. `fp8h, host confidence`), for an A/B in one
    /// call.
    #[arg(long, value_delimiter = ',', default_value = "device", value_parser = ["device", "host"])]
    confidence: Vec<String>,
    /// How FP8 drafts hold their gate/up weights, each a table row per layout and weights: `on`
    /// (paired, the SwiGLU as the product's epilogue: the library's default,
    /// `dspark_kernels::set_fp8_swiglu`) or `off` (stacked, the product then the SwiGLU kernel;
    /// the weights column then reads e.g. `fp8h, stacked gate/up`), for an A/B in one call.
    /// bf16 drafts take the epilogue always.
    #[arg(long, value_delimiter = ',', default_value = "on", value_parser = ["off", "on"])]
    fp8_swiglu: Vec<String>,
    /// Launch modes to time, each a table row per layout and weights: `on` (forwards, draft
    /// rounds and context extensions replayed as recorded CUDA graphs) or `off` (op by op).
    #[arg(long, value_delimiter = ',', default_value = "on")]
    graphs: Vec<String>,
    /// Acceptance lengths τ at which to report the implied speedup.
    #[arg(long, value_delimiter = ',', default_value = "3.35,6.0")]
    tau: Vec<f64>,
    /// Phases to run once more inside a profiling window (see `profile.rs`), after they are
    /// timed: `step` (target one-row step), `verify` (γ + 1 rows), `extend` (4 rows), `propose`
    /// (greedy), `propose-sampled` (T = 1). Run under `ncu --profile-from-start off` to see each kernel of one phase.
    #[arg(long, value_delimiter = ',')]
    profile: Vec<String>,
    /// After each phase is timed, run it `--reps` times more and print the host time inside each
    /// of the library's spans (`spans.rs`) beside the phase's wall time.
    #[arg(long)]
    spans: bool,
    /// Attention's split kernel: `tc` (tensor cores, the default) or `warp` (one warp per query
    /// row and head), for an A/B of the two in one call.
    #[arg(long, default_value = "tc", value_parser = ["tc", "warp"])]
    attention: String,
    /// Fewest keys of an attention split: 32 (the library's default), 64, 128 or 256
    /// (`dspark_kernels::set_attention_min_chunk`), for an A/B; the column then reads
    /// `(splits of ≥ N keys)`.
    #[arg(long, default_value = "32", value_parser = ["32", "64", "128", "256"])]
    attn_min_chunk: String,
    /// Threads of the RMSNorm cube: 1024 (the library's default), 512 or 256
    /// (`dspark_kernels::set_norm_threads`), for an A/B; the column then reads `(norm N threads)`.
    #[arg(long, default_value = "1024", value_parser = ["256", "512", "1024"])]
    norm_threads: String,
    /// Record graphs with programmatic dependencies between the kernels (`on`: from the kernel
    /// before's launch-completion port; `trigger`: from its programmatic port) or plain edges
    /// (`off`, the library's default; `dspark_kernels::set_programmatic_launch`), for an A/B
    /// across processes; the column then reads `(PDL)` or `(PDL, trigger)`.
    #[arg(long, default_value = "off", value_parser = ["on", "trigger", "off"])]
    pdl: String,
    /// Launch the bf16 products of 17–24 rows (a γ = 16 block or verify window) as four
    /// activation tiles (`on`, the library's default) or three (`off`), for an A/B
    /// (`dspark_kernels::set_tile_padding`).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pad_tiles: String,
    /// Take the recorded forwards' integer inputs as views of their buffer (`on`, the library's
    /// default) or as copies (`off`), for an A/B (`dspark_kernels::set_int_views`).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    int_views: String,
    /// Merge a one-row lane's attention splits inside the split kernel (`on`) or in a second
    /// launch (`off`, the library's default), for an A/B (`dspark_kernels::set_attention_fold`:
    /// the same bits).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    attn_fold: String,
    /// Run a layer's tail (o, norm, gate/up, down, norm) as one chained launch where it can
    /// (`on`) or as five launches (`off`, the library's default), for an A/B
    /// (`dspark_kernels::set_layer_chain`: the same bits).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    layer_chain: String,
    /// Weight chunks each warp of a chained product loads before it waits
    /// (`dspark_kernels::set_chain_prefetch`; the library's choice is 2), for an A/B.
    #[arg(long, default_value = "2", value_parser = ["1", "2", "8"])]
    chain_prefetch: String,
    /// How a sampled draw walks its segments, each a table row per layout and weights: in
    /// parallel (`on`, the library's default: segment weights one thread each, the chosen
    /// thread's values walked on that thread) or on one thread (`off`; the weights column then
    /// reads e.g. `fp8h, serial draws`), for an A/B (`dspark_kernels::set_parallel_draws`: the
    /// same draws). Only the sampled columns take it.
    #[arg(long, value_delimiter = ',', default_value = "on", value_parser = ["on", "off"])]
    parallel_draws: Vec<String>,
    /// How the greedy Markov steps run on the device, each a table row per layout and weights:
    /// as one launch for all steps (`loop`, the library's default: `dspark_kernels::
    /// set_markov_loop`), two a step (`on`: the W2 product's argmax epilogue, then the pick; the
    /// weights column then reads e.g. `fp8h, two-launch Markov`) or four (`off`: gather, product,
    /// two argmax passes; `fp8h, unfused Markov`), for an A/B (the same tokens). Only the greedy
    /// columns take it.
    #[arg(long, value_delimiter = ',', default_value = "loop", value_parser = ["loop", "on", "off"])]
    fused_markov: Vec<String>,
    /// Run the recorded paths where no graphs run (the CPU): each recorded body on every call,
    /// over the page-table attention path. A smoke test of the recorded rounds, not a timing.
    #[arg(long)]
    emulate_graphs: bool,
}

/// What a bench draft is built from: layout, weights, draft vocabulary, FP8 SwiGLU epilogue.
type DraftKey = (String, String, usize, String);

/// After a phase is timed: once more inside the profiling window when `--profile` names
/// `phase`; `--reps` times more with the library's spans timed when `--spans` is on.
fn profiled(
    args: &Args,
    device: &Device,
    spans: Option<&spans::SpanTimes>,
    phase: &str,
    mut f: impl FnMut() -> dspark::Result<()>,
) -> dspark::Result<()> {
    if args.profile.iter().any(|p| p == phase) {
        sync(device);
        profile::start().map_err(dspark::Error::Backend)?;
        f()?;
        sync(device);
        profile::stop().map_err(dspark::Error::Backend)?;
        eprintln!("profiled one {phase}");
    }
    if let Some(times) = spans {
        sync(device);
        times.reset();
        let mut wall = 0.0;
        for _ in 0..args.reps {
            let t = Instant::now();
            f()?;
            sync(device);
            wall += t.elapsed().as_secs_f64();
        }
        println!(
            "{}| wall, synchronised after each run | | {:.1} |\n",
            times.table(phase, args.reps),
            wall * 1e6 / args.reps as f64
        );
    }
    Ok(())
}

fn sync(device: &Device) {
    device.sync().expect("device sync");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f` over `reps` runs after `warmup`, the device synchronised around each.
fn time(
    device: &Device,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> dspark::Result<()>,
) -> dspark::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        sync(device);
        let t = Instant::now();
        f()?;
        sync(device);
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// Device bytes in use above the baseline (CUDA: the driver's view; CPU: resident set) and
/// CubeCL's pool (in use, reserved), printed at each stage so memory growth can be placed.
fn memory_at(stage: &str, meter: &memory::Meter, device: &Device) {
    sync(device);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let pool = device.memory_pool_usage().map(|u| (u.bytes_in_use >> 20, u.bytes_reserved >> 20));
    eprintln!(
        "memory after {stage}: {} MiB in use; pool in use/reserved (MiB) {pool:?}",
        meter.current() >> 20
    );
}

/// A target forward of `tokens` as a decode or verify step, its argmax read back; the rows
/// are dropped again.
fn step(target: &Qwen3, cache: &mut PagedKvCache, seq: SeqId, tokens: &[u32]) -> dspark::Result<()> {
    let len = cache.len(seq)?;
    let out = target.forward(&[SeqChunk { seq, tokens, logits: LogitRows::All }], &[], cache)?;
    let logits = out.logits.ok_or_else(|| dspark::Error::Backend("a forward without logits".into()))?;
    let _ = dspark_kernels::argmax_rows(logits).into_data();
    cache.truncate(seq, len)
}

/// A greedy round as the engine runs it with one-sync rounds: the verify window queued behind
/// the draft round reads its drafts on the device and captures the draft's feature layers, the
/// draft's context takes the whole window behind it, and the drafts and the target's argmax
/// come back in one read; both caches are cut back after (the engine keeps the accepted rows).
/// An error when the draft does not defer (no graphs).
fn one_read_round(
    target: &Qwen3,
    cache: &mut PagedKvCache,
    seq: SeqId,
    draft: &mut DSparkDraft,
    lane: &[ProposeLane<'_>],
) -> dspark::Result<()> {
    let gamma = draft.block_size();
    let deferred = draft
        .propose_deferred(lane)?
        .ok_or_else(|| dspark::Error::InvalidInput("the draft round was not deferred".into()))?;
    let len = cache.len(seq)?;
    let window: Vec<u32> = std::iter::once(11).chain(std::iter::repeat_n(0, gamma)).collect();
    let slots: Vec<(usize, usize)> = (0..gamma).map(|k| (k + 1, k)).collect();
    let tokens = DeviceTokens { values: &deferred.tokens, rows: &slots };
    let chunk = [SeqChunk { seq, tokens: &window, logits: LogitRows::All }];
    let layers = draft.feature_layers().to_vec();
    let out = target.forward_device_tokens(&chunk, tokens, &layers, cache)?;
    let logits = out.logits.ok_or_else(|| dspark::Error::Backend("a forward without logits".into()))?;
    let features = out.features.ok_or_else(|| dspark::Error::Backend("no features captured".into()))?;
    let dseq = lane[0].seq;
    let context = draft.context_len(dseq)?;
    draft.extend_contexts(&[(dseq, features)])?;
    let ids = dspark_kernels::argmax_rows(logits);
    let rows = ids.dims()[0];
    let [_, read] = deferred.readback.dims();
    let both =
        Tensor::cat(vec![deferred.readback.clone(), ids.float().cast(DType::F32).reshape([1, rows])], 1);
    let values = both
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| dspark::Error::Backend(format!("{e:?}")))?;
    draft.finish_deferred(lane, deferred, &values[..read])?;
    draft.truncate_context(dseq, context)?;
    cache.truncate(seq, len)
}

/// The A/B switches of this run as the graphs column's suffix.
fn switches(args: &Args) -> String {
    let mut label = String::new();
    if args.attention == "warp" {
        label += " (warp attention)";
    }
    if args.attn_min_chunk != "32" {
        label += &format!(" (splits of ≥ {} keys)", args.attn_min_chunk);
    }
    if args.norm_threads != "1024" {
        label += &format!(" (norm {} threads)", args.norm_threads);
    }
    if args.pdl != "off" {
        label += if args.pdl == "trigger" { " (PDL, trigger)" } else { " (PDL)" };
    }
    if args.pad_tiles == "off" {
        label += " (3 tiles at 17-24 rows)";
    }
    if args.int_views == "off" {
        label += " (int copies)";
    }
    if args.attn_fold == "on" {
        label += " (merge folded)";
    }
    if args.layer_chain == "on" {
        label += " (tail chained)";
    }
    if args.layer_chain == "on" && args.chain_prefetch != "2" {
        label += &format!(" (chain prefetch {})", args.chain_prefetch);
    }
    label
}

fn main() -> dspark::Result<()> {
    let args = Args::parse();
    dspark_kernels::set_tensor_core_attention(args.attention == "tc");
    // Both values are among the ones clap accepts, which the setters take.
    dspark_kernels::set_attention_min_chunk(args.attn_min_chunk.parse().unwrap_or(32));
    dspark_kernels::set_norm_threads(args.norm_threads.parse().unwrap_or(1024));
    dspark_kernels::set_programmatic_launch(args.pdl != "off");
    dspark_kernels::set_programmatic_trigger_port(args.pdl == "trigger");
    dspark_kernels::set_tile_padding(args.pad_tiles == "on");
    dspark_kernels::set_int_views(args.int_views == "on");
    dspark_kernels::set_attention_fold(args.attn_fold == "on");
    dspark_kernels::set_layer_chain(args.layer_chain == "on");
    dspark_kernels::set_chain_prefetch(args.chain_prefetch.parse().unwrap_or(2));
    if args.emulate_graphs {
        dspark_kernels::set_graph_emulation(true);
        dspark_kernels::set_paged_reference(true);
    }
    // Always installed: the library's warnings (a graph that would not record) reach stderr.
    let span_times = spans::SpanTimes::install(args.spans);
    let spans = span_times.as_ref().filter(|_| args.spans);
    let meter = memory::Meter::start(&args.device).map_err(dspark::Error::InvalidInput)?;
    let kind: DeviceKind = args.device.parse()?;
    let dtype: ComputeDtype = args.dtype.parse()?;
    let device = kind.device()?;
    let config = shapes::qwen3(&args.shape).map_err(dspark::Error::InvalidInput)?;
    let t = Instant::now();
    let target = Qwen3::random(config.clone(), dtype, kind)?;
    sync(&device);
    eprintln!("built {} target in {:.1} s", args.shape, t.elapsed().as_secs_f64());
    memory_at("building the target", &meter, &device);
    let vocab = target.vocab_size() as u32;
    let layout = target.kv_layout(16);
    let mut cache = PagedKvCache::new(
        layout,
        (args.context + 64) * layout.row_bytes() + 8 * layout.page_bytes(),
        &device,
    )?;
    let seq = cache.allocate();
    let prompt: Vec<u32> = (0..args.context as u32).map(|i| (17 + 31 * i) % vocab).collect();
    target.forward(&[SeqChunk { seq, tokens: &prompt, logits: LogitRows::Last }], &[], &mut cache)?;

    let mut header = String::from(
        "| device | dtype | draft | γ | weights | graphs | draft MiB | target step ms | verify γ+1 ms | × step | extend 4 rows ms | propose greedy ms | propose T=1 ms | propose T=1, q on device ms | accept T=1 ms | accept T=1 top-k 50 top-p 0.9 ms | host accept T=1 ms | host accept T=1 top-k 50 top-p 0.9 ms | round ms (greedy) | round ms (T=1, top-k/top-p) | round ms (T=1, top-k/top-p, host q and accept) | propose + verify, two reads ms | round ms (greedy, one read) |",
    );
    let mut rule = String::from(
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    );
    for tau in &args.tau {
        header.push_str(&format!(" implied speedup τ={tau} |"));
        rule.push_str("---|");
    }
    for tau in &args.tau {
        header.push_str(&format!(" implied speedup τ={tau}, one read |"));
        rule.push_str("---|");
    }
    println!("{header}\n{rule}");
    for w in &args.weights {
        if !["bf16", "fp8", "fp8h"].contains(&w.as_str()) {
            return Err(dspark::Error::InvalidInput(format!("--weights {w:?}: expected bf16, fp8 or fp8h")));
        }
    }
    for mode in &args.graphs {
        if !["on", "off"].contains(&mode.as_str()) {
            return Err(dspark::Error::InvalidInput(format!("--graphs {mode:?}: expected on or off")));
        }
    }
    for phase in &args.profile {
        if !["step", "verify", "extend", "propose", "propose-sampled"].contains(&phase.as_str()) {
            return Err(dspark::Error::InvalidInput(format!(
                "--profile {phase:?}: expected step, verify, extend, propose or propose-sampled"
            )));
        }
    }
    for mode in &args.graphs {
        dspark_kernels::set_graphs_enabled(mode == "on");
        let one_row = time(&device, args.warmup, args.reps, || step(&target, &mut cache, seq, &[11]))?;
        profiled(&args, &device, spans, "step", || step(&target, &mut cache, seq, &[11]))?;
        eprintln!("graphs {mode}: target one-row step {:.2} ms", one_row * 1e3);
        memory_at("target steps", &meter, &device);
        let mut combos = Vec::new();
        for l in &args.layouts {
            for w in &args.weights {
                for v in &args.draft_vocab {
                    // Confidence placement and draw walk innermost: they switch on a built draft.
                    for e in &args.fp8_swiglu {
                        for c in &args.confidence {
                            for d in &args.parallel_draws {
                                combos.extend(args.fused_markov.iter().map(|m| {
                                    (l.clone(), w.clone(), *v, e.clone(), c.clone(), d.clone(), m.clone())
                                }));
                            }
                        }
                    }
                }
            }
        }
        // The draft of the last row, reused while only the confidence placement or the draw walk
        // changes (an 8B-shaped FP8 draft takes some 20 s to draw and quantise on the host).
        let mut built: Option<(DraftKey, DSparkDraft, String)> = None;
        for (spec, weights, draft_vocab, epilogue, head_on, draws, fused) in combos {
            let key = (spec.clone(), weights.clone(), draft_vocab, epilogue.clone());
            let (spec, weights) = (&spec, &weights);
            let confidence = spec.ends_with('c');
            if head_on == "host" && !confidence {
                // Without a confidence head there is nothing to move: one row is enough.
                continue;
            }
            if weights == "bf16" && args.fp8_swiglu.first() != Some(&epilogue) {
                // bf16 gate/up weights are paired always: one row, whatever the list says.
                continue;
            }
            // Read when the draft's layers are built, below.
            dspark_kernels::set_fp8_swiglu(epilogue == "on");
            let gamma: usize = spec
                .trim_end_matches('c')
                .parse()
                .map_err(|_| dspark::Error::InvalidInput(format!("layout {spec:?}: want e.g. 7c or 16")))?;
            let mut draft_config = shapes::dspark(&args.shape, &config);
            draft_config.block_size = gamma;
            draft_config.enable_confidence_head = confidence;
            let window: Vec<u32> = (0..=gamma as u32).map(|i| (101 + 7 * i) % vocab).collect();
            let verify = time(&device, args.warmup, args.reps, || step(&target, &mut cache, seq, &window))?;
            profiled(&args, &device, spans, "verify", || step(&target, &mut cache, seq, &window))?;
            memory_at(&format!("verify windows of {}", gamma + 1), &meter, &device);
            let (key, mut draft, base_label) = match built.take() {
                Some(last) if last.0 == key => last,
                last => {
                    // The last draft's memory goes back before the next one is built.
                    drop(last);
                    let cache_config =
                        DraftCacheConfig { kv_budget_bytes: 64 << 20, ..DraftCacheConfig::default() };
                    let t = Instant::now();
                    let mut draft = if weights == "bf16" {
                        DSparkDraft::random(draft_config, TargetBinding::of(&target), &cache_config)?
                    } else {
                        // Drawn and quantised on the host: no bf16 copy on the device (as an FP8 checkpoint).
                        let fp8 = dspark::model::fp8::DraftQuant::Fp8PerChannel;
                        DSparkDraft::random_quantized(
                            draft_config,
                            TargetBinding::of(&target),
                            &cache_config,
                            fp8,
                            1,
                        )?
                    };
                    if weights != "bf16" {
                        if weights == "fp8h" {
                            draft.quantize_lm_head()?;
                        }
                        eprintln!(
                            "built the {spec} draft ({weights}) in {:.1} s: {} projections kept as FP8, {} layers' \
                         gate/up paired for the SwiGLU epilogue",
                            t.elapsed().as_secs_f64(),
                            draft.fp8_on_device(),
                            draft.fp8_swiglu_layers()
                        );
                    }
                    let weights = if draft_vocab > 0 {
                        draft.restrict_vocab(dspark::DraftVocab::leading(draft_vocab, config.vocab_size)?)?;
                        format!("{weights}, vocab {draft_vocab}")
                    } else {
                        weights.clone()
                    };
                    let weights = if epilogue == "off" && key.1 != "bf16" {
                        format!("{weights}, stacked gate/up")
                    } else {
                        weights
                    };
                    if args.emulate_graphs {
                        // Recorded rounds need the device Markov pass, which the CPU leaves to the host.
                        draft.set_device_markov(true);
                    }
                    (key, draft, weights)
                }
            };
            dspark_kernels::set_parallel_draws(draws == "on");
            dspark_kernels::set_fused_markov(fused != "off");
            dspark_kernels::set_markov_loop(fused == "loop");
            let weights =
                if draws == "off" { format!("{base_label}, serial draws") } else { base_label.clone() };
            let weights = match fused.as_str() {
                "off" => format!("{weights}, unfused Markov"),
                "on" => format!("{weights}, two-launch Markov"),
                _ => weights,
            };
            // Either call also drops the draft's recorded graphs, so the draw walk just set is
            // the one its rounds record.
            let weights = if confidence && head_on == "host" {
                draft.set_device_confidence(false);
                format!("{weights}, host confidence")
            } else {
                draft.set_device_confidence(true);
                weights
            };
            let width = draft.feature_layers().len() * config.hidden_size;
            let opts = TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
            let features = |rows: usize| {
                Tensor::<2>::random([rows, width], Distribution::Normal(0.0, 1.0), opts.clone())
            };
            memory_at(&format!("setting up the {spec} {weights} draft"), &meter, &device);
            let dseq = draft.begin();
            draft.extend_context(dseq, features(args.context))?;
            memory_at("the first context extension", &meter, &device);
            // Extension by 4 rows, undone by cutting the draft's context back after each run, so
            // the proposals see the same context length.
            let context = draft.context_len(dseq)?;
            let extend = {
                let mut times = Vec::new();
                for i in 0..args.warmup + args.reps {
                    let f = features(4);
                    sync(&device);
                    let t = Instant::now();
                    draft.extend_context(dseq, f)?;
                    sync(&device);
                    if i >= args.warmup {
                        times.push(t.elapsed().as_secs_f64());
                    }
                    draft.truncate_context(dseq, context)?;
                }
                median(times)
            };
            let f = features(4);
            profiled(&args, &device, spans, "extend", || draft.extend_context(dseq, f.clone()))?;
            draft.truncate_context(dseq, context)?;
            let greedy = SamplingParams::greedy(gamma);
            let sampled = SamplingParams { temperature: 1.0, seed: 7, ..SamplingParams::greedy(gamma) };
            let mut propose =
                |params: &SamplingParams, phase: &str, q_on_device: bool| -> dspark::Result<f64> {
                    draft.set_q_on_device(q_on_device);
                    let lane = [ProposeLane { seq: dseq, anchor: 5, params }];
                    let t = time(&device, args.warmup, args.reps, || draft.propose(&lane).map(|_| ()))?;
                    profiled(&args, &device, spans, phase, || draft.propose(&lane).map(|_| ()))?;
                    Ok(t)
                };
            let p_greedy = propose(&greedy, "propose", false)?;
            memory_at("greedy proposals", &meter, &device);
            let p_sampled = propose(&sampled, "propose-sampled", false)?;
            memory_at("sampled proposals", &meter, &device);
            // As the engine asks where it verifies on the device: the rows stay there.
            let p_kept = propose(&sampled, "propose-sampled", true)?;
            draft.set_q_on_device(false);
            // The greedy draft and verify as one engine round: drafts read back before the
            // verify (two reads), or the whole round queued and read once (one read).
            let lane = [ProposeLane { seq: dseq, anchor: 5, params: &greedy }];
            let two_reads = time(&device, args.warmup, args.reps, || {
                let proposal = draft.propose(&lane)?;
                let window: Vec<u32> =
                    std::iter::once(11).chain(proposal[0].tokens.iter().copied()).collect();
                step(&target, &mut cache, seq, &window)
            })?;
            let one_read = if dspark_kernels::graphs_available(&device) || args.emulate_graphs {
                Some(time(&device, args.warmup, args.reps, || {
                    one_read_round(&target, &mut cache, seq, &mut draft, &lane)
                })?)
            } else {
                None
            };
            // Chain acceptance of one lane's γ drafts on the device, and its two ids read back.
            let accept_opts = TensorCreationOptions::new(device.clone()).with_dtype(burn::tensor::DType::F32);
            let p_rows = Tensor::<2>::random(
                [gamma + 1, vocab as usize],
                Distribution::Normal(0.0, 2.0),
                accept_opts.clone(),
            );
            let q_rows =
                Tensor::<2>::random([gamma, vocab as usize], Distribution::Normal(0.0, 2.0), accept_opts);
            let accept = |top_k: usize, top_p: f32| -> dspark::Result<f64> {
                let lane = dspark_kernels::accept::AcceptLane {
                    p_row: 0,
                    q_row: 0,
                    drafts: (0..gamma as u32).map(|i| 3 + 11 * i).collect(),
                    temperature: 1.0,
                    top_k,
                    top_p,
                    accept_coins: vec![0.0; gamma],
                    draw_coins: vec![0.5; gamma + 1],
                };
                let (rows, words) = dspark_kernels::accept::accept_words(&[lane], gamma + 1, gamma, gamma);
                let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [3 * (2 * gamma + 1)]), &device);
                let stride = dspark_kernels::accept::lane_stride(gamma);
                let words = Tensor::<2, Int>::from_data(TensorData::new(words, [1, stride]), &device);
                time(&device, args.warmup, args.reps, || {
                    let out = dspark_kernels::chain_accept(
                        p_rows.clone(),
                        q_rows.clone(),
                        rows.clone(),
                        words.clone(),
                    );
                    let _ = out.into_data();
                    Ok(())
                })
            };
            let accept_plain = accept(0, 1.0)?;
            let accept_filtered = accept(50, 0.9)?;
            // The host path the device call replaces: the verify rows read back, the target's
            // distributions made and the chain decided on the host (q made beforehand, as the
            // proposal with host q hands it out; its cost is in "propose T=1").
            let q_host: Vec<Vec<f64>> = {
                let values =
                    q_rows.clone().into_data().convert::<f32>().try_to_vec::<f32>().unwrap_or_default();
                let softmax = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
                values.chunks(vocab as usize).map(|r| dspark::sampling::target_probs(r, &softmax)).collect()
            };
            let host_accept = |top_k: usize, top_p: f32| -> dspark::Result<f64> {
                let params =
                    SamplingParams { temperature: 1.0, top_k, top_p, seed: 3, ..SamplingParams::default() };
                let drafts: Vec<u32> = (0..gamma as u32).map(|i| 3 + 11 * i).collect();
                time(&device, args.warmup, args.reps, || {
                    let values = p_rows
                        .clone()
                        .into_data()
                        .convert::<f32>()
                        .try_to_vec::<f32>()
                        .map_err(|e| dspark::Error::Backend(format!("{e:?}")))?;
                    let rows: Vec<&[f32]> = values.chunks(vocab as usize).collect();
                    let p = dspark::sampling::target_probs_rows(&rows, &params);
                    let p: Vec<&[f64]> = p.iter().map(Vec::as_slice).collect();
                    let q: Vec<&[f64]> = q_host.iter().map(Vec::as_slice).collect();
                    // A draft with q = 0 is refused; these drafts are arbitrary, so only the
                    // work counts here.
                    let _ = dspark::accept::chain_verify_seeded(&drafts, &p, &q, params.seed, 100, None);
                    Ok(())
                })
            };
            let host_plain = host_accept(0, 1.0)?;
            let host_filtered = host_accept(50, 0.9)?;
            let round = extend + p_greedy + verify;
            let round_sampled = extend + p_kept + verify + accept_filtered;
            let round_host = extend + p_sampled + verify + host_filtered;
            let mut row = format!(
                "| {} | {} | {} | {gamma} | {weights} | {mode}{} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} |",
                args.device,
                dtype,
                if confidence { "confidence" } else { "no confidence" },
                switches(&args),
                draft.weight_bytes() as f64 / (1 << 20) as f64,
                one_row * 1e3,
                verify * 1e3,
                verify / one_row,
                extend * 1e3,
                p_greedy * 1e3,
                p_sampled * 1e3,
                p_kept * 1e3,
                accept_plain * 1e3,
                accept_filtered * 1e3,
                host_plain * 1e3,
                host_filtered * 1e3,
                round * 1e3,
                round_sampled * 1e3,
                round_host * 1e3
            );
            // The one-read round extends the draft's context itself (by the whole window).
            let round_one = one_read;
            let ms = |t: Option<f64>| t.map_or("—".to_string(), |t| format!("{:.2}", t * 1e3));
            row.push_str(&format!(" {:.2} | {} |", two_reads * 1e3, ms(round_one)));
            for tau in &args.tau {
                row.push_str(&format!(" {:.2}× |", tau * one_row / round));
            }
            for tau in &args.tau {
                let implied = round_one.map_or("—".to_string(), |r| format!("{:.2}×", tau * one_row / r));
                row.push_str(&format!(" {implied} |"));
            }
            println!("{row}");
            eprintln!("{row}");
            draft.end(dseq)?;
            built = Some((key, draft, base_label));
        }
    }
    let _ = meter.finish(0, &device);
    if args.pdl != "off" {
        // Whether the driver took the programmatic edges (the switch turns itself off if not).
        println!(
            "\nPDL: {} programmatic edges recorded, still on at the end: {}",
            dspark_kernels::programmatic_edges(),
            dspark_kernels::programmatic_launch()
        );
    }
    Ok(())
}
