//! Consistent reads: waiting until the cache has reached etcd's current revision, proven
//! by the source, before reading it.

use std::time::Duration;

use tokio::time::Instant;

use super::shared_informer::{Queue, SharedIndexInformer};
use crate::lister::Lister;
use crate::listwatch::Error as SourceError;
use crate::listwatch::SourceCapabilities;

/// Why a consistent read or [`SharedIndexInformer::wait_for_revision`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsistencyError {
    /// The cache did not reach the revision in time.
    #[error("informer {informer}: the cache did not reach revision {revision} within {waited:?} (it is at {applied})")]
    Timeout {
        /// The informer's name.
        informer: String,
        /// The revision waited for.
        revision: i64,
        /// The revision the cache had reached.
        applied: i64,
        /// How long it waited.
        waited: Duration,
    },
    /// The informer stopped ([`run`](SharedIndexInformer::run) ended) before its cache
    /// reached the revision: it never will.
    #[error("informer {informer} stopped at revision {applied}, before revision {revision}")]
    Stopped {
        /// The informer's name.
        informer: String,
        /// The revision waited for.
        revision: i64,
        /// The revision the cache had reached.
        applied: i64,
    },
    /// The source could not be asked for its revision (etcd unreachable, for example).
    #[error(
        "{}cannot read the current revision: {source}",
        named(informer, source)
    )]
    Source {
        /// The informer's name.
        informer: String,
        /// What the source said.
        #[source]
        source: SourceError,
    },
}

/// "informer NAME: ", unless the source's own message names it already (an informer is named
/// after its prefix by default, and etcd's errors name the prefix): a message names it once.
fn named(informer: &str, source: &SourceError) -> String {
    if source.to_string().contains(informer) {
        String::new()
    } else {
        format!("informer {informer}: ")
    }
}

/// What the source said of the cache's freshness.
struct Proof {
    /// The revision asked about (the source's current one when none was named).
    revision: i64,
    /// The cache is the source's content at `revision`, and did not change while asked.
    proven: bool,
    /// The cache's write count when the source was asked, if it was synced then: the answer
    /// holds until the cache changes (an unsynced cache is asked about again once it syncs,
    /// which in the DeltaFIFO mode an empty list does without a write).
    asked_at: Option<u64>,
}

