//! Drawing one token per row from `softmax(x / T)` on the device (see [`crate::sample_rows`]).
//!
//! Two launches. The first cuts each row into segments of [`SEGMENT`] values, one cube each:
//! the segment's largest value and its lowest index (as the argmax's first pass finds them),
//! and the f64 sum of the segment's weights `exp((x_i − m_s) / T)` relative to that local
//! maximum `m_s`. The second runs one cube per row: it merges the candidates into the row's
//! argmax and maximum `M`, and for a sampling row walks the segments in order with the weights
//! `sum_s · exp((m_s − M) / T)` until the running sum exceeds `u · total`; inside the chosen
//! segment it walks warps, then threads, then the thread's values, in index order. Every sum
//! has a fixed order, so a row's draw depends on nothing but the row and its coin.
//!
//! Where rounding leaves the target unreached at some level, the walk takes that level's last
//! positive weight, as [`crate::reference::draw_row`] does for the whole row.

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::fused::{better, warp_best};

/// Threads of a cube (both launches).
const THREADS: usize = 256;
/// Values each thread of the first launch reads.
const PER_THREAD: usize = 16;
/// Values of a row one cube of the first launch covers: a 151 936-wide vocabulary row is 38.
const SEGMENT: usize = THREADS * PER_THREAD;
/// An index no row has: no candidate.
const NONE: u32 = 0xFFFF_FFFF;

/// The temperature of row `row` (0 for the argmax) from its first draw word.
#[cube]
fn temperature(draws: &[i32], row: usize) -> f32 {
    f32::reinterpret(u32::cast_from(draws[3 * row]))
}

/// The coin of row `row`, `(hi · 2²⁷ + lo) / 2⁵³`.
#[cube]
fn coin(draws: &[i32], row: usize) -> f64 {
    coin_at(draws, 3 * row + 1)
}

/// The coin of the two words at `at`, `(hi · 2²⁷ + lo) / 2⁵³`.
#[cube]
pub(crate) fn coin_at(words: &[i32], at: usize) -> f64 {
    let hi = f64::cast_from(words[at]);
    let lo = f64::cast_from(words[at + 1]);
    (hi * 134_217_728.0f64 + lo) * (1.0f64 / 9_007_199_254_740_992.0f64)
}

/// Sum over a warp in a fixed butterfly order; every lane ends with the same bits (each level
/// adds the same two values, in either order).
#[cube]
pub(crate) fn warp_sum(v: f64) -> f64 {
    let mut s = v;
    #[unroll]
    for level in 0..5u32 {
        s += plane_shuffle_xor(s, 1u32 << level);
    }
    s
}

/// The walk of a draw over `count` slots `w[first ..]` in order: the first slot whose running
/// sum exceeds `goal` with a positive weight, and the goal left inside it; when rounding leaves
/// `goal` unreached, the last positive slot (`first` if none) and an infinite goal, so that the
/// walk inside it takes its last positive weight too.
#[cube]
pub(crate) fn walk_slots(w: &Shared<[f64]>, first: usize, count: usize, goal: f64) -> (usize, f64) {
    let mut running = 0.0f64;
    let mut found = false;
    let mut pick = first;
    let mut last = first;
    let mut left = f64::new(f32::INFINITY);
    for k in 0..count {
        let weight = w[first + k];
        let before = running;
        running += weight;
        if weight > 0.0f64 {
            last = first + k;
        }
        if !found && running > goal && weight > 0.0f64 {
            found = true;
            pick = first + k;
            left = goal - before;
        }
    }
    if !found {
        pick = last;
    }
    (pick, left)
}

