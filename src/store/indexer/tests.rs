//! The indexer's unit tests.

use super::*;
use crate::store::{namespace_index_func, namespace_indexers, IndexFunc, NAMESPACE_INDEX};

fn obj(key: &str, rev: i64, labels: &[&str]) -> Arc<Object<Vec<String>>> {
    Arc::new(Object::new(
        key,
        rev,
        labels.iter().map(|s| s.to_string()).collect(),
    ))
}

/// The index "label": the object's value, a list of labels.
fn label_index() -> Indexers<Vec<String>> {
    let mut indexers: Indexers<Vec<String>> = HashMap::new();
    indexers.insert(
        "label".into(),
        IndexFunc::new(|o: &Object<Vec<String>>| o.value.clone()),
    );
    indexers
}

fn label_indexer() -> Indexer<Vec<String>> {
    let indexer = Indexer::with_namespace_index();
    indexer.add_indexers(label_index()).unwrap();
    indexer
}

/// Comma-separated labels.
fn parse_labels(bytes: &[u8]) -> Result<Vec<String>, crate::codec::CodecError> {
    let text = std::str::from_utf8(bytes)?;
    Ok(text
        .split(',')
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

fn sorted(keys: Vec<Arc<str>>) -> Vec<String> {
    let mut v: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    v.sort();
    v
}

#[test]
fn multi_value_index_follows_updates_and_deletes() {
    let ix = label_indexer();
    ix.add(obj("tmp/a", 1, &["x", "y"]));
    ix.add(obj("tmp/b", 2, &["y"]));
    assert_eq!(
        sorted(ix.index_keys("label", "y").unwrap()),
        ["tmp/a", "tmp/b"]
    );
    ix.update(obj("tmp/a", 3, &["z"]));
    assert_eq!(sorted(ix.index_keys("label", "y").unwrap()), ["tmp/b"]);
    assert!(ix.index_keys("label", "x").unwrap().is_empty());
    assert_eq!(sorted(ix.index_keys("label", "z").unwrap()), ["tmp/a"]);
    ix.delete("tmp/b");
    let mut values = ix.list_index_func_values("label");
    values.sort();
    assert_eq!(values, ["z"], "empty index values are removed");
    assert_eq!(ix.by_index("label", "z").unwrap()[0].mod_revision, 3);
    let same = ix.index("label", &obj("other/c", 9, &["z", "q"])).unwrap();
    assert_eq!(same.len(), 1);
}

/// The namespace index is the items' own sets, one a namespace: it must answer as the same
/// function computed on every object does, through adds, updates and deletes, in both
/// representations.
#[test]
fn the_namespace_index_answers_as_the_function_it_skips() {
    let indexers = || {
        let mut indexers = namespace_indexers::<Vec<String>>();
        indexers.insert("computed".into(), IndexFunc::new(namespace_index_func));
        indexers
    };
    for ix in [
        Indexer::new(indexers()),
        Indexer::compact(indexers(), LabelCodec),
    ] {
        ix.add(obj("tmp/a", 1, &["x"]));
        ix.add(obj("tmp/b", 2, &["y"]));
        ix.add(obj("prod/c", 3, &[]));
        ix.add(obj("solo", 6, &[]));
        ix.add(obj("gone", 7, &[]));
        ix.update(obj("tmp/a", 4, &["z"]));
        ix.update(obj("prod/c", 5, &["w"]));
        ix.update(obj("solo", 8, &["v"]));
        ix.delete("tmp/b");
        ix.delete("gone");
        ix.delete("absent/d");
        // A key without a `/` has the empty namespace.
        for ns in ["tmp", "prod", "absent", ""] {
            let by_key = ix.by_index(NAMESPACE_INDEX, ns).unwrap();
            let computed = ix.by_index("computed", ns).unwrap();
            let revisions = |objs: &[Arc<Object<Vec<String>>>]| {
                let mut r: Vec<i64> = objs.iter().map(|o| o.mod_revision).collect();
                r.sort();
                r
            };
            assert_eq!(revisions(&by_key), revisions(&computed), "namespace {ns}");
        }
        assert_eq!(
            ix.by_index(NAMESPACE_INDEX, "tmp").unwrap()[0].mod_revision,
            4
        );
        ix.delete("tmp/a");
        let mut values = ix.list_index_func_values(NAMESPACE_INDEX);
        values.sort();
        assert_eq!(
            values,
            ["", "prod"],
            "an emptied namespace is no value any more"
        );
        // Registered later, another index of the namespace function answers at once.
        let again = [("again".to_owned(), IndexFunc::namespace())];
        ix.add_indexers(again.into_iter().collect()).unwrap();
        assert_eq!(ix.by_index("again", "prod").unwrap()[0].mod_revision, 5);
    }
}

#[test]
fn unknown_index_is_an_error() {
    let ix = label_indexer();
    assert_eq!(
        ix.by_index("nope", "x").unwrap_err(),
        StoreError::IndexNotFound("nope".into())
    );
    let mut dup: Indexers<Vec<String>> = HashMap::new();
    dup.insert(NAMESPACE_INDEX.into(), IndexFunc::new(namespace_index_func));
    assert_eq!(
        ix.add_indexers(dup).unwrap_err(),
        StoreError::IndexExists(NAMESPACE_INDEX.into())
    );
}

#[test]
fn indexer_added_later_indexes_existing_objects() {
    let ix: Indexer<Vec<String>> = Indexer::default();
    ix.add(obj("tmp/a", 1, &["x"]));
    ix.add(obj("prod/b", 2, &["x"]));
    let mut more: Indexers<Vec<String>> = HashMap::new();
    more.insert(NAMESPACE_INDEX.into(), IndexFunc::new(namespace_index_func));
    ix.add_indexers(more).unwrap();
    assert_eq!(
        sorted(ix.index_keys(NAMESPACE_INDEX, "prod").unwrap()),
        ["prod/b"]
    );
}

#[test]
fn replace_rebuilds_indexes_and_keys_are_shared() {
    let ix = label_indexer();
    ix.add(obj("tmp/a", 1, &["x"]));
    ix.replace(vec![obj("tmp/b", 5, &["y"])]);
    assert!(ix.get_by_key("tmp/a").is_none());
    assert!(ix.index_keys("label", "x").unwrap().is_empty());
    let stored = ix.get_by_key("tmp/b").unwrap();
    let indexed = ix.index_keys("label", "y").unwrap();
    assert!(
        Arc::ptr_eq(stored.shared_key(), &indexed[0]),
        "index shares the key"
    );
    assert_eq!(ix.len(), 1);
}

/// Labels as comma-separated text; "bad" does not round-trip (it decodes as an error).
struct LabelCodec;

impl Codec<Vec<String>> for LabelCodec {
    fn decode(&self, bytes: &[u8]) -> Result<Vec<String>, crate::codec::CodecError> {
        let labels = parse_labels(bytes)?;
        if labels.iter().any(|l| l == "bad") {
            return Err("bad label".into());
        }
        Ok(labels)
    }
    fn encode(&self, value: &Vec<String>) -> Result<Vec<u8>, crate::codec::CodecError> {
        Ok(value.join(",").into_bytes())
    }
}

fn snapshot(ix: &Indexer<Vec<String>>) -> Vec<String> {
    let mut out: Vec<String> = ix
        .list()
        .iter()
        .map(|o| format!("{} {} {} {:?}", o.key(), o.mod_revision, o.version, o.value))
        .collect();
    for name in ix.index_names() {
        for value in ix.list_index_func_values(&name) {
            let mut keys = sorted(ix.index_keys(&name, &value).unwrap());
            let mut objects: Vec<String> = ix
                .by_index(&name, &value)
                .unwrap()
                .iter()
                .map(|o| format!("{}@{}", o.key(), o.mod_revision))
                .collect();
            objects.sort();
            keys.push(format!("{objects:?}"));
            out.push(format!("{name}={value}: {keys:?}"));
        }
    }
    out.sort();
    out
}

#[test]
fn compact_store_answers_exactly_as_the_shared_one() {
    let shared = label_indexer();
    let compact = Indexer::compact(namespace_indexers(), LabelCodec);
    compact.add_indexers(label_index()).unwrap();
    let labels = ["x", "y", "z", "bad"];
    let mut rng = fastrand::Rng::with_seed(7);
    for step in 0..3_000i64 {
        let key = format!("ns{}/k{}", rng.usize(0..3), rng.usize(0..20));
        match rng.usize(0..10) {
            0..=5 => {
                let value: Vec<&str> = (0..rng.usize(0..3))
                    .map(|_| labels[rng.usize(0..labels.len())])
                    .collect();
                let mut o = Object::new(
                    key.as_str(),
                    step,
                    value.iter().map(|l| l.to_string()).collect(),
                );
                o.version = step % 5 + 1;
                o.lease = -step;
                let o = Arc::new(o);
                let (a, b) = (shared.add(o.clone()), compact.add(o));
                assert_eq!(a.as_deref(), b.as_deref(), "replaced object at step {step}");
            }
            6..=8 => assert_eq!(
                shared.delete(&key).as_deref(),
                compact.delete(&key).as_deref(),
                "deleted object at step {step}"
            ),
            _ => {
                // A relist: content built away from each store, page by page, then
                // installed (in the compact store, pages share chunks, repacked as they
                // die).
                let objects: Vec<_> = shared
                    .list()
                    .into_iter()
                    .filter(|o| o.mod_revision % 3 != 0)
                    .collect();
                for ix in [&shared, &compact] {
                    let mut next = ix.new_content();
                    for page in objects.chunks(7) {
                        next.add_page(page);
                    }
                    ix.transaction(|txn| txn.install(next));
                }
            }
        }
        assert_eq!(snapshot(&shared), snapshot(&compact), "after step {step}");
        assert_eq!(
            Store::mod_revision(&compact, &key),
            shared.get_by_key(&key).map(|o| o.mod_revision),
            "mod_revision without decoding, step {step}"
        );
    }
    assert!(compact.is_compact() && !shared.is_compact());
}

/// Labels as comma-separated text that drops the label "secret" (it does not round-trip)
/// and, while `broken`, decodes nothing.
struct Lossy(Arc<std::sync::atomic::AtomicBool>);

impl Codec<Vec<String>> for Lossy {
    fn decode(&self, bytes: &[u8]) -> Result<Vec<String>, crate::codec::CodecError> {
        if self.0.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("broken".into());
        }
        parse_labels(bytes)
    }
    fn encode(&self, value: &Vec<String>) -> Result<Vec<u8>, crate::codec::CodecError> {
        let kept: Vec<&str> = value
            .iter()
            .map(|l| l.as_str())
            .filter(|l| *l != "secret")
            .collect();
        Ok(kept.join(",").into_bytes())
    }
}

#[test]
fn compact_indexes_follow_what_reads_see_even_when_the_codec_loses_or_fails() {
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ix = Indexer::compact(HashMap::new(), Lossy(broken.clone()));
    ix.add_indexers(label_index()).unwrap();
    ix.add(obj("ns/a", 1, &["x", "secret"]));
    assert_eq!(
        ix.get_by_key("ns/a").unwrap().value,
        ["x"],
        "reads see what comes back"
    );
    assert!(
        ix.index_keys("label", "secret").unwrap().is_empty(),
        "indexed as read"
    );
    assert_eq!(sorted(ix.index_keys("label", "x").unwrap()), ["ns/a"]);
    // The old object can no longer be decoded: its index entries still go.
    broken.store(true, std::sync::atomic::Ordering::SeqCst);
    ix.add(obj("ns/a", 2, &["y"]));
    broken.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(
        ix.index_keys("label", "x").unwrap().is_empty(),
        "no stale entry"
    );
    assert_eq!(sorted(ix.index_keys("label", "y").unwrap()), ["ns/a"]);
    ix.delete("ns/a");
    assert!(ix.list_index_func_values("label").is_empty());
}

/// A relist after a warm start: the cache's records are a snapshot's, in one buffer in hash
/// order, and the list adopts them in key order, a page at a time, between the pages of keys
/// that changed. Each page's adoptions touch the whole buffer, so until the list is whole
/// the buffer looks mostly dead; the content repacked (copied) everything adopted so far
/// after every page, keeping almost none of the buffer's records (and costing a copy of the
/// table per page). A list's content now repacks once it is whole, if then.
#[test]
fn a_relist_after_a_warm_start_adopts_the_snapshots_records_without_copying_them() {
    use crate::store::compact::write_record;
    let n = 1000;
    let mut keys: Vec<String> = (0..n).map(|i| format!("ns/k{i:04}")).collect();
    fastrand::Rng::with_seed(3).shuffle(&mut keys);
    let mut bytes = Vec::new();
    let mut spans = Vec::new();
    for key in &keys {
        let at = bytes.len();
        write_record(&mut bytes, key, [5, 5, 1, 0], 9, 0, b"a");
        spans.push((at as u32, (bytes.len() - at) as u32));
    }
    let buffer = Arc::new(bytes.into_boxed_slice());
    let ix = Indexer::compact(HashMap::new(), LabelCodec);
    let mut warm = ix.new_content();
    let objs: Vec<_> = keys
        .iter()
        .zip(&spans)
        .map(|(key, &(at, len))| EncodedObject {
            key,
            value: b"a",
            revisions: [5, 5, 1, 0],
            digest: 9,
            index: Default::default(),
            record: Some(crate::object::SharedRecord {
                buffer: &buffer,
                at,
                len,
                key_hash: crate::store::key_hash(key),
            }),
        })
        .collect();
    warm.add_encoded(&objs);
    drop(objs);
    ix.transaction(|txn| txn.install(warm));
    assert_eq!(
        Arc::strong_count(&buffer) - 1,
        n,
        "the warm start shares every record"
    );

    keys.sort();
    let stamp = Stamp {
        mod_revision: 5,
        create_revision: 5,
        version: 1,
        digest: 9,
    };
    let mut next = ix.new_content();
    next.defer_repacks(true);
    for page in keys.chunks(10) {
        // The page's first key changed; the other nine are as the cache holds them.
        let (changed, unchanged) = page.split_at(1);
        for key in unchanged {
            assert!(next.adopt(&ix, key, &stamp), "{key} adopted");
        }
        next.add_page(&[obj(&changed[0], 6, &["b"])]);
    }
    next.defer_repacks(false);
    ix.transaction(|txn| txn.install(next));
    assert_eq!(ix.list().len(), n);
    assert_eq!(
        Arc::strong_count(&buffer) - 1,
        n - n / 10,
        "every adopted record is still the snapshot's"
    );
}
