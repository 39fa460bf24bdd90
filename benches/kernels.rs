//! Skinny GEMM benchmark: `x · Wᵀ` on the bf16 projection shapes of a Qwen3-8B target and its
//! DSpark draft, for 1..64 rows, through `dspark_kernels::linear` with this crate's kernel and
//! with burn's own matmul (the plain-burn body), in one process on one device.
//!
//! Each timing is the wall time of `--iters` back-to-back calls followed by one device sync,
//! divided by the count; the weight rotates among enough copies that the set exceeds the L2
//! cache twice over, so every call streams its weight from device memory. Calls through burn
//! carry burn's per-operation host cost; the `launch floor` line (a 1×256·256×256 product)
//! shows it, and a matrix whose time sits near it is launch-bound, not bandwidth-bound. The
//! cuBLAS figures for the same shapes come from `benches/cublas_gemm.py` in the same device
//! call.
//!
//! ```text
//! bench-kernels --device cuda --rows 1,2,4,8,16,32,64 --iters 30
//! bench-kernels --device cpu --shape tiny --rows 1,4 --iters 3     # smoke test
//! ```

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorCreationOptions};
use clap::Parser;
use dspark::DeviceKind;

#[path = "clock.rs"]
mod clock;

#[derive(Parser)]
struct Args {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// qwen3-8b or tiny.
    #[arg(long, default_value = "qwen3-8b")]
    shape: String,
    /// Activation rows to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    rows: Vec<usize>,
    /// Timed calls per (matrix, rows, path).
    #[arg(long, default_value_t = 30)]
    iters: usize,
    /// Also time the FP8-weight kernel (`dspark_kernels::linear_fp8`, e4m3 with per-row scales)
    /// on the same shapes, beside the bf16 kernel, in a second table.
    #[arg(long)]
    fp8: bool,
    /// Bytes the rotating weight copies must exceed (2× the H200's 50 MB L2 by default).
    #[arg(long, default_value_t = 100 << 20)]
    rotate_bytes: usize,
    /// Also time the small kernels of one decoder layer (norms, q/k norm + RoPE, SwiGLU, paged
    /// attention over `--context` keys: both split kernels, the rows one causal window), each
    /// recorded in a graph, at `--anatomy-rows` rows.
    #[arg(long)]
    anatomy: bool,
    /// Rows (one causal window) of each `--anatomy` table.
    #[arg(long, value_delimiter = ',', default_value = "1,8,17")]
    anatomy_rows: Vec<usize>,
    /// Context length of the attention in `--anatomy`.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Also time these cuts of the skinny GEMMs (`SPLITSxDEPTH`: cubes along the reduction axis,
    /// chunks in flight per warp), each forced on every shape where it fits, in graphs, bf16 and
    /// (with `--fp8`) FP8, beside the plan chosen per shape (`chosen`).
    #[arg(long, value_delimiter = ',')]
    plans: Vec<dspark_kernels::GemmPlan>,
    /// Only the `--plans` table (skip the host-timed bf16 and FP8 tables).
    #[arg(long)]
    plans_only: bool,
    /// Also time the chosen plans with these weight blocks per cube forced (1, 2, 4 or 8; where
    /// they do not fit, 1), in the `--plans` table (bf16, and FP8 with `--fp8`).
    #[arg(long, value_delimiter = ',')]
    mtiles: Vec<usize>,
    /// Only the matrices whose name contains one of these, in every table (all when empty).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only the floor of a one-row decode step's launch structure (CUDA, Qwen3-8B shapes): a bare
    /// streaming read of each product's weight bytes and a one-cube launch for each small kernel,
    /// recorded in a graph in the step's order (see `floor`).
    #[arg(long)]
    floor: bool,
    /// Cube counts the `--floor` reads try for each size (the fastest is kept).
    #[arg(long, value_delimiter = ',', default_value = "132,264,528,1056,2112")]
    floor_cubes: Vec<usize>,
}

