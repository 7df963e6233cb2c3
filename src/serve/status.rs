//! The errors the server answers with where etcd would, in etcd's words: clients (clientv3,
//! etcdctl) decide on them whether to retry elsewhere.

use tonic::Status;

/// Whether a request asks for a leader (etcd's `hasleader` metadata, clientv3's
/// `WithRequireLeader`).
pub(crate) fn requires_leader(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.get("hasleader").is_some_and(|v| v == "true")
}

/// etcd's answer on a stream it ends because it stops: clients take it as a reason to go to
/// another member.
pub(crate) fn stopped() -> Status {
    Status::unavailable("etcdserver: server stopped")
}

/// etcd's answer to a request that asks for a leader when its member has none.
pub(crate) fn no_leader() -> Status {
    Status::unavailable("etcdserver: no leader")
}
