//! Usage reports (`GET /v1/usage`): a project's durable usage in one
//! calendar window (`day` or `calendar_month`, in the project's time zone),
//! grouped by model, actor, agent or API key.
//!
//! The figures are what the projector has folded (the store's aggregates),
//! so they lag the hot path by the events not yet folded and never count an
//! event twice. Money is exact: picodollar sums printed as decimal dollar
//! strings (`"0.0025"`), never floats.

use std::collections::HashMap;
use std::str::FromStr;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use meter::{CounterKey, Dimension, ModelUsageRow, ProjectId, Totals, Usd, WindowKind, window_at};
use serde_json::{Value, json};

use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;

/// What a report groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Model,
    Actor,
    Agent,
    ApiKey,
}

impl GroupBy {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupBy::Model => "model",
            GroupBy::Actor => "actor",
            GroupBy::Agent => "agent",
            GroupBy::ApiKey => "api_key",
        }
    }
}

impl FromStr for GroupBy {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        [GroupBy::Model, GroupBy::Actor, GroupBy::Agent, GroupBy::ApiKey]
            .into_iter()
            .find(|g| g.as_str() == s)
            .ok_or(())
    }
}

/// A report asked for, its parameters checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    pub project_id: ProjectId,
    pub group_by: GroupBy,
    pub window: WindowKind,
    /// The instant whose window is reported; `None` is now.
    pub at: Option<DateTime<Utc>>,
}

impl TryFrom<&HashMap<String, String>> for UsageQuery {
    type Error = ApiError;
    fn try_from(raw: &HashMap<String, String>) -> ApiResult<UsageQuery> {
        if let Some(k) = raw.keys().find(|k| !["project_id", "group_by", "window", "at"].contains(&k.as_str())) {
            return Err(ApiError::invalid(k.clone(), "is not a known parameter"));
        }
        let project = raw.get("project_id").ok_or_else(|| ApiError::invalid("project_id", "is required"))?;
        let project_id =
            ProjectId::parse(project.clone()).map_err(|e| ApiError::invalid("project_id", e.to_string()))?;
        let group_by = raw.get("group_by").ok_or_else(|| ApiError::invalid("group_by", "is required"))?;
        let group_by = GroupBy::from_str(group_by).map_err(|_| {
            ApiError::invalid("group_by", format!("must be one of model, actor, agent, api_key; got {group_by:?}"))
        })?;
        let window = match raw.get("window").map(String::as_str) {
            None => WindowKind::CalendarMonth,
            Some("day") => WindowKind::Day,
            Some("calendar_month") => WindowKind::CalendarMonth,
            Some(w) => return Err(ApiError::invalid("window", format!("must be day or calendar_month; got {w:?}"))),
        };
        let at = raw
            .get("at")
            .map(|t| {
                DateTime::parse_from_rfc3339(t)
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(|_| ApiError::invalid("at", format!("must be an RFC 3339 timestamp; got {t:?}")))
            })
            .transpose()?;
        Ok(UsageQuery { project_id, group_by, window, at })
    }
}

fn model_json(r: &ModelUsageRow) -> Value {
    json!({
        "provider": r.key.provider, "model": r.key.model, "component": r.key.component.as_str(),
        "meter_type": r.meter.as_str(), "embedding": r.embedding,
        "priced_quantity": r.priced_quantity, "unpriced_quantity": r.unpriced_quantity,
        "cost_usd": r.cost.to_string(),
    })
}

/// One actor, agent or key: its counts and its priced cost on every meter.
fn totals_json(id_field: &str, id: &str, t: &Totals) -> Value {
    let cost = Usd(i64::try_from(t.cost(None)).unwrap_or(i64::MAX));
    json!({
        id_field: id, "requests": t.requests, "calls": t.calls, "rows": t.rows, "tokens": t.tokens,
        "cost_usd": cost.to_string(),
    })
}

/// The id field and id of a counter's dimension, if it is of the group.
fn member(group_by: GroupBy, key: &CounterKey) -> Option<(&'static str, String)> {
    match (group_by, &key.dimension) {
        (GroupBy::Actor, Dimension::Actor(a)) => Some(("actor_id", a.clone())),
        (GroupBy::Agent, Dimension::Agent(g)) => Some(("agent_id", g.clone())),
        (GroupBy::ApiKey, Dimension::ApiKey(k)) => Some(("api_key_id", k.as_str().to_owned())),
        _ => None,
    }
}

