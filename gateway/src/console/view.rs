//! The console's pages, as maud templates compiled into the binary.
//!
//! Plain, semantic HTML that reads without JavaScript: tables with header
//! cells, a `<label>` for every input, every usage bar's value in text as
//! well as in its length and colour. What a browser test needs to find has
//! a stable `id` or `data-` attribute (`#keys`, `tr[data-key-id]`,
//! `.usage[data-quota-id]` with `data-percent` and `data-level`, `#grants`,
//! `#new-key`, `#new-secret`). A form carries the session's CSRF token in a
//! hidden `csrf` field. The bar is an inline SVG (attributes, not inline
//! styles, so the pages need no `style-src 'unsafe-inline'`).

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use maud::{DOCTYPE, Markup, html};
use meter::{ApiKey, FieldError, Metric, Mode, Quota, Role, Usd, Window};

use super::form::{Fields, GRANT_FIELDS, input_of};
use crate::dto::reports::{MemberUsageView, ModelUsageView};
use crate::service::provisioning::{KeyDetail, ProjectSummary};
use crate::service::usage::{GroupBy, Report, Rows};

/// A page: the layout around `body`. `csrf` is the session's token (none
/// on the sign-in page, which has no session and no sign-out button).
pub fn page(title: &str, csrf: Option<&str>, crumbs: &[(&str, String)], body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Tollgate console" }
                link rel="stylesheet" href="/console/static/console.css";
            }
            body {
                header.top {
                    a.brand href="/console" { "Tollgate console" }
                    @if csrf.is_some() {
                        nav.main aria-label="Console" {
                            a href="/console" { "Projects" } " · " a #health-link href="/console/health" { "Pipeline health" }
                        }
                    }
                    @if let Some(csrf) = csrf {
                        form #sign-out method="post" action="/console/sign-out" {
                            input type="hidden" name="csrf" value=(csrf);
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                @if !crumbs.is_empty() {
                    nav.crumbs aria-label="Breadcrumb" {
                        ol {
                            li { a href="/console" { "Projects" } }
                            @for (i, (name, href)) in crumbs.iter().enumerate() {
                                li { a href=(href) aria-current=[(i + 1 == crumbs.len()).then_some("page")] { (name) } }
                            }
                        }
                    }
                }
                main #main { (body) }
            }
        }
    }
}

/// A page that only says something (a refusal, an error).
pub fn message_page(title: &str, message: &str, sign_in_link: bool) -> Markup {
    page(
        title,
        None,
        &[],
        html! {
            h1 { (title) }
            p #message role="alert" { (message) }
            @if sign_in_link { p { a href=(super::session::SIGN_IN_PATH) { "Sign in" } } }
        },
    )
}

/// The sign-in page; `error` after a wrong token.
pub fn sign_in(nonce: &str, error: Option<&str>) -> Markup {
    page(
        "Sign in",
        None,
        &[],
        html! {
            h1 { "Sign in" }
            p { "Sign in with the installation's admin token (" code { "TOLLGATE_ADMIN_TOKEN" } ")." }
            form #sign-in method="post" action="/console/sign-in" {
                input type="hidden" name="csrf" value=(nonce);
                @if let Some(e) = error { p.error #sign-in-error role="alert" { (e) } }
                div.field {
                    label for="token" { "Admin token" }
                    input #token type="password" name="token" autocomplete="current-password" required
                        aria-describedby=[error.map(|_| "sign-in-error")];
                }
                button type="submit" { "Sign in" }
            }
        },
    )
}

/// `/console`: every project.
pub fn projects(csrf: &str, projects: &[ProjectSummary]) -> Markup {
    page(
        "Projects",
        Some(csrf),
        &[],
        html! {
            h1 { "Projects" }
            @if projects.is_empty() {
                p #no-projects { "No projects yet. Create one with " code { "POST /v1/projects" } "." }
            } @else {
                table #projects {
                    caption { (projects.len()) " projects" }
                    thead { tr { th scope="col" { "Name" } th scope="col" { "ID" } th scope="col" { "Time zone" }
                        th scope="col" class="num" { "API keys" } th scope="col" class="num" { "Quotas" } } }
                    tbody {
                        @for p in projects {
                            tr data-project-id=(p.project.id) {
                                th scope="row" { a href=(project_href(p.project.id.as_str())) { (p.project.name) } }
                                td { code { (p.project.id) } }
                                td { (p.project.timezone.name()) }
                                td.num data-keys=(p.keys) { (p.keys) }
                                td.num data-quotas=(p.quotas) { (p.quotas) }
                            }
                        }
                    }
                }
            }
        },
    )
}

