//! The informer's source when snapshots are on: its first list is the snapshot, when the
//! file checks out and the source agrees to follow on from it; everything else is the source.

use std::sync::{Arc, OnceLock};

use super::error::{SnapshotError, SnapshotErrorKind};
use super::format::{self, Page};
use super::{SnapshotOptions, SnapshotStart};
use crate::listwatch::{
    BoxFuture, Capabilities, Error, ListResult, ListSink, ListerWatcher, Result, Resume,
    SavedCache, SourceCapabilities, WatchStream,
};
use crate::object::EncodedObject;
use crate::object::IndexValues;
use crate::object::Object;
use crate::object::SharedRecord;

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

/// Decoded objects, a chunk at a time, as the decoding threads finish them; an `Err` names the
/// value that did not decode.
type Chunks<T> = std::sync::mpsc::Receiver<Result<Vec<Object<T>>, String>>;

/// Keys per decoded chunk: large enough that handing one to the cache is cheap per key, small
/// enough that the cache is built while the rest decode.
const CHUNK: usize = 16_384;

/// Keys per page read from the file, and handed to a sink that takes them encoded: one page is
/// installed while the next is read. The cache's hash sets are filled a page at a time in the
/// order of their buckets, which saves the more memory traffic the larger the page (at a
/// million keys, a page of 16,384 left most of it).
const PAGE: usize = 131_072;

/// A snapshot the source agreed to resume from.
struct Warm<T> {
    revision: i64,
    keys: usize,
    content: Content<T>,
    start: SnapshotStart,
    started: std::time::Instant,
}

/// How a warm start's objects reach the cache.
enum Content<T> {
    /// Decoded, a chunk at a time, as the decoding threads finish them.
    Decoding(Chunks<T>),
    /// As the file holds them, encoded, with their index values: the list's sink keeps
    /// objects encoded with the same codec and the same indexes (a compact cache), so nothing
    /// is decoded (but a sample, to check the codec and the index functions still agree).
    /// They are handed to the sink a page at a time as they are read, while etcd is asked
    /// (the sink discards them if etcd says no, or if the file's checksum does not match):
    /// the task doing it, and why it stopped short.
    Installing(tokio::task::JoinHandle<Result<(), String>>),
}

/// Keys of the first page, read before etcd is asked: the file holds its keys in hash order
/// (the namespaces interleaved by size), so they are a random sample of all, where etcd's count
/// is split (see [`splits`]).
const FIRST_PAGE: usize = 4096;

/// The parts etcd is asked to count the snapshot's keys in, at once: etcd walks every key of a
/// range to count it, one core a request. A million keys on etcd 3.4.23, 2 idle cores: 0.22-0.44
/// s whole, 0.13-0.21 s in halves, 0.15-0.37 s in quarters; in a warm start, quarters answered
/// after 0.20-0.30 s, the whole count after 0.33-0.79 s (BENCHMARKS.md). More cores, more gain.
const COUNT_PARTS: usize = 4;

/// Where the snapshot's keys split into [`COUNT_PARTS`] parts of about the same size, going by
/// the first page's keys.
fn splits(first: Option<&Page>) -> Vec<String> {
    let Some(page) = first else {
        return Vec::new();
    };
    let mut keys: Vec<&str> = page.entries.iter().map(|e| page.key(e)).collect();
    keys.sort_unstable();
    (1..COUNT_PARTS)
        .filter_map(|part| keys.get(keys.len() * part / COUNT_PARTS))
        .map(|key| key.to_string())
        .collect()
}

/// How many records a sink decodes to check it may take the rest encoded.
const SAMPLE: usize = 64;

/// What the first list does.
enum Decision<T> {
    /// Serve the snapshot's objects as the list at its revision.
    Warm(Warm<T>),
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

