//! The greedy steps of a DSpark Markov head fused: each step one W2 product whose epilogue
//! merges each 16-column block's best value into the lane's running argmax
//! ([`super::gemm::argmax_candidate`]: an atomic max of
//! [`candidate_key`](super::gemm::candidate_key)s), and one small kernel that picks the token,
//! writes it, clears the slots and gathers the next step's `W1` row. Two launches a step
//! instead of four (gather, product, two argmax passes), one before the first step (the
//! anchors' rows, the slots cleared), and none after the last to join the steps' tokens or map
//! them to token ids.
//!
//! # Exactness
//! A step's values are the unfused path's: the product's sums in the same order, rounded to
//! bf16 as the product stores it, widened, plus the widened base logit. The winner follows the
//! same order-free rule (largest value, then lowest index; NaN and −∞ never win; index 0 when
//! nothing wins), which the atomic max of the keys keeps whatever order the cubes finish in, so
//! the tokens are those of the unfused loop bit for bit (`gpu_kernels
//! markov_greedy_matches_unfused`).

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::gemm::{MARKOV_SLOTS, SLOT_STRIDE};
use crate::fp8::ScaleGrid;

/// Copies row `index` of `table` (`rank_words` u32 words a row) to row `row` of `x`, one word a
/// lane of the cube's warp at a time.
#[cube]
fn gather_row(table: &[u32], x: &mut [u32], index: usize, row: usize, rank_words: usize) {
    let mut w = UNIT_POS as usize;
    while w < rank_words {
        x[row * rank_words + w] = table[index * rank_words + w];
        w += 32;
    }
}

/// Before step 0, one warp per lane `CUBE_POS_X`: the lane's [`MARKOV_SLOTS`] slots cleared and
/// row `anchors[lane]` of `w1` (`w1_rows` rows; an id outside reads row 0) copied to the lane's
/// row of `x`.
#[cube(launch_unchecked)]
fn markov_start_kernel(
    anchors: &[i32],
    w1: &[u32],
    slots: &[Atomic<u64>],
    x: &mut [u32],
    rank_words: u32,
    w1_rows: u32,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    slots[(row * MARKOV_SLOTS + UNIT_POS as usize) * SLOT_STRIDE].store(0u64);
    let mut anchor = anchors[row];
    if anchor < 0 || anchor >= w1_rows as i32 {
        anchor = 0;
    }
    gather_row(w1, x, anchor as usize, row, rank_words as usize);
}

/// Step `k`'s pick, one warp per lane `CUBE_POS_X`: the largest of the lane's slots (each lane of
/// the warp reads one and clears it for the next step), its index (0 when every slot is empty),
/// written to `tokens[lane · gamma + k]` (through `to_target` when `mapped`: a restricted draft
/// vocabulary's token ids), and row `index` of `table` copied to the lane's row of `x_next`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn markov_pick_kernel(
    slots: &[Atomic<u64>],
    table: &[u32],
    to_target: &[i32],
    tokens: &mut [i32],
    x_next: &mut [u32],
    rank_words: u32,
    gamma: u32,
    k: u32,
    #[comptime] mapped: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let lane = UNIT_POS as usize;
    let slot = (row * MARKOV_SLOTS + lane) * SLOT_STRIDE;
    let key = slots[slot].load();
    slots[slot].store(0u64);
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
    // A valid key's high word is at least 0x0080_0000 (see `candidate_key`).
    let mut index = 0u32;
    if hi != 0u32 {
        index = lo ^ 0xFFFF_FFFFu32;
    }
    if lane == 0 {
        let mut token = index as i32;
        if comptime![mapped] {
            token = to_target[index as usize];
        }
        tokens[row * gamma as usize + k as usize] = token;
    }
    gather_row(table, x_next, index as usize, row, rank_words as usize);
}

/// A Markov head's W2 on the device, as the launches take it.
#[allow(clippy::large_enum_variant)] // one per call, moved once
enum W2 {
    Dense(CubeTensor),
    Fp8 { words: CubeTensor, scales: CubeTensor, blocked: bool },
}

