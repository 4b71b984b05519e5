//! Shared state: the ports, the clock, settings, and a short-lived cache of
//! configuration (projects, quotas, keys) so the hot path does not read
//! PostgreSQL on every check.
//!
//! The cache is also what keeps checks and settles going while PostgreSQL
//! is down (DESIGN §2, guarantee 10): an entry older than
//! [`Settings::config_ttl`] is loaded again, and when that fails (or takes
//! longer than [`Settings::store_timeout`]) the last entry loaded is served
//! instead, as long as it is younger than [`Settings::config_max_stale`]
//! (one hour by default) — so during an outage a check runs on
//! configuration at most that old, and a quota, key or price change made
//! meanwhile reaches it only when the store is back. A lookup with no
//! entry young enough (a key never seen, or seen too long ago) fails with
//! a transient error: the caller answers 503, never 401 (the key may well
//! exist). Once a load has failed, the store is taken to be down for
//! [`STORE_RETRY`]: lookups serve what they have without waiting for it,
//! and one lookup per interval tries it again.
//!
//! The durable store is held as the focused ports it implements
//! ([`Stores`]), so each service reaches only for the one it uses; the view
//! is a [`SeedingView`], so no reader of it has to know the seed-and-retry
//! protocol.

use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use meter::{
    ApiKey, ApiKeyId, AuditId, AuditStore, Clock, EventId, Ledger, Log, PermitId, Permits, PortError, PortResult,
    PriceBook, PriceStore, Project, ProjectId, Quota, QuotaId, QuotaStore, ReportStore, ReservationId, Role, RoleId,
    Store, TenantStore, View, WebhookStore,
};
use rand::Rng;
use rand::distr::Alphanumeric;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::seeding::SeedingView;

/// What a check does when the view cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewDownPolicy {
    /// Admit the call uncounted by the view (it is still metered on the log).
    Allow,
    /// Refuse with 503.
    Deny,
}

/// Settings of the HTTP service.
#[derive(Clone)]
pub struct Settings {
    pub admin_token: String,
    pub gateway_token: String,
    /// How long an admitted call's reservation lives if never settled.
    pub lease: Duration,
    /// How long configuration is cached (a quota change reaches other
    /// gateway instances within this).
    pub config_ttl: Duration,
    /// The oldest configuration served while the store cannot be read (see
    /// the module doc): the staleness a PostgreSQL outage may cause.
    pub config_max_stale: Duration,
    /// How long the hot path waits for the store (a configuration load, a
    /// side write) before it goes on without it.
    pub store_timeout: Duration,
    pub horizon: chrono::Duration,
    pub view_down: ViewDownPolicy,
    /// This instance's name, written on every event it emits.
    pub instance: String,
    /// Accept webhook endpoints on private, loopback and link-local
    /// addresses (`TOLLGATE_WEBHOOK_ALLOW_PRIVATE`; off by default: SSRF).
    pub webhook_allow_private: bool,
    /// The server's query timeout (`TOLLGATE_QUERY_TIMEOUT`, 30 s by
    /// default), which a key's or role's `query_timeout` narrows: a
    /// permit's lease is the narrowest of them plus 30 s
    /// ([`meter::permit::lease`]).
    pub query_timeout: Duration,
    /// The rows of one page (`TOLLGATE_MAX_PAGE_SIZE`, 1,000 by default),
    /// which a key's or role's `max_rows` narrows: the tower Layer cuts a
    /// page to it.
    pub max_page_size: u64,
    /// The rows of one streamed response (`TOLLGATE_STREAM_MAX_ROWS`,
    /// 100,000 by default), which `max_rows` narrows too: the Layer stops a
    /// stream there.
    pub stream_max_rows: u64,
    /// Requests one caller may run at once on each of Tollgate's own heavy
    /// endpoints (`TOLLGATE_HEAVY_CONCURRENCY`, 4 by default; see
    /// [`crate::heavy`]).
    pub heavy_concurrency: u32,
    /// How long one of them may run (`TOLLGATE_HEAVY_TIMEOUT`, 30 s).
    pub heavy_timeout: Duration,
    /// The installation's cap on all permits together
    /// (`TOLLGATE_PERMITS_CAP`; by default a quarter of the PostgreSQL
    /// pool, at least one: [`meter::permit::installation_cap`]).
    pub installation_permits: u32,
    /// Billing exports run through the API (see [`crate::service::exports`]).
    pub exports: ExportSettings,
}

