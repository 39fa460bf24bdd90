//! The γ greedy steps of a DSpark Markov head in one launch: a cube per SM that stays for the
//! whole loop, keeps much of W2 in shared memory after the first step, and meets the other cubes
//! at a grid barrier between steps.
//!
//! # Why
//! The two-launch steps of [`super::markov`] stream the whole W2 (38.9 MB in FP8, 77.8 MB in
//! bf16 for rank 256 over 151 936 tokens) once a step, γ times a round, and each step pays two
//! launches, a ramp and a tail; on an H100 an FP8 step is some 24 µs of device time
//! (`benches/results/2026-12-06-h100-markov.md`). Here step 0 reads W2 from memory once, each
//! cube keeps its first `resident` 16-row blocks in shared memory (224 KiB a cube: 56 of an FP8
//! W2's 72 blocks a cube over 132 SMs, 28 of a bf16 one's) and reads the rest again from the L2
//! or memory, and a step ends at a barrier rather than at a launch boundary.
//!
//! # How a warp computes a block
//! Cube `c` takes a contiguous share of the 16-row blocks (`c · n / cubes ..`), so that every
//! cube, and every scheduler in it, has the same work; its warp `w` takes the share's blocks
//! `w, w + warps, …`, the last first (past step 0 those come from the L2, and their loads then
//! meet the step's `W1` gather). The instructions a block costs set a step's length (about 530
//! a warp for FP8 W2: the decode, 16 `mma`, the epilogue), so the epilogue keeps each lane's
//! best over all of the warp's blocks and merges across lanes once a step. For one
//! block it makes each chunk's sum (64 columns of FP8, 32 of bf16) as the product's warp for that
//! chunk does (the same decode, the same `m16n8k16` steps from zero, the same block scale), and
//! adds the chunks' sums in chunk order from zero, as that product's epilogue adds its warps'
//! partials: the same f32 values bit for bit. Those are rounded to bf16, widened and added to the
//! base logit as in [`argmax_candidate`](super::gemm::argmax_candidate), and the warp's best
//! over its blocks (the order-free rule of [`better`]) is merged into the lane's slot for the
//! step by an atomic max of [`candidate_key`]s, so the winner is the two-launch path's whatever
//! order the blocks and warps come in (`gpu_kernels markov_greedy_matches_unfused`).
//!
//! # The barrier
//! After a step's blocks every cube fences its atomics, counts itself in and waits for all
//! `cubes · (k + 1)` arrivals; then each cube reads the step's slots, picks the token (cube 0
//! writes it) and gathers the next `W1` row itself. The grid is at most one cube per SM, so all
//! cubes are resident together whenever the device is not shared. If it is (another process or
//! stream holding SMs), a waiting cube gives up after [`STALL_POLLS`] polls, records the stall and
//! waits no more in this launch: the tokens may then be other than the greedy ones, which lowers
//! acceptance but never exactness (every token is a valid id, and the target decides).

use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::bf16;

use super::fused::better;
use super::gemm::{MARKOV_SLOTS, SLOT_STRIDE, candidate_key};
use super::gemm_fp8::{even_pair, odd_pair};

/// 16 bytes as four 32-bit registers.
type Words = Vector<u32, Const<4>>;

/// Lanes (activation rows) the loop takes: one mma tile.
pub(crate) const LOOP_MAX_LANES: usize = 8;
/// Polls of the arrival counter before a cube stops waiting (a few tens of ms).
const STALL_POLLS: u32 = 1 << 16;

/// Every cube's arrival at barrier `target / cubes − 1`, then the wait for the others; at most
/// [`STALL_POLLS`] polls, and none once a stall is recorded (`sync[1]`). As a cooperative grid
/// sync: the cube's barrier first, then its first thread alone fences (cumulative over what the
/// cube's threads did before the barrier: their slot atomics), counts itself in, polls, fences
/// again, and the cube's barrier hands the result on. (A fence in every thread, as
/// `sync_storage` makes, had each warp wait for its own atomics: 7.5 % of the loop's stall
/// samples on an H100.)
#[cube]
fn grid_barrier(sync: &[Atomic<u32>], target: u32) {
    sync_cube();
    if UNIT_POS == 0 {
        gpu_asm!("fence.acq_rel.gpu;");
        sync[0].fetch_add(1u32);
        if sync[1].load() == 0u32 {
            let mut polls = 0u32;
            loop {
                if sync[0].load() >= target {
                    break;
                }
                polls += 1u32;
                if polls == STALL_POLLS {
                    sync[1].fetch_add(1u32);
                    break;
                }
            }
        }
        gpu_asm!("fence.acq_rel.gpu;");
    }
    sync_cube();
}

