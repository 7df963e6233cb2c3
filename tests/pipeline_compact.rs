//! The pipeline rules of SEMANTICS.md on the in-memory source, with a compact cache (values
//! packed as text, decoded on every read) in the default processing mode: the same cases as
//! pipeline.rs.
#![cfg(feature = "testing")]

const PROCESSING: etcd_informer::Processing = etcd_informer::Processing::Atomic;
const COMPACT: bool = true;

include!("common/pipeline_cases.rs");
