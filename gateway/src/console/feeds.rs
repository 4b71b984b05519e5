//! The console's pages of what the feeds hold: a project's breaches (the
//! `quota.exceeded` and `quota.nearly_used` notifications the notifier
//! enqueued from the fold), its audit trail (monitor breaches among the
//! admin changes), its unpriced-usage exceptions, and its webhook endpoints
//! with their delivery log and a resend button. Each list pages by the API's own cursor (its parameter
//! DTO read and checked, its service call), so a page of the console is a
//! page of the API: the link to the next one carries the `next` cursor.

use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use meter::{AuditAction, AuditEntry, FieldError, MessageId, ProjectId, UnpricedException, WebhookId};

use super::form::Fields;
use super::view::{self, amount, page, project_href, project_nav, when};
use super::{InProject, Posted, failure, heavy, html, refused, summary};
use crate::dto::prices::ExceptionParams;
use crate::dto::reports::AuditParams;
use crate::dto::webhooks::DeliveriesParams;
use crate::service::audit::{self, AuditQuery};
use crate::service::pricing::{self, ExceptionsQuery};
use crate::service::webhooks::{self, DeliveriesQuery};
use crate::service::{self, Page};
use crate::state::AppState;

/// Entries of one page of the console's audit trail and exceptions.
const PAGE: &str = "50";

/// A list page's query: its `after` cursor, if given and not empty. A
/// parameter the page does not have is refused (400, naming it).
pub(super) struct Paged(Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for Paged {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let fields = Fields::parse(parts.uri.query().unwrap_or("").as_bytes());
        fields.only(&["after"]).map_err(|e| refused(&e))?;
        Ok(Paged(fields.get("after").filter(|a| !a.is_empty()).map(str::to_owned)))
    }
}

/// The link to the next page, if there is one.
fn next_link(base: &str, next: Option<&String>) -> Markup {
    html! {
        nav.pager aria-label="Pages" {
            @if let Some(n) = next {
                a #next rel="next" href=(format!("{base}?after={}", form_urlencoded::byte_serialize(n.as_bytes()).collect::<String>())) { "Next page" }
            } @else { span #last { "Last page" } }
            " · " a href=(base) { "First page" }
        }
    }
}

pub(super) async fn audit_page(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Paged(after): Paged,
) -> Response {
    let params =
        AuditParams { scope: None, project_id: Some(pid.to_string()), after, limit: Some(PAGE.to_owned()), page: None };
    let q = match AuditQuery::try_from(params) {
        Ok(q) => q,
        Err(e) => return refused(&e),
    };
    let shown = async {
        let entries = audit::page(&s, &q).await?;
        let p = summary(&s, &pid).await?;
        Ok::<_, service::Error>(audit_view(&session.csrf, &p, &entries))
    };
    heavy(&s, "audit", async {
        match shown.await {
            Ok(markup) => html(StatusCode::OK, markup),
            Err(e) => failure(e),
        }
    })
    .await
}

fn audit_view(csrf: &str, p: &crate::service::provisioning::ProjectSummary, entries: &Page<AuditEntry>) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let base = format!("{}/audit", project_href(pid));
    page(
        &format!("Audit trail of {}", p.project.name),
        Some(csrf),
        &[(&p.project.name, project_href(pid)), ("Audit trail", base.clone())],
        html! {
            h1 { "Audit trail of " (p.project.name) }
            (project_nav(pid, "audit"))
            p { "Admin changes and monitor breaches, oldest first, as " code { "GET /v1/audit" } " pages them. "
                "An entry appears here once the audit folder has read it from the audit topic." }
            @if entries.items.is_empty() { p #no-entries { "No entries." } } @else {
                table #audit {
                    caption { (entries.items.len()) " entries" }
                    thead { tr { th scope="col" { "When" } th scope="col" { "Action" } th scope="col" { "By" }
                        th scope="col" { "Resource" } th scope="col" { "Detail" } } }
                    tbody {
                        @for e in &entries.items {
                            tr data-audit-id=(e.id) data-action=(e.action.as_str())
                                class=[(e.action == AuditAction::MonitorBreach).then_some("breach")] {
                                th scope="row" { (when(e.created_at, tz)) }
                                td { code { (e.action.as_str()) } }
                                td { @match &e.principal { Some(by) => { (by.kind) ":" (by.id) }, None => "—" } }
                                td { code { (e.resource) } }
                                td.detail { code { (serde_json::to_string(&e.detail).unwrap_or_default()) } }
                            }
                        }
                    }
                }
            }
            (next_link(&base, entries.next.as_ref()))
        },
    )
}

