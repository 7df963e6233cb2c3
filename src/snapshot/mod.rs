//! Warm restart: the informer's cache saved to a local file, and loaded on the next start
//! instead of listing the prefix again, when etcd confirms it can follow on from it.
//!
//! Turned on with [`InformerOptions::with_snapshot`](crate::InformerOptions::with_snapshot)
//! (off by default). While the informer runs, its cache is written every
//! [`SnapshotOptions::period`] (if it changed) and once more when it
//! [stops](crate::SharedIndexInformer::stop): the keys, their values as the codec encodes
//! them, their revisions, leases, digests of etcd's bytes and index values, at ONE revision
//! (read under the store's read lock; a compact cache whose codec has the snapshot codec's
//! name gives its records as they are, decoding nothing), with the upstream's cluster id, the
//! prefix, the codec's id, the index names, the key count and a checksum. The
//! file is written to `<path>.tmp`, synced, renamed over `<path>`, and the directory synced:
//! a crash at any point leaves the previous snapshot or the new one, whole. It is created
//! readable by its owner alone (0600): it holds every value of the prefix.
//!
//! On start, the informer reads the file's head and checks it (length, format version, codec
//! id, prefix), then asks the source ([`Resumable::can_resume`](crate::listwatch::Resumable::can_resume)) for the same cluster, a
//! revision etcd still has (not ahead of etcd's: a store replaced since), and as many keys
//! under the prefix at that revision as the snapshot holds. Meanwhile it reads the rest a page
//! at a time, each page handed on as the next is read, and checks the checksum at the end:
//! a mismatch drops what was handed on. Then:
//!
//! - **resumable**: the snapshot is the first list: handlers get its objects as adds (as
//!   after a list), the watch opens from its revision + 1, and no list is read. A compact
//!   cache whose codec has the snapshot codec's [name](crate::codec::Codec::name), with the
//!   same index names, takes the records undecoded and uncopied (the file holds them in its
//!   own layout; a sample of them is decoded, to check the codec and the index functions
//!   still agree with the file), while etcd is asked;
//! - **compacted** (its revision gone): etcd can neither count the keys at it nor show the
//!   changes since, so nothing proves the snapshot is this store: a cold start, and no object
//!   of the snapshot reaches a handler or a reader (a watch from it could also open at the
//!   compaction revision itself, where etcd 3.4 before 3.4.36 drops deletes);
//! - **anything else** (truncated, corrupt, another format, codec, prefix or cluster, a
//!   replaced store, a tally that differs, a value that no longer decodes): a warning naming
//!   the reason, and a cold start (a list, at once), as without a snapshot. No file yet is a cold start
//!   too, said at `info`.
//!
//! Whichever it was, one line at `info` (warm) or `warn` (cold) says so on start, and
//! [`SharedIndexInformer::snapshot_start`](crate::SharedIndexInformer::snapshot_start)
//! returns it ([`SnapshotStart`]).
//!
//! Only the default [`Processing::Atomic`](crate::Processing::Atomic) mode writes snapshots:
//! its cache is etcd at one revision, while a [`DeltaFifo`](crate::Processing::DeltaFifo)
//! cache can hold part of a later transaction. A transform
//! ([`InformerOptions::transform`](crate::InformerOptions::transform)) is applied again to
//! the loaded objects, so it must give the same result when applied twice (dropping fields
//! does).
//!

mod error;
mod format;
mod warm;

pub use error::{SnapshotError, SnapshotErrorKind};

use std::fmt;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::codec::Codec;
use crate::object::Object;
use crate::store::compact::write_record;
use crate::store::{IndexFunc, Indexers, Item, Records, SnapshotContent};

pub(crate) use warm::WarmSource;

