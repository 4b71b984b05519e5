//! A tower [`Layer`] that gives a Rust (axum) service admission and metering
//! in-process, on the same ports and rules as the HTTP gateway.
//!
//! ```ignore
//! let app = Router::new()
//!     .route("/reports", get(reports))
//!     .layer(TollgateLayer::new(state));
//! ```
//!
//! For every request the layer:
//!
//! 1. identifies the caller by API key (`Authorization: Bearer <key>` or
//!    `x-api-key` by default); a missing or unknown key is answered
//!    `401 UNAUTHENTICATED` and the service is not called;
//! 2. runs the check ([`admission::admit`]): a refusal (`429 QUOTA_EXCEEDED` with
//!    `Retry-After` and the `X-Quota-*` headers, `503` by the view-down
//!    policy, …) is answered with the same body and headers as `/v1/check`,
//!    and the service is not called;
//!    The check also takes a permit when the key (or its role) has a
//!    `max_concurrent` cap, together with its reservation: over the cap the
//!    answer is `429 TOO_MANY_CONCURRENT` with `Retry-After: 1`, never
//!    queued. The permit is held for the life of the response body and
//!    freed when the body ends or is dropped (its lease, the effective
//!    `query_timeout` + 30 s, frees it if the process dies first);
//! 3. calls the service, with the [`Admission`] in the request's extensions
//!    (so a handler can read the key and its `max_rows`), for at most the
//!    effective `query_timeout` (the key's or role's grant, narrowed by the
//!    server's `TOLLGATE_QUERY_TIMEOUT`): a handler that has not answered by
//!    then is cancelled (its future dropped) and the caller is answered
//!    `503 heavy-request-timed-out`; the call is settled as failed;
//! 4. settles the call from the response: a 2xx is a successful `call` with
//!    the rows the service reported in the rows header (default
//!    `x-tollgate-rows`, removed before the response leaves); anything else is
//!    a failed `call`, which releases the reservation and counts nothing.
//!    The rows counted never exceed the call's bounds (the server's
//!    `TOLLGATE_MAX_PAGE_SIZE` / `TOLLGATE_STREAM_MAX_ROWS`, narrowed by the
//!    key's or role's `max_rows`):
//!    - a page that reports more rows than `max_rows` is cut to `max_rows`
//!      with `X-Has-More: true` when it is a JSON array
//!      (`application/json`); any other body reporting more is not sent —
//!      the caller gets `500 ROWS_OVER_LIMIT` and the call counts nothing;
//!    - a response that declares itself a stream of rows ([`RowStream`] in
//!      its extensions; one row per line, JSON Lines) is stopped after
//!      `stream_max_rows` rows or at the `query_timeout`, whichever comes
//!      first, and then ends with a mark line naming the bound it reached —
//!      `{"mark":"ROWS","limit":N}` or `{"mark":"TIME","limit_ms":N}`; it
//!      is settled when its body ends (or is dropped) with the rows it let
//!      through;
//! 5. records that fact ([`recording::record`]: into the view, then onto the log)
//!    before answering — with the check's request event ahead of it in the
//!    same publish when the service answered on its first poll (one append
//!    per call; a service that has to wait has the request event sent when
//!    it first waits, so a call in flight has its reservation on the log) —
//!    and adds the admission's `X-Quota-*` headers (and, for a request
//!    with `X-Tollgate-Explain: 1`, the check's explanation in the same
//!    header of the response: [`EXPLAIN_HEADER`]).
//!
//! If recording fails, the service's response is still sent (the call has
//! happened; refusing it now would help nobody), with a warning and
//! `tollgate_layer_record_failures_total`. Recording runs in the request's
//! task, and what is left of it when a client disconnects mid-way goes on
//! in a task of its own, so that cannot leave a settle without its publish.
//! If the service's future is dropped or panics before it answers, the
//! reservation is released at once instead of waiting for its lease.
//!
//! The layer works with whatever ports the [`AppState`] holds: the embedded
//! view and store, or Redis, PostgreSQL and Kafka.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, header};
use axum::response::{IntoResponse, Response};
use meter::{ApiKey, EventKind, Outcome, PermitId, ProjectId, ReservationId, UsageFact, View};
use tower::{Layer, Service};
use tracing::warn;

use store::outbox::Finishing;

use crate::error::{ApiError, ApiResult, put_remaining};
use crate::service::admission::{self, Admission, RequestEvent};
use crate::service::recording;
use crate::state::{AppState, new_event_id};

