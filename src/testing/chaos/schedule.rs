//! Which faults a soak injects, in which order: [`Fault`], [`Endpoints`] and the seeded
//! [`fault_schedule`].

use std::fmt;

/// The fault a round injects; see the [module docs](crate::testing::chaos).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL a member, write, delete and compact on the others, restart it.
    KillRestart,
    /// SIGSTOP a member for [`ChaosConfig::pause`](super::ChaosConfig::pause) while the others take writes.
    PauseResume,
    /// SIGSTOP a member past the watch's idle timeout, write and compact meanwhile.
    Compaction,
    /// Wipe and recreate the whole cluster, then write fewer revisions than it had.
    WipeCluster,
    /// SIGSTOP the member serving the watch and keep it hung until the cache equals etcd
    /// through the others (all endpoints only).
    HungMember,
}

impl Fault {
    /// Every fault kind.
    pub const ALL: [Fault; 5] = [
        Fault::KillRestart,
        Fault::PauseResume,
        Fault::Compaction,
        Fault::WipeCluster,
        Fault::HungMember,
    ];

    /// The fault kinds that make sense with `endpoints`: a hung member can only be left for
    /// another one when the informer has the others.
    pub fn for_endpoints(endpoints: Endpoints) -> &'static [Fault] {
        match endpoints {
            Endpoints::One => &Self::ALL[..4],
            Endpoints::All => &Self::ALL,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::KillRestart => "kill-restart",
            Fault::PauseResume => "pause-resume",
            Fault::Compaction => "compaction",
            Fault::WipeCluster => "wipe-cluster",
            Fault::HungMember => "hung-member",
        })
    }
}

/// Which members the informer's client is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoints {
    /// Member 0 only: every fault but the wipe hits the informer's own member.
    One,
    /// All three members: the client may move to another one.
    All,
}

impl fmt::Display for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Endpoints::One => "one endpoint",
            Endpoints::All => "all endpoints",
        })
    }
}

/// `rounds_per_fault` rounds of every fault kind that makes sense with `endpoints`
/// ([`Fault::for_endpoints`]), in an order shuffled by `seed`.
pub fn fault_schedule(seed: u64, rounds_per_fault: usize, endpoints: Endpoints) -> Vec<Fault> {
    let mut faults: Vec<Fault> = (0..rounds_per_fault)
        .flat_map(|_| Fault::for_endpoints(endpoints).iter().copied())
        .collect();
    fastrand::Rng::with_seed(seed ^ 0x5eed_fa17).shuffle(&mut faults);
    faults
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::chaos::checker::epoch_of;
    use crate::testing::chaos::kills_corrupt;

    #[test]
    fn schedules_are_seeded_and_cover_every_fault() {
        let s = fault_schedule(3, 2, Endpoints::All);
        assert_eq!(s, fault_schedule(3, 2, Endpoints::All));
        assert!(!fault_schedule(3, 2, Endpoints::One).contains(&Fault::HungMember));
        assert_eq!(s.len(), 10);
        for f in Fault::ALL {
            assert_eq!(s.iter().filter(|x| **x == f).count(), 2);
        }
        assert_eq!(epoch_of("e12-r3-w4"), 12);
        assert!(kills_corrupt("3.5.1") && !kills_corrupt("3.5.3") && !kills_corrupt("3.4.23"));
    }
}
