//! C ABI for dspark (`libdspark`, header `include/dspark.h`).
//!
//! Not built yet: the handles, entry points and the cbindgen header are tracked by the bindings
//! issue. This crate exists so the workspace has its final shape; it exports nothing.
