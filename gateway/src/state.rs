//! Shared state: the ports, the clock, settings, and a short-lived cache of
//! configuration (projects, quotas, keys) so the hot path does not read
//! PostgreSQL on every check.
//!
//! The durable store is held as the focused ports it implements
//! ([`Stores`]), so each service reaches only for the one it uses; the view
//! is a [`SeedingView`], so no reader of it has to know the seed-and-retry
//! protocol.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meter::{
    ApiKey, ApiKeyId, AuditId, AuditStore, Clock, EventId, Ledger, Log, PortResult, PriceBook, PriceStore, Project,
    ProjectId, Quota, QuotaId, QuotaStore, ReportStore, ReservationId, Role, RoleId, Store, TenantStore, View,
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
    pub horizon: chrono::Duration,
    pub view_down: ViewDownPolicy,
    /// This instance's name, written on every event it emits.
    pub instance: String,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("admin_token", &"<redacted>")
            .field("gateway_token", &"<redacted>")
            .field("lease", &self.lease)
            .field("config_ttl", &self.config_ttl)
            .field("view_down", &self.view_down)
            .field("instance", &self.instance)
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
            horizon: meter::usage::DEFAULT_DEDUP_HORIZON,
            view_down: ViewDownPolicy::Deny,
            instance: format!("gw-{}", random_token(6)),
        }
    }
}

/// A project with its quotas, as the hot path needs them.
#[derive(Debug, Clone)]
pub struct ProjectConfig {
    pub project: Project,
    pub quotas: Arc<Vec<Quota>>,
    /// The counters its checks can read: where facts are settled.
    pub watched: Arc<meter::Watched>,
}

type Cached<T> = Mutex<HashMap<String, (Instant, T)>>;

/// Configuration cached for `config_ttl`.
#[derive(Default)]
pub struct ConfigCache {
    projects: Cached<Option<ProjectConfig>>,
    keys: Cached<Option<ApiKey>>,
    prices: Cached<Arc<PriceBook>>,
    roles: Cached<Option<Role>>,
}

fn get<T: Clone>(m: &Cached<T>, k: &str, ttl: Duration) -> Option<T> {
    let g = m.lock().unwrap_or_else(|e| e.into_inner());
    g.get(k).filter(|(at, _)| at.elapsed() < ttl).map(|(_, v)| v.clone())
}

fn put<T>(m: &Cached<T>, k: String, v: T) {
    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
    if g.len() > 100_000 {
        g.clear();
    }
    g.insert(k, (Instant::now(), v));
}

/// The monitor breaches this instance has already written (or is writing),
/// by quota and window key, so a quota that stays over its limit does not
/// reach the store on every check. Only a shortcut: the store's unique key
/// is what makes the entry once per window across instances.
#[derive(Default)]
pub struct BreachMemo {
    seen: Mutex<HashSet<(QuotaId, String)>>,
}

impl BreachMemo {
    /// Most remembered breaches; past it the memo starts afresh (old window
    /// keys never come back, and a forgotten one costs one store round trip).
    const MAX: usize = 10_000;

    /// True the first time a (quota, window key) is seen.
    pub fn first_sighting(&self, quota: &QuotaId, window_key: &str) -> bool {
        let mut g = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let k = (quota.clone(), window_key.to_owned());
        if g.contains(&k) {
            return false;
        }
        if g.len() >= Self::MAX {
            g.clear();
        }
        g.insert(k)
    }

    /// Forgets a sighting whose entry could not be written, so a later check retries.
    pub fn forget(&self, quota: &QuotaId, window_key: &str) {
        let mut g = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        g.remove(&(quota.clone(), window_key.to_owned()));
    }
}

