//! The audit log: what an admin changed, and what a monitor quota saw.
//!
//! A monitor quota never refuses, so the call its breach rode in on returns
//! success and leaves no trace; the breach is therefore written down as a
//! durable entry — action `quotas:MonitorBreach`, no principal (nobody
//! authorised it), the quota as its resource — **once per quota and
//! window**. The "once" is the entry's [`AuditEntry::once_key`], unique in
//! the store, so any number of gateways racing on the same breach write one
//! entry. Admin changes to quotas (`quotas:CreateQuota`, `quotas:UpdateQuota`,
//! `quotas:DeleteQuota`), keys (`keys:CreateApiKey`, `keys:UpdateApiKey`, `keys:DeleteApiKey`),
//! roles (`roles:CreateRole`), webhook endpoints
//! (`webhooks:CreateEndpoint`, `webhooks:UpdateEndpoint`,
//! `webhooks:DeleteEndpoint`, `webhooks:RotateSecret`), export schedules
//! (`exports:CreateSchedule`, `exports:UpdateSchedule`,
//! `exports:DeleteSchedule`) and the price book (`prices:PutPrices`) are
//! written in the same transaction as the change, with who made it; no
//! secret is ever in an entry. A billing export's run
//! (`exports:RunExport`: its status, rows, watermark and error) is written
//! with the run's end, by whoever started it: the admin API, the CLI
//! (`admin`/`cli`) or a schedule (`schedule`/its id).
//!
//! ## Projects and the installation
//!
//! Almost every entry belongs to one project ([`AuditEntry::project_id`]).
//! The price book does not: it is one for the whole installation, so a
//! write of prices is an **installation-wide** entry, whose `project_id` is
//! `None`. The two are read apart (`GET /v1/audit?project_id=` or
//! `?scope=installation`); on the audit topic an installation-wide entry is
//! keyed [`INSTALLATION_KEY`] where the others are keyed by their project.
//!
//! Entry ids are time-ordered, so a project's log (or the installation's)
//! reads in id order and the id of the last entry read is the cursor of
//! the next page.
//!
//! ## From the log (DESIGN §12)
//!
//! The audit trail is derived from the `tollgate.audit` topic, so every
//! entry survives a rebuild of the store:
//!
//! 1. **Outbox.** Whoever makes an entry (an admin change, the fold of a
//!    correction or of a monitor breach, a delivery that disables an endpoint)
//!    writes it to the store's audit outbox in the transaction of what it
//!    records ([`AuditStore::record_audit`](crate::AuditStore::record_audit)
//!    and the ports that take entries). The once-key is unique there, so
//!    "once" holds before the log.
//! 2. **Relay.** Beside the audit folder (where the projector runs), the
//!    relay publishes pending entries to the topic
//!    ([`AuditLog`](crate::AuditLog)), then marks them published. A relay
//!    killed between the two publishes them again: entries carry stable
//!    ids, so a duplicate is the same entry.
//! 3. **Folder.** A consumer of the topic with its own name and offsets
//!    writes each entry into the audit log, the offsets moving in the same
//!    transaction ([`AuditBatch`]), idempotent on the id (and the
//!    once-key). `GET /v1/audit` reads that log: an entry appears there
//!    about one poll after it was made.
//!
//! Ids the fold makes (corrections, monitor breaches) are derived from the
//! record they come from ([`crate::correction::audit_id`], and the alert's
//! dedup key in [`crate::alert`]), so a replay makes the same ones.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::admission::{CheckOutcome, CheckPlan};
use crate::error::named;
use crate::export::{ExportSchedule, Projects};
use crate::ids::{AuditId, ProjectId, QuotaId};
use crate::price::{Component, Price, PriceBook, Usd};
use crate::quota::{Metric, Quota};
use crate::role::{Role, RoleQuota};
use crate::tenant::{ApiKey, Grants};
use crate::webhook::Endpoint;
use crate::window::WindowKind;