/// The request header that asks for the check to be explained (`1` or
/// `true`), and the response header that answers it: every quota limit the
/// check evaluated, as compact JSON (the `explain` list of `/v1/check`). A
/// refused call's body carries it as `/v1/check`'s does, beside `error`.
pub const EXPLAIN_HEADER: &str = "x-tollgate-explain";

/// Whether the request asks to be explained: `1`/`true`, `0`/`false`, or
/// absent; anything else is a 400 naming the header.
fn explain_asked(headers: &HeaderMap) -> ApiResult<bool> {
    let Some(v) = headers.get(EXPLAIN_HEADER) else { return Ok(false) };
    match v.to_str().map(str::trim) {
        Ok(v) if v == "1" || v.eq_ignore_ascii_case("true") => Ok(true),
        Ok(v) if v == "0" || v.eq_ignore_ascii_case("false") => Ok(false),
        _ => Err(ApiError::invalid(EXPLAIN_HEADER, "must be 1, true, 0 or false")),
    }
}

/// The header the key is read from besides `Authorization: Bearer`.
pub const DEFAULT_KEY_HEADER: &str = "x-api-key";
/// The response header in which the service reports the rows it returned.
pub const DEFAULT_ROWS_HEADER: &str = "x-tollgate-rows";
/// The conventional request header naming the end user, when enabled.
pub const DEFAULT_ACTOR_HEADER: &str = "x-tollgate-actor";

/// Where the layer finds the caller's API key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `Authorization: Bearer <key>` only.
    Bearer,
    /// The raw key in this header only.
    Header(HeaderName),
    /// `Authorization: Bearer <key>`, else the raw key in this header.
    BearerOrHeader(HeaderName),
}

#[derive(Debug, Clone)]
struct Config {
    key: KeySource,
    rows_header: HeaderName,
    actor_header: Option<HeaderName>,
}

/// Admission and metering for the service it wraps. Cheap to clone.
#[derive(Clone)]
pub struct TollgateLayer {
    /// Shared, so a request clones one pointer, not every port's.
    state: Arc<AppState>,
    config: Arc<Config>,
}

impl std::fmt::Debug for TollgateLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TollgateLayer").field("config", &self.config).finish_non_exhaustive()
    }
}

impl TollgateLayer {
    /// A layer over `state`'s ports: key from `Authorization: Bearer` or
    /// `x-api-key`, rows from `x-tollgate-rows`, no actor.
    pub fn new(state: AppState) -> Self {
        TollgateLayer {
            state: Arc::new(state),
            config: Arc::new(Config {
                key: KeySource::BearerOrHeader(HeaderName::from_static(DEFAULT_KEY_HEADER)),
                rows_header: HeaderName::from_static(DEFAULT_ROWS_HEADER),
                actor_header: None,
            }),
        }
    }

    /// Where the API key is read from.
    pub fn key_source(mut self, source: KeySource) -> Self {
        Arc::make_mut(&mut self.config).key = source;
        self
    }

    /// Reads the key from this header only (not from `Authorization`), for a
    /// service that uses `Authorization` for something else.
    pub fn key_header(self, name: HeaderName) -> Self {
        self.key_source(KeySource::Header(name))
    }

    /// The response header the service reports its rows in.
    pub fn rows_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.config).rows_header = name;
        self
    }

    /// Reads the actor (end user) from this request header, for `actor`
    /// quotas and attribution. Enable it only when the header is set by
    /// something the service trusts (a proxy or an outer layer that
    /// authenticated the user): a caller who can set it freely can spread
    /// calls over made-up actors. See [`DEFAULT_ACTOR_HEADER`].
    pub fn actor_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.config).actor_header = Some(name);
        self
    }

    /// The ports this layer runs on.
    pub fn state(&self) -> &AppState {
        &self.state
    }
}

impl<S> Layer<S> for TollgateLayer {
    type Service = TollgateService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TollgateService { inner, state: self.state.clone(), config: self.config.clone() }
    }
}

/// The service [`TollgateLayer`] wraps around another.
#[derive(Clone)]
pub struct TollgateService<S> {
    inner: S,
    state: Arc<AppState>,
    config: Arc<Config>,
}

impl<S> std::fmt::Debug for TollgateService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TollgateService").field("config", &self.config).finish_non_exhaustive()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S> Service<Request<Body>> for TollgateService<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // Take the instance that was polled ready; leave a fresh clone behind.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        let state = self.state.clone();
        let config = self.config.clone();
        Box::pin(async move { Ok(handle(state, config, inner, req).await) })
    }
}

