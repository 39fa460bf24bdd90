//! One Python exception class per kind of [`dspark::Error`], all under `dspark.DsparkError`.
//!
//! Classes whose meaning matches a built-in exception also derive from it (`IoError` is an
//! `OSError`, bad arguments are `ValueError`s), so callers can catch either. The classes are
//! created once, when the module is initialised; the structured fields of a Rust error become
//! attributes of the exception (`path`, `tensor`, `token`, `vocab`, ...).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard};

use dspark::Error;
use pyo3::exceptions::{PyException, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// Exception classes, in the order they are created (a base before its subclasses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Base,
    Io,
    Checkpoint,
    Json,
    Config,
    Safetensors,
    MissingTensor,
    TensorShape,
    TensorDtype,
    TokenOutOfRange,
    InvalidInput,
    InvalidSampling,
    KvCacheFull,
    UnknownSequence,
    Unsupported,
    Text,
    Backend,
    Internal,
}

/// What Python sees of each class: name, bases (our base first), docstring.
const CLASSES: [(Kind, &str, &[Base], &str); 18] = [
    (Kind::Base, "DsparkError", &[Base::Exception], "Base class of every error raised by dspark."),
    (Kind::Io, "IoError", &[Base::Dspark, Base::OSError], "A file could not be read (`path`)."),
    (
        Kind::Checkpoint,
        "CheckpointError",
        &[Base::Dspark],
        "A checkpoint folder is malformed: base class of the config, JSON and weight errors.",
    ),
    (
        Kind::Json,
        "JsonError",
        &[Base::Checkpoint],
        "A JSON file is malformed or misses required keys (`path`).",
    ),
    (
        Kind::Config,
        "ConfigError",
        &[Base::Checkpoint],
        "A configuration value is out of range or inconsistent (`path`).",
    ),
    (
        Kind::Safetensors,
        "SafetensorsError",
        &[Base::Checkpoint],
        "A safetensors file is truncated, corrupt or unreadable (`path`).",
    ),
    (
        Kind::MissingTensor,
        "MissingTensorError",
        &[Base::Checkpoint],
        "A tensor the model needs is absent from the checkpoint (`dir`, `tensor`).",
    ),
    (
        Kind::TensorShape,
        "TensorShapeError",
        &[Base::Checkpoint],
        "A tensor has a shape other than the config implies (`path`, `tensor`, `expected`, `actual`).",
    ),
    (
        Kind::TensorDtype,
        "TensorDtypeError",
        &[Base::Checkpoint],
        "A tensor has a dtype dspark cannot load (`path`, `tensor`, `dtype`).",
    ),
    (
        Kind::TokenOutOfRange,
        "TokenOutOfRangeError",
        &[Base::Dspark, Base::ValueError],
        "A token id is not in the vocabulary (`token`, `vocab`).",
    ),
    (
        Kind::InvalidInput,
        "InvalidInputError",
        &[Base::Dspark, Base::ValueError],
        "An input is empty or malformed, or an option does not fit the engine.",
    ),
    (
        Kind::InvalidSampling,
        "InvalidSamplingError",
        &[Base::Dspark, Base::ValueError],
        "Sampling parameters are out of range.",
    ),
    (
        Kind::KvCacheFull,
        "KvCacheFullError",
        &[Base::Dspark],
        "The KV cache budget cannot hold the requested rows (`needed_pages`, `free_pages`, \
         `total_pages`, `page_bytes`, `budget_bytes`).",
    ),
    (
        Kind::UnknownSequence,
        "UnknownSequenceError",
        &[Base::Dspark],
        "A sequence id is unknown to the cache (never allocated, or freed).",
    ),
    (
        Kind::Unsupported,
        "UnsupportedError",
        &[Base::Dspark, Base::ValueError],
        "A device or dtype name is not recognised, or this build lacks its backend.",
    ),
    (Kind::Text, "TextError", &[Base::Dspark], "Tokenizer or chat template failure."),
    (
        Kind::Backend,
        "BackendError",
        &[Base::Dspark, Base::RuntimeError],
        "The backend failed while executing or reading back a tensor.",
    ),
    (
        Kind::Internal,
        "InternalError",
        &[Base::Dspark, Base::RuntimeError],
        "A bug in dspark: a Rust panic caught at the Python boundary, or an engine left unusable \
         by one.",
    ),
];

#[derive(Debug, Clone, Copy)]
enum Base {
    Exception,
    OSError,
    ValueError,
    RuntimeError,
    Dspark,
    Checkpoint,
}

static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// Create the classes (once) and add them to `module`.
pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    let types = TYPES.get_or_try_init(py, || {
        let mut types: Vec<Py<PyType>> = Vec::with_capacity(CLASSES.len());
        for (index, (kind, name, bases, doc)) in CLASSES.into_iter().enumerate() {
            if kind as usize != index {
                return Err(PyRuntimeError::new_err(format!("exception table out of order at {name}")));
            }
            let bases: Vec<Bound<'_, PyType>> = bases
                .iter()
                .map(|b| match b {
                    Base::Exception => py.get_type::<PyException>(),
                    Base::OSError => py.get_type::<PyOSError>(),
                    Base::ValueError => py.get_type::<PyValueError>(),
                    Base::RuntimeError => py.get_type::<PyRuntimeError>(),
                    Base::Dspark => types[Kind::Base as usize].bind(py).clone(),
                    Base::Checkpoint => types[Kind::Checkpoint as usize].bind(py).clone(),
                })
                .collect();
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "dspark")?;
            namespace.set_item("__doc__", doc)?;
            let class = py
                .get_type::<PyType>()
                .call1((name, PyTuple::new(py, bases)?, namespace))?
                .cast_into::<PyType>()?;
            types.push(class.unbind());
        }
        Ok::<_, PyErr>(types)
    })?;
    for ((_, name, _, _), class) in CLASSES.iter().zip(types) {
        module.add(*name, class.bind(py))?;
    }
    Ok(())
}