/// Where API export runs write their files, and their bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSettings {
    /// The directory of API runs' files (`TOLLGATE_EXPORT_DIR`), one file
    /// per run, `<run id>.<ext>`.
    pub dir: std::path::PathBuf,
    /// Most rows one run writes (`TOLLGATE_EXPORT_MAX_ROWS`, 10,000,000).
    pub max_rows: u64,
    /// How long one run may write (`TOLLGATE_EXPORT_MAX_TIME`, 10 min).
    pub max_time: Duration,
    /// How many customers of a charge period a run reads at once
    /// (`TOLLGATE_EXPORT_SLICE`, [`crate::service::exports::SLICE`]): what
    /// bounds its memory.
    pub slice: usize,
    /// The projector whose fold is exported: its consumer name and usage topic.
    pub consumer: String,
    pub topic: String,
}

impl Default for ExportSettings {
    fn default() -> Self {
        ExportSettings {
            dir: std::path::PathBuf::from("tollgate-exports"),
            max_rows: 10_000_000,
            max_time: Duration::from_secs(600),
            slice: crate::service::exports::SLICE,
            consumer: "tollgate-projector".to_owned(),
            topic: "tollgate.usage".to_owned(),
        }
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("admin_token", &"<redacted>")
            .field("gateway_token", &"<redacted>")
            .field("lease", &self.lease)
            .field("config_ttl", &self.config_ttl)
            .field("config_max_stale", &self.config_max_stale)
            .field("store_timeout", &self.store_timeout)
            .field("view_down", &self.view_down)
            .field("instance", &self.instance)
            .field("webhook_allow_private", &self.webhook_allow_private)
            .field("query_timeout", &self.query_timeout)
            .field("max_page_size", &self.max_page_size)
            .field("stream_max_rows", &self.stream_max_rows)
            .field("heavy_concurrency", &self.heavy_concurrency)
            .field("heavy_timeout", &self.heavy_timeout)
            .field("installation_permits", &self.installation_permits)
            .field("exports", &self.exports)
            .finish()
    }
}

impl Settings {
    pub fn new(admin_token: impl Into<String>, gateway_token: impl Into<String>) -> Self {
        Settings {
            admin_token: admin_token.into(),
            gateway_token: gateway_token.into(),
            lease: Duration::from_secs(60),
            config_ttl: Duration::from_secs(1),
            config_max_stale: Duration::from_secs(3600),
            store_timeout: Duration::from_secs(1),
            horizon: meter::usage::DEFAULT_DEDUP_HORIZON,
            view_down: ViewDownPolicy::Deny,
            instance: format!("gw-{}", random_token(6)),
            webhook_allow_private: false,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            max_page_size: DEFAULT_MAX_PAGE_SIZE,
            stream_max_rows: DEFAULT_STREAM_MAX_ROWS,
            heavy_concurrency: 4,
            heavy_timeout: DEFAULT_QUERY_TIMEOUT,
            installation_permits: meter::permit::installation_cap(DEFAULT_POOL_SIZE, None),
            exports: ExportSettings::default(),
        }
    }
}

impl Settings {
    /// The server's bounds on a call, which grants narrow.
    pub fn bounds(&self) -> meter::Bounds {
        meter::Bounds {
            query_timeout: self.query_timeout,
            max_rows: self.max_page_size,
            stream_max_rows: self.stream_max_rows,
        }
    }
}

/// The server's page size unless configured (`TOLLGATE_MAX_PAGE_SIZE`).
pub const DEFAULT_MAX_PAGE_SIZE: u64 = 1000;
/// The server's stream bound unless configured (`TOLLGATE_STREAM_MAX_ROWS`).
pub const DEFAULT_STREAM_MAX_ROWS: u64 = 100_000;

/// The server's query timeout unless configured (`TOLLGATE_QUERY_TIMEOUT`).
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The PostgreSQL pool size the installation's permit cap defaults to a
/// quarter of (`store::PgStore::connect`'s pool).
pub const DEFAULT_POOL_SIZE: u32 = 16;

/// A project with its quotas, as the hot path needs them.
#[derive(Debug, Clone)]
pub struct ProjectConfig {
    pub project: Project,
    pub quotas: Arc<Vec<Quota>>,
    /// The counters its checks can read: where facts are settled.
    pub watched: Arc<meter::Watched>,
}

/// How many shards a cache's entries are spread over, so lookups of
/// different keys do not wait on one lock.
const CACHE_SHARDS: usize = 16;

/// How many entries one shard holds before it is emptied (bounds memory
/// against lookups of ever new secrets).
const SHARD_CAPACITY: usize = 100_000 / CACHE_SHARDS;

