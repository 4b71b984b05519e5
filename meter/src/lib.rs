//! # meter — Tollgate's rules, with no I/O
//!
//! Quotas and their validity rules, window arithmetic in time zones, the
//! fold of usage facts into counters, and the admission verdict. Everything
//! here is a function of its inputs and an explicit `at`; the adapters in
//! `store` implement the [`ports`] declared here.
//!
//! ## Modules
//!
//! Values first, rules on them, ports last: [`ids`], [`error`], [`clock`],
//! [`window`], [`price`], [`quota`], [`tenant`], [`role`], [`usage`] (facts
//! and counters), [`fold`], [`ledger`] (a batch's fold as a store persists
//! it), [`admission`] (plan and verdict), [`apply`] (declarative quota
//! plans), [`audit`], [`report`], [`view`] (with the view's reference model),
//! [`webhook`] (endpoints, notifications, delivery rules), [`alert`] (the
//! quota alerts a folded batch makes due), [`permit`] (`max_concurrent`
//! slots and their leases), and [`ports`], which only declares traits over
//! them. No module imports one
//! that imports it back.
//!
//! ## Accuracy
//!
//! - **`requests` and `calls` are exact** within a window at any
//!   concurrency and across any number of gateways: the view counts the
//!   request (or reserves the call) and compares in one atomic step, and a
//!   refused check reserves nothing. Admitted ≤ limit, with zero overshoot.
//! - **`rows` can overshoot**, because a call's rows are known only after
//!   it ran: a call is admitted while the window's rows are below the limit,
//!   so the window can end over it by at most the rows of the calls in flight
//!   at that moment, each bounded by the call's `max_rows` (the key's or
//!   role's grant narrowing the server's page and stream bounds:
//!   [`Bounds`]). Behind the tower Layer that bound is applied, not
//!   trusted: a page is cut to it and a stream stopped at it, so the rows
//!   the Layer counts for one call never exceed it (tested in
//!   `tests/layer.rs`).
//! - **`tokens` and `cost_usd` are checked before a generation and counted
//!   after it**: a check is refused once the window's usage is at or over
//!   the limit, so a budget overshoots by at most the generations in flight.
//!   Cost is exact money (picodollars, see [`price`]); the view compares it
//!   in doubles, exactly up to about $9,007 per counter and within 4,096
//!   picodollars above, while the durable totals stay exact.
//! - **`storage_bytes` is approximate on the way up**: the footprint is the
//!   last snapshot plus the deltas settled since, and a write is refused when
//!   footprint + its delta exceeds the limit; concurrent writes are not
//!   reserved against each other. Deletes are never refused.
//! - **Durable totals saturate, they never fail**: every quantity and every
//!   event's sums are bounded by 2^53 at ingest ([`usage::MAX_QUANTITY`]),
//!   and a durable sum that would pass `i64::MAX` (a project spending more
//!   than ~$9.2M in one monthly counter) stays at it; the fold goes on.
//! - **The fold is a function of the log**: lateness is judged by each
//!   record's receipt and prices are read as of it ([`UsageFact::receipt`],
//!   [`price::PriceBook::price_as_of`]), never by a clock at fold time, so a
//!   replay gives the live fold's totals to the unit.
//! - **Alerts are exact per window**: `quota.nearly_used` (80 %, 100 %) and
//!   `quota.exceeded` are made by the fold from folded usage and from the
//!   breaches checks put on the log, once per quota and window by their
//!   dedup key ([`alert`]). They follow the fold, so they fire when the
//!   projector folds the crossing event, not at the check; and they judge by
//!   the quotas as they stand when the fold runs.
//! - **`max_concurrent` is exact across gateways** that share their
//!   permits (Redis or PostgreSQL, [`permit`]): a slot is reaped and claimed
//!   in one atomic step, so no more than the cap is ever held at once, and
//!   the installation's cap likewise. A holder that dies keeps its slot
//!   until its lease lapses (the effective `query_timeout` + 30 s), never
//!   longer. The memory permits (`tollgate dev`, the embedded Layer) count
//!   one process's permits only.
//! - **Windows reset, they do not decay**: a `rolling_1m` cap of 60 admits 60
//!   at 12:00:59 and 60 more at 12:01:00.
//! - **Freshness**: a settled call is in the view before its event is
//!   acknowledged; the durable total follows when the projector folds it.
//!   If the view is lost (Redis flushed), it is re-seeded from the durable
//!   totals, which lag the log by the events not yet folded.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod admission;
pub mod alert;
pub mod apply;
pub mod audit;
pub mod clock;
pub mod correction;
pub mod error;
pub mod export;
pub mod fold;
pub mod ids;
pub mod ledger;
pub mod permit;
pub mod ports;
pub mod price;
pub mod quota;
pub mod report;
pub mod role;
pub mod share;
pub mod tenant;
pub mod usage;
pub mod view;
pub mod webhook;
pub mod window;

pub use admission::{
    Breach, BreachKind, Caller, CheckInput, CheckOutcome, CheckPlan, Estimate, Explained, LimitKind, LimitVerdict,
    PlannedLimit, UnpricedFinding, UsageParts, Verdict, Watched, decide, explain, plan_check,
};
pub use apply::{DesiredQuota, QuotaPlan};
pub use audit::{
    AuditAction, AuditBatch, AuditDetail, AuditEntry, EndpointView, INSTALLATION_KEY, KeyView, MonitorBreach,
    PriceAudit, PriceRowChange, Principal, RoleView, admin_change, price_change,
};
pub use clock::{Clock, ManualClock};
pub use correction::{Counted, Target};
pub use error::{FieldError, PortError, PortResult, UnknownName};
pub use fold::{DeadLetter, DlqMark, FactSource, Fold, FoldBatch, FoldReport, OffsetMove, PendingDeadLetter};
pub use ids::{
    ApiKeyId, AuditId, EventId, IdError, MessageId, PermitId, ProjectId, QuotaId, ReservationId, RoleId, WebhookId,
};
pub use ledger::{
    BatchFold, FactOutcome, FootprintRead, ModelUsageAdd, ModelUsageChange, Posting, StorageFact, StorageKind,
    StoredFootprint, UnknownProject,
};
pub use permit::{Claimed, OwnCap, Permit, PermitClaim, PermitModel, Pool, Whose};
pub use ports::*;
pub use price::{Component, MeterType, Price, PriceBook, PriceKey, PriceVersion, Priced, TokenUsage, Usd};
pub use quota::{Metric, Mode, OnUnpriced, Quota, QuotaDraft, QuotaPatch, QuotaSpec, Scope};
pub use report::{ModelUsageRow, Population, UnpricedException, UnpricedRow};
pub use role::{Bounds, Per, Role, RoleQuota};
pub use tenant::{ApiKey, Grants, Project};
pub use usage::{
    Counter, CounterKey, Dimension, EventKind, Field, Footprint, LoggedBreach, Outcome, Totals, UsageFact,
};
pub use view::{CounterUsage, Hold, ProjectDump, Seed, SeedHold, Settlement, ViewModel, seed_from_tail};
pub use webhook::{Attempt, DeliveryStatus, DueDelivery, Endpoint, EndpointChange, EventTypes, Next, Notification};
pub use window::{Window, WindowKind, window_at};