#[utoipa::path(get, path = "/v1/usage", tag = "admin",
    params(("project_id" = String, Query, description = "The project"),
           ("group_by" = String, Query, description = "model, actor, agent or api_key"),
           ("window" = Option<String>, Query, description = "day or calendar_month (default), in the project's time zone"),
           ("at" = Option<String>, Query, description = "RFC 3339: report the window containing this instant (default now)")),
    responses((status = 200, description = "{project_id, window, window_key, group_by, data}: for model, one row per \
                (provider, model, component, meter_type, embedding) with priced_quantity, unpriced_quantity and \
                cost_usd; otherwise one row per actor_id, agent_id or api_key_id with requests, calls, rows, tokens \
                and cost_usd (all meters). Folded usage; cost_usd is a decimal string"),
              (status = 400, description = "INVALID_REQUEST naming the parameter"),
              (status = 404, description = "NOT_FOUND: no such project")))]
pub async fn usage(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(raw): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let q = UsageQuery::try_from(&raw)?;
    let project =
        s.store.project(&q.project_id).await?.ok_or_else(|| ApiError::not_found("project", q.project_id.as_str()))?;
    let window = window_at(q.window, project.timezone, q.at.unwrap_or_else(|| s.clock.now()));
    let data: Vec<Value> = match q.group_by {
        GroupBy::Model => {
            s.store.model_usage(&project.id, window.kind, &window.key).await?.iter().map(model_json).collect()
        }
        g => {
            let population = match g {
                GroupBy::Actor => meter::Population::Actors,
                GroupBy::Agent => meter::Population::Agents,
                _ => meter::Population::ApiKeys,
            };
            s.store
                .population_totals(&project.id, population, window.kind, &window.key)
                .await?
                .iter()
                .filter_map(|(k, t)| member(g, k).map(|(field, id)| totals_json(field, &id, t)))
                .collect()
        }
    };
    Ok(Json(json!({
        "project_id": project.id, "window": window.kind.as_str(), "window_key": window.key,
        "group_by": q.group_by.as_str(), "data": data,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn field(e: ApiError) -> String {
        e.meta["field"].as_str().unwrap_or_default().to_owned()
    }

    #[test]
    fn a_query_defaults_to_the_current_month() {
        let q = UsageQuery::try_from(&raw(&[("project_id", "proj_1"), ("group_by", "actor")])).expect("valid");
        assert_eq!((q.group_by, q.window, q.at), (GroupBy::Actor, WindowKind::CalendarMonth, None));
        let q = UsageQuery::try_from(&raw(&[
            ("project_id", "proj_1"),
            ("group_by", "api_key"),
            ("window", "day"),
            ("at", "2026-07-07T12:00:00+05:45"),
        ]))
        .expect("valid");
        assert_eq!(q.window, WindowKind::Day);
        assert_eq!(q.at.map(|t| t.to_rfc3339()), Some("2026-07-07T06:15:00+00:00".to_owned()));
    }

    #[test]
    fn a_bad_parameter_is_named() {
        let cases = [
            (vec![("group_by", "model")], "project_id"),
            (vec![("project_id", "proj_1")], "group_by"),
            (vec![("project_id", "proj_1"), ("group_by", "user")], "group_by"),
            (vec![("project_id", "proj_1"), ("group_by", "model"), ("window", "rolling_1h")], "window"),
            (vec![("project_id", "proj_1"), ("group_by", "model"), ("at", "yesterday")], "at"),
            (vec![("project_id", "proj_1"), ("group_by", "model"), ("limit", "10")], "limit"),
        ];
        for (pairs, name) in cases {
            let e = UsageQuery::try_from(&raw(&pairs)).expect_err(name);
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert_eq!(field(e), name);
        }
    }

    #[test]
    fn only_members_of_the_group_are_listed() {
        let k = |d: Dimension| CounterKey { dimension: d, window: WindowKind::Day, window_key: "2026-07-07".into() };
        assert_eq!(member(GroupBy::ApiKey, &k(Dimension::AllApiKeys)), None);
        assert_eq!(member(GroupBy::Actor, &k(Dimension::Agent("a".into()))), None);
        assert_eq!(member(GroupBy::Agent, &k(Dimension::Agent("a".into()))), Some(("agent_id", "a".to_owned())));
        let t = Totals { calls: 2, cost_llm_tokens: 2_500_000_000, cost_storage: 1, ..Totals::default() };
        assert_eq!(totals_json("actor_id", "u", &t)["cost_usd"], "0.002500000001");
    }

    mod http {
        use std::sync::Arc;

        use axum::body::Body;
        use axum::http::{Request, StatusCode};
        use chrono::TimeZone;
        use meter::{
            Component, EventId, EventKind, FoldBatch, Ledger, ManualClock, OffsetMove, Price, PriceKey, PriceStore,
            Project, TenantStore, TokenUsage, UsageFact,
        };
        use store::{MemoryView, SqliteLog, SqliteStore};
        use tower::ServiceExt;

        use super::*;
        use crate::state::Settings;

        /// The app over a fresh embedded store in `dir`, with one folded tokens
        /// event at 20:00 UTC on 31 July (1 August in Kathmandu) and the clock
        /// an hour later.
        async fn app(dir: &std::path::Path) -> axum::Router {
            let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
            store.migrate().await.expect("migrate");
            let at = Utc.with_ymd_and_hms(2026, 7, 31, 20, 0, 0).single().expect("instant");
            let pid = ProjectId::parse("proj_1").expect("id");
            store
                .create_project(&Project {
                    id: pid.clone(),
                    name: "p".into(),
                    timezone: chrono_tz::Asia::Kathmandu,
                    created_at: at,
                })
                .await
                .expect("project");
            let key = |c| PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: c };
            store
                .put_prices(&[Price {
                    key: key(Component::InputTokens),
                    unit_price_usd: Usd(2_500_000),
                    effective_from: at,
                }])
                .await
                .expect("prices");
            let fact = UsageFact {
                actor_id: Some("user_1".into()),
                agent_id: Some("agent_1".into()),
                tokens: vec![TokenUsage {
                    provider: "openai".into(),
                    model: "gpt-4o".into(),
                    input: 1000,
                    output: 7,
                    ..TokenUsage::default()
                }],
                ..UsageFact::new(EventId::parse("e1").expect("id"), pid, EventKind::Tokens, at)
            };
            let batch = FoldBatch {
                consumer: "projector".into(),
                topic: "tollgate.usage".into(),
                offsets: vec![OffsetMove { partition: 0, from: 0, to: 1 }],
                facts: vec![fact],
            };
            store.fold_batch(&batch).await.expect("fold");
            let log = SqliteLog::new(store.pool().clone(), "tollgate.");
            let clock = ManualClock::new(at + chrono::Duration::hours(1));
            let state = AppState::new(
                Arc::new(store),
                Arc::new(MemoryView::new()),
                Arc::new(log),
                Arc::new(clock),
                Settings::new("adm", "gw"),
            );
            crate::app(state)
        }

        async fn get(app: &axum::Router, uri: &str) -> (StatusCode, Value) {
            let req = Request::get(uri).header("authorization", "Bearer adm").body(Body::empty()).expect("request");
            let res = app.clone().oneshot(req).await.expect("response");
            let status = res.status();
            let body = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
            (status, serde_json::from_slice(&body).expect("json"))
        }

        #[tokio::test]
        async fn usage_reports_the_local_window_by_model_and_by_actor() {
            let dir = std::env::temp_dir().join(format!("tollgate-usage-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir).expect("dir");
            let app = app(&dir).await;

            let (status, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=model").await;
            assert_eq!(status, StatusCode::OK, "{body}");
            assert_eq!(
                body,
                json!({
                    "project_id": "proj_1", "window": "calendar_month", "window_key": "2026-08", "group_by": "model",
                    "data": [
                        { "provider": "openai", "model": "gpt-4o", "component": "input_tokens", "meter_type": "llm_tokens",
                          "embedding": false, "priced_quantity": 1000, "unpriced_quantity": 0, "cost_usd": "0.0025" },
                        { "provider": "openai", "model": "gpt-4o", "component": "output_tokens", "meter_type": "llm_tokens",
                          "embedding": false, "priced_quantity": 0, "unpriced_quantity": 7, "cost_usd": "0" },
                    ],
                })
            );
            let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=actor&window=day").await;
            assert_eq!(body["window_key"], "2026-08-01");
            assert_eq!(
                body["data"],
                json!([{ "actor_id": "user_1", "requests": 0, "calls": 0, "rows": 0, "tokens": 1007, "cost_usd": "0.0025" }])
            );
            let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=agent&window=day").await;
            assert_eq!(body["data"][0]["agent_id"], "agent_1");
            // The day before, in the project's zone: nothing.
            let (_, body) =
                get(&app, "/v1/usage?project_id=proj_1&group_by=model&window=day&at=2026-07-31T18:00:00Z").await;
            assert_eq!((body["window_key"].clone(), body["data"].clone()), (json!("2026-07-31"), json!([])));
            let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=api_key").await;
            assert_eq!(body["data"], json!([]));

            let (status, body) = get(&app, "/v1/usage?project_id=proj_9&group_by=model").await;
            assert_eq!((status, body["error"]["code"].clone()), (StatusCode::NOT_FOUND, json!("NOT_FOUND")));
            let (status, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=model&window=current").await;
            assert_eq!((status, body["error"]["meta"]["field"].clone()), (StatusCode::BAD_REQUEST, json!("window")));
            let req = Request::get("/v1/usage?project_id=proj_1&group_by=model").body(Body::empty()).expect("request");
            assert_eq!(app.clone().oneshot(req).await.expect("response").status(), StatusCode::UNAUTHORIZED);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
