//! Captured device work: record a forward's launches once as a CUDA graph, replay them as one
//! dispatch.
//!
//! A decode step of Qwen3-8B is a few hundred launches; issued one by one through burn each costs
//! about 25–30 µs of host time, so the host, not the 15 GB of weights, sets the step time. A
//! graph replays all of them for the cost of one launch.
//!
//! # What a captured body may do
//! A graph replays the recorded kernels against the device buffers they used when recorded, so
//! a body that is captured must
//! - read every per-step value (token ids, positions, page tables, lengths) from device buffers
//!   that outlive the graph, refreshed in place with [`write_into`] before each replay;
//! - never upload host data (an upload inside the window would replay the recorded bytes) and
//!   never read back (a host sync inside the window aborts it);
//! - keep its launch shapes fixed: one graph per shape.
//!
//! Allocations the body makes are served, during the recording, from memory the warm-up runs
//! left; the pages the recorded launches touched are then kept for the graph's life, so nothing
//! else is ever placed where a replay writes. A recording that would allocate is refused,
//! and the caller falls back to running the body op by op.
//!
//! On backends without graphs (the CPU) [`DeviceGraph::capture`] answers
//! [`GraphError::Unsupported`] and callers run the body directly.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::{Device, Int, Tensor};

static GRAPHS: AtomicBool = AtomicBool::new(true);
static EMULATE: AtomicBool = AtomicBool::new(false);

/// Turn graph capture on or off for the whole process (on by default). Off, every forward runs
/// op by op: for A/B benchmarks and checks in one process.
pub fn set_graphs_enabled(enabled: bool) {
    GRAPHS.store(enabled, Ordering::Relaxed);
}

/// Whether graph capture is on (see [`set_graphs_enabled`]).
pub fn graphs_enabled() -> bool {
    GRAPHS.load(Ordering::Relaxed)
}

/// Take the recorded path where no graph can be recorded (the CPU): callers that record their
/// forwards then run the body from their device inputs on every call, as a replay would read
/// them. Tests the input plumbing of recorded forwards without a GPU (dspark's engine then also
/// verifies sampled lanes through [`crate::chain_accept`], as on CUDA). Off by default;
/// process-wide.
pub fn set_graph_emulation(enabled: bool) {
    EMULATE.store(enabled, Ordering::Relaxed);
}

/// Whether [`set_graph_emulation`] is on.
pub fn graph_emulation() -> bool {
    EMULATE.load(Ordering::Relaxed)
}

/// Whether forwards on `device` can be captured: a CUDA build, a CUDA device, kernels and graphs
/// on.
pub fn graphs_available(device: &Device) -> bool {
    graphs_enabled() && crate::kernels_available(device)
}

/// Why a capture or a replay did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphError {
    /// The backend records no graphs (the CPU); run the body directly.
    Unsupported,
    /// The backend refused: the recording allocated, a launch inside it failed, or the driver
    /// would not instantiate or launch the graph. The message is the backend's.
    Backend(String),
}

impl std::fmt::Display for GraphError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unsupported => f.write_str("this backend does not record device graphs"),
            Self::Backend(msg) => write!(f, "device graph: {msg}"),
        }
    }
}

impl std::error::Error for GraphError {}

/// Warm-up runs before the recorded one. The first run autotunes and builds fused kernels, which
/// allocate differently from the steady state; from the second on the body takes the path the
/// recording will take, and its allocations are in the pools the recording draws from.
#[cfg(feature = "cuda")]
const WARMUPS: usize = 3;

/// A recorded body, replayed as one dispatch.
pub struct DeviceGraph {
    device: Device,
    #[cfg(feature = "cuda")]
    graph: burn::backend::BackendGraph<burn::backend::Dispatch>,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGraph").field("device", &self.device).finish_non_exhaustive()
    }
}

