//! # The outbox: what a publish leaves behind when the log does not answer
//!
//! Why it exists: a log outage must not switch a quota off (DESIGN §2,
//! guarantee 10). The gateway settles a call into the view *before* it
//! publishes the call's event; if the publish fails and the gateway took the
//! settlement back, the slot would be free again while the call happened — so
//! it keeps it, and the event must then reach the log eventually or the view
//! and the log disagree for good. The outbox is that "eventually": every
//! record a publish hands over stays here, in this process, until the log
//! acknowledged it, and is sent again until it is. Both logs use it
//! ([`KafkaLog`](crate::KafkaLog), [`SqliteLog`](crate::SqliteLog)), each
//! through a [`Transport`] that makes one attempt.
//!
//! ## What a publish answers (the [`Log`](meter::Log) contract)
//!
//! - `Ok` once every record of the publish is acknowledged;
//! - `Transient` after [`PublishOptions::timeout`] (2 s by default) if they
//!   are not — they stay queued — and **at once** (after [`DOWN_WAIT`],
//!   0.1 s, in case the log just came back) when the log is known to be
//!   unreachable: the transport says so, or since the last acknowledgement
//!   an attempt failed or a publish waited its whole timeout (a log that
//!   answers nothing reports no failure). The caller is told promptly and
//!   the records still go out when the log is back;
//! - `Transient` with nothing queued when the queue is full
//!   ([`PublishOptions::queue`] records not yet acknowledged) or there is no
//!   tokio runtime to retry on: the caller must publish again;
//! - `Permanent` when the transport refuses a record for good (it is
//!   dropped, logged and counted, never retried).
//!
//! ## How
//!
//! Each publish is a *job*: it sends its records, sleeps ([`RETRY_MIN`],
//! doubling to [`RETRY_MAX`]) and sends again those that failed
//! transiently, until none is left. The publish runs its job in the
//! caller's task (no task per publish while the log answers) and waits for
//! it (and for the jobs of its records that were already queued) up to the
//! timeout; giving up waiting, or being dropped, does not stop the job: it
//! goes on in a task of its own ([`Finishing`]). Jobs queued without waiting
//! ([`Outbox::queue`]) are sent by a *pump*, one task that sends every such
//! job queued so far in one attempt, waits for it (at most [`QUEUED_WAIT`])
//! and starts again with what was queued meanwhile: no task per job, and
//! under load one attempt of them on its way at a time, so the transport is
//! not handed records one by one while its last ones are still on their way
//! (an idempotent librdkafka producer with five or more records in flight to
//! a partition sends nothing more until they are answered, and polls in a
//! loop meanwhile). A job whose records must be sent again goes on in a task
//! of its own, so an outage does not hold the pump up. A record with an id
//! (a usage fact: project and event id) that is already queued is not queued
//! again: its publish waits for the job that holds it, so a client retrying
//! through an outage does not fill the queue with copies. [`Outbox::flush`]
//! waits for every job started before it.
//!
//! A record sent again after a failure may already be on the log (the ack
//! was lost, not the record): the log then holds it twice, and the fold
//! counts it once (dedup by event id). It also lands after records published
//! later, so the order of one project's facts holds only for records that
//! never failed; the fold does not depend on it.
//!
//! Records still queued when the process dies are lost (they were never
//! acknowledged); whatever the caller wrote ahead of them (a pending delta in
//! the view) over-counts until it expires — never under-counts.
//!
//! Telemetry: `tollgate_publish_queue_depth` (gauge: records awaiting the
//! log), `tollgate_publish_failures_total` (records whose attempt failed and
//! were queued again), `tollgate_publish_queue_full_total` (publishes refused
//! because the queue was full), `tollgate_publish_dropped_total` (records the
//! log refused for good), each labelled with the log (`kafka`, `sqlite`).

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use meter::{PortError, PortResult};
use tokio::sync::watch;
use tracing::{error, info, warn};

/// The first pause before a failed record is sent again.
pub const RETRY_MIN: Duration = Duration::from_millis(100);
/// The longest pause between two attempts of one record: after an outage,
/// queued records go out within this of the log answering again.
pub const RETRY_MAX: Duration = Duration::from_secs(1);

/// How long a publish waits while the log is known to be unreachable: long
/// enough for the acknowledgement of a log that just came back (the state
/// changes only with the next success), short enough to be "at once".
pub const DOWN_WAIT: Duration = Duration::from_millis(100);

/// The longest a record queued without a waiting publish waits for the
/// pump's attempt on its way before it goes out in the next one: the log
/// normally answers well within it (records queued meanwhile then go
/// together, and a producer is never handed more while its last ones are on
/// their way), and a slow answer holds nothing back longer than this.
pub const QUEUED_WAIT: Duration = Duration::from_millis(10);

/// How a log's publishes wait and queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishOptions {
    /// The longest a publish waits for its acknowledgement before it answers
    /// "not yet" (its records stay queued).
    pub timeout: Duration,
    /// Most records waiting for an acknowledgement in this process; a
    /// publish that would pass it queues nothing and is refused.
    pub queue: usize,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions { timeout: Duration::from_secs(2), queue: 100_000 }
    }
}

/// One record to put on the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutRecord {
    pub key: Vec<u8>,
    pub payload: Vec<u8>,
    /// What makes two records the same fact (project and event id), if
    /// anything: a record whose id is queued is not queued again.
    pub id: Option<String>,
}

