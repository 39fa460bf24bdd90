//! Skinny GEMM on tensor cores: `y = x · Wᵀ` for a bf16 weight `[out, in]` in its checkpoint
//! layout and a few bf16 activation rows (a decode step, a verify window, a few lanes).
//!
//! # How one cube works
//! A cube owns 16 consecutive weight rows (the `M` side of `mma.sync.m16n8k16`, bf16 operands,
//! f32 accumulators) and every activation row of the call, 8 at a time (the `N` side). Its
//! `WARPS` warps split the reduction axis: warp `w` takes the 32-wide chunks `w, w + WARPS, …`
//! of `in`. Every global load is 16 bytes (8 bf16): lane `(g, t)` (group `g = lane / 4`,
//! `t = lane % 4`) reads weight rows `g` and `g + 8` and activation row `g` at the same 8
//! consecutive `k`, and splits them over two mma steps. The mapping of those `k` to the
//! instruction's `k` slots is a permutation, the same for the weight and the activation, so every
//! dot product is unchanged. The warps' partial sums meet in shared memory and are added in warp
//! order.
//!
//! # Splitting the reduction across cubes
//! A matrix with few output rows (a `[4096, 4096]` o projection has 256 blocks of 16) gives each
//! warp a long chain of dependent loads, and the time of a 1-row product is then set by memory
//! latency, not bandwidth. A [`GemmPlan`](crate::GemmPlan) may cut the reduction axis into `splits` equal ranges
//! of chunks, one cube per (16 rows, range): each writes its f32 sums, and a second kernel adds
//! the ranges in order and rounds to bf16. `depth` is how many chunks a warp loads before it
//! multiplies.
//!
//! # Batch invariance
//! Nothing in a row's reduction depends on the other rows: the chunk order of each warp, the
//! mma tree inside one instruction, the warp order and the split order of the final sums depend
//! only on the matrix's shape (the plan is chosen from `in` and `out`, never from the number of
//! rows; `depth` changes when loads are issued, not the order of the sums). A row therefore gets
//! bit-identical results whether it is computed alone, inside a verify window or among other
//! lanes (the GPU tests check it).

use burn::backend::Dispatch;
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::bf16;

use super::fused::{lanes_best, swiglu_value};
use super::offline::{KernelSource, offline_kernel, transpile};

/// 16 bytes: eight bf16 as four 32-bit registers (element `2i` in the low half of word `i`).
type Words = Vector<u32, Const<4>>;

pub(crate) use crate::gemm_plan::{WARPS, Weights, plan};
/// Most activation rows one launch handles (8 per mma tile); larger calls are split on the host.
pub(crate) const MAX_ROWS: usize = 64;

/// One cube: `16 · mtiles` weight rows × every activation row of the call (`8 · tiles` slots).
///
/// `x`: `[rows, in]`, `w`: `[out, in]`, both contiguous bf16 read as words; `y`: `[rows, out]`.
/// `in_words = in / 8`; `in` a multiple of 32, `out` a multiple of `16 · mtiles`. Each weight
/// block of 16 rows is summed exactly as in a cube of its own (same chunks per warp, same mma
/// sequence, same warp order): `mtiles` changes only how often an activation row is fetched.
/// With `argmax` (a Markov step, see [`argmax_candidate`]) `y` is not written: `logits` holds
/// the step's base logits (row `r` at `r · stride`) and `slots` the rows' running argmax.
/// (`x` is only read; it is `&mut` because the cube's body, [`gemm_block`], also reads
/// activations that other cubes of a chained launch write; see [`super::chain`].)
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn skinny_gemm_kernel(
    x: &mut [Words],
    w: &[Words],
    y: &mut [bf16],
    parts: &mut [f32],
    logits: &[bf16],
    slots: &[Atomic<u64>],
    rows: u32,
    in_words: u32,
    out: u32,
    stride: u32,
    #[comptime] tiles: usize,
    #[comptime] warps: usize,
    #[comptime] unroll: usize,
    #[comptime] splits: usize,
    #[comptime] swiglu: bool,
    #[comptime] mtiles: usize,
    #[comptime] argmax: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let mut wa = Array::<Words>::new(unroll * mtiles);
    let mut wb = Array::<Words>::new(unroll * mtiles);
    gemm_block(
        x,
        w,
        y,
        parts,
        logits,
        slots,
        rows as usize,
        in_words as usize,
        out as usize,
        stride as usize,
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        &mut wa,
        &mut wb,
        tiles,
        warps,
        unroll,
        splits,
        swiglu,
        mtiles,
        argmax,
        0usize,
    );
}

/// Where a cube's first step of weight words starts, for [`gemm_block`] and
/// [`gemm_first_weights`]: `(first chunk of the cube's range, chunks in the range, the lane's
/// first word)`.
#[cube]
fn cube_range(
    in_words: usize,
    block: usize,
    split: usize,
    #[comptime] splits: usize,
    #[comptime] mtiles: usize,
) -> (usize, usize, usize) {
    let lane = UNIT_POS_X as usize;
    let g = lane / 4;
    let t = lane % 4;
    let chunks = in_words / 4 / splits;
    (split * chunks, chunks, (block * 16 * mtiles + g) * in_words + t)
}