/// A Python exception of `kind` with `message`; attributes from `attrs`.
pub(crate) fn new_err(
    py: Python<'_>,
    kind: Kind,
    message: impl Into<String>,
    attrs: &[(&str, Py<PyAny>)],
) -> PyErr {
    let Some(types) = TYPES.get(py) else {
        return PyRuntimeError::new_err(message.into());
    };
    let err = PyErr::from_type(types[kind as usize].bind(py).clone(), message.into());
    let value = err.value(py);
    for (name, v) in attrs {
        // Attributes are extra detail; failing to set one must not hide the error itself.
        let _ = value.setattr(*name, v);
    }
    err
}

/// Why a call failed, before it is turned into a Python exception (which needs the GIL).
#[derive(Debug)]
pub(crate) enum Failure {
    /// The Rust API reported an error.
    Dspark(Error),
    /// A panic was caught at the boundary.
    Panic(String),
    /// The engine's lock was poisoned by an earlier panic.
    Poisoned,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Dspark(e)
    }
}

impl From<dspark::text::TextError> for Failure {
    fn from(e: dspark::text::TextError) -> Self {
        Failure::Dspark(Error::Text(e))
    }
}

/// Run `body` with panics caught.
pub(crate) fn guarded<T>(body: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Failure::Panic(what))
    })
}

/// Lock a mutex, reporting a poisoned one instead of panicking.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> Result<MutexGuard<'_, T>, Failure> {
    mutex.lock().map_err(|_| Failure::Poisoned)
}

impl Failure {
    /// The Python exception for this failure.
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            Failure::Dspark(e) => to_py(py, e),
            Failure::Panic(what) => new_err(py, Kind::Internal, format!("internal panic: {what}"), &[]),
            Failure::Poisoned => new_err(
                py,
                Kind::Internal,
                "the engine is unusable after an internal panic in an earlier call; create a new Engine",
                &[],
            ),
        }
    }
}

fn obj<'py, T: pyo3::IntoPyObjectExt<'py>>(py: Python<'py>, v: T) -> Py<PyAny> {
    v.into_py_any(py).unwrap_or_else(|_| py.None())
}

/// The Python exception for a Rust error: its class by variant, its message, its fields.
pub(crate) fn to_py(py: Python<'_>, error: Error) -> PyErr {
    let message = error.to_string();
    let (kind, attrs): (Kind, Vec<(&str, Py<PyAny>)>) = match error {
        Error::Io { path, .. } => (Kind::Io, vec![("path", obj(py, path.display().to_string()))]),
        Error::Json { path, .. } => (Kind::Json, vec![("path", obj(py, path.display().to_string()))]),
        Error::Config { path, .. } => (Kind::Config, vec![("path", obj(py, path.display().to_string()))]),
        Error::Safetensors { path, .. } => {
            (Kind::Safetensors, vec![("path", obj(py, path.display().to_string()))])
        }
        Error::MissingTensor { dir, tensor } => (
            Kind::MissingTensor,
            vec![("dir", obj(py, dir.display().to_string())), ("tensor", obj(py, tensor))],
        ),
        Error::TensorShape { path, tensor, expected, actual } => (
            Kind::TensorShape,
            vec![
                ("path", obj(py, path.display().to_string())),
                ("tensor", obj(py, tensor)),
                ("expected", obj(py, expected)),
                ("actual", obj(py, actual)),
            ],
        ),
        Error::TensorDtype { path, tensor, dtype } => (
            Kind::TensorDtype,
            vec![
                ("path", obj(py, path.display().to_string())),
                ("tensor", obj(py, tensor)),
                ("dtype", obj(py, dtype)),
            ],
        ),
        Error::TokenOutOfRange { token, vocab } => {
            (Kind::TokenOutOfRange, vec![("token", obj(py, token)), ("vocab", obj(py, vocab))])
        }
        Error::InvalidInput(_) => (Kind::InvalidInput, vec![]),
        Error::InvalidSampling(_) => (Kind::InvalidSampling, vec![]),
        Error::KvCacheFull { needed_pages, free_pages, total_pages, page_bytes, budget_bytes } => (
            Kind::KvCacheFull,
            vec![
                ("needed_pages", obj(py, needed_pages)),
                ("free_pages", obj(py, free_pages)),
                ("total_pages", obj(py, total_pages)),
                ("page_bytes", obj(py, page_bytes)),
                ("budget_bytes", obj(py, budget_bytes)),
            ],
        ),
        Error::UnknownSequence(seq) => (Kind::UnknownSequence, vec![("sequence", obj(py, seq))]),
        Error::Unsupported(_) => (Kind::Unsupported, vec![]),
        Error::Text(_) => (Kind::Text, vec![]),
        Error::Backend(_) => (Kind::Backend, vec![]),
        // A variant added to the Rust enum later: still a DsparkError.
        _ => (Kind::Base, vec![]),
    };
    new_err(py, kind, message, &attrs)
}