/// The records of usage facts: each Avro encoded ([`schemas::encode_usage`]),
/// keyed by its project, its id the project and the event id; a fact that
/// cannot be encoded is [`PortError::Permanent`].
pub fn usage_records(facts: &[meter::UsageFact]) -> PortResult<Vec<OutRecord>> {
    facts
        .iter()
        .map(|f| {
            let payload = schemas::encode_usage(f).map_err(|e| PortError::Permanent(e.to_string()))?;
            let key = f.project_id.as_str().as_bytes().to_vec();
            Ok(OutRecord { key, payload, id: Some(format!("{}/{}", f.project_id, f.id)) })
        })
        .collect()
}

/// One attempt at putting records on a log.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// The log's name in telemetry (`kafka`, `sqlite`).
    fn name(&self) -> &'static str;
    /// Tries once to put every record on the log, and answers the outcome
    /// of each, in order (a missing outcome counts as a transient failure).
    async fn send(&self, records: &[OutRecord]) -> Vec<PortResult<()>>;
    /// [`Transport::send`] for one attempt of the pump: records queued
    /// without a waiting publish ([`Outbox::queue`]), every one queued since
    /// its last attempt, which the pump waits for (at most [`QUEUED_WAIT`])
    /// before it sends the next. A transport may put these on their way
    /// differently (the Kafka log sends a small one with no linger); by
    /// default, as any other.
    async fn send_queued(&self, records: &[OutRecord]) -> Vec<PortResult<()>> {
        self.send(records).await
    }
    /// Why the log is known to be unreachable right now, if it is (a
    /// producer that lost every broker); `None` when nothing is known.
    fn unreachable(&self) -> Option<String> {
        None
    }
}

/// The job's answer, once it has one.
type Answer = watch::Receiver<Option<PortResult<()>>>;

/// What is queued.
#[derive(Debug, Default)]
struct Queue {
    /// The number the next job gets.
    next_job: u64,
    /// Jobs not finished.
    unfinished: BTreeSet<u64>,
    /// Records not yet acknowledged (nor dropped).
    records: usize,
    /// The answer of the job holding each queued record that has an id.
    by_id: HashMap<String, Answer>,
    /// Jobs queued without a waiting publish ([`Outbox::queue`]) and not
    /// sent yet: the pump sends them together.
    batch: Vec<Queued>,
    /// A pump is running (and sends what `batch` holds).
    pumping: bool,
}

impl Queue {
    /// Every job numbered below this is finished.
    fn low_water(&self) -> u64 {
        self.unfinished.first().copied().unwrap_or(self.next_job)
    }
}

struct Shared<T> {
    transport: T,
    options: PublishOptions,
    queue: Mutex<Queue>,
    /// [`Queue::low_water`], for [`Outbox::flush`].
    low_water: watch::Sender<u64>,
    /// Why the last attempt failed, until a later one succeeds.
    failing: Mutex<Option<String>>,
}

