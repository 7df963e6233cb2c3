//! What the server's etcd version means for the watch: its known watch bugs, and whether its
//! progress notifications can be trusted as bookmarks.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::sync::lock;

/// A known etcd watch bug and what the source does about it.
pub(super) struct Bug {
    /// The bug, the version that fixed it, and what the source does (or, for a bug it cannot
    /// handle, what the user must do).
    pub(super) text: &'static str,
    /// How the source handles it.
    pub(super) handled: Handled,
}

/// How the source handles a known etcd bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Handled {
    /// Guarded against on the stream: it never reaches the cache.
    Guarded,
    /// Found later (the key tally at a re-watch, the informer's audit) and repaired by a
    /// relist.
    Repaired,
    /// Not detectable by a client: the user must act (the bug's text says how).
    No,
}

/// The watch bugs fixed after `version` (SEMANTICS.md, etcd rule 19), each with what the
/// source does about it.
pub(super) fn known_watch_bugs(version: &str) -> Vec<Bug> {
    let (major, minor, patch) = parse_version(version);
    let mut bugs = Vec::new();
    let before = |m: u32, p: u32| (major, minor) == (3, m) && patch < p;
    let mut bug = |text, handled| bugs.push(Bug { text, handled });
    if before(4, 24) {
        bug("duplicated events (fixed in 3.4.24): dropped, every event at or below the revision delivered is skipped", Handled::Guarded);
    }
    if before(4, 25) || before(5, 8) {
        bug("responses going back in time, progress out of step with the stream (fixed in 3.4.25 / 3.5.8): a member behind the watched revision is checked, progress never advances the cache", Handled::Guarded);
    }
    if before(4, 31) {
        bug("events lost after a compaction (fixed in 3.4.31): not detectable on the stream; the key tally at each re-watch and the informer's audit find it, and a relist repairs the cache", Handled::Repaired);
    }
    if before(4, 36) {
        bug("a missing delete when a watch opens at the compaction revision (fixed in 3.4.36): not detectable on the stream; the informer's audit finds it and relists", Handled::Repaired);
    }
    if (major, minor) == (3, 5) && patch < 3 {
        bug("a member killed during an apply can come back with its revisions off from its cluster's for good (etcd-io/etcd#13766, fixed in 3.5.3), which no client of that member can detect: upgrade etcd, or run every member with --experimental-initial-corrupt-check", Handled::No);
    }
    if before(4, 38) {
        bug("a watch on a future revision returning old events (fixed in 3.4.38): dropped, as duplicates", Handled::Guarded);
    }
    bugs
}

/// What is said at start about `bugs` of etcd `version`: a WARN line for each bug the user
/// must act on, and one INFO line for the bugs the source handles (`None` when there are none).
pub(super) struct Said {
    /// One line per bug the source cannot handle, saying what to do.
    pub(super) warn: Vec<String>,
    /// One line for the bugs the source handles, how many of each kind.
    pub(super) info: Option<String>,
}

/// The lines said at start about `bugs` of etcd `version`.
pub(super) fn said(version: &str, bugs: &[Bug]) -> Said {
    let count = |handled: Handled| bugs.iter().filter(|b| b.handled == handled).count();
    let (guarded, repaired) = (count(Handled::Guarded), count(Handled::Repaired));
    let handled = guarded + repaired;
    let info = (handled > 0).then(|| {
        format!(
            "etcd {version} has {handled} known watch bug{} that this client handles: {guarded} guarded on the stream, {repaired} found by the key tally or the audit and repaired by a relist; see the guide's chapter etcd_informer::guide::etcd_versions",
            if handled == 1 { "" } else { "s" }
        )
    });
    let warn = bugs
        .iter()
        .filter(|b| b.handled == Handled::No)
        .map(|b| format!("etcd {version} has a known bug: {}", b.text))
        .collect();
    Said { warn, info }
}

/// Says once per process and etcd version what that version's known watch bugs mean: a
/// WARN for each one the user must act on, one INFO line for those the source handles; each
/// bug's detail goes to the debug level.
pub(super) fn warn_of_known_watch_bugs(version: &str) {
    static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let bugs = known_watch_bugs(version);
    if bugs.is_empty() {
        return;
    }
    if !lock(&WARNED)
        .get_or_insert_with(HashSet::new)
        .insert(version.to_string())
    {
        return;
    }
    let lines = said(version, &bugs);
    for line in &lines.warn {
        tracing::warn!("{line}");
    }
    if let Some(line) = &lines.info {
        tracing::info!("{line}");
    }
    for bug in &bugs {
        tracing::debug!(
            etcd_version = version,
            handled = ?bug.handled,
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
    fn the_start_warns_only_of_what_must_be_acted_on() {
        let said_of = |version: &str| said(version, &known_watch_bugs(version));
        let old_34 = said_of("3.4.23");
        assert!(old_34.warn.is_empty(), "{:?}", old_34.warn);
        let info = old_34.info.unwrap();
        assert_eq!(
            info,
            "etcd 3.4.23 has 5 known watch bugs that this client handles: 3 guarded on the stream, 2 found by the key tally or the audit and repaired by a relist; see the guide's chapter etcd_informer::guide::etcd_versions"
        );
        assert!(!info.contains('\n'));
        let old_35 = said_of("3.5.1");
        assert_eq!(old_35.warn.len(), 1);
        assert!(old_35.warn[0].contains("--experimental-initial-corrupt-check"));
        assert!(old_35.info.unwrap().contains(" 1 known watch bug that"));
        let new = said_of("3.6.0");
        assert!(new.warn.is_empty() && new.info.is_none());
    }
}
