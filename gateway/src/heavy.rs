//! Tollgate's own heavy endpoints (ADR-0196 decision 1): the reads whose
//! cost grows with the data they cover — the audit log, usage reports,
//! webhook deliveries — each declare three bounds, as an [`Endpoint`]:
//!
//! - a **concurrency cap per caller** (`TOLLGATE_HEAVY_CONCURRENCY`, 4 by
//!   default): a permit of the installation's permits (the same store and
//!   installation-wide cap as `max_concurrent`, see [`meter::permit`]),
//!   held while the request runs and freed when it ends (or by its lease,
//!   the time bound + 30 s, if the process dies). Over it:
//!   `429 too-many-heavy-requests` with `Retry-After: 1`, naming the
//!   endpoint, the limit and whose it is (`caller` or `installation`);
//! - a **time bound** (`TOLLGATE_HEAVY_TIMEOUT`, 30 s by default): a read
//!   that has not answered by then is cancelled and answered
//!   `503 heavy-request-timed-out`, naming the endpoint;
//! - a **row cap**: a page of the audit log holds at most 1,000 entries and
//!   one of deliveries its own page size (a larger `limit` is a 400), and
//!   offset pages reach only the first 10,000 rows (beyond, the `after`
//!   cursor). A usage report answers one window's groups, unpaged.
//!
//! The caller is the principal of the admin token: every caller of these
//! endpoints presents it. A request without it takes no permit (its
//! handler answers 401).

use std::future::Future;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use meter::{Claimed, PermitClaim, Pool};
use tracing::warn;

use crate::auth::is_admin;
use crate::dto::errors::{ErrorMeta, HeavyMeta};
use crate::error::ApiError;
use crate::state::{AppState, new_permit_id};

/// A heavy endpoint and its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Its name, as a refusal names it: `audit`, `usage`, `deliveries`.
    pub name: &'static str,
    /// Requests one caller may run on it at once.
    pub concurrency: u32,
    /// How long one request may run. (Its row cap is its page size, which
    /// its `limit` parameter is held to: see the module doc.)
    pub time: Duration,
    /// Whose the concurrency cap is: `caller`, or `project` (an export:
    /// one per project at a time, whoever asks).
    pub per: &'static str,
}

impl Endpoint {
    /// The endpoint named `name`, bounded by the server's settings.
    pub fn of(s: &AppState, name: &'static str) -> Endpoint {
        Endpoint { name, concurrency: s.settings.heavy_concurrency, time: s.settings.heavy_timeout, per: "caller" }
    }

    /// The permit holder of one caller on this endpoint.
    fn holder(&self, caller: &str) -> String {
        format!("heavy:{}:{caller}", self.name)
    }
}

/// The principal every caller of the admin API is.
const ADMIN: &str = "admin_token";

