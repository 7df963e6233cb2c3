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

use super::error::{SnapshotError, SnapshotErrorKind, VERSION};
use crate::object::value_digest;
use crate::object::IndexValues;
use crate::object::ValueDigest;
use crate::store::compact::{parse_record, write_record};

/// The file's first 8 bytes.
pub(super) const MAGIC: &[u8; 8] = b"EISNAP\r\n";
/// Bytes before the prefix's length.
const FIXED_HEADER: usize = 56;
/// The most indexes a snapshot may name.
const MAX_INDEXES: usize = 4096;
/// The most bytes read past a garbled field to tell whether the checksum matches (see
/// [`PageReader::refused`]): beyond it the field's own error is given at once.
const MAX_DRAIN: usize = 256 << 20;
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
    /// The key's index values (see [`Page::index_values`]).
    pub(super) index: Range<usize>,
    /// The key's hash for the store's sets (`store::key_hash`), taken while the key's bytes
    /// are at hand: a compact cache reads no key again to fill its sets.
    pub(super) key_hash: u64,
}

/// A page of a snapshot's keys: its records, read into their own allocation (which a compact
/// cache can keep), and an entry per key pointing into them.
pub(super) struct Page {
    pub(super) entries: Vec<Entry>,
    pub(super) records: Arc<Box<[u8]>>,
    /// The file's head, where the entries' index values are.
    head: Arc<Vec<u8>>,
    indexes: usize,
}

impl Page {
    /// The key of `entry` (checked to be UTF-8 when the page was read).
    pub(super) fn key(&self, entry: &Entry) -> &str {
        std::str::from_utf8(&self.records[entry.key.clone()]).unwrap_or_default()
    }

    /// The encoded value of `entry`.
    pub(super) fn value(&self, entry: &Entry) -> &[u8] {
        &self.records[entry.value.clone()]
    }

    /// Every key's index values, one list for the whole page (checked when the page was
    /// read): a key's are [`PageIndex::of`] its entry's place.
    pub(super) fn index(&self) -> PageIndex<'_> {
        let mut values = Vec::with_capacity(self.entries.len() * self.indexes);
        let mut ends = Vec::with_capacity(self.entries.len() * self.indexes);
        for entry in &self.entries {
            let mut r = Reader {
                bytes: &self.head[..entry.index.end],
                at: entry.index.start,
            };
            for _ in 0..self.indexes {
                let n = r.u32().unwrap_or(0);
                for _ in 0..n {
                    let Some(range) = r.field() else { break };
                    values.extend(std::str::from_utf8(&self.head[range]).ok());
                }
                ends.push(values.len());
            }
        }
        PageIndex {
            values,
            ends,
            indexes: self.indexes,
        }
    }
}

/// A page's index values: one list for all its keys, so that a page costs two allocations,
/// not two a key.
pub(super) struct PageIndex<'a> {
    values: Vec<&'a str>,
    /// Where each key's values of each index end in `values`, `indexes` a key.
    ends: Vec<usize>,
    indexes: usize,
}

impl PageIndex<'_> {
    /// The index values of the page's `n`th entry, one list per index of the header (none
    /// past the last entry).
    pub(super) fn of(&self, n: usize) -> IndexValues<'_> {
        let first = n.saturating_mul(self.indexes);
        let start = first
            .checked_sub(1)
            .and_then(|last| self.ends.get(last))
            .copied()
            .unwrap_or(0);
        let ends = self
            .ends
            .get(first..first.saturating_add(self.indexes))
            .unwrap_or_default();
        IndexValues::within(&self.values, ends, start)
    }
}

/// The file's checksum, from its head (`[0, R)`) and its records: [`value_digest`] (FNV-1a a
/// word at a time) of the two parts' own.
fn checksum(head: &[u8], records: &[u8]) -> u64 {
    combine(value_digest(head), value_digest(records))
}