/// foldhash, not std's SipHash: each check looks up three entries, two
/// hashes each (its shard, then the entry).
type Entries<T> = HashMap<String, (Instant, T), foldhash::fast::RandomState>;

/// Entries by key, each with when it was loaded, and the loads under way.
/// The entries are spread over [`CACHE_SHARDS`] read-write locks by the
/// key's hash: a hit takes one shard's read lock, so concurrent hits never
/// wait for each other, and values are `Arc`s, so a hit copies no
/// configuration.
struct Cached<T> {
    shards: Box<[RwLock<Entries<T>>]>,
    hasher: foldhash::fast::RandomState,
    /// One lock per key being loaded: while entries are cached (a TTL above
    /// zero), the lookups that miss one key together wait for the first
    /// one's load and take its entry, instead of each asking the store — a
    /// cold gateway under a burst would otherwise send the store one load
    /// per request, time out, and take the store to be down.
    loads: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl<T> Default for Cached<T> {
    fn default() -> Self {
        Cached {
            shards: (0..CACHE_SHARDS).map(|_| RwLock::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
            loads: Mutex::default(),
        }
    }
}

impl<T> Cached<T> {
    fn shard(&self, key: &str) -> &RwLock<Entries<T>> {
        // The remainder is below the shard count, so it fits.
        &self.shards[(self.hasher.hash_one(key) % self.shards.len() as u64) as usize]
    }

    fn read(&self, key: &str) -> RwLockReadGuard<'_, Entries<T>> {
        self.shard(key).read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, key: &str) -> RwLockWriteGuard<'_, Entries<T>> {
        self.shard(key).write().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps only the entries `keep` says yes to, in every shard.
    fn retain(&self, mut keep: impl FnMut(&str, &T) -> bool) {
        for shard in self.shards.iter() {
            shard.write().unwrap_or_else(|e| e.into_inner()).retain(|k, (_, v)| keep(k, v));
        }
    }

    /// Waits until no other lookup is loading `key`, and holds that turn
    /// until the returned guard is dropped.
    async fn load_turn(&self, key: &str) -> LoadTurn<'_, T> {
        let lock = {
            let mut g = self.loads.lock().unwrap_or_else(|e| e.into_inner());
            g.entry(key.to_owned()).or_default().clone()
        };
        let held = lock.clone().lock_owned().await;
        LoadTurn { cached: self, key: key.to_owned(), lock, held: Some(held) }
    }
}

/// A lookup's turn to load one key (see [`Cached::load_turn`]); the last
/// one out removes the key's lock.
struct LoadTurn<'a, T> {
    cached: &'a Cached<T>,
    key: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl<T> Drop for LoadTurn<'_, T> {
    fn drop(&mut self) {
        drop(self.held.take());
        let mut g = self.cached.loads.lock().unwrap_or_else(|e| e.into_inner());
        // Ours and the map's: nobody else waits for this key.
        if Arc::strong_count(&self.lock) == 2 {
            g.remove(&self.key);
        }
    }
}

/// How long the store is taken to be down after a load failed: lookups
/// meanwhile serve what the cache holds, and the first one after it tries
/// the store again.
pub const STORE_RETRY: Duration = Duration::from_secs(1);

/// Configuration cached for `config_ttl`, and kept up to `config_max_stale`
/// for when the store cannot be read.
#[derive(Default)]
pub struct ConfigCache {
    projects: Cached<Option<Arc<ProjectConfig>>>,
    keys: Cached<Option<Arc<ApiKey>>>,
    prices: Cached<Arc<PriceBook>>,
    roles: Cached<Option<Arc<Role>>>,
    /// Until when the store is taken to be down, after a failed load.
    store_down_until: Mutex<Option<Instant>>,
}

impl ConfigCache {
    /// Whether a lookup may try the store now: it is not known to be down,
    /// or its retry time has come (this caller takes the retry; others keep
    /// serving what they have for another [`STORE_RETRY`]).
    fn may_try_store(&self) -> bool {
        let mut until = self.store_down_until.lock().unwrap_or_else(|e| e.into_inner());
        match *until {
            None => true,
            Some(t) if Instant::now() < t => false,
            Some(_) => {
                *until = Some(Instant::now() + STORE_RETRY);
                true
            }
        }
    }

    fn store_answered(&self) {
        let mut until = self.store_down_until.lock().unwrap_or_else(|e| e.into_inner());
        if until.take().is_some() {
            tracing::info!("store reachable again; configuration is loaded from it");
        }
    }

