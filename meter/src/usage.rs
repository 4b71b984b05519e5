//! Usage facts and the counters they land in.
//!
//! A usage fact is the domain form of one event on the log. Where it counts
//! is decided here, once, for the projector's fold, the gateway's settle and
//! the check alike: the same fact always maps to the same counters, which is
//! what lets the view drop a pending delta exactly when its event is folded.

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::error::{FieldError, named};
use crate::ids::{ApiKeyId, EventId, ProjectId, QuotaId, ReservationId};
use crate::price::{MeterType, PriceBook, Priced, TokenUsage, check_name, price_tokens_as_of};
use crate::window::{Window, WindowKind, window_at};

/// What an event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A request reached the check (counted even when refused).
    Request,
    /// A call finished; with outcome `success` it counts one call and its rows.
    Call,
    Tokens,
    StorageDelta,
    StorageSnapshot,
    Correction,
}

impl EventKind {
    pub const ALL: [EventKind; 6] = [
        EventKind::Request,
        EventKind::Call,
        EventKind::Tokens,
        EventKind::StorageDelta,
        EventKind::StorageSnapshot,
        EventKind::Correction,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Request => "request",
            EventKind::Call => "call",
            EventKind::Tokens => "tokens",
            EventKind::StorageDelta => "storage_delta",
            EventKind::StorageSnapshot => "storage_snapshot",
            EventKind::Correction => "correction",
        }
    }
    /// Whether this release folds this kind: every kind (a `correction`
    /// since corrections are folded, see [`crate::correction`]).
    pub fn is_folded(self) -> bool {
        true
    }
}

named!(EventKind, "event type", EventKind::ALL);

/// How a call ended. Only successful calls that returned data are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    #[default]
    Success,
    Failure,
}

impl Outcome {
    pub const ALL: [Outcome; 2] = [Outcome::Success, Outcome::Failure];
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "failure",
        }
    }
}

named!(Outcome, "outcome", Outcome::ALL);

/// One usage fact, as it is on the log.
///
/// Its JSON (what the dedup set keeps of a folded call or tokens event, see
/// [`crate::correction::Counted`]) leaves out every part that is empty
/// (`None`, `[]`, `false`, a zero estimate, no gateway) and reads it back as
/// empty, so rows written with every part spelled out read the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageFact {
    pub id: EventId,
    pub project_id: ProjectId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_id: Option<ApiKeyId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor_id: Option<String>,
    /// A signed-in user, as the gateway names it (`user:<subject>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    pub occurred_at: DateTime<Utc>,
    pub kind: EventKind,
    pub outcome: Outcome,
    pub rows: u64,
    /// Token components by provider and model (tokens events).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenUsage>,
    /// Bytes added (> 0) or removed (< 0) by a write (storage_delta), or
    /// held (storage_snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_bytes: Option<i64>,
    /// The meter a tokens event feeds; `None` is the AI meter (`llm_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meter_type: Option<MeterType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<ReservationId>,
    /// The gateway instance that emitted it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gateway: String,
    /// When the gateway accepted it: the clock its lateness is judged by
    /// (`None` on events written before schema v3; readers then use the
    /// log's own timestamp of the record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received_at: Option<DateTime<Utc>>,
    /// On a request event: whether its check admitted the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted: Option<bool>,
    /// On an admitted request event: when its reservation lapses unsettled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<DateTime<Utc>>,
    /// On an admitted request event: the counters its reservation holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<Counter>,
    /// On an admitted request event: what its reservation holds on each of
    /// those counters besides one call (zero: nothing estimated).
    #[serde(default, skip_serializing_if = "crate::admission::Estimate::is_zero")]
    pub estimate: crate::admission::Estimate,
    /// On a request event: the quotas its check found over their limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub breaches: Vec<LoggedBreach>,
    /// On a correction: the event it amends or voids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corrects: Option<EventId>,
    /// On a correction: void the corrected event (else amend it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub void: bool,
}

/// A quota a check found over its limit, as the check's request event
/// records it (so a breach seen only on the hot path is on the log).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedBreach {
    pub quota_id: QuotaId,
    pub window_key: String,
    /// The limit at the check, in the metric's unit.
    pub limit: u64,
    /// What the check compared: usage plus what the call needed.
    pub observed: u64,
    /// An enforce quota (the check was refused) or a monitor one.
    pub enforce: bool,
}

impl UsageFact {
    /// A fact of `kind` with every optional part empty.
    pub fn new(id: EventId, project_id: ProjectId, kind: EventKind, occurred_at: DateTime<Utc>) -> UsageFact {
        UsageFact {
            id,
            project_id,
            api_key_id: None,
            agent_id: None,
            actor_id: None,
            user_id: None,
            occurred_at,
            kind,
            outcome: Outcome::Success,
            rows: 0,
            tokens: Vec::new(),
            storage_bytes: None,
            meter_type: None,
            reservation_id: None,
            gateway: String::new(),
            received_at: None,
            admitted: None,
            lease_until: None,
            held: Vec::new(),
            estimate: crate::admission::Estimate::default(),
            breaches: Vec::new(),
            corrects: None,
            void: false,
        }
    }