/// The weight words of the first `early` chunk slots of the first step of [`gemm_block`]'s loop
/// for cube `(block, split)`, loaded into `wa` and `wb` before the cube may read its activations
/// (a product chained behind another loads them while it waits; then [`gemm_block`] runs with the
/// same `early`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_first_weights(
    w: &[Words],
    wa: &mut Array<Words>,
    wb: &mut Array<Words>,
    in_words: usize,
    block: usize,
    split: usize,
    #[comptime] warps: usize,
    #[comptime] unroll: usize,
    #[comptime] splits: usize,
    #[comptime] mtiles: usize,
    #[comptime] early: usize,
) {
    let warp = UNIT_POS_Y as usize;
    let (first, chunks, w_lo) = cube_range(in_words, block, split, splits, mtiles);
    let zero = Words::new(0u32);
    #[unroll]
    for u in 0..comptime!(early.min(unroll)) {
        let local = u * warps + warp;
        load_weight_blocks(w, wa, wb, w_lo, in_words, first + local, local < chunks, zero, u, mtiles);
    }
}

/// One cube of [`skinny_gemm_kernel`], cube `(block, split)` of its grid, with `wa` and `wb` the
/// registers of a step's weight words (the first `early` chunk slots of the first step already
/// loaded by [`gemm_first_weights`]; 0 for none). A cube's sums do not depend on where it runs: the products chained
/// in one launch ([`super::chain`]) give each block the bits of its own launch.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_block(
    x: &mut [Words],
    w: &[Words],
    y: &mut [bf16],
    parts: &mut [f32],
    logits: &[bf16],
    slots: &[Atomic<u64>],
    rows: usize,
    in_words: usize,
    out: usize,
    stride: usize,
    block: usize,
    split: usize,
    wa: &mut Array<Words>,
    wb: &mut Array<Words>,
    #[comptime] tiles: usize,
    #[comptime] warps: usize,
    #[comptime] unroll: usize,
    #[comptime] splits: usize,
    #[comptime] swiglu: bool,
    #[comptime] mtiles: usize,
    #[comptime] argmax: bool,
    #[comptime] early: usize,
) {
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let g = lane / 4;
    let t = lane % 4;
    // This cube's range of chunks: `[first, first + chunks)`.
    let (first, chunks, w_lo) = cube_range(in_words, block, split, splits, mtiles);

    let def = MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);

    // Accumulators: slot m·tiles + j holds, for weight block m of the cube, (weight row g, x row
    // 8j+2t), (g, 8j+2t+1), (g+8, 8j+2t), (g+8, 8j+2t+1).
    let mut acc = Array::<Vector<f32, Const<4>>>::new(mtiles * tiles);
    #[unroll]
    for j in 0..mtiles * tiles {
        acc[j] = Vector::<f32, Const<4>>::new(0.0f32);
    }

    let zero = Words::new(0u32);

    // With `argmax`, the base logits the epilogue adds, loaded now.
    let mut pre = Array::<f32>::new((mtiles * tiles * 128).div_ceil(warps * 32));
    if comptime![argmax] {
        argmax_prefetch(logits, &mut pre, stride, rows, block, warp * 32 + lane, tiles, mtiles, warps);
    }

    let steps = chunks.div_ceil(warps * unroll);
    for step in 0..steps {
        // 1. Loads: `unroll` chunks of both weight rows (the first step's `early` slots are in)
        //    and of every activation row.
        let mut xs = Array::<Words>::new(unroll * tiles);
        #[unroll]
        for u in 0..unroll {
            let local = (step * unroll + u) * warps + warp;
            let chunk = first + local;
            if comptime![u < early] {
                if step > 0 {
                    load_weight_blocks(w, wa, wb, w_lo, in_words, chunk, local < chunks, zero, u, mtiles);
                }
            } else {
                load_weight_blocks(w, wa, wb, w_lo, in_words, chunk, local < chunks, zero, u, mtiles);
            }
            #[unroll]
            for j in 0..tiles {
                let row = j * 8 + g;
                if local < chunks && row < rows {
                    xs[u * tiles + j] = x[row * in_words + chunk * 4 + t];
                } else {
                    xs[u * tiles + j] = zero;
                }
            }
        }
        // 2. Two mma steps per chunk: the first four k of each 8 go to step 0, the rest to 1.
        #[unroll]
        for u in 0..unroll {
            #[unroll]
            for s in 0..2usize {
                #[unroll]
                for m in 0..mtiles {
                    let mut a_words = Words::new(0u32);
                    a_words.insert(0usize, wa[u * mtiles + m].extract(2 * s));
                    a_words.insert(1usize, wb[u * mtiles + m].extract(2 * s));
                    a_words.insert(2usize, wa[u * mtiles + m].extract(2 * s + 1));
                    a_words.insert(3usize, wb[u * mtiles + m].extract(2 * s + 1));
                    let mut a = Array::<Vector<bf16, Const<8>>>::new(1usize);
                    a[0] = Vector::<bf16, Const<8>>::reinterpret(a_words);
                    #[unroll]
                    for j in 0..tiles {
                        let xw = xs[u * tiles + j];
                        let mut b_words = Vector::<u32, Const<2>>::new(0u32);
                        b_words.insert(0usize, xw.extract(2 * s));
                        b_words.insert(1usize, xw.extract(2 * s + 1));
                        let mut b = Array::<Vector<bf16, Const<4>>>::new(1usize);
                        b[0] = Vector::<bf16, Const<4>>::reinterpret(b_words);
                        let mut c = Array::<Vector<f32, Const<4>>>::new(1usize);
                        c[0] = acc[m * tiles + j];
                        def.execute_inplace(&a, &b, &mut c);
                        acc[m * tiles + j] = c[0];
                    }
                }
            }
        }
    }

    // 3. Partial sums of every warp into shared memory, laid out
    //    [warp][weight block][tile][x row][weight row].
    let tile_len = 128usize;
    let mut partial = Shared::<[f32]>::new_slice(warps * mtiles * tiles * 128);
    let base = warp * mtiles * tiles * tile_len;
    #[unroll]
    for j in 0..mtiles * tiles {
        let v = acc[j];
        let at = base + j * tile_len;
        partial[at + (2 * t) * 16 + g] = v.extract(0usize);
        partial[at + (2 * t + 1) * 16 + g] = v.extract(1usize);
        partial[at + (2 * t) * 16 + g + 8] = v.extract(2usize);
        partial[at + (2 * t + 1) * 16 + g + 8] = v.extract(3usize);
    }
    sync_cube();

    // 4. Sum over warps in warp order and write bf16 (or, for one split of several, the f32 sum
    //    into its slice of `parts`); consecutive threads write consecutive output features of
    //    one row.
    let threads = warps * 32;
    let id = warp * 32 + lane;
    let total = mtiles * tiles * tile_len;
    if comptime![swiglu] {
        // 4'. A paired gate/up weight (see `launch_swiglu`): weight rows 0..8 of this cube are
        //     gate rows 8·block.., rows 8..16 the matching up rows. Each thread sums one gate and
        //     its up in warp order, rounds both to bf16 (the product's own output) and writes
        //     `silu(g)·u` with the roundings of the SwiGLU kernel to column 8·block + wr of a
        //     `[rows, out / 2]` output.
        swiglu_epilogue(&partial, &*parts, y, rows, out, block, id, tiles, mtiles, warps, false);
    } else {
        let passes = total.div_ceil(threads);
        #[unroll]
        for p in 0..passes {
            let e = p * threads + id;
            if e < total {
                let mut sum = 0.0f32;
                #[unroll]
                for v in 0..warps {
                    sum += partial[v * total + e];
                }
                let q = e / tile_len;
                let j = q % tiles;
                let col = (block * mtiles + q / tiles) * 16 + (e % tile_len) % 16;
                let within = e % tile_len;
                let row = j * 8 + within / 16;
                if comptime![argmax] {
                    argmax_candidate(sum, pre[p], row, rows, col, slots);
                } else if row < rows {
                    if comptime![splits > 1] {
                        parts[(split * rows + row) * out + col] = sum;
                    } else {
                        y[row * out + col] = bf16::cast_from(sum);
                    }
                }
            }
        }
    }
}