/// The step-`k` base logits of a lane's four outputs in block `b` (rows `2t`, `2t + 1` × columns
/// `g`, `g + 8`; −∞ for rows past `rows`), kept in bf16 until the epilogue widens them, so that
/// the load's wait falls there and not at the block's start (the widening placed beside the load
/// was the loop's largest single stall on an H100).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_base(
    base: &[bf16],
    pre: &mut Array<bf16>,
    b: usize,
    k: usize,
    rows: usize,
    gamma: usize,
    width: usize,
    g: usize,
    t: usize,
) {
    #[unroll]
    for e in 0..4usize {
        let row = 2 * t + e % 2;
        let col = b * 16 + g + 8 * (e / 2);
        if row < rows {
            pre[e] = base[(row * gamma + k) * width + col];
        } else {
            pre[e] = bf16::cast_from(f32::NEG_INFINITY);
        }
    }
}

/// Block `b`'s weight words of this lane from global memory: both 8-row halves of every chunk.
#[cube]
fn load_block(w: &[Words], ws: &mut Array<Words>, b: usize, g: usize, t: usize, #[comptime] chunks: usize) {
    let w_words = chunks * 4;
    let lo_word = (b * 16 + g) * w_words + t;
    #[unroll]
    for c in 0..chunks {
        ws[2 * c] = w[lo_word + c * 4];
        ws[2 * c + 1] = w[lo_word + 8 * w_words + c * 4];
    }
}

/// Before the loop: the `γ · lanes` sets of [`MARKOV_SLOTS`] slots cleared (a cube of 32 units
/// each), and the arrival and stall counters zeroed.
#[cube(launch_unchecked)]
fn markov_loop_clear_kernel(slots: &[Atomic<u64>], sync: &[Atomic<u32>]) {
    crate::cuda::pdl::dependency_wait();
    let set = CUBE_POS_X as usize;
    slots[(set * MARKOV_SLOTS + UNIT_POS as usize) * SLOT_STRIDE].store(0u64);
    if set == 0 && UNIT_POS < 2 {
        sync[UNIT_POS as usize].store(0u32);
    }
}