    /// The meter a tokens event feeds.
    pub fn meter(&self) -> MeterType {
        self.meter_type.unwrap_or(MeterType::LlmTokens)
    }

    /// When the fact was received: the instant its lateness is judged by
    /// and the price book is read as of. It is `received_at`, which the
    /// projector fills from the log's own timestamp of the record when the
    /// gateway did not stamp it; a fact with neither (a record of an old
    /// embedded log, a fact built by hand) counts as received when it
    /// occurred, so it is never late and is priced by the book as it stood
    /// then. Every one of these is in the record itself, so a replay judges
    /// and prices each fact exactly as the live fold did.
    pub fn receipt(&self) -> DateTime<Utc> {
        self.received_at.unwrap_or(self.occurred_at)
    }
}

/// How far back an event may be and still be counted (and deduplicated).
pub const DEFAULT_DEDUP_HORIZON: Duration = Duration::days(35);
/// How far ahead of the clock an event may claim to be.
pub const MAX_FUTURE_SKEW: Duration = Duration::minutes(5);

/// Why a fact cannot be counted, as a DLQ reason or an API error: its event
/// time more than [`MAX_FUTURE_SKEW`] after `at`, or more than `horizon`
/// before it. `at` is the fact's receipt ([`UsageFact::receipt`]) in the
/// fold, the gateway's clock at ingest: never the projector's clock, so a
/// lagging projector or a replay judges every record as the live fold did.
pub fn check_fact_time(occurred_at: DateTime<Utc>, at: DateTime<Utc>, horizon: Duration) -> Result<(), FieldError> {
    if occurred_at > at + MAX_FUTURE_SKEW {
        return Err(FieldError::new("occurred_at", "is more than 5 minutes in the future"));
    }
    if occurred_at < at - horizon {
        return Err(FieldError::new(
            "occurred_at",
            format!("is older than the dedup horizon of {} days", horizon.num_days()),
        ));
    }
    Ok(())
}

/// Most token entries one event may carry.
pub const MAX_TOKEN_ENTRIES: usize = 64;

/// The largest quantity an event may carry (2^53), in any field and in any
/// sum over its entries: the view compares in Lua doubles, which are exact up
/// to it, and a counter summing such events has room for 1,024 of them before
/// `i64` saturates.
pub const MAX_QUANTITY: u64 = 1 << 53;

fn bounded(field: impl Into<String>, v: u64) -> Result<(), FieldError> {
    if v > MAX_QUANTITY {
        return Err(FieldError::new(field, format!("is more than 2^53 ({MAX_QUANTITY})")));
    }
    Ok(())
}

/// The earliest instant a fact may carry (1 January of the year 1, UTC).
pub const MIN_INSTANT: &str = "0001-01-01T00:00:00Z";
/// The latest instant a fact may carry (the end of the year 9999, UTC): what
/// every store can keep and order (the embedded one writes four-digit years).
pub const MAX_INSTANT: &str = "9999-12-31T23:59:59.999999Z";

fn check_instant(field: &str, at: DateTime<Utc>) -> Result<(), FieldError> {
    use chrono::Datelike;
    if !(1..=9999).contains(&at.year()) {
        return Err(FieldError::new(field, format!("must be between {MIN_INSTANT} and {MAX_INSTANT}")));
    }
    Ok(())
}

/// The rules of a list of token counts (a tokens event's, a check's
/// estimate by model), named `field`: at most [`MAX_TOKEN_ENTRIES`]
/// entries, named providers and models, every count and every sum over the
/// entries at most [`MAX_QUANTITY`].
pub fn check_token_usage(field: &str, list: &[TokenUsage]) -> Result<(), FieldError> {
    if list.len() > MAX_TOKEN_ENTRIES {
        return Err(FieldError::new(field, format!("at most {MAX_TOKEN_ENTRIES} entries")));
    }
    let mut sums = [0u64; 4];
    for (i, t) in list.iter().enumerate() {
        check_name(&format!("{field}[{i}].provider"), &t.provider)?;
        check_name(&format!("{field}[{i}].model"), &t.model)?;
        for (j, (name, v)) in
            [("input", t.input), ("output", t.output), ("cached", t.cached), ("reasoning", t.reasoning)]
                .into_iter()
                .enumerate()
        {
            bounded(format!("{field}[{i}].{name}"), v)?;
            // Each term is at most 2^53 and there are at most 64: no overflow.
            sums[j] += v;
        }
    }
    for (name, sum) in ["input", "output", "cached", "reasoning"].iter().zip(sums) {
        if sum > MAX_QUANTITY {
            return Err(FieldError::new(field, format!("the {name} tokens of its entries sum past 2^53")));
        }
    }
    if sums[0] + sums[1] + sums[2] > MAX_QUANTITY {
        return Err(FieldError::new(field, "its billable tokens (input + output + cached) sum past 2^53"));
    }
    Ok(())
}

