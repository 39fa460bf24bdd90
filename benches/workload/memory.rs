//! Peak memory of one benchmark child process (each child runs one mode of one workload).
//!
//! - CPU: the process's peak resident set (`VmHWM` of `/proc/self/status`) from the end of
//!   model building (the peak is reset there) to the end: resident weights, KV pools,
//!   activations, host buffers and the allocator's slack; everything the mode needed at once.
//! - CUDA: device memory in use, `total − free` from `cuMemGetInfo` (cudarc, the driver's view:
//!   CubeCL's reserved pools, the CUDA context, everything on the device), sampled every
//!   millisecond by a thread for the whole life of the child; the peak minus the reading taken
//!   right after the context was created (before any weight) is reported. The device must not be
//!   shared with another process during the run. CubeCL's own pool counters (bytes in use and
//!   reserved) are read at the end as a cross-check.

use serde::Serialize;

/// What a child measured.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct MemoryReading {
    /// `cpu-rss` or `cuda-device`.
    pub kind: String,
    /// Peak bytes attributable to the process (see the module documentation).
    pub peak_bytes: u64,
    /// Bytes after the models were built, before the first request.
    pub after_load_bytes: u64,
    /// CubeCL pool counters at the end (CUDA only): `[in use, reserved]`.
    pub pool_in_use_reserved: Option<[u64; 2]>,
    /// Name of the device, when known.
    pub device_name: Option<String>,
}

/// Reads `VmHWM` / `VmRSS` (bytes) of this process.
fn proc_status(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A running measurement.
pub enum Meter {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(cuda::Sampler),
}

impl Meter {
    /// Start measuring for `device` (`cpu`, `cuda`, `cuda:N`). On CUDA this creates the primary
    /// context and takes the baseline reading, so call it before building any model.
    pub fn start(device: &str) -> Result<Self, String> {
        if device == "cpu" {
            return Ok(Meter::Cpu);
        }
        #[cfg(feature = "cuda")]
        {
            let ordinal = device
                .strip_prefix("cuda:")
                .map_or(Ok(0), str::parse)
                .map_err(|_| format!("device {device:?}: expected cpu, cuda or cuda:N"))?;
            cuda::Sampler::start(ordinal).map(Meter::Cuda)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(format!("device {device:?}: this binary was built without the `cuda` feature"))
        }
    }

    /// Mark the end of model building: on CPU the peak is reset (`/proc/self/clear_refs`), so
    /// the transient of converting checkpoint tensors does not hide the run's own peak (the
    /// resident weights stay counted). Returns the bytes in use now.
    pub fn loaded(&mut self) -> u64 {
        if let Meter::Cpu = self
            && std::fs::write("/proc/self/clear_refs", "5").is_err()
        {
            eprintln!("bench-workload: could not reset VmHWM; the CPU peak includes model loading");
        }
        self.current()
    }

    /// Bytes in use now (CPU: resident set; CUDA: device bytes above the baseline).
    pub fn current(&self) -> u64 {
        match self {
            Meter::Cpu => proc_status("VmRSS:").unwrap_or(0),
            #[cfg(feature = "cuda")]
            Meter::Cuda(s) => s.current(),
        }
    }

    /// Stop and report.
    pub fn finish(self, after_load_bytes: u64, device: &burn::tensor::Device) -> MemoryReading {
        let pool = device.memory_pool_usage().map(|u| [u.bytes_in_use, u.bytes_reserved]);
        match self {
            Meter::Cpu => MemoryReading {
                kind: "cpu-rss".into(),
                peak_bytes: proc_status("VmHWM:").unwrap_or(0),
                after_load_bytes,
                pool_in_use_reserved: None,
                device_name: cpu_name(),
            },
            #[cfg(feature = "cuda")]
            Meter::Cuda(s) => {
                let (peak, name) = s.stop();
                MemoryReading {
                    kind: "cuda-device".into(),
                    peak_bytes: peak,
                    after_load_bytes,
                    pool_in_use_reserved: pool,
                    device_name: name,
                }
            }
        }
        .with_pool(pool)
    }
}

impl MemoryReading {
    fn with_pool(mut self, pool: Option<[u64; 2]>) -> Self {
        if self.pool_in_use_reserved.is_none() {
            self.pool_in_use_reserved = pool;
        }
        self
    }
}

fn cpu_name() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let model = text.lines().find(|l| l.starts_with("model name"))?.split(':').nth(1)?.trim().to_string();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some(format!("{model}, {cores} threads"))
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, mpsc};
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// A thread polling `cuMemGetInfo` every millisecond.
    pub struct Sampler {
        stop: Arc<AtomicBool>,
        now: Arc<AtomicU64>,
        baseline: u64,
        thread: JoinHandle<(u64, Option<String>)>,
    }

    impl Sampler {
        pub fn start(ordinal: usize) -> Result<Self, String> {
            let stop = Arc::new(AtomicBool::new(false));
            let now = Arc::new(AtomicU64::new(0));
            let (tx, rx) = mpsc::channel();
            let (stop2, now2) = (stop.clone(), now.clone());
            let thread = std::thread::spawn(move || {
                let ctx = match cudarc::driver::CudaContext::new(ordinal) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(format!("CUDA context on device {ordinal}: {e}")));
                        return (0, None);
                    }
                };
                let used = || ctx.mem_get_info().map(|(free, total)| (total - free) as u64).unwrap_or(0);
                let baseline = used();
                let _ = tx.send(Ok(baseline));
                let mut peak = baseline;
                while !stop2.load(Ordering::Relaxed) {
                    let u = used();
                    peak = peak.max(u);
                    now2.store(u, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                }
                peak = peak.max(used());
                (peak - baseline, ctx.name().ok())
            });
            let baseline = rx.recv().map_err(|e| format!("memory sampler: {e}"))??;
            Ok(Self { stop, now, baseline, thread })
        }

        pub fn current(&self) -> u64 {
            self.now.load(Ordering::Relaxed).saturating_sub(self.baseline)
        }

        pub fn stop(self) -> (u64, Option<String>) {
            self.stop.store(true, Ordering::Relaxed);
            self.thread.join().unwrap_or((0, None))
        }
    }
}
