//! GPU suite (feature `cuda`, run on the GPU machine, never in CI): every CUDA kernel of this
//! crate against its plain-burn body and a float64 recomputation on the host, on fresh random
//! inputs, with the output's memory poisoned before the run.
//!
//! ```text
//! CUDARC_CUDA_VERSION=13000 cargo test --release --features cuda -p dspark-kernels --test gpu_kernels
//! ```
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use burn::tensor::{DType, Device, Distribution, Tensor, TensorCreationOptions};

fn cuda() -> Device {
    Device::cuda(0)
}

/// A fresh `[rows, cols]` bf16 tensor of N(0, σ²) values.
fn random(rows: usize, cols: usize, sigma: f64, device: &Device) -> Tensor<2> {
    let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::F32);
    Tensor::<2>::random([rows, cols], Distribution::Normal(0.0, sigma), opts).cast(DType::BF16)
}

/// Fill and drop a NaN buffer of `elems` bf16, so the next allocation of that size reuses
/// poisoned memory: an element the kernel forgets to write reads back as NaN.
fn poison(elems: usize, device: &Device) {
    let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::BF16);
    let nan = Tensor::<1>::full([elems], f32::NAN, opts);
    let _ = nan.into_data();
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_into_vec::<f32>().unwrap()
}

/// `x · wᵀ` in float64 on the host, from the bf16 values the device holds.
fn reference_f64(x: &[f32], w: &[f32], rows: usize, inp: usize, out: usize) -> Vec<f64> {
    let cols: Vec<usize> = (0..out).collect();
    reference_cols(x, w, rows, inp, &cols)
}

/// Columns `cols` of `x · wᵀ` in float64, row by row (`[rows, cols.len()]`).
fn reference_cols(x: &[f32], w: &[f32], rows: usize, inp: usize, cols: &[usize]) -> Vec<f64> {
    let mut y = Vec::with_capacity(rows * cols.len());
    for r in 0..rows {
        let xr = &x[r * inp..(r + 1) * inp];
        for &o in cols {
            let wr = &w[o * inp..(o + 1) * inp];
            y.push(xr.iter().zip(wr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum());
        }
    }
    y
}

/// ‖a − b‖ / ‖b‖, or infinity when `a` holds a NaN or an infinity.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    if a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn skinny_gemm_matches_reference() {
    let device = cuda();
    // (in, out): a DSpark/Qwen3 hidden width onto a k/v projection, a down projection's long
    // reduction, and a small model's shape.
    let shapes = [(4096, 1024), (12288, 256), (256, 768)];
    let rows_list = [1, 2, 3, 7, 8, 9, 16, 17, 33, 64, 65, 130];
    for &(inp, out) in &shapes {
        let w = random(out, inp, 0.02, &device);
        let wh = host(w.clone());
        for &rows in &rows_list {
            let x = random(rows, inp, 1.0, &device);
            let xh = host(x.clone());
            poison(rows * out, &device);
            let y = host(dspark_kernels::linear(x.clone(), &w));
            let want = reference_f64(&xh, &wh, rows, inp, out);
            let err = rel_err(&y, &want);
            // The plain-burn body on the same device, for scale: bf16 output rounding alone is
            // ≈ 2⁻⁹ relative.
            let stock = host(dspark_kernels::reference::linear_f32(x, &w));
            let stock_err = rel_err(&stock, &want);
            println!(
                "skinny_gemm in={inp} out={out} rows={rows}: rel err {err:.2e} (plain burn {stock_err:.2e})"
            );
            assert!(err <= 4e-3, "in={inp} out={out} rows={rows}: rel err {err:.3e}");
        }
    }
}

#[test]
fn skinny_gemm_matches_reference_at_lm_head_width() {
    // 151936 outputs: rows whose byte length is no multiple of the allocator's row alignment,
    // and the widest grid. Checked on every 61st column (and the last) in float64.
    let device = cuda();
    let (inp, out) = (4096, 151_936);
    let w = random(out, inp, 0.02, &device);
    let wh = host(w.clone());
    let mut cols: Vec<usize> = (0..out).step_by(61).collect();
    cols.push(out - 1);
    for rows in [1, 2, 9, 33, 64] {
        let x = random(rows, inp, 1.0, &device);
        let xh = host(x.clone());
        poison(rows * out, &device);
        let y = host(dspark_kernels::linear(x, &w));
        assert!(y.iter().all(|v| v.is_finite()), "rows={rows}: unwritten or non-finite outputs");
        let picked: Vec<f32> =
            (0..rows).flat_map(|r| cols.iter().map(move |&o| (r, o))).map(|(r, o)| y[r * out + o]).collect();
        let err = rel_err(&picked, &reference_cols(&xh, &wh, rows, inp, &cols));
        println!("skinny_gemm in={inp} out={out} rows={rows}: rel err {err:.2e} on {} columns", cols.len());
        assert!(err <= 4e-3, "in={inp} out={out} rows={rows}: rel err {err:.3e}");
    }
}

#[test]
fn skinny_gemm_is_batch_invariant() {
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    // 4096 -> 6144 (the fused q/k/v) takes two weight blocks per cube for 9–32 rows. With the
    // tile padding on, the calls of 17–24 rows run four activation tiles instead of three.
    for (padding, &(inp, out)) in [false, true]
        .into_iter()
        .flat_map(|p| [(4096, 1024), (256, 768), (4096, 6144)].iter().map(move |shape| (p, shape)))
    {
        dspark_kernels::set_tile_padding(padding);
        let w = random(out, inp, 0.02, &device);
        let x = random(130, inp, 1.0, &device);
        let all = dspark_kernels::linear(x.clone(), &w).into_data();
        let all = all.as_bytes();
        let row_bytes = out * 2;
        // A row alone, a verify window, a batch of lanes: bit-identical rows.
        for (start, len) in [(0, 1), (5, 1), (129, 1), (3, 9), (60, 17), (40, 24), (90, 32), (64, 66)] {
            let part = dspark_kernels::linear(x.clone().narrow(0, start, len), &w).into_data();
            assert_eq!(
                part.as_bytes(),
                &all[start * row_bytes..(start + len) * row_bytes],
                "in={inp} out={out}: rows {start}..{} differ between a call of {len} rows and one of 130",
                start + len
            );
        }
        println!(
            "skinny_gemm in={inp} out={out}, tile padding {padding}: rows bit-identical alone, in windows and in batches"
        );
    }
    // Back to the library's default.
    dspark_kernels::set_tile_padding(true);
}

#[test]
fn linear_falls_back_for_unsupported_shapes_and_dtypes() {
    let device = cuda();
    // `in` not a multiple of 32: the plain-burn body answers, with the same values.
    let w = random(48, 40, 0.1, &device);
    let x = random(3, 40, 1.0, &device);
    let y = host(dspark_kernels::linear(x.clone(), &w));
    let want = reference_f64(&host(x.clone()), &host(w.clone()), 3, 40, 48);
    assert!(rel_err(&y, &want) <= 1e-2);
    // f32 stays on burn's matmul.
    let y32 = dspark_kernels::linear(x.cast(DType::F32), &w.cast(DType::F32));
    assert_eq!(y32.dtype(), DType::F32);
}

/// A small deterministic generator for page tables.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Per lane: (context length, query rows, causal). Returns keys, meta and the lanes' row ranges.
fn plan(
    lanes: &[(usize, usize, bool)],
    pool_rows: usize,
    seed: u64,
) -> (Vec<i32>, Vec<i32>, Vec<std::ops::Range<usize>>) {
    // A shuffled pool: lanes own disjoint, scattered physical rows, as pages do.
    let mut perm: Vec<usize> = (0..pool_rows).collect();
    let mut rng = Lcg(seed);
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.next(i + 1));
    }
    let (mut keys, mut meta, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
    let (mut taken, mut row) = (0, 0);
    for &(len, rows, causal) in lanes {
        let first = keys.len() as i32;
        keys.extend(perm[taken..taken + len].iter().map(|&p| p as i32));
        taken += len;
        for i in 0..rows {
            let visible = if causal { len - rows + i + 1 } else { len };
            meta.extend([first, visible as i32]);
        }
        ranges.push(row..row + rows);
        row += rows;
    }
    (keys, meta, ranges)
}

fn int_tensor<const D: usize>(
    values: Vec<i32>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, burn::tensor::Int> {
    let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::I32);
    Tensor::from_data(burn::tensor::TensorData::new(values, shape), opts)
}

