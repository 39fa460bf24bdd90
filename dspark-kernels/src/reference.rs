//! Plain-burn bodies: the reference every kernel is compared against.

use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

/// RMSNorm over the last axis, as Hugging Face Qwen3 computes it: normalise in f32, cast back to
/// the input dtype, then scale by `weight`.
///
/// # Shapes
/// `x`: `[..., d]`, `weight`: `[d]` → `[..., d]`.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: &Tensor<1>, eps: f64) -> Tensor<D> {
    let dtype = x.dtype();
    let x32 = if dtype == DType::F32 { x } else { x.cast(DType::F32) };
    let variance = x32.clone().square().mean_dim(D - 1);
    let normed = x32 * variance.add_scalar(eps).sqrt().recip();
    let normed = if dtype == DType::F32 { normed } else { normed.cast(dtype) };
    normed * weight.clone().unsqueeze::<D>()
}

/// `x · Wᵀ` for a weight in its checkpoint layout `[out, in]`, as burn's matmul computes it in
/// the tensors' dtype.
///
/// # Shapes
/// `x`: `[rows, in]`, `weight`: `[out, in]` → `[rows, out]`.
pub fn linear(x: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    x.matmul(weight.clone().transpose())
}

/// `x · Wᵀ` accumulated in f32 whatever the dtype, cast back to the dtype of `x`: what the
/// skinny GEMM kernel computes up to the order of its sums.
///
/// # Shapes
/// `x`: `[rows, in]`, `weight`: `[out, in]` → `[rows, out]`.
pub fn linear_f32(x: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    let dtype = x.dtype();
    let to32 = |t: Tensor<2>| if t.dtype() == DType::F32 { t } else { t.cast(DType::F32) };
    let y = to32(x).matmul(to32(weight.clone()).transpose());
    if dtype == DType::F32 { y } else { y.cast(dtype) }
}

/// Rotary position embedding (the "rotate half" form) with precomputed tables.
///
/// # Shapes
/// `x`: `[rows, heads, head_dim]`, `cos`/`sin`: `[rows, head_dim]` (both halves repeated) →
/// `[rows, heads, head_dim]`.
pub fn apply_rope(x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<3> {
    let [rows, heads, head_dim] = x.dims();
    let half = head_dim / 2;
    let x1 = x.clone().narrow(2, 0, half);
    let x2 = x.clone().narrow(2, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
    let cos = cos.clone().reshape([rows, 1, head_dim]).expand([rows, heads, head_dim]);
    let sin = sin.clone().reshape([rows, 1, head_dim]).expand([rows, heads, head_dim]);
    x * cos + rotated * sin
}

/// The SwiGLU gate of the Qwen3 MLP: `silu(gate) * up`.
///
/// # Shapes
/// `gate`, `up`: `[rows, intermediate]` → `[rows, intermediate]`.
pub fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    silu(gate) * up
}

/// RMSNorm of `x + delta`, returning the sum too (the residual stream) — the body of
/// [`crate::add_rms_norm`].
///
/// # Shapes
/// `x`, `delta`: `[rows, d]`, `weight`: `[d]` → (`[rows, d]`, `[rows, d]`).
pub fn add_rms_norm(x: Tensor<2>, delta: Tensor<2>, weight: &Tensor<1>, eps: f64) -> (Tensor<2>, Tensor<2>) {
    let sum = x + delta;
    (sum.clone(), rms_norm(sum, weight, eps))
}

/// The body of [`crate::qkv_norm_rope_store`]: q through [`crate::qk_norm_rope`], then
/// [`kv_norm_rope_store`] on the k/v columns.
#[allow(clippy::too_many_arguments)]
pub fn qkv_norm_rope_store(
    y: Tensor<2>,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    q_norm: &Tensor<1>,
    k_norm: &Tensor<1>,
    (cos, sin): (&Tensor<2>, &Tensor<2>),
    eps: f64,
    rows: &Tensor<1, Int>,
    k_pool: &mut Tensor<3>,
    v_pool: &mut Tensor<3>,
) -> Tensor<3> {
    let q = crate::qk_norm_rope(y.clone(), 0, heads, head_dim, q_norm, cos, sin, eps);
    let kv = y.narrow(1, heads * head_dim, 2 * kv_heads * head_dim);
    kv_norm_rope_store(kv, (kv_heads, head_dim), k_norm, (cos, sin), eps, rows, k_pool, v_pool);
    q
}

/// The body of [`crate::kv_norm_rope_store`]: k through [`crate::qk_norm_rope`], v as it is,
/// both assigned to pool rows `rows`.
#[allow(clippy::too_many_arguments)]
pub fn kv_norm_rope_store(
    y: Tensor<2>,
    (kv_heads, head_dim): (usize, usize),
    k_norm: &Tensor<1>,
    (cos, sin): (&Tensor<2>, &Tensor<2>),
    eps: f64,
    rows: &Tensor<1, Int>,
    k_pool: &mut Tensor<3>,
    v_pool: &mut Tensor<3>,
) {
    let n = y.dims()[0];
    let k = crate::qk_norm_rope(y.clone(), 0, kv_heads, head_dim, k_norm, cos, sin, eps);
    let v = y.narrow(1, kv_heads * head_dim, kv_heads * head_dim).reshape([n, kv_heads, head_dim]);
    let assign = burn::tensor::IndexingUpdateOp::Assign;
    k_pool.inplace(|t| t.select_assign(0, rows.clone(), k, assign));
    v_pool.inplace(|t| t.select_assign(0, rows.clone(), v, assign));
}

/// Per-head RMSNorm and RoPE of `heads` heads read from column `offset` of `x` (q or k out of a
/// fused q/k/v projection) — the body of [`crate::qk_norm_rope`].
///
/// # Shapes
/// `x`: `[rows, width]`, `weight`: `[head_dim]`, `cos`/`sin`: `[rows, head_dim]` →
/// `[rows, heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    x: Tensor<2>,
    offset: usize,
    heads: usize,
    head_dim: usize,
    weight: &Tensor<1>,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
    eps: f64,
) -> Tensor<3> {
    let rows = x.dims()[0];
    let x = x.narrow(1, offset, heads * head_dim).reshape([rows, heads, head_dim]);
    apply_rope(rms_norm(x, weight, eps), cos, sin)
}

