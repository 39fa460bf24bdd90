//! Chain rejection sampling on the device (see [`crate::accept`] for the rule).
//!
//! First, one launch per row set runs one cube per row (target rows and proposal rows alike) and
//! reduces the row to a few numbers that fix its distribution: the maximum `M`, the argmax, the
//! top-k floor key, the top-p boundary key and tie cutoff, and the kept weights' sum `S` (0 for a
//! one-hot row). Top-k and top-p need no sort: a radix descent over the keys' eight 4-bit digits
//! counts (top-k) or weighs (top-p) each digit's bucket in one pass over the row per digit. Then
//! three launches decide and draw, as [`crate::sample_rows`] draws: one thread per lane runs the
//! drafts' acceptance tests in order; cubes over segments of 4096 values of each lane's draw row
//! sum the residual's and `p`'s weights; one cube per lane walks the segments in order, then
//! inside the chosen one warps, threads and values.
//!
//! Every sum has a fixed order (per-thread in index order, warps by a fixed butterfly, warps in
//! order), so a lane's outcome depends only on its rows and words.

// `!(x > y)` is meant where a NaN must take the branch, and `v != v` is the NaN test of cube
// code.
#![allow(clippy::neg_cmp_op_on_partial_ord, clippy::eq_op)]

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::fused::{better, warp_best};
use super::sample::{coin_at, walk_slots, warp_sum};
use crate::accept::{ENTRY_WORDS, LANE_HEADER, RESIDUAL_FLOOR};

/// Threads of a cube (both launches).
const THREADS: usize = 1024;
/// Warps of a cube.
const WARPS: usize = THREADS / 32;
/// Loads each thread issues per step of a strided pass.
const UNROLL: usize = 4;
/// Buckets of a radix digit (4 bits).
const BUCKETS: usize = 16;
/// No index.
const NONE: u32 = 0xFFFF_FFFF;
/// Threads of a cube of the draw's launches.
const DRAW_THREADS: usize = 256;
/// Values each of those threads covers in a segment.
const PER_THREAD: usize = 16;
/// Values of a draw row one cube of the partial sums covers: 38 for a 151 936-wide row.
const SEGMENT: usize = DRAW_THREADS * PER_THREAD;

/// The order-preserving key of an f32 (NaN as −∞, −0 as +0), as [`crate::accept::key`].
#[cube]
fn key_of(v: f32) -> u32 {
    let b = u32::reinterpret(v);
    let mut k = b | 0x8000_0000u32;
    if (b & 0x8000_0000u32) != 0u32 {
        k = b ^ 0xFFFF_FFFFu32;
    }
    if v != v {
        // −∞: bits 0xFF80_0000, key !bits.
        k = 0x007F_FFFFu32;
    }
    if v == 0.0f32 {
        // −0 ranks with +0.
        k = 0x8000_0000u32;
    }
    k
}

/// The f32 whose key is `k`.
#[cube]
fn value_of(k: u32) -> f32 {
    let mut b = k ^ 0xFFFF_FFFFu32;
    if (k & 0x8000_0000u32) != 0u32 {
        b = k & 0x7FFF_FFFFu32;
    }
    f32::reinterpret(b)
}

/// Whether `v` is finite.
#[cube]
fn finite(v: f32) -> bool {
    v == v && v != f32::new(f32::INFINITY) && v != f32::new(f32::NEG_INFINITY)
}

/// Probability of token `i` (value `v`) under a row's statistics: `f` = (M, S, T), `u` = (floor,
/// boundary, cutoff, argmax). `S = 0` marks a one-hot row.
#[cube]
fn prob(v: f32, i: u32, stats_f: &[f64], stats_u: &[u32], row: usize) -> f64 {
    let s = stats_f[3 * row + 1];
    let mut p = 0.0f64;
    if s == 0.0f64 {
        if i == stats_u[4 * row + 3] {
            p = 1.0f64;
        }
    } else {
        let k = key_of(v);
        let floor = stats_u[4 * row];
        let b = stats_u[4 * row + 1];
        let cutoff = stats_u[4 * row + 2];
        if finite(v) && k >= floor && (k > b || (k == b && i <= cutoff)) {
            p = ((f64::cast_from(v) - stats_f[3 * row]) / stats_f[3 * row + 2]).exp() / s;
        }
    }
    p
}