/// Step 4' of the paired gate/up products, bf16 ([`skinny_gemm_kernel`]) and FP8
/// (`fp8_gemm_kernel`): thread `id` takes the pairs `e = id, id + threads, …` of the cube's
/// `mtiles · tiles · 64` (weight block `q / tiles` of the cube and activation tile `q % tiles`
/// for `q = e / 64`, activation row `(e % 64) / 8` of the tile, gate row `e % 8` of the block),
/// sums the warps' partial sums of that gate row and of its up row 8 rows below in warp order,
/// multiplies each by its row's scale when `scaled` (FP8 with per-row scales), rounds both to
/// bf16 (the product's own output) and writes their [`swiglu_value`] to column
/// `8 · block + gate row` of a `[rows, out / 2]` output. `partial` is laid out as step 3 of
/// both kernels leaves it; `scales` is read only when `scaled`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn swiglu_epilogue(
    partial: &Shared<[f32]>,
    scales: &[f32],
    y: &mut [bf16],
    rows: usize,
    out: usize,
    block: usize,
    id: usize,
    #[comptime] tiles: usize,
    #[comptime] mtiles: usize,
    #[comptime] warps: usize,
    #[comptime] scaled: bool,
) {
    let threads = warps * 32;
    let tile_len = 128usize;
    let total = mtiles * tiles * tile_len;
    let half = out / 2;
    let pairs = mtiles * tiles * 64;
    #[unroll]
    for p in 0..pairs.div_ceil(threads) {
        let e = p * threads + id;
        if e < pairs {
            let q = e / 64;
            let j = q % tiles;
            let wblock = block * mtiles + q / tiles;
            let col = wblock * 8;
            let xr = (e % 64) / 8;
            let wr = e % 8;
            let at = q * tile_len + xr * 16 + wr;
            let mut gs = 0.0f32;
            let mut us = 0.0f32;
            #[unroll]
            for v in 0..warps {
                gs += partial[v * total + at];
                us += partial[v * total + at + 8];
            }
            if comptime![scaled] {
                gs *= scales[wblock * 16 + wr];
                us *= scales[wblock * 16 + wr + 8];
            }
            let row = j * 8 + xr;
            if row < rows {
                let gv = f32::cast_from(bf16::cast_from(gs));
                let uv = f32::cast_from(bf16::cast_from(us));
                y[row * half + col + wr] = swiglu_value(gv, uv);
            }
        }
    }
}

