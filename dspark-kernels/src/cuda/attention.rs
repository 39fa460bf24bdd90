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
//! Two kernels compute a split; a process uses one (see
//! [`crate::set_tensor_core_attention`]), as they round differently.
//! - **Tensor cores** (the default, head widths up to 128; [`paged_attention_mma_kernel`]): a
//!   cube owns one K/V head, one split and up to 16 rows of a lane's window (all their query
//!   heads of that K/V head: up to 64 (row, head) pairs, the `M` side of `mma.sync`). Its four
//!   warps stage each 32-key block of K and V in shared memory once, then multiply `q·Kᵀ` and
//!   `P·V` on tensor cores with an f32 online softmax. A verify window of 17 rows thus reads
//!   each key twice instead of 68 times: at 512 keys its attention takes 18 µs instead of 39.
//! - **One warp per (row, head)** ([`paged_attention_split_kernel`]): a cube owns one query
//!   row, one K/V head and one split; its `groups` warps are the query heads that share that
//!   K/V head (native GQA: the K/V rows are fetched once per cube and served from L1 to the
//!   other warps). In a warp, lane `(kg, dq)` (`kg = lane / 4`, `dq = lane % 4`) holds a
//!   quarter of the head's dimensions and walks the split's keys `kg, kg + 8, …` with an online
//!   softmax; the four lanes of a key group add their partial dot products with two butterfly
//!   shuffles, and the eight key groups merge their (max, sum, accumulator) states with three
//!   more. Softmax and accumulation are f32.
//!
//! # Batch invariance
//! A row's splits and its reduction order depend only on its number of visible keys: the same
//! whether the row is decoded alone, verified inside a window, batched with other lanes, or
//! grouped with any other rows in a tensor-core cube.

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::MmaDefinition;
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
/// Keys each key group has in flight at once (a split of 32 keys is one batch).
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
fn split_stride(n_keys: usize, min_chunk: usize) -> usize {
    n_keys.div_ceil(min_chunk).clamp(1, MAX_SPLITS)
}