/// Checks what the fold needs of a fact beyond its types.
pub fn check_fact(fact: &UsageFact) -> Result<(), FieldError> {
    if !fact.kind.is_folded() {
        return Err(FieldError::new("type", format!("{} events are not metered by this release", fact.kind)));
    }
    check_instant("occurred_at", fact.occurred_at)?;
    if let Some(t) = fact.received_at {
        check_instant("received_at", t)?;
    }
    if let Some(t) = fact.lease_until {
        check_instant("lease_until", t)?;
    }
    let k = fact.kind;
    if k == EventKind::Correction {
        crate::correction::check_correction_fact(fact)?;
    }
    if !matches!(k, EventKind::Call | EventKind::Correction) && fact.rows != 0 {
        return Err(FieldError::new("rows", format!("a {k} event carries no rows")));
    }
    bounded("rows", fact.rows)?;
    if k == EventKind::Tokens || (k == EventKind::Correction && !fact.tokens.is_empty()) {
        if fact.tokens.is_empty() {
            return Err(FieldError::new("tokens", "a tokens event needs at least one entry"));
        }
        check_token_usage("tokens", &fact.tokens)?;
    } else {
        if !fact.tokens.is_empty() {
            return Err(FieldError::new("tokens", format!("a {k} event carries no tokens")));
        }
        if fact.meter_type.is_some() {
            return Err(FieldError::new("meter_type", "is only allowed on tokens events"));
        }
    }
    if let Some(b) = fact.storage_bytes {
        bounded("storage_bytes", b.unsigned_abs())?;
    }
    if k != EventKind::Request {
        let request_only = [
            ("admitted", fact.admitted.is_some()),
            ("lease_until", fact.lease_until.is_some()),
            ("held", !fact.held.is_empty()),
            ("estimate", !fact.estimate.is_zero()),
            ("breaches", !fact.breaches.is_empty()),
        ];
        if let Some((name, _)) = request_only.iter().find(|(_, set)| *set) {
            return Err(FieldError::new(*name, format!("is only carried by request events, not {k}")));
        }
    } else if fact.admitted != Some(true)
        && (fact.lease_until.is_some() || !fact.held.is_empty() || !fact.estimate.is_zero())
    {
        return Err(FieldError::new("held", "a refused (or unknown) check holds nothing"));
    }
    if k != EventKind::Correction && (fact.corrects.is_some() || fact.void) {
        return Err(FieldError::new("corrects", format!("only a correction corrects an event, not a {k} event")));
    }
    match (k, fact.storage_bytes) {
        (EventKind::StorageDelta, None) | (EventKind::StorageSnapshot, None) => {
            return Err(FieldError::new("storage_bytes", format!("a {k} event needs storage_bytes")));
        }
        (EventKind::StorageSnapshot, Some(b)) if b < 0 => {
            return Err(FieldError::new("storage_bytes", "a snapshot cannot be negative"));
        }
        (EventKind::StorageDelta, Some(_)) | (EventKind::StorageSnapshot, Some(_)) | (_, None) => {}
        (_, Some(_)) => {
            return Err(FieldError::new("storage_bytes", format!("a {k} event carries no storage_bytes")));
        }
    }
    if let Some(u) = &fact.user_id {
        check_user(u).map_err(|m| FieldError::new("user", m))?;
    }
    Ok(())
}

/// A signed-in user is named `user:<subject>`, the subject in the id alphabet.
pub fn check_user(u: &str) -> Result<(), String> {
    match u.strip_prefix("user:") {
        Some(subject) if !subject.is_empty() && crate::ids::check_id(u).is_ok() => Ok(()),
        _ => Err(format!("must be user:<subject> (letters, digits, '_', '-', '.', ':'); got {u:?}")),
    }
}

/// The population a counter counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Dimension {
    /// The whole project.
    Project,
    /// All key-authenticated traffic of the project (`api_key`, null ref).
    AllApiKeys,
    /// One API key.
    ApiKey(ApiKeyId),
    /// One agent.
    Agent(String),
    /// One end user.
    Actor(String),
    /// One signed-in user (`user:<subject>`), counted against its role's quota.
    User(String),
}

impl Dimension {
    /// A stable, compact string for storage keys: `p`, `k*`, `k:<id>`,
    /// `g:<agent>`, `a:<actor>`, `u:<user>`.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// [`Dimension::encode`], appended to `out`.
    fn encode_into(&self, out: &mut String) {
        let (tag, rest) = self.parts();
        out.push_str(tag);
        out.push_str(rest);
    }

    /// The encoding's length in bytes.
    fn encoded_len(&self) -> usize {
        let (tag, rest) = self.parts();
        tag.len() + rest.len()
    }

    /// The encoding as its tag and the rest.
    fn parts(&self) -> (&'static str, &str) {
        match self {
            Dimension::Project => ("p", ""),
            Dimension::AllApiKeys => ("k*", ""),
            Dimension::ApiKey(k) => ("k:", k.as_str()),
            Dimension::Agent(g) => ("g:", g),
            Dimension::Actor(a) => ("a:", a),
            Dimension::User(u) => ("u:", u),
        }
    }

    pub fn decode(s: &str) -> Option<Dimension> {
        match s {
            "p" => Some(Dimension::Project),
            "k*" => Some(Dimension::AllApiKeys),
            _ => {
                let (tag, rest) = s.split_once(':')?;
                match tag {
                    "k" => ApiKeyId::parse(rest).ok().map(Dimension::ApiKey),
                    "g" => Some(Dimension::Agent(rest.to_owned())),
                    "a" => Some(Dimension::Actor(rest.to_owned())),
                    "u" => Some(Dimension::User(rest.to_owned())),
                    _ => None,
                }
            }
        }
    }
}

