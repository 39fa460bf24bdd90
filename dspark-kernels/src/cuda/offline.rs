//! Compiling kernels without a GPU: the CubeCL expansion and the CUDA C++ transpilation the
//! runtime performs at a kernel's first launch, done here against the properties an H200
//! (sm_90) reports. With NVRTC on the loader path, the source then goes on to PTX and to sm_90a
//! machine code, as at a launch; see [`compile_sm90a`].
//!
//! What this catches before any device is involved: an expansion that panics (a comptime
//! mistake, an unsupported type or instruction), a transpilation the C++ backend refuses, and
//! with NVRTC, source that does not compile, plus each kernel's registers, spills and static
//! shared memory. What it cannot: anything about values, which only the GPU suite measures.

use std::sync::Arc;

use cubecl::cuda::{CudaCompilationOptions, CudaCompiler, CudaRepresentation, CudaRuntime};
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{AddressType, DeviceIdentity, DeviceProperties, HardwareProperties, MemoryDeviceProperties};
use cubecl::prelude::*;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_wmma_features,
};
use cubecl_runtime::runtime::Runtime;
use cubecl_server::kernel::CompiledKernel;

/// The compute capability kernels are compiled for: the H200's.
pub const ARCH: u32 = 90;

/// The device properties the CUDA runtime builds for an H200 (compute capability 9.0, 132 SMs,
/// 227 KiB of shared memory per cube), limited to what the expansion of this crate's kernels
/// reads: supported types, plane operations, `mma` shapes and the hardware limits.
pub fn h200_properties() -> DeviceProperties {
    let arch = CudaArchitecture { version: ARCH, tensor_cores: true };
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: 232_448,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_cpu_cores: None,
        last_level_cache_size: None,
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Default::default(),
        MemoryDeviceProperties::new(1 << 34, 512),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: "NVIDIA H200 (offline)".into(),
            fingerprint: format!("ptx_sm{ARCH}"),
            physical: None,
        },
    );
    cubecl_cpp::register_supported_types(&mut props);
    props.features.plane.insert(cubecl::ir::features::Plane::Ops);
    props.features.plane.insert(cubecl::ir::features::Plane::Sync);
    props.features.plane.insert(cubecl::ir::features::Plane::NonUniformControlFlow);
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.device_memory_scope = true;
    props.features.copy_async = true;
    register_wmma_features(
        cubecl_cpp::cuda::mma::CudaCmmaCompiler::Cpp.supported_cmma_combinations(&arch),
        &mut props,
    );
    register_mma_features(cubecl_cpp::cuda::supported_mma_combinations(&arch), &mut props);
    props
}

/// The options the runtime compiles with on an sm_90 device.
fn options() -> CudaCompilationOptions {
    CudaCompilationOptions {
        cpp: CompilationOptions {
            warp_size: 32,
            supports_features: CppSupportedFeatures {
                grid_constants: true,
                clusters: true,
                fast_math: true,
                fast_tanh: true,
                elect_sync: true,
                dp4a: true,
            },
            amd_wmma: None,
        },
        arch: Some(SmArch::new(ARCH, true)),
        ptx_version: None,
    }
}

/// One kernel variant as the runtime would hand it to NVRTC.
#[derive(Debug, Clone)]
pub struct KernelSource {
    /// What the variant is: the kernel and its comptime arguments.
    pub label: String,
    /// The entry point's name in `source`.
    pub entrypoint: String,
    /// The CUDA C++ source.
    pub source: String,
    /// Shared memory the kernel declares, in bytes.
    pub shared_bytes: usize,
    /// Threads per cube.
    pub threads: u32,
}

/// Expands `kernel` and transpiles it to CUDA C++, as the runtime does at its first launch.
///
/// # Errors
/// The expansion's panic message or the compiler's refusal, prefixed with `label`.
pub fn transpile<K: CubeKernel>(label: &str, kernel: K) -> Result<KernelSource, String> {
    let definition = cubecl::define_kernel(&kernel).map_err(|e| format!("{label}: expansion failed: {e}"))?;
    let compiled = CompiledKernel::compile(&kernel, definition, &mut CudaCompiler::default(), &options())
        .map_err(|e| format!("{label}: transpilation failed: {e}"))?;
    let shared_bytes = match &compiled.repr {
        Some(CudaRepresentation::Cpp(repr)) => repr.shared_memory_size,
        _ => 0,
    };
    Ok(KernelSource {
        label: label.to_string(),
        threads: compiled.cube_dim.num_elems(),
        entrypoint: compiled.entrypoint_name,
        source: compiled.source,
        shared_bytes,
    })
}