/// Paged attention in float64: row `r`, head `h` over pool rows `keys[first .. first + count]`.
fn attention_f64(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    keys: &[i32],
    meta: &[i32],
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> Vec<f64> {
    let rows = meta.len() / 2;
    let groups = heads / kv_heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0.0f64; rows * heads * head_dim];
    for r in 0..rows {
        let (first, count) = (meta[2 * r] as usize, meta[2 * r + 1] as usize);
        for h in 0..heads {
            let kvh = h / groups;
            let qv = &q[(r * heads + h) * head_dim..][..head_dim];
            let at = |pool: &[f32], j: usize| {
                let p = keys[first + j] as usize;
                pool[(p * kv_heads + kvh) * head_dim..][..head_dim].to_vec()
            };
            let scores: Vec<f64> = (0..count)
                .map(|j| {
                    at(k, j).iter().zip(qv).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = w.iter().sum();
            let o = &mut out[(r * heads + h) * head_dim..][..head_dim];
            for (j, wj) in w.iter().enumerate() {
                for (od, vd) in o.iter_mut().zip(at(v, j)) {
                    *od += wj / z * f64::from(vd);
                }
            }
        }
    }
    out
}

#[test]
fn paged_attention_matches_reference() {
    let device = cuda();
    // Both split kernels: tensor cores (the default) and one warp per row and head.
    for tensor_cores in [true, false] {
        dspark_kernels::set_tensor_core_attention(tensor_cores);
        // (heads, kv_heads, head_dim): Qwen3-8B, a narrower GQA layout, and 12 query heads per
        // K/V head (a row's heads straddle the tensor-core kernel's warps).
        for &(heads, kv_heads, head_dim) in &[(32, 8, 128), (8, 2, 64), (24, 2, 64)] {
            paged_attention_case(heads, kv_heads, head_dim, tensor_cores, &device);
        }
    }
    dspark_kernels::set_tensor_core_attention(true);
}

fn paged_attention_case(heads: usize, kv_heads: usize, head_dim: usize, tensor_cores: bool, device: &Device) {
    let pool_rows = 8192;
    // A decode row, a causal verify window, a draft block (all keys), a long context, a 150-row
    // prefill (the call spans several launches of at most 64 rows, and alone the lanes get
    // scratch strides of 1 to 32 splits: their key tables' lengths), and a window whose rows
    // sit on both sides of a chunk-size threshold (1020 .. 1037 keys: chunks of 32 and 64).
    let lanes = [
        (1, 1, true),
        (37, 8, true),
        (300, 8, false),
        (1500, 1, true),
        (2000, 17, true),
        (200, 150, true),
        (1037, 17, true),
    ];
    let (keys, meta, ranges) = plan(&lanes, pool_rows, 7);
    let rows: usize = lanes.iter().map(|l| l.1).sum();
    let k_pool = random(pool_rows, kv_heads * head_dim, 1.0, device).reshape([pool_rows, kv_heads, head_dim]);
    let v_pool = random(pool_rows, kv_heads * head_dim, 1.0, device).reshape([pool_rows, kv_heads, head_dim]);
    let q = random(rows, heads * head_dim, 1.0, device).reshape([rows, heads, head_dim]);
    let keys_t = int_tensor(keys.clone(), [keys.len()], device);
    let meta_t = int_tensor(meta.clone(), [rows, 2], device);
    assert!(dspark_kernels::paged_attention_supported(&q, &k_pool));
    poison(rows * heads * head_dim, device);
    let got = dspark_kernels::paged_attention(q.clone(), &k_pool, &v_pool, &keys_t, &meta_t);
    // Float64 on the host (the plain-burn body would compile a kernel per key count).
    let want64 = attention_f64(
        &host(q.clone().reshape([rows, heads * head_dim])),
        &host(k_pool.clone().reshape([pool_rows, kv_heads * head_dim])),
        &host(v_pool.clone().reshape([pool_rows, kv_heads * head_dim])),
        &keys,
        &meta,
        (heads, kv_heads, head_dim),
    );
    let flat = |t: Tensor<3>| host(t.reshape([rows, heads * head_dim]));
    let err = rel_err(&flat(got.clone()), &want64);
    println!(
        "paged_attention (tensor cores: {tensor_cores}) heads={heads}/{kv_heads} head_dim={head_dim} rows={rows}: \
         rel err {err:.2e}"
    );
    assert!(err <= 1e-2, "rel err {err:.3e}");

    // Any grouping of the rows (groups that cut across lanes, a whole window per group, more
    // rows than one cube takes): the same bits.
    let all = got.into_data();
    for group in [4, 8, 17, 64] {
        poison(rows * heads * head_dim, device);
        let grouped =
            dspark_kernels::paged_attention_grouped(q.clone(), &k_pool, &v_pool, &keys_t, &meta_t, group)
                .into_data();
        assert_eq!(grouped.as_bytes(), all.as_bytes(), "rows grouped by {group} differ from one by one");
    }

    // The merge folded into the split kernel (one-row groups, counters from the caller), twice
    // on the same counters: the bits of the separate merge, and the counters left zero. Every
    // row here is its own group, so every row of the tensor-core kernel takes the fold.
    let words = dspark_kernels::attention_sync_words(rows, kv_heads);
    let sync = int_tensor(vec![0; words], [words], device);
    let folds = dspark_kernels::attention_folds();
    let fold_was = dspark_kernels::attention_fold();
    dspark_kernels::set_attention_fold(true);
    for pass in 0..2 {
        poison(rows * heads * head_dim, device);
        let folded =
            dspark_kernels::paged_attention_synced(q.clone(), &k_pool, &v_pool, &keys_t, &meta_t, 1, &sync)
                .into_data();
        assert_eq!(folded.as_bytes(), all.as_bytes(), "folded merge (pass {pass}) differs from the combine");
        let left = sync.clone().into_data().convert::<i32>().try_into_vec::<i32>().unwrap();
        assert!(left.iter().all(|&c| c == 0), "counters left non-zero after pass {pass}: {left:?}");
    }
    if tensor_cores {
        assert!(dspark_kernels::attention_folds() > folds, "the tensor-core kernel did not fold its merge");
        // The switch off: the separate merge on the same call, the same bits.
        dspark_kernels::set_attention_fold(false);
        let apart =
            dspark_kernels::paged_attention_synced(q.clone(), &k_pool, &v_pool, &keys_t, &meta_t, 1, &sync)
                .into_data();
        assert_eq!(apart.as_bytes(), all.as_bytes(), "the fold switched off differs");
    }
    dspark_kernels::set_attention_fold(fold_was);

    // Each lane alone, its rows grouped as its window: bit-identical to its rows in the batch.
    let row_bytes = heads * head_dim * 2;
    for (lane, range) in ranges.iter().enumerate() {
        let first = meta[2 * range.start];
        let lane_keys: Vec<i32> = keys[first as usize..first as usize + lanes[lane].0].to_vec();
        let lane_meta: Vec<i32> =
            meta[2 * range.start..2 * range.end].chunks(2).flat_map(|c| [0, c[1]]).collect();
        poison(range.len() * heads * head_dim, device);
        let alone = dspark_kernels::paged_attention_grouped(
            q.clone().narrow(0, range.start, range.len()),
            &k_pool,
            &v_pool,
            &int_tensor(lane_keys.clone(), [lane_keys.len()], device),
            &int_tensor(lane_meta, [range.len(), 2], device),
            range.len(),
        )
        .into_data();
        assert_eq!(
            alone.as_bytes(),
            &all.as_bytes()[range.start * row_bytes..range.end * row_bytes],
            "lane {lane} differs alone and batched"
        );
    }
}

/// `[len]` bf16 of N(1, σ²) values: a norm weight.
fn norm_weight(len: usize, device: &Device) -> Tensor<1> {
    random(1, len, 0.2, device).reshape([len]).add_scalar(1.0)
}

fn host1(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_into_vec::<f32>().unwrap()
}

/// `RMSNorm(row)·w` in float64.
fn rms_f64(row: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    row.iter().zip(w).map(|(v, &w)| v * inv * f64::from(w)).collect()
}

/// The kernel must be as close to float64 as the plain-burn body is, up to a small margin, and
/// within the bf16 bound.
fn check_close(what: &str, got: &[f32], body: &[f32], want: &[f64]) {
    let (e_kernel, e_body) = (rel_err(got, want), rel_err(body, want));
    println!("{what}: kernel {e_kernel:.3e}, plain burn {e_body:.3e}");
    assert!(e_kernel <= 6e-3 && e_kernel <= 1.5 * e_body + 1e-4, "{what}: {e_kernel} vs body {e_body}");
}

/// With every cube size of `set_norm_threads` (process-wide: run this binary with
/// `--test-threads=1`, as the device scripts do; the default is restored after).
#[test]
fn rms_norm_kernels_match_reference() {
    let device = cuda();
    let eps = 1e-6;
    for threads in [256usize, 512, 1024] {
        assert!(dspark_kernels::set_norm_threads(threads));
        println!("norm cube of {threads} threads");
        rms_norm_cases(&device, eps);
    }
    assert!(dspark_kernels::set_norm_threads(1024));
}

fn rms_norm_cases(device: &Device, eps: f64) {
    let device = device.clone();
    for &d in &[4096usize, 256, 1000] {
        let w = norm_weight(d, &device);
        let wh = host1(w.clone());
        for &rows in &[1usize, 3, 17, 64] {
            let x = random(rows, d, 1.0, &device);
            let delta = random(rows, d, 0.5, &device);
            let (xh, dh) = (host(x.clone()), host(delta.clone()));
            // Plain norm.
            poison(rows * d, &device);
            let got = host(dspark_kernels::rms_norm_rows(x.clone(), &w, eps));
            let body = host(dspark_kernels::reference::rms_norm(x.clone(), &w, eps));
            let want: Vec<f64> = (0..rows)
                .flat_map(|r| {
                    let row: Vec<f64> = xh[r * d..(r + 1) * d].iter().map(|&v| f64::from(v)).collect();
                    rms_f64(&row, &wh, eps)
                })
                .collect();
            check_close(&format!("rms_norm d {d} rows {rows}"), &got, &body, &want);
            // With the residual add.
            poison(rows * d, &device);
            let (s, y) = dspark_kernels::add_rms_norm(x.clone(), delta.clone(), &w, eps);
            let (s_body, y_body) = dspark_kernels::reference::add_rms_norm(x.clone(), delta.clone(), &w, eps);
            let (s, y, s_body, y_body) = (host(s), host(y), host(s_body), host(y_body));
            assert_eq!(s, s_body, "residual sum d {d} rows {rows}: one bf16 rounding of x + delta");
            let sums: Vec<f64> = xh.iter().zip(&dh).map(|(&a, &b)| f64::from(a) + f64::from(b)).collect();
            let want: Vec<f64> =
                (0..rows).flat_map(|r| rms_f64(&sums[r * d..(r + 1) * d], &wh, eps)).collect();
            check_close(&format!("add_rms_norm d {d} rows {rows}"), &y, &y_body, &want);
            // A row alone gives the same bits as inside the batch.
            let last = rows - 1;
            let alone = host(dspark_kernels::rms_norm_rows(x.clone().narrow(0, last, 1), &w, eps));
            let batched = host(dspark_kernels::rms_norm_rows(x, &w, eps));
            assert_eq!(alone, batched[last * d..].to_vec(), "rms_norm row {last} of {rows}, d {d}");
        }
    }
}

#[test]
fn qk_norm_rope_matches_reference() {
    let device = cuda();
    let eps = 1e-6;
    // (heads, kv_heads, head_dim): Qwen3-8B and a small model.
    for &(heads, kv_heads, hd) in &[(32usize, 8usize, 128usize), (8, 2, 64)] {
        let width = (heads + 2 * kv_heads) * hd;
        let (wq, wk) = (norm_weight(hd, &device), norm_weight(hd, &device));
        let rope = |rows: usize, first: usize| {
            let half = hd / 2;
            let mut cos = Vec::new();
            let mut sin = Vec::new();
            for p in first..first + rows {
                for _ in 0..2 {
                    for i in 0..half {
                        let a = p as f64 / 1e6f64.powf(2.0 * i as f64 / hd as f64);
                        cos.push(a.cos() as f32);
                        sin.push(a.sin() as f32);
                    }
                }
            }
            let make = |v: Vec<f32>| {
                Tensor::<2>::from_data(burn::tensor::TensorData::new(v, [rows, hd]), &device)
                    .cast(DType::BF16)
            };
            (make(cos), make(sin))
        };
        for &rows in &[1usize, 8, 17, 64] {
            let x = random(rows, width, 1.0, &device);
            let xh = host(x.clone());
            let (cos, sin) = rope(rows, 1000);
            let (ch, sh) = (host(cos.clone()), host(sin.clone()));
            for (what, offset, n, w) in [("q", 0, heads, &wq), ("k", heads * hd, kv_heads, &wk)] {
                let wh = host1(w.clone());
                poison(rows * n * hd, &device);
                let got = dspark_kernels::qk_norm_rope(x.clone(), offset, n, hd, w, &cos, &sin, eps);
                let body =
                    dspark_kernels::reference::qk_norm_rope(x.clone(), offset, n, hd, w, &cos, &sin, eps);
                let flat = |t: Tensor<3>| host(t.reshape([rows, n * hd]));
                let (got, body) = (flat(got), flat(body));
                let half = hd / 2;
                let mut want = Vec::with_capacity(rows * n * hd);
                for r in 0..rows {
                    for h in 0..n {
                        let at = r * width + offset + h * hd;
                        let row: Vec<f64> = xh[at..at + hd].iter().map(|&v| f64::from(v)).collect();
                        let y = rms_f64(&row, &wh, eps);
                        let (c, s) = (&ch[r * hd..(r + 1) * hd], &sh[r * hd..(r + 1) * hd]);
                        for i in 0..hd {
                            let rot = if i < half { -y[i + half] } else { y[i - half] };
                            want.push(y[i] * f64::from(c[i]) + rot * f64::from(s[i]));
                        }
                    }
                }
                check_close(
                    &format!("{what} norm+rope {heads}/{kv_heads}x{hd} rows {rows}"),
                    &got,
                    &body,
                    &want,
                );
                let last = rows - 1;
                let alone = dspark_kernels::qk_norm_rope(
                    x.clone().narrow(0, last, 1),
                    offset,
                    n,
                    hd,
                    w,
                    &cos.clone().narrow(0, last, 1),
                    &sin.clone().narrow(0, last, 1),
                    eps,
                );
                assert_eq!(flat_row(alone), got[last * n * hd..].to_vec(), "{what} row {last} of {rows}");
            }
        }
    }
}

fn flat_row(t: Tensor<3>) -> Vec<f32> {
    let [rows, n, hd] = t.dims();
    host(t.reshape([rows, n * hd]))
}

#[test]
fn swiglu_matches_reference() {
    let device = cuda();
    for &width in &[12288usize, 768, 100] {
        for &rows in &[1usize, 9, 64] {
            // One fused gate/up output, read as two halves.
            let gu = random(rows, 2 * width, 2.0, &device);
            let h = host(gu.clone());
            poison(rows * width, &device);
            let got = host(dspark_kernels::swiglu_cols(gu.clone(), gu.clone(), 0, width, width));
            let body = host(dspark_kernels::reference::swiglu_cols(gu.clone(), gu.clone(), 0, width, width));
            let want: Vec<f64> = (0..rows)
                .flat_map(|r| {
                    let h = &h;
                    (0..width).map(move |j| {
                        let g = f64::from(h[r * 2 * width + j]);
                        let u = f64::from(h[r * 2 * width + width + j]);
                        g / (1.0 + (-g).exp()) * u
                    })
                })
                .collect();
            check_close(&format!("swiglu width {width} rows {rows}"), &got, &body, &want);
            // Two separate tensors give the same bits as the fused layout.
            let g = gu.clone().narrow(1, 0, width);
            let u = gu.narrow(1, width, width);
            let split = host(dspark_kernels::swiglu_cols(g, u, 0, 0, width));
            assert_eq!(split, got, "swiglu width {width} rows {rows}: split vs fused layout");
        }
    }
}

#[test]
fn argmax_rows_matches_reference() {
    let device = cuda();
    // Rows of one to 38 segments of 4096, the last one partial (8193: a single element).
    for &(rows, width) in &[(1usize, 151_936usize), (8, 151_936), (17, 1000), (64, 4096), (3, 7), (3, 8193)] {
        // bf16-rounded values: ties among the largest are common, as in real logits.
        let x = random(rows, width, 3.0, &device).cast(DType::F32);
        let mut h = host(x.clone());
        // Plant exact ties, a NaN and a row of −∞.
        h[0] = f32::NAN;
        if width > 10 {
            let max = h[..width].iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
            h[width - 1] = max;
            h[5] = max;
        }
        if rows > 2 {
            h[2 * width..3 * width].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        }
        if rows > 2 && width > 8192 {
            // A whole segment of NaN in row 1, and its maximum in the last, one-element segment.
            h[width..width + 4096].iter_mut().for_each(|v| *v = f32::NAN);
            h[2 * width - 1] = 1e30;
        }
        let x = Tensor::<2>::from_data(burn::tensor::TensorData::new(h.clone(), [rows, width]), &device);
        poison(rows * 2, &device);
        let got =
            dspark_kernels::argmax_rows(x.clone()).into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        let want = dspark_kernels::reference::argmax_rows(x)
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        assert_eq!(got, want, "argmax rows {rows} x {width}");
        if width > 10 {
            assert_eq!(got[0], 5, "the lowest index of a tie");
        }
        if rows > 2 && width > 8192 {
            assert_eq!(got[1], width as i64 - 1, "a maximum after a segment of NaN");
            assert_eq!(got[2], 0, "a row of −∞");
        }
    }
}

/// Random e4m3 bytes: every finite code, subnormals and ±0 included (NaN codes become 0x00).
fn fp8_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|_| {
            let b = rng.next(256) as u8;
            if b & 0x7F == 0x7F { 0 } else { b }
        })
        .collect()
}

