//! # The view in Redis
//!
//! [`RedisView`] implements [`meter::View`]: per counter, the projector's
//! durable totals, the deltas gateways settled but the projector has not
//! folded yet (indexed by event id), and live reservations with lease expiry.
//! Every operation on a project is **one Lua function call** (`FCALL`), so
//! each is atomic and costs one round trip; the functions, with their
//! KEYS/ARGV, live in `src/lua/` (one file each) and share the helpers of
//! `common.lua`, loaded as one function library ([`Functions`]).
//!
//! The rules the scripts follow are not written here: they are the view's
//! reference model, [`meter::ViewModel`] (`meter::view::model`), which also
//! defines the expiries ([`COUNTER_GRACE`], [`LEASE_GRACE`],
//! [`EVENT_INDEX_TTL`]). A property test (`tests/view_model.rs`) runs
//! generated operation sequences against the model and this view and
//! requires the same answers and, read back with [`RedisView::dump`], the
//! same state. The counter field list has one definition too,
//! [`Field::ALL`] and [`Field::as_str`]: the library starts with Lua
//! tables generated from it (see [`fields_prelude`]), and no script names a
//! field itself.
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
//! | `P{p}:e:<counter>` | hash | reservation id → the estimate it holds there besides one call (a value list); an entry only beside its lease in `r:`, with the same expiry written |
//! | `P{p}:res:<rid>` | set | the counters a reservation holds, or once released a tombstone (the one member `~`); expires at lease + [`LEASE_GRACE`] |
//! | `P{p}:ev:<event>` | hash | counter → the value list (signed decimals in [`Field::ALL`] order, trailing zeros left out) that event added to pending; expires [`EVENT_INDEX_TTL`] after the `at` of its last write; once folded, a tombstone (the one field `~`) until [`TOMBSTONE_TTL`] after the fold |
//! | `P{p}:loaded` | string | the `run_id` of the server that seeded the project ([`RedisView::run_id`]) |
//!
//! `<counter>` is [`CounterKey::encode`]. Without the `loaded` marker a check
//! answers `None` (the caller seeds from the store and the log tail, and
//! checks again), so a flushed Redis never admits against zero; a marker
//! holding another server's `run_id` (a restart from an older snapshot, a
//! promoted replica) reads as no marker, so restored old counts are never
//! trusted: the seeder deletes them ([`View::forget_stale`]) and seeds afresh.
//! The server's `run_id` is read once per library load (`INFO server`, at
//! the first call that needs it) and kept by the library.
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

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::view::model::{
    CounterRecord, EstimateRecord, EventRecord, HoldRecord, LeaseRecord, Values, event_expiry, hold_expiry,
    lost_hold_expiry, merged_deltas, sum_field, tombstone_expiry, validate_plan,
};
#[cfg(doc)]
use meter::view::{COUNTER_GRACE, EVENT_INDEX_TTL, LEASE_GRACE, TOMBSTONE_TTL};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Field, Hold, LimitKind, PortError, PortResult,
    ProjectDump, ProjectId, ReservationId, Seed, Settlement, Totals, View,
};
use redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind, ToRedisArgs};
use tracing::Instrument;

use crate::redis_conn::{RedisConn, ScanScope};

const COMMON: &str = include_str!("lua/common.lua");

/// The functions' bodies, by operation (each is a function of the library,
/// after [`fields_prelude`] and `common.lua`: see [`Functions`]).
const BODIES: [(&str, &str); 9] = [
    ("check", include_str!("lua/check.lua")),
    ("settle", include_str!("lua/settle.lua")),
    ("unsettle", include_str!("lua/unsettle.lua")),
    ("release", include_str!("lua/release.lua")),
    ("fold", include_str!("lua/fold.lua")),
    ("lower", include_str!("lua/lower.lua")),
    ("seed", include_str!("lua/seed.lua")),
    ("usage", include_str!("lua/usage.lua")),
    ("forget", include_str!("lua/forget.lua")),
];