/// Settings of a `launch_unchecked` kernel with `cube_dim` units per cube.
pub(crate) fn settings(cube_dim: CubeDim) -> KernelSettings {
    KernelSettings::new(cube_dim.into(), ExecutionMode::Unchecked, AddressType::U32)
}

/// `Kernel::new(..)` of a `#[cube(launch_unchecked)]` kernel, for [`transpile`]: the settings of
/// a cube of `$cube_dim`, the H200's properties, then one compilation argument per runtime
/// parameter in declaration order (`b` a buffer, `s` a scalar), then the comptime arguments.
macro_rules! offline_kernel {
    ($kernel:ty, $cube_dim:expr; $($arg:ident)*; $($comptime:expr),* $(,)?) => {
        <$kernel>::new(
            $crate::cuda::offline::settings($cube_dim),
            $crate::cuda::offline::props(),
            $crate::cuda::offline::target(),
            $($crate::cuda::offline::offline_arg!($arg),)*
            $($comptime,)*
        )
    };
}
pub(crate) use offline_kernel;

/// One runtime parameter's compilation argument in [`offline_kernel`]: `b` a buffer, `s` a scalar.
macro_rules! offline_arg {
    (b) => {
        $crate::cuda::offline::buffer()
    };
    (s) => {
        ()
    };
}
pub(crate) use offline_arg;

/// A buffer argument as a launch registers it (not aliased to another).
pub(crate) fn buffer() -> BufferCompilationArg {
    BufferCompilationArg { inplace: None }
}

pub(crate) fn props() -> Arc<DeviceProperties> {
    Arc::new(h200_properties())
}

pub(crate) fn target() -> Arc<TargetProperties> {
    Arc::new(<CudaRuntime as Runtime>::target_properties())
}

/// The shapes one model hands the kernels.
#[derive(Debug, Clone)]
pub struct ModelDims {
    /// Hidden width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate: usize,
    /// Vocabulary (rows of the LM head).
    pub vocab: usize,
    /// For a DSpark draft: the target layers its fc reads, and its Markov rank. A draft's
    /// products also run with FP8 weights.
    pub draft: Option<(usize, usize)>,
}

impl ModelDims {
    /// Qwen3-8B: 32/8 heads of 128, hidden 4096, FFN 12288, vocab 151936.
    pub fn qwen3_8b() -> Self {
        Self {
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 12288,
            vocab: 151_936,
            draft: None,
        }
    }

    /// The DSpark draft of Qwen3-8B: the target's widths, fc over 5 target layers, Markov rank 256.
    pub fn dspark_qwen3_8b() -> Self {
        Self { draft: Some((5, 256)), ..Self::qwen3_8b() }
    }

    /// The bf16 `[out, in]` products of the model: q, k/v, fused q/k/v, o, gate/up (alone and
    /// paired), down, the LM head, and for a draft its fc and Markov W2. Those whose shape the
    /// kernel does not take (they run on burn's own matmul) are left out.
    pub fn products(&self) -> Vec<[usize; 2]> {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let mut all = vec![
            [q, h],
            [kv, h],
            [q + 2 * kv, h],
            [h, q],
            [self.intermediate, h],
            [2 * self.intermediate, h],
            [h, self.intermediate],
            [self.vocab, h],
        ];
        if let Some((features, rank)) = self.draft {
            all.push([h, features * h]);
            all.push([self.vocab, rank]);
        }
        all.retain(|&[out, inp]| super::gemm::supported(1, inp, out));
        all
    }
}