async fn handle<S>(state: Arc<AppState>, config: Arc<Config>, mut inner: S, mut req: Request<Body>) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>,
{
    let (key, actor) = match identify(&state, &config, req.headers()).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let explain = match explain_asked(req.headers()) {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let (admission, permit, request) = match admission::admit_holding(&state, key, actor.clone(), explain).await {
        Ok(a) => a,
        Err(e) => return ApiError::from(e).into_response(),
    };
    if admission.exempt {
        // An administrator or break-glass caller: never limited or counted.
        req.extensions_mut().insert(admission);
        return match inner.call(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
    }
    // The release guard borrows the admission's ids, and a permit guard is
    // made only for a call that took a permit: a call costs them no copy of
    // an id and no count of the shared state's `Arc`.
    let guard =
        ReleaseGuard { state: &state, project: &admission.key.project_id, reservation: Some(&admission.reservation) };
    let held = permit.map(|p| PermitGuard { state: state.clone(), permit: Some(p.id) });
    let bounds = admission.bounds;
    let deadline = tokio::time::Instant::now() + bounds.query_timeout;
    req.extensions_mut().insert(admission.clone());

    // The request event waits for the service's first poll: a service that
    // answers at once has it published with the call's event, in one
    // publish; one that has to wait has it sent now, before it waits.
    let mut request = request;
    let mut call = std::pin::pin!(tokio::time::timeout_at(deadline, inner.call(req)));
    let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
    let answered = match first {
        Poll::Ready(answered) => answered,
        Poll::Pending => {
            if let Some(r) = request.take() {
                r.send();
            }
            call.await
        }
    };
    let mut res = match answered {
        Ok(Ok(r)) => r,
        Ok(Err(never)) => match never {},
        Err(_) => {
            metrics::counter!("tollgate_layer_timeouts_total").increment(1);
            ApiError::unavailable(
                "heavy-request-timed-out",
                format!(
                    "the service did not answer within its query_timeout of {} ms",
                    bounds.query_timeout.as_millis()
                ),
            )
            .into_response()
        }
    };

    let reported = res.headers_mut().remove(&config.rows_header);
    let success = res.status().is_success();
    if success && res.extensions().get::<RowStream>().is_some() {
        // Settled when the stream ends, with the rows it let through.
        guard.disarm();
        if let Some(r) = request.take() {
            r.send();
        }
        put_remaining(res.headers_mut(), &admission.remaining);
        explain_header(&mut res, &admission);
        res.headers_mut().remove(header::CONTENT_LENGTH);
        let settle = StreamSettle { state, admission, actor, status: res.status().as_u16(), done: false };
        let (parts, body) = res.into_parts();
        let rows = RowsBody::new(body, bounds, deadline, settle);
        return hold(Response::from_parts(parts, Body::new(rows)), held);
    }
    let (mut res, rows, success) = match success {
        true => bound_page(res, rows_of(reported.as_ref(), &config.rows_header), bounds.max_rows).await,
        false => (res, 0, false),
    };
    let fact = call_fact(&state, &admission, actor, success, rows);
    guard.disarm();
    if let Some(recorded) = record_call(&state, request, fact, res.status().as_u16()) {
        recorded.await;
    }

    put_remaining(res.headers_mut(), &admission.remaining);
    explain_header(&mut res, &admission);
    hold(res, held)
}

/// Answers a check that asked to be explained in [`EXPLAIN_HEADER`].
fn explain_header(res: &mut Response, admission: &Admission) {
    let Some(list) = &admission.explain else { return };
    let json = serde_json::to_string(&crate::dto::check::explained(list)).unwrap_or_default();
    match HeaderValue::from_str(&json) {
        Ok(v) => {
            res.headers_mut().insert(EXPLAIN_HEADER, v);
        }
        Err(_) => warn!("layer: the explanation is not a valid header value; not sent"),
    }
}

/// The response with its body holding the call's permit, if it took one.
fn hold(res: Response, held: Option<PermitGuard>) -> Response {
    let Some(held) = held else { return res };
    res.map(|body| Body::new(HeldBody { inner: body, held }))
}

/// The largest page the layer reads to cut it to `max_rows`.
const MAX_PAGE_BYTES: usize = 64 << 20;

/// A successful page bounded to `max_rows`: as it is when it reports no
/// more rows than that; else cut to `max_rows` with `X-Has-More: true` if
/// it is a JSON array; else refused (`500 ROWS_OVER_LIMIT`, a failed call).
/// Returns the response, the rows to count and whether the call succeeded.
async fn bound_page(res: Response, rows: u64, max_rows: u64) -> (Response, u64, bool) {
    if rows <= max_rows {
        return (res, rows, true);
    }
    let json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.trim_start().starts_with("application/json"));
    if json {
        let (mut parts, body) = res.into_parts();
        if let Ok(bytes) = axum::body::to_bytes(body, MAX_PAGE_BYTES).await
            && let Ok(serde_json::Value::Array(mut items)) = serde_json::from_slice(&bytes)
        {
            let had = items.len();
            items.truncate(usize::try_from(max_rows).unwrap_or(usize::MAX));
            if let Ok(cut) = serde_json::to_vec(&items) {
                parts.headers.remove(header::CONTENT_LENGTH);
                if had > items.len() {
                    parts.headers.insert(HAS_MORE, HeaderValue::from_static("true"));
                    metrics::counter!("tollgate_layer_pages_cut_total").increment(1);
                }
                let kept = u64::try_from(items.len()).unwrap_or(max_rows).min(max_rows);
                return (Response::from_parts(parts, Body::from(cut)), kept, true);
            }
        }
    }
    metrics::counter!("tollgate_layer_rows_over_limit_total").increment(1);
    warn!(rows, max_rows, "layer: a page past max_rows that is no JSON array cannot be cut; refused");
    let e = ApiError::new(
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        "ROWS_OVER_LIMIT",
        format!(
            "the service returned {rows} rows, past the call's max_rows of {max_rows}, in a body the layer cannot cut \
             (a JSON array, or a row stream)"
        ),
    );
    (e.into_response(), 0, false)
}

/// The header that says a page was cut at `max_rows`.
pub const HAS_MORE: HeaderName = HeaderName::from_static("x-has-more");

/// Declares a response a stream of rows, one per line (JSON Lines): put it
/// in the response's extensions. The layer stops the stream at the call's
/// `stream_max_rows` and at its `query_timeout`, ends it with a mark line
/// naming which (`ROWS` or `TIME`), and settles the call when the body
/// ends with the rows it let through.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowStream;

/// Records a call's fact so that settle and publish cannot be cut apart by
/// the client going away (a settle without its publish would leave a pending
/// delta that no fold ever drops). The recording runs here as far as it
/// goes without waiting, so a view and a log that answer at once (the
/// memory view, a log that only queues) cost no task; a failure is logged
/// and counted. Returns the rest of the recording if it has to wait
/// ([`Finishing`]: awaited, it runs in the caller's task; dropped first, in
/// a task of its own); `None` when it is done, or outside a runtime
/// (nothing to run it, nothing recorded). The check's request event,
/// when the call still holds it, is published in the same publish, ahead of
/// the call's.
fn record_call(
    state: &Arc<AppState>,
    request: Option<RequestEvent>,
    fact: UsageFact,
    status: u16,
) -> Option<Finishing<()>> {
    let rt = tokio::runtime::Handle::try_current().ok()?;
    let s = state.clone();
    let mut job: BoxFuture<()> = Box::pin(async move {
        let recorded = match request {
            Some(request) => recording::record_after(&s, request, vec![fact]).await,
            None => recording::record(&s, std::slice::from_ref(&fact)).await,
        };
        if let Err(e) = recorded {
            let e = ApiError::from(e);
            warn!(error = %format!("{}: {}", e.code, e.message), status, "layer: call not recorded");
            metrics::counter!("tollgate_layer_record_failures_total").increment(1);
        }
    });
    // Polled once here with a waker that does nothing: if it has to wait,
    // whoever runs the rest (the caller awaiting it, or the task it is
    // spawned into when dropped) polls it again at once with its own.
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match job.as_mut().poll(&mut cx) {
        Poll::Ready(()) => None,
        Poll::Pending => Some(Finishing::new(job, rt)),
    }
}

/// A stream's settle, made once: when its body ends, fails or is dropped.
struct StreamSettle {
    state: Arc<AppState>,
    admission: Admission,
    actor: Option<String>,
    status: u16,
    done: bool,
}

impl StreamSettle {
    fn settle(&mut self, rows: u64) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let fact = call_fact(&self.state, &self.admission, self.actor.take(), true, rows);
        // Not awaited: the body has ended, the caller has its answer.
        drop(record_call(&self.state, None, fact, self.status));
    }
}