/// One counter: a dimension in one window.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CounterKey {
    pub dimension: Dimension,
    pub window: WindowKind,
    pub window_key: String,
}

impl CounterKey {
    /// `<dimension>|<window>|<window_key>`: the counter's name in the view.
    pub fn encode(&self) -> String {
        let window = self.window.as_str();
        let mut out = String::with_capacity(self.dimension.encoded_len() + window.len() + self.window_key.len() + 2);
        self.dimension.encode_into(&mut out);
        out.push('|');
        out.push_str(window);
        out.push('|');
        out.push_str(&self.window_key);
        out
    }

    pub fn decode(s: &str) -> Option<CounterKey> {
        let mut it = s.splitn(3, '|');
        let dimension = Dimension::decode(it.next()?)?;
        let window = it.next()?.parse().ok()?;
        let window_key = it.next()?.to_owned();
        Some(CounterKey { dimension, window, window_key })
    }

    /// The project's storage footprint: its only `current` counter.
    pub fn footprint() -> CounterKey {
        CounterKey { dimension: Dimension::Project, window: WindowKind::Current, window_key: FOOTPRINT_KEY.to_owned() }
    }
}

/// The window key of the `current` window.
pub const FOOTPRINT_KEY: &str = "current";

/// A counter plus when it stops mattering (its window's reset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    pub key: CounterKey,
    pub resets_at: Option<DateTime<Utc>>,
}

/// Amounts a fact adds to a counter, or a counter's totals.
///
/// Every field but `storage` is a sum. `storage` is the footprint on the
/// `current` counter: as a fact's contribution it is a delta, as a durable
/// total it is the last snapshot plus the deltas after it, and
/// `storage_events` (how many storage facts it reflects, which only grows)
/// orders two durable footprints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Totals {
    pub requests: u64,
    pub calls: u64,
    pub rows: u64,
    /// Billable tokens on the AI meter.
    pub tokens: u64,
    /// Priced cost by meter, in picodollars (see [`crate::price::Usd`]).
    pub cost_llm_tokens: u64,
    pub cost_compute_execution: u64,
    pub cost_api_request: u64,
    pub cost_storage: u64,
    /// Metered LLM events, and those with a priced / an unpriced component.
    pub llm_events: u64,
    pub llm_priced: u64,
    pub llm_unpriced: u64,
    pub storage_events: u64,
    pub storage: i64,
}

/// A numeric field of [`Totals`]: what the view stores and a limit reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Field {
    Requests,
    Calls,
    Rows,
    Tokens,
    CostLlmTokens,
    CostComputeExecution,
    CostApiRequest,
    CostStorage,
    LlmEvents,
    LlmPriced,
    LlmUnpriced,
    StorageEvents,
    Storage,
}

