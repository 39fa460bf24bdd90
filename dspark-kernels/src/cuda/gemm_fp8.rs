//! Skinny GEMM with FP8 (e4m3) weights: `y = x · Wᵀ` for bf16 activation rows and an
//! [`Fp8Matrix`], on the bf16 tensor-core path of [`super::gemm`].
//!
//! # How one cube works
//! As in [`super::gemm`]: blocks of 16 weight rows (one, or several for a short reduction such
//! as a Markov W2's 256 columns; see [`GemmPlan::mtiles_fp8`](crate::GemmPlan::mtiles_fp8)),
//! every activation row of the call in tiles of 8, `warps` warps splitting the reduction axis,
//! here in 64-wide chunks (warp `w` takes chunks `w, w + warps, …`; `warps` is 8, or one per
//! chunk when a cube's range has fewer). Lane `(g, t)` loads 16 bytes of weight rows `g` and
//! `g + 8` (columns `16t .. 16t + 16` of the chunk: 16 weights each) and 32 bytes of activation
//! row `g` at the same columns, and feeds them to four `m16n8k16` steps of four columns each.
//!
//! # Decoding in registers
//! Each 32-bit word holds columns `(k, k+2, k+1, k+3)`. Its even bytes become the bf16 pair of
//! columns `(k, k+1)` and its odd bytes the pair `(k+2, k+3)` by moving each byte's magnitude
//! bits 4 places up and its sign bit to bit 15 of its half: the bf16 with those bits is the e4m3
//! value times 2⁻¹²⁰ (for subnormal e4m3 values too, which land on bf16 subnormals). One bf16
//! multiply by 2¹²⁰ makes every weight its exact e4m3 value; the mma then accumulates
//! `x · decode(w)` in f32. Per-row scales multiply each output at the end; block scales multiply
//! each chunk's products before they join the accumulator (a chunk lies inside one 128-column
//! block).
//!
//! # Splits
//! As in [`super::gemm`], a [`GemmPlan`](crate::GemmPlan) chosen from the shape may cut the chunks
//! into equal ranges, one cube each; each range's f32 sums (row scales applied) are added in
//! range order by a second kernel.
//!
//! # Batch invariance
//! As for [`super::gemm`]: chunk order, mma tree, warp order and split order depend only on the
//! matrix's shape.

use burn::backend::Dispatch;
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::bf16;

use super::gemm::{
    MARKOV_SLOTS, MAX_ROWS, Product, SLOT_STRIDE, Weights, argmax_candidate, argmax_prefetch, combine_splits,
    load_weight_blocks, plan, split_scratch, swiglu_epilogue,
};
use crate::fp8::{BLOCK, Fp8Matrix, ScaleGrid};

/// 16 bytes as four 32-bit registers.
type Words = Vector<u32, Const<4>>;

/// Columns `(k, k+1)` of a word in kernel order, as a bf16 pair scaled by 2⁻¹²⁰.
#[cube]
pub(crate) fn even_pair(w: u32) -> u32 {
    ((w & 0x007F_007Fu32) << 4u32) | ((w & 0x0080_0080u32) << 8u32)
}

/// Columns `(k+2, k+3)` of a word in kernel order, as a bf16 pair scaled by 2⁻¹²⁰.
#[cube]
pub(crate) fn odd_pair(w: u32) -> u32 {
    ((w >> 4u32) & 0x07F0_07F0u32) | (w & 0x8000_8000u32)
}