/// First launch: cube `r` reduces row `r` of `x` (`params[3r..]`: temperature bits, top-k, top-p
/// bits) to `stats_f[3r..]` = (M, S, T) and `stats_u[4r..]` = (floor, boundary, cutoff, argmax).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_lines)]
fn row_stats_kernel(x: &[f32], params: &[i32], stats_f: &mut [f64], stats_u: &mut [u32], width: u32) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let warp = tid / 32;
    let width = width as usize;
    let base = row * width;
    let t = f32::reinterpret(u32::cast_from(params[3 * row]));
    let top_k = u32::cast_from(params[3 * row + 1]) as usize;
    let top_p = f32::reinterpret(u32::cast_from(params[3 * row + 2]));
    let step = UNROLL * THREADS;

    let mut red_v = Shared::<[f32]>::new_slice(WARPS);
    let mut red_i = Shared::<[u32]>::new_slice(WARPS);
    let mut red = Shared::<[f64]>::new_slice(WARPS * BUCKETS);
    let mut hist = Shared::<[f64]>::new_slice(BUCKETS);
    let mut red_u = Shared::<[u32]>::new_slice(WARPS * BUCKETS);
    let mut hist_u = Shared::<[u32]>::new_slice(BUCKETS);
    let mut counts = Shared::<[u32]>::new_slice(THREADS);
    let mut found = Shared::<[u32]>::new_slice(3usize);
    let mut vals = Array::<f32>::new(UNROLL);
    let mut acc = Array::<f64>::new(BUCKETS);
    let mut cnt = Array::<u32>::new(BUCKETS);

    // 1. The maximum and its lowest index (NaN skipped).
    let mut best_v = f32::new(f32::NEG_INFINITY);
    let mut best_i = 0xFFFF_FFFFu32;
    let mut i0 = tid;
    while i0 < width {
        #[unroll]
        for j in 0..UNROLL {
            let i = i0 + j * THREADS;
            let mut v = f32::new(f32::NEG_INFINITY);
            if i < width {
                v = x[base + i];
            }
            vals[j] = v;
        }
        #[unroll]
        for j in 0..UNROLL {
            if vals[j] > best_v {
                best_v = vals[j];
                best_i = (i0 + j * THREADS) as u32;
            }
        }
        i0 += step;
    }
    let (wv, wi) = warp_best(best_v, best_i);
    if lane == 0 {
        red_v[warp] = wv;
        red_i[warp] = wi;
    }
    sync_cube();
    let mut m = red_v[0];
    let mut am = red_i[0];
    #[unroll]
    for w in 1..WARPS {
        let (nv, ni) = better(m, am, red_v[w], red_i[w]);
        m = nv;
        am = ni;
    }
    let onehot = !(t > 0.0f32) || am == NONE || m == f32::new(f32::INFINITY);
    let mf = f64::cast_from(m);
    let tf = f64::cast_from(t);
    let mut floor = 0u32;
    let mut boundary = 0u32;
    let mut cutoff = 0xFFFF_FFFFu32;
    let mut s_kept = 0.0f64;

    if !onehot {
        // 2. top-k: the k-th largest key, by a radix descent on counts (integers: any order).
        if top_k > 0 && top_k < width {
            let goal = top_k as u32;
            let mut prefix = 0u32;
            let mut above = 0u32;
            for level in 0..8u32 {
                let shift = 28u32 - 4u32 * level;
                let mut hi_mask = 0u32;
                if level > 0u32 {
                    hi_mask = 0xFFFF_FFFFu32 << (shift + 4u32);
                }
                #[unroll]
                for b in 0..BUCKETS {
                    cnt[b] = 0u32;
                }
                let mut i1 = tid;
                while i1 < width {
                    #[unroll]
                    for j in 0..UNROLL {
                        let i = i1 + j * THREADS;
                        let mut v = f32::new(f32::NEG_INFINITY);
                        if i < width {
                            v = x[base + i];
                        }
                        vals[j] = v;
                    }
                    #[unroll]
                    for j in 0..UNROLL {
                        if i1 + j * THREADS < width {
                            let k = key_of(vals[j]);
                            if (k & hi_mask) == prefix {
                                let d = (k >> shift) & 15u32;
                                #[unroll]
                                for b in 0..BUCKETS {
                                    if d == b as u32 {
                                        cnt[b] += 1u32;
                                    }
                                }
                            }
                        }
                    }
                    i1 += step;
                }
                #[unroll]
                for b in 0..BUCKETS {
                    let c = plane_sum(cnt[b]);
                    if lane == 0 {
                        red_u[warp * BUCKETS + b] = c;
                    }
                }
                sync_cube();
                if tid < BUCKETS {
                    let mut c = 0u32;
                    for w in 0..WARPS {
                        c += red_u[w * BUCKETS + tid];
                    }
                    hist_u[tid] = c;
                }
                sync_cube();
                let mut chosen = false;
                let mut digit = 0u32;
                for dd in 0..BUCKETS {
                    let d = BUCKETS - 1 - dd;
                    if !chosen {
                        if above + hist_u[d] >= goal || d == 0 {
                            chosen = true;
                            digit = d as u32;
                        } else {
                            above += hist_u[d];
                        }
                    }
                }
                prefix |= digit << shift;
                sync_cube();
            }
            floor = prefix;
        }
        boundary = floor;

        // 3. Z, the kept weights' sum after top-k.
        let mut z_part = 0.0f64;
        let mut i2 = tid;
        while i2 < width {
            #[unroll]
            for j in 0..UNROLL {
                let i = i2 + j * THREADS;
                let mut v = f32::new(f32::NEG_INFINITY);
                if i < width {
                    v = x[base + i];
                }
                vals[j] = v;
            }
            #[unroll]
            for j in 0..UNROLL {
                if finite(vals[j]) && key_of(vals[j]) >= floor {
                    z_part += ((f64::cast_from(vals[j]) - mf) / tf).exp();
                }
            }
            i2 += step;
        }
        let zw = warp_sum(z_part);
        if lane == 0 {
            red[warp] = zw;
        }
        sync_cube();
        let mut z = 0.0f64;
        for w in 0..WARPS {
            z += red[w];
        }
        sync_cube();
        s_kept = z;

        // 4. top-p: the boundary key by a radix descent on masses, then the ties' cutoff.
        if top_p < 1.0f32 {
            let goal = f64::cast_from(top_p) * z;
            let mut prefix = 0u32;
            let mut above = 0.0f64;
            for level in 0..8u32 {
                let shift = 28u32 - 4u32 * level;
                let mut hi_mask = 0u32;
                if level > 0u32 {
                    hi_mask = 0xFFFF_FFFFu32 << (shift + 4u32);
                }
                #[unroll]
                for b in 0..BUCKETS {
                    acc[b] = 0.0f64;
                }
                let mut i3 = tid;
                while i3 < width {
                    #[unroll]
                    for j in 0..UNROLL {
                        let i = i3 + j * THREADS;
                        let mut v = f32::new(f32::NEG_INFINITY);
                        if i < width {
                            v = x[base + i];
                        }
                        vals[j] = v;
                    }
                    #[unroll]
                    for j in 0..UNROLL {
                        let k = key_of(vals[j]);
                        if finite(vals[j]) && k >= floor && (k & hi_mask) == prefix {
                            let w = ((f64::cast_from(vals[j]) - mf) / tf).exp();
                            let d = ((k >> shift) & 15u32) as usize;
                            #[unroll]
                            for b in 0..BUCKETS {
                                if d == b {
                                    acc[b] += w;
                                }
                            }
                        }
                    }
                    i3 += step;
                }
                #[unroll]
                for b in 0..BUCKETS {
                    let s = warp_sum(acc[b]);
                    if lane == 0 {
                        red[warp * BUCKETS + b] = s;
                    }
                }
                sync_cube();
                if tid < BUCKETS {
                    let mut s = 0.0f64;
                    for w in 0..WARPS {
                        s += red[w * BUCKETS + tid];
                    }
                    hist[tid] = s;
                }
                sync_cube();
                let mut chosen = false;
                let mut digit = 0u32;
                for dd in 0..BUCKETS {
                    let d = BUCKETS - 1 - dd;
                    if !chosen {
                        if above + hist[d] >= goal || d == 0 {
                            chosen = true;
                            digit = d as u32;
                        } else {
                            above += hist[d];
                        }
                    }
                }
                prefix |= digit << shift;
                sync_cube();
            }
            boundary = prefix;
            // Ties at the boundary: each thread counts its contiguous chunk, in index order.
            let chunk = width.div_ceil(THREADS);
            let first = tid * chunk;
            let mut n_here = 0u32;
            for j in 0..chunk {
                let i = first + j;
                if i < width {
                    let v = x[base + i];
                    if finite(v) && key_of(v) == boundary && boundary >= floor {
                        n_here += 1u32;
                    }
                }
            }
            counts[tid] = n_here;
            sync_cube();
            if tid == 0 {
                found[0] = NONE;
                found[1] = 0u32;
                found[2] = 0xFFFF_FFFFu32;
                let mut ties = 0u32;
                for th in 0..THREADS {
                    ties += counts[th];
                }
                if ties > 0u32 {
                    let wb = ((f64::cast_from(value_of(boundary)) - mf) / tf).exp();
                    let mut keep = ((goal - above) / wb).ceil();
                    if keep < 1.0f64 {
                        keep = 1.0f64;
                    }
                    // NaN or past the ties: keep them all.
                    if keep < f64::cast_from(ties) {
                        let n = u32::cast_from(keep);
                        let mut before = 0u32;
                        let mut done = false;
                        for th in 0..THREADS {
                            if !done && before + counts[th] >= n {
                                done = true;
                                found[0] = th as u32;
                                found[1] = n - before;
                            }
                            before += counts[th];
                        }
                    }
                }
            }
            sync_cube();
            if found[0] == tid as u32 {
                let mut seen = 0u32;
                for j in 0..chunk {
                    let i = first + j;
                    if i < width {
                        let v = x[base + i];
                        if finite(v) && key_of(v) == boundary {
                            seen += 1u32;
                            if seen == found[1] {
                                found[2] = i as u32;
                            }
                        }
                    }
                }
            }
            sync_cube();
            cutoff = found[2];
            // S, the kept weights' sum.
            let mut s_part = 0.0f64;
            let mut i4 = tid;
            while i4 < width {
                #[unroll]
                for j in 0..UNROLL {
                    let i = i4 + j * THREADS;
                    let mut v = f32::new(f32::NEG_INFINITY);
                    if i < width {
                        v = x[base + i];
                    }
                    vals[j] = v;
                }
                #[unroll]
                for j in 0..UNROLL {
                    let k = key_of(vals[j]);
                    let i = (i4 + j * THREADS) as u32;
                    if finite(vals[j]) && k >= floor && (k > boundary || (k == boundary && i <= cutoff)) {
                        s_part += ((f64::cast_from(vals[j]) - mf) / tf).exp();
                    }
                }
                i4 += step;
            }
            let sw = warp_sum(s_part);
            if lane == 0 {
                red[warp] = sw;
            }
            sync_cube();
            let mut s = 0.0f64;
            for w in 0..WARPS {
                s += red[w];
            }
            s_kept = s;
        }
    }
    if tid == 0 {
        let mut arg = 0u32;
        if am != NONE {
            arg = am;
        }
        stats_f[3 * row] = mf;
        stats_f[3 * row + 1] = s_kept;
        stats_f[3 * row + 2] = tf;
        if onehot {
            stats_f[3 * row + 1] = 0.0f64;
        }
        stats_u[4 * row] = floor;
        stats_u[4 * row + 1] = boundary;
        stats_u[4 * row + 2] = cutoff;
        stats_u[4 * row + 3] = arg;
    }
}

