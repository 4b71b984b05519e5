//! # Billing exports: what a run adds
//!
//! The rule of issue 11 item 3 (DESIGN §13), as plain data: an export run
//! is selected by what was **folded**, not by event time. Each run compares
//! the fold's totals per line item (a charge period, a customer dimension,
//! an item) with what the earlier runs of the same export already wrote, and
//! writes only the difference:
//!
//! - a line whose charge period is not **final** is written in that
//!   period, `charge_class: usage`. A period becomes final once a complete
//!   run of the export ran after it **closed** (its end plus the grace):
//!   that run wrote its last rows;
//! - a line whose charge period is final is never written there again:
//!   what was folded for it since (a late event, a correction, negative for
//!   a credit) is written in the period open at the run, `charge_class:
//!   correction`, keeping its own charge period.
//!
//! So the sum of every run's rows per charge period and line is the fold's
//! total to the unit (the reconciliation of item 4), a final period's rows
//! never change, and a run that follows another with nothing folded in
//! between writes nothing. Wiring (the fold's totals by line, the store of
//! what each export wrote, the formats) builds on this.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use chrono_tz::Tz;

use crate::error::FieldError;
use crate::usage::Dimension;
use crate::window::{WindowKind, window_at};

pub mod format;
pub mod run;
pub mod schedule;

pub use run::{Check, CustomerKind, ExportRun, ExportSpec, ExportedLine, Format, Mark, Reconciliation, RunStatus};
pub use schedule::{Cadence, Destination, ExportSchedule, Projects};

/// How long after a charge period ends its usage may still arrive before
/// the period closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grace(Duration);

impl Grace {
    pub const DEFAULT: Grace = Grace(Duration::from_secs(3600));
    pub const MAX: Duration = Duration::from_secs(72 * 3600);

    /// A grace of at most 72 hours.
    pub fn new(d: Duration) -> Result<Grace, FieldError> {
        if d > Grace::MAX {
            return Err(FieldError::new("grace", "must be at most 72 hours"));
        }
        Ok(Grace(d))
    }

    pub fn duration(self) -> Duration {
        self.0
    }
}

/// A charge period: a `day` or `calendar_month` window of the project's
/// zone, by its key (`2026-07-07`, `2026-07`) and its bounds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Period {
    pub key: String,
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
}

/// The `day` or `calendar_month` period of `key` in `tz` (`None` for
/// another window or a key that is not one).
pub fn period_of(kind: WindowKind, key: &str, tz: Tz) -> Option<Period> {
    let date = match kind {
        WindowKind::Day => NaiveDate::parse_from_str(key, "%Y-%m-%d").ok()?,
        WindowKind::CalendarMonth => NaiveDate::parse_from_str(&format!("{key}-01"), "%Y-%m-%d").ok()?,
        _ => return None,
    };
    // Noon of the period's first day always exists, whatever the zone's
    // daylight-saving changes (they happen at night).
    let noon = tz.from_local_datetime(&date.and_hms_opt(12, 0, 0)?).earliest()?.with_timezone(&Utc);
    let w = window_at(kind, tz, noon);
    (w.key == key).then_some(Period { key: w.key, start: w.start, end: w.resets_at? })
}

impl Period {
    /// Closed once its end plus the grace is not after `at`.
    pub fn closed(&self, grace: Grace, at: DateTime<Utc>) -> bool {
        let grace = chrono::Duration::from_std(grace.0).unwrap_or(chrono::Duration::hours(72));
        self.end + grace <= at
    }
}

/// What a line measures: a metric (`requests`, `calls`, `rows`, `tokens`,
/// `cost_usd:<meter>`…) or one (provider, model, component).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Item {
    Metric(String),
    Model { provider: String, model: String, component: String },
}

/// One line item: its charge period, its customer, what it measures.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Line {
    pub period: Period,
    pub dimension: Dimension,
    pub item: Item,
}

/// A line's amounts: consumed quantity, its priced and unpriced parts, and
/// the cost of the priced part in picodollars. Signed: a run's difference
/// is negative where a correction took usage back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Amounts {
    pub consumed: i128,
    pub priced: i128,
    pub unpriced: i128,
    pub cost: i128,
}

impl Amounts {
    pub fn is_zero(&self) -> bool {
        *self == Amounts::default()
    }

    fn minus(self, o: Amounts) -> Amounts {
        Amounts {
            consumed: self.consumed - o.consumed,
            priced: self.priced - o.priced,
            unpriced: self.unpriced - o.unpriced,
            cost: self.cost - o.cost,
        }
    }