/// The Lua the library starts with, generated from [`Field::ALL`] and
/// [`Field::as_str`] so the field list has one definition: `FIELDS`, the
/// short names in order; `FIELD_AT` (name → position), `T_FIELDS` and
/// `P_FIELDS` (the durable and pending hash fields, `t_<name>` and
/// `p_<name>`), written out as literal tables; and the positions
/// (1-based) of the fields the scripts treat specially. Run once per
/// library load, not at every call.
fn fields_prelude() -> String {
    let at = |f: Field| f.index() + 1;
    let list = |f: &dyn Fn(Field) -> String| Field::ALL.iter().map(|x| f(*x)).collect::<Vec<_>>().join(", ");
    format!(
        "-- generated by RedisView from meter::Field::ALL (Field::as_str)\n\
         local FIELDS = {{ {} }}\n\
         local FIELD_AT = {{ {} }}\n\
         local T_FIELDS = {{ {} }}\n\
         local P_FIELDS = {{ {} }}\n\
         local REQ, CALLS, LLM_P, STO_N, STO = {}, {}, {}, {}, {}\n",
        list(&|f| format!("'{}'", f.as_str())),
        list(&|f| format!("['{}'] = {}", f.as_str(), at(f))),
        list(&|f| format!("'t_{}'", f.as_str())),
        list(&|f| format!("'p_{}'", f.as_str())),
        at(Field::Requests),
        at(Field::Calls),
        at(Field::LlmPriced),
        at(Field::StorageEvents),
        at(Field::Storage),
    )
}

/// The view's Redis function library (Redis 7's `FUNCTION LOAD`, called
/// with `FCALL`): the field prelude and the shared helpers once, then every
/// body of [`BODIES`] as a function of `(KEYS, ARGV)`.
///
/// A library, not one script per operation (`EVALSHA`), because a script
/// runs its whole text at every call: the prelude's tables and the helpers'
/// closures were rebuilt each time, and `server_id()` read `INFO server`
/// each time. In a library they are built once, when the library is loaded
/// into the server's Lua state, and `common.lua` keeps the server's
/// `run_id` in a local of the library: a check call went from 25–28 µs to
/// 17–18 µs of Redis's time (BENCHMARKS.md, session 19).
///
/// The library and its functions are named after a digest of their code
/// (`tollgate_<v>`, `tg_<v>_<op>`), so gateways of two versions sharing a
/// Redis each call their own code (function names are global to a
/// server). A Redis that does not have the library (restarted empty, its
/// functions flushed, a new cluster master) answers `Function not found`;
/// [`RedisView`] then loads it (`FUNCTION LOAD REPLACE`, on every master of
/// a cluster) and calls again. A Redis restarted from a snapshot has it
/// already (functions are saved with the data), in a fresh Lua state.
struct Functions {
    /// The library's code, for `FUNCTION LOAD REPLACE`.
    code: String,
    check: String,
    settle: String,
    unsettle: String,
    release: String,
    fold: String,
    lower: String,
    seed: String,
    usage: String,
    forget: String,
}

impl Functions {
    fn new() -> Self {
        let helpers = format!("{}{COMMON}\n", fields_prelude());
        let version = {
            let all: String = std::iter::once(helpers.as_str()).chain(BODIES.iter().map(|(_, b)| *b)).collect();
            // The SHA-1 (hex) redis-rs computes for a script's text.
            Script::new(&all).get_hash()[..16].to_owned()
        };
        let name = |op: &str| format!("tg_{version}_{op}");
        let mut code = format!("#!lua name=tollgate_{version}\n{helpers}");
        for (op, body) in BODIES {
            code.push_str(&format!("\nredis.register_function('{}', function(KEYS, ARGV)\n{body}\nend)\n", name(op)));
        }
        Functions {
            code,
            check: name("check"),
            settle: name("settle"),
            unsettle: name("unsettle"),
            release: name("release"),
            fold: name("fold"),
            lower: name("lower"),
            seed: name("seed"),
            usage: name("usage"),
            forget: name("forget"),
        }
    }

    /// Loads the library (replacing one of the same name: the same code) on
    /// the server, or on every master of a cluster.
    async fn load(&self, conn: &mut RedisConn) -> redis::RedisResult<()> {
        let _: redis::Value =
            redis::cmd("FUNCTION").arg("LOAD").arg("REPLACE").arg(&self.code).query_async(conn).await?;
        Ok(())
    }
}

