//! Hot-path operations for dspark.
//!
//! Every operation here has a body in plain burn ops that runs on any device (the CPU
//! reference); the CUDA kernels that replace them on the GPU are checked against these bodies.
//! Model code calls only the functions of this crate for these steps, so a kernel can be swapped
//! in without touching the models.

pub mod accept;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::offline;
pub mod fp8;
pub mod gemm_plan;
pub mod graph;
pub mod reference;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use burn::tensor::{Int, Tensor};

static KERNELS: AtomicBool = AtomicBool::new(true);
static PAGED_REFERENCE: AtomicBool = AtomicBool::new(false);
static TENSOR_CORE_ATTENTION: AtomicBool = AtomicBool::new(true);
static TILE_PADDING: AtomicBool = AtomicBool::new(true);
static INT_VIEWS: AtomicBool = AtomicBool::new(true);
static CONFIDENCE_KERNEL: AtomicBool = AtomicBool::new(true);
static FP8_SWIGLU: AtomicBool = AtomicBool::new(true);
static PARALLEL_DRAWS: AtomicBool = AtomicBool::new(true);
static FUSED_MARKOV: AtomicBool = AtomicBool::new(true);
static MARKOV_LOOP: AtomicBool = AtomicBool::new(true);
static ATTENTION_FOLD: AtomicBool = AtomicBool::new(false);
static LAYER_CHAIN: AtomicBool = AtomicBool::new(false);
static CHAIN_PREFETCH: AtomicUsize = AtomicUsize::new(2);

/// Turn this crate's GPU kernels on or off for the whole process (on by default); off, every
/// operation runs its plain-burn body. For A/B benchmarks and checks in one process.
pub fn set_kernels_enabled(enabled: bool) {
    KERNELS.store(enabled, Ordering::Relaxed);
}

/// Route [`paged_attention`] through its plain-burn body on every device and dtype, and make
/// [`paged_attention_runs`] say yes: the models then take their page-table path (one table per
/// forward, K/V stored by physical row, draft blocks in scratch rows) on the CPU too, so that
/// path is tested where the kernels do not run. Off by default; process-wide.
pub fn set_paged_reference(enabled: bool) {
    PAGED_REFERENCE.store(enabled, Ordering::Relaxed);
}

/// Run [`paged_attention`]'s key splits on tensor cores (on by default, for head widths up to
/// 128) or with one warp per query row and head. Both are batch-invariant, but they round
/// differently, so a process keeps one choice while it decodes. For A/B benchmarks.
pub fn set_tensor_core_attention(enabled: bool) {
    TENSOR_CORE_ATTENTION.store(enabled, Ordering::Relaxed);
}

/// Launch the bf16 skinny GEMM's products of 17–24 rows with four activation tiles of 8 rows
/// instead of three (on by default). On the H100 a Qwen3-8B forward of 17 rows (a γ = 16 verify
/// window) takes 7.35 ms padded against 8.08 ms unpadded, and one of 24 rows 7.38 against 8.10
/// (`benches/results/2026-12-05-h100-switches-*`). No bit changes, since a row's sums do not
/// depend on the tiles beside it: `skinny_gemm_is_batch_invariant` passes with the padding off
/// and on, and so do the 8B-shaped engine tests with it on (`gpu_tiles.sh check`, H100). For
/// A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_tile_padding(enabled: bool) {
    TILE_PADDING.store(enabled, Ordering::Relaxed);
}

/// Let [`int_view`] on CUDA share its tensor's buffer where the view starts aligned, instead of
/// copying through burn's slice (which copies unless the view's end is aligned as well); on by
/// default. A recorded forward takes its inputs as views of one buffer: 4–5 copy launches of
/// about 3 µs each per target step and per draft round on the H100 (`ncu`) without the views.
/// Checked on the H100 (`gpu_tiles.sh check`: `int_views_read_their_buffer`, and the recorded
/// forwards equal to op by op at 8B shapes with it on). For A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_int_views(enabled: bool) {
    INT_VIEWS.store(enabled, Ordering::Relaxed);
}

/// Drafts built (or switched to the device Markov pass) from now on evaluate their confidence
/// head with [`confidence_logits`] beside the device Markov pass, so a round reads back γ logits
/// a lane instead of its hidden rows (`DSparkDraft::set_device_confidence` chooses per draft).
/// On by default: the kernel matches its body and f64, and the engine tests pass with it
/// (`benches/gpu_staged.sh check`, H100, 2026-12-06); a γ = 7 FP8 proposal takes 0.99–1.01 ms
/// against 1.02–1.05 with the host head (`benches/results/2026-12-06-h100-staged.md`). Off, the
/// host evaluates the head on the read-back hidden rows in f64. For A/B benchmarks;
/// process-wide.
#[doc(hidden)]
pub fn set_confidence_kernel(enabled: bool) {
    CONFIDENCE_KERNEL.store(enabled, Ordering::Relaxed);
}

/// Whether new drafts run their confidence head on the device (see [`set_confidence_kernel`]).
#[doc(hidden)]
pub fn confidence_kernel() -> bool {
    CONFIDENCE_KERNEL.load(Ordering::Relaxed)
}

/// FP8 gate/up weights with per-row scales built from now on (kept as [`Fp8Matrix`]: where the
/// FP8 kernel runs, or on the reference path of [`fp8::set_fp8_reference`]) are paired
/// ([`Fp8Matrix::pair_gate_up`]) for [`linear_fp8_swiglu`], whose SwiGLU is the product's
/// epilogue (one launch and no `[rows, 2·inter]` intermediate a draft layer), instead of stacked
/// for [`linear_fp8`] and [`swiglu_cols`]; the same bits either way (`gpu_kernels
/// linear_fp8_swiglu_matches_reference` and the engine tests, H100, 2026-12-06). On by default:
/// one launch fewer a layer, though the proposal times measured with and without it differ by
/// no more than their noise (`benches/results/2026-12-06-h100-staged.md`). For A/B benchmarks;
/// process-wide.
#[doc(hidden)]
pub fn set_fp8_swiglu(enabled: bool) {
    FP8_SWIGLU.store(enabled, Ordering::Relaxed);
}

/// Whether new FP8 gate/up weights are paired (see [`set_fp8_swiglu`]).
#[doc(hidden)]
pub fn fp8_swiglu() -> bool {
    FP8_SWIGLU.load(Ordering::Relaxed)
}

/// Let [`sample_rows`] on CUDA make a sampling row's segment weights in parallel (one thread
/// per segment) and walk the chosen thread's values on that thread, instead of thread 0 making
/// every `exp` of the walk (about 2·segments + 17 f64 exponentials a row: 93 over a
/// 151 936-wide vocabulary). The same products, sums and order, so the same draws
/// (`gpu_kernels sample_rows_parallel_walk_matches_serial`, H100, 2026-12-06). On by default: a
/// sampled γ = 7 FP8 proposal over the whole vocabulary takes 1.12–1.19 ms against 1.28–1.33
/// (`benches/results/2026-12-06-h100-staged.md`). For A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_parallel_draws(enabled: bool) {
    PARALLEL_DRAWS.store(enabled, Ordering::Relaxed);
}

/// Whether [`sample_rows`] walks in parallel (see [`set_parallel_draws`]).
#[doc(hidden)]
pub fn parallel_draws() -> bool {
    PARALLEL_DRAWS.load(Ordering::Relaxed)
}

