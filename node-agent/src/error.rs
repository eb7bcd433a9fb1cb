//! The agent library's one error type.

use std::io;
use std::path::PathBuf;

use hugepool_crds::PageSize;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write {value:?} to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("unexpected content in {path}: {detail}")]
    Parse { path: PathBuf, detail: String },
    #[error("the kernel does not offer {size} huge pages (offered: {offered})")]
    SizeNotOffered { size: PageSize, offered: String },
    #[error("NUMA node {node} has no {size} pool")]
    NoNumaPool { node: u32, size: PageSize },
    #[error("kernel write thread failed: {0}")]
    WriteThread(String),
    #[error("invalid {name}: {detail}")]
    InvalidArgument { name: &'static str, detail: String },
}

impl Error {
    /// The OS error number behind an I/O failure, if any (EIO from a write).
    pub fn os_error(&self) -> Option<i32> {
        match self {
            Error::Read { source, .. } | Error::Write { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
