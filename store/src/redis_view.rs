//! # The view in Redis
//!
//! [`RedisView`] implements [`meter::View`]: per counter, the projector's
//! durable totals, the deltas gateways settled but the projector has not
//! folded yet (indexed by event id), and live reservations with lease expiry.
//! Every operation on a project is **one Lua script call**, so each is atomic
//! and costs one round trip; the scripts, with their KEYS/ARGV, live in
//! `src/lua/` and share the helpers of `common.lua`.
//!
//! ## Layout
//!
//! With `P` the prefix and `p` the project id, every key of a project carries
//! the hash tag `{p}`, so one script may touch them all (also on Redis
//! Cluster, including the keys a script derives at run time):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `P{p}:c:<counter>` | hash | `t_<f>` (durable) and `p_<f>` (pending) for each [`Field`] `f` by its short name ([`Field::as_str`]), a missing field being 0; expires one hour after the window resets |
//! | `P{p}:r:<counter>` | zset | reservation id → lease expiry (ms) |
//! | `P{p}:res:<rid>` | set | the counters a reservation holds; expires at lease + grace |
//! | `P{p}:ev:<event>` | hash | counter → the value list (signed decimals in [`Field::ALL`] order, trailing zeros left out) that event added to pending; 7 days |
//! | `P{p}:loaded` | string | the durable totals were seeded |
//!
//! `<counter>` is [`CounterKey::encode`]. Without the `loaded` marker a check
//! answers `None` (the caller seeds from the store and checks again), so a
//! flushed Redis never admits against zero.
//!
//! ## Limits
//!
//! A check's limits name their [`LimitKind`] and the fields they sum, so the
//! script knows no metric: with `v(f) = max(0, t_f + p_f)`, a cap reads the
//! sum of `v(f)` (plus the live reservations when `calls` is among the
//! fields), a blackout reads `v(llm)` while `v(llm_p)` is 0 (else 0), and a
//! probe reads like a cap and never refuses.
//!
//! ## Durable totals
//!
//! Seed and fold never lower a sum (`t = max(current, new)`). The storage
//! footprint (`t_sto`, on [`CounterKey::footprint`]) can go down, so it is
//! replaced instead, and only by a total reflecting more storage facts
//! (`t_sto_n` greater): a stale fold or a late seed cannot bring back an old
//! footprint.
//!
//! ## Accuracy
//!
//! Amounts are sent as decimal strings and stored with `HSET`/`HINCRBY`, so
//! what Redis holds is exact. Durable sums are compared as decimal strings,
//! so "never lower a total" is exact for every `u64`. Sums and limit
//! comparisons inside a check use Lua numbers, which are doubles: exact up to
//! 2^53 (about 9·10^15). Requests, calls, rows, tokens, events and bytes stay
//! far below that. Costs are picodollars, so a cost compared above about
//! $9,007 is approximate: off by at most the doubles' spacing there, under
//! 4,096 picodollars (a millionth of a cent) anywhere below 2^64. The `used`
//! a check reports is that double, rounded.
//!
//! A call that times out on the client may still have run on the server: a
//! check's reservation is then freed by its lease; a settle or fold is
//! idempotent per event id and may simply be retried.
//!
//! Redis must not evict keys (`maxmemory-policy noeviction`): an evicted
//! counter under a surviving `loaded` marker would read as lower usage.
//!
//! Errors: connection refused, dropped or timed out, and the retryable server
//! states (loading, busy, cluster down, …) are [`PortError::Transient`];
//! script and type errors are [`PortError::Permanent`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Field, Hold, LimitKind, PortError, PortResult,
    ProjectId, ReservationId, Settlement, Totals, View,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use tracing::Instrument;

/// How long a counter outlives its window's reset.
pub const COUNTER_GRACE: Duration = Duration::from_secs(3600);
/// How long a reservation's index outlives its lease.
pub const LEASE_GRACE: Duration = Duration::from_secs(3600);
/// How long an event's pending index lives if the event is never folded.
pub const EVENT_INDEX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

const COMMON: &str = include_str!("lua/common.lua");

/// The scripts, each prefixed with the shared helpers.
struct Scripts {
    check: Script,
    settle: Script,
    unsettle: Script,
    release: Script,
    fold: Script,
    seed: Script,
    usage: Script,
}

