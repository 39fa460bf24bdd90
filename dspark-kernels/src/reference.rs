//! Plain-burn bodies: the reference every kernel is compared against.

use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, DType, Tensor, TensorData};

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
