//! The etcd source.