/// The step's base logits the argmax epilogue ([`argmax_candidate`]) adds, loaded before the
/// product streams its weight so that their latency is not paid after it: for each pass `p` of
/// the epilogue, element `e = p · threads + id` (activation row `row`, output column `col`, as
/// the epilogue maps it) gets `f32(logits[row · stride + col])` in `pre[p]`, or −∞ where `e` or
/// its row lies past the end.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn argmax_prefetch(
    logits: &[bf16],
    pre: &mut Array<f32>,
    stride: usize,
    rows: usize,
    block: usize,
    id: usize,
    #[comptime] tiles: usize,
    #[comptime] mtiles: usize,
    #[comptime] warps: usize,
) {
    let threads = warps * 32;
    let total = mtiles * tiles * 128;
    #[unroll]
    for p in 0..total.div_ceil(threads) {
        let e = p * threads + id;
        let q = e / 128;
        let within = e % 128;
        let row = (q % tiles) * 8 + within / 16;
        let col = (block * mtiles + q / tiles) * 16 + within % 16;
        if e < total && row < rows {
            pre[p] = f32::cast_from(logits[row * stride + col]);
        } else {
            pre[p] = f32::new(f32::NEG_INFINITY);
        }
    }
}

/// Slots of a lane's running argmax in a fused Markov step: cube `c` of the product merges its
/// candidate into slot `c % MARKOV_SLOTS`, so that some 300 cubes (of 9496 over a 151 936-wide
/// vocabulary) share an address, and the pick reads one slot a lane of its warp.
pub(crate) const MARKOV_SLOTS: usize = 32;
/// u64 words from one slot to the next: 128 bytes, a cache line each, so that no two slots'
/// atomics meet at one line (adjacent slots measured the same on the H100).
pub(crate) const SLOT_STRIDE: usize = 16;

/// The order of candidates as one integer, for `fetch_max`: the value's bits made monotone
/// (−0 taken as +0, so equal values have equal keys) in the high word, the index's complement
/// in the low word, so that a larger key is a larger value or, for equal values, a lower index:
/// the rule of [`better`](super::fused::better). A valid candidate (a value above −∞, never
/// NaN) has a high word of at least `0x0080_0000`, so 0 means "none".
#[cube]
pub(crate) fn candidate_key(v: f32, i: u32) -> u64 {
    let mut b = u32::reinterpret(v);
    if v == 0.0f32 {
        b = 0u32;
    }
    let mut key = b | 0x8000_0000u32;
    if b >= 0x8000_0000u32 {
        key = b ^ 0xFFFF_FFFFu32;
    }
    (u64::cast_from(key) << 32u64) | u64::cast_from(i ^ 0xFFFF_FFFFu32)
}

/// Step 4'' of a Markov step's W2 product, bf16 ([`skinny_gemm_kernel`]) and FP8
/// (`fp8_gemm_kernel`) with `argmax`: output `(row, col)`'s f32 sum `sum` (scaled, for FP8 with
/// per-row scales) is rounded to bf16 as the product would store it, widened, and added to the
/// step's base logit `base` (`f32(logits[row · stride + col])`, from [`argmax_prefetch`]): the
/// value the unfused argmax ([`crate::argmax_sum_rows`]) forms. The 16 threads of a 16-column
/// block of one row (aligned lanes of one warp: `e` and the lane agree in their low five bits)
/// merge their values by the order-free rule of [`better`](super::fused::better) (largest
/// first, then the lowest column; NaN and −∞ never win), and the block's first thread merges the
/// winner's [`candidate_key`] into the row's slot `(col / 16) % MARKOV_SLOTS` of `slots`
/// (`SLOT_STRIDE` words apart) with an atomic max. Rows past `rows` join the shuffles with no
/// candidate. Every thread of a warp that reaches this must call it (the shuffles span the
/// warp): the kernels call it for all elements `e < total`, and `total` is a multiple of 128, so
/// whole warps take it or skip it.
///
/// The epilogue makes a Markov W2 product about 3 µs longer on the H100 (17.0 → 20.0 µs under
/// Nsight); a plain read to skip the atomic for losing blocks, and slots in one cache line
/// instead of one a line, measured the same (`benches/results/2026-12-06-h100-markov.md`).
#[cube]
#[allow(clippy::manual_is_multiple_of)] // cube code: `%` on a column index
pub(crate) fn argmax_candidate(
    sum: f32,
    base: f32,
    row: usize,
    rows: usize,
    col: usize,
    slots: &[Atomic<u64>],
) {
    let mut best_v = f32::new(f32::NEG_INFINITY);
    let mut best_i = 0xFFFF_FFFFu32;
    if row < rows {
        let v = base + f32::cast_from(bf16::cast_from(sum));
        if v > best_v {
            best_v = v;
            best_i = col as u32;
        }
    }
    let (best_v, best_i) = lanes_best(best_v, best_i, 4u32);
    if col % 16 == 0 && row < rows && best_i != 0xFFFF_FFFFu32 {
        let key = candidate_key(best_v, best_i);
        // The old value is not used: a reduction the cube does not wait for.
        slots[(row * MARKOV_SLOTS + (col / 16) % MARKOV_SLOTS) * SLOT_STRIDE].fetch_max(key);
    }
}

