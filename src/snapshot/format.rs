//! The snapshot file: its binary layout, its checksum, and how it is written so that a crash
//! mid-write leaves the previous one intact.
//!
//! Layout (integers little-endian):
//!
//! ```text
//! offset  size  field
//! 0       8     magic b"EISNAP\r\n" (a CR/LF pair, as PNG's: a transfer in text mode breaks it)
//! 8       4     format version (2; 1 had no digests)
//! 12      4     reserved, 0
//! 16      8     length of the whole file, checksum included (tells truncated from corrupt)
//! 24      8     the upstream's cluster id
//! 32      8     the revision the content is etcd's at
//! 40      8     key count
//! 48      4+n   the prefix (source identity), length then UTF-8 bytes
//! ..      4+n   the codec id, length then UTF-8 bytes
//! ..            u32 index count, then each index's name (length, UTF-8 bytes), sorted
//! ..            per key: u32 key length, key (relative to the prefix), u32 value length,
//!               value (as the codec encodes it), i64 mod_revision, i64 create_revision,
//!               i64 version, i64 lease, u64 digest of the value as etcd stored it
//!               (0: unknown; see `Object::stamp`), then per index (in the header's order)
//!               u32 value count and each value (length, UTF-8 bytes)
//! end-8   8     checksum of everything before it
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{SnapshotError, SnapshotErrorKind};
use crate::value_digest;

/// The file's first 8 bytes.
pub(super) const MAGIC: &[u8; 8] = b"EISNAP\r\n";
/// The layout this build writes and reads.
pub(super) const VERSION: u32 = 2;
/// Bytes before the prefix's length.
const FIXED_HEADER: usize = 48;
/// Bytes of one key's fixed fields: two lengths and four revisions.
const ENTRY_FIXED: usize = 4 + 4 + 5 * 8;

/// What a snapshot says about itself, besides its keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) cluster_id: u64,
    pub(super) revision: i64,
    pub(super) prefix: String,
    pub(super) codec_id: String,
    /// The names of the indexes whose values each key carries, sorted.
    pub(super) indexes: Vec<String>,
}

/// One key as stored: its value still encoded, as a range of the file's bytes (values are
/// decoded only once the source agreed to resume).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) key: Range<usize>,
    pub(super) value: Range<usize>,
    pub(super) mod_revision: i64,
    pub(super) create_revision: i64,
    pub(super) version: i64,
    pub(super) lease: i64,
    pub(super) digest: u64,
    /// The key's index values (see [`Loaded::index_values`]).
    pub(super) index: Range<usize>,
}

/// A verified snapshot file: header, entries, and the bytes they point into.
pub(super) struct Loaded {
    pub(super) header: Header,
    pub(super) entries: Vec<Entry>,
    pub(super) bytes: Vec<u8>,
}

impl Loaded {
    /// The key of `entry` (checked to be UTF-8 when the file was read).
    pub(super) fn key(&self, entry: &Entry) -> &str {
        std::str::from_utf8(&self.bytes[entry.key.clone()]).unwrap_or_default()
    }

    /// The index values of `entry`, one list per index of the header (checked when the file
    /// was read).
    pub(super) fn index_values(&self, entry: &Entry) -> Vec<Vec<&str>> {
        let mut r = Reader {
            bytes: &self.bytes[..entry.index.end],
            at: entry.index.start,
        };
        (0..self.header.indexes.len())
            .map(|_| {
                let n = r.u32().unwrap_or(0);
                (0..n)
                    .filter_map(|_| {
                        let range = r.field()?;
                        std::str::from_utf8(&self.bytes[range]).ok()
                    })
                    .collect()
            })
            .collect()
    }
}

/// The file's checksum: [`value_digest`] (FNV-1a a word at a time) over its bytes.
pub(super) fn checksum(bytes: &[u8]) -> u64 {
    value_digest(bytes)
}

/// Builds a snapshot file's bytes, key by key.
pub(super) struct Encoder {
    buf: Vec<u8>,
    keys: u64,
}

impl Encoder {
    pub(super) fn new(header: &Header, capacity: usize) -> Self {
        let mut buf = Vec::with_capacity(capacity);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        buf.extend_from_slice(&0u32.to_le_bytes());
        buf.extend_from_slice(&0u64.to_le_bytes()); // length, set by `finish`
        buf.extend_from_slice(&header.cluster_id.to_le_bytes());
        buf.extend_from_slice(&header.revision.to_le_bytes());
        buf.extend_from_slice(&0u64.to_le_bytes()); // key count, set by `finish`
        put_bytes(&mut buf, header.prefix.as_bytes());
        put_bytes(&mut buf, header.codec_id.as_bytes());
        buf.extend_from_slice(&(header.indexes.len() as u32).to_le_bytes());
        for name in &header.indexes {
            put_bytes(&mut buf, name.as_bytes());
        }
        Encoder { buf, keys: 0 }
    }