pub(super) async fn breaches_page(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Paged(after): Paged,
) -> Response {
    // The cursor is a message id, as the delivery log's is.
    let after = match after.map(MessageId::parse).transpose() {
        Ok(a) => a,
        Err(e) => return refused(&FieldError::new("after", e.to_string())),
    };
    let shown = async {
        let p = summary(&s, &pid).await?;
        let page = webhooks::breaches(&s, &pid, after.as_ref(), BREACHES).await?;
        Ok::<_, service::Error>(breaches_view(&session.csrf, &p, &page))
    };
    match shown.await {
        Ok(markup) => html(StatusCode::OK, markup),
        Err(e) => failure(e),
    }
}

/// Breaches of one page.
const BREACHES: usize = 50;

/// A field of a notification's `data`, as text.
fn datum(data: &serde_json::Value, field: &str) -> String {
    match &data[field] {
        serde_json::Value::Null => String::new(),
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

fn breaches_view(
    csrf: &str,
    p: &crate::service::provisioning::ProjectSummary,
    list: &Page<meter::Notification>,
) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let base = format!("{}/breaches", project_href(pid));
    page(
        &format!("Breaches of {}", p.project.name),
        Some(csrf),
        &[(&p.project.name, project_href(pid)), ("Breaches", base.clone())],
        html! {
            h1 { "Breaches of " (p.project.name) }
            (project_nav(pid, "breaches"))
            p { "Each quota over its limit (" code { "quota.exceeded" } ", enforce and monitor) or near it ("
                code { "quota.nearly_used" } " at 80 % and 100 %), once per window, oldest first, as the fold found them "
                "(whether or not a webhook endpoint took them)." }
            @if list.items.is_empty() { p #no-breaches { "No breaches." } } @else {
                table #breaches {
                    thead { tr { th scope="col" { "When" } th scope="col" { "Event" } th scope="col" { "Quota" }
                        th scope="col" { "Metric" } th scope="col" { "Window" } th scope="col" class="num" { "Observed" }
                        th scope="col" class="num" { "Limit" } th scope="col" { "Mode" } } }
                    tbody {
                        @for n in &list.items {
                            @let body: serde_json::Value = serde_json::from_str(&n.body).unwrap_or_default();
                            @let data = &body["data"];
                            @let quota = datum(data, "quota_id");
                            tr data-message-id=(n.id) data-event=(n.event_type) data-quota-id=(quota) {
                                th scope="row" { (when(n.created_at, tz)) }
                                td { (n.event_type)
                                    @let t = datum(data, "threshold");
                                    @if !t.is_empty() { " (" (t) " %, " (datum(data, "severity")) ")" } }
                                td { a href=(view::quota_href(pid, &quota)) { code { (quota) } } }
                                td { (datum(data, "metric")) }
                                td { (datum(data, "window")) " " code { (datum(data, "window_key")) } }
                                td.num.observed { (datum(data, "observed_value")) }
                                td.num.limit { (datum(data, "limit")) }
                                td { (datum(data, "mode")) }
                            }
                        }
                    }
                }
            }
            (next_link(&base, list.next.as_ref()))
        },
    )
}

pub(super) async fn exceptions_page(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Paged(after): Paged,
) -> Response {
    let params = ExceptionParams { project_id: Some(pid.to_string()), after, limit: Some(PAGE.to_owned()) };
    let q = match ExceptionsQuery::try_from(params) {
        Ok(q) => q,
        Err(e) => return refused(&e),
    };
    let shown = async {
        let p = summary(&s, &pid).await?;
        let list = pricing::exceptions(&s, &q).await?;
        Ok::<_, service::Error>(exceptions_view(&session.csrf, &p, &list))
    };
    match shown.await {
        Ok(markup) => html(StatusCode::OK, markup),
        Err(e) => failure(e),
    }
}

