//! A decoder layer's tail in one launch: the o projection, the residual add and norm after it,
//! the gate/up product with its SwiGLU, the down projection, and the residual add and norm that
//! hand the next layer its input (five launches of [`super::gemm`] and [`super::fused`]
//! otherwise).
//!
//! # Why
//! A one-row product streams its weight at the memory's pace, but each launch of it also pays a
//! launch, a ramp (its first weight bytes arrive a memory round trip after it starts) and a tail
//! (its last cubes finish while the rest of the GPU idles): about 4–6 µs of a 10–50 µs product on
//! the H200 (`benches/results/2026-12-07-h200-l2-prefetch.md`), and the norm between two
//! products adds its own latency. A product's weights do not depend on the product before it, so
//! in one launch a cube of the next product can stream its first weights while the last cubes of
//! the one before finish and the norm runs.
//!
//! # How the launch is ordered
//! The launch has one cube per task: every cube of each product as its own launch would have it,
//! and one cube per row for each norm, phase after phase. A cube takes the next task from a
//! counter (its ticket), not from its place in the grid, so tasks are taken in order. A task
//! waits only for tasks of earlier phases (the products for the norm after them, a product for
//! the norm before it), and those were all taken, by cubes already running, before its own: so
//! every wait ends, whatever the number of cubes the GPU holds at once (no cube waits for one
//! that is not running, as a grid barrier would need). A product's cube loads its first step of
//! weights before it waits; a norm's cube its row and weights.
//!
//! Each phase counts its finished tasks; a task of the next phase waits until the count is
//! complete. A cube's stores come before its count (its threads' barrier, then its first thread
//! fences and counts), and a waiting cube's first thread fences after it sees the count and
//! before its cube's barrier, so every store of the earlier phase is seen. The last task of the
//! last phase sets the counters back to zero for the next launch. Data one phase writes and a
//! later one reads is read through a pointer the kernel also writes (never executed: see
//! [`chain_kernel`]), so the compiler cannot take it for read-only data and read it through the
//! non-coherent cache.
//!
//! # The same bits
//! Each product's cube runs [`super::gemm::gemm_block`], the body of its own launch, on the same
//! block; each norm row runs the body of [`super::fused`]'s norm with the reduction order of the
//! norm's own cube ([`crate::norm_threads`] threads, emulated by this launch's 256). So every
//! value is bit for bit the one the five launches make (`gpu_kernels layer_tail_matches_unfused`),
//! and a row gets the same bits through the chain as through the separate launches of a longer
//! forward.

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::bf16;

use super::fused::norm_row_staged;
use super::gemm::{MAX_ROWS, WARPS, gemm_block, gemm_first_weights, launch_tiles, plan};
use super::gemm_fp8::fp8_gemm_block;
use super::offline::{KernelSource, offline_kernel, transpile};
use crate::TailWeights;
use crate::fp8::ScaleGrid;
use crate::gemm_plan::Weights;

/// 16 bytes: eight bf16 as four 32-bit words.
type Words = Vector<u32, Const<4>>;

/// Counter words a chained launch needs: the ticket, then one count of finished tasks per phase.
pub(crate) const CHAIN_WORDS: usize = 8;
/// The prefetch depths the chain is built for ([`crate::set_chain_prefetch`]): the compile check
/// covers these (at depth 0 ptxas spills a few bytes in two variants).
pub(crate) const PREFETCH_DEPTHS: [usize; 3] = [1, 2, 8];

