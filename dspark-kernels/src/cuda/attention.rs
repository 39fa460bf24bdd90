//! Paged decode attention: every query row of every lane in one launch, keys read through a
//! physical-row table, lengths read from device memory (no kernel depends on a context length,
//! so nothing recompiles as contexts grow).
//!
//! # How one cube works
//! A cube owns one query row and one K/V head; its `groups` warps are the query heads that share
//! that K/V head (native GQA: the K/V rows are fetched once per cube and served from L1 to the
//! other warps). In a warp, lane `(kg, dq)` (`kg = lane / 4`, `dq = lane % 4`) holds a quarter
//! of the head's dimensions and walks keys `kg, kg + 8, …` with an online softmax; the four lanes
//! of a key group add their partial dot products with two butterfly shuffles, and the eight key
//! groups merge their (max, sum, accumulator) states with three more. Softmax and accumulation
//! are f32.
//!
//! # Batch invariance
//! A row's reduction order depends only on its number of visible keys: the same whether the row
//! is decoded alone, verified inside a window, or batched with other lanes.

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::bf16;

/// 16 bytes: eight bf16 as four 32-bit words (element `2i` in the low half of word `i`).
type Words = Vector<u32, Const<4>>;

/// Key groups per warp (lanes `4·kg .. 4·kg + 4` share a key).
const KEY_GROUPS: usize = 8;

/// Low and high bf16 of a 32-bit word, as f32 (bf16 is the top half of an f32).
#[cube]
fn unpack(word: u32) -> (f32, f32) {
    (f32::reinterpret(word << 16u32), f32::reinterpret(word & 0xFFFF_0000u32))
}

/// `out[r, h, :] = softmax(scale · q[r, h] · K[rows]ᵀ) · V[rows]` over the rows
/// `keys[meta[2r] .. meta[2r] + meta[2r + 1]]` of the paged pool.
///
/// `q`/`out`: `[rows, heads, head_dim]`, `k`/`v`: `[pool_rows, kv_heads, head_dim]`, bf16,
/// contiguous; `keys`: physical pool rows (i32); `meta`: `[rows, 2]` (i32).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn paged_attention_kernel(
    q: &[Words],
    k: &[Words],
    v: &[Words],
    keys: &[i32],
    meta: &[i32],
    out: &mut [bf16],
    kv_heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] groups: usize,
) {
    let row = CUBE_POS_X as usize;
    let kvh = CUBE_POS_Y as usize;
    let lane = UNIT_POS_X;
    let head = kvh * groups + UNIT_POS_Y as usize;
    let kv_heads = kv_heads as usize;
    let heads = kv_heads * groups;
    let kg = (lane / 4) as usize;
    let dq = (lane % 4) as usize;
    // Words of one lane's quarter of a head.
    let words = head_dim / 32;

    // 1. This lane's quarter of q, scaled, in f32.
    let mut qs = Array::<f32>::new(head_dim / 4);
    let q_base = (row * heads + head) * (head_dim / 8) + dq * words;
    #[unroll]
    for w in 0..words {
        let word = q[q_base + w];
        #[unroll]
        for e in 0..4usize {
            let (lo, hi) = unpack(word.extract(e));
            qs[w * 8 + 2 * e] = lo * scale;
            qs[w * 8 + 2 * e + 1] = hi * scale;
        }
    }

    // 2. Online softmax over keys kg, kg + 8, …
    let first = meta[2 * row] as usize;
    let count = meta[2 * row + 1] as usize;
    let neg_inf = f32::new(f32::NEG_INFINITY);
    let mut m = neg_inf;
    let mut l = 0.0f32;
    let mut acc = Array::<f32>::new(head_dim / 4);
    #[unroll]
    for i in 0..head_dim / 4 {
        acc[i] = 0.0f32;
    }
    let mut j = kg;
    while j < count {
        let phys = keys[first + j] as usize;
        let base = (phys * kv_heads + kvh) * (head_dim / 8) + dq * words;
        let mut dot = 0.0f32;
        #[unroll]
        for w in 0..words {
            let word = k[base + w];
            #[unroll]
            for e in 0..4usize {
                let (lo, hi) = unpack(word.extract(e));
                dot += qs[w * 8 + 2 * e] * lo;
                dot += qs[w * 8 + 2 * e + 1] * hi;
            }
        }
        dot += plane_shuffle_xor(dot, 1u32);
        dot += plane_shuffle_xor(dot, 2u32);
        let m_new = max(m, dot);
        let corr = (m - m_new).exp();
        let p = (dot - m_new).exp();
        l = l * corr + p;
        #[unroll]
        for w in 0..words {
            let word = v[base + w];
            #[unroll]
            for e in 0..4usize {
                let (lo, hi) = unpack(word.extract(e));
                let a = w * 8 + 2 * e;
                acc[a] = acc[a] * corr + p * lo;
                acc[a + 1] = acc[a + 1] * corr + p * hi;
            }
        }
        m = m_new;
        j += KEY_GROUPS;
    }

    // 3. Merge the key groups (lanes 4 apart, then 8, then 16): the same sums on both sides.
    #[unroll]
    for level in 0..3u32 {
        let mask = 4u32 << level;
        let m_o = plane_shuffle_xor(m, mask);
        let l_o = plane_shuffle_xor(l, mask);
        let m_new = max(m, m_o);
        let mut c_self = 0.0f32;
        let mut c_other = 0.0f32;
        if m_new != neg_inf {
            c_self = (m - m_new).exp();
            c_other = (m_o - m_new).exp();
        }
        l = l * c_self + l_o * c_other;
        #[unroll]
        for i in 0..head_dim / 4 {
            let a_o = plane_shuffle_xor(acc[i], mask);
            acc[i] = acc[i] * c_self + a_o * c_other;
        }
        m = m_new;
    }

    // 4. Key group 0 writes its quarter.
    if kg == 0 {
        let inv = 1.0f32 / l;
        let o_base = (row * heads + head) * head_dim + dq * (head_dim / 4);
        #[unroll]
        for i in 0..head_dim / 4 {
            out[o_base + i] = bf16::cast_from(acc[i] * inv);
        }
    }
}