    /// Appends a key; `index` holds its values for each index of the header, in order.
    pub(super) fn key(
        &mut self,
        key: &str,
        value: &[u8],
        revisions: [i64; 4],
        digest: u64,
        index: &[Vec<String>],
    ) {
        put_bytes(&mut self.buf, key.as_bytes());
        put_bytes(&mut self.buf, value);
        for r in revisions {
            self.buf.extend_from_slice(&r.to_le_bytes());
        }
        self.buf.extend_from_slice(&digest.to_le_bytes());
        for values in index {
            self.buf
                .extend_from_slice(&(values.len() as u32).to_le_bytes());
            for v in values {
                put_bytes(&mut self.buf, v.as_bytes());
            }
        }
        self.keys += 1;
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        let len = (self.buf.len() + 8) as u64;
        self.buf[16..24].copy_from_slice(&len.to_le_bytes());
        self.buf[40..48].copy_from_slice(&self.keys.to_le_bytes());
        let sum = checksum(&self.buf);
        self.buf.extend_from_slice(&sum.to_le_bytes());
        self.buf
    }
}

/// A length-prefixed field. Keys and values longer than 4 GiB cannot exist in etcd (1.5 MiB
/// requests), so the cast cannot truncate.
fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// The cluster id, revision and key count in the header of the snapshot at `path`, read
/// alone and unverified (so that etcd can be asked about them while the whole file is read
/// and checked, which must then agree); `None` if it is not a snapshot of this format.
pub(super) fn peek(path: &Path) -> Option<(u64, i64, u64)> {
    use std::io::Read;
    let mut head = [0u8; FIXED_HEADER];
    File::open(path).ok()?.read_exact(&mut head).ok()?;
    let mut r = Reader {
        bytes: &head,
        at: MAGIC.len(),
    };
    if &head[..MAGIC.len()] != MAGIC || r.u32()? != VERSION {
        return None;
    }
    r.at = 24;
    Some((r.u64()?, r.i64()?, r.u64()?))
}

/// Reads and verifies the snapshot at `path`: layout, length, checksum, and every field in
/// bounds. Nothing in it is trusted before the checksum matched.
pub(super) fn read(path: &Path) -> Result<Loaded, SnapshotError> {
    let bytes = std::fs::read(path).map_err(|e| SnapshotError::new(path, e.into()))?;
    parse(bytes).map_err(|kind| SnapshotError::new(path, kind))
}

fn parse(bytes: Vec<u8>) -> Result<Loaded, SnapshotErrorKind> {
    use SnapshotErrorKind as K;
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        if bytes.len() < MAGIC.len() && MAGIC.starts_with(&bytes) {
            return Err(K::Truncated {
                len: bytes.len() as u64,
                expected: None,
            });
        }
        return Err(K::NotASnapshot);
    }
    let mut r = Reader {
        bytes: &bytes,
        at: MAGIC.len(),
    };
    let truncated = |len: usize, expected: Option<u64>| K::Truncated {
        len: len as u64,
        expected,
    };
    let version = r.u32().ok_or(truncated(bytes.len(), None))?;
    if version != VERSION {
        return Err(K::Version(version));
    }
    let _reserved = r.u32().ok_or(truncated(bytes.len(), None))?;
    let declared = r.u64().ok_or(truncated(bytes.len(), None))?;
    if (bytes.len() as u64) < declared {
        return Err(truncated(bytes.len(), Some(declared)));
    }
    if bytes.len() as u64 != declared || declared < (FIXED_HEADER + 8 + 8) as u64 {
        return Err(K::Corrupt(format!(
            "the file is {} bytes, its header says {declared}",
            bytes.len()
        )));
    }
    let body = bytes.len() - 8;
    let mut stored = [0u8; 8];
    stored.copy_from_slice(&bytes[body..]);
    let stored = u64::from_le_bytes(stored);
    let computed = checksum(&bytes[..body]);
    if stored != computed {
        return Err(K::Checksum { stored, computed });
    }
    // From here on the bytes are the ones written; bounds are still checked, since a file
    // written by a buggy or hostile program can carry a matching checksum.
    let corrupt = |what: &str| K::Corrupt(format!("{what} runs past the end of the file"));
    let r = &mut Reader {
        bytes: &bytes[..body],
        at: 24,
    };
    let cluster_id = r.u64().ok_or_else(|| corrupt("the header"))?;
    let revision = r.i64().ok_or_else(|| corrupt("the header"))?;
    let keys = r.u64().ok_or_else(|| corrupt("the header"))?;
    let prefix = r.string().ok_or_else(|| corrupt("the prefix"))?;
    let codec_id = r.string().ok_or_else(|| corrupt("the codec id"))?;
    let indexes = (|| {
        let n = r.u32()?;
        // Each name takes at least its length's 4 bytes.
        if n as usize > body / 4 {
            return None;
        }
        (0..n).map(|_| r.string()).collect::<Option<Vec<_>>>()
    })()
    .ok_or_else(|| corrupt("the index names"))?;
    // Each key takes at least ENTRY_FIXED bytes: a count the file cannot hold is refused
    // before anything is allocated for it.
    if keys > (body / ENTRY_FIXED) as u64 {
        return Err(K::Corrupt(format!(
            "{keys} keys cannot fit in {body} bytes"
        )));
    }
    let mut entries = Vec::with_capacity(keys as usize);
    for i in 0..keys {
        let entry = (|| {
            let key = r.field()?;
            std::str::from_utf8(&r.bytes[key.clone()]).ok()?;
            let value = r.field()?;
            Some(Entry {
                key,
                value,
                mod_revision: r.i64()?,
                create_revision: r.i64()?,
                version: r.i64()?,
                lease: r.i64()?,
                digest: r.array().map(u64::from_le_bytes)?,
                index: {
                    let start = r.at;
                    for _ in 0..indexes.len() {
                        let n = r.u32()?;
                        for _ in 0..n {
                            let value = r.field()?;
                            std::str::from_utf8(&r.bytes[value]).ok()?;
                        }
                    }
                    start..r.at
                },
            })
        })()
        .ok_or_else(|| K::Corrupt(format!("key {i} of {keys} is cut short or not UTF-8")))?;
        entries.push(entry);
    }
    if r.at != body {
        return Err(K::Corrupt(format!(
            "{} bytes follow the last of {keys} keys",
            body - r.at
        )));
    }
    Ok(Loaded {
        header: Header {
            cluster_id,
            revision,
            prefix,
            codec_id,
            indexes,
        },
        entries,
        bytes,
    })
}

