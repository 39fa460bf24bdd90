//! `dspark.SamplingParams`: the per-request decoding settings of [`dspark::SamplingParams`].

use pyo3::prelude::*;

use crate::errors::Failure;

/// Per-request decoding settings.
///
/// Every argument defaults to the Rust `SamplingParams::default()`: greedy, 64 new tokens,
/// seed 0, no extra stop tokens. The values are checked when the object is made and again
/// when it is used (attributes may be changed in between).
///
/// Raises:
///     InvalidSamplingError: a negative or non-finite temperature, or `top_p` outside (0, 1].
#[pyclass(module = "dspark", name = "SamplingParams", get_all, set_all, eq, from_py_object)]
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Softmax temperature; `0` means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (ties at the boundary kept); `0` disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p`; `1` disables.
    pub top_p: f32,
    /// Seed of the request's coins: the same seed gives the same tokens, whatever else is in
    /// the batch and whether the engine speculates or not.
    pub seed: u64,
    /// Generation ends after any of these tokens (which is emitted).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the checkpoint's end-of-sequence ids (`Engine.eos_token_ids`): only
    /// `stop_token_ids` and `max_new_tokens` end generation (as the Rust engine does).
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::from_rust(dspark::SamplingParams::default())
    }
}

impl SamplingParams {
    fn from_rust(p: dspark::SamplingParams) -> Self {
        Self {
            max_new_tokens: p.max_new_tokens,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            seed: p.seed,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: false,
        }
    }

    /// The Rust parameters; `eos` is added to the stop tokens unless `ignore_eos`.
    pub(crate) fn to_rust(&self, eos: &[u32]) -> dspark::SamplingParams {
        let mut stop = self.stop_token_ids.clone();
        if !self.ignore_eos {
            for &t in eos {
                if !stop.contains(&t) {
                    stop.push(t);
                }
            }
        }
        dspark::SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            stop_token_ids: stop,
            max_new_tokens: self.max_new_tokens,
        }
    }
}

#[pymethods]
impl SamplingParams {
    #[new]
    #[pyo3(signature = (max_new_tokens=None, *, temperature=None, top_k=None, top_p=None, seed=None, stop_token_ids=None, ignore_eos=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_new_tokens: Option<usize>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        seed: Option<u64>,
        stop_token_ids: Option<Vec<u32>>,
        ignore_eos: bool,
    ) -> PyResult<Self> {
        let d = Self::default();
        let p = Self {
            max_new_tokens: max_new_tokens.unwrap_or(d.max_new_tokens),
            temperature: temperature.unwrap_or(d.temperature),
            top_k: top_k.unwrap_or(d.top_k),
            top_p: top_p.unwrap_or(d.top_p),
            seed: seed.unwrap_or(d.seed),
            stop_token_ids: stop_token_ids.unwrap_or(d.stop_token_ids),
            ignore_eos,
        };
        p.validate(py)?;
        Ok(p)
    }

    /// Greedy decoding of at most `max_new_tokens` tokens.
    #[staticmethod]
    fn greedy(max_new_tokens: usize) -> Self {
        Self::from_rust(dspark::SamplingParams::greedy(max_new_tokens))
    }

    /// Whether this request decodes greedily (temperature 0).
    #[getter]
    fn is_greedy(&self) -> bool {
        self.to_rust(&[]).is_greedy()
    }

    /// Check ranges.
    ///
    /// Raises:
    ///     InvalidSamplingError: a negative or non-finite temperature, or `top_p` outside
    ///         (0, 1].
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.to_rust(&[]).validate().map_err(|e| Failure::from(e).into_py(py))
    }

    fn __repr__(&self) -> String {
        format!(
            "SamplingParams(max_new_tokens={}, temperature={}, top_k={}, top_p={}, seed={}, \
             stop_token_ids={:?}, ignore_eos={})",
            self.max_new_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed,
            self.stop_token_ids,
            if self.ignore_eos { "True" } else { "False" }
        )
    }
}