pub fn project_href(id: &str) -> String {
    format!("/console/projects/{id}")
}

pub fn key_href(project: &str, key: &str) -> String {
    format!("/console/projects/{project}/keys/{key}")
}

/// One usage bar: a quota's count in its window against its limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bar {
    /// The quota's id (`role:<id>:calls` for a role's quota).
    pub id: String,
    /// What it counts, as a person reads it: `calls per rolling_1m (this key)`.
    pub label: String,
    pub metric: Metric,
    /// Durable + settled + reserved: what a check compares.
    pub count: u64,
    pub limit: u64,
    pub window_key: String,
    pub resets_at: Option<DateTime<Utc>>,
    /// `enforce` or `monitor`.
    pub mode: &'static str,
}

impl Bar {
    /// A bar of nothing against nothing, to fill in.
    pub fn empty() -> Bar {
        Bar {
            id: String::new(),
            label: String::new(),
            metric: Metric::Calls,
            count: 0,
            limit: 0,
            window_key: String::new(),
            resets_at: None,
            mode: "enforce",
        }
    }

    /// The whole percentage used, rounded down (100 for a zero limit).
    pub fn percent(&self) -> u64 {
        if self.limit == 0 {
            return 100;
        }
        u64::try_from(u128::from(self.count) * 100 / u128::from(self.limit)).unwrap_or(u64::MAX)
    }

    /// `ok` below 80 %, `warn` from 80 %, `full` from 100 %.
    pub fn level(&self) -> &'static str {
        match self.percent() {
            p if p >= 100 => "full",
            p if p >= 80 => "warn",
            _ => "ok",
        }
    }
}

/// A quantity of a metric as shown: dollars for `cost_usd` (picodollars
/// underneath), a whole number otherwise.
pub fn amount(metric: Metric, v: u64) -> String {
    match metric {
        Metric::CostUsd => format!("${}", Usd(i64::try_from(v).unwrap_or(i64::MAX))),
        _ => v.to_string(),
    }
}

/// An instant in the project's zone, with the zone.
pub fn when(at: DateTime<Utc>, tz: Tz) -> Markup {
    html! { time datetime=(at.to_rfc3339()) { (at.with_timezone(&tz).format("%Y-%m-%d %H:%M:%S %Z")) } }
}

/// A usage bar with its value in text: count of limit, percentage, window and reset.
pub fn bar(b: &Bar, tz: Tz) -> Markup {
    let pct = b.percent();
    let width = pct.min(100);
    html! {
        div class={ "usage " (b.level()) } data-quota-id=(b.id) data-percent=(pct) data-level=(b.level())
            data-count=(b.count) data-limit=(b.limit) {
            div.usage-label { (b.label) @if b.mode == "monitor" { " " span.tag { "monitor" } } }
            svg.bar viewBox="0 0 100 6" preserveAspectRatio="none" aria-hidden="true" focusable="false" {
                rect.track x="0" y="0" width="100" height="6" {}
                rect.fill x="0" y="0" width=(width) height="6" {}
            }
            p.usage-text {
                strong.pct { (pct) " %" } " — " (amount(b.metric, b.count)) " of " (amount(b.metric, b.limit))
                " in window " code { (b.window_key) }
                @if let Some(r) = b.resets_at { "; resets " (when(r, tz)) } @else { "; never resets" }
            }
        }
    }
}

/// A key's row on its project's page.
pub struct KeyRow<'a> {
    pub key: &'a ApiKey,
    pub bars: Vec<Bar>,
}

/// What the new-key form shows: the values typed and the refusal, after a bad post.
#[derive(Debug, Clone, Default)]
pub struct FormState {
    pub fields: Fields,
    pub error: Option<FieldError>,
}

/// A key just created: its secret, shown this once.
pub struct Issued<'a> {
    pub key: &'a ApiKey,
    pub secret: &'a str,
}