/// One cube: `16 · mtiles` weight rows × every activation row of the call (`8 · tiles` slots).
///
/// `x`: `[rows, in]` bf16 as words (`in / 8` per row); `w`: `[out, in]` bytes as words
/// (`in / 16` per row); `scales`: per row or per 128×128 block (`scale_cols` blocks per row);
/// `y`: `[rows, out]`. `in` a multiple of 64, `out` of `16 · mtiles`. Each block of 16 weight
/// rows is summed exactly as in a cube of its own: `mtiles` changes only how often an
/// activation row is fetched. With `argmax` (a Markov step, see
/// [`argmax_candidate`](super::gemm::argmax_candidate)) `y` is not written: `logits` holds the
/// step's base logits (row `r` at `r · stride`) and `slots` the rows' running argmax.
/// (`x` is only read; it is `&mut` because the cube's body, [`fp8_gemm_block`], also reads
/// activations that other cubes of a chained launch write; see [`super::chain`].)
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn fp8_gemm_kernel(
    x: &mut [Words],
    w: &[Words],
    scales: &[f32],
    y: &mut [bf16],
    parts: &mut [f32],
    logits: &[bf16],
    slots: &[Atomic<u64>],
    rows: u32,
    x_words: u32,
    out: u32,
    scale_cols: u32,
    pow2_120: f32,
    stride: u32,
    #[comptime] tiles: usize,
    #[comptime] warps: usize,
    #[comptime] unroll: usize,
    #[comptime] blocked: bool,
    #[comptime] splits: usize,
    #[comptime] mtiles: usize,
    #[comptime] swiglu: bool,
    #[comptime] argmax: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let mut wa = Array::<Words>::new(unroll * mtiles);
    let mut wb = Array::<Words>::new(unroll * mtiles);
    fp8_gemm_block(
        x,
        w,
        scales,
        y,
        parts,
        logits,
        slots,
        rows as usize,
        x_words as usize,
        out as usize,
        scale_cols as usize,
        pow2_120,
        stride as usize,
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        &mut wa,
        &mut wb,
        tiles,
        warps,
        unroll,
        blocked,
        splits,
        mtiles,
        swiglu,
        argmax,
        0usize,
    );
}