/// Let [`markov_greedy`] on CUDA run each greedy Markov step as two launches (the W2 product
/// with an argmax epilogue, then a pick that writes the token and gathers the next `W1` row)
/// instead of four (gather, product, two argmax passes), with no launches after the last step
/// to join or map the tokens: some 2γ launches fewer a round. The same tokens bit for bit
/// (the same sums, roundings and order-free choice: `gpu_kernels markov_greedy_matches_unfused`
/// and the engine tests, H100, 2026-12-06). On by default: γ = 16 bf16 proposals 0.04–0.06 ms
/// shorter, the others unchanged within noise, some 27 µs less device time in a γ = 7 FP8
/// proposal (`benches/results/2026-12-06-h100-markov.md`). For A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_fused_markov(enabled: bool) {
    FUSED_MARKOV.store(enabled, Ordering::Relaxed);
}

/// Whether [`markov_greedy`] fuses its steps on CUDA (see [`set_fused_markov`]).
#[doc(hidden)]
pub fn fused_markov() -> bool {
    FUSED_MARKOV.load(Ordering::Relaxed)
}

/// Let the fused greedy Markov steps (see [`set_fused_markov`]) with a W2 of rank at most 256
/// (bf16 or FP8) and at most 8 lanes run as one launch: a cube per SM for the whole loop, much of
/// W2 kept in shared memory after the first step, a grid barrier between steps
/// (`cuda::markov_loop`). The same tokens bit for bit (`gpu_kernels
/// markov_greedy_matches_unfused` and the engine tests, H200 and H100, 2026-12-06). On by
/// default: the Markov part of a γ = 7 FP8 proposal takes 99 µs of device time instead of 158,
/// and greedy proposals measured 0.03–0.07 ms shorter in four of four pairs
/// (`benches/results/2026-12-06-h200-loop.md`); balanced block shares later took the loop
/// kernel from 103 to 95 µs (FP8) and 193 to 175 µs (bf16) on an H100
/// (`benches/results/2026-12-06-h100-loop2.md`), and loading base logits and blocks ahead with a
/// one-thread-fenced barrier from 95 to 89 µs (FP8) and 173 to 161 µs (bf16)
/// (`benches/results/2026-12-07-h100-pdl-loop3.md`). For A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_markov_loop(enabled: bool) {
    MARKOV_LOOP.store(enabled, Ordering::Relaxed);
}

/// Whether greedy Markov steps run as one launch (see [`set_markov_loop`]).
#[doc(hidden)]
pub fn markov_loop() -> bool {
    MARKOV_LOOP.load(Ordering::Relaxed)
}

/// Record graphs with programmatic dependencies between this crate's kernels on Hopper
/// (`cuda::pdl`): each kernel's cubes are placed while the kernel before it still runs and wait
/// for it on the device (`griddepcontrol.wait`, the first instruction of every kernel here), so
/// a replay no longer pays a grid launch at every boundary. Changes when cubes start, never what
/// they compute. Turn it on before the process launches its first kernel (kernels are built
/// with the wait only then); it applies to graphs recorded after the call. Off by default until
/// measured. Returns whether it took (`false` without the `cuda` feature, or when turning it on
/// after kernels were built without the wait).
pub fn set_programmatic_launch(enabled: bool) -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::pdl::set_enabled(enabled)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = enabled;
        false
    }
}

/// Take the programmatic edges of [`set_programmatic_launch`] from the kernel before's
/// programmatic port (its cubes trigger right after their own wait) instead of its
/// launch-completion port (the default). For A/B benchmarks; graphs recorded from then on.
#[doc(hidden)]
pub fn set_programmatic_trigger_port(enabled: bool) {
    #[cfg(feature = "cuda")]
    cuda::pdl::set_trigger_port(enabled);
    #[cfg(not(feature = "cuda"))]
    let _ = enabled;
}

/// Programmatic dependencies recorded into graphs by this process so far (see
/// [`set_programmatic_launch`]): for benchmarks and checks that the switch took effect.
#[doc(hidden)]
pub fn programmatic_edges() -> usize {
    #[cfg(feature = "cuda")]
    return cuda::pdl::edges();
    #[cfg(not(feature = "cuda"))]
    0
}

/// Whether graphs are recorded with programmatic dependencies (see [`set_programmatic_launch`];
/// it turns itself off if the driver refuses one).
pub fn programmatic_launch() -> bool {
    #[cfg(feature = "cuda")]
    return cuda::pdl::enabled();
    #[cfg(not(feature = "cuda"))]
    false
}

/// Whether [`int_view`] shares buffers (see [`set_int_views`]).
#[doc(hidden)]
pub fn int_views() -> bool {
    INT_VIEWS.load(Ordering::Relaxed)
}

/// Whether products of 17–24 rows run as four tiles (see [`set_tile_padding`]).
#[doc(hidden)]
pub fn tile_padding() -> bool {
    TILE_PADDING.load(Ordering::Relaxed)
}

/// Threads of a row-norm cube (see [`set_norm_threads`]).
static NORM_THREADS: AtomicUsize = AtomicUsize::new(1024);

/// Sets the threads of the RMSNorm kernel's cube (one cube per row): 1024 (the default), 512
/// or 256; anything else is refused (`false`). A one-row norm is one cube on one SM, whose time
/// is its instruction stream (Nsight on the H100 with 256 threads: 2.3 µs active of 4.4, 0.36
/// instructions issued per scheduler and cycle with two warps each); more threads split that
/// stream. Measured on the H100 (2026-12-05, `bench-target --norm-threads`, one process each,
/// interleaved): one-row step 6.03 / 6.10 ms with 256, 5.98 / 5.97 with 1024, 6.00 with 512;
/// 16 lanes unchanged. The sum of squares adds the warps' sums in warp order, so the bits
/// differ between settings but never between rows, windows or lanes of one setting (checked at
/// Qwen3-8B shapes with 1024: `gpu_golden` batch invariance and recorded forwards): a process
/// uses one. For A/B benchmarks.
#[doc(hidden)]
pub fn set_norm_threads(threads: usize) -> bool {
    let ok = matches!(threads, 256 | 512 | 1024);
    if ok {
        NORM_THREADS.store(threads, Ordering::Relaxed);
    }
    ok
}

/// Threads of the RMSNorm kernel's cube (see [`set_norm_threads`]).
#[doc(hidden)]
pub fn norm_threads() -> usize {
    NORM_THREADS.load(Ordering::Relaxed)
}

/// Fewest keys of a paged-attention split (see [`set_attention_min_chunk`]).
static ATTENTION_MIN_CHUNK: AtomicUsize = AtomicUsize::new(32);

/// Sets the fewest keys of a paged-attention split (flash decoding): 32 (the default), 64, 128
/// or 256; anything else is refused (`false`). A row with `n` visible keys is cut into
/// `⌈n / chunk⌉` splits of `chunk = max(min_chunk, ⌈⌈n / 32⌉ / min_chunk⌉ · min_chunk)` keys,
/// so fewer, longer splits (fewer cubes, a shorter merge) for contexts below `32 · min_chunk`.
/// A row's splits still depend on its own key count alone, so results stay batch-invariant,
/// but the reduction order differs between settings: a process uses one. For A/B benchmarks.
#[doc(hidden)]
pub fn set_attention_min_chunk(keys: usize) -> bool {
    let ok = matches!(keys, 32 | 64 | 128 | 256);
    if ok {
        ATTENTION_MIN_CHUNK.store(keys, Ordering::Relaxed);
    }
    ok
}