fn exceptions_view(
    csrf: &str,
    p: &crate::service::provisioning::ProjectSummary,
    list: &Page<UnpricedException>,
) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let base = format!("{}/exceptions", project_href(pid));
    page(
        &format!("Exceptions of {}", p.project.name),
        Some(csrf),
        &[(&p.project.name, project_href(pid)), ("Exceptions", base.clone())],
        html! {
            h1 { "Exceptions of " (p.project.name) }
            (project_nav(pid, "exceptions"))
            p { "Cost quotas whose window held usage with no price: that usage is in no cost. One per quota, "
                "with how often it was seen." }
            @if list.items.is_empty() { p #no-exceptions { "No exceptions." } } @else {
                table #exceptions {
                    thead { tr { th scope="col" { "Quota" } th scope="col" { "Window" } th scope="col" class="num" { "Limit" }
                        th scope="col" class="num" { "Unpriced LLM events" } th scope="col" { "Unpriced (provider, model, component)" }
                        th scope="col" class="num" { "Seen" } th scope="col" { "Last seen" } } }
                    tbody {
                        @for x in &list.items {
                            tr data-quota-id=(x.quota_id) {
                                th scope="row" { a href=(view::quota_href(pid, x.quota_id.as_str())) { code { (x.quota_id) } } }
                                td { code { (x.window_key) } }
                                td.num { (amount(meter::Metric::CostUsd, x.limit)) }
                                td.num { (x.unpriced_events) " of " (x.llm_events) }
                                td { ul.plain { @for k in &x.unpriced_rows {
                                    li { (k.provider) " / " (k.model) " / " (k.component.as_str()) } } } }
                                td.num { (x.occurrence_count) }
                                td { (when(x.last_seen, tz)) }
                            }
                        }
                    }
                }
            }
            (next_link(&base, list.next.as_ref()))
        },
    )
}

pub(super) async fn webhooks_page(InProject { session, id: pid }: InProject, State(s): State<AppState>) -> Response {
    let shown = async {
        let p = summary(&s, &pid).await?;
        let endpoints = webhooks::list(&s, &pid).await?;
        let pid = pid.as_str();
        let base = format!("{}/webhooks", project_href(pid));
        Ok::<_, service::Error>(page(
            &format!("Webhooks of {}", p.project.name),
            Some(&session.csrf),
            &[(&p.project.name, project_href(pid)), ("Webhooks", base.clone())],
            html! {
                h1 { "Webhooks of " (p.project.name) }
                (project_nav(pid, "webhooks"))
                @if endpoints.is_empty() { p #no-webhooks { "No endpoints. Subscribe one with "
                    code { "POST /v1/projects/{id}/webhooks" } "." } } @else {
                    table #webhooks {
                        thead { tr { th scope="col" { "Endpoint" } th scope="col" { "Events" } th scope="col" { "State" } } }
                        tbody {
                            @for e in &endpoints {
                                tr data-webhook-id=(e.id) {
                                    th scope="row" { a href=(format!("{base}/{}", e.id)) { (e.url) } }
                                    td { (e.event_types.as_slice().join(", ")) }
                                    td { (endpoint_state(e, p.project.timezone)) }
                                }
                            }
                        }
                    }
                }
            },
        ))
    };
    match shown.await {
        Ok(markup) => html(StatusCode::OK, markup),
        Err(e) => failure(e),
    }
}

/// Whether an endpoint is delivered to, and why not. (Its secrets are never shown.)
fn endpoint_state(e: &meter::Endpoint, tz: chrono_tz::Tz) -> Markup {
    html! {
        @if e.enabled {
            "enabled"
            @if let Some(since) = e.failing_since { "; failing since " (when(since, tz)) }
        } @else {
            "disabled" @if let Some(r) = &e.disabled_reason { ": " (r) }
        }
    }
}

/// The endpoint of a path, one of the project's (404 otherwise).
async fn endpoint_of(s: &AppState, pid: &ProjectId, raw: String) -> service::Result<meter::Endpoint> {
    let wid = crate::dto::path_id("webhook", raw, WebhookId::parse)?;
    let e = webhooks::get(s, &wid).await?;
    if &e.project_id != pid {
        return Err(service::Error::not_found("webhook", wid.as_str()));
    }
    Ok(e)
}