/// The loop. `anchors` `[rows]` i32 (step 0 embeds them from `w1`, an id outside its `w1_rows`
/// rows reads row 0), `table` (later steps' rows), `w1` and `table` as 16-byte words (`chunks ·
/// 8` a row), `w` the FP8 W2 `[width, 64 · chunks]` as words, `scales` per row or per 128×128
/// block (`scale_cols` a block row), `base` `[rows, γ, width]` bf16, `tokens` `[rows, γ]`,
/// `slots` `γ · rows` sets of [`MARKOV_SLOTS`] slots [`SLOT_STRIDE`] apart (zero), `sync` two
/// counters (zero).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn markov_loop_kernel(
    anchors: &[i32],
    w1: &[Words],
    table: &[Words],
    w: &[Words],
    scales: &[f32],
    base: &[bf16],
    to_target: &[i32],
    tokens: &mut [i32],
    slots: &[Atomic<u64>],
    sync: &[Atomic<u32>],
    rows: u32,
    width: u32,
    gamma: u32,
    w1_rows: u32,
    scale_cols: u32,
    pow2_120: f32,
    #[comptime] chunks: usize,
    #[comptime] warps: usize,
    #[comptime] resident: usize,
    #[comptime] dense: bool,
    #[comptime] blocked: bool,
    #[comptime] mapped: bool,
    #[comptime] ahead: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let g = lane / 4;
    let t = lane % 4;
    let rows = rows as usize;
    let width = width as usize;
    let gamma = gamma as usize;
    let scale_cols = scale_cols as usize;
    // A chunk is 64 columns of an FP8 row (two activation words a lane) or 32 of a bf16 row
    // (one); either way a weight row is `4 · chunks` words and a lane loads two a chunk.
    let xw_per_chunk = comptime![if dense { 1usize } else { 2usize }];
    let x_words = chunks * 4 * xw_per_chunk;
    let n_blocks = width / 16;
    let cubes = CUBE_COUNT_X as usize;
    let cube = CUBE_POS_X as usize;
    // The cube's blocks: a contiguous share of the grid's (71 or 72 of 9496 on 132 SMs), so that
    // every cube, and every scheduler in it, has the same work; warp w takes the cube's blocks
    // w, w + warps, … and the first `resident` of them stay in shared memory after step 0.
    let lo = cube * n_blocks / cubes;
    let count = (cube + 1) * n_blocks / cubes - lo;
    let mut mine = 0usize;
    if warp < count {
        mine = (count - warp).div_ceil(warps);
    }
    // The warp's slot in a step's set: its atomics meet those of 1 in 32 warps.
    let slot_of = (cube * warps + warp) % MARKOV_SLOTS;

    let def = MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    let lift = Vector::<bf16, Const<8>>::new(bf16::cast_from(pow2_120));
    let zero = Words::new(0u32);
    let zero4 = Vector::<f32, Const<4>>::new(0.0f32);

    // The resident blocks: block j's words for lane l at `(j · 2 · chunks + q) · 32 + l`, so
    // that a warp's 16-byte loads are contiguous.
    let mut kept = Shared::<[Words]>::new_slice(comptime![resident.max(1) * 2 * chunks * 32]);
    // Each lane's row for this step: its anchor, then its token's index.
    let mut picked = Shared::<[u32]>::new_slice(LOOP_MAX_LANES);
    if warp == 0 && lane < rows {
        let mut anchor = anchors[lane];
        if anchor < 0 || anchor >= w1_rows as i32 {
            anchor = 0;
        }
        picked[lane] = anchor as u32;
    }
    sync_cube();

    // The first block's base logits and (past step 0, when not resident) weight words for the
    // step about to start.
    let mut pre_next = Array::<bf16>::new(4usize);
    // A block's weight words: both 8-row halves of every chunk (the next step's first block's
    // when loaded before a barrier).
    let mut ws = Array::<Words>::new(comptime![chunks * 2]);
    // The next block's words, loaded one block ahead (`ahead` only).
    let mut ws_ahead = Array::<Words>::new(comptime![chunks * 2]);
    if mine > 0 {
        load_base(base, &mut pre_next, lo + warp + (mine - 1) * warps, 0usize, rows, gamma, width, g, t);
    }

    for k in 0..gamma {
        // The step's activation row for lane g (rows g ≥ rows are zero), the words the
        // product's lane loads: columns `8 · (xw · t + h)` of each chunk.
        let mut xs = Array::<Words>::new(comptime![chunks * xw_per_chunk]);
        let src = picked[g % LOOP_MAX_LANES] as usize;
        #[unroll]
        for c in 0..chunks {
            #[unroll]
            for h in 0..xw_per_chunk {
                let at = src * x_words + (c * 4 + t) * xw_per_chunk + h;
                if g >= rows {
                    xs[c * xw_per_chunk + h] = zero;
                } else if k == 0 {
                    xs[c * xw_per_chunk + h] = w1[at];
                } else {
                    xs[c * xw_per_chunk + h] = table[at];
                }
            }
        }

        // This lane's best of the step for its rows 2t and 2t + 1 over all the warp's blocks
        // (the order-free rule of `better`: the warp's blocks may come in any order).
        let mut best_v = Array::<f32>::new(2usize);
        let mut best_i = Array::<u32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            best_v[r] = f32::new(f32::NEG_INFINITY);
            best_i[r] = 0xFFFF_FFFFu32;
        }
        // The last blocks first: past step 0 those are the ones read from the L2 or memory, whose
        // latency the other warps' resident blocks then cover.
        for m in 0..mine {
            let j = warp + (mine - 1 - m) * warps;
            let b = lo + j;
            // This block's base logits (loaded one block ahead), and the next block's started.
            let mut pre = Array::<bf16>::new(4usize);
            #[unroll]
            for e in 0..4usize {
                pre[e] = pre_next[e];
            }
            if m + 1 < mine {
                load_base(base, &mut pre_next, b - warps, k, rows, gamma, width, g, t);
            }
            let kept_at = j * 2 * chunks * 32 + lane;
            // Whether this block comes from memory (every block at step 0).
            let fetched = j >= resident || k == 0;
            if m == 0 && k > 0 && j >= resident {
                // Loaded before the last barrier.
            } else if comptime![ahead] && m > 0 && fetched {
                // Loaded while the previous block was multiplied.
                #[unroll]
                for q in 0..2 * chunks {
                    ws[q] = ws_ahead[q];
                }
            } else if j < resident && k > 0 {
                #[unroll]
                for q in 0..2 * chunks {
                    ws[q] = kept[kept_at + q * 32];
                }
            } else {
                load_block(w, &mut ws, b, g, t, chunks);
            }
            if j < resident && k == 0 {
                #[unroll]
                for q in 0..2 * chunks {
                    kept[kept_at + q * 32] = ws[q];
                }
            }
            // With registers to spare (bf16: 8 warps a cube), the next block's words are loaded
            // now when it comes from memory, so that a warp's reads overlap its products.
            #[allow(clippy::collapsible_if)]
            if comptime![ahead] {
                if m + 1 < mine && (j - warps >= resident || k == 0) {
                    load_block(w, &mut ws_ahead, b - warps, g, t, chunks);
                }
            }
            // Each chunk's sum as the product's warp for that chunk makes it.
            let mut accs = Array::<Vector<f32, Const<4>>>::new(chunks);
            #[unroll]
            for c in 0..chunks {
                let mut part = Array::<Vector<f32, Const<4>>>::new(1usize);
                part[0] = zero4;
                if comptime![dense] {
                    // The bf16 product's two steps: the first four columns of each 8 to step 0.
                    #[unroll]
                    for s in 0..2usize {
                        let mut a_words = Words::new(0u32);
                        a_words.insert(0usize, ws[2 * c].extract(2 * s));
                        a_words.insert(1usize, ws[2 * c + 1].extract(2 * s));
                        a_words.insert(2usize, ws[2 * c].extract(2 * s + 1));
                        a_words.insert(3usize, ws[2 * c + 1].extract(2 * s + 1));
                        let mut a = Array::<Vector<bf16, Const<8>>>::new(1usize);
                        a[0] = Vector::<bf16, Const<8>>::reinterpret(a_words);
                        let xw = xs[c];
                        let mut b_words = Vector::<u32, Const<2>>::new(0u32);
                        b_words.insert(0usize, xw.extract(2 * s));
                        b_words.insert(1usize, xw.extract(2 * s + 1));
                        let mut bx = Array::<Vector<bf16, Const<4>>>::new(1usize);
                        bx[0] = Vector::<bf16, Const<4>>::reinterpret(b_words);
                        def.execute_inplace(&a, &bx, &mut part);
                    }
                    accs[c] = part[0];
                } else {
                    #[unroll]
                    for s in 0..4usize {
                        let ga = ws[2 * c].extract(s);
                        let gb = ws[2 * c + 1].extract(s);
                        let mut a_words = Words::new(0u32);
                        a_words.insert(0usize, even_pair(ga));
                        a_words.insert(1usize, even_pair(gb));
                        a_words.insert(2usize, odd_pair(ga));
                        a_words.insert(3usize, odd_pair(gb));
                        let mut a = Array::<Vector<bf16, Const<8>>>::new(1usize);
                        a[0] = Vector::<bf16, Const<8>>::reinterpret(a_words) * lift;
                        let xw = xs[c * 2 + s / 2];
                        let mut b_words = Vector::<u32, Const<2>>::new(0u32);
                        b_words.insert(0usize, xw.extract(2 * (s % 2)));
                        b_words.insert(1usize, xw.extract(2 * (s % 2) + 1));
                        let mut bx = Array::<Vector<bf16, Const<4>>>::new(1usize);
                        bx[0] = Vector::<bf16, Const<4>>::reinterpret(b_words);
                        def.execute_inplace(&a, &bx, &mut part);
                    }
                    if comptime![blocked] {
                        let s = scales[b * 16 / 128usize * scale_cols + c / 2];
                        let mut acc = zero4;
                        acc += part[0] * Vector::<f32, Const<4>>::new(s);
                        accs[c] = acc;
                    } else {
                        accs[c] = part[0];
                    }
                }
            }
            // Output e of the lane: activation row 2t + e % 2, weight row g + 8 · (e / 2).
            #[unroll]
            for e in 0..4usize {
                let mut sum = 0.0f32;
                #[unroll]
                for c in 0..chunks {
                    sum += accs[c].extract(e);
                }
                let col = b * 16 + g + 8 * (e / 2);
                if !comptime![dense || blocked] {
                    sum *= scales[col];
                }
                let row = 2 * t + e % 2;
                if row < rows {
                    let v = f32::cast_from(pre[e]) + f32::cast_from(bf16::cast_from(sum));
                    let (nv, ni) = better(best_v[e % 2], best_i[e % 2], v, col as u32);
                    if v > f32::new(f32::NEG_INFINITY) {
                        best_v[e % 2] = nv;
                        best_i[e % 2] = ni;
                    }
                }
            }
        }
        // The 8 lanes of one t hold a row's candidates: merge them, then lane g = 0 merges the
        // warp's best into the row's slot (rows past `rows` skip the shuffles: a uniform branch).
        #[unroll]
        for r in 0..2usize {
            if r < rows {
                let mut v = best_v[r];
                let mut ix = best_i[r];
                #[unroll]
                for level in 2..5u32 {
                    let mask = 1u32 << level;
                    let (nv, ni) = better(v, ix, plane_shuffle_xor(v, mask), plane_shuffle_xor(ix, mask));
                    v = nv;
                    ix = ni;
                }
                let row = 2 * t + r;
                if g == 0 && row < rows && ix != 0xFFFF_FFFFu32 {
                    let slot = ((k * rows + row) * MARKOV_SLOTS + slot_of) * SLOT_STRIDE;
                    slots[slot].fetch_max(candidate_key(v, ix));
                }
            }
        }

        // The next step's first block does not depend on its token: its base logits, and its
        // weight words when it is not resident, are loaded now and arrive during the barrier.
        if k + 1 < gamma && mine > 0 {
            let b0 = lo + warp + (mine - 1) * warps;
            load_base(base, &mut pre_next, b0, k + 1, rows, gamma, width, g, t);
            if warp + (mine - 1) * warps >= resident {
                load_block(w, &mut ws, b0, g, t, chunks);
            }
        }

        grid_barrier(sync, (cubes * (k + 1)) as u32);

        // The step's pick, warp r for lane r: the largest slot's index (0 when none).
        if warp < rows {
            let key = slots[((k * rows + warp) * MARKOV_SLOTS + lane) * SLOT_STRIDE].load();
            let mut hi = u32::cast_from(key >> 32u64);
            let mut lo = u32::cast_from(key & 0xFFFF_FFFFu64);
            #[unroll]
            for level in 0..5u32 {
                let mask = 1u32 << level;
                let (oh, ol) = (plane_shuffle_xor(hi, mask), plane_shuffle_xor(lo, mask));
                if oh > hi || (oh == hi && ol > lo) {
                    hi = oh;
                    lo = ol;
                }
            }
            let mut index = 0u32;
            if hi != 0u32 {
                index = lo ^ 0xFFFF_FFFFu32;
            }
            if lane == 0 {
                picked[warp] = index;
                if CUBE_POS_X == 0 {
                    let mut token = index as i32;
                    if comptime![mapped] {
                        token = to_target[index as usize];
                    }
                    tokens[warp * gamma + k] = token;
                }
            }
        }
        sync_cube();
    }
}

