//! A profiling window for one phase of a benchmark: the device work between [`start`] and
//! [`stop`] is what a profiler started with collection off records (Nsight Compute's
//! `--profile-from-start off`: `cuProfilerStart` / `cuProfilerStop` on the device's primary
//! context, which CubeCL's CUDA runtime also uses). Without CUDA, or without a profiler
//! attached, both are no-ops.

/// Open the window (after the device is synchronised, so earlier work stays outside it).
pub fn start() -> Result<(), String> {
    toggle(true)
}

/// Close the window (after the device is synchronised, so the phase's work is inside it).
pub fn stop() -> Result<(), String> {
    toggle(false)
}

#[cfg(feature = "cuda")]
fn toggle(on: bool) -> Result<(), String> {
    let ctx = cudarc::driver::CudaContext::new(0).map_err(|e| format!("CUDA context: {e}"))?;
    ctx.bind_to_thread().map_err(|e| format!("CUDA context: {e}"))?;
    let r = if on { cudarc::driver::profiler_start() } else { cudarc::driver::profiler_stop() };
    r.map_err(|e| format!("profiler {}: {e}", if on { "start" } else { "stop" }))
}

#[cfg(not(feature = "cuda"))]
fn toggle(_on: bool) -> Result<(), String> {
    Ok(())
}
