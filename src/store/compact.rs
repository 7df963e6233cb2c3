//! The compact representation: each cached object packed as one record holding its key, its
//! revisions as varints and its value encoded by the codec, decoded again on every read.
//!
//! Layout of a record: `[flags][len(key)][key][mod_revision][create_revision][version][lease]
//! [digest][value]`, numbers as LEB128 varints (negative ones take ten bytes) but the digest of
//! the value's bytes as etcd stored them ([`Object::stamp`]), 8 bytes. With the `WHOLE` flag the
//! value is replaced by an id: the object could not be packed (its value did not encode, or did
//! not decode back) and is kept decoded beside the table under that id.
//!
//! The records of a list page share one chunk (one allocation): records allocated one by one
//! between the page's short-lived decoded objects would pin most of the heap's pages, several
//! times their own size. A chunk is freed when its last record goes. The table copies its
//! records into fresh chunks once the chunks hold more dead bytes than live ones, or once the
//! records stored one by one (watch events) outweigh the packed ones: amortized, each record is
//! copied a few times at most, and the store stays as dense as after a list.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::table::Repr;
use crate::codec::Codec;
use crate::object::EncodedObject;
use crate::object::Object;
use crate::object::Stamp;

const WHOLE: u8 = 1;

/// The size of the chunks a repack fills, and the dead bytes worth a repack (small in unit
/// tests, so that small stores repack).
const REPACK_CHUNK: usize = if cfg!(test) { 256 } else { 1 << 20 };

/// The most a page's chunk grows to before another is started (offsets are `u32`).
const MAX_CHUNK: usize = 64 << 20;

/// The largest value packed (etcd's own limit is far lower); a larger one is kept decoded.
const MAX_VALUE: usize = 1 << 30;

/// Whether a record of `len` bytes, alone in its allocation, counts as loose: allocated among
/// whatever else the process allocated then. A record as large as a repack chunk is a chunk.
fn loose(len: usize) -> bool {
    len < REPACK_CHUNK
}

/// One packed object: a record in a chunk, hashed and compared by its key.
#[derive(Clone)]
pub(super) struct Packed {
    chunk: Arc<Box<[u8]>>,
    at: u32,
    len: u32,
}

impl Packed {
    fn bytes(&self) -> &[u8] {
        let at = self.at as usize;
        self.chunk
            .get(at..at + self.len as usize)
            .unwrap_or_default()
    }

    /// Whether `other` is in the same chunk.
    #[cfg(test)]
    pub(super) fn same_chunk(&self, other: &Packed) -> bool {
        Arc::ptr_eq(&self.chunk, &other.chunk)
    }

    /// Whether other records share the chunk (only those count towards a repack).
    pub(super) fn shares_chunk(&self) -> bool {
        self.chunk.len() > self.len as usize
    }

    fn key(&self) -> &str {
        // Records are built from a `&str` key, so this never fails; an empty key would only
        // make a lookup miss.
        std::str::from_utf8(self.key_bytes()).unwrap_or_default()
    }

    fn key_bytes(&self) -> &[u8] {
        let bytes = self.bytes();
        let (len, at) = read_varint(bytes, 1);
        bytes.get(at..at + len as usize).unwrap_or_default()
    }

    /// Where the revisions start.
    fn after_key(&self) -> usize {
        let (len, at) = read_varint(self.bytes(), 1);
        at + len as usize
    }

    fn whole(&self) -> bool {
        self.bytes().first().is_some_and(|f| f & WHOLE != 0)
    }

    /// `[mod_revision, create_revision, version, lease]`, the digest, and where the value
    /// starts.
    fn revisions(&self) -> ([i64; 4], u64, usize) {
        let bytes = self.bytes();
        let mut at = self.after_key();
        let mut out = [0; 4];
        for v in &mut out {
            let (n, next) = read_varint(bytes, at);
            *v = n as i64;
            at = next;
        }
        let mut digest = [0; 8];
        if let Some(d) = bytes.get(at..at + 8) {
            digest.copy_from_slice(d);
        }
        (out, u64::from_le_bytes(digest), at + 8)
    }