/// A random FP8 matrix: the device copy and the host bytes and scales it was made from.
struct Fp8Case {
    m: dspark_kernels::Fp8Matrix,
    bytes: Vec<u8>,
    scales: Vec<f32>,
    inp: usize,
}

impl Fp8Case {
    fn new(out: usize, inp: usize, grid: dspark_kernels::fp8::ScaleGrid, seed: u64, device: &Device) -> Self {
        let bytes = fp8_bytes(out * inp, seed);
        let mut rng = Lcg(seed ^ 0xABCD);
        // Scales of the size real checkpoints have (max |w| ≈ 0.05 → 1e-4), spread over 2⁴.
        let scales: Vec<f32> =
            (0..grid.len(out, inp)).map(|_| 1e-4 * 2f32.powf(rng.next(1000) as f32 / 250.0)).collect();
        let m = dspark_kernels::Fp8Matrix::upload(&bytes, &scales, [out, inp], grid, device).unwrap();
        Self { m, bytes, scales, inp }
    }

    /// Weight `(r, c)` as `decode(byte) · scale` in float64 (exact).
    fn weight(&self, r: usize, c: usize) -> f64 {
        use dspark_kernels::fp8::{BLOCK, ScaleGrid, e4m3_to_f32};
        let s = match self.m.grid() {
            ScaleGrid::PerRow => self.scales[r],
            ScaleGrid::Blocks => self.scales[(r / BLOCK) * self.inp.div_ceil(BLOCK) + c / BLOCK],
        };
        f64::from(e4m3_to_f32(self.bytes[r * self.inp + c])) * f64::from(s)
    }

    /// Columns `cols` of `x · Wᵀ` in float64.
    fn reference(&self, x: &[f32], rows: usize, cols: &[usize]) -> Vec<f64> {
        let inp = self.inp;
        let w: Vec<Vec<f64>> = cols.iter().map(|&o| (0..inp).map(|c| self.weight(o, c)).collect()).collect();
        let mut y = Vec::with_capacity(rows * cols.len());
        for r in 0..rows {
            let xr = &x[r * inp..(r + 1) * inp];
            for wo in &w {
                y.push(xr.iter().zip(wo).map(|(&a, &b)| f64::from(a) * b).sum());
            }
        }
        y
    }
}

#[test]
fn fp8_gemm_matches_reference() {
    use dspark_kernels::fp8::ScaleGrid;
    let device = cuda();
    // (in, out, grid): a hidden width onto a k/v projection, a down projection's long reduction,
    // a small model, and block rows that end inside a block (144 = 128 + 16).
    let cases = [
        (4096, 1024, ScaleGrid::PerRow),
        (4096, 1024, ScaleGrid::Blocks),
        (12288, 256, ScaleGrid::Blocks),
        (12288, 256, ScaleGrid::PerRow),
        (256, 768, ScaleGrid::PerRow),
        (4096, 144, ScaleGrid::Blocks),
    ];
    let rows_list = [1, 2, 3, 7, 8, 9, 16, 17, 33, 64, 65, 130];
    for (i, &(inp, out, grid)) in cases.iter().enumerate() {
        let case = Fp8Case::new(out, inp, grid, 100 + i as u64, &device);
        let m = &case.m;
        let cols: Vec<usize> = (0..out).collect();
        for &rows in &rows_list {
            let x = random(rows, inp, 1.0, &device);
            let xh = host(x.clone());
            poison(rows * out, &device);
            let y = host(dspark_kernels::linear_fp8(x.clone(), m));
            let want = case.reference(&xh, rows, &cols);
            let err = rel_err(&y, &want);
            let stock = host(dspark_kernels::reference::linear_fp8(x, m));
            let stock_err = rel_err(&stock, &want);
            println!(
                "fp8_gemm {grid:?} in={inp} out={out} rows={rows}: rel err {err:.2e} (plain burn {stock_err:.2e})"
            );
            assert!(err <= 4e-3, "{grid:?} in={inp} out={out} rows={rows}: rel err {err:.3e}");
        }
    }
}

#[test]
fn fp8_gemm_matches_reference_at_lm_head_width() {
    use dspark_kernels::fp8::ScaleGrid;
    let device = cuda();
    let (inp, out) = (4096, 151_936);
    let case = Fp8Case::new(out, inp, ScaleGrid::PerRow, 7, &device);
    let mut cols: Vec<usize> = (0..out).step_by(61).collect();
    cols.push(out - 1);
    for rows in [1, 9, 64] {
        let x = random(rows, inp, 1.0, &device);
        let xh = host(x.clone());
        poison(rows * out, &device);
        let y = host(dspark_kernels::linear_fp8(x, &case.m));
        assert!(y.iter().all(|v| v.is_finite()), "rows={rows}: unwritten or non-finite outputs");
        let picked: Vec<f32> =
            (0..rows).flat_map(|r| cols.iter().map(move |&o| (r, o))).map(|(r, o)| y[r * out + o]).collect();
        let err = rel_err(&picked, &case.reference(&xh, rows, &cols));
        println!("fp8_gemm in={inp} out={out} rows={rows}: rel err {err:.2e} on {} columns", cols.len());
        assert!(err <= 4e-3, "rows={rows}: rel err {err:.3e}");
    }
}

#[test]
fn fp8_gemm_is_batch_invariant() {
    use dspark_kernels::fp8::ScaleGrid;
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    for (i, &(inp, out, grid)) in
        [(4096, 1024, ScaleGrid::PerRow), (4096, 256, ScaleGrid::Blocks), (256, 768, ScaleGrid::PerRow)]
            .iter()
            .enumerate()
    {
        let m = Fp8Case::new(out, inp, grid, 40 + i as u64, &device).m;
        let x = random(130, inp, 1.0, &device);
        let all = dspark_kernels::linear_fp8(x.clone(), &m).into_data();
        let all = all.as_bytes();
        let row_bytes = out * 2;
        for (start, len) in [(0, 1), (5, 1), (129, 1), (3, 9), (60, 17), (90, 32), (64, 66)] {
            let part = dspark_kernels::linear_fp8(x.clone().narrow(0, start, len), &m).into_data();
            assert_eq!(
                part.as_bytes(),
                &all[start * row_bytes..(start + len) * row_bytes],
                "{grid:?} in={inp} out={out}: rows {start}..{} differ between a call of {len} rows and one of 130",
                start + len
            );
        }
        println!("fp8_gemm {grid:?} in={inp} out={out}: rows bit-identical alone, in windows and in batches");
    }
}

/// Serialises the tests that force a GEMM plan (a process-wide setting) with the tests whose
/// assertions depend on one plan staying in force.
static PLAN_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Every cut the kernels take (splits × depth), bf16 and FP8 (per row and per block), on a
/// short and a long reduction: float64 error within the bf16 bound, and each row bit-identical
/// alone, in a window and in a batch while the plan stays in force.
#[test]
fn skinny_gemm_plans_match_reference() {
    use dspark_kernels::GemmPlan;
    use dspark_kernels::fp8::ScaleGrid;
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    let plans: Vec<GemmPlan> =
        ["1x1", "1x8", "2x4", "2x8", "4x4", "4x8", "8x4"].iter().map(|p| p.parse().unwrap()).collect();
    for (i, &(inp, out)) in [(4096usize, 1024usize), (12288, 256)].iter().enumerate() {
        let w = random(out, inp, 0.02, &device);
        let wh = host(w.clone());
        let per_row = Fp8Case::new(out, inp, ScaleGrid::PerRow, 200 + i as u64, &device);
        let blocks = Fp8Case::new(out, inp, ScaleGrid::Blocks, 300 + i as u64, &device);
        let cols: Vec<usize> = (0..out).collect();
        let x = random(130, inp, 1.0, &device);
        let xh = host(x.clone());
        for &plan in &plans {
            dspark_kernels::force_plan(Some(plan));
            for rows in [1usize, 9, 33, 130] {
                let xr = x.clone().narrow(0, 0, rows);
                poison(rows * out, &device);
                let y = host(dspark_kernels::linear(xr.clone(), &w));
                let err = rel_err(&y, &reference_f64(&xh[..rows * inp], &wh, rows, inp, out));
                let y8 = host(dspark_kernels::linear_fp8(xr.clone(), &per_row.m));
                let err8 = rel_err(&y8, &per_row.reference(&xh[..rows * inp], rows, &cols));
                let yb = host(dspark_kernels::linear_fp8(xr, &blocks.m));
                let errb = rel_err(&yb, &blocks.reference(&xh[..rows * inp], rows, &cols));
                println!(
                    "plan {plan} in={inp} out={out} rows={rows}: rel err bf16 {err:.2e}, fp8 per row {err8:.2e}, fp8 blocks {errb:.2e}"
                );
                assert!(
                    err <= 4e-3 && err8 <= 4e-3 && errb <= 4e-3,
                    "plan {plan} in={inp} out={out} rows={rows}"
                );
            }
            let all = dspark_kernels::linear(x.clone(), &w).into_data();
            let all8 = dspark_kernels::linear_fp8(x.clone(), &blocks.m).into_data();
            let row_bytes = out * 2;
            for (start, len) in [(0, 1), (129, 1), (3, 9), (60, 17), (64, 66)] {
                let xs = x.clone().narrow(0, start, len);
                let part = dspark_kernels::linear(xs.clone(), &w).into_data();
                let part8 = dspark_kernels::linear_fp8(xs, &blocks.m).into_data();
                let range = start * row_bytes..(start + len) * row_bytes;
                assert_eq!(
                    part.as_bytes(),
                    &all.as_bytes()[range.clone()],
                    "plan {plan} in={inp}: bf16 rows {start}+{len}"
                );
                assert_eq!(
                    part8.as_bytes(),
                    &all8.as_bytes()[range],
                    "plan {plan} in={inp}: fp8 rows {start}+{len}"
                );
            }
        }
        dspark_kernels::force_plan(None);
    }
}

#[test]
fn graph_input_writes_match_reference() {
    // The in-place writes that refresh a recorded graph's inputs, and the copy that detaches its
    // outputs: exact, into the same buffer (a graph recorded before the write sees the values),
    // leaving the rest of the buffer as it was.
    let device = cuda();
    let ints: Vec<i32> = (0..1000).map(|i| i * 7 - 300).collect();
    let dst = int_tensor(ints.clone(), [1000], &device);
    let src: Vec<i32> = (0..37).map(|i| 100_000 + i * 13).collect();
    let written = dspark_kernels::write_into(dst, int_tensor(src.clone(), [37], &device));
    let got = written.into_data().convert::<i32>().try_into_vec::<i32>().unwrap();
    let mut want = ints.clone();
    want[..37].copy_from_slice(&src);
    assert_eq!(got, want, "integer write");

    // A graph reading `dst` replays with what was written after it was recorded.
    let dst = int_tensor(vec![0; 64], [64], &device);
    let (graph, out) = dspark_kernels::DeviceGraph::capture(&device, || {
        Ok::<_, ()>(dst.clone().float().cast(DType::F32).mul_scalar(2.0))
    })
    .unwrap()
    .unwrap();
    let dst = dspark_kernels::write_into(dst, int_tensor((0..64).collect(), [64], &device));
    // SAFETY: `dst` and `out` are alive until the read below.
    unsafe { graph.replay() }.unwrap();
    let got = out.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
    assert_eq!(got, (0..64).map(|i| 2.0 * i as f32).collect::<Vec<_>>(), "replay after a write");
    drop(dst);

    // Floats, and the detached copy.
    let dst = random(1, 4096, 1.0, &device).reshape([4096]);
    let before = host(dst.clone().reshape([1, 4096]));
    let src = random(1, 1024, 1.0, &device).reshape([1024]);
    let src_host = host(src.clone().reshape([1, 1024]));
    let written = dspark_kernels::write_floats_into(dst, src);
    let copy = dspark_kernels::graph::fresh_copy(written.clone());
    let mut want = before;
    want[..1024].copy_from_slice(&src_host);
    assert_eq!(host(written.reshape([1, 4096])), want, "float write");
    assert_eq!(host(copy.reshape([1, 4096])), want, "fresh copy");
}