impl DeviceGraph {
    /// Run `body` `WARMUPS` (3) times, then once under capture; returns the graph and the outputs
    /// of the recorded run. The recorded run does not execute: its outputs hold what the last
    /// warm-up wrote until the graph is [replayed](Self::replay). Each run must compute the
    /// same thing from the same device inputs (a warm-up that writes K/V rows writes the rows
    /// the step writes anyway).
    ///
    /// # Errors
    /// [`GraphError::Unsupported`] off CUDA (before `body` runs); [`GraphError::Backend`] when
    /// the recording is refused (after `body` ran; its writes are the step's own).
    pub fn capture<T, E>(
        device: &Device,
        mut body: impl FnMut() -> Result<T, E>,
    ) -> Result<Result<(Self, T), E>, GraphError> {
        if !graphs_available(device) {
            return Err(GraphError::Unsupported);
        }
        #[cfg(feature = "cuda")]
        {
            // Every buffer of the warm-ups and the recording is an exact-size persistent slice:
            // a graph keeps what its launches touched for its life, and in CubeCL's pools that
            // is whole pages sized to the largest activation served so far (a prefill's, a
            // verify window's logits), one set per graph. Exact slices make a graph cost its own
            // working set; slices the warm-ups free are reused by the recording and by later
            // recordings of the same sizes.
            let OnThisThread(recorded) = device
                .memory_persistent_allocations(OnThisThread(&mut body), |OnThisThread(body)| {
                    OnThisThread(record(device, body))
                });
            // What the warm-ups left that the recording did not keep (slices of sizes no later
            // step asks for, emptied pages) goes back to the driver now rather than staying
            // reserved for the process: a recording happens once per shape.
            device.memory_cleanup();
            recorded
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = &mut body;
            Err(GraphError::Unsupported)
        }
    }

    /// Enqueue the recorded launches after everything queued on the device so far.
    ///
    /// # Safety
    /// Every buffer the recorded body read or wrote must still be alive and not used by another
    /// stream; the device inputs must have been refreshed (with [`write_into`]) on this device's
    /// stream. Callers keep the inputs, the outputs, the weights and the caches the body touched
    /// for as long as the graph lives.
    ///
    /// # Errors
    /// [`GraphError::Backend`] when the driver refuses the launch.
    pub unsafe fn replay(&self) -> Result<(), GraphError> {
        #[cfg(feature = "cuda")]
        {
            use burn::backend::{Backend, Dispatch};
            // SAFETY: forwarded from this function's contract.
            unsafe { Dispatch::graph_replay(self.device.as_dispatch(), &self.graph) }
                .map_err(|e| GraphError::Backend(e.to_string()))
        }
        #[cfg(not(feature = "cuda"))]
        Err(GraphError::Unsupported)
    }
}

/// Carries a value through [`Device::memory_persistent_allocations`], which asks for `Send`
/// but runs its closure on the calling thread (the window is armed on the device's stream).
#[cfg(feature = "cuda")]
struct OnThisThread<T>(T);

// SAFETY: the value never leaves the thread that made it: burn calls the closure of
// `memory_persistent_allocations` inline and hands its output straight back.
#[cfg(feature = "cuda")]
unsafe impl<T> Send for OnThisThread<T> {}

/// [`DeviceGraph::capture`] on CUDA: prepare, warm up, record.
#[cfg(feature = "cuda")]
fn record<T, E>(
    device: &Device,
    body: &mut impl FnMut() -> Result<T, E>,
) -> Result<Result<(DeviceGraph, T), E>, GraphError> {
    use burn::backend::{Backend, Dispatch};
    let dispatch = device.as_dispatch();
    let backend = |e: &dyn std::fmt::Display| GraphError::Backend(e.to_string());
    Dispatch::graph_prepare(dispatch).map_err(|e| backend(&e))?;
    for _ in 0..WARMUPS {
        // Held across the sync: a lazy backend skips work whose result is dropped, and
        // the skipped work's buffers would then first be allocated inside the window.
        let out = match body() {
            Ok(out) => out,
            Err(e) => {
                abandon(dispatch);
                return Ok(Err(e));
            }
        };
        let synced = Dispatch::sync(dispatch);
        drop(out);
        if let Err(e) = synced {
            abandon(dispatch);
            return Err(backend(&e));
        }
    }
    // Spare slices of the smallest size class, free when the window opens.
    let spares = spare_small_slices(device);
    let synced = Dispatch::sync(dispatch);
    drop(spares);
    if let Err(e) = synced.and_then(|()| Dispatch::sync(dispatch)) {
        abandon(dispatch);
        return Err(backend(&e));
    }
    Dispatch::graph_start_capture(dispatch).map_err(|e| {
        abandon(dispatch);
        backend(&e)
    })?;
    let out = body();
    // Closing the window whatever the body answered: a stream left recording would
    // record everything after it.
    let graph = Dispatch::graph_stop_capture(dispatch).map_err(|e| backend(&e));
    let out = match out {
        Ok(out) => out,
        Err(e) => return Ok(Err(e)),
    };
    Ok(Ok((DeviceGraph { device: device.clone(), graph: graph? }, out)))
}

