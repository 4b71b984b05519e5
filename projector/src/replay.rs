//! What a replay (`tollgate replay`) needs of the projector: the same
//! [`Projector`](crate::Projector), folding into a shadow store, over a
//! reader that stops where it is told.
//!
//! [`Bounded`] hands the projector the records of each partition below a
//! bound and nothing past it, so the shadow can be folded to exactly the
//! offsets the live fold stands at (read in one snapshot of the live store)
//! and then compared with it. Raising the bound lets it read on.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use meter::{DlqMark, LogReader, LogRecord, PortResult};

/// A reader that returns, per partition, only the records below a bound
/// (none of a partition it has no bound for).
pub struct Bounded<R: LogReader> {
    inner: R,
    until: BTreeMap<i32, i64>,
    /// The next offset to hand out, per partition.
    positions: BTreeMap<i32, i64>,
    /// The inner reader must be positioned again before the next poll (a
    /// seek, a new bound, or records past the bound read and dropped).
    stale: bool,
    /// Whether the last positioning left any partition to read.
    open: bool,
}

impl<R: LogReader> Bounded<R> {
    /// Reads nothing until given a bound.
    pub fn new(inner: R) -> Self {
        Bounded { inner, until: BTreeMap::new(), positions: BTreeMap::new(), stale: true, open: false }
    }

    /// Reads on up to `until` (per partition, the first offset not to read).
    pub fn set_until(&mut self, until: BTreeMap<i32, i64>) {
        self.until = until;
        self.stale = true;
    }

    /// Whether every partition was read up to its bound.
    pub fn reached(&self) -> bool {
        self.until.iter().all(|(p, u)| self.positions.get(p).copied().unwrap_or(0) >= *u)
    }

    /// The next offset to read, per partition (after a successful projector
    /// step: what the shadow store holds).
    pub fn positions(&self) -> &BTreeMap<i32, i64> {
        &self.positions
    }

    pub fn inner_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    fn bound(&self, partition: i32) -> i64 {
        self.until.get(&partition).copied().unwrap_or(0)
    }
}

#[async_trait]
impl<R: LogReader> LogReader for Bounded<R> {
    async fn partitions(&mut self) -> PortResult<Vec<i32>> {
        self.inner.partitions().await
    }

    async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()> {
        self.positions = positions.clone();
        self.stale = true;
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> PortResult<Vec<LogRecord>> {
        if self.stale {
            let open: BTreeMap<i32, i64> =
                self.positions.iter().filter(|(p, o)| **o < self.bound(**p)).map(|(p, o)| (*p, *o)).collect();
            self.inner.seek(&open).await?;
            self.open = !open.is_empty();
            self.stale = false;
        }
        if !self.open {
            tokio::time::sleep(wait.min(Duration::from_millis(20))).await;
            return Ok(Vec::new());
        }
        let records = self.inner.poll(max, wait).await?;
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            let next = self.positions.get(&r.partition).copied().unwrap_or(0);
            if r.offset < next {
                continue;
            }
            if r.offset >= self.bound(r.partition) {
                // Read past the bound: position the inner reader again.
                self.stale = true;
                continue;
            }
            self.positions.insert(r.partition, r.offset + 1);
            if r.offset + 1 >= self.bound(r.partition) {
                self.stale = true;
            }
            out.push(r);
        }
        Ok(out)
    }

    async fn ends(&mut self) -> PortResult<BTreeMap<i32, i64>> {
        self.inner.ends().await
    }

    async fn dead_letter(&mut self, record: &LogRecord, reason: &str) -> PortResult<()> {
        self.inner.dead_letter(record, reason).await
    }

    async fn dead_letter_mark(&mut self) -> PortResult<DlqMark> {
        self.inner.dead_letter_mark().await
    }

    async fn dead_lettered_since(&mut self, mark: &DlqMark) -> PortResult<std::collections::BTreeSet<(i32, i64)>> {
        self.inner.dead_lettered_since(mark).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of one partition with records at the given offsets.
    struct Log {
        offsets: Vec<i64>,
        next: i64,
    }

    #[async_trait]
    impl LogReader for Log {
        async fn partitions(&mut self) -> PortResult<Vec<i32>> {
            Ok(vec![0])
        }
        async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()> {
            self.next = positions.get(&0).copied().unwrap_or(i64::MAX);
            Ok(())
        }
        async fn poll(&mut self, max: usize, _wait: Duration) -> PortResult<Vec<LogRecord>> {
            let out: Vec<LogRecord> = self
                .offsets
                .iter()
                .filter(|o| **o >= self.next)
                .take(max)
                .map(|&offset| LogRecord { partition: 0, offset, key: None, payload: vec![], timestamp: None })
                .collect();
            if let Some(last) = out.last() {
                self.next = last.offset + 1;
            }
            Ok(out)
        }
        async fn dead_letter(&mut self, _: &LogRecord, _: &str) -> PortResult<()> {
            Ok(())
        }
        async fn dead_letter_mark(&mut self) -> PortResult<DlqMark> {
            Ok(DlqMark::new())
        }
        async fn dead_lettered_since(&mut self, _: &DlqMark) -> PortResult<std::collections::BTreeSet<(i32, i64)>> {
            Ok(Default::default())
        }
    }

    async fn drain(b: &mut Bounded<Log>) -> Vec<i64> {
        let mut seen = Vec::new();
        for _ in 0..10 {
            seen.extend(b.poll(3, Duration::ZERO).await.expect("poll").into_iter().map(|r| r.offset));
        }
        seen
    }

    #[tokio::test]
    async fn reads_exactly_below_the_bound_and_on_when_it_rises() {
        let mut b = Bounded::new(Log { offsets: vec![0, 1, 2, 5, 6, 9, 10], next: 0 });
        b.seek(&BTreeMap::from([(0, 0)])).await.expect("seek");
        assert!(drain(&mut b).await.is_empty(), "no bound, nothing read");
        b.set_until(BTreeMap::from([(0, 6)]));
        assert_eq!(drain(&mut b).await, vec![0, 1, 2, 5]);
        assert!(b.reached());
        b.set_until(BTreeMap::from([(0, 10)]));
        assert!(!b.reached());
        assert_eq!(drain(&mut b).await, vec![6, 9]);
        assert!(b.reached());
        // A seek back (a failed step) reads again from there, to the bound.
        b.seek(&BTreeMap::from([(0, 6)])).await.expect("seek");
        assert_eq!(drain(&mut b).await, vec![6, 9]);
        assert_eq!(b.positions(), &BTreeMap::from([(0, 10)]));
    }
}