/// The durable store as the six focused ports it implements. Built from one
/// [`Store`] (PostgreSQL, or the embedded SQLite file); cheap to clone.
#[derive(Clone)]
pub struct Stores {
    pub tenants: Arc<dyn TenantStore>,
    pub quotas: Arc<dyn QuotaStore>,
    pub audit: Arc<dyn AuditStore>,
    pub prices: Arc<dyn PriceStore>,
    pub ledger: Arc<dyn Ledger>,
    pub reports: Arc<dyn ReportStore>,
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
            reports: store,
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
    pub breaches: Arc<BreachMemo>,
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
            view: Arc::new(SeedingView::new(view, stores.ledger.clone())),
            stores,
            log,
            clock,
            settings: Arc::new(settings),
            cache: Arc::default(),
            breaches: Arc::default(),
        }
    }

    /// A project and its quotas (cached).
    pub async fn project_config(&self, id: &ProjectId) -> PortResult<Option<ProjectConfig>> {
        if let Some(c) = get(&self.cache.projects, id.as_str(), self.settings.config_ttl) {
            return Ok(c);
        }
        let cfg = match self.stores.tenants.project(id).await? {
            None => None,
            Some(project) => {
                let quotas = self.stores.quotas.quotas(id).await?;
                let watched = Arc::new(meter::Watched::of(&quotas));
                Some(ProjectConfig { project, quotas: Arc::new(quotas), watched })
            }
        };
        put(&self.cache.projects, id.as_str().to_owned(), cfg.clone());
        Ok(cfg)
    }

    /// The price book (cached). The gateway prices tokens events with it to
    /// settle their cost into the view; the projector prices them again,
    /// durably, from the store's book.
    pub async fn price_book(&self) -> PortResult<Arc<PriceBook>> {
        if let Some(b) = get(&self.cache.prices, "", self.settings.config_ttl) {
            return Ok(b);
        }
        let book = Arc::new(PriceBook::new(self.stores.prices.prices().await?));
        put(&self.cache.prices, String::new(), book.clone());
        Ok(book)
    }

    /// A role by its id (cached).
    pub async fn role_by_id(&self, id: &RoleId) -> PortResult<Option<Role>> {
        if let Some(r) = get(&self.cache.roles, id.as_str(), self.settings.config_ttl) {
            return Ok(r);
        }
        let r = self.stores.tenants.role(id).await?;
        put(&self.cache.roles, id.as_str().to_owned(), r.clone());
        Ok(r)
    }

    /// Forgets the cached price book after a change.
    pub fn invalidate_prices(&self) {
        let mut g = self.cache.prices.lock().unwrap_or_else(|e| e.into_inner());
        g.clear();
    }

    /// Forgets a project's cached configuration after an admin change.
    pub fn invalidate_project(&self, id: &ProjectId) {
        let mut g = self.cache.projects.lock().unwrap_or_else(|e| e.into_inner());
        g.remove(id.as_str());
    }

    /// Forgets a key's cached lookups after it was deleted.
    pub fn invalidate_key(&self, id: &ApiKeyId) {
        let mut g = self.cache.keys.lock().unwrap_or_else(|e| e.into_inner());
        g.retain(|k, (_, v)| k != &format!("id:{id}") && v.as_ref().is_none_or(|key| &key.id != id));
    }

    /// An API key by its secret (cached by the secret's hash).
    pub async fn key_by_secret(&self, secret: &str) -> PortResult<Option<ApiKey>> {
        let hash = hash_secret(secret);
        if let Some(k) = get(&self.cache.keys, &hash, self.settings.config_ttl) {
            return Ok(k);
        }
        let k = self.stores.tenants.api_key_by_secret_hash(&hash).await?;
        put(&self.cache.keys, hash, k.clone());
        Ok(k)
    }

    /// An API key by its id (cached).
    pub async fn key_by_id(&self, id: &ApiKeyId) -> PortResult<Option<ApiKey>> {
        let k = format!("id:{id}");
        if let Some(v) = get(&self.cache.keys, &k, self.settings.config_ttl) {
            return Ok(v);
        }
        let v = self.stores.tenants.api_key(id).await?;
        put(&self.cache.keys, k, v.clone());
        Ok(v)
    }
}

/// The stored form of a secret: its SHA-256, hex. Secrets are random and
/// long, so a fast hash is enough (no dictionary to attack).
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// A random token of letters and digits.
pub fn random_token(len: usize) -> String {
    rand::rng().sample_iter(&Alphanumeric).take(len).map(char::from).collect()
}

/// A new public id with a type prefix, time-ordered.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::now_v7().simple())
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

/// A new reservation id (same invariant as [`new_quota_id`]).
pub fn new_reservation_id() -> ReservationId {
    ReservationId::parse(new_id("res")).expect("a new id is in the id alphabet")
}

/// A new event id with a type prefix (`req`, `evt`); same invariant as
/// [`new_quota_id`] for a prefix in the id alphabet, as every caller's is.
pub fn new_event_id(prefix: &'static str) -> EventId {
    EventId::parse(new_id(prefix)).expect("a new id is in the id alphabet")
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