    /// The id of a `WHOLE` record's object.
    fn whole_id(&self) -> u64 {
        let (_, _, at) = self.revisions();
        read_varint(self.bytes(), at).0
    }
}

impl PartialEq for Packed {
    fn eq(&self, other: &Self) -> bool {
        // The same as comparing the keys as `str` (records are made from a `str` key, or
        // checked to hold one), without checking each is UTF-8 again: a hash set's insert
        // compares a slot with every slot of the same hash tag.
        self.key_bytes() == other.key_bytes()
    }
}

impl Eq for Packed {}

impl Hash for Packed {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state)
    }
}

impl Borrow<str> for Packed {
    fn borrow(&self) -> &str {
        self.key()
    }
}

fn write_varint(out: &mut Vec<u8>, mut n: u64) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The varint at `at` and the position after it; a truncated one reads as what it has.
fn read_varint(bytes: &[u8], mut at: usize) -> (u64, usize) {
    let mut n = 0u64;
    let mut shift = 0;
    while let Some(&byte) = bytes.get(at) {
        at += 1;
        if shift < 64 {
            n |= u64::from(byte & 0x7f) << shift;
        }
        shift += 7;
        if byte & 0x80 == 0 {
            break;
        }
    }
    (n, at)
}

/// The varint at `at` and the position after it, or `None` if it runs past the end or past
/// ten bytes (read as [`read_varint`] reads it).
fn strict_varint(bytes: &[u8], at: usize) -> Option<(u64, usize)> {
    let end = bytes.iter().skip(at).take(10).position(|b| b & 0x80 == 0)?;
    Some(read_varint(&bytes[..at + end + 1], at))
}

/// The fields of a record read from outside (a snapshot file): ranges within the record.
pub(crate) struct RecordFields {
    pub(crate) key: std::ops::Range<usize>,
    pub(crate) revisions: [i64; 4],
    pub(crate) digest: u64,
    pub(crate) value: std::ops::Range<usize>,
    /// The key's [`key_hash`](super::key_hash).
    pub(crate) key_hash: u64,
}

/// Reads a record as [`write_record`] wrote it with no flags (a `WHOLE` record's id means
/// nothing outside its table); `None` if it does not hold together or its key is not UTF-8.
/// A record that passes reads the same through [`Packed`].
pub(crate) fn parse_record(bytes: &[u8]) -> Option<RecordFields> {
    if *bytes.first()? != 0 {
        return None;
    }
    let (len, at) = strict_varint(bytes, 1)?;
    let key = at..at.checked_add(usize::try_from(len).ok()?)?;
    let key_hash = super::key_hash(std::str::from_utf8(bytes.get(key.clone())?).ok()?);
    let mut at = key.end;
    let mut revisions = [0; 4];
    for r in &mut revisions {
        let (n, next) = strict_varint(bytes, at)?;
        *r = n as i64;
        at = next;
    }
    let digest = u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?);
    Some(RecordFields {
        key,
        revisions,
        digest,
        value: at + 8..bytes.len(),
        key_hash,
    })
}

/// Records written into one buffer, then frozen into a chunk.
#[derive(Default)]
struct ChunkWriter {
    buf: Vec<u8>,
    spans: Vec<(u32, u32)>,
}

impl ChunkWriter {
    /// Appends a record, built by `write`.
    fn record(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.buf.len();
        write(&mut self.buf);
        self.spans
            .push((start as u32, (self.buf.len() - start) as u32));
    }

    /// The chunk's records; the chunk's size and how many records share it.
    fn finish(&mut self, out: &mut Vec<Packed>) -> (usize, usize) {
        if self.spans.is_empty() {
            return (0, 0);
        }
        let chunk = Arc::new(std::mem::take(&mut self.buf).into_boxed_slice());
        let size = chunk.len();
        let records = self.spans.len();
        out.extend(self.spans.drain(..).map(|(at, len)| Packed {
            chunk: chunk.clone(),
            at,
            len,
        }));
        (size, records)
    }
}