#[test]
fn graph_input_buffers_write_in_place() {
    // `InputBuffer` on CUDA: one host-to-device copy into the very buffer a recorded graph
    // reads, for i32 and the default integer dtype; each replay sees the latest write, the rest
    // of the buffer keeps its values, and values are converted to the buffer's width.
    let device = cuda();
    for dtype in [DType::I32, Tensor::<1, burn::tensor::Int>::zeros([1], &device).dtype()] {
        let opts = TensorCreationOptions::new(device.clone()).with_dtype(dtype);
        let start: Vec<i64> = (0..256).map(|i| i * 3 - 100).collect();
        let t = Tensor::<1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(start.clone(), [256]),
            opts,
        );
        let mut buffer = dspark_kernels::InputBuffer::new(t);
        assert!(buffer.is_direct(), "{dtype:?}: writes should go straight to the device");
        // The view is taken inside the body, as a recorded forward takes its inputs' views: a
        // view made once outside may be materialised once, and the graph would read that.
        let whole = buffer.tensor();
        let (graph, out) = dspark_kernels::DeviceGraph::capture(&device, || {
            Ok::<_, ()>(whole.clone().narrow(0, 0, 64).float().cast(DType::F32).mul_scalar(2.0))
        })
        .unwrap()
        .unwrap();
        let read =
            |t: Tensor<1, burn::tensor::Int>| t.into_data().convert::<i64>().try_into_vec::<i64>().unwrap();
        for round in 0..3i64 {
            let values: Vec<i64> = (0..40).map(|i| 1_000 * (round + 1) + i * 7 - 9_000).collect();
            // Round 1 writes i32 values, the others i64: both land in either dtype.
            if round == 1 {
                buffer.write(&values.iter().map(|&v| v as i32).collect::<Vec<i32>>());
            } else {
                buffer.write(&values);
            }
            // SAFETY: the buffer and `out` are alive until the reads below.
            unsafe { graph.replay() }.unwrap();
            let got = out.clone().into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
            let mut want: Vec<i64> = start[..64].to_vec();
            want[..40].copy_from_slice(&values);
            let want_f: Vec<f32> = want.iter().map(|&v| 2.0 * v as f32).collect();
            assert_eq!(got, want_f, "{dtype:?}: replay {round} after a write");
            let mut whole = start.clone();
            whole[..40].copy_from_slice(&values);
            assert_eq!(read(buffer.tensor()), whole, "{dtype:?}: buffer after write {round}");
        }
    }
}

/// The product's combine, the residual add and the norm in one kernel: the same bits as the
/// product then `add_rms_norm` on every row (bf16 and FP8 weights, split and whole plans,
/// 1..100 rows; past 64 rows the call goes the unfused way), and, on the first and last rows, as
/// close to float64 as the plain-burn body.
#[test]
fn linear_add_rms_norm_matches_reference() {
    use dspark_kernels::fp8::ScaleGrid;
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    let eps = 1e-6;
    // `[first, last]` rows of a `[rows, width]` host copy.
    let ends = |v: &[f32], rows: usize, width: usize| -> Vec<f32> {
        [&v[..width], &v[(rows - 1) * width..]].concat()
    };
    // (in, out): o (split in 2), down (2), a k/v-sized product (4), a fused q/k/v (whole).
    for (i, &(inp, out)) in
        [(4096usize, 4096usize), (12288, 4096), (4096, 1024), (4096, 6144)].iter().enumerate()
    {
        let weight = random(out, inp, 0.02, &device);
        let fp8 = Fp8Case::new(out, inp, ScaleGrid::PerRow, 300 + i as u64, &device);
        let norm = norm_weight(out, &device);
        let (wh, nh) = (host(weight.clone()), host1(norm.clone()));
        // The FP8 weight in float64, once.
        let w8: Vec<f32> = (0..out)
            .flat_map(|r| (0..inp).map(move |c| (r, c)))
            .map(|(r, c)| fp8.weight(r, c) as f32)
            .collect();
        for &rows in &[1usize, 8, 17, 64, 100] {
            let x = random(rows, out, 1.0, &device);
            let a = random(rows, inp, 1.0, &device);
            let (xh, ah) = (ends(&host(x.clone()), rows, out), ends(&host(a.clone()), rows, inp));
            let want = |w: &[f32]| -> Vec<f64> {
                let delta = reference_f64(&ah, w, 2, inp, out);
                let sums: Vec<f64> = xh.iter().zip(&delta).map(|(&v, d)| f64::from(v) + d).collect();
                (0..2).flat_map(|r| rms_f64(&sums[r * out..(r + 1) * out], &nh, eps)).collect()
            };
            // bf16 weight.
            poison(rows * out, &device);
            let (s, y) = dspark_kernels::linear_add_rms_norm(x.clone(), a.clone(), &weight, &norm, eps);
            let (s_un, y_un) = dspark_kernels::add_rms_norm(
                x.clone(),
                dspark_kernels::linear(a.clone(), &weight),
                &norm,
                eps,
            );
            let (s, y) = (host(s), host(y));
            assert_eq!(s, host(s_un), "bf16 {inp}->{out} rows {rows}: sum differs from the unfused calls");
            assert_eq!(y, host(y_un), "bf16 {inp}->{out} rows {rows}: norm differs from the unfused calls");
            let (_, y_body) = dspark_kernels::reference::add_rms_norm(
                x.clone(),
                dspark_kernels::reference::linear(a.clone(), &weight),
                &norm,
                eps,
            );
            let what = format!("linear_add_rms_norm {inp}->{out} rows {rows}");
            check_close(&what, &ends(&y, rows, out), &ends(&host(y_body), rows, out), &want(&wh));
            // FP8 weight (its float64 values rounded to f32).
            poison(rows * out, &device);
            let (s, y) = dspark_kernels::linear_fp8_add_rms_norm(x.clone(), a.clone(), &fp8.m, &norm, eps);
            let (s_un, y_un) = dspark_kernels::add_rms_norm(
                x.clone(),
                dspark_kernels::linear_fp8(a.clone(), &fp8.m),
                &norm,
                eps,
            );
            let (s, y) = (host(s), host(y));
            assert_eq!(s, host(s_un), "fp8 {inp}->{out} rows {rows}: sum differs from the unfused calls");
            assert_eq!(y, host(y_un), "fp8 {inp}->{out} rows {rows}: norm differs from the unfused calls");
            let err = rel_err(&ends(&y, rows, out), &want(&w8));
            println!("linear_fp8_add_rms_norm {inp}->{out} rows {rows}: rel err {err:.2e}");
            assert!(err <= 6e-3, "fp8 {inp}->{out} rows {rows}: rel err {err:.3e}");
        }
    }
}

/// q/k norm + RoPE and both K/V stores in one kernel: q as `qk_norm_rope` gives it, the pool
/// rows named by the index (i32 and i64) holding k and v exactly, every other pool row
/// unchanged, and the same pools as the plain-burn body's row assignment; the K/V-only variant
/// (context rows) stores the same rows.
#[test]
fn qkv_norm_rope_store_matches_reference() {
    let device = cuda();
    let eps = 1e-6;
    let pool_rows = 300usize;
    for &(heads, kv_heads, hd) in &[(32usize, 8usize, 128usize), (8, 2, 64)] {
        let width = (heads + 2 * kv_heads) * hd;
        let (wq, wk) = (norm_weight(hd, &device), norm_weight(hd, &device));
        for &rows in &[1usize, 8, 17, 64] {
            for dtype in [DType::I32, DType::I64] {
                let y = random(rows, width, 1.0, &device);
                let (cos, sin) = (random(rows, hd, 0.7, &device), random(rows, hd, 0.7, &device));
                let at: Vec<usize> = (0..rows).map(|r| (r * 37 + 11) % pool_rows).collect();
                let idx = Tensor::<1, burn::tensor::Int>::from_data(
                    burn::tensor::TensorData::new(at.iter().map(|&v| v as i64).collect::<Vec<_>>(), [rows]),
                    &device,
                )
                .cast(dtype);
                let pool = |seed: f64| {
                    random(pool_rows, kv_heads * hd, seed, &device).reshape([pool_rows, kv_heads, hd])
                };
                let (k0, v0) = (pool(1.0), pool(2.0));
                let flat = |t: &Tensor<3>| host(t.clone().reshape([t.dims()[0], t.dims()[1] * t.dims()[2]]));
                let (k0h, v0h) = (flat(&k0), flat(&v0));
                // The kernel on fresh copies it owns alone (written in place).
                let (mut kp, mut vp) = (k0.clone().add_scalar(0.0), v0.clone().add_scalar(0.0));
                poison(rows * heads * hd, &device);
                let q = dspark_kernels::qkv_norm_rope_store(
                    y.clone(),
                    (heads, kv_heads, hd),
                    &wq,
                    &wk,
                    (&cos, &sin),
                    eps,
                    &idx,
                    &mut kp,
                    &mut vp,
                );
                let what = format!("{heads}/{kv_heads}x{hd} rows {rows} {dtype:?}");
                let q_want = dspark_kernels::qk_norm_rope(y.clone(), 0, heads, hd, &wq, &cos, &sin, eps);
                assert_eq!(flat_row(q), flat_row(q_want), "{what}: q");
                let k_want = flat_row(dspark_kernels::qk_norm_rope(
                    y.clone(),
                    heads * hd,
                    kv_heads,
                    hd,
                    &wk,
                    &cos,
                    &sin,
                    eps,
                ));
                let yh = host(y.clone());
                let (kh, vh) = (flat(&kp), flat(&vp));
                let row_len = kv_heads * hd;
                for p in 0..pool_rows {
                    let (k_row, v_row) =
                        (&kh[p * row_len..(p + 1) * row_len], &vh[p * row_len..(p + 1) * row_len]);
                    match at.iter().position(|&a| a == p) {
                        Some(r) => {
                            assert_eq!(
                                k_row,
                                &k_want[r * row_len..(r + 1) * row_len],
                                "{what}: k at pool row {p}"
                            );
                            let v_src = r * width + (heads + kv_heads) * hd;
                            assert_eq!(v_row, &yh[v_src..v_src + row_len], "{what}: v at pool row {p}");
                        }
                        None => {
                            assert_eq!(
                                k_row,
                                &k0h[p * row_len..(p + 1) * row_len],
                                "{what}: k pool row {p} changed"
                            );
                            assert_eq!(
                                v_row,
                                &v0h[p * row_len..(p + 1) * row_len],
                                "{what}: v pool row {p} changed"
                            );
                        }
                    }
                }
                // K/V only (a draft's context rows): the same pools from the k/v columns alone.
                let (mut kc, mut vc) = (k0.clone().add_scalar(0.0), v0.clone().add_scalar(0.0));
                let y_kv = y.clone().narrow(1, heads * hd, 2 * kv_heads * hd);
                dspark_kernels::kv_norm_rope_store(
                    y_kv,
                    (kv_heads, hd),
                    &wk,
                    (&cos, &sin),
                    eps,
                    &idx,
                    &mut kc,
                    &mut vc,
                );
                assert_eq!((flat(&kc), flat(&vc)), (kh.clone(), vh.clone()), "{what}: K/V-only store");
                // The plain-burn body gives the same pools; a shared pool is not written in place.
                let (mut kb, mut vb) = (k0.clone(), v0.clone());
                let _ = dspark_kernels::reference::qkv_norm_rope_store(
                    y.clone(),
                    (heads, kv_heads, hd),
                    &wq,
                    &wk,
                    (&cos, &sin),
                    eps,
                    &idx,
                    &mut kb,
                    &mut vb,
                );
                assert_eq!((flat(&kb), flat(&vb)), (kh, vh), "{what}: pools differ from the body's");
                assert_eq!(
                    (flat(&k0), flat(&v0)),
                    (k0h.clone(), v0h.clone()),
                    "{what}: a shared pool was written"
                );
                let (mut ks, mut vs) = (k0.clone(), v0.clone());
                let _ = dspark_kernels::qkv_norm_rope_store(
                    y,
                    (heads, kv_heads, hd),
                    &wq,
                    &wk,
                    (&cos, &sin),
                    eps,
                    &idx,
                    &mut ks,
                    &mut vs,
                );
                assert_eq!((flat(&k0), flat(&v0)), (k0h, v0h), "{what}: the kernel wrote a shared pool");
                println!("qkv_norm_rope_store {what}: q, k and v rows exact, other rows kept");
            }
        }
    }
}