/// Second launch: lane `l`'s acceptance tests in order (thread 0 of cube `l`), writing the
/// accepted count and whether a residual draw follows at `decision[2l..]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn accept_tests_kernel(
    p: &[f32],
    q: &[f32],
    words: &[i32],
    p_f: &[f64],
    p_u: &[u32],
    q_f: &[f64],
    q_u: &[u32],
    decision: &mut [u32],
    width: u32,
    stride: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let lane_id = CUBE_POS_X as usize;
    if UNIT_POS == 0 {
        let width = width as usize;
        let at = lane_id * (stride as usize);
        let p_row = u32::cast_from(words[at]) as usize;
        let q_row = u32::cast_from(words[at + 1]) as usize;
        let m = u32::cast_from(words[at + 2]) as usize;
        let mut c = 0usize;
        let mut going = true;
        for j in 0..m {
            if going {
                let e = at + LANE_HEADER + ENTRY_WORDS * j;
                let d = u32::cast_from(words[e]) as usize;
                let pr = p_row + j;
                let qr = q_row + j;
                let pd = prob(p[pr * width + d], d as u32, p_f, p_u, pr);
                let qd = prob(q[qr * width + d], d as u32, q_f, q_u, qr);
                if coin_at(words, e + 1) * qd < pd {
                    c += 1;
                } else {
                    going = false;
                }
            }
        }
        decision[2 * lane_id] = c as u32;
        decision[2 * lane_id + 1] = 0u32;
        if c < m {
            decision[2 * lane_id + 1] = 1u32;
        }
    }
}

