//! Projectors sharing a topic's partitions over SQL
//! (`migrations/0018_partition_owners.sql`; the rule is `meter::share`).
//!
//! A heartbeat is one transaction that first makes sure every partition has
//! its row and then reads them all `FOR UPDATE` (PostgreSQL; SQLite has one
//! writer at a time): heartbeats of one topic's members run one after the
//! other, each seeing the owners the one before it wrote, so no partition
//! is ever given to two members.

use std::collections::{BTreeMap, BTreeSet};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{PartitionLeases, PortResult};

use super::{Backend, Rec, Rows, SqlStore, Stmt, corrupt, each, error};

fn partition<B: Backend>(r: &Rec<'_, B>) -> PortResult<i32> {
    let p = r.int("partition")?;
    i32::try_from(p).map_err(|_| corrupt("partition", &p.to_string()))
}

fn owners_stmt<B: Backend>(consumer: &str, topic: &str, lock: bool) -> Stmt {
    Stmt::new(format!(
        r#"SELECT CAST("partition" AS BIGINT) AS "partition", owner FROM partition_owners
           WHERE consumer = $1 AND topic = $2 ORDER BY "partition"{}"#,
        if lock { B::LOCK_ROWS } else { "" }
    ))
    .text(consumer)
    .text(topic)
}

fn members_stmt(consumer: &str, topic: &str, at: DateTime<Utc>) -> Stmt {
    Stmt::new("SELECT member FROM projector_members WHERE consumer = $1 AND topic = $2 AND expires_at >= $3")
        .text(consumer)
        .text(topic)
        .time(at)
}

#[async_trait]
impl<B: Backend> PartitionLeases for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "share_partitions"))]
    async fn share_partitions(
        &self,
        consumer: &str,
        topic: &str,
        member: &str,
        partitions: &[i32],
        at: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> PortResult<BTreeSet<i32>> {
        // Dropping `tx` without committing rolls everything back.
        let mut tx = B::begin(self.pool()).await.map_err(error::<B>)?;
        if !partitions.is_empty() {
            let rows = Rows::new().int("p", partitions.iter().map(|p| i64::from(*p)));
            // `WHERE true` keeps SQLite from reading ON CONFLICT as part of the SELECT.
            let ensure = Stmt::new(
                r#"INSERT INTO partition_owners (consumer, topic, "partition", owner)
                   SELECT $1, $2, t.p, NULL FROM {rows} AS t WHERE true ON CONFLICT DO NOTHING"#,
            )
            .text(consumer)
            .text(topic)
            .rows(rows);
            B::execute(&mut *tx, ensure).await?;
        }
        let held = B::fetch(&mut *tx, owners_stmt::<B>(consumer, topic, true)).await?;
        let mut owners = BTreeMap::new();
        for row in &held {
            let r = Rec::<B>(row);
            owners.insert(partition(&r)?, r.get::<Option<String>>("owner")?);
        }
        let wanted: BTreeSet<i32> = partitions.iter().copied().collect();
        owners.retain(|p, _| wanted.contains(p));
        let renew = Stmt::new(
            "INSERT INTO projector_members (consumer, topic, member, expires_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (consumer, topic, member) DO UPDATE SET expires_at = excluded.expires_at",
        )
        .text(consumer)
        .text(topic)
        .text(member)
        .time(until);
        B::execute(&mut *tx, renew).await?;
        let lapsed = Stmt::new("DELETE FROM projector_members WHERE consumer = $1 AND topic = $2 AND expires_at < $3")
            .text(consumer)
            .text(topic)
            .time(at);
        B::execute(&mut *tx, lapsed).await?;
        let live: BTreeSet<String> =
            each(&B::fetch(&mut *tx, members_stmt(consumer, topic, at)).await?, |r: &Rec<'_, B>| r.text("member"))?
                .into_iter()
                .collect();
        let mine = meter::share::assign(&owners, &live, member);
        for (p, owner) in &owners {
            let set = match (mine.contains(p), owner.as_deref() == Some(member)) {
                (true, false) => Some(member),
                (false, true) => None,
                _ => continue,
            };
            let stmt = Stmt::new(
                r#"UPDATE partition_owners SET owner = $4 WHERE consumer = $1 AND topic = $2 AND "partition" = $3"#,
            )
            .text(consumer)
            .text(topic)
            .int(i64::from(*p))
            .opt_text(set);
            B::execute(&mut *tx, stmt).await?;
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(mine)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "leave_partitions"))]
    async fn leave_partitions(&self, consumer: &str, topic: &str, member: &str) -> PortResult<()> {
        let mut tx = B::begin(self.pool()).await.map_err(error::<B>)?;
        let free =
            Stmt::new("UPDATE partition_owners SET owner = NULL WHERE consumer = $1 AND topic = $2 AND owner = $3")
                .text(consumer)
                .text(topic)
                .text(member);
        B::execute(&mut *tx, free).await?;
        let gone = Stmt::new("DELETE FROM projector_members WHERE consumer = $1 AND topic = $2 AND member = $3")
            .text(consumer)
            .text(topic)
            .text(member);
        B::execute(&mut *tx, gone).await?;
        tx.commit().await.map_err(error::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "partition_owners"))]
    async fn partition_owners(
        &self,
        consumer: &str,
        topic: &str,
        at: DateTime<Utc>,
    ) -> PortResult<(BTreeMap<i32, Option<String>>, BTreeSet<String>)> {
        let mut owners = BTreeMap::new();
        for row in &self.all(owners_stmt::<B>(consumer, topic, false)).await? {
            let r = Rec::<B>(row);
            owners.insert(partition(&r)?, r.get::<Option<String>>("owner")?);
        }
        let live = each(&self.all(members_stmt(consumer, topic, at)).await?, |r: &Rec<'_, B>| r.text("member"))?;
        Ok((owners, live.into_iter().collect()))
    }
}
