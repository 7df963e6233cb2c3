//! Whether a saved cache can follow this etcd prefix from its revision (warm restart from a
//! snapshot, issue 26): one key read for etcd's header, one count-only range of the prefix, no
//! value read.

use etcd_client::GetOptions;

use super::identity::Tally;
use super::request::{classify_code, read};
use super::EtcdListerWatcher;
use crate::listwatch::hedged::Hedged;
use crate::listwatch::{Error, Result, Resume};
use crate::lock;

impl<T: Send + Sync + 'static> EtcdListerWatcher<T> {
    /// [`ListerWatcher::can_resume`](crate::ListerWatcher::can_resume) for etcd (SEMANTICS
    /// rule 22): the cluster id of a response header must be the snapshot's; etcd's current
    /// revision must not be below the snapshot's (a store replaced since: revisions started
    /// over); and etcd must count as many keys under the prefix at that revision as the
    /// snapshot holds (a store wiped and written past the revision almost never does). A
    /// compacted revision is [`Resume::Compacted`]. On [`Resume::Ready`] the source takes the
    /// snapshot's tally as its own, as after a list, so that the watch's own checks go on from
    /// there.
    pub(super) async fn resume_inner(
        &self,
        revision: i64,
        keys: usize,
        cluster_id: u64,
    ) -> Result<Resume> {
        self.token.renew_if_refused(&self.client).await;
        let timeout = self.options.page_timeout;
        let first = self.first_key();
        // Linearizable: a member cut off from its cluster must not vouch for a revision. One
        // key, not the prefix: etcd 3.4 walks every key of a range to count it, and the count
        // at the snapshot's revision below is the one walk needed.
        let now = GetOptions::new().with_count_only();
        let now = match read(&self.client, &first, now, timeout).await {
            Hedged::Answered(r) => r,
            Hedged::Failed(e) => return Err(self.failed(e, revision)),
            Hedged::TimedOut => return Err(self.timed_out("reading etcd's revision", timeout)),
        };
        let Some(header) = now.header() else {
            return Ok(Resume::Refused(
                "etcd's answer carried no header (no cluster id to compare)".into(),
            ));
        };
        if header.cluster_id() != cluster_id {
            return Ok(Resume::Refused(format!(
                "another cluster: the snapshot's cluster id is {cluster_id:x}, etcd's {:x}",
                header.cluster_id()
            )));
        }
        if header.revision() < revision {
            return Ok(Resume::Refused(format!(
                "the snapshot's revision {revision} is ahead of etcd's {}: the store was replaced (wiped or restored)",
                header.revision()
            )));
        }
        let at = GetOptions::new()
            .with_range(self.range_end.clone())
            .with_count_only()
            .with_revision(revision);
        let then = match read(&self.client, &first, at, timeout).await {
            Hedged::Answered(r) => r,
            Hedged::Failed(e) if classify_code(&e) == Some(tonic::Code::OutOfRange) => {
                return Ok(Resume::Compacted(format!(
                    "etcd compacted revision {revision} away: {e}"
                )))
            }
            Hedged::Failed(e) => return Err(self.failed(e, revision)),
            Hedged::TimedOut => {
                return Err(self.timed_out("counting the keys at the snapshot's revision", timeout))
            }
        };
        let counted = then.count();
        if usize::try_from(counted).ok() != Some(keys) {
            return Ok(Resume::Refused(format!(
                "the key tally differs at revision {revision}: etcd counts {counted} keys under {}, the snapshot holds {keys} (the store was replaced, or keys that do not decode are missing from the cache)",
                self.prefix()
            )));
        }
        *lock(&self.tally) = Tally {
            revision,
            keys: counted,
        };
        // As a list's first page would: the store the cache now follows.
        let mut identity = lock(&self.identity);
        if identity.cluster_id == 0 {
            identity.cluster_id = header.cluster_id();
        }
        Ok(Resume::Ready)
    }

    fn timed_out(&self, what: &str, timeout: std::time::Duration) -> Error {
        Error::unavailable(format!(
            "{what} of {} timed out after {timeout:?}",
            self.prefix()
        ))
    }
}