/// The draw's weight of token `i`: `p_i`, or the residual `max(0, p_i − q_i)`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn draw_weight(
    p: &[f32],
    q: &[f32],
    p_f: &[f64],
    p_u: &[u32],
    q_f: &[f64],
    q_u: &[u32],
    pr: usize,
    qr: usize,
    i: usize,
    width: usize,
    residual: bool,
) -> f64 {
    let mut w = prob(p[pr * width + i], i as u32, p_f, p_u, pr);
    if residual {
        w -= prob(q[qr * width + i], i as u32, q_f, q_u, qr);
        if !(w > 0.0f64) {
            w = 0.0f64;
        }
    }
    w
}

/// Third launch: cube `(s, l)` sums segment `s` of lane `l`'s draw row: the residual's weights
/// (when the lane rejected a draft) at `part_r[l·segs + s]` and `p`'s at `part_p[l·segs + s]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn draw_partial_kernel(
    p: &[f32],
    q: &[f32],
    words: &[i32],
    p_f: &[f64],
    p_u: &[u32],
    q_f: &[f64],
    q_u: &[u32],
    decision: &[u32],
    part_r: &mut [f64],
    part_p: &mut [f64],
    width: u32,
    stride: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let seg = CUBE_POS_X as usize;
    let segs = CUBE_COUNT_X as usize;
    let lane_id = CUBE_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let width = width as usize;
    let at = lane_id * (stride as usize);
    let c = decision[2 * lane_id] as usize;
    let residual = decision[2 * lane_id + 1] == 1u32;
    let pr = u32::cast_from(words[at]) as usize + c;
    let qr = u32::cast_from(words[at + 1]) as usize + c;
    let start = seg * SEGMENT;
    let mut sr = 0.0f64;
    let mut sp = 0.0f64;
    #[unroll]
    for j in 0..PER_THREAD {
        let i = start + j * DRAW_THREADS + tid;
        if i < width {
            let pp = prob(p[pr * width + i], i as u32, p_f, p_u, pr);
            sp += pp;
            if residual {
                let r = pp - prob(q[qr * width + i], i as u32, q_f, q_u, qr);
                if r > 0.0f64 {
                    sr += r;
                }
            }
        }
    }
    let mut sums_r = Shared::<[f64]>::new_slice(DRAW_THREADS / 32);
    let mut sums_p = Shared::<[f64]>::new_slice(DRAW_THREADS / 32);
    let wr = warp_sum(sr);
    let wp = warp_sum(sp);
    if lane == 0 {
        sums_r[tid / 32] = wr;
        sums_p[tid / 32] = wp;
    }
    sync_cube();
    if tid == 0 {
        let mut tr = 0.0f64;
        let mut tp = 0.0f64;
        for w in 0..DRAW_THREADS / 32 {
            tr += sums_r[w];
            tp += sums_p[w];
        }
        part_r[lane_id * segs + seg] = tr;
        part_p[lane_id * segs + seg] = tp;
    }
}

