//! Codecs: how etcd values become the user's type, and back.
//!
//! A value that does not decode never stops the cache: the etcd source reports a
//! [`DecodeError`] naming the key and revision (through its error hook, `tracing` and a counter)
//! and treats the key as absent, so every other key keeps flowing.

use std::fmt;
#[cfg(any(feature = "json", feature = "bincode", feature = "protobuf"))]
use std::marker::PhantomData;

/// The error a codec returns.
pub type CodecError = Box<dyn std::error::Error + Send + Sync>;

/// Decodes etcd values into `T` and encodes `T` into values.
///
/// `JsonCodec`, `BincodeCodec`, `ProstCodec` (by cargo feature), [`RawCodec`] and
/// [`TextCodec`] come with the crate; a format of your own is two functions. A decode error names no key: the source
/// adds the key and revision ([`DecodeError`]).
///
/// ```
/// use etcd_informer::codec::{Codec, CodecError};
///
/// /// `host:port` values.
/// struct Endpoint { host: String, port: u16 }
/// struct EndpointCodec;
///
/// impl Codec<Endpoint> for EndpointCodec {
///     fn decode(&self, bytes: &[u8]) -> Result<Endpoint, CodecError> {
///         let text = std::str::from_utf8(bytes)?;
///         let (host, port) = text.rsplit_once(':').ok_or("expected host:port")?;
///         Ok(Endpoint { host: host.to_owned(), port: port.parse()? })
///     }
///     fn encode(&self, e: &Endpoint) -> Result<Vec<u8>, CodecError> {
///         Ok(format!("{}:{}", e.host, e.port).into_bytes())
///     }
/// }
/// let e = EndpointCodec.decode(b"10.0.0.1:2379").unwrap();
/// assert_eq!((e.host.as_str(), e.port), ("10.0.0.1", 2379));
/// assert!(EndpointCodec.decode(b"nonsense").is_err());
/// ```
pub trait Codec<T>: Send + Sync + 'static {
    /// Decodes one value.
    fn decode(&self, bytes: &[u8]) -> Result<T, CodecError>;
    /// Encodes one value.
    fn encode(&self, value: &T) -> Result<Vec<u8>, CodecError>;
    /// Names the encoding: bytes one codec wrote are handed undecoded to another (a snapshot's
    /// records to a compact cache, a compact cache's to a snapshot) only if both give the
    /// same name. Default: the codec's Rust type name, which names `T` too. Override it if one
    /// type encodes in several ways.
    fn name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
}

/// A key under the prefix that cannot become an object: its key is not UTF-8, or the codec
/// could not decode its value.
///
/// The key is kept as etcd's bytes and printed escaped: a UTF-8 key as a quoted string, any other
/// as `b"..."` with `\xNN` escapes, so that two different keys never print alike.
///
/// ```
/// use etcd_informer::codec::{DecodeError, DecodeErrorKind};
///
/// let bad_key = DecodeError::new(b"/pods/\xff".to_vec(), 7, DecodeErrorKind::KeyNotUtf8);
/// assert_eq!(bad_key.to_string(), r#"the key b"/pods/\xff" at revision 7 is not UTF-8"#);
/// assert_eq!(bad_key.key_str(), None);
///
/// let bad_value = DecodeError::new(b"/pods/a".to_vec(), 8, DecodeErrorKind::Value("EOF".into()));
/// assert_eq!(
///     bad_value.to_string(),
///     r#"cannot decode the value of key "/pods/a" at revision 8: EOF"#
/// );
/// assert_eq!(bad_value.key_str(), Some("/pods/a"));
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct DecodeError {
    /// The full etcd key, as etcd's bytes.
    pub key: Vec<u8>,
    /// The key's `mod_revision`.
    pub revision: i64,
    /// What is wrong: the key or the value.
    pub kind: DecodeErrorKind,
}

/// What [`DecodeError`] found wrong.
#[derive(Debug)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// The key is not UTF-8, so it cannot be an object's key (the value was not looked at).
    KeyNotUtf8,
    /// The codec could not decode the value; what it said.
    Value(CodecError),
}

impl DecodeError {
    /// The error about `key` at `revision`.
    pub fn new(key: Vec<u8>, revision: i64, kind: DecodeErrorKind) -> Self {
        DecodeError {
            key,
            revision,
            kind,
        }
    }

    /// The key, if it is UTF-8.
    pub fn key_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.key).ok()
    }

    /// The key, escaped as in the error's message.
    pub fn escaped_key(&self) -> String {
        EscapedKey(&self.key).to_string()
    }
}

/// Prints a key unambiguously: `"text"` (Rust string escapes) when UTF-8, else `b"..."`.
struct EscapedKey<'a>(&'a [u8]);

impl fmt::Display for EscapedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(self.0) {
            Ok(key) => write!(f, "{key:?}"),
            Err(_) => write!(f, "b\"{}\"", self.0.escape_ascii()),
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = EscapedKey(&self.key);
        match &self.kind {
            DecodeErrorKind::KeyNotUtf8 => write!(
                f,
                "the key {key} at revision {} is not UTF-8",
                self.revision
            ),
            DecodeErrorKind::Value(e) => write!(
                f,
                "cannot decode the value of key {key} at revision {}: {e}",
                self.revision
            ),
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            DecodeErrorKind::KeyNotUtf8 => None,
            DecodeErrorKind::Value(e) => Some(&**e),
        }
    }
}