/// `(name, in, out)` of each weight.
fn matrices(shape: &str) -> Vec<(&'static str, usize, usize)> {
    match shape {
        "tiny" => vec![("q/o", 64, 64), ("gate/up", 64, 128), ("lm_head", 64, 512)],
        _ => vec![
            ("q/o proj", 4096, 4096),
            ("k/v proj", 4096, 1024),
            ("qkv fused", 4096, 6144),
            ("gate/up", 4096, 12_288),
            ("gate+up fused", 4096, 24_576),
            ("down", 12_288, 4096),
            ("draft fc (5 layers)", 20_480, 4096),
            ("lm_head", 4096, 151_936),
            ("markov W2 (rank 256)", 256, 151_936),
        ],
    }
}

fn sync(device: &Device) {
    device.sync().expect("device sync");
}

fn random(rows: usize, cols: usize, sigma: f64, device: &Device) -> Tensor<2> {
    let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::F32);
    Tensor::<2>::random([rows, cols], Distribution::Normal(0.0, sigma), opts).cast(DType::BF16)
}

/// Seconds per call of `dspark_kernels::linear` over rotating weights.
fn time_calls(x: &Tensor<2>, weights: &[Tensor<2>], iters: usize, device: &Device) -> f64 {
    // Warm-up: compiles (and for burn's matmul, autotunes) this shape.
    for w in weights.iter().take(2) {
        let _ = dspark_kernels::linear(x.clone(), w);
    }
    sync(device);
    let start = Instant::now();
    for i in 0..iters {
        let _ = dspark_kernels::linear(x.clone(), &weights[i % weights.len()]);
    }
    sync(device);
    start.elapsed().as_secs_f64() / iters as f64
}

/// Device time per call: `iters` calls recorded as one CUDA graph, replayed 5 times back to back
/// with one sync at the end, a throughput ([`time_graph_median`] syncs each replay instead). The
/// host launch cost is gone, so this is the kernel's own time plus the graph's gap between
/// launches. `None` where no graph is recorded.
fn time_graphed<T>(mut call: impl FnMut(usize) -> T, iters: usize, device: &Device) -> Option<f64> {
    let (graph, outputs) = dspark_kernels::DeviceGraph::capture(device, || {
        Ok::<_, ()>((0..iters).map(&mut call).collect::<Vec<_>>())
    })
    .ok()?
    .ok()?;
    let reps = 5;
    // SAFETY: the graph reads `x` and the weights (borrowed by `call`, alive for this function)
    // and writes `outputs`, held until the replays are synchronised below.
    unsafe { graph.replay() }.ok()?;
    sync(device);
    let start = Instant::now();
    for _ in 0..reps {
        // SAFETY: as above.
        unsafe { graph.replay() }.ok()?;
    }
    sync(device);
    drop(outputs);
    Some(start.elapsed().as_secs_f64() / (reps * iters) as f64)
}

/// Random e4m3 bytes (every finite code; NaN codes replaced by zero) and per-row scales.
fn random_fp8(out: usize, inp: usize, seed: u64, device: &Device) -> dspark_kernels::Fp8Matrix {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut bytes = Vec::with_capacity(out * inp);
    while bytes.len() < out * inp {
        for b in next().to_le_bytes() {
            bytes.push(if b & 0x7F == 0x7F { 0 } else { b });
        }
    }
    bytes.truncate(out * inp);
    // Scales near 0.02 / 448 · 4: values of the size of the bf16 benchmark's weights.
    let scales: Vec<f32> = (0..out).map(|r| 1.5e-4 * (1.0 + (r % 7) as f32 / 7.0)).collect();
    dspark_kernels::Fp8Matrix::upload(
        &bytes,
        &scales,
        [out, inp],
        dspark_kernels::fp8::ScaleGrid::PerRow,
        device,
    )
    .expect("benchmark shapes are supported")
}

/// Seconds per call of `dspark_kernels::linear_fp8` over rotating weights.
fn time_fp8(x: &Tensor<2>, weights: &[dspark_kernels::Fp8Matrix], iters: usize, device: &Device) -> f64 {
    for w in weights.iter().take(2) {
        let _ = dspark_kernels::linear_fp8(x.clone(), w);
    }
    sync(device);
    let start = Instant::now();
    for i in 0..iters {
        let _ = dspark_kernels::linear_fp8(x.clone(), &weights[i % weights.len()]);
    }
    sync(device);
    start.elapsed().as_secs_f64() / iters as f64
}