/// How long [`SharedIndexInformer::wait_for_revision`] waits for the watch before it asks the
/// source to prove the cache fresh (at most half its timeout). The watch brings a write to the
/// prefix within a millisecond or two (the informer bench's `ryw` scenario: the handler hears
/// it 0.3-0.5 ms after the put began, p99 0.5-4.2 ms), while etcd's proof walks the prefix's
/// keys, for every wait. A revision written elsewhere (a quiet prefix) is proven this much
/// later.
const ASK_AFTER: Duration = Duration::from_millis(5);

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// Asks the source whether the cache is its content at `at` (or now). `proven` in the
    /// answer: it is, and the cache did not change while the source was asked.
    async fn freshness(&self, at: Option<i64>) -> Result<Proof, ConsistencyError> {
        let synced = self.has_synced();
        let (since, cached, writes) = self.revision_len_and_writes();
        // Only the revision-atomic mode's cache is exactly the source's content at its
        // revision (the DeltaFIFO's may hold later changes too), and only while it lacks no
        // key it held (see `verify_warm_start`).
        let exact = (matches!(self.shared.queue, Queue::Atomic(_))
            && !self
                .shared
                .incomplete
                .load(std::sync::atomic::Ordering::Acquire))
        .then_some(cached);
        let fresh = self
            .shared
            .source
            .freshness(since, exact, at)
            .await
            .map_err(|source| ConsistencyError::Source {
                informer: self.shared.name.clone(),
                source,
            })?;
        // Only a synced cache can be the source's content.
        let proven = fresh.unchanged && self.has_synced() && self.prove(writes, fresh.revision);
        Ok(Proof {
            revision: fresh.revision,
            proven,
            asked_at: synced.then_some(writes),
        })
    }

    /// How many relists the cache has applied so far (0 before the first). Not the
    /// reflector's count, which moves once a list is read: the cache takes it a moment later
    /// (at a million keys, about a second), and a read that looked in between would see the
    /// old store again and wait for yet another relist.
    fn relists(&self) -> u64 {
        self.shared.queue.replaces_applied()
    }

    /// After the source said its store was replaced ([`SourceError::StoreReplaced`]: etcd went
    /// back in time), waits until the cache has applied a relist since `before`: until then
    /// it is the old store's, and nothing can prove it fresh. `false` at the deadline.
    async fn relisted_since(&self, before: u64, deadline: Instant) -> bool {
        self.until(deadline, || self.relists() > before && self.has_synced())
            .await
    }

    /// Waits until `done` holds (true), or `deadline` passes or the informer stops first
    /// (false). `done` is checked again each time the cache moves (`Shared::moved`), never on
    /// a timer.
    async fn until(&self, deadline: Instant, done: impl Fn() -> bool) -> bool {
        loop {
            let moved = self.shared.moved.notified();
            tokio::pin!(moved);
            // Registered before `done` is checked, so that a move in between is not lost.
            moved.as_mut().enable();
            if done() {
                return true;
            }
            if self.is_stopped() {
                return false;
            }
            if tokio::time::timeout_at(deadline, moved).await.is_err() {
                return done();
            }
        }
    }

    /// Waits until the cache reflects the source at `revision` or later: its
    /// [`proven_revision`](Self::proven_revision) reaches it, or the source shows that nothing
    /// under the prefix changed between the cache's revision and `revision`. The source is asked
    /// only if the watch has not brought `revision` within 5 ms or half the timeout, whichever is
    /// less (a proof costs etcd a walk of the prefix's keys), then once per change of the cache,
    /// so a quiet prefix on a busy etcd is answered within milliseconds, on every etcd version.
    /// Each move of the cache wakes the wait; nothing polls. Fails after `timeout`, when the source cannot be read, or at once
    /// when the informer has stopped ([`ConsistencyError::Stopped`]); cancel it by dropping the
    /// future.
    ///
    /// A revision at or below the cache's returns at once, without asking etcd (the common case
    /// of reading one's own write must cost nothing). So after etcd went back in time (wiped,
    /// restored), a revision of the new store that is below the old store's is taken as
    /// reached until the reflector has relisted, which it does as soon as its watch opens again
    /// on the new store; [`consistent_lister`](Self::consistent_lister) asks etcd, and waits
    /// for that relist.
    ///
    /// Use it with the revision a write returned
    /// ([`TypedClient`](crate::client::TypedClient)) to read your own writes.
    pub async fn wait_for_revision(
        &self,
        revision: i64,
        timeout: Duration,
    ) -> Result<(), ConsistencyError> {
        let started = Instant::now();
        let deadline = started + timeout;
        // The watch brings a write to the prefix within milliseconds, and a proof costs etcd a
        // walk of the prefix's keys: the watch gets a head start.
        let head_start = started + ASK_AFTER.min(timeout / 2);
        if self.until(head_start, || self.reached(revision)).await {
            return Ok(());
        }
        self.prove_or_wait(revision, started, deadline, None).await
    }

    /// Whether the cache is known to hold the source's content at `revision`.
    fn reached(&self, revision: i64) -> bool {
        self.proven_revision() >= revision && self.has_synced()
    }

    /// Waits until the cache reaches `revision` or the source proves it there, asking the
    /// source again each time the cache has changed since it was last asked (`asked_at`, the
    /// cache's write count then).
    async fn prove_or_wait(
        &self,
        revision: i64,
        started: Instant,
        deadline: Instant,
        mut asked_at: Option<u64>,
    ) -> Result<(), ConsistencyError> {
        loop {
            let moved = self.shared.moved.notified();
            tokio::pin!(moved);
            // Registered before the cache is looked at: a move while it is, or while etcd is
            // asked, wakes the wait below at once.
            moved.as_mut().enable();
            if self.reached(revision) {
                return Ok(());
            }
            if self.is_stopped() {
                return Err(ConsistencyError::Stopped {
                    informer: self.shared.name.clone(),
                    revision,
                    applied: self.revision(),
                });
            }
            let writes = self.revision_len_and_writes().2;
            // A source that cannot prove freshness leaves the watch to bring the revision.
            let provable = self.shared.source.capabilities().freshness.is_some();
            if asked_at != Some(writes) && self.has_synced() && provable {
                asked_at = Some(writes);
                let relists = self.relists();
                let ask = tokio::time::timeout_at(deadline, self.freshness(Some(revision)));
                // The watch may still bring it before etcd has walked the prefix's keys for the
                // proof: whichever comes first answers.
                let asked = tokio::select! {
                    true = self.until(deadline, || self.reached(revision)) => return Ok(()),
                    asked = ask => asked,
                };
                match asked {
                    Ok(Ok(fresh)) if fresh.proven => return Ok(()),
                    Ok(Ok(_)) => {}
                    Ok(Err(ConsistencyError::Source { source, .. }))
                        if source.is_store_replaced() =>
                    {
                        // The cache's revision is the old store's: it says nothing of
                        // `revision` until the cache is listed from the new one.
                        if self.relisted_since(relists, deadline).await {
                            asked_at = None;
                            continue;
                        }
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_elapsed) => {}
                }
            }
            if Instant::now() >= deadline {
                return Err(ConsistencyError::Timeout {
                    informer: self.shared.name.clone(),
                    revision,
                    applied: self.revision(),
                    waited: started.elapsed(),
                });
            }
            let _ = tokio::time::timeout_at(deadline, moved).await;
        }
    }

    /// A lister that reads the cache only once it is at least as fresh as etcd is now: one
    /// linearizable read gives etcd's current revision (and, for a prefix that did not change
    /// since the cache's revision, proves the cache current at once), then it waits as
    /// [`wait_for_revision`](Self::wait_for_revision) does. Kubernetes' consistent reads from
    /// the watch cache (KEP-2340), over etcd.
    ///
    /// ```no_run
    /// # async fn demo(informer: etcd_informer::SharedIndexInformer<String>) -> Result<(), Box<dyn std::error::Error>> {
    /// let lister = informer.consistent_lister(std::time::Duration::from_secs(3)).await?;
    /// println!("{} objects as of now", lister.list().len());
    /// # Ok(()) }
    /// ```
    pub async fn consistent_lister(
        &self,
        timeout: Duration,
    ) -> Result<Lister<T>, ConsistencyError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut relists = self.relists();
        let current = loop {
            let asked = tokio::time::timeout_at(deadline, self.freshness(None))
                .await
                .map_err(|_| ConsistencyError::Source {
                    informer: self.shared.name.clone(),
                    source: SourceError::transient(format!("no answer within {timeout:?}")),
                })?;
            match asked {
                // etcd went back in time: the cache is the old store's until it is listed
                // again, and its content must not be answered (see `relisted_since`).
                Err(ConsistencyError::Source { source, informer })
                    if source.is_store_replaced() =>
                {
                    if !self.relisted_since(relists, deadline).await {
                        return Err(ConsistencyError::Source { informer, source });
                    }
                    relists = self.relists();
                }
                asked => break asked?,
            }
        };
        if !current.proven {
            // etcd was just asked: no head start, and asked again once the cache moves.
            self.prove_or_wait(current.revision, started, deadline, current.asked_at)
                .await?;
        }
        Ok(self.lister())
    }
}

#[cfg(test)]
mod tests {
    use super::{ConsistencyError, SourceError};

    #[test]
    fn a_source_error_names_the_prefix_once() {
        let source = || SourceError::unavailable("/services/: grpc request error: refused");
        let e = ConsistencyError::Source {
            informer: "/services/".into(),
            source: source(),
        };
        assert_eq!(
            e.to_string(),
            "cannot read the current revision: /services/: grpc request error: refused"
        );
        let e = ConsistencyError::Source {
            informer: "zones".into(),
            source: source(),
        };
        assert_eq!(
            e.to_string(),
            "informer zones: cannot read the current revision: /services/: grpc request error: refused"
        );
    }
}