/// Spare slices left free for the recording, of the smallest size class (every buffer of at most
/// 512 bytes: one row's token, position or argmax, a lane's `[first, len]`).
///
/// The recording may allocate only slices the warm-ups freed. How many small ones are free at
/// each point of it depends on when earlier frees land, which need not match the warm-ups: on
/// the H200 one process in two failed to record the one-lane draft round ("No room for 512
/// bytes … a graph capture is recording"). A few dozen spares (16 KiB) cover that drift; those
/// the recording does not use are released by the cleanup after it.
#[cfg(feature = "cuda")]
const SPARE_SMALL_SLICES: usize = 32;

/// Allocate [`SPARE_SMALL_SLICES`] small buffers (inside the persistent window the recording
/// draws from); the caller syncs, then drops them so that they are free when the window opens.
#[cfg(feature = "cuda")]
fn spare_small_slices(device: &Device) -> Vec<Tensor<1, Int>> {
    use burn::tensor::{DType, TensorCreationOptions};
    let i32s = TensorCreationOptions::new(device.clone()).with_dtype(DType::I32);
    (0..SPARE_SMALL_SLICES).map(|_| Tensor::<1, Int>::zeros([128], i32s.clone())).collect()
}

/// Close a prepared capture that never opened, so the stream returns to normal.
#[cfg(feature = "cuda")]
fn abandon(dispatch: &burn::backend::DispatchDevice) {
    use burn::backend::{Backend, Dispatch};
    // A stop with no open window tears down the preparation; its error is the expected "no
    // window", so there is nothing to report.
    let _ = Dispatch::graph_stop_capture(dispatch);
}

/// `dst[0 .. n] = src` for an integer `src` of `n` elements, written into `dst`'s own buffer on
/// CUDA (so a graph that reads `dst` sees the new values) and returned. Elsewhere the result is
/// a new tensor with the same contents, which is what the caller keeps either way.
///
/// # Panics
/// Never; a `src` longer than `dst` or of another dtype is a caller bug reported by
/// `debug_assert`, and on release builds only the first `dst.len()` elements are written.
pub fn write_into(dst: Tensor<1, Int>, src: Tensor<1, Int>) -> Tensor<1, Int> {
    let [n, cap] = [src.dims()[0], dst.dims()[0]];
    debug_assert!(n <= cap && src.dtype() == dst.dtype(), "write_into: {n} into {cap}");
    let n = n.min(cap);
    if n == 0 {
        return dst;
    }
    #[cfg(feature = "cuda")]
    if crate::kernels_available(&dst.device()) && src.dtype() == dst.dtype() {
        return crate::cuda::copy::write_into(dst, src.narrow(0, 0, n));
    }
    dst.slice_assign(0..n, src.narrow(0, 0, n))
}

/// [`write_into`] for float tensors of one dtype (on CUDA their size must be a multiple of four
/// bytes, else the result is a new tensor as elsewhere).
pub fn write_floats_into(dst: Tensor<1>, src: Tensor<1>) -> Tensor<1> {
    let [n, cap] = [src.dims()[0], dst.dims()[0]];
    debug_assert!(n <= cap && src.dtype() == dst.dtype(), "write_floats_into: {n} into {cap}");
    let n = n.min(cap);
    if n == 0 {
        return dst;
    }
    #[cfg(feature = "cuda")]
    if crate::kernels_available(&dst.device())
        && src.dtype() == dst.dtype()
        && (n * src.dtype().size()).is_multiple_of(4)
    {
        return crate::cuda::copy::write_floats_into(dst, src.narrow(0, 0, n));
    }
    dst.slice_assign(0..n, src.narrow(0, 0, n))
}

/// Elements a section of a recorded forward's integer inputs should start at a multiple of, so
/// that [`int_view`] shares the buffer instead of copying (512 bytes, the CUDA runtime's
/// alignment of buffer offsets, for 4-byte elements; 8-byte ones are then aligned too).
pub const INT_VIEW_ALIGN: usize = 128;