// The codecs of the optional formats.
#[cfg(any(feature = "json", feature = "bincode", feature = "protobuf"))]
macro_rules! marker_codec {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub struct $name<T>(PhantomData<fn() -> T>);

        impl<T> $name<T> {
            /// The codec.
            pub fn new() -> Self {
                $name(PhantomData)
            }
        }

        impl<T> Default for $name<T> {
            fn default() -> Self {
                Self::new()
            }
        }

        impl<T> Clone for $name<T> {
            fn clone(&self) -> Self {
                Self::new()
            }
        }

        impl<T> fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(stringify!($name))
            }
        }
    };
}

#[cfg(feature = "json")]
marker_codec!(
    /// JSON through serde_json.
    ///
    /// ```
    /// use etcd_informer::{Codec, JsonCodec};
    /// let codec = JsonCodec::<Vec<u32>>::new();
    /// assert_eq!(codec.decode(b"[1,2]").unwrap(), vec![1, 2]);
    /// assert!(codec.decode(b"{oops").is_err());
    /// ```
    JsonCodec
);

#[cfg(feature = "json")]
impl<T> Codec<T> for JsonCodec<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned + 'static,
{
    fn decode(&self, bytes: &[u8]) -> Result<T, CodecError> {
        Ok(serde_json::from_slice(bytes)?)
    }
    fn encode(&self, value: &T) -> Result<Vec<u8>, CodecError> {
        Ok(serde_json::to_vec(value)?)
    }
}

#[cfg(feature = "bincode")]
marker_codec!(
    /// bincode 2 (standard configuration) through serde.
    BincodeCodec
);

#[cfg(feature = "bincode")]
impl<T> Codec<T> for BincodeCodec<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned + 'static,
{
    fn decode(&self, bytes: &[u8]) -> Result<T, CodecError> {
        let (value, used) = bincode::serde::decode_from_slice(bytes, bincode::config::standard())?;
        if used != bytes.len() {
            return Err(format!("{} trailing bytes after the value", bytes.len() - used).into());
        }
        Ok(value)
    }
    fn encode(&self, value: &T) -> Result<Vec<u8>, CodecError> {
        Ok(bincode::serde::encode_to_vec(
            value,
            bincode::config::standard(),
        )?)
    }
}

#[cfg(feature = "protobuf")]
marker_codec!(
    /// Protocol Buffers through prost.
    ProstCodec
);

#[cfg(feature = "protobuf")]
impl<T> Codec<T> for ProstCodec<T>
where
    T: prost::Message + Default + 'static,
{
    fn decode(&self, bytes: &[u8]) -> Result<T, CodecError> {
        Ok(T::decode(bytes)?)
    }
    fn encode(&self, value: &T) -> Result<Vec<u8>, CodecError> {
        Ok(value.encode_to_vec())
    }
}

/// The raw bytes, undecoded.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec<Vec<u8>> for RawCodec {
    fn decode(&self, bytes: &[u8]) -> Result<Vec<u8>, CodecError> {
        Ok(bytes.to_vec())
    }
    fn encode(&self, value: &Vec<u8>) -> Result<Vec<u8>, CodecError> {
        Ok(value.clone())
    }
}

/// UTF-8 text; anything else is a decode error.
#[derive(Debug, Clone, Copy, Default)]
pub struct TextCodec;

impl Codec<String> for TextCodec {
    fn decode(&self, bytes: &[u8]) -> Result<String, CodecError> {
        Ok(std::str::from_utf8(bytes)?.to_owned())
    }
    fn encode(&self, value: &String) -> Result<Vec<u8>, CodecError> {
        Ok(value.as_bytes().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Cm {
        name: String,
        n: u32,
    }

    #[test]
    fn round_trips_and_rejects_garbage() {
        let v = Cm {
            name: "a".into(),
            n: 3,
        };
        #[cfg(feature = "json")]
        {
            let c = JsonCodec::<Cm>::new();
            assert_eq!(c.decode(&c.encode(&v).unwrap()).unwrap(), v);
            assert!(c.decode(b"\xff").is_err());
        }
        #[cfg(feature = "bincode")]
        {
            let c = BincodeCodec::<Cm>::new();
            let mut bytes = c.encode(&v).unwrap();
            assert_eq!(c.decode(&bytes).unwrap(), v);
            bytes.push(0);
            assert!(c.decode(&bytes).is_err(), "trailing bytes");
            assert!(c.decode(&[0xff, 0xff]).is_err());
        }
        #[cfg(feature = "protobuf")]
        {
            let c = ProstCodec::<crate::proto::ConfigMap>::new();
            let cm = crate::proto::ConfigMap {
                namespace: "tmp".into(),
                name: "demo".into(),
                ..Default::default()
            };
            assert_eq!(c.decode(&c.encode(&cm).unwrap()).unwrap(), cm);
            assert!(c.decode(&[0xff, 0xff, 0xff]).is_err());
        }
        assert_eq!(TextCodec.decode(b"hi").unwrap(), "hi");
        assert!(TextCodec.decode(b"\xff\xfe").is_err());
        assert_eq!(RawCodec.decode(b"\xff").unwrap(), vec![0xff]);
        let _ = v;
    }
}