/// The fewest keys of a paged-attention split (see [`set_attention_min_chunk`]).
#[doc(hidden)]
pub fn attention_min_chunk() -> usize {
    ATTENTION_MIN_CHUNK.load(Ordering::Relaxed)
}

/// Let [`paged_attention_synced`] merge the key splits of one-row groups inside the split
/// kernel instead of in a second launch; the same bits either way. Off by default until its GPU
/// checks have run (`benches/gpu_chain.sh check`). For A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_attention_fold(enabled: bool) {
    ATTENTION_FOLD.store(enabled, Ordering::Relaxed);
}

/// Let [`layer_tail`] chain a layer's tail into one launch where it can; off, it runs its five
/// launches. The same bits either way. Off by default until its GPU checks have run
/// (`benches/gpu_chain.sh check`). For A/B benchmarks; process-wide.
#[doc(hidden)]
pub fn set_layer_chain(enabled: bool) {
    LAYER_CHAIN.store(enabled, Ordering::Relaxed);
}

/// Sets the weight chunks each warp of a chained product loads before it waits for the step
/// before it (see [`layer_tail`]): 1, 2 (the default) or 8 (capped by the product's unroll);
/// anything else is refused (`false`). Held in registers across the wait, so more raises the
/// chained kernel's registers (sm_90a, Qwen3-8B widths, one tile: 54 / 60 / 122 for bf16, so 4 /
/// 4 / 2 cubes an SM). Numerically neutral: for A/B benchmarks.
#[doc(hidden)]
pub fn set_chain_prefetch(chunks: usize) -> bool {
    let ok = matches!(chunks, 1 | 2 | 8);
    if ok {
        CHAIN_PREFETCH.store(chunks, Ordering::Relaxed);
    }
    ok
}

/// The chunks a chained product's warps load before they wait (see [`set_chain_prefetch`]).
#[doc(hidden)]
pub fn chain_prefetch() -> usize {
    CHAIN_PREFETCH.load(Ordering::Relaxed)
}

/// Whether [`layer_tail`] chains (see [`set_layer_chain`]).
#[doc(hidden)]
pub fn layer_chain() -> bool {
    LAYER_CHAIN.load(Ordering::Relaxed)
}

/// Calls of [`layer_tail`] in this process that ran as one chained launch: tests check with it
/// that the chain ran.
#[doc(hidden)]
pub fn layer_chains() -> usize {
    #[cfg(feature = "cuda")]
    return cuda::chain::CHAINS.load(Ordering::Relaxed);
    #[cfg(not(feature = "cuda"))]
    0
}

/// Calls of [`paged_attention_synced`] in this process whose merges were folded into the split
/// kernel: tests check with it that the fold ran.
#[doc(hidden)]
pub fn attention_folds() -> usize {
    #[cfg(feature = "cuda")]
    return cuda::attention::FOLDS.load(Ordering::Relaxed);
    #[cfg(not(feature = "cuda"))]
    0
}

/// Whether [`paged_attention_synced`] folds the merge in (see [`set_attention_fold`]).
#[doc(hidden)]
pub fn attention_fold() -> bool {
    ATTENTION_FOLD.load(Ordering::Relaxed)
}

/// Whether [`paged_attention`] uses tensor cores (see [`set_tensor_core_attention`]).
pub fn tensor_core_attention() -> bool {
    TENSOR_CORE_ATTENTION.load(Ordering::Relaxed)
}

/// Whether this crate's GPU kernels are on (see [`set_kernels_enabled`]).
pub fn kernels_enabled() -> bool {
    KERNELS.load(Ordering::Relaxed)
}

pub use fp8::{Fp8Matrix, linear_fp8, linear_fp8_add_rms_norm, linear_fp8_swiglu};
pub use gemm_plan::{GemmPlan, force_mtiles, force_plan, force_unroll_wide};
pub use graph::{
    DeviceGraph, GraphError, INT_VIEW_ALIGN, InputBuffer, graph_emulation, graphs_available, int_view,
    set_graph_emulation, set_graphs_enabled, write_floats_into, write_into,
};
pub use reference::{AttentionMask, apply_rope, attention, rms_norm, swiglu};

/// `x · Wᵀ` for a weight in its checkpoint layout `[out, in]`.
///
/// On CUDA, bf16 activations and weights with `in` a multiple of 32 and `out` a multiple of 16
/// (every Qwen3 and DSpark projection and LM head) run the tensor-core skinny GEMM of this crate:
/// one pass over the weight for up to 64 rows, f32 accumulation, and a reduction order that does
/// not depend on the number of rows (a row's result is bit-identical alone or batched). Everything
/// else runs [`reference::linear`].
///
/// # Shapes
/// `x`: `[rows, in]`, `weight`: `[out, in]` → `[rows, out]`.
///
pub fn linear(x: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::gemm::takes(&x, weight) {
        return cuda::gemm::linear(x, weight);
    }
    reference::linear(x, weight)
}

/// Rows of the gate and up projections paired for [`linear_swiglu`]: 16-row block `b` holds
/// gate rows `8b .. 8b + 8`, then up rows `8b .. 8b + 8`.
///
/// # Shapes
/// `gate`, `up`: `[inter, in]` with `inter` a multiple of 8 → `[2·inter, in]`.
pub fn pair_gate_up(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    let [inter, inp] = gate.dims();
    let blocks = inter / 8;
    let gate = gate.reshape([blocks, 8, inp]);
    let up = up.reshape([blocks, 8, inp]);
    Tensor::cat(vec![gate, up], 1).reshape([2 * inter, inp])
}

/// `silu(x·Gᵀ)·(x·Uᵀ)` for gate and up weights paired by [`pair_gate_up`], as [`linear`] then
/// [`swiglu_cols`] compute it (the same bits). On CUDA, where the skinny GEMM does not cut the
/// reduction (a Qwen3-8B gate/up pair), the SwiGLU is the product's epilogue: one launch.
///
/// # Shapes
/// `x`: `[rows, in]`, `paired`: `[2·inter, in]` → `[rows, inter]`.
pub fn linear_swiglu(x: Tensor<2>, paired: &Tensor<2>) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if kernels_enabled() && paired.dims()[0].is_multiple_of(16) && cuda::gemm::takes_swiglu(&x, paired) {
        return cuda::gemm::linear_swiglu(x, paired);
    }
    let rows = x.dims()[0];
    let inter = paired.dims()[0] / 2;
    let y = linear(x, paired).reshape([rows, inter / 8, 2, 8]);
    let gate = y.clone().narrow(2, 0, 1).reshape([rows, inter]);
    let up = y.narrow(2, 1, 1).reshape([rows, inter]);
    swiglu_cols(gate, up, 0, 0, inter)
}

/// RMSNorm of each row (`[rows, d]`), as [`reference::rms_norm`] computes it. On CUDA in bf16 it
/// is one kernel (a cube per row, f32 sums in an order fixed by `d`).
pub fn rms_norm_rows(x: Tensor<2>, weight: &Tensor<1>, eps: f64) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::fused::takes_norm(&x, weight) {
        return cuda::fused::rms_norm(x, weight, eps);
    }
    reference::rms_norm(x, weight, eps)
}

