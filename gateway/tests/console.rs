//! The console through `gateway::app(..)` and `oneshot` (no sockets, no
//! browser), over the embedded backends: a fresh SQLite store and log per
//! test, the in-memory view and a manual clock. Signing in, the session
//! every page needs, the CSRF token every form needs, a key made and
//! granted through the forms, and the usage bars against checks run
//! through the service layer.

use std::sync::Arc;

use axum::body::Body;
use axum::http::header::{COOKIE, LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, Request, StatusCode};
use chrono::{TimeZone, Utc};
use gateway::service::admission::{self, CheckRequest, EstimateAsk, KeyRef, Who};
use gateway::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
use gateway::service::{quotas, webhooks};
use gateway::{AppState, Settings};
use meter::{
    ApiKeyId, AuditBatch, AuditStore, Clock, Component, EventId, EventKind, EventTypes, FoldBatch, Grants, Ledger, Log,
    ManualClock, Metric, OffsetMove, Price, PriceKey, PriceStore, Principal, ProjectId, TenantStore, TokenUsage,
    UnpricedException, UsageFact, Usd, WindowKind,
};
use store::{MemoryView, SqliteLog, SqliteStore};
use tower::ServiceExt;

/// An admin token no page, header or cookie may ever show.
const ADMIN: &str = "adm-Console-Secret-7f3a9c";