/// Reads fields in order, each checked to lie within the bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<Range<usize>> {
        let end = self.at.checked_add(n)?;
        (end <= self.bytes.len()).then(|| {
            let range = self.at..end;
            self.at = end;
            range
        })
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let range = self.take(N)?;
        self.bytes[range].try_into().ok()
    }
    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
    fn i64(&mut self) -> Option<i64> {
        self.array().map(i64::from_le_bytes)
    }
    fn field(&mut self) -> Option<Range<usize>> {
        let len = self.u32()? as usize;
        self.take(len)
    }
    fn string(&mut self) -> Option<String> {
        let range = self.field()?;
        String::from_utf8(self.bytes[range].to_vec()).ok()
    }
}

/// The temporary file a snapshot is written to before it replaces `path`: in the same
/// directory, so that the rename stays within one file system and is atomic.
pub(super) fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes `bytes` to `path` so that a crash at any point leaves either the previous file or
/// the new one, whole: a temporary file in the same directory, synced, renamed over `path`,
/// then the directory synced so that the rename itself survives a power loss. The file is
/// readable and writable by its owner only (0600).
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    let temp = temp_path(path);
    let result = (|| {
        let mut options = OpenOptions::new();
        options.write(true).create(true).truncate(true);
        // The file holds every value of the prefix: its owner's alone, as etcd's own data.
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&temp)?;
        // `mode` applies only to a file it creates: a temporary file left behind keeps its own.
        #[cfg(unix)]
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temp, path)?;
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        File::open(dir)?.sync_all()
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        SnapshotError::new(path, e.into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let header = Header {
            cluster_id: 0xabc,
            revision: 42,
            prefix: "/p/".into(),
            codec_id: "json".into(),
            indexes: vec!["namespace".into(), "zone".into()],
        };
        let mut e = Encoder::new(&header, 0);
        let no_values = [vec![], vec![]];
        e.key("ns/a", b"1", [40, 30, 2, 0], 0, &no_values);
        let values = [vec!["ns".to_owned()], vec!["a".to_owned(), "b".to_owned()]];
        e.key("ns/b", b"22", [41, 41, 1, 7], u64::MAX, &values);
        e.finish()
    }

    #[cfg(unix)]
    #[test]
    fn the_file_is_its_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("cache.snapshot");
        // A temporary file left behind, world-readable: the write does not inherit its mode.
        std::fs::write(temp_path(&path), b"old").expect("write");
        std::fs::set_permissions(temp_path(&path), std::fs::Permissions::from_mode(0o644))
            .expect("chmod");
        write_atomic(&path, &sample()).expect("written");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
    }

    #[test]
    fn round_trip() {
        let loaded = parse(sample()).expect("parses");
        assert_eq!(loaded.header.revision, 42);
        assert_eq!(loaded.header.cluster_id, 0xabc);
        assert_eq!(loaded.header.prefix, "/p/");
        assert_eq!(loaded.entries.len(), 2);
        let b = &loaded.entries[1];
        assert_eq!(loaded.key(b), "ns/b");
        assert_eq!(&loaded.bytes[b.value.clone()], b"22");
        assert_eq!(
            (
                b.mod_revision,
                b.create_revision,
                b.version,
                b.lease,
                b.digest
            ),
            (41, 41, 1, 7, u64::MAX)
        );
        assert_eq!(loaded.index_values(b), vec![vec!["ns"], vec!["a", "b"]]);
        assert_eq!(
            loaded.index_values(&loaded.entries[0]),
            vec![Vec::<&str>::new(); 2]
        );
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_refused() {
        let bytes = sample();
        for len in 0..bytes.len() {
            let kind = parse(bytes[..len].to_vec()).err().expect("refused");
            assert!(
                matches!(kind, SnapshotErrorKind::Truncated { .. }),
                "cut at {len}: {kind}"
            );
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(parse(bad).is_err(), "byte {i} flipped went unnoticed");
        }
    }
}