/// The residual add and the RMSNorm after it, `(s, RMSNorm(s)·w)` with `s = x + delta`, as
/// [`reference::add_rms_norm`] computes them. On CUDA in bf16 it is one kernel.
///
/// # Shapes
/// `x`, `delta`: `[rows, d]`, `weight`: `[d]` → (`[rows, d]`, `[rows, d]`).
pub fn add_rms_norm(x: Tensor<2>, delta: Tensor<2>, weight: &Tensor<1>, eps: f64) -> (Tensor<2>, Tensor<2>) {
    #[cfg(feature = "cuda")]
    if kernels_enabled()
        && x.dims() == delta.dims()
        && delta.dtype() == x.dtype()
        && cuda::fused::takes_norm(&x, weight)
    {
        return cuda::fused::add_rms_norm(x, delta, weight, eps);
    }
    reference::add_rms_norm(x, delta, weight, eps)
}

/// The residual add of a projection and the RMSNorm after it: `(s, RMSNorm(s)·norm)` with
/// `s = x + a·Wᵀ`, as [`linear`] then [`add_rms_norm`] compute them (the same bits).
///
/// On CUDA, where [`linear`] runs its kernel with a split reduction (the o and down projections
/// of Qwen3-8B) for at most 64 rows, the split sums are added, rounded, added to `x` and normed
/// by one kernel instead of three (the product's combine, the residual add, the norm).
///
/// # Shapes
/// `x`: `[rows, out]`, `a`: `[rows, in]`, `weight`: `[out, in]`, `norm`: `[out]` →
/// (`[rows, out]`, `[rows, out]`).
pub fn linear_add_rms_norm(
    x: Tensor<2>,
    a: Tensor<2>,
    weight: &Tensor<2>,
    norm: &Tensor<1>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    #[cfg(feature = "cuda")]
    if kernels_enabled()
        && x.dims() == [a.dims()[0], weight.dims()[0]]
        && x.dtype() == a.dtype()
        && cuda::gemm::takes(&a, weight)
        && cuda::fused::takes_norm(&x, norm)
    {
        return cuda::fused::linear_add_rms_norm(x, a, weight, norm, eps);
    }
    add_rms_norm(x, linear(a, weight), norm, eps)
}

/// i32 counter words [`layer_tail`] needs in its `sync` buffer.
pub const LAYER_TAIL_SYNC_WORDS: usize = 8;

/// The weights of a decoder layer's tail ([`layer_tail`]): the o projection `[d, hq]`, the
/// gate/up pair `[2·inter, d]` (paired as [`pair_gate_up`] or [`Fp8Matrix::pair_gate_up`] make
/// it) and the down projection `[d, inter]`, all bf16 or all FP8.
#[derive(Debug, Clone, Copy)]
pub enum TailWeights<'a> {
    /// bf16 `[out, in]` tensors.
    Bf16 {
        /// The o projection.
        o: &'a Tensor<2>,
        /// The paired gate/up projection.
        gate_up: &'a Tensor<2>,
        /// The down projection.
        down: &'a Tensor<2>,
    },
    /// FP8 matrices (the gate/up pair with per-row scales).
    Fp8 {
        /// The o projection.
        o: &'a Fp8Matrix,
        /// The paired gate/up projection.
        gate_up: &'a Fp8Matrix,
        /// The down projection.
        down: &'a Fp8Matrix,
    },
}

/// A decoder layer's tail after its attention: `(x2, RMSNorm(x2)·next_norm)` with
/// `x1 = x + a·w_oᵀ`, `h1 = RMSNorm(x1)·post_norm`, `x2 = x1 + swiglu(h1, gate_up)·w_downᵀ`: the
/// same bits as [`linear_add_rms_norm`], [`linear_swiglu`] and [`linear_add_rms_norm`] again (or
/// their FP8 forms for FP8 weights).
///
/// On CUDA with bf16 activations, for at most 16 rows, with `sync` (at least
/// [`LAYER_TAIL_SYNC_WORDS`] zeroed i32 counters, left zero) and [`set_layer_chain`] on, the five
/// launches of those calls are one, in which each product's cubes stream their first weights
/// while the step before them finishes (see `cuda/chain.rs`). Elsewhere the three calls run as
/// they are, and `sync` is not touched.
///
/// # Shapes
/// `x`: `[rows, d]`, `a`: `[rows, hq]`, norms: `[d]` → (`[rows, d]`, `[rows, d]`).
pub fn layer_tail(
    x: Tensor<2>,
    a: Tensor<2>,
    (post_norm, next_norm): (&Tensor<1>, &Tensor<1>),
    weights: TailWeights,
    eps: f64,
    sync: Option<&Tensor<1, Int>>,
) -> (Tensor<2>, Tensor<2>) {
    #[cfg(feature = "cuda")]
    if let Some(sync) = sync
        && kernels_enabled()
        && layer_chain()
        && cuda::chain::takes(&x, &a, [post_norm, next_norm], &weights, sync)
    {
        return cuda::chain::layer_tail(x, a, [post_norm, next_norm], &weights, eps, sync);
    }
    let _ = sync;
    match weights {
        TailWeights::Bf16 { o, gate_up, down } => {
            let (x, h) = linear_add_rms_norm(x, a, o, post_norm, eps);
            let act = linear_swiglu(h, gate_up);
            linear_add_rms_norm(x, act, down, next_norm, eps)
        }
        TailWeights::Fp8 { o, gate_up, down } => {
            let (x, h) = linear_fp8_add_rms_norm(x, a, o, post_norm, eps);
            let act = linear_fp8_swiglu(h, gate_up);
            linear_fp8_add_rms_norm(x, act, down, next_norm, eps)
        }
    }
}

/// The attention input of a layer from one fused q/k/v projection output `y` (q heads at
/// column 0, then `kv_heads` k heads, then as many v heads): q normed and rotated, returned;
/// k normed and rotated and v as it is, stored at pool rows `rows` of `k_pool` and `v_pool`.
/// The values are those of [`qk_norm_rope`] (q and k) and a row assignment into the pools
/// ([`reference::qkv_norm_rope_store`]); on CUDA in bf16 it is one kernel, which writes the
/// pools in place.
///
/// # Shapes
/// `y`: `[n, ≥ (heads + 2·kv_heads)·head_dim]`, `cos`/`sin`: `[n, head_dim]`, `rows`: `[n]`,
/// pools: `[pool_rows, kv_heads, head_dim]` → q `[n, heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn qkv_norm_rope_store(
    y: Tensor<2>,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    q_norm: &Tensor<1>,
    k_norm: &Tensor<1>,
    (cos, sin): (&Tensor<2>, &Tensor<2>),
    eps: f64,
    rows: &Tensor<1, Int>,
    k_pool: &mut Tensor<3>,
    v_pool: &mut Tensor<3>,
) -> Tensor<3> {
    #[cfg(feature = "cuda")]
    if kernels_enabled()
        && cuda::fused::takes_qkv_store(
            &y, heads, kv_heads, head_dim, q_norm, k_norm, cos, sin, rows, k_pool, v_pool,
        )
    {
        return with_pools(k_pool, v_pool, |k, v| {
            cuda::fused::qkv_norm_rope_store(y, heads, head_dim, q_norm, k_norm, cos, sin, eps, rows, k, v)
        });
    }
    reference::qkv_norm_rope_store(
        y,
        (heads, kv_heads, head_dim),
        q_norm,
        k_norm,
        (cos, sin),
        eps,
        rows,
        k_pool,
        v_pool,
    )
}

