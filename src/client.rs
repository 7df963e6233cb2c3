//! Safe writes: a typed client for one prefix whose writes never overwrite a change the caller
//! has not seen (client-go's resourceVersion preconditions, over etcd transactions).

use std::sync::Arc;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};

use crate::codec::{Codec, CodecError, DecodeError, DecodeErrorKind};
use crate::listwatch::etcd::ConfigError;
use crate::Object;

/// Why a write failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The key changed since the caller read it (or was deleted, or created meanwhile): read it
    /// again and retry. `actual` is its current `mod_revision`, `None` if it does not exist;
    /// `revision` is etcd's revision when it refused the write: wait for an informer to reach
    /// it ([`SharedIndexInformer::wait_for_revision`](crate::SharedIndexInformer::wait_for_revision))
    /// and its cache holds the change that won.
    #[error("conflict on key {key:?}: expected mod_revision {expected}, found {actual:?} (etcd at revision {revision})")]
    Conflict {
        /// The full key.
        key: String,
        /// The revision the caller expected (0: expected the key to be absent).
        expected: i64,
        /// The revision found.
        actual: Option<i64>,
        /// etcd's revision when the write was refused.
        revision: i64,
    },
    /// The value could not be encoded.
    #[error("cannot encode the value for key {key:?}: {source}")]
    Encode {
        /// The full key.
        key: String,
        /// What the codec said.
        source: CodecError,
    },
    /// The stored value could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// etcd failed.
    #[error("etcd request on key {key:?} failed: {source}")]
    Etcd {
        /// The full key.
        key: String,
        /// The client's error.
        source: etcd_client::Error,
    },
}

impl WriteError {
    /// Whether this is a [`WriteError::Conflict`].
    pub fn is_conflict(&self) -> bool {
        matches!(self, WriteError::Conflict { .. })
    }
}

/// Reads and writes typed objects under one prefix, with optimistic concurrency: updates and
/// deletes name the `mod_revision` they read, and fail with [`WriteError::Conflict`] if the key
/// changed since.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use etcd_informer::{client::TypedClient, TextCodec};
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// let pods = TypedClient::new(client, "/demo/pods/", TextCodec)?;
/// let rev = pods.create("web-0", &"running".to_string()).await?;
/// match pods.update("web-0", &"stopped".to_string(), rev).await {
///     Err(e) if e.is_conflict() => println!("someone else changed web-0 first"),
///     other => { other?; }
/// }
/// # Ok(()) }
/// ```
pub struct TypedClient<T> {
    client: Client,
    prefix: Arc<str>,
    codec: Arc<dyn Codec<T>>,
}

impl<T> Clone for TypedClient<T> {
    fn clone(&self) -> Self {
        TypedClient {
            client: self.client.clone(),
            prefix: self.prefix.clone(),
            codec: self.codec.clone(),
        }
    }
}

impl<T: Send + Sync + 'static> TypedClient<T> {
    /// A client for keys under `prefix` (which must end with `/`).
    pub fn new(
        client: Client,
        prefix: impl Into<String>,
        codec: impl Codec<T>,
    ) -> Result<Self, ConfigError> {
        let prefix = prefix.into();
        if !prefix.ends_with('/') {
            return Err(ConfigError::Prefix(prefix));
        }
        Ok(TypedClient {
            client,
            prefix: prefix.into(),
            codec: Arc::new(codec),
        })
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn encode(&self, key: &str, value: &T) -> Result<Vec<u8>, WriteError> {
        self.codec
            .encode(value)
            .map_err(|source| WriteError::Encode {
                key: self.full(key),
                source,
            })
    }

    fn etcd(&self, key: &str) -> impl FnOnce(etcd_client::Error) -> WriteError {
        let key = self.full(key);
        move |source| WriteError::Etcd { key, source }
    }

    /// The object under `key` (relative to the prefix), if any.
    pub async fn get(&self, key: &str) -> Result<Option<Object<T>>, WriteError> {
        let full = self.full(key);
        let resp = self
            .client
            .kv_client()
            .get(full.clone(), None)
            .await
            .map_err(self.etcd(key))?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(None);
        };
        let value = self.codec.decode(kv.value()).map_err(|source| {
            DecodeError::new(
                full.into_bytes(),
                kv.mod_revision(),
                DecodeErrorKind::Value(source),
            )
        })?;
        let mut obj = Object::new(key, kv.mod_revision(), value);
        obj.create_revision = kv.create_revision();
        obj.version = kv.version();
        obj.lease = kv.lease();
        Ok(Some(obj))
    }

    /// Writes `value` unconditionally; returns the new `mod_revision`.
    pub async fn put(&self, key: &str, value: &T) -> Result<i64, WriteError> {
        let bytes = self.encode(key, value)?;
        let resp = self
            .client
            .kv_client()
            .put(self.full(key), bytes, None)
            .await
            .map_err(self.etcd(key))?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// Creates `key` only if it does not exist; returns its `mod_revision`.
    pub async fn create(&self, key: &str, value: &T) -> Result<i64, WriteError> {
        let bytes = self.encode(key, value)?;
        let full = self.full(key);
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(full, bytes, None)]);
        self.commit(key, 0, txn).await
    }

    /// Replaces `key` only if its `mod_revision` is still `expected`; returns the new one.
    pub async fn update(&self, key: &str, value: &T, expected: i64) -> Result<i64, WriteError> {
        let bytes = self.encode(key, value)?;
        let full = self.full(key);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                full.clone(),
                CompareOp::Equal,
                expected,
            )])
            .and_then([TxnOp::put(full, bytes, None)]);
        self.commit(key, expected, txn).await
    }

    /// Deletes `key` only if its `mod_revision` is still `expected`; returns the delete's revision.
    pub async fn delete(&self, key: &str, expected: i64) -> Result<i64, WriteError> {
        let full = self.full(key);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                full.clone(),
                CompareOp::Equal,
                expected,
            )])
            .and_then([TxnOp::delete(full, None)]);
        self.commit(key, expected, txn).await
    }

    async fn commit(&self, key: &str, expected: i64, txn: Txn) -> Result<i64, WriteError> {
        let resp = self
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(self.etcd(key))?;
        let revision = resp.header().map_or(0, |h| h.revision());
        if resp.succeeded() {
            return Ok(revision);
        }
        // Only for the error's sake: the key may change again right after.
        let actual = self
            .client
            .kv_client()
            .get(self.full(key), None)
            .await
            .ok()
            .and_then(|r| r.kvs().first().map(|kv| kv.mod_revision()));
        Err(WriteError::Conflict {
            key: self.full(key),
            expected,
            actual,
            revision,
        })
    }
}