/// Fourth launch: cube `l` draws lane `l`'s token. Thread 0 takes the residual (or `p` when the
/// lane accepted everything or the residual's mass is at most [`RESIDUAL_FLOOR`]) and walks the
/// segments' sums in order; inside the chosen segment each thread sums its 16 consecutive values,
/// and thread 0 walks warps, threads, then values. Writes `(accepted, token)` at `out[2l..]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn draw_walk_kernel(
    p: &[f32],
    q: &[f32],
    words: &[i32],
    p_f: &[f64],
    p_u: &[u32],
    q_f: &[f64],
    q_u: &[u32],
    decision: &[u32],
    part_r: &[f64],
    part_p: &[f64],
    out: &mut [i32],
    width: u32,
    stride: u32,
    segs: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let lane_id = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let width = width as usize;
    let segs = segs as usize;
    let at = lane_id * (stride as usize);
    let c = decision[2 * lane_id] as usize;
    let pr = u32::cast_from(words[at]) as usize + c;
    let qr = u32::cast_from(words[at + 1]) as usize + c;
    // Slot 0: the chosen segment; 1: the residual is drawn from; 2: a draw happens. Slot 0 of
    // `target`: the goal inside the chosen segment.
    let mut chosen = Shared::<[u32]>::new_slice(3usize);
    let mut target = Shared::<[f64]>::new_slice(1usize);
    let mut per_thread = Shared::<[f64]>::new_slice(DRAW_THREADS);
    let mut per_warp = Shared::<[f64]>::new_slice(DRAW_THREADS / 32);
    if tid == 0 {
        chosen[0] = 0u32;
        chosen[1] = 0u32;
        chosen[2] = 0u32;
        target[0] = 0.0f64;
        let mut use_r = decision[2 * lane_id + 1] == 1u32;
        if use_r {
            let mut mass = 0.0f64;
            for s in 0..segs {
                mass += part_r[lane_id * segs + s];
            }
            if !(mass > RESIDUAL_FLOOR) {
                use_r = false;
            }
        }
        let mut total = 0.0f64;
        for s in 0..segs {
            if use_r {
                total += part_r[lane_id * segs + s];
            } else {
                total += part_p[lane_id * segs + s];
            }
        }
        if total > 0.0f64 {
            let goal = coin_at(words, at + LANE_HEADER + ENTRY_WORDS * c + 3) * total;
            let mut running = 0.0f64;
            let mut found = false;
            let mut pick = 0usize;
            let mut last = 0usize;
            let mut local = f64::new(f32::INFINITY);
            for s in 0..segs {
                let mut w = part_p[lane_id * segs + s];
                if use_r {
                    w = part_r[lane_id * segs + s];
                }
                let before = running;
                running += w;
                if w > 0.0f64 {
                    last = s;
                }
                if !found && running > goal && w > 0.0f64 {
                    found = true;
                    pick = s;
                    local = goal - before;
                }
            }
            if !found {
                pick = last;
            }
            chosen[0] = pick as u32;
            chosen[2] = 1u32;
            target[0] = local;
            if use_r {
                chosen[1] = 1u32;
            }
        }
    }
    sync_cube();
    let draws = chosen[2] == 1u32;
    let residual = chosen[1] == 1u32;
    let start = chosen[0] as usize * SEGMENT;
    let mut sum = 0.0f64;
    if draws {
        #[unroll]
        for j in 0..PER_THREAD {
            let i = start + tid * PER_THREAD + j;
            if i < width {
                sum += draw_weight(p, q, p_f, p_u, q_f, q_u, pr, qr, i, width, residual);
            }
        }
    }
    per_thread[tid] = sum;
    sync_cube();
    if lane == 0 {
        let mut w = 0.0f64;
        for l in 0..32usize {
            w += per_thread[tid + l];
        }
        per_warp[tid / 32] = w;
    }
    sync_cube();
    if tid == 0 {
        let mut token = i32::cast_from(p_u[4 * pr + 3]);
        if draws {
            // Warps, then the threads of that warp.
            let (wpick, in_warp) = walk_slots(&per_warp, 0, DRAW_THREADS / 32, target[0]);
            let (pick, goal) = walk_slots(&per_thread, wpick * 32, 32, in_warp);
            let mut running = 0.0f64;
            let mut found = false;
            let first = start + pick * PER_THREAD;
            let mut index = first;
            let mut ilast = first;
            for j in 0..PER_THREAD {
                let i = first + j;
                if i < width {
                    let w = draw_weight(p, q, p_f, p_u, q_f, q_u, pr, qr, i, width, residual);
                    running += w;
                    if w > 0.0f64 {
                        ilast = i;
                    }
                    if !found && running > goal && w > 0.0f64 {
                        found = true;
                        index = i;
                    }
                }
            }
            if !found {
                index = ilast;
            }
            token = index as i32;
        }
        out[2 * lane_id] = c as i32;
        out[2 * lane_id + 1] = token;
    }
}