/// Calls that ran the chained launch, for tests (see [`crate::layer_chains`]).
pub(crate) static CHAINS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Threads of every cube of the launch (the products' `WARPS` warps).
const THREADS: usize = WARPS * 32;
/// Most rows the chain takes: two activation tiles, so the three products' shared sums stay at
/// 8 KiB each (more rows run the separate launches).
pub(crate) const CHAIN_MAX_ROWS: usize = 16;

/// This cube's task: the ticket counter's value as the cube's first thread took it.
#[cube]
fn take_ticket(sync: &[Atomic<u32>]) -> u32 {
    let mut ticket = Shared::<[u32]>::new_slice(1usize);
    if UNIT_POS == 0 {
        ticket[0] = sync[0].fetch_add(1u32);
    }
    sync_cube();
    ticket[0]
}

/// Waits until phase counter `sync[at]` reaches `target`: the first thread polls, then fences,
/// and the cube's barrier hands on what it saw.
#[cube]
fn wait_for(sync: &[Atomic<u32>], at: usize, target: u32) {
    if UNIT_POS == 0 {
        loop {
            if sync[at].load() >= target {
                break;
            }
            gpu_asm!("nanosleep.u32 32;");
        }
        gpu_asm!("fence.acq_rel.gpu;");
    }
    sync_cube();
}

/// Counts this cube's task as finished at `sync[at]`, after every thread's stores; returns the
/// count before it (in every thread).
#[cube]
fn finish_task(sync: &[Atomic<u32>], at: usize) -> u32 {
    sync_cube();
    let mut before = Shared::<[u32]>::new_slice(1usize);
    if UNIT_POS == 0 {
        gpu_asm!("fence.acq_rel.gpu;");
        before[0] = sync[at].fetch_add(1u32);
    }
    sync_cube();
    before[0]
}

/// One product's cube `(block, split)` of a chained launch, counted at `sync[phase + 1]` when
/// done: [`gemm_block`] for bf16 weights, [`fp8_gemm_block`] for FP8 ones (`scales` per row, or
/// per 128×128 block when `blocked`), `x_words` the activation row's width in 16-byte words.
/// Past phase 0 it first loads its first `early` chunk slots of weights
/// ([`gemm_first_weights`]; an FP8 row has half the words of its bf16 activation row), then waits
/// until `sync[phase]` counts `target` finished tasks of the phase before it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn chained_product(
    x: &mut [Words],
    w: &[Words],
    scales: &[f32],
    y: &mut [bf16],
    parts: &mut [f32],
    logits: &[bf16],
    slots: &[Atomic<u64>],
    sync: &[Atomic<u32>],
    rows: usize,
    x_words: usize,
    out: usize,
    scale_cols: usize,
    pow2_120: f32,
    block: usize,
    split: usize,
    target: u32,
    #[comptime] phase: usize,
    #[comptime] tiles: usize,
    #[comptime] unroll: usize,
    #[comptime] splits: usize,
    #[comptime] mtiles: usize,
    #[comptime] blocked: bool,
    #[comptime] swiglu: bool,
    #[comptime] early: usize,
    #[comptime] fp8: bool,
) {
    let mut wa = Array::<Words>::new(unroll * mtiles);
    let mut wb = Array::<Words>::new(unroll * mtiles);
    let early = comptime!(if phase > 0 { early } else { 0 });
    if comptime![phase > 0] {
        let w_words = if comptime![fp8] { x_words / 2 } else { x_words };
        gemm_first_weights(w, &mut wa, &mut wb, w_words, block, split, WARPS, unroll, splits, mtiles, early);
        wait_for(sync, phase, target);
    }
    if comptime![fp8] {
        fp8_gemm_block(
            x, w, scales, y, parts, logits, slots, rows, x_words, out, scale_cols, pow2_120, 0usize, block,
            split, &mut wa, &mut wb, tiles, WARPS, unroll, blocked, splits, mtiles, swiglu, false, early,
        );
    } else {
        gemm_block(
            x, w, y, parts, logits, slots, rows, x_words, out, 0usize, block, split, &mut wa, &mut wb, tiles,
            WARPS, unroll, splits, swiglu, mtiles, false, early,
        );
    }
    finish_task(sync, phase + 1);
}

