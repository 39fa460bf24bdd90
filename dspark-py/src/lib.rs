//! Python bindings for dspark (`import dspark`).
//!
//! Not built yet: the pyo3 module, its wheel and its pytest suite are tracked by the bindings
//! issue. This crate exists so the workspace has its final shape; it exports nothing.