/// The FP8 table: the FP8 kernel beside the bf16 kernel on the same shapes.
fn fp8_table(args: &Args, device: &Device) {
    println!("\n# Skinny GEMM with FP8 (e4m3, per-row scales) weights, bf16 activations\n");
    println!(
        "| matrix | in | out | FP8 MB | rows | bf16 kernel µs | FP8 kernel µs | bf16 TB/s | FP8 TB/s | FP8 vs bf16 | max rel diff vs plain burn | graphed bf16 µs | graphed FP8 µs | graphed FP8 TB/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, inp, out) in matrices(&args.shape) {
        if !wanted(args, name) {
            continue;
        }
        let bytes = inp * out;
        let copies = args.rotate_bytes.div_ceil(bytes).clamp(1, 16);
        let fp8: Vec<_> = (0..copies).map(|i| random_fp8(out, inp, i as u64 + 1, device)).collect();
        let bf16_copies = args.rotate_bytes.div_ceil(2 * bytes).clamp(1, 16);
        let dense: Vec<Tensor<2>> = (0..bf16_copies).map(|_| random(out, inp, 0.02, device)).collect();
        for &rows in &args.rows {
            let x = random(rows, inp, 1.0, device);
            let bf16 = time_calls(&x, &dense, args.iters, device);
            let kernel = time_fp8(&x, &fp8, args.iters, device);
            let got = dspark_kernels::linear_fp8(x.clone(), &fp8[0]);
            let want = dspark_kernels::reference::linear_fp8(x.clone(), &fp8[0]);
            let diff = max_rel_diff(got, want);
            let g_bf16 = time_graphed(
                |i| dspark_kernels::linear(x.clone(), &dense[i % dense.len()]),
                args.iters,
                device,
            );
            let g_fp8 = time_graphed(
                |i| dspark_kernels::linear_fp8(x.clone(), &fp8[i % fp8.len()]),
                args.iters,
                device,
            );
            let us = |g: Option<f64>| g.map_or("—".into(), |g| format!("{:.1}", g * 1e6));
            println!(
                "| {name} | {inp} | {out} | {:.1} | {rows} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2}× | {diff:.1e} | {} | {} | {} |",
                bytes as f64 / 1e6,
                bf16 * 1e6,
                kernel * 1e6,
                2.0 * bytes as f64 / bf16 / 1e12,
                bytes as f64 / kernel / 1e12,
                bf16 / kernel,
                us(g_bf16),
                us(g_fp8),
                g_fp8.map_or("—".into(), |g| format!("{:.2}", bytes as f64 / g / 1e12)),
            );
        }
    }
}

/// Whether `--only` keeps the matrix `name`.
fn wanted(args: &Args, name: &str) -> bool {
    args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()))
}

