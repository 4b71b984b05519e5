//! Corrections: an event amended or voided after it was folded.
//!
//! A `correction` event names an earlier event of its project (`corrects`)
//! and either **voids** it (`void`: it counts for nothing) or **amends** it
//! (it carries the corrected quantities: the new truth for that event —
//! `rows` for a call, `tokens` for a tokens event). It is folded as the
//! difference between what the original counts now and what it should count,
//! on the original's own counters (its dimensions, the windows of its
//! `occurred_at` in the zone it was folded in), its cost priced as the
//! original was (by the price book as of the original's receipt), its token
//! breakdown by model and its unpriced rows.
//!
//! Why the fold stays a pure function of the log: what each folded call and
//! tokens event counts now ([`Counted`]) is kept in the store's dedup set, in
//! the fold's transaction, so a correction reads the same original whether
//! it is folded live or in a replay from offset 0.
//!
//! The rules (the same at ingest, where the store can tell, and in the fold):
//!
//! - Only `call` and `tokens` events can be corrected (a request is the fact
//!   that a check happened; a storage footprint is corrected by sending a
//!   `storage_snapshot`, which supersedes what came before it). A correction
//!   cannot be corrected: correct the original again instead.
//! - The original must be folded before the correction (on the log, a
//!   project's events are in one partition, in order) and be within the dedup
//!   horizon at the correction's receipt. Otherwise the correction is
//!   dead-lettered at fold with its reason; at ingest the gateway cannot tell
//!   "unknown" from "not folded yet", so it accepts it.
//! - Amends in sequence each replace the last (the newest is the truth); a
//!   voided event stays voided: correcting it again is refused.
//! - A correction keeps the original's attribution (key, agent, actor, user,
//!   meter, outcome) and times; it carries only `corrects`, `void` and the
//!   quantities.
//! - A counter is never taken below zero: a difference that would is floored
//!   at zero (it can only happen on a counter that saturated).
//! - The correction's own id is deduplicated like any event's; a refused one
//!   is forgotten, so it can be sent again once its original is folded.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::audit::{AuditAction, AuditDetail, AuditEntry, Principal};
use crate::error::FieldError;
use crate::ids::{AuditId, EventId, ProjectId};
use crate::ledger::MODEL_USAGE_WINDOWS;
use crate::price::{MeterType, PriceBook, PriceKey};
use crate::usage::{
    CounterKey, Dimension, EventKind, Outcome, UsageFact, component_usage, counters_for, dimensions_of, priced,
};
use crate::window::{WindowKind, window_at};

/// Whether events of `kind` can be corrected.
pub fn correctable(kind: EventKind) -> bool {
    matches!(kind, EventKind::Call | EventKind::Tokens)
}

/// What the dedup set keeps of a folded call or tokens event: the event as
/// it counts now (its latest amend, or void), and the zone its windows were
/// taken in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counted {
    /// The original, its quantities those of its latest amend.
    pub fact: UsageFact,
    /// The IANA name of the project's zone when it was folded.
    pub tz: String,
    /// Voided: it counts for nothing, and cannot be corrected again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub voided: bool,
    /// The correction that last changed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corrected_by: Option<EventId>,
}

impl Counted {
    /// What a store keeps of a new fact folded in `tz`: `None` unless it can
    /// be corrected.
    pub fn of(fact: &UsageFact, tz: Tz) -> Option<Counted> {
        correctable(fact.kind).then(|| Counted {
            fact: UsageFact { gateway: String::new(), ..fact.clone() },
            tz: tz.name().to_owned(),
            voided: false,
            corrected_by: None,
        })
    }

    /// Its stored form: JSON, or `""` for a fact that cannot be corrected.
    pub fn encode(counted: Option<&Counted>) -> String {
        // Serialising plain data into a String cannot fail.
        counted.and_then(|c| serde_json::to_string(c).ok()).unwrap_or_default()
    }

    /// [`Counted::encode`] read back.
    pub fn decode(s: &str) -> Result<Option<Counted>, String> {
        if s.is_empty() {
            return Ok(None);
        }
        serde_json::from_str(s).map(Some).map_err(|e| format!("not a counted event: {e}"))
    }

    fn zone(&self) -> Tz {
        self.tz.parse().unwrap_or(Tz::UTC)
    }
}

/// What a store knows of the event a correction names, once it is folded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A call or tokens event, as it counts now.
    Counted(Box<Counted>),
    /// A folded event of another kind (a request, a storage fact, a correction).
    Other,
}

impl Target {
    /// The target as the dedup set's stored form says (see [`Counted::encode`]).
    pub fn decode(s: &str) -> Result<Target, String> {
        Ok(Counted::decode(s)?.map_or(Target::Other, |c| Target::Counted(Box::new(c))))
    }
}