impl Scripts {
    fn new() -> Self {
        let s = |body: &str| Script::new(&format!("{COMMON}\n{body}"));
        Scripts {
            check: s(include_str!("lua/check.lua")),
            settle: s(include_str!("lua/settle.lua")),
            unsettle: s(include_str!("lua/unsettle.lua")),
            release: s(include_str!("lua/release.lua")),
            fold: s(include_str!("lua/fold.lua")),
            seed: s(include_str!("lua/seed.lua")),
            usage: s(include_str!("lua/usage.lua")),
        }
    }
}

/// The hot-path view in Redis. Cheap to clone: clones share one multiplexed,
/// self-reconnecting connection.
#[derive(Clone)]
pub struct RedisView {
    conn: ConnectionManager,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
}

impl fmt::Debug for RedisView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisView").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl RedisView {
    /// Connects to `url` (`redis://host:port/db`); every key starts with
    /// `prefix` (for example `tg:`), which must not contain `{` or `}` (the
    /// project's hash tag follows it).
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisView, PortError> {
        if prefix.contains(['{', '}']) {
            return Err(PortError::Permanent(format!("redis key prefix {prefix:?} must not contain '{{' or '}}'")));
        }
        let client = redis::Client::open(url).map_err(|e| PortError::Permanent(format!("redis url: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(3);
        let conn = ConnectionManager::new_with_config(client, config)
            .instrument(tracing::debug_span!("datastore", op = "connect"))
            .await
            .map_err(|e| classify("connect", &e))?;
        Ok(RedisView { conn, prefix: prefix.into(), scripts: Arc::new(Scripts::new()) })
    }

    /// `P{p}:`, the start of every key of a project.
    fn base(&self, project: &ProjectId) -> String {
        format!("{}{{{}}}:", self.prefix, project.as_str())
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        project: &ProjectId,
        inv: &redis::ScriptInvocation<'_>,
    ) -> PortResult<T> {
        let mut conn = self.conn.clone();
        inv.invoke_async(&mut conn)
            .instrument(tracing::debug_span!("datastore", op, project = %project))
            .await
            .map_err(|e| classify(op, &e))
    }
}

/// Decides once whether retrying can help.
fn classify(op: &str, e: &RedisError) -> PortError {
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
            ) | ErrorKind::ClusterConnectionNotFound
        )
        || e.code() == Some("BUSY");
    let msg = format!("redis {op}: {e}");
    if transient { PortError::Transient(msg) } else { PortError::Permanent(msg) }
}