struct Fixture {
    app: axum::Router,
    state: AppState,
    clock: ManualClock,
    store: SqliteStore,
    dir: std::path::PathBuf,
    project: ProjectId,
    key: ApiKeyId,
    secret: String,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The app over a fresh embedded store, with a project ("acme", Kathmandu)
/// and one key in it under an enforce quota of 5 calls a day.
async fn fixture() -> Fixture {
    let dir = std::env::temp_dir().join(format!("tollgate-console-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
    store.migrate().await.expect("migrate");
    let log = SqliteLog::new(store.pool().clone(), "tollgate.");
    log.ensure_schema().await.expect("log schema");
    let clock = ManualClock::new(Utc.with_ymd_and_hms(2026, 8, 1, 6, 0, 0).single().expect("instant"));
    let state = AppState::new(
        Arc::new(store.clone()),
        Arc::new(MemoryView::new()),
        Arc::new(log),
        Arc::new(clock.clone()),
        settings(&dir),
    );
    let starter = Starter {
        project: NewProject { name: "acme".into(), timezone: chrono_tz::Asia::Kathmandu },
        key: NewApiKey { name: "partner".into(), ..NewApiKey::default() },
        quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: 5 }),
    };
    let made = provisioning::provision(&state, starter, &Principal::new("admin", "test")).await.expect("provision");
    Fixture {
        app: gateway::app(state.clone()),
        state,
        clock,
        store,
        dir,
        project: made.project.id,
        key: made.key.id,
        secret: made.secret,
    }
}

/// The settings of the fixture: its admin token, and exports written under `dir`.
fn settings(dir: &std::path::Path) -> Settings {
    let mut settings = Settings::new(ADMIN, "gw");
    settings.exports.dir = dir.join("exports");
    settings
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn location(&self) -> Option<&str> {
        self.headers.get(LOCATION).and_then(|v| v.to_str().ok())
    }

    /// The `Set-Cookie` header naming `name`, whole.
    fn set_cookie(&self, name: &str) -> Option<String> {
        self.headers
            .get_all(SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find(|v| v.starts_with(&format!("{name}=")))
            .map(str::to_owned)
    }

    /// The value of the first `csrf` field of the page.
    fn csrf(&self) -> String {
        let (_, rest) = self.body.split_once(r#"name="csrf" value=""#).expect("a form with a csrf field");
        rest.split_once('"').expect("end of the value").0.to_owned()
    }
}

async fn send(app: &axum::Router, req: Request<Body>) -> Answer {
    let res = app.clone().oneshot(req).await.expect("response");
    let status = res.status();
    let headers = res.headers().clone();
    let body = axum::body::to_bytes(res.into_body(), 1 << 22).await.expect("body");
    let body = String::from_utf8(body.to_vec()).expect("utf-8");
    for v in headers.values() {
        assert!(!v.as_bytes().windows(ADMIN.len()).any(|w| w == ADMIN.as_bytes()), "the admin token in a header");
    }
    assert!(!body.contains(ADMIN), "the admin token in a page");
    Answer { status, headers, body }
}

async fn get(app: &axum::Router, uri: &str, cookie: Option<&str>) -> Answer {
    let mut req = Request::get(uri);
    if let Some(c) = cookie {
        req = req.header(COOKIE, c);
    }
    send(app, req.body(Body::empty()).expect("request")).await
}

async fn post(app: &axum::Router, uri: &str, cookie: Option<&str>, form: &[(&str, &str)]) -> Answer {
    let body = form_urlencoded::Serializer::new(String::new()).extend_pairs(form).finish();
    let mut req = Request::post(uri).header("content-type", "application/x-www-form-urlencoded");
    if let Some(c) = cookie {
        req = req.header(COOKIE, c);
    }
    send(app, req.body(Body::from(body)).expect("request")).await
}

/// `name=value` of a `Set-Cookie` header, as a `Cookie` header sends it back.
fn pair(set_cookie: &str) -> String {
    set_cookie.split(';').next().expect("name=value").to_owned()
}

/// Signs in through the form; the session cookie as a `Cookie` header.
async fn sign_in(app: &axum::Router) -> String {
    sign_in_with(app, ADMIN).await
}

async fn sign_in_with(app: &axum::Router, token: &str) -> String {
    let form = get(app, "/console/sign-in", None).await;
    assert_eq!(form.status, StatusCode::OK);
    let nonce = pair(&form.set_cookie("tollgate_console_sign_in").expect("the sign-in cookie"));
    let signed = post(app, "/console/sign-in", Some(&nonce), &[("csrf", &form.csrf()), ("token", token)]).await;
    assert_eq!((signed.status, signed.location()), (StatusCode::SEE_OTHER, Some("/console")));
    pair(&signed.set_cookie("tollgate_console").expect("the session cookie"))
}

#[tokio::test]
async fn signing_in_sets_an_http_only_strict_session_cookie_that_is_not_the_token() {
    let f = fixture().await;
    let form = get(&f.app, "/console/sign-in", None).await;
    assert_eq!(form.status, StatusCode::OK);
    assert!(form.body.contains(r#"<label for="token">Admin token</label>"#), "{}", form.body);
    assert!(form.body.contains(r#"type="password""#));
    let nonce = pair(&form.set_cookie("tollgate_console_sign_in").expect("the sign-in cookie"));

    // A wrong token: the form again, no session.
    let wrong = post(&f.app, "/console/sign-in", Some(&nonce), &[("csrf", &form.csrf()), ("token", "nope")]).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.body.contains("That is not the admin token."));
    assert_eq!(wrong.set_cookie("tollgate_console"), None);
    // The right token without the form's token: refused.
    let forged = post(&f.app, "/console/sign-in", Some(&nonce), &[("token", ADMIN)]).await;
    assert_eq!((forged.status, forged.set_cookie("tollgate_console")), (StatusCode::FORBIDDEN, None));
    let forged = post(&f.app, "/console/sign-in", None, &[("csrf", &form.csrf()), ("token", ADMIN)]).await;
    assert_eq!((forged.status, forged.set_cookie("tollgate_console")), (StatusCode::FORBIDDEN, None));

    let odd =
        post(&f.app, "/console/sign-in", Some(&nonce), &[("csrf", &form.csrf()), ("token", ADMIN), ("remember", "1")])
            .await;
    assert_eq!((odd.status, odd.set_cookie("tollgate_console")), (StatusCode::BAD_REQUEST, None));
    assert!(odd.body.contains("remember: is not a known field"), "{}", odd.body);

    let signed = post(&f.app, "/console/sign-in", Some(&nonce), &[("csrf", &form.csrf()), ("token", ADMIN)]).await;
    assert_eq!((signed.status, signed.location()), (StatusCode::SEE_OTHER, Some("/console")));
    let cookie = signed.set_cookie("tollgate_console").expect("the session cookie");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        assert!(cookie.split("; ").any(|a| a == attribute), "{attribute} in {cookie}");
    }
    let session = pair(&cookie);

    // Signed in, the sign-in page sends to the console.
    let again = get(&f.app, "/console/sign-in", Some(&session)).await;
    assert_eq!((again.status, again.location()), (StatusCode::SEE_OTHER, Some("/console")));
    // Behind a proxy that took HTTPS, the cookie is Secure too.
    let form = get(&f.app, "/console/sign-in", None).await;
    let nonce = pair(&form.set_cookie("tollgate_console_sign_in").expect("the sign-in cookie"));
    let req = Request::post("/console/sign-in")
        .header("content-type", "application/x-www-form-urlencoded")
        .header(COOKIE, &nonce)
        .header("x-forwarded-proto", "https")
        .body(Body::from(format!("csrf={}&token={ADMIN}", form.csrf())))
        .expect("request");
    let behind = send(&f.app, req).await;
    let cookie = behind.set_cookie("tollgate_console").expect("the session cookie");
    assert!(cookie.ends_with("; Secure"), "{cookie}");
    assert!(!signed.set_cookie("tollgate_console").expect("cookie").contains("Secure"), "not over plain HTTP");

    let projects = get(&f.app, "/console", Some(&session)).await;
    assert_eq!(projects.status, StatusCode::OK, "{}", projects.body);
    let row = format!(r#"<tr data-project-id="{}">"#, f.project);
    assert!(projects.body.contains(&row), "{}", projects.body);
    assert!(projects.body.contains("Asia/Kathmandu"));
    assert!(projects.body.contains(r#"data-keys="1""#) && projects.body.contains(r#"data-quotas="1""#));
    assert_eq!(projects.headers["cache-control"], "no-store");
    assert!(projects.headers["content-security-policy"].to_str().expect("ascii").contains("default-src 'none'"));

    // A session lasts twelve hours.
    f.clock.advance(chrono::Duration::hours(12) + chrono::Duration::seconds(1));
    let expired = get(&f.app, "/console", Some(&session)).await;
    assert_eq!((expired.status, expired.location()), (StatusCode::SEE_OTHER, Some("/console/sign-in")));
}

#[tokio::test]
async fn every_console_page_needs_a_session() {
    let f = fixture().await;
    let key_page = format!("/console/projects/{}/keys/{}", f.project, f.key);
    let qid = quotas::list(&f.state, &f.project).await.expect("quotas").remove(0).quota.id;
    let project = format!("/console/projects/{}", f.project);
    let mut pages = vec!["/console".to_owned(), "/console/health".to_owned(), project.clone(), key_page.clone()];
    for tail in ["quotas", "usage", "breaches", "audit", "exceptions", "webhooks", "exports"] {
        pages.push(format!("{project}/{tail}"));
    }
    pages.push(format!("{project}/quotas/{qid}"));
    pages.push(format!("{project}/webhooks/wh_any"));
    pages.push(format!("{project}/exports/exr_any/file"));
    // None, a forged one, and one signed with another admin token.
    let other = AppState::new(
        Arc::new(f.store.clone()),
        Arc::new(MemoryView::new()),
        f.state.log.clone(),
        Arc::new(f.clock.clone()),
        Settings::new("another-token", "gw"),
    );
    let foreign = sign_in_with(&gateway::app(other), "another-token").await;
    for cookie in [None, Some("tollgate_console=v1.1785564000.00ff"), Some(foreign.as_str())] {
        for page in &pages {
            let a = get(&f.app, page, cookie).await;
            assert_eq!((a.status, a.location()), (StatusCode::SEE_OTHER, Some("/console/sign-in")), "{page}");
        }
        for (uri, form) in [
            (format!("/console/projects/{}/keys", f.project), vec![("name", "x")]),
            (format!("{key_page}/grants"), vec![("max_rows", "5")]),
            ("/console/sign-out".to_owned(), vec![]),
            (format!("{project}/quotas/{qid}/mode"), vec![("mode", "monitor")]),
            (format!("{project}/webhooks/wh_any/deliveries/msg_any/resend"), vec![]),
        ] {
            assert_eq!(post(&f.app, &uri, cookie, &form).await.status, StatusCode::UNAUTHORIZED, "{uri}");
        }
    }
    assert_eq!(f.store.api_keys(&f.project).await.expect("keys").len(), 1, "no key was made");
    let quota = quotas::get(&f.state, &qid).await.expect("quota").quota;
    assert_eq!(quota.spec.mode, meter::Mode::Enforce, "no quota was switched");

    // The root sends a browser to the console (and on to signing in).
    let root = get(&f.app, "/", None).await;
    assert_eq!((root.status, root.location()), (StatusCode::SEE_OTHER, Some("/console")));

    // The stylesheet needs none: the sign-in page uses it.
    let css = get(&f.app, "/console/static/console.css", None).await;
    assert_eq!(css.status, StatusCode::OK);
    assert_eq!(css.headers["content-type"], "text/css; charset=utf-8");
    assert!(css.body.contains(".usage.full"));
}

#[tokio::test]
async fn a_post_without_the_csrf_token_is_refused_and_changes_nothing() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let key_page = format!("/console/projects/{}/keys/{}", f.project, f.key);
    let csrf = get(&f.app, &key_page, Some(&session)).await.csrf();
    let new_key = format!("/console/projects/{}/keys", f.project);
    let grants = format!("{key_page}/grants");
    for token in [None, Some(""), Some("00"), Some(&csrf[..csrf.len() - 2])] {
        let with = |form: &[(&'static str, &'static str)]| {
            let mut form: Vec<(&str, &str)> = form.to_vec();
            if let Some(t) = token {
                form.push(("csrf", t));
            }
            form
        };
        let a = post(&f.app, &new_key, Some(&session), &with(&[("name", "sneaky")])).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{token:?}");
        let a = post(&f.app, &grants, Some(&session), &with(&[("max_rows", "7")])).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{token:?}");
        let a = post(&f.app, "/console/sign-out", Some(&session), &with(&[])).await;
        assert_eq!((a.status, a.set_cookie("tollgate_console")), (StatusCode::FORBIDDEN, None), "{token:?}");
    }
    // Another session's token is not this one's.
    f.clock.advance(chrono::Duration::seconds(5));
    let later = sign_in(&f.app).await;
    assert_ne!(later, session);
    let theirs = get(&f.app, "/console", Some(&later)).await.csrf();
    let a = post(&f.app, &grants, Some(&session), &[("max_rows", "7"), ("csrf", &theirs)]).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);

    assert_eq!(f.store.api_keys(&f.project).await.expect("keys").len(), 1, "no key was made");
    let key = f.store.api_key(&f.key).await.expect("read").expect("live");
    assert_eq!(key.grants, Grants::default(), "no grant was changed");
    assert_eq!(f.store.unpublished_audit(100).await.expect("outbox").len(), 2, "only the fixture's key and quota");
    assert_eq!(get(&f.app, "/console", Some(&session)).await.status, StatusCode::OK, "still signed in");

    // A field the sign-out form does not have: refused, still signed in.
    let odd = post(&f.app, "/console/sign-out", Some(&session), &[("csrf", &csrf), ("everywhere", "1")]).await;
    assert_eq!((odd.status, odd.set_cookie("tollgate_console")), (StatusCode::BAD_REQUEST, None));

    // With it, signing out ends the session.
    let out = post(&f.app, "/console/sign-out", Some(&session), &[("csrf", &csrf)]).await;
    assert_eq!((out.status, out.location()), (StatusCode::SEE_OTHER, Some("/console/sign-in")));
    let cleared = out.set_cookie("tollgate_console").expect("the cookie cleared");
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
    assert_eq!(pair(&cleared), "tollgate_console=");
}

#[tokio::test]
async fn a_key_made_through_the_form_with_a_grant_shows_its_secret_once_and_authenticates() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let page = get(&f.app, &format!("/console/projects/{}", f.project), Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK);
    for input in ["name", "max_concurrent", "query_timeout", "max_rows"] {
        assert!(page.body.contains(&format!(r#"<label for="f-{input}">"#)), "a label for {input}");
    }
    assert!(page.body.contains(r#"<label for="new-key-role">Role</label>"#));
    let made = post(
        &f.app,
        &format!("/console/projects/{}/keys", f.project),
        Some(&session),
        &[
            ("csrf", &page.csrf()),
            ("name", "reports"),
            ("max_rows", "500"),
            ("max_concurrent", "2"),
            ("query_timeout", ""),
        ],
    )
    .await;
    assert_eq!(made.status, StatusCode::OK, "{}", made.body);
    let keys = f.store.api_keys(&f.project).await.expect("keys");
    let key = keys.iter().find(|k| k.name == "reports").expect("the new key");
    assert_eq!(key.grants, Grants { max_concurrent: Some(2), query_timeout: None, max_rows: Some(500) });
    let (_, rest) = made.body.split_once(r#"<code id="secret""#).expect("the secret shown");
    let secret = rest.split_once('>').expect("tag").1.split_once('<').expect("end").0;
    assert!(secret.starts_with("tg_") && secret.starts_with(&key.prefix), "{secret}");
    assert!(made.body.contains(&format!(r#"<tr data-key-id="{}">"#, key.id)), "the new key is listed");

    // The secret is the key's: a check with it is admitted under its grant.
    let checked = admission::check(&f.state, check_of(secret)).await.expect("admitted");
    let admission::Checked::Admitted { bounds, .. } = checked else { panic!("not exempt") };
    assert_eq!(bounds.max_rows, 500);
    // And never shown again.
    let again = get(&f.app, &format!("/console/projects/{}/keys/{}", f.project, key.id), Some(&session)).await;
    assert_eq!(again.status, StatusCode::OK);
    assert!(!again.body.contains(secret));
    assert!(!get(&f.app, &format!("/console/projects/{}", f.project), Some(&session)).await.body.contains(secret));

    // A refused form: re-rendered with the field's message and what was typed; nothing made.
    let bad = post(
        &f.app,
        &format!("/console/projects/{}/keys", f.project),
        Some(&session),
        &[("csrf", &page.csrf()), ("name", "second"), ("max_concurrent", "1001")],
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.body.contains("grants.max_concurrent: must be between 1 and 1000"), "{}", bad.body);
    assert!(bad.body.contains(r#"value="1001""#) && bad.body.contains(r#"value="second""#));
    assert_eq!(f.store.api_keys(&f.project).await.expect("keys").len(), 2, "nothing made");
}

fn check_of(secret: &str) -> CheckRequest {
    CheckRequest {
        who: Who::Key(KeyRef::Secret(secret.to_owned())),
        project: None,
        agent: None,
        actor: None,
        storage_delta: None,
        permit: false,
        explain: false,
        estimate: EstimateAsk::None,
    }
}

/// The usage bar of a quota on a page: its percentage and level.
fn bar_of(body: &str, quota: &str) -> (String, String) {
    let (_, rest) = body.split_once(&format!(r#"data-quota-id="{quota}""#)).expect("the quota's bar");
    let attr = |name: &str| {
        let (_, v) = rest.split_once(&format!(r#"{name}=""#)).expect("attribute");
        v.split_once('"').expect("end").0.to_owned()
    };
    (attr("data-percent"), attr("data-level"))
}

#[tokio::test]
async fn the_bar_shows_the_count_a_check_compares_and_turns_at_80_and_100_percent() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let quota = quotas::list(&f.state, &f.project).await.expect("quotas").remove(0).quota;
    let key_page = format!("/console/projects/{}/keys/{}", f.project, f.key);
    let project_page = format!("/console/projects/{}", f.project);

    let page = get(&f.app, &key_page, Some(&session)).await;
    assert_eq!(bar_of(&page.body, quota.id.as_str()), ("0".into(), "ok".into()));
    for _ in 0..4 {
        admission::check(&f.state, check_of(&f.secret)).await.expect("admitted");
    }
    let page = get(&f.app, &key_page, Some(&session)).await;
    assert_eq!(bar_of(&page.body, quota.id.as_str()), ("80".into(), "warn".into()));
    assert!(page.body.contains("80 %</strong> — 4 of 5"), "the value in text: {}", page.body);
    assert!(page.body.contains(r#"class="usage warn""#));
    // The same count GET /v1/quotas/{id} answers: durable + settled + reserved.
    let detail = quotas::get(&f.state, &quota.id).await.expect("quota");
    assert_eq!(detail.current_usage.as_ref().map(|u| u.count), Some(4));
    // The window is the project's day (Kathmandu, +05:45), reset at its midnight.
    assert!(page.body.contains("<code>2026-08-01</code>"), "{}", page.body);
    assert!(page.body.contains(r#"datetime="2026-08-01T18:15:00+00:00""#), "{}", page.body);
    let listed = get(&f.app, &project_page, Some(&session)).await;
    assert_eq!(bar_of(&listed.body, quota.id.as_str()), ("80".into(), "warn".into()));

    admission::check(&f.state, check_of(&f.secret)).await.expect("the fifth is admitted");
    let page = get(&f.app, &key_page, Some(&session)).await;
    assert_eq!(bar_of(&page.body, quota.id.as_str()), ("100".into(), "full".into()));
    assert!(page.body.contains("100 %</strong> — 5 of 5"));
    assert!(admission::check(&f.state, check_of(&f.secret)).await.is_err(), "the sixth is refused");
    let page = get(&f.app, &key_page, Some(&session)).await;
    assert_eq!(bar_of(&page.body, quota.id.as_str()), ("100".into(), "full".into()), "a refusal reserves nothing");
    let listed = get(&f.app, &project_page, Some(&session)).await;
    assert_eq!(bar_of(&listed.body, quota.id.as_str()), ("100".into(), "full".into()));
}

#[tokio::test]
async fn a_bad_grant_is_refused_with_its_message_and_changes_nothing() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let key_page = format!("/console/projects/{}/keys/{}", f.project, f.key);
    let grants = format!("{key_page}/grants");
    let csrf = get(&f.app, &key_page, Some(&session)).await.csrf();

    // A role of another project is no role of this key's.
    let other =
        provisioning::create_project(&f.state, NewProject { name: "other".into(), timezone: chrono_tz::Tz::UTC })
            .await
            .expect("project");
    let foreign_role = provisioning::create_role(
        &f.state,
        &other.id,
        provisioning::NewRole { name: "r".into(), ..provisioning::NewRole::default() },
        &Principal::new("admin", "test"),
    )
    .await
    .expect("role");
    let outbox = f.store.unpublished_audit(100).await.expect("outbox").len();
    for (form, field, message) in [
        (vec![("max_concurrent", "0")], "max_concurrent", "grants.max_concurrent: must be between 1 and 1000"),
        (vec![("max_rows", "abc")], "max_rows", "grants.max_rows: must be a number"),
        (vec![("query_timeout", "0")], "query_timeout", "grants.query_timeout: must be greater than 0"),
        (vec![("max_rows", "-4")], "max_rows", "grants.max_rows: must be a whole number ≥ 0"),
        (vec![("role_id", foreign_role.id.as_str())], "role_id", "role_id: no role"),
        (vec![("name", "renamed")], "name", "name: is not a known field"),
    ] {
        let mut form = form.clone();
        form.push(("csrf", &csrf));
        let a = post(&f.app, &grants, Some(&session), &form).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{form:?}");
        assert!(a.body.contains(message), "{message} in {}", a.body);
        if field != "role_id" && field != "name" {
            let invalid = format!(r#"id="f-{field}" name="{field}" type="text" value="{}""#, form[0].1);
            assert!(a.body.contains(&invalid), "{invalid} in {}", a.body);
            assert!(a.body.contains(&format!(r#"id="f-{field}-error""#)));
        }
    }
    let key = f.store.api_key(&f.key).await.expect("read").expect("live");
    assert_eq!((key.grants, key.role_id), (Grants::default(), None), "nothing changed");
    assert_eq!(f.store.unpublished_audit(100).await.expect("outbox").len(), outbox, "nothing audited");

    // A good one: changed, audited, and shown granted beside effective.
    let role = provisioning::create_role(
        &f.state,
        &f.project,
        provisioning::NewRole {
            name: "narrow".into(),
            grants: Grants { max_rows: Some(50), ..Grants::default() },
            ..provisioning::NewRole::default()
        },
        &Principal::new("admin", "test"),
    )
    .await
    .expect("role");
    let ok = post(
        &f.app,
        &grants,
        Some(&session),
        &[("csrf", &csrf), ("max_rows", "200"), ("max_concurrent", "3"), ("role_id", role.id.as_str())],
    )
    .await;
    assert_eq!((ok.status, ok.location()), (StatusCode::SEE_OTHER, Some(key_page.as_str())));
    let key = f.store.api_key(&f.key).await.expect("read").expect("live");
    assert_eq!(key.grants, Grants { max_concurrent: Some(3), query_timeout: None, max_rows: Some(200) });
    assert_eq!(key.role_id.as_ref(), Some(&role.id));
    let audit = f.store.unpublished_audit(100).await.expect("outbox");
    assert_eq!(audit.last().map(|e| e.action.as_str()), Some("keys:UpdateApiKey"));
    let page = get(&f.app, &key_page, Some(&session)).await;
    let row = page.body.split_once(r#"<tr data-limit="max_rows">"#).expect("the max_rows row").1;
    let row = row.split_once("</tr>").expect("end").0;
    assert!(row.contains(r#"<td class="num granted">200</td>"#), "{row}");
    assert!(row.contains(r#"<td class="num effective">50</td>"#), "the role narrows it: {row}");
    // The checks of the key run under the new grants at once.
    let checked = admission::check(&f.state, check_of(&f.secret)).await.expect("admitted");
    let admission::Checked::Admitted { bounds, .. } = checked else { panic!("not exempt") };
    assert_eq!(bounds.max_rows, 50);
}

#[tokio::test]
async fn a_key_is_shown_only_under_its_own_project() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let other =
        provisioning::create_project(&f.state, NewProject { name: "other".into(), timezone: chrono_tz::Tz::UTC })
            .await
            .expect("project");
    let elsewhere = format!("/console/projects/{}/keys/{}", other.id, f.key);
    assert_eq!(get(&f.app, &elsewhere, Some(&session)).await.status, StatusCode::NOT_FOUND);
    let csrf = get(&f.app, "/console", Some(&session)).await.csrf();
    let a = post(&f.app, &format!("{elsewhere}/grants"), Some(&session), &[("csrf", &csrf), ("max_rows", "9")]).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(f.store.api_key(&f.key).await.expect("read").expect("live").grants, Grants::default());
    assert_eq!(get(&f.app, "/console/projects/proj_nope", Some(&session)).await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(&f.app, "/console/projects/bad%20id", Some(&session)).await.status, StatusCode::NOT_FOUND);
}

/// Folds `facts` into the store, as the projector would (offsets from `from`).
async fn fold(store: &SqliteStore, from: i64, facts: Vec<UsageFact>) {
    let to = from + i64::try_from(facts.len()).expect("few");
    let batch = FoldBatch {
        consumer: "tollgate-projector".into(),
        topic: "tollgate.usage".into(),
        offsets: vec![OffsetMove { partition: 0, from, to }],
        facts,
        ..FoldBatch::default()
    };
    store.fold_batch(&batch).await.expect("fold");
}

fn at(s: &str) -> chrono::DateTime<Utc> {
    chrono::DateTime::parse_from_rfc3339(s).expect("instant").with_timezone(&Utc)
}

/// A successful call of `key` at `when`.
fn call(f: &Fixture, id: &str, when: &str) -> UsageFact {
    UsageFact {
        api_key_id: Some(f.key.clone()),
        rows: 2,
        ..UsageFact::new(EventId::parse(id).expect("id"), f.project.clone(), EventKind::Call, at(when))
    }
}

#[tokio::test]
async fn the_quotas_page_switches_a_quota_between_enforce_and_monitor() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let qid = quotas::list(&f.state, &f.project).await.expect("quotas").remove(0).quota.id;
    let list = format!("/console/projects/{}/quotas", f.project);
    let switch = format!("{list}/{qid}/mode");
    let page = get(&f.app, &list, Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains(&format!(r#"<tr data-quota-id="{qid}" data-mode="enforce">"#)), "{}", page.body);
    assert_eq!(bar_of(&page.body, qid.as_str()), ("0".into(), "ok".into()));
    assert!(page.body.contains("Switch to monitor"));
    let csrf = page.csrf();
    let mode = || async { quotas::get(&f.state, &qid).await.expect("quota").quota.spec.mode };
    let outbox = f.store.unpublished_audit(100).await.expect("outbox").len();

    // Without the CSRF token, or with a mode the API refuses: nothing changes.
    let a = post(&f.app, &switch, Some(&session), &[("mode", "monitor")]).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    let a = post(&f.app, &switch, Some(&session), &[("csrf", &csrf), ("mode", "asleep")]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("mode: must be enforce or monitor"), "{}", a.body);
    let a = post(&f.app, &switch, Some(&session), &[("csrf", &csrf), ("mode", "monitor"), ("limit", "1")]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("limit: is not a known field"), "{}", a.body);
    assert_eq!(mode().await, meter::Mode::Enforce);
    assert_eq!(f.store.unpublished_audit(100).await.expect("outbox").len(), outbox, "nothing audited");

    // Used up while enforced: the sixth check is refused.
    for _ in 0..5 {
        admission::check(&f.state, check_of(&f.secret)).await.expect("admitted");
    }
    assert!(admission::check(&f.state, check_of(&f.secret)).await.is_err(), "enforced");
    assert_eq!(bar_of(&get(&f.app, &list, Some(&session)).await.body, qid.as_str()), ("100".into(), "full".into()));

    // Switched to monitor, as PATCH /v1/quotas/{id} would: audited, and checks past the limit admitted.
    let a = post(&f.app, &switch, Some(&session), &[("csrf", &csrf), ("mode", "monitor"), ("from", "quotas")]).await;
    assert_eq!((a.status, a.location()), (StatusCode::SEE_OTHER, Some(list.as_str())));
    assert_eq!(mode().await, meter::Mode::Monitor);
    let audit = f.store.unpublished_audit(100).await.expect("outbox");
    assert_eq!(audit.last().map(|e| e.action.as_str()), Some("quotas:UpdateQuota"));
    admission::check(&f.state, check_of(&f.secret)).await.expect("a monitor quota refuses nothing");
    let page = get(&f.app, &list, Some(&session)).await;
    assert!(page.body.contains(&format!(r#"<tr data-quota-id="{qid}" data-mode="monitor">"#)));
    // The bar is still the count GET /v1/quotas/{id} gives.
    let count = quotas::get(&f.state, &qid).await.expect("quota").current_usage.expect("a counter").count;
    assert_eq!(bar_of(&page.body, qid.as_str()).0, (count * 100 / 5).to_string());
    assert!(page.body.contains("Switch to enforce"));

    // And back, from the quota's own page.
    let a = post(&f.app, &switch, Some(&session), &[("csrf", &csrf), ("mode", "enforce")]).await;
    assert_eq!((a.status, a.location()), (StatusCode::SEE_OTHER, Some(format!("{list}/{qid}").as_str())));
    assert_eq!(mode().await, meter::Mode::Enforce);
    assert!(admission::check(&f.state, check_of(&f.secret)).await.is_err(), "enforced again");

    // A quota is switched only under its own project.
    let other =
        provisioning::create_project(&f.state, NewProject { name: "other".into(), timezone: chrono_tz::Tz::UTC })
            .await
            .expect("project");
    let elsewhere = format!("/console/projects/{}/quotas/{qid}", other.id);
    assert_eq!(get(&f.app, &elsewhere, Some(&session)).await.status, StatusCode::NOT_FOUND);
    let a = post(&f.app, &format!("{elsewhere}/mode"), Some(&session), &[("csrf", &csrf), ("mode", "monitor")]).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(mode().await, meter::Mode::Enforce);
    let a = get(&f.app, &list, None).await;
    assert_eq!((a.status, a.location()), (StatusCode::SEE_OTHER, Some("/console/sign-in")));
}

#[tokio::test]
async fn a_quotas_chart_shows_what_was_folded_over_its_window() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let qid = quotas::list(&f.state, &f.project).await.expect("quotas").remove(0).quota.id;
    // The clock is 06:00 UTC on 1 August, 11:45 in Kathmandu: the day began at 18:15 UTC.
    fold(
        &f.store,
        0,
        vec![
            call(&f, "c1", "2026-08-01T00:30:00Z"),
            call(&f, "c2", "2026-08-01T00:40:00Z"),
            call(&f, "c3", "2026-08-01T03:10:00Z"),
            call(&f, "c0", "2026-07-31T18:05:00Z"),
        ],
    )
    .await;
    let page = get(&f.app, &format!("/console/projects/{}/quotas/{qid}", f.project), Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert_eq!(bar_of(&page.body, qid.as_str()), ("60".into(), "ok".into()), "3 of 5 today; c0 was yesterday");
    assert!(page.body.contains(r#"<figure id="chart" data-slices="13">"#), "18:00 to 06:00 UTC: {}", page.body);
    assert!(page.body.contains(r#"role="img" aria-labelledby="chart-title""#));
    // The 13 hours so far take 13 of the window's 25 (600 / 25 = 24 units each, a gap of one).
    assert!(page.body.contains(r#"<rect class="slice warn" x="288" y="#), "the 13th slice at 12 × 24: {}", page.body);
    assert!(page.body.contains(r#"width="23""#));
    // The limit (5) under a tenth of headroom (a top of 6): 160 - 5 × 160 / 6.
    assert!(page.body.contains(r#"<line class="limit" x1="0" x2="600" y1="27" y2="27">"#), "{}", page.body);
    let values: Vec<(String, String)> = page
        .body
        .split(r#"data-value=""#)
        .skip(1)
        .map(|rest| {
            let (v, rest) = rest.split_once('"').expect("value");
            let c = rest.split_once(r#"data-cumulative=""#).expect("cumulative").1.split_once('"').expect("end").0;
            (v.to_owned(), c.to_owned())
        })
        .collect();
    let expected: Vec<(String, String)> = [0, 0, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0]
        .iter()
        .scan(0, |sum, v| {
            *sum += v;
            Some((v.to_string(), sum.to_string()))
        })
        .collect();
    // The first hour (18:00-19:00 UTC) began before the day: it holds c0, folded into yesterday's day.
    let mut expected = expected;
    expected[0] = ("1".into(), "1".into());
    for e in expected.iter_mut().skip(1) {
        let (v, c) = (e.0.parse::<u64>().expect("n"), e.1.parse::<u64>().expect("n") + 1);
        *e = (v.to_string(), c.to_string());
    }
    assert_eq!(values, expected);
    assert!(page.body.contains(r#"<table id="chart-data">"#), "the numbers in a table too");
    assert!(page.body.contains("Switch to monitor"));
}

#[tokio::test]
async fn the_usage_page_shows_the_apis_report_with_priced_and_unpriced_apart() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let when = at("2026-07-31T20:00:00Z");
    let key = |c| PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: c };
    f.store
        .put_prices(
            &[Price { key: key(Component::InputTokens), unit_price_usd: Usd(2_500_000), effective_from: when }],
            when,
            None,
        )
        .await
        .expect("prices");
    let tokens = UsageFact {
        actor_id: Some("user_1".into()),
        tokens: vec![TokenUsage {
            provider: "openai".into(),
            model: "gpt-4o".into(),
            input: 1000,
            output: 7,
            ..TokenUsage::default()
        }],
        ..UsageFact::new(EventId::parse("t1").expect("id"), f.project.clone(), EventKind::Tokens, when)
    };
    fold(&f.store, 0, vec![tokens]).await;
    let usage = format!("/console/projects/{}/usage", f.project);

    let page = get(&f.app, &usage, Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains(r#"<table id="usage-table" data-group-by="model">"#), "by model by default");
    let row = |body: &str, component: &str| {
        let r = body.split_once(&format!(r#"data-component="{component}">"#)).expect("the row").1;
        r.split_once("</tr>").expect("end").0.to_owned()
    };
    let input = row(&page.body, "input_tokens");
    assert!(
        input.contains(
            r#"<td class="num priced">1000</td><td class="num unpriced">0</td><td class="num cost">0.0025</td>"#
        ),
        "{input}"
    );
    let output = row(&page.body, "output_tokens");
    assert!(
        output.contains(r#"<td class="num priced">0</td><td class="num unpriced">7</td><td class="num cost">0</td>"#),
        "{output}"
    );
    assert!(page.body.contains(r#"<td class="num" id="total-cost">0.0025</td>"#), "{}", page.body);
    assert!(page.body.contains(r#"id="unpriced-note""#));
    // The same figures as GET /v1/usage.
    let api = Request::get(format!("/v1/usage?project_id={}&group_by=model", f.project))
        .header("authorization", format!("Bearer {ADMIN}"))
        .body(Body::empty())
        .expect("request");
    let api = send(&f.app, api).await;
    let api: serde_json::Value = serde_json::from_str(&api.body).expect("json");
    assert_eq!(api["data"][0]["cost_usd"], "0.0025");
    assert_eq!(api["window_key"], "2026-08");
    assert!(page.body.contains("<code>2026-08</code>"), "Kathmandu's August");

    let by_actor = get(&f.app, &format!("{usage}?group_by=actor&window=day"), Some(&session)).await;
    assert_eq!(by_actor.status, StatusCode::OK);
    let r = by_actor.body.split_once(r#"<tr data-member="user_1">"#).expect("the actor").1;
    let r = r.split_once("</tr>").expect("end").0;
    assert!(
        r.contains(r#"<td class="num">1007</td><td class="num cost">0.0025</td><td class="num unpriced">1</td>"#),
        "{r}"
    );
    assert!(by_actor.body.contains(r#"<option value="actor" selected>actor</option>"#));

    let earlier = get(&f.app, &format!("{usage}?group_by=model&at=2026-07-01T00:00:00Z"), Some(&session)).await;
    assert_eq!(earlier.status, StatusCode::OK);
    assert!(earlier.body.contains(r#"id="no-usage""#) && earlier.body.contains("<code>2026-07</code>"));

    for (query, message) in [
        ("window=current", "window: must be day or calendar_month"),
        ("at=yesterday", "at: must be an RFC 3339 timestamp"),
        ("group_by=colour", "group_by: must be one of model, actor, agent, api_key"),
        ("group_by=model&project_id=proj_other", "project_id: is not a known field"),
    ] {
        let a = get(&f.app, &format!("{usage}?{query}"), Some(&session)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(a.body.contains(message), "{message} in {}", a.body);
    }
}

#[tokio::test]
async fn the_audit_trail_pages_by_the_apis_cursor() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    for i in 0..60 {
        let key = NewApiKey { name: format!("k{i}"), ..NewApiKey::default() };
        provisioning::create_api_key(&f.state, &f.project, key, &Principal::new("admin", "test")).await.expect("key");
    }
    // What the audit relay and folder would do: the outbox onto the audit log.
    let entries = f.store.unpublished_audit(1000).await.expect("outbox");
    assert_eq!(entries.len(), 62);
    let batch = AuditBatch {
        consumer: "tollgate-audit".into(),
        topic: "tollgate.audit".into(),
        offsets: vec![OffsetMove { partition: 0, from: 0, to: 62 }],
        entries,
    };
    f.store.fold_audit(&batch).await.expect("fold the audit");
    let base = format!("/console/projects/{}/audit", f.project);

    let odd = get(&f.app, &format!("{base}?after=&limit=5"), Some(&session)).await;
    assert_eq!(odd.status, StatusCode::BAD_REQUEST, "a parameter the page does not have");
    assert!(odd.body.contains("limit: is not a known field"), "{}", odd.body);
    let first = get(&f.app, &base, Some(&session)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(first.body.matches("<tr data-audit-id=").count(), 50);
    assert!(first.body.contains(r#"data-action="keys:CreateApiKey""#));
    let (_, next) = first.body.split_once(r#"<a id="next" rel="next" href=""#).expect("a next page");
    let next = next.split_once('"').expect("end").0.replace("&amp;", "&");
    assert!(next.starts_with(&format!("{base}?after=aud_")), "{next}");
    let second = get(&f.app, &next, Some(&session)).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.body.matches("<tr data-audit-id=").count(), 12);
    assert!(second.body.contains(r#"<span id="last">"#));
    // The API's page after the same cursor holds the same entries.
    let cursor = next.split_once("after=").expect("cursor").1;
    let api = Request::get(format!("/v1/audit?project_id={}&limit=50&after={cursor}", f.project))
        .header("authorization", format!("Bearer {ADMIN}"))
        .body(Body::empty())
        .expect("request");
    let api: serde_json::Value = serde_json::from_str(&send(&f.app, api).await.body).expect("json");
    let first_id = api["data"][0]["id"].as_str().expect("an id").to_owned();
    assert!(second.body.contains(&format!(r#"<tr data-audit-id="{first_id}""#)));

    let bad = get(&f.app, &format!("{base}?after=no%20such%20id"), Some(&session)).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.body.contains("after: "), "{}", bad.body);
}

#[tokio::test]
async fn exceptions_are_listed_by_quota() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let base = format!("/console/projects/{}/exceptions", f.project);
    let empty = get(&f.app, &base, Some(&session)).await;
    assert_eq!(empty.status, StatusCode::OK);
    assert!(empty.body.contains(r#"id="no-exceptions""#));
    let quota = quotas::list(&f.state, &f.project).await.expect("quotas").remove(0).quota;
    let exception = UnpricedException {
        project_id: f.project.clone(),
        quota_id: quota.id.clone(),
        limit: 25_000_000_000_000,
        window_key: "2026-08".into(),
        llm_events: 4,
        unpriced_events: 3,
        unpriced_rows: vec![PriceKey {
            provider: "acme".into(),
            model: "mystery".into(),
            component: Component::InputTokens,
        }],
        occurrence_count: 1,
        first_seen: at("2026-08-01T05:00:00Z"),
        last_seen: at("2026-08-01T05:00:00Z"),
    };
    f.store.file_exception(&exception).await.expect("filed");
    f.store.file_exception(&exception).await.expect("filed again");
    let page = get(&f.app, &base, Some(&session)).await;
    let row = page.body.split_once(&format!(r#"<tr data-quota-id="{}">"#, quota.id)).expect("its row").1;
    let row = row.split_once("</tr>").expect("end").0;
    assert!(row.contains("$25") && row.contains("3 of 4") && row.contains("acme / mystery / input_tokens"), "{row}");
    assert!(row.contains(r#"<td class="num">2</td>"#), "seen twice: {row}");
    let bad = get(&f.app, &format!("{base}?after=bad%20cursor"), Some(&session)).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_delivery_is_resent_from_the_webhook_page() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let new = webhooks::NewEndpoint {
        url: "https://hooks.example.com/tollgate".into(),
        event_types: EventTypes::parse(vec!["quota.exceeded".into()], "event_types").expect("types"),
        description: Some("billing".into()),
        enabled: true,
    };
    let made = webhooks::create(&f.state, &f.project, new, &Principal::new("admin", "test")).await.expect("endpoint");
    let wid = made.endpoint.id.clone();
    let mid = webhooks::test(&f.state, &wid).await.expect("a test message");
    let list = get(&f.app, &format!("/console/projects/{}/webhooks", f.project), Some(&session)).await;
    assert_eq!(list.status, StatusCode::OK);
    assert!(list.body.contains(&format!(r#"<tr data-webhook-id="{wid}">"#)));
    let page_uri = format!("/console/projects/{}/webhooks/{wid}", f.project);
    let page = get(&f.app, &page_uri, Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(!page.body.contains(&made.endpoint.secret), "the signing secret is never shown");
    assert!(page.body.contains(&format!(r#"<tr data-message-id="{mid}" data-status="pending">"#)), "{}", page.body);
    assert!(page.body.contains(&format!(r#"id="resend-{mid}""#)));

    let resend = format!("{page_uri}/deliveries/{mid}/resend");
    let next_attempt = || async {
        let q = webhooks::DeliveriesQuery { after: None, limit: 10 };
        webhooks::deliveries(&f.state, &wid, &q).await.expect("log").items.remove(0).next_attempt_at
    };
    let before = next_attempt().await;
    f.clock.advance(chrono::Duration::hours(1));
    assert_eq!(post(&f.app, &resend, Some(&session), &[]).await.status, StatusCode::FORBIDDEN);
    let a = post(&f.app, &resend, Some(&session), &[("csrf", &page.csrf()), ("message_id", "msg_other")]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("message_id: is not a known field"), "{}", a.body);
    assert_eq!(next_attempt().await, before, "not resent");
    let a = post(&f.app, &resend, Some(&session), &[("csrf", &page.csrf())]).await;
    assert_eq!((a.status, a.location()), (StatusCode::SEE_OTHER, Some(page_uri.as_str())));
    assert_eq!(next_attempt().await, Some(f.clock.now()), "due now, on a fresh schedule");
    // Under another project, or an unknown message: 404.
    let other =
        provisioning::create_project(&f.state, NewProject { name: "other".into(), timezone: chrono_tz::Tz::UTC })
            .await
            .expect("project");
    let elsewhere = format!("/console/projects/{}/webhooks/{wid}", other.id);
    assert_eq!(get(&f.app, &elsewhere, Some(&session)).await.status, StatusCode::NOT_FOUND);
    let a =
        post(&f.app, &format!("{elsewhere}/deliveries/{mid}/resend"), Some(&session), &[("csrf", &page.csrf())]).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    let a = post(&f.app, &format!("{page_uri}/deliveries/msg_nope/resend"), Some(&session), &[("csrf", &page.csrf())])
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn export_runs_are_listed_with_a_link_to_their_file() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let base = format!("/console/projects/{}/exports", f.project);
    let empty = get(&f.app, &base, Some(&session)).await;
    assert_eq!(empty.status, StatusCode::OK);
    assert!(empty.body.contains(r#"id="no-exports""#));
    fold(&f.store, 0, vec![call(&f, "c1", "2026-08-01T00:30:00Z")]).await;
    let body =
        serde_json::json!({"project_id": f.project, "period": "day", "dimensions": ["api_key"], "format": "csv"});
    let req = Request::post("/v1/exports")
        .header("authorization", format!("Bearer {ADMIN}"))
        .body(Body::from(body.to_string()))
        .expect("request");
    let made = send(&f.app, req).await;
    assert_eq!(made.status, StatusCode::CREATED, "{}", made.body);
    let run: serde_json::Value = serde_json::from_str(&made.body).expect("json");
    let run_id = run["id"].as_str().expect("an id").to_owned();

    let page = get(&f.app, &base, Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK);
    let status = run["status"].as_str().expect("a status");
    assert!(page.body.contains(&format!(r#"<tr data-run-id="{run_id}" data-status="{status}">"#)), "{}", page.body);
    let link = format!("{base}/{run_id}/file");
    assert!(page.body.contains(&format!(r#"href="{link}""#)), "{}", page.body);
    let file = get(&f.app, &link, Some(&session)).await;
    assert_eq!(file.status, StatusCode::OK);
    assert_eq!(file.headers["content-type"], "text/csv; charset=utf-8");
    // The same bytes as the API's download.
    let req = Request::get(format!("/v1/exports/{run_id}/file"))
        .header("authorization", format!("Bearer {ADMIN}"))
        .body(Body::empty())
        .expect("request");
    let api = send(&f.app, req).await;
    assert_eq!(file.body, api.body);
    assert!(file.body.contains(f.key.as_str()), "the key's usage is in it: {}", file.body);

    // Not without a session, not under another project, not an unknown run.
    let a = get(&f.app, &link, None).await;
    assert_eq!((a.status, a.location()), (StatusCode::SEE_OTHER, Some("/console/sign-in")));
    let other =
        provisioning::create_project(&f.state, NewProject { name: "other".into(), timezone: chrono_tz::Tz::UTC })
            .await
            .expect("project");
    let elsewhere = format!("/console/projects/{}/exports/{run_id}/file", other.id);
    assert_eq!(get(&f.app, &elsewhere, Some(&session)).await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(&f.app, &format!("{base}/exr_nope/file"), Some(&session)).await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn pipeline_health_shows_the_numbers_metrics_serves() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    assert_eq!(get(&f.app, "/console/health", None).await.status, StatusCode::SEE_OTHER);
    // Labels no other test records, so the counts are this test's alone.
    metrics::counter!("tollgate_dead_letters_total", "reason" => "console_test").increment(3);
    metrics::counter!("tollgate_publish_failures_total", "log" => "console_test").increment(2);
    fold(&f.store, 0, vec![call(&f, "c1", "2026-08-01T00:30:00Z"), call(&f, "c2", "2026-08-01T00:31:00Z")]).await;
    // The page before a projector of this process sampled its lag: none shown, and why.
    let page = get(&f.app, "/console/health", Some(&session)).await;
    assert!(page.body.contains(r#"<td class="num lag">—</td>"#), "{}", page.body);
    assert!(page.body.contains("no projector in this process samples the lag"), "{}", page.body);
    // As a projector of this process records it (the store's consumer, partition 0).
    let consumer = f.state.settings.exports.consumer.clone();
    metrics::gauge!("tollgate_projector_partition_lag_offsets", "consumer" => consumer, "partition" => "0").set(7.0);

    let page = get(&f.app, "/console/health", Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let row = |metric: &str, labels: &str| {
        let start = format!(r#"<tr data-metric="{metric}" data-labels="{labels}">"#);
        let r = page.body.split_once(&start).unwrap_or_else(|| panic!("{start} in {}", page.body)).1;
        r.split_once("</tr>").expect("end").0.to_owned()
    };
    assert!(
        row("tollgate_dead_letters_total", "reason=&quot;console_test&quot;").contains(r#"<td class="num">3</td>"#)
    );
    assert!(
        row("tollgate_publish_failures_total", "log=&quot;console_test&quot;").contains(r#"<td class="num">2</td>"#)
    );
    // The same number on /metrics.
    let metrics = get(&f.app, "/metrics", None).await;
    assert!(metrics.body.contains("tollgate_dead_letters_total{reason=\"console_test\"} 3"), "{}", metrics.body);
    // The projector's position per partition, from the store.
    assert!(
        page.body.contains(
            r#"<tr data-partition="0"><th scope="row">0</th><td class="num">2</td><td class="num lag">7</td></tr>"#
        ),
        "{}",
        page.body
    );
    assert!(page.body.contains(r#"id="health-link""#));

    // A deployment that reads its log back: the lag is the log's end now
    // against the stored offset, whatever a gauge says.
    let log = SqliteLog::new(f.store.pool().clone(), "tollgate.");
    log.publish(&[call(&f, "c3", "2026-08-01T00:32:00Z"), call(&f, "c4", "2026-08-01T00:33:00Z")])
        .await
        .expect("published");
    let end = meter::LogTail::ends(&log).await.expect("the log's end")[&0];
    let tail = gateway::seeding::TailSource {
        tail: Arc::new(log),
        consumer: f.state.settings.exports.consumer.clone(),
        topic: f.state.settings.exports.topic.clone(),
        flush_timeout: std::time::Duration::from_secs(1),
        lease_horizon: std::time::Duration::from_secs(60),
    };
    let app = gateway::app(f.state.clone().with_log_tail(tail));
    let page = get(&app, "/console/health", Some(&session)).await;
    let row = format!(r#"<td class="num">2</td><td class="num lag">{}</td>"#, end - 2);
    assert!(end > 2 && page.body.contains(&row), "{row} in {}", page.body);
}

#[tokio::test]
async fn the_consoles_heavy_reads_share_the_admin_apis_bounds() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let usage = format!("/console/projects/{}/usage", f.project);
    // Every one of the admin's concurrent usage reads taken, as four running API reports would.
    let mut held = Vec::new();
    for _ in 0..f.state.settings.heavy_concurrency {
        let claim = meter::PermitClaim {
            id: gateway::state::new_permit_id(),
            holder: "heavy:usage:admin_token".into(),
            cap: f.state.settings.heavy_concurrency,
            installation_cap: f.state.settings.installation_permits,
            lease: std::time::Duration::from_secs(60),
        };
        match f.state.permits.claim(&claim, f.clock.now()).await.expect("claim") {
            meter::Claimed::Granted(p) => held.push(p.id),
            meter::Claimed::Full(_) => panic!("the pool is the admin's alone here"),
        }
    }
    let refused = get(&f.app, &usage, Some(&session)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{}", refused.body);
    assert_eq!(refused.headers["retry-after"], "1");
    // Other pages are not heavy reads.
    assert_eq!(get(&f.app, &format!("/console/projects/{}", f.project), Some(&session)).await.status, StatusCode::OK);
    for id in &held {
        f.state.permits.release(id, f.clock.now()).await.expect("release");
    }
    assert_eq!(get(&f.app, &usage, Some(&session)).await.status, StatusCode::OK);
}

#[tokio::test]
async fn breaches_are_the_quota_notifications_the_fold_enqueued() {
    let f = fixture().await;
    let session = sign_in(&f.app).await;
    let base = format!("/console/projects/{}/breaches", f.project);
    let none = get(&f.app, &base, Some(&session)).await;
    assert_eq!(none.status, StatusCode::OK);
    assert!(none.body.contains(r#"id="no-breaches""#));
    let qid = quotas::list(&f.state, &f.project).await.expect("quotas").remove(0).quota.id;
    // Five calls against the key's 5 a day: 80 %, then 100 % and over.
    let calls = (1..=5).map(|i| call(&f, &format!("c{i}"), &format!("2026-08-01T0{i}:00:00Z"))).collect();
    fold(&f.store, 0, calls).await;

    let page = get(&f.app, &base, Some(&session)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let rows: Vec<(String, String)> = page
        .body
        .split(r#"<tr data-message-id=""#)
        .skip(1)
        .map(|r| {
            let id = r.split_once('"').expect("id").0.to_owned();
            let event = r.split_once(r#"data-event=""#).expect("event").1.split_once('"').expect("end").0.to_owned();
            (id, event)
        })
        .collect();
    let mut events: Vec<&str> = rows.iter().map(|(_, e)| e.as_str()).collect();
    events.sort_unstable();
    assert_eq!(events, ["quota.exceeded", "quota.nearly_used", "quota.nearly_used"], "{}", page.body);
    assert!(page.body.contains(&format!(r#"data-event="quota.exceeded" data-quota-id="{qid}">"#)));
    assert!(page.body.contains("(80 %, warning)") && page.body.contains("(100 %, critical)"), "{}", page.body);
    let exceeded = page.body.split_once(r#"data-event="quota.exceeded""#).expect("the breach").1;
    let exceeded = exceeded.split_once("</tr>").expect("end").0;
    assert!(
        exceeded.contains(r#"<td class="num observed">5</td><td class="num limit">5</td><td>enforce</td>"#),
        "{exceeded}"
    );

    // Paged by message id, as the API pages the delivery log.
    let after = get(&f.app, &format!("{base}?after={}", rows[0].0), Some(&session)).await;
    assert_eq!(after.body.matches("<tr data-message-id=").count(), 2);
    let bad = get(&f.app, &format!("{base}?after=not%20an%20id"), Some(&session)).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.body.contains("after: "));
}