/// Middleware for a heavy route: the endpoint's bounds around the handler.
pub async fn guard(State((s, name)): State<(AppState, &'static str)>, req: Request, next: Next) -> Response {
    if !is_admin(req.headers(), &s) {
        return next.run(req).await;
    }
    let endpoint = Endpoint::of(&s, name);
    bounded(&s, endpoint, ADMIN, next.run(req)).await
}

/// Runs `work` for `caller` within `endpoint`'s permit and time bound.
pub async fn bounded(s: &AppState, endpoint: Endpoint, caller: &str, work: impl Future<Output = Response>) -> Response {
    let claim = PermitClaim {
        id: new_permit_id(),
        holder: endpoint.holder(caller),
        cap: endpoint.concurrency,
        installation_cap: s.settings.installation_permits,
        lease: endpoint.time.saturating_add(meter::permit::LEASE_MARGIN),
    };
    let permit = match s.permits.claim(&claim, s.clock.now()).await {
        Ok(Claimed::Granted(p)) => p,
        Ok(Claimed::Full(pool)) => {
            metrics::counter!("tollgate_heavy_refused_total", "endpoint" => endpoint.name).increment(1);
            return too_many(endpoint, pool, s.settings.installation_permits).into_response();
        }
        Err(e) => {
            warn!(error = %e, endpoint = endpoint.name, "heavy request: permits unavailable");
            return ApiError::unavailable("UNAVAILABLE", "a backend is unavailable; retry").into_response();
        }
    };
    let res = match tokio::time::timeout(endpoint.time, work).await {
        Ok(res) => res,
        Err(_) => {
            metrics::counter!("tollgate_heavy_timeouts_total", "endpoint" => endpoint.name).increment(1);
            ApiError::unavailable(
                "heavy-request-timed-out",
                format!("{} did not answer within its time bound of {} ms", endpoint.name, endpoint.time.as_millis()),
            )
            .into_response()
        }
    };
    if let Err(e) = s.permits.release(&permit.id, s.clock.now()).await {
        warn!(error = %e, endpoint = endpoint.name, "heavy request: permit not released; it lapses with its lease");
    }
    res
}

fn too_many(endpoint: Endpoint, pool: Pool, installation: u32) -> ApiError {
    let (limit, whose, message) = match pool {
        Pool::Caller => (
            endpoint.concurrency,
            endpoint.per,
            format!(
                "Too many heavy requests: {} allows {} at once per {}.",
                endpoint.name, endpoint.concurrency, endpoint.per
            ),
        ),
        Pool::Installation => (
            installation,
            "installation",
            format!("Too many heavy requests: the installation holds its {installation} permits."),
        ),
    };
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too-many-heavy-requests", message)
        .with_meta(ErrorMeta::Heavy(Box::new(HeavyMeta {
            endpoint: endpoint.name.to_owned(),
            limit,
            whose: whose.to_owned(),
        })))
        .header("retry-after", "1")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::Request;
    use store::{MemoryView, SqliteLog, SqliteStore};
    use tower::ServiceExt;

    use super::*;
    use crate::Settings;
    use crate::state::SystemClock;

    async fn state(installation_permits: u32) -> AppState {
        let dir = std::env::temp_dir().join(format!("tollgate-heavy-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        let mut settings = Settings::new("adm", "gw");
        settings.installation_permits = installation_permits;
        AppState::new(Arc::new(store), Arc::new(MemoryView::new()), Arc::new(log), Arc::new(SystemClock), settings)
    }

    fn endpoint(concurrency: u32, time: Duration) -> Endpoint {
        Endpoint { name: "audit", concurrency, time, per: "caller" }
    }

    /// A read that answers 200 after `ms`.
    async fn read(ms: u64) -> Response {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        StatusCode::OK.into_response()
    }

    async fn meta(res: Response) -> (u16, serde_json::Value) {
        let status = res.status().as_u16();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 16).await.expect("body");
        (status, serde_json::from_slice(&bytes).unwrap_or_default())
    }

    /// Two at once per caller: the third is refused naming the endpoint,
    /// the limit and whose; another caller is not; once the two end, the
    /// caller is admitted again.
    #[tokio::test]
    async fn a_caller_runs_at_most_its_cap_at_once() {
        let s = state(100).await;
        let e = endpoint(2, Duration::from_secs(5));
        let (a, b, (status, body), other) = tokio::join!(
            bounded(&s, e, "alice", read(400)),
            bounded(&s, e, "alice", read(400)),
            async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                meta(bounded(&s, e, "alice", read(0)).await).await
            },
            async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                bounded(&s, e, "bob", read(0)).await
            },
        );
        assert_eq!((a.status(), b.status(), other.status()), (StatusCode::OK, StatusCode::OK, StatusCode::OK));
        assert_eq!(status, 429);
        assert_eq!(body["error"]["code"], "too-many-heavy-requests", "{body}");
        assert_eq!(body["error"]["meta"], serde_json::json!({"endpoint": "audit", "limit": 2, "whose": "caller"}));
        assert_eq!(bounded(&s, e, "alice", read(0)).await.status(), StatusCode::OK, "freed when they ended");
    }

    /// All heavy requests together stay within the installation's cap.
    #[tokio::test]
    async fn the_installation_cap_spans_callers() {
        let s = state(1).await;
        let e = endpoint(2, Duration::from_secs(5));
        let (a, (status, body)) = tokio::join!(bounded(&s, e, "alice", read(300)), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            meta(bounded(&s, e, "bob", read(0)).await).await
        });
        assert_eq!(a.status(), StatusCode::OK);
        assert_eq!((status, body["error"]["meta"]["whose"].clone()), (429, "installation".into()), "{body}");
        assert_eq!(body["error"]["meta"]["limit"], 1);
    }

    /// A read past its time bound is cancelled and answered 503, and its
    /// permit is freed.
    #[tokio::test]
    async fn a_read_past_its_time_bound_is_cut() {
        let s = state(100).await;
        let e = endpoint(1, Duration::from_millis(100));
        let started = std::time::Instant::now();
        let (status, body) = meta(bounded(&s, e, "alice", read(5_000)).await).await;
        assert!(started.elapsed() < Duration::from_secs(2), "cut at the bound");
        assert_eq!((status, body["error"]["code"].clone()), (503, "heavy-request-timed-out".into()), "{body}");
        assert_eq!(bounded(&s, e, "alice", read(0)).await.status(), StatusCode::OK, "its permit was freed");
    }

    /// The routes are bounded: with the admin token's slots on the audit
    /// endpoint taken, `GET /v1/audit` is refused; a caller without the
    /// token takes no slot and is answered 401.
    #[tokio::test]
    async fn the_audit_route_is_a_heavy_endpoint() {
        let s = state(100).await;
        let e = Endpoint::of(&s, "audit");
        let mut held = Vec::new();
        for _ in 0..e.concurrency {
            let claim = PermitClaim {
                id: new_permit_id(),
                holder: e.holder(ADMIN),
                cap: e.concurrency,
                installation_cap: 100,
                lease: Duration::from_secs(60),
            };
            match s.permits.claim(&claim, s.clock.now()).await.expect("claim") {
                Claimed::Granted(p) => held.push(p),
                Claimed::Full(_) => panic!("a slot is free"),
            }
        }
        let get = |auth: Option<&str>| {
            let mut req = Request::get("/v1/audit?scope=installation");
            if let Some(t) = auth {
                req = req.header("authorization", format!("Bearer {t}"));
            }
            crate::app(s.clone()).oneshot(req.body(Body::empty()).expect("request"))
        };
        let (status, body) = meta(get(Some("adm")).await.expect("infallible")).await;
        assert_eq!((status, body["error"]["meta"]["endpoint"].clone()), (429, "audit".into()), "{body}");
        assert_eq!(get(None).await.expect("infallible").status(), StatusCode::UNAUTHORIZED);
        for p in &held {
            s.permits.release(&p.id, s.clock.now()).await.expect("release");
        }
        assert_eq!(get(Some("adm")).await.expect("infallible").status(), StatusCode::OK);
    }
}