/// The launch: see the module doc. Phases, in ticket order:
/// 0. o: `a · w_oᵀ` (`d / 16 / mt` blocks × `splits` cubes): bf16 into `dy`, or with splits the
///    f32 split sums into `parts`;
/// 1. one cube per row: `x1 = x + o`, `h1 = RMSNorm(x1)·norm1`;
/// 2. gate/up: `act = silu(h1 · gᵀ) · (h1 · uᵀ)` from the paired weight `w_gu` (`2·inter / 16 /
///    mt` cubes);
/// 3. down: `act · w_dᵀ`, into `dy` or `parts` as the o product;
/// 4. one cube per row: `x2 = x1 + down`, `h2 = RMSNorm(x2)·norm2`.
///
/// `x`, `x1`, `x2`, `h1`, `h2`, `dy`: `[rows, d]` bf16; `a`: `[rows, hq]` as words; `act`:
/// `[rows, inter]` bf16, `actw` the same buffer as words, `h1w` `h1`'s; `parts`: `[splits, rows,
/// d]` f32. `dy` and `parts` hold the o product, then the down product: phase 3 starts after
/// phase 1 read them. With `fp8` the weights are e4m3 bytes as words with their scales (`s_*`;
/// `o.3` and `down.3` say whether per block); without, the scales are never read. `sync`:
/// [`CHAIN_WORDS`] zeroed counters; `slots` stands in for the products' unused argmax slots.
/// The comptime tuples: `o` and `down` (unroll, splits, weight blocks a cube, blocked scales),
/// `gu` (unroll, weight blocks a cube).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn chain_kernel(
    x: &mut [bf16],
    a: &mut [Words],
    w_o: &[Words],
    s_o: &[f32],
    norm1: &[bf16],
    x1: &mut [bf16],
    h1: &mut [bf16],
    h1w: &mut [Words],
    w_gu: &[Words],
    s_gu: &[f32],
    act: &mut [bf16],
    actw: &mut [Words],
    w_d: &[Words],
    s_d: &[f32],
    norm2: &[bf16],
    x2: &mut [bf16],
    h2: &mut [bf16],
    dy: &mut [bf16],
    parts: &mut [f32],
    slots: &[Atomic<u64>],
    sync: &[Atomic<u32>],
    rows: u32,
    hq_words: u32,
    inter_words: u32,
    o_scale_cols: u32,
    d_scale_cols: u32,
    pow2_120: f32,
    eps: f32,
    inv_d: f32,
    #[comptime] d: usize,
    #[comptime] tiles: usize,
    #[comptime] o_unroll: usize,
    #[comptime] o_splits: usize,
    #[comptime] o_mt: usize,
    #[comptime] o_blocked: bool,
    #[comptime] gu_unroll: usize,
    #[comptime] gu_mt: usize,
    #[comptime] d_unroll: usize,
    #[comptime] d_splits: usize,
    #[comptime] d_mt: usize,
    #[comptime] d_blocked: bool,
    #[comptime] virt: usize,
    #[comptime] fp8: bool,
    #[comptime] early: usize,
) {
    crate::cuda::pdl::dependency_wait();
    let rows = rows as usize;
    // Never true (a launch has rows): stores the compiler must assume, so that it reads the
    // activations the norms and the gate/up cubes write (as bf16) through pointers it may not
    // take for read-only ones (see the module doc).
    if rows == 0 {
        h1w[0] = Words::new(0u32);
        actw[0] = Words::new(0u32);
    }
    let hq_words = hq_words as usize;
    let inter_words = inter_words as usize;
    let o_blocks = d / 16 / o_mt;
    let gu_blocks = inter_words * 8 * 2 / 16 / gu_mt;
    let d_blocks = d / 16 / d_mt;
    let end_o = o_blocks * o_splits;
    let end_n1 = end_o + rows;
    let end_gu = end_n1 + gu_blocks;
    let end_d = end_gu + d_blocks * d_splits;
    let parts_len = (rows * d) as u32;
    let tid = UNIT_POS as usize;
    // A product cut in splits leaves f32 sums for the norm; one not cut, bf16 rows in `dy`.
    let o_norm = comptime!(if o_splits > 1 { o_splits } else { 0 });
    let d_norm = comptime!(if d_splits > 1 { d_splits } else { 0 });

    // A norm row's sums (one buffer for both norm phases: a cube runs one task).
    let mut staged = Shared::<[f32]>::new_slice(d);
    let task = take_ticket(sync) as usize;
    if task < end_o {
        chained_product(
            a,
            w_o,
            s_o,
            dy,
            parts,
            norm1,
            slots,
            sync,
            rows,
            hq_words,
            d,
            o_scale_cols as usize,
            pow2_120,
            task % o_blocks,
            task / o_blocks,
            0u32,
            0usize,
            tiles,
            o_unroll,
            o_splits,
            o_mt,
            o_blocked,
            false,
            early,
            fp8,
        );
    } else if task < end_n1 {
        let row = task - end_o;
        wait_for(sync, 1usize, end_o as u32);
        norm_row_staged(
            x,
            norm1,
            dy,
            parts,
            x1,
            h1,
            &mut staged,
            eps,
            inv_d,
            parts_len,
            row,
            tid,
            d,
            o_norm,
            THREADS,
            virt,
        );
        finish_task(sync, 2usize);
    } else if task < end_gu {
        chained_product(
            h1w,
            w_gu,
            s_gu,
            act,
            parts,
            norm1,
            slots,
            sync,
            rows,
            d / 8,
            inter_words * 8 * 2,
            1usize,
            pow2_120,
            task - end_n1,
            0usize,
            rows as u32,
            2usize,
            tiles,
            gu_unroll,
            1usize,
            gu_mt,
            false,
            true,
            early,
            fp8,
        );
    } else if task < end_d {
        let t = task - end_gu;
        chained_product(
            actw,
            w_d,
            s_d,
            dy,
            parts,
            norm2,
            slots,
            sync,
            rows,
            inter_words,
            d,
            d_scale_cols as usize,
            pow2_120,
            t % d_blocks,
            t / d_blocks,
            gu_blocks as u32,
            3usize,
            tiles,
            d_unroll,
            d_splits,
            d_mt,
            d_blocked,
            false,
            early,
            fp8,
        );
    } else {
        let row = task - end_d;
        // Phase 1 finished before any down cube started (they waited for gate/up, which waited
        // for it): `x1` is complete.
        wait_for(sync, 4usize, (d_blocks * d_splits) as u32);
        norm_row_staged(
            x1,
            norm2,
            dy,
            parts,
            x2,
            h2,
            &mut staged,
            eps,
            inv_d,
            parts_len,
            row,
            tid,
            d,
            d_norm,
            THREADS,
            virt,
        );
        if finish_task(sync, 5usize) + 1u32 == rows as u32 {
            // Every task is done and every cube took its ticket: clear for the next launch.
            if UNIT_POS < 6 {
                sync[UNIT_POS as usize].store(0u32);
            }
        }
    }
}

