//! The console: web pages where operators see projects, keys and their
//! usage against quotas, and change a key's grants — served by the gateway
//! at `/console`, server-rendered from templates compiled into the binary
//! ([`view`]), with its stylesheet served by Tollgate itself. Nothing is
//! fetched from elsewhere and no page needs JavaScript.
//!
//! The pages are not API routes (they are not in the route table or
//! `/openapi.json`). Their handlers are shaped like the API's: the
//! [`Session`] extractor first (a GET without one is sent to the sign-in
//! page, anything else answered 401), a form's CSRF token checked before
//! it is read (403, changing nothing), the form read into the API's own
//! request body ([`form`]), one call into [`crate::service`] — the same
//! call, with the same validation, as the API route — and the result
//! rendered. A refusal re-renders the form with the field's message;
//! nothing changed.
//!
//! Every answer carries a Content-Security-Policy that allows only
//! Tollgate's own stylesheet, `Cache-Control: no-store` (a page may show a
//! secret once) and refuses framing.

pub mod exports;
pub mod feeds;
pub mod form;
pub mod health;
pub mod session;
pub mod view;

use std::collections::HashMap;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_FRAME_OPTIONS};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use maud::Markup;
use meter::{ApiKeyId, ProjectId};

use self::form::Fields;
use self::session::{SESSION_COOKIE, SESSION_TTL, SIGN_IN_COOKIE, SIGN_IN_PATH, Session, set_cookie, with_cookie};
use self::view::{Bar, FormState, Issued, KeyRow};
use crate::error::ApiError;
use crate::service::provisioning::{self, ProjectSummary};
use crate::service::{self, admin_api, quotas};
use crate::state::{AppState, same_secret};

/// The console's stylesheet, compiled in.
const STYLESHEET: &str = include_str!("console.css");

/// The console's pages, to merge into the app's router.
pub fn router() -> Router<AppState> {
    Router::new()
        // The root sends a browser to the console.
        .route("/", get(|| async { Redirect::to("/console") }))
        .route("/console", get(projects))
        .route(SIGN_IN_PATH, get(sign_in_form).post(sign_in))
        .route("/console/sign-out", post(sign_out))
        .route("/console/static/console.css", get(stylesheet))
        .route("/console/projects/{id}", get(project))
        .route("/console/projects/{id}/keys", post(create_key))
        .route("/console/projects/{id}/keys/{key_id}", get(key))
        .route("/console/projects/{id}/keys/{key_id}/grants", post(set_grants))
        .route("/console/projects/{id}/quotas", get(quotas_page))
        .route("/console/projects/{id}/quotas/{quota_id}", get(quota_page))
        .route("/console/projects/{id}/quotas/{quota_id}/mode", post(set_mode))
        .route("/console/projects/{id}/usage", get(usage_page))
        .route("/console/projects/{id}/breaches", get(feeds::breaches_page))
        .route("/console/projects/{id}/audit", get(feeds::audit_page))
        .route("/console/projects/{id}/exceptions", get(feeds::exceptions_page))
        .route("/console/projects/{id}/webhooks", get(feeds::webhooks_page))
        .route("/console/projects/{id}/webhooks/{webhook_id}", get(feeds::webhook_page))
        .route("/console/projects/{id}/webhooks/{webhook_id}/deliveries/{message_id}/resend", post(feeds::resend))
        .route("/console/health", get(health::health_page))
        .route("/console/projects/{id}/exports", get(exports::exports_page))
        .route("/console/projects/{id}/exports/{run_id}/file", get(exports::export_file))
        .layer(axum::middleware::from_fn(protect))
}