/// The gate/up product with the SwiGLU as its epilogue: the same bits as the paired product
/// followed by the SwiGLU kernel, the same bits as two separate products where their plan is the
/// same, and (on the first and last rows) as close to float64 as the plain-burn body.
#[test]
fn linear_swiglu_matches_reference() {
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    // (in, inter): Qwen3-8B's MLP, and a smaller one.
    for &(inp, inter) in &[(4096usize, 12288usize), (1024, 4608)] {
        let (gate, up) = (random(inter, inp, 0.02, &device), random(inter, inp, 0.02, &device));
        let paired = dspark_kernels::pair_gate_up(gate.clone(), up.clone());
        let (gh, uh) = (host(gate.clone()), host(up.clone()));
        for &rows in &[1usize, 8, 17, 64, 100] {
            let x = random(rows, inp, 1.0, &device);
            poison(rows * inter, &device);
            let got = host(dspark_kernels::linear_swiglu(x.clone(), &paired));
            // The paired product, then the SwiGLU kernel.
            let y = dspark_kernels::linear(x.clone(), &paired).reshape([rows, inter / 8, 2, 8]);
            let g = y.clone().narrow(2, 0, 1).reshape([rows, inter]);
            let u = y.narrow(2, 1, 1).reshape([rows, inter]);
            let what = format!("linear_swiglu {inp}->{inter} rows {rows}");
            assert_eq!(
                got,
                host(dspark_kernels::swiglu_cols(g, u, 0, 0, inter)),
                "{what}: vs product + swiglu"
            );
            // Two separate products (the same plan at these widths), then the SwiGLU kernel.
            let split = dspark_kernels::swiglu_cols(
                dspark_kernels::linear(x.clone(), &gate),
                dspark_kernels::linear(x.clone(), &up),
                0,
                0,
                inter,
            );
            assert_eq!(got, host(split), "{what}: vs separate products");
            let body = host(dspark_kernels::reference::swiglu_cols(
                dspark_kernels::reference::linear(x.clone(), &gate),
                dspark_kernels::reference::linear(x.clone(), &up),
                0,
                0,
                inter,
            ));
            let xh = host(x);
            let ends =
                |v: &[f32], width: usize| -> Vec<f32> { [&v[..width], &v[(rows - 1) * width..]].concat() };
            let xe = ends(&xh, inp);
            let (gs, us) = (reference_f64(&xe, &gh, 2, inp, inter), reference_f64(&xe, &uh, 2, inp, inter));
            let want: Vec<f64> = gs.iter().zip(&us).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
            check_close(&what, &ends(&got, inter), &ends(&body, inter), &want);
        }
    }
}

/// Rows 1–3 of `h` (rows of `width`) made special: row 1 holds a NaN (drawn as the argmax),
/// row 2 is all −∞ (0), row 3 has a single finite value (always drawn).
fn plant_special_rows(h: &mut [f32], width: usize) {
    h[width + 1] = f32::NAN;
    h[2 * width..3 * width].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    h[3 * width..4 * width].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    h[4 * width - 2] = 0.5;
}

/// `(CDF just before i, CDF through i)` of `softmax(x / t)` in float64, the sums in index order.
fn cdf_around(x: &[f32], t: f32, i: usize) -> (f64, f64) {
    let max = x.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = x.iter().map(|&v| ((f64::from(v) - f64::from(max)) / f64::from(t)).exp()).collect();
    let total: f64 = w.iter().sum();
    let before: f64 = w[..i].iter().sum();
    (before / total, (before + w[i]) / total)
}

#[test]
fn sample_rows_matches_reference() {
    let device = cuda();
    let mut next = uniforms(0x5EED);
    let temps = [0.0f32, 0.6, 1.0, 1.7];
    let (mut sampled, mut mismatches) = (0usize, 0usize);
    for &(rows, width) in &[(8usize, 151_936usize), (33, 1000), (5, 8193), (64, 4096), (200, 64)] {
        let x = random(rows, width, 2.5, &device).cast(DType::F32);
        let mut h = host(x.clone());
        if rows > 4 {
            plant_special_rows(&mut h, width);
        }
        let mut words = Vec::with_capacity(3 * rows);
        let mut params = Vec::with_capacity(rows);
        for r in 0..rows {
            let t = temps[r % temps.len()];
            // Coins at both ends of [0, 1) as well as in between.
            let u = match r % 7 {
                5 => 0.0,
                6 => 1.0 - 1.0 / (1u64 << 53) as f64,
                _ => next(),
            };
            let w = dspark_kernels::reference::draw_words(t, u);
            assert_eq!(dspark_kernels::reference::draw_params(w), (t, u), "draw words round trip");
            words.extend(w);
            params.push((t, u));
        }
        let x = Tensor::<2>::from_data(burn::tensor::TensorData::new(h.clone(), [rows, width]), &device);
        let draws = Tensor::<1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(words.clone(), [3 * rows]),
            &device,
        );
        poison(rows * 8, &device);
        let got = dspark_kernels::sample_rows(x.clone(), draws.clone())
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        let want = dspark_kernels::reference::sample_rows(x.clone(), draws)
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        for r in 0..rows {
            let (t, u) = params[r];
            let row = &h[r * width..(r + 1) * width];
            let token = got[r] as usize;
            assert!(token < width, "row {r}: token {token} of {width}");
            if t == 0.0 || (rows > 4 && (1..=2).contains(&r)) {
                assert_eq!(got[r], want[r], "rows {rows} x {width}, row {r}: argmax");
                continue;
            }
            if rows > 4 && r == 3 {
                assert_eq!(token, width - 2, "the only finite value");
                continue;
            }
            sampled += 1;
            // The defining property of an inverse-CDF draw, up to f64 rounding of the sums.
            let (lo, hi) = cdf_around(row, t, token);
            assert!(
                lo <= u + 1e-12 && u < hi + 1e-12,
                "rows {rows} x {width}, row {r} (T {t}, u {u}): token {token} covers [{lo}, {hi})"
            );
            if got[r] != want[r] {
                mismatches += 1;
                // Only a coin on a boundary between two tokens may land differently.
                let (wlo, whi) = cdf_around(row, t, want[r] as usize);
                let edge = (u - wlo).abs().min((u - whi).abs()).min((u - lo).abs()).min((u - hi).abs());
                assert!(edge < 1e-12, "row {r}: device {token}, host {} (coin {u}, edge {edge})", want[r]);
            }
        }
        // A row's draw does not depend on the other rows of the call.
        let alone = dspark_kernels::sample_rows(
            x.narrow(0, rows - 1, 1),
            Tensor::<1, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(words[3 * (rows - 1)..].to_vec(), [3]),
                &device,
            ),
        )
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap();
        assert_eq!(alone[0], got[rows - 1], "the last row alone");
    }
    println!(
        "sample_rows: {sampled} sampled rows, {mismatches} differ from the host rule (coins on a boundary)"
    );
    assert!(sampled > 100, "too few sampled rows checked: {sampled}");
}

#[test]
fn sample_rows_parallel_walk_matches_serial() {
    // `set_parallel_draws`: the segment weights made by one thread each and the last walk on
    // the chosen thread, against thread 0 doing every step. The same draws, bit for bit, on
    // vocabulary rows, a draft vocabulary, ragged widths and a row of 258 segments (two chunks
    // of the parallel walk); and each a valid inverse-CDF draw.
    let device = cuda();
    let mut next = uniforms(0x0D15_EA5E);
    let temps = [0.0f32, 0.6, 1.0, 1.7];
    let mut sampled = 0usize;
    for &(rows, width) in &[(8usize, 151_936usize), (7, 16_384), (5, 8193), (33, 1000), (2, 258 * 4096 - 7)] {
        let mut h = host(random(rows, width, 2.5, &device).cast(DType::F32));
        if rows > 4 {
            plant_special_rows(&mut h, width);
        }
        let mut words = Vec::with_capacity(3 * rows);
        let mut params = Vec::with_capacity(rows);
        for r in 0..rows {
            let t = temps[(r + 1) % temps.len()];
            let u = match r % 5 {
                3 => 0.0,
                4 => 1.0 - 1.0 / (1u64 << 53) as f64,
                _ => next(),
            };
            words.extend(dspark_kernels::reference::draw_words(t, u));
            params.push((t, u));
        }
        let x = Tensor::<2>::from_data(burn::tensor::TensorData::new(h.clone(), [rows, width]), &device);
        let draws = Tensor::<1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(words.clone(), [3 * rows]),
            &device,
        );
        let run = |parallel: bool| {
            dspark_kernels::set_parallel_draws(parallel);
            poison(rows * 8, &device);
            let ids = dspark_kernels::sample_rows(x.clone(), draws.clone())
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .unwrap();
            // Back to the default, for the tests after this one.
            dspark_kernels::set_parallel_draws(true);
            ids
        };
        let (serial, parallel) = (run(false), run(true));
        assert_eq!(parallel, serial, "rows {rows} x {width}: parallel walk vs serial");
        for r in 0..rows {
            let (t, u) = params[r];
            let token = parallel[r] as usize;
            assert!(token < width, "row {r}: token {token} of {width}");
            if t == 0.0 || (rows > 4 && (1..=3).contains(&r)) {
                continue;
            }
            sampled += 1;
            let (lo, hi) = cdf_around(&h[r * width..(r + 1) * width], t, token);
            assert!(
                lo <= u + 1e-12 && u < hi + 1e-12,
                "rows {rows} x {width}, row {r} (T {t}, u {u}): token {token} covers [{lo}, {hi})"
            );
        }
    }
    println!("sample_rows parallel walk: {sampled} sampled rows, the serial walk's draws");
    assert!(sampled > 20, "too few sampled rows checked: {sampled}");
}

#[test]
fn sample_rows_follow_the_softmax() {
    // 20 000 draws from one 1000-wide row at T = 0.8: the frequencies against float64 softmax.
    let device = cuda();
    let (n, width, t) = (20_000usize, 1000usize, 0.8f32);
    let row = host(random(1, width, 1.5, &device).cast(DType::F32));
    let mut h = Vec::with_capacity(n * width);
    let mut words = Vec::with_capacity(3 * n);
    for i in 0..n {
        h.extend_from_slice(&row);
        words.extend(dspark_kernels::reference::draw_words(t, (i as f64 + 0.5) / n as f64));
    }
    let x = Tensor::<2>::from_data(burn::tensor::TensorData::new(h, [n, width]), &device);
    let draws =
        Tensor::<1, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(words, [3 * n]), &device);
    let got = dspark_kernels::sample_rows(x, draws).into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
    let mut counts = vec![0usize; width];
    for &g in &got {
        counts[g as usize] += 1;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = row.iter().map(|&v| ((f64::from(v) - f64::from(max)) / f64::from(t)).exp()).collect();
    let total: f64 = w.iter().sum();
    // Stratified coins: each token's count is within one of n·q.
    for (i, &c) in counts.iter().enumerate() {
        let expected = n as f64 * w[i] / total;
        assert!((c as f64 - expected).abs() <= 1.0 + 1e-9, "token {i}: {c} draws, expected {expected:.3}");
    }
}

