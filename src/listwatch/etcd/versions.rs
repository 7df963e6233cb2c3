//! What the server's etcd version means for the watch: its known watch bugs, and whether its
//! progress notifications can be trusted as bookmarks.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::sync::lock;

/// A known etcd watch bug and what the source does about it.
pub(super) struct Bug {
    /// The bug, the version that fixed it, and what the source does.
    pub(super) text: &'static str,
    /// The source guards against it on the stream; otherwise only a later check (the key
    /// tally, a relist) repairs it, or nothing can.
    pub(super) guarded: bool,
}

/// The watch bugs fixed after `version` (SEMANTICS.md, etcd rule 19), each with what the
/// source does about it.
pub(super) fn known_watch_bugs(version: &str) -> Vec<Bug> {
    let (major, minor, patch) = parse_version(version);
    let mut bugs = Vec::new();
    let before = |m: u32, p: u32| (major, minor) == (3, m) && patch < p;
    let mut bug = |text, guarded| bugs.push(Bug { text, guarded });
    if before(4, 24) {
        bug("duplicated events (fixed in 3.4.24): dropped, every event at or below the revision delivered is skipped", true);
    }
    if before(4, 25) || before(5, 8) {
        bug("responses going back in time, progress out of step with the stream (fixed in 3.4.25 / 3.5.8): a member behind the watched revision is checked, progress never advances the cache", true);
    }
    if before(4, 31) {
        bug("events lost after a compaction (fixed in 3.4.31): not detectable on the stream; the key tally at each re-watch and the informer's audit find it, and a relist repairs the cache", false);
    }
    if before(4, 36) {
        bug("a missing delete when a watch opens at the compaction revision (fixed in 3.4.36): not detectable on the stream; the informer's audit finds it and relists", false);
    }
    if (major, minor) == (3, 5) && patch < 3 {
        bug("a member killed during an apply can come back with its revisions off from its cluster's for good (etcd-io/etcd#13766, fixed in 3.5.3): not detectable by a client of that member alone; etcd's --experimental-initial-corrupt-check finds it", false);
    }
    if before(4, 38) {
        bug("a watch on a future revision returning old events (fixed in 3.4.38): dropped, as duplicates", true);
    }
    bugs
}

/// The one line said at start about `bugs` of etcd `version`, or `None` when it has none.
pub(super) fn summary(version: &str, bugs: &[Bug]) -> Option<String> {
    if bugs.is_empty() {
        return None;
    }
    let guarded = bugs.iter().filter(|b| b.guarded).count();
    Some(format!(
        "etcd {version} has {} known watch bugs: {guarded} guarded on the stream, {} caught by the key tally or the audit and repaired by a relist; see the README's \"etcd versions\"",
        bugs.len(),
        bugs.len() - guarded
    ))
}

/// Says once per process and etcd version, in one line, how many known watch bugs that version
/// has; each bug's detail goes to the debug level.
pub(super) fn warn_of_known_watch_bugs(version: &str) {
    static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let bugs = known_watch_bugs(version);
    let Some(line) = summary(version, &bugs) else {
        return;
    };
    if !lock(&WARNED)
        .get_or_insert_with(HashSet::new)
        .insert(version.to_string())
    {
        return;
    }
    tracing::warn!("{line}");
    for bug in &bugs {
        tracing::debug!(
            etcd_version = version,
            guarded = bug.guarded,
            "{}",
            bug.text
        );
    }
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

    #[test]
    fn the_start_says_one_short_line() {
        let line = summary("3.4.23", &known_watch_bugs("3.4.23")).unwrap();
        assert_eq!(
            line,
            "etcd 3.4.23 has 5 known watch bugs: 3 guarded on the stream, 2 caught by the key tally or the audit and repaired by a relist; see the README's \"etcd versions\""
        );
        assert!(line.len() < 160 && !line.contains('\n'));
        assert!(summary("3.5.1", &known_watch_bugs("3.5.1")).unwrap().len() < 160);
        assert!(summary("3.6.0", &known_watch_bugs("3.6.0")).is_none());
    }
}
