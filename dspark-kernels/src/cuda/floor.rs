//! Two probes for the floor of a decode step's launch structure (benchmarks only): a streaming
//! read of a buffer that does nothing else, and a one-cube launch that does nothing but depend on
//! the one before. Recorded in a graph in a step's order, they time what the step would take if
//! every product read its weight as fast as a bare read can and every small kernel cost only its
//! launch.

use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// 16 bytes as four 32-bit registers.
type Words = Vector<u32, Const<4>>;

/// Threads of a read cube.
const READ_THREADS: usize = 256;

/// Reads every 16-byte word of `src` once (thread `t` of `T` takes words `t, t + T, …`, `unroll`
/// loads in flight) and folds them into a register; the only store is behind a test on that
/// value, so the loads cannot be dropped and no bandwidth goes to writes.
#[cube(launch_unchecked)]
fn stream_read_kernel(src: &[Words], out: &mut [u32], n: u32, #[comptime] unroll: usize) {
    crate::cuda::pdl::dependency_wait();
    let threads = CUBE_COUNT_X * READ_THREADS as u32;
    let tid = CUBE_POS_X * READ_THREADS as u32 + UNIT_POS_X;
    let mut acc = Words::new(0u32);
    let mut base = tid;
    let group = threads * unroll as u32;
    while base + threads * (unroll as u32 - 1) < n {
        let mut vals = Array::<Words>::new(unroll);
        #[unroll]
        for u in 0..unroll {
            vals[u] = src[(base + u as u32 * threads) as usize];
        }
        #[unroll]
        for u in 0..unroll {
            acc ^= vals[u];
        }
        base += group;
    }
    while base < n {
        acc ^= src[base as usize];
        base += threads;
    }
    let folded = acc.extract(0usize) ^ acc.extract(1usize) ^ acc.extract(2usize) ^ acc.extract(3usize);
    if folded == 0x9E37_79B9u32 {
        out[tid as usize] = folded;
    }
}

/// `x[0] += 1` by one thread: a launch that costs only its launch and its ordering.
#[cube(launch_unchecked)]
fn tick_kernel(x: &mut [u32]) {
    crate::cuda::pdl::dependency_wait();
    if UNIT_POS_X == 0 {
        x[0] += 1u32;
    }
}

fn read_launch(src: CubeTensor, out: CubeTensor, cubes: usize, unroll: usize) -> CubeTensor {
    let bytes = src.meta.shape().num_elements() * src.dtype.size();
    let words = bytes / 16;
    let slots = out.meta.shape().num_elements();
    assert!(
        cubes * READ_THREADS <= slots,
        "stream_read: {cubes} cubes need {} output words",
        cubes * READ_THREADS
    );
    // SAFETY: `src` holds at least `words` 16-byte words (its contiguous bytes, rounded down);
    // `out` holds `cubes · READ_THREADS` 32-bit words, the highest index a thread stores.
    unsafe {
        match unroll {
            1 => launch_read::<1>(&src, &out, cubes, words),
            2 => launch_read::<2>(&src, &out, cubes, words),
            4 => launch_read::<4>(&src, &out, cubes, words),
            _ => launch_read::<8>(&src, &out, cubes, words),
        }
    }
    out
}

/// # Safety
/// As in [`read_launch`].
unsafe fn launch_read<const U: usize>(src: &CubeTensor, out: &CubeTensor, cubes: usize, words: usize) {
    let slots = out.meta.shape().num_elements();
    unsafe {
        super::pdl::before_launch(&src.client);
        stream_read_kernel::launch_unchecked(
            &src.client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(READ_THREADS as u32),
            BufferArg::from_raw_parts(src.handle.clone(), words),
            BufferArg::from_raw_parts(out.handle.clone(), slots),
            words as u32,
            U,
        );
    }
}

fn tick_launch(x: CubeTensor) -> CubeTensor {
    // SAFETY: one thread writes word 0 of `x`, which holds at least one element (checked by the
    // caller).
    unsafe {
        super::pdl::before_launch(&x.client);
        tick_kernel::launch_unchecked(
            &x.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(32),
            BufferArg::from_raw_parts(x.handle.clone(), 1),
        );
    }
    x
}

fn same_shape(x: &burn::tensor::Shape) -> burn::tensor::Shape {
    x.clone()
}

/// The backend extension for the floor probes.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait FloorOps: burn::backend::Backend {
    /// Reads all of `src` with `cubes` cubes; returns `out` (its buffer; written only by chance).
    #[fusion(dtype = out, shape = same_shape(out))]
    fn stream_read(
        src: burn::backend::tensor::FloatTensor<Self>,
        out: burn::backend::tensor::IntTensor<Self>,
        cubes: usize,
        unroll: usize,
    ) -> burn::backend::tensor::IntTensor<Self>;

    /// `x[0] += 1` in `x`'s buffer; returns `x`.
    #[fusion(dtype = x, shape = same_shape(x))]
    fn tick(x: burn::backend::tensor::IntTensor<Self>) -> burn::backend::tensor::IntTensor<Self>;
}

impl FloorOps for CubeBackend {
    fn stream_read(src: CubeTensor, out: CubeTensor, cubes: usize, unroll: usize) -> CubeTensor {
        read_launch(burn_cubecl::kernel::into_contiguous(src), out, cubes, unroll)
    }

    fn tick(x: CubeTensor) -> CubeTensor {
        tick_launch(x)
    }
}

/// See [`crate::stream_read`].
pub(crate) fn stream_read(
    src: Tensor<1>,
    out: Tensor<1, Int>,
    cubes: usize,
    unroll: usize,
) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as FloorOps>::stream_read(
        src.into_dispatch(),
        out.into_dispatch(),
        cubes,
        unroll,
    ))
}

/// See [`crate::tick`].
pub(crate) fn tick(x: Tensor<1, Int>) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as FloorOps>::tick(x.into_dispatch()))
}