/// Slot `u` of a step's weight loads, for the bf16 and FP8 skinny GEMMs: both 8-row halves of
/// each of the cube's `mtiles` 16-row weight blocks at `chunk` (one word per lane each; the
/// lane's first word is `w_lo`, a weight row is `w_words` words), or `zero` past the cube's
/// chunks (`valid` false).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_weight_blocks(
    w: &[Words],
    wa: &mut Array<Words>,
    wb: &mut Array<Words>,
    w_lo: usize,
    w_words: usize,
    chunk: usize,
    valid: bool,
    zero: Words,
    #[comptime] u: usize,
    #[comptime] mtiles: usize,
) {
    #[unroll]
    for m in 0..mtiles {
        let lo = w_lo + m * 16 * w_words;
        if valid {
            wa[u * mtiles + m] = w[lo + chunk * 4];
            wb[u * mtiles + m] = w[lo + 8 * w_words + chunk * 4];
        } else {
            wa[u * mtiles + m] = zero;
            wb[u * mtiles + m] = zero;
        }
    }
}

/// `y[i] = bf16(parts[0][i] + parts[1][i] + …)`, adding the splits in order; `parts` is
/// `[splits, len]` f32.
#[cube(launch_unchecked)]
pub(crate) fn combine_splits_kernel(parts: &[f32], y: &mut [bf16], len: u32, #[comptime] splits: usize) {
    crate::cuda::pdl::dependency_wait();
    let i = ABSOLUTE_POS;
    let len = len as usize;
    if i < len {
        let mut sum = parts[i];
        #[unroll]
        for s in 1..splits {
            sum += parts[s * len + i];
        }
        y[i] = bf16::cast_from(sum);
    }
}

/// Threads of a [`combine_splits_kernel`] cube.
const COMBINE_THREADS: usize = 256;

/// Launches [`combine_splits_kernel`] over `len` outputs of `y` (a bf16 buffer from its own
/// start) from `parts` (`[splits, len]` f32).
pub(crate) fn combine_splits(
    client: &cubecl::client::Client,
    parts: &CubeTensor,
    y: cubecl::server::Handle,
    len: usize,
    splits: usize,
) {
    let threads = COMBINE_THREADS;
    // SAFETY: `parts` holds `splits · len` f32 and `y` at least `len` bf16 from its start; the
    // kernel touches index `i < len` of each split and of `y` only.
    unsafe {
        super::pdl::before_launch(client);
        combine_splits_kernel::launch_unchecked(
            client,
            CubeCount::Static(len.div_ceil(threads) as u32, 1, 1),
            CubeDim::new_1d(threads as u32),
            BufferArg::from_raw_parts(parts.handle.clone(), splits * len),
            BufferArg::from_raw_parts(y, len),
            len as u32,
            splits,
        );
    }
}

