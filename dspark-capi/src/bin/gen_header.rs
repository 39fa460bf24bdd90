//! Writes the C header of `libdspark_capi` (the committed copy is `include/dspark.h`; CI
//! regenerates it and fails when the two differ).
//!
//! ```text
//! cargo run -p dspark-capi --bin gen-header -- include/dspark.h
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::args().nth(1).map_or_else(|| crate_dir.join("../include/dspark.h"), PathBuf::from);
    let config = match cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cbindgen::generate_with_config(&crate_dir, config) {
        Ok(bindings) => {
            bindings.write_to_file(&out);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
