//! The snapshot file: its binary layout, its checksum, and how it is written so that a crash
//! mid-write leaves the previous one intact.
//!
//! Layout (integers little-endian):
//!
//! ```text
//! offset  size  field
//! 0       8     magic b"EISNAP\r\n" (a CR/LF pair, as PNG's: a transfer in text mode breaks it)
//! 8       4     format version (3; 2 had its own record layout, 1 no digests)
//! 12      4     reserved, 0
//! 16      8     length of the whole file, checksum included (tells truncated from corrupt)
//! 24      8     the upstream's cluster id
//! 32      8     the revision the content is etcd's at
//! 40      8     key count
//! 48      8     where the records start (R)
//! 56      4+n   the prefix (source identity), length then UTF-8 bytes
//! ..      4+n   the codec id, length then UTF-8 bytes
//! ..            u32 index count, then each index's name (length, UTF-8 bytes), sorted
//! ..            per key: u32 length of its record
//! ..            per key: its index values, per index (in the header's order) u32 value count
//!               and each value (length, UTF-8 bytes)
//! R             per key: its record, in the compact cache's layout (`store::compact`): the
//!               key relative to the prefix, mod_revision, create_revision, version, lease,
//!               the digest of the value as etcd stored it (0: unknown; see `Object::stamp`),
//!               and the value as the codec encodes it
//! end-8   8     checksum: value_digest of the two checksums of [0, R) and [R, end-8)
//! ```
//!
//! The records come last and in the compact cache's own layout, so that a compact cache takes
//! them as they are read, without a copy: at a million keys, copying them into the cache's
//! chunks was a third of a warm start. A change to that layout is a new format version.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{SnapshotError, SnapshotErrorKind};
use crate::store::compact::{parse_record, write_record};
use crate::value_digest;

/// The file's first 8 bytes.
pub(super) const MAGIC: &[u8; 8] = b"EISNAP\r\n";
/// The layout this build writes and reads.
pub(super) const VERSION: u32 = 3;
/// Bytes before the prefix's length.
const FIXED_HEADER: usize = 56;
/// The fewest bytes a key takes: its record's length and index value counts in the head...
const KEY_HEAD: usize = 4;
/// ...and its record: flags, key length, four revisions and the digest.
const MIN_RECORD: usize = 1 + 1 + 4 + 8;

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

/// One key as stored: its value still encoded. `record`, `key` and `value` are ranges of the
/// records (values are decoded only once the source agreed to resume), `index` of the head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) record: Range<usize>,
    pub(super) key: Range<usize>,
    pub(super) value: Range<usize>,
    pub(super) mod_revision: i64,
    pub(super) create_revision: i64,
    pub(super) version: i64,
    pub(super) lease: i64,
    pub(super) digest: u64,
    /// The key's index values (see [`Loaded::index_values`]).
    pub(super) index: Range<usize>,
    /// The key's hash for the store's sets (`store::key_hash`), taken while the key's bytes
    /// are at hand: a compact cache reads no key again to fill its sets.
    pub(super) key_hash: u64,
}

/// A verified snapshot file: header, entries, and the bytes they point into.
pub(super) struct Loaded {
    pub(super) header: Header,
    pub(super) entries: Vec<Entry>,
    /// Everything before the records.
    pub(super) head: Vec<u8>,
    /// The records, in one allocation a compact cache can keep.
    pub(super) records: Arc<Box<[u8]>>,
}

impl Loaded {
    /// The key of `entry` (checked to be UTF-8 when the file was read).
    pub(super) fn key(&self, entry: &Entry) -> &str {
        std::str::from_utf8(&self.records[entry.key.clone()]).unwrap_or_default()
    }

    /// The encoded value of `entry`.
    pub(super) fn value(&self, entry: &Entry) -> &[u8] {
        &self.records[entry.value.clone()]
    }

    /// The index values of `entry`, one list per index of the header (checked when the file
    /// was read).
    pub(super) fn index_values(&self, entry: &Entry) -> Vec<Vec<&str>> {
        let mut r = Reader {
            bytes: &self.head[..entry.index.end],
            at: entry.index.start,
        };
        (0..self.header.indexes.len())
            .map(|_| {
                let n = r.u32().unwrap_or(0);
                (0..n)
                    .filter_map(|_| {
                        let range = r.field()?;
                        std::str::from_utf8(&self.head[range]).ok()
                    })
                    .collect()
            })
            .collect()
    }
}