/// Whether [`linear`] runs this product: a CUDA device, bf16 on both sides, matching inner
/// dimensions and [`supported`] shapes.
pub(crate) fn takes(x: &Tensor<2>, w: &Tensor<2>) -> bool {
    let [rows, inp] = x.dims();
    let [out, w_in] = w.dims();
    inp == w_in
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && supported(rows, inp, out)
        && matches!(x.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// `x · wᵀ` through the kernel, on burn tensors that [`takes`] accepted.
pub(crate) fn linear(x: Tensor<2>, w: &Tensor<2>) -> Tensor<2> {
    let y = <Dispatch as SkinnyGemmOps>::skinny_gemm(x.into_dispatch(), w.clone().into_dispatch());
    Tensor::from_dispatch(y)
}

/// Whether the kernel takes this problem: bf16 on both sides, `in` a multiple of 32 and `out` a
/// multiple of 16 (every Qwen3 and DSpark projection, and the LM heads).
pub(crate) fn supported(rows: usize, inp: usize, out: usize) -> bool {
    rows > 0 && inp > 0 && out > 0 && inp.is_multiple_of(32) && out.is_multiple_of(16)
}

/// What a product hands out: its rows, or the f32 partial sums of a split product whose
/// combine the caller folds into its next kernel (see [`launch_product`]).
pub(crate) enum Product {
    /// `[rows, out]` bf16.
    Rows(CubeTensor),
    /// `[splits, rows, out]` f32, added in split order and rounded once to bf16 by the reader
    /// (as [`combine_splits_kernel`] does).
    Parts(CubeTensor, usize),
}

/// `x · wᵀ` on CubeCL tensors; `x` `[rows, in]`, `w` `[out, in]`, both bf16 and contiguous.
///
/// # Panics
/// If the shapes are not [`supported`] or the tensors are not contiguous bf16 (the caller checks).
pub(crate) fn launch(x: CubeTensor, w: CubeTensor) -> CubeTensor {
    match launch_product(x, w, false) {
        Product::Rows(y) => y,
        // Only a deferred product hands out its parts.
        Product::Parts(..) => unreachable!("a product that was not deferred is combined"),
    }
}

/// [`launch`], or with `defer` for a split plan and at most [`MAX_ROWS`] rows (one launch), the
/// split sums uncombined: the caller's next kernel adds them ([`Product::Parts`]).
pub(crate) fn launch_product(x: CubeTensor, w: CubeTensor, defer: bool) -> Product {
    let x = burn_cubecl::kernel::into_contiguous(x);
    let w = burn_cubecl::kernel::into_contiguous(w);
    let [rows, inp] = [x.meta.shape()[0], x.meta.shape()[1]];
    let out = w.meta.shape()[0];
    assert!(supported(rows, inp, out), "skinny_gemm: unsupported shape [{rows}, {inp}] x [{out}, {inp}]");
    let client = x.client.clone();
    let in_words = inp / 8;
    let plan = plan(Weights::Bf16, inp / 32, out);
    let parts = split_scratch(&x, plan.splits, rows.min(MAX_ROWS) * out);
    let deferred = defer && parts.is_some() && rows <= MAX_ROWS;
    // Contiguous: the default allocation pads rows to an alignment (an LM head's 151936 bf16
    // rows would get a longer pitch), and the kernel writes rows `out` apart. A deferred
    // product never writes it: a one-element stand-in.
    let y = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        if deferred { [1, 1].into() } else { [rows, out].into() },
        x.dtype,
    );
    let mut start = 0;
    while start < rows {
        let n = (rows - start).min(MAX_ROWS);
        let tiles = launch_tiles(n);
        let mt = plan.mtiles(tiles, out, inp / 32);
        // Row `start` of x and of y: byte offsets into the same buffers.
        let x_handle = x.handle.clone().offset_start((start * inp * 2) as u64);
        let y_handle = y.handle.clone().offset_start((start * out * 2) as u64);
        // Without splits the kernel never touches `parts`: y's own buffer stands in.
        let (parts_handle, parts_len) = match &parts {
            Some(p) => (p.handle.clone(), plan.splits * n * out),
            None => (y_handle.clone(), n * out / 2),
        };
        // SAFETY: the lengths below are the buffers' sizes from `start` on, in the kernel's
        // element units (16-byte words for x and w, bf16 for y, f32 for parts); the kernel reads
        // x rows `< n`, w rows `< out`, and writes y rows `< n` (or parts `[splits, n, out]`).
        unsafe {
            super::pdl::before_launch(&client);
            skinny_gemm_kernel::launch_unchecked(
                &client,
                CubeCount::Static((out / 16 / mt) as u32, plan.splits as u32, 1),
                CubeDim::new_2d(32, WARPS as u32),
                BufferArg::from_raw_parts(x_handle.clone(), n * in_words),
                BufferArg::from_raw_parts(w.handle.clone(), out * in_words),
                BufferArg::from_raw_parts(y_handle.clone(), if deferred { 1 } else { n * out }),
                BufferArg::from_raw_parts(parts_handle, parts_len),
                // `logits` and `slots` are touched only with `argmax`: x's buffer stands in.
                BufferArg::from_raw_parts(x_handle.clone(), 1),
                BufferArg::from_raw_parts(x_handle, 1),
                n as u32,
                in_words as u32,
                out as u32,
                0u32,
                tiles,
                WARPS,
                plan.unroll_with(tiles, mt, inp / 32, WARPS),
                plan.splits,
                false,
                mt,
                false,
            );
        }
        if let Some(p) = &parts
            && !deferred
        {
            combine_splits(&client, p, y_handle, n * out, plan.splits);
        }
        start += n;
    }
    match parts {
        Some(p) if deferred => Product::Parts(p, plan.splits),
        _ => Product::Rows(y),
    }
}

/// Whether [`launch_swiglu`] takes this problem: [`takes`], a paired weight of an even number
/// of 16-row blocks, and a plan that does not cut the reduction (the epilogue sums whole rows).
pub(crate) fn takes_swiglu(x: &Tensor<2>, w: &Tensor<2>) -> bool {
    let [out, inp] = w.dims();
    takes(x, w) && swiglu_plan_fits(inp, out)
}

/// Whether an `[out, in]` paired weight's plan leaves the reduction whole, as the SwiGLU
/// epilogue needs.
pub(crate) fn swiglu_plan_fits(inp: usize, out: usize) -> bool {
    plan(Weights::Bf16, inp / 32, out).splits == 1
}

/// `silu(g)·u` of a paired gate/up weight in one pass: `x` `[rows, in]`, `w` `[out, in]` whose
/// 16-row block `b` holds gate rows `8b..8b+8` then up rows `8b..8b+8` → `[rows, out / 2]`.
/// The values are those of the product (rounded to bf16) followed by the SwiGLU kernel.
pub(crate) fn launch_swiglu(x: CubeTensor, w: CubeTensor) -> CubeTensor {
    let x = burn_cubecl::kernel::into_contiguous(x);
    let w = burn_cubecl::kernel::into_contiguous(w);
    let [rows, inp] = [x.meta.shape()[0], x.meta.shape()[1]];
    let out = w.meta.shape()[0];
    let plan = plan(Weights::Bf16, inp / 32, out);
    assert!(
        supported(rows, inp, out) && plan.splits == 1,
        "skinny_gemm_swiglu: unsupported shape [{rows}, {inp}] x [{out}, {inp}]"
    );
    let client = x.client.clone();
    let half = out / 2;
    let y = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        [rows, half].into(),
        x.dtype,
    );
    let in_words = inp / 8;
    let mut start = 0;
    while start < rows {
        let n = (rows - start).min(MAX_ROWS);
        let tiles = launch_tiles(n);
        let mt = plan.mtiles(tiles, out, inp / 32);
        let x_handle = x.handle.clone().offset_start((start * inp * 2) as u64);
        let y_handle = y.handle.clone().offset_start((start * half * 2) as u64);
        // SAFETY: as in `launch_product` (no splits: `parts` is never touched, y's buffer stands
        // in); the epilogue writes y rows `< n` of `half` columns, column `8·block + wr < half`.
        unsafe {
            super::pdl::before_launch(&client);
            skinny_gemm_kernel::launch_unchecked(
                &client,
                CubeCount::Static((out / 16 / mt) as u32, 1, 1),
                CubeDim::new_2d(32, WARPS as u32),
                BufferArg::from_raw_parts(x_handle.clone(), n * in_words),
                BufferArg::from_raw_parts(w.handle.clone(), out * in_words),
                BufferArg::from_raw_parts(y_handle.clone(), n * half),
                BufferArg::from_raw_parts(y_handle, n * half / 2),
                BufferArg::from_raw_parts(x_handle.clone(), 1),
                BufferArg::from_raw_parts(x_handle, 1),
                n as u32,
                in_words as u32,
                out as u32,
                0u32,
                tiles,
                WARPS,
                plan.unroll_with(tiles, mt, inp / 32, WARPS),
                1,
                true,
                mt,
                false,
            );
        }
        start += n;
    }
    y
}

