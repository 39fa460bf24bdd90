//! Hot-path operations for dspark.
//!
//! Every operation here has a body in plain burn ops that runs on any device (the CPU
//! reference); the CUDA kernels that replace them on the GPU are checked against these bodies.
//! Model code calls only the functions of this crate for these steps, so a kernel can be swapped
//! in without touching the models.

pub mod reference;

pub use reference::{AttentionMask, apply_rope, attention, rms_norm, swiglu};