impl<T: Transport> Shared<T> {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        // Every update leaves the queue consistent before it can panic.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn gauge(&self, records: usize) {
        metrics::gauge!("tollgate_publish_queue_depth", "log" => self.transport.name()).set(records as f64);
    }

    /// Forgets `n` records that were acknowledged or dropped.
    fn settled(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut q = self.queue();
        q.records = q.records.saturating_sub(n);
        self.gauge(q.records);
    }

    fn set_failing(&self, why: Option<String>) {
        let mut f = self.failing.lock().unwrap_or_else(PoisonError::into_inner);
        match (&*f, &why) {
            (None, Some(w)) => warn!(log = self.transport.name(), reason = %w, "log unreachable; queueing"),
            (Some(_), None) => info!(log = self.transport.name(), "log reachable again"),
            _ => {}
        }
        *f = why;
    }

    /// Why the log is unreachable, if it is known to be.
    fn unreachable(&self) -> Option<String> {
        self.transport.unreachable().or_else(|| self.failing.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    /// Sorts one attempt's outcomes: counts the records acknowledged or
    /// refused for good (the latter into `outcome`), notes whether the log
    /// answers, and returns the records to send again.
    fn sorted(
        &self,
        records: Vec<OutRecord>,
        results: Vec<PortResult<()>>,
        outcome: &mut PortResult<()>,
    ) -> Vec<OutRecord> {
        let mut results = results.into_iter();
        let mut retry = Vec::new();
        let mut why = None;
        let mut settled = 0;
        for r in records {
            match results.next().unwrap_or_else(|| Err(PortError::Transient("no outcome for the record".into()))) {
                Ok(()) => settled += 1,
                Err(PortError::Transient(w)) => {
                    why = Some(w);
                    retry.push(r);
                }
                Err(e) => {
                    error!(log = self.transport.name(), error = %e, "record refused by the log for good; dropped");
                    metrics::counter!("tollgate_publish_dropped_total", "log" => self.transport.name()).increment(1);
                    settled += 1;
                    *outcome = Err(e);
                }
            }
        }
        self.settled(settled);
        if retry.is_empty() {
            if settled > 0 {
                self.set_failing(None);
            }
        } else {
            self.set_failing(why);
            metrics::counter!("tollgate_publish_failures_total", "log" => self.transport.name())
                .increment(retry.len() as u64);
        }
        retry
    }

    /// Sends `records` until none is left to retry, pausing `delay` before
    /// the first resend and doubling it (to [`RETRY_MAX`]) after each;
    /// returns `outcome` with any refusal for good put in.
    async fn deliver(
        &self,
        mut records: Vec<OutRecord>,
        mut outcome: PortResult<()>,
        mut delay: Duration,
    ) -> PortResult<()> {
        loop {
            let results = self.transport.send(&records).await;
            records = self.sorted(records, results, &mut outcome);
            if records.is_empty() {
                return outcome;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RETRY_MAX);
        }
    }

    /// Sends a publish's records until none is left to retry; answers the
    /// job (to the publishes waiting on its records) and returns the answer.
    async fn run(self: Arc<Self>, job: Queued) -> PortResult<()> {
        let Queued { job, records, ids, answer } = job;
        let outcome = self.deliver(records, Ok(()), RETRY_MIN).await;
        self.finish(job, &ids, &answer, outcome.clone());
        outcome
    }

    /// Answers a finished job and forgets it.
    fn finish(
        &self,
        job: u64,
        ids: &[String],
        answer: &watch::Sender<Option<PortResult<()>>>,
        outcome: PortResult<()>,
    ) {
        // Answered before the ids are forgotten: a publish that finds one of
        // them meanwhile gets this answer at once.
        let _ = answer.send(Some(outcome));
        let this_job = answer.subscribe();
        let mut q = self.queue();
        for id in ids {
            if q.by_id.get(id).is_some_and(|a| a.same_channel(&this_job)) {
                q.by_id.remove(id);
            }
        }
        q.unfinished.remove(&job);
        // Sent under the lock: two jobs finishing at once would otherwise
        // race, and the one that saw the other unfinished could send its
        // lower mark last, leaving a flush waiting for a job long done.
        self.low_water.send_replace(q.low_water());
    }

    /// Sends the jobs queued without a waiting publish, all queued ones
    /// together in one attempt, until none is queued: it waits for each
    /// attempt, at most [`QUEUED_WAIT`], before it starts the next one with
    /// what was queued meanwhile (an attempt it stops waiting for goes on in
    /// a task of its own).
    async fn pump(self: Arc<Self>, runtime: tokio::runtime::Handle) {
        let mut running = Pumping { shared: Arc::clone(&self), done: false };
        loop {
            let jobs = {
                let mut q = self.queue();
                if q.batch.is_empty() {
                    q.pumping = false;
                    running.done = true;
                    return;
                }
                std::mem::take(&mut q.batch)
            };
            let attempt = Finishing::new(Arc::clone(&self).attempt(jobs, runtime.clone()), runtime.clone());
            // Timed out, the attempt is dropped, and so goes on on its own.
            let _ = tokio::time::timeout(QUEUED_WAIT, attempt).await;
        }
    }

    /// One attempt of the pump: sends the records of `jobs` together and
    /// answers each job whose records were all taken or refused for good;
    /// a job with records to send again goes on in a task of its own (the
    /// log is failing), so it holds up no later attempt.
    async fn attempt(self: Arc<Self>, jobs: Vec<Queued>, runtime: tokio::runtime::Handle) {
        let mut records = Vec::with_capacity(jobs.iter().map(|j| j.records.len()).sum());
        let mut sizes = Vec::with_capacity(jobs.len());
        let mut rest = Vec::with_capacity(jobs.len());
        for Queued { job, records: mine, ids, answer } in jobs {
            sizes.push(mine.len());
            records.extend(mine);
            rest.push((job, ids, answer));
        }
        let mut results = self.transport.send_queued(&records).await.into_iter();
        let mut records = records.into_iter();
        for ((job, ids, answer), n) in rest.into_iter().zip(sizes) {
            let mine: Vec<OutRecord> = records.by_ref().take(n).collect();
            let outcomes: Vec<PortResult<()>> = results.by_ref().take(n).collect();
            let mut outcome = Ok(());
            let retry = self.sorted(mine, outcomes, &mut outcome);
            if retry.is_empty() {
                self.finish(job, &ids, &answer, outcome);
            } else {
                let shared = Arc::clone(&self);
                drop(runtime.spawn(async move {
                    tokio::time::sleep(RETRY_MIN).await;
                    let outcome = shared.deliver(retry, outcome, RETRY_MIN * 2).await;
                    shared.finish(job, &ids, &answer, outcome);
                }));
            }
        }
    }
}

/// A pump that ends before its queue is empty (its runtime shut down)
/// lets the next queued job start another.
struct Pumping<T: Transport> {
    shared: Arc<Shared<T>>,
    /// It ended the normal way (and said so under the lock).
    done: bool,
}

impl<T: Transport> Drop for Pumping<T> {
    fn drop(&mut self) {
        if !self.done {
            self.shared.queue().pumping = false;
        }
    }
}

/// A job [`Outbox::enqueue`] made, with the runtime it finishes on.
type NewJob = (Queued, tokio::runtime::Handle);

/// A job: its number, the records it sends, their ids (held in
/// [`Queue::by_id`]) and where its answer goes.
#[derive(Debug)]
struct Queued {
    job: u64,
    records: Vec<OutRecord>,
    ids: Vec<String>,
    answer: watch::Sender<Option<PortResult<()>>>,
}

/// A bounded queue of records on their way to a log; cheap to clone (clones
/// share the queue).
pub struct Outbox<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for Outbox<T> {
    fn clone(&self) -> Self {
        Outbox { shared: Arc::clone(&self.shared) }
    }
}

impl<T> std::fmt::Debug for Outbox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").field("options", &self.shared.options).finish_non_exhaustive()
    }
}

