//! Paged decode attention: every query row of every lane in one launch, keys read through a
//! physical-row table, lengths read from device memory (no kernel depends on a context length,
//! so nothing recompiles as contexts grow, and a recorded graph serves every length).
//!
//! # Flash decoding
//! A row's keys are cut into at most [`MAX_SPLITS`] splits of a length fixed by the row's key
//! count ([`split_chunk`]); one launch computes every split's partial softmax state, a second
//! merges them in split order. One decode row over eight K/V heads thus fills the GPU instead
//! of eight SMs.
//!
//! # How one split works
//! A cube owns one query row, one K/V head and one split; its `groups` warps are the query
//! heads that share that K/V head (native GQA: the K/V rows are fetched once per cube and served
//! from L1 to the other warps). In a warp, lane `(kg, dq)` (`kg = lane / 4`, `dq = lane % 4`)
//! holds a quarter of the head's dimensions and walks the split's keys `kg, kg + 8, …` with an
//! online softmax; the four lanes of a key group add their partial dot products with two
//! butterfly shuffles, and the eight key groups merge their (max, sum, accumulator) states with
//! three more. Softmax and accumulation are f32.
//!
//! # Batch invariance
//! A row's splits and its reduction order depend only on its number of visible keys: the same
//! whether the row is decoded alone, verified inside a window, or batched with other lanes.

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

/// Key splits a row's keys are divided into, at most (flash decoding): with one row and eight
/// K/V heads, 32 splits give 256 cubes for the 132 SMs of an H200.
const MAX_SPLITS: usize = 32;
/// Fewest keys of a split (a multiple of [`KEY_GROUPS`]).
const MIN_CHUNK: usize = 32;
/// Keys each key group has in flight at once (a split of [`MIN_CHUNK`] keys is one batch).
const KEYS_IN_FLIGHT: usize = 4;
/// Query rows per launch: a long prefill or context extension runs in launches of this many
/// rows that share one scratch buffer, so its scratch is that of a verify window (at most
/// `64 · heads · MAX_SPLITS · head_dim` f32: 33.5 MB at Qwen3-8B shapes) instead of growing
/// with the rows (449 MB for 856 rows), which would also set the page size of the device
/// memory pools. A row's result does not depend on the launch it runs in.
const ROWS_PER_LAUNCH: usize = 64;

/// Splits any row of a call can have when every row reads at most `n_keys` keys: the slots
/// per (row, head) in the scratch. A function of the table's length only (the scratch layout;
/// never the arithmetic, which [`split_chunk`] alone fixes).
fn split_stride(n_keys: usize) -> usize {
    n_keys.div_ceil(MIN_CHUNK).clamp(1, MAX_SPLITS)
}

/// Keys per split of a row with `count` visible keys: a function of `count` alone, so a row's
/// reduction order never depends on the rows beside it.
#[cube]
fn split_chunk(count: usize) -> usize {
    let per = (count + MAX_SPLITS - 1) / MAX_SPLITS;
    let mut chunk = (per + MIN_CHUNK - 1) / MIN_CHUNK * MIN_CHUNK;
    if chunk == 0 {
        chunk = MIN_CHUNK;
    }
    chunk
}