    /// Reads the file's head and a first small page, asks the source, and starts handing the
    /// pages to the sink encoded (or decoding their values) as the rest is read and checked
    /// while the source answers (reading and installing are most of a warm start's time; a
    /// refusal wastes them). `Err` only when the source could not answer (the reflector retries
    /// the list, and this with it).
    async fn decide(&self, sink: Option<&Arc<dyn ListSink<T>>>) -> Result<Decision<T>> {
        let started = std::time::Instant::now();
        let Some(name) = self.inner.identity().map(|identity| identity.name) else {
            return Ok(Decision::Cold(
                "the source cannot resume from a snapshot (its capabilities lack it)".into(),
            ));
        };
        let path = self.options.path.clone();
        let opened = tokio::task::spawn_blocking(move || {
            let mut reader = format::PageReader::open(&path)?;
            let first = reader
                .next_page(FIRST_PAGE)
                .map_err(|kind| SnapshotError::new(&path, kind))?;
            Ok::<_, SnapshotError>((reader, first))
        })
        .await;
        let (reader, first) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Ok(Decision::Cold(cold_reason(&e))),
            Err(e) => return Ok(Decision::Cold(format!("reading the snapshot failed: {e}"))),
        };
        let header = reader.header().clone();
        let mismatch = if header.codec_id != self.options.codec_id {
            Some(SnapshotErrorKind::Codec {
                snapshot: header.codec_id.clone(),
                informer: self.options.codec_id.clone(),
            })
        } else {
            (header.prefix != name).then(|| SnapshotErrorKind::Prefix {
                snapshot: header.prefix.clone(),
                informer: name,
            })
        };
        if let Some(kind) = mismatch {
            let e = SnapshotError::new(&self.options.path, kind);
            return Ok(Decision::Cold(e.to_string()));
        }
        let (revision, keys) = (header.revision, reader.keys());
        let cluster_id = header.cluster_id;
        let read_at = started.elapsed();
        // etcd is asked while the file is read and checked: at a million keys, each takes a
        // few hundred milliseconds.
        let asking = {
            let (inner, splits) = (self.inner.clone(), splits(first.as_ref()));
            let saved = SavedCache::new(revision, keys, cluster_id).with_splits(splits);
            tokio::spawn(async move { inner.can_resume(saved).await })
        };
        // The sample is the file's first records: it holds its keys in hash order, the
        // namespaces interleaved by size, so any run of them is a random sample of all. (Not
        // every n-th: namespaces of one size interleave in turn, and n would pick some only.)
        let encoded = sink.is_some_and(|sink| {
            let index = first.as_ref().map(|page| (page, page.index()));
            let sample: Vec<_> = index.as_ref().map_or_else(Vec::new, |(page, index)| {
                (page.entries.iter().enumerate())
                    .take(SAMPLE)
                    .map(|(n, e)| record(page, e, index.of(n)))
                    .collect()
            });
            sink.takes_encoded(self.options.codec.name(), &header.indexes, keys, &sample)
        });
        if let Some(sink) = sink {
            sink.begin(revision, keys);
        }
        // Set when etcd says no: the pages still to read are not.
        let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pages = Pages {
            reader,
            first,
            path: self.options.path.clone(),
            abandoned: abandoned.clone(),
        };
        let content = match sink.filter(|_| encoded) {
            Some(sink) => {
                let sink = sink.clone();
                Content::Installing(tokio::task::spawn_blocking(move || {
                    let installed = pages.each(|page| {
                        let index = page.index();
                        let records: Vec<_> = (page.entries.iter().enumerate())
                            .map(|(n, e)| record(&page, e, index.of(n)))
                            .collect();
                        sink.page_encoded(&records);
                        Ok(())
                    });
                    if installed.is_err() {
                        // What the sink took is not this file's as it was written.
                        sink.discard();
                    }
                    installed
                }))
            }
            None => {
                let (tx, chunks) = std::sync::mpsc::channel();
                let codec = self.options.codec.clone();
                // Detached: if the answer is no, dropping `chunks` stops it at its next chunk.
                drop(tokio::task::spawn_blocking(move || {
                    let path = pages.path.clone();
                    let decoded = pages.each(|page| decode_chunks(&page, &*codec, &path, &tx));
                    if let Err(reason) = decoded {
                        let _ = tx.send(Err(reason));
                    }
                }));
                Content::Decoding(chunks)
            }
        };
        let answer = (asking.await)
            .unwrap_or_else(|e| Err(Error::transient(format!("asking etcd failed: {e}"))));
        tracing::debug!(path = %self.options.path.display(), read = ?read_at, etcd_answered = ?started.elapsed(), encoded, "snapshot checked");
        let refused = match &answer {
            Ok(Resume::Ready) => None,
            // etcd cannot show what changed since a compacted revision (nor count its keys):
            // the snapshot cannot be proven to be this store, and none of it may reach a
            // handler or a reader. A watch from it could also open at the compaction revision
            // itself, where etcd 3.4 before 3.4.36 drops deletes.
            Ok(Resume::Compacted(reason)) => Some(format!(
                "snapshot {} at revision {revision}: {reason}; etcd cannot vouch for it, so it is not used",
                self.options.path.display()
            )),
            Ok(Resume::Refused(reason)) => Some(format!(
                "snapshot {}: {reason}",
                self.options.path.display()
            )),
            Err(_) => Some(String::new()),
        };
        if let Some(reason) = refused {
            abandoned.store(true, std::sync::atomic::Ordering::Relaxed);
            if let (Content::Installing(installing), Some(sink)) = (content, sink) {
                // What the sink took is not this store's (or not proven so): gone before the
                // source is listed into it.
                let _ = installing.await;
                sink.discard();
            }
            answer?;
            return Ok(Decision::Cold(reason));
        }
        let start = SnapshotStart::Warm { revision, keys };
        Ok(Decision::Warm(Warm {
            revision,
            keys,
            content,
            start,
            started,
        }))
    }

    /// The first list's snapshot, if the source agreed to resume from it; `None` once decided
    /// before, or when it starts cold (recorded here).
    async fn first_list(&self, sink: Option<&Arc<dyn ListSink<T>>>) -> Result<Option<Warm<T>>> {
        if self.start.get().is_some() {
            return Ok(None);
        }
        match self.decide(sink).await? {
            Decision::Warm(warm) => Ok(Some(warm)),
            Decision::Cold(reason) => {
                self.decided(SnapshotStart::Cold { reason });
                Ok(None)
            }
        }
    }

    /// Logs how the informer started, and records it.
    fn decided(&self, start: SnapshotStart) {
        let path = self.options.path.display();
        match &start {
            SnapshotStart::Cold { reason } if reason.contains("(no such file") => {
                tracing::info!(%path, "{start}")
            }
            SnapshotStart::Cold { .. } => tracing::warn!(%path, "{start}"),
            _ => tracing::info!(%path, "{start}"),
        }
        let _ = self.start.set(start);
    }

    /// Hands every decoded chunk to `take` as it comes (on a blocking thread: building the
    /// cache is CPU work), or waits for the encoded records to be in the sink, then records
    /// the warm start and returns its revision. A file whose checksum does not match (known
    /// once it is read to the end), a value that does not decode, or decoding that stopped
    /// short make this a cold start after all (`None`): the caller drops what was taken and
    /// lists the source at once.
    async fn serve(
        &self,
        warm: Warm<T>,
        mut take: impl FnMut(Vec<Object<T>>) + Send + 'static,
    ) -> Option<i64> {
        let Warm {
            revision,
            keys,
            content,
            start,
            started,
        } = warm;
        let served = match content {
            Content::Installing(installing) => installing
                .await
                .map_err(|e| format!("installing the snapshot failed: {e}"))
                .and_then(|r| r),
            Content::Decoding(chunks) => tokio::task::spawn_blocking(move || {
                let mut got = 0;
                for chunk in chunks {
                    let objects = chunk?;
                    got += objects.len();
                    take(objects);
                }
                if got != keys {
                    return Err(format!(
                        "decoding the snapshot stopped after {got} of {keys} keys"
                    ));
                }
                Ok(())
            })
            .await
            .map_err(|e| format!("decoding the snapshot failed: {e}"))
            .and_then(|r| r),
        };
        match served {
            Ok(()) => {
                tracing::debug!(path = %self.options.path.display(), cached = ?started.elapsed(), "snapshot handed to the cache");
                self.decided(start);
                Some(revision)
            }
            Err(reason) => {
                self.decided(SnapshotStart::Cold { reason });
                None
            }
        }
    }
}