/// How the loop runs one W2: its kind, chunks and warps a cube.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LoopShape {
    /// A bf16 W2 (32-column chunks) rather than FP8 (64-column chunks).
    pub dense: bool,
    /// Chunks of a W2 row.
    pub chunks: usize,
    /// Warps a cube: 16 (512 threads, so at most 128 registers a thread at one cube an SM) for
    /// FP8, 8 for bf16, whose lane holds twice the weight and activation words.
    pub warps: usize,
    /// Whether a warp loads its next block's words while it multiplies the current one (bf16:
    /// at 8 warps a cube a thread may take 255 registers; FP8's 16 warps leave it 128).
    pub ahead: bool,
}

impl LoopShape {
    /// The loop's shape for a rank-`rank` W2, or `None` when it does not take it: FP8 up to
    /// rank 256 in 64-column chunks, bf16 up to rank 256 in 32-column chunks (the bf16 product
    /// gives each of its 8 warps one chunk there, which the loop's order follows).
    pub(crate) fn new(dense: bool, rank: usize) -> Option<Self> {
        let width = if dense { 32 } else { 64 };
        let max = if dense { 8 } else { 4 };
        (rank.is_multiple_of(width) && (1..=max).contains(&(rank / width))).then_some(Self {
            dense,
            chunks: rank / width,
            warps: if dense { 8 } else { 16 },
            ahead: dense,
        })
    }