/// The γ steps: `anchors` `[lanes]` i32 (step 0 embeds them from `w1` `[V, r]`), `base`
/// `[lanes, γ, V']` bf16, `table` `[≥ V', r]` bf16 (the rows later steps gather), `to_target`
/// `[V']` i32 when `mapped` (any one-element i32 tensor otherwise) → `[lanes, γ]` i32 tokens.
fn launch(
    anchors: CubeTensor,
    w1: CubeTensor,
    base: CubeTensor,
    w2: W2,
    table: CubeTensor,
    to_target: CubeTensor,
    mapped: bool,
) -> CubeTensor {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (anchors, w1, base, table, to_target) =
        (contiguous(anchors), contiguous(w1), contiguous(base), contiguous(table), contiguous(to_target));
    let w2 = match w2 {
        W2::Dense(w) => W2::Dense(contiguous(w)),
        W2::Fp8 { words, scales, blocked } => {
            W2::Fp8 { words: contiguous(words), scales: contiguous(scales), blocked }
        }
    };
    let [lanes, gamma, width] = [base.meta.shape()[0], base.meta.shape()[1], base.meta.shape()[2]];
    let [w1_rows, rank] = [w1.meta.shape()[0], w1.meta.shape()[1]];
    let [table_rows, rank_words] = [table.meta.shape()[0], rank / 2];
    let client = base.client.clone();
    let (dense, w2_handle) = match &w2 {
        W2::Dense(w) => (true, &w.handle),
        W2::Fp8 { words, .. } => (false, &words.handle),
    };
    if crate::markov_loop()
        && super::markov_loop::loop_fits(lanes, width)
        // The loop reads W1, table and W2 rows as 16-byte words.
        && [&w1.handle, &table.handle, w2_handle].iter().all(|h| h.offset_start.unwrap_or(0).is_multiple_of(16))
        && let Some(shape) = super::markov_loop::LoopShape::new(dense, rank)
    {
        // One buffer: the tokens (`lanes · γ` i32), then from a 128-byte boundary a set of
        // slots a step and lane (u64, a cache line apart), then the barrier's two counters.
        let slots_at = (lanes * gamma).next_multiple_of(2 * SLOT_STRIDE);
        let sync_at = slots_at + 2 * gamma * lanes * MARKOV_SLOTS * SLOT_STRIDE;
        let all = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            base.device.clone(),
            [sync_at + 2].into(),
            DType::I32,
        );
        let loop_w2 = match &w2 {
            W2::Dense(w) => super::markov_loop::LoopW2::Dense(w),
            W2::Fp8 { words, scales, blocked } => {
                super::markov_loop::LoopW2::Fp8 { words, scales, blocked: *blocked }
            }
        };
        super::markov_loop::launch(
            &anchors, &w1, &table, loop_w2, shape, &base, &to_target, mapped, &all, slots_at, sync_at,
        );
        return CubeTensor::new_contiguous(
            client,
            base.device.clone(),
            [lanes, gamma].into(),
            all.handle,
            DType::I32,
        );
    }
    // One buffer: the tokens (`lanes · γ` i32), the slots (`lanes · MARKOV_SLOTS` u64 a cache
    // line apart, from a 128-byte boundary) and the gathered rows (`lanes · rank` bf16, at a 16-byte boundary: the
    // products load them as 16-byte words), so a recorded round takes one allocation here.
    let slots_at = (lanes * gamma).next_multiple_of(2 * SLOT_STRIDE);
    let x_at = (slots_at + 2 * lanes * MARKOV_SLOTS * SLOT_STRIDE).next_multiple_of(4);
    let all = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        base.device.clone(),
        [x_at + lanes * rank_words].into(),
        DType::I32,
    );
    let word = 4u64;
    let slots = all.handle.clone().offset_start(slots_at as u64 * word);
    let x = all.handle.clone().offset_start(x_at as u64 * word);
    let n_slots = lanes * MARKOV_SLOTS * SLOT_STRIDE;
    // SAFETY: cube `row < lanes` of 32 units reads `anchors[row]` (`lanes` i32) and one row below
    // `w1_rows` of `w1` (`w1_rows · rank_words` words), clears slot `(row · 32 + unit) · SLOT_STRIDE` (`n_slots`
    // u64) and writes its row of `x` (`lanes · rank_words` words).
    unsafe {
        super::pdl::before_launch(&client);
        markov_start_kernel::launch_unchecked(
            &client,
            CubeCount::Static(lanes as u32, 1, 1),
            CubeDim::new_1d(MARKOV_SLOTS as u32),
            BufferArg::from_raw_parts(anchors.handle.clone(), lanes),
            BufferArg::from_raw_parts(w1.handle.clone(), w1_rows * rank_words),
            BufferArg::from_raw_parts(slots.clone(), n_slots),
            BufferArg::from_raw_parts(x.clone(), lanes * rank_words),
            rank_words as u32,
            w1_rows as u32,
        );
    }
    for k in 0..gamma {
        // Step k's base rows: element `(lane, k, col)` at `lane · γ · width + k · width + col`.
        let base_k = base.handle.clone().offset_start((k * width * 2) as u64);
        let base_len = (lanes - 1) * gamma * width + width;
        match &w2 {
            W2::Dense(w) => super::gemm::launch_argmax_step(
                &client,
                x.clone(),
                w,
                base_k,
                base_len,
                gamma * width,
                slots.clone(),
                lanes,
            ),
            W2::Fp8 { words, scales, blocked } => super::gemm_fp8::launch_argmax_step(
                &client,
                x.clone(),
                words,
                scales,
                *blocked,
                base_k,
                base_len,
                gamma * width,
                slots.clone(),
                lanes,
            ),
        }
        // SAFETY: cube `row < lanes` of 32 units reads and clears slot `(row · 32 + unit) · SLOT_STRIDE`, reads
        // one `to_target` entry at an index below `width` (its length, when `mapped`) and row
        // `index < width ≤ table_rows` of `table` (a key's index is a column of the product), and
        // writes `tokens[row · γ + k]` (`lanes · γ` i32) and its row of `x`. The product before
        // it (which reads `x`) and the one after it (which reads the slots) are ordered by the
        // stream.
        unsafe {
            super::pdl::before_launch(&client);
            markov_pick_kernel::launch_unchecked(
                &client,
                CubeCount::Static(lanes as u32, 1, 1),
                CubeDim::new_1d(MARKOV_SLOTS as u32),
                BufferArg::from_raw_parts(slots.clone(), n_slots),
                BufferArg::from_raw_parts(table.handle.clone(), table_rows * rank_words),
                BufferArg::from_raw_parts(to_target.handle.clone(), to_target.meta.shape()[0]),
                BufferArg::from_raw_parts(all.handle.clone(), lanes * gamma),
                BufferArg::from_raw_parts(x.clone(), lanes * rank_words),
                rank_words as u32,
                gamma as u32,
                k as u32,
                mapped,
            );
        }
    }
    CubeTensor::new_contiguous(client, base.device.clone(), [lanes, gamma].into(), all.handle, DType::I32)
}