/// What an entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuditAction {
    MonitorBreach,
    CreateQuota,
    UpdateQuota,
    DeleteQuota,
    /// A correction folded: an event amended or voided.
    CorrectEvent,
    /// A webhook endpoint disabled by delivery (a 410, five days failing).
    WebhookEndpointDisabled,
    /// An API key created.
    CreateApiKey,
    /// An API key deleted.
    DeleteApiKey,
    /// An API key's grants or role changed (the console's grant form).
    UpdateApiKey,
    /// A role created.
    CreateRole,
    /// A webhook endpoint subscribed.
    CreateWebhook,
    /// A webhook endpoint changed by an admin (url, event types,
    /// description, enabled).
    UpdateWebhook,
    /// A webhook endpoint deleted.
    DeleteWebhook,
    /// A webhook endpoint's signing secret rotated.
    RotateWebhookSecret,
    /// Rows written to the price book (installation-wide).
    PutPrices,
    /// A billing export run ended (complete, partial or failed).
    RunExport,
    /// An export schedule created.
    CreateExportSchedule,
    /// An export schedule changed by an admin (enabled, cadence, format,
    /// destination, or run now).
    UpdateExportSchedule,
    /// An export schedule deleted.
    DeleteExportSchedule,
}

impl AuditAction {
    pub const ALL: [AuditAction; 19] = [
        AuditAction::MonitorBreach,
        AuditAction::CreateQuota,
        AuditAction::UpdateQuota,
        AuditAction::DeleteQuota,
        AuditAction::CorrectEvent,
        AuditAction::WebhookEndpointDisabled,
        AuditAction::CreateApiKey,
        AuditAction::DeleteApiKey,
        AuditAction::CreateRole,
        AuditAction::CreateWebhook,
        AuditAction::UpdateWebhook,
        AuditAction::DeleteWebhook,
        AuditAction::RotateWebhookSecret,
        AuditAction::PutPrices,
        AuditAction::RunExport,
        AuditAction::CreateExportSchedule,
        AuditAction::UpdateExportSchedule,
        AuditAction::DeleteExportSchedule,
        AuditAction::UpdateApiKey,
    ];

    /// The IAM-style action string.
    pub fn as_str(self) -> &'static str {
        match self {
            AuditAction::MonitorBreach => "quotas:MonitorBreach",
            AuditAction::CreateQuota => "quotas:CreateQuota",
            AuditAction::UpdateQuota => "quotas:UpdateQuota",
            AuditAction::DeleteQuota => "quotas:DeleteQuota",
            AuditAction::CorrectEvent => "events:CorrectEvent",
            AuditAction::WebhookEndpointDisabled => "webhook.endpoint_disabled",
            AuditAction::CreateApiKey => "keys:CreateApiKey",
            AuditAction::DeleteApiKey => "keys:DeleteApiKey",
            AuditAction::UpdateApiKey => "keys:UpdateApiKey",
            AuditAction::CreateRole => "roles:CreateRole",
            AuditAction::CreateWebhook => "webhooks:CreateEndpoint",
            AuditAction::UpdateWebhook => "webhooks:UpdateEndpoint",
            AuditAction::DeleteWebhook => "webhooks:DeleteEndpoint",
            AuditAction::RotateWebhookSecret => "webhooks:RotateSecret",
            AuditAction::PutPrices => "prices:PutPrices",
            AuditAction::RunExport => "exports:RunExport",
            AuditAction::CreateExportSchedule => "exports:CreateSchedule",
            AuditAction::UpdateExportSchedule => "exports:UpdateSchedule",
            AuditAction::DeleteExportSchedule => "exports:DeleteSchedule",
        }
    }
}

named!(AuditAction, "audit action", AuditAction::ALL);

/// Who did it: `("admin", "admin_token")` for the admin API, `("admin",
/// "cli")` for `tollgate apply`. A monitor breach has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub kind: String,
    pub id: String,
}

