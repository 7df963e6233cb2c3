//! The waiting items: two priority levels, each a round robin of groups with a FIFO per group.

use std::collections::{HashMap, VecDeque};

/// How urgently an added item should be handed out. See
/// [`WorkQueue::add_with_priority`](super::WorkQueue::add_with_priority).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Priority {
    /// A change that just happened: handed out before [`Background`](Priority::Background)
    /// items. What [`WorkQueue::add`](super::WorkQueue::add) uses.
    #[default]
    Live,
    /// Bulk work such as the keys of an initial list, a relist or a resync: handed out when no
    /// `Live` item waits, and in turns under a stream of `Live` items (see
    /// [`WorkQueueConfig::live_burst`](super::WorkQueueConfig::live_burst)).
    Background,
}

impl Priority {
    fn index(self) -> usize {
        match self {
            Priority::Live => 0,
            Priority::Background => 1,
        }
    }

    /// Whether an item added with `self` must be handed out before one added with `other`.
    pub(super) fn outranks(self, other: Priority) -> bool {
        self == Priority::Live && other == Priority::Background
    }
}

/// Maps an item to its fairness group.
pub(super) type GroupFn<K> = Box<dyn Fn(&K) -> String + Send + Sync>;

/// Identifies one waiting entry. An item's dirty record holds the ticket of its current entry,
/// so an entry whose ticket no longer matches (the item moved to `Live`, or was handed out) is
/// stale and skipped.
pub(super) type Ticket = u64;

/// The waiting items.
///
/// Entries are never removed from the middle of a FIFO: an item that moves up from
/// `Background` to `Live` gets a new entry and its old one goes stale (lazy deletion). The
/// counts of current entries are kept per level, so `len` stays exact and O(1); stale entries
/// are dropped when `pop` reaches them, which is amortized O(1) since each was pushed once.
pub(super) struct Waiting<K> {
    levels: [Level<K>; 2],
    group_of: Option<GroupFn<K>>,
    /// `Live` items handed out in a row while `Background` items waited.
    streak: usize,
    live_burst: usize,
    next_ticket: Ticket,
}

/// One priority level: a FIFO of entries per group, and the groups in turn order.
///
/// Invariant: a group is in `groups` if and only if its name is in `turns`, exactly once. A group
/// is removed once its FIFO is empty, so memory follows the waiting (and stale) entries.
struct Level<K> {
    groups: HashMap<String, VecDeque<(K, Ticket)>>,
    turns: VecDeque<String>,
    /// Current (not stale) entries.
    len: usize,
}

impl<K> Level<K> {
    fn new() -> Self {
        Self {
            groups: HashMap::new(),
            turns: VecDeque::new(),
            len: 0,
        }
    }

    fn push(&mut self, group: String, item: K, ticket: Ticket) {
        match self.groups.get_mut(&group) {
            Some(fifo) => fifo.push_back((item, ticket)),
            None => {
                self.groups
                    .insert(group.clone(), VecDeque::from([(item, ticket)]));
                self.turns.push_back(group);
            }
        }
        self.len += 1;
    }

    /// Takes the oldest current entry of the group whose turn it is, and moves that group to
    /// the back of the turns.
    fn pop(&mut self, is_current: impl Fn(&K, Ticket) -> bool) -> Option<K> {
        while let Some(group) = self.turns.pop_front() {
            let Some(fifo) = self.groups.get_mut(&group) else {
                continue;
            };
            while let Some((item, ticket)) = fifo.pop_front() {
                if is_current(&item, ticket) {
                    if fifo.is_empty() {
                        self.groups.remove(&group);
                    } else {
                        self.turns.push_back(group);
                    }
                    self.len = self.len.saturating_sub(1);
                    return Some(item);
                }
            }
            self.groups.remove(&group);
        }
        None
    }
}

impl<K> Waiting<K> {
    pub(super) fn new(live_burst: usize, group_of: Option<GroupFn<K>>) -> Self {
        Self {
            levels: [Level::new(), Level::new()],
            group_of,
            streak: 0,
            live_burst: live_burst.max(1),
            next_ticket: 0,
        }
    }

    /// Number of current entries.
    pub(super) fn len(&self) -> usize {
        self.levels[0].len + self.levels[1].len
    }

    pub(super) fn len_of(&self, priority: Priority) -> usize {
        self.levels[priority.index()].len
    }

    /// Groups held at `priority`, including groups with only stale entries left.
    #[cfg(test)]
    pub(super) fn groups(&self, priority: Priority) -> usize {
        let level = &self.levels[priority.index()];
        debug_assert_eq!(level.groups.len(), level.turns.len());
        level.groups.len()
    }

    /// Queues `item` at `priority` and returns the ticket its dirty record must hold.
    pub(super) fn push(&mut self, item: K, priority: Priority) -> Ticket {
        // The group function is user code: call it before changing anything, so that a panic
        // leaves the queue consistent.
        let group = self.group_of.as_ref().map(|f| f(&item)).unwrap_or_default();
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.levels[priority.index()].push(group, item, ticket);
        ticket
    }

    /// Records that one entry at `priority` went stale without being popped.
    pub(super) fn forget_one(&mut self, priority: Priority) {
        let level = &mut self.levels[priority.index()];
        level.len = level.len.saturating_sub(1);
    }

    /// Takes the next item: `Live` first, except that after `live_burst` `Live` items in a row
    /// while `Background` items wait, the next turn is `Background`'s. `is_current` tells
    /// whether an entry is still its item's current one.
    pub(super) fn pop(&mut self, is_current: impl Fn(&K, Ticket) -> bool) -> Option<K> {
        let live = self.levels[Priority::Live.index()].len > 0;
        let background = self.levels[Priority::Background.index()].len > 0;
        let level = match (live, background) {
            (true, true) if self.streak >= self.live_burst => {
                self.streak = 0;
                Priority::Background
            }
            (true, true) => {
                self.streak += 1;
                Priority::Live
            }
            (true, false) => {
                // Nothing was kept waiting: a Background item added later waits a full burst.
                self.streak = 0;
                Priority::Live
            }
            (false, true) => {
                self.streak = 0;
                Priority::Background
            }
            (false, false) => return None,
        };
        self.levels[level.index()].pop(is_current)
    }
}
