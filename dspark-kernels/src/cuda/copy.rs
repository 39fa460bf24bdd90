//! In-place writes of integer inputs, for graphs: the recorded launches read the very buffer
//! this writes into.

use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Threads of a copy cube.
const COPY_THREADS: usize = 256;

/// `dst[i] = src[i]` for `i < n` (32-bit words).
#[cube(launch_unchecked)]
fn copy_words_kernel(src: &[u32], dst: &mut [u32], n: u32) {
    crate::cuda::pdl::dependency_wait();
    let i = (CUBE_POS_X * COPY_THREADS as u32 + UNIT_POS_X) as usize;
    if i < n as usize {
        dst[i] = src[i];
    }
}

/// Copy `src` over the front of `dst`'s buffer and return `dst` (same buffer).
fn launch(dst: CubeTensor, src: CubeTensor) -> CubeTensor {
    let src = burn_cubecl::kernel::into_contiguous(src);
    let size = src.dtype.size();
    let words = src.meta.shape()[0] * size / 4;
    let client = src.client.clone();
    // SAFETY: `dst` is contiguous (checked by the caller's `contiguous` below) and holds at least
    // `src.len()` elements of the same dtype; the kernel writes words `< words` of it and reads
    // words `< words` of `src`.
    unsafe {
        super::pdl::before_launch(&client);
        copy_words_kernel::launch_unchecked(
            &client,
            CubeCount::Static(words.div_ceil(COPY_THREADS) as u32, 1, 1),
            CubeDim::new_1d(COPY_THREADS as u32),
            BufferArg::from_raw_parts(src.handle.clone(), words),
            BufferArg::from_raw_parts(dst.handle.clone(), words),
            words as u32,
        );
    }
    dst
}

fn dst_shape(dst: &burn::tensor::Shape) -> burn::tensor::Shape {
    dst.clone()
}

/// The backend extension for the in-place write.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait WriteIntoOps: burn::backend::Backend {
    /// `dst[0 .. src.len()] = src`, in `dst`'s buffer; returns `dst`.
    #[fusion(dtype = dst, shape = dst_shape(dst))]
    fn write_into(
        dst: burn::backend::tensor::IntTensor<Self>,
        src: burn::backend::tensor::IntTensor<Self>,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl WriteIntoOps for CubeBackend {
    fn write_into(dst: CubeTensor, src: CubeTensor) -> CubeTensor {
        launch(dst, src)
    }
}

/// The backend extension for the in-place write of floats.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait WriteFloatsIntoOps: burn::backend::Backend {
    /// `dst[0 .. src.len()] = src`, in `dst`'s buffer; returns `dst`.
    #[fusion(dtype = dst, shape = dst_shape(dst))]
    fn write_floats_into(
        dst: burn::backend::tensor::FloatTensor<Self>,
        src: burn::backend::tensor::FloatTensor<Self>,
    ) -> burn::backend::tensor::FloatTensor<Self>;
}

impl WriteFloatsIntoOps for CubeBackend {
    fn write_floats_into(dst: CubeTensor, src: CubeTensor) -> CubeTensor {
        launch(dst, src)
    }
}

/// See [`crate::graph::write_floats_into`]; sizes a multiple of four bytes.
pub(crate) fn write_floats_into(dst: Tensor<1>, src: Tensor<1>) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as WriteFloatsIntoOps>::write_floats_into(
        dst.into_dispatch(),
        src.into_dispatch(),
    ))
}

/// The backend extension for a copy into a new buffer.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait FreshCopyOps: burn::backend::Backend {
    /// A copy of `x` in a buffer of its own.
    #[fusion(dtype = x, shape = dst_shape(x))]
    fn fresh_copy(x: burn::backend::tensor::FloatTensor<Self>) -> burn::backend::tensor::FloatTensor<Self>;
}

impl FreshCopyOps for CubeBackend {
    fn fresh_copy(x: CubeTensor) -> CubeTensor {
        let x = burn_cubecl::kernel::into_contiguous(x);
        let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            x.client.clone(),
            x.device.clone(),
            x.meta.shape().clone(),
            x.dtype,
        );
        let words = x.meta.shape().num_elements() * x.dtype.size() / 4;
        // SAFETY: `out` is a new contiguous buffer of `x`'s size; the kernel copies `words`
        // 32-bit words (the caller checked the size is a multiple of four bytes).
        unsafe {
            super::pdl::before_launch(&x.client);
            copy_words_kernel::launch_unchecked(
                &x.client,
                CubeCount::Static(words.div_ceil(COPY_THREADS) as u32, 1, 1),
                CubeDim::new_1d(COPY_THREADS as u32),
                BufferArg::from_raw_parts(x.handle.clone(), words),
                BufferArg::from_raw_parts(out.handle.clone(), words),
                words as u32,
            );
        }
        out
    }
}

/// See [`crate::graph::fresh_copy`]; `x`'s size must be a multiple of four bytes.
pub(crate) fn fresh_copy<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FreshCopyOps>::fresh_copy(x.into_dispatch()))
}

/// See [`crate::graph::write_into`]; `dst` must be a whole contiguous buffer (as allocated).
pub(crate) fn write_into(dst: Tensor<1, Int>, src: Tensor<1, Int>) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as WriteIntoOps>::write_into(dst.into_dispatch(), src.into_dispatch()))
}

