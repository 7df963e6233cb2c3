//! Test helpers (feature `testing`): an in-memory source to unit-test controllers without etcd,
//! and throwaway etcd processes for integration tests.

pub mod etcd;
mod fake;

pub use fake::FakeSource;