/// The plans table: graphed device time of each forced plan on each shape.
fn plans_table(args: &Args, device: &Device) {
    println!("\n# Skinny GEMM plans (splits x depth), device time per call in a graph\n");
    println!(
        "| matrix | in | out | rows | plan | bf16 µs | bf16 TB/s | bf16 max rel diff | FP8 µs | FP8 TB/s | FP8 max rel diff |"
    );
    println!("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|");
    for (name, inp, out) in matrices(&args.shape) {
        if !wanted(args, name) {
            continue;
        }
        let bytes = inp * out;
        let dense: Vec<Tensor<2>> = (0..args.rotate_bytes.div_ceil(2 * bytes).clamp(1, 16))
            .map(|_| random(out, inp, 0.02, device))
            .collect();
        let fp8: Vec<_> = if args.fp8 {
            (0..args.rotate_bytes.div_ceil(bytes).clamp(1, 16))
                .map(|i| random_fp8(out, inp, i as u64 + 1, device))
                .collect()
        } else {
            Vec::new()
        };
        for &rows in &args.rows {
            let x = random(rows, inp, 1.0, device);
            let want = dspark_kernels::reference::linear_f32(x.clone(), &dense[0]);
            let want_fp8 = fp8.first().map(|m| dspark_kernels::reference::linear_fp8(x.clone(), m));
            // (plan, blocks per cube): the chosen plan, each forced plan, then the chosen plan with
            // each forced block count.
            let runs = std::iter::once((None, None))
                .chain(args.plans.iter().map(|&p| (Some(p), None)))
                .chain(args.mtiles.iter().map(|&m| (None, Some(m))));
            for (plan, mtiles) in runs {
                dspark_kernels::force_plan(plan);
                dspark_kernels::force_mtiles(mtiles);
                let label = match (plan, mtiles) {
                    (Some(p), _) => p.to_string(),
                    (None, Some(m)) => format!("chosen, {m} blocks/cube"),
                    (None, None) => "chosen".to_string(),
                };
                let diff = max_rel_diff(dspark_kernels::linear(x.clone(), &dense[0]), want.clone());
                let g = time_graphed(
                    |i| dspark_kernels::linear(x.clone(), &dense[i % dense.len()]),
                    args.iters,
                    device,
                );
                let (g8, diff8) = match (&want_fp8, fp8.is_empty()) {
                    (Some(w8), false) => (
                        time_graphed(
                            |i| dspark_kernels::linear_fp8(x.clone(), &fp8[i % fp8.len()]),
                            args.iters,
                            device,
                        ),
                        Some(max_rel_diff(dspark_kernels::linear_fp8(x.clone(), &fp8[0]), w8.clone())),
                    ),
                    _ => (None, None),
                };
                let us = |g: Option<f64>| g.map_or("—".into(), |g| format!("{:.1}", g * 1e6));
                let tbs = |g: Option<f64>, b: usize| {
                    g.map_or("—".into(), |g| format!("{:.2}", b as f64 / g / 1e12))
                };
                println!(
                    "| {name} | {inp} | {out} | {rows} | {label} | {} | {} | {diff:.1e} | {} | {} | {} |",
                    us(g),
                    tbs(g, 2 * bytes),
                    us(g8),
                    tbs(g8, bytes),
                    diff8.map_or("—".into(), |d| format!("{d:.1e}")),
                );
            }
            dspark_kernels::force_plan(None);
            dspark_kernels::force_mtiles(None);
        }
    }
}

/// One timed call of [`anatomy`].
type Call<'a> = Box<dyn FnMut(usize) -> Tensor<2> + 'a>;

