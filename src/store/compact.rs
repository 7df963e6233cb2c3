//! The compact representation: each cached object packed into one allocation holding its key,
//! its revisions as varints and its value encoded by the codec, decoded again on every read.
//!
//! Layout of a record: `[flags][len(key)][key][mod_revision][create_revision][version][lease]
//! [value]`, numbers as LEB128 varints (negative ones take ten bytes). With the `WHOLE` flag the
//! record has no value: the object could not be packed (its value did not encode, or did not
//! decode back) and is kept decoded beside the table.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::table::Repr;
use crate::codec::Codec;
use crate::Object;

const WHOLE: u8 = 1;

/// One packed object, hashed and compared by its key.
#[derive(Clone)]
pub(super) struct Packed(Arc<[u8]>);

impl Packed {
    fn key(&self) -> &str {
        let (len, at) = read_varint(&self.0, 1);
        let key = self.0.get(at..at + len as usize).unwrap_or_default();
        // Records are built from a `&str` key, so this never fails; an empty key would only
        // make a lookup miss.
        std::str::from_utf8(key).unwrap_or_default()
    }

    /// Where the revisions start.
    fn after_key(&self) -> usize {
        let (len, at) = read_varint(&self.0, 1);
        at + len as usize
    }

    fn whole(&self) -> bool {
        self.0.first().is_some_and(|f| f & WHOLE != 0)
    }

    /// `[mod_revision, create_revision, version, lease]` and where the value starts.
    fn revisions(&self) -> ([i64; 4], usize) {
        let mut at = self.after_key();
        let mut out = [0; 4];
        for v in &mut out {
            let (n, next) = read_varint(&self.0, at);
            *v = n as i64;
            at = next;
        }
        (out, at)
    }
}

impl PartialEq for Packed {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
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

/// Packs objects with a codec; keeps the few that cannot be packed decoded, by key.
pub(super) struct PackedRepr<T> {
    codec: Arc<dyn Codec<T>>,
    whole: HashMap<Arc<str>, Arc<Object<T>>>,
}

impl<T> PackedRepr<T> {
    pub(super) fn new(codec: Arc<dyn Codec<T>>) -> Self {
        PackedRepr {
            codec,
            whole: HashMap::new(),
        }
    }

    fn record(obj: &Object<T>, flags: u8, value: &[u8]) -> Packed {
        let mut out = Vec::with_capacity(1 + 5 + obj.key().len() + 4 * 5 + value.len());
        out.push(flags);
        write_varint(&mut out, obj.key().len() as u64);
        out.extend_from_slice(obj.key().as_bytes());
        for n in [
            obj.mod_revision,
            obj.create_revision,
            obj.version,
            obj.lease,
        ] {
            write_varint(&mut out, n as u64);
        }
        out.extend_from_slice(value);
        Packed(Arc::from(out))
    }
}

impl<T> Clone for PackedRepr<T> {
    fn clone(&self) -> Self {
        PackedRepr {
            codec: self.codec.clone(),
            whole: self.whole.clone(),
        }
    }
}

impl<T: Send + Sync + 'static> Repr<T> for PackedRepr<T> {
    type Slot = Packed;

    fn pack(&mut self, obj: &Arc<Object<T>>) -> Packed {
        // A value that does not come back as it went in would fail on the first read; it is
        // cheaper to find out now, once, than to have a read lose an object.
        let problem = match self.codec.encode(&obj.value) {
            Ok(bytes) => match self.codec.decode(&bytes) {
                Ok(_) => {
                    self.whole.remove(obj.key());
                    return Self::record(obj, 0, &bytes);
                }
                Err(e) => format!("its encoded value does not decode: {e}"),
            },
            Err(e) => format!("its value does not encode: {e}"),
        };
        if self.whole.is_empty() {
            tracing::warn!(
                key = obj.key(),
                problem,
                "compact cache: an object is kept decoded (more may follow, logged at debug)"
            );
        } else {
            tracing::debug!(key = obj.key(), problem, "compact cache: kept decoded");
        }
        self.whole.insert(obj.shared_key().clone(), obj.clone());
        Self::record(obj, WHOLE, &[])
    }

    fn unpack(&self, slot: &Packed) -> Option<Arc<Object<T>>> {
        if slot.whole() {
            return self.whole.get(slot.key()).cloned();
        }
        let ([mod_revision, create_revision, version, lease], at) = slot.revisions();
        let bytes = slot.0.get(at..).unwrap_or_default();
        match self.codec.decode(bytes) {
            Ok(value) => {
                let mut obj = Object::new(slot.key(), mod_revision, value);
                obj.create_revision = create_revision;
                obj.version = version;
                obj.lease = lease;
                Some(Arc::new(obj))
            }
            Err(e) => {
                // It decoded when packed: only a codec that changed its mind gets here.
                tracing::error!(key = slot.key(), error = %e, "compact cache: a packed value no longer decodes");
                None
            }
        }
    }

    fn mod_revision(&self, slot: &Packed) -> i64 {
        read_varint(&slot.0, slot.after_key()).0 as i64
    }

    fn shared_key(&self, slot: &Packed) -> Arc<str> {
        Arc::from(slot.key())
    }

    fn release(&mut self, slot: &Packed) {
        if slot.whole() {
            self.whole.remove(slot.key());
        }
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
    fn varints_round_trip_including_negative_and_large() {
        for n in [0i64, 1, 127, 128, 300, 1 << 40, i64::MAX, -1, i64::MIN] {
            let mut out = vec![9];
            write_varint(&mut out, n as u64);
            let (back, at) = read_varint(&out, 1);
            assert_eq!((back as i64, at), (n, out.len()), "{n}");
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
        let slot = repr.pack(&obj);
        assert!(!slot.whole());
        assert_eq!(Borrow::<str>::borrow(&slot), "ns/é-key");
        assert_eq!(repr.mod_revision(&slot), 1 << 33);
        assert_eq!(repr.unpack(&slot).as_deref(), Some(&*obj));

        for value in [13, 7] {
            let obj = Arc::new(Object::new(format!("ns/{value}"), 9, value));
            let slot = repr.pack(&obj);
            assert!(slot.whole(), "{value} cannot be packed");
            let back = repr.unpack(&slot).expect("kept whole");
            assert!(Arc::ptr_eq(&back, &obj));
            assert_eq!(repr.mod_revision(&slot), 9);
            // Packing the key again with a good value drops the whole copy.
            repr.pack(&Arc::new(Object::new(format!("ns/{value}"), 10, 1)));
            assert!(!repr.whole.contains_key(obj.key()));
        }
    }
}