/// One kernel variant: which kernel, and its comptime arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Variant {
    Gemm(super::gemm::GemmVariant),
    Fp8Gemm(super::gemm_fp8::Fp8Variant),
    CombineSplits(usize),
    Norm { d: usize, residual: bool, splits: usize },
    QkNormRope(usize),
    QkvStore { heads: usize, kv_heads: usize, head_dim: usize, idx_words: usize },
    Attention { head_dim: usize, groups: usize },
    Confidence { hd: usize, rank: usize },
    Chain(super::chain::ChainVariant),
}

impl Variant {
    fn transpile(&self) -> Vec<Result<KernelSource, String>> {
        match *self {
            Variant::Gemm(v) => vec![super::gemm::offline_gemm(v)],
            Variant::Fp8Gemm(v) => vec![super::gemm_fp8::offline_fp8_gemm(v)],
            Variant::CombineSplits(splits) => vec![super::gemm::offline_combine_splits(splits)],
            Variant::Norm { d, residual, splits } => vec![super::fused::offline_norm(d, residual, splits)],
            Variant::QkNormRope(head_dim) => vec![super::fused::offline_qk(head_dim)],
            Variant::QkvStore { heads, kv_heads, head_dim, idx_words } => {
                vec![super::fused::offline_qkv_store(heads, kv_heads, head_dim, idx_words)]
            }
            Variant::Attention { head_dim, groups } => super::attention::offline_attention(head_dim, groups),
            Variant::Confidence { hd, rank } => [false, true]
                .into_iter()
                .map(|with_tokens| super::confidence::offline_confidence(hd, rank, with_tokens))
                .collect(),
            Variant::Chain(v) => vec![super::chain::offline_chain(v)],
        }
    }
}

/// The kernel variants `models` launch, each once, in a fixed order. GEMMs come in every
/// row-tile count of one launch (1..=8 tiles, up to 64 rows).
fn variants(models: &[ModelDims]) -> std::collections::BTreeSet<Variant> {
    use crate::gemm_plan::{Weights, plan};
    let mut all = std::collections::BTreeSet::new();
    for m in models {
        let mut norm_splits = std::collections::BTreeSet::from([0usize]);
        for [out, inp] in m.products() {
            let bf16_splits = plan(Weights::Bf16, inp / 32, out).splits;
            for tiles in 1..=8 {
                all.insert(Variant::Gemm(super::gemm::gemm_variant(tiles, inp, out, false, false)));
                // As `linear_swiglu` decides (the shape is one `products` kept).
                if super::gemm::swiglu_plan_fits(inp, out) {
                    all.insert(Variant::Gemm(super::gemm::gemm_variant(tiles, inp, out, true, false)));
                }
                // A draft's Markov W2 with the argmax epilogue (`markov_greedy`, fused).
                if m.draft.is_some_and(|(_, rank)| [out, inp] == [m.vocab, rank])
                    && super::gemm::argmax_step_fits(tiles * 8, inp, out)
                {
                    all.insert(Variant::Gemm(super::gemm::gemm_variant(tiles, inp, out, false, true)));
                }
            }
            if out == m.hidden {
                norm_splits.insert(bf16_splits);
            }
            if m.draft.is_some() && crate::fp8::Fp8Matrix::shape_supported(out, inp) {
                for tiles in 1..=8 {
                    for blocked in [false, true] {
                        all.insert(Variant::Fp8Gemm(super::gemm_fp8::fp8_variant(
                            tiles, inp, out, blocked, false, false,
                        )));
                        if m.draft.is_some_and(|(_, rank)| [out, inp] == [m.vocab, rank])
                            && super::gemm_fp8::argmax_step_fits(tiles * 8, inp, out)
                        {
                            all.insert(Variant::Fp8Gemm(super::gemm_fp8::fp8_variant(
                                tiles, inp, out, blocked, false, true,
                            )));
                        }
                    }
                    // As `linear_fp8_swiglu` decides: a paired gate/up weight with per-row scales.
                    if out == 2 * m.intermediate && super::gemm_fp8::swiglu_plan_fits(inp, out) {
                        all.insert(Variant::Fp8Gemm(super::gemm_fp8::fp8_variant(
                            tiles, inp, out, false, true, false,
                        )));
                    }
                }
                if out == m.hidden {
                    norm_splits.insert(plan(Weights::Fp8, inp / 64, out).splits);
                }
            }
        }
        // A residual norm reads its delta as bf16 rows (0) or as a split product's sums.
        for splits in norm_splits {
            if splits != 1 {
                all.insert(Variant::Norm { d: m.hidden, residual: true, splits });
            }
            if splits > 1 {
                all.insert(Variant::CombineSplits(splits));
            }
        }
        all.insert(Variant::Norm { d: m.hidden, residual: false, splits: 0 });
        all.insert(Variant::QkNormRope(m.head_dim));
        for idx_words in [1, 2] {
            for heads in [m.heads, 0] {
                all.insert(Variant::QkvStore {
                    heads,
                    kv_heads: m.kv_heads,
                    head_dim: m.head_dim,
                    idx_words,
                });
            }
        }
        all.insert(Variant::Attention { head_dim: m.head_dim, groups: m.heads / m.kv_heads });
        // A layer's chained tail, for every row count it takes: bf16, and a draft's FP8 with
        // per-row or per-block scales for o and down; with the prefetch depths the benchmarks
        // take (`--chain-prefetch 1|2|8`; 2 the default).
        let hq = m.heads * m.head_dim;
        let mut weights = vec![None];
        if m.draft.is_some() {
            weights.extend([false, true].into_iter().map(|blocked| Some((blocked, blocked))));
        }
        let depth = crate::chain_prefetch();
        for early in super::chain::PREFETCH_DEPTHS {
            crate::set_chain_prefetch(early);
            for rows in 1..=super::chain::CHAIN_MAX_ROWS {
                for &fp8 in &weights {
                    if let Some(v) = super::chain::variant(rows, m.hidden, hq, m.intermediate, fp8) {
                        all.insert(Variant::Chain(v));
                    }
                }
            }
        }
        crate::set_chain_prefetch(depth);
        // A draft's confidence head, with and without the Markov embedding term.
        if let Some((_, rank)) = m.draft {
            for rank in [rank, 0] {
                all.insert(Variant::Confidence { hd: m.hidden, rank });
            }
        }
    }
    all
}

