//! Admin routes for billing exports: run one, read a run, download its file.

use axum::Json;
use axum::body::Body as HttpBody;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use meter::export::{ExportSpec, RunStatus};

use crate::auth::AdminAuth;
use crate::dto::Body;
use crate::dto::errors::ErrorBody;
use crate::dto::exports::{ExportBody, ExportRunView, NewExport};
use crate::error::{ApiError, ApiResult};
use crate::heavy::{Endpoint, bounded};
use crate::service::{admin_api, exports};
use crate::state::AppState;

/// How long past its own time bound a run may take to end (record what it
/// wrote, reconcile) before the request is cut.
const ENDING: std::time::Duration = std::time::Duration::from_secs(120);

#[utoipa::path(post, path = "/v1/exports", tag = "admin", security(("admin_token" = [])),
    request_body = ExportBody,
    responses(
        (status = 201, description = "The run, as it ended: `complete` (reconciled against the fold), `partial` \
            (stopped at the row cap or the time bound: `mark` is ROWS or TIME, the next run writes the rest) or \
            `failed` (`error` says why)", body = ExportRunView),
        (status = 400, description = "INVALID_REQUEST naming the field; nothing ran", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "dimensions[1]: `team` is not one of project, api_key, actor, agent, user", "meta": {"field": "dimensions[1]"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
        (status = 429, description = "too-many-heavy-requests: an export of this project is running (one per project at a time); Retry-After: 1", body = ErrorBody,
         example = json!({"error": {"code": "too-many-heavy-requests", "message": "Too many heavy requests: exports allows 1 at once per project.", "meta": {"endpoint": "exports", "limit": 1, "whose": "project"}}})),
    ))]
pub async fn create_export(_: AdminAuth, State(s): State<AppState>, Body(body): Body<ExportBody>) -> Response {
    let new = match NewExport::try_from(body) {
        Ok(n) => n,
        Err(e) => return ApiError::from(crate::service::Error::Invalid(e)).into_response(),
    };
    let spec = match ExportSpec::new(new.project_id.clone(), new.period, new.dimensions, new.grace) {
        Ok(spec) => spec,
        Err(e) => return ApiError::from(crate::service::Error::Invalid(e)).into_response(),
    };
    let endpoint = Endpoint {
        name: "exports",
        concurrency: 1,
        time: s.settings.exports.max_time.saturating_add(ENDING),
        per: "project",
    };
    let caller = format!("project:{}", new.project_id);
    let work = async {
        match exports::start(&s, spec, new.format, admin_api()).await {
            Ok(run) => (StatusCode::CREATED, Json(ExportRunView::of(&run, true))).into_response(),
            Err(e) => ApiError::from(e).into_response(),
        }
    };
    bounded(&s, endpoint, &caller, work).await
}

#[utoipa::path(get, path = "/v1/exports/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The run (`exr_…`)")),
    responses(
        (status = 200, description = "The run", body = ExportRunView),
        (status = 404, description = "NOT_FOUND: no such run", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "export run exr_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_export(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<ExportRunView>> {
    let run = exports::get(&s, &id).await?;
    Ok(Json(ExportRunView::of(&run, downloadable(&s, &run))))
}

/// Whether the run's file is one this server wrote and holds.
pub(crate) fn downloadable(s: &AppState, run: &meter::export::ExportRun) -> bool {
    run.status != RunStatus::Failed
        && run.file.as_deref().is_some_and(|f| std::path::Path::new(f).starts_with(&s.settings.exports.dir))
}

#[utoipa::path(get, path = "/v1/exports/{id}/file", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The run (`exr_…`)")),
    responses(
        (status = 200, description = "The run's file, streamed, as its format: CSV (`text/csv`, shown), JSON Lines \
            (`application/jsonl`) or Parquet (`application/vnd.apache.parquet`)", body = String,
         content_type = "text/csv; charset=utf-8",
         example = "export_run_id,watermark,billing_period,charge_period_start,charge_period_end,charge_class,project_id,customer_type,customer_id,metric,meter_type,provider,model,component,consumed_quantity,priced_quantity,unpriced_quantity,unit_price_usd,cost_usd,currency,unpriced_reason\r\nexr_0193,0:7,2026-12-02,2026-12-02T00:00:00Z,2026-12-03T00:00:00Z,usage,proj_01j9,actor,cust_42,calls,,,,,12,,,,,,\r\n"),
        (status = 404, description = "NOT_FOUND: no such run, or no file this server holds (a run of `tollgate export` wrote it elsewhere)", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "export file exr_0193 does not exist", "meta": {}}})),
    ))]
pub async fn export_file(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    let run = exports::get(&s, &id).await?;
    let missing = || ApiError::from(crate::service::Error::not_found("export file", id.clone()));
    let Some(path) = run.file.as_deref().filter(|_| downloadable(&s, &run)) else { return Err(missing()) };
    let file = tokio::fs::File::open(path).await.map_err(|_| missing())?;
    let body = HttpBody::from_stream(tokio_util::io::ReaderStream::new(file));
    let name = format!("attachment; filename=\"{}.{}\"", run.id, run.format.extension());
    Ok(([(header::CONTENT_TYPE, run.format.content_type().to_owned()), (header::CONTENT_DISPOSITION, name)], body)
        .into_response())
}