impl Principal {
    pub fn new(kind: impl Into<String>, id: impl Into<String>) -> Self {
        Principal { kind: kind.into(), id: id.into() }
    }
}

/// What happened, stored as JSON tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AuditDetail {
    /// A monitor quota found over its limit.
    QuotaMonitorBreach {
        metric: Metric,
        meter_type: Option<String>,
        window: WindowKind,
        window_key: String,
        limit: u64,
        observed_value: u64,
    },
    /// A quota created (`before` null), changed, or deleted (`after` null).
    QuotaChange { before: Option<Box<Quota>>, after: Option<Box<Quota>> },
    /// A correction folded (see [`crate::correction`]): the event it amended
    /// or voided, and what that event counted before and after.
    EventCorrection {
        original_id: String,
        correction_id: String,
        original_kind: String,
        void: bool,
        before: crate::correction::CorrectedQuantities,
        after: crate::correction::CorrectedQuantities,
    },
    /// A webhook endpoint disabled by delivery.
    WebhookEndpointDisabled { url: String, reason: String },
    /// An API key created (`before` null), changed (its grants or role), or
    /// deleted (`after` null). Its
    /// secret is never in it, only the prefix the key is shown by.
    ApiKeyChange { before: Option<KeyView>, after: Option<KeyView> },
    /// A role created.
    RoleChange { before: Option<RoleView>, after: Option<RoleView> },
    /// A webhook endpoint subscribed (`before` null), changed, or deleted
    /// (`after` null). Its signing secrets are never in it.
    WebhookChange { before: Option<EndpointView>, after: Option<EndpointView> },
    /// A webhook endpoint's signing secret rotated: the old one signs beside
    /// the new one until `previous_valid_until`. Neither secret is in it.
    WebhookSecretRotated { previous_valid_until: DateTime<Utc> },
    /// Rows written to the price book, in the order they were given, each
    /// with the unit price it replaced.
    PriceChange { prices: Vec<PriceRowChange> },
    /// A billing export run as it ended: `partial` with the bound it
    /// stopped at (`ROWS` or `TIME`), `failed` with why.
    ExportRun {
        export_key: String,
        format: String,
        status: String,
        mark: Option<String>,
        rows: u64,
        bytes: u64,
        /// `partition:offset`, `;`-separated.
        watermark: String,
        error: Option<String>,
        /// The schedule that started the run (`exs_…`), if one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        schedule_id: Option<String>,
    },
    /// An export schedule created (`before` null), changed, or deleted
    /// (`after` null).
    ExportScheduleChange { before: Option<ScheduleView>, after: Option<ScheduleView> },
}

/// What an audit entry shows of an export schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleView {
    /// The project ids, or `["*"]` for all of them.
    pub projects: Vec<String>,
    pub period: String,
    pub dimensions: Vec<String>,
    pub grace_seconds: u64,
    pub format: String,
    pub destination: String,
    pub cadence: String,
    pub timezone: String,
    pub enabled: bool,
    pub next_run_at: DateTime<Utc>,
}

impl From<&ExportSchedule> for ScheduleView {
    fn from(s: &ExportSchedule) -> Self {
        ScheduleView {
            projects: match &s.projects {
                Projects::All => vec!["*".to_owned()],
                Projects::Some(ids) => ids.iter().map(ToString::to_string).collect(),
            },
            period: s.period.as_str().to_owned(),
            dimensions: s.dimensions.iter().map(|d| d.as_str().to_owned()).collect(),
            grace_seconds: s.grace.duration().as_secs(),
            format: s.format.as_str().to_owned(),
            destination: s.destination.as_str().to_owned(),
            cadence: s.cadence.as_str().to_owned(),
            timezone: s.timezone.name().to_owned(),
            enabled: s.enabled,
            next_run_at: s.next_run_at,
        }
    }
}