/// [`swiglu`] of `width` columns of `g` from `g_off` and of `u` from `u_off` (one fused gate/up
/// output given twice, or two outputs) — the body of [`crate::swiglu_cols`].
///
/// # Shapes
/// `g`: `[rows, ≥ g_off + width]`, `u`: `[rows, ≥ u_off + width]` → `[rows, width]`.
pub fn swiglu_cols(g: Tensor<2>, u: Tensor<2>, g_off: usize, u_off: usize, width: usize) -> Tensor<2> {
    swiglu(g.narrow(1, g_off, width), u.narrow(1, u_off, width))
}

/// Index of each row's largest value: the lowest index on ties, NaN skipped, 0 when no value
/// exceeds −∞ — the rule of greedy decoding. The body of [`crate::argmax_rows`]: the rows are
/// read back and scanned on the host.
///
/// # Shapes
/// `x`: `[rows, width]` → `[rows]` (i64 on `x`'s device).
///
/// # Panics
/// If `x` cannot be read back as f32 (a device error).
pub fn argmax_rows(x: Tensor<2>) -> Tensor<1, Int> {
    let [rows, width] = x.dims();
    let device = x.device();
    let values = x.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 rows");
    let ids: Vec<i64> = values
        .chunks(width.max(1))
        .take(rows)
        .map(|row| {
            let (mut best, mut best_value) = (0usize, f32::NEG_INFINITY);
            for (i, &v) in row.iter().enumerate() {
                if v > best_value {
                    best = i;
                    best_value = v;
                }
            }
            best as i64
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows]), &device)
}

/// Which keys each query row may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionMask {
    /// Query row `i` sits at position `first + i` and sees keys `0..=first + i`.
    Causal {
        /// Position of the first query row.
        first: usize,
    },
    /// Every query row sees every key.
    Full,
}

/// One row's draw from `softmax(x / T)` over the whole row, the rule of
/// [`crate::sample_rows`]: f64 weights `exp((x_i − max) / T)`, the first index whose running
/// sum exceeds `u · Σ weights` (with a positive weight), the last positive weight when rounding
/// leaves `u · Σ` unreached. `T = 0`, a total that is not positive or not a number, or no value
/// above −∞ give the argmax (lowest index on ties, NaN skipped, 0 when nothing exceeds −∞).
pub fn draw_row(x: &[f32], temperature: f32, u: f64) -> u32 {
    let (mut best, mut best_value) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    if temperature <= 0.0 || best_value == f32::NEG_INFINITY {
        return best as u32;
    }
    let (max, t) = (f64::from(best_value), f64::from(temperature));
    let weights: Vec<f64> = x.iter().map(|&v| ((f64::from(v) - max) / t).exp()).collect();
    let total: f64 = weights.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return best as u32;
    }
    let target = u * total;
    let (mut running, mut last_positive) = (0.0f64, best);
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last_positive = i;
        }
        running += w;
        if running > target && w > 0.0 {
            return i as u32;
        }
    }
    last_positive as u32
}