    fn store_failed(&self) {
        let mut until = self.store_down_until.lock().unwrap_or_else(|e| e.into_inner());
        if until.is_none() {
            tracing::warn!("store unreachable; serving the configuration last loaded");
        }
        *until = Some(Instant::now() + STORE_RETRY);
    }

    /// Whether the store is taken to be down right now.
    pub fn store_down(&self) -> bool {
        let until = self.store_down_until.lock().unwrap_or_else(|e| e.into_inner());
        until.is_some_and(|t| Instant::now() < t)
    }
}

/// The entry under `k`, if any: whether it is fresh (younger than `ttl`),
/// and its value if it is younger than `max_stale` (or fresh).
fn get<T: Clone>(m: &Cached<T>, k: &str, ttl: Duration, max_stale: Duration) -> Option<(bool, T)> {
    let g = m.read(k);
    g.get(k).and_then(|(at, v)| {
        let age = at.elapsed();
        (age < ttl || age < max_stale).then(|| (age < ttl, v.clone()))
    })
}

fn put<T>(m: &Cached<T>, k: String, v: T) {
    let mut g = m.write(&k);
    if g.len() >= SHARD_CAPACITY {
        g.clear();
    }
    g.insert(k, (Instant::now(), v));
}

/// The durable store as the seven focused ports it implements. Built from one
/// [`Store`] (PostgreSQL, or the embedded SQLite file); cheap to clone.
#[derive(Clone)]
pub struct Stores {
    pub tenants: Arc<dyn TenantStore>,
    pub quotas: Arc<dyn QuotaStore>,
    pub audit: Arc<dyn AuditStore>,
    pub prices: Arc<dyn PriceStore>,
    pub ledger: Arc<dyn Ledger>,
    pub reports: Arc<dyn ReportStore>,
    pub webhooks: Arc<dyn WebhookStore>,
    pub exports: Arc<dyn meter::ExportStore>,
    pub schedules: Arc<dyn meter::ScheduleStore>,
}

impl Stores {
    /// Every port of one database.
    pub fn of(store: Arc<dyn Store>) -> Self {
        Stores {
            tenants: store.clone(),
            quotas: store.clone(),
            audit: store.clone(),
            prices: store.clone(),
            ledger: store.clone(),
            reports: store.clone(),
            webhooks: store.clone(),
            exports: store.clone(),
            schedules: store,
        }
    }
}

impl std::fmt::Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores").finish_non_exhaustive()
    }
}

/// Everything a service needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub stores: Stores,
    /// The view, seeding itself from the ledger when a project is not loaded.
    pub view: Arc<SeedingView>,
    pub log: Arc<dyn Log>,
    pub clock: Arc<dyn Clock>,
    pub settings: Arc<Settings>,
    pub cache: Arc<ConfigCache>,
    /// The concurrency permits: in memory unless [`AppState::with_permits`]
    /// gives the shared ones (Redis or PostgreSQL, `TOLLGATE_PERMITS`).
    pub permits: Arc<dyn Permits>,
}

impl AppState {
    /// The state over one database (every store port), a view, a log and a clock.
    pub fn new(
        store: Arc<dyn Store>,
        view: Arc<dyn View>,
        log: Arc<dyn Log>,
        clock: Arc<dyn Clock>,
        settings: Settings,
    ) -> Self {
        let stores = Stores::of(store);
        AppState {
            view: Arc::new(SeedingView::new(view, stores.clone(), log.clone(), None)),
            stores,
            log,
            clock,
            settings: Arc::new(settings),
            cache: Arc::default(),
            permits: Arc::new(store::MemoryPermits::new()),
        }
    }

    /// The permits shared by every gateway of the installation (Redis or
    /// PostgreSQL) in place of this process's memory.
    pub fn with_permits(mut self, permits: Arc<dyn Permits>) -> Self {
        self.permits = permits;
        self
    }

    /// Seeds the view from the log's state — the durable totals and the log
    /// tail past them (see [`crate::seeding`]) — rather than from the
    /// durable totals alone. Every deployment that can read its log back
    /// does this; without it a lost view forgets live reservations and
    /// settled-but-unfolded usage.
    pub fn with_log_tail(mut self, source: crate::seeding::TailSource) -> Self {
        let inner = self.view.inner().clone();
        self.view = Arc::new(SeedingView::new(inner, self.stores.clone(), self.log.clone(), Some(source)));
        self
    }