/// First launch: cube `(s, r)` writes segment `s` of row `r`'s maximum, its lowest index
/// ([`NONE`] when no value exceeds −∞) and, for a sampling row, the f64 sum of its weights
/// relative to that maximum, at slot `r·segs + s`.
#[cube(launch_unchecked)]
fn draw_partial_kernel(
    x: &[f32],
    draws: &[i32],
    part_v: &mut [f32],
    part_i: &mut [u32],
    part_s: &mut [f64],
    width: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let seg = CUBE_POS_X as usize;
    let segs = CUBE_COUNT_X as usize;
    let row = CUBE_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let width = width as usize;
    let start = seg * SEGMENT;
    let mut vals = Array::<f32>::new(PER_THREAD);
    let mut best_v = f32::new(f32::NEG_INFINITY);
    let mut best_i = 0xFFFF_FFFFu32;
    #[unroll]
    for j in 0..PER_THREAD {
        let i = start + j * THREADS + tid;
        let mut v = f32::new(f32::NEG_INFINITY);
        if i < width {
            v = x[row * width + i];
        }
        vals[j] = v;
        if v > best_v {
            best_v = v;
            best_i = i as u32;
        }
    }
    let (wv, wi) = warp_best(best_v, best_i);
    let mut values = Shared::<[f32]>::new_slice(THREADS / 32);
    let mut indices = Shared::<[u32]>::new_slice(THREADS / 32);
    let mut sums = Shared::<[f64]>::new_slice(THREADS / 32);
    if lane == 0 {
        values[tid / 32] = wv;
        indices[tid / 32] = wi;
    }
    sync_cube();
    // Every thread merges the warps' candidates in the same order: the same maximum everywhere.
    let mut m = values[0];
    let mut k = indices[0];
    #[unroll]
    for w in 1..THREADS / 32 {
        let (nv, nk) = better(m, k, values[w], indices[w]);
        m = nv;
        k = nk;
    }
    let t = temperature(draws, row);
    let mut s = 0.0f64;
    if t > 0.0f32 && k != NONE {
        let mf = f64::cast_from(m);
        let tf = f64::cast_from(t);
        #[unroll]
        for j in 0..PER_THREAD {
            // Values past the row are −∞: weight 0.
            s += ((f64::cast_from(vals[j]) - mf) / tf).exp();
        }
    }
    let ws = warp_sum(s);
    if lane == 0 {
        sums[tid / 32] = ws;
    }
    sync_cube();
    if tid == 0 {
        let mut total = sums[0];
        #[unroll]
        for w in 1..THREADS / 32 {
            total += sums[w];
        }
        part_v[row * segs + seg] = m;
        part_i[row * segs + seg] = k;
        part_s[row * segs + seg] = total;
    }
}

/// Thread `tid`'s segment of chunk `c` of a parallel walk, `c·THREADS + tid`, with its weight
/// `sum_s · exp((m_s − M) / T)` (0 past the row's segments, for a segment with no candidate and
/// for a row that does not draw) stored at `weights[tid]`; then the cube syncs. Returns how many
/// of the chunk's slots hold segments.
#[cube]
#[allow(clippy::too_many_arguments)]
fn chunk_weights(
    part_v: &[f32],
    part_i: &[u32],
    part_s: &[f64],
    weights: &mut Shared<[f64]>,
    row: usize,
    segs: usize,
    c: usize,
    draws_here: bool,
    mf: f64,
    tf: f64,
) -> usize {
    let tid = UNIT_POS as usize;
    let s = c * THREADS + tid;
    let mut w = 0.0f64;
    // Nested: a cube function's `&&` evaluates both sides, and `part_i` ends at `segs`.
    #[allow(clippy::collapsible_if)]
    if draws_here && s < segs {
        if part_i[row * segs + s] != NONE {
            w = part_s[row * segs + s] * ((f64::cast_from(part_v[row * segs + s]) - mf) / tf).exp();
        }
    }
    weights[tid] = w;
    sync_cube();
    let mut n = segs - c * THREADS;
    if n > THREADS {
        n = THREADS;
    }
    n
}

/// Step 2 of [`draw_merge_kernel`] with every thread of the cube (call it from all of them):
/// the segments' weights made in parallel, `THREADS` segments at a time, and added and walked
/// in segment order by thread 0, so the total, the running sums and the pick are the serial
/// walk's bits. Returns, on thread 0, the chosen segment, the goal left inside it in its local
/// weights, and whether the row draws (`false` for a greedy row or a total that is not
/// positive).
#[cube]
#[allow(clippy::too_many_arguments)]
fn walk_segments(
    part_v: &[f32],
    part_i: &[u32],
    part_s: &[f64],
    row: usize,
    segs: usize,
    draws_here: bool,
    mf: f64,
    tf: f64,
    u: f64,
) -> (u32, f64, bool) {
    let tid = UNIT_POS as usize;
    let mut weights = Shared::<[f64]>::new_slice(THREADS);
    let chunks = segs.div_ceil(THREADS);
    // Pass 1: the total.
    let mut total = 0.0f64;
    for c in 0..chunks {
        let n = chunk_weights(part_v, part_i, part_s, &mut weights, row, segs, c, draws_here, mf, tf);
        if tid == 0 {
            for j in 0..n {
                total += weights[j];
            }
        }
        sync_cube();
    }
    // Pass 2: the walk (false for a NaN total too).
    let drew = draws_here && total > 0.0f64;
    let goal = u * total;
    let mut running = 0.0f64;
    let mut found = false;
    let mut pick = 0u32;
    let mut base = 0.0f64;
    let mut last = 0u32;
    for c in 0..chunks {
        let n = chunk_weights(part_v, part_i, part_s, &mut weights, row, segs, c, draws_here, mf, tf);
        if tid == 0 && drew {
            for j in 0..n {
                let w = weights[j];
                let before = running;
                running += w;
                if w > 0.0f64 {
                    last = (c * THREADS + j) as u32;
                }
                if !found && running > goal && w > 0.0f64 {
                    found = true;
                    pick = (c * THREADS + j) as u32;
                    base = before;
                }
            }
        }
        sync_cube();
    }
    let mut local = 0.0f64;
    if drew {
        local = f64::new(f32::INFINITY);
        if found {
            let scale = ((f64::cast_from(part_v[row * segs + pick as usize]) - mf) / tf).exp();
            local = (goal - base) / scale;
        } else {
            pick = last;
        }
    } else {
        pick = 0u32;
    }
    (pick, local, drew)
}