/// `/console/projects/{id}`: the project's keys with their bars, and the new-key form.
pub fn project(
    csrf: &str,
    p: &ProjectSummary,
    keys: &[KeyRow<'_>],
    roles: &[Role],
    form: &FormState,
    issued: Option<Issued<'_>>,
) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    page(
        &p.project.name,
        Some(csrf),
        &[(&p.project.name, project_href(pid))],
        html! {
            h1 { "Project " (p.project.name) }
            (project_nav(pid, "keys"))
            dl.facts {
                dt { "ID" } dd { code { (pid) } }
                dt { "Time zone" } dd { (tz.name()) }
                dt { "Quotas" } dd { (p.quotas) }
            }
            @if let Some(i) = issued {
                section #new-secret role="status" aria-labelledby="new-secret-title" {
                    h2 #new-secret-title { "Key " (i.key.name) " created" }
                    p { "Its secret is shown this once; copy it now:" }
                    p { code #secret data-key-id=(i.key.id) { (i.secret) } }
                    p { a href=(key_href(pid, i.key.id.as_str())) { "Go to the key" } }
                }
            }
            section aria-labelledby="keys-title" {
                h2 #keys-title { "API keys" }
                @if keys.is_empty() {
                    p #no-keys { "No keys yet." }
                } @else {
                    table #keys {
                        caption { (keys.len()) " keys, with the quotas that count their calls" }
                        thead { tr { th scope="col" { "Name" } th scope="col" { "ID" } th scope="col" { "Prefix" }
                            th scope="col" { "Role" } th scope="col" { "Usage" } } }
                        tbody {
                            @for k in keys {
                                tr data-key-id=(k.key.id) {
                                    th scope="row" { a href=(key_href(pid, k.key.id.as_str())) { (k.key.name) } }
                                    td { code { (k.key.id) } }
                                    td { code { (k.key.prefix) } }
                                    td { @if let Some(r) = &k.key.role_id { code { (r) } } @else { "—" } }
                                    td {
                                        @if k.bars.is_empty() { "no quota" }
                                        @for b in &k.bars { (bar(b, tz)) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            section aria-labelledby="new-key-title" {
                h2 #new-key-title { "New key" }
                form #new-key method="post" action=(format!("/console/projects/{pid}/keys")) novalidate {
                    input type="hidden" name="csrf" value=(csrf);
                    (error_summary(form.error.as_ref(), "new-key-error"))
                    (input(form, "name", "Name", "text", None))
                    (grant_inputs(form, roles, "new-key"))
                    button type="submit" { "Create key" }
                }
            }
        },
    )
}

/// A form's refusal, above its fields.
fn error_summary(error: Option<&FieldError>, id: &str) -> Markup {
    html! {
        @if let Some(e) = error {
            p.error id=(id) role="alert" data-field=(e.field) { (e.field) ": " (e.message) }
        }
    }
}

/// One labelled input, with its value as typed and its refusal beside it.
fn input(form: &FormState, name: &str, label: &str, kind: &str, hint: Option<&str>) -> Markup {
    let id = format!("f-{name}");
    let err = form.error.as_ref().filter(|e| input_of(&e.field) == name);
    let err_id = format!("{id}-error");
    let hint_id = format!("{id}-hint");
    let described = match (err.is_some(), hint.is_some()) {
        (true, true) => Some(format!("{err_id} {hint_id}")),
        (true, false) => Some(err_id.clone()),
        (false, true) => Some(hint_id.clone()),
        (false, false) => None,
    };
    html! {
        div.field.invalid[err.is_some()] {
            label for=(id) { (label) }
            input id=(id) name=(name) type=(kind) value=(form.fields.value(name))
                inputmode=[(kind == "text" && name != "name").then_some("numeric")]
                aria-invalid=[err.map(|_| "true")] aria-describedby=[described];
            @if let Some(h) = hint { small id=(hint_id) { (h) } }
            @if let Some(e) = err { span.field-error id=(err_id) { (e.message) } }
        }
    }
}

/// The grant inputs (role, max_concurrent, query_timeout, max_rows).
fn grant_inputs(form: &FormState, roles: &[Role], prefix: &str) -> Markup {
    let chosen = form.fields.value("role_id");
    let role_err = form.error.as_ref().filter(|e| e.field == "role_id");
    let role_id = format!("{prefix}-role");
    html! {
        div.field.invalid[role_err.is_some()] {
            label for=(role_id) { "Role" }
            select id=(role_id) name="role_id" aria-invalid=[role_err.map(|_| "true")] {
                option value="" selected[chosen.is_empty()] { "none" }
                @for r in roles {
                    option value=(r.id) selected[chosen == r.id.as_str()] { (r.name) " (" (r.id) ")" }
                }
                @if !chosen.is_empty() && !roles.iter().any(|r| r.id.as_str() == chosen) {
                    option value=(chosen) selected { (chosen) }
                }
            }
            @if let Some(e) = role_err { span.field-error { (e.message) } }
        }
        @for name in GRANT_FIELDS {
            (input(form, name, grant_label(name), "text", Some(grant_hint(name))))
        }
    }
}

fn grant_label(name: &str) -> &'static str {
    match name {
        "max_concurrent" => "Max concurrent calls",
        "query_timeout" => "Query timeout (seconds)",
        _ => "Max rows per call",
    }
}

fn grant_hint(name: &str) -> &'static str {
    match name {
        "max_concurrent" => "1–1000; empty for none",
        _ => "greater than 0; narrows the server's; empty for the server's",
    }
}

/// `/console/projects/{id}/keys/{key_id}`: the key, its bars, its limits
/// granted and effective, and the grant form.
pub fn key(csrf: &str, p: &ProjectSummary, d: &KeyDetail, bars: &[Bar], roles: &[Role], form: &FormState) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let k = &d.key;
    let opt = |v: Option<u64>| v.map_or_else(|| "—".to_owned(), |v| v.to_string());
    page(
        &k.name,
        Some(csrf),
        &[(&p.project.name, project_href(pid)), (&k.name, key_href(pid, k.id.as_str()))],
        html! {
            h1 { "API key " (k.name) }
            dl.facts #key data-key-id=(k.id) {
                dt { "ID" } dd { code { (k.id) } }
                dt { "Prefix" } dd { code { (k.prefix) } }
                dt { "Role" } dd { @if let Some(r) = &k.role_id { code { (r) } } @else { "none" } }
                dt { "Created" } dd { (when(k.created_at, tz)) }
            }
            section #usage aria-labelledby="usage-title" {
                h2 #usage-title { "Usage" }
                @if bars.is_empty() { p { "No quota counts this key's calls." } }
                @for b in bars { (bar(b, tz)) }
            }
            section aria-labelledby="limits-title" {
                h2 #limits-title { "Limits" }
                table #limits {
                    caption { "Granted to the key, and in effect (narrowed by its role and the server's)" }
                    thead { tr { th scope="col" { "Limit" } th scope="col" class="num" { "Granted" }
                        th scope="col" class="num" { "Effective" } } }
                    tbody {
                        tr data-limit="max_concurrent" {
                            th scope="row" { "Max concurrent calls" }
                            td.num.granted { (opt(k.grants.max_concurrent.map(u64::from))) }
                            td.num.effective { (opt(d.effective.max_concurrent.map(u64::from))) }
                        }
                        tr data-limit="query_timeout" {
                            th scope="row" { "Query timeout (s)" }
                            td.num.granted { (opt(k.grants.query_timeout)) }
                            td.num.effective { (crate::dto::check::whole_secs(d.bounds.query_timeout)) }
                        }
                        tr data-limit="max_rows" {
                            th scope="row" { "Max rows per page" }
                            td.num.granted { (opt(k.grants.max_rows)) }
                            td.num.effective { (d.bounds.max_rows) }
                        }
                        tr data-limit="stream_max_rows" {
                            th scope="row" { "Max rows per stream" }
                            td.num.granted { (opt(k.grants.max_rows)) }
                            td.num.effective { (d.bounds.stream_max_rows) }
                        }
                    }
                }
            }
            section aria-labelledby="grants-title" {
                h2 #grants-title { "Grants" }
                form #grants method="post" action=(format!("{}/grants", key_href(pid, k.id.as_str()))) novalidate {
                    input type="hidden" name="csrf" value=(csrf);
                    (error_summary(form.error.as_ref(), "grants-error"))
                    (grant_inputs(form, roles, "grants"))
                    button type="submit" { "Save grants" }
                }
            }
        },
    )
}

