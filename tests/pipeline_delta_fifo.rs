//! The pipeline rules of SEMANTICS.md on the in-memory source, in the DeltaFIFO processing mode
//! (the same cases as pipeline.rs).
#![cfg(feature = "testing")]

const PROCESSING: etcd_informer::Processing = etcd_informer::Processing::DeltaFifo;
const COMPACT: bool = false;

include!("common/pipeline_cases.rs");