/// Packs objects with a codec; keeps the few that cannot be packed decoded, by id.
pub(super) struct PackedRepr<T> {
    codec: Arc<dyn Codec<T>>,
    whole: HashMap<u64, Arc<Object<T>>>,
    next_id: u64,
    /// Bytes of the shared chunks made since the last repack, and of their live records.
    chunk_bytes: usize,
    chunk_live: usize,
    /// Bytes of the live records allocated one by one (watch events, the DeltaFIFO's adds).
    loose: usize,
    /// The chunks of other tables that records were adopted from (by address), each counted
    /// once in `chunk_bytes`.
    adopted: HashSet<usize>,
}

impl<T> PackedRepr<T> {
    pub(super) fn new(codec: Arc<dyn Codec<T>>) -> Self {
        PackedRepr {
            codec,
            whole: HashMap::new(),
            next_id: 0,
            chunk_bytes: 0,
            chunk_live: 0,
            loose: 0,
            adopted: HashSet::new(),
        }
    }
}

impl<T: Send + Sync + 'static> PackedRepr<T> {
    /// The record's flags and value for `obj`: its encoded value, or the id it is kept
    /// decoded under. Calls `seen` with the object as reads will see it.
    fn encode(&mut self, obj: &Arc<Object<T>>, seen: &mut dyn FnMut(&Object<T>)) -> (u8, Vec<u8>) {
        // A value that does not come back would fail on the first read; it is cheaper to find
        // out now, once, than to have a read lose an object. What comes back is what reads
        // will see (a field the codec does not write comes back as its default), so it is what
        // the indexes must see too.
        let problem = match self.codec.encode(&obj.value) {
            Ok(bytes) if bytes.len() > MAX_VALUE => {
                format!("its encoded value has {} bytes", bytes.len())
            }
            Ok(bytes) => match self.codec.decode(&bytes) {
                Ok(value) => {
                    let mut back = Object::new(obj.shared_key().clone(), obj.mod_revision, value);
                    back.create_revision = obj.create_revision;
                    back.version = obj.version;
                    back.lease = obj.lease;
                    let back = back.with_digest(obj.digest());
                    seen(&back);
                    return (0, bytes);
                }
                Err(e) => format!("its encoded value does not decode: {e}"),
            },
            Err(e) => format!("its value does not encode: {e}"),
        };
        seen(obj);
        if self.whole.is_empty() {
            tracing::warn!(
                key = obj.key(),
                problem,
                "compact cache: an object is kept decoded (more may follow, logged at debug)"
            );
        } else {
            tracing::debug!(key = obj.key(), problem, "compact cache: kept decoded");
        }
        let id = self.next_id;
        self.next_id += 1;
        self.whole.insert(id, obj.clone());
        let mut value = Vec::new();
        write_varint(&mut value, id);
        (WHOLE, value)
    }

    /// Packs records `0..n` into chunks of at most [`MAX_CHUNK`] bytes (a larger record
    /// alone), each allocated once at its size: `len(i)` is record `i`'s size, `write(i, buf)`
    /// writes it.
    fn pack_records(
        &mut self,
        n: usize,
        len: impl Fn(usize) -> usize,
        mut write: impl FnMut(usize, &mut Vec<u8>),
    ) -> Vec<Packed> {
        let mut out = Vec::with_capacity(n);
        let mut start = 0;
        while start < n {
            let (mut end, mut size) = (start, 0);
            while end < n {
                let len = len(end);
                if end > start && size + len > MAX_CHUNK {
                    break;
                }
                size += len;
                end += 1;
            }
            let mut writer = ChunkWriter {
                buf: Vec::with_capacity(size),
                spans: Vec::with_capacity(end - start),
            };
            for i in start..end {
                writer.record(|buf| write(i, buf));
            }
            let chunk = writer.finish(&mut out);
            self.count(chunk);
            start = end;
        }
        out
    }

    /// Accounts for a chunk of `size` bytes holding `records` records.
    fn count(&mut self, (size, records): (usize, usize)) {
        if records == 1 && loose(size) {
            self.loose += size;
        } else {
            self.chunk_bytes += size;
            self.chunk_live += size;
        }
    }
}

fn varint_len(n: u64) -> usize {
    (64 - n.leading_zeros() as usize).div_ceil(7).max(1)
}

fn revisions_of<T>(obj: &Object<T>) -> [i64; 4] {
    [
        obj.mod_revision,
        obj.create_revision,
        obj.version,
        obj.lease,
    ]
}