    pub fn plus(self, o: Amounts) -> Amounts {
        Amounts {
            consumed: self.consumed + o.consumed,
            priced: self.priced + o.priced,
            unpriced: self.unpriced + o.unpriced,
            cost: self.cost + o.cost,
        }
    }
}

/// Whether a row bills usage of its own period or corrects a closed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChargeClass {
    Usage,
    Correction,
}

impl ChargeClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeClass::Usage => "usage",
            ChargeClass::Correction => "correction",
        }
    }
}

/// One row of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The period the row is billed in: its line's own while open, else the
    /// period open at the run.
    pub billing_period: Period,
    pub charge_class: ChargeClass,
    /// The line, with its own charge period.
    pub line: Line,
    pub amounts: Amounts,
}

/// The rows a run writes at `at`: for every line, what the fold holds
/// (`folded`) less what earlier runs wrote of it (`exported`, by charge
/// period). A line's period is **final** once a complete earlier run (the
/// newest at `frozen`) ran after it closed: that run wrote the period's
/// last rows, and from then on what is folded for it is billed in `open`
/// (the period open at the run) as a correction. A period that closed since
/// the last complete run is still written in its own period, this once: a
/// new export, or one that did not run while a period closed, bills it as
/// usage. Rows are in line order; a line with no difference writes none.
pub fn run(
    folded: &BTreeMap<Line, Amounts>,
    exported: &BTreeMap<Line, Amounts>,
    open: &Period,
    grace: Grace,
    frozen: Option<DateTime<Utc>>,
) -> Vec<Row> {
    let lines: BTreeSet<&Line> = folded.keys().chain(exported.keys()).collect();
    let mut rows = Vec::new();
    for line in lines {
        let now = folded.get(line).copied().unwrap_or_default();
        let before = exported.get(line).copied().unwrap_or_default();
        let amounts = now.minus(before);
        if amounts.is_zero() {
            continue;
        }
        let (billing_period, charge_class) = if frozen.is_some_and(|f| line.period.closed(grace, f)) {
            (open.clone(), ChargeClass::Correction)
        } else {
            (line.period.clone(), ChargeClass::Usage)
        };
        rows.push(Row { billing_period, charge_class, line: line.clone(), amounts });
    }
    rows
}

/// What the runs wrote of each line (by its own charge period): the
/// `exported` of the next run, once `rows` are written.
pub fn record(exported: &mut BTreeMap<Line, Amounts>, rows: &[Row]) {
    for r in rows {
        let e = exported.entry(r.line.clone()).or_default();
        *e = e.plus(r.amounts);
        if e.is_zero() {
            exported.remove(&r.line);
        }
    }
}

/// A slice of one charge period's customers: the dimensions whose stored
/// encoding ([`Dimension::encode`]) is bytewise after `after` and not after
/// `through` (`None`: no bound on that side). A run reads a period slice by
/// slice, the same range on the fold and on what earlier runs wrote, so
/// what it holds at once is one slice's lines, whatever the period's size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DimRange {
    pub after: Option<String>,
    pub through: Option<String>,
}

impl DimRange {
    /// Every dimension.
    pub fn all() -> DimRange {
        DimRange::default()
    }

    /// Whether the range holds a dimension, by its encoding.
    pub fn contains(&self, encoded: &str) -> bool {
        self.after.as_deref().is_none_or(|a| encoded.as_bytes() > a.as_bytes())
            && self.through.as_deref().is_none_or(|t| encoded.as_bytes() <= t.as_bytes())
    }
}

/// Whether a dimension is a customer an export bills: the project, a key,
/// an actor, an agent or a signed-in user (not the all-keys sum).
pub fn is_customer(d: &Dimension) -> bool {
    matches!(
        d,
        Dimension::Project | Dimension::ApiKey(_) | Dimension::Actor(_) | Dimension::Agent(_) | Dimension::User(_)
    )
}