impl Field {
    pub const ALL: [Field; 13] = [
        Field::Requests,
        Field::Calls,
        Field::Rows,
        Field::Tokens,
        Field::CostLlmTokens,
        Field::CostComputeExecution,
        Field::CostApiRequest,
        Field::CostStorage,
        Field::LlmEvents,
        Field::LlmPriced,
        Field::LlmUnpriced,
        Field::StorageEvents,
        Field::Storage,
    ];
    /// The short name the view stores it under (`t_<name>`, `p_<name>`).
    pub fn as_str(self) -> &'static str {
        match self {
            Field::Requests => "req",
            Field::Calls => "calls",
            Field::Rows => "rows",
            Field::Tokens => "tok",
            Field::CostLlmTokens => "c_llm",
            Field::CostComputeExecution => "c_cpu",
            Field::CostApiRequest => "c_api",
            Field::CostStorage => "c_sto",
            Field::LlmEvents => "llm",
            Field::LlmPriced => "llm_p",
            Field::LlmUnpriced => "llm_u",
            Field::StorageEvents => "sto_n",
            Field::Storage => "sto",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
    /// The cost field of a meter.
    pub fn cost_of(meter: MeterType) -> Field {
        match meter {
            MeterType::LlmTokens => Field::CostLlmTokens,
            MeterType::ComputeExecution => Field::CostComputeExecution,
            MeterType::ApiRequest => Field::CostApiRequest,
            MeterType::Storage => Field::CostStorage,
        }
    }
    pub const COSTS: [Field; 4] =
        [Field::CostLlmTokens, Field::CostComputeExecution, Field::CostApiRequest, Field::CostStorage];
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Totals {
    pub fn is_zero(&self) -> bool {
        *self == Totals::default()
    }

    pub fn get(&self, f: Field) -> i64 {
        match f {
            Field::Requests => clamp(self.requests),
            Field::Calls => clamp(self.calls),
            Field::Rows => clamp(self.rows),
            Field::Tokens => clamp(self.tokens),
            Field::CostLlmTokens => clamp(self.cost_llm_tokens),
            Field::CostComputeExecution => clamp(self.cost_compute_execution),
            Field::CostApiRequest => clamp(self.cost_api_request),
            Field::CostStorage => clamp(self.cost_storage),
            Field::LlmEvents => clamp(self.llm_events),
            Field::LlmPriced => clamp(self.llm_priced),
            Field::LlmUnpriced => clamp(self.llm_unpriced),
            Field::StorageEvents => clamp(self.storage_events),
            Field::Storage => self.storage,
        }
    }

    /// Sets a field; a negative value of a sum field reads as 0.
    pub fn set(&mut self, f: Field, v: i64) {
        let u = u64::try_from(v).unwrap_or(0);
        match f {
            Field::Requests => self.requests = u,
            Field::Calls => self.calls = u,
            Field::Rows => self.rows = u,
            Field::Tokens => self.tokens = u,
            Field::CostLlmTokens => self.cost_llm_tokens = u,
            Field::CostComputeExecution => self.cost_compute_execution = u,
            Field::CostApiRequest => self.cost_api_request = u,
            Field::CostStorage => self.cost_storage = u,
            Field::LlmEvents => self.llm_events = u,
            Field::LlmPriced => self.llm_priced = u,
            Field::LlmUnpriced => self.llm_unpriced = u,
            Field::StorageEvents => self.storage_events = u,
            Field::Storage => self.storage = v,
        }
    }

    /// Every field, in [`Field::ALL`] order.
    pub fn values(&self) -> [i64; 13] {
        Field::ALL.map(|f| self.get(f))
    }

    pub fn from_values(v: &[i64]) -> Totals {
        let mut t = Totals::default();
        for (f, x) in Field::ALL.iter().zip(v) {
            t.set(*f, *x);
        }
        t
    }

    /// Adds every field (saturating), `storage` included, as deltas.
    pub fn add(&mut self, other: Totals) {
        for f in Field::ALL {
            self.set(f, self.get(f).saturating_add(other.get(f)));
        }
    }

    /// Priced cost: of one meter, or (`None`) of every meter.
    pub fn cost(&self, meter: Option<MeterType>) -> u64 {
        match meter {
            Some(m) => u64::try_from(self.get(Field::cost_of(m))).unwrap_or(0),
            None => {
                Field::COSTS.iter().map(|f| u64::try_from(self.get(*f)).unwrap_or(0)).fold(0u64, u64::saturating_add)
            }
        }
    }
}

/// What one fact adds, wherever it is counted, priced against `book`.
pub fn delta_of(fact: &UsageFact, book: &PriceBook) -> Totals {
    match (fact.kind, fact.outcome) {
        // A signed-in user's check (no key) is on the log for its
        // reservation, and counts no request: requests are key traffic.
        (EventKind::Request, _) if fact.api_key_id.is_none() && fact.user_id.is_some() && fact.admitted.is_some() => {
            Totals::default()
        }
        (EventKind::Request, _) => Totals { requests: 1, ..Totals::default() },
        (EventKind::Call, Outcome::Success) => Totals { calls: 1, rows: fact.rows, ..Totals::default() },
        (EventKind::Tokens, _) => {
            let p = priced(fact, book);
            let mut t = Totals {
                tokens: p.tokens,
                llm_events: u64::from(p.llm_event),
                llm_priced: u64::from(p.llm_priced),
                llm_unpriced: u64::from(p.llm_unpriced),
                ..Totals::default()
            };
            t.set(Field::cost_of(fact.meter()), p.cost.picos());
            t
        }
        (EventKind::StorageDelta, _) => {
            Totals { storage_events: 1, storage: fact.storage_bytes.unwrap_or(0), ..Totals::default() }
        }
        // A snapshot's effect is not a delta: the store recomputes the footprint.
        (EventKind::StorageSnapshot, _) => Totals { storage_events: 1, ..Totals::default() },
        _ => Totals::default(),
    }
}

/// A tokens fact broken down by (provider, model, component), priced at its
/// event time by the book as of its receipt; empty for other kinds.
pub fn component_usage(fact: &UsageFact, book: &PriceBook) -> Vec<crate::price::ComponentUsage> {
    if fact.kind != EventKind::Tokens {
        return Vec::new();
    }
    crate::price::component_usage_as_of(&fact.tokens, fact.meter(), fact.occurred_at, fact.receipt(), book)
}

/// Prices a tokens fact at its event time, by the book as of its receipt
/// ([`UsageFact::receipt`]; a book of plain rows, as the gateway holds, is
/// known since always).
pub fn priced(fact: &UsageFact, book: &PriceBook) -> Priced {
    price_tokens_as_of(&fact.tokens, fact.meter(), fact.occurred_at, fact.receipt(), book)
}

/// The dimensions a fact is attributed to: only those some quota can scope
/// its metrics by (requests: project and keys; calls and rows: project, keys,
/// actors and users; tokens and cost: project, agents and actors).
pub fn dimensions_of(fact: &UsageFact) -> Vec<Dimension> {
    let mut dims = vec![Dimension::Project];
    let keys = |dims: &mut Vec<Dimension>| {
        if let Some(k) = &fact.api_key_id {
            dims.push(Dimension::AllApiKeys);
            dims.push(Dimension::ApiKey(k.clone()));
        }
    };
    match fact.kind {
        EventKind::Request => keys(&mut dims),
        EventKind::Call => {
            keys(&mut dims);
            if let Some(a) = &fact.actor_id {
                dims.push(Dimension::Actor(a.clone()));
            }
            if let Some(u) = &fact.user_id {
                dims.push(Dimension::User(u.clone()));
            }
        }
        EventKind::Tokens => {
            if let Some(g) = &fact.agent_id {
                dims.push(Dimension::Agent(g.clone()));
            }
            if let Some(a) = &fact.actor_id {
                dims.push(Dimension::Actor(a.clone()));
            }
        }
        _ => {}
    }
    dims
}

/// Every counter a fact lands in (each flow window of each dimension; the
/// footprint for storage facts), with what it adds there. Empty when the
/// fact adds nothing.
pub fn counters_for(fact: &UsageFact, tz: Tz, book: &PriceBook) -> Vec<(Counter, Totals)> {
    counters_where(fact, tz, book, |_, _| true)
}

/// [`counters_for`], only the counters `keep` accepts by dimension and
/// window: the others are never built, and a window no kept counter needs is
/// never computed (what a settle on the hot path wants, where a check reads
/// a few of the counters a fact lands in).
pub fn counters_where(
    fact: &UsageFact,
    tz: Tz,
    book: &PriceBook,
    keep: impl Fn(&Dimension, WindowKind) -> bool,
) -> Vec<(Counter, Totals)> {
    // Four dimensions in five windows, for most facts.
    let mut out = Vec::with_capacity(4 * WindowKind::FLOW.len());
    each_counter(fact, tz, book, keep, |dimension, window, delta| {
        out.push((
            Counter {
                key: CounterKey { dimension: dimension.clone(), window: window.kind, window_key: window.key.clone() },
                resets_at: window.resets_at,
            },
            delta,
        ));
    });
    out
}

/// What [`counters_where`] builds, handed to `f` one counter at a time, by
/// its dimension and window (borrowed) and its delta, so that a caller
/// adding to counters it already holds copies no name (the fold).
pub fn each_counter(
    fact: &UsageFact,
    tz: Tz,
    book: &PriceBook,
    keep: impl Fn(&Dimension, WindowKind) -> bool,
    mut f: impl FnMut(&Dimension, &Window, Totals),
) {
    let delta = delta_of(fact, book);
    if delta.is_zero() {
        return;
    }
    if matches!(fact.kind, EventKind::StorageDelta | EventKind::StorageSnapshot) {
        let key = CounterKey::footprint();
        if keep(&key.dimension, key.window) {
            let window =
                Window { kind: key.window, key: key.window_key, start: DateTime::<Utc>::UNIX_EPOCH, resets_at: None };
            f(&key.dimension, &window, delta);
        }
        return;
    }
    let mut windows: [Option<Window>; WindowKind::FLOW.len()] = std::array::from_fn(|_| None);
    for dimension in dimensions_of(fact) {
        for (kind, window) in WindowKind::FLOW.into_iter().zip(windows.iter_mut()) {
            if !keep(&dimension, kind) {
                continue;
            }
            f(&dimension, window.get_or_insert_with(|| window_at(kind, tz, fact.occurred_at)), delta);
        }
    }
}

/// A project's storage footprint, folded from its storage facts in any
/// order: the newest snapshot (by event time, then event id) plus the deltas
/// that happened after it. A project never measured is its deltas alone.
/// The sum is exact (128 bits) and saturates to 64 only in [`Footprint::bytes`],
/// so it does not depend on the order or the batches of the facts even
/// past the bounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Footprint {
    snapshot: Option<(DateTime<Utc>, EventId, i64)>,
    deltas: Vec<(DateTime<Utc>, i128)>,
    events: u64,
}

impl Footprint {
    /// A footprint resumed from what a store holds of a project's storage
    /// facts, summed up: its newest `snapshot` (at, event id, bytes), its
    /// deltas as sums each placed at an instant (a sum counts when its
    /// instant is after the newest snapshot, exactly as one delta there
    /// would), and how many `events` they are. See [`crate::ledger`].
    pub fn resume(
        snapshot: Option<(DateTime<Utc>, EventId, i64)>,
        deltas: Vec<(DateTime<Utc>, i128)>,
        events: u64,
    ) -> Footprint {
        Footprint { snapshot, deltas, events }
    }