/// Every kernel variant `models` launch, expanded and transpiled once each, then the kernels
/// without comptime arguments.
pub fn catalog(models: &[ModelDims]) -> Vec<Result<KernelSource, String>> {
    // Expanded for the H200 these are compiled for: with the wait of programmatic launches.
    super::pdl::assume_hopper();
    let mut all: Vec<_> = variants(models).iter().flat_map(Variant::transpile).collect();
    all.extend(super::fused::offline_fixed());
    all.extend(super::accept::offline_fixed());
    all.extend(super::sample::offline_fixed());
    all.push(super::copy::offline_copy());
    if models.iter().any(|m| m.draft.is_some()) {
        all.extend(super::markov::offline_markov());
        all.extend(super::markov_loop::offline_markov_loop());
    }
    all
}

/// What ptxas reports for one kernel compiled to sm_90a machine code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MachineStats {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of local memory written by register spills, per thread.
    pub spill_stores: u32,
    /// Bytes of local memory read back by register spills, per thread.
    pub spill_loads: u32,
    /// Bytes of stack frame per thread.
    pub stack: u32,
    /// Size of the compiled cubin, in bytes.
    pub cubin_bytes: usize,
}

/// Cubes of `threads` threads, `registers` registers each and `shared` bytes of shared memory
/// that fit on one H200 SM at once: 65536 registers (allocated per warp in units of 256, a
/// thread's count rounded up to 8), 2048 threads, 32 cubes, and 228 KiB of shared memory of
/// which each cube's runtime reserves 1 KiB. A streaming kernel with few cubes per SM has few
/// loads in flight.
pub fn cubes_per_sm(threads: u32, registers: u32, shared: usize) -> u32 {
    let warps = threads.div_ceil(32).max(1);
    let per_warp = (registers.max(1).div_ceil(8) * 8 * 32).div_ceil(256) * 256;
    let by_registers = (65_536 / per_warp) / warps;
    let by_threads = 2048 / (warps * 32);
    let by_shared = (233_472 / (shared + 1024)) as u32;
    by_registers.min(by_threads).min(by_shared).min(32)
}