/// Keys per split of a row with `count` visible keys: a function of `count` alone, so a row's
/// reduction order never depends on the rows beside it.
#[cube]
fn split_chunk(count: usize, #[comptime] min_chunk: usize) -> usize {
    let per = count.div_ceil(MAX_SPLITS);
    let mut chunk = per.div_ceil(min_chunk) * min_chunk;
    if chunk == 0 {
        chunk = min_chunk;
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
    #[comptime] min_chunk: usize,
) {
    crate::cuda::pdl::dependency_wait();
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
    let chunk = split_chunk(count, min_chunk);
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

/// Keys per block of the tensor-core kernel: four 8-key tiles of `S`, two k16 steps of `P·V`,
/// staged by the cube's 128 threads (a quarter row each).
const KEY_BLOCK: usize = 32;
/// Threads of a tensor-core cube (4 warps: they stage a block together; those whose tile
/// holds rows multiply).
const MMA_WARPS: usize = 4;
/// 16-byte words per staged K row: 16 for a 128-wide head plus 4 of padding, so the eight
/// lanes of a 16-byte read phase (two keys × four quarters) hit distinct banks.
const KS_STRIDE: usize = 20;
/// 32-bit words per staged V row: 64 plus 4 of padding, so the fragment reads (keys 2t, dims
/// g) spread over the banks.
const VS_STRIDE: usize = 68;
/// Query rows × heads one tensor-core cube serves at most (four warps of 16).
const MMA_ROWS: usize = 64;

/// Round an f32 to bf16 (nearest, ties to even) and return its 16 bits in the low half of the
/// word. Finite inputs only (softmax weights in `[0, 1]` and their rounding remainders).
/// A lane's scalar stores of one of its two (row, head) pairs (`pair` 0: elements 0 and 1 of
/// each accumulator word, 1: elements 2 and 3) into `part`'s slot `slot`, columns
/// `nd·8 + 2t, nd·8 + 2t + 1`.
#[cube]
fn store_pair(
    part: &mut [f32],
    o: &Array<Vector<f32, Const<4>>>,
    slot: usize,
    t: usize,
    #[comptime] head_dim: usize,
    #[comptime] pair: usize,
) {
    #[unroll]
    for nd in 0..head_dim / 8 {
        part[slot * head_dim + nd * 8 + 2 * t] = o[nd].extract(comptime![2 * pair]);
        part[slot * head_dim + nd * 8 + 2 * t + 1] = o[nd].extract(comptime![2 * pair + 1]);
    }
}

#[cube]
fn bf16_bits(x: f32) -> u32 {
    let b = u32::reinterpret(x);
    (b + 0x7FFFu32 + ((b >> 16u32) & 1u32)) >> 16u32
}

/// `bytes` (16, or 0 for sixteen zero bytes) from global `src` to shared `dst` with `cp.async`:
/// the copy does not pass through registers, so a block's rows can be in flight while the
/// previous block is multiplied without holding them in the threads' registers (which took the
/// tensor-core kernel from 168 to 246 registers, two cubes an SM instead of three). Both
/// addresses 16-byte aligned; complete after [`copies_commit`] and [`copies_wait`].
#[cube]
fn copy_16<S: CubePrimitive, D: CubePrimitive>(src: *const S, dst: *const D, bytes: u32) {
    let smem = cubecl_cpp::cuda::ptx::generic_to_shared::<D>(dst);
    gpu_asm!("cp.async.cg.shared.global [{}], [{}], 16, {};", in(_) smem, in(_) src, in(_) bytes);
}

/// Closes this thread's group of [`copy_16`] copies issued since the last one.
#[cube]
fn copies_commit() {
    gpu_asm!("cp.async.commit_group;");
}

/// Waits until at most `pending` of this thread's committed copy groups are still in flight
/// (the others' bytes are then in shared memory; a barrier makes them every thread's).
#[cube]
fn copies_wait(#[comptime] pending: u32) {
    gpu_asm!("cp.async.wait_group {n};", n = const pending);
}

/// Starts copying a quarter (`tq`) of the K and V rows of pool row `phys` into slot `tkey` of
/// staging buffer `buf` (zeros when `valid` is false: a key past the pass's end).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_key(
    k: &[Words],
    v: &[Words],
    ks: &mut [Words],
    vs: &mut [u32],
    phys: usize,
    valid: bool,
    kvh: usize,
    kv_heads: usize,
    tkey: usize,
    tq: usize,
    buf: usize,
    #[comptime] head_dim: usize,
) {
    let words = head_dim / 8;
    // Immutable: an asm operand must be a value, not a local's address.
    let bytes = select(valid, 16u32, 0u32);
    #[unroll]
    for i in 0..head_dim / 32 {
        let at = (phys * kv_heads + kvh) * words + i * 4 + tq;
        let kd = (buf * KEY_BLOCK + tkey) * KS_STRIDE + i * 4 + tq;
        let vd = (buf * KEY_BLOCK + tkey) * VS_STRIDE + (i * 4 + tq) * 4;
        // SAFETY: `at` is a word of pool row `phys` (< pool rows: the caller's tables, or 0),
        // `kd` and `vd` start 16-byte words inside the two staging buffers.
        unsafe {
            copy_16::<Words, Words>(
                k.slice(at, at + 1).as_ptr_unchecked(),
                ks.slice(kd, kd + 1).as_ptr_unchecked(),
                bytes,
            );
            copy_16::<Words, u32>(
                v.slice(at, at + 1).as_ptr_unchecked(),
                vs.slice(vd, vd + 4).as_ptr_unchecked(),
                bytes,
            );
        }
    }
}

/// The split kernel on tensor cores: one cube serves up to [`MMA_ROWS`] (query row, head)
/// pairs of one K/V head and one split, so each key of the split is read once for all of them
/// instead of once per pair.
///
/// # Layout
/// The cube's rows are `per_cube` consecutive rows of a group of `group` rows (a lane's
/// verify window or draft block, as the caller says); its pairs are `m = row · groups + head`,
/// 16 per warp, the `M` side of `mma.sync.m16n8k16` (bf16 operands, f32 accumulators). The
/// cube's four warps stage each block of [`KEY_BLOCK`] keys (K and V rows, 16-byte `cp.async`
/// copies) in shared memory once, the next block's rows in flight into a second buffer while
/// this one is multiplied: the copies hold no registers, so the kernel keeps to 168 a thread
/// and three cubes fit an SM (a 17-row window's two cubes per head and split then run in one
/// wave at 512 keys). On a
/// block a warp forms `S = q·Kᵀ` (keys on the `N` side; each lane takes 16 bytes of one key per
/// 32 dimensions and of each of its two pairs' q, split over two mma steps exactly as the
/// skinny GEMM splits weights and activations), masks and scales it, updates its pairs'
/// running max and sum (f32; a row's four lanes meet by two butterflies), rounds the weights
/// to bf16 and adds `P·V` to its f32 accumulators.
///
/// # Writing the split states
/// `part` and `part4` are the same scratch, as f32 and as 16-byte words. With `wide` (callers
/// whose groups hold several rows: a window's pass covers many pairs) the lanes of a pair swap
/// halves and store 16 bytes each; otherwise each lane stores its own values one by one, which
/// measured faster for cubes of one-row lanes (one pass per row, few pairs each; H200, 512 keys:
/// 38 against 44 µs for 16 lanes). The values stored are the same either way.
///
/// # Rows that do not share keys
/// A row's split range depends on its own key count, and its keys on its own table: rows of
/// different lanes, or on both sides of a chunk threshold, cannot share blocks. The cube runs
/// one pass per distinct `(first key, chunk)` among its rows, each over the rows that have it;
/// a lane's window is one pass.
///
/// # Batch invariance
/// A pair's result depends only on its q, its keys and its key count: its split is chosen from
/// the count, its blocks start at the split's start, the k order of every mma and the
/// butterflies are fixed, and no other row's values reach its sums (masked keys weigh exactly
/// 0, and a pair's place in the tile does not change an mma's arithmetic). So a row gets the
/// same bits alone, in a window, in any grouping or beside other lanes.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn paged_attention_mma_kernel(
    q: &[Words],
    k: &[Words],
    v: &[Words],
    keys: &[i32],
    meta: &[i32],
    part: &mut [f32],
    part4: &mut [Vector<f32, Const<4>>],
    ml: &mut [f32],
    sync: &[Atomic<u32>],
    out: &mut [bf16],
    row0: u32,
    rows: u32,
    stride: u32,
    kv_heads: u32,
    scale: f32,
    group: u32,
    per_cube: u32,
    cubes_per_group: u32,
    #[comptime] head_dim: usize,
    #[comptime] groups: usize,
    #[comptime] wide: bool,
    #[comptime] min_chunk: usize,
    #[comptime] fold: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let g = lane / 4;
    let t = lane % 4;
    let kvh = CUBE_POS_Y as usize;
    let split = CUBE_POS_Z as usize;
    let stride = stride as usize;
    let kv_heads = kv_heads as usize;
    let heads = kv_heads * groups;
    let row0 = row0 as usize;
    let words = head_dim / 8;
    let chunks = head_dim / 32;
    let id = warp * 32 + lane;

    // This cube's rows, launch-relative: `lo .. hi`.
    let cpg = cubes_per_group as usize;
    let group_lo = (CUBE_POS_X as usize / cpg) * group as usize;
    let mut group_hi = group_lo + group as usize;
    if group_hi > rows as usize {
        group_hi = rows as usize;
    }
    let lo = group_lo + (CUBE_POS_X as usize % cpg) * per_cube as usize;
    let mut hi = lo + per_cube as usize;
    if hi > group_hi {
        hi = group_hi;
    }
    // The last group of a launch may be short: its later cubes have no rows.
    if hi < lo {
        hi = lo;
    }
    // This lane's two pairs (rows g and g + 8 of its warp's tile).
    let m0 = warp * 16 + g;
    let m1 = m0 + 8;
    let r0 = lo + m0 / groups;
    let r1 = lo + m1 / groups;
    let h0 = kvh * groups + m0 % groups;
    let h1 = kvh * groups + m1 % groups;

    let neg_inf = f32::new(f32::NEG_INFINITY);
    let zero = Words::new(0u32);
    let def = MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    // Two staging buffers: a block is multiplied from one while the next is copied into the other.
    // `cp.async` needs 16-byte aligned slots: `vs` follows `ks`, whose length is in 16-byte words
    // (and every `vs` slot starts at a multiple of four words, `VS_STRIDE` being one too).
    let mut ks = Shared::<[Words]>::new_slice(2 * KEY_BLOCK * KS_STRIDE);
    let mut vs = Shared::<[u32]>::new_slice(2 * KEY_BLOCK * VS_STRIDE);

    // The cube's rows' tables in shared memory (local row `i` is launch row `lo + i`): first
    // key, key count, the first row with the same (first key, chunk) (its pass's leader), and
    // for a leader the end of its pass's keys in this split (the longest range of its rows).
    let nr = hi - lo;
    let mut row_first = Shared::<[u32]>::new_slice(MMA_ROWS);
    let mut row_count = Shared::<[u32]>::new_slice(MMA_ROWS);
    let mut row_lead = Shared::<[u32]>::new_slice(MMA_ROWS);
    let mut pass_end = Shared::<[u32]>::new_slice(MMA_ROWS);
    if id < nr {
        row_first[id] = u32::cast_from(meta[2 * (row0 + lo + id)]);
        row_count[id] = u32::cast_from(meta[2 * (row0 + lo + id) + 1]);
    }
    sync_cube();
    if id < nr {
        let f = row_first[id];
        let c = split_chunk(row_count[id] as usize, min_chunk);
        let mut lead = id;
        for j in 0..id {
            if lead == id && row_first[j] == f && split_chunk(row_count[j] as usize, min_chunk) == c {
                lead = j;
            }
        }
        row_lead[id] = lead as u32;
    }
    sync_cube();
    #[allow(clippy::collapsible_if)]
    if id < nr {
        if row_lead[id] as usize == id {
            let chunk = split_chunk(row_count[id] as usize, min_chunk);
            let start = split * chunk;
            let mut end = start;
            for r in id..nr {
                if row_lead[r] as usize == id {
                    let mut e = start + chunk;
                    if e > row_count[r] as usize {
                        e = row_count[r] as usize;
                    }
                    if e > end {
                        end = e;
                    }
                }
            }
            pass_end[id] = end as u32;
        }
    }
    sync_cube();
    // This lane's pairs' local rows (`nr` or more: padding of the warp's tile).
    let l0 = m0 / groups;
    let l1 = m1 / groups;

    // One pass per leader with keys in this split; every condition is the cube's (shared
    // values), so all threads reach each sync.
    for i in 0..nr {
        let first = row_first[i] as usize;
        let chunk = split_chunk(row_count[i] as usize, min_chunk);
        let start = split * chunk;
        let end = pass_end[i] as usize;
        if row_lead[i] as usize == i && end > start {
            // Where each of this lane's pairs stops (at most `start`: not in the pass, every
            // key masked). The bounds check comes first in its own `if`: a kernel's `&&` may read
            // both sides.
            let mut end0 = 0usize;
            let mut end1 = 0usize;
            #[allow(clippy::collapsible_if)]
            if l0 < nr {
                if row_lead[l0] as usize == i {
                    end0 = start + chunk;
                    if end0 > row_count[l0] as usize {
                        end0 = row_count[l0] as usize;
                    }
                }
            }
            #[allow(clippy::collapsible_if)]
            if l1 < nr {
                if row_lead[l1] as usize == i {
                    end1 = start + chunk;
                    if end1 > row_count[l1] as usize {
                        end1 = row_count[l1] as usize;
                    }
                }
            }
            // 1. q of both pairs, 16 bytes per 32 dimensions (zero for a pair not in the pass).
            let mut qa = Array::<Words>::new(chunks);
            let mut qb = Array::<Words>::new(chunks);
            #[unroll]
            for c in 0..chunks {
                qa[c] = zero;
                qb[c] = zero;
                if end0 > start {
                    qa[c] = q[((row0 + r0) * heads + h0) * words + c * 4 + t];
                }
                if end1 > start {
                    qb[c] = q[((row0 + r1) * heads + h1) * words + c * 4 + t];
                }
            }
            let mut mm0 = neg_inf;
            let mut mm1 = neg_inf;
            let mut ll0 = 0.0f32;
            let mut ll1 = 0.0f32;
            let mut o = Array::<Vector<f32, Const<4>>>::new(head_dim / 8);
            #[unroll]
            for nd in 0..head_dim / 8 {
                o[nd] = Vector::<f32, Const<4>>::new(0.0f32);
            }

            // 2. The pass's keys in blocks of KEY_BLOCK, staged in shared memory by the whole
            //    cube: thread `id` copies a quarter of key `id / 4`'s K and V rows (`cp.async`,
            //    two buffers). The next block's copies are issued before the current block is
            //    multiplied, its page-table entry a block earlier still. Keys past `end` are
            //    zero.
            let tkey = id / 4;
            let tq = id % 4;
            let mut phys = 0usize;
            if start + tkey < end {
                phys = keys[first + start + tkey] as usize;
            }
            let mut next_phys = 0usize;
            if start + KEY_BLOCK + tkey < end {
                next_phys = keys[first + start + KEY_BLOCK + tkey] as usize;
            }
            // (The previous pass's last block is no longer read from buffer 0: every pass ends
            // with a barrier before its stores.)
            stage_key(
                k,
                v,
                &mut ks,
                &mut vs,
                phys,
                start + tkey < end,
                kvh,
                kv_heads,
                tkey,
                tq,
                0usize,
                head_dim,
            );
            copies_commit();
            let mut kb = start;
            let mut buf = 0usize;
            while kb < end {
                // Every warp is done with the other buffer (the block before this one).
                sync_cube();
                if kb + KEY_BLOCK < end {
                    let key = kb + KEY_BLOCK + tkey;
                    stage_key(
                        k,
                        v,
                        &mut ks,
                        &mut vs,
                        next_phys,
                        key < end,
                        kvh,
                        kv_heads,
                        tkey,
                        tq,
                        1 - buf,
                        head_dim,
                    );
                    copies_commit();
                    next_phys = 0usize;
                    if key + KEY_BLOCK < end {
                        next_phys = keys[first + key + KEY_BLOCK] as usize;
                    }
                    copies_wait(1u32);
                } else {
                    copies_wait(0u32);
                }
                // This block's rows are in shared memory for every thread.
                sync_cube();
                let kbase = buf * KEY_BLOCK * KS_STRIDE;
                let vbase = buf * KEY_BLOCK * VS_STRIDE;

                // A warp whose tile holds none of the cube's rows only stages.
                if warp * 16 < (hi - lo) * groups {
                    // 3. S = q·Kᵀ for the block's four 8-key tiles: two mma steps per 32
                    //    dimensions; lane (g, t) takes 16 bytes of key g of each tile.
                    let mut s = Array::<Vector<f32, Const<4>>>::new(4usize);
                    #[unroll]
                    for nt in 0..4usize {
                        let mut acc = Array::<Vector<f32, Const<4>>>::new(1usize);
                        acc[0] = Vector::<f32, Const<4>>::new(0.0f32);
                        #[unroll]
                        for c in 0..chunks {
                            let kword = ks[kbase + (nt * 8 + g) * KS_STRIDE + c * 4 + t];
                            #[unroll]
                            for st in 0..2usize {
                                let mut a_words = Words::new(0u32);
                                a_words.insert(0usize, qa[c].extract(2 * st));
                                a_words.insert(1usize, qb[c].extract(2 * st));
                                a_words.insert(2usize, qa[c].extract(2 * st + 1));
                                a_words.insert(3usize, qb[c].extract(2 * st + 1));
                                let mut a = Array::<Vector<bf16, Const<8>>>::new(1usize);
                                a[0] = Vector::<bf16, Const<8>>::reinterpret(a_words);
                                let mut b_words = Vector::<u32, Const<2>>::new(0u32);
                                b_words.insert(0usize, kword.extract(2 * st));
                                b_words.insert(1usize, kword.extract(2 * st + 1));
                                let mut b = Array::<Vector<bf16, Const<4>>>::new(1usize);
                                b[0] = Vector::<bf16, Const<4>>::reinterpret(b_words);
                                def.execute_inplace(&a, &b, &mut acc);
                            }
                        }
                        s[nt] = acc[0];
                    }

                    // 4. Scale, mask (keys past a pair's end weigh nothing), online softmax.
                    //    Element `nt·4 + e` is key `nt·8 + 2t + e % 2` of pair `e / 2`.
                    let mut sv = Array::<f32>::new(16usize);
                    #[unroll]
                    for nt in 0..4usize {
                        #[unroll]
                        for e in 0..4usize {
                            let key = kb + nt * 8 + 2 * t + e % 2;
                            let mut stop = end0;
                            if e >= 2 {
                                stop = end1;
                            }
                            sv[nt * 4 + e] = neg_inf;
                            if key < stop {
                                sv[nt * 4 + e] = s[nt].extract(e) * scale;
                            }
                        }
                    }
                    let mut b0 = neg_inf;
                    let mut b1 = neg_inf;
                    #[unroll]
                    for nt in 0..4usize {
                        b0 = max(b0, max(sv[nt * 4], sv[nt * 4 + 1]));
                        b1 = max(b1, max(sv[nt * 4 + 2], sv[nt * 4 + 3]));
                    }
                    b0 = max(b0, plane_shuffle_xor(b0, 1u32));
                    b0 = max(b0, plane_shuffle_xor(b0, 2u32));
                    b1 = max(b1, plane_shuffle_xor(b1, 1u32));
                    b1 = max(b1, plane_shuffle_xor(b1, 2u32));
                    let n0 = max(mm0, b0);
                    let n1 = max(mm1, b1);
                    let mut c0 = 1.0f32;
                    let mut c1 = 1.0f32;
                    let mut pw = Array::<f32>::new(16usize);
                    #[unroll]
                    for e in 0..16usize {
                        pw[e] = 0.0f32;
                    }
                    if n0 != neg_inf {
                        c0 = (mm0 - n0).exp();
                        #[unroll]
                        for nt in 0..4usize {
                            pw[nt * 4] = (sv[nt * 4] - n0).exp();
                            pw[nt * 4 + 1] = (sv[nt * 4 + 1] - n0).exp();
                        }
                    }
                    if n1 != neg_inf {
                        c1 = (mm1 - n1).exp();
                        #[unroll]
                        for nt in 0..4usize {
                            pw[nt * 4 + 2] = (sv[nt * 4 + 2] - n1).exp();
                            pw[nt * 4 + 3] = (sv[nt * 4 + 3] - n1).exp();
                        }
                    }
                    let mut sum0 = 0.0f32;
                    let mut sum1 = 0.0f32;
                    #[unroll]
                    for nt in 0..4usize {
                        sum0 += pw[nt * 4] + pw[nt * 4 + 1];
                        sum1 += pw[nt * 4 + 2] + pw[nt * 4 + 3];
                    }
                    sum0 += plane_shuffle_xor(sum0, 1u32);
                    sum0 += plane_shuffle_xor(sum0, 2u32);
                    sum1 += plane_shuffle_xor(sum1, 1u32);
                    sum1 += plane_shuffle_xor(sum1, 2u32);
                    ll0 = ll0 * c0 + sum0;
                    ll1 = ll1 * c1 + sum1;
                    mm0 = n0;
                    mm1 = n1;
                    #[unroll]
                    for nd in 0..head_dim / 8 {
                        let prev = o[nd];
                        let mut scaled = Vector::<f32, Const<4>>::new(0.0f32);
                        scaled.insert(0usize, prev.extract(0usize) * c0);
                        scaled.insert(1usize, prev.extract(1usize) * c0);
                        scaled.insert(2usize, prev.extract(2usize) * c1);
                        scaled.insert(3usize, prev.extract(3usize) * c1);
                        o[nd] = scaled;
                    }

                    // 5. O += P·V, one k16 step per two tiles: P as the A operand (the C layout of
                    //    two tiles is the A layout of one step), in two bf16 parts, the rounded
                    //    weight and the rounded remainder (their sum is the f32 weight to about
                    //    16 bits, so P·V loses no more than f32 accumulation would); lane (g, t)
                    //    takes dimension g of keys 2t, 2t + 1, 2t + 8, 2t + 9 of the step from
                    //    shared memory.
                    #[unroll]
                    for ks_step in 0..2usize {
                        let p0 = ks_step * 8;
                        let mut hi_words = Words::new(0u32);
                        let mut lo_words = Words::new(0u32);
                        #[unroll]
                        for r in 0..4usize {
                            let x0 = pw[p0 + 2 * r];
                            let x1 = pw[p0 + 2 * r + 1];
                            let h0 = bf16_bits(x0);
                            let h1 = bf16_bits(x1);
                            let rem0 = bf16_bits(x0 - f32::reinterpret(h0 << 16u32));
                            let rem1 = bf16_bits(x1 - f32::reinterpret(h1 << 16u32));
                            hi_words.insert(r, h0 | (h1 << 16u32));
                            lo_words.insert(r, rem0 | (rem1 << 16u32));
                        }
                        let mut a = Array::<Vector<bf16, Const<8>>>::new(1usize);
                        a[0] = Vector::<bf16, Const<8>>::reinterpret(hi_words);
                        let mut a_lo = Array::<Vector<bf16, Const<8>>>::new(1usize);
                        a_lo[0] = Vector::<bf16, Const<8>>::reinterpret(lo_words);
                        let key0 = ks_step * 16 + 2 * t;
                        #[unroll]
                        for nd in 0..head_dim / 8 {
                            let col = (nd * 8 + g) / 2;
                            let shift = u32::cast_from(g % 2) * 16u32;
                            let v0 = (vs[vbase + key0 * VS_STRIDE + col] >> shift) & 0xFFFFu32;
                            let v1 = (vs[vbase + (key0 + 1) * VS_STRIDE + col] >> shift) & 0xFFFFu32;
                            let v8 = (vs[vbase + (key0 + 8) * VS_STRIDE + col] >> shift) & 0xFFFFu32;
                            let v9 = (vs[vbase + (key0 + 9) * VS_STRIDE + col] >> shift) & 0xFFFFu32;
                            let mut b_words = Vector::<u32, Const<2>>::new(0u32);
                            b_words.insert(0usize, v0 | (v1 << 16u32));
                            b_words.insert(1usize, v8 | (v9 << 16u32));
                            let mut b = Array::<Vector<bf16, Const<4>>>::new(1usize);
                            b[0] = Vector::<bf16, Const<4>>::reinterpret(b_words);
                            let mut acc = Array::<Vector<f32, Const<4>>>::new(1usize);
                            acc[0] = o[nd];
                            def.execute_inplace(&a, &b, &mut acc);
                            def.execute_inplace(&a_lo, &b, &mut acc);
                            o[nd] = acc[0];
                        }
                    }
                }
                kb += KEY_BLOCK;
                buf = 1 - buf;
            }

            // 7. Each pair's split state, in the layout `combine_kernel` reads. The barrier first:
            //    the next pass may stage into the buffers as soon as every warp is past it (and
            //    with it here the compiler keeps the kernel at 168 registers, three cubes an SM,
            //    instead of 183 with the wide stores).
            sync_cube();
            if wide {
                // 16 bytes per store: lanes t and t ^ 1 (same pairs) swap halves, so that for
                // each two 8-wide column tiles the even lane stores four dimensions of the first
                // tile and the odd lane four of the second (every lane of the warp swaps).
                let odd = t % 2 == 1;
                let quad = head_dim / 4;
                #[unroll]
                for pi in 0..head_dim / 16 {
                    let mut keep = o[2 * pi];
                    let mut send = o[2 * pi + 1];
                    if odd {
                        keep = o[2 * pi + 1];
                        send = o[2 * pi];
                    }
                    let mut got = Vector::<f32, Const<4>>::new(0.0f32);
                    got.insert(0usize, plane_shuffle_xor(send.extract(0usize), 1u32));
                    got.insert(1usize, plane_shuffle_xor(send.extract(1usize), 1u32));
                    got.insert(2usize, plane_shuffle_xor(send.extract(2usize), 1u32));
                    got.insert(3usize, plane_shuffle_xor(send.extract(3usize), 1u32));
                    // The even lane's own values come first, then its partner's; the odd lane's
                    // after its partner's.
                    let mut lo = keep;
                    let mut hi = got;
                    if odd {
                        lo = got;
                        hi = keep;
                    }
                    let mut w0 = Vector::<f32, Const<4>>::new(0.0f32);
                    let mut w1 = Vector::<f32, Const<4>>::new(0.0f32);
                    w0.insert(0usize, lo.extract(0usize));
                    w0.insert(1usize, lo.extract(1usize));
                    w0.insert(2usize, hi.extract(0usize));
                    w0.insert(3usize, hi.extract(1usize));
                    w1.insert(0usize, lo.extract(2usize));
                    w1.insert(1usize, lo.extract(3usize));
                    w1.insert(2usize, hi.extract(2usize));
                    w1.insert(3usize, hi.extract(3usize));
                    // Column tile 2·pi (even lane) or 2·pi + 1 (odd), dimensions from 2·(t − t % 2).
                    let at = (2 * pi + t % 2) * 2 + t / 2;
                    if end0 > start {
                        part4[((r0 * heads + h0) * stride + split) * quad + at] = w0;
                    }
                    if end1 > start {
                        part4[((r1 * heads + h1) * stride + split) * quad + at] = w1;
                    }
                }
            } else {
                // Scalar stores of this lane's own values, only for pairs in the pass.
                if end0 > start {
                    store_pair(part, &o, (r0 * heads + h0) * stride + split, t, head_dim, 0usize);
                }
                if end1 > start {
                    store_pair(part, &o, (r1 * heads + h1) * stride + split, t, head_dim, 1usize);
                }
            }
            if t == 0 {
                if end0 > start {
                    let slot = (r0 * heads + h0) * stride + split;
                    ml[2 * slot] = mm0;
                    ml[2 * slot + 1] = ll0;
                }
                if end1 > start {
                    let slot = (r1 * heads + h1) * stride + split;
                    ml[2 * slot] = mm1;
                    ml[2 * slot + 1] = ll1;
                }
            }
        }
    }

    // 8. With `fold` (cubes of one row), the last of the row's split cubes for this K/V head to
    //    arrive merges the split states of its query heads, as `combine_kernel` would.
    if comptime![fold] {
        let at = CUBE_POS_X as usize * CUBE_COUNT_Y as usize + kvh;
        if arrive_last(sync, at, CUBE_COUNT_Z) && nr == 1usize {
            fold_combine(
                part,
                ml,
                meta,
                out,
                row0 + lo,
                lo,
                kvh,
                heads,
                stride,
                id,
                head_dim,
                groups,
                min_chunk,
            );
        }
    }
}