/// Whether Redis answered that it has no such function: the library is not
/// loaded there (yet, or any more).
fn function_missing(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// One `FCALL` being built, as redis-rs's `ScriptInvocation` builds an
/// `EVALSHA`: keys and arguments each in the order given.
struct Call<'a> {
    function: &'a str,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl<'a> Call<'a> {
    fn new(function: &'a str) -> Self {
        Call { function, keys: Vec::new(), args: Vec::new() }
    }

    fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(self.function).arg(self.keys.len()).arg(&self.keys).arg(&self.args);
        cmd
    }
}

/// The hot-path view in Redis. Cheap to clone: clones share one multiplexed,
/// self-reconnecting connection.
#[derive(Clone)]
pub struct RedisView {
    conn: RedisConn,
    prefix: Arc<str>,
    functions: Arc<Functions>,
}

impl fmt::Debug for RedisView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisView").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl RedisView {
    /// Connects to `url` — `redis://host:port/db` for one server, or
    /// `redis+cluster://host:port,host:port` for a Redis Cluster (any of
    /// its nodes; see [`crate::redis_conn`]); every key starts with
    /// `prefix` (for example `tg:`), which must not contain `{` or `}` (the
    /// project's hash tag follows it).
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisView, PortError> {
        if prefix.contains(['{', '}']) {
            return Err(PortError::Permanent(format!("redis key prefix {prefix:?} must not contain '{{' or '}}'")));
        }
        let mut conn = RedisConn::connect(url).await?;
        let functions = Functions::new();
        functions
            .load(&mut conn)
            .instrument(tracing::debug_span!("datastore", op = "function_load"))
            .await
            .map_err(|e| classify("function load (the view needs Redis 7.0 or later)", &e))?;
        Ok(RedisView { conn, prefix: prefix.into(), functions: Arc::new(functions) })
    }

    /// Whether this view is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.conn.is_cluster()
    }

    /// The permits of this Redis, over this view's connection and prefix
    /// (see [`crate::redis_permits`]).
    pub fn permits(&self) -> crate::RedisPermits {
        crate::RedisPermits::new(self.conn.clone(), &self.prefix)
    }

    /// `P{p}:`, the start of every key of a project.
    fn base(&self, project: &ProjectId) -> String {
        format!("{}{{{}}}:", self.prefix, project.as_str())
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        project: &ProjectId,
        call: &Call<'_>,
    ) -> PortResult<T> {
        let mut conn = self.conn.clone();
        let cmd = call.cmd();
        async {
            match cmd.query_async(&mut conn).await {
                Err(e) if function_missing(&e) => {
                    // Redis lost the library (restarted empty, flushed):
                    // load it again and call once more.
                    self.functions.load(&mut conn).await?;
                    cmd.query_async(&mut conn).await
                }
                r => r,
            }
        }
        .instrument(tracing::debug_span!("datastore", op, project = %project))
        .await
        .map_err(|e| classify(op, &e))
    }

    /// Deletes every key under this view's prefix, as a `FLUSHDB` would
    /// for this deployment: every project is unseeded, so the next check
    /// seeds it again from the store (and the log's tail). What `tollgate
    /// replay --swap` does after the store's totals changed under the view
    /// (a seed never lowers a total). Returns how many keys it deleted.
    pub async fn forget_all(&self) -> PortResult<u64> {
        let mut conn = self.conn.clone();
        let span = tracing::debug_span!("datastore", op = "forget_all");
        let pattern = format!("{}*", glob_escape(&self.prefix));
        let mut deleted = 0u64;
        // Batch by batch, as the SCAN gives them; on a cluster the client
        // splits an UNLINK by slot.
        self.conn
            .scan_each("forget_all", &pattern, ScanScope::All, async |batch| {
                if batch.is_empty() {
                    return Ok(());
                }
                let n: u64 = redis::cmd("UNLINK")
                    .arg(&batch)
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("forget_all", &e))?;
                deleted = deleted.saturating_add(n);
                Ok(())
            })
            .await?;
        Ok(deleted)
    }

    /// The `run_id` of the Redis server that holds `project`'s keys now
    /// (on a cluster, the master of the project's slot). A project's
    /// `loaded` marker holds the `run_id` of the server that seeded it: a
    /// server restarted (from a snapshot or not) or a promoted replica has
    /// another, so a marker it restored is not trusted (the scripts compare
    /// it with the `run_id` they read from `INFO server` once per load).
    pub async fn run_id(&self, project: &ProjectId) -> PortResult<String> {
        let mut conn = self.conn.clone();
        // A script naming the project's `loaded` key runs where that key lives.
        let info: String = Script::new("return redis.call('INFO', 'server')")
            .key(format!("{}loaded", self.base(project)))
            .invoke_async(&mut conn)
            .instrument(tracing::debug_span!("datastore", op = "info"))
            .await
            .map_err(|e| classify("info", &e))?;
        info.lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .map(|s| s.trim().to_owned())
            .ok_or_else(|| PortError::Permanent("redis INFO server has no run_id".into()))
    }

    /// Every key of one project (a `SCAN`; not atomic, never on the hot path).
    async fn project_keys(&self, project: &ProjectId) -> PortResult<Vec<String>> {
        let base = self.base(project);
        let pattern = format!("{}*", glob_escape(&base));
        let mut keys = self.conn.scan("scan", &pattern, ScanScope::SlotOf(&base)).await?;
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// One project's keys read back into the model's comparable form
    /// ([`ProjectDump`]), for tests and debugging: a `SCAN` over the
    /// project's keys, then one `MULTI` per key (its content and
    /// `PEXPIRETIME`). Not atomic and not cheap: never on the hot path.
    /// A key that expires meanwhile is left out; a key this view does not
    /// write is an error.
    pub async fn dump(&self, project: &ProjectId) -> PortResult<ProjectDump> {
        let base = self.base(project);
        let mut conn = self.conn.clone();
        let span = tracing::debug_span!("datastore", op = "dump", project = %project);
        let keys = self.project_keys(project).await?;
        let run_id = self.run_id(project).await?;
        let bad = |key: &str, what: &str| PortError::Permanent(format!("redis dump: {key}: {what}"));
        let mut dump = ProjectDump::default();
        for key in keys {
            let Some(rest) = key.strip_prefix(&base) else { continue };
            let read = |cmd: &str| {
                let mut p = redis::pipe();
                p.atomic().cmd(cmd).arg(&key);
                if cmd == "ZRANGE" {
                    p.arg(0).arg(-1).arg("WITHSCORES");
                }
                p.cmd("PEXPIRETIME").arg(&key);
                p
            };
            // PEXPIRETIME: -2 the key is gone, -1 it never expires.
            let expiry = |t: i64| (t >= 0).then_some(t);
            if rest == "loaded" {
                let marker: Option<String> = redis::cmd("GET")
                    .arg(&key)
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("dump", &e))?;
                dump.loaded = marker.as_deref() == Some(run_id.as_str());
            } else if let Some(name) = rest.strip_prefix("c:") {
                let (fields, t): (Vec<(String, String)>, i64) = read("HGETALL")
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("dump", &e))?;
                if t == -2 {
                    continue;
                }
                let mut rec = CounterRecord { expires: expiry(t), ..CounterRecord::default() };
                for (field, value) in fields {
                    let (durable, short) = match (field.strip_prefix("t_"), field.strip_prefix("p_")) {
                        (Some(s), _) => (true, s),
                        (None, Some(s)) => (false, s),
                        (None, None) => return Err(bad(&key, &format!("unknown field {field}"))),
                    };
                    let f = Field::ALL
                        .into_iter()
                        .find(|f| f.as_str() == short)
                        .ok_or_else(|| bad(&key, &format!("unknown field {field}")))?;
                    if durable {
                        set_durable(&mut rec.durable, f, &value);
                        rec.footprint |= f == Field::StorageEvents;
                    } else {
                        rec.pending[f.index()] = value.parse().map_err(|_| bad(&key, &format!("{field} = {value}")))?;
                    }
                }
                dump.counters.insert(name.to_owned(), rec);
            } else if let Some(name) = rest.strip_prefix("r:") {
                let (members, t): (Vec<(String, f64)>, i64) = read("ZRANGE")
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("dump", &e))?;
                if t == -2 {
                    continue;
                }
                let mut rec = LeaseRecord { expires: expiry(t), ..LeaseRecord::default() };
                for (rid, lease) in members {
                    let rid = ReservationId::parse(rid).map_err(|e| bad(&key, &e.to_string()))?;
                    rec.leases.insert(rid, lease as i64);
                }
                dump.leases.insert(name.to_owned(), rec);
            } else if let Some(name) = rest.strip_prefix("e:") {
                let (fields, t): (Vec<(String, String)>, i64) = read("HGETALL")
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("dump", &e))?;
                if t == -2 {
                    continue;
                }
                let mut rec = EstimateRecord { expires: expiry(t), ..EstimateRecord::default() };
                for (rid, list) in fields {
                    let rid = ReservationId::parse(rid).map_err(|e| bad(&key, &e.to_string()))?;
                    let v = parse_value_list(&list).ok_or_else(|| bad(&key, &format!("value list {list:?}")))?;
                    rec.amounts.insert(rid, v);
                }
                dump.estimates.insert(name.to_owned(), rec);
            } else if let Some(rid) = rest.strip_prefix("res:") {
                let (counters, t): (Vec<String>, i64) = read("SMEMBERS")
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("dump", &e))?;
                if t == -2 {
                    continue;
                }
                let rid = ReservationId::parse(rid).map_err(|e| bad(&key, &e.to_string()))?;
                let released = counters.iter().any(|c| c == TOMBSTONE);
                let counters = counters.into_iter().filter(|c| c != TOMBSTONE).collect();
                dump.holds.insert(rid, HoldRecord { counters, released, expires: expiry(t) });
            } else if let Some(event) = rest.strip_prefix("ev:") {
                let (fields, t): (Vec<(String, String)>, i64) = read("HGETALL")
                    .query_async(&mut conn)
                    .instrument(span.clone())
                    .await
                    .map_err(|e| classify("dump", &e))?;
                if t == -2 {
                    continue;
                }
                let event = EventId::parse(event).map_err(|e| bad(&key, &e.to_string()))?;
                let mut rec = EventRecord { expires: expiry(t), ..EventRecord::default() };
                for (name, list) in fields {
                    if name == TOMBSTONE {
                        rec.folded = true;
                        continue;
                    }
                    let v = parse_value_list(&list).ok_or_else(|| bad(&key, &format!("value list {list:?}")))?;
                    rec.deltas.insert(name, v);
                }
                dump.events.insert(event, rec);
            } else {
                return Err(bad(&key, "not a key of the view"));
            }
        }
        Ok(dump)
    }
}