    /// The cube count and resident blocks a cube for `n_blocks` 16-row blocks on a device of
    /// `sms` SMs with `shared` bytes of shared memory a cube.
    pub(crate) fn plan(self, n_blocks: usize, sms: usize, shared: usize) -> (usize, usize) {
        let cubes = n_blocks.div_ceil(self.warps).clamp(1, sms.max(1));
        let per_cube = n_blocks.div_ceil(cubes);
        // A block: 2 · chunks words a lane (4 KiB FP8, 8 KiB bf16 at rank 256); 1 KiB kept for
        // `picked` and the compiler.
        let block_bytes = 2 * self.chunks * 32 * 16;
        let resident = (shared.saturating_sub(1024) / block_bytes).min(per_cube);
        (cubes, resident)
    }
}

/// Whether the loop takes a problem of `lanes` lanes and a W2 of `width` rows and this shape.
pub(crate) fn loop_fits(lanes: usize, width: usize) -> bool {
    (1..=LOOP_MAX_LANES).contains(&lanes) && width.is_multiple_of(16) && width > 0
}

/// A W2 as the loop takes it: bf16 rows, or FP8 words with their scales.
pub(crate) enum LoopW2<'a> {
    Dense(&'a CubeTensor),
    Fp8 { words: &'a CubeTensor, scales: &'a CubeTensor, blocked: bool },
}

