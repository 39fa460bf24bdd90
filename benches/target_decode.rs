//! Target-only decode benchmark at real Qwen3 shapes with random weights.
//!
//! Builds a Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, head_dim 128,
//! FFN 12288, vocab 151936) directly on the device, measures the device-copy bandwidth as the
//! ceiling, then times target-only decode steps (forward + on-device argmax + token readback, the
//! engine's per-step work) at each lane count, after `--context` untimed steps of the same shape
//! that build the KV context and compile every kernel. Prints a markdown table.
//!
//! ```text
//! bench-target --device cuda --dtype bf16 --lanes 1,16 --steps 20
//! bench-target --device cpu --dtype f32 --shape tiny --lanes 1,4 --steps 5   # smoke test
//! ```

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor, TensorCreationOptions};
use clap::Parser;
use dspark::{ComputeDtype, DeviceKind, KvCache, LogitRows, PagedKvCache, Qwen3, Qwen3Config, SeqChunk};

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
    /// Lane counts to time.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    lanes: Vec<usize>,
    /// Untimed decode steps per lane before timing (they build the context and warm up).
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Timed decode steps per lane count.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Bytes of the copy used to measure the bandwidth ceiling.
    #[arg(long, default_value_t = 2 << 30)]
    copy_bytes: usize,
    /// Run dspark's CUDA kernels (`on`) or burn's plain ops for every operation (`off`).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    kernels: String,
    /// Weight blocks of 16 rows per cube of the bf16 skinny GEMM: `auto` (the library's choice,
    /// 2 for 9–32 rows of wide weights), or `1` everywhere (for an A/B of that choice).
    #[arg(long, default_value = "auto", value_parser = ["auto", "1"])]
    mtiles: String,
    /// Chunks each warp of the skinny GEMMs keeps in flight for 17–32 rows: `auto` (the
    /// library's choice, 2 before the division by the cube's weight blocks), or 1, 2, 4 or 8
    /// (for an A/B).
    #[arg(long, default_value = "auto", value_parser = ["auto", "1", "2", "4", "8"])]
    unroll_wide: String,
    /// Launch the bf16 products of 17–24 rows as four activation tiles (`on`, the library's
    /// default) or three (`off`), for an A/B.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pad_tiles: String,
    /// Take the recorded forwards' inputs as views of their buffer (`on`, the library's
    /// default) or as copies (`off`; `dspark_kernels::set_int_views`), for an A/B.
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
    /// Verify-window widths to time at one lane (rows per forward, logits for every row), each
    /// beside the one-row step of the same run; empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "8,16")]
    windows: Vec<usize>,
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
}

fn config(shape: &str) -> Qwen3Config {
    let (v, h, i, l, heads, kv, hd) = match shape {
        "tiny" => (512, 64, 128, 6, 4, 2, 16),
        _ => (151_936, 4096, 12_288, 36, 32, 8, 128),
    };
    serde_json::from_value(serde_json::json!({
        "vocab_size": v, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": l,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 40960,
        "tie_word_embeddings": false
    }))
    .expect("static config")
}

fn sync(device: &Device) {
    device.sync().expect("device sync");
}

/// Read+write bytes per second of an elementwise copy.
fn copy_bandwidth(device: &Device, dtype: ComputeDtype, bytes: usize) -> f64 {
    let n = bytes / dtype.size();
    let opts = TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
    let x = Tensor::<1>::random([n], Distribution::Uniform(-1.0, 1.0), opts);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        sync(device);
        let t = Instant::now();
        let y = x.clone().mul_scalar(1.0);
        sync(device);
        best = best.min(t.elapsed().as_secs_f64());
        drop(y);
    }
    2.0 * (n * dtype.size()) as f64 / best
}