/// The three index values that tell [`crate::sample_rows`] how to draw one row: the bits of
/// the temperature (0 for the argmax), and the coin `u ∈ [0, 1)` on a grid of 2⁻⁵³ as its high
/// 26 and low 27 bits. Each fits in an i32, so the values travel in either index dtype.
pub fn draw_words(temperature: f32, u: f64) -> [i64; 3] {
    let bits = if temperature > 0.0 { temperature.to_bits() } else { 0 };
    let c = (u.clamp(0.0, 1.0) * (1u64 << 53) as f64) as u64;
    let c = c.min((1u64 << 53) - 1);
    [i64::from(bits), (c >> 27) as i64, (c & ((1 << 27) - 1)) as i64]
}

/// Inverse of [`draw_words`]: the temperature and the coin.
pub fn draw_params(words: [i64; 3]) -> (f32, f64) {
    let t = f32::from_bits(words[0] as u32);
    let c = ((words[1] as u64) << 27) | (words[2] as u64 & ((1 << 27) - 1));
    (t, c as f64 * (1.0 / (1u64 << 53) as f64))
}

/// The body of [`crate::sample_rows`]: the rows and their draw words are read back and each row
/// is drawn on the host by [`draw_row`].
///
/// # Shapes
/// `x`: `[rows, width]` (any float dtype, widened to f32), `draws`: `[3·rows]` → `[rows]` (i64
/// on `x`'s device).
///
/// # Panics
/// If `x` or `draws` cannot be read back (a device error).
pub fn sample_rows(x: Tensor<2>, draws: Tensor<1, Int>) -> Tensor<1, Int> {
    let [rows, width] = x.dims();
    let device = x.device();
    let values = x.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 rows");
    let words = draws.into_data().convert::<i64>().try_to_vec::<i64>().expect("draw words");
    let ids: Vec<i64> = (0..rows)
        .map(|r| {
            let (t, u) = draw_params([words[3 * r], words[3 * r + 1], words[3 * r + 2]]);
            i64::from(draw_row(&values[r * width..(r + 1) * width], t, u))
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows]), &device)
}

/// The confidence head's logits of draft blocks, the rule of [`crate::confidence_logits`]: for
/// row `r = lane·γ + k`, `bias + Σ_j w[j]·hidden[r, j] + Σ_j w[hd + j]·table[prev_r, j]` with
/// `prev_r` the lane's anchor for `k = 0` and `tokens[r − 1]` after it (an id outside the table
/// reads row 0); without `table`, the first sum only. Read back and summed in f64 in index order
/// (the hidden terms, then the table's), the bias added last, rounded to f32.
///
/// # Shapes
/// `hidden`: `[rows, hd]`, `table`: `[V, rank]`, `anchors`: `[lanes]`, `tokens`: `[rows]`,
/// `weight`: `[≥ hd + rank]` → `[rows]` (f32 on `hidden`'s device).
///
/// # Panics
/// If `rows` is not a multiple of `lanes`, the weights are too few, or a tensor cannot be read
/// back (a device error).
pub fn confidence_logits(
    hidden: Tensor<2>,
    table: Option<&Tensor<2>>,
    anchors: Tensor<1, Int>,
    tokens: Tensor<1, Int>,
    weight: &Tensor<1>,
    bias: f32,
) -> Tensor<1> {
    let [rows, hd] = hidden.dims();
    let lanes = anchors.dims()[0];
    assert!(lanes > 0 && rows.is_multiple_of(lanes), "confidence_logits: {rows} rows for {lanes} lanes");
    let gamma = rows / lanes;
    let device = hidden.device();
    let ints = |t: Tensor<1, Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().expect("ids");
    let floats = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 rows");
    let (anchors, tokens) = (ints(anchors), ints(tokens));
    let w = weight.clone().into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 weights");
    let embedded = table.map(|t| {
        let [table_rows, rank] = t.dims();
        let prev: Vec<i64> = (0..rows)
            .map(|r| if r % gamma == 0 { anchors[r / gamma] } else { tokens[r - 1] })
            .map(|id| if (0..table_rows as i64).contains(&id) { id } else { 0 })
            .collect();
        let prev = Tensor::<1, Int>::from_data(TensorData::new(prev, [rows]), &device);
        (floats(t.clone().select(0, prev)), rank)
    });
    let rank = embedded.as_ref().map_or(0, |(_, rank)| *rank);
    assert!(w.len() >= hd + rank, "confidence_logits: {} weights for {hd} + {rank} inputs", w.len());
    let h = floats(hidden);
    let logits: Vec<f32> = (0..rows)
        .map(|r| {
            let mut acc = 0.0f64;
            for (a, b) in w[..hd].iter().zip(&h[r * hd..(r + 1) * hd]) {
                acc += f64::from(*a) * f64::from(*b);
            }
            if let Some((e, rank)) = &embedded {
                for (a, b) in w[hd..hd + rank].iter().zip(&e[r * rank..(r + 1) * rank]) {
                    acc += f64::from(*a) * f64::from(*b);
                }
            }
            (acc + f64::from(bias)) as f32
        })
        .collect();
    let options = burn::tensor::TensorCreationOptions::new(device).with_dtype(DType::F32);
    Tensor::from_data(TensorData::new(logits, [rows]), options)
}

