//! CubeCL kernels for CUDA, launched on burn's CUDA tensors through a backend extension.
//!
//! Each one has a plain-burn body in [`crate::reference`]; the `*_matches_reference` tests in
//! `tests/gpu_kernels.rs` (GPU machine only) compare them on fresh random inputs.

pub(crate) mod accept;
pub(crate) mod attention;
pub(crate) mod chain;
pub(crate) mod confidence;
pub(crate) mod copy;
pub(crate) mod floor;
pub(crate) mod fused;
pub(crate) mod gemm;
pub(crate) mod gemm_fp8;
pub(crate) mod markov;
pub(crate) mod markov_loop;
pub mod offline;
pub(crate) mod pdl;
pub(crate) mod sample;