/// Device time of each small kernel of a Qwen3-8B decoder layer, recorded in graphs.
fn anatomy(args: &Args, device: &Device) {
    use burn::tensor::{Int, TensorData};
    println!("\n# Small kernels of one decoder layer (Qwen3-8B shapes), device time per call in a graph\n");
    println!("| kernel | rows | graphed µs | × 36 layers µs |");
    println!("|---|---:|---:|---:|");
    let (hidden, heads, kv_heads, head_dim, inter) = (4096, 32, 8, 128, 12_288);
    let w = random(1, hidden, 1.0, device).reshape([hidden]);
    let wh = random(1, head_dim, 1.0, device).reshape([head_dim]);
    let pool_rows = args.context.max(1) + 64;
    let k_pool = random(pool_rows, kv_heads * head_dim, 1.0, device).reshape([pool_rows, kv_heads, head_dim]);
    let v_pool = random(pool_rows, kv_heads * head_dim, 1.0, device).reshape([pool_rows, kv_heads, head_dim]);
    for &rows in args.anatomy_rows.iter().filter(|&&r| r > 0) {
        let x = random(rows, hidden, 1.0, device);
        let qkv = random(rows, (heads + 2 * kv_heads) * head_dim, 1.0, device);
        let cos = random(rows, head_dim, 1.0, device);
        let sin = random(rows, head_dim, 1.0, device);
        let gu = random(rows, 2 * inter, 1.0, device);
        let q = random(rows, heads * head_dim, 1.0, device).reshape([rows, heads, head_dim]);
        let i32s = TensorCreationOptions::new(device.clone()).with_dtype(DType::I32);
        let context = args.context;
        let keys: Vec<i32> = (0..(context + rows) as i32).collect();
        let meta: Vec<i32> = (0..rows).flat_map(|r| [0, (context + r + 1) as i32]).collect();
        let keys = Tensor::<1, Int>::from_data(TensorData::new(keys, [context + rows]), i32s.clone());
        let meta = Tensor::<2, Int>::from_data(TensorData::new(meta, [rows, 2]), i32s.clone());
        // The same rows as one-row lanes of a decode step: a table of `context + 1` keys each.
        let lane_keys: Vec<i32> = (0..rows * (context + 1)).map(|i| (i % pool_rows) as i32).collect();
        let lane_meta: Vec<i32> =
            (0..rows).flat_map(|r| [(r * (context + 1)) as i32, (context + 1) as i32]).collect();
        let lane_keys =
            Tensor::<1, Int>::from_data(TensorData::new(lane_keys, [rows * (context + 1)]), i32s.clone());
        let lane_meta = Tensor::<2, Int>::from_data(TensorData::new(lane_meta, [rows, 2]), i32s);
        let mut cases: Vec<(String, Call<'_>)> = vec![
            ("rms_norm".into(), Box::new(|_| dspark_kernels::rms_norm_rows(x.clone(), &w, 1e-6))),
            (
                "add + rms_norm".into(),
                Box::new(|_| dspark_kernels::add_rms_norm(x.clone(), x.clone(), &w, 1e-6).1),
            ),
            (
                "q norm + RoPE".into(),
                Box::new(|_| {
                    dspark_kernels::qk_norm_rope(qkv.clone(), 0, heads, head_dim, &wh, &cos, &sin, 1e-6)
                        .reshape([rows, heads * head_dim])
                }),
            ),
            (
                "SwiGLU".into(),
                Box::new(|_| dspark_kernels::swiglu_cols(gu.clone(), gu.clone(), 0, inter, inter)),
            ),
        ];
        // Attention with each kernel, over one window's table and over one table per lane.
        let (q, k_pool, v_pool) = (&q, &k_pool, &v_pool);
        for (tables, keys, meta, group) in
            [("", &keys, &meta, rows), (", one row per lane", &lane_keys, &lane_meta, 1)]
        {
            for kernel in ["tensor cores", "warp per row and head"] {
                cases.push((
                    format!("paged attention ({kernel}){tables}"),
                    Box::new(move |_| {
                        dspark_kernels::paged_attention_grouped(q.clone(), k_pool, v_pool, keys, meta, group)
                            .reshape([rows, heads * head_dim])
                    }),
                ));
            }
        }
        for (name, call) in cases {
            // The kernel is chosen when the deferred operation runs, inside the timing: the
            // switch holds for the whole measurement.
            dspark_kernels::set_tensor_core_attention(!name.contains("warp per row"));
            let t = time_graphed(call, args.iters, device);
            dspark_kernels::set_tensor_core_attention(true);
            let us = t.map_or("—".into(), |t| format!("{:.1}", t * 1e6));
            let layers = t.map_or("—".into(), |t| format!("{:.0}", t * 1e6 * 36.0));
            println!("| {name} | {rows} | {us} | {layers} |");
        }
    }
    markov_steps(args, device);
}