/// Launches the loop (after its clear): see [`markov_loop_kernel`]. `all` holds the tokens at 0,
/// the slots from word `slots_at` and the two counters from word `sync_at` (i32 words).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    anchors: &CubeTensor,
    w1: &CubeTensor,
    table: &CubeTensor,
    w2: LoopW2<'_>,
    shape: LoopShape,
    base: &CubeTensor,
    to_target: &CubeTensor,
    mapped: bool,
    all: &CubeTensor,
    slots_at: usize,
    sync_at: usize,
) {
    let [lanes, gamma, width] = [base.meta.shape()[0], base.meta.shape()[1], base.meta.shape()[2]];
    let [w1_rows, rank] = [w1.meta.shape()[0], w1.meta.shape()[1]];
    let table_rows = table.meta.shape()[0];
    let client = base.client.clone();
    let hardware = &client.properties().hardware;
    let sms = hardware.num_streaming_multiprocessors.unwrap_or(1) as usize;
    let (cubes, resident) = shape.plan(width / 16, sms, hardware.max_shared_memory_size);
    let (words, scales, n_scales, blocked) = match w2 {
        // A bf16 W2 has no scales: its own buffer stands in, never read.
        LoopW2::Dense(w) => (w.handle.clone(), w.handle.clone(), 1, false),
        LoopW2::Fp8 { words, scales, blocked } => {
            (words.handle.clone(), scales.handle.clone(), scales.meta.shape()[0], blocked)
        }
    };
    let scale_cols = if blocked { rank.div_ceil(crate::fp8::BLOCK) } else { 1 };
    let n_slots = gamma * lanes * MARKOV_SLOTS * SLOT_STRIDE;
    let word = 4u64;
    let slots = all.handle.clone().offset_start(slots_at as u64 * word);
    let sync = all.handle.clone().offset_start(sync_at as u64 * word);
    // SAFETY: cube `set < γ · lanes` of 32 units clears slot `(set · 32 + unit) · SLOT_STRIDE`
    // (`n_slots` u64) and cube 0 the two counters.
    unsafe {
        super::pdl::before_launch(&client);
        markov_loop_clear_kernel::launch_unchecked(
            &client,
            CubeCount::Static((gamma * lanes) as u32, 1, 1),
            CubeDim::new_1d(MARKOV_SLOTS as u32),
            BufferArg::from_raw_parts(slots.clone(), n_slots),
            BufferArg::from_raw_parts(sync.clone(), 2),
        );
    }
    // SAFETY: `anchors` `lanes` i32; `w1` rows `< w1_rows` and `table` rows `< width ≤
    // table_rows` (a key's index is a column) of `rank / 8` words; `w` `width` rows of
    // `4 · chunks` words; for FP8 `scales` at columns `< width` (per row) or at `row_block ·
    // scale_cols + chunk / 2` (blocks), for bf16 never; `base` `lanes · γ · width` bf16;
    // `to_target` at an index `< width` when `mapped`; `tokens` `lanes · γ` i32; slots `n_slots`
    // u64 and the two counters, all in `all`, disjoint.
    unsafe {
        super::pdl::before_launch(&client);
        markov_loop_kernel::launch_unchecked(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_2d(32, shape.warps as u32),
            BufferArg::from_raw_parts(anchors.handle.clone(), lanes),
            BufferArg::from_raw_parts(w1.handle.clone(), w1_rows * rank / 8),
            BufferArg::from_raw_parts(table.handle.clone(), table_rows * rank / 8),
            BufferArg::from_raw_parts(words, width * shape.chunks * 4),
            BufferArg::from_raw_parts(scales, n_scales),
            BufferArg::from_raw_parts(base.handle.clone(), lanes * gamma * width),
            BufferArg::from_raw_parts(to_target.handle.clone(), to_target.meta.shape()[0]),
            BufferArg::from_raw_parts(all.handle.clone(), lanes * gamma),
            BufferArg::from_raw_parts(slots, n_slots),
            BufferArg::from_raw_parts(sync, 2),
            lanes as u32,
            width as u32,
            gamma as u32,
            w1_rows as u32,
            scale_cols as u32,
            2f32.powi(120),
            shape.chunks,
            shape.warps,
            resident,
            shape.dense,
            blocked,
            mapped,
            shape.ahead,
        );
    }
}