/// Row statistics of `rows` rows of `width` f32 values at `x` under the words at `params`
/// (`3·rows` i32) into two fresh buffers `(stats_f, stats_u)`.
fn row_stats(
    like: &CubeTensor,
    x: cubecl::server::Handle,
    params: cubecl::server::Handle,
    rows: usize,
    width: usize,
) -> (CubeTensor, CubeTensor) {
    let client = like.client.clone();
    let fresh = |len: usize, dtype: DType| {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            like.device.clone(),
            [len].into(),
            dtype,
        )
    };
    let stats_f = fresh(3 * rows, DType::F64);
    let stats_u = fresh(4 * rows, DType::U32);
    // SAFETY: cube r reads row r of x (`rows·width` f32) and words 3r..3r+3 of `params`
    // (`3·rows`, checked by the caller), and writes entries 3r..3r+3 of `stats_f` and 4r..4r+4 of
    // `stats_u`, both sized for `rows` rows.
    unsafe {
        super::pdl::before_launch(&client);
        row_stats_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(THREADS as u32),
            BufferArg::from_raw_parts(x, rows * width),
            BufferArg::from_raw_parts(params, 3 * rows),
            BufferArg::from_raw_parts(stats_f.handle.clone(), 3 * rows),
            BufferArg::from_raw_parts(stats_u.handle.clone(), 4 * rows),
            width as u32,
        );
    }
    (stats_f, stats_u)
}

