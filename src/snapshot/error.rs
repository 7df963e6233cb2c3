//! Why a snapshot file could not be used, below the format and the warm start that report it.

use std::path::{Path, PathBuf};

/// The snapshot file layout this build writes and reads (here, below the format that writes
/// it and the error that names it).
pub(crate) const VERSION: u32 = 3;

/// Why a snapshot file could not be used: the file and the reason.
#[derive(Debug, thiserror::Error)]
#[error("snapshot {}: {kind}", path.display())]
pub struct SnapshotError {
    /// The snapshot file.
    pub path: PathBuf,
    /// What was wrong.
    #[source]
    pub kind: SnapshotErrorKind,
}

impl SnapshotError {
    pub(crate) fn new(path: &Path, kind: SnapshotErrorKind) -> Self {
        SnapshotError {
            path: path.to_owned(),
            kind,
        }
    }
}

/// What was wrong with a snapshot file (see [`SnapshotError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotErrorKind {
    /// Reading or writing it failed (`NotFound`: there is none yet).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Shorter than its header says (or than a header): a write cut short.
    #[error("truncated: {len} bytes{}", expected.map(|e| format!(" of {e}")).unwrap_or_default())]
    Truncated {
        /// Its length.
        len: u64,
        /// The length its header gives, if it got that far.
        expected: Option<u64>,
    },
    /// It does not start with the snapshot magic.
    #[error("not a snapshot file (no magic)")]
    NotASnapshot,
    /// Written in a format version this build does not read.
    #[error("format version {0}, this build reads {VERSION}")]
    Version(u32),
    /// Its checksum does not match its bytes.
    #[error("corrupt: checksum {computed:016x} of its bytes, {stored:016x} stored")]
    Checksum {
        /// The checksum in the file.
        stored: u64,
        /// The checksum of its bytes.
        computed: u64,
    },
    /// Its fields do not hold together.
    #[error("corrupt: {0}")]
    Corrupt(String),
    /// Written with another codec (or type).
    #[error("written with codec {snapshot:?}, the informer's is {informer:?}")]
    Codec {
        /// The file's codec id.
        snapshot: String,
        /// The informer's.
        informer: String,
    },
    /// Written for another prefix (source).
    #[error("written for {snapshot:?}, the informer reads {informer:?}")]
    Prefix {
        /// The file's prefix.
        snapshot: String,
        /// The informer's source.
        informer: String,
    },
    /// A value does not decode with the codec.
    #[error("the value of key {key:?} does not decode: {error}")]
    Value {
        /// The key.
        key: String,
        /// What the codec said.
        error: crate::codec::CodecError,
    },
    /// A value does not encode with the codec (while writing).
    #[error("the value of key {key:?} does not encode: {error}")]
    Encode {
        /// The key.
        key: String,
        /// What the codec said.
        error: crate::codec::CodecError,
    },
}
