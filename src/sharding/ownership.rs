//! The records in etcd that say who is a member and who owns which shard, all attached to
//! their member's lease so that a crashed member's records vanish with its lease.
//!
//! Layout under the sharding prefix `P`:
//!
//! - `P/members/NAME` = `NAME`: a live member.
//! - `P/shards/NNNN` = `NAME`: the owner of shard `NNNN`. Created only if absent, deleted only
//!   by its owner at the `mod_revision` it created it at (or by etcd with the owner's lease).
//!   Its key and `mod_revision` are the shard's [`Fence`].

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};

use crate::client::Fence;

/// Reads and writes one sharded runner's records.
#[derive(Clone)]
pub(crate) struct Records {
    client: Client,
    prefix: String,
}

impl Records {
    /// `prefix` ends with `/`.
    pub(crate) fn new(client: Client, prefix: String) -> Self {
        Records { client, prefix }
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn members_prefix(&self) -> String {
        format!("{}members/", self.prefix)
    }

    /// The owner record's key of `shard`, relative to the prefix.
    pub(crate) fn shard_key(shard: u32) -> String {
        format!("shards/{shard:04}")
    }

    /// The owner record's full key of `shard`.
    pub(crate) fn shard_key_full(&self, shard: u32) -> String {
        format!("{}{}", self.prefix, Self::shard_key(shard))
    }

    /// The shard an owner record's key (relative to the prefix) names.
    pub(crate) fn shard_of_record(key: &str) -> Option<u32> {
        key.strip_prefix("shards/")?.parse().ok()
    }

    /// The member a membership key (relative to the prefix) names.
    pub(crate) fn member_of_record(key: &str) -> Option<&str> {
        key.strip_prefix("members/").filter(|m| !m.is_empty())
    }

    /// Announces `member`, held by `lease`.
    pub(crate) async fn join(&self, member: &str, lease: i64) -> Result<(), etcd_client::Error> {
        let key = format!("{}{member}", self.members_prefix());
        self.client
            .kv_client()
            .put(key, member, Some(PutOptions::new().with_lease(lease)))
            .await
            .map(drop)
    }

    /// Takes `shard` for `member` if nobody owns it; the fence of the new record, or `None` if
    /// the shard has an owner.
    pub(crate) async fn acquire(
        &self,
        shard: u32,
        member: &str,
        lease: i64,
    ) -> Result<Option<Fence>, etcd_client::Error> {
        let key = self.shard_key_full(shard);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                member,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let resp = self.client.kv_client().txn(txn).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        Ok(resp.succeeded().then(|| Fence::new(key, revision)))
    }

    /// Deletes the owner record behind `fence`, if it is still that record. `Ok(false)`: it was
    /// already gone (or replaced), which also means the shard is no longer ours.
    pub(crate) async fn release(&self, fence: &Fence) -> Result<bool, etcd_client::Error> {
        let txn = Txn::new()
            .when([Compare::mod_revision(
                fence.key(),
                CompareOp::Equal,
                fence.revision(),
            )])
            .and_then([TxnOp::delete(fence.key(), None)]);
        Ok(self.client.kv_client().txn(txn).await?.succeeded())
    }
}