#[test]
fn skinny_gemm_two_blocks_per_cube_match_one() {
    // Two 16-row weight blocks per cube (9–32 rows) against one, forced: the same bits, for the
    // plain product (uncut and cut in 2) and for the SwiGLU epilogue; and against float64. Then
    // four blocks on a Markov head's W2.
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    // `f`'s output (`elems` values) with `mt` blocks per cube forced, over poisoned memory.
    let forced = |mt: usize, elems: usize, f: &dyn Fn() -> Tensor<2>| {
        dspark_kernels::force_mtiles(Some(mt));
        poison(elems, &device);
        let y = host(f());
        dspark_kernels::force_mtiles(None);
        y
    };
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for &(inp, out) in &[(4096usize, 6144usize), (4096, 4096), (12288, 4096)] {
        let w = random(out, inp, 0.02, &device);
        for rows in [9usize, 17, 32] {
            let x = random(rows, inp, 1.0, &device);
            let product = || dspark_kernels::linear(x.clone(), &w);
            let (one, two) = (forced(1, rows * out, &product), forced(2, rows * out, &product));
            assert!(same(&one, &two), "{inp}->{out}, {rows} rows");
            let want = reference_f64(&host(x.clone()), &host(w.clone()), rows, inp, out);
            let err = rel_err(&two, &want);
            println!("two blocks per cube, {inp}->{out}, {rows} rows: bit-equal to one; rel err {err:.2e}");
            assert!(err < 4e-3, "rel err {err}");
        }
    }
    // A Markov head's W2 (rank 256: one chunk per warp) with four blocks per cube forced, and
    // with the chosen count (two), against one: the same bits, up to two tiles (16 rows).
    let (inp, out) = (256usize, 151_936usize);
    let w = random(out, inp, 0.02, &device);
    for rows in [1usize, 8, 16] {
        let x = random(rows, inp, 1.0, &device);
        let product = || dspark_kernels::linear(x.clone(), &w);
        let (one, four) = (forced(1, rows * out, &product), forced(4, rows * out, &product));
        assert!(one.iter().all(|v| v.is_finite()), "W2 output left unwritten");
        assert!(same(&one, &four), "W2, {rows} rows");
        assert!(same(&one, &host(product())), "W2 with the chosen blocks, {rows} rows");
        println!("four blocks per cube, {inp}->{out}, {rows} rows: bit-equal to one");
    }
    let (inp, inter) = (4096usize, 12288usize);
    let paired =
        dspark_kernels::pair_gate_up(random(inter, inp, 0.02, &device), random(inter, inp, 0.02, &device));
    for rows in [9usize, 24] {
        let x = random(rows, inp, 1.0, &device);
        let product = || dspark_kernels::linear_swiglu(x.clone(), &paired);
        let (one, two) = (forced(1, rows * inter, &product), forced(2, rows * inter, &product));
        assert!(one.iter().all(|v| v.is_finite()), "SwiGLU output left unwritten");
        assert!(same(&one, &two), "SwiGLU, {rows} rows");
        println!("two blocks per cube, SwiGLU 4096->2x12288, {rows} rows: bit-equal to one");
    }
}

#[test]
fn fp8_gemm_blocks_per_cube_match_one() {
    // The FP8 kernel with 2, 4 and 8 weight blocks per cube (forced) against one: the same bits,
    // per-row and block scales. A Markov W2 in FP8 (rank 256: four chunks of 64, so four warps
    // of one chunk each, and four blocks chosen up to 16 rows) against float64 on sampled
    // columns, and each row alone equal to the same row among others.
    use dspark_kernels::fp8::ScaleGrid;
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    let forced = |mt: Option<usize>, elems: usize, f: &dyn Fn() -> Tensor<2>| {
        dspark_kernels::force_mtiles(mt);
        poison(elems, &device);
        let y = host(f());
        dspark_kernels::force_mtiles(None);
        y
    };
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for (i, &(inp, out, grid)) in [
        (256usize, 151_936usize, ScaleGrid::PerRow),
        (4096, 4096, ScaleGrid::Blocks),
        (12288, 1024, ScaleGrid::PerRow),
        (256, 1024, ScaleGrid::Blocks),
    ]
    .iter()
    .enumerate()
    {
        let case = Fp8Case::new(out, inp, grid, 500 + i as u64, &device);
        let mut cols: Vec<usize> = (0..out).step_by(if out > 8192 { 97 } else { 7 }).collect();
        cols.push(out - 1);
        for rows in [1usize, 8, 16] {
            let x = random(rows, inp, 1.0, &device);
            let product = || dspark_kernels::linear_fp8(x.clone(), &case.m);
            let one = forced(Some(1), rows * out, &product);
            assert!(one.iter().all(|v| v.is_finite()), "{inp}->{out}: output left unwritten");
            for mt in [2usize, 4, 8] {
                let many = forced(Some(mt), rows * out, &product);
                assert!(same(&one, &many), "{grid:?} {inp}->{out}, {rows} rows: {mt} blocks per cube differ");
            }
            let chosen = forced(None, rows * out, &product);
            assert!(same(&one, &chosen), "{grid:?} {inp}->{out}, {rows} rows: the chosen blocks differ");
            let xh = host(x.clone());
            let picked: Vec<f32> = (0..rows)
                .flat_map(|r| cols.iter().map(move |&o| (r, o)))
                .map(|(r, o)| one[r * out + o])
                .collect();
            let err = rel_err(&picked, &case.reference(&xh, rows, &cols));
            println!(
                "fp8 {grid:?} {inp}->{out}, {rows} rows: 1/2/4/8 blocks per cube bit-equal; rel err {err:.2e}"
            );
            assert!(err <= 4e-3, "{grid:?} {inp}->{out}, {rows} rows: rel err {err:.3e}");
            if rows == 16 {
                // Row 5 alone (one tile, four blocks) against the same row among 16 (two tiles).
                let alone = host(dspark_kernels::linear_fp8(x.clone().narrow(0, 5, 1), &case.m));
                assert!(same(&alone, &one[5 * out..6 * out]), "{inp}->{out}: row 5 alone differs");
            }
        }
    }
}

/// A uniform stream in `[0, 1)` from a seed.
fn uniforms(seed: u64) -> impl FnMut() -> f64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Inverse-CDF draw from a distribution, by the crate's rule.
fn draw_from(dist: &[f64], u: f64) -> u32 {
    dspark_kernels::accept::draw_weights(dist, u).expect("a distribution with positive mass")
}

/// Run [`dspark_kernels::chain_accept`] on device rows and lanes; `(accepted, token)` per lane.
fn chain_accept_on(
    p: &[f32],
    q: &[f32],
    width: usize,
    lanes: &[dspark_kernels::accept::AcceptLane],
    gamma: usize,
    device: &Device,
) -> Vec<(usize, u32)> {
    use burn::tensor::{Int, TensorData};
    let (p_rows, q_rows) = (p.len() / width, q.len() / width);
    let (rows, words) = dspark_kernels::accept::accept_words(lanes, p_rows, q_rows, gamma);
    let stride = dspark_kernels::accept::lane_stride(gamma);
    let pt = Tensor::<2>::from_data(TensorData::new(p.to_vec(), [p_rows, width]), device);
    let qt = Tensor::<2>::from_data(TensorData::new(q.to_vec(), [q_rows, width]), device);
    let rt = Tensor::<1, Int>::from_data(TensorData::new(rows, [3 * (p_rows + q_rows)]), device);
    let wt = Tensor::<2, Int>::from_data(TensorData::new(words, [lanes.len(), stride]), device);
    poison(2 * lanes.len(), device);
    let out = dspark_kernels::chain_accept(pt, qt, rt, wt)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap();
    out.chunks(2).map(|c| (c[0] as usize, c[1] as u32)).collect()
}

#[test]
fn chain_accept_matches_reference() {
    use dspark_kernels::accept::{AcceptLane, accept_lane, row_distribution};
    let device = cuda();
    let mut next = uniforms(0x00AC_CE97);
    let gamma = 7;
    let settings = [
        (1.0f32, 0usize, 1.0f32),
        (0.7, 0, 1.0),
        (1.0, 20, 1.0),
        (1.0, 1, 1.0),
        (0.9, 0, 0.9),
        (1.2, 0, 0.5),
        (0.8, 50, 0.95),
        (1.0, 1000, 0.8),
    ];
    let (mut lanes_checked, mut accepted_total, mut rejections) = (0usize, 0usize, 0usize);
    for &(width, lanes_n, coarse) in &[(151_936usize, 8usize, false), (1000, 24, true), (4097, 16, false)] {
        let mut p = Vec::new();
        let mut q = Vec::new();
        let mut lanes = Vec::new();
        for l in 0..lanes_n {
            let (t, top_k, top_p) = settings[l % settings.len()];
            let m = (l * 3) % (gamma + 1);
            let p_row = p.len() / width;
            let q_row = q.len() / width;
            // Target rows N(0, 2.5²) (on a grid of 0.5 for the coarse case: ties), proposal rows
            // the target's, perturbed.
            for _ in 0..=m {
                for _ in 0..width {
                    let g = (-2.0 * next().max(1e-300).ln()).sqrt() * (std::f64::consts::TAU * next()).cos();
                    let v = (2.5 * g) as f32;
                    p.push(if coarse { (v * 2.0).round() / 2.0 } else { v });
                }
            }
            for r in 0..m {
                for i in 0..width {
                    q.push(p[(p_row + r) * width + i] + ((next() - 0.5) * 0.8) as f32);
                }
            }
            if l == 3 {
                // A NaN in the target's first row and −∞ in the proposal's.
                p[p_row * width + 5] = f32::NAN;
                if m > 0 {
                    q[q_row * width + 6] = f32::NEG_INFINITY;
                }
            }
            let drafts: Vec<u32> = (0..m)
                .map(|r| {
                    let row = &q[(q_row + r) * width..(q_row + r + 1) * width];
                    draw_from(&row_distribution(row, t, 0, 1.0), next())
                })
                .collect();
            lanes.push(AcceptLane {
                p_row,
                q_row,
                drafts,
                temperature: t,
                top_k,
                top_p,
                accept_coins: (0..m).map(|_| next()).collect(),
                draw_coins: (0..=m).map(|_| next()).collect(),
            });
        }
        if lanes_n > 10 {
            // A lane whose target row is one-hot (+∞), with no drafts.
            let p_row = p.len() / width;
            let mut row: Vec<f32> = (0..width).map(|i| (i % 7) as f32).collect();
            row[width / 2] = f32::INFINITY;
            p.extend(row);
            lanes.push(AcceptLane {
                p_row,
                q_row: 0,
                drafts: vec![],
                temperature: 1.0,
                top_k: 0,
                top_p: 0.9,
                accept_coins: vec![],
                draw_coins: vec![next()],
            });
        }
        let got = chain_accept_on(&p, &q, width, &lanes, gamma, &device);
        for (l, lane) in lanes.iter().enumerate() {
            let want = accept_lane(&p, &q, width, lane);
            assert_eq!(got[l], want, "width {width}, lane {l} ({lane:?})");
            assert!(got[l].0 <= lane.drafts.len() && (got[l].1 as usize) < width);
            accepted_total += got[l].0;
            rejections += usize::from(got[l].0 < lane.drafts.len());
        }
        if lanes_n > 10 {
            assert_eq!(got[lanes.len() - 1], (0, (width / 2) as u32), "a one-hot row draws its +∞");
        }
        // A lane alone decides as in the batch.
        let alone = chain_accept_on(&p, &q, width, &lanes[1..2], gamma, &device);
        assert_eq!(alone[0], got[1], "width {width}: lane 1 alone");
        lanes_checked += lanes.len();
    }
    println!(
        "chain_accept: {lanes_checked} lanes equal to the reference; {accepted_total} drafts accepted, {rejections} rejections"
    );
    assert!(accepted_total > 20 && rejections > 10, "both outcomes exercised");
}

#[test]
fn chain_accept_follows_the_target() {
    // 20 000 lanes verify one draft each, drawn from q, against one target row with top-k and
    // top-p: the committed token's frequencies against the target's distribution.
    use dspark_kernels::accept::{AcceptLane, row_distribution};
    let device = cuda();
    let mut next = uniforms(0xD157);
    let (n, width, t, top_k, top_p) = (20_000usize, 1000usize, 0.8f32, 60usize, 0.9f32);
    let p: Vec<f32> = host(random(2, width, 1.5, &device).cast(DType::F32));
    let q: Vec<f32> = p[..width].iter().map(|&v| v + ((next() - 0.5) * 2.0) as f32).collect();
    let qd = row_distribution(&q, t, 0, 1.0);
    let pd = row_distribution(&p[..width], t, top_k, top_p);
    let lanes: Vec<AcceptLane> = (0..n)
        .map(|_| AcceptLane {
            p_row: 0,
            q_row: 0,
            drafts: vec![draw_from(&qd, next())],
            temperature: t,
            top_k,
            top_p,
            accept_coins: vec![next()],
            draw_coins: vec![next(), next()],
        })
        .collect();
    let got = chain_accept_on(&p, &q, width, &lanes, 1, &device);
    let mut counts = vec![0usize; width];
    for (l, &(c, token)) in got.iter().enumerate() {
        let first = if c == 1 { lanes[l].drafts[0] } else { token };
        counts[first as usize] += 1;
    }
    let kept = pd.iter().filter(|&&x| x > 0.0).count();
    assert!(kept > 5 && kept <= top_k, "{kept} tokens kept");
    // χ² over the kept tokens, those expected fewer than 5 times pooled into one bin.
    let (mut chi2, mut bins) = (0.0, 0usize);
    let (mut pooled_seen, mut pooled_expected) = (0.0, 0.0);
    for (i, &c) in counts.iter().enumerate() {
        let expected = n as f64 * pd[i];
        if pd[i] == 0.0 {
            assert_eq!(c, 0, "token {i} is outside top-k/top-p but was committed {c} times");
        } else if expected < 5.0 {
            pooled_seen += c as f64;
            pooled_expected += expected;
        } else {
            chi2 += (c as f64 - expected).powi(2) / expected;
            bins += 1;
        }
    }
    if pooled_expected > 0.0 {
        chi2 += (pooled_seen - pooled_expected).powi(2) / pooled_expected;
        bins += 1;
    }
    // χ² with bins − 1 degrees of freedom: mean bins − 1, sd √(2(bins − 1)); 6 sd is far out.
    let df = (bins - 1) as f64;
    println!("chain_accept: χ² {chi2:.1} on {df} df over {kept} kept tokens ({bins} bins)");
    assert!(chi2 < df + 6.0 * (2.0 * df).sqrt(), "χ² {chi2} on {df} df");
}