/// Scaled dot-product attention with grouped-query heads (query head `h` reads key/value head
/// `h / (heads / kv_heads)`), softmax in f32.
///
/// # Shapes
/// `q`: `[rows, heads, head_dim]`, `k`/`v`: `[keys, kv_heads, head_dim]` →
/// `[rows, heads, head_dim]`.
pub fn attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, mask: AttentionMask) -> Tensor<3> {
    let [rows, heads, head_dim] = q.dims();
    let [keys, kv_heads, _] = k.dims();
    let groups = heads / kv_heads;
    let dtype = q.dtype();
    let device = q.device();
    let to32 = |t: Tensor<3>| if t.dtype() == DType::F32 { t } else { t.cast(DType::F32) };
    // 1. [rows, heads, hd] -> [kv_heads, groups * rows, hd]; k, v -> [kv_heads, keys, hd].
    let q = to32(q).swap_dims(0, 1).reshape([kv_heads, groups * rows, head_dim]);
    let k = to32(k).swap_dims(0, 1);
    let v = to32(v).swap_dims(0, 1);
    // 2. scores [kv_heads, groups * rows, keys].
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut scores = q.matmul(k.swap_dims(1, 2)).mul_scalar(scale);
    // 3. mask, softmax, weighted sum.
    if let AttentionMask::Causal { first } = mask {
        let hidden: Vec<bool> = (0..rows).flat_map(|i| (0..keys).map(move |j| j > first + i)).collect();
        let hidden = Tensor::<2, Bool>::from_data(TensorData::new(hidden, [rows, keys]), &device)
            .reshape([1, 1, rows, keys])
            .expand([kv_heads, groups, rows, keys])
            .reshape([kv_heads, groups * rows, keys]);
        scores = scores.mask_fill(hidden, f32::NEG_INFINITY);
    }
    let out = softmax(scores, 2).matmul(v);
    // 4. [kv_heads, groups * rows, hd] -> [rows, heads, hd].
    let out = out.reshape([heads, rows, head_dim]).swap_dims(0, 1);
    if dtype == DType::F32 { out } else { out.cast(dtype) }
}

/// The plain-burn body of [`crate::paged_attention`]: each query row gathers its keys from the
/// pool and runs [`attention`] over them. Reads `keys` and `meta` back to the host.
///
/// # Shapes
/// `q`: `[rows, heads, head_dim]`, `k_pool`/`v_pool`: `[pool_rows, kv_heads, head_dim]`,
/// `keys`: `[n]`, `meta`: `[rows, 2]` → `[rows, heads, head_dim]`.
///
/// # Panics
/// If `meta` names keys outside `keys`.
pub fn paged_attention(
    q: Tensor<3>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
    keys: &Tensor<1, Int>,
    meta: &Tensor<2, Int>,
) -> Tensor<3> {
    let rows = q.dims()[0];
    let host = |t: TensorData| t.convert::<i64>().try_into_vec::<i64>().unwrap_or_default();
    let keys_h = host(keys.to_data());
    let meta_h = host(meta.to_data());
    let device = q.device();
    let outs: Vec<Tensor<3>> = (0..rows)
        .map(|r| {
            let (first, count) = (meta_h[2 * r] as usize, meta_h[2 * r + 1] as usize);
            let idx: Vec<i64> = keys_h[first..first + count].to_vec();
            let idx = Tensor::<1, Int>::from_data(TensorData::new(idx, [count]), &device);
            let k = k_pool.clone().select(0, idx.clone());
            let v = v_pool.clone().select(0, idx);
            attention(q.clone().narrow(0, r, 1), k, v, AttentionMask::Full)
        })
        .collect();
    Tensor::cat(outs, 0)
}