/// The record of `entry`, as it is in the file.
pub(super) fn record<'a>(
    page: &'a Page,
    entry: &format::Entry,
    index: IndexValues<'a>,
) -> EncodedObject<'a> {
    // A compact cache keeps the record itself, if its 32-bit offsets reach every record of
    // the buffer (one shared in part would be held whole, counted in part).
    let record = u32::try_from(page.records.len())
        .is_ok()
        .then(|| SharedRecord {
            buffer: &page.records,
            at: entry.record.start as u32,
            len: entry.record.len() as u32,
            key_hash: entry.key_hash,
        });
    EncodedObject {
        key: page.key(entry),
        value: page.value(entry),
        record,
        revisions: [
            entry.mod_revision,
            entry.create_revision,
            entry.version,
            entry.lease,
        ],
        digest: entry.digest,
        index,
    }
}

/// The file's pages, from the first (read to decide), each handed on as it is read.
struct Pages {
    reader: format::PageReader<std::fs::File>,
    first: Option<Page>,
    path: std::path::PathBuf,
    /// Set when etcd said no: the rest is not read.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

impl Pages {
    /// Hands each page to `take` until it fails, while a thread of its own reads the next
    /// (so that reading and installing overlap on two cores), then checks the checksum: `Err`
    /// says why the pages handed on are not this file's as it was written, or not all of it.
    fn each(self, mut take: impl FnMut(Page) -> Result<(), String>) -> Result<(), String> {
        let Pages {
            mut reader,
            first,
            path,
            abandoned,
        } = self;
        let refused = || Err("etcd refused the snapshot".to_owned());
        let Some(first) = first else {
            return reader
                .finish()
                .map_err(|kind| SnapshotError::new(&path, kind).to_string());
        };
        // One page read ahead: the file's bytes are held at most three pages at a time
        // beyond what the sink keeps.
        let (tx, pages) = std::sync::mpsc::sync_channel::<Result<Option<Page>, String>>(1);
        std::thread::scope(|scope| {
            let abandoned = &abandoned;
            let path = &path;
            scope.spawn(move || {
                let failed = |kind| SnapshotError::new(path, kind).to_string();
                while !abandoned.load(std::sync::atomic::Ordering::Relaxed) {
                    let next = match reader.next_page(PAGE) {
                        Ok(None) => {
                            let _ = tx.send(reader.finish().map(|()| None).map_err(failed));
                            return;
                        }
                        next => next.map_err(failed),
                    };
                    let stop = next.is_err();
                    // An error from `send`: the installer stopped.
                    if tx.send(next).is_err() || stop {
                        return;
                    }
                }
            });
            // The receiver goes with this closure, so that a reader blocked on a full channel
            // hears that the installer stopped, and the scope can end.
            let install = move || {
                // After `take` failed, the rest is still read: a file that is not the one
                // written says why better than the value it garbled.
                let mut failed = take(first).err();
                loop {
                    if abandoned.load(std::sync::atomic::Ordering::Relaxed) {
                        return refused();
                    }
                    match pages.recv() {
                        Ok(Ok(Some(page))) if failed.is_none() => failed = take(page).err(),
                        Ok(Ok(Some(_))) => {}
                        Ok(Ok(None)) => return failed.map_or(Ok(()), Err),
                        Ok(Err(reason)) => return Err(reason),
                        Err(_) => return refused(),
                    }
                }
            };
            install()
        })
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

/// Decodes the values of `page`, a chunk at a time on up to 4 threads, sending each chunk as
/// it is done; `Err` names the first value that does not decode, or says nobody receives.
fn decode_chunks<T: Send + 'static>(
    page: &Page,
    codec: &dyn crate::codec::Codec<T>,
    path: &std::path::Path,
    tx: &std::sync::mpsc::Sender<Result<Vec<Object<T>>, String>>,
) -> Result<(), String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let chunks: Vec<_> = page.entries.chunks(CHUNK).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let tx = tx.clone();
            let (chunks, next, failed) = (&chunks, &next, &failed);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(entries) = chunks.get(i) else {
                    return;
                };
                // A codec that panics is a value that does not decode: a cold start.
                let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    decode(page, entries, codec)
                }));
                let sent = match decoded {
                    Ok(Ok(decoded)) => tx
                        .send(Ok(decoded))
                        .map_err(|_| "nobody takes the decoded values".to_owned()),
                    Ok(Err(kind)) => Err(SnapshotError::new(path, kind).to_string()),
                    Err(panic) => Err(format!(
                        "snapshot {}: the codec panicked: {}",
                        path.display(),
                        crate::sync::panic_message(&*panic)
                    )),
                };
                if let Err(reason) = sent {
                    crate::sync::lock(failed).get_or_insert(reason);
                    // The other threads stop at their next chunk.
                    next.store(chunks.len(), std::sync::atomic::Ordering::Relaxed);
                    return;
                }
            });
        }
    });
    let failed = crate::sync::lock(&failed).take();
    failed.map_or(Ok(()), Err)
}