fn main() -> dspark::Result<()> {
    let args = Args::parse();
    dspark_kernels::set_kernels_enabled(args.kernels == "on");
    dspark_kernels::force_mtiles((args.mtiles == "1").then_some(1));
    dspark_kernels::force_unroll_wide(args.unroll_wide.parse().ok());
    dspark_kernels::set_tile_padding(args.pad_tiles == "on");
    dspark_kernels::set_int_views(args.int_views == "on");
    dspark_kernels::set_attention_fold(args.attn_fold == "on");
    dspark_kernels::set_layer_chain(args.layer_chain == "on");
    dspark_kernels::set_chain_prefetch(args.chain_prefetch.parse().unwrap_or(2));
    dspark_kernels::set_tensor_core_attention(args.attention == "tc");
    // Both values are among the ones clap accepts, which the setters take.
    dspark_kernels::set_attention_min_chunk(args.attn_min_chunk.parse().unwrap_or(32));
    dspark_kernels::set_norm_threads(args.norm_threads.parse().unwrap_or(1024));
    dspark_kernels::set_programmatic_launch(args.pdl != "off");
    dspark_kernels::set_programmatic_trigger_port(args.pdl == "trigger");
    let kind: DeviceKind = args.device.parse()?;
    let dtype: ComputeDtype = args.dtype.parse()?;
    let device = kind.device()?;
    let t = Instant::now();
    let model = Qwen3::random(config(&args.shape), dtype, kind)?;
    sync(&device);
    eprintln!("built {} target in {:.1} s", args.shape, t.elapsed().as_secs_f64());
    let copy_bw = copy_bandwidth(&device, dtype, args.copy_bytes.min(model.step_weight_bytes()));
    let step_bytes = model.step_weight_bytes();
    let max_lanes = args.lanes.iter().copied().max().unwrap_or(1);
    let rows = max_lanes * (args.context + args.steps + 8);
    let budget = rows * model.kv_layout(16).row_bytes() + 64 * model.kv_layout(16).page_bytes() * max_lanes;
    let mut cache = PagedKvCache::new(model.kv_layout(16), budget, &device)?;
    println!(
        "| device | dtype | shape | kernels | lanes | context | ms/step | tok/s | weight GB/step | achieved TB/s | copy TB/s | share of copy |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &lanes in &args.lanes {
        let seqs: Vec<_> = (0..lanes).map(|_| cache.allocate()).collect();
        // The context is built by decode steps of the timed shape (one row per lane), so the
        // run compiles only the kernels it times: a separate long prefill would add its own
        // (slow, first-use) kernel compilations for nothing. The untimed steps are the warm-up.
        let vocab = model.vocab_size() as u32;
        let mut next: Vec<[u32; 1]> = (0..lanes as u32).map(|i| [(100 + 7 * i) % vocab]).collect();
        let mut times = Vec::new();
        let start = Instant::now();
        for step in 0..args.context + args.steps {
            sync(&device);
            let t = Instant::now();
            let chunks: Vec<SeqChunk<'_>> = seqs
                .iter()
                .zip(&next)
                .map(|(&seq, tok)| SeqChunk { seq, tokens: tok, logits: LogitRows::Last })
                .collect();
            let out = model.forward(&chunks, &[], &mut cache)?;
            let logits = out.logits.expect("logits requested");
            let ids = dspark_kernels::argmax_rows(logits);
            let ids = ids.into_data().convert::<i64>().try_to_vec::<i64>().expect("ids");
            next = ids.iter().map(|&i| [i as u32]).collect();
            let elapsed = t.elapsed().as_secs_f64();
            if step < 4 || step % 32 == 0 || step >= args.context {
                eprintln!(
                    "lanes {lanes}: step {step} {:.2} ms (run {:.1} s)",
                    elapsed * 1e3,
                    start.elapsed().as_secs_f64()
                );
            }
            if step >= args.context {
                times.push(elapsed);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let achieved = step_bytes as f64 / median;
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.0}% |",
            args.device,
            dtype,
            args.shape,
            kernels_label(&args),
            lanes,
            args.context,
            median * 1e3,
            lanes as f64 / median,
            step_bytes as f64 / 1e9,
            achieved / 1e12,
            copy_bw / 1e12,
            100.0 * achieved / copy_bw
        );
        for seq in seqs {
            cache.free(seq)?;
        }
    }
    if !args.windows.is_empty() {
        verify_windows(&args, &model, &mut cache, &device)?;
    }
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

/// One lane: the median time of a one-row step and of a forward over each window width (a
/// verify step: logits of every row, argmax, readback; the rows are dropped again so the
/// context stays put), all in this run.
fn verify_windows(
    args: &Args,
    model: &Qwen3,
    cache: &mut PagedKvCache,
    device: &Device,
) -> dspark::Result<()> {
    let seq = cache.allocate();
    let vocab = model.vocab_size() as u32;
    let step = |tokens: &[u32], cache: &mut PagedKvCache| -> dspark::Result<(f64, u32)> {
        sync(device);
        let t = Instant::now();
        let out = model.forward(&[SeqChunk { seq, tokens, logits: LogitRows::All }], &[], cache)?;
        let ids = dspark_kernels::argmax_rows(out.logits.expect("logits requested"));
        let ids = ids.into_data().convert::<i64>().try_to_vec::<i64>().expect("ids");
        Ok((t.elapsed().as_secs_f64(), ids[ids.len() - 1] as u32 % vocab))
    };
    let mut next = 100u32;
    for _ in 0..args.context {
        next = step(&[next], cache)?.1;
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut one = Vec::new();
    for _ in 0..args.steps {
        let (t, id) = step(&[next], cache)?;
        one.push(t);
        next = id;
    }
    let one = median(one);
    println!();
    println!("| device | dtype | shape | kernels | rows per forward | context | ms | × one-row step |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {} | 1 | {} | {:.2} | 1.00 |",
        args.device,
        args.dtype,
        args.shape,
        kernels_label(args),
        args.context,
        one * 1e3
    );
    for &w in &args.windows {
        let tokens: Vec<u32> = (0..w as u32).map(|i| (next + 31 * i) % vocab).collect();
        let mut times = Vec::new();
        for _ in 0..args.steps.max(3) {
            let len = cache.len(seq)?;
            times.push(step(&tokens, cache)?.0);
            cache.truncate(seq, len)?;
        }
        let t = median(times);
        eprintln!("window {w}: {:.2} ms", t * 1e3);
        println!(
            "| {} | {} | {} | {} | {w} | {} | {:.2} | {:.2} |",
            args.device,
            args.dtype,
            args.shape,
            kernels_label(args),
            args.context,
            t * 1e3,
            t / one
        );
    }
    cache.free(seq)?;
    Ok(())
}

/// The kernels column: `on`, `on (1 block)` when the GEMM's blocks per cube are forced to 1,
/// `on (warp attention)` with the warp-per-row attention kernel, `on (unroll N at 17-32 rows)`
/// with a forced wide unroll, `on (3 tiles at 17-24 rows)` without the tile padding, `on (int
/// copies)` without the int views, or `off`.
fn kernels_label(args: &Args) -> String {
    let mut label = args.kernels.clone();
    if args.kernels == "on" && args.mtiles == "1" {
        label += " (1 block)";
    }
    if args.kernels == "on" && args.attention == "warp" {
        label += " (warp attention)";
    }
    if args.kernels == "on" && args.attn_min_chunk != "32" {
        label += &format!(" (splits of ≥ {} keys)", args.attn_min_chunk);
    }
    if args.kernels == "on" && args.norm_threads != "1024" {
        label += &format!(" (norm {} threads)", args.norm_threads);
    }
    if args.kernels == "on" && args.pdl != "off" {
        label += if args.pdl == "trigger" { " (PDL, trigger)" } else { " (PDL)" };
    }
    if args.kernels == "on" && args.pad_tiles == "off" {
        label += " (3 tiles at 17-24 rows)";
    }
    if args.kernels == "on" && args.int_views == "off" {
        label += " (int copies)";
    }
    if args.kernels == "on" && args.attn_fold == "on" {
        label += " (merge folded)";
    }
    if args.kernels == "on" && args.layer_chain == "on" {
        label += " (tail chained)";
    }
    if args.kernels == "on" && args.layer_chain == "on" && args.chain_prefetch != "2" {
        label += &format!(" (chain prefetch {})", args.chain_prefetch);
    }
    if args.kernels == "on" && args.unroll_wide != "auto" {
        label += &format!(" (unroll {} at 17-32 rows)", args.unroll_wide);
    }
    label
}
