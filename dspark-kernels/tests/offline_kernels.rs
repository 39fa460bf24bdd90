//! Every CUDA kernel variant that the Qwen3-8B target, its DSpark draft and the tiny models
//! launch, compiled without a GPU: expanded and transpiled to CUDA C++ as the runtime does at a
//! first launch, then compiled by NVRTC to sm_90a machine code (the H200's), with ptxas'
//! register and spill report. CI runs it; no device is involved.
//!
//! NVRTC and the CUDA headers come from PyPI (`scripts/nvrtc.sh` installs them and prints the
//! two variables to set):
//!
//! ```text
//! eval "$(bash scripts/nvrtc.sh target/nvrtc)"
//! CUDARC_CUDA_VERSION=13000 cargo test -p dspark-kernels --features cuda --test offline_kernels
//! ```
//!
//! With `DSPARK_OFFLINE_DUMP=DIR`, each variant's CUDA C++ is also written to `DIR/ENTRY.cu`
//! (its label in a first comment line), for reading what a kernel became, or for comparing the
//! code of two versions of it, and the sm_90a test writes each cubin to `DIR/ENTRY.cubin`
//! (`nvdisasm -c DIR/ENTRY.cubin` shows its machine code).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use dspark_kernels::offline::{self, KernelSource, ModelDims};

/// The models whose launches are compiled: Qwen3-8B and its draft (the flagship), and the
/// golden and trained tiny pairs (the widths the CPU-side tests and the GPU golden suite use).
fn models() -> Vec<ModelDims> {
    let tiny = ModelDims {
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        vocab: 512,
        draft: None,
    };
    let code = ModelDims {
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 768,
        vocab: 4096,
        draft: None,
    };
    vec![
        ModelDims::qwen3_8b(),
        ModelDims::dspark_qwen3_8b(),
        ModelDims { draft: Some((2, 8)), ..tiny.clone() },
        tiny,
        ModelDims { draft: Some((3, 32)), ..code.clone() },
        code,
    ]
}

fn sources() -> Vec<KernelSource> {
    let (ok, failed): (Vec<_>, Vec<_>) = offline::catalog(&models()).into_iter().partition(Result::is_ok);
    let failed: Vec<String> = failed.into_iter().map(Result::unwrap_err).collect();
    assert!(failed.is_empty(), "{} variants failed to transpile:\n{}", failed.len(), failed.join("\n"));
    ok.into_iter().map(Result::unwrap).collect()
}

/// Every kernel of the crate is in the catalog, each variant expands and transpiles, and no
/// cube asks for more shared memory than an H200 grants one.
#[test]
fn every_kernel_variant_transpiles() {
    let all = sources();
    for kernel in [
        "skinny_gemm_kernel",
        "combine_splits_kernel",
        "fp8_gemm_kernel",
        "rms_norm_kernel",
        "qk_norm_rope_kernel",
        "qkv_store_kernel",
        "swiglu_kernel",
        "argmax_partial_kernel",
        "argmax_sum_partial_kernel",
        "argmax_merge_kernel",
        "paged_attention_mma_kernel",
        "paged_attention_split_kernel",
        "combine_kernel",
        "row_stats_kernel",
        "accept_tests_kernel",
        "draw_partial_kernel",
        "draw_walk_kernel",
        "draw_merge_kernel",
        "copy_words_kernel",
        "confidence_kernel",
    ] {
        assert!(
            all.iter().any(|k| k.entrypoint.starts_with(kernel)),
            "no variant of {kernel} in the catalog"
        );
    }
    if let Ok(dir) = std::env::var("DSPARK_OFFLINE_DUMP") {
        std::fs::create_dir_all(&dir).unwrap();
        for k in &all {
            let text = format!("// {}\n{}", k.label, k.source);
            std::fs::write(std::path::Path::new(&dir).join(format!("{}.cu", k.entrypoint)), text).unwrap();
        }
    }
    let max_shared = offline::h200_properties().hardware.max_shared_memory_size;
    for k in &all {
        assert!(k.source.contains(&k.entrypoint), "{}: entry point missing from its source", k.label);
        assert!(k.shared_bytes <= max_shared, "{}: {} bytes of shared memory", k.label, k.shared_bytes);
    }
    println!("{} distinct kernel variants transpiled", all.len());
}

/// Register spills the kernels are allowed, in bytes stored plus loaded per thread, by the start
/// of a variant's label: exactly what they spill today, so a new spill, or a larger one, fails.
/// Both are off the decode step's hot path (once per round, on one row per lane), and both spill
/// only a few words:
/// - the acceptance's row statistics: 1024-thread cubes cap a thread at 64 registers;
/// - the sampler's merge: a few words of its candidate merge.
const SPILL_BUDGET: [(&str, u32); 2] = [("accept row_stats", 32), ("sample draw_merge", 16)];

/// Cubes an SM must hold at once, by the start of a variant's label, where the launch shapes
/// depend on it: the tensor-core attention's splits at Qwen3-8B's head width (a 17-row verify
/// window is 2 cubes per K/V head and split: 272 busy cubes at 512 keys, one wave on 132 SMs at
/// three cubes an SM, two at two).
const OCCUPANCY_FLOOR: [(&str, u32); 1] = [("paged_attention_mma: head_dim=128", 3)];

