//! What the server's etcd version means for the watch: its known watch bugs, and whether its
//! progress notifications can be trusted as bookmarks.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::lock;

/// The watch bugs fixed after `version` (SEMANTICS.md, etcd rule 19), each with what the
/// source does about it.
pub(super) fn known_watch_bugs(version: &str) -> Vec<&'static str> {
    let (major, minor, patch) = parse_version(version);
    let mut bugs = Vec::new();
    let before = |m: u32, p: u32| (major, minor) == (3, m) && patch < p;
    if before(4, 24) {
        bugs.push("duplicated events (fixed in 3.4.24): dropped, every event at or below the revision delivered is skipped");
    }
    if before(4, 25) || before(5, 8) {
        bugs.push("responses going back in time, progress out of step with the stream (fixed in 3.4.25 / 3.5.8): a member behind the watched revision is checked, progress never advances the cache");
    }
    if before(4, 31) {
        bugs.push("events lost after a compaction (fixed in 3.4.31): not detectable on the stream; the key tally at each re-watch and every relist repair the cache");
    }
    if before(4, 36) {
        bugs.push("a missing delete when a watch opens at the compaction revision (fixed in 3.4.36): not detectable on the stream; the next relist repairs it");
    }
    if (major, minor) == (3, 5) && patch < 3 {
        bugs.push("a member killed during an apply can come back with its revisions off from its cluster's for good (etcd-io/etcd#13766, fixed in 3.5.3): not detectable by a client of that member alone; etcd's --experimental-initial-corrupt-check finds it");
    }
    if before(4, 38) {
        bugs.push("a watch on a future revision returning old events (fixed in 3.4.38): dropped, as duplicates");
    }
    bugs
}

/// Warns once per process and etcd version of the watch bugs that version has.
pub(super) fn warn_of_known_watch_bugs(version: &str) {
    static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let bugs = known_watch_bugs(version);
    if bugs.is_empty()
        || !lock(&WARNED)
            .get_or_insert_with(HashSet::new)
            .insert(version.to_string())
    {
        return;
    }
    tracing::warn!(
        etcd_version = version,
        bugs = %bugs.join("; "),
        "this etcd version has known watch bugs; see the README's \"etcd versions\" for what the informer does about each"
    );
}

/// `major.minor.patch` of a version string; missing or unreadable parts are 0.
pub(super) fn parse_version(version: &str) -> (u32, u32, u32) {
    let mut parts = version.split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .unwrap_or(0)
    });
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

/// Whether an etcd version reports progress revisions that can be trusted to advance the watch:
/// RequestProgress could report a revision ahead of undelivered events before 3.4.25 / 3.5.8.
pub(super) fn progress_is_trustworthy(version: &str) -> bool {
    let (major, minor, patch) = parse_version(version);
    match (major, minor) {
        (3, 4) => patch >= 25,
        (3, 5) => patch >= 8,
        (3, m) => m > 5,
        (m, _) => m > 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_trust_by_version() {
        assert!(!progress_is_trustworthy("3.4.23"));
        assert!(progress_is_trustworthy("3.4.25"));
        assert!(!progress_is_trustworthy("3.5.7"));
        assert!(progress_is_trustworthy("3.5.17"));
        assert!(progress_is_trustworthy("3.6.0"));
        assert!(!progress_is_trustworthy("garbage"));
    }

    #[test]
    fn known_watch_bugs_by_version() {
        assert_eq!(known_watch_bugs("3.4.23").len(), 5);
        assert_eq!(known_watch_bugs("3.4.30").len(), 3);
        assert_eq!(known_watch_bugs("3.4.38").len(), 0);
        assert_eq!(known_watch_bugs("3.5.1").len(), 2);
        assert!(known_watch_bugs("3.5.8").is_empty());
        assert!(known_watch_bugs("3.6.0").is_empty());
    }
}