fn view_shape(len: usize) -> burn::tensor::Shape {
    [len].into()
}

/// The backend extension for a view of part of a 1-D integer tensor.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait IntViewOps: burn::backend::Backend {
    /// `x[offset .. offset + len]`, sharing `x`'s buffer where the start is aligned.
    #[fusion(dtype = x, shape = view_shape(*len))]
    fn int_view(
        x: burn::backend::tensor::IntTensor<Self>,
        offset: usize,
        len: usize,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl IntViewOps for CubeBackend {
    fn int_view(x: CubeTensor, offset: usize, len: usize) -> CubeTensor {
        let start = (offset * x.dtype.size()) as u64;
        let aligned = start.is_multiple_of(x.client.properties().memory.alignment);
        if x.meta.shape().num_dims() == 1 && x.meta.strides()[0] == 1 && aligned {
            // The view's buffer runs on past its `len` elements (to the end of `x`'s): kernels
            // read the shape, and the start keeps the alignment vector loads need. burn's slice
            // would copy here unless the end were aligned too.
            return CubeTensor::new_contiguous(
                x.client.clone(),
                x.device.clone(),
                [len].into(),
                x.handle.clone().offset_start(start),
                x.dtype,
            );
        }
        burn_cubecl::kernel::slice(x, std::slice::from_ref(&(offset..offset + len)))
    }
}

/// See [`crate::graph::int_view`]; the caller checked the range.
pub(crate) fn int_view(x: Tensor<1, Int>, offset: usize, len: usize) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as IntViewOps>::int_view(x.into_dispatch(), offset, len))
}

/// Device buffers resolved by [`ResolveOps::resolve_buffer`], by the key the caller chose.
static RESOLVED: std::sync::Mutex<Vec<(usize, cubecl::client::Client, cubecl::server::Handle)>> =
    std::sync::Mutex::new(Vec::new());

/// The backend extension that hands a tensor's device buffer to the host side.
#[burn::backend::backend_extension(Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "cuda"))]
pub trait ResolveOps: burn::backend::Backend {
    /// `x` itself; records its client and buffer under `key` (see [`HostWrites::new`]).
    #[fusion(dtype = x, shape = dst_shape(x))]
    fn resolve_buffer(
        x: burn::backend::tensor::IntTensor<Self>,
        key: usize,
    ) -> burn::backend::tensor::IntTensor<Self>;
}

impl ResolveOps for CubeBackend {
    fn resolve_buffer(x: CubeTensor, key: usize) -> CubeTensor {
        if let Ok(mut resolved) = RESOLVED.lock() {
            resolved.push((key, x.client.clone(), x.handle.clone()));
        }
        x
    }
}

/// Host-to-device writes straight into one contiguous integer buffer: one copy on the device's
/// stream, no upload into a new tensor and no copy kernel through the fusion queue.
pub(crate) struct HostWrites {
    client: cubecl::client::Client,
    handle: cubecl::server::Handle,
    /// Bytes per element (4: i32, 8: i64).
    width: usize,
    len: usize,
}

impl HostWrites {
    /// Resolve `x` (contiguous, as allocated; i32 or i64) and return it with its writer, or
    /// `None` (with `x`) where its buffer could not be resolved.
    pub(crate) fn new(x: Tensor<1, Int>) -> (Tensor<1, Int>, Option<Self>) {
        use burn::backend::Backend;
        static KEYS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let width = x.dtype().size();
        let len = x.dims()[0];
        if width != 4 && width != 8 {
            return (x, None);
        }
        let key = KEYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let device = x.device();
        let x = Tensor::from_dispatch(<Dispatch as ResolveOps>::resolve_buffer(x.into_dispatch(), key));
        // The extension runs when the queue is flushed: now.
        if Dispatch::sync(device.as_dispatch()).is_err() {
            return (x, None);
        }
        let found = RESOLVED.lock().ok().and_then(|mut r| {
            let at = r.iter().position(|(k, ..)| *k == key)?;
            Some(r.swap_remove(at))
        });
        let writes = found.map(|(_, client, handle)| Self { client, handle, width, len });
        (x, writes)
    }

    /// `buffer[0 .. values.len()] = values`, converted to the buffer's integer width (values
    /// past its length are not written). Enqueued on the calling thread's stream, after the
    /// launches issued so far; the caller flushes whatever queued work reads the old values
    /// first.
    pub(crate) fn write<T: Copy + Into<i64>>(&self, values: &[T]) {
        let n = values.len().min(self.len);
        if n == 0 {
            return;
        }
        let values = &values[..n];
        let bytes = if self.width == 8 {
            cubecl::bytes::Bytes::from_elems(values.iter().map(|&v| v.into()).collect::<Vec<i64>>())
        } else {
            cubecl::bytes::Bytes::from_elems(values.iter().map(|&v| v.into() as i32).collect::<Vec<i32>>())
        };
        self.client.write(&self.handle, bytes);
    }
}

/// [`copy_words_kernel`], transpiled without a device (see [`super::offline`]).
pub(crate) fn offline_copy() -> Result<super::offline::KernelSource, String> {
    use super::offline::{offline_kernel, transpile};
    let kernel =
        offline_kernel!(copy_words_kernel::CopyWordsKernel, CubeDim::new_1d(COPY_THREADS as u32); b b s; );
    transpile("copy_words", kernel)
}
