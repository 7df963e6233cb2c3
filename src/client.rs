//! Safe writes: a typed client for one prefix whose writes never overwrite a change the caller
//! has not seen (client-go's resourceVersion preconditions, over etcd transactions).

use std::sync::Arc;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use crate::codec::{Codec, CodecError, DecodeError, DecodeErrorKind};
use crate::listwatch::etcd::ConfigError;
use crate::object::Object;

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
    /// The write was fenced off: the [`Fence`] it was made under no longer holds (the shard's
    /// owner record is gone or was taken over), so another owner may be acting on the key.
    /// Stop working on the key; do not retry under the same fence.
    #[error("write to {key:?} fenced off: {fence:?} is no longer at mod_revision {held} (found {actual:?})")]
    Fenced {
        /// The full key written.
        key: String,
        /// The fence's key.
        fence: String,
        /// The revision the fence expected.
        held: i64,
        /// The fence key's `mod_revision` now, `None` if it is gone.
        actual: Option<i64>,
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

    /// Whether this is a [`WriteError::Fenced`].
    pub fn is_fenced(&self) -> bool {
        matches!(self, WriteError::Fenced { .. })
    }
}

/// A write precondition that proves the writer still holds what it acts for: the key `key` is
/// still at `mod_revision` `revision`. A [sharded runner](crate::sharding) gives each reconcile
/// the fence of its shard's owner record ([`Context::fence`](crate::runner::Context::fence)):
/// once the record is released, or deleted with its owner's expired lease, every write made
/// under the fence fails with [`WriteError::Fenced`], so a replica that lost its shard (to a
/// partition, a pause) cannot overwrite the new owner's work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    key: String,
    revision: i64,
}

impl Fence {
    /// Writes under this fence require `key` to be at `mod_revision` `revision`.
    pub fn new(key: impl Into<String>, revision: i64) -> Self {
        Fence {
            key: key.into(),
            revision,
        }
    }

    /// The key that must not have changed.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Its `mod_revision` when the fence was taken.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    fn compare(&self) -> Compare {
        Compare::mod_revision(self.key.clone(), CompareOp::Equal, self.revision)
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
    fence: Option<Fence>,
}

impl<T> Clone for TypedClient<T> {
    fn clone(&self) -> Self {
        TypedClient {
            client: self.client.clone(),
            prefix: self.prefix.clone(),
            codec: self.codec.clone(),
            fence: self.fence.clone(),
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
            fence: None,
        })
    }

    /// This client with every write made under `fence`: a write whose fence no longer holds
    /// fails with [`WriteError::Fenced`] and changes nothing.
    ///
    /// ```no_run
    /// # async fn demo(ctx: etcd_informer::runner::Context, done: etcd_informer::client::TypedClient<String>) -> Result<(), etcd_informer::client::WriteError> {
    /// let done = match ctx.fence() {
    ///     Some(fence) => done.fenced(fence.clone()),
    ///     None => done,
    /// };
    /// done.put(ctx.key(), &"reconciled".to_string()).await?;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn fenced(&self, fence: Fence) -> Self {
        TypedClient {
            fence: Some(fence),
            ..self.clone()
        }
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

    /// Writes `value` whatever the key's revision (only under the client's fence, if any);
    /// returns the new `mod_revision`.
    pub async fn put(&self, key: &str, value: &T) -> Result<i64, WriteError> {
        let bytes = self.encode(key, value)?;
        if self.fence.is_some() {
            let op = TxnOp::put(self.full(key), bytes, None);
            return self.commit(key, None, op).await;
        }
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
        let absent = Compare::create_revision(full.clone(), CompareOp::Equal, 0);
        let op = TxnOp::put(full, bytes, None);
        self.commit(key, Some((0, absent)), op).await
    }

    /// Replaces `key` only if its `mod_revision` is still `expected`; returns the new one.
    pub async fn update(&self, key: &str, value: &T, expected: i64) -> Result<i64, WriteError> {
        let bytes = self.encode(key, value)?;
        let full = self.full(key);
        let unchanged = Compare::mod_revision(full.clone(), CompareOp::Equal, expected);
        let op = TxnOp::put(full, bytes, None);
        self.commit(key, Some((expected, unchanged)), op).await
    }

    /// Deletes `key` only if its `mod_revision` is still `expected`; returns the delete's revision.
    pub async fn delete(&self, key: &str, expected: i64) -> Result<i64, WriteError> {
        let full = self.full(key);
        let unchanged = Compare::mod_revision(full.clone(), CompareOp::Equal, expected);
        let op = TxnOp::delete(full, None);
        self.commit(key, Some((expected, unchanged)), op).await
    }

    /// Runs `op` if the key is at the `expected` revision (with its compare), if any, and the
    /// client's fence holds, if any. When they fail, the fence key is read back in the same txn
    /// to tell a fenced-off write from a conflict.
    async fn commit(
        &self,
        key: &str,
        expected: Option<(i64, Compare)>,
        op: TxnOp,
    ) -> Result<i64, WriteError> {
        let full = self.full(key);
        let (expected, mut compares) = match expected {
            Some((revision, compare)) => (Some(revision), vec![compare]),
            None => (None, Vec::new()),
        };
        let mut otherwise = Vec::new();
        if let Some(fence) = &self.fence {
            compares.push(fence.compare());
            otherwise.push(TxnOp::get(fence.key.clone(), None));
        }
        // etcd-client wants `when`, `and_then`, `or_else` in this order.
        let txn = Txn::new().when(compares).and_then([op]).or_else(otherwise);
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
        if let Some(fence) = &self.fence {
            let actual = resp.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => Some(get.kvs().first().map(|kv| kv.mod_revision())),
                _ => None,
            });
            let actual = actual.flatten();
            if actual != Some(fence.revision) {
                return Err(WriteError::Fenced {
                    key: full,
                    fence: fence.key.clone(),
                    held: fence.revision,
                    actual,
                });
            }
        }
        // Only for the error's sake: the key may change again right after.
        let actual = self
            .client
            .kv_client()
            .get(full.clone(), None)
            .await
            .ok()
            .and_then(|r| r.kvs().first().map(|kv| kv.mod_revision()));
        Err(WriteError::Conflict {
            key: full,
            expected: expected.unwrap_or(0),
            actual,
            revision,
        })
    }
}