impl Drop for StreamSettle {
    fn drop(&mut self) {
        // A body dropped before its first frame: nothing was sent.
        self.settle(0);
    }
}

/// Which bound stopped a stream.
#[derive(Debug, Clone, Copy)]
enum Mark {
    Rows(u64),
    Time(std::time::Duration),
}

impl Mark {
    fn line(self, partial: bool) -> axum::body::Bytes {
        let json = match self {
            Mark::Rows(limit) => serde_json::json!({"mark": "ROWS", "limit": limit}),
            Mark::Time(d) => {
                serde_json::json!({"mark": "TIME", "limit_ms": u64::try_from(d.as_millis()).unwrap_or(u64::MAX)})
            }
        };
        // On a line of its own, after a row cut mid-line.
        axum::body::Bytes::from(format!("{}{json}\n", if partial { "\n" } else { "" }))
    }

    fn name(self) -> &'static str {
        match self {
            Mark::Rows(_) => "ROWS",
            Mark::Time(_) => "TIME",
        }
    }
}

/// A row stream under its bounds (see [`RowStream`]).
struct RowsBody {
    inner: Option<Body>,
    bounds: meter::Bounds,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// Rows let through, each ended by a newline.
    rows: u64,
    /// Bytes of a row let through after the last newline.
    partial: bool,
    /// `stream_max_rows` rows let through: what comes next is cut.
    full: bool,
    /// The mark still to send.
    mark: Option<axum::body::Bytes>,
    settle: StreamSettle,
}