/// Second launch: one cube per row. The argmax from the segments' candidates; for a sampling
/// row, the draw (see the module doc).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn draw_merge_kernel(
    x: &[f32],
    draws: &[i32],
    part_v: &[f32],
    part_i: &[u32],
    part_s: &[f64],
    out: &mut [i32],
    width: u32,
    segs: u32,
    #[comptime] parallel: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let lane = tid % 32;
    let segs = segs as usize;
    let width = width as usize;

    // 1. The row's maximum and its lowest index.
    let mut v = f32::new(f32::NEG_INFINITY);
    let mut k = 0xFFFF_FFFFu32;
    let mut s = tid;
    while s < segs {
        let (nv, nk) = better(v, k, part_v[row * segs + s], part_i[row * segs + s]);
        v = nv;
        k = nk;
        s += THREADS;
    }
    let (wv, wi) = warp_best(v, k);
    let mut values = Shared::<[f32]>::new_slice(THREADS / 32);
    let mut indices = Shared::<[u32]>::new_slice(THREADS / 32);
    // The chosen segment (slot 0) and the target inside it in its local weights (slot 0 of
    // `target`); slot 1 of `chosen` is 1 when the row draws.
    let mut chosen = Shared::<[u32]>::new_slice(2usize);
    let mut target = Shared::<[f64]>::new_slice(1usize);
    let mut per_thread = Shared::<[f64]>::new_slice(THREADS);
    let mut per_warp = Shared::<[f64]>::new_slice(THREADS / 32);
    if lane == 0 {
        values[tid / 32] = wv;
        indices[tid / 32] = wi;
    }
    sync_cube();
    let mut m = values[0];
    let mut best = indices[0];
    #[unroll]
    for w in 1..THREADS / 32 {
        let (nv, nk) = better(m, best, values[w], indices[w]);
        m = nv;
        best = nk;
    }
    let t = temperature(draws, row);
    let draws_here = t > 0.0f32 && best != NONE;
    let mf = f64::cast_from(m);
    let tf = f64::cast_from(t);

    // 2. The segment, from the segments' weights in order.
    if comptime![parallel] {
        let (pick, local, drew) =
            walk_segments(part_v, part_i, part_s, row, segs, draws_here, mf, tf, coin(draws, row));
        if tid == 0 {
            chosen[0] = pick;
            chosen[1] = 0u32;
            if drew {
                chosen[1] = 1u32;
            }
            target[0] = local;
        }
    } else if tid == 0 {
        // Thread 0 makes every weight and walks them (the serial variant).
        // Defaults for a row that does not draw (read by every thread below).
        chosen[0] = 0u32;
        chosen[1] = 0u32;
        target[0] = 0.0f64;
        if draws_here {
            let mut total = 0.0f64;
            for s in 0..segs {
                if part_i[row * segs + s] != NONE {
                    total +=
                        part_s[row * segs + s] * ((f64::cast_from(part_v[row * segs + s]) - mf) / tf).exp();
                }
            }
            // False for a NaN total too.
            if total > 0.0f64 {
                let goal = coin(draws, row) * total;
                let mut running = 0.0f64;
                let mut found = false;
                let mut pick = 0u32;
                let mut base = 0.0f64;
                let mut last = 0u32;
                for s in 0..segs {
                    let mut w = 0.0f64;
                    if part_i[row * segs + s] != NONE {
                        w = part_s[row * segs + s]
                            * ((f64::cast_from(part_v[row * segs + s]) - mf) / tf).exp();
                    }
                    let before = running;
                    running += w;
                    if w > 0.0f64 {
                        last = s as u32;
                    }
                    if !found && running > goal && w > 0.0f64 {
                        found = true;
                        pick = s as u32;
                        base = before;
                    }
                }
                let mut local = f64::new(f32::INFINITY);
                if found {
                    let scale = ((f64::cast_from(part_v[row * segs + pick as usize]) - mf) / tf).exp();
                    local = (goal - base) / scale;
                } else {
                    pick = last;
                }
                chosen[0] = pick;
                chosen[1] = 1u32;
                target[0] = local;
            }
        }
    }
    sync_cube();
    let sampling = chosen[1] == 1u32;
    let pick = chosen[0] as usize;
    let start = pick * SEGMENT;
    let mut seg_max = 0.0f64;
    if sampling {
        seg_max = f64::cast_from(part_v[row * segs + pick]);
    }

    // 3. Inside the segment: each thread's 16 consecutive values, then warps, then threads.
    // The parallel variant keeps each thread's weights for its own walk at the end.
    let mut mine = Array::<f64>::new(PER_THREAD);
    let mut c = 0.0f64;
    #[unroll]
    for j in 0..PER_THREAD {
        mine[j] = 0.0f64;
    }
    if sampling {
        #[unroll]
        for j in 0..PER_THREAD {
            let i = start + tid * PER_THREAD + j;
            if i < width {
                let weight = ((f64::cast_from(x[row * width + i]) - seg_max) / tf).exp();
                c += weight;
                mine[j] = weight;
            }
        }
    }
    per_thread[tid] = c;
    sync_cube();
    if lane == 0 {
        let mut w = 0.0f64;
        for l in 0..32usize {
            w += per_thread[tid + l];
        }
        per_warp[tid / 32] = w;
    }
    sync_cube();
    if comptime![parallel] {
        // Thread 0 walks warps and threads; the chosen thread walks its own weights.
        let mut owner = Shared::<[u32]>::new_slice(1usize);
        let mut goal_in = Shared::<[f64]>::new_slice(1usize);
        if tid == 0 {
            owner[0] = NONE;
            if sampling {
                let (wpick, in_warp) = walk_slots(&per_warp, 0, THREADS / 32, target[0]);
                let (tpick, in_thread) = walk_slots(&per_thread, wpick * 32, 32, in_warp);
                owner[0] = tpick as u32;
                goal_in[0] = in_thread;
            } else {
                let mut result = 0i32;
                if best != NONE {
                    result = best as i32;
                }
                out[row] = result;
            }
        }
        sync_cube();
        if sampling && tid as u32 == owner[0] {
            let goal = goal_in[0];
            let first = start + tid * PER_THREAD;
            let mut running = 0.0f64;
            let mut found = false;
            let mut index = first;
            let mut ilast = first;
            #[unroll]
            for j in 0..PER_THREAD {
                let weight = mine[j];
                running += weight;
                if weight > 0.0f64 {
                    ilast = first + j;
                }
                if !found && running > goal && weight > 0.0f64 {
                    found = true;
                    index = first + j;
                }
            }
            if !found {
                index = ilast;
            }
            out[row] = index as i32;
        }
    } else if tid == 0 {
        let mut result = 0i32;
        if best != NONE {
            result = best as i32;
        }
        if sampling {
            // Warps, then the threads of that warp.
            let (wpick, in_warp) = walk_slots(&per_warp, 0, THREADS / 32, target[0]);
            let (tpick, in_thread) = walk_slots(&per_thread, wpick * 32, 32, in_warp);
            let goal = in_thread;
            // That thread's values.
            let mut running = 0.0f64;
            let mut found = false;
            let first = start + tpick * PER_THREAD;
            let mut index = first;
            let mut ilast = first;
            for j in 0..PER_THREAD {
                let i = first + j;
                let mut weight = 0.0f64;
                if i < width {
                    weight = ((f64::cast_from(x[row * width + i]) - seg_max) / tf).exp();
                }
                running += weight;
                if weight > 0.0f64 {
                    ilast = i;
                }
                if !found && running > goal && weight > 0.0f64 {
                    found = true;
                    index = i;
                }
            }
            if !found {
                index = ilast;
            }
            result = index as i32;
        }
        out[row] = result;
    }
}