/// [`qkv_norm_rope_store`] without q heads: the K/V of context rows from one fused k/v
/// projection output `y` (`kv_heads` k heads from column 0, then as many v heads), k normed and
/// rotated, both stored at pool rows `rows` (one kernel on CUDA in bf16).
///
/// # Shapes
/// `y`: `[n, ≥ 2·kv_heads·head_dim]`, `cos`/`sin`: `[n, head_dim]`, `rows`: `[n]`, pools:
/// `[pool_rows, kv_heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn kv_norm_rope_store(
    y: Tensor<2>,
    (kv_heads, head_dim): (usize, usize),
    k_norm: &Tensor<1>,
    (cos, sin): (&Tensor<2>, &Tensor<2>),
    eps: f64,
    rows: &Tensor<1, Int>,
    k_pool: &mut Tensor<3>,
    v_pool: &mut Tensor<3>,
) {
    #[cfg(feature = "cuda")]
    if kernels_enabled()
        && cuda::fused::takes_qkv_store(
            &y, 0, kv_heads, head_dim, k_norm, k_norm, cos, sin, rows, k_pool, v_pool,
        )
    {
        return with_pools(k_pool, v_pool, |k, v| {
            let (k, v) = cuda::fused::kv_norm_rope_store(y, head_dim, k_norm, cos, sin, eps, rows, k, v);
            ((), k, v)
        });
    }
    reference::kv_norm_rope_store(y, (kv_heads, head_dim), k_norm, (cos, sin), eps, rows, k_pool, v_pool)
}

/// Runs `f` on the two pools taken out of their places, puts back the pools it returns and hands
/// out the rest (a kernel that writes the pools in place returns the same buffers).
#[cfg(feature = "cuda")]
fn with_pools<T>(
    k_pool: &mut Tensor<3>,
    v_pool: &mut Tensor<3>,
    f: impl FnOnce(Tensor<3>, Tensor<3>) -> (T, Tensor<3>, Tensor<3>),
) -> T {
    let mut out = None;
    k_pool.inplace(|k| {
        let mut k_out = None;
        v_pool.inplace(|v| {
            let (rest, k_new, v_new) = f(k, v);
            out = Some(rest);
            k_out = Some(k_new);
            v_new
        });
        // `inplace` runs its closure exactly once.
        k_out.expect("the pool update ran")
    });
    out.expect("the pool update ran")
}

/// Per-head RMSNorm then RoPE of `heads` heads starting at column `offset` of `x`, as
/// [`reference::qk_norm_rope`] computes them: q or k straight out of a fused q/k/v projection.
/// On CUDA in bf16 with a head width that is a multiple of 64 it is one kernel (a warp per row
/// and head).
///
/// # Shapes
/// `x`: `[rows, width]`, `weight`: `[head_dim]`, `cos`/`sin`: `[rows, head_dim]` →
/// `[rows, heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    x: Tensor<2>,
    offset: usize,
    heads: usize,
    head_dim: usize,
    weight: &Tensor<1>,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
    eps: f64,
) -> Tensor<3> {
    #[cfg(feature = "cuda")]
    if kernels_enabled()
        && offset + heads * head_dim <= x.dims()[1]
        && sin.dims() == cos.dims()
        && sin.dtype() == cos.dtype()
        && cuda::fused::takes_qk(&x, weight, cos, head_dim)
    {
        return cuda::fused::qk_norm_rope(x, offset, heads, head_dim, weight, cos, sin, eps);
    }
    reference::qk_norm_rope(x, offset, heads, head_dim, weight, cos, sin, eps)
}

/// `silu(g)·u` over `width` columns of `g` from `g_off` and of `u` from `u_off`, as
/// [`reference::swiglu_cols`] computes it (pass a fused gate/up output as both). On CUDA in
/// bf16 it is one kernel.
///
/// # Shapes
/// `g`: `[rows, ≥ g_off + width]`, `u`: `[rows, ≥ u_off + width]` → `[rows, width]`.
pub fn swiglu_cols(g: Tensor<2>, u: Tensor<2>, g_off: usize, u_off: usize, width: usize) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if kernels_enabled()
        && g.dims()[0] == u.dims()[0]
        && g_off + width <= g.dims()[1]
        && u_off + width <= u.dims()[1]
        && cuda::fused::takes_swiglu(&g, &u)
    {
        return cuda::fused::swiglu(g, u, g_off, u_off, width);
    }
    reference::swiglu_cols(g, u, g_off, u_off, width)
}

/// Index of each row's largest value, the lowest on ties (NaN skipped; 0 when nothing exceeds
/// −∞): greedy decoding's choice, as [`reference::argmax_rows`] makes it. On CUDA for f32 rows it
/// is two launches (row segments of 4096 in parallel, then one warp per row merging their
/// candidates) whose result is exact whatever the cut, and only the ids need to leave the
/// device.
///
/// # Shapes
/// `x`: `[rows, width]` → `[rows]`.
pub fn argmax_rows(x: Tensor<2>) -> Tensor<1, Int> {
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::fused::takes_argmax(&x) {
        return cuda::fused::argmax(x);
    }
    reference::argmax_rows(x)
}

/// [`argmax_rows`] of `f32(a[:, k, :]) + f32(b)`: a Markov step's greedy choice from its base
/// logits (step `k` of `a`, `[rows, steps, width]`) and its bias `b` (`[rows, width]`), as the
/// widening, the add and [`argmax_rows`] make it (the same index: the sums are the same f32
/// values). On CUDA for bf16 inputs the sums are formed inside the argmax's first pass and never
/// stored: two launches instead of four or five.
///
/// # Shapes
/// `a`: `[rows, steps, width]`, `b`: `[rows, width]` → `[rows]`.
pub fn argmax_sum_rows(a: Tensor<3>, k: usize, b: Tensor<2>) -> Tensor<1, Int> {
    let [rows, steps, width] = a.dims();
    assert!(k < steps, "argmax_sum_rows: step {k} of {steps}");
    assert_eq!(b.dims(), [rows, width], "argmax_sum_rows: b is not [rows, width]");
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::fused::takes_argmax_sum(&a, &b) {
        return cuda::fused::argmax_sum(a, k, b);
    }
    let f32 = |t: Tensor<2>| {
        if t.dtype() == burn::tensor::DType::F32 { t } else { t.cast(burn::tensor::DType::F32) }
    };
    argmax_rows(f32(a.narrow(1, k, 1).reshape([rows, width])) + f32(b))
}

/// A Markov head's `W2` `[V', r]` for [`markov_greedy`]: dense in the draft's dtype, or FP8.
#[derive(Debug, Clone, Copy)]
pub enum MarkovW2<'a> {
    /// `[V', r]` in the draft's dtype.
    Dense(&'a Tensor<2>),
    /// e4m3 with its scales.
    Fp8(&'a Fp8Matrix),
}

impl MarkovW2<'_> {
    /// `x · W2ᵀ` through [`linear`] or [`linear_fp8`].
    pub fn product(self, x: Tensor<2>) -> Tensor<2> {
        match self {
            MarkovW2::Dense(w) => linear(x, w),
            MarkovW2::Fp8(m) => linear_fp8(x, m),
        }
    }
}