/// One product of the chain as its own launch cuts it: (unroll, splits, weight blocks a cube,
/// blocked scales).
pub(crate) type Cut = (usize, usize, usize, bool);

/// The comptime arguments of one [`chain_kernel`] launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ChainVariant {
    d: usize,
    tiles: usize,
    o: Cut,
    gu: (usize, usize),
    down: Cut,
    virt: usize,
    fp8: bool,
    early: usize,
}

impl TailWeights<'_> {
    /// `(hq, d, inter)` as the weights have them, if they fit one layer.
    fn dims(&self) -> Option<(usize, usize, usize)> {
        let ([o_out, o_in], [gu_out, gu_in], [d_out, d_in]) = match self {
            TailWeights::Bf16 { o, gate_up, down } => (o.dims(), gate_up.dims(), down.dims()),
            TailWeights::Fp8 { o, gate_up, down } => {
                ([o.out, o.inp], [gate_up.out, gate_up.inp], [down.out, down.inp])
            }
        };
        (gu_in == o_out && d_out == o_out && gu_out == 2 * d_in).then_some((o_in, o_out, d_in))
    }
}

/// The variant for `rows` rows of a layer of width `d`, `hq` attention features and an
/// intermediate width `inter` (each product cut as its own launch would be), with FP8 weights
/// (`Some((o blocked, down blocked))`) or bf16 ones, or `None` where the chain does not run: more
/// than [`CHAIN_MAX_ROWS`] rows, a width the kernels do not take, a gate/up plan that cuts the
/// reduction (the SwiGLU epilogue sums whole rows), FP8 products of fewer than eight warps, or
/// a norm cube of fewer than 256 threads.
pub(crate) fn variant(
    rows: usize,
    d: usize,
    hq: usize,
    inter: usize,
    fp8: Option<(bool, bool)>,
) -> Option<ChainVariant> {
    let virt = crate::norm_threads();
    let width = if fp8.is_some() { 64 } else { 32 };
    if rows == 0
        || rows > CHAIN_MAX_ROWS.min(MAX_ROWS)
        || !d.is_multiple_of(width)
        || !hq.is_multiple_of(width)
        || !inter.is_multiple_of(width)
        || virt < THREADS
        || !virt.is_multiple_of(THREADS)
    {
        return None;
    }
    let (tiles, weights) = match fp8 {
        // As the FP8 launches: no padding of three tiles.
        Some(_) => (rows.div_ceil(8), Weights::Fp8),
        None => (launch_tiles(rows), Weights::Bf16),
    };
    let cut = |inp: usize, out: usize, blocked: bool| {
        let p = plan(weights, inp / width, out);
        let mt = match weights {
            Weights::Fp8 => p.mtiles_fp8(tiles, out, inp / width),
            Weights::Bf16 => p.mtiles(tiles, out, inp / width),
        };
        let warps = if weights == Weights::Fp8 { p.warps(inp / width) } else { WARPS };
        (warps == WARPS && out.is_multiple_of(16 * mt)).then_some((
            p.unroll_with(tiles, mt, inp / width, WARPS),
            p.splits,
            mt,
            blocked,
        ))
    };
    let (o_blocked, d_blocked) = fp8.unwrap_or((false, false));
    let o = cut(hq, d, o_blocked)?;
    let gu = cut(d, 2 * inter, false)?;
    let down = cut(inter, d, d_blocked)?;
    let early = crate::chain_prefetch();
    (gu.1 == 1).then_some(ChainVariant {
        d,
        tiles,
        o,
        gu: (gu.0, gu.2),
        down,
        virt,
        fp8: fp8.is_some(),
        early,
    })
}