/// Whether a Markov step's bf16 W2 `[out, in]` product for `rows` rows takes the argmax
/// epilogue ([`launch_argmax_step`]): one launch ([`MAX_ROWS`]) and a plan that does not cut the
/// reduction.
pub(crate) fn argmax_step_fits(rows: usize, inp: usize, out: usize) -> bool {
    rows <= MAX_ROWS && supported(rows, inp, out) && plan(Weights::Bf16, inp / 32, out).splits == 1
}

/// One Markov step's product with the argmax epilogue ([`argmax_candidate`]): `x` `rows` bf16
/// rows of `in` (words), `w` the bf16 W2 `[out, in]`, `base` the step's base logits (bf16, row
/// `r` at `r · stride`), `slots` `rows · MARKOV_SLOTS` u64 (zero, or holding this step's earlier
/// candidates). The caller checked [`argmax_step_fits`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_argmax_step(
    client: &cubecl::client::Client,
    x: cubecl::server::Handle,
    w: &CubeTensor,
    base: cubecl::server::Handle,
    base_len: usize,
    stride: usize,
    slots: cubecl::server::Handle,
    rows: usize,
) {
    let [out, inp] = [w.meta.shape()[0], w.meta.shape()[1]];
    let plan = plan(Weights::Bf16, inp / 32, out);
    let in_words = inp / 8;
    let tiles = launch_tiles(rows);
    let mt = plan.mtiles(tiles, out, inp / 32);
    // SAFETY: x holds `rows · in_words` words, w `out · in_words`, base `base_len` bf16 of which
    // the kernel reads `r · stride + col` for rows `r < rows` and columns `col < out` (the
    // caller's `base_len` covers them), slots `rows · MARKOV_SLOTS` u64 (slot `r · MARKOV_SLOTS
    // + b % MARKOV_SLOTS`); y and parts are never touched with `argmax` (x's buffer stands in).
    unsafe {
        super::pdl::before_launch(client);
        skinny_gemm_kernel::launch_unchecked(
            client,
            CubeCount::Static((out / 16 / mt) as u32, 1, 1),
            CubeDim::new_2d(32, WARPS as u32),
            BufferArg::from_raw_parts(x.clone(), rows * in_words),
            BufferArg::from_raw_parts(w.handle.clone(), out * in_words),
            BufferArg::from_raw_parts(x.clone(), 1),
            BufferArg::from_raw_parts(x, 1),
            BufferArg::from_raw_parts(base, base_len),
            BufferArg::from_raw_parts(slots, rows * MARKOV_SLOTS * SLOT_STRIDE),
            rows as u32,
            in_words as u32,
            out as u32,
            stride as u32,
            tiles,
            WARPS,
            plan.unroll_with(tiles, mt, inp / 32, WARPS),
            1,
            false,
            mt,
            true,
        );
    }
}

/// The f32 scratch of a split product, `[splits, len]` (reused by each launch of the call), or
/// `None` without splits.
pub(crate) fn split_scratch(like: &CubeTensor, splits: usize, len: usize) -> Option<CubeTensor> {
    (splits > 1).then(|| {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            [splits * len].into(),
            DType::F32,
        )
    })
}

/// `[rows, out]` for `x` `[rows, in]` and `w` `[out, in]`.
fn output_shape(x: &burn::tensor::Shape, w: &burn::tensor::Shape) -> burn::tensor::Shape {
    [x[0], w[0]].into()
}