/// One term of a split merge, `acc + value · weight`: the combine kernel and the folded merge
/// of the tensor-core kernel both add their terms through this, so the two compile to the same
/// arithmetic (a fused multiply-add or not alike) and give the same bits.
#[cube]
fn merge_term(acc: f32, value: f32, weight: f32) -> f32 {
    acc + value * weight
}

/// A cube's arrival at its counter `sync[at]`, after its split states are written: `true` in
/// every thread of the last of `arrivals` cubes to arrive, which finds every other cube's states
/// written (each cube's threads store before the barrier, then its first thread fences and
/// counts itself in; the last one fences again before reading) and sets the counter back to zero
/// for the next launch. As the Markov loop's grid barrier, but no cube waits.
#[cube]
fn arrive_last(sync: &[Atomic<u32>], at: usize, arrivals: u32) -> bool {
    sync_cube();
    let mut flag = Shared::<[u32]>::new_slice(1usize);
    if UNIT_POS == 0 {
        gpu_asm!("fence.acq_rel.gpu;");
        let before = sync[at].fetch_add(1u32);
        let mut last = 0u32;
        if before + 1u32 == arrivals {
            sync[at].store(0u32);
            last = 1u32;
        }
        gpu_asm!("fence.acq_rel.gpu;");
        flag[0] = last;
    }
    sync_cube();
    flag[0] == 1u32
}

