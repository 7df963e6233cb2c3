//! Whether a saved cache can follow this etcd prefix from its revision (warm restart from a
//! snapshot, issue 26): one key read for etcd's header, then the prefix counted at the
//! snapshot's revision in count-only ranges asked at once; no value read.

use etcd_client::GetOptions;

use super::identity::Tally;
use super::request::{classify_code, read};
use super::EtcdListerWatcher;
use crate::listwatch::hedged::Hedged;
use crate::listwatch::{Error, Result, Resume};
use crate::sync::lock;

impl<T: Send + Sync + 'static> EtcdListerWatcher<T> {
    /// [`Resumable::can_resume`](crate::listwatch::Resumable::can_resume) for etcd (SEMANTICS
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
        splits: Vec<String>,
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
        let counted = match self.count_at(revision, &splits).await? {
            Ok(counted) => counted,
            Err(compacted) => return Ok(Resume::Compacted(compacted)),
        };
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

    /// The prefix's keys at `revision`, counted in parts split at `splits` (keys relative to
    /// the prefix, sorted) and asked at once: etcd walks every key of a range to count it, on
    /// one core a request, so parts take a fraction of the time where etcd has cores to spare.
    /// `Ok(Err(why))` when etcd compacted `revision` away.
    async fn count_at(
        &self,
        revision: i64,
        splits: &[String],
    ) -> Result<std::result::Result<i64, String>> {
        let timeout = self.options.page_timeout;
        let bounds = count_bounds(&self.prefix, &self.first_key(), &self.range_end, splits);
        let mut parts = tokio::task::JoinSet::new();
        for part in bounds.windows(2) {
            let (client, start, end) = (self.client.clone(), part[0].clone(), part[1].clone());
            let at = GetOptions::new()
                .with_range(end)
                .with_count_only()
                .with_revision(revision);
            parts.spawn(async move { read(&client, &start, at, timeout).await });
        }
        let mut counted = 0;
        while let Some(part) = parts.join_next().await {
            let part = part.map_err(|e| {
                Error::transient(format!(
                    "counting the keys of {} failed: {e}",
                    self.prefix()
                ))
            })?;
            match part {
                Hedged::Answered(r) => counted += r.count(),
                Hedged::Failed(e) if classify_code(&e) == Some(tonic::Code::OutOfRange) => {
                    return Ok(Err(format!("etcd compacted revision {revision} away: {e}")))
                }
                Hedged::Failed(e) => return Err(self.failed(e, revision)),
                Hedged::TimedOut => {
                    let what = "counting the keys at the snapshot's revision";
                    return Err(self.timed_out(what, timeout));
                }
            }
        }
        Ok(Ok(counted))
    }

    fn timed_out(&self, what: &str, timeout: std::time::Duration) -> Error {
        Error::unavailable(format!(
            "{what} of {} timed out after {timeout:?}",
            self.prefix()
        ))
    }
}

/// The bounds of the parts a count of the range `[first, end)` of `prefix` is asked in: `first`,
/// then each of `splits` (relative to the prefix) that comes after the bound before it and
/// before `end`, then `end`. Each part is `[bounds[i], bounds[i + 1])`: every key once.
fn count_bounds(prefix: &[u8], first: &[u8], end: &[u8], splits: &[String]) -> Vec<Vec<u8>> {
    let mut bounds = vec![first.to_vec()];
    // An end of `\0` means "every key from `first` on" (the whole keyspace, or a prefix of
    // `0xff` bytes): no key is below it, so it is counted in one.
    if end != [0] {
        for split in splits {
            let key = [prefix, split.as_bytes()].concat();
            if bounds.last().is_some_and(|last| key > *last) && *key < *end {
                bounds.push(key);
            }
        }
    }
    bounds.push(end.to_vec());
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(prefix: &str, first: &str, end: &[u8], splits: &[&str]) -> Vec<Vec<u8>> {
        let splits: Vec<String> = splits.iter().map(|s| s.to_string()).collect();
        count_bounds(prefix.as_bytes(), first.as_bytes(), end, &splits)
    }

    #[test]
    fn a_count_is_split_into_parts_that_cover_the_range_once() {
        let (p, end) = ("/p/", b"/p0".as_slice());
        let b = |s: &str| s.as_bytes().to_vec();
        // In order: one part between each.
        assert_eq!(
            bounds(p, p, end, &["b", "m"]),
            [b("/p/"), b("/p/b"), b("/p/m"), b("/p0")]
        );
        // Out of order, repeated, empty (the prefix itself): skipped.
        assert_eq!(
            bounds(p, p, end, &["m", "b", "m", ""]),
            [b("/p/"), b("/p/m"), b("/p0")]
        );
        // No splits: the range whole.
        assert_eq!(bounds(p, p, end, &[]), [b("/p/"), b("/p0")]);
        // The whole keyspace, and a prefix whose end wraps to `\0`: never split.
        assert_eq!(bounds("", "\0", b"\0", &["a"]), [b("\0"), b("\0")]);
        let ff = [0xffu8, 0xff];
        let splits = ["a".to_owned()];
        assert_eq!(
            count_bounds(&ff, &ff, &[0], &splits),
            [ff.to_vec(), vec![0]]
        );
    }
}