/// The checksum from the digests of the head and of the records.
fn combine(head: u64, records: u64) -> u64 {
    let mut both = [0u8; 16];
    both[..8].copy_from_slice(&head.to_le_bytes());
    both[8..].copy_from_slice(&records.to_le_bytes());
    value_digest(&both)
}

/// Builds a snapshot file's bytes, key by key: each key's record here, or only its length
/// and index values when the records go straight to the file ([`Encoder::streamed`]).
pub(super) struct Encoder {
    head: Vec<u8>,
    lengths: Vec<u8>,
    index: Vec<u8>,
    records: Vec<u8>,
    /// The length of the records streamed.
    streamed: u64,
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
            streamed: 0,
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
        index: &[Vec<impl AsRef<str>>],
    ) {
        let start = self.records.len();
        write_record(&mut self.records, key, revisions, digest, 0, value);
        self.keyed(self.records.len() - start, index);
    }

    /// Appends a key whose record (`store::compact`'s layout), `len` bytes, goes straight to
    /// the file after the head ([`RecordsWriter`]); `index` as for [`key`](Self::key).
    pub(super) fn streamed(&mut self, len: usize, index: &[Vec<impl AsRef<str>>]) {
        self.streamed += len as u64;
        self.keyed(len, index);
    }

    /// The head's part of a key whose record is `len` bytes.
    fn keyed(&mut self, len: usize, index: &[Vec<impl AsRef<str>>]) {
        // Keys and values longer than 4 GiB cannot exist in etcd (1.5 MiB requests).
        let len = len as u32;
        self.lengths.extend_from_slice(&len.to_le_bytes());
        for values in index {
            self.index
                .extend_from_slice(&(values.len() as u32).to_le_bytes());
            for v in values {
                put_bytes(&mut self.index, v.as_ref().as_bytes());
            }
        }
        self.keys += 1;
    }

    /// The file's bytes, in three parts to write one after the other: the head, the records
    /// and the checksum (not copied into one buffer: at a million keys that is 200 MB).
    pub(super) fn finish(mut self) -> [Vec<u8>; 3] {
        debug_assert_eq!(self.streamed, 0, "keys streamed to a buffered file");
        let records = std::mem::take(&mut self.records);
        let head = self.finish_head(records.len() as u64);
        let sum = checksum(&head, &records);
        [head, records, sum.to_le_bytes().to_vec()]
    }

    /// The head of a file whose records were [streamed](Self::streamed), and each record's
    /// length: what [`RecordsWriter`] needs.
    pub(super) fn finish_streamed(self) -> (Vec<u8>, Vec<u32>) {
        debug_assert!(self.records.is_empty(), "keys buffered in a streamed file");
        let lengths = (self.lengths.chunks_exact(4))
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let streamed = self.streamed;
        (self.finish_head(streamed), lengths)
    }

    fn finish_head(self, records_len: u64) -> Vec<u8> {
        let Encoder {
            mut head,
            lengths,
            index,
            keys,
            ..
        } = self;
        head.extend_from_slice(&lengths);
        head.extend_from_slice(&index);
        let records_at = head.len() as u64;
        let len = records_at + records_len + 8;
        head[16..24].copy_from_slice(&len.to_le_bytes());
        head[40..48].copy_from_slice(&keys.to_le_bytes());
        head[48..56].copy_from_slice(&records_at.to_le_bytes());
        head
    }
}

/// Writes a snapshot's head, then its records one by one as they come, then the checksum: no
/// buffer holds the records (a compact cache's are already in memory, in the file's layout).
/// Each record must have the length the head gives it, and none may be missing: a file whose
/// head does not describe its records is never written.
pub(super) struct RecordsWriter<W: Write> {
    out: std::io::BufWriter<W>,
    head: u64,
    records: ValueDigest,
    /// Each record's length, as the head gives them, and the next record's place.
    lengths: Vec<u32>,
    next: usize,
}