fn tokens_shape(base: &burn::tensor::Shape) -> burn::tensor::Shape {
    [base[0], base[1]].into()
}

/// The backend extension for the fused greedy steps.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait MarkovOps: burn::backend::Backend {
    /// The γ greedy steps with a bf16 W2, i32 tokens `[lanes, γ]`.
    #[fusion(dtype = DType::I32, shape = tokens_shape(base))]
    fn markov_greedy_dense(
        anchors: burn::backend::tensor::IntTensor<Self>,
        w1: burn::backend::tensor::FloatTensor<Self>,
        base: burn::backend::tensor::FloatTensor<Self>,
        w2: burn::backend::tensor::FloatTensor<Self>,
        table: burn::backend::tensor::FloatTensor<Self>,
        to_target: burn::backend::tensor::IntTensor<Self>,
        mapped: bool,
    ) -> burn::backend::tensor::IntTensor<Self>;

    /// The γ greedy steps with an FP8 W2 (`words`, `scales`; block scales when `blocked`).
    #[fusion(dtype = DType::I32, shape = tokens_shape(base))]
    #[allow(clippy::too_many_arguments)]
    fn markov_greedy_fp8(
        anchors: burn::backend::tensor::IntTensor<Self>,
        w1: burn::backend::tensor::FloatTensor<Self>,
        base: burn::backend::tensor::FloatTensor<Self>,
        words: burn::backend::tensor::IntTensor<Self>,
        scales: burn::backend::tensor::FloatTensor<Self>,
        table: burn::backend::tensor::FloatTensor<Self>,
        to_target: burn::backend::tensor::IntTensor<Self>,
        mapped: bool,
        blocked: bool,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl MarkovOps for CubeBackend {
    fn markov_greedy_dense(
        anchors: CubeTensor,
        w1: CubeTensor,
        base: CubeTensor,
        w2: CubeTensor,
        table: CubeTensor,
        to_target: CubeTensor,
        mapped: bool,
    ) -> CubeTensor {
        launch(anchors, w1, base, W2::Dense(w2), table, to_target, mapped)
    }

    #[allow(clippy::too_many_arguments)]
    fn markov_greedy_fp8(
        anchors: CubeTensor,
        w1: CubeTensor,
        base: CubeTensor,
        words: CubeTensor,
        scales: CubeTensor,
        table: CubeTensor,
        to_target: CubeTensor,
        mapped: bool,
        blocked: bool,
    ) -> CubeTensor {
        launch(anchors, w1, base, W2::Fp8 { words, scales, blocked }, table, to_target, mapped)
    }
}

/// Whether the fused steps take this problem: on CUDA, `anchors` `[lanes]` (at most
/// [`super::gemm::MAX_ROWS`] lanes), bf16 `w1` `[V, r]`, `base` `[lanes, γ, V']` and `table`
/// `[≥ V', r]`, an even rank, a W2 `[V', r]` whose product is one launch with the reduction
/// whole, and `to_target` (when given) `V'` long.
pub(crate) fn takes(
    anchors: &Tensor<1, Int>,
    w1: &Tensor<2>,
    base: &Tensor<3>,
    w2: crate::MarkovW2<'_>,
    table: &Tensor<2>,
    to_target: Option<&Tensor<1, Int>>,
) -> bool {
    let [lanes] = anchors.dims();
    let rank = w1.dims()[1];
    let [b_lanes, gamma, width] = base.dims();
    let cuda = |t: &Tensor<2>| matches!(t.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_));
    let shapes = lanes > 0
        && b_lanes == lanes
        && gamma > 0
        && rank > 0
        && rank.is_multiple_of(2)
        && w1.dims()[0] > 0
        && table.dims()[1] == rank
        && table.dims()[0] >= width
        && width < i32::MAX as usize
        && to_target.is_none_or(|m| m.dims()[0] == width)
        && [w1.dtype(), base.dtype(), table.dtype()].iter().all(|&d| d == DType::BF16)
        && cuda(w1)
        && cuda(table)
        && matches!(base.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_));
    shapes
        && match w2 {
            crate::MarkovW2::Dense(w) => {
                w.dims() == [width, rank]
                    && w.dtype() == DType::BF16
                    && cuda(w)
                    && super::gemm::argmax_step_fits(lanes, rank, width)
            }
            crate::MarkovW2::Fp8(m) => {
                m.out == width
                    && m.inp == rank
                    && super::gemm_fp8::argmax_step_fits(lanes, rank, width)
                    && matches!(m.words.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
            }
        }
}