/// The size of the record of a key of `key_len` bytes, at `revisions`, with a value of
/// `value_len` bytes.
fn record_len(key_len: usize, revisions: [i64; 4], value_len: usize) -> usize {
    let revisions: usize = revisions.iter().map(|&n| varint_len(n as u64)).sum();
    1 + varint_len(key_len as u64) + key_len + revisions + 8 + value_len
}

/// Writes a record in the layout above (a snapshot file holds its records so too).
pub(crate) fn write_record(
    out: &mut Vec<u8>,
    key: &str,
    revisions: [i64; 4],
    digest: u64,
    flags: u8,
    value: &[u8],
) {
    out.reserve(record_len(key.len(), revisions, value.len()));
    out.push(flags);
    write_varint(out, key.len() as u64);
    out.extend_from_slice(key.as_bytes());
    for n in revisions {
        write_varint(out, n as u64);
    }
    out.extend_from_slice(&digest.to_le_bytes());
    out.extend_from_slice(value);
}

impl<T> Clone for PackedRepr<T> {
    fn clone(&self) -> Self {
        PackedRepr {
            codec: self.codec.clone(),
            whole: self.whole.clone(),
            next_id: self.next_id,
            chunk_bytes: self.chunk_bytes,
            chunk_live: self.chunk_live,
            loose: self.loose,
            adopted: self.adopted.clone(),
        }
    }
}

