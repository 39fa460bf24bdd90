//! Python bindings for dspark: the native module `dspark._dspark`, re-exported by the Python
//! package `dspark` (see `python/dspark/__init__.py` and the stubs beside it).
//!
//! A thin layer over the Rust API: every call converts its arguments, releases the GIL, calls
//! the Rust engine behind a lock with panics caught, and converts the result or raises the
//! exception class of the Rust error's variant.

mod engine;
mod errors;
mod params;
mod prompts;
mod results;
mod stream;

use pyo3::prelude::*;

/// Record forwards as CUDA graphs and replay them (the default) or run them op by op; the
/// output is the same either way. Process-wide, from the next forward.
#[pyfunction]
fn set_graphs_enabled(enabled: bool) {
    dspark::set_graphs_enabled(enabled);
}

/// Whether forwards are recorded as CUDA graphs.
#[pyfunction]
fn graphs_enabled() -> bool {
    dspark::graphs_enabled()
}

/// Lossless speculative decoding for Qwen3 models with DSpark block drafts.
#[pymodule]
fn _dspark(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(module)?;
    module.add_class::<engine::Engine>()?;
    module.add_class::<params::SamplingParams>()?;
    module.add_class::<results::Generation>()?;
    module.add_class::<results::GenerationStats>()?;
    module.add_class::<results::RoundRecord>()?;
    module.add_class::<results::BatchStats>()?;
    module.add_class::<results::StreamChunk>()?;
    module.add_class::<stream::TokenStream>()?;
    module.add_function(wrap_pyfunction!(set_graphs_enabled, module)?)?;
    module.add_function(wrap_pyfunction!(graphs_enabled, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
