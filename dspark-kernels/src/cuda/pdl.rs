//! Programmatic dependent launch inside recorded graphs: a kernel's cubes become resident while
//! the kernel before it still runs, and wait for it on the device instead of being launched
//! after it.
//!
//! # Why
//! A replayed graph runs its launches back to back, yet every boundary costs the last cube's
//! exit, the memory flush, the next grid's launch and its cubes' start: about 1.5 µs of an empty
//! kernel on an H100 (`copy_words`, `benches/results/2026-12-06-h100-where.md`), paid some 330
//! times in a Qwen3-8B step and 53 times in a γ = 7 proposal. On Hopper a graph edge may be
//! *programmatic*: the dependent grid is launched as soon as every cube of the one before has
//! started, and its threads wait at `griddepcontrol.wait` until that grid has finished and its
//! writes are visible.
//!
//! # How
//! CubeCL launches through `cuLaunchKernel` without launch attributes, so the edge cannot be
//! asked for at the launch. It is set on the capture instead: just before one of this crate's
//! kernels is launched into a recording, [`before_launch`] replaces the capturing stream's
//! dependency set (the nodes the next captured node will depend on) by the same nodes with
//! programmatic edges from their launch-completion port (or, for an A/B, their programmatic
//! port, which each cube triggers right after its wait) (`cuStreamUpdateCaptureDependencies_v2`),
//! when every one of them is a kernel node. Every
//! kernel of this crate starts with [`dependency_wait`], so none of its threads reads or writes
//! memory before the grids it depends on have completed: a programmatic edge changes when its
//! cubes are placed, never what they compute. Launches from outside this crate (burn's fused
//! element-wise kernels) keep plain edges; as the kernel *before* a programmatic edge any kernel
//! will do, since the waiting is the dependent's.
//!
//! Whether kernels carry the wait is fixed at the process's first launch of one of them: with
//! the switch on and a Hopper device (compute capability 9 or later) they do, otherwise they are
//! built exactly as without this module, and the switch can no longer be turned on. Outside a
//! recording the instruction is a no-op (a grid launched without a programmatic dependency).
//!
//! # What it is worth
//! On the H100 the edges alone move a Qwen3-8B step by 1–2 % at most
//! (`benches/results/2026-12-07-h100-pdl-loop3.md`), so they stay off by default. Four ways of
//! using the head start were measured and removed (`2026-12-07-h100-early-pipelined.md`): the
//! products asking the L2 for their weight rows before the wait (the rows of a product placed
//! early were evicted by the running product's stream: step 7.6 ms against 6.0–6.1), loading
//! their first step's weights into registers before it (6.5–6.6 ms, the FP8 proposal 1.08
//! against 0.90 ms: early cubes hold SM room and DRAM requests the running kernel needs), and
//! pipelining every product's weight loads one step ahead (6.43 against 6.07 ms); and products
//! that trigger their dependents only after their main loop, with early weights (6.12–6.19
//! against 6.04–6.06 ms, the proposal 1.09 against 0.94–0.95).
//!
//! # Reaching the stream
//! The capturing `CUstream` belongs to CubeCL's CUDA server. [`before_launch`] runs a task on the
//! device's runner (in order with the launches queued before it), reaches the server through its
//! public runtime type and the stream through the server's write scope, and calls the driver
//! there. If the driver refuses the update, the switch turns itself off for the process (logged
//! once) and the recording goes on with plain edges.

use std::any::TypeId;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use cubecl::prelude::*;
use cudarc::driver::sys;

