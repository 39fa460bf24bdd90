//! Choosing the device and the compute dtype at run time.

use std::fmt;
use std::str::FromStr;

use burn::tensor::{DType, Device};

use crate::error::{Error, Result};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceKind {
    /// burn's Flex backend on the CPU (feature `cpu`).
    Cpu,
    /// An NVIDIA GPU by index (feature `cuda`).
    Cuda(usize),
}

impl DeviceKind {
    /// The burn device for this kind.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when this build lacks the backend.
    pub fn device(self) -> Result<Device> {
        match self {
            #[cfg(feature = "cpu")]
            DeviceKind::Cpu => Ok(Device::flex()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(index) => Ok(Device::cuda(index)),
            #[allow(unreachable_patterns)]
            other => Err(Error::Unsupported(format!(
                "device {other} is not compiled into this build (enable the `{}` feature)",
                match other {
                    DeviceKind::Cpu => "cpu",
                    DeviceKind::Cuda(_) => "cuda",
                }
            ))),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceKind::Cpu => write!(f, "cpu"),
            DeviceKind::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for DeviceKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" | "gpu" => Ok(DeviceKind::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(DeviceKind::Cuda)
                .ok_or_else(|| Error::Unsupported(format!("device {s:?} (expected cpu, cuda or cuda:N)"))),
        }
    }
}

/// The floating-point type weights and activations are computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ComputeDtype {
    /// 32-bit float: the reference precision.
    #[default]
    F32,
    /// bfloat16: the checkpoints' native type and the GPU default.
    Bf16,
    /// IEEE half.
    F16,
}

impl ComputeDtype {
    /// burn's dtype.
    pub fn dtype(self) -> DType {
        match self {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::BF16,
            ComputeDtype::F16 => DType::F16,
        }
    }

    /// The compute dtype of burn's `dtype`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a dtype models do not compute in.
    pub fn of(dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(ComputeDtype::F32),
            DType::BF16 => Ok(ComputeDtype::Bf16),
            DType::F16 => Ok(ComputeDtype::F16),
            other => Err(Error::Unsupported(format!("compute dtype {other:?}"))),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ComputeDtype::F32 => 4,
            ComputeDtype::Bf16 | ComputeDtype::F16 => 2,
        }
    }
}

impl fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "f16",
        })
    }
}

impl FromStr for ComputeDtype {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" => Ok(ComputeDtype::F32),
            "bf16" | "bfloat16" => Ok(ComputeDtype::Bf16),
            "f16" | "float16" => Ok(ComputeDtype::F16),
            _ => Err(Error::Unsupported(format!("dtype {s:?} (expected f32, bf16 or f16)"))),
        }
    }
}

/// Run `make` with every device allocation it makes taken as persistent memory (exact-size,
/// kept for the process), the way weights, K/V pools and other long-lived buffers are created.
///
/// Why: CubeCL's pools size their pages to the largest allocation they have served. A
/// 1.2 GB LM head in those pools made every page 1.2 GB, and each recorded graph, which keeps
/// the pages it touched for its life, then cost a whole such page. With long-lived buffers
/// outside the pools, the pages stay as small as the activations.
pub(crate) fn persistent<T: Send, I: Send>(device: &Device, input: I, make: impl Fn(I) -> T + Send) -> T {
    device.memory_persistent_allocations(input, make)
}
