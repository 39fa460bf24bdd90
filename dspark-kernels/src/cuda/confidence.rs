//! The confidence head of a draft block on the device (see [`crate::confidence_logits`]): one
//! cube per block row, so that a round reads back γ logits a lane instead of the block's γ hidden
//! rows (γ·H floats) and the host has no dot products left to make.

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::bf16;

use super::offline::{KernelSource, offline_kernel, transpile};

/// Threads of a cube.
const THREADS: usize = 256;

/// Row `r = lane·γ + k` of a block: `bias + Σ_j w[j]·h[r, j] + Σ_j w[hd + j]·table[prev, j]` in
/// f32, `prev` the lane's anchor for `k = 0` and the draft before (`tokens[r − 1]`) after it;
/// with `rank = 0`, the first sum only. An id outside the table's rows reads row 0 (ids come from
/// the argmax and the engine, so this never happens; it only keeps every read inside the table).
///
/// Thread `t` adds the products of elements `t, t + THREADS, …` of `[h_r ; table[prev]]` in that
/// order; then a warp butterfly, then the warps in order, then the bias: an order fixed by the
/// widths alone, whatever the number of rows or lanes.
///
/// The logit goes to `out[r]`, or with `with_tokens` to `out[rows + r]` after the row's token
/// as f32 in `out[r]` (a draft round's whole readback in one buffer, no cast or concatenation
/// after).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn confidence_kernel(
    hidden: &[bf16],
    table: &[bf16],
    anchors: &[u32],
    tokens: &[u32],
    w: &[f32],
    out: &mut [f32],
    gamma: u32,
    table_rows: u32,
    bias: f32,
    #[comptime] hd: usize,
    #[comptime] rank: usize,
    #[comptime] with_tokens: bool,
) {
    crate::cuda::pdl::dependency_wait();
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let gamma = gamma as usize;
    let mut part = 0.0f32;
    #[unroll]
    for j in 0..comptime!(hd.div_ceil(THREADS)) {
        let i = j * THREADS + tid;
        if i < hd {
            part += w[i] * f32::cast_from(hidden[row * hd + i]);
        }
    }
    if comptime![rank > 0] {
        let k = row % gamma;
        // The ids are i32 read as u32: a negative one is past every row.
        let mut prev = anchors[row / gamma];
        if k > 0 {
            prev = tokens[row - 1];
        }
        let mut at = 0usize;
        if prev < table_rows {
            at = prev as usize * rank;
        }
        #[unroll]
        for j in 0..comptime!(rank.div_ceil(THREADS)) {
            let i = j * THREADS + tid;
            if i < rank {
                part += w[hd + i] * f32::cast_from(table[at + i]);
            }
        }
    }
    let warp_sum = plane_sum(part);
    let mut partial = Shared::<[f32]>::new_slice(THREADS / 32);
    if tid.is_multiple_of(32) {
        partial[tid / 32] = warp_sum;
    }
    sync_cube();
    if tid == 0 {
        let mut total = 0.0f32;
        #[unroll]
        for k in 0..THREADS / 32 {
            total += partial[k];
        }
        if comptime![with_tokens] {
            // The ids are i32 (read as u32); token ids are below 2²⁴, exact in f32.
            out[row] = f32::cast_from(i32::reinterpret(tokens[row]));
            out[CUBE_COUNT_X as usize + row] = total + bias;
        } else {
            out[row] = total + bias;
        }
    }
}

/// Whether the kernel takes these inputs: bf16 rows and table on CUDA, f32 weights as wide as
/// the rows (and the table's rows), a row count a grid's x extent holds.
pub(crate) fn takes(hidden: &Tensor<2>, table: Option<&Tensor<2>>, weight: &Tensor<1>) -> bool {
    let [rows, hd] = hidden.dims();
    let rank = table.map_or(0, |t| t.dims()[1]);
    let on_cuda = |d: burn::tensor::Device| matches!(d.as_dispatch(), burn::backend::DispatchDevice::Cube(_));
    rows > 0
        && hd > 0
        && rows <= i32::MAX as usize
        && hidden.dtype() == DType::BF16
        && table.is_none_or(|t| t.dtype() == DType::BF16 && t.dims()[0] > 0 && rank > 0)
        && table.is_none_or(|t| t.dims()[0] <= u32::MAX as usize)
        && weight.dtype() == DType::F32
        && weight.dims()[0] >= hd + rank
        && on_cuda(hidden.device())
}

/// See [`crate::confidence_logits`]; the caller checked [`takes`] and the shapes.
/// With `with_tokens`, `[2·rows]`: the tokens as f32, then the logits (see
/// [`crate::tokens_and_confidence_logits`]).
pub(crate) fn confidence_logits(
    hidden: Tensor<2>,
    table: Option<&Tensor<2>>,
    anchors: Tensor<1, Int>,
    tokens: Tensor<1, Int>,
    weight: &Tensor<1>,
    bias: f32,
    with_tokens: bool,
) -> Tensor<1> {
    let markov = table.is_some();
    // Without a table the kernel never reads one: the rows stand in.
    let table = table.cloned().unwrap_or_else(|| hidden.clone());
    let ids = |t: Tensor<1, Int>| t.cast(DType::I32).into_dispatch();
    Tensor::from_dispatch(<Dispatch as ConfidenceOps>::confidence_logits(
        hidden.into_dispatch(),
        table.into_dispatch(),
        ids(anchors),
        ids(tokens),
        weight.clone().into_dispatch(),
        bias,
        markov,
        with_tokens,
    ))
}