/// The headers every console answer carries.
async fn protect(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.entry(CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    res
}

/// An HTML answer.
pub(crate) fn html(status: StatusCode, markup: Markup) -> Response {
    (status, [(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"))], markup.into_string())
        .into_response()
}

/// A service refusal or failure as a page, with the status and message the
/// API would answer (a backend failure is logged once, by that mapping).
fn failure(e: service::Error) -> Response {
    let e = ApiError::from(e);
    let title = e.status.canonical_reason().unwrap_or("Error");
    html(e.status, view::message_page(title, &e.message, false))
}

/// A refusal of a form's field or a page's parameter, as the API gives it
/// (400, naming the field), on a page of its own.
pub(crate) fn refused(e: &meter::FieldError) -> Response {
    html(StatusCode::BAD_REQUEST, view::message_page("Bad request", &format!("{}: {}", e.field, e.message), false))
}

/// A POST whose CSRF token is missing or wrong: refused, nothing read or changed.
fn forbidden() -> Response {
    html(
        StatusCode::FORBIDDEN,
        view::message_page(
            "Forbidden",
            "The form's CSRF token is missing or wrong; reload the page and try again.",
            false,
        ),
    )
}

async fn stylesheet() -> Response {
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static("text/css; charset=utf-8")),
            (CACHE_CONTROL, HeaderValue::from_static("public, max-age=3600")),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// The sign-in form (or, signed in already, a 303 to `/console`).
async fn sign_in_form(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if session::signed_in(&s, &headers) {
        return Redirect::to("/console").into_response();
    }
    let nonce = session::sign_in_nonce();
    let res = html(StatusCode::OK, view::sign_in(&nonce, None));
    with_cookie(res, set_cookie(SIGN_IN_COOKIE, &nonce, SIGN_IN_PATH, 3600, session::over_https(&headers)))
}

/// Signs in with the admin token typed into the form: a session cookie and
/// a 303 to `/console`, or the form again (401) after a wrong token.
async fn sign_in(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let fields = Fields::parse(&body);
    if !session::sign_in_csrf_ok(&headers, fields.get("csrf")) {
        return forbidden();
    }
    let secure = session::over_https(&headers);
    if let Err(e) = fields.only(&["token"]) {
        let nonce = session::sign_in_nonce();
        let res = html(StatusCode::BAD_REQUEST, view::sign_in(&nonce, Some(&format!("{}: {}", e.field, e.message))));
        return with_cookie(res, set_cookie(SIGN_IN_COOKIE, &nonce, SIGN_IN_PATH, 3600, secure));
    }
    if !fields.get("token").is_some_and(|t| same_secret(t, &s.settings.admin_token)) {
        let nonce = session::sign_in_nonce();
        let res = html(StatusCode::UNAUTHORIZED, view::sign_in(&nonce, Some("That is not the admin token.")));
        return with_cookie(res, set_cookie(SIGN_IN_COOKIE, &nonce, SIGN_IN_PATH, 3600, secure));
    }
    let cookie = session::new_session(&s, s.clock.now());
    let res = with_cookie(
        Redirect::to("/console").into_response(),
        set_cookie(SESSION_COOKIE, &cookie, "/console", SESSION_TTL.num_seconds(), secure),
    );
    with_cookie(res, set_cookie(SIGN_IN_COOKIE, "", SIGN_IN_PATH, 0, secure))
}

async fn sign_out(headers: HeaderMap, Posted(fields): Posted) -> Response {
    if let Err(e) = fields.only(&[]) {
        return refused(&e);
    }
    let cleared = set_cookie(SESSION_COOKIE, "", "/console", 0, session::over_https(&headers));
    with_cookie(Redirect::to(SIGN_IN_PATH).into_response(), cleared)
}

async fn projects(session: Session, State(s): State<AppState>) -> Response {
    match provisioning::projects(&s).await {
        Ok(list) => html(StatusCode::OK, view::projects(&session.csrf, &list)),
        Err(e) => failure(e),
    }
}

/// A project id from a path: one that cannot be an id names nothing (404).
fn project_id(raw: String) -> service::Result<ProjectId> {
    crate::dto::path_id("project", raw, ProjectId::parse)
}

/// A signed-in request for a page under `/console/projects/{id}`: the
/// session (without one, as [`Session`] answers) and the path's project id
/// (one that cannot be an id names nothing: 404).
pub(crate) struct InProject {
    session: Session,
    id: ProjectId,
}

impl FromRequestParts<AppState> for InProject {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, Response> {
        let session = Session::from_request_parts(parts, s).await?;
        let Path(params) =
            Path::<HashMap<String, String>>::from_request_parts(parts, s).await.map_err(IntoResponse::into_response)?;
        let id = project_id(params.get("id").cloned().unwrap_or_default()).map_err(failure)?;
        Ok(InProject { session, id })
    }
}

/// A console form's fields, posted with the session's CSRF token. Without
/// a session, as [`Session`] answers; with the token missing or wrong, 403
/// and nothing read or changed.
pub(crate) struct Posted(Fields);

impl FromRequest<AppState> for Posted {
    type Rejection = Response;

    async fn from_request(req: Request, s: &AppState) -> Result<Self, Response> {
        let (mut parts, body) = req.into_parts();
        let session = Session::from_request_parts(&mut parts, s).await?;
        let body =
            Bytes::from_request(Request::from_parts(parts, body), s).await.map_err(IntoResponse::into_response)?;
        let fields = Fields::parse(&body);
        if !session.csrf_ok(s, fields.get("csrf")) {
            return Err(forbidden());
        }
        Ok(Posted(fields))
    }
}

/// A quota's usage bar, from its current usage.
fn quota_bar(q: &meter::Quota, u: quotas::CurrentUsage, whose: &str) -> Bar {
    let sp = &q.spec;
    Bar {
        id: q.id.to_string(),
        label: format!("{} per {} ({whose})", sp.metric.as_str(), sp.window.as_str()),
        metric: sp.metric,
        count: u.count,
        limit: sp.limit,
        window_key: u.window_key,
        resets_at: u.resets_at,
        mode: sp.mode.as_str(),
    }
}

/// The usage bar of each of `listed` that has one, keyed by quota id: each
/// quota's counter read once per page, since a quota on the project or on
/// all keys together shows the same bar on every key's row.
async fn bars_of<'a>(
    s: &AppState,
    p: &meter::Project,
    listed: impl IntoIterator<Item = &'a quotas::Listed>,
    at: chrono::DateTime<chrono::Utc>,
) -> service::Result<HashMap<&'a meter::QuotaId, Bar>> {
    let mut bars = HashMap::new();
    for l in listed {
        let Some(u) = quotas::current_usage(s, p, &l.quota, l.inert, at).await? else { continue };
        let whose = match (&l.quota.spec.scope, &l.quota.spec.scope_ref) {
            (meter::Scope::Project, _) => "the whole project",
            (_, None) => "all keys together",
            _ => "this key",
        };
        bars.insert(&l.quota.id, quota_bar(&l.quota, u, whose));
    }
    Ok(bars)
}

/// The bars of `applying`, in its order.
fn bars_in(applying: &[&quotas::Listed], bars: &HashMap<&meter::QuotaId, Bar>) -> Vec<Bar> {
    applying.iter().filter_map(|l| bars.get(&l.quota.id).cloned()).collect()
}

/// A project's quotas by the keys they count: those on one key under its
/// id, those on every key (and the project's) for all.
struct ByKey<'a> {
    all: Vec<&'a quotas::Listed>,
    one: HashMap<&'a str, Vec<&'a quotas::Listed>>,
}

impl<'a> ByKey<'a> {
    fn of(listed: &'a [quotas::Listed]) -> Self {
        let mut by = ByKey { all: Vec::new(), one: HashMap::new() };
        for l in listed {
            match (l.quota.spec.scope, l.quota.spec.scope_ref.as_deref()) {
                (meter::Scope::Project, _) | (meter::Scope::ApiKey, None) => by.all.push(l),
                (meter::Scope::ApiKey, Some(k)) => by.one.entry(k).or_default().push(l),
                _ => {}
            }
        }
        by
    }

    /// The quotas counting `key`'s calls, in the project's order.
    fn of_key(&self, key: &meter::ApiKey) -> Vec<&'a quotas::Listed> {
        let mut out: Vec<&quotas::Listed> = self.all.clone();
        out.extend(self.one.get(key.id.as_str()).into_iter().flatten().copied());
        out.sort_by(|a, b| (a.quota.created_at, &a.quota.id).cmp(&(b.quota.created_at, &b.quota.id)));
        out
    }
}