#[cfg(all(test, feature = "cpu"))]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

    #[test]
    fn confidence_logits_read_the_anchor_then_the_draft_before() {
        // Two lanes of γ = 3 over a 4-wide hidden row and a rank-2 table of 5 rows; row r's
        // embedding is table[anchor] for k = 0 and table[tokens[r − 1]] after, an id outside
        // the table reading row 0.
        let device = Device::flex();
        let (lanes, gamma, hd, rank) = (2usize, 3usize, 4usize, 2usize);
        let rows = lanes * gamma;
        let h: Vec<f32> = (0..rows * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let t: Vec<f32> = (0..5 * rank).map(|i| i as f32 - 4.5).collect();
        let w: Vec<f32> = vec![0.5, -1.0, 2.0, 0.25, 3.0, -0.5];
        let (anchors, tokens) = (vec![4i64, 1], vec![2i64, 9, 3, 0, -1, 2]);
        let hidden = Tensor::<2>::from_data(TensorData::new(h.clone(), [rows, hd]), &device);
        let table = Tensor::<2>::from_data(TensorData::new(t.clone(), [5, rank]), &device);
        let weight = Tensor::<1>::from_data(TensorData::new(w.clone(), [hd + rank]), &device);
        let ids = |v: &Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(v.clone(), [v.len()]), &device);
        let prev = [4usize, 2, 0, 1, 0, 0];
        type Logits =
            fn(Tensor<2>, Option<&Tensor<2>>, Tensor<1, Int>, Tensor<1, Int>, &Tensor<1>, f32) -> Tensor<1>;
        for markov in [true, false] {
            let run = |f: Logits| {
                f(hidden.clone(), markov.then_some(&table), ids(&anchors), ids(&tokens), &weight, -0.125)
            };
            let got = run(confidence_logits);
            assert_eq!(got.dtype(), DType::F32);
            let got = got.into_data().try_to_vec::<f32>().expect("f32");
            for r in 0..rows {
                let mut want: f64 = (0..hd).map(|j| f64::from(w[j]) * f64::from(h[r * hd + j])).sum();
                if markov {
                    want += (0..rank)
                        .map(|j| f64::from(w[hd + j]) * f64::from(t[prev[r] * rank + j]))
                        .sum::<f64>();
                }
                want -= 0.125;
                assert!(
                    (f64::from(got[r]) - want).abs() < 1e-5,
                    "markov {markov} row {r}: {} vs {want}",
                    got[r]
                );
            }
            // The readback form: the tokens as f32 (the negative one too), then these logits.
            let packed = run(crate::tokens_and_confidence_logits);
            assert_eq!(packed.dtype(), DType::F32);
            let packed = packed.into_data().try_to_vec::<f32>().expect("f32");
            let mut expect: Vec<f32> = tokens.iter().map(|&id| id as f32).collect();
            expect.extend(&got);
            assert_eq!(packed, expect, "markov {markov}: tokens then logits");
        }
    }

    #[test]
    fn qkv_store_puts_k_and_v_at_the_named_pool_rows_and_keeps_the_rest() {
        let device = Device::flex();
        let (heads, kv_heads, hd, rows, pool_rows) = (2usize, 1usize, 4usize, 3usize, 6usize);
        let width = (heads + 2 * kv_heads) * hd;
        let y = Tensor::<2>::random([rows, width], Distribution::Normal(0.0, 1.0), &device);
        let (cos, sin) = (
            Tensor::<2>::random([rows, hd], Distribution::Normal(0.0, 1.0), &device),
            Tensor::<2>::random([rows, hd], Distribution::Normal(0.0, 1.0), &device),
        );
        let (wq, wk) = (
            Tensor::<1>::random([hd], Distribution::Normal(1.0, 0.1), &device),
            Tensor::<1>::random([hd], Distribution::Normal(1.0, 0.1), &device),
        );
        let at = [4i64, 0, 2];
        let idx = Tensor::<1, Int>::from_data(TensorData::new(at.to_vec(), [rows]), &device);
        let pool = |v: f32| Tensor::<3>::full([pool_rows, kv_heads, hd], v, &device);
        let (mut kp, mut vp) = (pool(7.0), pool(-7.0));
        let q = qkv_norm_rope_store(
            y.clone(),
            (heads, kv_heads, hd),
            &wq,
            &wk,
            (&cos, &sin),
            1e-6,
            &idx,
            &mut kp,
            &mut vp,
        );
        let vec = |t: Tensor<3>| t.into_data().try_to_vec::<f32>().expect("f32");
        assert_eq!(vec(q), vec(qk_norm_rope(y.clone(), 0, heads, hd, &wq, &cos, &sin, 1e-6)));
        let k = vec(qk_norm_rope(y.clone(), heads * hd, kv_heads, hd, &wk, &cos, &sin, 1e-6));
        let yv = y.into_data().try_to_vec::<f32>().expect("f32");
        let (kv, vv) = (vec(kp), vec(vp));
        let len = kv_heads * hd;
        for p in 0..pool_rows {
            let (k_row, v_row) = (&kv[p * len..(p + 1) * len], &vv[p * len..(p + 1) * len]);
            match at.iter().position(|&a| a as usize == p) {
                Some(r) => {
                    assert_eq!(k_row, &k[r * len..(r + 1) * len], "k at pool row {p}");
                    let v_at = r * width + (heads + kv_heads) * hd;
                    assert_eq!(v_row, &yv[v_at..v_at + len], "v at pool row {p}");
                }
                None => {
                    assert!(k_row.iter().all(|&v| v == 7.0), "k pool row {p} kept");
                    assert!(v_row.iter().all(|&v| v == -7.0), "v pool row {p} kept");
                }
            }
        }
    }

    #[test]
    fn kv_store_matches_the_kv_part_of_the_qkv_store() {
        let device = Device::flex();
        let (heads, kv_heads, hd, rows, pool_rows) = (2usize, 2usize, 4usize, 3usize, 5usize);
        let y =
            Tensor::<2>::random([rows, (heads + 2 * kv_heads) * hd], Distribution::Normal(0.0, 1.0), &device);
        let table = || Tensor::<2>::random([rows, hd], Distribution::Normal(0.0, 1.0), &device);
        let (cos, sin, w) =
            (table(), table(), Tensor::<1>::random([hd], Distribution::Normal(1.0, 0.1), &device));
        let idx = Tensor::<1, Int>::from_data(TensorData::new(vec![3i64, 1, 4], [rows]), &device);
        let pool = || Tensor::<3>::zeros([pool_rows, kv_heads, hd], &device);
        let (mut k1, mut v1, mut k2, mut v2) = (pool(), pool(), pool(), pool());
        let _ = qkv_norm_rope_store(
            y.clone(),
            (heads, kv_heads, hd),
            &w,
            &w,
            (&cos, &sin),
            1e-6,
            &idx,
            &mut k1,
            &mut v1,
        );
        let kv = y.narrow(1, heads * hd, 2 * kv_heads * hd);
        crate::kv_norm_rope_store(kv, (kv_heads, hd), &w, (&cos, &sin), 1e-6, &idx, &mut k2, &mut v2);
        let vec = |t: Tensor<3>| t.into_data().try_to_vec::<f32>().expect("f32");
        assert_eq!(vec(k1), vec(k2));
        assert_eq!(vec(v1), vec(v2));
    }

    #[test]
    fn paired_gate_up_product_is_the_swiglu_of_the_two_products() {
        let device = Device::flex();
        let (rows, inp, inter) = (3usize, 32usize, 24usize);
        let normal = |dims: [usize; 2]| Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let (x, gate, up) = (normal([rows, inp]), normal([inter, inp]), normal([inter, inp]));
        let paired = crate::pair_gate_up(gate.clone(), up.clone());
        // Block b of the pairing: gate rows 8b.., then up rows 8b...
        let p = paired.clone().into_data().try_to_vec::<f32>().expect("f32");
        let (g, u) = (
            gate.clone().into_data().try_to_vec::<f32>().expect("f32"),
            up.clone().into_data().try_to_vec::<f32>().expect("f32"),
        );
        assert_eq!(&p[..8 * inp], &g[..8 * inp]);
        assert_eq!(&p[8 * inp..16 * inp], &u[..8 * inp]);
        assert_eq!(&p[16 * inp..24 * inp], &g[8 * inp..16 * inp]);
        let got = crate::linear_swiglu(x.clone(), &paired).into_data().try_to_vec::<f32>().expect("f32");
        let want = swiglu_cols(linear(x.clone(), &gate), linear(x, &up), 0, 0, inter)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32");
        assert_eq!(got.len(), rows * inter);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn draw_words_round_trip_and_fit_in_i32() {
        for (t, u) in
            [(0.7f32, 0.0f64), (1.0, 0.5), (2.5, 1.0 - 1.0 / (1u64 << 53) as f64), (1e-3, 0.123_456_789)]
        {
            let words = draw_words(t, u);
            assert!(words.iter().all(|&w| (0..=i64::from(i32::MAX)).contains(&w)), "{words:?}");
            let (t2, u2) = draw_params(words);
            assert_eq!(t2, t);
            // On the 2⁻⁵³ grid the coin is exact.
            assert_eq!(u2, (u * (1u64 << 53) as f64).floor() / (1u64 << 53) as f64);
        }
        // A greedy lane's words: temperature 0.
        assert_eq!(draw_params(draw_words(0.0, 0.9)).0, 0.0);
        assert_eq!(draw_params(draw_words(-1.0, 0.9)).0, 0.0);
    }

    #[test]
    fn draw_row_is_an_inverse_cdf_draw() {
        // ln-weights 0, ln 3, ln 4 at T = 1: probabilities 1/8, 3/8, 4/8.
        let x = [0.0f32, 3.0f32.ln(), 4.0f32.ln()];
        assert_eq!(draw_row(&x, 1.0, 0.0), 0);
        assert_eq!(draw_row(&x, 1.0, 0.124), 0);
        assert_eq!(draw_row(&x, 1.0, 0.126), 1);
        assert_eq!(draw_row(&x, 1.0, 0.499), 1);
        assert_eq!(draw_row(&x, 1.0, 0.501), 2);
        assert_eq!(draw_row(&x, 1.0, 0.999_999), 2);
        // T = 0 and a NaN total give the argmax; −∞ values are never drawn; a row of −∞ gives 0.
        assert_eq!(draw_row(&x, 0.0, 0.01), 2);
        assert_eq!(draw_row(&[1.0, f32::NAN, 0.5], 1.0, 0.9), 0);
        assert_eq!(draw_row(&[f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY], 1.0, 0.99), 1);
        assert_eq!(draw_row(&[f32::NEG_INFINITY; 3], 1.0, 0.5), 0);
        // A low temperature sharpens toward the maximum.
        assert_eq!(draw_row(&x, 0.05, 0.9), 2);
        // The body draws each row with its own words.
        let device = Default::default();
        let rows = Tensor::<2>::from_data(TensorData::new(vec![0.0f32, 10.0, 10.0, 0.0], [2, 2]), &device);
        let words: Vec<i64> = [draw_words(1.0, 0.5), draw_words(0.0, 0.5)].concat();
        let draws = Tensor::<1, Int>::from_data(TensorData::new(words, [6]), &device);
        let ids = sample_rows(rows, draws).into_data().convert::<i64>().try_to_vec::<i64>().expect("i64 ids");
        assert_eq!(ids, vec![1, 0]);
    }

    #[test]
    fn argmax_rows_takes_the_lowest_index_of_the_max_and_skips_nan() {
        let device = Device::flex();
        let inf = f32::INFINITY;
        let rows: Vec<f32> = vec![
            1.0,
            3.0,
            3.0,
            2.0, // tie: lowest index
            f32::NAN,
            -1.0,
            f32::NAN,
            -2.0, // NaN skipped
            -inf,
            -inf,
            -inf,
            -inf, // nothing above −∞: 0
            0.0,
            0.0,
            inf,
            5.0, // +∞ wins
        ];
        let x = Tensor::<2>::from_data(TensorData::new(rows, [4, 4]), &device);
        let ids = argmax_rows(x).into_data().convert::<i64>().try_to_vec::<i64>().expect("i64 ids");
        assert_eq!(ids, vec![1, 1, 0, 2]);
    }

    /// The paged body over scattered pool rows equals causal attention over each lane's
    /// gathered keys, and a block row seeing every key equals unmasked attention.
    #[test]
    fn paged_attention_equals_attention_over_gathered_keys() {
        let device = Device::flex();
        let (pool_rows, kv_heads, heads, head_dim) = (40, 2, 4, 8);
        let pool =
            |_| Tensor::<3>::random([pool_rows, kv_heads, head_dim], Distribution::Normal(0.0, 1.0), &device);
        let (k_pool, v_pool) = (pool(0), pool(1));
        // Lane 0: context of 5, a 3-row causal window at positions 2..5. Lane 1: 7 keys, 2 block
        // rows seeing all of them. Physical rows scattered over the pool.
        let lane0: Vec<i64> = vec![31, 4, 17, 9, 22];
        let lane1: Vec<i64> = vec![0, 39, 12, 5, 26, 33, 8];
        let keys: Vec<i64> = lane0.iter().chain(&lane1).copied().collect();
        let meta: Vec<i64> = vec![0, 3, 0, 4, 0, 5, 5, 7, 5, 7];
        let q = Tensor::<3>::random([5, heads, head_dim], Distribution::Normal(0.0, 1.0), &device);
        let keys_t = Tensor::<1, Int>::from_data(TensorData::new(keys.clone(), [keys.len()]), &device);
        let meta_t = Tensor::<2, Int>::from_data(TensorData::new(meta, [5, 2]), &device);
        let got = paged_attention(q.clone(), &k_pool, &v_pool, &keys_t, &meta_t);

        let gather = |rows: &[i64], pool: &Tensor<3>| {
            let idx = Tensor::<1, Int>::from_data(TensorData::new(rows.to_vec(), [rows.len()]), &device);
            pool.clone().select(0, idx)
        };
        let want0 = attention(
            q.clone().narrow(0, 0, 3),
            gather(&lane0, &k_pool),
            gather(&lane0, &v_pool),
            AttentionMask::Causal { first: 2 },
        );
        let want1 = attention(
            q.narrow(0, 3, 2),
            gather(&lane1, &k_pool),
            gather(&lane1, &v_pool),
            AttentionMask::Full,
        );
        let want = Tensor::cat(vec![want0, want1], 0);
        let diff = (got - want).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-5, "max |paged - gathered| = {diff}");
    }
}

