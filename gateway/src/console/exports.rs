//! The console's exports page: a project's newest billing export runs with
//! how each ended, and a link to download the file of each one this server
//! holds (streamed, as `GET /v1/exports/{id}/file` streams it).

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::html;
use meter::export::ExportRun;

use super::view::{page, project_href, project_nav, when};
use super::{InProject, failure, html, summary};
use crate::service::{self, exports};
use crate::state::AppState;

/// Runs listed on the page.
const RUNS: usize = 50;

fn file_href(pid: &str, run: &str) -> String {
    format!("{}/exports/{run}/file", project_href(pid))
}

pub(super) async fn exports_page(InProject { session, id: pid }: InProject, State(s): State<AppState>) -> Response {
    let shown = async {
        let runs = exports::runs(&s, &pid, RUNS).await?;
        let p = summary(&s, &pid).await?;
        let tz = p.project.timezone;
        let pid = pid.as_str();
        Ok::<_, service::Error>(page(
            &format!("Exports of {}", p.project.name),
            Some(&session.csrf),
            &[(&p.project.name, project_href(pid)), ("Exports", format!("{}/exports", project_href(pid)))],
            html! {
                h1 { "Exports of " (p.project.name) }
                (project_nav(pid, "exports"))
                p { "The newest " (RUNS) " billing export runs. Start one with " code { "POST /v1/exports" }
                    ", " code { "tollgate export" } " or a schedule." }
                @if runs.is_empty() { p #no-exports { "No export runs yet." } } @else {
                    table #exports {
                        thead { tr { th scope="col" { "Run" } th scope="col" { "Period" } th scope="col" { "Format" }
                            th scope="col" { "Status" } th scope="col" { "Started" } th scope="col" { "Finished" }
                            th scope="col" class="num" { "Rows" } th scope="col" { "File" } } }
                        tbody {
                            @for r in &runs {
                                tr data-run-id=(r.id) data-status=(r.status.as_str()) {
                                    th scope="row" { code { (r.id) } }
                                    td { (r.spec.period.as_str()) }
                                    td { (r.format.extension()) }
                                    td { (r.status.as_str())
                                        @if let Some(m) = &r.mark { " (stopped at " (m.as_str()) ")" }
                                        @if let Some(e) = &r.error { br; small { (e) } } }
                                    td { (when(r.started_at, tz)) }
                                    td { @if let Some(f) = r.finished_at { (when(f, tz)) } @else { "—" } }
                                    td.num { (r.rows) }
                                    td { @if exports::server_file(&s, r).is_some() {
                                        a.download href=(file_href(pid, &r.id)) download { "Download" }
                                    } @else { "—" } }
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

/// A run's file, streamed; 404 unless the run is the project's and its file is one this server holds.
pub(super) async fn export_file(
    InProject { id: pid, .. }: InProject,
    State(s): State<AppState>,
    Path((_, run_id)): Path<(String, String)>,
) -> Response {
    let found = async {
        let run: ExportRun = exports::get(&s, &run_id).await?;
        let missing = || service::Error::not_found("export file", run_id.clone());
        if run.spec.project_id != pid {
            return Err(missing());
        }
        let path = exports::server_file(&s, &run).ok_or_else(missing)?;
        let file = tokio::fs::File::open(path).await.map_err(|_| missing())?;
        Ok((run, file))
    };
    match found.await {
        Ok((run, file)) => {
            let body = Body::from_stream(tokio_util::io::ReaderStream::new(file));
            let name = format!("attachment; filename=\"{}.{}\"", run.id, run.format.extension());
            ([(header::CONTENT_TYPE, run.format.content_type().to_owned()), (header::CONTENT_DISPOSITION, name)], body)
                .into_response()
        }
        Err(e) => failure(e),
    }
}