/// The layer tail through [`chain_kernel`]: `(x2, h2)` from the residual `x` `[rows, d]`, the
/// attention output `a` `[rows, hq]`, the norms `n1` and `n2`, and each weight's words and
/// scales (`w`: o, gate/up, down; a bf16 weight's own buffer stands in for its scales), FP8 when
/// `fp8` says which have block scales; `sync` at least [`CHAIN_WORDS`] zeroed i32 counters, left
/// zero. The caller checked [`variant`].
#[allow(clippy::too_many_arguments)]
fn launch(
    x: CubeTensor,
    a: CubeTensor,
    n1: CubeTensor,
    n2: CubeTensor,
    w: [(CubeTensor, CubeTensor); 3],
    fp8: Option<(bool, bool)>,
    sync: CubeTensor,
    eps: f32,
) -> (CubeTensor, CubeTensor) {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (x, a, n1, n2) = (contiguous(x), contiguous(a), contiguous(n1), contiguous(n2));
    let [(w_o, s_o), (w_gu, s_gu), (w_d, s_d)] = w.map(|(w, s)| (contiguous(w), contiguous(s)));
    let [rows, d] = [x.meta.shape()[0], x.meta.shape()[1]];
    let hq = a.meta.shape()[1];
    // The down weight's columns: bf16 elements, or i32 words of four e4m3 bytes.
    let inter = w_d.meta.shape()[1] * if fp8.is_some() { 4 } else { 1 };
    let v = variant(rows, d, hq, inter, fp8).expect("layer_tail: the caller checked the variant");
    CHAINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let client = x.client.clone();
    let buffer = |shape: [usize; 2], dtype: DType| {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            x.device.clone(),
            shape.into(),
            dtype,
        )
    };
    let n = rows * d;
    let rows_d = || buffer([rows, d], x.dtype);
    let (x1, h1, x2, h2, dy) = (rows_d(), rows_d(), rows_d(), rows_d(), rows_d());
    let act = buffer([rows, inter], x.dtype);
    let splits = v.o.1.max(v.down.1);
    let parts = buffer([splits, n], DType::F32);
    let tasks = d / 16 / v.o.2 * v.o.1 + rows + 2 * inter / 16 / v.gu.1 + d / 16 / v.down.2 * v.down.1 + rows;
    let scale_cols = |blocked: bool, inp: usize| if blocked { inp.div_ceil(crate::fp8::BLOCK) } else { 1 };
    // A weight's 16-byte words; its scales' f32 (one stands in for a bf16 weight's).
    let words = |t: &CubeTensor| t.meta.num_elements() * t.dtype.size() / 16;
    let floats = |t: &CubeTensor| if fp8.is_some() { t.meta.num_elements() } else { 1 };
    // SAFETY: every buffer's length is given in the kernel's units (bf16, 16-byte words, f32,
    // 32-bit counters). Each product's cube reads and writes what its own launch's cube would
    // (`gemm_block` / `fp8_gemm_block`: activation rows `< rows`, weight rows `< out`, scales as
    // that launch reads them, bf16 rows `< rows` of `dy` or `act`, split sums `[splits, rows,
    // out]` within `parts`), each norm cube its row of `d`; `h1w` and `actw` are `h1` and `act`
    // as words (`d` and `inter` multiples of 32, so their rows are whole words); `slots` is never
    // touched (no argmax), and a bf16 weight's scales are never read. `sync` holds the
    // `CHAIN_WORDS` counters, zero at the launch, which the kernel leaves zero. Every task waits
    // only for tasks of earlier phases, taken by cubes already running (see the module doc), so
    // the launch ends.
    unsafe {
        super::pdl::before_launch(&client);
        chain_kernel::launch_unchecked(
            &client,
            CubeCount::Static(tasks as u32, 1, 1),
            CubeDim::new_2d(32, WARPS as u32),
            BufferArg::from_raw_parts(x.handle.clone(), n),
            BufferArg::from_raw_parts(a.handle.clone(), rows * hq / 8),
            BufferArg::from_raw_parts(w_o.handle.clone(), words(&w_o)),
            BufferArg::from_raw_parts(s_o.handle.clone(), floats(&s_o)),
            BufferArg::from_raw_parts(n1.handle.clone(), d),
            BufferArg::from_raw_parts(x1.handle.clone(), n),
            BufferArg::from_raw_parts(h1.handle.clone(), n),
            BufferArg::from_raw_parts(h1.handle.clone(), n / 8),
            BufferArg::from_raw_parts(w_gu.handle.clone(), words(&w_gu)),
            BufferArg::from_raw_parts(s_gu.handle.clone(), floats(&s_gu)),
            BufferArg::from_raw_parts(act.handle.clone(), rows * inter),
            BufferArg::from_raw_parts(act.handle.clone(), rows * inter / 8),
            BufferArg::from_raw_parts(w_d.handle.clone(), words(&w_d)),
            BufferArg::from_raw_parts(s_d.handle.clone(), floats(&s_d)),
            BufferArg::from_raw_parts(n2.handle.clone(), d),
            BufferArg::from_raw_parts(x2.handle.clone(), n),
            BufferArg::from_raw_parts(h2.handle.clone(), n),
            BufferArg::from_raw_parts(dy.handle.clone(), n),
            BufferArg::from_raw_parts(parts.handle.clone(), splits * n),
            BufferArg::from_raw_parts(x.handle.clone(), 1),
            BufferArg::from_raw_parts(sync.handle.clone(), CHAIN_WORDS),
            rows as u32,
            (hq / 8) as u32,
            (inter / 8) as u32,
            scale_cols(v.o.3, hq) as u32,
            scale_cols(v.down.3, inter) as u32,
            2f32.powi(120),
            eps,
            1.0 / d as f32,
            v.d,
            v.tiles,
            v.o.0,
            v.o.1,
            v.o.2,
            v.o.3,
            v.gu.0,
            v.gu.1,
            v.down.0,
            v.down.1,
            v.down.2,
            v.down.3,
            v.virt,
            v.fp8,
            v.early,
        );
    }
    (x2, h2)
}