/// The links between a project's pages; `current` is marked.
pub fn project_nav(pid: &str, current: &str) -> Markup {
    let links = [
        ("keys", "API keys", project_href(pid)),
        ("quotas", "Quotas", format!("{}/quotas", project_href(pid))),
        ("usage", "Usage", format!("{}/usage", project_href(pid))),
        ("breaches", "Breaches", format!("{}/breaches", project_href(pid))),
        ("audit", "Audit trail", format!("{}/audit", project_href(pid))),
        ("exceptions", "Exceptions", format!("{}/exceptions", project_href(pid))),
        ("webhooks", "Webhooks", format!("{}/webhooks", project_href(pid))),
        ("exports", "Exports", format!("{}/exports", project_href(pid))),
    ];
    html! {
        nav.sub aria-label="Project" {
            ul {
                @for (name, label, href) in &links {
                    li { a href=(href) aria-current=[(*name == current).then_some("page")] { (label) } }
                }
            }
        }
    }
}

pub fn quota_href(project: &str, quota: &str) -> String {
    format!("/console/projects/{project}/quotas/{quota}")
}

/// Who a quota counts, as a person reads it.
pub fn scope_text(q: &Quota) -> String {
    match &q.spec.scope_ref {
        Some(r) => format!("{} {r}", q.spec.scope.as_str()),
        None if q.spec.scope == meter::Scope::Actor => "each actor".to_owned(),
        None if q.spec.scope == meter::Scope::Project => "the project".to_owned(),
        None => format!("every {}", q.spec.scope.as_str()),
    }
}