/// Draw rows: f32 `[rows, width]` on CUDA (rows within a grid's y extent), as for the argmax.
fn launch(x: CubeTensor, draws: CubeTensor) -> CubeTensor {
    let x = burn_cubecl::kernel::into_contiguous(x);
    let draws = burn_cubecl::kernel::into_contiguous(draws);
    let [rows, width] = [x.meta.shape()[0], x.meta.shape()[1]];
    let segs = width.div_ceil(SEGMENT);
    let client = x.client.clone();
    // One buffer (one allocation per call, as for the argmax): the `rows` i32 results, the
    // candidates' values (f32) and indices (u32), then their f64 sums at an 8-byte boundary.
    let cand = rows * segs;
    let sums_at = (rows + 2 * cand).next_multiple_of(2);
    let all = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        [sums_at + 2 * cand].into(),
        DType::I32,
    );
    let word = 4u64;
    let part_v = all.handle.clone().offset_start(rows as u64 * word);
    let part_i = all.handle.clone().offset_start((rows + cand) as u64 * word);
    let part_s = all.handle.clone().offset_start(sums_at as u64 * word);
    // SAFETY: cube (s, r) of the first launch reads elements `s·SEGMENT ..` below `width` of
    // row r of x (`rows·width` f32) and words `3r .. 3r + 3` of `draws` (`3·rows` i32, checked
    // by the caller), and writes slot `r·segs + s` of each candidate section (`cand` entries
    // each). The second reads row r's slots, row r of x inside one segment, and writes result
    // r. The sections do not overlap and lie within the buffer.
    unsafe {
        super::pdl::before_launch(&client);
        draw_partial_kernel::launch_unchecked(
            &client,
            CubeCount::Static(segs as u32, rows as u32, 1),
            CubeDim::new_1d(THREADS as u32),
            BufferArg::from_raw_parts(x.handle.clone(), rows * width),
            BufferArg::from_raw_parts(draws.handle.clone(), 3 * rows),
            BufferArg::from_raw_parts(part_v.clone(), cand),
            BufferArg::from_raw_parts(part_i.clone(), cand),
            BufferArg::from_raw_parts(part_s.clone(), cand),
            width as u32,
        );
        super::pdl::before_launch(&client);
        draw_merge_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(THREADS as u32),
            BufferArg::from_raw_parts(x.handle.clone(), rows * width),
            BufferArg::from_raw_parts(draws.handle.clone(), 3 * rows),
            BufferArg::from_raw_parts(part_v, cand),
            BufferArg::from_raw_parts(part_i, cand),
            BufferArg::from_raw_parts(part_s, cand),
            BufferArg::from_raw_parts(all.handle.clone(), rows),
            width as u32,
            segs as u32,
            crate::parallel_draws(),
        );
    }
    CubeTensor::new_contiguous(client, x.device.clone(), [rows].into(), all.handle, DType::I32)
}