/// `s` as a literal in a `SCAN MATCH` pattern.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

/// Decides once whether retrying can help.
pub(crate) fn classify(op: &str, e: &RedisError) -> PortError {
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

/// The field of an event index that makes it a tombstone (common.lua).
const TOMBSTONE: &str = "~";

/// [`LEASE_GRACE`](meter::view::LEASE_GRACE) in ms.
fn grace_ms() -> i64 {
    i64::try_from(meter::view::LEASE_GRACE.as_millis()).unwrap_or(i64::MAX)
}

fn ms(at: DateTime<Utc>) -> i64 {
    meter::view::model::millis(at)
}

/// An expiry as the scripts take it: ms, or `''` for never.
fn expiry_arg(at: Option<i64>) -> String {
    at.map(|e| e.to_string()).unwrap_or_default()
}

/// When a counter's keys may go ([`meter::counter_expiry`](meter::view::counter_expiry)).
fn counter_expiry(c: &Counter) -> String {
    expiry_arg(meter::view::counter_expiry(c))
}

/// A durable value, exact: a sum as `u64`, the footprint as `i64`.
fn durable_str(t: &Totals, f: Field) -> String {
    meter::view::model::durable_value(t, f).to_string()
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
fn value_list(v: &Values) -> String {
    let len = v.iter().rposition(|x| *x != 0).map_or(0, |i| i + 1);
    v[..len].iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

/// A value list read back (missing trailing values are zeros).
fn parse_value_list(s: &str) -> Option<Values> {
    let mut v: Values = [0; Field::ALL.len()];
    for (i, part) in s.split(',').filter(|p| !p.is_empty()).enumerate() {
        *v.get_mut(i)? = part.parse().ok()?;
    }
    Some(v)
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

/// A signed reply value that may come as a double (`%.0f`), saturating.
fn parse_signed(s: &str) -> i64 {
    s.parse::<i64>().or_else(|_| s.parse::<f64>().map(|f| f as i64)).unwrap_or(0)
}

/// A reply value as `i64` (garbage reads as 0).
fn parse_i64(s: &str) -> i64 {
    s.parse::<i64>().unwrap_or(0)
}

/// Counter arguments of seed and fold: expire-at, then the durable totals in
/// [`Field::ALL`] order.
fn durable_args(inv: &mut Call<'_>, c: &Counter, t: &Totals) {
    inv.arg(counter_expiry(c));
    for f in Field::ALL {
        inv.arg(durable_str(t, f));
    }
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
        validate_plan(plan)?;
        let base = self.base(project);
        let reserved = plan.reserved_counters();
        let mut inv = Call::new(&self.functions.check);
        inv.key(format!("{base}loaded"))
            .key(format!("{base}ev:{}", hold.request_event))
            .key(format!("{base}res:{}", hold.reservation));
        inv.arg(ms(at).to_string())
            .arg(ms(hold.lease_until).to_string())
            .arg(hold.reservation.as_str())
            .arg(hold_expiry(hold).to_string())
            .arg(event_expiry(at).to_string())
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
            inv.arg((l.counter + 1).to_string())
                .arg(kind_name(l.kind))
                .arg(field_names(&l.fields))
                .arg(l.limit.to_string())
                .arg(l.need.to_string())
                .arg(if l.enforce { "1" } else { "0" });
        }
        inv.arg(value_list(&plan.estimate.totals().values()));
        let reply: Option<Vec<String>> = self.run("check", project, &inv).await?;
        let Some(reply) = reply else { return Ok(None) };
        let Some((admitted, values)) = reply.split_first() else {
            return Err(PortError::Permanent("redis check: empty reply".into()));
        };
        let n = plan.limits.len();
        if values.len() != 4 * n {
            return Err(PortError::Permanent(format!("redis check: {} values for {n} limits", values.len())));
        }
        let (used, split) = values.split_at(n);
        let parts = split
            .chunks_exact(3)
            .map(|p| meter::UsageParts {
                durable: parse_used(&p[0]),
                settled: parse_signed(&p[1]),
                reserved: parse_used(&p[2]),
            })
            .collect();
        Ok(Some(CheckOutcome { admitted: admitted == "1", used: used.iter().map(|u| parse_used(u)).collect(), parts }))
    }

    async fn seed(&self, project: &ProjectId, seed: &Seed, at: DateTime<Utc>) -> PortResult<()> {
        let base = self.base(project);
        let mut inv = Call::new(&self.functions.seed);
        inv.key(format!("{base}loaded"));
        inv.arg(base.as_str()).arg(event_expiry(at).to_string()).arg(ms(at).to_string());
        inv.arg(seed.totals.len().to_string());
        for (c, t) in &seed.totals {
            inv.arg(c.key.encode());
            durable_args(&mut inv, c, t);
        }
        inv.arg(seed.pending.len().to_string());
        for s in &seed.pending {
            let deltas = merged_deltas(&s.deltas);
            inv.arg(s.event.as_str()).arg(deltas.len().to_string());
            for d in deltas {
                inv.arg(d.name.as_str()).arg(expiry_arg(d.expires)).arg(value_list(&d.values));
            }
        }
        inv.arg(seed.holds.len().to_string());
        for h in &seed.holds {
            inv.arg(h.reservation.as_str())
                .arg(ms(h.lease_until).to_string())
                .arg(ms(h.lease_until).saturating_add(grace_ms()).to_string())
                .arg(value_list(&h.estimate.totals().values()))
                .arg(h.counters.len().to_string());
            for c in &h.counters {
                inv.arg(c.key.encode());
            }
        }
        let _: i64 = self.run("seed", project, &inv).await?;
        Ok(())
    }

    /// A marker that is not this server's (see [`RedisView::run_id`]): the
    /// project's keys are what a snapshot held, so they are deleted, with
    /// the test of the marker, in one script (`forget.lua`).
    async fn forget_stale(&self, project: &ProjectId) -> PortResult<bool> {
        let base = self.base(project);
        let mut inv = Call::new(&self.functions.forget);
        inv.key(format!("{base}loaded")).arg(format!("{}*", glob_escape(&base)));
        let forgot: i64 = self.run("forget_stale", project, &inv).await?;
        Ok(forgot == 1)
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()> {
        if settlements.is_empty() {
            return Ok(());
        }
        let base = self.base(project);
        let mut inv = Call::new(&self.functions.settle);
        inv.arg(base.as_str())
            .arg(event_expiry(at).to_string())
            .arg(lost_hold_expiry(at).to_string())
            .arg(settlements.len().to_string());
        for s in settlements {
            let deltas = merged_deltas(&s.deltas);
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
            for d in deltas {
                inv.key(format!("{base}c:{}", d.name));
                inv.arg(d.name.as_str()).arg(expiry_arg(d.expires)).arg(value_list(&d.values));
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
        let mut inv = Call::new(&self.functions.unsettle);
        inv.arg(base.as_str());
        for e in events {
            inv.key(format!("{base}ev:{e}"));
        }
        let _: i64 = self.run("unsettle", project, &inv).await?;
        Ok(())
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId, at: DateTime<Utc>) -> PortResult<()> {
        let base = self.base(project);
        let mut inv = Call::new(&self.functions.release);
        inv.key(format!("{base}res:{reservation}"));
        inv.arg(base.as_str()).arg(reservation.as_str()).arg(lost_hold_expiry(at).to_string());
        let _: i64 = self.run("release", project, &inv).await?;
        Ok(())
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
        at: DateTime<Utc>,
    ) -> PortResult<()> {
        if totals.is_empty() && events.is_empty() {
            return Ok(());
        }
        let base = self.base(project);
        let mut inv = Call::new(&self.functions.fold);
        inv.arg(base.as_str()).arg(tombstone_expiry(at).to_string()).arg(totals.len().to_string());
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

    async fn lower_totals(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        if totals.is_empty() {
            return Ok(());
        }
        let base = self.base(project);
        let mut inv = Call::new(&self.functions.lower);
        inv.arg(base.as_str()).arg(totals.len().to_string());
        for (c, t) in totals {
            inv.key(format!("{base}c:{}", c.key.encode()));
            durable_args(&mut inv, c, t);
        }
        let _: i64 = self.run("lower_totals", project, &inv).await?;
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
        let mut inv = Call::new(&self.functions.usage);
        inv.key(format!("{base}loaded"))
            .key(format!("{base}c:{name}"))
            .key(format!("{base}r:{name}"))
            .key(format!("{base}e:{name}"));
        inv.arg(ms(at).to_string());
        let reply: Option<Vec<String>> = self.run("usage", project, &inv).await?;
        let Some(v) = reply else { return Ok(None) };
        let n = Field::ALL.len();
        if v.len() != 3 * n + 1 {
            return Err(PortError::Permanent(format!("redis usage: {} values, expected {}", v.len(), 3 * n + 1)));
        }
        let mut durable = Totals::default();
        for (f, s) in Field::ALL.iter().zip(&v[..n]) {
            set_durable(&mut durable, *f, s);
        }
        // Pending sums are never negative in a consistent view; Totals clamps them at 0 anyway.
        let pending = Totals::from_values(&v[n..2 * n].iter().map(|s| parse_i64(s)).collect::<Vec<_>>());
        let reserved = Totals::from_values(&v[2 * n + 1..].iter().map(|s| parse_signed(s)).collect::<Vec<_>>());
        Ok(Some(CounterUsage { durable, pending, reserved_calls: parse_used(&v[2 * n]), reserved }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prelude's `FIELDS`, read back.
    fn prelude_fields() -> Vec<String> {
        let prelude = fields_prelude();
        let line = prelude.lines().find(|l| l.starts_with("local FIELDS = {")).expect("FIELDS is defined");
        let inner = line.trim_start_matches("local FIELDS = {").trim_end_matches('}');
        inner.split(',').map(|s| s.trim().trim_matches('\'').to_owned()).collect()
    }

    #[test]
    fn the_lua_field_list_is_field_all() {
        let names: Vec<&str> = Field::ALL.iter().map(|f| f.as_str()).collect();
        assert_eq!(prelude_fields(), names);
        let prelude = fields_prelude();
        let positions = format!(
            "local REQ, CALLS, LLM_P, STO_N, STO = {}, {}, {}, {}, {}",
            Field::Requests.index() + 1,
            Field::Calls.index() + 1,
            Field::LlmPriced.index() + 1,
            Field::StorageEvents.index() + 1,
            Field::Storage.index() + 1,
        );
        assert!(prelude.contains(&positions), "{prelude}");
        let at: Vec<String> = names.iter().enumerate().map(|(i, n)| format!("['{n}'] = {}", i + 1)).collect();
        assert!(prelude.contains(&format!("local FIELD_AT = {{ {} }}", at.join(", "))), "{prelude}");
        let t: Vec<String> = names.iter().map(|n| format!("'t_{n}'")).collect();
        let p: Vec<String> = names.iter().map(|n| format!("'p_{n}'")).collect();
        assert!(prelude.contains(&format!("local T_FIELDS = {{ {} }}", t.join(", "))), "{prelude}");
        assert!(prelude.contains(&format!("local P_FIELDS = {{ {} }}", p.join(", "))), "{prelude}");
    }

    #[test]
    fn no_script_names_a_field_itself() {
        for (name, body) in BODIES.iter().copied().chain([("common", COMMON)]) {
            assert!(!body.contains("local FIELDS"), "{name}.lua defines its own field list");
            for f in Field::ALL {
                for lit in [format!("'t_{}'", f.as_str()), format!("'p_{}'", f.as_str())] {
                    assert!(!body.contains(&lit), "{name}.lua names {lit}: use T_FIELDS/P_FIELDS");
                }
            }
        }
    }

    #[test]
    fn the_library_is_the_prelude_the_helpers_then_every_body_as_a_function() {
        let f = Functions::new();
        let (first, rest) = f.code.split_once('\n').expect("a shebang line");
        let version = first.strip_prefix("#!lua name=tollgate_").expect("the library's name");
        assert_eq!(version.len(), 16);
        assert!(rest.starts_with(&format!("{}{COMMON}\n", fields_prelude())));
        let names = [&f.check, &f.settle, &f.unsettle, &f.release, &f.fold, &f.lower, &f.seed, &f.usage, &f.forget];
        for ((op, body), name) in BODIES.iter().zip(names) {
            assert_eq!(*name, format!("tg_{version}_{op}"));
            let wrapped = format!("redis.register_function('{name}', function(KEYS, ARGV)\n{body}\nend)\n");
            assert!(f.code.contains(&wrapped), "{op} is not registered as its body");
        }
        // Same code, same names; the digest moves with any body.
        assert_eq!(Functions::new().code, f.code);
    }

    #[test]
    fn value_lists_round_trip() {
        let mut v: Values = [0; Field::ALL.len()];
        assert_eq!(value_list(&v), "");
        assert_eq!(parse_value_list(""), Some(v));
        v[Field::Calls.index()] = 1;
        v[Field::Rows.index()] = 7;
        assert_eq!(value_list(&v), "0,1,7");
        assert_eq!(parse_value_list("0,1,7"), Some(v));
        v[Field::Storage.index()] = -300;
        assert_eq!(parse_value_list(&value_list(&v)), Some(v));
        assert_eq!(parse_value_list("1,x"), None);
        assert_eq!(parse_value_list(&vec!["1"; Field::ALL.len() + 1].join(",")), None);
    }

    #[test]
    fn scan_patterns_escape_glob_characters() {
        assert_eq!(glob_escape("tg:{p-1}:"), "tg:{p-1}:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
