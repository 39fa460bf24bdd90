//! The small fused kernels around the projections: RMSNorm (with or without the residual add
//! before it, whose delta may be a split product's uncombined f32 sums), per-head RMSNorm + RoPE
//! of q or k, the whole attention input of a layer with both K/V pool stores, and the SwiGLU
//! gate. Each replaces a chain of a few to a dozen elementwise and reduction launches of plain
//! burn (or of this crate's own smaller kernels) with one launch.
//!
//! Every kernel rounds to bf16 where its plain-burn body (in [`crate::reference`]) rounds, so
//! the two differ only in the order of the f32 sum of squares. A row's sums are made in an
//! order fixed by the row's width alone (thread-serial, then a warp butterfly, then warps in
//! order), never by how many rows share the launch.

use burn::backend::Dispatch;
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::bf16;

use super::offline::{KernelSource, offline_kernel, transpile};

/// Threads of a SwiGLU cube.
const SWIGLU_THREADS: usize = 256;

fn on_cuda(t: &Tensor<2>) -> bool {
    matches!(t.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// `RMSNorm(x)·w`, as [`crate::reference::rms_norm`] rounds it; with `residual`, first
/// `x ← bf16(x + delta)`, which is written to `sum` and normed.
///
/// With `splits > 0` the delta is not read from `delta` but made from the f32 partial sums of a
/// split product, `parts` `[splits, rows·d]` (`parts_len = rows·d`): `bf16(Σ_p parts[p])` in
/// split order, the very value the product's own combine kernel writes. The product's combine,
/// the residual add and the norm are then one launch, with the same bits as three.
///
/// One cube per row; `x`, `delta`, `sum`, `out`: `[rows, d]`, `w`: `[d]`, bf16, contiguous.
/// (`delta` and `parts` are only read; they are taken `&mut` because [`norm_delta`], which reads
/// them, also serves [`norm_row_staged`], whose chained launch writes them; see
/// [`super::chain`].)
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_kernel(
    x: &[bf16],
    delta: &mut [bf16],
    parts: &mut [f32],
    w: &[bf16],
    sum: &mut [bf16],
    out: &mut [bf16],
    eps: f32,
    inv_d: f32,
    parts_len: u32,
    #[comptime] d: usize,
    #[comptime] residual: bool,
    #[comptime] splits: usize,
    #[comptime] threads: usize,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let per = comptime!(d.div_ceil(threads));
    let mut vals = Array::<f32>::new(per);
    let mut ws = Array::<f32>::new(per);
    norm_row_loads(x, w, row, tid, &mut vals, &mut ws, d, threads, threads);
    norm_row_finish(
        delta, parts, sum, out, &mut vals, &ws, eps, inv_d, parts_len, row, tid, d, residual, splits,
        threads, threads,
    );
}

/// The first reads of row `row`'s RMSNorm by thread `tid` of `threads` (each the
/// `virt / threads` virtual threads `tid + threads·q` of a cube of `virt`: slot
/// `q·per + j` holds element `j·virt + tid + threads·q`, `per = ⌈d / virt⌉`): its elements of
/// `x` and of the weight `w`, as f32 (0 past `d`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_row_loads(
    x: &[bf16],
    w: &[bf16],
    row: usize,
    tid: usize,
    vals: &mut Array<f32>,
    ws: &mut Array<f32>,
    #[comptime] d: usize,
    #[comptime] threads: usize,
    #[comptime] virt: usize,
) {
    let base = row * d;
    let per = comptime!(d.div_ceil(virt));
    #[unroll]
    for q in 0..virt / threads {
        #[unroll]
        for j in 0..per {
            let i = j * virt + tid + q * threads;
            vals[q * per + j] = 0.0f32;
            ws[q * per + j] = 0.0f32;
            if i < d {
                ws[q * per + j] = f32::cast_from(w[i]);
                vals[q * per + j] = f32::cast_from(x[base + i]);
            }
        }
    }
}

/// The rest of [`rms_norm_kernel`]'s row after [`norm_row_loads`]: with `residual`, the delta
/// (bf16 from `delta`, or the split sums of `parts` added in split order and rounded once) is
/// added, rounded and stored to `sum`; then the sum of squares of the row as a cube of `virt`
/// threads makes it (each virtual thread's elements in order, a warp butterfly per virtual
/// warp, the virtual warps in order), whatever `threads` actually run it, so a row gets the same
/// bits from a cube of 256 threads as from one of `virt`; then the normalised row, rounded,
/// times the weight, rounded, to `out`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_row_finish(
    delta: &mut [bf16],
    parts: &mut [f32],
    sum: &mut [bf16],
    out: &mut [bf16],
    vals: &mut Array<f32>,
    ws: &Array<f32>,
    eps: f32,
    inv_d: f32,
    parts_len: u32,
    row: usize,
    tid: usize,
    #[comptime] d: usize,
    #[comptime] residual: bool,
    #[comptime] splits: usize,
    #[comptime] threads: usize,
    #[comptime] virt: usize,
) {
    let base = row * d;
    let per = comptime!(d.div_ceil(virt));
    let groups = comptime!(virt / threads);
    // 1. The deltas: every read before any store (the stores to `sum` could alias them as far
    //    as the compiler knows, so reads issued after a store would each wait for the one before;
    //    measured: 9.7 µs instead of about 3 for one 4096-wide row with a two-way split delta).
    let mut ds = Array::<f32>::new(groups * per);
    #[unroll]
    for q in 0..groups {
        #[unroll]
        for j in 0..per {
            let i = j * virt + tid + q * threads;
            ds[q * per + j] = 0.0f32;
            // `residual` is a compile-time choice, not a run-time operand of `&&`.
            #[allow(clippy::collapsible_if)]
            if i < d {
                if residual {
                    ds[q * per + j] = norm_delta(delta, parts, base + i, parts_len, splits);
                }
            }
        }
    }
    // 2. The residual add (stored), each virtual thread's sum of squares in order, a warp
    //    butterfly per virtual warp, then the virtual warps in order.
    let mut partial = Shared::<[f32]>::new_slice(virt / 32);
    #[unroll]
    for q in 0..groups {
        let mut part = 0.0f32;
        #[unroll]
        for j in 0..per {
            let i = j * virt + tid + q * threads;
            let mut v = vals[q * per + j];
            if residual {
                let s = bf16::cast_from(v + ds[q * per + j]);
                if i < d {
                    sum[base + i] = s;
                }
                v = f32::cast_from(s);
            }
            vals[q * per + j] = v;
            part += v * v;
        }
        let warp_sum = plane_sum(part);
        if tid.is_multiple_of(32) {
            partial[tid / 32 + q * threads / 32] = warp_sum;
        }
    }
    sync_cube();
    // 3. Normalise in f32, round, scale by the weight, round.
    let inv = norm_inv(&partial, eps, inv_d, virt);
    #[unroll]
    for q in 0..groups {
        #[unroll]
        for j in 0..per {
            let i = j * virt + tid + q * threads;
            if i < d {
                out[base + i] = norm_value(vals[q * per + j], inv, ws[q * per + j]);
            }
        }
    }
}

/// The delta a residual norm adds at element `at`: bf16 from `delta`, or (`splits > 0`) the f32
/// sums of a split product added in split order and rounded once, as the product's own combine
/// would have written it.
#[cube]
fn norm_delta(
    delta: &mut [bf16],
    parts: &mut [f32],
    at: usize,
    parts_len: u32,
    #[comptime] splits: usize,
) -> f32 {
    if comptime![splits > 0] {
        let mut acc = parts[at];
        #[unroll]
        for p in 1..splits {
            acc += parts[p * parts_len as usize + at];
        }
        f32::cast_from(bf16::cast_from(acc))
    } else {
        f32::cast_from(delta[at])
    }
}

