//! The service layer: Tollgate's operations, between the ways in and the ports.
//!
//! The HTTP handlers, the tower [`Layer`](crate::TollgateLayer),
//! `tollgate apply`, `tollgate dev` and the examples all call these
//! functions, so an operation (admitting a call, recording its usage,
//! provisioning a project and a key, changing quotas…) is written once. They
//! take domain values — already parsed: ids, metrics, windows, limits — and
//! the [`AppState`](crate::AppState) (or just the [`Stores`](crate::state::Stores)
//! where no view or log is involved, for the CLI), and return an [`Error`]
//! that names the refusal. They know nothing of HTTP: `ApiError` maps an
//! [`Error`] to the status, code, body and headers the API answers with.
//!
//! Store lookups that decide whether an input is acceptable (the project
//! exists, the key belongs to the project, the role is the project's)
//! happen here, not while parsing: parsing is pure.

pub mod admission;
pub mod audit;
pub mod export_schedules;
pub mod exports;
pub mod permits;
pub mod pricing;
pub mod provisioning;
pub mod quotas;
pub mod recording;
pub mod usage;
pub mod webhooks;

use chrono::{DateTime, SubsecRound, Utc};
use meter::{Breach, Clock, FieldError, PortError, PriceKey, Principal, ProjectId};

pub use admission::{Admission, Remaining};

/// Why an operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller's input was refused; nothing changed.
    #[error(transparent)]
    Invalid(#[from] FieldError),
    /// What was named does not exist (or no longer does).
    #[error("{what} {id} does not exist")]
    NotFound { what: &'static str, id: String },
    /// The caller is not who it claims, or no longer exists; `field` names
    /// the input that identified it, if one did.
    #[error("{message}")]
    Unauthenticated { message: String, field: Option<&'static str> },
    /// A quota refused the check (a refusal is a verdict, reported as one).
    #[error("refused by quota {}", .0.breach.quota_id)]
    Refused(Box<Refusal>),
    /// A refusal answered with every limit the check evaluated.
    #[error("{error}")]
    Explained { error: Box<Error>, explain: Vec<meter::Explained> },
    /// A permit pool was full: the caller's own (its key's or role's
    /// `max_concurrent`) or the installation's. Nothing was taken, reserved
    /// or counted; never queued (429 `TOO_MANY_CONCURRENT`, `Retry-After: 1`).
    #[error("too many concurrent calls: the {} limit of {limit} is reached", whose.as_str())]
    TooManyConcurrent {
        limit: u32,
        whose: meter::Whose,
        /// The key's or role's id (`None` for the installation's).
        owner: Option<String>,
    },
    /// An export of the project is running (one per project at a time,
    /// whoever started it): 429 `too-many-heavy-requests`.
    #[error("an export of project {project} is running: one per project at a time")]
    ExportRunning { project: String },
    /// A quota with the same identity exists.
    #[error("a quota with the same project, scope, scope_ref, metric, window and meter_type exists")]
    QuotaConflict,
    /// Another uniqueness rule of the store was hit.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The log did not acknowledge the events (in time); none is
    /// acknowledged. Their usage stays in the view and they stay queued for
    /// the log (see [`recording`]): the caller retries with the same ids.
    #[error("the event log did not acknowledge the events; retry with the same ids")]
    LogUnavailable,
    /// The view could not be reached and the policy refuses the check.
    #[error("quota view unreachable; the check is refused by policy")]
    ViewUnavailable,
    /// A backend failed (transient or not, as the adapter decided).
    #[error(transparent)]
    Backend(PortError),
}

impl Error {
    /// A refusal of the input, naming the field.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid(FieldError::new(field, message))
    }

    pub fn not_found(what: &'static str, id: impl Into<String>) -> Self {
        Error::NotFound { what, id: id.into() }
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Error::Unauthenticated { message: message.into(), field: None }
    }
}

impl From<PortError> for Error {
    fn from(e: PortError) -> Self {
        match e {
            PortError::Conflict(m) => Error::Conflict(m),
            e => Error::Backend(e),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A check a quota refused: the breach the verdict reports, what the
/// caller's headers say of the quotas, and for a pricing blackout the usage
/// that could not be priced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub project: ProjectId,
    pub breach: Breach,
    pub remaining: Remaining,
    /// For `BreachKind::Unenforceable` only: the unpriced (provider, model,
    /// component) rows of the breached counter, at most
    /// [`meter::price::MAX_UNPRICED_ROWS`].
    pub unpriced_rows: Vec<PriceKey>,
}

/// One page of a list, and the cursor of the next (`None` on the last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

/// The time, at the store's precision (the microsecond), so what an
/// operation answers is what a later read gives back.
pub fn now_micros(clock: &dyn Clock) -> DateTime<Utc> {
    clock.now().trunc_subsecs(6)
}

/// Who the admin API's changes are audited as.
pub fn admin_api() -> Principal {
    Principal::new("admin", "admin_token")
}