impl<T: Transport> Outbox<T> {
    pub fn new(transport: T, options: PublishOptions) -> Outbox<T> {
        Outbox {
            shared: Arc::new(Shared {
                transport,
                options,
                queue: Mutex::new(Queue::default()),
                low_water: watch::Sender::new(0),
                failing: Mutex::new(None),
            }),
        }
    }

    pub fn transport(&self) -> &T {
        &self.shared.transport
    }

    pub fn options(&self) -> PublishOptions {
        self.shared.options
    }

    /// Records queued and not yet acknowledged.
    pub fn queued(&self) -> usize {
        self.shared.queue().records
    }

    /// Why the log is known to be unreachable, if it is.
    pub fn unreachable(&self) -> Option<String> {
        self.shared.unreachable()
    }

    /// Queues `records` (see the module doc) and waits for their
    /// acknowledgement, at most the publish timeout.
    pub async fn publish(&self, records: Vec<OutRecord>) -> PortResult<()> {
        if records.is_empty() {
            return Ok(());
        }
        let (answers, job) = self.enqueue(records)?;
        let mut job = job.map(|(job, runtime)| Finishing::new(Arc::clone(&self.shared).run(job), runtime));
        let down = self.shared.unreachable();
        let timeout = match down {
            Some(_) => self.shared.options.timeout.min(DOWN_WAIT),
            None => self.shared.options.timeout,
        };
        // The job runs here; cut short by the timeout (or by this publish
        // being dropped), it goes on in a task of its own.
        let all = async {
            let mine = match job.as_mut() {
                Some(job) => job.await,
                None => Ok(()),
            };
            let theirs = wait_all(answers).await;
            mine.and(theirs)
        };
        match tokio::time::timeout(timeout, all).await {
            Ok(outcome) => outcome,
            Err(_) => Err(PortError::Transient(match down {
                Some(why) => format!("log unavailable ({why}); the records are queued and published when it is back"),
                None => {
                    // A log that answers nothing (a frozen broker) reports no
                    // failure: the wait is the report.
                    let why = format!("no acknowledgement within {timeout:?}");
                    self.shared.set_failing(Some(why.clone()));
                    format!("log unavailable ({why}); the records stay queued and are published when it answers")
                }
            })),
        }
    }

    /// Queues `records` (see the module doc) without waiting for them: `Ok`
    /// once they are queued, an error when nothing was (a full queue, no
    /// runtime to retry on). Jobs queued this way are sent together, by
    /// one pump at a time: while one attempt is on its way, the records
    /// queued meanwhile wait for it and go in the next one.
    pub fn queue(&self, records: Vec<OutRecord>) -> PortResult<()> {
        if records.is_empty() {
            return Ok(());
        }
        let Some((job, runtime)) = self.enqueue(records)?.1 else { return Ok(()) };
        let mut q = self.shared.queue();
        q.batch.push(job);
        if !q.pumping {
            q.pumping = true;
            drop(q);
            drop(runtime.spawn(Arc::clone(&self.shared).pump(runtime.clone())));
        }
        Ok(())
    }

    /// Makes a job of the records not queued yet: the answers of the jobs
    /// already holding the others, and the new job, with the runtime to
    /// finish it on.
    fn enqueue(&self, records: Vec<OutRecord>) -> PortResult<(Vec<Answer>, Option<NewJob>)> {
        let name = self.shared.transport.name();
        let mut q = self.shared.queue();
        let mut answers = Vec::new();
        let mut mine = Vec::with_capacity(records.len());
        for r in records {
            match r.id.as_ref().and_then(|id| q.by_id.get(id)) {
                Some(a) => {
                    if !answers.iter().any(|b: &Answer| b.same_channel(a)) {
                        answers.push(a.clone());
                    }
                }
                None => mine.push(r),
            }
        }
        if mine.is_empty() {
            return Ok((answers, None));
        }
        let capacity = self.shared.options.queue;
        if q.records + mine.len() > capacity {
            metrics::counter!("tollgate_publish_queue_full_total", "log" => name).increment(1);
            return Err(PortError::Transient(format!(
                "the publish queue is full ({} of {capacity} records await the log); nothing was queued: publish again",
                q.records
            )));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            PortError::Transient(format!("publishing needs a tokio runtime to retry on ({e}); nothing was queued"))
        })?;
        let job = q.next_job;
        q.next_job += 1;
        q.unfinished.insert(job);
        q.records += mine.len();
        self.shared.gauge(q.records);
        let (answer, rx) = watch::channel(None);
        let mut ids = Vec::new();
        for r in &mine {
            if let Some(id) = &r.id {
                q.by_id.insert(id.clone(), rx.clone());
                ids.push(id.clone());
            }
        }
        drop(rx);
        drop(q);
        Ok((answers, Some((Queued { job, records: mine, ids, answer }, runtime))))
    }

    /// Waits until every job started before this call has finished, at most
    /// `timeout`.
    pub async fn flush(&self, timeout: Duration) -> PortResult<()> {
        let target = self.shared.queue().next_job;
        let mut low = self.shared.low_water.subscribe();
        match tokio::time::timeout(timeout, low.wait_for(|l| *l >= target)).await {
            Ok(Ok(_)) => Ok(()),
            // The sender lives in `shared`, which `self` holds.
            Ok(Err(_)) => Ok(()),
            Err(_) => Err(PortError::Transient(format!(
                "{} records still await the log after {timeout:?}; they stay queued",
                self.queued()
            ))),
        }
    }
}