impl RowsBody {
    fn new(inner: Body, bounds: meter::Bounds, deadline: tokio::time::Instant, settle: StreamSettle) -> Self {
        RowsBody {
            inner: Some(inner),
            bounds,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            rows: 0,
            partial: false,
            full: false,
            mark: None,
            settle,
        }
    }

    /// The rows sent, a row cut mid-line included.
    fn sent(&self) -> u64 {
        self.rows.saturating_add(u64::from(self.partial))
    }

    fn finish(&mut self) {
        self.inner = None;
        let rows = self.sent();
        self.settle.settle(rows);
    }

    /// Stops the stream at `mark`: the mark line is its last frame.
    fn stop(&mut self, mark: Mark) -> Option<Result<http_body::Frame<axum::body::Bytes>, axum::Error>> {
        metrics::counter!("tollgate_layer_streams_stopped_total", "mark" => mark.name()).increment(1);
        let line = mark.line(self.partial);
        self.finish();
        Some(Ok(http_body::Frame::data(line)))
    }
}

impl Drop for RowsBody {
    fn drop(&mut self) {
        self.finish();
    }
}

impl http_body::Body for RowsBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(mark) = this.mark.take() {
            this.finish();
            return Poll::Ready(Some(Ok(http_body::Frame::data(mark))));
        }
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(this.stop(Mark::Time(this.bounds.query_timeout)));
        }
        let frame = match Pin::new(inner).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {
                this.finish();
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish();
                return Poll::Ready(Some(Err(e)));
            }
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        let data = match frame.into_data() {
            Ok(d) if !d.is_empty() => d,
            Ok(empty) => return Poll::Ready(Some(Ok(http_body::Frame::data(empty)))),
            // Trailers pass as they are.
            Err(other) => return Poll::Ready(Some(Ok(other))),
        };
        if this.full {
            return Poll::Ready(this.stop(Mark::Rows(this.bounds.stream_max_rows)));
        }
        let mut cut = None;
        for (i, b) in data.iter().enumerate() {
            this.partial = *b != b'\n';
            if *b == b'\n' {
                this.rows += 1;
                if this.rows >= this.bounds.stream_max_rows {
                    cut = Some(i + 1);
                    break;
                }
            }
        }
        let Some(n) = cut else { return Poll::Ready(Some(Ok(http_body::Frame::data(data)))) };
        this.full = true;
        if n < data.len() {
            // More than the bound in this frame: the rest is not sent.
            metrics::counter!("tollgate_layer_streams_stopped_total", "mark" => "ROWS").increment(1);
            this.mark = Some(Mark::Rows(this.bounds.stream_max_rows).line(false));
            this.inner = None;
        }
        Poll::Ready(Some(Ok(http_body::Frame::data(data.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none() && self.mark.is_none()
    }
}

/// A permit held for the life of a response body: freed when the body has
/// sent its last frame, or when it is dropped unfinished (the client went
/// away).
struct PermitGuard {
    state: Arc<AppState>,
    permit: Option<PermitId>,
}

impl PermitGuard {
    fn release(&mut self) {
        let Some(id) = self.permit.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let permits = self.state.permits.clone();
        let now = self.state.clock.now();
        rt.spawn(async move {
            match permits.release(&id, now).await {
                Ok(_) => metrics::counter!("tollgate_permits_released_total", "by" => "layer").increment(1),
                Err(e) => warn!(error = %e, permit = %id, "layer: permit not released; it lapses with its lease"),
            }
        });
    }
}

impl Drop for PermitGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// A response body that holds its call's permit until it ends.
struct HeldBody {
    inner: Body,
    held: PermitGuard,
}

impl http_body::Body for HeldBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.held.release();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The caller's key and actor, or the 401/400 to answer with.
async fn identify(state: &AppState, config: &Config, headers: &HeaderMap) -> ApiResult<(Arc<ApiKey>, Option<String>)> {
    let Some(secret) = secret(&config.key, headers) else {
        return Err(unauthenticated(&config.key, "an api key is required"));
    };
    let Some(key) = state.key_by_secret(secret).await? else {
        return Err(unauthenticated(&config.key, "unknown api key"));
    };
    let actor = match &config.actor_header {
        None => None,
        Some(name) => actor(headers, name)?,
    };
    Ok((key, actor))
}

fn unauthenticated(source: &KeySource, message: &str) -> ApiError {
    let e = match source {
        KeySource::Bearer => ApiError::unauthenticated(format!("{message} (Authorization: Bearer <key>)")),
        KeySource::Header(h) => ApiError::unauthenticated(format!("{message} ({h}: <key>)")),
        KeySource::BearerOrHeader(h) => {
            ApiError::unauthenticated(format!("{message} (Authorization: Bearer <key>, or {h}: <key>)"))
        }
    };
    match source {
        KeySource::Header(_) => e,
        _ => e.header("www-authenticate", "Bearer"),
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    headers.get(name)?.to_str().ok().map(str::trim).filter(|s| !s.is_empty())
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

fn secret<'a>(source: &KeySource, headers: &'a HeaderMap) -> Option<&'a str> {
    match source {
        KeySource::Bearer => bearer(headers),
        KeySource::Header(h) => header_str(headers, h),
        KeySource::BearerOrHeader(h) => bearer(headers).or_else(|| header_str(headers, h)),
    }
}

fn actor(headers: &HeaderMap, name: &HeaderName) -> ApiResult<Option<String>> {
    let Some(v) = headers.get(name) else { return Ok(None) };
    let v = v.to_str().map_err(|_| ApiError::invalid(name.as_str(), "must be visible ASCII"))?.trim();
    if v.is_empty() {
        return Ok(None);
    }
    meter::ids::check_id(v).map_err(|e| ApiError::invalid(name.as_str(), e.to_string()))?;
    Ok(Some(v.to_owned()))
}

/// The rows a 2xx reported; a value that is not a whole number counts 0.
fn rows_of(value: Option<&HeaderValue>, name: &HeaderName) -> u64 {
    let Some(v) = value else { return 0 };
    match v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()).filter(|n| *n <= i64::MAX as u64) {
        Some(n) => n,
        None => {
            warn!(header = %name, value = ?v, "layer: rows header is not a whole number; counting 0 rows");
            metrics::counter!("tollgate_layer_bad_rows_total").increment(1);
            0
        }
    }
}

fn call_fact(state: &AppState, admission: &Admission, actor: Option<String>, success: bool, rows: u64) -> UsageFact {
    let now = state.clock.now();
    UsageFact {
        api_key_id: Some(admission.key.id.clone()),
        actor_id: actor,
        outcome: if success { Outcome::Success } else { Outcome::Failure },
        rows,
        reservation_id: Some(admission.reservation.clone()),
        gateway: state.settings.instance.clone(),
        received_at: Some(now),
        ..UsageFact::new(new_event_id("evt"), admission.key.project_id.clone(), EventKind::Call, now)
    }
}

/// Releases an admitted call's reservation if the call never reaches its
/// settlement (the service's future was dropped or panicked).
struct ReleaseGuard<'a> {
    state: &'a AppState,
    project: &'a ProjectId,
    reservation: Option<&'a ReservationId>,
}