/// `v` expanded and transpiled without a device (see [`super::offline`]).
pub(crate) fn offline_chain(v: ChainVariant) -> Result<KernelSource, String> {
    let ChainVariant { d, tiles, o, gu, down, virt, fp8, early } = v;
    let label = format!(
        "layer_tail: d={d} tiles={tiles} o={o:?} gate/up={gu:?} down={down:?} norm threads={virt} fp8={fp8} early={early}"
    );
    let kernel = offline_kernel!(
        chain_kernel::ChainKernel,
        CubeDim::new_2d(32, WARPS as u32);
        b b b b b b b b b b b b b b b b b b b b b s s s s s s s s;
        d, tiles, o.0, o.1, o.2, o.3, gu.0, gu.1, down.0, down.1, down.2, down.3, virt, fp8, early
    );
    transpile(&label, kernel)
}

/// Whether [`layer_tail`] runs [`chain_kernel`] for these tensors: bf16 activations and norms on
/// a CUDA device, weights that fit one layer (`x` `[rows, d]`, `a` `[rows, hq]`), a [`variant`]
/// for them, and at least [`CHAIN_WORDS`] i32 counters.
pub(crate) fn takes(
    x: &Tensor<2>,
    a: &Tensor<2>,
    norms: [&Tensor<1>; 2],
    w: &TailWeights,
    sync: &Tensor<1, Int>,
) -> bool {
    let ([rows, d], [a_rows, hq]) = (x.dims(), a.dims());
    let bf16 = [x.dtype(), a.dtype(), norms[0].dtype(), norms[1].dtype()].iter().all(|t| *t == DType::BF16)
        && match w {
            TailWeights::Bf16 { o, gate_up, down } => {
                [o, gate_up, down].iter().all(|t| t.dtype() == DType::BF16)
            }
            TailWeights::Fp8 { gate_up, .. } => gate_up.grid == ScaleGrid::PerRow,
        };
    let fp8 = match w {
        TailWeights::Bf16 { .. } => None,
        TailWeights::Fp8 { o, down, .. } => {
            Some((o.grid == ScaleGrid::Blocks, down.grid == ScaleGrid::Blocks))
        }
    };
    bf16 && a_rows == rows
        && w.dims().is_some_and(|(w_hq, w_d, inter)| {
            (w_hq, w_d) == (hq, d) && variant(rows, d, hq, inter, fp8).is_some()
        })
        && norms.iter().all(|n| n.dims() == [d])
        && sync.dtype() == DType::I32
        && sync.dims()[0] >= CHAIN_WORDS
        && matches!(x.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// See [`crate::layer_tail`]; the caller checked [`takes`].
pub(crate) fn layer_tail(
    x: Tensor<2>,
    a: Tensor<2>,
    norms: [&Tensor<1>; 2],
    w: &TailWeights,
    eps: f64,
    sync: &Tensor<1, Int>,
) -> (Tensor<2>, Tensor<2>) {
    let (x, a) = (x.into_dispatch(), a.into_dispatch());
    let (n1, n2) = (norms[0].clone().into_dispatch(), norms[1].clone().into_dispatch());
    let sync = sync.clone().into_dispatch();
    let (x2, h2) = match w {
        TailWeights::Bf16 { o, gate_up, down } => <Dispatch as ChainOps>::layer_tail(
            x,
            a,
            n1,
            n2,
            (*o).clone().into_dispatch(),
            (*gate_up).clone().into_dispatch(),
            (*down).clone().into_dispatch(),
            sync,
            eps as f32,
        ),
        TailWeights::Fp8 { o, gate_up, down } => <Dispatch as ChainOps>::layer_tail_fp8(
            x,
            a,
            n1,
            n2,
            o.words.clone().into_dispatch(),
            o.scales.clone().into_dispatch(),
            gate_up.words.clone().into_dispatch(),
            gate_up.scales.clone().into_dispatch(),
            down.words.clone().into_dispatch(),
            down.scales.clone().into_dispatch(),
            o.grid == ScaleGrid::Blocks,
            down.grid == ScaleGrid::Blocks,
            sync,
            eps as f32,
        ),
    };
    (Tensor::from_dispatch(x2), Tensor::from_dispatch(h2))
}

/// The backend extension: run by CubeCL on CUDA and deferred through fusion.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait ChainOps: burn::backend::Backend {
    /// See [`crate::layer_tail`], bf16 weights: `(x2, h2)`, shaped as `x`.
    #[fusion(meta = |x, _a, _n1, _n2, _w_o, _w_gu, _w_d, _sync, _eps| (x.clone(), x.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn layer_tail(
        x: burn::backend::tensor::FloatTensor<Self>,
        a: burn::backend::tensor::FloatTensor<Self>,
        n1: burn::backend::tensor::FloatTensor<Self>,
        n2: burn::backend::tensor::FloatTensor<Self>,
        w_o: burn::backend::tensor::FloatTensor<Self>,
        w_gu: burn::backend::tensor::FloatTensor<Self>,
        w_d: burn::backend::tensor::FloatTensor<Self>,
        sync: burn::backend::tensor::IntTensor<Self>,
        eps: f32,
    ) -> (burn::backend::tensor::FloatTensor<Self>, burn::backend::tensor::FloatTensor<Self>);

    /// See [`crate::layer_tail`], FP8 weights (words and scales; o's and down's scales per block
    /// or per row): `(x2, h2)`, shaped as `x`.
    #[fusion(meta = |x, _a, _n1, _n2, _wo, _so, _wg, _sg, _wd, _sd, _bo, _bd, _sync, _eps| (x.clone(), x.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn layer_tail_fp8(
        x: burn::backend::tensor::FloatTensor<Self>,
        a: burn::backend::tensor::FloatTensor<Self>,
        n1: burn::backend::tensor::FloatTensor<Self>,
        n2: burn::backend::tensor::FloatTensor<Self>,
        words_o: burn::backend::tensor::IntTensor<Self>,
        scales_o: burn::backend::tensor::FloatTensor<Self>,
        words_gu: burn::backend::tensor::IntTensor<Self>,
        scales_gu: burn::backend::tensor::FloatTensor<Self>,
        words_d: burn::backend::tensor::IntTensor<Self>,
        scales_d: burn::backend::tensor::FloatTensor<Self>,
        blocked_o: bool,
        blocked_d: bool,
        sync: burn::backend::tensor::IntTensor<Self>,
        eps: f32,
    ) -> (burn::backend::tensor::FloatTensor<Self>, burn::backend::tensor::FloatTensor<Self>);
}