impl<W: Write> RecordsWriter<W> {
    /// Writes `head` (from [`Encoder::finish_streamed`], with `lengths`) to `out`.
    pub(super) fn new(out: W, head: &[u8], lengths: Vec<u32>) -> std::io::Result<Self> {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, out);
        out.write_all(head)?;
        Ok(RecordsWriter {
            out,
            head: value_digest(head),
            records: ValueDigest::default(),
            lengths,
            next: 0,
        })
    }

    /// The next record, in the order the encoder took them.
    pub(super) fn record(&mut self, record: &[u8]) -> std::io::Result<()> {
        let announced = self.lengths.get(self.next).copied();
        if announced != Some(record.len() as u32) {
            return Err(std::io::Error::other(format!(
                "record {} is {} bytes, the head gives {announced:?}",
                self.next,
                record.len()
            )));
        }
        self.next += 1;
        self.records.update(record);
        self.out.write_all(record)
    }

    /// The checksum, after the last record.
    pub(super) fn finish(mut self) -> std::io::Result<()> {
        if self.next != self.lengths.len() {
            return Err(std::io::Error::other(format!(
                "{} records written, the head gives {}",
                self.next,
                self.lengths.len()
            )));
        }
        let sum = combine(self.head, self.records.finish());
        self.out.write_all(&sum.to_le_bytes())?;
        self.out.flush()
    }
}