/// The argmax of a Markov step's sum `f32(a[:, k, :]) + f32(b)`, formed inside the argmax's first
/// pass, against the widening, the add and the plain-burn argmax; with planted exact ties of the
/// sum (different terms, one sum) and a NaN.
#[test]
fn argmax_sum_rows_matches_reference() {
    let device = cuda();
    for &(rows, steps, width) in
        &[(1usize, 7usize, 151_936usize), (8, 7, 151_936), (3, 16, 8193), (16, 2, 1000)]
    {
        let a = random(rows * steps, width, 3.0, &device);
        let b = random(rows, width, 1.0, &device);
        let (mut ah, mut bh) = (host(a), host(b));
        for k in [0, steps - 1] {
            // Row 0 at step k: the largest sum at two places, made of different terms (all exact
            // in bf16).
            let at = |col: usize| k * width + col;
            let big = 64.0f32;
            ah[at(7)] = big;
            bh[7] = 2.0;
            ah[at(width - 2)] = big + 2.0;
            bh[width - 2] = 0.0;
            ah[at(3)] = f32::NAN;
        }
        let a = Tensor::<2>::from_data(burn::tensor::TensorData::new(ah, [rows * steps, width]), &device)
            .cast(DType::BF16)
            .reshape([rows, steps, width]);
        let b = Tensor::<2>::from_data(burn::tensor::TensorData::new(bh, [rows, width]), &device)
            .cast(DType::BF16);
        for k in [0, steps / 2, steps - 1] {
            poison(rows * 2, &device);
            let got = dspark_kernels::argmax_sum_rows(a.clone(), k, b.clone())
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .unwrap();
            let sum = a.clone().narrow(1, k, 1).reshape([rows, width]).cast(DType::F32)
                + b.clone().cast(DType::F32);
            let want = dspark_kernels::reference::argmax_rows(sum)
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .unwrap();
            assert_eq!(got, want, "argmax of sums, {rows} x {steps} x {width}, step {k}");
            if k == 0 || k == steps - 1 {
                assert_eq!(got[0], 7, "the lowest index of a tie of sums");
            }
        }
        println!("argmax_sum_rows {rows} x {steps} x {width}: equal to the widened sum's argmax");
    }
}

#[test]
fn int_views_read_their_buffer() {
    // `int_view` with the views on: an aligned start shares the buffer (a later in-place write
    // shows through the view, as a recorded forward's replays need), an unaligned one is a copy;
    // both read the right values. With the views off, every view is a copy.
    use burn::tensor::{Int, TensorData};
    let device = cuda();
    let n = 4 * dspark_kernels::INT_VIEW_ALIGN;
    let ints = |values: Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(values, [n]), &device);
    let read = |t: Tensor<1, Int>| t.into_data().convert::<i64>().try_into_vec::<i64>().unwrap();
    for views in [true, false] {
        dspark_kernels::set_int_views(views);
        let buffer = ints((0..n as i64).map(|i| 3 * i + 1).collect());
        let align = dspark_kernels::INT_VIEW_ALIGN;
        let cases = [(0, 5), (align, 7), (2 * align, align + 3), (3, 9), (align + 1, 2)];
        let taken: Vec<Tensor<1, Int>> =
            cases.iter().map(|&(at, len)| dspark_kernels::int_view(buffer.clone(), at, len)).collect();
        for (&(at, len), view) in cases.iter().zip(&taken) {
            let want: Vec<i64> = (at..at + len).map(|i| 3 * i as i64 + 1).collect();
            assert_eq!(read(view.clone()), want, "views {views}: {at}+{len} before the write");
        }
        // New values in the buffer itself (a recorded forward's input refresh).
        let buffer = dspark_kernels::write_into(buffer, ints((0..n as i64).map(|i| -i).collect()));
        let _ = read(buffer.clone());
        for (&(at, len), view) in cases.iter().zip(taken) {
            let shared = views && at % align == 0;
            let want: Vec<i64> =
                (at..at + len).map(|i| if shared { -(i as i64) } else { 3 * i as i64 + 1 }).collect();
            assert_eq!(read(view), want, "views {views}: {at}+{len} after the write (shared: {shared})");
        }
        println!("int_view, views {views}: aligned views share the buffer, the others copy");
    }
    // Back to the library's default.
    dspark_kernels::set_int_views(true);
}

#[test]
fn confidence_logits_match_reference() {
    // A draft's confidence head at DSpark widths (hidden 4096, Markov rank 256) and a small one:
    // 1 and 4 lanes of γ = 7 and 16, with and without the Markov term; the ids include one past
    // the table and a negative one (both read row 0).
    let device = cuda();
    for &(hd, rank, vocab) in &[(4096usize, 256usize, 151_936usize), (64, 32, 100)] {
        for &(lanes, gamma) in &[(1usize, 7usize), (4, 7), (1, 16), (3, 16)] {
            let rows = lanes * gamma;
            let hidden = random(rows, hd, 1.0, &device);
            let table = random(vocab, rank, 0.5, &device);
            let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::F32);
            let weight = Tensor::<1>::random([hd + rank], Distribution::Normal(0.0, 0.05), opts);
            let mut ids: Vec<i32> = (0..rows).map(|i| ((i * 7919 + 13) % vocab) as i32).collect();
            ids[rows / 2] = vocab as i32;
            ids[rows - 1] = -3;
            let anchors: Vec<i32> = (0..lanes).map(|l| ((l * 104_729 + 5) % vocab) as i32).collect();
            let tokens = int_tensor(ids, [rows], &device);
            let anchors = int_tensor(anchors, [lanes], &device);
            let (h, t, w) = (host(hidden.clone()), host(table.clone()), host1(weight.clone()));
            let tk = tokens.clone().into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
            let an = anchors.clone().into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
            for markov in [true, false] {
                let tab = markov.then_some(&table);
                type Logits = fn(
                    Tensor<2>,
                    Option<&Tensor<2>>,
                    Tensor<1, burn::tensor::Int>,
                    Tensor<1, burn::tensor::Int>,
                    &Tensor<1>,
                    f32,
                ) -> Tensor<1>;
                let run = |f: Logits| {
                    poison(rows * 2, &device);
                    host1(f(hidden.clone(), tab, anchors.clone(), tokens.clone(), &weight, 0.25))
                };
                let (got, body) = (
                    run(dspark_kernels::confidence_logits),
                    run(dspark_kernels::reference::confidence_logits),
                );
                // Float64 on the host, and Σ|w·x| for the bound of an f32 sum of hd + rank terms.
                let (mut want, mut scale) = (Vec::new(), Vec::new());
                for r in 0..rows {
                    let mut terms: Vec<f64> =
                        (0..hd).map(|j| f64::from(w[j]) * f64::from(h[r * hd + j])).collect();
                    if markov {
                        let prev = if r % gamma == 0 { an[r / gamma] } else { tk[r - 1] };
                        let prev = if (0..vocab as i64).contains(&prev) { prev as usize } else { 0 };
                        terms.extend((0..rank).map(|j| f64::from(w[hd + j]) * f64::from(t[prev * rank + j])));
                    }
                    want.push(terms.iter().sum::<f64>() + 0.25);
                    scale.push(terms.iter().map(|v| v.abs()).sum::<f64>() + 0.25);
                }
                for r in 0..rows {
                    let bound = 2.0 * (hd + rank) as f64 * f64::from(f32::EPSILON) * scale[r];
                    for (what, v) in [("kernel", got[r]), ("body", body[r])] {
                        assert!(
                            (f64::from(v) - want[r]).abs() <= bound,
                            "{what} hd {hd} rank {rank} lanes {lanes} γ {gamma} markov {markov} row {r}: \
                             {v} vs {} (bound {bound})",
                            want[r]
                        );
                    }
                }
                // The round's readback form: the tokens as f32 (the negative id too), then the
                // same launch's logits, bit for bit.
                poison(rows * 2, &device);
                let both = host1(dspark_kernels::tokens_and_confidence_logits(
                    hidden.clone(),
                    tab,
                    anchors.clone(),
                    tokens.clone(),
                    &weight,
                    0.25,
                ));
                let mut expect: Vec<f32> = tk.iter().map(|&id| id as f32).collect();
                expect.extend(&got);
                assert_eq!(
                    both.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    expect.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "tokens and logits, hd {hd} rank {rank} lanes {lanes} γ {gamma} markov {markov}"
                );
            }
        }
    }
}

#[test]
fn linear_fp8_swiglu_matches_reference() {
    use dspark_kernels::fp8::ScaleGrid;
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    // (in, inter): a Qwen3-8B-shaped draft's MLP with per-row scales, and a smaller one.
    for (i, &(inp, inter)) in [(4096usize, 12288usize), (1024, 4608)].iter().enumerate() {
        let gate = Fp8Case::new(inter, inp, ScaleGrid::PerRow, 300 + i as u64, &device);
        let up = Fp8Case::new(inter, inp, ScaleGrid::PerRow, 400 + i as u64, &device);
        let paired = dspark_kernels::Fp8Matrix::pair_gate_up(&gate.m, &up.m).unwrap();
        let ends_cols: Vec<usize> = (0..inter).collect();
        for &rows in &[1usize, 8, 17, 64, 100] {
            let x = random(rows, inp, 1.0, &device);
            poison(rows * inter, &device);
            let got = host(dspark_kernels::linear_fp8_swiglu(x.clone(), &paired));
            let what = format!("linear_fp8_swiglu {inp}->{inter} rows {rows}");
            // The paired product, then the SwiGLU kernel: the same bits.
            let y = dspark_kernels::linear_fp8(x.clone(), &paired).reshape([rows, inter / 8, 2, 8]);
            let g = y.clone().narrow(2, 0, 1).reshape([rows, inter]);
            let u = y.narrow(2, 1, 1).reshape([rows, inter]);
            assert_eq!(
                got,
                host(dspark_kernels::swiglu_cols(g, u, 0, 0, inter)),
                "{what}: vs product + swiglu"
            );
            // Two separate products, then the SwiGLU kernel: the same bits (the same plan).
            let split = dspark_kernels::swiglu_cols(
                dspark_kernels::linear_fp8(x.clone(), &gate.m),
                dspark_kernels::linear_fp8(x.clone(), &up.m),
                0,
                0,
                inter,
            );
            assert_eq!(got, host(split), "{what}: vs separate products");
            // Float64 from the exact e4m3 values, first and last rows.
            let xh = host(x.clone());
            let body = host(dspark_kernels::reference::swiglu_cols(
                dspark_kernels::reference::linear_fp8(x.clone(), &gate.m),
                dspark_kernels::reference::linear_fp8(x, &up.m),
                0,
                0,
                inter,
            ));
            let ends =
                |v: &[f32], width: usize| -> Vec<f32> { [&v[..width], &v[(rows - 1) * width..]].concat() };
            let xe = ends(&xh, inp);
            let (gs, us) = (gate.reference(&xe, 2, &ends_cols), up.reference(&xe, 2, &ends_cols));
            let want: Vec<f64> = gs.iter().zip(&us).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
            check_close(&what, &ends(&got, inter), &ends(&body, inter), &want);
        }
    }
}