/// One split of `softmax(scale · q[r, h] · K[rows]ᵀ) · V[rows]` over the rows
/// `keys[meta[2r] .. meta[2r] + meta[2r + 1]]` of the paged pool: split `s` takes keys
/// `s·chunk .. (s + 1)·chunk` and writes its unnormalised accumulator to `part` and its running
/// max and sum to `ml`, for [`combine_kernel`].
///
/// Cube `x` serves query row `row0 + x`. `q`: `[rows, heads, head_dim]`, `k`/`v`:
/// `[pool_rows, kv_heads, head_dim]`, bf16, contiguous; `keys`: physical pool rows (i32);
/// `meta`: `[rows, 2]` (i32); `part`: `[launch rows, heads, stride, head_dim]` f32; `ml`:
/// `[launch rows, heads, stride, 2]` f32.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn paged_attention_split_kernel(
    q: &[Words],
    k: &[Words],
    v: &[Words],
    keys: &[i32],
    meta: &[i32],
    part: &mut [f32],
    ml: &mut [f32],
    row0: u32,
    stride: u32,
    kv_heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] groups: usize,
) {
    let local = CUBE_POS_X as usize;
    let row = row0 as usize + local;
    let kvh = CUBE_POS_Y as usize;
    let split = CUBE_POS_Z as usize;
    let stride = stride as usize;
    let lane = UNIT_POS_X;
    let head = kvh * groups + UNIT_POS_Y as usize;
    let kv_heads = kv_heads as usize;
    let heads = kv_heads * groups;
    let kg = (lane / 4) as usize;
    let dq = (lane % 4) as usize;
    // Words of one lane's quarter of a head.
    let words = head_dim / 32;

    let first = meta[2 * row] as usize;
    let count = meta[2 * row + 1] as usize;
    let chunk = split_chunk(count);
    let start = split * chunk;
    // A whole cube leaves at once (the condition is the cube's), so the shuffles below always
    // see every lane.
    if start < count {
        let mut end = start + chunk;
        if end > count {
            end = count;
        }
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

        // 2. Online softmax over this split's keys start + kg, start + kg + 8, … in batches of
        // KEYS_IN_FLIGHT keys per key group: the batch's page-table entries, then its K and V
        // words are all requested before the first is used, so one batch costs about one
        // memory round trip instead of one per key. The batch loop's trip count is the cube's
        // (start and end are), so every lane reaches the shuffles; keys past `end` are read
        // from pool row 0 and left out of the softmax. Each key group still takes its keys in
        // increasing order with the same arithmetic.
        let neg_inf = f32::new(f32::NEG_INFINITY);
        let mut m = neg_inf;
        let mut l = 0.0f32;
        let mut acc = Array::<f32>::new(head_dim / 4);
        #[unroll]
        for i in 0..head_dim / 4 {
            acc[i] = 0.0f32;
        }
        let mut kw = Array::<u32>::new(KEYS_IN_FLIGHT * head_dim / 8);
        let mut vw = Array::<u32>::new(KEYS_IN_FLIGHT * head_dim / 8);
        let mut dots = Array::<f32>::new(KEYS_IN_FLIGHT);
        let mut b = start;
        while b < end {
            #[unroll]
            for t in 0..KEYS_IN_FLIGHT {
                let j = b + t * KEY_GROUPS + kg;
                let mut phys = 0usize;
                if j < end {
                    phys = keys[first + j] as usize;
                }
                let base = (phys * kv_heads + kvh) * (head_dim / 8) + dq * words;
                #[unroll]
                for w in 0..words {
                    let kword = k[base + w];
                    let vword = v[base + w];
                    #[unroll]
                    for e in 0..4usize {
                        kw[(t * words + w) * 4 + e] = kword.extract(e);
                        vw[(t * words + w) * 4 + e] = vword.extract(e);
                    }
                }
            }
            #[unroll]
            for t in 0..KEYS_IN_FLIGHT {
                let mut dot = 0.0f32;
                #[unroll]
                for w in 0..words {
                    #[unroll]
                    for e in 0..4usize {
                        let (lo, hi) = unpack(kw[(t * words + w) * 4 + e]);
                        dot += qs[w * 8 + 2 * e] * lo;
                        dot += qs[w * 8 + 2 * e + 1] * hi;
                    }
                }
                dot += plane_shuffle_xor(dot, 1u32);
                dot += plane_shuffle_xor(dot, 2u32);
                dots[t] = dot;
            }
            #[unroll]
            for t in 0..KEYS_IN_FLIGHT {
                if b + t * KEY_GROUPS + kg < end {
                    let dot = dots[t];
                    let m_new = max(m, dot);
                    let corr = (m - m_new).exp();
                    let p = (dot - m_new).exp();
                    l = l * corr + p;
                    #[unroll]
                    for w in 0..words {
                        #[unroll]
                        for e in 0..4usize {
                            let (lo, hi) = unpack(vw[(t * words + w) * 4 + e]);
                            let a = w * 8 + 2 * e;
                            acc[a] = acc[a] * corr + p * lo;
                            acc[a + 1] = acc[a + 1] * corr + p * hi;
                        }
                    }
                    m = m_new;
                }
            }
            b += KEYS_IN_FLIGHT * KEY_GROUPS;
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

        // 4. Key group 0 writes its quarter of the split's state.
        let slot = (local * heads + head) * stride + split;
        if kg == 0 {
            let p_base = slot * head_dim + dq * (head_dim / 4);
            #[unroll]
            for i in 0..head_dim / 4 {
                part[p_base + i] = acc[i];
            }
            if dq == 0 {
                ml[2 * slot] = m;
                ml[2 * slot + 1] = l;
            }
        }
    }
}

/// `out[r, h, d]`: the splits of row `r = row0 + x`, head `h` merged in split order (thread
/// `d` of cube `(x, h)`), normalised, rounded to bf16.
#[cube(launch_unchecked)]
fn combine_kernel(
    part: &[f32],
    ml: &[f32],
    meta: &[i32],
    out: &mut [bf16],
    row0: u32,
    stride: u32,
    #[comptime] head_dim: usize,
) {
    let local = CUBE_POS_X as usize;
    let row = row0 as usize + local;
    let head = CUBE_POS_Y as usize;
    let heads = CUBE_COUNT_Y as usize;
    let d = UNIT_POS_X as usize;
    let stride = stride as usize;
    let count = meta[2 * row + 1] as usize;
    let chunk = split_chunk(count);
    let mut splits = (count + chunk - 1) / chunk;
    // Only a row reading past the key table could have more (the launch's contract rules it
    // out); never read past the scratch.
    if splits > stride {
        splits = stride;
    }
    let base = (local * heads + head) * stride;
    let mut big = f32::new(f32::NEG_INFINITY);
    for s in 0..splits {
        big = max(big, ml[2 * (base + s)]);
    }
    let mut l = 0.0f32;
    let mut acc = 0.0f32;
    for s in 0..splits {
        let c = (ml[2 * (base + s)] - big).exp();
        l += ml[2 * (base + s) + 1] * c;
        acc += part[(base + s) * head_dim + d] * c;
    }
    out[(row * heads + head) * head_dim + d] = bf16::cast_from(acc * (1.0f32 / l));
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
    let scratch = |len: usize| {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            q.device.clone(),
            [len].into(),
            DType::F32,
        )
    };
    let stride = split_stride(n_keys);
    let launch_rows = rows.min(ROWS_PER_LAUNCH);
    let part_len = launch_rows * heads * stride * head_dim;
    let ml_len = launch_rows * heads * stride * 2;
    let part = scratch(part_len);
    let ml = scratch(ml_len);
    for row0 in (0..rows).step_by(ROWS_PER_LAUNCH) {
        let n = launch_rows.min(rows - row0);
        // SAFETY: lengths are the buffers' sizes in the kernel's units; the split kernel reads q
        // rows `row0 .. row0 + n < rows`, pool rows named in `keys` (the caller's page tables,
        // all `< pool_rows`), `keys` entries `meta[2r] .. meta[2r] + meta[2r + 1]` (within `keys`
        // by construction of the plan, so a row has at most `split_stride(n_keys)` splits: its
        // chunk is at least MIN_CHUNK keys), and writes slots `< n · heads · stride` of `part`
        // and `ml` (split `< stride`: the grid's z); the combine reads the slots the splits of
        // each row wrote (the same `split_chunk` of the same count, at most `stride`) and writes
        // rows `row0 .. row0 + n` of `out` within `[rows, heads, head_dim]`. Launches of one
        // call run in order on one stream, so each finds the scratch free.
        unsafe {
            paged_attention_split_kernel::launch_unchecked(
                &client,
                CubeCount::Static(n as u32, kv_heads as u32, stride as u32),
                CubeDim::new_2d(32, groups as u32),
                BufferArg::from_raw_parts(q.handle.clone(), rows * heads * head_dim / 8),
                BufferArg::from_raw_parts(k.handle.clone(), pool_words),
                BufferArg::from_raw_parts(v.handle.clone(), pool_words),
                BufferArg::from_raw_parts(keys.handle.clone(), n_keys),
                BufferArg::from_raw_parts(meta.handle.clone(), rows * 2),
                BufferArg::from_raw_parts(part.handle.clone(), part_len),
                BufferArg::from_raw_parts(ml.handle.clone(), ml_len),
                row0 as u32,
                stride as u32,
                kv_heads as u32,
                1.0 / (head_dim as f32).sqrt(),
                head_dim,
                groups,
            );
            combine_kernel::launch_unchecked(
                &client,
                CubeCount::Static(n as u32, heads as u32, 1),
                CubeDim::new_1d(head_dim as u32),
                BufferArg::from_raw_parts(part.handle.clone(), part_len),
                BufferArg::from_raw_parts(ml.handle.clone(), ml_len),
                BufferArg::from_raw_parts(meta.handle.clone(), rows * 2),
                BufferArg::from_raw_parts(out.handle.clone(), rows * heads * head_dim),
                row0 as u32,
                stride as u32,
                head_dim,
            );
        }
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