/// A row's `1 / rms` from the sums of squares of its `virt / 32` (virtual) warps, added in order.
#[cube]
fn norm_inv(partial: &Shared<[f32]>, eps: f32, inv_d: f32, #[comptime] virt: usize) -> f32 {
    let mut total = 0.0f32;
    #[unroll]
    for k in 0..virt / 32 {
        total += partial[k];
    }
    1.0f32 / f32::sqrt(total * inv_d + eps)
}

/// One element of a normed row: `v · inv` rounded, times the weight `w`, rounded.
#[cube]
fn norm_value(v: f32, inv: f32, w: f32) -> bf16 {
    let n = f32::cast_from(bf16::cast_from(v * inv));
    bf16::cast_from(n * w)
}

/// A residual norm's row as [`norm_row_loads`] then [`norm_row_finish`] make it (the same
/// arithmetic in the same order, so the same bits), by `threads` threads emulating a cube of
/// `virt`, with the row's sums `x + delta` staged in `staged` (shared, `d` f32) instead of
/// registers: a cube of 256 threads holds 16 elements of a 4096-wide row a thread, which kept in
/// registers would set the register count of every other phase of a chained launch
/// ([`super::chain`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_row_staged(
    x: &mut [bf16],
    w: &[bf16],
    delta: &mut [bf16],
    parts: &mut [f32],
    sum: &mut [bf16],
    out: &mut [bf16],
    staged: &mut Shared<[f32]>,
    eps: f32,
    inv_d: f32,
    parts_len: u32,
    row: usize,
    tid: usize,
    #[comptime] d: usize,
    #[comptime] splits: usize,
    #[comptime] threads: usize,
    #[comptime] virt: usize,
) {
    let base = row * d;
    let per = comptime!(d.div_ceil(virt));
    let mut partial = Shared::<[f32]>::new_slice(virt / 32);
    #[unroll]
    for q in 0..virt / threads {
        let mut part = 0.0f32;
        #[unroll]
        for j in 0..per {
            let i = j * virt + tid + q * threads;
            let mut v = 0.0f32;
            if i < d {
                let s = bf16::cast_from(
                    f32::cast_from(x[base + i]) + norm_delta(delta, parts, base + i, parts_len, splits),
                );
                sum[base + i] = s;
                v = f32::cast_from(s);
                staged[i] = v;
            }
            part += v * v;
        }
        let warp_sum = plane_sum(part);
        if tid.is_multiple_of(32) {
            partial[tid / 32 + q * threads / 32] = warp_sum;
        }
    }
    sync_cube();
    let inv = norm_inv(&partial, eps, inv_d, virt);
    #[unroll]
    for q in 0..virt / threads {
        #[unroll]
        for j in 0..per {
            let i = j * virt + tid + q * threads;
            if i < d {
                out[base + i] = norm_value(staged[i], inv, f32::cast_from(w[i]));
            }
        }
    }
}

/// `RoPE(RMSNorm(x[base .. base + hd])·w)` of one head, by one warp, written to
/// `out[o .. o + hd]`; `t` is the row's offset in the rotary tables.
///
/// Lane `l` holds the rotary pairs `(i, i + hd/2)`, `i = 32·j + l`, so the rotation needs no
/// shuffles. The roundings are the reference's: the norm (rounded, scaled, rounded), then
/// `out_i = x_i·cos_i + (−x_{i+h})·sin_i`, `out_{i+h} = x_{i+h}·cos_{i+h} + x_i·sin_{i+h}` with
/// each product rounded.
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_rope_head(
    x: &[bf16],
    base: usize,
    w: &[bf16],
    cos: &[bf16],
    sin: &[bf16],
    t: usize,
    out: &mut [bf16],
    o: usize,
    lane: usize,
    eps: f32,
    inv_hd: f32,
    #[comptime] head_dim: usize,
) {
    let half = head_dim / 2;
    let pairs = half / 32;
    // 1. Every read first (the lane's pairs, weights and rotary entries: a store to `out` could
    //    alias a later read as far as the compiler knows), then the pairs' sum of squares.
    let mut a = Array::<f32>::new(pairs);
    let mut b = Array::<f32>::new(pairs);
    let mut wl = Array::<f32>::new(pairs);
    let mut wh = Array::<f32>::new(pairs);
    let mut rot = Array::<f32>::new(4 * pairs);
    let mut part = 0.0f32;
    #[unroll]
    for j in 0..pairs {
        let i = j * 32 + lane;
        a[j] = f32::cast_from(x[base + i]);
        b[j] = f32::cast_from(x[base + i + half]);
        wl[j] = f32::cast_from(w[i]);
        wh[j] = f32::cast_from(w[i + half]);
        rot[4 * j] = f32::cast_from(cos[t + i]);
        rot[4 * j + 1] = f32::cast_from(sin[t + i]);
        rot[4 * j + 2] = f32::cast_from(cos[t + i + half]);
        rot[4 * j + 3] = f32::cast_from(sin[t + i + half]);
        part += a[j] * a[j];
        part += b[j] * b[j];
    }
    let total = plane_sum(part);
    let inv = 1.0f32 / f32::sqrt(total * inv_hd + eps);
    // 2. Norm, then rotate-half.
    #[unroll]
    for j in 0..pairs {
        let i = j * 32 + lane;
        let na = f32::cast_from(bf16::cast_from(f32::cast_from(bf16::cast_from(a[j] * inv)) * wl[j]));
        let nb = f32::cast_from(bf16::cast_from(f32::cast_from(bf16::cast_from(b[j] * inv)) * wh[j]));
        let lo_c = f32::cast_from(bf16::cast_from(na * rot[4 * j]));
        let lo_s = f32::cast_from(bf16::cast_from(-nb * rot[4 * j + 1]));
        let hi_c = f32::cast_from(bf16::cast_from(nb * rot[4 * j + 2]));
        let hi_s = f32::cast_from(bf16::cast_from(na * rot[4 * j + 3]));
        out[o + i] = bf16::cast_from(lo_c + lo_s);
        out[o + i + half] = bf16::cast_from(hi_c + hi_s);
    }
}

/// Per-head `RoPE(RMSNorm(x_h)·w)` of q or k, read from column `offset` of a row that is
/// `stride` elements wide (so q and k come straight out of a fused q/k/v projection).
///
/// One warp per (row, head) ([`norm_rope_head`]). `x`: `[rows, stride]`, `w`: `[hd]`,
/// `cos`/`sin`: `[rows, hd]`, `out`: `[rows, heads, hd]`, bf16.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn qk_norm_rope_kernel(
    x: &[bf16],
    w: &[bf16],
    cos: &[bf16],
    sin: &[bf16],
    out: &mut [bf16],
    stride: u32,
    offset: u32,
    eps: f32,
    inv_hd: f32,
    #[comptime] head_dim: usize,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let heads = CUBE_COUNT_Y as usize;
    let lane = UNIT_POS_X as usize;
    let base = row * stride as usize + offset as usize + head * head_dim;
    let o = (row * heads + head) * head_dim;
    norm_rope_head(x, base, w, cos, sin, row * head_dim, out, o, lane, eps, inv_hd, head_dim);
}