fn decode<T: 'static>(
    page: &Page,
    entries: &[format::Entry],
    codec: &dyn crate::codec::Codec<T>,
) -> Result<Vec<Object<T>>, SnapshotErrorKind> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let key = page.key(e);
        let value = codec
            .decode(page.value(e))
            .map_err(|error| SnapshotErrorKind::Value {
                key: key.to_owned(),
                error,
            })?;
        let mut o = Object::new(key, e.mod_revision, value);
        o.create_revision = e.create_revision;
        o.version = e.version;
        o.lease = e.lease;
        out.push(o.with_digest(e.digest));
    }
    Ok(out)
}

impl<T: Send + Sync + 'static> ListerWatcher<T> for WarmSource<T> {
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        Box::pin(async move {
            let Some(warm) = self.first_list(None).await? else {
                return self.inner.list().await;
            };
            let items = Arc::new(std::sync::Mutex::new(Vec::with_capacity(warm.keys)));
            let into = items.clone();
            let served = self
                .serve(warm, move |objects| {
                    crate::sync::lock(&into).extend(objects)
                })
                .await;
            let Some(revision) = served else {
                return self.inner.list().await;
            };
            let items = std::mem::take(&mut *crate::sync::lock(&items));
            Ok(ListResult { items, revision })
        })
    }

    fn list_into(&self, sink: Arc<dyn ListSink<T>>) -> BoxFuture<'_, Result<i64>>
    where
        T: 'static,
    {
        Box::pin(async move {
            let Some(warm) = self.first_list(Some(&sink)).await? else {
                return self.inner.list_into(sink).await;
            };
            let taker = sink.clone();
            let served = self
                .serve(warm, move |objects| {
                    taker.page(objects.into_iter().map(Arc::new).collect())
                })
                .await;
            match served {
                Some(revision) => Ok(revision),
                None => {
                    // What the snapshot put in is not this file's as written, or not all of
                    // it: gone before the source is listed into the sink.
                    sink.discard();
                    self.inner.list_into(sink).await
                }
            }
        })
    }

    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        self.inner.watch(after_revision)
    }

    fn capabilities(&self) -> Capabilities<'_> {
        self.inner.capabilities()
    }
}