/// The bars of a key's role quota (calls and rows this period).
fn role_bars(d: &provisioning::KeyDetail) -> Vec<Bar> {
    let Some(q) = d.quota else { return Vec::new() };
    let role = d.key.role_id.as_ref().map_or_else(String::new, ToString::to_string);
    [(meter::Metric::Calls, q.calls, d.calls), (meter::Metric::Rows, q.rows, d.rows)]
        .into_iter()
        .filter_map(|(metric, limit, count)| {
            limit.map(|limit| Bar {
                id: format!("role:{role}:{}", metric.as_str()),
                label: format!("{} per {} (its role's quota)", metric.as_str(), q.per.as_str()),
                metric,
                count,
                limit,
                window_key: d.period.key.clone(),
                resets_at: d.period.resets_at,
                mode: "enforce",
            })
        })
        .collect()
}

/// The project page, with the form as given and, after a creation, the new secret.
async fn project_page(
    s: &AppState,
    session: &Session,
    id: &ProjectId,
    form: &FormState,
    issued: Option<&provisioning::IssuedKey>,
    status: StatusCode,
) -> Response {
    let render = async {
        let project = provisioning::project(s, id).await?;
        let keys = provisioning::api_keys(s, id).await?;
        let roles = provisioning::roles(s, id).await?;
        let quotas = quotas::list_knowing(s, id, &keys).await?;
        let by_key = ByKey::of(&quotas);
        let bars = bars_of(s, &project, &quotas, s.clock.now()).await?;
        let rows: Vec<KeyRow<'_>> =
            keys.iter().map(|key| KeyRow { key, bars: bars_in(&by_key.of_key(key), &bars) }).collect();
        let summary = ProjectSummary { keys: keys.len(), quotas: quotas.len(), project };
        let issued = issued.map(|i| Issued { key: &i.key, secret: &i.secret });
        Ok::<_, service::Error>(view::project(&session.csrf, &summary, &rows, &roles, form, issued))
    };
    match render.await {
        Ok(markup) => html(status, markup),
        Err(e) => failure(e),
    }
}