/// One row of a write of prices, as its audit entry shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceRowChange {
    pub provider: String,
    pub model: String,
    pub component: Component,
    /// Dollars per unit, a decimal string as the price API shows it.
    pub unit_price_usd: Usd,
    pub effective_from: DateTime<Utc>,
    /// The unit price in effect at `effective_from` just before this row was
    /// written (the rows of the same write before it included): the price
    /// of the row of the same key and `effective_from` it overwrote, or of
    /// the earlier row it supersedes from then on; `None` when no price
    /// covered that instant.
    pub replaced_unit_price_usd: Option<Usd>,
}

/// What a write of prices is audited with: the entry's id and who writes.
/// The store makes the entry ([`price_change`]) in the write's transaction,
/// where it reads the book the rows replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceAudit {
    pub id: AuditId,
    pub by: Principal,
}

/// The resource of a price book entry.
pub const PRICES_RESOURCE: &str = "prices";

/// The entry recording a write of `written` to the price book by `by` at
/// `at` (`prices:PutPrices`, installation-wide), against `before`: the book
/// as it stood in the write's transaction, before it. `None` for no rows.
pub fn price_change(
    id: AuditId,
    before: &PriceBook,
    written: &[Price],
    by: &Principal,
    at: DateTime<Utc>,
) -> Option<AuditEntry> {
    if written.is_empty() {
        return None;
    }
    let mut book = before.clone();
    let prices = written
        .iter()
        .map(|p| {
            let replaced = book.price_at(&p.key, p.effective_from);
            book.insert(p.clone());
            PriceRowChange {
                provider: p.key.provider.clone(),
                model: p.key.model.clone(),
                component: p.key.component,
                unit_price_usd: p.unit_price_usd,
                effective_from: p.effective_from,
                replaced_unit_price_usd: replaced,
            }
        })
        .collect();
    Some(AuditEntry {
        id,
        project_id: None,
        action: AuditAction::PutPrices,
        principal: Some(by.clone()),
        resource: PRICES_RESOURCE.into(),
        detail: AuditDetail::PriceChange { prices },
        created_at: at,
    })
}

/// What an audit entry shows of an API key (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyView {
    pub name: String,
    pub prefix: String,
    pub role_id: Option<String>,
    pub grants: Grants,
}

impl From<&ApiKey> for KeyView {
    fn from(k: &ApiKey) -> Self {
        KeyView {
            name: k.name.clone(),
            prefix: k.prefix.clone(),
            role_id: k.role_id.as_ref().map(ToString::to_string),
            grants: k.grants.clone(),
        }
    }
}

/// What an audit entry shows of a role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleView {
    pub name: String,
    pub grants: Grants,
    pub quota: Option<RoleQuota>,
    pub exempt: bool,
}

impl From<&Role> for RoleView {
    fn from(r: &Role) -> Self {
        RoleView { name: r.name.clone(), grants: r.grants.clone(), quota: r.quota, exempt: r.exempt }
    }
}

/// What an audit entry shows of a webhook endpoint (never its secrets).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointView {
    pub url: String,
    pub event_types: Vec<String>,
    pub description: Option<String>,
    pub enabled: bool,
}

impl From<&Endpoint> for EndpointView {
    fn from(e: &Endpoint) -> Self {
        EndpointView {
            url: e.url.clone(),
            event_types: e.event_types.as_slice().to_vec(),
            description: e.description.clone(),
            enabled: e.enabled,
        }
    }
}

/// The entry recording an admin's change to a key, a role or a webhook
/// endpoint (`action` says which change), by `by` at `at`.
pub fn admin_change(
    id: AuditId,
    project_id: &ProjectId,
    action: AuditAction,
    resource: impl Into<String>,
    detail: AuditDetail,
    by: &Principal,
    at: DateTime<Utc>,
) -> AuditEntry {
    AuditEntry {
        id,
        project_id: Some(project_id.clone()),
        action,
        principal: Some(by.clone()),
        resource: resource.into(),
        detail,
        created_at: at,
    }
}