/// The whole attention input of a layer from one fused q/k/v projection output, in one launch:
/// q heads normed and rotated into `q`, k heads normed and rotated and v heads copied straight
/// into the K/V pools at each row's pool row `idx[row]`.
///
/// One warp per (row, head) over `heads + 2·kv_heads` heads: the heads of `y`'s row in column
/// order (q, then k, then v). `y`: `[rows, stride]`, `q`: `[rows, heads, hd]`, pools:
/// `[pool_rows, kv_heads, hd]`, bf16; `idx`: `[rows]` i32 or i64 read as 32-bit words
/// (`idx_words` per entry, the low word first: pool rows are below 2³¹).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn qkv_store_kernel(
    y: &[bf16],
    q_w: &[bf16],
    k_w: &[bf16],
    cos: &[bf16],
    sin: &[bf16],
    idx: &[u32],
    q: &mut [bf16],
    k_pool: &mut [bf16],
    v_pool: &mut [bf16],
    stride: u32,
    eps: f32,
    inv_hd: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] idx_words: usize,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let base = row * stride as usize + head * head_dim;
    let t = row * head_dim;
    if head < heads {
        let o = (row * heads + head) * head_dim;
        norm_rope_head(y, base, q_w, cos, sin, t, q, o, lane, eps, inv_hd, head_dim);
    } else {
        let dst = idx[row * idx_words] as usize;
        if head < heads + kv_heads {
            let o = (dst * kv_heads + head - heads) * head_dim;
            norm_rope_head(y, base, k_w, cos, sin, t, k_pool, o, lane, eps, inv_hd, head_dim);
        } else {
            let o = (dst * kv_heads + head - heads - kv_heads) * head_dim;
            // Reads first, then stores (see `norm_rope_head`).
            let mut vals = Array::<bf16>::new(head_dim / 32);
            #[unroll]
            for j in 0..head_dim / 32 {
                vals[j] = y[base + j * 32 + lane];
            }
            #[unroll]
            for j in 0..head_dim / 32 {
                v_pool[o + j * 32 + lane] = vals[j];
            }
        }
    }
}

/// `silu(g)·u` with the reference's roundings (`σ(g)`, `g·σ(g)`, the product), reading `g` and
/// `u` from columns `g_off` and `u_off` of rows `stride` wide (one fused gate/up output, or two
/// separate ones given twice). `out`: `[rows, width]`, bf16.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn swiglu_kernel(
    g: &[bf16],
    u: &[bf16],
    out: &mut [bf16],
    g_stride: u32,
    g_off: u32,
    u_stride: u32,
    u_off: u32,
    width: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_Y as usize;
    let j = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let width = width as usize;
    if j < width {
        let gv = f32::cast_from(g[row * g_stride as usize + g_off as usize + j]);
        let uv = f32::cast_from(u[row * u_stride as usize + u_off as usize + j]);
        out[row * width + j] = swiglu_value(gv, uv);
    }
}

/// `silu(g)·u` of one gate and one up value (bf16 values widened to f32) with the reference's
/// roundings: `σ(g)`, `g·σ(g)` and the product each rounded to bf16. The SwiGLU kernel and the
/// SwiGLU epilogues of the bf16 and FP8 products share it, so all three give the same bits.
#[cube]
pub(crate) fn swiglu_value(gv: f32, uv: f32) -> bf16 {
    let sig = f32::cast_from(bf16::cast_from(1.0f32 / (1.0f32 + (-gv).exp())));
    let s = f32::cast_from(bf16::cast_from(gv * sig));
    bf16::cast_from(s * uv)
}

// ---------------------------------------------------------------------------------------------
// Which problems the kernels take.

/// RMSNorm rows: bf16 `[rows, d]` with a bf16 weight on CUDA.
pub(crate) fn takes_norm(x: &Tensor<2>, w: &Tensor<1>) -> bool {
    let [rows, d] = x.dims();
    rows > 0
        && d > 0
        && w.dims()[0] == d
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && on_cuda(x)
}

/// Per-head norm + RoPE: bf16, a head width that is a multiple of 64 (whole pairs per lane),
/// bf16 tables of `[rows, head_dim]`.
pub(crate) fn takes_qk(x: &Tensor<2>, w: &Tensor<1>, cos: &Tensor<2>, head_dim: usize) -> bool {
    let [rows, _] = x.dims();
    rows > 0
        && head_dim.is_multiple_of(64)
        && w.dims()[0] == head_dim
        && cos.dims() == [rows, head_dim]
        && [x.dtype(), w.dtype(), cos.dtype()].iter().all(|&t| t == DType::BF16)
        && on_cuda(x)
}

/// SwiGLU: bf16 on CUDA.
pub(crate) fn takes_swiglu(g: &Tensor<2>, u: &Tensor<2>) -> bool {
    g.dims()[0] > 0 && g.dtype() == DType::BF16 && u.dtype() == DType::BF16 && on_cuda(g)
}

// ---------------------------------------------------------------------------------------------
// Launches on CubeCL tensors.

fn empty_like(x: &CubeTensor, shape: burn::tensor::Shape) -> CubeTensor {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        shape,
        x.dtype,
    )
}

fn launch_norm(
    x: CubeTensor,
    delta: Option<CubeTensor>,
    w: CubeTensor,
    eps: f32,
) -> (CubeTensor, CubeTensor) {
    let delta = delta.map(burn_cubecl::kernel::into_contiguous);
    launch_norm_from(x, delta.map(Delta::Rows), w, eps)
}

/// Where a residual norm's delta comes from.
pub(crate) enum Delta {
    /// A bf16 `[rows, d]` tensor.
    Rows(CubeTensor),
    /// The f32 partial sums `[splits, rows·d]` of a split product (see [`rms_norm_kernel`]).
    Parts(CubeTensor, usize),
}

/// [`rms_norm_kernel`] over `x` (contiguous on return), with the residual add of `delta` when
/// given: `(sum, out)` (without a delta `sum` is `out`'s buffer and not written).
pub(crate) fn launch_norm_from(
    x: CubeTensor,
    delta: Option<Delta>,
    w: CubeTensor,
    eps: f32,
) -> (CubeTensor, CubeTensor) {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (x, w) = (contiguous(x), contiguous(w));
    let [rows, d] = [x.meta.shape()[0], x.meta.shape()[1]];
    let client = x.client.clone();
    let out = empty_like(&x, [rows, d].into());
    let residual = delta.is_some();
    // Without a residual the kernel never touches `delta`, `parts` or `sum`, and with one it
    // reads either `delta` or `parts`: `x` and `out` stand in for the others.
    let sum = if residual { empty_like(&x, [rows, d].into()) } else { out.clone() };
    let n = rows * d;
    let (delta, parts, parts_len, splits) = match delta {
        None => (x.handle.clone(), x.handle.clone(), n / 2, 0),
        Some(Delta::Rows(t)) => (t.handle.clone(), x.handle.clone(), n / 2, 0),
        Some(Delta::Parts(p, splits)) => (x.handle.clone(), p.handle.clone(), splits * n, splits),
    };
    let threads = crate::norm_threads();
    // SAFETY: every bf16 buffer holds `rows·d` elements (`w` holds `d`) and `parts`, when read
    // (`splits > 0`), `splits·rows·d` f32; cube `r` reads and writes row `r` only (of each split).
    unsafe {
        super::pdl::before_launch(&client);
        rms_norm_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(threads as u32),
            BufferArg::from_raw_parts(x.handle.clone(), n),
            BufferArg::from_raw_parts(delta, n),
            BufferArg::from_raw_parts(parts, parts_len),
            BufferArg::from_raw_parts(w.handle.clone(), d),
            BufferArg::from_raw_parts(sum.handle.clone(), n),
            BufferArg::from_raw_parts(out.handle.clone(), n),
            eps,
            1.0 / d as f32,
            n as u32,
            d,
            residual,
            splits,
            threads,
        );
    }
    (sum, out)
}