/// How often the cache is written by default: once a minute. Kubernetes' apiserver compacts
/// etcd every 5 minutes, so a snapshot at most a minute old is usually still within etcd's
/// history after a restart that takes a few minutes (a rollout, a reboot). Writing 100k keys
/// of 256 B takes 0.2 s and 1M keys of 128 B 1.7-2.8 s (BENCHMARKS.md, "Warm restart" and
/// "Snapshot writes from a compact cache's records"): at most 5% of a core at this period, and
/// a cache that did not change is not written again.
pub const DEFAULT_SNAPSHOT_PERIOD: Duration = Duration::from_secs(60);

/// Where and how an informer saves its cache for a warm restart; see the [module
/// docs](self).
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::codec::JsonCodec;
/// use etcd_informer::snapshot::SnapshotOptions;
/// use etcd_informer::InformerOptions;
///
/// let options = InformerOptions::<serde_json::Value>::default().with_snapshot_options(
///     SnapshotOptions::new("/var/lib/agent/configmaps.snap", JsonCodec::new())
///         .with_period(Duration::from_secs(30)),
/// );
/// assert!(options.snapshot.is_some());
/// ```
#[non_exhaustive]
pub struct SnapshotOptions<T> {
    /// The snapshot file; its directory must exist. `<path>.tmp` is used while writing.
    pub path: PathBuf,
    /// Encodes the cached values into the file and decodes them on load. A compact cache
    /// whose codec has this one's [name](Codec::name) writes its values as it holds them,
    /// and takes the file's as they are.
    pub codec: Arc<dyn Codec<T>>,
    /// Names the codec and the type in the file: a snapshot written with another id is not
    /// loaded. Default: the codec's Rust type name (which names `T` too, e.g.
    /// `etcd_informer::codec::JsonCodec<app::ConfigMap>`). Change it when `T`'s encoding
    /// changes incompatibly under the same names.
    pub codec_id: String,
    /// How often the cache is written while the informer runs (if it changed since); default
    /// [`DEFAULT_SNAPSHOT_PERIOD`]. It is also written when the informer stops.
    pub period: Duration,
}

impl<T> SnapshotOptions<T> {
    /// A snapshot at `path`, values encoded with `codec`, every [`DEFAULT_SNAPSHOT_PERIOD`].
    pub fn new<C: Codec<T>>(path: impl Into<PathBuf>, codec: C) -> Self {
        SnapshotOptions {
            path: path.into(),
            codec: Arc::new(codec),
            codec_id: std::any::type_name::<C>().to_owned(),
            period: DEFAULT_SNAPSHOT_PERIOD,
        }
    }

    /// Sets how often the cache is written (`period`).
    #[must_use]
    pub fn with_period(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }

    /// Sets the codec's id recorded in the file (`codec_id`).
    #[must_use]
    pub fn with_codec_id(mut self, codec_id: impl Into<String>) -> Self {
        self.codec_id = codec_id.into();
        self
    }
}

impl<T> Clone for SnapshotOptions<T> {
    fn clone(&self) -> Self {
        SnapshotOptions {
            path: self.path.clone(),
            codec: self.codec.clone(),
            codec_id: self.codec_id.clone(),
            period: self.period,
        }
    }
}

impl<T> fmt::Debug for SnapshotOptions<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotOptions")
            .field("path", &self.path)
            .field("codec_id", &self.codec_id)
            .field("period", &self.period)
            .finish_non_exhaustive()
    }
}

/// How an informer with a snapshot started: the one line it logs on start.
///
/// ```
/// use etcd_informer::snapshot::SnapshotStart;
/// let warm = SnapshotStart::Warm { revision: 42, keys: 1000 };
/// assert_eq!(warm.to_string(), "warm start from the snapshot at revision 42 (1000 keys), no list");
/// assert!(warm.is_warm());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SnapshotStart {
    /// The snapshot was loaded and the watch opened from its revision + 1: no list.
    Warm {
        /// The snapshot's revision.
        revision: i64,
        /// How many keys it held.
        keys: usize,
    },
    /// The snapshot was not used (there was none, it was damaged, or etcd could not vouch for
    /// it: another store, or its revision compacted): a list, as without snapshots.
    Cold {
        /// Why.
        reason: String,
    },
}