/// The metric lines of one folded counter of a charge period (a `day` or
/// `calendar_month` window of a customer, in the project's zone `tz`):
/// requests, calls, rows and billable tokens as consumed quantities, and
/// the cost of each meter that has one (`cost_usd:<meter>`, the cost in
/// picodollars). Zero lines are left out; a counter of another window or
/// dimension has none.
pub fn metric_lines(k: &crate::usage::CounterKey, tz: Tz, t: &crate::usage::Totals) -> Vec<(Line, Amounts)> {
    let Some(period) = period_of(k.window, &k.window_key, tz).filter(|_| is_customer(&k.dimension)) else {
        return Vec::new();
    };
    let line = |item: String| Line { period: period.clone(), dimension: k.dimension.clone(), item: Item::Metric(item) };
    let quantity = |n: u64| Amounts { consumed: i128::from(n), ..Amounts::default() };
    let mut out = Vec::new();
    for (name, n) in [("requests", t.requests), ("calls", t.calls), ("rows", t.rows), ("tokens", t.tokens)] {
        if n > 0 {
            out.push((line(name.to_owned()), quantity(n)));
        }
    }
    for meter in crate::price::MeterType::ALL {
        let picos = t.get(crate::usage::Field::cost_of(meter));
        if picos != 0 {
            let cost = Amounts { cost: i128::from(picos), ..Amounts::default() };
            out.push((line(format!("cost_usd:{}", meter.as_str())), cost));
        }
    }
    out
}

/// The line of one (provider, model, component) of a charge period: its
/// consumed tokens, the priced and unpriced parts, the cost of the priced.
pub fn model_line(period: Period, dimension: Dimension, row: &crate::report::ModelUsageRow) -> (Line, Amounts) {
    let (priced, unpriced) = (i128::from(row.priced_quantity), i128::from(row.unpriced_quantity));
    let item = Item::Model {
        provider: row.key.provider.clone(),
        model: row.key.model.clone(),
        component: row.key.component.as_str().to_owned(),
    };
    let amounts = Amounts { consumed: priced + unpriced, priced, unpriced, cost: i128::from(row.cost.picos()) };
    (Line { period, dimension, item }, amounts)
}

/// The footprint at each of `instants` (ascending) from a project's storage
/// facts (in (occurred_at, event id) order): the newest snapshot before the
/// instant plus the deltas after it and before the instant, as
/// [`crate::usage::Footprint`] folds them.
pub fn footprints_at(facts: &[crate::ports::StoredStorageFact], instants: &[DateTime<Utc>]) -> Vec<i128> {
    let mut out = Vec::with_capacity(instants.len());
    let (mut i, mut bytes, mut snapshot_at) = (0usize, 0i128, None::<DateTime<Utc>>);
    for t in instants {
        while let Some(f) = facts.get(i).filter(|f| f.occurred_at < *t) {
            if f.snapshot {
                bytes = i128::from(f.bytes);
                snapshot_at = Some(f.occurred_at);
            } else if snapshot_at.is_none_or(|s| f.occurred_at > s) {
                bytes += i128::from(f.bytes);
            }
            i += 1;
        }
        out.push(bytes);
    }
    out
}

/// The storage lines of one charge period of the project (`tz` its zone),
/// as of `at`: `storage_bytes`, the footprint at the period's end (at `at`
/// while it has not ended), and `storage_byte_days`, the footprint at the
/// end of each of its days that ended by `at`, summed (a day's footprint is
/// the one it ends with). `facts` are the project's storage facts before
/// `at`, in (occurred_at, event id) order. Zero lines are left out.
pub fn storage_lines(
    period: &Period,
    tz: Tz,
    facts: &[crate::ports::StoredStorageFact],
    at: DateTime<Utc>,
) -> Vec<(Line, Amounts)> {
    let mut days = Vec::new();
    let mut t = period.start;
    while t < period.end {
        let Some(end) = window_at(WindowKind::Day, tz, t).resets_at.filter(|e| *e > t) else { break };
        let end = end.min(period.end);
        if end > at {
            break;
        }
        days.push(end);
        t = end;
    }
    let mut instants = days.clone();
    let level_at = period.end.min(at);
    instants.push(level_at);
    let values = footprints_at(facts, &instants);
    let byte_days: i128 = values[..days.len()].iter().sum();
    let level = values.last().copied().unwrap_or(0);
    let line = |m: &str| Line { period: period.clone(), dimension: Dimension::Project, item: Item::Metric(m.into()) };
    let mut out = Vec::new();
    if level != 0 {
        out.push((line("storage_bytes"), Amounts { consumed: level, ..Amounts::default() }));
    }
    if byte_days != 0 {
        out.push((line("storage_byte_days"), Amounts { consumed: byte_days, ..Amounts::default() }));
    }
    out
}