pub(super) async fn webhook_page(
    InProject { session, id: pid }: InProject,
    State(s): State<AppState>,
    Path((_, webhook_id)): Path<(String, String)>,
    Paged(after): Paged,
) -> Response {
    let q = match DeliveriesQuery::try_from(DeliveriesParams { after, limit: None }) {
        Ok(q) => q,
        Err(e) => return refused(&e),
    };
    let shown = async {
        let e = endpoint_of(&s, &pid, webhook_id).await?;
        let p = summary(&s, &pid).await?;
        let log = webhooks::deliveries(&s, &e.id, &q).await?;
        Ok::<_, service::Error>(webhook_view(&session.csrf, &p, &e, &log))
    };
    heavy(&s, "deliveries", async {
        match shown.await {
            Ok(markup) => html(StatusCode::OK, markup),
            Err(e) => failure(e),
        }
    })
    .await
}

fn webhook_view(
    csrf: &str,
    p: &crate::service::provisioning::ProjectSummary,
    e: &meter::Endpoint,
    log: &Page<meter::DeliveryLog>,
) -> Markup {
    let pid = p.project.id.as_str();
    let tz = p.project.timezone;
    let base = format!("{}/webhooks/{}", project_href(pid), e.id);
    page(
        &format!("Webhook {}", e.url),
        Some(csrf),
        &[
            (&p.project.name, project_href(pid)),
            ("Webhooks", format!("{}/webhooks", project_href(pid))),
            (e.id.as_str(), base.clone()),
        ],
        html! {
            h1 { "Webhook endpoint" }
            (project_nav(pid, "webhooks"))
            dl.facts #webhook data-webhook-id=(e.id) {
                dt { "URL" } dd { code { (e.url) } }
                dt { "Events" } dd { (e.event_types.as_slice().join(", ")) }
                dt { "State" } dd { (endpoint_state(e, tz)) }
                @if let Some(d) = &e.description { dt { "Description" } dd { (d) } }
            }
            h2 { "Delivery log" }
            @if log.items.is_empty() { p #no-deliveries { "Nothing delivered yet." } } @else {
                table #deliveries {
                    caption { "Oldest messages first, each with its attempts" }
                    thead { tr { th scope="col" { "Message" } th scope="col" { "Event" } th scope="col" { "Status" }
                        th scope="col" { "Attempts" } th scope="col" { "Resend" } } }
                    tbody {
                        @for d in &log.items {
                            tr data-message-id=(d.message.id) data-status=(d.status.as_str()) {
                                th scope="row" { code { (d.message.id) } br; (when(d.message.created_at, tz)) }
                                td { (d.message.event_type) @if d.message.test { " (test)" } }
                                td { (d.status.as_str())
                                    @if let Some(n) = d.next_attempt_at { br; "next attempt " (when(n, tz)) } }
                                td {
                                    @if d.attempts.is_empty() { "none yet" }
                                    ol.attempts { @for a in &d.attempts {
                                        li { "#" (a.number) " " (when(a.at, tz)) ": "
                                            @match a.status_code { Some(c) => { "HTTP " (c) }, None => "no response" }
                                            " in " (a.latency_ms) " ms"
                                            @if !a.response.is_empty() { " — " code { (a.response) } } }
                                    } }
                                }
                                td {
                                    form.resend id=(format!("resend-{}", d.message.id)) method="post"
                                        action=(format!("{base}/deliveries/{}/resend", d.message.id)) {
                                        input type="hidden" name="csrf" value=(csrf);
                                        button type="submit" { "Resend" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            (next_link(&base, log.next.as_ref()))
        },
    )
}

/// The resend button: `POST /v1/webhooks/{id}/deliveries/{message_id}/resend`'s call; a 303 back.
pub(super) async fn resend(
    InProject { id: pid, .. }: InProject,
    State(s): State<AppState>,
    Path((_, webhook_id, message_id)): Path<(String, String, String)>,
    Posted(fields): Posted,
) -> Response {
    if let Err(e) = fields.only(&[]) {
        return refused(&e);
    }
    let done = async {
        let e = endpoint_of(&s, &pid, webhook_id).await?;
        let mid = crate::dto::path_id("message", message_id, MessageId::parse)?;
        webhooks::resend(&s, &e.id, &mid).await?;
        Ok::<_, service::Error>(format!("{}/webhooks/{}", project_href(pid.as_str()), e.id))
    };
    match done.await {
        Ok(back) => Redirect::to(&back).into_response(),
        Err(e) => failure(e),
    }
}