/// The weights of an FP8 matrix as f32 values, row-major `[out, in]`: `decode(byte) · scale`,
/// one f32 product per element (exact decoding through a 256-entry table).
pub fn dequantize_fp8(m: &crate::fp8::Fp8Matrix) -> Tensor<2> {
    use crate::fp8::{BLOCK, ScaleGrid, e4m3_to_f32};
    let [out, inp] = m.dims();
    let device = m.words.device();
    // Bytes j = 0..3 of each word hold columns (k, k+2, k+1, k+3) of a group of four.
    let byte = |j: i32| m.words.clone().bitwise_right_shift_scalar(8 * j).bitwise_and_scalar(0xFF);
    let bytes: Tensor<3, Int> = Tensor::stack(vec![byte(0), byte(2), byte(1), byte(3)], 2);
    let index = bytes.reshape([out * inp]);
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let table = Tensor::<1>::from_data(
        TensorData::new(table, [256]),
        burn::tensor::TensorCreationOptions::new(device).with_dtype(DType::F32),
    );
    let values = table.select(0, index).reshape([out, inp]);
    match m.grid() {
        ScaleGrid::PerRow => values * m.scales.clone().reshape([out, 1]),
        ScaleGrid::Blocks => {
            let (ob, ib) = (out.div_ceil(BLOCK), inp.div_ceil(BLOCK));
            let grid = m
                .scales
                .clone()
                .reshape([ob, 1, ib, 1])
                .expand([ob, BLOCK, ib, BLOCK])
                .reshape([ob * BLOCK, ib * BLOCK])
                .slice([0..out, 0..inp]);
            values * grid
        }
    }
}

/// `x · Wᵀ` for an FP8 weight: the dequantised weights ([`dequantize_fp8`]) and `x` in f32, the
/// product cast back to the dtype of `x`.
///
/// # Shapes
/// `x`: `[rows, in]` → `[rows, out]`.
pub fn linear_fp8(x: Tensor<2>, weight: &crate::fp8::Fp8Matrix) -> Tensor<2> {
    let dtype = x.dtype();
    let x32 = if dtype == DType::F32 { x } else { x.cast(DType::F32) };
    let y = x32.matmul(dequantize_fp8(weight).transpose());
    if dtype == DType::F32 { y } else { y.cast(dtype) }
}