fn rows_shape(x: &burn::tensor::Shape) -> burn::tensor::Shape {
    [x[0]].into()
}

/// The backend extension for the draws.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait SampleOps: burn::backend::Backend {
    /// One draw (or argmax) per row, i32.
    #[fusion(dtype = DType::I32, shape = rows_shape(x))]
    fn sample_rows(
        x: burn::backend::tensor::FloatTensor<Self>,
        draws: burn::backend::tensor::IntTensor<Self>,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl SampleOps for CubeBackend {
    fn sample_rows(x: CubeTensor, draws: CubeTensor) -> CubeTensor {
        launch(x, draws)
    }
}

/// See [`crate::sample_rows`]; the caller checked [`super::fused::takes_argmax`].
///
/// # Panics
/// If `draws` does not hold `3·rows` values.
pub(crate) fn sample_rows(x: Tensor<2>, draws: Tensor<1, Int>) -> Tensor<1, Int> {
    let rows = x.dims()[0];
    assert_eq!(draws.dims()[0], 3 * rows, "sample_rows: {} draw words for {rows} rows", draws.dims()[0]);
    let draws = draws.cast(DType::I32);
    Tensor::from_dispatch(<Dispatch as SampleOps>::sample_rows(x.into_dispatch(), draws.into_dispatch()))
}

/// The sampling kernels (the merge with and without [`crate::set_parallel_draws`]), transpiled without a device (see
/// [`super::offline`]).
pub(crate) fn offline_fixed() -> Vec<Result<super::offline::KernelSource, String>> {
    use super::offline::{offline_kernel, transpile};
    vec![
        transpile(
            "sample draw_partial",
            offline_kernel!(
                draw_partial_kernel::DrawPartialKernel,
                CubeDim::new_1d(THREADS as u32);
                b b b b b s;
            ),
        ),
        transpile(
            "sample draw_merge",
            offline_kernel!(
                draw_merge_kernel::DrawMergeKernel,
                CubeDim::new_1d(THREADS as u32);
                b b b b b b s s;
                false
            ),
        ),
        transpile(
            "sample draw_merge parallel",
            offline_kernel!(
                draw_merge_kernel::DrawMergeKernel,
                CubeDim::new_1d(THREADS as u32);
                b b b b b b s s;
                true
            ),
        ),
    ]
}