/// A future that is not abandoned when its awaiter is: awaited, it runs in
/// the awaiting task (no task of its own while it is awaited to the end);
/// dropped before it is done, it goes on to its end in a task of its own on
/// the runtime it was made on, its output discarded.
pub struct Finishing<T: Send + 'static> {
    rest: Option<Pin<Box<dyn Future<Output = T> + Send + 'static>>>,
    runtime: tokio::runtime::Handle,
}

impl<T: Send + 'static> Finishing<T> {
    pub fn new(future: impl Future<Output = T> + Send + 'static, runtime: tokio::runtime::Handle) -> Self {
        Finishing { rest: Some(Box::pin(future)), runtime }
    }
}

impl<T: Send + 'static> Future for Finishing<T> {
    type Output = T;

    /// # Panics
    ///
    /// Polled again after it returned its output (as any future may).
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(rest) = self.rest.as_mut() else { panic!("`Finishing` polled after its end") };
        let out = std::task::ready!(rest.as_mut().poll(cx));
        self.rest = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Finishing<T> {
    fn drop(&mut self) {
        if let Some(rest) = self.rest.take() {
            drop(self.runtime.spawn(rest));
        }
    }
}

/// The first failure among the answers, once all have one.
async fn wait_all(answers: Vec<Answer>) -> PortResult<()> {
    let mut outcome = Ok(());
    for mut a in answers {
        let got = match a.wait_for(Option::is_some).await {
            Ok(v) => v.clone().unwrap_or(Ok(())),
            Err(_) => Err(PortError::Transient(
                "the publish was abandoned (its runtime shut down); the records may or may not be on the log".into(),
            )),
        };
        if outcome.is_ok() {
            outcome = got;
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A log whose attempts fail while `down` is set, and that remembers
    /// every record it took, in order.
    #[derive(Default)]
    struct FakeLog {
        down: AtomicBool,
        /// Outcomes to give instead, first come first served, one per record.
        scripted: Mutex<VecDeque<PortResult<()>>>,
        taken: Mutex<Vec<Vec<u8>>>,
        attempts: Mutex<usize>,
        /// The records of each attempt, in order.
        sent: Mutex<Vec<Vec<String>>>,
        /// The records of each attempt made through `send_queued`.
        sent_queued: Mutex<Vec<Vec<String>>>,
        knows_down: AtomicBool,
        /// Attempts wait for this before answering (a frozen log), while set.
        frozen: AtomicBool,
        thawed: tokio::sync::Notify,
    }

    #[async_trait]
    impl Transport for Arc<FakeLog> {
        fn name(&self) -> &'static str {
            "fake"
        }
        async fn send(&self, records: &[OutRecord]) -> Vec<PortResult<()>> {
            *self.attempts.lock().expect("lock") += 1;
            let names = records.iter().map(|r| String::from_utf8_lossy(&r.payload).into_owned()).collect();
            self.sent.lock().expect("lock").push(names);
            loop {
                // Registered before the check, so a thaw in between wakes it.
                let thawed = self.thawed.notified();
                if !self.frozen.load(Ordering::SeqCst) {
                    break;
                }
                thawed.await;
            }
            records
                .iter()
                .map(|r| {
                    if let Some(o) = self.scripted.lock().expect("lock").pop_front() {
                        if o.is_ok() {
                            self.taken.lock().expect("lock").push(r.payload.clone());
                        }
                        return o;
                    }
                    if self.down.load(Ordering::SeqCst) {
                        return Err(PortError::Transient("down".into()));
                    }
                    self.taken.lock().expect("lock").push(r.payload.clone());
                    Ok(())
                })
                .collect()
        }
        async fn send_queued(&self, records: &[OutRecord]) -> Vec<PortResult<()>> {
            let names = records.iter().map(|r| String::from_utf8_lossy(&r.payload).into_owned()).collect();
            self.sent_queued.lock().expect("lock").push(names);
            self.send(records).await
        }
        fn unreachable(&self) -> Option<String> {
            self.knows_down.load(Ordering::SeqCst).then(|| "all brokers down".to_owned())
        }
    }

    fn rec(id: &str) -> OutRecord {
        OutRecord { key: b"p".to_vec(), payload: id.as_bytes().to_vec(), id: Some(format!("p/{id}")) }
    }

    fn outbox(queue: usize) -> (Arc<FakeLog>, Outbox<Arc<FakeLog>>) {
        let log = Arc::new(FakeLog::default());
        let o = Outbox::new(Arc::clone(&log), PublishOptions { timeout: Duration::from_secs(2), queue });
        (log, o)
    }

    fn taken(log: &FakeLog) -> Vec<String> {
        log.taken.lock().expect("lock").iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn an_answered_publish_is_acknowledged_and_leaves_nothing_queued() {
        let (log, o) = outbox(10);
        o.publish(vec![rec("a"), rec("b")]).await.expect("acknowledged");
        assert_eq!(taken(&log), ["a", "b"]);
        assert_eq!(o.queued(), 0);
        o.publish(Vec::new()).await.expect("nothing to publish is fine");
        o.flush(Duration::ZERO).await.expect("nothing to flush");
    }

    /// A publish runs its job in its own task; dropped mid-way (its caller
    /// went away), the job goes on without it and the record is taken.
    #[tokio::test(start_paused = true)]
    async fn a_publish_dropped_while_the_log_waits_still_puts_its_records_on_the_log() {
        let (log, o) = outbox(10);
        log.frozen.store(true, Ordering::SeqCst);
        let publish = o.publish(vec![rec("a")]);
        assert!(tokio::time::timeout(Duration::from_millis(50), publish).await.is_err(), "the log is frozen");
        assert_eq!(*log.attempts.lock().expect("lock"), 1, "the attempt was made before the drop");
        assert!(taken(&log).is_empty());
        assert_eq!(o.queued(), 1, "still queued");

        log.frozen.store(false, Ordering::SeqCst);
        log.thawed.notify_waiters();
        o.flush(Duration::from_secs(5)).await.expect("the dropped publish's job finished");
        assert_eq!(taken(&log), ["a"]);
        assert_eq!(o.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_publish_the_log_does_not_take_answers_within_the_timeout_and_is_retried_until_taken() {
        let (log, o) = outbox(10);
        log.down.store(true, Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let e = o.publish(vec![rec("a")]).await.expect_err("not acknowledged");
        assert!(e.is_transient(), "{e}");
        assert!(started.elapsed() <= Duration::from_secs(2), "answered after {:?}", started.elapsed());
        assert_eq!(o.queued(), 1, "still queued");

        // Known to be failing now: the next publish answers at once, queued too.
        let started = tokio::time::Instant::now();
        let e = o.publish(vec![rec("b")]).await.expect_err("not acknowledged");
        assert!(e.to_string().contains("log unavailable"), "{e}");
        assert_eq!(started.elapsed(), DOWN_WAIT, "at once");
        assert_eq!(o.queued(), 2);
        assert!(o.flush(Duration::from_secs(5)).await.is_err(), "flush times out while the log is down");

        log.down.store(false, Ordering::SeqCst);
        o.flush(Duration::from_secs(5)).await.expect("flushed once the log is back");
        assert_eq!(o.queued(), 0);
        let mut got = taken(&log);
        got.sort();
        assert_eq!(got, ["a", "b"], "each record taken once");
        assert_eq!(o.unreachable(), None, "reachable again after a success");
        o.publish(vec![rec("c")]).await.expect("acknowledged again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_log_that_answers_nothing_is_known_down_after_one_publish_waited_its_timeout() {
        let (log, o) = outbox(10);
        log.frozen.store(true, Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        assert!(o.publish(vec![rec("a")]).await.is_err());
        assert_eq!(started.elapsed(), Duration::from_secs(2), "the first waits its whole timeout");
        assert!(o.unreachable().is_some_and(|w| w.contains("no acknowledgement")), "{:?}", o.unreachable());
        let started = tokio::time::Instant::now();
        assert!(o.publish(vec![rec("b")]).await.is_err());
        assert_eq!(started.elapsed(), DOWN_WAIT, "the next answers at once");

        log.frozen.store(false, Ordering::SeqCst);
        log.thawed.notify_waiters();
        o.flush(Duration::from_secs(5)).await.expect("both go out once the log answers");
        assert_eq!(o.unreachable(), None, "and the log is known up again");
        let mut got = taken(&log);
        got.sort();
        assert_eq!(got, ["a", "b"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_already_queued_is_not_queued_again() {
        let (log, o) = outbox(10);
        log.down.store(true, Ordering::SeqCst);
        assert!(o.publish(vec![rec("a")]).await.is_err());
        for _ in 0..5 {
            assert!(o.publish(vec![rec("a")]).await.is_err(), "a client retrying with the same id");
        }
        assert_eq!(o.queued(), 1, "one copy queued");
        log.down.store(false, Ordering::SeqCst);
        // A client retrying once the log is back: a retry waits for the job
        // that holds the queued copy, and is acknowledged with it.
        let mut tries = 0;
        while o.publish(vec![rec("a"), rec("b")]).await.is_err() {
            tries += 1;
            assert!(tries < 20, "never acknowledged");
        }
        o.flush(Duration::from_secs(1)).await.expect("flushed");
        let got = taken(&log);
        assert_eq!(got.iter().filter(|r| *r == "a").count(), 1, "the queued copy of a went out, once: {got:?}");
        assert!(got.iter().any(|r| r == "b"), "b went out (a retry after its ack may send it again): {got:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_and_queues_nothing() {
        let (log, o) = outbox(3);
        log.down.store(true, Ordering::SeqCst);
        assert!(o.publish(vec![rec("a"), rec("b")]).await.is_err());
        let e = o.publish(vec![rec("c"), rec("d")]).await.expect_err("full");
        assert!(e.is_transient() && e.to_string().contains("queue is full"), "{e}");
        assert_eq!(o.queued(), 2, "nothing of the refused publish queued");
        // Records already queued do not count again.
        assert!(o.publish(vec![rec("a"), rec("c")]).await.is_err());
        assert_eq!(o.queued(), 3);
        log.down.store(false, Ordering::SeqCst);
        o.flush(Duration::from_secs(5)).await.expect("flushed");
        let mut got = taken(&log);
        got.sort();
        assert_eq!(got, ["a", "b", "c"], "d was never queued");
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_refused_for_good_is_dropped_and_its_publish_fails() {
        let (log, o) = outbox(10);
        log.scripted.lock().expect("lock").extend([Ok(()), Err(PortError::Permanent("too large".into())), Ok(())]);
        let e = o.publish(vec![rec("a"), rec("b"), rec("c")]).await.expect_err("one refused");
        assert_eq!(e, PortError::Permanent("too large".into()));
        assert_eq!(taken(&log), ["a", "c"], "the others are on the log");
        assert_eq!(o.queued(), 0, "nothing retried");
        assert_eq!(*log.attempts.lock().expect("lock"), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_records_that_failed_are_sent_again() {
        let (log, o) = outbox(10);
        log.scripted.lock().expect("lock").extend([Ok(()), Err(PortError::Transient("timed out".into())), Ok(())]);
        o.publish(vec![rec("a"), rec("b"), rec("c")]).await.expect("acknowledged after one retry");
        assert_eq!(taken(&log), ["a", "c", "b"], "b sent again, after the others");
        assert_eq!(*log.attempts.lock().expect("lock"), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_transport_that_knows_the_log_is_down_makes_a_publish_answer_at_once() {
        let (log, o) = outbox(10);
        log.knows_down.store(true, Ordering::SeqCst);
        log.down.store(true, Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let e = o.publish(vec![rec("a")]).await.expect_err("down");
        assert!(e.to_string().contains("all brokers down"), "{e}");
        assert_eq!(started.elapsed(), DOWN_WAIT, "at once");
        log.knows_down.store(false, Ordering::SeqCst);
        log.down.store(false, Ordering::SeqCst);
        o.flush(Duration::from_secs(5)).await.expect("the queued record went out");
        assert_eq!(taken(&log), ["a"]);
    }

    #[tokio::test(start_paused = true)]
    async fn flush_waits_for_the_jobs_started_before_it() {
        let (log, o) = outbox(100);
        log.down.store(true, Ordering::SeqCst);
        assert!(o.publish(vec![rec("a")]).await.is_err());
        let flush = {
            let o = o.clone();
            tokio::spawn(async move { o.flush(Duration::from_secs(60)).await })
        };
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!flush.is_finished(), "the job before the flush is not done");
        log.down.store(false, Ordering::SeqCst);
        flush.await.expect("the flush task").expect("flushed when the job before it finished");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_flush_returns_when_jobs_finishing_at_once_are_all_done() {
        // Many jobs answered in the same instant, on several threads: the
        // low-water mark a flush waits on must end at the newest, whichever
        // job reports last. (With the mark sent after the queue's lock was
        // let go, a round failed within the first few thousand here; under
        // the whole suite's load, once in a few runs of log_conformance.)
        for round in 0..5_000 {
            let (log, o) = outbox(100);
            log.frozen.store(true, Ordering::SeqCst);
            let publishes: Vec<_> = (0..16)
                .map(|i| {
                    let o = o.clone();
                    tokio::spawn(async move { o.publish(vec![rec(&format!("{round}-{i}"))]).await })
                })
                .collect();
            while *log.attempts.lock().expect("lock") < 16 {
                tokio::task::yield_now().await;
            }
            log.frozen.store(false, Ordering::SeqCst);
            log.thawed.notify_waiters();
            for p in publishes {
                p.await.expect("the publish task").expect("acknowledged");
            }
            o.flush(Duration::from_millis(500)).await.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }

    /// Waits (in paused time) until the log has taken `n` records.
    async fn until_taken(log: &FakeLog, n: usize) {
        for _ in 0..1_000 {
            if taken(log).len() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the log took {:?}, not {n} records", taken(log));
    }

    /// An outbox over a frozen log, with `a` queued and its attempt on its way.
    async fn a_on_its_way_to_a_frozen_log() -> (Arc<FakeLog>, Outbox<Arc<FakeLog>>) {
        let (log, o) = outbox(10);
        log.frozen.store(true, Ordering::SeqCst);
        o.queue(vec![rec("a")]).expect("queued");
        while *log.attempts.lock().expect("lock") < 1 {
            tokio::task::yield_now().await;
        }
        (log, o)
    }

    /// Records queued without waiting go out one attempt at a time: what is
    /// queued while an attempt is on its way waits for it, and then goes
    /// out together, in the order it was queued.
    #[tokio::test(start_paused = true)]
    async fn queued_records_wait_for_the_attempt_on_its_way_and_then_go_together() {
        let (log, o) = a_on_its_way_to_a_frozen_log().await;
        o.queue(vec![rec("b")]).expect("queued");
        o.queue(vec![rec("c"), rec("d")]).expect("queued");
        tokio::time::sleep(QUEUED_WAIT / 2).await;
        assert_eq!(*log.attempts.lock().expect("lock"), 1, "nothing more while the first attempt is on its way");
        assert_eq!(o.queued(), 4);

        log.frozen.store(false, Ordering::SeqCst);
        log.thawed.notify_waiters();
        o.flush(Duration::from_secs(5)).await.expect("flushed");
        assert_eq!(*log.sent.lock().expect("lock"), [vec!["a"], vec!["b", "c", "d"]]);
        assert_eq!(taken(&log), ["a", "b", "c", "d"]);
        assert_eq!(o.queued(), 0);
        // A queued record is not queued again while it waits, and a publish
        // of it waits for the pump's attempt.
        log.frozen.store(true, Ordering::SeqCst);
        o.queue(vec![rec("e")]).expect("queued");
        o.queue(vec![rec("e")]).expect("already queued");
        let publish = tokio::spawn({
            let o = o.clone();
            async move { o.publish(vec![rec("e")]).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(o.queued(), 1);
        log.frozen.store(false, Ordering::SeqCst);
        log.thawed.notify_waiters();
        publish.await.expect("the publish task").expect("acknowledged with the pump's attempt");
        assert_eq!(taken(&log).iter().filter(|r| *r == "e").count(), 1);
    }

    /// The pump's attempts go through `send_queued`, a waited publish's
    /// through `send`, so a transport can tell them apart.
    #[tokio::test(start_paused = true)]
    async fn the_pump_sends_through_send_queued_and_a_publish_through_send() {
        let (log, o) = outbox(10);
        o.queue(vec![rec("a"), rec("b")]).expect("queued");
        o.publish(vec![rec("c")]).await.expect("acknowledged");
        o.flush(Duration::from_secs(5)).await.expect("flushed");
        assert_eq!(*log.sent_queued.lock().expect("lock"), [vec!["a", "b"]]);
        let mut sent = log.sent.lock().expect("lock").clone();
        sent.sort();
        assert_eq!(sent, [vec!["a", "b"], vec!["c"]]);
    }

    /// A queued record the log did not take is sent again on its own, and
    /// the records queued after it do not wait for it.
    #[tokio::test(start_paused = true)]
    async fn a_queued_record_that_failed_does_not_hold_up_the_ones_after_it() {
        let (log, o) = outbox(10);
        log.scripted.lock().expect("lock").push_back(Err(PortError::Transient("timed out".into())));
        o.queue(vec![rec("a")]).expect("queued");
        while *log.attempts.lock().expect("lock") < 1 {
            tokio::task::yield_now().await;
        }
        o.queue(vec![rec("b")]).expect("queued");
        until_taken(&log, 1).await;
        assert_eq!(taken(&log), ["b"], "b went out before a was sent again");
        o.flush(Duration::from_secs(5)).await.expect("a was sent again and taken");
        assert_eq!(taken(&log), ["b", "a"]);
        assert_eq!(o.queued(), 0);
        assert_eq!(*log.sent.lock().expect("lock"), [vec!["a"], vec!["b"], vec!["a"]]);
    }

    /// A record queued while the pump's attempt is on its way waits for it
    /// at most [`QUEUED_WAIT`]: a log that answers slowly holds later
    /// records back no longer than that, and each goes out once.
    #[tokio::test(start_paused = true)]
    async fn a_queued_record_waits_for_a_slow_attempt_no_longer_than_queued_wait() {
        let (log, o) = a_on_its_way_to_a_frozen_log().await;
        let queued_at = tokio::time::Instant::now();
        o.queue(vec![rec("b")]).expect("queued");
        while *log.attempts.lock().expect("lock") < 2 {
            assert!(queued_at.elapsed() < Duration::from_secs(1), "b still waits for a's attempt");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let waited = queued_at.elapsed();
        assert!(
            waited >= QUEUED_WAIT - Duration::from_millis(1) && waited <= QUEUED_WAIT + Duration::from_millis(2),
            "{waited:?}"
        );
        assert_eq!(*log.sent.lock().expect("lock"), [vec!["a"], vec!["b"]]);
        log.frozen.store(false, Ordering::SeqCst);
        log.thawed.notify_waiters();
        o.flush(Duration::from_secs(5)).await.expect("both taken");
        assert_eq!(taken(&log), ["a", "b"]);
        assert_eq!(o.queued(), 0);
    }

    /// A pump that ends with its runtime leaves none running: the next
    /// record queued (on another runtime) starts one and goes out.
    #[test]
    fn a_pump_ended_with_its_runtime_lets_the_next_queued_record_start_another() {
        let (log, o) = outbox(10);
        log.frozen.store(true, Ordering::SeqCst);
        let first = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
        first.block_on(async {
            o.queue(vec![rec("a")]).expect("queued");
            while *log.attempts.lock().expect("lock") < 1 {
                tokio::task::yield_now().await;
            }
        });
        drop(first);
        log.frozen.store(false, Ordering::SeqCst);
        let second = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
        second.block_on(async {
            o.queue(vec![rec("b")]).expect("queued");
            tokio::time::timeout(Duration::from_secs(5), until_taken(&log, 1)).await.expect("b went out");
        });
        assert_eq!(taken(&log), ["b"], "a was lost with its runtime, as a task of its own would be");
    }

    #[test]
    fn outside_a_runtime_nothing_is_queued() {
        let (_, o) = outbox(10);
        let e = futures::executor::block_on(o.publish(vec![rec("a")])).expect_err("no runtime");
        assert!(e.is_transient() && e.to_string().contains("runtime"), "{e}");
        assert_eq!(o.queued(), 0);
    }
}