#[allow(clippy::too_many_arguments)]
fn launch_qk(
    x: CubeTensor,
    w: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    offset: usize,
    heads: usize,
    head_dim: usize,
    eps: f32,
) -> CubeTensor {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (x, w, cos, sin) = (contiguous(x), contiguous(w), contiguous(cos), contiguous(sin));
    let [rows, stride] = [x.meta.shape()[0], x.meta.shape()[1]];
    assert!(offset + heads * head_dim <= stride, "qk_norm_rope: heads past the end of the row");
    let client = x.client.clone();
    let out = empty_like(&x, [rows, heads, head_dim].into());
    // SAFETY: `x` holds `rows·stride` bf16 and cube (r, h) reads row r's columns
    // `offset + h·hd .. offset + (h+1)·hd` (checked above); tables hold `rows·hd`; cube (r, h)
    // writes out[r, h, ..] only.
    unsafe {
        super::pdl::before_launch(&client);
        qk_norm_rope_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, heads as u32, 1),
            CubeDim::new_1d(32),
            BufferArg::from_raw_parts(x.handle.clone(), rows * stride),
            BufferArg::from_raw_parts(w.handle.clone(), head_dim),
            BufferArg::from_raw_parts(cos.handle.clone(), rows * head_dim),
            BufferArg::from_raw_parts(sin.handle.clone(), rows * head_dim),
            BufferArg::from_raw_parts(out.handle.clone(), rows * heads * head_dim),
            stride as u32,
            offset as u32,
            eps,
            1.0 / head_dim as f32,
            head_dim,
        );
    }
    out
}

/// Whether [`launch_qkv_store`] takes this problem (checked on burn tensors): bf16 q/k/v
/// columns and pools on CUDA, whole rotary pairs per lane, pools of `[_, kv_heads, hd]`, one
/// i32 or i64 pool row per input row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn takes_qkv_store(
    y: &Tensor<2>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q_w: &Tensor<1>,
    k_w: &Tensor<1>,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
    idx: &Tensor<1, burn::tensor::Int>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
) -> bool {
    let [rows, width] = y.dims();
    let pool = [k_pool.dims()[1], k_pool.dims()[2]];
    rows <= 65_535
        && (heads + 2 * kv_heads) * head_dim <= width
        && heads + 2 * kv_heads <= 65_535
        && takes_qk(y, q_w, cos, head_dim)
        && k_w.dims()[0] == head_dim
        && k_w.dtype() == DType::BF16
        && sin.dims() == cos.dims()
        && sin.dtype() == DType::BF16
        && idx.dims()[0] == rows
        && matches!(idx.dtype(), DType::I32 | DType::I64)
        && pool == [kv_heads, head_dim]
        && v_pool.dims() == k_pool.dims()
        && k_pool.dtype() == DType::BF16
        && v_pool.dtype() == DType::BF16
}

/// Launches [`qkv_store_kernel`]: returns q and the pools (the same buffers, written in place;
/// a pool that is shared or not contiguous is first copied, and the copy is returned).
#[allow(clippy::too_many_arguments)]
fn launch_qkv_store(
    y: CubeTensor,
    q_w: CubeTensor,
    k_w: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    idx: CubeTensor,
    k_pool: CubeTensor,
    v_pool: CubeTensor,
    heads: usize,
    head_dim: usize,
    eps: f32,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (y, q_w, k_w, cos, sin, idx) =
        (contiguous(y), contiguous(q_w), contiguous(k_w), contiguous(cos), contiguous(sin), contiguous(idx));
    // Writable in place only when nothing else holds the pools' buffers (as burn's own row
    // assignment decides); otherwise into copies, which are returned.
    let own = |t: CubeTensor| if t.can_mut() && t.is_contiguous() { t } else { contiguous(t.copy()) };
    let (k_pool, v_pool) = (own(k_pool), own(v_pool));
    let [rows, stride] = [y.meta.shape()[0], y.meta.shape()[1]];
    let [pool_rows, kv_heads] = [k_pool.meta.shape()[0], k_pool.meta.shape()[1]];
    let all = heads + 2 * kv_heads;
    assert!(all * head_dim <= stride, "qkv_store: heads past the end of the row");
    let idx_words = idx.dtype.size() / 4;
    let client = y.client.clone();
    // Without q heads (context rows' K/V only) the kernel never writes q: a one-element stand-in.
    let q_shape: [usize; 3] = if heads == 0 { [1, 1, 1] } else { [rows, heads, head_dim] };
    let q = empty_like(&y, q_shape.into());
    let q_len = q_shape.iter().product::<usize>();
    let pool_len = pool_rows * kv_heads * head_dim;
    // SAFETY: `y` holds `rows·stride` bf16 and cube (r, h) reads row r's columns
    // `h·hd .. (h+1)·hd < stride` (checked above); tables hold `rows·hd`, `idx` `rows` entries of
    // `idx_words` words; cube (r, h) writes q[r, h] (h < heads) or one head of pool row idx[r],
    // which the caller keeps below `pool_rows` (the cache hands out only its own rows).
    unsafe {
        super::pdl::before_launch(&client);
        qkv_store_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, all as u32, 1),
            CubeDim::new_1d(32),
            BufferArg::from_raw_parts(y.handle.clone(), rows * stride),
            BufferArg::from_raw_parts(q_w.handle.clone(), head_dim),
            BufferArg::from_raw_parts(k_w.handle.clone(), head_dim),
            BufferArg::from_raw_parts(cos.handle.clone(), rows * head_dim),
            BufferArg::from_raw_parts(sin.handle.clone(), rows * head_dim),
            BufferArg::from_raw_parts(idx.handle.clone(), rows * idx_words),
            BufferArg::from_raw_parts(q.handle.clone(), q_len),
            BufferArg::from_raw_parts(k_pool.handle.clone(), pool_len),
            BufferArg::from_raw_parts(v_pool.handle.clone(), pool_len),
            stride as u32,
            eps,
            1.0 / head_dim as f32,
            heads,
            kv_heads,
            head_dim,
            idx_words,
        );
    }
    (q, k_pool, v_pool)
}