async fn project(p: InProject, State(s): State<AppState>) -> Response {
    project_page(&s, &p.session, &p.id, &FormState::default(), None, StatusCode::OK).await
}

/// The new-key form: `POST /v1/projects/{id}/api-keys`'s body and call. The
/// page that answers shows the secret this once (it is never in a URL).
async fn create_key(
    InProject { session, id }: InProject,
    State(s): State<AppState>,
    Posted(fields): Posted,
) -> Response {
    let refused = |e| FormState { fields: fields.clone(), error: Some(e) };
    let new = match fields.new_key() {
        Ok(new) => new,
        Err(e) => return project_page(&s, &session, &id, &refused(e), None, StatusCode::BAD_REQUEST).await,
    };
    match provisioning::create_api_key(&s, &id, new, &admin_api()).await {
        Ok(issued) => project_page(&s, &session, &id, &FormState::default(), Some(&issued), StatusCode::OK).await,
        Err(service::Error::Invalid(e)) => {
            project_page(&s, &session, &id, &refused(e), None, StatusCode::BAD_REQUEST).await
        }
        Err(e) => failure(e),
    }
}

/// The key page, with the grant form as given (or as the key has it).
async fn key_page(
    s: &AppState,
    session: &Session,
    pid: &ProjectId,
    kid: &ApiKeyId,
    form: Option<&FormState>,
    status: StatusCode,
) -> Response {
    let render = async {
        let detail = provisioning::api_key(s, kid).await?;
        // A key is shown under its own project only.
        if &detail.key.project_id != pid {
            return Err(service::Error::not_found("api key", kid.as_str()));
        }
        let p = summary(s, pid).await?;
        let roles = provisioning::roles(s, pid).await?;
        let applying = quotas::applying_to_key(s, &detail.key).await?;
        let read = bars_of(s, &p.project, &applying, s.clock.now()).await?;
        let mut bars = bars_in(&applying.iter().collect::<Vec<_>>(), &read);
        bars.extend(role_bars(&detail));
        let current = FormState { fields: view::grant_fields(&detail.key), error: None };
        Ok(view::key(&session.csrf, &p, &detail, &bars, &roles, form.unwrap_or(&current)))
    };
    match render.await {
        Ok(markup) => html(status, markup),
        Err(e) => failure(e),
    }
}

