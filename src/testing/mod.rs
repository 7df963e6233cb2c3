//! Test helpers (feature `testing`): an in-memory source to unit-test controllers without etcd,
//! throwaway etcd processes for integration tests, and a chaos driver that injects faults into
//! a real etcd cluster under an informer.

pub mod chaos;
pub mod etcd;
mod fake;

pub use fake::FakeSource;