/// Device time of one Markov step of a DSpark draft (rank 256 over the Qwen3 vocabulary) at
/// `--anatomy-rows` lanes, in graphs: the gather of `W1[prev]`, the `W2` product, and either the
/// greedy choice (`argmax_sum_rows`) or a sampled step's corrected logits (widening and add),
/// each part alone and the whole chain as the draft runs it.
fn markov_steps(args: &Args, device: &Device) {
    use burn::tensor::{Int, TensorData};
    println!("\n# One Markov step (rank 256, vocabulary 151 936), device time per call in a graph\n");
    println!(
        "| lanes | gather µs | W2 product µs | argmax of sums µs | widen + add µs | greedy chain µs | sampled chain µs | greedy × γ = 7 µs |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let (vocab, rank, gamma) = (151_936, 256, 7);
    let w1 = random(vocab, rank, 1.0, device);
    let w2 = random(vocab, rank, 0.05, device);
    for &rows in args.anatomy_rows.iter().filter(|&&r| (1..=64).contains(&r)) {
        // One flat buffer, as the LM-head product writes the base logits: a `[rows·γ, vocab]`
        // allocation would pad each row's pitch, and the kernels would first copy it.
        let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::F32);
        let logits = Tensor::<1>::random([rows * gamma * vocab], Distribution::Normal(0.0, 2.0), opts)
            .cast(DType::BF16)
            .reshape([rows, gamma, vocab]);
        let ids: Vec<i32> = (0..rows).map(|r| ((r * 7919 + 13) % vocab) as i32).collect();
        let i32s = TensorCreationOptions::new(device.clone()).with_dtype(DType::I32);
        let prev = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows]), i32s);
        // The parts: the gather, the product (of rows gathered once) and what follows it.
        let gather = |_: usize| w1.clone().select(0, prev.clone());
        let x = gather(0);
        let product = |_: usize| dspark_kernels::linear(x.clone(), &w2);
        let bias = product(0);
        let choose = |k: usize, b: Tensor<2>| dspark_kernels::argmax_sum_rows(logits.clone(), k % gamma, b);
        let widen_add = |k: usize, b: Tensor<2>| {
            logits.clone().narrow(1, k % gamma, 1).reshape([rows, vocab]).cast(DType::F32)
                + b.cast(DType::F32)
        };
        let argmax = |k: usize| choose(k, bias.clone());
        let widen = |k: usize| widen_add(k, bias.clone());
        // The chains, as the draft runs a step.
        let greedy = |k: usize| choose(k, dspark_kernels::linear(gather(k), &w2));
        let sampled = |k: usize| widen_add(k, dspark_kernels::linear(gather(k), &w2));
        let us = |t: Option<f64>| t.map_or("—".into(), |t| format!("{:.1}", t * 1e6));
        let chain = time_graphed(greedy, args.iters, device);
        println!(
            "| {rows} | {} | {} | {} | {} | {} | {} | {} |",
            us(time_graphed(gather, args.iters, device)),
            us(time_graphed(product, args.iters, device)),
            us(time_graphed(argmax, args.iters, device)),
            us(time_graphed(widen, args.iters, device)),
            us(chain),
            us(time_graphed(sampled, args.iters, device)),
            chain.map_or("—".into(), |t| format!("{:.0}", t * 1e6 * gamma as f64)),
        );
    }
}