fn launch_swiglu(g: CubeTensor, u: CubeTensor, g_off: usize, u_off: usize, width: usize) -> CubeTensor {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (g, u) = (contiguous(g), contiguous(u));
    let [rows, g_stride] = [g.meta.shape()[0], g.meta.shape()[1]];
    let u_stride = u.meta.shape()[1];
    assert!(g_off + width <= g_stride && u_off + width <= u_stride, "swiglu: columns past the row");
    let client = g.client.clone();
    let out = empty_like(&g, [rows, width].into());
    // SAFETY: reads row r's columns `off .. off + width` of g and u (checked above), writes
    // out[r, ..width].
    unsafe {
        super::pdl::before_launch(&client);
        swiglu_kernel::launch_unchecked(
            &client,
            CubeCount::Static(width.div_ceil(SWIGLU_THREADS) as u32, rows as u32, 1),
            CubeDim::new_1d(SWIGLU_THREADS as u32),
            BufferArg::from_raw_parts(g.handle.clone(), rows * g_stride),
            BufferArg::from_raw_parts(u.handle.clone(), rows * u_stride),
            BufferArg::from_raw_parts(out.handle.clone(), rows * width),
            g_stride as u32,
            g_off as u32,
            u_stride as u32,
            u_off as u32,
            width as u32,
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Backend extension and burn-tensor entry points.

fn qk_shape(x: &burn::tensor::Shape, heads: &usize, head_dim: &usize) -> burn::tensor::Shape {
    [x[0], *heads, *head_dim].into()
}

fn swiglu_shape(g: &burn::tensor::Shape, width: &usize) -> burn::tensor::Shape {
    [g[0], *width].into()
}

/// The backend extension: run by CubeCL on CUDA and deferred through fusion.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait FusedOps: burn::backend::Backend {
    /// `RMSNorm(x)·w` per row.
    #[fusion(dtype = x, shape = x)]
    fn rms_norm_rows(
        x: burn::backend::tensor::FloatTensor<Self>,
        w: burn::backend::tensor::FloatTensor<Self>,
        eps: f32,
    ) -> burn::backend::tensor::FloatTensor<Self>;

    /// `(s, RMSNorm(s)·w)` with `s = x + delta`.
    #[fusion(meta = |x, _delta, _w, _eps| (x.clone(), x.clone()))]
    fn add_rms_norm(
        x: burn::backend::tensor::FloatTensor<Self>,
        delta: burn::backend::tensor::FloatTensor<Self>,
        w: burn::backend::tensor::FloatTensor<Self>,
        eps: f32,
    ) -> (burn::backend::tensor::FloatTensor<Self>, burn::backend::tensor::FloatTensor<Self>);

    /// Per-head norm + RoPE of `heads` heads from column `offset` of `x`.
    #[fusion(dtype = x, shape = qk_shape(x, heads, head_dim))]
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        x: burn::backend::tensor::FloatTensor<Self>,
        w: burn::backend::tensor::FloatTensor<Self>,
        cos: burn::backend::tensor::FloatTensor<Self>,
        sin: burn::backend::tensor::FloatTensor<Self>,
        offset: usize,
        heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> burn::backend::tensor::FloatTensor<Self>;

    /// `(s, RMSNorm(s)·w)` with `s = x + a·Wᵀ` for a bf16 weight `[out, in]`.
    #[fusion(meta = |x, _a, _weight, _w, _eps| (x.clone(), x.clone()))]
    fn linear_add_rms_norm(
        x: burn::backend::tensor::FloatTensor<Self>,
        a: burn::backend::tensor::FloatTensor<Self>,
        weight: burn::backend::tensor::FloatTensor<Self>,
        w: burn::backend::tensor::FloatTensor<Self>,
        eps: f32,
    ) -> (burn::backend::tensor::FloatTensor<Self>, burn::backend::tensor::FloatTensor<Self>);

    /// `(s, RMSNorm(s)·w)` with `s = x + a·Wᵀ` for an FP8 weight (`words`, `scales`).
    #[fusion(meta = |x, _a, _words, _scales, _blocked, _w, _eps| (x.clone(), x.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn linear_fp8_add_rms_norm(
        x: burn::backend::tensor::FloatTensor<Self>,
        a: burn::backend::tensor::FloatTensor<Self>,
        words: burn::backend::tensor::IntTensor<Self>,
        scales: burn::backend::tensor::FloatTensor<Self>,
        blocked: bool,
        w: burn::backend::tensor::FloatTensor<Self>,
        eps: f32,
    ) -> (burn::backend::tensor::FloatTensor<Self>, burn::backend::tensor::FloatTensor<Self>);

    /// q of `heads` heads, with the k and v heads stored at pool rows `idx` (see
    /// [`qkv_store_kernel`]); returns `(q, k_pool, v_pool)`.
    #[fusion(meta = qkv_store_meta)]
    #[allow(clippy::too_many_arguments)]
    fn qkv_norm_rope_store(
        y: burn::backend::tensor::FloatTensor<Self>,
        q_w: burn::backend::tensor::FloatTensor<Self>,
        k_w: burn::backend::tensor::FloatTensor<Self>,
        cos: burn::backend::tensor::FloatTensor<Self>,
        sin: burn::backend::tensor::FloatTensor<Self>,
        idx: burn::backend::tensor::IntTensor<Self>,
        k_pool: burn::backend::tensor::FloatTensor<Self>,
        v_pool: burn::backend::tensor::FloatTensor<Self>,
        heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> (
        burn::backend::tensor::FloatTensor<Self>,
        burn::backend::tensor::FloatTensor<Self>,
        burn::backend::tensor::FloatTensor<Self>,
    );

    /// The k and v heads of `y` (k from column 0, then v) stored at pool rows `idx`, k normed
    /// and rotated ([`qkv_store_kernel`] without q heads); returns `(k_pool, v_pool)`.
    #[fusion(meta = |_y, _k_w, _cos, _sin, _idx, k_pool, v_pool, _head_dim, _eps| (k_pool.clone(), v_pool.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn kv_norm_rope_store(
        y: burn::backend::tensor::FloatTensor<Self>,
        k_w: burn::backend::tensor::FloatTensor<Self>,
        cos: burn::backend::tensor::FloatTensor<Self>,
        sin: burn::backend::tensor::FloatTensor<Self>,
        idx: burn::backend::tensor::IntTensor<Self>,
        k_pool: burn::backend::tensor::FloatTensor<Self>,
        v_pool: burn::backend::tensor::FloatTensor<Self>,
        head_dim: usize,
        eps: f32,
    ) -> (burn::backend::tensor::FloatTensor<Self>, burn::backend::tensor::FloatTensor<Self>);

    /// `silu(g[:, g_off..])·u[:, u_off..]`, `width` columns.
    #[fusion(dtype = g, shape = swiglu_shape(g, width))]
    fn swiglu_cols(
        g: burn::backend::tensor::FloatTensor<Self>,
        u: burn::backend::tensor::FloatTensor<Self>,
        g_off: usize,
        u_off: usize,
        width: usize,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl FusedOps for CubeBackend {
    fn rms_norm_rows(x: CubeTensor, w: CubeTensor, eps: f32) -> CubeTensor {
        launch_norm(x, None, w, eps).1
    }

    fn add_rms_norm(x: CubeTensor, delta: CubeTensor, w: CubeTensor, eps: f32) -> (CubeTensor, CubeTensor) {
        launch_norm(x, Some(delta), w, eps)
    }

    fn qk_norm_rope(
        x: CubeTensor,
        w: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        offset: usize,
        heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> CubeTensor {
        launch_qk(x, w, cos, sin, offset, heads, head_dim, eps)
    }

    fn linear_add_rms_norm(
        x: CubeTensor,
        a: CubeTensor,
        weight: CubeTensor,
        w: CubeTensor,
        eps: f32,
    ) -> (CubeTensor, CubeTensor) {
        let delta = match super::gemm::launch_product(a, weight, true) {
            super::gemm::Product::Rows(y) => Delta::Rows(y),
            super::gemm::Product::Parts(p, splits) => Delta::Parts(p, splits),
        };
        launch_norm_from(x, Some(delta), w, eps)
    }

    fn linear_fp8_add_rms_norm(
        x: CubeTensor,
        a: CubeTensor,
        words: CubeTensor,
        scales: CubeTensor,
        blocked: bool,
        w: CubeTensor,
        eps: f32,
    ) -> (CubeTensor, CubeTensor) {
        let delta = match super::gemm_fp8::launch_product(a, words, scales, blocked, true) {
            super::gemm::Product::Rows(y) => Delta::Rows(y),
            super::gemm::Product::Parts(p, splits) => Delta::Parts(p, splits),
        };
        launch_norm_from(x, Some(delta), w, eps)
    }

    fn qkv_norm_rope_store(
        y: CubeTensor,
        q_w: CubeTensor,
        k_w: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        idx: CubeTensor,
        k_pool: CubeTensor,
        v_pool: CubeTensor,
        heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        launch_qkv_store(y, q_w, k_w, cos, sin, idx, k_pool, v_pool, heads, head_dim, eps)
    }

    fn kv_norm_rope_store(
        y: CubeTensor,
        k_w: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        idx: CubeTensor,
        k_pool: CubeTensor,
        v_pool: CubeTensor,
        head_dim: usize,
        eps: f32,
    ) -> (CubeTensor, CubeTensor) {
        let (_, k, v) =
            launch_qkv_store(y, k_w.clone(), k_w, cos, sin, idx, k_pool, v_pool, 0, head_dim, eps);
        (k, v)
    }

    fn swiglu_cols(g: CubeTensor, u: CubeTensor, g_off: usize, u_off: usize, width: usize) -> CubeTensor {
        launch_swiglu(g, u, g_off, u_off, width)
    }
}

/// Output metadata of [`FusedOps::qkv_norm_rope_store`]: q `[rows, heads, hd]`, the pools as
/// they came.
#[allow(clippy::too_many_arguments)]
fn qkv_store_meta(
    y: &burn::backend::fusion::custom::TensorSpec,
    _q_w: &burn::backend::fusion::custom::TensorSpec,
    _k_w: &burn::backend::fusion::custom::TensorSpec,
    _cos: &burn::backend::fusion::custom::TensorSpec,
    _sin: &burn::backend::fusion::custom::TensorSpec,
    _idx: &burn::backend::fusion::custom::TensorSpec,
    k_pool: &burn::backend::fusion::custom::TensorSpec,
    v_pool: &burn::backend::fusion::custom::TensorSpec,
    heads: &usize,
    head_dim: &usize,
    _eps: &f32,
) -> (
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
) {
    let q = burn::backend::fusion::custom::TensorSpec::new([y.shape[0], *heads, *head_dim].into(), y.dtype);
    (q, k_pool.clone(), v_pool.clone())
}

pub(crate) fn rms_norm(x: Tensor<2>, w: &Tensor<1>, eps: f64) -> Tensor<2> {
    let y = <Dispatch as FusedOps>::rms_norm_rows(x.into_dispatch(), w.clone().into_dispatch(), eps as f32);
    Tensor::from_dispatch(y)
}

pub(crate) fn add_rms_norm(
    x: Tensor<2>,
    delta: Tensor<2>,
    w: &Tensor<1>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    let (s, y) = <Dispatch as FusedOps>::add_rms_norm(
        x.into_dispatch(),
        delta.into_dispatch(),
        w.clone().into_dispatch(),
        eps as f32,
    );
    (Tensor::from_dispatch(s), Tensor::from_dispatch(y))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_rope(
    x: Tensor<2>,
    offset: usize,
    heads: usize,
    head_dim: usize,
    w: &Tensor<1>,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
    eps: f64,
) -> Tensor<3> {
    let y = <Dispatch as FusedOps>::qk_norm_rope(
        x.into_dispatch(),
        w.clone().into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
        offset,
        heads,
        head_dim,
        eps as f32,
    );
    Tensor::from_dispatch(y)
}

pub(crate) fn linear_add_rms_norm(
    x: Tensor<2>,
    a: Tensor<2>,
    weight: &Tensor<2>,
    w: &Tensor<1>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    let (s, y) = <Dispatch as FusedOps>::linear_add_rms_norm(
        x.into_dispatch(),
        a.into_dispatch(),
        weight.clone().into_dispatch(),
        w.clone().into_dispatch(),
        eps as f32,
    );
    (Tensor::from_dispatch(s), Tensor::from_dispatch(y))
}

pub(crate) fn linear_fp8_add_rms_norm(
    x: Tensor<2>,
    a: Tensor<2>,
    weight: &crate::Fp8Matrix,
    w: &Tensor<1>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    let (s, y) = <Dispatch as FusedOps>::linear_fp8_add_rms_norm(
        x.into_dispatch(),
        a.into_dispatch(),
        weight.words.clone().into_dispatch(),
        weight.scales.clone().into_dispatch(),
        weight.grid == crate::fp8::ScaleGrid::Blocks,
        w.clone().into_dispatch(),
        eps as f32,
    );
    (Tensor::from_dispatch(s), Tensor::from_dispatch(y))
}

/// See [`crate::qkv_norm_rope_store`]; the caller checked [`takes_qkv_store`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_norm_rope_store(
    y: Tensor<2>,
    heads: usize,
    head_dim: usize,
    q_w: &Tensor<1>,
    k_w: &Tensor<1>,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
    eps: f64,
    idx: &Tensor<1, burn::tensor::Int>,
    k_pool: Tensor<3>,
    v_pool: Tensor<3>,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let (q, k, v) = <Dispatch as FusedOps>::qkv_norm_rope_store(
        y.into_dispatch(),
        q_w.clone().into_dispatch(),
        k_w.clone().into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
        idx.clone().into_dispatch(),
        k_pool.into_dispatch(),
        v_pool.into_dispatch(),
        heads,
        head_dim,
        eps as f32,
    );
    (Tensor::from_dispatch(q), Tensor::from_dispatch(k), Tensor::from_dispatch(v))
}

/// See [`crate::kv_norm_rope_store`]; the caller checked [`takes_qkv_store`] (no q heads).
#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_norm_rope_store(
    y: Tensor<2>,
    head_dim: usize,
    k_w: &Tensor<1>,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
    eps: f64,
    idx: &Tensor<1, burn::tensor::Int>,
    k_pool: Tensor<3>,
    v_pool: Tensor<3>,
) -> (Tensor<3>, Tensor<3>) {
    let (k, v) = <Dispatch as FusedOps>::kv_norm_rope_store(
        y.into_dispatch(),
        k_w.clone().into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
        idx.clone().into_dispatch(),
        k_pool.into_dispatch(),
        v_pool.into_dispatch(),
        head_dim,
        eps as f32,
    );
    (Tensor::from_dispatch(k), Tensor::from_dispatch(v))
}

pub(crate) fn swiglu(g: Tensor<2>, u: Tensor<2>, g_off: usize, u_off: usize, width: usize) -> Tensor<2> {
    let y = <Dispatch as FusedOps>::swiglu_cols(g.into_dispatch(), u.into_dispatch(), g_off, u_off, width);
    Tensor::from_dispatch(y)
}

// ---------------------------------------------------------------------------------------------
// Argmax of f32 rows.

/// Threads of an argmax cube.
const ARGMAX_THREADS: usize = 256;

/// Merge two (value, index) candidates: the larger value, the lower index on equal values.
#[cube]
pub(crate) fn better(v: f32, i: u32, v_o: f32, i_o: u32) -> (f32, u32) {
    let mut out_v = v;
    let mut out_i = i;
    if v_o > v || (v_o == v && i_o < i) {
        out_v = v_o;
        out_i = i_o;
    }
    (out_v, out_i)
}

/// Elements each thread of an argmax cube scans (independent loads in flight).
const ARGMAX_PER_THREAD: usize = 16;
/// Elements of a row one argmax cube scans: a 151 936-wide vocabulary row is 38 cubes.
const ARGMAX_SEGMENT: usize = ARGMAX_THREADS * ARGMAX_PER_THREAD;

/// Merge the candidates of a warp by butterfly shuffles (every lane ends with the warp's best).
#[cube]
pub(crate) fn warp_best(v: f32, i: u32) -> (f32, u32) {
    lanes_best(v, i, 5u32)
}

/// Merge the candidates of each aligned group of `2^levels` lanes of a warp by butterfly
/// shuffles (every lane ends with its group's best; 5 levels: the whole warp).
#[cube]
pub(crate) fn lanes_best(v: f32, i: u32, #[comptime] levels: u32) -> (f32, u32) {
    let mut best_v = v;
    let mut best_i = i;
    #[unroll]
    for level in 0..levels {
        let mask = 1u32 << level;
        let (nv, ni) =
            better(best_v, best_i, plane_shuffle_xor(best_v, mask), plane_shuffle_xor(best_i, mask));
        best_v = nv;
        best_i = ni;
    }
    (best_v, best_i)
}

/// The end of an argmax first pass: merge the cube's per-thread candidates (warps by
/// butterflies, then the warps in order by thread 0) and write the segment's best to `slot`.
#[cube]
#[allow(clippy::manual_is_multiple_of)] // cube code: `%` on the unit index
fn segment_best(best_v: f32, best_i: u32, part_v: &mut [f32], part_i: &mut [u32], slot: usize) {
    let tid = UNIT_POS as usize;
    let (wv, wi) = warp_best(best_v, best_i);
    let mut values = Shared::<[f32]>::new_slice(ARGMAX_THREADS / 32);
    let mut indices = Shared::<[u32]>::new_slice(ARGMAX_THREADS / 32);
    if tid % 32 == 0 {
        values[tid / 32] = wv;
        indices[tid / 32] = wi;
    }
    sync_cube();
    if tid == 0 {
        let mut v = values[0];
        let mut k = indices[0];
        #[unroll]
        for w in 1..ARGMAX_THREADS / 32 {
            let (nv, nk) = better(v, k, values[w], indices[w]);
            v = nv;
            k = nk;
        }
        part_v[slot] = v;
        part_i[slot] = k;
    }
}

/// First pass of the argmax: cube `(s, r)` finds the largest value of segment `s` of row `r`
/// (elements `s·SEGMENT ..`), the lowest index on ties, NaN skipped, and writes the candidate
/// (index `u32::MAX` when nothing in the segment exceeds −∞) to slot `r·segs + s`. Each thread
/// scans its elements in increasing order; candidates then merge by an order-free rule, so the
/// result is exact and the same however the row is cut.
#[cube(launch_unchecked)]
fn argmax_partial_kernel(x: &[f32], part_v: &mut [f32], part_i: &mut [u32], width: u32) {
    crate::cuda::pdl::dependency_wait();
    let seg = CUBE_POS_X as usize;
    let segs = CUBE_COUNT_X as usize;
    let row = CUBE_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let width = width as usize;
    let start = seg * ARGMAX_SEGMENT;
    let mut best_v = f32::new(f32::NEG_INFINITY);
    // No candidate yet: an index no row has.
    let mut best_i = 0xFFFF_FFFFu32;
    #[unroll]
    for j in 0..ARGMAX_PER_THREAD {
        let i = start + j * ARGMAX_THREADS + tid;
        if i < width {
            let v = x[row * width + i];
            if v > best_v {
                best_v = v;
                best_i = i as u32;
            }
        }
    }
    segment_best(best_v, best_i, part_v, part_i, row * segs + seg);
}

/// [`argmax_partial_kernel`] over the f32 sums `f32(a[row, k, i]) + f32(b[row, i])` of two
/// bf16 inputs, `a` `[rows, steps, width]` and `b` `[rows, width]` (a Markov step's base logits
/// and its bias): the values the unfused widening and add give, never stored.
#[cube(launch_unchecked)]
fn argmax_sum_partial_kernel(
    a: &[bf16],
    b: &[bf16],
    part_v: &mut [f32],
    part_i: &mut [u32],
    width: u32,
    steps: u32,
    k: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let seg = CUBE_POS_X as usize;
    let segs = CUBE_COUNT_X as usize;
    let row = CUBE_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let width = width as usize;
    let a_base = (row * steps as usize + k as usize) * width;
    let start = seg * ARGMAX_SEGMENT;
    let mut best_v = f32::new(f32::NEG_INFINITY);
    let mut best_i = 0xFFFF_FFFFu32;
    #[unroll]
    for j in 0..ARGMAX_PER_THREAD {
        let i = start + j * ARGMAX_THREADS + tid;
        if i < width {
            let v = f32::cast_from(a[a_base + i]) + f32::cast_from(b[row * width + i]);
            if v > best_v {
                best_v = v;
                best_i = i as u32;
            }
        }
    }
    segment_best(best_v, best_i, part_v, part_i, row * segs + seg);
}

/// Second pass: one warp per row merges the row's `segs` candidates; 0 when there is none (no
/// value exceeds −∞), as the host `argmax` of `dspark::sampling` answers.
#[cube(launch_unchecked)]
fn argmax_merge_kernel(part_v: &[f32], part_i: &[u32], out: &mut [i32], segs: u32) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let lane = UNIT_POS as usize;
    let segs = segs as usize;
    let mut v = f32::new(f32::NEG_INFINITY);
    let mut k = 0xFFFF_FFFFu32;
    let mut s = lane;
    while s < segs {
        let (nv, nk) = better(v, k, part_v[row * segs + s], part_i[row * segs + s]);
        v = nv;
        k = nk;
        s += 32;
    }
    let (_, best) = warp_best(v, k);
    if lane == 0 {
        let mut result = 0i32;
        if best != 0xFFFF_FFFFu32 {
            result = best as i32;
        }
        out[row] = result;
    }
}

/// Argmax rows: f32 `[rows, width]` on CUDA (rows within a grid's y extent).
pub(crate) fn takes_argmax(x: &Tensor<2>) -> bool {
    let [rows, width] = x.dims();
    rows > 0
        && rows <= 65_535
        && width > 0
        && width < i32::MAX as usize
        && x.dtype() == DType::F32
        && on_cuda(x)
}

/// Argmax of `f32(a[:, k, :]) + f32(b)`: bf16 `a` `[rows, steps, width]` and `b`
/// `[rows, width]` on CUDA (rows within a grid's y extent).
pub(crate) fn takes_argmax_sum(a: &Tensor<3>, b: &Tensor<2>) -> bool {
    let [rows, steps, width] = a.dims();
    rows > 0
        && rows <= 65_535
        && steps > 0
        && width > 0
        && width < i32::MAX as usize
        && b.dims() == [rows, width]
        && a.dtype() == DType::BF16
        && b.dtype() == DType::BF16
        && matches!(a.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
        && on_cuda(b)
}

/// The first pass of an argmax: which kernel fills the candidates.
#[allow(clippy::large_enum_variant)] // one per call, moved once
enum ArgmaxInput {
    /// f32 rows `[rows, width]`.
    Rows(CubeTensor),
    /// `f32(a[:, k, :]) + f32(b)` for bf16 `a` `[rows, steps, width]`, `b` `[rows, width]`.
    Sum(CubeTensor, CubeTensor, usize),
}

fn launch_argmax(x: CubeTensor) -> CubeTensor {
    launch_argmax_of(ArgmaxInput::Rows(x))
}

fn launch_argmax_of(input: ArgmaxInput) -> CubeTensor {
    let input = match input {
        ArgmaxInput::Rows(x) => ArgmaxInput::Rows(burn_cubecl::kernel::into_contiguous(x)),
        ArgmaxInput::Sum(a, b, k) => ArgmaxInput::Sum(
            burn_cubecl::kernel::into_contiguous(a),
            burn_cubecl::kernel::into_contiguous(b),
            k,
        ),
    };
    // A `[rows, width]` tensor of the call for its shape, client and device (with a sum, `b`).
    let x = match &input {
        ArgmaxInput::Rows(x) | ArgmaxInput::Sum(_, x, _) => x.clone(),
    };
    let [rows, width] = [x.meta.shape()[0], x.meta.shape()[1]];
    let segs = width.div_ceil(ARGMAX_SEGMENT);
    let client = x.client.clone();
    // One buffer: the `rows` i32 results, then the candidates' values (f32) and indices (u32),
    // `rows·segs` of each. A single allocation per call keeps a recorded round's small slices
    // to one per argmax (an allocation inside a recording can only reuse what the warm-ups
    // left; see `dspark_kernels::graph`).
    let cand = rows * segs;
    let all = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        [rows + 2 * cand].into(),
        DType::I32,
    );
    let word = 4u64;
    let part_v = all.handle.clone().offset_start(rows as u64 * word);
    let part_i = all.handle.clone().offset_start((rows + cand) as u64 * word);
    // SAFETY: cube (s, r) of the first pass reads elements `s·SEGMENT ..` below `width` of row
    // r of x (`rows·width` f32) and writes slot `r·segs + s` of each candidate section (`cand`
    // words each, after the `rows` results); the second pass reads row r's `segs` slots and
    // writes result r. The sections do not overlap and lie within the `rows + 2·cand` words.
    // (With a sum, cube (s, r) reads the same elements of row r of `b` and of row (r, k) of
    // `a`, `rows·steps·width` bf16.)
    unsafe {
        super::pdl::before_launch(&client);
        match &input {
            ArgmaxInput::Rows(_) => argmax_partial_kernel::launch_unchecked(
                &client,
                CubeCount::Static(segs as u32, rows as u32, 1),
                CubeDim::new_1d(ARGMAX_THREADS as u32),
                BufferArg::from_raw_parts(x.handle.clone(), rows * width),
                BufferArg::from_raw_parts(part_v.clone(), cand),
                BufferArg::from_raw_parts(part_i.clone(), cand),
                width as u32,
            ),
            ArgmaxInput::Sum(a, b, k) => {
                let steps = a.meta.shape()[1];
                argmax_sum_partial_kernel::launch_unchecked(
                    &client,
                    CubeCount::Static(segs as u32, rows as u32, 1),
                    CubeDim::new_1d(ARGMAX_THREADS as u32),
                    BufferArg::from_raw_parts(a.handle.clone(), rows * steps * width),
                    BufferArg::from_raw_parts(b.handle.clone(), rows * width),
                    BufferArg::from_raw_parts(part_v.clone(), cand),
                    BufferArg::from_raw_parts(part_i.clone(), cand),
                    width as u32,
                    steps as u32,
                    *k as u32,
                )
            }
        }
        super::pdl::before_launch(&client);
        argmax_merge_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(32),
            BufferArg::from_raw_parts(part_v, cand),
            BufferArg::from_raw_parts(part_i, cand),
            BufferArg::from_raw_parts(all.handle.clone(), rows),
            segs as u32,
        );
    }
    // The results are the front of the buffer: a `[rows]` i32 tensor over it (the candidates
    // behind them are never read again).
    CubeTensor::new_contiguous(client, x.device.clone(), [rows].into(), all.handle, DType::I32)
}

fn rows_shape(x: &burn::tensor::Shape) -> burn::tensor::Shape {
    [x[0]].into()
}

/// The backend extension for the argmax.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait ArgmaxOps: burn::backend::Backend {
    /// Lowest index of each row's maximum, i32.
    #[fusion(dtype = DType::I32, shape = rows_shape(x))]
    fn argmax_rows(x: burn::backend::tensor::FloatTensor<Self>) -> burn::backend::tensor::IntTensor<Self>;
}