    /// A cached lookup: the entry if fresh, else `load` (bounded by
    /// `store_timeout`), else — when the store fails — the entry if it is
    /// younger than `config_max_stale` (see the module doc).
    async fn cached<T: Clone>(
        &self,
        map: &Cached<T>,
        key: &str,
        load: impl Future<Output = PortResult<T>>,
    ) -> PortResult<T> {
        let (ttl, max_stale) = (self.settings.config_ttl, self.settings.config_max_stale);
        let mut stale = match get(map, key, ttl, max_stale) {
            Some((true, v)) => return Ok(v),
            Some((false, v)) => Some(v),
            None => None,
        };
        // With a TTL of zero every lookup reads the store itself.
        let _turn = if ttl.is_zero() {
            None
        } else {
            let turn = map.load_turn(key).await;
            // Loaded by the lookup whose turn came before this one.
            match get(map, key, ttl, max_stale) {
                Some((true, v)) => return Ok(v),
                Some((false, v)) => stale = Some(v),
                None => {}
            }
            Some(turn)
        };
        let failure = if self.cache.may_try_store() {
            match tokio::time::timeout(self.settings.store_timeout, load).await {
                Ok(Ok(v)) => {
                    self.cache.store_answered();
                    put(map, key.to_owned(), v.clone());
                    return Ok(v);
                }
                Ok(Err(e)) => {
                    if e.is_transient() {
                        self.cache.store_failed();
                    }
                    e
                }
                Err(_) => {
                    self.cache.store_failed();
                    PortError::Transient(format!("the store did not answer within {:?}", self.settings.store_timeout))
                }
            }
        } else {
            PortError::Transient("the store is unavailable".into())
        };
        match stale {
            Some(v) => {
                metrics::counter!("tollgate_config_stale_total").increment(1);
                Ok(v)
            }
            // Logged once, where the caller's error is answered.
            None => Err(failure),
        }
    }

    /// Whether the store is taken to be down right now (a load failed less
    /// than [`STORE_RETRY`] ago): side writes on the hot path skip it.
    pub fn store_down(&self) -> bool {
        self.cache.store_down()
    }

    /// A project and its quotas (cached).
    pub async fn project_config(&self, id: &ProjectId) -> PortResult<Option<Arc<ProjectConfig>>> {
        self.cached(&self.cache.projects, id.as_str(), async {
            Ok(match self.stores.tenants.project(id).await? {
                None => None,
                Some(project) => {
                    let quotas = self.stores.quotas.quotas(id).await?;
                    let watched = Arc::new(meter::Watched::of(&quotas));
                    Some(Arc::new(ProjectConfig { project, quotas: Arc::new(quotas), watched }))
                }
            })
        })
        .await
    }

    /// The price book (cached). The gateway prices tokens events with it to
    /// settle their cost into the view; the projector prices them again,
    /// durably, from the store's book.
    pub async fn price_book(&self) -> PortResult<Arc<PriceBook>> {
        self.cached(&self.cache.prices, "", async { Ok(Arc::new(PriceBook::new(self.stores.prices.prices().await?))) })
            .await
    }

    /// A role by its id (cached).
    pub async fn role_by_id(&self, id: &RoleId) -> PortResult<Option<Arc<Role>>> {
        self.cached(&self.cache.roles, id.as_str(), async { Ok(self.stores.tenants.role(id).await?.map(Arc::new)) })
            .await
    }

    /// Forgets the cached price book after a change.
    pub fn invalidate_prices(&self) {
        self.cache.prices.retain(|_, _| false);
    }

    /// Forgets a project's cached configuration after an admin change.
    pub fn invalidate_project(&self, id: &ProjectId) {
        self.cache.projects.write(id.as_str()).remove(id.as_str());
    }

    /// Forgets a key's cached lookups after it was deleted.
    pub fn invalidate_key(&self, id: &ApiKeyId) {
        let by_id = format!("id:{id}");
        self.cache.keys.retain(|k, v| k != by_id && v.as_ref().is_none_or(|key| &key.id != id));
    }

    /// An API key by its secret (cached by the secret's hash, and a key
    /// found also by its id, so the settles of a checked key find it while
    /// the store is down).
    pub async fn key_by_secret(&self, secret: &str) -> PortResult<Option<Arc<ApiKey>>> {
        let mut buf = [0; SECRET_HASH_LEN];
        let hash = hash_secret_into(secret, &mut buf);
        self.cached(&self.cache.keys, hash, async {
            let key = self.stores.tenants.api_key_by_secret_hash(hash).await?.map(Arc::new);
            if let Some(k) = &key {
                put(&self.cache.keys, format!("id:{}", k.id), key.clone());
            }
            Ok(key)
        })
        .await
    }

