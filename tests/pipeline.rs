//! The pipeline rules of SEMANTICS.md on the in-memory source, in the default revision-atomic
//! processing mode (the same cases run in the DeltaFIFO mode in pipeline_delta_fifo.rs).
#![cfg(feature = "testing")]

const PROCESSING: etcd_informer::Processing = etcd_informer::Processing::Atomic;
const COMPACT: bool = false;

include!("common/pipeline_cases.rs");
