//! The informer's source when snapshots are on: its first list is the snapshot, when the
//! file checks out and the source agrees to follow on from it; everything else is the source.

use std::sync::{Arc, OnceLock};

use super::format::{self, Loaded};
use super::{SnapshotError, SnapshotErrorKind, SnapshotOptions, SnapshotStart};
use crate::listwatch::{
    BoxFuture, Freshness, ListResult, ListSink, ListerWatcher, Result, Resume, SourceIdentity,
    WatchStream,
};
use crate::Object;

/// Wraps the informer's source: the first `list`/`list_into` may be answered from the
/// snapshot; every other call, and every later list, goes to the source.
///
/// Invariant: `start` is set exactly once, by the first list that got an answer (from the
/// snapshot, or from the source after the snapshot was refused); before it is set, no list has
/// been handed to the queue. A list that fails (the source could not be asked) leaves it unset,
/// so the reflector's retry decides again.
pub(crate) struct WarmSource<T> {
    inner: Arc<dyn ListerWatcher<T>>,
    options: SnapshotOptions<T>,
    start: Arc<OnceLock<SnapshotStart>>,
}

/// What the first list does.
enum Decision<T> {
    /// Serve the snapshot's objects as the list at `revision`.
    Warm {
        revision: i64,
        objects: Vec<Object<T>>,
        start: SnapshotStart,
    },
    /// List the source; why the snapshot was not used.
    Cold(String),
}

impl<T: Send + Sync + 'static> WarmSource<T> {
    pub(crate) fn new(
        inner: Arc<dyn ListerWatcher<T>>,
        options: SnapshotOptions<T>,
        start: Arc<OnceLock<SnapshotStart>>,
    ) -> Self {
        WarmSource {
            inner,
            options,
            start,
        }
    }

    /// Reads and checks the file, asks the source, decodes the values. `Err` only when the
    /// source could not answer (the reflector retries the list, and this with it).
    async fn decide(&self) -> Result<Decision<T>> {
        let started = std::time::Instant::now();
        let path = self.options.path.clone();
        let read = tokio::task::spawn_blocking(move || format::read(&path)).await;
        let loaded = match read {
            Ok(Ok(loaded)) => loaded,
            Ok(Err(e)) => return Ok(Decision::Cold(cold_reason(&e))),
            Err(e) => return Ok(Decision::Cold(format!("reading the snapshot failed: {e}"))),
        };
        let header = &loaded.header;
        let mismatch = if header.codec_id != self.options.codec_id {
            Some(SnapshotErrorKind::Codec {
                snapshot: header.codec_id.clone(),
                informer: self.options.codec_id.clone(),
            })
        } else {
            let name = self.inner.identity().name;
            (header.prefix != name).then(|| SnapshotErrorKind::Prefix {
                snapshot: header.prefix.clone(),
                informer: name,
            })
        };
        if let Some(kind) = mismatch {
            let e = SnapshotError::new(&self.options.path, kind);
            return Ok(Decision::Cold(e.to_string()));
        }
        let (revision, keys) = (header.revision, loaded.entries.len());
        let cluster_id = header.cluster_id;
        let read_at = started.elapsed();
        // Values are decoded while etcd is asked: decoding is most of a warm start's time, and
        // etcd's count at a revision walks its whole index. A refusal wastes the decoding.
        let codec = self.options.codec.clone();
        let path = self.options.path.clone();
        let decoding = tokio::task::spawn_blocking(move || {
            decode_all(&loaded, &*codec).map_err(|kind| SnapshotError::new(&path, kind).to_string())
        });
        let answer = self.inner.can_resume(revision, keys, cluster_id).await?;
        let asked_at = started.elapsed();
        let start = match answer {
            Resume::Ready => SnapshotStart::Warm { revision, keys },
            Resume::Compacted(reason) => SnapshotStart::WarmCompacted {
                revision,
                keys,
                reason,
            },
            Resume::Refused(reason) => {
                return Ok(Decision::Cold(format!(
                    "snapshot {}: {reason}",
                    self.options.path.display()
                )))
            }
        };
        let decoded = decoding
            .await
            .map_err(|e| format!("decoding the snapshot failed: {e}"))
            .and_then(|r| r);
        // Where a warm start's time goes (BENCHMARKS.md, "restart").
        tracing::debug!(path = %self.options.path.display(), read = ?read_at, etcd_answered = ?asked_at, decoded = ?started.elapsed(), "snapshot loaded");
        Ok(match decoded {
            Ok(objects) => Decision::Warm {
                revision,
                objects,
                start,
            },
            Err(reason) => Decision::Cold(reason),
        })
    }

    /// The first list's decision, logged and recorded; `None` once decided before.
    async fn first_list(&self) -> Result<Option<(i64, Vec<Object<T>>)>> {
        if self.start.get().is_some() {
            return Ok(None);
        }
        let (start, served) = match self.decide().await? {
            Decision::Warm {
                revision,
                objects,
                start,
            } => (start, Some((revision, objects))),
            Decision::Cold(reason) => (SnapshotStart::Cold { reason }, None),
        };
        match &start {
            SnapshotStart::Cold { reason } if reason.contains("(no such file") => {
                tracing::info!(path = %self.options.path.display(), "{start}")
            }
            SnapshotStart::Cold { .. } => {
                tracing::warn!(path = %self.options.path.display(), "{start}")
            }
            _ => tracing::info!(path = %self.options.path.display(), "{start}"),
        }
        let _ = self.start.set(start);
        Ok(served)
    }
}