    pub fn apply(&mut self, fact: &UsageFact) {
        self.add(fact.kind, fact.occurred_at, &fact.id, fact.storage_bytes.unwrap_or(0));
    }

    /// [`Footprint::apply`] of a fact given by its parts; a kind other than
    /// the two storage kinds adds nothing.
    pub fn add(&mut self, kind: EventKind, at: DateTime<Utc>, id: &EventId, bytes: i64) {
        match kind {
            EventKind::StorageDelta => self.deltas.push((at, i128::from(bytes))),
            EventKind::StorageSnapshot => {
                let newer = match &self.snapshot {
                    None => true,
                    Some((t, snapshot_id, _)) => (at, id) > (*t, snapshot_id),
                };
                if newer {
                    self.snapshot = Some((at, id.clone(), bytes));
                }
            }
            _ => return,
        }
        self.events += 1;
    }

    /// The footprint, held within the bounds of a 64-bit integer.
    pub fn bytes(&self) -> i64 {
        let (base, after) = match &self.snapshot {
            Some((t, _, b)) => (i128::from(*b), Some(*t)),
            None => (0, None),
        };
        let sum = self.deltas.iter().filter(|(t, _)| after.is_none_or(|s| *t > s)).fold(base, |acc, (_, d)| acc + d);
        i64::try_from(sum).unwrap_or(if sum < 0 { i64::MIN } else { i64::MAX })
    }