/// The file's checksum, from its head (`[0, R)`) and its records: [`value_digest`] (FNV-1a a
/// word at a time) of the two parts' own.
fn checksum(head: &[u8], records: &[u8]) -> u64 {
    let mut both = [0u8; 16];
    both[..8].copy_from_slice(&value_digest(head).to_le_bytes());
    both[8..].copy_from_slice(&value_digest(records).to_le_bytes());
    value_digest(&both)
}

/// Builds a snapshot file's bytes, key by key.
pub(super) struct Encoder {
    head: Vec<u8>,
    lengths: Vec<u8>,
    index: Vec<u8>,
    records: Vec<u8>,
    keys: u64,
}

impl Encoder {
    /// `capacity`: the records' expected size.
    pub(super) fn new(header: &Header, capacity: usize) -> Self {
        let mut head = Vec::new();
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes()); // length, set by `finish`
        head.extend_from_slice(&header.cluster_id.to_le_bytes());
        head.extend_from_slice(&header.revision.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes()); // key count, set by `finish`
        head.extend_from_slice(&0u64.to_le_bytes()); // where the records start, by `finish`
        put_bytes(&mut head, header.prefix.as_bytes());
        put_bytes(&mut head, header.codec_id.as_bytes());
        head.extend_from_slice(&(header.indexes.len() as u32).to_le_bytes());
        for name in &header.indexes {
            put_bytes(&mut head, name.as_bytes());
        }
        Encoder {
            head,
            lengths: Vec::new(),
            index: Vec::new(),
            records: Vec::with_capacity(capacity),
            keys: 0,
        }
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
        let start = self.records.len();
        write_record(&mut self.records, key, revisions, digest, 0, value);
        // Keys and values longer than 4 GiB cannot exist in etcd (1.5 MiB requests).
        let len = (self.records.len() - start) as u32;
        self.lengths.extend_from_slice(&len.to_le_bytes());
        for values in index {
            self.index
                .extend_from_slice(&(values.len() as u32).to_le_bytes());
            for v in values {
                put_bytes(&mut self.index, v.as_bytes());
            }
        }
        self.keys += 1;
    }

    /// The file's bytes, in three parts to write one after the other: the head, the records
    /// and the checksum (not copied into one buffer: at a million keys that is 200 MB).
    pub(super) fn finish(self) -> [Vec<u8>; 3] {
        let Encoder {
            mut head,
            lengths,
            index,
            records,
            keys,
        } = self;
        head.extend_from_slice(&lengths);
        head.extend_from_slice(&index);
        let records_at = head.len() as u64;
        let len = records_at + records.len() as u64 + 8;
        head[16..24].copy_from_slice(&len.to_le_bytes());
        head[40..48].copy_from_slice(&keys.to_le_bytes());
        head[48..56].copy_from_slice(&records_at.to_le_bytes());
        let sum = checksum(&head, &records);
        [head, records, sum.to_le_bytes().to_vec()]
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

/// Where the records start in a file of `len` bytes that begins with `fixed` (its first
/// [`FIXED_HEADER`] bytes, or all of it if shorter), if magic, version, declared length and
/// that offset agree with the file's length. Nothing else is trusted before the checksum.
fn records_at(fixed: &[u8], len: usize) -> Result<usize, SnapshotErrorKind> {
    use SnapshotErrorKind as K;
    if fixed.len() < MAGIC.len() || &fixed[..MAGIC.len()] != MAGIC {
        if fixed.len() < MAGIC.len() && MAGIC.starts_with(fixed) {
            return Err(K::Truncated {
                len: len as u64,
                expected: None,
            });
        }
        return Err(K::NotASnapshot);
    }
    let mut r = Reader {
        bytes: fixed,
        at: MAGIC.len(),
    };
    let truncated = || K::Truncated {
        len: len as u64,
        expected: None,
    };
    let version = r.u32().ok_or_else(truncated)?;
    if version != VERSION {
        return Err(K::Version(version));
    }
    let _reserved = r.u32().ok_or_else(truncated)?;
    let declared = r.u64().ok_or_else(truncated)?;
    if (len as u64) < declared {
        return Err(K::Truncated {
            len: len as u64,
            expected: Some(declared),
        });
    }
    if len as u64 != declared || declared < (FIXED_HEADER + 8 + 8) as u64 {
        return Err(K::Corrupt(format!(
            "the file is {len} bytes, its header says {declared}"
        )));
    }
    r.at = 48;
    let at = r.u64().ok_or_else(truncated)?;
    if at < FIXED_HEADER as u64 || at > (len - 8) as u64 {
        return Err(K::Corrupt(format!(
            "its records start at byte {at}, outside its {len} bytes"
        )));
    }
    Ok(at as usize)
}

/// Reads and verifies the snapshot at `path`: layout, length, checksum, and every field in
/// bounds. Nothing in it is trusted before the checksum matched. The records are read
/// straight into their own allocation.
pub(super) fn read(path: &Path) -> Result<Loaded, SnapshotError> {
    let fail = |kind: SnapshotErrorKind| SnapshotError::new(path, kind);
    let io = |e: std::io::Error| SnapshotError::new(path, e.into());
    let mut file = File::open(path).map_err(io)?;
    let len = usize::try_from(file.metadata().map_err(io)?.len())
        .map_err(|_| fail(SnapshotErrorKind::Corrupt("larger than memory".into())))?;
    let mut head = Vec::new();
    read_more(&mut file, &mut head, FIXED_HEADER.min(len), len).map_err(fail)?;
    let at = records_at(&head, len).map_err(fail)?;
    read_more(&mut file, &mut head, at - FIXED_HEADER, len).map_err(fail)?;
    let mut records = Vec::new();
    read_more(&mut file, &mut records, len - 8 - at, len).map_err(fail)?;
    let mut stored = Vec::new();
    read_more(&mut file, &mut stored, 8, len).map_err(fail)?;
    // The file is replaced by a rename, never written in place: more bytes mean another writer.
    if file.read(&mut [0u8; 1]).map_err(io)? != 0 {
        return Err(fail(SnapshotErrorKind::Corrupt(format!(
            "it grew past its {len} bytes while it was read"
        ))));
    }
    let stored = u64::from_le_bytes(stored.try_into().unwrap_or_default());
    parse_parts(head, records.into_boxed_slice(), stored).map_err(fail)
}

/// Appends the file's next `n` bytes to `buf`, allocated exactly (so that boxing it copies
/// nothing), and refused rather than aborting the process when it cannot be: a file's length
/// is not trusted before its checksum is checked. `len`: the file's length, for the error.
fn read_more(
    file: &mut File,
    buf: &mut Vec<u8>,
    n: usize,
    len: usize,
) -> Result<(), SnapshotErrorKind> {
    buf.try_reserve_exact(n).map_err(|e| {
        SnapshotErrorKind::Corrupt(format!("{n} bytes of it cannot be allocated: {e}"))
    })?;
    let before = buf.len();
    // `read_to_end` fills the reserved room without zeroing it first.
    file.take(n as u64).read_to_end(buf)?;
    if buf.len() - before < n {
        return Err(SnapshotErrorKind::Truncated {
            len: len as u64,
            expected: None,
        });
    }
    Ok(())
}

/// Parses a whole file's bytes (the tests' way in; [`read`] reads the parts apart).
#[cfg(test)]
fn parse(bytes: Vec<u8>) -> Result<Loaded, SnapshotErrorKind> {
    let fixed = &bytes[..FIXED_HEADER.min(bytes.len())];
    let at = records_at(fixed, bytes.len())?;
    let body = bytes.len() - 8;
    let stored = u64::from_le_bytes(bytes[body..].try_into().unwrap_or_default());
    let records = bytes[at..body].to_vec().into_boxed_slice();
    parse_parts(bytes[..at].to_vec(), records, stored)
}

/// Checks the checksum, then parses the head and every record.
fn parse_parts(
    head: Vec<u8>,
    records: Box<[u8]>,
    stored: u64,
) -> Result<Loaded, SnapshotErrorKind> {
    use SnapshotErrorKind as K;
    let computed = checksum(&head, &records);
    if stored != computed {
        return Err(K::Checksum { stored, computed });
    }
    // From here on the bytes are the ones written; bounds are still checked, since a file
    // written by a buggy or hostile program can carry a matching checksum.
    let corrupt = |what: &str| K::Corrupt(format!("{what} runs past the end of the file"));
    let r = &mut Reader {
        bytes: &head,
        at: 24,
    };
    let cluster_id = r.u64().ok_or_else(|| corrupt("the header"))?;
    let revision = r.i64().ok_or_else(|| corrupt("the header"))?;
    let keys = r.u64().ok_or_else(|| corrupt("the header"))?;
    r.at = FIXED_HEADER;
    let prefix = r.string().ok_or_else(|| corrupt("the prefix"))?;
    let codec_id = r.string().ok_or_else(|| corrupt("the codec id"))?;
    let indexes = (|| {
        let n = r.u32()?;
        // Each name takes at least its length's 4 bytes.
        if n as usize > head.len() / 4 {
            return None;
        }
        (0..n).map(|_| r.string()).collect::<Option<Vec<_>>>()
    })()
    .ok_or_else(|| corrupt("the index names"))?;
    // A count the file cannot hold is refused before anything is allocated for it.
    let fits = (head.len() / (KEY_HEAD + 4 * indexes.len())).min(records.len() / MIN_RECORD);
    if keys > fits as u64 {
        return Err(K::Corrupt(format!(
            "{keys} keys cannot fit in {} bytes",
            head.len() + records.len()
        )));
    }
    let lengths = r
        .take(keys as usize * 4)
        .ok_or_else(|| corrupt("the record lengths"))?;
    let mut entries = Vec::with_capacity(keys as usize);
    let mut at = 0usize;
    for (i, len) in head[lengths].chunks_exact(4).enumerate() {
        let len = u32::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
        let entry = (|| {
            let record = at..at.checked_add(len)?;
            let fields = parse_record(records.get(record.clone())?)?;
            let index = {
                let start = r.at;
                for _ in 0..indexes.len() {
                    let n = r.u32()?;
                    for _ in 0..n {
                        let value = r.field()?;
                        std::str::from_utf8(&r.bytes[value]).ok()?;
                    }
                }
                start..r.at
            };
            let [mod_revision, create_revision, version, lease] = fields.revisions;
            Some(Entry {
                key_hash: fields.key_hash,
                key: at + fields.key.start..at + fields.key.end,
                value: at + fields.value.start..at + fields.value.end,
                record,
                mod_revision,
                create_revision,
                version,
                lease,
                digest: fields.digest,
                index,
            })
        })()
        .ok_or_else(|| K::Corrupt(format!("key {i} of {keys} is cut short or not UTF-8")))?;
        at = entry.record.end;
        entries.push(entry);
    }
    if r.at != head.len() || at != records.len() {
        return Err(K::Corrupt(format!(
            "{} bytes follow the last of {keys} keys",
            (head.len() - r.at) + (records.len() - at)
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
        head,
        records: Arc::new(records),
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

/// Writes `parts`, one after the other, to `path` so that a crash at any point leaves either the previous file or
/// the new one, whole: a temporary file in the same directory, synced, renamed over `path`,
/// then the directory synced so that the rename itself survives a power loss. The file is
/// readable and writable by its owner only (0600).
pub(super) fn write_atomic(path: &Path, parts: &[Vec<u8>]) -> Result<(), SnapshotError> {
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
        for part in parts {
            file.write_all(part)?;
        }
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
        e.finish().concat()
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
        write_atomic(&path, &[sample()]).expect("written");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
    }

    #[test]
    fn a_huge_length_is_refused_not_allocated() {
        // A sparse file of 1 TiB whose header agrees with its length: reading it must fail
        // (its checksum cannot be checked without reading it), never abort on allocation.
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("huge.snapshot");
        let len: u64 = 1 << 40;
        let mut head = sample()[..FIXED_HEADER].to_vec();
        head[16..24].copy_from_slice(&len.to_le_bytes());
        head[48..56].copy_from_slice(&(FIXED_HEADER as u64).to_le_bytes());
        let file = File::create(&path).expect("create");
        (&file).write_all(&head).expect("write");
        file.set_len(len).expect("sparse");
        let error = read(&path).err().expect("refused");
        assert!(error.to_string().contains("cannot be allocated"), "{error}");
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
        assert_eq!(loaded.value(b), b"22");
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