/// A length-prefixed field. Keys and values longer than 4 GiB cannot exist in etcd (1.5 MiB
/// requests), so the cast cannot truncate.
fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Where the records start in a file of `len` bytes that begins with `fixed` (its first
/// [`FIXED_HEADER`] bytes, or all of it if shorter), if magic, version, declared length and
/// that offset agree with the file's length. Nothing else is trusted before the checksum (see
/// [`PageReader`]).
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

/// A snapshot read a page of keys at a time, so that a warm start installs one page while
/// the next is read. Every field is checked to lie in bounds as it is read, but nothing is
/// trusted before [`PageReader::finish`] matched the checksum: a page handed out before then
/// is taken on approval, and dropped if the file turns out not to be the one written.
pub(super) struct PageReader<R> {
    input: R,
    /// The file's length, for errors.
    len: usize,
    header: Header,
    keys: usize,
    head: Arc<Vec<u8>>,
    /// Where the next key's record length is in the head...
    next_length: usize,
    /// ...and its index values.
    next_index: usize,
    /// Keys read so far.
    done: usize,
    /// Bytes of records not read yet.
    records_left: usize,
    head_sum: u64,
    records_sum: ValueDigest,
}

impl PageReader<File> {
    /// Opens the snapshot at `path` and reads its head.
    pub(super) fn open(path: &Path) -> Result<Self, SnapshotError> {
        let fail = |kind: SnapshotErrorKind| SnapshotError::new(path, kind);
        let io = |e: std::io::Error| SnapshotError::new(path, e.into());
        let file = File::open(path).map_err(io)?;
        let len = usize::try_from(file.metadata().map_err(io)?.len())
            .map_err(|_| fail(SnapshotErrorKind::Corrupt("larger than memory".into())))?;
        PageReader::new(file, len).map_err(fail)
    }
}

impl<R: Read> PageReader<R> {
    /// Reads the head of a snapshot of `len` bytes from `input`.
    fn new(mut input: R, len: usize) -> Result<Self, SnapshotErrorKind> {
        use SnapshotErrorKind as K;
        let mut head = Vec::new();
        read_more(&mut input, &mut head, FIXED_HEADER.min(len), len)?;
        let at = records_at(&head, len)?;
        read_more(&mut input, &mut head, at - FIXED_HEADER, len)?;
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
            // Each name takes at least its length's 4 bytes; and no informer has thousands
            // of indexes (names are collected before the checksum is known).
            if n as usize > (head.len() / 4).min(MAX_INDEXES) {
                return None;
            }
            (0..n).map(|_| r.string()).collect::<Option<Vec<_>>>()
        })()
        .ok_or_else(|| corrupt("the index names"))?;
        let records_left = len - 8 - at;
        // A count the file cannot hold is refused before anything is allocated for it.
        let fits = (head.len() / (KEY_HEAD + 4 * indexes.len())).min(records_left / MIN_RECORD);
        if keys > fits as u64 {
            return Err(K::Corrupt(format!(
                "{keys} keys cannot fit in {} bytes",
                head.len() + records_left
            )));
        }
        let lengths = r
            .take(keys as usize * 4)
            .ok_or_else(|| corrupt("the record lengths"))?;
        let head_sum = value_digest(&head);
        Ok(PageReader {
            input,
            len,
            header: Header {
                cluster_id,
                revision,
                prefix,
                codec_id,
                indexes,
            },
            keys: keys as usize,
            head: Arc::new(head),
            next_length: lengths.start,
            next_index: lengths.end,
            done: 0,
            records_left,
            head_sum,
            records_sum: ValueDigest::default(),
        })
    }

    /// What the snapshot says about itself (checked only once it is read to the end).
    pub(super) fn header(&self) -> &Header {
        &self.header
    }

    /// How many keys the header counts.
    pub(super) fn keys(&self) -> usize {
        self.keys
    }

    /// Reads the next `max` keys or fewer; `None` after the last.
    pub(super) fn next_page(&mut self, max: usize) -> Result<Option<Page>, SnapshotErrorKind> {
        use SnapshotErrorKind as K;
        let n = (self.keys - self.done).min(max);
        if n == 0 {
            return Ok(None);
        }
        let head = self.head.clone();
        let corrupt = |what: String| K::Corrupt(format!("{what} runs past the end of the file"));
        let lengths = self.next_length..self.next_length + 4 * n;
        let lengths: Vec<usize> = head[lengths]
            .chunks_exact(4)
            .map(|len| u32::from_le_bytes(len.try_into().unwrap_or_default()) as usize)
            .collect();
        let Some(size) = lengths
            .iter()
            .try_fold(0usize, |sum, len| sum.checked_add(*len))
            .filter(|size| *size <= self.records_left)
        else {
            let records = format!("the records of keys {}..{}", self.done, self.done + n);
            return Err(self.refused(corrupt(records)));
        };
        let mut records = Vec::new();
        read_more(&mut self.input, &mut records, size, self.len)?;
        self.records_sum.update(&records);
        self.records_left -= size;
        let r = &mut Reader {
            bytes: &head,
            at: self.next_index,
        };
        let mut entries = Vec::with_capacity(n);
        let mut at = 0usize;
        for (i, len) in lengths.into_iter().enumerate() {
            let entry = (|| {
                let record = at..at + len;
                let fields = parse_record(&records[record.clone()])?;
                let index = {
                    let start = r.at;
                    for _ in 0..self.header.indexes.len() {
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
            })();
            let Some(entry) = entry else {
                let (key, keys) = (self.done + i, self.keys);
                let kind = K::Corrupt(format!("key {key} of {keys} is cut short or not UTF-8"));
                return Err(self.refused(kind));
            };
            at = entry.record.end;
            entries.push(entry);
        }
        self.next_index = r.at;
        self.next_length += 4 * n;
        self.done += n;
        Ok(Some(Page {
            entries,
            records: Arc::new(records.into_boxed_slice()),
            head,
            indexes: self.header.indexes.len(),
        }))
    }

    /// Why the file is refused, `kind` having been found in it: a checksum that does not
    /// match, if it does not (the rest of the file is read to tell), says more than the field
    /// it garbled.
    fn refused(&mut self, kind: SnapshotErrorKind) -> SnapshotErrorKind {
        if self.records_left > MAX_DRAIN {
            // A file of a terabyte (sparse, say) is not read to the end to name its fault.
            return kind;
        }
        let mut rest = vec![0u8; 1 << 16];
        while self.records_left > 0 {
            let n = self.records_left.min(rest.len());
            if self.input.read_exact(&mut rest[..n]).is_err() {
                return kind;
            }
            self.records_sum.update(&rest[..n]);
            self.records_left -= n;
        }
        let mut stored = [0u8; 8];
        if self.input.read_exact(&mut stored).is_err() {
            return kind;
        }
        let stored = u64::from_le_bytes(stored);
        let computed = combine(
            self.head_sum,
            std::mem::take(&mut self.records_sum).finish(),
        );
        if stored != computed {
            return SnapshotErrorKind::Checksum { stored, computed };
        }
        kind
    }

    /// Checks, once every page was read, that nothing follows the last key and that the
    /// checksum matches: only then are the pages this file's as it was written.
    pub(super) fn finish(mut self) -> Result<(), SnapshotErrorKind> {
        use SnapshotErrorKind as K;
        if self.done != self.keys {
            return Err(K::Corrupt(format!(
                "it was read to key {} of {}",
                self.done, self.keys
            )));
        }
        if self.next_index != self.head.len() || self.records_left != 0 {
            let kind = K::Corrupt(format!(
                "{} bytes follow the last of {} keys",
                (self.head.len() - self.next_index) + self.records_left,
                self.keys
            ));
            return Err(self.refused(kind));
        }
        let mut stored = Vec::new();
        read_more(&mut self.input, &mut stored, 8, self.len)?;
        // The file is replaced by a rename, never written in place: more bytes mean another
        // writer.
        if self.input.read(&mut [0u8; 1])? != 0 {
            return Err(K::Corrupt(format!(
                "it grew past its {} bytes while it was read",
                self.len
            )));
        }
        let stored = u64::from_le_bytes(stored.try_into().unwrap_or_default());
        let computed = combine(self.head_sum, self.records_sum.finish());
        if stored != computed {
            return Err(K::Checksum { stored, computed });
        }
        Ok(())
    }
}

/// Appends the input's next `n` bytes to `buf`, allocated exactly (so that boxing it copies
/// nothing), and refused rather than aborting the process when it cannot be: a file's length
/// is not trusted before its checksum is checked. `len`: the file's length, for the error.
fn read_more(
    input: &mut impl Read,
    buf: &mut Vec<u8>,
    n: usize,
    len: usize,
) -> Result<(), SnapshotErrorKind> {
    buf.try_reserve_exact(n).map_err(|e| {
        SnapshotErrorKind::Corrupt(format!("{n} bytes of it cannot be allocated: {e}"))
    })?;
    let before = buf.len();
    // `read_to_end` fills the reserved room without zeroing it first.
    input.take(n as u64).read_to_end(buf)?;
    if buf.len() - before < n {
        return Err(SnapshotErrorKind::Truncated {
            len: len as u64,
            expected: None,
        });
    }
    Ok(())
}

/// A whole snapshot read and verified: its header and its pages.
#[cfg(test)]
pub(super) struct Loaded {
    pub(super) header: Header,
    pub(super) pages: Vec<Page>,
}

/// Reads and verifies the whole snapshot at `path`.
#[cfg(test)]
pub(super) fn read(path: &Path) -> Result<Loaded, SnapshotError> {
    let reader = PageReader::open(path)?;
    read_all(reader).map_err(|kind| SnapshotError::new(path, kind))
}

#[cfg(test)]
fn read_all<R: Read>(mut reader: PageReader<R>) -> Result<Loaded, SnapshotErrorKind> {
    let mut pages = Vec::new();
    // Small pages, so that the tests cross their boundaries.
    while let Some(page) = reader.next_page(1)? {
        pages.push(page);
    }
    let header = reader.header.clone();
    reader.finish()?;
    Ok(Loaded { header, pages })
}

/// Parses a whole file's bytes.
#[cfg(test)]
fn parse(bytes: Vec<u8>) -> Result<Loaded, SnapshotErrorKind> {
    let len = bytes.len();
    read_all(PageReader::new(std::io::Cursor::new(bytes), len)?)
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
    write_atomic_with(path, |file| {
        for part in parts {
            file.write_all(part)?;
        }
        Ok(())
    })
}

/// [`write_atomic`] of what `write` writes to the file.
pub(super) fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<(), SnapshotError> {
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
        write(&mut file)?;
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

    #[test]
    fn records_streamed_after_the_head_make_the_same_file() {
        let header = Header {
            cluster_id: 1,
            revision: 9,
            prefix: "/p/".into(),
            codec_id: "text".into(),
            indexes: vec!["namespace".into()],
        };
        let (mut buffered, mut streamed) = (Encoder::new(&header, 0), Encoder::new(&header, 0));
        let mut records = Vec::new();
        for (n, key) in [(1, "ns/a"), (2, "ns/b"), (3, "other/c")] {
            let index = [vec![key.split('/').next().unwrap_or_default()]];
            buffered.key(key, b"value", [n, n, 1, 0], 7, &index);
            let mut record = Vec::new();
            write_record(&mut record, key, [n, n, 1, 0], 7, 0, b"value");
            streamed.streamed(record.len(), &index);
            records.push(record);
        }
        let whole = buffered.finish().concat();
        let (head, lengths) = streamed.finish_streamed();
        let mut file = Vec::new();
        let mut out = RecordsWriter::new(&mut file, &head, lengths.clone()).expect("head");
        for record in &records {
            out.record(record).expect("record");
        }
        out.finish().expect("checksum");
        assert_eq!(file, whole);
        // A record short, one too many, or one of another length than the head gives: refused,
        // not a file whose head does not describe its records.
        let mut out = RecordsWriter::new(Vec::new(), &head, lengths.clone()).expect("head");
        out.record(&records[0]).expect("record");
        assert!(out.finish().is_err());
        let mut out = RecordsWriter::new(Vec::new(), &head, lengths.clone()).expect("head");
        for record in &records {
            out.record(record).expect("record");
        }
        assert!(out.record(&records[0]).is_err());
        let mut out = RecordsWriter::new(Vec::new(), &head, lengths).expect("head");
        assert!(
            out.record(&records[2]).is_err(),
            "ns/a's place, other/c's length"
        );
    }

    fn sample() -> Vec<u8> {
        let header = Header {
            cluster_id: 0xabc,
            revision: 42,
            prefix: "/p/".into(),
            codec_id: "json".into(),
            indexes: vec!["namespace".into(), "zone".into()],
        };
        let mut e = Encoder::new(&header, 0);
        let no_values: [Vec<String>; 2] = [vec![], vec![]];
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
        // A sparse file of 1 TiB whose header agrees with its length, and whose 255 records
        // say they take 4 GiB each: reading it must fail (its checksum cannot be checked
        // without reading it), never abort on allocation.
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("huge.snapshot");
        let header = Header {
            cluster_id: 1,
            revision: 2,
            prefix: "/p/".into(),
            codec_id: "json".into(),
            indexes: vec![],
        };
        let mut e = Encoder::new(&header, 0);
        for i in 0..255 {
            e.key(
                &format!("k{i}"),
                b"",
                [1, 1, 1, 0],
                0,
                &[] as &[Vec<String>],
            );
        }
        let [mut head, ..] = e.finish();
        let lengths = head.len() - 255 * 4;
        for length in head[lengths..].chunks_exact_mut(4) {
            length.copy_from_slice(&u32::MAX.to_le_bytes());
        }
        let len: u64 = 1 << 40;
        head[16..24].copy_from_slice(&len.to_le_bytes());
        let file = File::create(&path).expect("create");
        (&file).write_all(&head).expect("write");
        file.set_len(len).expect("sparse");
        let mut reader = PageReader::open(&path).expect("the head reads");
        let error = reader.next_page(usize::MAX).err().expect("refused");
        assert!(error.to_string().contains("cannot be allocated"), "{error}");

        // One good key, then a terabyte of nothing: refused at once, not read to the end to
        // see whether the checksum would have matched.
        let mut e = Encoder::new(&header, 0);
        e.key("k", b"v", [1, 1, 1, 0], 0, &[] as &[Vec<String>]);
        let [mut head, records, _] = e.finish();
        head[16..24].copy_from_slice(&len.to_le_bytes());
        let file = File::create(&path).expect("create");
        (&file).write_all(&head).expect("write");
        (&file).write_all(&records).expect("write");
        file.set_len(len).expect("sparse");
        let mut reader = PageReader::open(&path).expect("the head reads");
        assert!(reader.next_page(usize::MAX).expect("one key").is_some());
        assert!(reader.next_page(usize::MAX).expect("no more").is_none());
        let error = reader.finish().expect_err("refused");
        assert!(error.to_string().contains("follow the last"), "{error}");
    }

    #[test]
    fn a_pages_index_values_are_each_keys_own() {
        // Keys with no value, one, several, none again, in one page: each key's lists start
        // where the previous key's ended.
        let mut bytes = sample();
        let (a, b) = (vec!["ns".to_owned()], vec!["a".to_owned(), "b".to_owned()]);
        let mut e = Encoder::new(&parse(bytes.clone()).expect("parses").header, 0);
        let keys = [
            ("k0", [vec![], vec![]]),
            ("k1", [a.clone(), b.clone()]),
            ("k2", [b.clone(), vec![]]),
            ("k3", [vec![], a.clone()]),
        ];
        for (key, values) in &keys {
            e.key(key, b"v", [1, 1, 1, 0], 0, values);
        }
        bytes = e.finish().concat();
        let len = bytes.len();
        let mut reader = PageReader::new(std::io::Cursor::new(bytes), len).expect("parses");
        let page = reader
            .next_page(usize::MAX)
            .expect("reads")
            .expect("a page");
        let index = page.index();
        for (n, (key, values)) in keys.iter().enumerate() {
            let got: Vec<Vec<&str>> = index.of(n).iter().map(<[&str]>::to_vec).collect();
            assert_eq!(got, values.to_vec(), "{key}");
        }
        assert!(index.of(keys.len()).is_empty());
    }

    #[test]
    fn round_trip() {
        let loaded = parse(sample()).expect("parses");
        assert_eq!(loaded.header.revision, 42);
        assert_eq!(loaded.header.cluster_id, 0xabc);
        assert_eq!(loaded.header.prefix, "/p/");
        // One key a page (see `read_all`).
        assert_eq!(loaded.pages.len(), 2);
        let (a, b) = (&loaded.pages[0], &loaded.pages[1]);
        let e = &b.entries[0];
        assert_eq!(b.key(e), "ns/b");
        assert_eq!(b.value(e), b"22");
        assert_eq!(
            (
                e.mod_revision,
                e.create_revision,
                e.version,
                e.lease,
                e.digest
            ),
            (41, 41, 1, 7, u64::MAX)
        );
        let values = |page: &Page, n| -> Vec<Vec<String>> {
            let index = page.index();
            let values = index.of(n).iter().map(|v| v.iter().map(|s| s.to_string()));
            values.map(Iterator::collect).collect()
        };
        assert_eq!(values(b, 0), [vec!["ns"], vec!["a", "b"]]);
        assert_eq!(values(a, 0), vec![Vec::<String>::new(); 2]);
        assert_eq!(a.key(&a.entries[0]), "ns/a");
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
            let kind = parse(bad).err().expect("refused");
            // A record garbled is read as a checksum that does not match, not as the field
            // it garbled (the pages before it were handed on: the checksum is what says why
            // they are dropped).
            let at = records_at(&bytes[..FIXED_HEADER], bytes.len()).expect("whole");
            if i >= at {
                assert!(
                    matches!(kind, SnapshotErrorKind::Checksum { .. }),
                    "byte {i} flipped: {kind}"
                );
            }
        }
    }
}