    pub fn events(&self) -> u64 {
        self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fact(kind: EventKind, outcome: Outcome, rows: u64) -> UsageFact {
        UsageFact {
            api_key_id: Some(ApiKeyId::parse("k1").expect("id")),
            actor_id: Some("u1".into()),
            outcome,
            rows,
            gateway: "g".into(),
            ..UsageFact::new(
                EventId::parse("e1").expect("id"),
                ProjectId::parse("p1").expect("id"),
                kind,
                DateTime::parse_from_rfc3339("2026-07-07T12:31:00Z").expect("ts").with_timezone(&Utc),
            )
        }
    }

    /// The names are the view's keys (in Redis too) and the store's
    /// dimension column: they never change.
    #[test]
    fn counter_names_are_as_stored() {
        let at =
            |kind, key: &str, d: Dimension| CounterKey { dimension: d, window: kind, window_key: key.into() }.encode();
        assert_eq!(at(WindowKind::Day, "2026-07-07", Dimension::Project), "p|day|2026-07-07");
        assert_eq!(at(WindowKind::CalendarMonth, "2026-07", Dimension::AllApiKeys), "k*|calendar_month|2026-07");
        let key = Dimension::ApiKey(ApiKeyId::parse("key_1").expect("id"));
        assert_eq!(at(WindowKind::Rolling1m, "2026-07-07T12:31Z", key), "k:key_1|rolling_1m|2026-07-07T12:31Z");
        assert_eq!(at(WindowKind::Rolling1h, "h", Dimension::Agent("bot".into())), "g:bot|rolling_1h|h");
        assert_eq!(at(WindowKind::Rolling24h, "d", Dimension::Actor("ann".into())), "a:ann|rolling_24h|d");
        assert_eq!(at(WindowKind::Current, "current", Dimension::User("u@x".into())), "u:u@x|current|current");
        assert_eq!(Dimension::Actor("ann".into()).encode(), "a:ann");
    }

    #[test]
    fn a_successful_call_counts_in_every_window_of_every_dimension() {
        let c = counters_for(&fact(EventKind::Call, Outcome::Success, 7), Tz::UTC, &PriceBook::default());
        assert_eq!(c.len(), 4 * 5);
        assert!(c.iter().all(|(_, d)| *d == Totals { calls: 1, rows: 7, ..Totals::default() }));
    }

    #[test]
    fn a_failed_call_counts_nothing_and_a_request_skips_actors() {
        assert!(counters_for(&fact(EventKind::Call, Outcome::Failure, 7), Tz::UTC, &PriceBook::default()).is_empty());
        let c = counters_for(&fact(EventKind::Request, Outcome::Success, 0), Tz::UTC, &PriceBook::default());
        assert_eq!(c.len(), 3 * 5);
    }

    /// A signed-in user's check is logged (its reservation must survive a
    /// lost view) and counts no request; a request event without a key that
    /// records no check (one a client reported) still counts one.
    #[test]
    fn a_signed_in_users_check_counts_no_request() {
        let user_check = UsageFact {
            api_key_id: None,
            user_id: Some("user:alice".into()),
            admitted: Some(true),
            ..fact(EventKind::Request, Outcome::Success, 0)
        };
        assert!(counters_for(&user_check, Tz::UTC, &PriceBook::default()).is_empty());
        let reported = UsageFact { api_key_id: None, ..fact(EventKind::Request, Outcome::Success, 0) };
        assert_eq!(delta_of(&reported, &PriceBook::default()).requests, 1);
    }

    /// The hot path's filtered counters are exactly the full list filtered,
    /// in the same order, for any choice of dimensions and windows.
    #[test]
    fn counters_where_is_counters_for_filtered() {
        let book = PriceBook::default();
        let tz: Tz = "America/New_York".parse().expect("zone");
        for kind in [EventKind::Call, EventKind::Request, EventKind::StorageDelta] {
            let f = UsageFact { storage_bytes: Some(5), ..fact(kind, Outcome::Success, 3) };
            let all = counters_for(&f, tz, &book);
            for mask in 0u32..64 {
                let keep = |d: &Dimension, w: WindowKind| {
                    let dim = match d {
                        Dimension::Project => 0,
                        Dimension::AllApiKeys => 1,
                        _ => 2,
                    };
                    let win = WindowKind::FLOW.iter().position(|k| *k == w).unwrap_or(5);
                    mask & (1 << dim) != 0 && (mask >> 3) & (1 << (win % 3)) != 0
                };
                let expected: Vec<_> =
                    all.iter().filter(|(c, _)| keep(&c.key.dimension, c.key.window)).cloned().collect();
                assert_eq!(counters_where(&f, tz, &book, keep), expected, "{kind:?} mask {mask:#b}");
            }
        }
    }

    #[test]
    fn counter_keys_round_trip() {
        for (c, _) in counters_for(&fact(EventKind::Call, Outcome::Success, 1), Tz::UTC, &PriceBook::default()) {
            assert_eq!(CounterKey::decode(&c.key.encode()), Some(c.key));
        }
    }

    #[test]
    fn quantities_and_their_sums_are_bounded_by_2_pow_53() {
        let field = |f: UsageFact| check_fact(&f).map_err(|e| e.field);
        let big = MAX_QUANTITY;
        assert_eq!(field(fact(EventKind::Call, Outcome::Success, big)), Ok(()));
        assert_eq!(field(fact(EventKind::Call, Outcome::Success, big + 1)), Err("rows".into()));
        let entry = |input| TokenUsage { provider: "p".into(), model: "m".into(), input, ..TokenUsage::default() };
        let tokens = |entries| UsageFact { tokens: entries, ..fact(EventKind::Tokens, Outcome::Success, 0) };
        assert_eq!(field(tokens(vec![entry(big)])), Ok(()));
        assert_eq!(field(tokens(vec![entry(big + 1)])), Err("tokens[0].input".into()));
        // Two entries each within the bound whose sum is not (the i64 overflow of old).
        assert_eq!(field(tokens(vec![entry(big / 2 + 1), entry(big / 2)])), Err("tokens".into()));
        let billable = TokenUsage { output: big / 2 + 1, ..entry(big / 2) };
        assert_eq!(field(tokens(vec![billable])), Err("tokens".into()));
        let storage = |b| UsageFact { storage_bytes: Some(b), ..fact(EventKind::StorageDelta, Outcome::Success, 0) };
        assert_eq!(field(storage(-(big as i64))), Ok(()));
        assert_eq!(field(storage(big as i64 + 1)), Err("storage_bytes".into()));
        assert_eq!(field(storage(i64::MIN)), Err("storage_bytes".into()));
    }

    #[test]
    fn what_a_check_decided_rides_only_on_request_events() {
        let field = |f: UsageFact| check_fact(&f).map_err(|e| e.field);
        let request = fact(EventKind::Request, Outcome::Success, 0);
        let at = request.occurred_at;
        let admitted = UsageFact { admitted: Some(true), lease_until: Some(at), ..request.clone() };
        assert_eq!(field(admitted.clone()), Ok(()));
        let refused_holding = UsageFact { admitted: Some(false), ..admitted };
        assert_eq!(field(refused_holding), Err("held".into()));
        let call = UsageFact { admitted: Some(true), ..fact(EventKind::Call, Outcome::Success, 1) };
        assert_eq!(field(call), Err("admitted".into()));
        let corrects = UsageFact { corrects: Some(EventId::parse("e0").expect("id")), ..request };
        assert_eq!(field(corrects), Err("corrects".into()));
    }

    #[test]
    fn a_fact_is_received_when_stamped_else_when_it_occurred() {
        let f = fact(EventKind::Call, Outcome::Success, 1);
        assert_eq!(f.receipt(), f.occurred_at, "neither stamp nor log timestamp: never late");
        let stamped = UsageFact { received_at: Some(f.occurred_at + Duration::days(40)), ..f.clone() };
        assert_eq!(stamped.receipt(), f.occurred_at + Duration::days(40));
        // Judged by its receipt: 40 days late is past the horizon, whatever the clock says.
        assert!(check_fact_time(stamped.occurred_at, stamped.receipt(), DEFAULT_DEDUP_HORIZON).is_err());
        let on_time = UsageFact { received_at: Some(f.occurred_at + Duration::days(30)), ..f };
        assert!(check_fact_time(on_time.occurred_at, on_time.receipt(), DEFAULT_DEDUP_HORIZON).is_ok());
    }

    #[test]
    fn instants_are_bounded_to_what_every_store_keeps() {
        let field = |f: UsageFact| check_fact(&f).map_err(|e| e.field);
        let ok = fact(EventKind::Call, Outcome::Success, 1);
        let year = |y: i32| {
            use chrono::TimeZone;
            Utc.with_ymd_and_hms(y, 1, 1, 0, 0, 0).single().expect("instant")
        };
        assert_eq!(field(UsageFact { occurred_at: year(9999), ..ok.clone() }), Ok(()));
        assert_eq!(field(UsageFact { occurred_at: year(10_000), ..ok.clone() }), Err("occurred_at".into()));
        assert_eq!(field(UsageFact { occurred_at: year(0), ..ok.clone() }), Err("occurred_at".into()));
        assert_eq!(field(UsageFact { received_at: Some(year(20_000)), ..ok.clone() }), Err("received_at".into()));
        let request = fact(EventKind::Request, Outcome::Success, 0);
        let leased = UsageFact { admitted: Some(true), lease_until: Some(year(12_000)), ..request };
        assert_eq!(field(leased), Err("lease_until".into()));
    }

    #[test]
    fn fact_time_bounds() {
        let at = DateTime::parse_from_rfc3339("2026-07-07T12:00:00Z").expect("ts").with_timezone(&Utc);
        assert!(check_fact_time(at, at, DEFAULT_DEDUP_HORIZON).is_ok());
        assert!(check_fact_time(at + Duration::minutes(6), at, DEFAULT_DEDUP_HORIZON).is_err());
        assert!(check_fact_time(at - Duration::days(36), at, DEFAULT_DEDUP_HORIZON).is_err());
    }
}