/// `x[offset .. offset + len]` of a 1-D integer tensor. On CUDA with [`crate::set_int_views`] on
/// (the default), where `offset` is a multiple of [`INT_VIEW_ALIGN`] elements, the result is a view of `x`'s
/// buffer: no launch, so a recorded forward that takes its inputs as views of one buffer holds
/// no copy kernels (burn's slice copies unless the view's end is aligned as well). Elsewhere it
/// is [`Tensor::narrow`].
///
/// # Panics
/// When the range runs past `x`, as [`Tensor::narrow`] does.
pub fn int_view(x: Tensor<1, Int>, offset: usize, len: usize) -> Tensor<1, Int> {
    let n = x.dims()[0];
    assert!(offset <= n && len <= n - offset, "int_view: {offset}+{len} of {n}");
    #[cfg(feature = "cuda")]
    if crate::kernels_available(&x.device()) && crate::int_views() && len > 0 {
        return crate::cuda::copy::int_view(x, offset, len);
    }
    x.narrow(0, offset, len)
}

/// A copy of `x` in a buffer of its own: a graph's outputs are overwritten by its next replay,
/// so what a forward hands out is copied first. Off CUDA (where nothing is replayed) `x` itself.
pub fn fresh_copy<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cuda")]
    if crate::kernels_available(&x.device())
        && (x.shape().num_elements() * x.dtype().size()).is_multiple_of(4)
    {
        return crate::cuda::copy::fresh_copy(x);
    }
    x
}

/// An integer device buffer that recorded forwards read, refreshed from the host in place
/// before each replay.
///
/// On CUDA a write is one host-to-device copy into the buffer, enqueued on the calling thread's
/// stream at once: no upload into a new tensor and no copy kernel through the fusion queue
/// (those cost 150–300 µs of host time per replay on the H200, with the device idle).
/// Elsewhere it is an upload and [`write_into`].
///
/// Ordering: the copy is ordered after every launch already submitted to the stream, but not
/// after work still queued in burn's fusion queue. Work that reads this buffer must therefore
/// have been submitted (a replay, or a synced warm-up) before the next write; a recorded
/// forward's replay is. A recorded body takes its views of the buffer ([`int_view`])
/// inside the body, so that the graph reads the buffer itself.
pub struct InputBuffer {
    tensor: Tensor<1, Int>,
    #[cfg(feature = "cuda")]
    direct: Option<crate::cuda::copy::HostWrites>,
}

impl std::fmt::Debug for InputBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let direct = {
            #[cfg(feature = "cuda")]
            {
                self.direct.is_some()
            }
            #[cfg(not(feature = "cuda"))]
            false
        };
        f.debug_struct("InputBuffer").field("len", &self.len()).field("direct", &direct).finish()
    }
}

impl InputBuffer {
    /// Wrap `tensor`: a whole contiguous buffer as allocated (i32 or i64 for direct writes).
    pub fn new(tensor: Tensor<1, Int>) -> Self {
        #[cfg(feature = "cuda")]
        if crate::kernels_available(&tensor.device()) {
            let (tensor, direct) = crate::cuda::copy::HostWrites::new(tensor);
            return Self { tensor, direct };
        }
        Self {
            tensor,
            #[cfg(feature = "cuda")]
            direct: None,
        }
    }

    /// The buffer (a handle to the same device memory).
    pub fn tensor(&self) -> Tensor<1, Int> {
        self.tensor.clone()
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.tensor.dims()[0]
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether writes go straight to the device (CUDA) rather than through an upload and a copy.
    pub fn is_direct(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.direct.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// `buffer[0 .. values.len()] = values` (i32 or i64), each converted to the buffer's integer
    /// dtype (values past its length are not written; a caller bug reported by `debug_assert`).
    pub fn write<T: Copy + Into<i64>>(&mut self, values: &[T]) {
        debug_assert!(values.len() <= self.len(), "InputBuffer::write: {} into {}", values.len(), self.len());
        let n = values.len().min(self.len());
        if n == 0 {
            return;
        }
        #[cfg(feature = "cuda")]
        if let Some(direct) = &self.direct {
            direct.write(&values[..n]);
            return;
        }
        let opts =
            burn::tensor::TensorCreationOptions::new(self.tensor.device()).with_dtype(self.tensor.dtype());
        let values: Vec<i64> = values[..n].iter().map(|&v| v.into()).collect();
        let src = Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(values, [n]), opts);
        self.tensor = write_into(self.tensor.clone(), src);
    }
}