/// The γ greedy steps of a vanilla Markov head for every lane: step `k` chooses, per lane, the
/// lowest index of the largest `f32(base[lane, k, i]) + f32((x_k · W2ᵀ)[lane, i])` (as
/// [`argmax_sum_rows`]), where `x_0 = w1[anchors]` and `x_{k+1} = table[choice_k]`; returns the
/// choices `[lanes, γ]`, through `to_target` (a restricted draft vocabulary's token ids) when
/// given.
///
/// On CUDA, with [`set_fused_markov`] on and shapes it takes (bf16, at most 64 lanes, a W2 whose
/// product does not cut the reduction: every DSpark head), a step is two launches: the product,
/// whose epilogue merges each 16-column block's best into the lane's running argmax (an atomic
/// max of order-preserving keys), and a pick that writes the choice and gathers the next row;
/// with [`set_markov_loop`] on (the default) and at most 8 lanes and rank 256, all γ steps are
/// one launch with the same sums and the same choice.
/// Elsewhere, and as its reference, the loop of a gather, [`MarkovW2::product`] and
/// [`argmax_sum_rows`]: the same choices bit for bit (`gpu_kernels
/// markov_greedy_matches_unfused`).
///
/// # Shapes
/// `anchors`: `[lanes]`, `w1`: `[V, r]`, `base`: `[lanes, γ, V']`, `table`: `[≥ V', r]`,
/// `to_target`: `[V']` → `[lanes, γ]`.
pub fn markov_greedy(
    anchors: Tensor<1, Int>,
    w1: &Tensor<2>,
    base: Tensor<3>,
    w2: MarkovW2<'_>,
    table: &Tensor<2>,
    to_target: Option<&Tensor<1, Int>>,
) -> Tensor<2, Int> {
    let [lanes, gamma, _] = base.dims();
    assert_eq!(anchors.dims()[0], lanes, "markov_greedy: {} anchors for {lanes} lanes", anchors.dims()[0]);
    #[cfg(feature = "cuda")]
    if markov_greedy_fuses(&anchors, w1, &base, w2, table, to_target) {
        return cuda::markov::markov_greedy(anchors, w1, base, w2, table, to_target);
    }
    let mut x = w1.clone().select(0, anchors);
    let mut chosen: Vec<Tensor<2, Int>> = Vec::with_capacity(gamma);
    for k in 0..gamma {
        let t = argmax_sum_rows(base.clone(), k, w2.product(x));
        chosen.push(t.clone().reshape([lanes, 1]));
        x = table.clone().select(0, t);
    }
    let chosen = Tensor::cat(chosen, 1);
    match to_target {
        Some(m) => m.clone().select(0, chosen.reshape([lanes * gamma])).reshape([lanes, gamma]),
        None => chosen,
    }
}

/// Whether [`markov_greedy`] runs these inputs as its fused steps (CUDA, [`set_fused_markov`]
/// on, shapes it takes), for tests that must not compare the unfused loop with itself.
#[doc(hidden)]
pub fn markov_greedy_fuses(
    anchors: &Tensor<1, Int>,
    w1: &Tensor<2>,
    base: &Tensor<3>,
    w2: MarkovW2<'_>,
    table: &Tensor<2>,
    to_target: Option<&Tensor<1, Int>>,
) -> bool {
    #[cfg(feature = "cuda")]
    return kernels_enabled()
        && fused_markov()
        && cuda::markov::takes(anchors, w1, base, w2, table, to_target);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (anchors, w1, base, w2, table, to_target);
        false
    }
}

/// Whether [`markov_greedy`] runs these inputs as the one-launch loop ([`set_markov_loop`] on,
/// [`markov_greedy_fuses`], at most 8 lanes, a W2 rank the loop takes), for tests that must not
/// compare the two-launch steps with themselves. (The launch also falls back to the two-launch
/// steps for rows that do not start on a 16-byte boundary, which uploads never give.)
#[doc(hidden)]
pub fn markov_greedy_loops(
    anchors: &Tensor<1, Int>,
    w1: &Tensor<2>,
    base: &Tensor<3>,
    w2: MarkovW2<'_>,
    table: &Tensor<2>,
    to_target: Option<&Tensor<1, Int>>,
) -> bool {
    #[cfg(feature = "cuda")]
    return markov_loop()
        && markov_greedy_fuses(anchors, w1, base, w2, table, to_target)
        && cuda::markov_loop::loop_fits(anchors.dims()[0], base.dims()[2])
        && cuda::markov_loop::LoopShape::new(matches!(w2, MarkovW2::Dense(_)), w1.dims()[1]).is_some();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (anchors, w1, base, w2, table, to_target);
        false
    }
}

/// The pre-sigmoid logits of a draft's confidence head over its blocks, `c_k = σ(logit)`: for
/// row `r = lane·γ + k` (`γ = rows / lanes`), `bias + w[.. hd]·hidden[r] + w[hd ..]·table[prev_r]`
/// with `prev_r` the lane's anchor for `k = 0` and the draft before (`tokens[r − 1]`) after it;
/// without `table` (a head that does not read the Markov embedding), the first dot product only.
/// Ids outside the table read its row 0.
///
/// On CUDA for bf16 `hidden` and `table` and f32 weights it is one launch (a cube per row, f32
/// sums in an order fixed by the widths), so a draft round reads back γ logits a lane instead of
/// its γ hidden rows. Elsewhere [`reference::confidence_logits`] reads everything back and sums
/// in f64; the two differ by f32 rounding only.
///
/// # Shapes
/// `hidden`: `[rows, hd]`, `table`: `[V, rank]`, `anchors`: `[lanes]`, `tokens`: `[rows]`,
/// `weight`: `[≥ hd + rank]` → `[rows]` (f32).
///
/// # Panics
/// If `rows` is not a positive multiple of `lanes`, `tokens` is not `rows` long, or the weights
/// are too few.
pub fn confidence_logits(
    hidden: Tensor<2>,
    table: Option<&Tensor<2>>,
    anchors: Tensor<1, Int>,
    tokens: Tensor<1, Int>,
    weight: &Tensor<1>,
    bias: f32,
) -> Tensor<1> {
    check_confidence_shapes(&hidden, table, &anchors, &tokens, weight);
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::confidence::takes(&hidden, table, weight) {
        return cuda::confidence::confidence_logits(hidden, table, anchors, tokens, weight, bias, false);
    }
    reference::confidence_logits(hidden, table, anchors, tokens, weight, bias)
}

/// The shape rules of [`confidence_logits`] (see its panics).
fn check_confidence_shapes(
    hidden: &Tensor<2>,
    table: Option<&Tensor<2>>,
    anchors: &Tensor<1, Int>,
    tokens: &Tensor<1, Int>,
    weight: &Tensor<1>,
) {
    let [rows, hd] = hidden.dims();
    let lanes = anchors.dims()[0];
    let rank = table.map_or(0, |t| t.dims()[1]);
    assert!(
        lanes > 0 && rows > 0 && rows.is_multiple_of(lanes),
        "confidence_logits: {rows} rows for {lanes} lanes"
    );
    assert_eq!(tokens.dims()[0], rows, "confidence_logits: one token per row");
    assert!(
        weight.dims()[0] >= hd + rank,
        "confidence_logits: {} weights for {hd} + {rank}",
        weight.dims()[0]
    );
}