impl SnapshotStart {
    /// Whether the snapshot was loaded.
    pub fn is_warm(&self) -> bool {
        !matches!(self, SnapshotStart::Cold { .. })
    }
}

impl fmt::Display for SnapshotStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapshotStart::Warm { revision, keys } => write!(
                f,
                "warm start from the snapshot at revision {revision} ({keys} keys), no list"
            ),
            SnapshotStart::Cold { reason } => write!(f, "cold start: {reason}"),
        }
    }
}

/// What an informer with snapshots on keeps: the options, how it started, and the revision
/// last written (behind an async lock, so that two writes never overlap).
pub(crate) struct Snapshots<T> {
    pub(crate) options: SnapshotOptions<T>,
    pub(crate) start: Arc<OnceLock<SnapshotStart>>,
    pub(crate) written: tokio::sync::Mutex<i64>,
}

/// Writes `content`, the source's content at `revision` in cluster `cluster_id` under
/// `prefix`, to the snapshot file, with their values for each of `indexers` (see the [module
/// docs](self) for how). A compact cache's records are written as they are.
pub(crate) fn write<T: 'static>(
    options: &SnapshotOptions<T>,
    cluster_id: u64,
    prefix: &str,
    revision: i64,
    content: &SnapshotContent<T>,
    indexers: &Indexers<T>,
) -> Result<(), SnapshotError> {
    let mut indexes: Vec<_> = indexers.iter().collect();
    indexes.sort_by(|a, b| a.0.cmp(b.0));
    let header = format::Header {
        cluster_id,
        revision,
        prefix: prefix.to_owned(),
        codec_id: options.codec_id.clone(),
        indexes: indexes.iter().map(|(name, _)| (*name).clone()).collect(),
    };
    let functions: Vec<_> = indexes.iter().map(|(_, f)| (*f).clone()).collect();
    let object = Objects {
        options,
        indexes: &functions,
    };
    let objects = match content {
        SnapshotContent::Objects(objects) => objects,
        SnapshotContent::Records(records) => return write_records(&header, records, &object),
    };
    let mut encoder = format::Encoder::new(&header, objects.len() * 128);
    for o in objects {
        let value = object.value(o)?;
        encoder.key(o.key(), &value, revisions(o), o.digest(), &object.index(o));
    }
    format::write_atomic(&options.path, &encoder.finish())
}

/// How a decoded object goes into a snapshot.
struct Objects<'a, T> {
    options: &'a SnapshotOptions<T>,
    /// The index functions, in the order of the sorted index names.
    indexes: &'a [IndexFunc<T>],
}

impl<T: 'static> Objects<'_, T> {
    fn value(&self, o: &Object<T>) -> Result<Vec<u8>, SnapshotError> {
        self.options.codec.encode(&o.value).map_err(|error| {
            let key = o.key().to_owned();
            SnapshotError::new(&self.options.path, SnapshotErrorKind::Encode { key, error })
        })
    }

    fn index(&self, o: &Object<T>) -> Vec<Vec<String>> {
        self.indexes.iter().map(|f| f.values(o)).collect()
    }
}

fn revisions<T>(o: &Object<T>) -> [i64; 4] {
    [o.mod_revision, o.create_revision, o.version, o.lease]
}