/// What the fold holds of one charge period of an export: the metric lines
/// of its customers' counters (`totals`, every counter of the period's
/// window), the lines of their breakdown by model (`models`; the rows of one
/// (provider, model, component) on several meters are one line), and, when
/// the export bills the project, its storage lines ([`storage_lines`]).
pub fn folded_lines(
    spec: &ExportSpec,
    period: &Period,
    tz: Tz,
    totals: &[(crate::usage::CounterKey, crate::usage::Totals)],
    models: &[(Dimension, crate::report::ModelUsageRow)],
    storage: &[crate::ports::StoredStorageFact],
    at: DateTime<Utc>,
) -> BTreeMap<Line, Amounts> {
    let mut out: BTreeMap<Line, Amounts> = BTreeMap::new();
    let mut add = |l: Line, a: Amounts| {
        let e = out.entry(l).or_default();
        *e = e.plus(a);
    };
    for (k, t) in totals {
        if k.window == spec.period && k.window_key == period.key && spec.covers(&k.dimension) {
            metric_lines(k, tz, t).into_iter().for_each(|(l, a)| add(l, a));
        }
    }
    for (d, row) in models {
        if spec.covers(d) {
            let (l, a) = model_line(period.clone(), d.clone(), row);
            add(l, a);
        }
    }
    if spec.dimensions.contains(&CustomerKind::Project) {
        storage_lines(period, tz, storage, at).into_iter().for_each(|(l, a)| add(l, a));
    }
    out.retain(|_, a| !a.is_zero());
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn at(h: i64) -> DateTime<Utc> {
        DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::hours(h)
    }

    /// Days of 24 hours from the epoch: day `d` ends at hour 24 (d + 1).
    fn day(d: i64) -> Period {
        Period { key: format!("d{d}"), start: at(24 * d), end: at(24 * (d + 1)) }
    }

    fn line(d: i64, who: u8, item: &str) -> Line {
        let dimension = if who == 0 { Dimension::Project } else { Dimension::Actor(format!("a{who}")) };
        Line { period: day(d), dimension, item: Item::Metric(item.into()) }
    }

    fn amounts(n: i128) -> Amounts {
        Amounts { consumed: n, priced: n, unpriced: 0, cost: 10 * n }
    }

    #[test]
    fn a_customers_day_counter_gives_its_metric_lines_and_others_none() {
        use crate::usage::{CounterKey, Totals};
        let t = Totals { requests: 3, calls: 2, rows: 40, tokens: 1200, cost_llm_tokens: 4_500, ..Totals::default() };
        let counter = |dimension, window| CounterKey { dimension, window, window_key: "2026-07-07".into() };
        let tz = Tz::Asia__Kathmandu;
        let lines = metric_lines(&counter(Dimension::Actor("cust_42".into()), WindowKind::Day), tz, &t);
        let got: Vec<(String, i128, i128)> = lines
            .iter()
            .map(|(l, a)| match &l.item {
                Item::Metric(m) => (m.clone(), a.consumed, a.cost),
                Item::Model { .. } => panic!("a metric line"),
            })
            .collect();
        let want = [
            ("requests", 3, 0),
            ("calls", 2, 0),
            ("rows", 40, 0),
            ("tokens", 1200, 0),
            ("cost_usd:llm_tokens", 0, 4_500),
        ];
        assert_eq!(got, want.map(|(m, n, c)| (m.to_owned(), n, c)));
        let utc = |s: &str| DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc);
        let period =
            Period { key: "2026-07-07".into(), start: utc("2026-07-06T18:15:00Z"), end: utc("2026-07-07T18:15:00Z") };
        assert!(lines.iter().all(|(l, _)| l.period == period), "{lines:?}");
        assert!(metric_lines(&counter(Dimension::AllApiKeys, WindowKind::Day), tz, &t).is_empty(), "not a customer");
        assert!(metric_lines(&counter(Dimension::Project, WindowKind::Rolling1h), tz, &t).is_empty(), "not a period");
    }

    #[test]
    fn a_period_is_found_from_its_key_across_daylight_saving() {
        let ny = Tz::America__New_York;
        let utc = |s: &str| DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc);
        // The day clocks go forward is 23 hours long; March is an hour short.
        let d = period_of(WindowKind::Day, "2026-03-08", ny).expect("a day");
        assert_eq!((d.start, d.end), (utc("2026-03-08T05:00:00Z"), utc("2026-03-09T04:00:00Z")));
        let m = period_of(WindowKind::CalendarMonth, "2026-03", ny).expect("a month");
        assert_eq!((m.start, m.end), (utc("2026-03-01T05:00:00Z"), utc("2026-04-01T04:00:00Z")));
        assert_eq!(period_of(WindowKind::Day, "2026-02-30", ny), None);
        assert_eq!(period_of(WindowKind::Rolling1m, "2026-03-08", ny), None);
    }

    #[test]
    fn a_model_line_keeps_priced_and_unpriced_apart() {
        use crate::price::{Component, MeterType, PriceKey, Usd};
        let row = crate::report::ModelUsageRow {
            key: PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: Component::OutputTokens },
            meter: MeterType::LlmTokens,
            embedding: false,
            priced_quantity: 200,
            unpriced_quantity: 50,
            cost: Usd(2_000_000_000),
        };
        let (l, a) = model_line(day(0), Dimension::Project, &row);
        let item = Item::Model { provider: "openai".into(), model: "gpt-4o".into(), component: "output_tokens".into() };
        assert_eq!((l.item, l.period, l.dimension), (item, day(0), Dimension::Project));
        assert_eq!(a, Amounts { consumed: 250, priced: 200, unpriced: 50, cost: 2_000_000_000 });
    }

    #[test]
    fn storage_gives_the_footprint_and_the_byte_days_of_ended_days() {
        use crate::ports::StoredStorageFact;
        let utc = |s: &str| DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc);
        let fact = |id: &str, snapshot: bool, at: &str, bytes: i64| StoredStorageFact {
            event_id: crate::EventId::parse(id).expect("id"),
            snapshot,
            occurred_at: utc(at),
            bytes,
        };
        let facts = [
            fact("e1", false, "2026-01-01T06:00:00Z", 100),
            // A snapshot, and a delta at its very instant: not after it.
            fact("e2", true, "2026-01-02T12:00:00Z", 1000),
            fact("e3", false, "2026-01-02T12:00:00Z", 50),
            fact("e4", false, "2026-01-03T01:00:00Z", 10),
        ];
        let month = period_of(WindowKind::CalendarMonth, "2026-01", Tz::UTC).expect("January");
        let lines = storage_lines(&month, Tz::UTC, &facts, utc("2026-01-04T01:00:00Z"));
        let got: Vec<(String, i128)> = lines
            .iter()
            .map(|(l, a)| (if let Item::Metric(m) = &l.item { m.clone() } else { String::new() }, a.consumed))
            .collect();
        // Days 1, 2 and 3 ended: 100 + 1000 + 1010; the level is now's.
        assert_eq!(got, [("storage_bytes".to_owned(), 1010), ("storage_byte_days".to_owned(), 2110)]);
        // A closed month: the level at its end, every day counted.
        let all = storage_lines(&month, Tz::UTC, &facts, utc("2026-03-01T00:00:00Z"));
        assert_eq!(all.iter().map(|(_, a)| a.consumed).collect::<Vec<_>>(), [1010, 100 + 1000 + 29 * 1010]);
        assert!(storage_lines(&month, Tz::UTC, &[], utc("2026-03-01T00:00:00Z")).is_empty());
    }

    #[test]
    fn a_range_of_customers_is_bytewise_after_and_through() {
        let r = DimRange { after: Some("a:B".into()), through: Some("a:b".into()) };
        assert!(!r.contains("a:B") && r.contains("a:a") && r.contains("a:b") && !r.contains("p"));
        // Bytewise: upper case before lower, `*` before `:`.
        assert!(!r.contains("a:A"));
        let open = DimRange { after: Some("k*".into()), through: None };
        assert!(open.contains("k:key_1") && open.contains("p") && !open.contains("g:agent"));
        assert!(DimRange::all().contains(""));
    }

    #[test]
    fn the_grace_is_at_most_72_hours() {
        assert!(Grace::new(Duration::from_secs(72 * 3600)).is_ok());
        assert_eq!(Grace::new(Duration::from_secs(72 * 3600 + 1)).map_err(|e| e.field), Err("grace".to_owned()));
    }

    #[test]
    fn a_closed_periods_late_usage_is_a_correction_in_the_open_period() {
        let grace = Grace::DEFAULT;
        let mut folded = BTreeMap::from([(line(0, 0, "calls"), amounts(5))]);
        let mut exported = BTreeMap::new();
        // Hour 24.5: day 0 ended, within the grace: still open.
        let rows = run(&folded, &exported, &day(1), grace, None);
        assert_eq!((rows.len(), rows[0].charge_class, rows[0].billing_period.clone()), (1, ChargeClass::Usage, day(0)));
        record(&mut exported, &rows);
        let first = at(24) + chrono::Duration::minutes(30);
        // Folded since, and a run at hour 26 (day 0 closed at 25): the
        // last run saw day 0 open, so this one writes it in day 0, finally.
        folded.insert(line(0, 0, "calls"), amounts(6));
        let rows = run(&folded, &exported, &day(1), grace, Some(first));
        assert_eq!((rows[0].charge_class, rows[0].amounts), (ChargeClass::Usage, amounts(1)));
        record(&mut exported, &rows);
        let closing = at(26);
        // Late usage of day 0 and a credit, folded after that run.
        folded.insert(line(0, 0, "calls"), amounts(8));
        folded.insert(line(1, 0, "calls"), amounts(1));
        let rows = run(&folded, &exported, &day(1), grace, Some(closing));
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].charge_class, &rows[0].billing_period, &rows[0].line.period),
            (ChargeClass::Correction, &day(1), &day(0))
        );
        assert_eq!(rows[0].amounts, amounts(2));
        assert_eq!((rows[1].charge_class, rows[1].amounts), (ChargeClass::Usage, amounts(1)));
        record(&mut exported, &rows);
        folded.insert(line(0, 0, "calls"), amounts(7)); // a correction took one back
        let rows = run(&folded, &exported, &day(1), grace, Some(at(27)));
        assert_eq!((rows.len(), rows[0].charge_class, rows[0].amounts), (1, ChargeClass::Correction, amounts(-1)));
        record(&mut exported, &rows);
        assert!(
            run(&folded, &exported, &day(1), grace, Some(at(28))).is_empty(),
            "nothing folded since: nothing written"
        );
    }

    /// A fold step: a line of some day gains (or, corrected, loses) some.
    #[derive(Debug, Clone)]
    enum Step {
        Fold { day: i64, who: u8, item: bool, n: i128 },
        Run,
        Wait(i64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0i64..4, 0u8..3, any::<bool>(), -3i128..20).prop_map(|(day, who, item, n)| Step::Fold { day, who, item, n }),
            2 => Just(Step::Run),
            2 => (1i64..30).prop_map(Step::Wait),
        ]
    }

    proptest! {
        /// Whatever the order of folds, runs and time: the rows of all runs
        /// sum, per line, to the fold; no row is ever billed in a period an
        /// earlier run saw closed (its rows never change after that run); a
        /// usage row bills its own period, a correction row such a final
        /// period's line in the period open at its run.
        #[test]
        fn the_runs_sum_to_the_fold_and_final_periods_never_change(steps in prop::collection::vec(step(), 1..60)) {
            let grace = Grace::new(Duration::from_secs(2 * 3600)).expect("grace");
            let (mut folded, mut exported) = (BTreeMap::new(), BTreeMap::new());
            let mut written: BTreeMap<Line, Amounts> = BTreeMap::new();
            let mut hour = 0i64;
            let mut last: Option<DateTime<Utc>> = None;
            let mut steps = steps;
            steps.push(Step::Wait(200));
            steps.push(Step::Run);
            for s in steps {
                match s {
                    Step::Fold { day, who, item, n } => {
                        let l = line(day, who, if item { "calls" } else { "tokens" });
                        let e: &mut Amounts = folded.entry(l).or_default();
                        *e = e.plus(amounts(n));
                    }
                    Step::Wait(h) => hour += h,
                    Step::Run => {
                        let now = at(hour);
                        let open = day(hour.div_euclid(24));
                        let rows = run(&folded, &exported, &open, grace, last);
                        for r in &rows {
                            let final_at = |p: &Period| last.is_some_and(|l| p.closed(grace, l));
                            prop_assert!(!final_at(&r.billing_period), "billed in a final period: {r:?}");
                            match r.charge_class {
                                ChargeClass::Usage => prop_assert_eq!(&r.billing_period, &r.line.period),
                                ChargeClass::Correction => {
                                    prop_assert!(final_at(&r.line.period));
                                    prop_assert_eq!(&r.billing_period, &open);
                                }
                            }
                            let w: &mut Amounts = written.entry(r.line.clone()).or_default();
                            *w = w.plus(r.amounts);
                        }
                        record(&mut exported, &rows);
                        last = Some(now);
                    }
                }
            }
            written.retain(|_, a| !a.is_zero());
            folded.retain(|_, a: &mut Amounts| !a.is_zero());
            prop_assert_eq!(written, folded);
        }
    }
}