/// Whether NVRTC can be loaded (from the loader path, as the runtime loads it).
pub fn nvrtc_available() -> bool {
    // SAFETY: the call only tries to `dlopen` each candidate library name.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `kernel` with NVRTC to sm_90a machine code, the target and options the runtime
/// uses (plus ptxas' verbose report), with `include` as the CUDA header directory when given;
/// returns ptxas' figures and the cubin (for `nvdisasm`, to read the machine code offline).
///
/// # Errors
/// NVRTC's log when the source does not compile, or a report ptxas did not write.
pub fn compile_sm90a(
    kernel: &KernelSource,
    include: Option<&str>,
) -> Result<(MachineStats, Vec<u8>), String> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::{CStr, CString};
    let label = &kernel.label;
    let source = CString::new(kernel.source.as_str()).map_err(|e| format!("{label}: {e}"))?;
    let mut options =
        vec![format!("--gpu-architecture=sm_{ARCH}a"), "-lineinfo".into(), "--ptxas-options=-v".into()];
    if let Some(dir) = include {
        // As the runtime: the toolkit's headers, and CCCL's beside them when present.
        options.push(format!("--include-path={dir}"));
        let cccl = std::path::Path::new(dir).join("cccl");
        if cccl.exists() {
            options.push(format!("--include-path={}", cccl.display()));
        }
    }
    let program = result::create_program(&source, None).map_err(|e| format!("{label}: {e}"))?;
    let log = |program| -> String {
        // SAFETY: `program` was created above and is destroyed only after the last use.
        match unsafe { result::get_program_log(program) } {
            Ok(raw) => {
                // SAFETY: NVRTC writes a NUL-terminated log of the size it reported.
                unsafe { CStr::from_ptr(raw.as_ptr()) }.to_string_lossy().into_owned()
            }
            Err(e) => format!("(no log: {e})"),
        }
    };
    // SAFETY: `program` is live; the options are owned strings converted by the call.
    let compiled = unsafe { result::compile_program(program, &options) };
    let text = log(program);
    let outcome = match compiled {
        Err(e) => Err(format!("{label}: NVRTC: {e}\n{text}")),
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `program` compiled; NVRTC writes the cubin's size, then fills a buffer of it.
            let cubin = unsafe {
                sys::nvrtcGetCUBINSize(program, &mut size).result().map(|()| {
                    let mut bytes = vec![0u8; size];
                    sys::nvrtcGetCUBIN(program, bytes.as_mut_ptr().cast()).result().map(|()| bytes)
                })
            };
            match cubin {
                Ok(Ok(bytes)) => parse_ptxas(&text, &kernel.entrypoint)
                    .map(|stats| (MachineStats { cubin_bytes: bytes.len(), ..stats }, bytes))
                    .ok_or_else(|| format!("{label}: no ptxas report for {} in\n{text}", kernel.entrypoint)),
                Ok(Err(e)) | Err(e) => Err(format!("{label}: no cubin: {e}")),
            }
        }
    };
    // SAFETY: destroyed once, after the last use above.
    let _ = unsafe { result::destroy_program(program) };
    outcome
}

/// Reads `entry`'s registers, spills and stack from ptxas' verbose report, whose lines are
/// `ptxas info : Compiling entry function 'NAME' for 'sm_90a'`, then `... N bytes stack frame,
/// N bytes spill stores, N bytes spill loads` and `ptxas info : Used N registers, ...`.
pub fn parse_ptxas(log: &str, entry: &str) -> Option<MachineStats> {
    let start = log.find(&format!("'{entry}'"))?;
    let section = &log[start..];
    // The report of this entry ends where the next entry's begins.
    let section = match section[1..].find("Compiling entry function") {
        Some(end) => &section[..end + 1],
        None => section,
    };
    let number_before = |text: &str, unit: &str| -> Option<u32> {
        let at = text.find(unit)?;
        text[..at].split_whitespace().last()?.parse().ok()
    };
    Some(MachineStats {
        registers: number_before(section, " registers")?,
        spill_stores: number_before(section, " bytes spill stores")?,
        spill_loads: number_before(section, " bytes spill loads")?,
        stack: number_before(section, " bytes stack frame")?,
        cubin_bytes: 0,
    })
}
