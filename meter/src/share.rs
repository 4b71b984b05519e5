//! # Projectors sharing the usage topic's partitions
//!
//! Any number of projectors may fold one topic (issue 14 item 4). They split
//! its partitions by **leases in the store**, not by a Kafka consumer group:
//! each projector is a *member* with a lease it renews on every heartbeat,
//! and each partition has at most one *owner*. At each heartbeat a member,
//! in one transaction that holds the partitions' rows still, renews its
//! membership, reads the live members and the partitions' owners, and
//! [`assign`]s itself its share: it keeps what it holds up to its fair
//! share, gives back what is over it, and takes free partitions (no owner,
//! or an owner whose membership lapsed) up to it. So the members converge,
//! within two heartbeats of a change, to shares that differ by at most one
//! ([`fair_share`]), and a killed member's partitions are taken once its
//! membership lapses.
//!
//! **Exactly once does not rest on this.** The fold moves a partition's
//! offset in the same transaction as the aggregates, and only if the offset
//! is still where the batch began (the store's fence): two projectors that
//! both read a partition for a moment (a lease that lapsed under a paused
//! process) fold each record once between them, the second being fenced
//! and re-reading from the stored offsets. The leases spread the work; the
//! offsets keep it exact. Why not a consumer group: a group's rebalance is
//! the broker's (and tansu, the broker the tests run on, is not Apache
//! Kafka), Kafka's committed offsets are never Tollgate's record of what was
//! folded, and the same leases work on the embedded log.

use std::collections::{BTreeMap, BTreeSet};

/// How many of `partitions` the member ranked `rank` (0-based, in the
/// members' sorted order) of `members` should hold: the partitions split as
/// evenly as they go, the first ranks taking one more.
pub fn fair_share(partitions: usize, members: usize, rank: usize) -> usize {
    if members == 0 {
        return 0;
    }
    partitions / members + usize::from(rank < partitions % members)
}

/// The partitions `me` holds after a heartbeat: `owners` is each
/// partition's owner as the store holds it (`None`: never owned, or given
/// back), `live` the members whose membership has not lapsed (`me` among
/// them). It keeps its own partitions up to its fair share (the lowest
/// first), gives back the rest, and takes free ones — no owner, or an owner
/// not live — lowest first, up to its share. A partition another live
/// member holds is never taken, so no two members hold one at once.
pub fn assign(owners: &BTreeMap<i32, Option<String>>, live: &BTreeSet<String>, me: &str) -> BTreeSet<i32> {
    let rank = live.iter().position(|m| m == me).unwrap_or(live.len());
    let members = live.len().max(rank + 1);
    let share = fair_share(owners.len(), members, rank);
    let mut mine: BTreeSet<i32> =
        owners.iter().filter(|(_, o)| o.as_deref() == Some(me)).map(|(p, _)| *p).take(share).collect();
    for (p, owner) in owners {
        if mine.len() >= share {
            break;
        }
        let free = match owner {
            None => true,
            Some(o) => o != me && !live.contains(o),
        };
        if free {
            mine.insert(*p);
        }
    }
    mine
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn owners(n: i32) -> BTreeMap<i32, Option<String>> {
        (0..n).map(|p| (p, None)).collect()
    }

    fn members(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// One heartbeat of `me`: its assignment written back.
    fn beat(owners: &mut BTreeMap<i32, Option<String>>, live: &BTreeSet<String>, me: &str) {
        let mine = assign(owners, live, me);
        for (p, o) in owners.iter_mut() {
            if mine.contains(p) {
                *o = Some(me.to_owned());
            } else if o.as_deref() == Some(me) {
                *o = None;
            }
        }
    }

    fn held(owners: &BTreeMap<i32, Option<String>>, me: &str) -> usize {
        owners.values().filter(|o| o.as_deref() == Some(me)).count()
    }

    #[test]
    fn shares_split_as_evenly_as_they_go() {
        assert_eq!((0..3).map(|r| fair_share(6, 3, r)).collect::<Vec<_>>(), [2, 2, 2]);
        assert_eq!((0..4).map(|r| fair_share(6, 4, r)).collect::<Vec<_>>(), [2, 2, 1, 1]);
        assert_eq!((0..2).map(|r| fair_share(1, 2, r)).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(fair_share(6, 0, 0), 0);
    }

    #[test]
    fn a_member_joining_and_one_dying_move_partitions_within_two_heartbeats() {
        let mut o = owners(6);
        let one = members(&["a"]);
        beat(&mut o, &one, "a");
        assert_eq!(held(&o, "a"), 6, "alone, it takes them all");
        let two = members(&["a", "b"]);
        beat(&mut o, &two, "b");
        assert_eq!(held(&o, "b"), 0, "nothing free yet: a holds them and is live");
        beat(&mut o, &two, "a");
        assert_eq!(held(&o, "a"), 3, "a gives back what is over its share");
        beat(&mut o, &two, "b");
        assert_eq!((held(&o, "a"), held(&o, "b")), (3, 3));
        // b dies: once its membership lapses, a takes its partitions.
        beat(&mut o, &one, "a");
        assert_eq!(held(&o, "a"), 6);
        assert!(o.values().all(|x| x.as_deref() == Some("a")));
    }

    proptest! {
        /// Whatever the order of heartbeats, joins and deaths: no partition
        /// ever has two live owners, and once the members settle and each
        /// beats twice, every partition is held and the shares differ by at
        /// most one.
        #[test]
        fn members_converge_to_fair_disjoint_shares(
            partitions in 1i32..12,
            events in proptest::collection::vec((0usize..5, any::<bool>()), 0..60),
        ) {
            let names = ["m0", "m1", "m2", "m3", "m4"];
            let mut o = owners(partitions);
            let mut live: BTreeSet<String> = BTreeSet::new();
            for (who, alive) in events {
                let name = names[who];
                if alive {
                    live.insert(name.to_owned());
                    beat(&mut o, &live, name);
                } else {
                    live.remove(name);
                }
                // A partition is held by at most one live member: by
                // construction it has one owner; that owner may be dead
                // (not yet taken over), never two at once.
                for m in &live {
                    let mine = assign(&o, &live, m);
                    for p in &mine {
                        let owner = o.get(p).cloned().flatten();
                        prop_assert!(owner.is_none() || owner.as_deref() == Some(m.as_str())
                            || !live.contains(owner.as_deref().unwrap_or("")), "{m} takes {p} from a live {owner:?}");
                    }
                }
            }
            if live.is_empty() {
                return Ok(());
            }
            for _ in 0..2 {
                for m in live.clone() {
                    beat(&mut o, &live, &m);
                }
            }
            let counts: Vec<usize> = live.iter().map(|m| held(&o, m)).collect();
            prop_assert_eq!(counts.iter().sum::<usize>(), partitions as usize, "every partition held: {:?}", o);
            let (lo, hi) = (counts.iter().min().copied().unwrap_or(0), counts.iter().max().copied().unwrap_or(0));
            prop_assert!(hi - lo <= 1, "shares {:?}", counts);
        }
    }
}