/// The loop and its clear, transpiled without a device (see [`super::offline`]): bf16 and FP8,
/// rank 256 and 128, at the residency an H200 gives the whole Qwen3 vocabulary.
pub(crate) fn offline_markov_loop() -> Vec<Result<super::offline::KernelSource, String>> {
    use super::offline::{offline_kernel, transpile};
    let clear = offline_kernel!(
        markov_loop_clear_kernel::MarkovLoopClearKernel,
        CubeDim::new_1d(MARKOV_SLOTS as u32);
        b b;
    );
    let mut all = vec![transpile("markov_loop_clear", clear)];
    let props = super::offline::h200_properties();
    let sms = props.hardware.num_streaming_multiprocessors.unwrap_or(1) as usize;
    for dense in [false, true] {
        for rank in [256usize, 128] {
            let shape = LoopShape::new(dense, rank).expect("the loop takes ranks 128 and 256");
            let (_, resident) = shape.plan(151_936 / 16, sms, props.hardware.max_shared_memory_size);
            let kinds: &[(bool, bool)] = if dense {
                &[(false, false), (false, true)]
            } else {
                &[(false, false), (true, false), (false, true)]
            };
            for &(blocked, mapped) in kinds {
                let kernel = offline_kernel!(
                    markov_loop_kernel::MarkovLoopKernel,
                    CubeDim::new_2d(32, shape.warps as u32);
                    b b b b b b b b b b s s s s s s;
                    shape.chunks, shape.warps, resident, dense, blocked, mapped, shape.ahead
                );
                all.push(transpile(
                    &format!(
                        "markov_loop: dense={dense} chunks={} resident={resident} blocked={blocked} mapped={mapped}",
                        shape.chunks
                    ),
                    kernel,
                ));
            }
        }
    }
    all
}