/// Splits merged per batch of loads in the folded combine (four accumulators a thread each).
const FOLD_BATCH: usize = 8;

/// The merge of [`combine_kernel`] for the `groups` query heads of K/V head `kvh` of launch row
/// `local` (query row `row`), by the one cube that found every split state written
/// ([`arrive_last`]): thread `id` takes head `id / (head_dim / 4)` of the group and four
/// consecutive dimensions, loads its splits' accumulators, [`FOLD_BATCH`] splits in flight, and
/// adds them in split order with the combine's arithmetic, so each output has the combine's
/// bits. The states are read through the pointers the split kernel writes them with (`part`
/// and `ml`): through a pointer the kernel never writes, the compiler could take them for
/// read-only data and read them through the non-coherent cache, which need not hold what other
/// cubes wrote.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fold_combine(
    part: &mut [f32],
    ml: &mut [f32],
    meta: &[i32],
    out: &mut [bf16],
    row: usize,
    local: usize,
    kvh: usize,
    heads: usize,
    stride: usize,
    id: usize,
    #[comptime] head_dim: usize,
    #[comptime] groups: usize,
    #[comptime] min_chunk: usize,
) {
    let quads = head_dim / 4;
    let count = meta[2 * row + 1] as usize;
    let chunk = split_chunk(count, min_chunk);
    let mut splits = count.div_ceil(chunk);
    if splits > stride {
        splits = stride;
    }
    // Every (head, split) state's max and sum into shared memory, one load a thread per round.
    let mut ms = Shared::<[f32]>::new_slice(groups * MAX_SPLITS);
    let mut ls = Shared::<[f32]>::new_slice(groups * MAX_SPLITS);
    let threads = MMA_WARPS * 32;
    #[unroll]
    for r in 0..(groups * MAX_SPLITS).div_ceil(threads) {
        let e = r * threads + id;
        let hh = e / MAX_SPLITS;
        let s = e % MAX_SPLITS;
        if hh < groups && s < splits {
            let slot = (local * heads + kvh * groups + hh) * stride + s;
            ms[e] = ml[2 * slot];
            ls[e] = ml[2 * slot + 1];
        }
    }
    sync_cube();
    #[unroll]
    for r in 0..(groups * quads).div_ceil(threads) {
        let e = r * threads + id;
        let hh = e / quads;
        let quad = e % quads;
        if hh < groups {
            let head = kvh * groups + hh;
            let base = (local * heads + head) * stride;
            let mut big = f32::new(f32::NEG_INFINITY);
            for s in 0..splits {
                big = max(big, ms[hh * MAX_SPLITS + s]);
            }
            let mut l = 0.0f32;
            let mut a0 = 0.0f32;
            let mut a1 = 0.0f32;
            let mut a2 = 0.0f32;
            let mut a3 = 0.0f32;
            let mut s0 = 0usize;
            while s0 < splits {
                let mut pv = Array::<f32>::new(4 * FOLD_BATCH);
                #[unroll]
                for b in 0..FOLD_BATCH {
                    #[unroll]
                    for c in 0..4usize {
                        pv[4 * b + c] = 0.0f32;
                        if s0 + b < splits {
                            pv[4 * b + c] = part[(base + s0 + b) * head_dim + quad * 4 + c];
                        }
                    }
                }
                #[unroll]
                for b in 0..FOLD_BATCH {
                    if s0 + b < splits {
                        let s = s0 + b;
                        let c = (ms[hh * MAX_SPLITS + s] - big).exp();
                        l = merge_term(l, ls[hh * MAX_SPLITS + s], c);
                        a0 = merge_term(a0, pv[4 * b], c);
                        a1 = merge_term(a1, pv[4 * b + 1], c);
                        a2 = merge_term(a2, pv[4 * b + 2], c);
                        a3 = merge_term(a3, pv[4 * b + 3], c);
                    }
                }
                s0 += FOLD_BATCH;
            }
            let o = (row * heads + head) * head_dim + quad * 4;
            out[o] = bf16::cast_from(a0 * (1.0f32 / l));
            out[o + 1] = bf16::cast_from(a1 * (1.0f32 / l));
            out[o + 2] = bf16::cast_from(a2 * (1.0f32 / l));
            out[o + 3] = bf16::cast_from(a3 * (1.0f32 / l));
        }
    }
}