/// `[tokens as f32 ; confidence_logits(..)]`: a draft round's readback (its `rows` tokens, then
/// their confidence logits) in one f32 buffer. On CUDA where [`confidence_logits`] runs its
/// kernel, the same launch writes both halves (no cast or concatenation after it); elsewhere the
/// tokens are cast and joined to [`confidence_logits`]. Token ids are below 2²⁴, so exact.
///
/// # Shapes
/// As [`confidence_logits`], → `[2·rows]` (f32).
///
/// # Panics
/// As [`confidence_logits`].
pub fn tokens_and_confidence_logits(
    hidden: Tensor<2>,
    table: Option<&Tensor<2>>,
    anchors: Tensor<1, Int>,
    tokens: Tensor<1, Int>,
    weight: &Tensor<1>,
    bias: f32,
) -> Tensor<1> {
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::confidence::takes(&hidden, table, weight) {
        check_confidence_shapes(&hidden, table, &anchors, &tokens, weight);
        return cuda::confidence::confidence_logits(hidden, table, anchors, tokens, weight, bias, true);
    }
    let as_f32 = tokens.clone().float().cast(burn::tensor::DType::F32);
    let logits = confidence_logits(hidden, table, anchors, tokens, weight, bias);
    Tensor::cat(vec![as_f32, logits], 0)
}

/// One draw per row from `softmax(x_r / T_r)` over the whole row (the draft's proposal in a
/// sampled Markov step), or the argmax where `T_r = 0`, as [`reference::draw_row`] defines it.
/// Row `r`'s temperature and coin are the three values `draws[3r .. 3r + 3]` made by
/// [`reference::draw_words`]; they live in device memory, so a recorded round draws new coins
/// on every replay.
///
/// On CUDA for f32 rows it is two launches (row segments of 4096 in parallel: each one's maximum,
/// its lowest index and its f64 sum of weights; then one cube per row walking the segments, and
/// inside the chosen one, in index order). The sums run in a fixed order, so a row's draw
/// depends only on the row and its words; against the host rule the weights and sums differ
/// only by f64 rounding.
///
/// # Shapes
/// `x`: `[rows, width]`, `draws`: `[3·rows]` → `[rows]`.
pub fn sample_rows(x: Tensor<2>, draws: Tensor<1, Int>) -> Tensor<1, Int> {
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::fused::takes_argmax(&x) {
        return cuda::sample::sample_rows(x, draws);
    }
    reference::sample_rows(x, draws)
}

/// Chain rejection sampling of several lanes' draft blocks against the target, on the device:
/// for each lane `(accepted, token)`, where `token` is the draw from the residual at the first
/// rejection, or the bonus from the row after the last draft. The rule, including top-k and top-p
/// on the target's rows (no sort), is that of [`accept`]; `rows` and `lanes` are the words
/// [`accept::accept_words`] makes. Only the `2·lanes` results need to leave the device.
///
/// On CUDA for f32 rows it is two launches (one cube per row reducing it to its distribution's
/// constants; one cube per lane testing the drafts and drawing); every sum has a fixed order.
/// Elsewhere the host body [`accept::chain_accept`] reads everything back. The two differ by
/// f64 rounding only.
///
/// # Shapes
/// `p`: `[p_rows, width]`, `q`: `[q_rows, width]`, `rows`: `[3·(p_rows + q_rows)]`, `lanes`:
/// `[lanes, stride]` → `[lanes, 2]`.
///
/// # Panics
/// If the shapes disagree (the words' contents are trusted: build them with
/// [`accept::accept_words`]).
pub fn chain_accept(
    p: Tensor<2>,
    q: Tensor<2>,
    rows: Tensor<1, Int>,
    lanes: Tensor<2, Int>,
) -> Tensor<2, Int> {
    let [p_rows, width] = p.dims();
    let [q_rows, q_width] = q.dims();
    assert_eq!(rows.dims()[0], 3 * (p_rows + q_rows), "chain_accept: row words");
    assert!(q_rows == 0 || q_width == width, "chain_accept: p is {width} wide, q {q_width}");
    assert!(lanes.dims()[1] >= accept::lane_stride(0), "chain_accept: lane words");
    #[cfg(feature = "cuda")]
    if kernels_enabled() && cuda::accept::takes(&p, &q, lanes.dims()[0]) {
        return cuda::accept::chain_accept(p, q, rows, lanes);
    }
    let _ = rows;
    accept::chain_accept(p, q, lanes)
}

/// Benchmarks only (the launch-structure floor of `bench-kernels --floor`): reads every 16-byte
/// word of `src` once with `cubes` cubes of 256 threads (`unroll` loads in flight per thread: 1,
/// 2, 4 or 8) and nothing else; `out` (at least `256 · cubes` words) is returned, written only
/// if the words fold to one particular value. `None` where this crate's CUDA kernels do not run.
#[doc(hidden)]
pub fn stream_read(
    src: Tensor<1>,
    out: Tensor<1, Int>,
    cubes: usize,
    unroll: usize,
) -> Option<Tensor<1, Int>> {
    #[cfg(feature = "cuda")]
    if kernels_available(&src.device()) && out.dims()[0] >= 256 * cubes && cubes > 0 {
        return Some(cuda::floor::stream_read(src, out, cubes, unroll));
    }
    let _ = (src, out, cubes, unroll);
    None
}

/// Benchmarks only: `x[0] += 1` in `x`'s buffer by a one-cube launch, returning `x`: a launch
/// that costs only itself and its ordering after the previous one. `None` where this crate's CUDA
/// kernels do not run.
#[doc(hidden)]
pub fn tick(x: Tensor<1, Int>) -> Option<Tensor<1, Int>> {
    #[cfg(feature = "cuda")]
    if kernels_available(&x.device()) && x.dims()[0] > 0 {
        return Some(cuda::floor::tick(x));
    }
    let _ = x;
    None
}

/// Whether this crate's CUDA kernels can run on `device` (a CUDA build, a CUDA device, kernels
/// enabled). Callers use it to skip preparing kernel inputs on other devices.
pub fn kernels_available(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cuda")]
    if kernels_enabled() {
        return matches!(device.as_dispatch(), burn::backend::DispatchDevice::Cube(_));
    }
    let _ = device;
    false
}

/// Whether [`paged_attention`] runs a kernel for these tensors: CUDA, bf16, a head width that is
/// a multiple of 32 (up to 256). Callers without it keep a per-lane path over
/// [`reference::attention`], which is what the kernel is checked against.
pub fn paged_attention_supported(q: &Tensor<3>, pool: &Tensor<3>) -> bool {
    #[cfg(feature = "cuda")]
    if kernels_enabled() {
        return cuda::attention::supported(q, pool);
    }
    let _ = (q, pool);
    false
}

/// Whether [`paged_attention`] runs its kernel for `heads` bf16 query heads over this pool
/// (checkable before q exists, e.g. when a forward's page tables are planned).
pub fn paged_attention_runs(heads: usize, pool: &Tensor<3>) -> bool {
    if PAGED_REFERENCE.load(Ordering::Relaxed) {
        return true;
    }
    #[cfg(feature = "cuda")]
    if kernels_enabled() {
        return cuda::attention::runs(heads, pool);
    }
    let _ = (heads, pool);
    false
}