#[test]
fn markov_greedy_matches_unfused() {
    // The fused greedy Markov steps (`set_fused_markov`: the W2 product's argmax epilogue, then
    // the pick) against the unfused loop (product, `argmax_sum_rows`, gather) on the same
    // inputs: the same tokens bit for bit. DSpark widths (rank 256 over the whole Qwen3
    // vocabulary, and over 16 384 draft ids mapped to token ids) and a smaller head; bf16, FP8
    // per-row and FP8 block-scaled W2; 1 to 9 lanes (two activation tiles). Planted: W2 rows
    // `c1 < c2` equal and base logits equal and large at both (lane 0, even steps: the lower
    // index must win), a NaN base logit (never chosen), and a step whose base row is all −∞
    // (no candidate: index 0, whose `W1` row the next step then reads).
    use burn::tensor::TensorData;
    use dspark_kernels::MarkovW2;
    use dspark_kernels::fp8::ScaleGrid;
    let device = cuda();
    let ids = |t: Tensor<2, burn::tensor::Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
    let cases: [(usize, usize, &[usize], usize, bool); 3] =
        [(256, 151_936, &[1, 4, 9], 7, false), (256, 16_384, &[3], 16, true), (128, 8192, &[2, 8], 5, false)];
    for (case, &(rank, width, lane_counts, gamma, mapped)) in cases.iter().enumerate() {
        let seed = 900 + case as u64;
        let (c1, c2) = (37usize, width - 5);
        // The whole table (anchors embed from it) and the table later steps read.
        let full = if mapped { 151_936 } else { width };
        let w1 = random(full, rank, 0.5, &device);
        let table = if mapped { random(width, rank, 0.5, &device) } else { w1.clone() };
        let to_target =
            mapped.then(|| int_tensor((0..width).map(|i| (i * 9 + 1) as i32).collect(), [width], &device));
        let mut w2h = host(random(width, rank, 0.05, &device));
        w2h.copy_within(c1 * rank..(c1 + 1) * rank, c2 * rank);
        let w2 = Tensor::<2>::from_data(TensorData::new(w2h, [width, rank]), &device).cast(DType::BF16);
        let mut bytes = fp8_bytes(width * rank, seed);
        bytes.copy_within(c1 * rank..(c1 + 1) * rank, c2 * rank);
        let mut rng = Lcg(seed);
        let mut scales: Vec<f32> =
            (0..width).map(|_| 1e-4 * 2f32.powf(rng.next(1000) as f32 / 250.0)).collect();
        scales[c2] = scales[c1];
        let per_row =
            dspark_kernels::Fp8Matrix::upload(&bytes, &scales, [width, rank], ScaleGrid::PerRow, &device)
                .unwrap();
        let blocks = Fp8Case::new(width, rank, ScaleGrid::Blocks, seed + 50, &device);
        let token_of = |i: usize| if mapped { (i * 9 + 1) as i64 } else { i as i64 };
        for &lanes in lane_counts {
            let mut bh = host(random(lanes * gamma, width, 3.0, &device));
            for k in (0..gamma).step_by(2) {
                bh[k * width + c1] = 96.0;
                bh[k * width + c2] = 96.0;
            }
            for k in 0..gamma {
                bh[k * width + 3] = f32::NAN;
            }
            let dark = (lanes > 1 && gamma > 1).then_some(lanes - 1);
            if let Some(l) = dark {
                bh[(l * gamma + 1) * width..(l * gamma + 2) * width].fill(f32::NEG_INFINITY);
            }
            let base = Tensor::<2>::from_data(TensorData::new(bh, [lanes * gamma, width]), &device)
                .cast(DType::BF16)
                .reshape([lanes, gamma, width]);
            let anchors: Vec<i32> = (0..lanes).map(|l| ((l * 104_729 + 5) % full) as i32).collect();
            let anchors = int_tensor(anchors, [lanes], &device);
            let w2s = [("bf16", MarkovW2::Dense(&w2)), ("FP8 per row", MarkovW2::Fp8(&per_row))];
            let w2s = w2s.into_iter().chain([("FP8 blocks", MarkovW2::Fp8(&blocks.m))]);
            for (name, w) in w2s {
                let run = |fused: bool, one_launch: bool| {
                    dspark_kernels::set_fused_markov(fused);
                    dspark_kernels::set_markov_loop(one_launch);
                    // The fused call's one buffer (tokens, slots, gathered rows; for the loop
                    // a set of slots a step) in bf16.
                    let slots_at = (lanes * gamma).next_multiple_of(32);
                    let two_launch = (slots_at + 1024 * lanes).next_multiple_of(4) + lanes * rank / 2;
                    poison(2 * two_launch.max(slots_at + 1024 * lanes * gamma + 2), &device);
                    ids(dspark_kernels::markov_greedy(
                        anchors.clone(),
                        &w1,
                        base.clone(),
                        w,
                        &table,
                        to_target.as_ref(),
                    ))
                };
                dspark_kernels::set_fused_markov(true);
                assert!(
                    dspark_kernels::markov_greedy_fuses(&anchors, &w1, &base, w, &table, to_target.as_ref()),
                    "the fused path must take these inputs"
                );
                let (want, got) = (run(false, false), run(true, false));
                // The one-launch loop (at most 8 lanes), then a second call of it: the first
                // leaves its slots and counters behind in a freed buffer.
                let one_launch = lanes <= 8;
                dspark_kernels::set_markov_loop(true);
                assert_eq!(
                    dspark_kernels::markov_greedy_loops(&anchors, &w1, &base, w, &table, to_target.as_ref()),
                    one_launch,
                    "the one-launch loop must take these inputs exactly when there are at most 8 lanes"
                );
                let looped = one_launch.then(|| (run(true, true), run(true, true)));
                // Back to the defaults for the tests after this one.
                dspark_kernels::set_fused_markov(true);
                dspark_kernels::set_markov_loop(true);
                let what =
                    format!("rank {rank} width {width} lanes {lanes} γ {gamma} {name} mapped {mapped}");
                assert_eq!(got, want, "{what}: fused tokens differ from the unfused loop");
                if let Some((first, second)) = &looped {
                    assert_eq!(first, &want, "{what}: one-launch loop's tokens differ from the unfused loop");
                    assert_eq!(second, &want, "{what}: a second one-launch loop's tokens differ");
                    println!("markov_greedy {what}: one-launch loop = unfused (twice)");
                }
                if name != "FP8 blocks" {
                    for k in (0..gamma).step_by(2) {
                        assert_eq!(got[k], token_of(c1), "{what}: step {k} of lane 0 breaks the tie low");
                    }
                }
                if let Some(l) = dark {
                    assert_eq!(got[l * gamma + 1], token_of(0), "{what}: a row with no candidate picks 0");
                }
                println!("markov_greedy {what}: fused = unfused ({} tokens)", got.len());
            }
        }
    }
}

/// `layer_tail` on `x` and `a` without counters (the unfused calls), then chained twice on
/// `sync`: both outputs of the chained launch bit for bit the unfused ones, and the counters left
/// zero. Returns the unfused `(x2, h2)`, all finite; outputs are poisoned before each call.
fn chained_equals_unfused(
    x: &Tensor<2>,
    a: &Tensor<2>,
    norms: (&Tensor<1>, &Tensor<1>),
    weights: dspark_kernels::TailWeights,
    sync: &Tensor<1, burn::tensor::Int>,
    what: &str,
) -> (Vec<f32>, Vec<f32>) {
    let [rows, d] = x.dims();
    let tail = |sync: Option<&Tensor<1, burn::tensor::Int>>| {
        poison(rows * d, &x.device());
        let (x2, h2) = dspark_kernels::layer_tail(x.clone(), a.clone(), norms, weights, 1e-6, sync);
        (host(x2), host(h2))
    };
    let apart = tail(None);
    assert!(apart.0.iter().chain(&apart.1).all(|v| v.is_finite()), "{what}: not finite");
    let chains = dspark_kernels::layer_chains();
    for pass in 0..2 {
        let chained = tail(Some(sync));
        assert!(dspark_kernels::layer_chains() > chains, "{what}: the chain did not run");
        assert_eq!(chained.0, apart.0, "{what}: residual differs (pass {pass})");
        assert_eq!(chained.1, apart.1, "{what}: normed output differs (pass {pass})");
        let left = sync.clone().into_data().convert::<i32>().try_into_vec::<i32>().unwrap();
        assert!(left.iter().all(|&c| c == 0), "{what}: counters left {left:?}");
    }
    apart
}

/// A layer's tail chained into one launch (`layer_tail` with counters) against the same calls
/// without (three calls, five launches): the same bits for both outputs at Qwen3-8B widths, for
/// every row count the chain takes (1 and 2 activation tiles, rows within a tile), and for each
/// norm cube size (the chain's 256 threads emulate the norm's order); the counters left zero
/// (each size runs twice on them); the outputs within bf16 rounding of the plain-burn bodies.
#[test]
fn layer_tail_matches_unfused() {
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    let (d, hq, inter, eps) = (4096usize, 4096usize, 12288usize, 1e-6);
    let w_o = random(d, hq, 0.02, &device);
    let w_gu = dspark_kernels::pair_gate_up(random(inter, d, 0.02, &device), random(inter, d, 0.02, &device));
    let w_d = random(d, inter, 0.01, &device);
    let (n1, n2) = (norm_weight(d, &device), norm_weight(d, &device));
    let words = dspark_kernels::LAYER_TAIL_SYNC_WORDS;
    let sync = int_tensor(vec![0; words], [words], &device);
    let chain_was = dspark_kernels::layer_chain();
    dspark_kernels::set_layer_chain(true);
    for threads in [1024usize, 512, 256] {
        assert!(dspark_kernels::set_norm_threads(threads));
        for &rows in &[1usize, 2, 5, 8, 9, 16] {
            let x = random(rows, d, 1.0, &device);
            let a = random(rows, hq, 1.0, &device);
            let what = format!("layer_tail rows {rows} norm threads {threads}");
            let weights = dspark_kernels::TailWeights::Bf16 { o: &w_o, gate_up: &w_gu, down: &w_d };
            let apart = chained_equals_unfused(&x, &a, (&n1, &n2), weights, &sync, &what);
            if threads == 1024 {
                // The plain-burn bodies (f32 sums in burn's order): within bf16 rounding.
                let (x1, h1) = dspark_kernels::reference::add_rms_norm(
                    x.clone(),
                    dspark_kernels::reference::linear(a.clone(), &w_o),
                    &n1,
                    eps,
                );
                let y = dspark_kernels::reference::linear(h1, &w_gu).reshape([rows, inter / 8, 2, 8]);
                let act = dspark_kernels::reference::swiglu(
                    y.clone().narrow(2, 0, 1).reshape([rows, inter]),
                    y.narrow(2, 1, 1).reshape([rows, inter]),
                );
                let (x2, h2) = dspark_kernels::reference::add_rms_norm(
                    x1,
                    dspark_kernels::reference::linear(act, &w_d),
                    &n2,
                    eps,
                );
                let as64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
                let (ex, eh) = (rel_err(&apart.0, &as64(host(x2))), rel_err(&apart.1, &as64(host(h2))));
                println!("{what}: rel err vs plain burn: residual {ex:.2e}, normed {eh:.2e}");
                assert!(ex <= 2e-2 && eh <= 2e-2, "{what}: rel err {ex:.3e} / {eh:.3e}");
            }
        }
    }
    assert!(dspark_kernels::set_norm_threads(1024));
    dspark_kernels::set_layer_chain(chain_was);
}

/// The chained tail with FP8 weights (a draft's layers): o and down with per-row and with
/// per-block scales (the o product is not cut, so its norm reads bf16 rows; down is), the
/// gate/up pair per row. The same bits as the three FP8 calls, the counters left zero.
#[test]
fn layer_tail_fp8_matches_unfused() {
    use dspark_kernels::fp8::ScaleGrid;
    let _lock = PLAN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let device = cuda();
    let (d, hq, inter) = (4096usize, 4096usize, 12288usize);
    let gate = Fp8Case::new(inter, d, ScaleGrid::PerRow, 901, &device);
    let up = Fp8Case::new(inter, d, ScaleGrid::PerRow, 902, &device);
    let gate_up = dspark_kernels::Fp8Matrix::pair_gate_up(&gate.m, &up.m).unwrap();
    let (n1, n2) = (norm_weight(d, &device), norm_weight(d, &device));
    let words = dspark_kernels::LAYER_TAIL_SYNC_WORDS;
    let sync = int_tensor(vec![0; words], [words], &device);
    let chain_was = dspark_kernels::layer_chain();
    dspark_kernels::set_layer_chain(true);
    for grid in [ScaleGrid::PerRow, ScaleGrid::Blocks] {
        let o = Fp8Case::new(d, hq, grid, 903, &device);
        let down = Fp8Case::new(d, inter, grid, 904, &device);
        let weights = dspark_kernels::TailWeights::Fp8 { o: &o.m, gate_up: &gate_up, down: &down.m };
        for &rows in &[1usize, 7, 8, 9, 16] {
            let x = random(rows, d, 1.0, &device);
            let a = random(rows, hq, 1.0, &device);
            let what = format!("layer_tail fp8 {grid:?} rows {rows}");
            chained_equals_unfused(&x, &a, (&n1, &n2), weights, &sync, &what);
        }
    }
    dspark_kernels::set_layer_chain(chain_was);
}