/// One cube of [`fp8_gemm_kernel`], cube `(block, split)` of its grid, with `wa` and `wb` the
/// registers of a step's weight words (the first step's first `early` chunk slots already loaded
/// by [`gemm_first_weights`](super::gemm::gemm_first_weights) over the weight's `x_words / 2`
/// words a row): as [`super::gemm::gemm_block`] for bf16 weights.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn fp8_gemm_block(
    x: &mut [Words],
    w: &[Words],
    scales: &[f32],
    y: &mut [bf16],
    parts: &mut [f32],
    logits: &[bf16],
    slots: &[Atomic<u64>],
    rows: usize,
    x_words: usize,
    out: usize,
    scale_cols: usize,
    pow2_120: f32,
    stride: usize,
    block: usize,
    split: usize,
    wa: &mut Array<Words>,
    wb: &mut Array<Words>,
    #[comptime] tiles: usize,
    #[comptime] warps: usize,
    #[comptime] unroll: usize,
    #[comptime] blocked: bool,
    #[comptime] splits: usize,
    #[comptime] mtiles: usize,
    #[comptime] swiglu: bool,
    #[comptime] argmax: bool,
    #[comptime] early: usize,
) {
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let g = lane / 4;
    let t = lane % 4;
    let w_words = x_words / 2;
    // This cube's range of chunks: `[first, first + chunks)`.
    let chunks = x_words / 8 / splits;
    let first = split * chunks;

    let def = MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    let lift = Vector::<bf16, Const<8>>::new(bf16::cast_from(pow2_120));

    // Slot m·tiles + j: weight block m of the cube against activation tile j.
    let mut acc = Array::<Vector<f32, Const<4>>>::new(mtiles * tiles);
    #[unroll]
    for j in 0..mtiles * tiles {
        acc[j] = Vector::<f32, Const<4>>::new(0.0f32);
    }

    let w_lo = (block * 16 * mtiles + g) * w_words + t;
    let zero = Words::new(0u32);

    // With `argmax`, the base logits the epilogue adds, loaded now.
    let mut pre = Array::<f32>::new((mtiles * tiles * 128).div_ceil(warps * 32));
    if comptime![argmax] {
        argmax_prefetch(logits, &mut pre, stride, rows, block, warp * 32 + lane, tiles, mtiles, warps);
    }

    let steps = chunks.div_ceil(warps * unroll);
    for step in 0..steps {
        // 1. Loads: `unroll` chunks of both weight rows of every block (one word each; with
        //    the first step's `early` slots are in) and of every activation row (two words each).
        let mut xs = Array::<Words>::new(unroll * tiles * 2);
        #[unroll]
        for u in 0..unroll {
            let local = (step * unroll + u) * warps + warp;
            let chunk = first + local;
            if comptime![u < early] {
                if step > 0 {
                    load_weight_blocks(w, wa, wb, w_lo, w_words, chunk, local < chunks, zero, u, mtiles);
                }
            } else {
                load_weight_blocks(w, wa, wb, w_lo, w_words, chunk, local < chunks, zero, u, mtiles);
            }
            #[unroll]
            for j in 0..tiles {
                let row = j * 8 + g;
                #[unroll]
                for h in 0..2usize {
                    if local < chunks && row < rows {
                        xs[(u * tiles + j) * 2 + h] = x[row * x_words + chunk * 8 + 2 * t + h];
                    } else {
                        xs[(u * tiles + j) * 2 + h] = zero;
                    }
                }
            }
        }
        // 2. Four mma steps per chunk, four columns each.
        #[unroll]
        for u in 0..unroll {
            let mut part = Array::<Vector<f32, Const<4>>>::new(mtiles * tiles);
            #[unroll]
            for j in 0..mtiles * tiles {
                if comptime![blocked] {
                    part[j] = Vector::<f32, Const<4>>::new(0.0f32);
                } else {
                    part[j] = acc[j];
                }
            }
            #[unroll]
            for s in 0..4usize {
                #[unroll]
                for m in 0..mtiles {
                    let ga = wa[u * mtiles + m].extract(s);
                    let gb = wb[u * mtiles + m].extract(s);
                    let mut a_words = Words::new(0u32);
                    a_words.insert(0usize, even_pair(ga));
                    a_words.insert(1usize, even_pair(gb));
                    a_words.insert(2usize, odd_pair(ga));
                    a_words.insert(3usize, odd_pair(gb));
                    let mut a = Array::<Vector<bf16, Const<8>>>::new(1usize);
                    a[0] = Vector::<bf16, Const<8>>::reinterpret(a_words) * lift;
                    #[unroll]
                    for j in 0..tiles {
                        let xw = xs[(u * tiles + j) * 2 + s / 2];
                        let mut b_words = Vector::<u32, Const<2>>::new(0u32);
                        b_words.insert(0usize, xw.extract(2 * (s % 2)));
                        b_words.insert(1usize, xw.extract(2 * (s % 2) + 1));
                        let mut b = Array::<Vector<bf16, Const<4>>>::new(1usize);
                        b[0] = Vector::<bf16, Const<4>>::reinterpret(b_words);
                        let mut c = Array::<Vector<f32, Const<4>>>::new(1usize);
                        c[0] = part[m * tiles + j];
                        def.execute_inplace(&a, &b, &mut c);
                        part[m * tiles + j] = c[0];
                    }
                }
            }
            #[unroll]
            for m in 0..mtiles {
                #[unroll]
                for j in 0..tiles {
                    if comptime![blocked] {
                        let local = (step * unroll + u) * warps + warp;
                        let chunk = first + local;
                        if local < chunks {
                            // The 128-row block of this weight block's rows.
                            let scale_row = (block * mtiles + m) * 16 / 128usize * scale_cols;
                            let s = scales[scale_row + chunk / 2];
                            acc[m * tiles + j] += part[m * tiles + j] * Vector::<f32, Const<4>>::new(s);
                        }
                    } else {
                        acc[m * tiles + j] = part[m * tiles + j];
                    }
                }
            }
        }
    }

    // 3. Partial sums of every warp into shared memory,
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

    // 4. Sum over warps in warp order, apply a per-row scale, write bf16.
    let threads = warps * 32;
    let id = warp * 32 + lane;
    let total = mtiles * tiles * tile_len;
    if comptime![swiglu] {
        // 4'. A paired gate/up weight with per-row scales (see `launch_swiglu`): weight rows
        //     0..8 of each block are gate rows 8·block.., rows 8..16 the matching up rows. Each
        //     thread sums one gate and its up in warp order, scales and rounds both to bf16 (the
        //     product's own output) and writes `silu(g)·u` with the roundings of the SwiGLU
        //     kernel to column 8·block + wr of a `[rows, out / 2]` output, as the bf16 kernel's
        //     epilogue does.
        swiglu_epilogue(&partial, scales, y, rows, out, block, id, tiles, mtiles, warps, true);
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
                let within = e % tile_len;
                let row = j * 8 + within / 16;
                let col = (block * mtiles + q / tiles) * 16 + within % 16;
                if !comptime![blocked] {
                    sum *= scales[col];
                }
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

/// Whether [`linear`] runs this product: a CUDA device, bf16 activations whose width is the
/// matrix's `in`, at least one row.
pub(crate) fn takes(x: &Tensor<2>, w: &Fp8Matrix) -> bool {
    let [rows, inp] = x.dims();
    rows > 0
        && inp == w.inp
        && x.dtype() == DType::BF16
        && Fp8Matrix::shape_supported(w.out, w.inp)
        && matches!(x.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
        && matches!(w.words.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// `x · Wᵀ` through the kernel, on tensors that [`takes`] accepted.
pub(crate) fn linear(x: Tensor<2>, w: &Fp8Matrix) -> Tensor<2> {
    let y = <Dispatch as Fp8GemmOps>::fp8_gemm(
        x.into_dispatch(),
        w.words.clone().into_dispatch(),
        w.scales.clone().into_dispatch(),
        w.grid == ScaleGrid::Blocks,
    );
    Tensor::from_dispatch(y)
}

/// `x · Wᵀ` on CubeCL tensors: `x` `[rows, in]` bf16, `words` `[out, in / 4]` 32-bit, `scales`
/// f32.
fn launch(x: CubeTensor, words: CubeTensor, scales: CubeTensor, blocked: bool) -> CubeTensor {
    match launch_product(x, words, scales, blocked, false) {
        Product::Rows(y) => y,
        // Only a deferred product hands out its parts.
        Product::Parts(..) => unreachable!("a product that was not deferred is combined"),
    }
}

/// [`launch`], or with `defer` as [`super::gemm::launch_product`]: a split product of at most
/// [`MAX_ROWS`] rows hands out its f32 split sums uncombined.
pub(crate) fn launch_product(
    x: CubeTensor,
    words: CubeTensor,
    scales: CubeTensor,
    blocked: bool,
    defer: bool,
) -> Product {
    let x = burn_cubecl::kernel::into_contiguous(x);
    let words = burn_cubecl::kernel::into_contiguous(words);
    let scales = burn_cubecl::kernel::into_contiguous(scales);
    let [rows, inp] = [x.meta.shape()[0], x.meta.shape()[1]];
    let out = words.meta.shape()[0];
    assert!(
        Fp8Matrix::shape_supported(out, inp) && words.meta.shape()[1] * 4 == inp,
        "fp8_gemm: unsupported shape [{rows}, {inp}] x [{out}, {inp}]"
    );
    let n_scales = scales.meta.shape()[0];
    let client = x.client.clone();
    let x_words = inp / 8;
    let scale_cols = if blocked { inp.div_ceil(BLOCK) } else { 1 };
    let plan = plan(Weights::Fp8, inp / 64, out);
    let warps = plan.warps(inp / 64);
    let parts = split_scratch(&x, plan.splits, rows.min(MAX_ROWS) * out);
    let deferred = defer && parts.is_some() && rows <= MAX_ROWS;
    // A deferred product never writes `y`: a one-element stand-in.
    let y = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        if deferred { [1, 1].into() } else { [rows, out].into() },
        x.dtype,
    );
    let mut start = 0;
    while start < rows {
        let n = (rows - start).min(MAX_ROWS);
        let tiles = n.div_ceil(8);
        let mt = plan.mtiles_fp8(tiles, out, inp / 64);
        let x_handle = x.handle.clone().offset_start((start * inp * 2) as u64);
        let y_handle = y.handle.clone().offset_start((start * out * 2) as u64);
        // Without splits the kernel never touches `parts`: y's own buffer stands in.
        let (parts_handle, parts_len) = match &parts {
            Some(p) => (p.handle.clone(), plan.splits * n * out),
            None => (y_handle.clone(), n * out / 2),
        };
        // SAFETY: lengths are the buffers' sizes from `start` on in the kernel's units (16-byte
        // words for x and w, f32 for scales and parts, bf16 for y); the kernel reads x rows `< n`,
        // w rows `< out`, scales at `row_block · scale_cols + chunk / 2 < n_scales` (blocked) or
        // at output columns `< out = n_scales` (per row), and writes y rows `< n` (or parts
        // `[splits, n, out]`).
        unsafe {
            super::pdl::before_launch(&client);
            fp8_gemm_kernel::launch_unchecked(
                &client,
                CubeCount::Static((out / 16 / mt) as u32, plan.splits as u32, 1),
                CubeDim::new_2d(32, warps as u32),
                BufferArg::from_raw_parts(x_handle.clone(), n * x_words),
                BufferArg::from_raw_parts(words.handle.clone(), out * inp / 16),
                BufferArg::from_raw_parts(scales.handle.clone(), n_scales),
                BufferArg::from_raw_parts(y_handle.clone(), if deferred { 1 } else { n * out }),
                BufferArg::from_raw_parts(parts_handle, parts_len),
                // `logits` and `slots` are touched only with `argmax`: x's buffer stands in.
                BufferArg::from_raw_parts(x_handle.clone(), 1),
                BufferArg::from_raw_parts(x_handle, 1),
                n as u32,
                x_words as u32,
                out as u32,
                scale_cols as u32,
                2f32.powi(120),
                0u32,
                tiles,
                warps,
                plan.unroll_with(tiles, mt, inp / 64, warps),
                blocked,
                plan.splits,
                mt,
                false,
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

/// Whether [`launch_swiglu`] takes this problem: [`takes`], per-row scales, and a plan that
/// does not cut the reduction (the epilogue sums whole rows).
pub(crate) fn takes_swiglu(x: &Tensor<2>, w: &Fp8Matrix) -> bool {
    takes(x, w) && w.grid == ScaleGrid::PerRow && swiglu_plan_fits(w.inp, w.out)
}

/// Whether an `[out, in]` paired FP8 weight's plan leaves the reduction whole.
pub(crate) fn swiglu_plan_fits(inp: usize, out: usize) -> bool {
    plan(Weights::Fp8, inp / 64, out).splits == 1
}

/// `silu(g)·u` of a paired gate/up FP8 weight with per-row scales in one pass: `x` `[rows, in]`,
/// `words` `[out, in / 4]` whose 16-row block `b` holds gate rows `8b..8b+8` then up rows
/// `8b..8b+8` (`scales` paired the same way) → `[rows, out / 2]`. The values are those of the
/// product (scaled, rounded to bf16) followed by the SwiGLU kernel.
fn launch_swiglu(x: CubeTensor, words: CubeTensor, scales: CubeTensor) -> CubeTensor {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (x, words, scales) = (contiguous(x), contiguous(words), contiguous(scales));
    let [rows, inp] = [x.meta.shape()[0], x.meta.shape()[1]];
    let out = words.meta.shape()[0];
    let plan = plan(Weights::Fp8, inp / 64, out);
    assert!(
        Fp8Matrix::shape_supported(out, inp)
            && words.meta.shape()[1] * 4 == inp
            && scales.meta.shape()[0] == out
            && plan.splits == 1,
        "fp8_gemm_swiglu: unsupported shape [{rows}, {inp}] x [{out}, {inp}]"
    );
    let client = x.client.clone();
    let half = out / 2;
    let y = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        [rows, half].into(),
        x.dtype,
    );
    let x_words = inp / 8;
    let warps = plan.warps(inp / 64);
    let mut start = 0;
    while start < rows {
        let n = (rows - start).min(MAX_ROWS);
        let tiles = n.div_ceil(8);
        let mt = plan.mtiles_fp8(tiles, out, inp / 64);
        let x_handle = x.handle.clone().offset_start((start * inp * 2) as u64);
        let y_handle = y.handle.clone().offset_start((start * half * 2) as u64);
        // SAFETY: as in `launch_product` with per-row scales (`out` of them) and no splits
        // (`parts` is never touched: y's buffer stands in); the epilogue writes y rows `< n` of
        // `half` columns, column `8·block + wr < half`.
        unsafe {
            super::pdl::before_launch(&client);
            fp8_gemm_kernel::launch_unchecked(
                &client,
                CubeCount::Static((out / 16 / mt) as u32, 1, 1),
                CubeDim::new_2d(32, warps as u32),
                BufferArg::from_raw_parts(x_handle.clone(), n * x_words),
                BufferArg::from_raw_parts(words.handle.clone(), out * inp / 16),
                BufferArg::from_raw_parts(scales.handle.clone(), out),
                BufferArg::from_raw_parts(y_handle.clone(), n * half),
                BufferArg::from_raw_parts(y_handle, n * half / 2),
                BufferArg::from_raw_parts(x_handle.clone(), 1),
                BufferArg::from_raw_parts(x_handle, 1),
                n as u32,
                x_words as u32,
                out as u32,
                1u32,
                2f32.powi(120),
                0u32,
                tiles,
                warps,
                plan.unroll_with(tiles, mt, inp / 64, warps),
                false,
                1,
                mt,
                true,
                false,
            );
        }
        start += n;
    }
    y
}

/// Whether a Markov step's FP8 W2 `[out, in]` product for `rows` rows takes the argmax
/// epilogue ([`launch_argmax_step`]): one launch ([`MAX_ROWS`]) and a plan that does not cut the
/// reduction.
pub(crate) fn argmax_step_fits(rows: usize, inp: usize, out: usize) -> bool {
    rows <= MAX_ROWS && Fp8Matrix::shape_supported(out, inp) && plan(Weights::Fp8, inp / 64, out).splits == 1
}

/// One Markov step's FP8 product with the argmax epilogue, as
/// [`super::gemm::launch_argmax_step`] for an [`Fp8Matrix`] W2 (`words`, `scales`, block scales
/// when `blocked`). The caller checked [`argmax_step_fits`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_argmax_step(
    client: &cubecl::client::Client,
    x: cubecl::server::Handle,
    words: &CubeTensor,
    scales: &CubeTensor,
    blocked: bool,
    base: cubecl::server::Handle,
    base_len: usize,
    stride: usize,
    slots: cubecl::server::Handle,
    rows: usize,
) {
    let out = words.meta.shape()[0];
    let inp = words.meta.shape()[1] * 4;
    let n_scales = scales.meta.shape()[0];
    let plan = plan(Weights::Fp8, inp / 64, out);
    let warps = plan.warps(inp / 64);
    let tiles = rows.div_ceil(8);
    let mt = plan.mtiles_fp8(tiles, out, inp / 64);
    let scale_cols = if blocked { inp.div_ceil(BLOCK) } else { 1 };
    // SAFETY: as in `launch_product` without splits for x, w and scales; base holds `base_len`
    // bf16 of which the kernel reads `r · stride + col` for rows `r < rows` and columns
    // `col < out`, slots `rows · MARKOV_SLOTS` u64; y and parts are never touched with `argmax`
    // (x's buffer stands in).
    unsafe {
        super::pdl::before_launch(client);
        fp8_gemm_kernel::launch_unchecked(
            client,
            CubeCount::Static((out / 16 / mt) as u32, 1, 1),
            CubeDim::new_2d(32, warps as u32),
            BufferArg::from_raw_parts(x.clone(), rows * (inp / 8)),
            BufferArg::from_raw_parts(words.handle.clone(), out * inp / 16),
            BufferArg::from_raw_parts(scales.handle.clone(), n_scales),
            BufferArg::from_raw_parts(x.clone(), 1),
            BufferArg::from_raw_parts(x, 1),
            BufferArg::from_raw_parts(base, base_len),
            BufferArg::from_raw_parts(slots, rows * MARKOV_SLOTS * SLOT_STRIDE),
            rows as u32,
            (inp / 8) as u32,
            out as u32,
            scale_cols as u32,
            2f32.powi(120),
            stride as u32,
            tiles,
            warps,
            plan.unroll_with(tiles, mt, inp / 64, warps),
            blocked,
            1,
            mt,
            false,
            true,
        );
    }
}

/// `[rows, out]` for `x` `[rows, in]` and `words` `[out, in / 4]`.
fn output_shape(x: &burn::tensor::Shape, words: &burn::tensor::Shape) -> burn::tensor::Shape {
    [x[0], words[0]].into()
}

/// `[rows, out / 2]` for `x` `[rows, in]` and paired `words` `[out, in / 4]`.
fn swiglu_shape(x: &burn::tensor::Shape, words: &burn::tensor::Shape) -> burn::tensor::Shape {
    [x[0], words[0] / 2].into()
}

/// The backend extension: run by CubeCL on CUDA and deferred through fusion.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait Fp8GemmOps: burn::backend::Backend {
    /// `x · Wᵀ` for FP8 `words` with `scales` (per 128×128 block when `blocked`, else per row).
    #[fusion(dtype = x, shape = output_shape(x, words))]
    fn fp8_gemm(
        x: burn::backend::tensor::FloatTensor<Self>,
        words: burn::backend::tensor::IntTensor<Self>,
        scales: burn::backend::tensor::FloatTensor<Self>,
        blocked: bool,
    ) -> burn::backend::tensor::FloatTensor<Self>;

    /// `silu(g)·u` for a paired gate/up FP8 weight with per-row `scales` (see
    /// [`launch_swiglu`]).
    #[fusion(dtype = x, shape = swiglu_shape(x, words))]
    fn fp8_gemm_swiglu(
        x: burn::backend::tensor::FloatTensor<Self>,
        words: burn::backend::tensor::IntTensor<Self>,
        scales: burn::backend::tensor::FloatTensor<Self>,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl Fp8GemmOps for CubeBackend {
    fn fp8_gemm(x: CubeTensor, words: CubeTensor, scales: CubeTensor, blocked: bool) -> CubeTensor {
        launch(x, words, scales, blocked)
    }

    fn fp8_gemm_swiglu(x: CubeTensor, words: CubeTensor, scales: CubeTensor) -> CubeTensor {
        launch_swiglu(x, words, scales)
    }
}

/// See [`crate::fp8::linear_fp8_swiglu`]; the caller checked [`takes_swiglu`].
pub(crate) fn linear_swiglu(x: Tensor<2>, w: &Fp8Matrix) -> Tensor<2> {
    let y = <Dispatch as Fp8GemmOps>::fp8_gemm_swiglu(
        x.into_dispatch(),
        w.words.clone().into_dispatch(),
        w.scales.clone().into_dispatch(),
    );
    Tensor::from_dispatch(y)
}

/// The comptime arguments of one [`fp8_gemm_kernel`] launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Fp8Variant {
    tiles: usize,
    warps: usize,
    unroll: usize,
    blocked: bool,
    splits: usize,
    mtiles: usize,
    swiglu: bool,
    argmax: bool,
}

/// The variant [`launch_product`] (or with `swiglu`, [`launch_swiglu`], per-row scales only;
/// with `argmax`, [`launch_argmax_step`]) launches for `8·tiles` rows or fewer (one launch) of an
/// `[out, in]` e4m3 weight with block (`blocked`) or per-row scales.
pub(crate) fn fp8_variant(
    tiles: usize,
    inp: usize,
    out: usize,
    blocked: bool,
    swiglu: bool,
    argmax: bool,
) -> Fp8Variant {
    let plan = plan(Weights::Fp8, inp / 64, out);
    let warps = plan.warps(inp / 64);
    let mtiles = plan.mtiles_fp8(tiles, out, inp / 64);
    Fp8Variant {
        tiles,
        warps,
        unroll: plan.unroll_with(tiles, mtiles, inp / 64, warps),
        blocked: blocked && !swiglu,
        splits: if swiglu || argmax { 1 } else { plan.splits },
        mtiles,
        swiglu,
        argmax,
    }
}

/// `v` expanded and transpiled without a device (see [`super::offline`]).
pub(crate) fn offline_fp8_gemm(v: Fp8Variant) -> Result<super::offline::KernelSource, String> {
    use super::offline::{offline_kernel, transpile};
    let Fp8Variant { tiles, warps, unroll, blocked, splits, mtiles, swiglu, argmax } = v;
    let label = format!(
        "fp8_gemm: tiles={tiles} warps={warps} unroll={unroll} blocked={blocked} splits={splits} mtiles={mtiles} \
         swiglu={swiglu} argmax={argmax}"
    );
    let kernel = offline_kernel!(
        fp8_gemm_kernel::Fp8GemmKernel,
        CubeDim::new_2d(32, warps as u32);
        b b b b b b b s s s s s s;
        tiles, warps, unroll, blocked, splits, mtiles, swiglu, argmax
    );
    transpile(&label, kernel)
}