fn launch(p: CubeTensor, q: CubeTensor, rows: CubeTensor, lanes: CubeTensor) -> CubeTensor {
    let p = burn_cubecl::kernel::into_contiguous(p);
    let q = burn_cubecl::kernel::into_contiguous(q);
    let rows = burn_cubecl::kernel::into_contiguous(rows);
    let lanes = burn_cubecl::kernel::into_contiguous(lanes);
    let [p_rows, width] = [p.meta.shape()[0], p.meta.shape()[1]];
    let q_rows = q.meta.shape()[0];
    let [count, stride] = [lanes.meta.shape()[0], lanes.meta.shape()[1]];
    let client = p.client.clone();
    let (p_f, p_u) = row_stats(&p, p.handle.clone(), rows.handle.clone(), p_rows, width);
    // Without proposal rows (every lane has 0 drafts) the kernel never reads them: the target's
    // stand in.
    let (q_buf, q_len) = if q_rows > 0 { (q.handle.clone(), q_rows) } else { (p.handle.clone(), p_rows) };
    let (q_f, q_u) = if q_rows > 0 {
        row_stats(
            &p,
            q.handle.clone(),
            rows.handle.clone().offset_start(3 * p_rows as u64 * 4),
            q_rows,
            width,
        )
    } else {
        (p_f.clone(), p_u.clone())
    };
    let fresh = |len: usize, dtype: DType| {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            p.device.clone(),
            [len].into(),
            dtype,
        )
    };
    let segs = width.div_ceil(SEGMENT);
    let decision = fresh(2 * count, DType::U32);
    let part_r = fresh(count * segs, DType::F64);
    let part_p = fresh(count * segs, DType::F64);
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        p.device.clone(),
        [count, 2].into(),
        DType::I32,
    );
    // SAFETY: every use below passes a buffer's own length.
    let rows_of = |h: &cubecl::server::Handle, n: usize| unsafe { BufferArg::from_raw_parts(h.clone(), n) };
    // SAFETY: cube l (and cubes (s, l)) read words `l·stride .. (l+1)·stride` (the caller
    // checked the shapes and that every lane's rows lie inside `p` and `q` and its drafts below
    // `width`), the rows of `p` and `q` and their statistics named there, and segment s of one
    // row; they write `decision[2l..2l+2]`, slot `l·segs + s` of each part, and `out[2l..2l+2]`,
    // all sized for `count` lanes.
    unsafe {
        super::pdl::before_launch(&client);
        accept_tests_kernel::launch_unchecked(
            &client,
            CubeCount::Static(count as u32, 1, 1),
            CubeDim::new_1d(32),
            rows_of(&p.handle, p_rows * width),
            rows_of(&q_buf, q_len * width),
            rows_of(&lanes.handle, count * stride),
            rows_of(&p_f.handle, 3 * p_rows),
            rows_of(&p_u.handle, 4 * p_rows),
            rows_of(&q_f.handle, 3 * q_len),
            rows_of(&q_u.handle, 4 * q_len),
            rows_of(&decision.handle, 2 * count),
            width as u32,
            stride as u32,
        );
        super::pdl::before_launch(&client);
        draw_partial_kernel::launch_unchecked(
            &client,
            CubeCount::Static(segs as u32, count as u32, 1),
            CubeDim::new_1d(DRAW_THREADS as u32),
            rows_of(&p.handle, p_rows * width),
            rows_of(&q_buf, q_len * width),
            rows_of(&lanes.handle, count * stride),
            rows_of(&p_f.handle, 3 * p_rows),
            rows_of(&p_u.handle, 4 * p_rows),
            rows_of(&q_f.handle, 3 * q_len),
            rows_of(&q_u.handle, 4 * q_len),
            rows_of(&decision.handle, 2 * count),
            rows_of(&part_r.handle, count * segs),
            rows_of(&part_p.handle, count * segs),
            width as u32,
            stride as u32,
        );
        super::pdl::before_launch(&client);
        draw_walk_kernel::launch_unchecked(
            &client,
            CubeCount::Static(count as u32, 1, 1),
            CubeDim::new_1d(DRAW_THREADS as u32),
            rows_of(&p.handle, p_rows * width),
            rows_of(&q_buf, q_len * width),
            rows_of(&lanes.handle, count * stride),
            rows_of(&p_f.handle, 3 * p_rows),
            rows_of(&p_u.handle, 4 * p_rows),
            rows_of(&q_f.handle, 3 * q_len),
            rows_of(&q_u.handle, 4 * q_len),
            rows_of(&decision.handle, 2 * count),
            rows_of(&part_r.handle, count * segs),
            rows_of(&part_p.handle, count * segs),
            rows_of(&out.handle, 2 * count),
            width as u32,
            stride as u32,
            segs as u32,
        );
    }
    out
}