#[allow(clippy::too_many_arguments)]
fn launch(
    hidden: CubeTensor,
    table: CubeTensor,
    anchors: CubeTensor,
    tokens: CubeTensor,
    w: CubeTensor,
    bias: f32,
    markov: bool,
    with_tokens: bool,
) -> CubeTensor {
    let contiguous = burn_cubecl::kernel::into_contiguous;
    let (hidden, table, anchors, tokens, w) =
        (contiguous(hidden), contiguous(table), contiguous(anchors), contiguous(tokens), contiguous(w));
    let [rows, hd] = [hidden.meta.shape()[0], hidden.meta.shape()[1]];
    let [table_rows, rank] = if markov { [table.meta.shape()[0], table.meta.shape()[1]] } else { [rows, 0] };
    let lanes = anchors.meta.shape()[0];
    assert!(
        lanes > 0 && rows.is_multiple_of(lanes) && tokens.meta.shape()[0] == rows,
        "confidence_logits: {rows} rows, {lanes} anchors, {} tokens",
        tokens.meta.shape()[0]
    );
    let n_w = w.meta.shape()[0];
    assert!(n_w >= hd + rank, "confidence_logits: {n_w} weights for {hd} + {rank} inputs");
    let client = hidden.client.clone();
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client.clone(),
        hidden.device.clone(),
        [rows * (1 + usize::from(with_tokens))].into(),
        DType::F32,
    );
    let table_len = if markov { table_rows * rank } else { rows * hd };
    // SAFETY: cube r reads row r of `hidden` (`rows·hd` bf16), `w[.. hd + rank]` (`n_w` f32),
    // anchor `r / γ < lanes` or token `r − 1 < rows`, and, with a table, row `prev` of it only
    // when `prev < table_rows` (else row 0), `rank` bf16; it writes `out[r]` (`rows` f32), and
    // with `with_tokens` also `out[rows + r]` (`2·rows` f32; the grid's x extent is `rows`).
    unsafe {
        super::pdl::before_launch(&client);
        confidence_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(THREADS as u32),
            BufferArg::from_raw_parts(hidden.handle.clone(), rows * hd),
            BufferArg::from_raw_parts(table.handle.clone(), table_len),
            BufferArg::from_raw_parts(anchors.handle.clone(), lanes),
            BufferArg::from_raw_parts(tokens.handle.clone(), rows),
            BufferArg::from_raw_parts(w.handle.clone(), n_w),
            BufferArg::from_raw_parts(out.handle.clone(), rows * (1 + usize::from(with_tokens))),
            (rows / lanes) as u32,
            table_rows as u32,
            bias,
            hd,
            rank,
            with_tokens,
        );
    }
    out
}

/// `[rows]`, or `[2·rows]` with the tokens before the logits.
fn logits_shape(
    hidden: &burn::tensor::Shape,
    with_tokens: impl std::borrow::Borrow<bool>,
) -> burn::tensor::Shape {
    [hidden[0] * (1 + usize::from(*with_tokens.borrow()))].into()
}

/// The backend extension: run by CubeCL on CUDA and deferred through fusion.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait ConfidenceOps: burn::backend::Backend {
    /// The confidence logits of a block's rows (f32), with the table's term when `markov`;
    /// with `with_tokens`, after the rows' tokens as f32 (`[2·rows]`).
    #[fusion(dtype = DType::F32, shape = logits_shape(hidden, with_tokens))]
    #[allow(clippy::too_many_arguments)]
    fn confidence_logits(
        hidden: burn::backend::tensor::FloatTensor<Self>,
        table: burn::backend::tensor::FloatTensor<Self>,
        anchors: burn::backend::tensor::IntTensor<Self>,
        tokens: burn::backend::tensor::IntTensor<Self>,
        weight: burn::backend::tensor::FloatTensor<Self>,
        bias: f32,
        markov: bool,
        with_tokens: bool,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl ConfidenceOps for CubeBackend {
    fn confidence_logits(
        hidden: CubeTensor,
        table: CubeTensor,
        anchors: CubeTensor,
        tokens: CubeTensor,
        weight: CubeTensor,
        bias: f32,
        markov: bool,
        with_tokens: bool,
    ) -> CubeTensor {
        launch(hidden, table, anchors, tokens, weight, bias, markov, with_tokens)
    }
}

/// The kernel at a draft's widths (`hd` hidden, `rank` Markov rank, 0 without the Markov term),
/// transpiled without a device (see [`super::offline`]).
pub(crate) fn offline_confidence(hd: usize, rank: usize, with_tokens: bool) -> Result<KernelSource, String> {
    transpile(
        &format!("confidence: hd={hd} rank={rank} with_tokens={with_tokens}"),
        offline_kernel!(
            confidence_kernel::ConfidenceKernel,
            CubeDim::new_1d(THREADS as u32);
            b b b b b b s s s;
            hd, rank, with_tokens
        ),
    )
}