/// `out[r, h, d]`: the splits of row `r = row0 + x`, head `h` merged in split order (thread
/// `d` of cube `(x, h)`), normalised, rounded to bf16.
///
/// The split states are read in two rounds of loads issued together (the `(max, sum)` pairs by
/// one thread each into shared memory, then every split's accumulator for this thread's
/// dimension), not one dependent load per split; the sums are the same, in split order.
#[cube(launch_unchecked)]
fn combine_kernel(
    part: &[f32],
    ml: &[f32],
    meta: &[i32],
    out: &mut [bf16],
    row0: u32,
    stride: u32,
    #[comptime] head_dim: usize,
    #[comptime] min_chunk: usize,
) {
    crate::cuda::pdl::dependency_wait();
    let local = CUBE_POS_X as usize;
    let row = row0 as usize + local;
    let head = CUBE_POS_Y as usize;
    let heads = CUBE_COUNT_Y as usize;
    let d = UNIT_POS_X as usize;
    let stride = stride as usize;
    let count = meta[2 * row + 1] as usize;
    let chunk = split_chunk(count, min_chunk);
    let mut splits = count.div_ceil(chunk);
    // Only a row reading past the key table could have more (the launch's contract rules it
    // out); never read past the scratch.
    if splits > stride {
        splits = stride;
    }
    let base = (local * heads + head) * stride;
    // head_dim ≥ 32 = MAX_SPLITS threads: one per split.
    let mut ms = Shared::<[f32]>::new_slice(MAX_SPLITS);
    let mut ls = Shared::<[f32]>::new_slice(MAX_SPLITS);
    if d < splits {
        ms[d] = ml[2 * (base + d)];
        ls[d] = ml[2 * (base + d) + 1];
    }
    let mut pv = Array::<f32>::new(MAX_SPLITS);
    #[unroll]
    for s in 0..MAX_SPLITS {
        pv[s] = 0.0f32;
        if s < splits {
            pv[s] = part[(base + s) * head_dim + d];
        }
    }
    sync_cube();
    let mut big = f32::new(f32::NEG_INFINITY);
    for s in 0..splits {
        big = max(big, ms[s]);
    }
    let mut l = 0.0f32;
    let mut acc = 0.0f32;
    #[unroll]
    for s in 0..MAX_SPLITS {
        if s < splits {
            let c = (ms[s] - big).exp();
            l = merge_term(l, ls[s], c);
            acc = merge_term(acc, pv[s], c);
        }
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

/// Attention of `q` over the paged pool through the kernel (see [`crate::paged_attention`]);
/// `group` rows in a row share their keys as far as the caller knows (a lane's window), which
/// only decides how rows meet in the tensor-core kernel's cubes, never a result.
pub(crate) fn paged_attention(
    q: Tensor<3>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
    keys: &Tensor<1, Int>,
    meta: &Tensor<2, Int>,
    group: usize,
    sync: Option<&Tensor<1, Int>>,
) -> Tensor<3> {
    let (q, k_pool, v_pool) =
        (q.into_dispatch(), k_pool.clone().into_dispatch(), v_pool.clone().into_dispatch());
    let keys = keys.clone().cast(DType::I32).into_dispatch();
    let meta = meta.clone().cast(DType::I32).into_dispatch();
    // The counters are used in place (a cast would count in a copy), so only i32 ones are taken.
    let y = match sync.filter(|s| s.dtype() == DType::I32) {
        Some(sync) => <Dispatch as PagedAttentionOps>::paged_attention_synced(
            q,
            k_pool,
            v_pool,
            keys,
            meta,
            sync.clone().into_dispatch(),
            group,
        ),
        None => <Dispatch as PagedAttentionOps>::paged_attention(q, k_pool, v_pool, keys, meta, group),
    };
    Tensor::from_dispatch(y)
}

/// Whether the tensor-core split kernel serves this head width (its f32 accumulators take
/// `head_dim / 2` registers per lane).
fn mma_serves(head_dim: usize) -> bool {
    crate::tensor_core_attention() && head_dim <= 128
}

/// How the tensor-core kernel cuts groups of `group` rows of `groups` heads each into cubes:
/// `(rows per cube, cubes per group)`.
fn mma_cubes(group: usize, groups: usize) -> (usize, usize) {
    let cap = (MMA_ROWS / groups).max(1);
    let cubes = group.div_ceil(cap);
    (group.div_ceil(cubes), cubes)
}

/// Calls whose merge was folded into the split kernel, for tests (see [`crate::attention_folds`]).
pub(crate) static FOLDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counter words [`launch`] needs in `sync` to fold the combine into the split kernel for `rows`
/// query rows over `kv_heads` K/V heads: one per (row of a launch, K/V head).
pub(crate) fn sync_words(rows: usize, kv_heads: usize) -> usize {
    const _: () = assert!(ROWS_PER_LAUNCH == 64, "crate::attention_sync_words assumes 64");
    crate::attention_sync_words(rows.min(ROWS_PER_LAUNCH), kv_heads)
}

fn launch(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    keys: CubeTensor,
    meta: CubeTensor,
    group: usize,
    sync: Option<CubeTensor>,
) -> CubeTensor {
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
    let mma = mma_serves(head_dim);
    // Launches hold whole groups (a lane's window is never cut between two launches).
    let group = group.clamp(1, ROWS_PER_LAUNCH);
    let per_launch = if mma { ROWS_PER_LAUNCH / group * group } else { ROWS_PER_LAUNCH };
    let (per_cube, cubes_per_group) = mma_cubes(group, groups);
    let min_chunk = crate::attention_min_chunk();
    let stride = split_stride(n_keys, min_chunk);
    let launch_rows = rows.min(per_launch);
    let part_len = launch_rows * heads * stride * head_dim;
    let ml_len = launch_rows * heads * stride * 2;
    let part = scratch(part_len);
    let ml = scratch(ml_len);
    // The combine folded into the split kernel: cubes of one row, and a zeroed counter a
    // (launch row, K/V head) from the caller. The merge is the combine's, so the bits are the
    // same either way (and the same as a window's rows get from the combine kernel).
    let sync = sync
        .filter(|s| {
            mma && group == 1
                && crate::attention_fold()
                && s.dtype == DType::I32
                && s.meta.num_elements() >= sync_words(launch_rows, kv_heads)
        })
        .map(contiguous);
    let fold = sync.is_some();
    if fold {
        FOLDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let sync_handle = sync.as_ref().map_or_else(|| ml.handle.clone(), |s| s.handle.clone());
    let sync_len = sync.as_ref().map_or(1, |s| s.meta.num_elements());
    for row0 in (0..rows).step_by(per_launch) {
        let n = launch_rows.min(rows - row0);
        // SAFETY: lengths are the buffers' sizes in the kernel's units; the split kernels read
        // q rows `row0 .. row0 + n < rows`, pool rows named in `keys` (the caller's page tables,
        // all `< pool_rows`), `keys` entries `meta[2r] .. meta[2r] + meta[2r + 1]` (within
        // `keys` by construction of the plan, so a row has at most `split_stride(n_keys)`
        // splits: its chunk is at least `min_chunk` keys), and write slots `< n · heads · stride`
        // of `part` and `ml` (split `< stride`: the grid's z; the tensor-core kernel's cubes
        // cover rows `< n`; it takes `part` twice, as f32 and as 16-byte words, and writes it
        // through one of them only, chosen at compile time); the combine reads the slots the
        // splits of each row wrote (the same `split_chunk` of the same count, at most `stride`)
        // and writes rows `row0 .. row0 + n` of `out` within `[rows, heads, head_dim]`. With
        // `fold` (cubes of one row, `group == 1`), the tensor-core kernel's cube `(x, y)` counts
        // itself in at `sync[x · kv_heads + y]` (`x < n ≤ launch_rows`, so within the
        // `sync_words(launch_rows, kv_heads)` the filter above asked for) and the last of the
        // `stride` cubes of that counter reads back the states they wrote (through `part4`) and
        // writes its row's heads of `out`, as the combine would; it leaves the counter zero, so
        // every launch finds them all zero. Launches of one call run in order on one stream, so
        // each finds the scratch free.
        unsafe {
            if mma {
                super::pdl::before_launch(&client);
                paged_attention_mma_kernel::launch_unchecked(
                    &client,
                    CubeCount::Static(
                        (n.div_ceil(group) * cubes_per_group) as u32,
                        kv_heads as u32,
                        stride as u32,
                    ),
                    CubeDim::new_2d(32, MMA_WARPS as u32),
                    BufferArg::from_raw_parts(q.handle.clone(), rows * heads * head_dim / 8),
                    BufferArg::from_raw_parts(k.handle.clone(), pool_words),
                    BufferArg::from_raw_parts(v.handle.clone(), pool_words),
                    BufferArg::from_raw_parts(keys.handle.clone(), n_keys),
                    BufferArg::from_raw_parts(meta.handle.clone(), rows * 2),
                    BufferArg::from_raw_parts(part.handle.clone(), part_len),
                    BufferArg::from_raw_parts(part.handle.clone(), part_len / 4),
                    BufferArg::from_raw_parts(ml.handle.clone(), ml_len),
                    BufferArg::from_raw_parts(sync_handle.clone(), sync_len),
                    BufferArg::from_raw_parts(out.handle.clone(), rows * heads * head_dim),
                    row0 as u32,
                    n as u32,
                    stride as u32,
                    kv_heads as u32,
                    1.0 / (head_dim as f32).sqrt(),
                    group as u32,
                    per_cube as u32,
                    cubes_per_group as u32,
                    head_dim,
                    groups,
                    group > 1,
                    min_chunk,
                    fold,
                );
                if fold {
                    continue;
                }
            } else {
                super::pdl::before_launch(&client);
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
                    min_chunk,
                );
            }
            super::pdl::before_launch(&client);
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
                min_chunk,
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
        group: usize,
    ) -> burn::backend::tensor::FloatTensor<Self>;

    /// See [`crate::paged_attention_synced`]: `sync` holds zeroed i32 counters, left zero.
    #[fusion(dtype = q, shape = same_shape(q))]
    fn paged_attention_synced(
        q: burn::backend::tensor::FloatTensor<Self>,
        k_pool: burn::backend::tensor::FloatTensor<Self>,
        v_pool: burn::backend::tensor::FloatTensor<Self>,
        keys: burn::backend::tensor::IntTensor<Self>,
        meta: burn::backend::tensor::IntTensor<Self>,
        sync: burn::backend::tensor::IntTensor<Self>,
        group: usize,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl PagedAttentionOps for CubeBackend {
    fn paged_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        keys: CubeTensor,
        meta: CubeTensor,
        group: usize,
    ) -> CubeTensor {
        launch(q, k, v, keys, meta, group, None)
    }

    fn paged_attention_synced(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        keys: CubeTensor,
        meta: CubeTensor,
        sync: CubeTensor,
        group: usize,
    ) -> CubeTensor {
        launch(q, k, v, keys, meta, group, Some(sync))
    }
}

/// The attention kernels for heads of `head_dim`, `groups` query heads per K/V head, as
/// [`launch`] launches them: the tensor-core kernel (one row per group, and `wide` windows), the
/// split kernel, and the combine; transpiled without a device (see [`super::offline`]).
pub(crate) fn offline_attention(
    head_dim: usize,
    groups: usize,
) -> Vec<Result<super::offline::KernelSource, String>> {
    use super::offline::{offline_kernel, transpile};
    let mut all = Vec::new();
    if head_dim <= 128 {
        // Windows (`wide`), and one-row cubes with the combine apart or folded in.
        for (wide, fold) in [(false, false), (true, false), (false, true)] {
            let name = if fold { " fold" } else { "" };
            all.push(transpile(
                &format!("paged_attention_mma: head_dim={head_dim} groups={groups} wide={wide}{name}"),
                offline_kernel!(
                    paged_attention_mma_kernel::PagedAttentionMmaKernel,
                    CubeDim::new_2d(32, MMA_WARPS as u32);
                    b b b b b b b b b b s s s s s s s s;
                    head_dim, groups, wide, crate::attention_min_chunk(), fold
                ),
            ));
        }
    }
    all.push(transpile(
        &format!("paged_attention_split: head_dim={head_dim} groups={groups}"),
        offline_kernel!(
            paged_attention_split_kernel::PagedAttentionSplitKernel,
            CubeDim::new_2d(32, groups as u32);
            b b b b b b b s s s s;
            head_dim, groups, crate::attention_min_chunk()
        ),
    ));
    all.push(transpile(
        &format!("attention combine: head_dim={head_dim}"),
        offline_kernel!(
            combine_kernel::CombineKernel,
            CubeDim::new_1d(head_dim as u32);
            b b b b s s;
            head_dim, crate::attention_min_chunk()
        ),
    ));
    all
}