/// A quota's row on the quotas page: its bar, or why it has none.
pub struct QuotaRow<'a> {
    pub quota: &'a Quota,
    pub inert: bool,
    pub bar: Option<Bar>,
}

/// The form that switches a quota between enforce and monitor (`PATCH
/// /v1/quotas/{id}`'s `mode`); `from` is the page to come back to.
fn mode_form(csrf: &str, pid: &str, q: &Quota, from: &str) -> Markup {
    let to = match q.spec.mode {
        Mode::Enforce => Mode::Monitor,
        Mode::Monitor => Mode::Enforce,
    };
    html! {
        form.mode id=(format!("mode-{}", q.id)) method="post" action=(format!("{}/mode", quota_href(pid, q.id.as_str())))
            data-quota-id=(q.id) {
            input type="hidden" name="csrf" value=(csrf);
            input type="hidden" name="from" value=(from);
            input type="hidden" name="mode" value=(to.as_str());
            button type="submit" { "Switch to " (to.as_str()) }
        }
    }
}

/// When a quota has no bar: why.
fn no_bar(r: &QuotaRow<'_>) -> &'static str {
    if r.inert {
        "inert: its key was deleted"
    } else if r.quota.spec.scope == meter::Scope::Actor {
        "one budget per actor"
    } else {
        "no single counter"
    }
}

/// `/console/projects/{id}/quotas`: every quota with its usage, mode and switch.
pub fn quotas(csrf: &str, p: &ProjectSummary, rows: &[QuotaRow<'_>], error: Option<&FieldError>) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    page(
        &format!("Quotas of {}", p.project.name),
        Some(csrf),
        &[(&p.project.name, project_href(pid)), ("Quotas", format!("{}/quotas", project_href(pid)))],
        html! {
            h1 { "Quotas of " (p.project.name) }
            (project_nav(pid, "quotas"))
            (error_summary(error, "quotas-error"))
            @if rows.is_empty() {
                p #no-quotas { "No quotas yet." }
            } @else {
                table #quotas {
                    caption { (rows.len()) " quotas, with their usage in the current window" }
                    thead { tr { th scope="col" { "Quota" } th scope="col" { "Counts" } th scope="col" { "Metric" }
                        th scope="col" { "Window" } th scope="col" { "Usage" } th scope="col" { "Mode" } } }
                    tbody {
                        @for r in rows {
                            tr data-quota-id=(r.quota.id) data-mode=(r.quota.spec.mode.as_str()) {
                                th scope="row" { a href=(quota_href(pid, r.quota.id.as_str())) { code { (r.quota.id) } } }
                                td { (scope_text(r.quota)) }
                                td { (r.quota.spec.metric.as_str())
                                    @if let Some(m) = &r.quota.spec.meter_type { " (" (m) ")" } }
                                td { (r.quota.spec.window.as_str()) }
                                td {
                                    @match &r.bar {
                                        Some(b) => (bar(b, tz)),
                                        None => { "limit " (amount(r.quota.spec.metric, r.quota.spec.limit)) "; " (no_bar(r)) }
                                    }
                                }
                                td.mode {
                                    strong { (r.quota.spec.mode.as_str()) }
                                    (mode_form(csrf, pid, r.quota, "quotas"))
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// The chart's size, in its own units (the page scales it).
const CHART_W: u64 = 600;
const CHART_H: u64 = 160;

/// A quota's usage over its window as an SVG: one bar per slice, its height
/// the usage folded up to the slice's end, against a line at the limit.
/// `slots` is how many slices the whole window has (the bars so far take their share of the width).
pub fn chart(q: &Quota, series: &[(Window, u64)], slots: usize, tz: Tz) -> Markup {
    let limit = q.spec.limit;
    let mut running = 0u64;
    let cumulative: Vec<u64> = series
        .iter()
        .map(|(_, v)| {
            running = running.saturating_add(*v);
            running
        })
        .collect();
    // A tenth of headroom above the highest of the usage and the limit.
    let high = cumulative.iter().copied().chain([limit, 1]).max().unwrap_or(1);
    let top = high.saturating_add(high / 10).saturating_add(1);
    let y = |v: u64| CHART_H - u64::try_from(u128::from(v) * u128::from(CHART_H) / u128::from(top)).unwrap_or(CHART_H);
    let n = u64::try_from(series.len().max(slots).max(1)).unwrap_or(1);
    let bw = CHART_W / n;
    let level = |v: u64| Bar { count: v, limit, ..Bar::empty() }.level();
    let (first, last) = (series.first().map(|(w, _)| w.start), series.last().and_then(|(w, _)| w.resets_at));
    html! {
        figure #chart data-slices=(series.len()) {
            svg.chart viewBox=(format!("0 0 {CHART_W} {CHART_H}")) preserveAspectRatio="none" role="img"
                aria-labelledby="chart-title" {
                title #chart-title { "Usage of quota " (q.id) " over its window, against its limit" }
                rect.chart-bg x="0" y="0" width=(CHART_W) height=(CHART_H) {}
                @for (i, ((w, v), c)) in series.iter().zip(&cumulative).enumerate() {
                    @let x = u64::try_from(i).unwrap_or(0) * bw;
                    rect class={ "slice " (level(*c)) } x=(x) y=(y(*c)) width=(bw.saturating_sub(1).max(1))
                        height=(CHART_H - y(*c)) data-slice=(w.key) data-value=(v) data-cumulative=(c) {}
                }
                line.limit x1="0" x2=(CHART_W) y1=(y(limit)) y2=(y(limit)) {}
            }
            figcaption {
                "Folded usage, cumulative, by " (series.first().map_or("slice", |(w, _)| slice_noun(w)))
                @if let Some(f) = first { " from " (when(f, tz)) }
                @if let Some(l) = last { " to " (when(l, tz)) }
                "; the line is the limit (" (amount(q.spec.metric, limit)) ")."
            }
            details {
                summary { "The chart's numbers" }
                table #chart-data {
                    thead { tr { th scope="col" { "Slice" } th scope="col" class="num" { "In the slice" }
                        th scope="col" class="num" { "Cumulative" } } }
                    tbody {
                        @for ((w, v), c) in series.iter().zip(&cumulative) {
                            tr { th scope="row" { (when(w.start, tz)) } td.num { (amount(q.spec.metric, *v)) }
                                td.num { (amount(q.spec.metric, *c)) } }
                        }
                    }
                }
            }
        }
    }
}

fn slice_noun(w: &Window) -> &'static str {
    match w.kind {
        meter::WindowKind::Day => "day",
        meter::WindowKind::Rolling1m => "minute",
        _ => "hour",
    }
}

/// `/console/projects/{id}/quotas/{quota_id}`: a quota, its bar, its chart and its mode switch.
pub fn quota(csrf: &str, p: &ProjectSummary, row: &QuotaRow<'_>, series: &[(Window, u64)], slots: usize) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let q = row.quota;
    let sp = &q.spec;
    page(
        &format!("Quota {}", q.id),
        Some(csrf),
        &[
            (&p.project.name, project_href(pid)),
            ("Quotas", format!("{}/quotas", project_href(pid))),
            (q.id.as_str(), quota_href(pid, q.id.as_str())),
        ],
        html! {
            h1 { "Quota " code { (q.id) } }
            (project_nav(pid, "quotas"))
            dl.facts #quota data-quota-id=(q.id) data-mode=(sp.mode.as_str()) {
                dt { "Counts" } dd { (scope_text(q)) }
                dt { "Metric" } dd { (sp.metric.as_str()) @if let Some(m) = &sp.meter_type { " (" (m) ")" } }
                dt { "Window" } dd { (sp.window.as_str()) " in " (tz.name()) }
                dt { "Limit" } dd { (amount(sp.metric, sp.limit)) }
                dt { "Mode" } dd { strong { (sp.mode.as_str()) } (mode_form(csrf, pid, q, "quota")) }
                @if let Some(o) = sp.on_unpriced {
                    dt { "Unpriced usage" }
                    dd { @match o { meter::OnUnpriced::Block => "block", meter::OnUnpriced::Allow => "allow" } }
                }
            }
            section #usage aria-labelledby="usage-title" {
                h2 #usage-title { "Current window" }
                @match &row.bar {
                    Some(b) => (bar(b, tz)),
                    None => p { (no_bar(row)) }
                }
            }
            section aria-labelledby="chart-title-h" {
                h2 #chart-title-h { "Over the window" }
                @if series.is_empty() {
                    p #no-chart { "No chart for this quota (a one-minute window, storage, or no single counter)." }
                } @else {
                    (chart(q, series, slots, tz))
                }
            }
        },
    )
}

/// The usage page's choices, as typed.
pub struct UsageForm<'a> {
    pub group_by: &'a str,
    pub window: &'a str,
    pub at: &'a str,
}

/// `/console/projects/{id}/usage`: `GET /v1/usage`'s report, by model, actor, agent or key.
pub fn usage(
    csrf: &str,
    p: &ProjectSummary,
    form: &UsageForm<'_>,
    report: Option<&Report>,
    error: Option<&FieldError>,
) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let select = |name: &str, label: &str, options: &[&str], chosen: &str| {
        html! {
            div.field.invalid[error.is_some_and(|e| e.field == name)] {
                label for=(format!("u-{name}")) { (label) }
                select id=(format!("u-{name}")) name=(name) {
                    @for o in options { option value=(o) selected[*o == chosen] { (o) } }
                }
            }
        }
    };
    let groups: Vec<&str> = GroupBy::ALL.iter().map(|g| g.as_str()).collect();
    page(
        &format!("Usage of {}", p.project.name),
        Some(csrf),
        &[(&p.project.name, project_href(pid)), ("Usage", format!("{}/usage", project_href(pid)))],
        html! {
            h1 { "Usage of " (p.project.name) }
            (project_nav(pid, "usage"))
            form #usage-form method="get" action=(format!("{}/usage", project_href(pid))) {
                (error_summary(error, "usage-error"))
                (select("group_by", "Group by", &groups, form.group_by))
                (select("window", "Period", &["calendar_month", "day"], form.window))
                div.field.invalid[error.is_some_and(|e| e.field == "at")] {
                    label for="u-at" { "At (RFC 3339; empty for now)" }
                    input #u-at type="text" name="at" value=(form.at) placeholder="2026-08-01T00:00:00Z";
                }
                button type="submit" { "Show" }
            }
            @if let Some(r) = report {
                p #period { "Folded usage in " (r.window.kind.as_str()) " " code { (r.window.key) }
                    " (" (when(r.window.start, tz)) @if let Some(e) = r.window.resets_at { " to " (when(e, tz)) } ")."
                    " Costs are of priced usage only, in USD." }
                @match &r.rows {
                    Rows::Models(rows) => (model_table(rows)),
                    Rows::Members(rows) => (member_table(r.group_by, rows)),
                }
            }
        },
    )
}