/// Programmatic edges asked for in recordings (see [`crate::set_programmatic_launch`]).
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Edges leave the kernel before them from its programmatic port (each of its cubes triggers
/// right after its own wait) instead of its launch-completion port (every cube started).
static TRIGGER_PORT: AtomicBool = AtomicBool::new(false);

/// Take edges from the programmatic port (`true`) or the launch-completion port (`false`, the
/// default), for recordings from then on.
pub(crate) fn set_trigger_port(on: bool) {
    TRIGGER_PORT.store(on, Ordering::Relaxed);
}
/// Programmatic edges recorded so far (one per dependency of a kernel made programmatic).
static EDGES: AtomicUsize = AtomicUsize::new(0);
/// Whether this process's kernels carry the wait: 0 not known yet, 1 no (a device before
/// Hopper), 2 yes.
static WAITS: AtomicU8 = AtomicU8::new(0);

/// Turn programmatic edges in recordings on or off (graphs recorded from then on). Turning them
/// on is refused (`false`) once kernels were built without the wait (see [`before_launch`]).
pub(crate) fn set_enabled(on: bool) -> bool {
    if on && WAITS.load(Ordering::Relaxed) == 1 {
        return false;
    }
    ENABLED.store(on, Ordering::Relaxed);
    true
}

/// Whether programmatic edges are asked for in recordings.
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Programmatic edges recorded in this process so far.
pub(crate) fn edges() -> usize {
    EDGES.load(Ordering::Relaxed)
}

/// Whether the kernels start with `griddepcontrol.wait`: fixed by the first launch
/// ([`before_launch`]) or by [`assume_hopper`]. Read at kernel expansion, which for every kernel
/// follows its first launch call; it never changes afterwards, so a compiled kernel's body does
/// not depend on when it was compiled.
pub(crate) fn kernels_wait() -> bool {
    WAITS.load(Ordering::Relaxed) == 2
}

/// Expand kernels for a Hopper device without one (the offline sm_90a compile checks).
pub(crate) fn assume_hopper() {
    let _ = WAITS.compare_exchange(0, 2, Ordering::Relaxed, Ordering::Relaxed);
}

/// The first statement of every kernel of this crate: wait until the grids this one depends on
/// have completed and their writes are visible, then let the grids that depend on this one be
/// launched (for edges from the programmatic port; those from the launch-completion port need no
/// trigger). Both are no-ops without programmatic edges; left out unless [`kernels_wait`].
#[cube]
pub(crate) fn dependency_wait() {
    if comptime![kernels_wait()] {
        gpu_asm!("griddepcontrol.wait;");
        gpu_asm!("griddepcontrol.launch_dependents;");
    }
}

/// The CUDA server behind CubeCL's CUDA runtime.
type Server = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// Called by every launch site of this crate just before its kernel is launched on `client`:
/// on the first call fixes whether kernels carry the wait (the switch on and a Hopper device),
/// and while a recording is open (and [`enabled`]) makes the next captured node depend
/// programmatically on the current ones.
pub(crate) fn before_launch(client: &cubecl::client::Client) {
    let service = client.service_id();
    if service.service != TypeId::of::<Server>() {
        return;
    }
    if WAITS.load(Ordering::Relaxed) == 0 {
        let waits = enabled() && compute_major(u32::from(service.device.index_id)).is_some_and(|m| m >= 9);
        let _ = WAITS.compare_exchange(0, if waits { 2 } else { 1 }, Ordering::Relaxed, Ordering::Relaxed);
    }
    if !enabled() || !kernels_wait() || !client.is_capturing() {
        return;
    }
    let handle = cubecl::device_handle::DeviceHandle::<Server>::new(service.device);
    let outcome = handle.submit_blocking(|server| {
        use cubecl_server::stream::WriteScoped;
        let stream = cubecl_environment::stream::StreamId::current();
        match server.write_streams().try_stream_mut(&stream) {
            // SAFETY: `sys` is the live stream of the server this task runs on; the driver
            // calls below only read and set its capture state.
            Some(s) => unsafe { mark_programmatic(s.sys) },
            None => Ok(()),
        }
    });
    let refused = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(e) => format!("{e:?}"),
    };
    if ENABLED.swap(false, Ordering::Relaxed) {
        tracing::warn!("programmatic launches off for this process: {refused}");
    }
}

/// The device's compute capability major, from the driver (initialised by CubeCL's runtime).
fn compute_major(ordinal: u32) -> Option<i32> {
    let mut device: sys::CUdevice = 0;
    let mut major = 0i32;
    // SAFETY: plain queries of an ordinal; out-pointers are valid locals.
    unsafe {
        sys::cuDeviceGet(&mut device, ordinal as i32).result().ok()?;
        sys::cuDeviceGetAttribute(
            &mut major,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            device,
        )
        .result()
        .ok()?;
    }
    Some(major)
}

/// If `stream` is recording and every node the next one will depend on is a kernel node, make
/// those dependencies programmatic (launch-completion port).
///
/// # Safety
/// `stream` must be a valid stream.
unsafe fn mark_programmatic(stream: sys::CUstream) -> Result<(), String> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut count = 0usize;
    // SAFETY: out-pointers are valid locals; `stream` is valid (caller).
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut deps,
            &mut edges,
            &mut count,
        )
    }
    .result()
    .map_err(|e| format!("cuStreamGetCaptureInfo: {e}"))?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || count == 0 || deps.is_null() {
        return Ok(());
    }
    // SAFETY: the driver returned `count` nodes at `deps`, valid until the next call on the
    // stream; copied before any.
    let mut nodes: Vec<sys::CUgraphNode> = unsafe { std::slice::from_raw_parts(deps, count) }.to_vec();
    for &node in &nodes {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a node of the graph being captured.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
            .result()
            .map_err(|e| format!("cuGraphNodeGetType: {e}"))?;
        if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            return Ok(());
        }
    }
    let port = if TRIGGER_PORT.load(Ordering::Relaxed) {
        sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    } else {
        sys::CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER
    };
    let edge = sys::CUgraphEdgeData {
        from_port: port as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    let data = vec![edge; count];
    // SAFETY: `nodes` and `data` hold `count` entries each; the flag replaces the set.
    unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(
            stream,
            nodes.as_mut_ptr(),
            data.as_ptr(),
            count,
            sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES as u32,
        )
    }
    .result()
    .map_err(|e| format!("cuStreamUpdateCaptureDependencies: {e}"))?;
    EDGES.fetch_add(count, Ordering::Relaxed);
    Ok(())
}