/// Why a file that could not be read means a cold start.
fn cold_reason(e: &SnapshotError) -> String {
    match &e.kind {
        SnapshotErrorKind::Io(io) if io.kind() == std::io::ErrorKind::NotFound => {
            format!("no snapshot at {} yet (no such file)", e.path.display())
        }
        _ => e.to_string(),
    }
}

/// Every value decoded, on up to 4 threads: decoding is most of a warm start's time.
fn decode_all<T: Send + 'static>(
    loaded: &Loaded,
    codec: &dyn crate::codec::Codec<T>,
) -> Result<Vec<Object<T>>, SnapshotErrorKind> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let chunk = loaded.entries.len().div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<Object<T>>, SnapshotErrorKind>> = std::thread::scope(|scope| {
        let handles: Vec<_> = loaded
            .entries
            .chunks(chunk)
            .map(|entries| {
                scope.spawn(move || {
                    let mut out = Vec::with_capacity(entries.len());
                    for e in entries {
                        let key = loaded.key(e);
                        let value =
                            codec
                                .decode(&loaded.bytes[e.value.clone()])
                                .map_err(|error| SnapshotErrorKind::Value {
                                    key: key.to_owned(),
                                    error,
                                })?;
                        let mut o = Object::new(key, e.mod_revision, value);
                        o.create_revision = e.create_revision;
                        o.version = e.version;
                        o.lease = e.lease;
                        out.push(o);
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(SnapshotErrorKind::Corrupt("the codec panicked".into()))
                })
            })
            .collect()
    });
    let mut objects = Vec::with_capacity(loaded.entries.len());
    for part in parts {
        objects.extend(part?);
    }
    Ok(objects)
}

impl<T: Send + Sync + 'static> ListerWatcher<T> for WarmSource<T> {
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        Box::pin(async move {
            match self.first_list().await? {
                Some((revision, items)) => Ok(ListResult { items, revision }),
                None => self.inner.list().await,
            }
        })
    }

    fn list_into(&self, sink: Arc<dyn ListSink<T>>) -> BoxFuture<'_, Result<i64>>
    where
        T: 'static,
    {
        Box::pin(async move {
            match self.first_list().await? {
                Some((revision, objects)) => {
                    sink.begin(revision, objects.len());
                    sink.page(objects.into_iter().map(Arc::new).collect());
                    Ok(revision)
                }
                None => self.inner.list_into(sink).await,
            }
        })
    }

    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        self.inner.watch(after_revision)
    }

    fn freshness(
        &self,
        since: i64,
        cached: usize,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        self.inner.freshness(since, cached, at)
    }

    fn liveness_bound(&self) -> Option<std::time::Duration> {
        self.inner.liveness_bound()
    }

    fn decode_errors(&self) -> u64 {
        self.inner.decode_errors()
    }

    fn identity(&self) -> SourceIdentity {
        self.inner.identity()
    }

    fn can_resume(
        &self,
        revision: i64,
        keys: usize,
        cluster_id: u64,
    ) -> BoxFuture<'_, Result<Resume>> {
        self.inner.can_resume(revision, keys, cluster_id)
    }
}