fn model_table(rows: &[meter::ModelUsageRow]) -> Markup {
    let total = rows.iter().fold(Usd(0), |acc, r| Usd(acc.0.saturating_add(r.cost.0)));
    let unpriced = rows.iter().filter(|r| r.unpriced_quantity > 0).count();
    html! {
        @if rows.is_empty() { p #no-usage { "No usage folded in this period." } } @else {
            table #usage-table data-group-by="model" {
                caption { "By model: priced and unpriced quantities apart; cost of the priced" }
                thead { tr { th scope="col" { "Provider" } th scope="col" { "Model" } th scope="col" { "Component" }
                    th scope="col" { "Meter" } th scope="col" class="num" { "Priced quantity" }
                    th scope="col" class="num" { "Unpriced quantity" } th scope="col" class="num" { "Cost (USD)" } } }
                tbody {
                    @for r in rows {
                        @let v = ModelUsageView::from(r);
                        tr data-model=(v.model) data-component=(v.component) {
                            th scope="row" { (v.provider) }
                            td { (v.model) @if v.embedding { " (embedding)" } }
                            td { (v.component) }
                            td { (v.meter_type) }
                            td.num.priced { (v.priced_quantity) }
                            td.num.unpriced { (v.unpriced_quantity) }
                            td.num.cost { (v.cost_usd) }
                        }
                    }
                }
                tfoot { tr { th scope="row" colspan="6" { "Total priced cost" } td.num #total-cost { (total) } } }
            }
            @if unpriced > 0 {
                p #unpriced-note { (unpriced) " rows have unpriced usage, which no cost includes: put a price for them." }
            }
        }
    }
}

fn member_table(group_by: GroupBy, rows: &[crate::service::usage::Member]) -> Markup {
    let who = match group_by {
        GroupBy::Actor => "Actor",
        GroupBy::Agent => "Agent",
        _ => "API key",
    };
    html! {
        @if rows.is_empty() { p #no-usage { "No usage folded in this period." } } @else {
            table #usage-table data-group-by=(group_by.as_str()) {
                caption { "By " (who.to_lowercase()) ": counts, priced cost, and LLM events with unpriced usage" }
                thead { tr { th scope="col" { (who) } th scope="col" class="num" { "Requests" }
                    th scope="col" class="num" { "Calls" } th scope="col" class="num" { "Rows" }
                    th scope="col" class="num" { "Tokens" } th scope="col" class="num" { "Cost (USD, priced)" }
                    th scope="col" class="num" { "LLM events unpriced" } } }
                tbody {
                    @for m in rows {
                        @let v = MemberUsageView::from(m);
                        tr data-member=(m.id) {
                            th scope="row" { code { (m.id) } }
                            td.num { (v.requests) } td.num { (v.calls) } td.num { (v.rows) } td.num { (v.tokens) }
                            td.num.cost { (v.cost_usd) }
                            td.num.unpriced { (m.totals.llm_unpriced) }
                        }
                    }
                }
            }
        }
    }
}