/// See [`crate::markov_greedy`]; the caller checked [`takes`].
pub(crate) fn markov_greedy(
    anchors: Tensor<1, Int>,
    w1: &Tensor<2>,
    base: Tensor<3>,
    w2: crate::MarkovW2<'_>,
    table: &Tensor<2>,
    to_target: Option<&Tensor<1, Int>>,
) -> Tensor<2, Int> {
    let mapped = to_target.is_some();
    let to_target = match to_target {
        Some(m) => m.clone().cast(DType::I32),
        // Never read: a one-element stand-in, allocated without a fill.
        None => Tensor::<1, Int>::empty(
            [1],
            burn::tensor::TensorCreationOptions::new(base.device()).with_dtype(DType::I32),
        ),
    };
    let anchors = anchors.cast(DType::I32).into_dispatch();
    let tokens = match w2 {
        crate::MarkovW2::Dense(w) => <Dispatch as MarkovOps>::markov_greedy_dense(
            anchors,
            w1.clone().into_dispatch(),
            base.into_dispatch(),
            w.clone().into_dispatch(),
            table.clone().into_dispatch(),
            to_target.into_dispatch(),
            mapped,
        ),
        crate::MarkovW2::Fp8(m) => <Dispatch as MarkovOps>::markov_greedy_fp8(
            anchors,
            w1.clone().into_dispatch(),
            base.into_dispatch(),
            m.words.clone().into_dispatch(),
            m.scales.clone().into_dispatch(),
            table.clone().into_dispatch(),
            to_target.into_dispatch(),
            mapped,
            m.grid == ScaleGrid::Blocks,
        ),
    };
    Tensor::from_dispatch(tokens)
}

/// The start and pick kernels (the pick mapped or not), transpiled without a device (see
/// [`super::offline`]).
pub(crate) fn offline_markov() -> Vec<Result<super::offline::KernelSource, String>> {
    use super::offline::{offline_kernel, transpile};
    let start = offline_kernel!(
        markov_start_kernel::MarkovStartKernel,
        CubeDim::new_1d(MARKOV_SLOTS as u32);
        b b b b s s;
    );
    let mut all = vec![transpile("markov_start", start)];
    for mapped in [false, true] {
        let kernel = offline_kernel!(
            markov_pick_kernel::MarkovPickKernel,
            CubeDim::new_1d(MARKOV_SLOTS as u32);
            b b b b b s s s;
            mapped
        );
        all.push(transpile(&format!("markov_pick: mapped={mapped}"), kernel));
    }
    all
}