    /// An API key by its id (cached).
    pub async fn key_by_id(&self, id: &ApiKeyId) -> PortResult<Option<Arc<ApiKey>>> {
        self.cached(&self.cache.keys, &format!("id:{id}"), async {
            Ok(self.stores.tenants.api_key(id).await?.map(Arc::new))
        })
        .await
    }
}

/// The stored form of a secret: its SHA-256, hex. Secrets are random and
/// long, so a fast hash is enough (no dictionary to attack).
pub fn hash_secret(secret: &str) -> String {
    let mut buf = [0; SECRET_HASH_LEN];
    hash_secret_into(secret, &mut buf).to_owned()
}

/// The length of [`hash_secret`]'s hex.
const SECRET_HASH_LEN: usize = 64;

/// [`hash_secret`] written into `buf`, so that a check's key lookup
/// allocates nothing (`hex::encode` built it a character at a time, about
/// 2,200 instructions a check).
fn hash_secret_into<'b>(secret: &str, buf: &'b mut [u8; SECRET_HASH_LEN]) -> &'b str {
    // A 32-byte digest fills the 64 bytes exactly, with hex digits only.
    match hex::encode_to_slice(Sha256::digest(secret.as_bytes()), buf) {
        Ok(()) => std::str::from_utf8(buf).unwrap_or_default(),
        Err(_) => "",
    }
}

/// A random token of letters and digits.
pub fn random_token(len: usize) -> String {
    rand::rng().sample_iter(&Alphanumeric).take(len).map(char::from).collect()
}

/// A new public id with a type prefix, time-ordered: one id after another
/// is greater, whichever thread makes them (a process-wide counter behind
/// one mutex, `uuid`'s).
pub fn new_id(prefix: &str) -> String {
    prefixed(prefix, uuid::Uuid::now_v7(), str::to_owned)
}

thread_local! {
    /// This thread's UUIDv7 counter, for [`new_hot_id`].
    static HOT_IDS: uuid::ContextV7 = const { uuid::ContextV7::new() };
}

/// A new id for the hot path (reservations, events, permits): as
/// [`new_id`], but ordered by the millisecond only across threads (strictly
/// within one), since its counter is the thread's own. Every check makes
/// three; with `new_id`'s shared counter they took one process-wide lock
/// three times per check, which issue 14 rules out on the hot path.
/// Nothing orders these ids: the log orders events, and a reservation's id
/// is only a name.
pub fn new_hot_id(prefix: &str) -> String {
    hot_id(prefix, str::to_owned)
}

/// [`new_hot_id`], handed to `make` from the stack (no heap block for an id
/// that is parsed straight into its type).
fn hot_id<R>(prefix: &str, make: impl FnOnce(&str) -> R) -> R {
    let ctx = uuid::timestamp::context::ThreadLocalContext::new(&HOT_IDS);
    prefixed(prefix, uuid::Uuid::new_v7(uuid::Timestamp::now(&ctx)), make)
}

/// `<prefix>_<the uuid in 32 lower hex digits>`, handed to `make`: written
/// on the stack when it fits in the id alphabet's 128 characters (every
/// prefix here is a short word), else in a `String`.
fn prefixed<R>(prefix: &str, uuid: uuid::Uuid, make: impl FnOnce(&str) -> R) -> R {
    let mut buf = uuid::Uuid::encode_buffer();
    let hex = uuid.simple().encode_lower(&mut buf);
    let mut id = arrayvec::ArrayString::<128>::new();
    let fits = id.try_push_str(prefix).and_then(|()| id.try_push_str("_")).and_then(|()| id.try_push_str(hex));
    match fits {
        Ok(()) => make(&id),
        Err(_) => make(&format!("{prefix}_{hex}")),
    }
}

/// A new quota id. Invariant: [`new_id`] gives `<prefix>_<32 hex digits>`,
/// always inside the id alphabet, so parsing cannot fail.
pub fn new_quota_id() -> QuotaId {
    QuotaId::parse(new_id("quota")).expect("a new id is in the id alphabet")
}

/// A new audit-entry id, time-ordered (same invariant as [`new_quota_id`]).
pub fn new_audit_id() -> AuditId {
    AuditId::parse(new_id("aud")).expect("a new id is in the id alphabet")
}