/// Writes a compact cache's records in two passes: the head (each record's length and index
/// values), then the records straight from the cache to the file, none copied into a buffer
/// (a million keys are about 180 MB). Objects the cache holds decoded are encoded in the
/// first pass, their records kept for the second.
fn write_records<T: 'static>(
    header: &format::Header,
    records: &Records<T>,
    object: &Objects<'_, T>,
) -> Result<(), SnapshotError> {
    let mut encoder = format::Encoder::new(header, 0);
    let names: Vec<&str> = header.indexes.iter().map(String::as_str).collect();
    let mut decoded = Vec::new();
    let mut decoded_ends = Vec::new();
    let mut failed = Ok(());
    records.for_each_record(&names, &mut |item| {
        match item {
            Item::Record(record, index) => encoder.streamed(record.len(), index),
            Item::Decoded(o) => match object.value(&o) {
                Ok(value) => {
                    let start = decoded.len();
                    write_record(&mut decoded, o.key(), revisions(&o), o.digest(), 0, &value);
                    decoded_ends.push(decoded.len());
                    encoder.streamed(decoded.len() - start, &object.index(&o));
                }
                Err(e) => failed = Err(e),
            },
        }
        match failed {
            Ok(()) => ControlFlow::Continue(()),
            Err(_) => ControlFlow::Break(()),
        }
    });
    failed?;
    let (head, lengths) = encoder.finish_streamed();
    format::write_atomic_with(&object.options.path, |file| {
        let mut out = format::RecordsWriter::new(file, &head, lengths)?;
        let mut ends = decoded_ends.iter();
        let mut start = 0;
        let mut written = Ok(());
        records.for_each_record(&[], &mut |item| {
            written = match item {
                Item::Record(record, _) => out.record(record),
                Item::Decoded(_) => match ends.next() {
                    Some(&end) => {
                        let record = decoded.get(start..end).unwrap_or_default();
                        start = end;
                        out.record(record)
                    }
                    None => Err(std::io::Error::other(
                        "more objects held decoded than the first pass met",
                    )),
                },
            };
            match written {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            }
        });
        written?;
        out.finish()
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::codec::TextCodec;

    #[test]
    fn written_then_read_back() {
        let dir = std::env::temp_dir().join(format!("eisnap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let options = SnapshotOptions::new(dir.join("s"), TextCodec);
        let objects = vec![Arc::new(Object::new("a/b", 5, "v".to_string()))];
        let content = SnapshotContent::Objects(objects);
        write(&options, 7, "/p/", 9, &content, &Indexers::new()).expect("written");
        // A leftover temporary file from a crash does not matter.
        std::fs::write(format::temp_path(&options.path), b"half").expect("temp");
        let loaded = format::read(&options.path).expect("read");
        assert_eq!(loaded.header.revision, 9);
        let page = &loaded.pages[0];
        assert_eq!(page.key(&page.entries[0]), "a/b");
        std::fs::remove_dir_all(dir).ok();
    }

    /// Labels as comma-separated text, counting its decodes; a label "bad" does not decode,
    /// so a compact cache holds its object decoded, and neither does "unencodable" encode.
    struct Labels(Arc<AtomicUsize>);

    impl Codec<Vec<String>> for Labels {
        fn decode(&self, bytes: &[u8]) -> Result<Vec<String>, crate::codec::CodecError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            let labels: Vec<String> = std::str::from_utf8(bytes)?
                .split(',')
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect();
            if labels.iter().any(|l| l == "bad") {
                return Err("bad label".into());
            }
            Ok(labels)
        }

        fn encode(&self, value: &Vec<String>) -> Result<Vec<u8>, crate::codec::CodecError> {
            if value.iter().any(|l| l == "unencodable") {
                return Err("unencodable label".into());
            }
            Ok(value.join(",").into_bytes())
        }
    }

    /// A key of a snapshot file: its record, and its values for each index, as a set.
    type Key = (Vec<u8>, Vec<Vec<String>>);

    /// Each key of a snapshot file.
    fn keys_in(path: &Path) -> (format::Header, Vec<Key>) {
        let loaded = format::read(path).expect("read");
        let mut keys = Vec::new();
        for page in &loaded.pages {
            let page_index = page.index();
            for (n, entry) in page.entries.iter().enumerate() {
                let record = page.records[entry.record.clone()].to_vec();
                let mut index: Vec<Vec<String>> = (page_index.of(n).iter())
                    .map(|values| values.iter().map(|v| v.to_string()).collect())
                    .collect();
                for values in &mut index {
                    values.sort();
                    values.dedup();
                }
                keys.push((record, index));
            }
        }
        (loaded.header, keys)
    }

    #[test]
    fn a_compact_cache_is_written_from_its_records_without_decoding_them() {
        let dir = std::env::temp_dir().join(format!("eisnap-records-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let decodes = Arc::new(AtomicUsize::new(0));
        let mut indexers: Indexers<Vec<String>> = Indexers::new();
        indexers.insert(
            "label".into(),
            IndexFunc::new(|o: &Object<Vec<String>>| o.value.clone()),
        );
        indexers.insert(
            "first".into(),
            IndexFunc::new(|o: &Object<Vec<String>>| o.value.iter().take(1).cloned().collect()),
        );
        let ix = crate::Indexer::compact(indexers, Labels(decodes.clone()));
        for (key, labels) in [
            ("ns/a", vec!["x"]),
            ("ns/b", vec!["x", "y", "z"]),
            ("ns/c", vec![]),
            ("ns/d", vec!["bad", "y"]),
            ("ns/e", vec!["y", "y"]),
        ] {
            let labels = labels.into_iter().map(String::from).collect();
            ix.add(Arc::new(Object::new(key, 5, labels)));
        }
        let options = SnapshotOptions::new(dir.join("records"), Labels(decodes.clone()));
        let codec = options.codec.name();
        let (_, _, content, indexers) = ix.snapshot_content(codec);
        assert!(
            matches!(content, SnapshotContent::Records(_)),
            "records, as they are"
        );
        let before = decodes.load(Ordering::SeqCst);
        write(&options, 7, "/p/", 9, &content, &indexers).expect("written");
        assert_eq!(decodes.load(Ordering::SeqCst), before, "nothing decoded");
        // The same content as a cache of decoded objects writes it.
        let objects = SnapshotContent::Objects(ix.list());
        let decoded = SnapshotOptions::new(dir.join("objects"), Labels(decodes));
        write(&decoded, 7, "/p/", 9, &objects, &indexers).expect("written");
        let (header, records) = keys_in(&options.path);
        assert_eq!((header, records), keys_in(&decoded.path));
        // A warm start into a compact cache takes the file's records as they are: each index's
        // values are compared as sets (the records' are in no particular order, each once).
        let loaded = format::read(&options.path).expect("read");
        let page = &loaded.pages[0];
        let index = page.index();
        let sample: Vec<_> = (page.entries.iter().enumerate())
            .filter(|(_, e)| page.key(e) != "ns/d")
            .map(|(n, e)| warm::record(page, e, index.of(n)))
            .collect();
        let mut content = ix.new_content();
        assert!(content.takes_encoded(codec, &loaded.header.indexes, 5, &sample));
        // A codec by another name: the objects.
        let (_, _, content, _) = ix.snapshot_content("another codec");
        assert!(matches!(content, SnapshotContent::Objects(o) if o.len() == 5));
        // An object that does not encode fails the write before the file is touched: the
        // snapshot before it stays, whole, and no temporary file is left.
        let labels = vec!["unencodable".to_owned()];
        ix.add(Arc::new(Object::new("ns/f", 6, labels)));
        let before = std::fs::read(&options.path).expect("the snapshot");
        let (_, _, content, indexers) = ix.snapshot_content(codec);
        let failed = write(&options, 7, "/p/", 10, &content, &indexers);
        let failed = failed.expect_err("ns/f does not encode").to_string();
        assert!(failed.contains("ns/f"), "{failed}");
        assert_eq!(std::fs::read(&options.path).expect("the snapshot"), before);
        assert!(!format::temp_path(&options.path).exists());
        std::fs::remove_dir_all(dir).ok();
    }
}