/// Every variant compiles with NVRTC to sm_90a machine code, none spills registers to local
/// memory beyond [`SPILL_BUDGET`] (a spill in a streaming kernel costs bandwidth the decode step
/// cannot spare), and none falls below its [`OCCUPANCY_FLOOR`].
#[test]
fn every_kernel_variant_compiles_for_sm90a_without_spills() {
    assert!(
        offline::nvrtc_available(),
        "NVRTC is not on the loader path: run `eval \"$(bash scripts/nvrtc.sh target/nvrtc)\"` first"
    );
    let include = std::env::var("DSPARK_CUDA_INCLUDE")
        .expect("DSPARK_CUDA_INCLUDE names the CUDA headers' directory (scripts/nvrtc.sh prints it)");
    let all = sources();
    // NVRTC compiles distinct programs concurrently: one worker per core.
    let workers = std::thread::available_parallelism().map_or(2, usize::from);
    let chunk = all.len().div_ceil(workers);
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = all
            .chunks(chunk)
            .map(|part| {
                let include = include.as_str();
                scope.spawn(move || {
                    part.iter().map(|k| offline::compile_sm90a(k, Some(include))).collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut failures = Vec::new();
    let mut spills = Vec::new();
    println!("{:>4} {:>6} {:>7} {:>7} {:>6}  variant", "regs", "spill", "shared", "cubin", "per SM");
    // With DSPARK_OFFLINE_DUMP set, each variant's cubin is written there too (read it with
    // `nvdisasm -c -g`).
    let dump = std::env::var("DSPARK_OFFLINE_DUMP").ok();
    for (k, result) in all.iter().zip(results) {
        match result {
            Ok((stats, cubin)) => {
                if let Some(dir) = &dump {
                    std::fs::create_dir_all(dir).unwrap();
                    let name = format!("{}.cubin", k.entrypoint);
                    std::fs::write(std::path::Path::new(dir).join(name), cubin).unwrap();
                }
                let spilled = stats.spill_stores + stats.spill_loads;
                let per_sm = offline::cubes_per_sm(k.threads, stats.registers, k.shared_bytes);
                println!(
                    "{:>4} {:>6} {:>7} {:>7} {:>6}  {}",
                    stats.registers, spilled, k.shared_bytes, stats.cubin_bytes, per_sm, k.label
                );
                let budget = SPILL_BUDGET
                    .iter()
                    .find(|(label, _)| k.label.starts_with(label))
                    .map_or(0, |&(_, bytes)| bytes);
                if spilled > budget {
                    spills.push(format!("{} ({} bytes allowed): {stats:?}", k.label, budget));
                }
                let floor = OCCUPANCY_FLOOR
                    .iter()
                    .find(|(label, _)| k.label.starts_with(label))
                    .map_or(0, |&(_, cubes)| cubes);
                if per_sm < floor {
                    spills.push(format!("{}: {per_sm} cubes an SM, {floor} required: {stats:?}", k.label));
                }
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{} variants failed to compile:\n{}", failures.len(), failures.join("\n\n"));
    assert!(
        spills.is_empty(),
        "{} variants spill registers or lost occupancy:\n{}",
        spills.len(),
        spills.join("\n")
    );
    println!("{} variants compiled for sm_90a", all.len());
}

/// The ptxas report parser reads the numbers of the entry it is asked about, not its neighbour's.
#[test]
fn ptxas_report_is_read_per_entry() {
    let log = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'a_1' for 'sm_90a'\n\
        ptxas info    : Function properties for a_1\n    \
        8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
        ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem\n\
        ptxas info    : Compiling entry function 'b_2' for 'sm_90a'\n\
        ptxas info    : Function properties for b_2\n    \
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
        ptxas info    : Used 128 registers, used 1 barriers\n";
    let a = offline::parse_ptxas(log, "a_1").unwrap();
    assert_eq!((a.registers, a.spill_stores, a.spill_loads, a.stack), (40, 4, 12, 8));
    let b = offline::parse_ptxas(log, "b_2").unwrap();
    assert_eq!((b.registers, b.spill_stores, b.spill_loads, b.stack), (128, 0, 0, 0));
    assert!(offline::parse_ptxas(log, "c_3").is_none());
}

/// A source NVRTC refuses comes back as an error carrying the compiler's log, not as a pass.
#[test]
fn nvrtc_refusal_is_an_error_with_its_log() {
    assert!(offline::nvrtc_available(), "NVRTC is not on the loader path (see the file's header)");
    let broken = KernelSource {
        label: "broken".into(),
        entrypoint: "broken_kernel".into(),
        source: "extern \"C\" __global__ void broken_kernel(float* y) { y[0] = no_such_value; }".into(),
        shared_bytes: 0,
        threads: 32,
    };
    let err = offline::compile_sm90a(&broken, None).unwrap_err();
    assert!(err.contains("no_such_value"), "{err}");
}

/// Occupancy: each limit binds where it should (registers, threads, shared memory, the cube cap).
#[test]
fn cubes_per_sm_takes_the_tightest_limit() {
    // 256 threads at 33 registers: 40 per thread after rounding, 6 cubes by registers.
    assert_eq!(offline::cubes_per_sm(256, 33, 4096), 6);
    // At 32 registers the threads bind: 8 cubes of 256.
    assert_eq!(offline::cubes_per_sm(256, 32, 0), 8);
    // 173 registers: 176 per thread, 5632 per warp, 11 warps: one cube of eight.
    assert_eq!(offline::cubes_per_sm(256, 173, 32768), 1);
    // Shared memory: 36992 + 1024 bytes a cube, six fit in 228 KiB.
    assert_eq!(offline::cubes_per_sm(256, 32, 36992), 6);
    // Small cubes stop at 32.
    assert_eq!(offline::cubes_per_sm(32, 16, 0), 32);
}