/// The message key of an installation-wide entry on the audit topic (the
/// others are keyed by their project id).
pub const INSTALLATION_KEY: &str = "installation";

/// One entry of the audit log: of a project's, or of the installation's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub id: AuditId,
    /// The project the entry belongs to, or `None` for an
    /// installation-wide entry (a write of prices).
    pub project_id: Option<ProjectId>,
    pub action: AuditAction,
    pub principal: Option<Principal>,
    /// What the entry is about: a quota, an event, a key, a role or a
    /// webhook endpoint id, or `prices`.
    pub resource: String,
    pub detail: AuditDetail,
    pub created_at: DateTime<Utc>,
}

impl AuditEntry {
    /// Its message key on the audit topic: its project's id, or
    /// [`INSTALLATION_KEY`].
    pub fn log_key(&self) -> &str {
        self.project_id.as_ref().map_or(INSTALLATION_KEY, ProjectId::as_str)
    }

    /// The key that makes an entry written at most once, if it has one: a
    /// monitor breach's quota and window key.
    pub fn once_key(&self) -> Option<String> {
        match &self.detail {
            AuditDetail::QuotaMonitorBreach { window_key, .. } => Some(format!("{}/{window_key}", self.resource)),
            AuditDetail::QuotaChange { .. }
            | AuditDetail::WebhookEndpointDisabled { .. }
            | AuditDetail::ApiKeyChange { .. }
            | AuditDetail::RoleChange { .. }
            | AuditDetail::WebhookChange { .. }
            | AuditDetail::WebhookSecretRotated { .. }
            | AuditDetail::PriceChange { .. }
            | AuditDetail::ExportScheduleChange { .. } => None,
            // One entry per run: its run id.
            AuditDetail::ExportRun { .. } => Some(format!("export/{}", self.resource)),
            // One entry per correction folded, whatever refolds it.
            AuditDetail::EventCorrection { correction_id, .. } => {
                Some(format!("correction/{}/{correction_id}", self.log_key()))
            }
        }
    }
}

/// Entries read from the audit topic, for the store to fold into the audit
/// log atomically with the folder's offsets (see
/// [`AuditStore::fold_audit`](crate::AuditStore::fold_audit)). Every record
/// the offsets move past is one of `entries` or was dead-lettered (it could
/// not be decoded) before the batch was folded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditBatch {
    pub consumer: String,
    pub topic: String,
    pub entries: Vec<AuditEntry>,
    pub offsets: Vec<crate::fold::OffsetMove>,
}

/// A monitor quota over its limit in one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MonitorBreach {
    pub quota_id: QuotaId,
    pub project_id: ProjectId,
    pub metric: Metric,
    pub meter_type: Option<String>,
    pub window: WindowKind,
    pub window_key: String,
    pub limit: u64,
    /// The usage the check saw, this call included for `requests` and `calls`.
    pub observed_value: u64,
}

impl MonitorBreach {
    /// The audit entry that records it.
    pub fn entry(&self, id: AuditId, at: DateTime<Utc>) -> AuditEntry {
        AuditEntry {
            id,
            project_id: Some(self.project_id.clone()),
            action: AuditAction::MonitorBreach,
            principal: None,
            resource: self.quota_id.to_string(),
            detail: AuditDetail::QuotaMonitorBreach {
                metric: self.metric,
                meter_type: self.meter_type.clone(),
                window: self.window,
                window_key: self.window_key.clone(),
                limit: self.limit,
                observed_value: self.observed_value,
            },
            created_at: at,
        }
    }
}