fn out_shape(lanes: &burn::tensor::Shape) -> burn::tensor::Shape {
    [lanes[0], 2].into()
}

/// The backend extension for chain acceptance.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait ChainAcceptOps: burn::backend::Backend {
    /// `(accepted, token)` per lane, i32 `[lanes, 2]`.
    #[fusion(dtype = DType::I32, shape = out_shape(lanes))]
    fn chain_accept(
        p: burn::backend::tensor::FloatTensor<Self>,
        q: burn::backend::tensor::FloatTensor<Self>,
        rows: burn::backend::tensor::IntTensor<Self>,
        lanes: burn::backend::tensor::IntTensor<Self>,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl ChainAcceptOps for CubeBackend {
    fn chain_accept(p: CubeTensor, q: CubeTensor, rows: CubeTensor, lanes: CubeTensor) -> CubeTensor {
        launch(p, q, rows, lanes)
    }
}

/// Whether the kernel takes these rows: f32 on CUDA, rows and lanes within a grid's extent.
pub(crate) fn takes(p: &Tensor<2>, q: &Tensor<2>, lanes: usize) -> bool {
    let [p_rows, width] = p.dims();
    let [q_rows, q_width] = q.dims();
    p_rows > 0
        && lanes > 0
        && lanes <= 65_535
        && p_rows <= 65_535
        && q_rows <= 65_535
        && (q_rows == 0 || q_width == width)
        && width > 0
        && width < i32::MAX as usize
        && p.dtype() == DType::F32
        && q.dtype() == DType::F32
        && super::fused::takes_argmax(p)
}

/// See [`crate::chain_accept`]; the caller checked [`takes`] and the words.
pub(crate) fn chain_accept(
    p: Tensor<2>,
    q: Tensor<2>,
    rows: Tensor<1, Int>,
    lanes: Tensor<2, Int>,
) -> Tensor<2, Int> {
    let rows = rows.cast(DType::I32);
    let lanes = lanes.cast(DType::I32);
    Tensor::from_dispatch(<Dispatch as ChainAcceptOps>::chain_accept(
        p.into_dispatch(),
        q.into_dispatch(),
        rows.into_dispatch(),
        lanes.into_dispatch(),
    ))
}

/// The acceptance kernels (no comptime arguments), transpiled without a device (see
/// [`super::offline`]).
pub(crate) fn offline_fixed() -> Vec<Result<super::offline::KernelSource, String>> {
    use super::offline::{offline_kernel, transpile};
    vec![
        transpile(
            "accept row_stats",
            offline_kernel!(row_stats_kernel::RowStatsKernel, CubeDim::new_1d(THREADS as u32); b b b b s; ),
        ),
        transpile(
            "accept tests",
            offline_kernel!(
                accept_tests_kernel::AcceptTestsKernel,
                CubeDim::new_1d(32);
                b b b b b b b b s s;
            ),
        ),
        transpile(
            "accept draw_partial",
            offline_kernel!(
                draw_partial_kernel::DrawPartialKernel,
                CubeDim::new_1d(DRAW_THREADS as u32);
                b b b b b b b b b b s s;
            ),
        ),
        transpile(
            "accept draw_walk",
            offline_kernel!(
                draw_walk_kernel::DrawWalkKernel,
                CubeDim::new_1d(DRAW_THREADS as u32);
                b b b b b b b b b b b s s s;
            ),
        ),
    ]
}