/// The key id of a key's path (one malformed names nothing: 404).
fn key_id(raw: String) -> service::Result<ApiKeyId> {
    crate::dto::path_id("api key", raw, ApiKeyId::parse)
}

async fn key(p: InProject, State(s): State<AppState>, Path((_, key_id)): Path<(String, String)>) -> Response {
    match self::key_id(key_id) {
        Ok(kid) => key_page(&s, &p.session, &p.id, &kid, None, StatusCode::OK).await,
        Err(e) => failure(e),
    }
}

/// The grant form: the key's grants and role, validated as the API
/// validates them; a 303 back to the key, or the form again with the refusal.
async fn set_grants(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Path((_, key_id)): Path<(String, String)>,
    Posted(fields): Posted,
) -> Response {
    let kid = match self::key_id(key_id) {
        Ok(kid) => kid,
        Err(e) => return failure(e),
    };
    let refused = |e| FormState { fields: fields.clone(), error: Some(e) };
    let change = match fields.key_grants() {
        Ok(c) => c,
        Err(e) => return key_page(&s, &session, &pid, &kid, Some(&refused(e)), StatusCode::BAD_REQUEST).await,
    };
    // Only a key of the project in the path is changed.
    match provisioning::api_key(&s, &kid).await {
        Ok(d) if d.key.project_id == pid => {}
        Ok(_) => return failure(service::Error::not_found("api key", kid.as_str())),
        Err(e) => return failure(e),
    }
    match provisioning::set_grants(&s, &kid, change, &admin_api()).await {
        Ok(_) => Redirect::to(&view::key_href(pid.as_str(), kid.as_str())).into_response(),
        Err(service::Error::Invalid(e)) => {
            key_page(&s, &session, &pid, &kid, Some(&refused(e)), StatusCode::BAD_REQUEST).await
        }
        Err(e) => failure(e),
    }
}

/// A project with its counts, for a page's header.
async fn summary(s: &AppState, pid: &ProjectId) -> service::Result<ProjectSummary> {
    let project = provisioning::project(s, pid).await?;
    let keys = s.stores.tenants.api_keys(pid).await?.len();
    let quotas = s.stores.quotas.quotas(pid).await?.len();
    Ok(ProjectSummary { project, keys, quotas })
}

/// The quotas page, with a refusal of the mode switch if there was one.
async fn quotas_view(
    s: &AppState,
    session: &Session,
    pid: &ProjectId,
    error: Option<&meter::FieldError>,
) -> service::Result<Markup> {
    let keys = provisioning::api_keys(s, pid).await?;
    let listed = quotas::list_knowing(s, pid, &keys).await?;
    let p = ProjectSummary { project: provisioning::project(s, pid).await?, keys: keys.len(), quotas: listed.len() };
    let at = s.clock.now();
    let mut rows = Vec::with_capacity(listed.len());
    for l in &listed {
        let usage = quotas::current_usage(s, &p.project, &l.quota, l.inert, at).await?;
        let bar = usage.map(|u| quota_bar(&l.quota, u, &view::scope_text(&l.quota)));
        rows.push(view::QuotaRow { quota: &l.quota, inert: l.inert, bar });
    }
    Ok(view::quotas(&session.csrf, &p, &rows, error))
}

async fn quotas_page(p: InProject, State(s): State<AppState>) -> Response {
    match quotas_view(&s, &p.session, &p.id, None).await {
        Ok(markup) => html(StatusCode::OK, markup),
        Err(e) => failure(e),
    }
}

/// The quota of a quota's path, one of that project's (404 otherwise).
async fn project_quota(s: &AppState, pid: &ProjectId, quota_id: String) -> service::Result<quotas::Detail> {
    let qid = crate::dto::path_id("quota", quota_id, meter::QuotaId::parse)?;
    let detail = quotas::get(s, &qid).await?;
    if &detail.quota.spec.project_id != pid {
        return Err(service::Error::not_found("quota", qid.as_str()));
    }
    Ok(detail)
}