/// A new project id (same invariant as [`new_quota_id`]).
pub fn new_project_id() -> ProjectId {
    ProjectId::parse(new_id("proj")).expect("a new id is in the id alphabet")
}

/// A new API key id (same invariant as [`new_quota_id`]).
pub fn new_api_key_id() -> ApiKeyId {
    ApiKeyId::parse(new_id("key")).expect("a new id is in the id alphabet")
}

/// A new role id (same invariant as [`new_quota_id`]).
pub fn new_role_id() -> RoleId {
    RoleId::parse(new_id("role")).expect("a new id is in the id alphabet")
}

/// A new webhook endpoint id (same invariant as [`new_quota_id`]).
pub fn new_webhook_id() -> meter::WebhookId {
    meter::WebhookId::parse(new_id("wh")).expect("a new id is in the id alphabet")
}

/// A new notification message id (same invariant as [`new_quota_id`]).
pub fn new_message_id() -> meter::MessageId {
    meter::MessageId::parse(new_id("msg")).expect("a new id is in the id alphabet")
}

/// A new reservation id (same invariant as [`new_quota_id`]).
pub fn new_reservation_id() -> ReservationId {
    hot_id("res", |s| ReservationId::parse(s)).expect("a new id is in the id alphabet")
}

/// A new permit id (same invariant as [`new_quota_id`]).
pub fn new_permit_id() -> PermitId {
    hot_id("pmt", |s| PermitId::parse(s)).expect("a new id is in the id alphabet")
}

/// A new event id with a type prefix (`req`, `evt`); same invariant as
/// [`new_quota_id`] for a prefix in the id alphabet, as every caller's is.
pub fn new_event_id(prefix: &'static str) -> EventId {
    hot_id(prefix, |s| EventId::parse(s)).expect("a new id is in the id alphabet")
}

/// Compares two secrets in time independent of where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc::now()
    }
}

#[cfg(all(test, feature = "embedded"))]
mod tests {
    use meter::{Metric, Principal, UsageFact, WindowKind};
    use store::{MemoryView, SqliteLog, SqliteStore};

    use super::*;
    use crate::error::ApiError;
    use crate::service::admission::{self, CheckRequest, KeyRef, Who};
    use crate::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
    use crate::service::{Error, recording};

    fn check_of(secret: &str) -> CheckRequest {
        CheckRequest {
            who: Who::Key(KeyRef::Secret(secret.to_owned())),
            project: None,
            agent: None,
            actor: None,
            storage_delta: None,
            permit: false,
            explain: false,
            estimate: admission::EstimateAsk::None,
        }
    }

    fn status(e: Error) -> u16 {
        ApiError::from(e).status.as_u16()
    }