fn ms(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

fn grace_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// When a counter's keys may go: one hour after its window resets, or never.
fn counter_expiry(c: &Counter) -> String {
    c.resets_at.map(|r| (ms(r).saturating_add(grace_ms(COUNTER_GRACE))).to_string()).unwrap_or_default()
}

/// The `u64` behind a sum field of `t`, or `None` for `storage` (an `i64`).
/// [`Totals::get`] clamps at `i64::MAX`; durable sums are kept exact to `u64`.
pub(crate) fn sum_field(t: &mut Totals, f: Field) -> Option<&mut u64> {
    Some(match f {
        Field::Requests => &mut t.requests,
        Field::Calls => &mut t.calls,
        Field::Rows => &mut t.rows,
        Field::Tokens => &mut t.tokens,
        Field::CostLlmTokens => &mut t.cost_llm_tokens,
        Field::CostComputeExecution => &mut t.cost_compute_execution,
        Field::CostApiRequest => &mut t.cost_api_request,
        Field::CostStorage => &mut t.cost_storage,
        Field::LlmEvents => &mut t.llm_events,
        Field::LlmPriced => &mut t.llm_priced,
        Field::LlmUnpriced => &mut t.llm_unpriced,
        Field::StorageEvents => &mut t.storage_events,
        Field::Storage => return None,
    })
}

/// A durable value, exact: a sum as `u64`, the footprint as `i64`.
fn durable_str(t: &Totals, f: Field) -> String {
    let mut t = *t;
    match sum_field(&mut t, f) {
        Some(v) => v.to_string(),
        None => t.storage.to_string(),
    }
}

/// Parses a stored durable value back into `t` (garbage reads as 0).
fn set_durable(t: &mut Totals, f: Field, s: &str) {
    match sum_field(t, f) {
        Some(v) => *v = s.parse::<u64>().unwrap_or(0),
        None => t.storage = s.parse::<i64>().unwrap_or(0),
    }
}

/// A delta as a value list: signed decimals in [`Field::ALL`] order,
/// trailing zeros left out (`""` when all are zero).
fn value_list(t: &Totals) -> String {
    let v = t.values();
    let len = v.iter().rposition(|x| *x != 0).map_or(0, |i| i + 1);
    v[..len].iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

fn kind_name(k: LimitKind) -> &'static str {
    match k {
        LimitKind::Cap => "cap",
        LimitKind::Blackout => "blackout",
        LimitKind::Probe => "probe",
    }
}

fn field_names(fields: &[Field]) -> String {
    fields.iter().map(|f| f.as_str()).collect::<Vec<_>>().join(",")
}

/// A `used` the check reports: a decimal of a double, never negative.
fn parse_used(s: &str) -> u64 {
    s.parse::<u64>().or_else(|_| s.parse::<f64>().map(|f| f as u64)).unwrap_or(0)
}

/// A reply value as `i64` (garbage reads as 0).
fn parse_i64(s: &str) -> i64 {
    s.parse::<i64>().unwrap_or(0)
}

/// Counter arguments of seed and fold: expire-at, then the 13 durable totals.
fn durable_args(inv: &mut redis::ScriptInvocation<'_>, c: &Counter, t: &Totals) {
    inv.arg(counter_expiry(c));
    for f in Field::ALL {
        inv.arg(durable_str(t, f));
    }
}

/// The deltas of one settlement, one per counter (a counter named twice is summed).
fn merged(deltas: &[(Counter, Totals)]) -> Vec<(String, String, Totals)> {
    let mut by: BTreeMap<String, (String, Totals)> = BTreeMap::new();
    for (c, t) in deltas {
        let e = by.entry(c.key.encode()).or_insert_with(|| (counter_expiry(c), Totals::default()));
        e.1.add(*t);
    }
    by.into_iter().map(|(n, (exp, t))| (n, exp, t)).collect()
}

#[async_trait]
impl View for RedisView {
    async fn check(
        &self,
        project: &ProjectId,
        plan: &CheckPlan,
        hold: &Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CheckOutcome>> {
        let base = self.base(project);
        let reserved = plan.reserved_counters();
        let mut inv = self.scripts.check.prepare_invoke();
        inv.key(format!("{base}loaded"))
            .key(format!("{base}ev:{}", hold.request_event))
            .key(format!("{base}res:{}", hold.reservation));
        inv.arg(ms(at).to_string())
            .arg(ms(hold.lease_until).to_string())
            .arg(hold.reservation.as_str())
            .arg(ms(hold.lease_until).saturating_add(grace_ms(LEASE_GRACE)).to_string())
            .arg(grace_ms(EVENT_INDEX_TTL).to_string())
            .arg(plan.counters.len().to_string());
        for (i, c) in plan.counters.iter().enumerate() {
            let name = c.key.encode();
            inv.key(format!("{base}c:{name}")).key(format!("{base}r:{name}"));
            inv.arg(name)
                .arg(counter_expiry(c))
                .arg(if plan.count_request.contains(&i) { "1" } else { "0" })
                .arg(if reserved.contains(&i) { "1" } else { "0" });
        }
        inv.arg(plan.limits.len().to_string());
        for l in &plan.limits {
            if l.counter >= plan.counters.len() {
                return Err(PortError::Permanent(format!(
                    "check plan names counter {} of {}",
                    l.counter,
                    plan.counters.len()
                )));
            }
            inv.arg((l.counter + 1).to_string())
                .arg(kind_name(l.kind))
                .arg(field_names(&l.fields))
                .arg(l.limit.to_string())
                .arg(l.need.to_string())
                .arg(if l.enforce { "1" } else { "0" });
        }
        let reply: Option<Vec<String>> = self.run("check", project, &inv).await?;
        let Some(reply) = reply else { return Ok(None) };
        let Some((admitted, used)) = reply.split_first() else {
            return Err(PortError::Permanent("redis check: empty reply".into()));
        };
        if used.len() != plan.limits.len() {
            return Err(PortError::Permanent(format!(
                "redis check: {} values for {} limits",
                used.len(),
                plan.limits.len()
            )));
        }
        Ok(Some(CheckOutcome { admitted: admitted == "1", used: used.iter().map(|u| parse_used(u)).collect() }))
    }

    async fn seed(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        let base = self.base(project);
        let mut inv = self.scripts.seed.prepare_invoke();
        inv.key(format!("{base}loaded"));
        for (c, t) in totals {
            inv.key(format!("{base}c:{}", c.key.encode()));
            durable_args(&mut inv, c, t);
        }
        let _: i64 = self.run("seed", project, &inv).await?;
        Ok(())
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], _at: DateTime<Utc>) -> PortResult<()> {
        if settlements.is_empty() {
            return Ok(());
        }
        let base = self.base(project);
        let mut inv = self.scripts.settle.prepare_invoke();
        inv.arg(base.as_str()).arg(grace_ms(EVENT_INDEX_TTL).to_string()).arg(settlements.len().to_string());
        for s in settlements {
            let deltas = merged(&s.deltas);
            inv.key(format!("{base}ev:{}", s.event));
            inv.arg(s.event.as_str());
            match &s.reservation {
                Some(rid) => {
                    inv.key(format!("{base}res:{rid}"));
                    inv.arg(rid.as_str());
                }
                None => {
                    inv.arg("");
                }
            }
            inv.arg(deltas.len().to_string());
            for (name, exp, t) in deltas {
                inv.key(format!("{base}c:{name}"));
                inv.arg(name).arg(exp).arg(value_list(&t));
            }
        }
        let _: i64 = self.run("settle", project, &inv).await?;
        Ok(())
    }

    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        if events.is_empty() {
            return Ok(());
        }
        let base = self.base(project);
        let mut inv = self.scripts.unsettle.prepare_invoke();
        inv.arg(base.as_str());
        for e in events {
            inv.key(format!("{base}ev:{e}"));
        }
        let _: i64 = self.run("unsettle", project, &inv).await?;
        Ok(())
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId) -> PortResult<()> {
        let base = self.base(project);
        let mut inv = self.scripts.release.prepare_invoke();
        inv.key(format!("{base}res:{reservation}"));
        inv.arg(base.as_str()).arg(reservation.as_str());
        let _: i64 = self.run("release", project, &inv).await?;
        Ok(())
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
    ) -> PortResult<()> {
        if totals.is_empty() && events.is_empty() {
            return Ok(());
        }
        let base = self.base(project);
        let mut inv = self.scripts.fold.prepare_invoke();
        inv.arg(base.as_str()).arg(totals.len().to_string());
        for (c, t) in totals {
            inv.key(format!("{base}c:{}", c.key.encode()));
            durable_args(&mut inv, c, t);
        }
        for e in events {
            inv.key(format!("{base}ev:{e}"));
        }
        let _: i64 = self.run("apply_fold", project, &inv).await?;
        Ok(())
    }

    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>> {
        let base = self.base(project);
        let name = counter.encode();
        let mut inv = self.scripts.usage.prepare_invoke();
        inv.key(format!("{base}loaded")).key(format!("{base}c:{name}")).key(format!("{base}r:{name}"));
        inv.arg(ms(at).to_string());
        let reply: Option<Vec<String>> = self.run("usage", project, &inv).await?;
        let Some(v) = reply else { return Ok(None) };
        let n = Field::ALL.len();
        if v.len() != 2 * n + 1 {
            return Err(PortError::Permanent(format!("redis usage: {} values, expected {}", v.len(), 2 * n + 1)));
        }
        let mut durable = Totals::default();
        for (f, s) in Field::ALL.iter().zip(&v[..n]) {
            set_durable(&mut durable, *f, s);
        }
        // Pending sums are never negative in a consistent view; Totals clamps them at 0 anyway.
        let pending = Totals::from_values(&v[n..2 * n].iter().map(|s| parse_i64(s)).collect::<Vec<_>>());
        Ok(Some(CounterUsage { durable, pending, reserved_calls: parse_used(&v[2 * n]) }))
    }
}