/// Attention of every query row of every lane over a paged K/V pool, in one call.
///
/// Row `r` attends to the pool rows `keys[meta[r, 0] .. meta[r, 0] + meta[r, 1]]` (the lane's
/// positions `0 .. start + i + 1` for a causal row, every context and block key for a draft
/// block row), with grouped-query heads and the softmax in f32. The lengths live in device
/// memory, so a captured launch stays valid as contexts grow. With
/// [`paged_attention_supported`] it is one CUDA kernel whose per-row reduction order depends
/// only on the row's key count; otherwise [`reference::paged_attention`].
///
/// # Shapes
/// `q`: `[rows, heads, head_dim]`, `k_pool`/`v_pool`: `[pool_rows, kv_heads, head_dim]`,
/// `keys`: `[n]`, `meta`: `[rows, 2]` → `[rows, heads, head_dim]`.
pub fn paged_attention(
    q: Tensor<3>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
    keys: &Tensor<1, Int>,
    meta: &Tensor<2, Int>,
) -> Tensor<3> {
    paged_attention_grouped(q, k_pool, v_pool, keys, meta, 1)
}

/// [`paged_attention`] where the rows come in groups of `group` that share a key table (each
/// lane's verify window or draft block: `meta[r, 0]` equal within a group), so the kernel can
/// read each key once for the whole group. The grouping never changes a result: a row gets the
/// same bits under any `group` (rows of a group that do not share keys are served apart).
pub fn paged_attention_grouped(
    q: Tensor<3>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
    keys: &Tensor<1, Int>,
    meta: &Tensor<2, Int>,
    group: usize,
) -> Tensor<3> {
    #[cfg(feature = "cuda")]
    if !PAGED_REFERENCE.load(Ordering::Relaxed) && paged_attention_supported(&q, k_pool) {
        return cuda::attention::paged_attention(q, k_pool, v_pool, keys, meta, group, None);
    }
    let _ = group;
    reference::paged_attention(q, k_pool, v_pool, keys, meta)
}

/// i32 counter words [`paged_attention_synced`] needs for `rows` query rows over `kv_heads`
/// K/V heads.
pub fn attention_sync_words(rows: usize, kv_heads: usize) -> usize {
    rows.clamp(1, 64) * kv_heads
}

/// [`paged_attention_grouped`] with `sync`, a zeroed i32 buffer of at least
/// [`attention_sync_words`] words that the call leaves zero again: where every group is one
/// row (a decode step of one or many lanes) the tensor-core kernel then merges each row's key
/// splits itself (the last of a row's split cubes for a K/V head to finish counts itself in at
/// its counter and merges them), one launch instead of two. The merge is the one the separate
/// combine makes, so the bits are the same, and the same as the row's would be inside a window.
/// Elsewhere (windows, other dtypes, [`set_attention_fold`] off, a buffer too short or not i32)
/// `sync` is not touched.
pub fn paged_attention_synced(
    q: Tensor<3>,
    k_pool: &Tensor<3>,
    v_pool: &Tensor<3>,
    keys: &Tensor<1, Int>,
    meta: &Tensor<2, Int>,
    group: usize,
    sync: &Tensor<1, Int>,
) -> Tensor<3> {
    #[cfg(feature = "cuda")]
    if !PAGED_REFERENCE.load(Ordering::Relaxed) && paged_attention_supported(&q, k_pool) {
        return cuda::attention::paged_attention(q, k_pool, v_pool, keys, meta, group, Some(sync));
    }
    let _ = (group, sync);
    reference::paged_attention(q, k_pool, v_pool, keys, meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two launch-shape switches take only the sizes their kernels are built for and keep
    /// the current value otherwise (no test here sets a valid one: the values are process-wide).
    #[test]
    fn switches_refuse_sizes_the_kernels_do_not_take() {
        let (threads, chunk) = (norm_threads(), attention_min_chunk());
        assert_eq!((threads, chunk), (1024, 32), "the defaults");
        for bad in [0, 1, 128, 300, 2048] {
            assert!(!set_norm_threads(bad), "norm threads {bad}");
        }
        for bad in [0, 16, 48, 96, 512] {
            assert!(!set_attention_min_chunk(bad), "min chunk {bad}");
        }
        assert_eq!((norm_threads(), attention_min_chunk()), (threads, chunk));
    }

    /// Without the chained kernel (the CPU), a layer's tail is the three calls it stands for,
    /// composed here from the plain-burn bodies: the same values to f32 rounding, with or
    /// without counters (which it leaves as they were).
    #[test]
    fn layer_tail_without_the_kernel_is_the_unfused_tail() {
        use burn::tensor::{Distribution, TensorData};
        let device = burn::tensor::Device::flex();
        let (rows, d, hq, inter, eps) = (3, 64, 32, 96, 1e-6);
        let rand =
            |shape: [usize; 2], s: f64| Tensor::<2>::random(shape, Distribution::Normal(0.0, s), &device);
        let (x, a) = (rand([rows, d], 1.0), rand([rows, hq], 1.0));
        let (w_o, w_d) = (rand([d, hq], 0.2), rand([d, inter], 0.1));
        let (gate, up) = (rand([inter, d], 0.2), rand([inter, d], 0.2));
        let gate_up = pair_gate_up(gate.clone(), up.clone());
        let n1 = rand([1, d], 0.1).reshape([d]).add_scalar(1.0);
        let n2 = rand([1, d], 0.1).reshape([d]).add_scalar(1.0);
        let sync =
            Tensor::<1, Int>::from_data(TensorData::new(vec![7i64; LAYER_TAIL_SYNC_WORDS], [8]), &device);
        let weights = TailWeights::Bf16 { o: &w_o, gate_up: &gate_up, down: &w_d };
        let (x2, h2) = layer_tail(x.clone(), a.clone(), (&n1, &n2), weights, eps, Some(&sync));
        let (bx, bh) = layer_tail(x.clone(), a.clone(), (&n1, &n2), weights, eps, None);
        let (x1, h1) = reference::add_rms_norm(x, reference::linear(a, &w_o), &n1, eps);
        let act = reference::swiglu(reference::linear(h1.clone(), &gate), reference::linear(h1, &up));
        let (wx, wh) = reference::add_rms_norm(x1, reference::linear(act, &w_d), &n2, eps);
        for (got, want) in [(&x2, &wx), (&h2, &wh), (&bx, &wx), (&bh, &wh)] {
            let diff = (got.clone() - want.clone()).abs().max().into_scalar::<f32>();
            assert!(diff <= 1e-4, "max |difference| {diff}");
        }
        assert_eq!(
            sync.into_data().convert::<i64>().try_to_vec::<i64>().expect("i64 counters"),
            vec![7; 8],
            "counters touched"
        );
    }

    /// On the CPU the floor probes answer `None` rather than reading anything.
    #[test]
    fn floor_probes_are_cuda_only() {
        let device = burn::tensor::Device::flex();
        assert!(!kernels_available(&device));
        let src = Tensor::<1>::zeros([64], &device);
        assert!(stream_read(src, Tensor::<1, Int>::zeros([256], &device), 1, 4).is_none());
        assert!(tick(Tensor::<1, Int>::zeros([1], &device)).is_none());
    }
}