/// Median device time of one replay of what `body` launches, recorded as one graph: `reps`
/// replays, each synchronised. `None` where no graph is recorded.
fn time_graph_median<T>(body: impl FnMut() -> T, reps: usize, device: &Device) -> Option<f64> {
    let mut body = body;
    let (graph, outputs) = dspark_kernels::DeviceGraph::capture(device, || Ok::<_, ()>(body())).ok()?.ok()?;
    let mut times = Vec::with_capacity(reps);
    for i in 0..=reps {
        let start = Instant::now();
        // SAFETY: the graph reads buffers `body` borrows (alive for this function) and writes
        // `outputs`, held until the replays are synchronised.
        unsafe { graph.replay() }.ok()?;
        sync(device);
        if i > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    drop(outputs);
    times.sort_by(f64::total_cmp);
    Some(times[times.len() / 2])
}

/// The floor of a one-row Qwen3-8B decode step's launch structure, on the device:
///
/// 1. each product's weight size (q/k/v, o, gate/up, down, LM head) read by a bare streaming read
///    (`dspark_kernels::stream_read`) of 36 distinct buffers in a graph, for each cube count of
///    `--floor-cubes` and 4 or 8 loads in flight; the fastest is kept per size;
/// 2. a chain of 335 one-cube launches (`dspark_kernels::tick`) in a graph: the cost of a launch
///    that does nothing but follow the one before;
/// 3. the step's 145 reads in a graph, in the step's order, each at its size's fastest cut;
/// 4. the same with a one-cube launch wherever the step launches a small kernel (per layer the
///    input norm, the K/V store, attention and its combine, the second norm; at the end the
///    final norm, the argmax's two launches and the step's input copies): 335 launches, as in
///    the recorded step (Nsight, 2026-12-04).
///
/// (4) is what the step would take if every product read its weight as fast as a bare read and
/// every small kernel cost only its launch; the measured step is `bench-target`'s.
fn floor(args: &Args, device: &Device) {
    const LAYERS: usize = 36;
    let sizes: [(&str, usize); 5] = [
        ("q/k/v", 6144 * 4096 * 2),
        ("o", 4096 * 4096 * 2),
        ("gate/up", 24576 * 4096 * 2),
        ("down", 4096 * 12288 * 2),
        ("LM head", 151_936 * 4096 * 2),
    ];
    let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::BF16);
    let buffer = |bytes: usize| Tensor::<1>::zeros([bytes / 2], opts.clone());
    // Before the 15 GB of buffers: the probes run only on this crate's CUDA kernels.
    if dspark_kernels::stream_read(buffer(4096), Tensor::<1, Int>::zeros([256], device), 1, 4).is_none() {
        println!("--floor needs this crate's CUDA kernels (a CUDA build and device)");
        return;
    }
    // Distinct buffers per layer, as the step's weights: no read finds the one before in L2.
    let layers: Vec<Vec<Tensor<1>>> =
        (0..LAYERS).map(|_| sizes[..4].iter().map(|&(_, b)| buffer(b)).collect()).collect();
    let head = buffer(sizes[4].1);
    let max_cubes = args.floor_cubes.iter().copied().max().unwrap_or(132).max(1);
    let out = Tensor::<1, Int>::zeros([256 * max_cubes], device);
    sync(device);
    println!("## Bare streaming reads, 36 distinct buffers per size in one graph (device time per read)\n");
    println!("| size | MB | cubes | loads in flight | µs per read | TB/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut best: Vec<(usize, usize, f64)> = Vec::new();
    for (k, &(name, bytes)) in sizes.iter().enumerate() {
        let bufs: Vec<Tensor<1>> =
            if k < 4 { layers.iter().map(|l| l[k].clone()).collect() } else { vec![head.clone()] };
        let mut fastest = (0, 0, f64::INFINITY);
        for &cubes in &args.floor_cubes {
            for unroll in [4, 8] {
                let per = time_graph_median(
                    || {
                        bufs.iter()
                            .filter_map(|b| {
                                dspark_kernels::stream_read(b.clone(), out.clone(), cubes, unroll)
                            })
                            .collect::<Vec<_>>()
                    },
                    10,
                    device,
                )
                .map(|t| t / bufs.len() as f64);
                if let Some(t) = per {
                    println!(
                        "| {name} | {:.1} | {cubes} | {unroll} | {:.1} | {:.2} |",
                        bytes as f64 / 1e6,
                        t * 1e6,
                        bytes as f64 / t / 1e12
                    );
                    if t < fastest.2 {
                        fastest = (cubes, unroll, t);
                    }
                }
            }
        }
        best.push(fastest);
    }
    let chain = 335;
    let tick = Tensor::<1, Int>::zeros([1], device);
    let ticks = time_graph_median(
        || {
            let mut t = tick.clone();
            for _ in 0..chain {
                t = dspark_kernels::tick(t).unwrap_or_else(|| tick.clone());
            }
            t
        },
        20,
        device,
    );
    let read = |k: usize, b: &Tensor<1>| {
        let (cubes, unroll, _) = best[k];
        dspark_kernels::stream_read(b.clone(), out.clone(), cubes, unroll)
    };
    let reads_only = time_graph_median(
        || {
            let mut outs = Vec::new();
            for l in &layers {
                for (k, b) in l.iter().enumerate() {
                    outs.extend(read(k, b));
                }
            }
            outs.extend(read(4, &head));
            outs
        },
        20,
        device,
    );
    let structure = time_graph_median(
        || {
            let mut t = tick.clone();
            let small = |t: Tensor<1, Int>| dspark_kernels::tick(t.clone()).unwrap_or(t);
            let mut outs = Vec::new();
            for l in &layers {
                t = small(t); // input norm
                outs.extend(read(0, &l[0]));
                for _ in 0..3 {
                    t = small(t); // K/V store, attention, combine
                }
                outs.extend(read(1, &l[1]));
                t = small(t); // post-attention norm
                outs.extend(read(2, &l[2]));
                outs.extend(read(3, &l[3]));
            }
            t = small(t); // final norm
            outs.extend(read(4, &head));
            for _ in 0..9 {
                t = small(t); // argmax (2), the step's input copies and casts (7)
            }
            (t, outs)
        },
        20,
        device,
    );
    let weight_bytes = LAYERS * sizes[..4].iter().map(|&(_, b)| b).sum::<usize>() + sizes[4].1;
    let ms = |t: Option<f64>| t.map_or("—".into(), |t| format!("{:.3}", t * 1e3));
    println!("\n## The step's floor (one graph each, median of 20 replays)\n");
    println!("| what | launches | ms | weight TB/s |");
    println!("|---|---:|---:|---:|");
    println!(
        "| one-cube launch chain | {chain} | {} ({} µs a launch) | — |",
        ms(ticks),
        ticks.map_or("—".into(), |t| format!("{:.2}", t * 1e6 / chain as f64))
    );
    let tbs = |t: Option<f64>| t.map_or("—".into(), |t| format!("{:.2}", weight_bytes as f64 / t / 1e12));
    println!("| the step's reads, bare | {} | {} | {} |", LAYERS * 4 + 1, ms(reads_only), tbs(reads_only));
    println!("| reads + a one-cube launch per small kernel | 335 | {} | {} |", ms(structure), tbs(structure));
    println!("\n(weights {:.2} GB per step)", weight_bytes as f64 / 1e9);
}

/// Largest |a − b| over the largest |b|.
fn max_rel_diff(a: Tensor<2>, b: Tensor<2>) -> f32 {
    let a = a.into_data().convert::<f32>().try_into_vec::<f32>().unwrap_or_default();
    let b = b.into_data().convert::<f32>().try_into_vec::<f32>().unwrap_or_default();
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn main() {
    let args = Args::parse();
    let kind: DeviceKind = match args.device.parse() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let device = match kind.device() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };

    println!("# Skinny GEMM, bf16 `x · Wᵀ`, {} ({}), {}\n", args.device, args.shape, clock::now_utc());
    // Launch floor: a product too small to cost any device time.
    let (fx, fw) = (random(1, 256, 1.0, &device), [random(256, 256, 0.05, &device)]);
    let floor_kernel = time_calls(&fx, &fw, args.iters.max(50), &device);
    dspark_kernels::set_kernels_enabled(false);
    let floor_plain = time_calls(&fx, &fw, args.iters.max(50), &device);
    dspark_kernels::set_kernels_enabled(true);
    println!(
        "launch floor (1×256 · 256×256): kernel {:.1} µs, plain burn {:.1} µs per call\n",
        floor_kernel * 1e6,
        floor_plain * 1e6
    );
    if args.plans_only {
        plans_table(&args, &device);
        return;
    }
    if args.floor {
        floor(&args, &device);
        return;
    }
    println!(
        "| matrix | in | out | MB | rows | plain burn µs | kernel µs | plain TB/s | kernel TB/s | kernel speedup | max rel diff | graphed kernel µs | graphed TB/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, inp, out) in matrices(&args.shape) {
        if !wanted(&args, name) {
            continue;
        }
        let bytes = inp * out * 2;
        let copies = args.rotate_bytes.div_ceil(bytes).clamp(1, 16);
        let weights: Vec<Tensor<2>> = (0..copies).map(|_| random(out, inp, 0.02, &device)).collect();
        for &rows in &args.rows {
            let x = random(rows, inp, 1.0, &device);
            dspark_kernels::set_kernels_enabled(false);
            let plain = time_calls(&x, &weights, args.iters, &device);
            let want = dspark_kernels::linear(x.clone(), &weights[0]);
            dspark_kernels::set_kernels_enabled(true);
            let kernel = time_calls(&x, &weights, args.iters, &device);
            let got = dspark_kernels::linear(x.clone(), &weights[0]);
            let diff = max_rel_diff(got, want);
            let tbs = |s: f64| bytes as f64 / s / 1e12;
            let graphed = time_graphed(
                |i| dspark_kernels::linear(x.clone(), &weights[i % weights.len()]),
                args.iters,
                &device,
            );
            println!(
                "| {name} | {inp} | {out} | {:.1} | {rows} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2}× | {diff:.1e} | {} | {} |",
                bytes as f64 / 1e6,
                plain * 1e6,
                kernel * 1e6,
                tbs(plain),
                tbs(kernel),
                plain / kernel,
                graphed.map_or("—".into(), |g| format!("{:.1}", g * 1e6)),
                graphed.map_or("—".into(), |g| format!("{:.2}", tbs(g))),
            );
        }
    }
    if args.fp8 {
        fp8_table(&args, &device);
    }
    if !args.plans.is_empty() {
        plans_table(&args, &device);
    }
    if args.anatomy {
        anatomy(&args, &device);
    }
}