/// The monitor quotas a check found over their limit (the same rule as
/// [`decide`](crate::admission::decide): `used + need > limit`), with what
/// their audit entries carry.
pub fn monitor_breaches(quotas: &[Quota], plan: &CheckPlan, outcome: &CheckOutcome) -> Vec<MonitorBreach> {
    let mut out = Vec::new();
    for (li, l) in plan.limits.iter().enumerate() {
        let used = outcome.used.get(li).copied().unwrap_or(0);
        if l.enforce || used.saturating_add(l.need) <= l.limit {
            continue;
        }
        let (Some(q), Some(w)) = (quotas.get(l.quota), plan.window_of(li)) else { continue };
        // Rows are known only after the call: `need` is a threshold there,
        // not a quantity this call adds.
        let observed_value = if l.metric == Metric::Rows { used } else { used.saturating_add(l.need) };
        out.push(MonitorBreach {
            quota_id: q.id.clone(),
            project_id: q.spec.project_id.clone(),
            metric: l.metric,
            meter_type: q.spec.meter_type.clone(),
            window: w.kind,
            window_key: w.key.clone(),
            limit: l.limit,
            observed_value,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{decide, plan_check};
    use crate::ids::ApiKeyId;
    use crate::quota::{Mode, QuotaSpec, Scope};

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
    }

    fn quota(id: &str, metric: Metric, mode: Mode, limit: u64) -> Quota {
        let t0 = utc("2026-01-01T00:00:00Z");
        Quota {
            id: QuotaId::parse(id).expect("quota id"),
            spec: QuotaSpec {
                project_id: ProjectId::parse("p1").expect("project id"),
                scope: Scope::Project,
                scope_ref: None,
                metric,
                window: WindowKind::Day,
                limit,
                mode,
                meter_type: None,
                on_unpriced: None,
            },
            created_at: t0,
            updated_at: t0,
        }
    }

    #[test]
    fn monitor_breaches_agree_with_the_verdict_and_carry_the_window() {
        let at = utc("2026-07-07T12:00:00Z");
        let quotas = [
            quota("q_req", Metric::Requests, Mode::Monitor, 3),
            quota("q_calls", Metric::Calls, Mode::Monitor, 2),
            quota("q_rows", Metric::Rows, Mode::Monitor, 10),
            quota("q_enforced", Metric::Calls, Mode::Enforce, 100),
        ];
        let plan = plan_check(
            &quotas,
            chrono_tz::Tz::UTC,
            &crate::CheckInput {
                caller: crate::Caller::key(&ApiKeyId::parse("k1").expect("key"), None),
                storage_delta: None,
                ..Default::default()
            },
            at,
        );
        // (used, over?) per quota: requests 4 > 3; calls 2 + 1 > 2; rows 9 < 10.
        let outcome = CheckOutcome::of(true, vec![4, 2, 9, 2]);
        let verdict = decide(&quotas, &plan, &outcome, at);
        let got = monitor_breaches(&quotas, &plan, &outcome);
        let ids: Vec<QuotaId> = got.iter().map(|b| b.quota_id.clone()).collect();
        assert_eq!(ids, verdict.monitor_breaches);
        assert_eq!(
            got.iter().map(|b| (b.quota_id.as_str(), b.observed_value)).collect::<Vec<_>>(),
            [("q_req", 4), ("q_calls", 3)]
        );
        assert!(got.iter().all(|b| b.window == WindowKind::Day && b.window_key == "2026-07-07"));

        // Rows at the limit: over, observed as they are.
        let outcome = CheckOutcome::of(true, vec![0, 0, 10, 0]);
        let got = monitor_breaches(&quotas, &plan, &outcome);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].quota_id.as_str(), got[0].observed_value, got[0].limit), ("q_rows", 10, 10));
    }

    #[test]
    fn a_breach_entry_is_once_per_quota_and_window_and_round_trips_as_json() {
        let b = MonitorBreach {
            quota_id: QuotaId::parse("q1").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            metric: Metric::Calls,
            meter_type: None,
            window: WindowKind::Rolling1m,
            window_key: "2026-07-07T12:31Z".into(),
            limit: 5,
            observed_value: 6,
        };
        let at = utc("2026-07-07T12:31:10Z");
        let e = b.entry(AuditId::parse("aud_1").expect("id"), at);
        assert_eq!(e.action.as_str(), "quotas:MonitorBreach");
        assert_eq!(e.principal, None);
        assert_eq!(e.once_key().as_deref(), Some("q1/2026-07-07T12:31Z"));
        let again = b.entry(AuditId::parse("aud_2").expect("id"), at + chrono::Duration::seconds(5));
        assert_eq!(again.once_key(), e.once_key(), "same quota, same window");

        let json = serde_json::to_value(&e.detail).expect("encode");
        assert_eq!(
            json,
            serde_json::json!({
                "kind": "quota_monitor_breach", "metric": "calls", "meter_type": null, "window": "rolling_1m",
                "window_key": "2026-07-07T12:31Z", "limit": 5, "observed_value": 6,
            })
        );
        assert_eq!(serde_json::from_value::<AuditDetail>(json).expect("decode"), e.detail);

        let q = quota("q_calls", Metric::Calls, Mode::Enforce, 2);
        let change = AuditDetail::QuotaChange { before: None, after: Some(Box::new(q)) };
        let json = serde_json::to_value(&change).expect("encode");
        assert_eq!(json["kind"], "quota_change");
        assert_eq!(json["after"]["window"], "day");
        assert_eq!(serde_json::from_value::<AuditDetail>(json).expect("decode"), change);
        for a in AuditAction::ALL {
            assert_eq!(a.as_str().parse::<AuditAction>(), Ok(a));
        }
    }

    #[test]
    fn an_admin_change_to_a_key_or_an_endpoint_shows_no_secret_and_round_trips_as_json() {
        let at = utc("2026-07-07T12:31:10Z");
        let key = ApiKey {
            id: crate::ApiKeyId::parse("key_1").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            name: "ci".into(),
            prefix: "tg_abcdefg".into(),
            grants: Grants { max_concurrent: Some(2), query_timeout: None, max_rows: None },
            role_id: Some(crate::RoleId::parse("role_1").expect("id")),
            created_at: at,
        };
        let e = admin_change(
            AuditId::parse("aud_1").expect("id"),
            &key.project_id,
            AuditAction::CreateApiKey,
            key.id.as_str(),
            AuditDetail::ApiKeyChange { before: None, after: Some(KeyView::from(&key)) },
            &Principal::new("admin", "admin_token"),
            at,
        );
        assert_eq!((e.action.as_str(), e.resource.as_str(), e.once_key()), ("keys:CreateApiKey", "key_1", None));
        let json = serde_json::to_value(&e.detail).expect("encode");
        assert_eq!(
            json,
            serde_json::json!({"kind": "api_key_change", "before": null,
                               "after": {"name": "ci", "prefix": "tg_abcdefg", "role_id": "role_1",
                                         "grants": {"max_concurrent": 2}}})
        );
        assert_eq!(serde_json::from_value::<AuditDetail>(json).expect("decode"), e.detail);

        let endpoint = Endpoint {
            id: crate::WebhookId::parse("wh_1").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            url: "https://hooks.example.com/x".into(),
            event_types: crate::webhook::EventTypes::parse(vec!["quota.*".into()], "event_types").expect("types"),
            description: None,
            enabled: true,
            disabled_reason: None,
            secret: "whsec_new".into(),
            previous_secret: Some(("whsec_old".into(), at)),
            failing_since: None,
            created_at: at,
            updated_at: at,
        };
        let changed = AuditDetail::WebhookChange { before: Some((&endpoint).into()), after: None };
        let text = serde_json::to_string(&changed).expect("encode");
        assert!(!text.contains("whsec_"), "{text}");
        assert_eq!(serde_json::from_str::<AuditDetail>(&text).expect("decode"), changed);
        let rotated = AuditDetail::WebhookSecretRotated { previous_valid_until: at };
        let json = serde_json::to_value(&rotated).expect("encode");
        assert_eq!(json["kind"], "webhook_secret_rotated");
        assert_eq!(serde_json::from_value::<AuditDetail>(json).expect("decode"), rotated);
    }

    fn price(model: &str, component: Component, usd: &str, from: &str) -> Price {
        Price {
            key: crate::PriceKey { provider: "openai".into(), model: model.into(), component },
            unit_price_usd: Usd::parse(usd).expect("price"),
            effective_from: utc(from),
        }
    }

    #[test]
    fn a_write_of_prices_is_one_installation_wide_entry_naming_what_each_row_replaced() {
        let at = utc("2026-07-07T12:00:00Z");
        let by = Principal::new("admin", "admin_token");
        let before = PriceBook::new([
            price("gpt-4o", Component::InputTokens, "0.0000025", "2026-01-01T00:00:00Z"),
            price("gpt-4o", Component::OutputTokens, "0.00001", "2026-01-01T00:00:00Z"),
        ]);
        let written = [
            // A later row of a priced key: replaces the price in effect then.
            price("gpt-4o", Component::InputTokens, "0.000003", "2026-07-01T00:00:00Z"),
            // The same key and instant as a stored row: overwrites it.
            price("gpt-4o", Component::OutputTokens, "0.000012", "2026-01-01T00:00:00Z"),
            // A new key: replaces nothing.
            price("o3", Component::CachedTokens, "0.0000005", "2026-07-01T00:00:00Z"),
            // Before any row of its key: replaces nothing either.
            price("gpt-4o", Component::InputTokens, "0.000002", "2025-06-01T00:00:00Z"),
            // The same key and instant as a row earlier in this write.
            price("o3", Component::CachedTokens, "0.0000004", "2026-07-01T00:00:00Z"),
        ];
        let e = price_change(AuditId::parse("aud_p1").expect("id"), &before, &written, &by, at).expect("an entry");
        assert_eq!(
            (e.project_id.as_ref(), e.action.as_str(), e.resource.as_str(), e.principal.as_ref(), e.created_at),
            (None, "prices:PutPrices", "prices", Some(&by), at)
        );
        assert_eq!((e.log_key(), e.once_key()), (INSTALLATION_KEY, None));
        let AuditDetail::PriceChange { prices } = &e.detail else { panic!("a price change: {:?}", e.detail) };
        let replaced: Vec<Option<String>> =
            prices.iter().map(|r| r.replaced_unit_price_usd.map(|u| u.to_string())).collect();
        assert_eq!(replaced, [Some("0.0000025".into()), Some("0.00001".into()), None, None, Some("0.0000005".into())]);
        assert_eq!(prices.len(), written.len(), "every row written, in order");

        let json = serde_json::to_value(&e.detail).expect("encode");
        assert_eq!(
            json["prices"][0],
            serde_json::json!({"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
                               "unit_price_usd": "0.000003", "effective_from": "2026-07-01T00:00:00Z",
                               "replaced_unit_price_usd": "0.0000025"})
        );
        assert_eq!(json["kind"], "price_change");
        assert_eq!(json["prices"][2]["replaced_unit_price_usd"], serde_json::Value::Null);
        assert_eq!(serde_json::from_value::<AuditDetail>(json).expect("decode"), e.detail);

        assert_eq!(price_change(AuditId::parse("aud_p2").expect("id"), &before, &[], &by, at), None, "no rows");
    }

    #[test]
    fn a_project_entry_is_keyed_by_its_project() {
        let e = MonitorBreach {
            quota_id: QuotaId::parse("q1").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            metric: Metric::Calls,
            meter_type: None,
            window: WindowKind::Day,
            window_key: "2026-07-07".into(),
            limit: 1,
            observed_value: 2,
        }
        .entry(AuditId::parse("aud_1").expect("id"), utc("2026-07-07T12:00:00Z"));
        assert_eq!(e.log_key(), "p1");
    }
}