/// The backend extension: one operation, run by CubeCL on CUDA and deferred through fusion.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait SkinnyGemmOps: burn::backend::Backend {
    /// `x · wᵀ`; `x` `[rows, in]`, `w` `[out, in]` → `[rows, out]`.
    #[fusion(dtype = x, shape = output_shape(x, w))]
    fn skinny_gemm(
        x: burn::backend::tensor::FloatTensor<Self>,
        w: burn::backend::tensor::FloatTensor<Self>,
    ) -> burn::backend::tensor::FloatTensor<Self>;

    /// `silu(g)·u` of a paired gate/up weight; `x` `[rows, in]`, `w` `[out, in]` →
    /// `[rows, out / 2]`.
    #[fusion(dtype = x, shape = swiglu_shape(x, w))]
    fn skinny_gemm_swiglu(
        x: burn::backend::tensor::FloatTensor<Self>,
        w: burn::backend::tensor::FloatTensor<Self>,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl SkinnyGemmOps for CubeBackend {
    fn skinny_gemm(x: CubeTensor, w: CubeTensor) -> CubeTensor {
        launch(x, w)
    }

    fn skinny_gemm_swiglu(x: CubeTensor, w: CubeTensor) -> CubeTensor {
        launch_swiglu(x, w)
    }
}

/// `[rows, out / 2]` for `x` `[rows, in]` and a paired `w` `[out, in]`.
fn swiglu_shape(x: &burn::tensor::Shape, w: &burn::tensor::Shape) -> burn::tensor::Shape {
    [x[0], w[0] / 2].into()
}

/// See [`crate::linear_swiglu`]; the caller checked [`takes_swiglu`].
pub(crate) fn linear_swiglu(x: Tensor<2>, w: &Tensor<2>) -> Tensor<2> {
    let y = <Dispatch as SkinnyGemmOps>::skinny_gemm_swiglu(x.into_dispatch(), w.clone().into_dispatch());
    Tensor::from_dispatch(y)
}

/// The comptime arguments of one [`skinny_gemm_kernel`] launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GemmVariant {
    tiles: usize,
    unroll: usize,
    splits: usize,
    swiglu: bool,
    mtiles: usize,
    argmax: bool,
}

/// Activation tiles of 8 rows one launch of `rows` rows (at most [`MAX_ROWS`]) runs:
/// `rows / 8` rounded up, and, with [`crate::set_tile_padding`] on (the default), three taken
/// as four. On the H100 (2026-12-05, `bench-target --windows 16,17,24,32`) a whole Qwen3-8B
/// forward of 17 or 24 rows (three tiles) took 8.12 ms and one of 32 rows (four) 7.66, with
/// every cube's plan the same; with the padding, 17 and 24 rows took 7.36 and 7.39 ms (`2026-12-05-h100-tiles.md`).
/// The fourth tile's rows are past `rows`, so the kernel neither reads nor writes them, and a
/// row's sums do not depend on the tiles beside it (`gpu_kernels
/// skinny_gemm_is_batch_invariant` passes with it off and on, H100 2026-12-05), so the padding
/// changes no bit.
pub(crate) fn launch_tiles(rows: usize) -> usize {
    match rows.div_ceil(8) {
        3 if crate::tile_padding() => 4,
        tiles => tiles,
    }
}

/// The variant [`launch_product`] (or with `swiglu`, [`launch_swiglu`]; with `argmax`,
/// [`launch_argmax_step`]) launches for `8·tiles` rows or fewer (one launch) of an `[out, in]`
/// weight.
pub(crate) fn gemm_variant(tiles: usize, inp: usize, out: usize, swiglu: bool, argmax: bool) -> GemmVariant {
    let plan = plan(Weights::Bf16, inp / 32, out);
    let mtiles = plan.mtiles(tiles, out, inp / 32);
    GemmVariant {
        tiles,
        unroll: plan.unroll_with(tiles, mtiles, inp / 32, WARPS),
        splits: if swiglu || argmax { 1 } else { plan.splits },
        swiglu,
        mtiles,
        argmax,
    }
}

/// `v` expanded and transpiled without a device (see [`super::offline`]).
pub(crate) fn offline_gemm(v: GemmVariant) -> Result<KernelSource, String> {
    let GemmVariant { tiles, unroll, splits, swiglu, mtiles, argmax } = v;
    let label = format!(
        "skinny_gemm: tiles={tiles} warps={WARPS} unroll={unroll} splits={splits} swiglu={swiglu} mtiles={mtiles} \
         argmax={argmax}"
    );
    let kernel = offline_kernel!(
        skinny_gemm_kernel::SkinnyGemmKernel,
        CubeDim::new_2d(32, WARPS as u32);
        b b b b b b s s s s;
        tiles, WARPS, unroll, splits, swiglu, mtiles, argmax
    );
    transpile(&label, kernel)
}

/// The [`combine_splits_kernel`] variant [`combine_splits`] launches for `splits` splits.
pub(crate) fn offline_combine_splits(splits: usize) -> Result<KernelSource, String> {
    let kernel = offline_kernel!(
        combine_splits_kernel::CombineSplitsKernel,
        CubeDim::new_1d(COMBINE_THREADS as u32);
        b b s;
        splits
    );
    transpile(&format!("combine_splits: splits={splits}"), kernel)
}