impl ChainOps for CubeBackend {
    #[allow(clippy::too_many_arguments)]
    fn layer_tail(
        x: CubeTensor,
        a: CubeTensor,
        n1: CubeTensor,
        n2: CubeTensor,
        w_o: CubeTensor,
        w_gu: CubeTensor,
        w_d: CubeTensor,
        sync: CubeTensor,
        eps: f32,
    ) -> (CubeTensor, CubeTensor) {
        let w = [(w_o.clone(), w_o), (w_gu.clone(), w_gu), (w_d.clone(), w_d)];
        launch(x, a, n1, n2, w, None, sync, eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_tail_fp8(
        x: CubeTensor,
        a: CubeTensor,
        n1: CubeTensor,
        n2: CubeTensor,
        words_o: CubeTensor,
        scales_o: CubeTensor,
        words_gu: CubeTensor,
        scales_gu: CubeTensor,
        words_d: CubeTensor,
        scales_d: CubeTensor,
        blocked_o: bool,
        blocked_d: bool,
        sync: CubeTensor,
        eps: f32,
    ) -> (CubeTensor, CubeTensor) {
        let w = [(words_o, scales_o), (words_gu, scales_gu), (words_d, scales_d)];
        launch(x, a, n1, n2, w, Some((blocked_o, blocked_d)), sync, eps)
    }
}
