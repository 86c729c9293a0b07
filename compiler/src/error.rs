//! The compiler's error type: every user mistake names the file, the field and what to do.
//!
//! Compiler bugs are panics; everything a user can cause (a bad manifest, a
//! truncated weight file, an architecture we do not support) is an [`Error`].

use std::path::{Path, PathBuf};

/// Result alias used throughout the compiler library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A user-facing compiler error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read at all.
    #[error("{path}: cannot read file: {error}")]
    Io { path: PathBuf, error: std::io::Error },

    /// An output (the artifact, `--dump-ir`, `--emit-*`) could not be written.
    #[error("{path}: cannot write: {error}")]
    Write { path: PathBuf, error: std::io::Error },

    /// A file was read but one of its fields is missing, malformed or out of range.
    #[error("{path}: {field}: {message}")]
    Invalid { path: PathBuf, field: String, message: String },

    /// The model's architecture has no graph builder.
    #[error(
        "{path}: architecture `{architecture}` is not supported; supported architectures: {supported}"
    )]
    UnsupportedArchitecture { path: PathBuf, architecture: String, supported: String },

    /// A weight that the architecture needs is absent from the checkpoint.
    #[error(
        "{path}: weight `{name}` is required by {architecture} but is not in the checkpoint; \
         check that the checkpoint is complete and matches {config}"
    )]
    MissingWeight { path: PathBuf, name: String, architecture: String, config: String },

    /// A weight exists but its shape does not match what config.json implies.
    #[error("{path}: weight `{name}` has shape {found:?}, expected {expected:?} from {config}")]
    WeightShape { path: PathBuf, name: String, expected: Vec<usize>, found: Vec<usize>, config: String },

    /// Text IR that does not parse.
    #[error("IR parse error at line {line}: {message}")]
    IrParse { line: usize, message: String },

    /// A graph that breaks an IR invariant (reported by the verifier).
    #[error("IR verification failed: {0}")]
    Verify(String),

    /// Code generation or linking failed (or the target is invalid).
    #[error(transparent)]
    Codegen(#[from] maxc_codegen::CodegenError),

    /// A command-line flag or override with a bad value.
    #[error("{flag}: {message}")]
    Flag { flag: String, message: String },
}

impl Error {
    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(path: impl AsRef<Path>, field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid { path: path.as_ref().to_path_buf(), field: field.into(), message: message.into() }
    }

    /// Shorthand for [`Error::Io`].
    pub fn io(path: impl AsRef<Path>, error: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().to_path_buf(), error }
    }

    /// The error for an output that could not be written.
    pub fn write(path: impl AsRef<Path>, error: std::io::Error) -> Self {
        Error::Write { path: path.as_ref().to_path_buf(), error }
    }
}