/// The grant form's fields as the key has them now.
pub fn grant_fields(k: &ApiKey) -> Fields {
    let mut body = String::new();
    let mut add = |name: &str, v: Option<String>| {
        if let Some(v) = v {
            body.push_str(&format!("{name}={}&", form_urlencoded::byte_serialize(v.as_bytes()).collect::<String>()));
        }
    };
    add("role_id", k.role_id.as_ref().map(ToString::to_string));
    add("max_concurrent", k.grants.max_concurrent.map(|v| v.to_string()));
    add("query_timeout", k.grants.query_timeout.map(|v| v.to_string()));
    add("max_rows", k.grants.max_rows.map(|v| v.to_string()));
    Fields::parse(body.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(count: u64, limit: u64) -> Bar {
        Bar {
            id: "q".into(),
            label: "calls".into(),
            metric: Metric::Calls,
            count,
            limit,
            window_key: "2026-08".into(),
            resets_at: None,
            mode: "enforce",
        }
    }

    #[test]
    fn a_bar_turns_at_80_and_100_percent() {
        assert_eq!((b(7, 10).percent(), b(7, 10).level()), (70, "ok"));
        assert_eq!((b(79, 100).percent(), b(79, 100).level()), (79, "ok"));
        assert_eq!((b(4, 5).percent(), b(4, 5).level()), (80, "warn"));
        assert_eq!((b(99, 100).level(), b(5, 5).level(), b(12, 5).level()), ("warn", "full", "full"));
        assert_eq!(b(12, 5).percent(), 240, "the text says how far over");
        assert_eq!(b(u64::MAX, 1).percent(), u64::MAX, "no overflow");
        let html = bar(&b(12, 5), Tz::UTC).into_string();
        assert!(html.contains(r#"width="100""#) && html.contains("240 %"), "{html}");
    }

    #[test]
    fn money_is_shown_in_dollars_never_as_a_float() {
        assert_eq!(amount(Metric::CostUsd, 2_500_000_000), "$0.0025");
        assert_eq!(amount(Metric::Rows, 2_500), "2500");
    }
}