async fn quota_page(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Path((_, quota_id)): Path<(String, String)>,
) -> Response {
    let shown = async {
        let d = project_quota(&s, &pid, quota_id).await?;
        let p = summary(&s, &pid).await?;
        let at = s.clock.now();
        let series = quotas::series(&s, &p.project, &d.quota, d.inert, at).await?;
        // How many slices the whole window has: the chart's width.
        let tz = p.project.timezone;
        let window = meter::window_at(d.quota.spec.window, tz, at);
        let slots = service::usage::slices(&window, tz, window.resets_at.unwrap_or(at)).len();
        let bar = d.current_usage.clone().map(|u| quota_bar(&d.quota, u, &view::scope_text(&d.quota)));
        let row = view::QuotaRow { quota: &d.quota, inert: d.inert, bar };
        Ok::<_, service::Error>(view::quota(&session.csrf, &p, &row, &series, slots))
    };
    match shown.await {
        Ok(markup) => html(StatusCode::OK, markup),
        Err(e) => failure(e),
    }
}

/// The mode switch: `PATCH /v1/quotas/{id}`'s body (`{"mode"}`) and call;
/// a 303 back to the page it was on, or the quotas page again with the refusal.
async fn set_mode(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Path((_, quota_id)): Path<(String, String)>,
    Posted(fields): Posted,
) -> Response {
    let d = match project_quota(&s, &pid, quota_id).await {
        Ok(found) => found,
        Err(e) => return failure(e),
    };
    let edit = match fields.quota_mode() {
        Ok(edit) => edit,
        Err(e) => return mode_refused(&s, &session, &pid, &e).await,
    };
    match quotas::edit(&s, &d.quota.id, edit).await {
        Ok(_) => {
            let back = match fields.get("from") {
                Some("quotas") => format!("{}/quotas", view::project_href(pid.as_str())),
                _ => view::quota_href(pid.as_str(), d.quota.id.as_str()),
            };
            Redirect::to(&back).into_response()
        }
        Err(service::Error::Invalid(e)) => mode_refused(&s, &session, &pid, &e).await,
        Err(e) => failure(e),
    }
}

/// The quotas page again, 400, with a refused mode switch's message.
async fn mode_refused(s: &AppState, session: &Session, pid: &ProjectId, e: &meter::FieldError) -> Response {
    match quotas_view(s, session, pid, Some(e)).await {
        Ok(markup) => html(StatusCode::BAD_REQUEST, markup),
        Err(e) => failure(e),
    }
}

/// The usage page: `GET /v1/usage`'s parameters (read and checked by its
/// DTO) and report. With no parameters: by model, this month.
async fn usage_page(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    uri: axum::http::Uri,
) -> Response {
    let fields = Fields::parse(uri.query().unwrap_or("").as_bytes());
    let shown = async {
        let p = summary(&s, &pid).await?;
        let form = view::UsageForm {
            group_by: fields.get("group_by").unwrap_or("model"),
            window: fields.get("window").unwrap_or("calendar_month"),
            at: fields.value("at"),
        };
        let query = fields.usage_query(&pid);
        let (report, error, status) = match query {
            Ok(q) => match service::usage::report(&s, q).await {
                Ok(r) => (Some(r), None, StatusCode::OK),
                Err(service::Error::Invalid(e)) => (None, Some(e), StatusCode::BAD_REQUEST),
                Err(e) => return Err(e),
            },
            Err(e) => (None, Some(e), StatusCode::BAD_REQUEST),
        };
        Ok::<_, service::Error>((status, view::usage(&session.csrf, &p, &form, report.as_ref(), error.as_ref())))
    };
    heavy(&s, "usage", async {
        match shown.await {
            Ok((status, markup)) => html(status, markup),
            Err(e) => failure(e),
        }
    })
    .await
}

/// Runs a page that reads one of Tollgate's heavy endpoints (the usage
/// report, the audit log, the delivery log) within the same bounds as the
/// API's route, counted against the admin token's principal, whom the
/// console signs in as (see [`crate::heavy`]).
async fn heavy(s: &AppState, name: &'static str, page: impl std::future::Future<Output = Response>) -> Response {
    crate::heavy::bounded(s, crate::heavy::Endpoint::of(s, name), &admin_api().id, page).await
}