impl<T: Send + Sync + 'static> Repr<T> for PackedRepr<T> {
    type Slot = Packed;

    fn pack(&mut self, obj: &Arc<Object<T>>, seen: &mut dyn FnMut(&Object<T>)) -> Packed {
        let (flags, value) = self.encode(obj, seen);
        let mut buf = Vec::new();
        write_record(
            &mut buf,
            obj.key(),
            revisions_of(obj),
            obj.digest(),
            flags,
            &value,
        );
        self.count((buf.len(), 1));
        let len = buf.len() as u32;
        Packed {
            chunk: Arc::new(buf.into_boxed_slice()),
            at: 0,
            len,
        }
    }

    fn pack_all(
        &mut self,
        objs: &[Arc<Object<T>>],
        seen: &mut dyn FnMut(usize, &Object<T>),
    ) -> Vec<Packed> {
        // Every value is encoded first, so that each chunk is allocated once, at its size.
        let mut values = Vec::with_capacity(objs.len());
        for (i, obj) in objs.iter().enumerate() {
            values.push(self.encode(obj, &mut |o| seen(i, o)));
        }
        self.pack_records(
            objs.len(),
            |i| {
                record_len(
                    objs[i].key().len(),
                    revisions_of(&objs[i]),
                    values[i].1.len(),
                )
            },
            |i, buf| {
                let (obj, (flags, value)) = (&objs[i], &values[i]);
                write_record(
                    buf,
                    obj.key(),
                    revisions_of(obj),
                    obj.digest(),
                    *flags,
                    value,
                )
            },
        )
    }

    fn unpack(&self, slot: &Packed) -> Option<Arc<Object<T>>> {
        if slot.whole() {
            return self.whole.get(&slot.whole_id()).cloned();
        }
        let ([mod_revision, create_revision, version, lease], digest, at) = slot.revisions();
        let bytes = slot.bytes().get(at..).unwrap_or_default();
        match self.codec.decode(bytes) {
            Ok(value) => {
                let mut obj = Object::new(slot.key(), mod_revision, value);
                obj.create_revision = create_revision;
                obj.version = version;
                obj.lease = lease;
                Some(Arc::new(obj.with_digest(digest)))
            }
            Err(e) => {
                // It decoded when packed: only a codec that changed its mind gets here.
                tracing::error!(key = slot.key(), error = %e, "compact cache: a packed value no longer decodes");
                None
            }
        }
    }

    fn mod_revision(&self, slot: &Packed) -> i64 {
        read_varint(slot.bytes(), slot.after_key()).0 as i64
    }

    fn record<'a>(&self, slot: &'a Packed) -> Option<&'a [u8]> {
        // Flags 0 only: a file's reader refuses any other.
        let bytes = slot.bytes();
        (bytes.first() == Some(&0)).then_some(bytes)
    }

    fn stamp(&self, slot: &Packed) -> Option<Stamp> {
        let ([mod_revision, create_revision, version, _], digest, _) = slot.revisions();
        (digest != 0).then_some(Stamp {
            mod_revision,
            create_revision,
            version,
            digest,
        })
    }

    fn shared_key(&self, slot: &Packed) -> Arc<str> {
        Arc::from(slot.key())
    }

    fn release(&mut self, slot: &Packed) {
        let len = slot.len as usize;
        if !slot.shares_chunk() && loose(len) {
            self.loose = self.loose.saturating_sub(len);
        } else {
            self.chunk_live = self.chunk_live.saturating_sub(len);
        }
        if slot.whole() {
            self.whole.remove(&slot.whole_id());
        }
    }

    fn adopt(&mut self, slot: &Packed) -> Option<Packed> {
        if slot.whole() {
            // Its object lives in the other table's map, under that table's id.
            return None;
        }
        let len = slot.len as usize;
        if !slot.shares_chunk() && loose(len) {
            self.loose += len;
        } else {
            // The whole chunk stays allocated while any record of it lives: count all of it,
            // so that a table holding a few records of many chunks repacks.
            if self.adopted.insert(Arc::as_ptr(&slot.chunk) as usize) {
                self.chunk_bytes += slot.chunk.len();
            }
            self.chunk_live += len;
        }
        Some(slot.clone())
    }

    fn needs_repack(&self) -> bool {
        // Dead bytes in chunks outweigh live ones, or records allocated one by one (each
        // between whatever else the process allocated then) outweigh the packed ones.
        self.chunk_bytes > 2 * self.chunk_live + REPACK_CHUNK
            || self.loose > self.chunk_live + REPACK_CHUNK
    }

    fn repack(&mut self, slots: Vec<Packed>) -> Vec<Packed> {
        let mut out = Vec::with_capacity(slots.len());
        let mut writer = ChunkWriter::default();
        self.chunk_bytes = 0;
        self.chunk_live = 0;
        self.loose = 0;
        self.adopted.clear();
        for slot in &slots {
            writer.record(|buf| buf.extend_from_slice(slot.bytes()));
            if writer.buf.len() >= REPACK_CHUNK {
                let chunk = writer.finish(&mut out);
                self.count(chunk);
            }
        }
        let chunk = writer.finish(&mut out);
        self.count(chunk);
        out
    }

    fn codec_name(&self) -> Option<&'static str> {
        Some(self.codec.name())
    }

    fn decode_encoded(&self, encoded: &EncodedObject<'_>) -> Option<Object<T>> {
        let value = self.codec.decode(encoded.value).ok()?;
        let [mod_revision, create_revision, version, lease] = encoded.revisions;
        let mut obj = Object::new(encoded.key, mod_revision, value);
        obj.create_revision = create_revision;
        obj.version = version;
        obj.lease = lease;
        Some(obj.with_digest(encoded.digest))
    }

    fn pack_encoded(&mut self, objs: &[EncodedObject<'_>]) -> Option<Vec<Packed>> {
        if let Some(shared) = objs.iter().map(|o| o.record).collect::<Option<Vec<_>>>() {
            // Already records of this layout, in a buffer the table can keep (a snapshot
            // file's): shared, not copied. The buffer holds nothing but records, which come a
            // page at a time: each counts as its own bytes of a chunk (counting the whole
            // buffer with the first page would make every page look mostly dead, and repack).
            return Some(
                shared
                    .into_iter()
                    .map(|r| {
                        let slot = Packed {
                            chunk: r.buffer.clone(),
                            at: r.at,
                            len: r.len,
                        };
                        // As `release` will take it back: a buffer of one small record is
                        // loose.
                        let len = r.len as usize;
                        if !slot.shares_chunk() && loose(len) {
                            self.loose += len;
                        } else {
                            self.chunk_bytes += len;
                            self.chunk_live += len;
                        }
                        slot
                    })
                    .collect(),
            );
        }
        Some(self.pack_records(
            objs.len(),
            |i| record_len(objs[i].key.len(), objs[i].revisions, objs[i].value.len()),
            |i, buf| {
                let o = &objs[i];
                write_record(buf, o.key, o.revisions, o.digest, 0, o.value)
            },
        ))
    }

    fn empty(&self) -> Self {
        PackedRepr::new(self.codec.clone())
    }

    fn packed(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::CodecError;
    use crate::object::SharedRecord;

    /// Encodes `u32`s as decimal text; refuses to encode 13 and to decode "7".
    struct Picky;

    impl Codec<u32> for Picky {
        fn decode(&self, bytes: &[u8]) -> Result<u32, CodecError> {
            let text = std::str::from_utf8(bytes)?;
            if text == "7" {
                return Err("seven".into());
            }
            Ok(text.parse()?)
        }
        fn encode(&self, value: &u32) -> Result<Vec<u8>, CodecError> {
            if *value == 13 {
                return Err("thirteen".into());
            }
            Ok(value.to_string().into_bytes())
        }
    }

    #[test]
    fn a_page_shares_one_chunk_and_a_repack_drops_the_dead_bytes() {
        let mut repr = PackedRepr::<u32>::new(Arc::new(Picky));
        let objs: Vec<_> = (0..400u32)
            .map(|i| {
                Arc::new(Object::new(
                    format!("ns/{i:0>64}"),
                    i64::from(i) + 1,
                    i + 100,
                ))
            })
            .collect();
        let slots = repr.pack_all(&objs, &mut |_, _| {});
        assert!(slots.iter().all(|s| s.same_chunk(&slots[0])));
        for (slot, obj) in slots.iter().zip(&objs) {
            assert_eq!(repr.unpack(slot).as_deref(), Some(&**obj));
        }
        assert!(!repr.needs_repack());
        let (dead, live) = slots.split_at(300);
        for slot in dead {
            repr.release(slot);
        }
        assert!(repr.needs_repack(), "three quarters of the chunk are dead");
        let repacked = repr.repack(live.to_vec());
        assert!(!repr.needs_repack());
        assert!(!repacked[0].same_chunk(&slots[0]));
        for (slot, obj) in repacked.iter().zip(&objs[300..]) {
            assert_eq!(repr.unpack(slot).as_deref(), Some(&**obj));
        }
    }

    #[test]
    fn records_as_large_as_a_repack_chunk_do_not_repack_forever() {
        let mut repr = PackedRepr::<u32>::new(Arc::new(Picky));
        let slots: Vec<Packed> = (0..20u32)
            .map(|i| {
                let key = format!("ns/{i:0>300}");
                repr.pack(&Arc::new(Object::new(key, 1, i)), &mut |_| {})
            })
            .collect();
        assert!(slots.iter().all(|s| s.len as usize >= REPACK_CHUNK));
        assert!(
            !repr.needs_repack(),
            "large records are chunks of their own"
        );
        let repacked = repr.repack(slots);
        assert!(!repr.needs_repack(), "a repack leaves nothing to repack");
        for slot in &repacked[..10] {
            repr.release(slot);
        }
        assert!(!repr.needs_repack(), "half dead is not worth a repack");
    }

    #[test]
    fn varints_round_trip_including_negative_and_large() {
        for n in [0i64, 1, 127, 128, 300, 1 << 40, i64::MAX, -1, i64::MIN] {
            let mut out = vec![9];
            write_varint(&mut out, n as u64);
            let (back, at) = read_varint(&out, 1);
            assert_eq!((back as i64, at), (n, out.len()), "{n}");
            assert_eq!(varint_len(n as u64), out.len() - 1, "{n}");
        }
        // Truncated input does not panic.
        assert_eq!(read_varint(&[0x80], 0), (0, 1));
        assert_eq!(read_varint(&[], 0), (0, 0));
    }

    #[test]
    fn packs_every_field_and_keeps_unpackable_values_whole() {
        let mut repr = PackedRepr::<u32>::new(Arc::new(Picky));
        let mut obj = Object::new("ns/é-key", 1 << 33, 42);
        obj.create_revision = 5;
        obj.version = 300;
        obj.lease = -4;
        let obj = Arc::new(obj);
        let mut seen = None;
        let slot = repr.pack(&obj, &mut |o| seen = Some(o.clone()));
        assert!(!slot.whole());
        assert_eq!(seen.as_ref(), Some(&*obj), "what reads will see");
        assert_eq!(Borrow::<str>::borrow(&slot), "ns/é-key");
        assert_eq!(repr.mod_revision(&slot), 1 << 33);
        assert_eq!(repr.unpack(&slot).as_deref(), Some(&*obj));

        for value in [13, 7] {
            let obj = Arc::new(Object::new(format!("ns/{value}"), 9, value));
            let mut seen = None;
            let slot = repr.pack(&obj, &mut |o| seen = Some(o.clone()));
            assert!(slot.whole(), "{value} cannot be packed");
            assert_eq!(seen.as_ref(), Some(&*obj), "kept as it is");
            let back = repr.unpack(&slot).expect("kept whole");
            assert!(Arc::ptr_eq(&back, &obj));
            assert_eq!(repr.mod_revision(&slot), 9);
            // Its slot leaving the table drops the whole copy.
            repr.release(&slot);
            assert!(repr.whole.is_empty());
        }
    }

    #[test]
    fn a_record_read_from_outside_reads_as_the_table_reads_it() {
        let mut bytes = Vec::new();
        write_record(&mut bytes, "ns/a", [7, -3, 2, 1 << 40], 0xfeed, 0, b"value");
        let fields = parse_record(&bytes).expect("parses");
        let slot = Packed {
            chunk: Arc::new(bytes.clone().into_boxed_slice()),
            at: 0,
            len: bytes.len() as u32,
        };
        assert_eq!(&bytes[fields.key.clone()], slot.key().as_bytes());
        let (revisions, digest, value_at) = slot.revisions();
        assert_eq!(
            (fields.revisions, fields.digest, fields.value.start),
            (revisions, digest, value_at)
        );
        assert_eq!(&bytes[fields.value], b"value");
        // Cut anywhere before the value, it does not hold together.
        for len in 0..value_at {
            assert!(parse_record(&bytes[..len]).is_none(), "cut at {len}");
        }
        // A record kept decoded by its table has no value to read.
        let mut whole = bytes.clone();
        whole[0] = WHOLE;
        assert!(parse_record(&whole).is_none());
        // A key that is not UTF-8.
        let mut bad = bytes;
        bad[fields.key.start] = 0xff;
        assert!(parse_record(&bad).is_none());
    }

    #[test]
    fn shared_records_are_kept_without_a_copy_and_counted_as_they_come() {
        let mut bytes = Vec::new();
        let mut spans = Vec::new();
        let keys: Vec<String> = (0..1000).map(|i| format!("ns/{i}")).collect();
        let values: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
        for (key, value) in keys.iter().zip(&values) {
            let at = bytes.len();
            write_record(&mut bytes, key, [5, 5, 1, 0], 0, 0, value.as_bytes());
            spans.push((key, value, at, bytes.len() - at));
        }
        let buffer = Arc::new(bytes.into_boxed_slice());
        let objs: Vec<_> = spans
            .iter()
            .map(|&(key, value, at, len)| EncodedObject {
                key,
                value: value.as_bytes(),
                revisions: [5, 5, 1, 0],
                digest: 0,
                index: Default::default(),
                record: Some(SharedRecord {
                    buffer: &buffer,
                    at: at as u32,
                    len: len as u32,
                    key_hash: crate::store::key_hash(key),
                }),
            })
            .collect();
        let mut repr = PackedRepr::<u32>::new(Arc::new(Picky));
        // The first page of the buffer is no reason to repack, however much of it is to come.
        let first = repr.pack_encoded(&objs[..10]).expect("packed");
        assert!(!repr.needs_repack());
        let rest = repr.pack_encoded(&objs[10..]).expect("packed");
        assert!(first
            .iter()
            .chain(&rest)
            .all(|s| Arc::ptr_eq(&s.chunk, &buffer)));
        let values: Vec<_> = rest[..2]
            .iter()
            .map(|s| repr.unpack(s).map(|o| o.value))
            .collect();
        assert_eq!(values, [Some(10), Some(11)]);
        assert_eq!(
            (repr.chunk_bytes, repr.chunk_live),
            (buffer.len(), buffer.len())
        );
        assert!(!repr.needs_repack());
    }
}