impl ReleaseGuard<'_> {
    fn disarm(mut self) {
        self.reservation = None;
    }
}

impl Drop for ReleaseGuard<'_> {
    fn drop(&mut self) {
        let Some(reservation) = self.reservation.take().cloned() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let view = self.state.view.clone();
        let project = self.project.clone();
        let at = self.state.clock.now();
        rt.spawn(async move {
            if let Err(e) = view.release(&project, &reservation, at).await {
                warn!(error = %e, %project, "layer: reservation not released; its lease will free it");
            }
        });
    }
}

#[cfg(all(test, feature = "embedded"))]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_trait::async_trait;
    use axum::Router;
    use axum::routing::get;
    use meter::{Log, Metric, PortError, PortResult, Principal, WindowKind};
    use store::{MemoryView, SqliteStore};
    use tokio::sync::Semaphore;
    use tower::ServiceExt;

    use super::*;
    use crate::Settings;
    use crate::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
    use crate::state::SystemClock;

    /// A log whose publishes each wait for a permit of `gate`, then keep
    /// their facts.
    struct GatedLog {
        gate: Semaphore,
        taken: Mutex<Vec<UsageFact>>,
    }

    #[async_trait]
    impl Log for GatedLog {
        async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
            let _permit = self.gate.acquire().await.map_err(|e| PortError::Transient(e.to_string()))?;
            self.taken.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(facts);
            Ok(())
        }
    }

    /// A log that keeps every publish it took, each as it came.
    #[derive(Default)]
    struct PublishLog {
        publishes: Mutex<Vec<Vec<UsageFact>>>,
    }

    #[async_trait]
    impl Log for PublishLog {
        async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
            self.publishes.lock().unwrap_or_else(|e| e.into_inner()).push(facts.to_vec());
            Ok(())
        }
    }

    impl PublishLog {
        /// The kinds of each publish, in order.
        fn kinds(&self) -> Vec<Vec<EventKind>> {
            let publishes = self.publishes.lock().unwrap_or_else(|e| e.into_inner());
            publishes.iter().map(|p| p.iter().map(|f| f.kind).collect()).collect()
        }
    }

    /// A state over `log` with a project, a key and a `calls` quota of 10;
    /// the key's secret.
    async fn layered_state(log: Arc<dyn Log>) -> (AppState, String, std::path::PathBuf) {
        layered_state_over(log, MemoryView::new()).await
    }

    /// [`layered_state`] over a view the test keeps a handle of.
    async fn layered_state_over(log: Arc<dyn Log>, view: MemoryView) -> (AppState, String, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("tollgate-layer-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let state =
            AppState::new(Arc::new(store), Arc::new(view), log, Arc::new(SystemClock), Settings::new("adm", "gw"));
        let starter = Starter {
            project: NewProject { name: "p".into(), timezone: chrono_tz::Tz::UTC },
            key: NewApiKey { name: "k".into(), ..NewApiKey::default() },
            quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: 10 }),
        };
        let made = provisioning::provision(&state, starter, &Principal::new("admin", "test")).await.expect("provision");
        (state, made.secret, dir)
    }

    /// The layer over a service that answers `ok` once it takes a permit
    /// of `gate`.
    fn gated_app(state: AppState, gate: Arc<Semaphore>) -> Router {
        Router::new()
            .route(
                "/x",
                get(move || {
                    let gate = gate.clone();
                    async move {
                        let _permit = gate.acquire().await.expect("semaphore");
                        "ok"
                    }
                }),
            )
            .layer(TollgateLayer::new(state))
    }

    fn get_with(secret: &str) -> Request<Body> {
        Request::get("/x").header("authorization", format!("Bearer {secret}")).body(Body::empty()).expect("request")
    }

    /// A service that answers on its first poll has the check's request
    /// event published with the call's, in one publish, request first, both
    /// naming the reservation.
    #[tokio::test]
    async fn a_call_answered_at_once_is_one_publish_behind_its_request_event() {
        let log = Arc::new(PublishLog::default());
        let (state, secret, dir) = layered_state(log.clone()).await;
        let app = Router::new().route("/x", get(|| async { "ok" })).layer(TollgateLayer::new(state));
        let res = app.clone().oneshot(get_with(&secret)).await.expect("answer");
        assert_eq!(res.status(), axum::http::StatusCode::OK);
        assert_eq!(log.kinds(), vec![vec![EventKind::Request, EventKind::Call]]);
        let publishes = log.publishes.lock().expect("lock").clone();
        let [request, call] = publishes[0].as_slice() else { panic!("two facts") };
        assert!(request.reservation_id.is_some());
        assert_eq!(request.reservation_id, call.reservation_id);
        assert_eq!(request.admitted, Some(true));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A service that has to wait has the check's request event on the log
    /// before it answers (its reservation is recoverable from the log while
    /// the call is in flight); the call's event follows on its own.
    #[tokio::test]
    async fn a_waiting_call_has_its_request_event_published_before_it_answers() {
        let log = Arc::new(PublishLog::default());
        let (state, secret, dir) = layered_state(log.clone()).await;
        let go = Arc::new(Semaphore::new(0));
        let app = gated_app(state, go.clone());
        let call = tokio::spawn(app.oneshot(get_with(&secret)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while log.kinds().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "no request event while the service waits");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(log.kinds(), vec![vec![EventKind::Request]], "the request event alone, the call still waiting");
        go.add_permits(1);
        let res = call.await.expect("task").expect("answer");
        assert_eq!(res.status(), axum::http::StatusCode::OK);
        assert_eq!(log.kinds(), vec![vec![EventKind::Request], vec![EventKind::Call]]);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A service that panics on its first poll: the request event held for
    /// the call's publish is sent anyway (dropped with the request's future).
    #[tokio::test]
    async fn a_request_event_held_for_the_call_is_sent_when_the_service_panics() {
        let log = Arc::new(PublishLog::default());
        let (state, secret, dir) = layered_state(log.clone()).await;
        let app = Router::new()
            .route(
                "/x",
                get(|| async {
                    if std::hint::black_box(true) {
                        panic!("the service fails");
                    }
                    "never"
                }),
            )
            .layer(TollgateLayer::new(state));
        let panicked = tokio::spawn(app.oneshot(get_with(&secret))).await;
        assert!(panicked.is_err_and(|e| e.is_panic()), "the service's panic reaches the caller's task");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while log.kinds().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "the held request event was never sent");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(log.kinds(), vec![vec![EventKind::Request]]);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A caller that goes away while the service still works (its future
    /// dropped, as hyper drops it when the connection closes) frees the
    /// call's reservation at once, not at the end of its lease: the
    /// release guard.
    #[tokio::test]
    async fn a_call_dropped_before_the_service_answers_frees_its_reservation() {
        let view = MemoryView::new();
        let log = Arc::new(PublishLog::default());
        let (state, secret, dir) = layered_state_over(log, view.clone()).await;
        let project = state.key_by_secret(&secret).await.expect("lookup").expect("key").project_id.clone();
        let app = gated_app(state, Arc::new(Semaphore::new(0)));
        let held = |view: &MemoryView| view.dump(&project).leases.values().map(|l| l.leases.len()).sum::<usize>();

        let mut call = Box::pin(app.oneshot(get_with(&secret)));
        assert!(tokio::time::timeout(Duration::from_millis(200), call.as_mut()).await.is_err(), "answered");
        assert_eq!(held(&view), 1, "the call holds its reservation while the service works");
        drop(call);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while held(&view) > 0 {
            assert!(tokio::time::Instant::now() < deadline, "the reservation was left to its lease");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A caller that goes away while its call is being recorded (the log
    /// is slow to acknowledge) leaves no settle without its publish: the
    /// recording goes on without it, and the call's event reaches the log.
    #[tokio::test]
    async fn a_call_is_recorded_when_its_caller_goes_away_mid_way() {
        let log = Arc::new(GatedLog { gate: Semaphore::new(0), taken: Mutex::default() });
        let (state, secret, dir) = layered_state(log.clone()).await;
        let app = Router::new().route("/x", get(|| async { "ok" })).layer(TollgateLayer::new(state));

        // The service answers; the recording waits for the log; the caller gives up.
        let call = app.oneshot(get_with(&secret));
        assert!(tokio::time::timeout(Duration::from_millis(300), call).await.is_err(), "answered before the log");
        assert!(log.taken.lock().expect("lock").is_empty(), "nothing was acknowledged yet");

        log.gate.add_permits(16);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let kinds: Vec<EventKind> = log.taken.lock().expect("lock").iter().map(|f| f.kind).collect();
            if kinds.contains(&EventKind::Call) {
                assert!(kinds.contains(&EventKind::Request), "the check's request event too: {kinds:?}");
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the call's event never reached the log: {kinds:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