/// Checks a correction's own fields (what [`crate::usage::check_fact`]
/// asks of a `correction`): it names its original, a void carries no
/// quantity, and it carries nothing of the original's attribution.
pub fn check_correction_fact(fact: &UsageFact) -> Result<(), FieldError> {
    let Some(original) = &fact.corrects else {
        return Err(FieldError::new("corrects", "a correction names the event it corrects"));
    };
    if original == &fact.id {
        return Err(FieldError::new("corrects", "an event cannot correct itself"));
    }
    let attribution = [
        ("api_key_id", fact.api_key_id.is_some()),
        ("agent_id", fact.agent_id.is_some()),
        ("actor_id", fact.actor_id.is_some()),
        ("user", fact.user_id.is_some()),
        ("reservation_id", fact.reservation_id.is_some()),
        ("meter_type", fact.meter_type.is_some()),
        ("storage_bytes", fact.storage_bytes.is_some()),
        ("outcome", fact.outcome != Outcome::Success),
    ];
    if let Some((name, _)) = attribution.iter().find(|(_, set)| *set) {
        return Err(FieldError::new(
            *name,
            "a correction keeps the original event's; it carries only corrects, void and quantities",
        ));
    }
    if fact.void && (fact.rows != 0 || !fact.tokens.is_empty()) {
        let field = if fact.rows != 0 { "rows" } else { "tokens" };
        return Err(FieldError::new(field, "a void carries no quantities"));
    }
    if fact.rows != 0 && !fact.tokens.is_empty() {
        return Err(FieldError::new(
            "tokens",
            "an amend carries rows (of a call) or tokens (of a tokens event), not both",
        ));
    }
    Ok(())
}

/// What the original counts once `correction` is applied to it: the new
/// state to keep, or why it is refused (the field at fault, `corrects` but
/// for quantities of the wrong kind). `target` is what the store holds of
/// the original (`None`: nothing, in this project, within the horizon);
/// `horizon` is the dedup horizon, which the original must be within at the
/// correction's receipt.
pub fn apply_correction(
    correction: &UsageFact,
    target: Option<&Target>,
    horizon: Duration,
) -> Result<Counted, FieldError> {
    let original = correction.corrects.as_ref().map(EventId::as_str).unwrap_or_default();
    let project = &correction.project_id;
    let counted = match target {
        None => {
            return Err(FieldError::new(
                "corrects",
                format!(
                    "no event {original} of project {project} is folded (unknown, of another project, \
                     not folded yet, or past the dedup horizon)"
                ),
            ));
        }
        Some(Target::Other) => {
            return Err(FieldError::new(
                "corrects",
                format!(
                    "event {original} of project {project} is not a call or tokens event: only those can be corrected"
                ),
            ));
        }
        Some(Target::Counted(c)) => c,
    };
    if counted.voided {
        return Err(FieldError::new("corrects", format!("event {original} of project {project} is already voided")));
    }
    if counted.fact.occurred_at < correction.receipt() - horizon {
        return Err(FieldError::new(
            "corrects",
            format!("event {original} is older than the dedup horizon of {} days", horizon.num_days()),
        ));
    }
    let mut next = Counted::clone(counted);
    next.corrected_by = Some(correction.id.clone());
    if correction.void {
        next.voided = true;
        return Ok(next);
    }
    match counted.fact.kind {
        EventKind::Tokens => {
            if correction.tokens.is_empty() {
                return Err(FieldError::new(
                    "tokens",
                    "an amend of a tokens event carries its corrected tokens (or send void)",
                ));
            }
            next.fact.tokens = correction.tokens.clone();
        }
        _ => {
            if !correction.tokens.is_empty() {
                return Err(FieldError::new(
                    "tokens",
                    format!("event {original} is a call: an amend carries its rows"),
                ));
            }
            next.fact.rows = correction.rows;
        }
    }
    Ok(next)
}

/// A signed change to every field of a counter's totals, in [`Field::ALL`] order.
pub type Delta = [i64; 13];

/// The key of one row of the breakdown by model in one window of a
/// project, for one dimension.
pub type ModelKey = (Dimension, WindowKind, String, PriceKey, MeterType, bool);

/// What one counted event contributes everywhere it counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contribution {
    pub counters: BTreeMap<CounterKey, (Option<DateTime<Utc>>, Delta)>,
    /// Priced quantity, unpriced quantity, cost in picodollars.
    pub models: BTreeMap<ModelKey, [i64; 3]>,
    /// The unpriced components, on every counter the event lands in.
    pub unpriced: BTreeSet<(CounterKey, PriceKey)>,
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// What `counted` contributes (nothing once voided), priced by `book` as of
/// the original's receipt.
pub fn contribution(counted: &Counted, book: &PriceBook) -> Contribution {
    let mut out = Contribution::default();
    if counted.voided {
        return out;
    }
    let fact = &counted.fact;
    let tz = counted.zone();
    let footprint = CounterKey::footprint();
    for (c, t) in counters_for(fact, tz, book) {
        if c.key == footprint {
            continue;
        }
        out.counters.insert(c.key, (c.resets_at, t.values()));
    }
    if fact.kind == EventKind::Tokens {
        let rows = component_usage(fact, book);
        for dimension in dimensions_of(fact) {
            for kind in MODEL_USAGE_WINDOWS {
                let window_key = window_at(kind, tz, fact.occurred_at).key;
                for r in &rows {
                    let key = (dimension.clone(), kind, window_key.clone(), r.key.clone(), r.meter, r.embedding);
                    let e = out.models.entry(key).or_default();
                    e[0] = e[0].saturating_add(clamp(r.priced_quantity));
                    e[1] = e[1].saturating_add(clamp(r.unpriced_quantity));
                    e[2] = e[2].saturating_add(r.cost.picos());
                }
            }
        }
        for k in priced(fact, book).unpriced_rows {
            for key in out.counters.keys() {
                out.unpriced.insert((key.clone(), k.clone()));
            }
        }
    }
    out
}