    #[test]
    fn a_secret_is_stored_as_its_sha256_in_lower_hex() {
        for secret in ["", "tg_live_abc", &"x".repeat(300)] {
            assert_eq!(hash_secret(secret), hex::encode(Sha256::digest(secret.as_bytes())));
        }
        assert_eq!(hash_secret("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn hot_ids_are_well_formed_distinct_and_ordered_within_a_thread() {
        let mut threads = Vec::new();
        for _ in 0..4 {
            threads.push(std::thread::spawn(|| {
                let ids: Vec<String> = (0..5_000).map(|_| new_hot_id("res")).collect();
                for w in ids.windows(2) {
                    assert!(w[0] < w[1], "{} then {}", w[0], w[1]);
                }
                ids
            }));
        }
        let mut all = std::collections::HashSet::new();
        for t in threads {
            for id in t.join().expect("thread") {
                assert!(ReservationId::parse(id.clone()).is_ok(), "{id}");
                assert!(id.starts_with("res_") && id.len() == 4 + 32, "{id}");
                assert!(all.insert(id), "an id made twice");
            }
        }
        // The time part is now's: the first 12 hex digits are the millisecond.
        let id = new_hot_id("evt");
        let ms = i64::from_str_radix(&id[4..16], 16).expect("hex");
        assert!((ms - chrono::Utc::now().timestamp_millis()).abs() < 60_000, "{id}");
    }

    async fn state_with_ttl(ttl: Duration) -> AppState {
        let dir = std::env::temp_dir().join(format!("tollgate-cache-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        let mut settings = Settings::new("adm", "gw");
        settings.config_ttl = ttl;
        AppState::new(Arc::new(store), Arc::new(MemoryView::new()), Arc::new(log), Arc::new(SystemClock), settings)
    }

    /// Lookups of one key that miss together, `n` of them at once, each
    /// with a load that takes 50 ms: how many loads reached the store.
    async fn loads_of_a_burst(s: &AppState, n: usize) -> usize {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let map = Cached::<u32>::default();
        let loads = AtomicUsize::new(0);
        let lookups = (0..n).map(|_| {
            s.cached(&map, "k", async {
                loads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(7)
            })
        });
        for v in futures::future::join_all(lookups).await {
            assert_eq!(v.expect("loaded"), 7);
        }
        assert!(map.loads.lock().unwrap_or_else(|e| e.into_inner()).is_empty(), "no load lock is left behind");
        loads.load(Ordering::SeqCst)
    }

    /// A cold gateway under a burst asks the store once per key while
    /// entries are cached; with a TTL of zero every lookup reads the store.
    #[tokio::test]
    async fn concurrent_misses_of_one_key_share_one_load() {
        assert_eq!(loads_of_a_burst(&state_with_ttl(Duration::from_secs(1)).await, 16).await, 1);
        assert_eq!(loads_of_a_burst(&state_with_ttl(Duration::ZERO).await, 16).await, 16);
    }

    /// PostgreSQL's outage, played by closing the store's pool: checks and
    /// settles of a key loaded before go on from the cache, a key never
    /// seen is 503 (not 401), a key seen unknown stays 401, nothing older
    /// than `config_max_stale` is served, and a store that is back is read
    /// again.
    #[tokio::test]
    async fn the_cache_serves_the_last_configuration_while_the_store_is_down() {
        let dir = std::env::temp_dir().join(format!("tollgate-cache-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        // The log in a file of its own: only the store goes down.
        let log_file = SqliteStore::open(&dir.join("log.db")).await.expect("open the log file");
        let log = SqliteLog::new(log_file.pool().clone(), "tollgate.");
        log.ensure_schema().await.expect("log schema");
        let mut settings = Settings::new("adm", "gw");
        settings.config_ttl = Duration::ZERO;
        settings.config_max_stale = Duration::from_secs(3);
        let mut s = AppState::new(
            Arc::new(store.clone()),
            Arc::new(MemoryView::new()),
            Arc::new(log),
            Arc::new(SystemClock),
            settings,
        );
        let starter = Starter {
            project: NewProject { name: "p".into(), timezone: chrono_tz::Tz::UTC },
            key: NewApiKey { name: "k".into(), ..NewApiKey::default() },
            quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: 5 }),
        };
        let made = provisioning::provision(&s, starter, &Principal::new("admin", "test")).await.expect("provision");
        let loaded = Instant::now();
        admission::check(&s, check_of(&made.secret)).await.expect("a check while the store is up");
        let e = admission::check(&s, check_of("tg_seen_unknown")).await.expect_err("unknown");
        assert_eq!(status(e), 401);

        store.pool().close().await;
        let admitted = admission::check(&s, check_of(&made.secret)).await.expect("a check from the cache");
        let admission::Checked::Admitted { reservation, .. } = admitted else { panic!("not exempt") };
        let fact = UsageFact {
            api_key_id: Some(made.key.id.clone()),
            reservation_id: Some(reservation),
            rows: 3,
            ..UsageFact::new(
                EventId::parse("call-1").expect("id"),
                made.project.id.clone(),
                meter::EventKind::Call,
                chrono::Utc::now(),
            )
        };
        let accepted = recording::accept(&s, vec![fact]).await.expect("a settle from the cache");
        assert_eq!(accepted.accepted, 1);
        let e = admission::check(&s, check_of("tg_never_seen")).await.expect_err("cannot know");
        assert_eq!(status(e), 503, "a key never seen cannot be told unknown while the store is down");
        let e = admission::check(&s, check_of("tg_seen_unknown")).await.expect_err("still unknown");
        assert_eq!(status(e), 401, "a key seen unknown before the outage is still unknown");
        assert!(s.store_down());

        tokio::time::sleep(Duration::from_secs(3).saturating_sub(loaded.elapsed()) + Duration::from_millis(200)).await;
        let e = admission::check(&s, check_of(&made.secret)).await.expect_err("too stale");
        assert_eq!(status(e), 503, "configuration older than config_max_stale is not served");

        // The store is back (a new pool on the same file).
        let again = SqliteStore::open(&dir.join("t.db")).await.expect("reopen");
        s.stores = Stores::of(Arc::new(again));
        tokio::time::sleep(STORE_RETRY).await;
        admission::check(&s, check_of(&made.secret)).await.expect("read from the store again");
        assert!(!s.store_down());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