/// Whether the kernel takes this problem: bf16 q and pool, a head width that splits into four
/// 16-byte-aligned quarters, a whole number of query heads per K/V head.
pub(crate) fn supported(q: &Tensor<3>, pool: &Tensor<3>) -> bool {
    let [_, heads, head_dim] = q.dims();
    q.dtype() == DType::BF16 && head_dim == pool.dims()[2] && runs(heads, pool)
}

/// The pool's half of [`supported`], for `heads` bf16 query heads.
pub(crate) fn runs(heads: usize, pool: &Tensor<3>) -> bool {
    let [_, kv_heads, head_dim] = pool.dims();
    pool.dtype() == DType::BF16
        && head_dim.is_multiple_of(32)
        && head_dim <= 256
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && heads / kv_heads <= 32
        && matches!(pool.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// Attention of `q` over the paged pool through the kernel (see [`crate::paged_attention`]).
pub(crate) fn paged_attention(
    q: Tensor<3>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
    keys: &Tensor<1, Int>,
    meta: &Tensor<2, Int>,
) -> Tensor<3> {
    let y = <Dispatch as PagedAttentionOps>::paged_attention(
        q.into_dispatch(),
        k_pool.clone().into_dispatch(),
        v_pool.clone().into_dispatch(),
        keys.clone().cast(DType::I32).into_dispatch(),
        meta.clone().cast(DType::I32).into_dispatch(),
    );
    Tensor::from_dispatch(y)
}

fn launch(q: CubeTensor, k: CubeTensor, v: CubeTensor, keys: CubeTensor, meta: CubeTensor) -> CubeTensor {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (q, k, v, keys, meta) =
        (contiguous(q), contiguous(k), contiguous(v), contiguous(keys), contiguous(meta));
    let [rows, heads, head_dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2]];
    let [pool_rows, kv_heads] = [k.meta.shape()[0], k.meta.shape()[1]];
    let groups = heads / kv_heads;
    let client = q.client.clone();
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        q.device.clone(),
        [rows, heads, head_dim].into(),
        q.dtype,
    );
    let n_keys = keys.meta.shape()[0];
    let pool_words = pool_rows * kv_heads * head_dim / 8;
    // SAFETY: lengths are the buffers' sizes in the kernel's units; the kernel reads q rows
    // `< rows`, pool rows named in `keys` (the caller's page tables, all `< pool_rows`), `keys`
    // entries `meta[2r] .. meta[2r] + meta[2r + 1]` (within `keys` by construction of the plan),
    // and writes `out` within `[rows, heads, head_dim]`.
    unsafe {
        paged_attention_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, kv_heads as u32, 1),
            CubeDim::new_2d(32, groups as u32),
            BufferArg::from_raw_parts(q.handle.clone(), rows * heads * head_dim / 8),
            BufferArg::from_raw_parts(k.handle.clone(), pool_words),
            BufferArg::from_raw_parts(v.handle.clone(), pool_words),
            BufferArg::from_raw_parts(keys.handle.clone(), n_keys),
            BufferArg::from_raw_parts(meta.handle.clone(), rows * 2),
            BufferArg::from_raw_parts(out.handle.clone(), rows * heads * head_dim),
            kv_heads as u32,
            1.0 / (head_dim as f32).sqrt(),
            head_dim,
            groups,
        );
    }
    out
}

/// `[rows, heads, head_dim]` of `q`.
fn same_shape(q: &burn::tensor::Shape) -> burn::tensor::Shape {
    q.clone()
}

/// The backend extension: one operation, run by CubeCL on CUDA and deferred through fusion.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait PagedAttentionOps: burn::backend::Backend {
    /// See [`crate::paged_attention`].
    #[fusion(dtype = q, shape = same_shape(q))]
    fn paged_attention(
        q: burn::backend::tensor::FloatTensor<Self>,
        k_pool: burn::backend::tensor::FloatTensor<Self>,
        v_pool: burn::backend::tensor::FloatTensor<Self>,
        keys: burn::backend::tensor::IntTensor<Self>,
        meta: burn::backend::tensor::IntTensor<Self>,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl PagedAttentionOps for CubeBackend {
    fn paged_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        keys: CubeTensor,
        meta: CubeTensor,
    ) -> CubeTensor {
        launch(q, k, v, keys, meta)
    }
}