/// Adds `b` to `a`, field by field, saturating (and never to `i64::MIN`, so
/// a delta can always be negated).
pub fn add_delta(a: &mut [i64], b: &[i64]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = x.saturating_add(*y).max(-i64::MAX);
    }
}

/// The change from `old` to `new`: per counter and per model row, new − old.
/// (Both are of the same original, so their counters coincide but where an
/// amend moves a quantity to or from zero.) Unpriced rows are `new`'s: the
/// list of components a counter saw unpriced is never taken back, the
/// count of unpriced events is.
pub fn difference(old: &Contribution, new: &Contribution) -> Contribution {
    let mut out = Contribution { unpriced: new.unpriced.clone(), ..Contribution::default() };
    for (key, (resets_at, d)) in &new.counters {
        out.counters.insert(key.clone(), (*resets_at, *d));
    }
    for (key, (resets_at, d)) in &old.counters {
        let e = out.counters.entry(key.clone()).or_insert((*resets_at, [0; 13]));
        let neg: Vec<i64> = d.iter().map(|v| -v.max(&-i64::MAX)).collect();
        add_delta(&mut e.1, &neg);
    }
    out.counters.retain(|_, (_, d)| d.iter().any(|v| *v != 0));
    for (key, v) in &new.models {
        out.models.insert(key.clone(), *v);
    }
    for (key, v) in &old.models {
        let e = out.models.entry(key.clone()).or_default();
        let neg: Vec<i64> = v.iter().map(|x| -x.max(&-i64::MAX)).collect();
        add_delta(e, &neg);
    }
    out.models.retain(|_, v| v.iter().any(|x| *x != 0));
    out
}

/// The quantities an audit entry shows of one state of an event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorrectedQuantities {
    pub voided: bool,
    pub rows: u64,
    /// Billable tokens (input + output + cached), summed over its entries.
    pub tokens: u64,
    pub token_entries: Vec<crate::price::TokenUsage>,
}

impl CorrectedQuantities {
    pub fn of(c: &Counted) -> CorrectedQuantities {
        let tokens = c
            .fact
            .tokens
            .iter()
            .map(|t| t.input.saturating_add(t.output).saturating_add(t.cached))
            .fold(0u64, u64::saturating_add);
        CorrectedQuantities {
            voided: c.voided,
            rows: if c.fact.kind == EventKind::Call { c.fact.rows } else { 0 },
            tokens,
            token_entries: c.fact.tokens.clone(),
        }
    }
}

/// A time-ordered audit id derived from the correction alone (its receipt
/// and its id), so a replay writes the same entry: the shape of a UUIDv7
/// (48 bits of milliseconds, then a version nibble), its other bits a hash
/// of the project and the correction's id.
pub fn audit_id(project: &ProjectId, correction: &UsageFact) -> AuditId {
    // FNV-1a, 64 bits: stable across builds and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in project.as_str().bytes().chain([0]).chain(correction.id.as_str().bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let ms = u64::try_from(correction.receipt().timestamp_millis()).unwrap_or(0) & 0xffff_ffff_ffff;
    let id = format!("aud_{ms:012x}7{:019x}", u128::from(h) << 12);
    // Invariant: `aud_` and hex digits are in the id alphabet.
    AuditId::parse(id).unwrap_or_else(|_| unreachable!("hex digits form an id"))
}

/// The audit entry of a correction folded: `events:CorrectEvent`, the
/// original's id as its resource, both ids and the quantities before and
/// after in its detail; written once (its once-key is the correction's id).
pub fn audit_entry(correction: &UsageFact, before: &Counted, after: &Counted) -> AuditEntry {
    AuditEntry {
        id: audit_id(&correction.project_id, correction),
        project_id: Some(correction.project_id.clone()),
        action: AuditAction::CorrectEvent,
        principal: (!correction.gateway.is_empty()).then(|| Principal::new("gateway", correction.gateway.clone())),
        resource: before.fact.id.to_string(),
        detail: AuditDetail::EventCorrection {
            original_id: before.fact.id.to_string(),
            correction_id: correction.id.to_string(),
            original_kind: before.fact.kind.as_str().to_owned(),
            void: correction.void,
            before: CorrectedQuantities::of(before),
            after: CorrectedQuantities::of(after),
        },
        created_at: correction.receipt(),
    }
}