impl ArgmaxOps for CubeBackend {
    fn argmax_rows(x: CubeTensor) -> CubeTensor {
        launch_argmax(x)
    }
}

pub(crate) fn argmax(x: Tensor<2>) -> Tensor<1, burn::tensor::Int> {
    Tensor::from_dispatch(<Dispatch as ArgmaxOps>::argmax_rows(x.into_dispatch()))
}

/// The backend extension for the argmax of a sum.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait ArgmaxSumOps: burn::backend::Backend {
    /// Lowest index of each row's maximum of `f32(a[:, k, :]) + f32(b)`, i32.
    #[fusion(dtype = DType::I32, shape = rows_shape(b))]
    fn argmax_sum_rows(
        a: burn::backend::tensor::FloatTensor<Self>,
        b: burn::backend::tensor::FloatTensor<Self>,
        k: usize,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl ArgmaxSumOps for CubeBackend {
    fn argmax_sum_rows(a: CubeTensor, b: CubeTensor, k: usize) -> CubeTensor {
        launch_argmax_of(ArgmaxInput::Sum(a, b, k))
    }
}

/// See [`crate::argmax_sum_rows`]; the caller checked [`takes_argmax_sum`].
pub(crate) fn argmax_sum(a: Tensor<3>, k: usize, b: Tensor<2>) -> Tensor<1, burn::tensor::Int> {
    Tensor::from_dispatch(<Dispatch as ArgmaxSumOps>::argmax_sum_rows(
        a.into_dispatch(),
        b.into_dispatch(),
        k,
    ))
}

// ---------------------------------------------------------------------------------------------
// The variants the launches above make, transpiled without a device (see `super::offline`).

/// [`rms_norm_kernel`] over rows of `d`, with or without the residual add, whose delta is
/// `splits` partial sums (0: bf16 rows), as [`launch_norm_from`] launches it.
pub(crate) fn offline_norm(d: usize, residual: bool, splits: usize) -> Result<KernelSource, String> {
    let kernel = offline_kernel!(
        rms_norm_kernel::RmsNormKernel,
        CubeDim::new_1d(crate::norm_threads() as u32);
        b b b b b b s s s;
        d, residual, splits, crate::norm_threads()
    );
    transpile(&format!("rms_norm: d={d} residual={residual} splits={splits}"), kernel)
}

/// [`qk_norm_rope_kernel`] for heads of `head_dim`, as [`launch_qk`] launches it.
pub(crate) fn offline_qk(head_dim: usize) -> Result<KernelSource, String> {
    let kernel = offline_kernel!(
        qk_norm_rope_kernel::QkNormRopeKernel,
        CubeDim::new_1d(32);
        b b b b b s s s s;
        head_dim
    );
    transpile(&format!("qk_norm_rope: head_dim={head_dim}"), kernel)
}

/// [`qkv_store_kernel`] as [`launch_qkv_store`] launches it (`heads` 0: context rows' K/V only;
/// `idx_words` 1 or 2: i32 or i64 pool rows).
pub(crate) fn offline_qkv_store(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    idx_words: usize,
) -> Result<KernelSource, String> {
    let kernel = offline_kernel!(
        qkv_store_kernel::QkvStoreKernel,
        CubeDim::new_1d(32);
        b b b b b b b b b s s s;
        heads, kv_heads, head_dim, idx_words
    );
    let label =
        format!("qkv_store: heads={heads} kv_heads={kv_heads} head_dim={head_dim} idx_words={idx_words}");
    transpile(&label, kernel)
}

/// The kernels of this file without comptime arguments, one variant each.
pub(crate) fn offline_fixed() -> Vec<Result<KernelSource, String>> {
    vec![
        transpile(
            "swiglu",
            offline_kernel!(
                swiglu_kernel::SwigluKernel,
                CubeDim::new_1d(SWIGLU_THREADS as u32);
                b b b s s s s s;
            ),
        ),
        transpile(
            "argmax_partial",
            offline_kernel!(
                argmax_partial_kernel::ArgmaxPartialKernel,
                CubeDim::new_1d(ARGMAX_THREADS as u32);
                b b b s;
            ),
        ),
        transpile(
            "argmax_sum_partial",
            offline_kernel!(
                argmax_sum_partial_kernel::ArgmaxSumPartialKernel,
                CubeDim::new_1d(ARGMAX_THREADS as u32);
                b b b b s s s;
            ),
        ),
        transpile(
            "argmax_merge",
            offline_kernel!(argmax_merge_kernel::ArgmaxMergeKernel, CubeDim::new_1d(32); b b b s; ),
        ),
    ]
}
