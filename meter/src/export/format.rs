//! # Export files, format version 1
//!
//! One row per [`Row`] of a run, with these columns, in this order (a change
//! of the header is a new format version, never an edit of this one):
//!
//! | column | what |
//! |---|---|
//! | `export_run_id` | the run that wrote the row |
//! | `watermark` | what the run covers: the log offsets it read to (`partition:offset`, `;`-separated) |
//! | `billing_period` | the period the row is billed in: its own while open, else the one open at the run |
//! | `charge_period_start`, `charge_period_end` | the row's own period, UTC instants (RFC 3339) |
//! | `charge_class` | `usage`, or `correction` for what was folded after its period closed |
//! | `project_id` | |
//! | `customer_type`, `customer_id` | `project`, `api_key`, `actor`, `agent` or `user`, and its id |
//! | `metric` | `requests`, `calls`, `rows`, `tokens`, `cost_usd`, `storage_bytes` (the project's footprint at the period's end, or at the run while it lasts) or `storage_byte_days` (the footprint at the end of each day of the period that has ended, summed); a `tokens` row with a provider breaks the customer's `tokens` row (provider empty) down by model and component: sum one or the other |
//! | `meter_type` | a `cost_usd` row's meter (`llm_tokens`, `compute_execution`, `api_request`, `storage`) |
//! | `provider`, `model`, `component` | a model's tokens row (`input_tokens`, `output_tokens`, `cached_tokens`) |
//! | `consumed_quantity` | the quantity (empty on a `cost_usd` row) |
//! | `priced_quantity`, `unpriced_quantity` | a model's tokens row: the tokens a price covered, and those none did |
//! | `unit_price_usd` | a model's tokens row: cost / priced quantity, when one price applied throughout (exact at 12 decimal places); empty when the period mixed prices |
//! | `cost_usd` | dollars, a decimal exact to the picodollar; empty where nothing is priced |
//! | `currency` | `USD` where there is a cost |
//! | `unpriced_reason` | why a model's tokens row has an unpriced quantity |
//!
//! Amounts are signed: a correction that took usage back is negative.
//! CSV is RFC 4180 (UTF-8, a header row, CRLF, quoted where needed; an
//! empty cell is null). JSON Lines has one object per row with the same
//! names, null for an empty cell, quantities as numbers and money as decimal
//! strings.

use std::io::{self, Write};

use rust_decimal::Decimal;
use serde_json::{Map, Value};

use super::{ChargeClass, Item, Row};
use crate::usage::Dimension;

/// This format's version.
pub const VERSION: u32 = 1;

/// The columns of version 1, in order.
pub const COLUMNS: [&str; 21] = [
    "export_run_id",
    "watermark",
    "billing_period",
    "charge_period_start",
    "charge_period_end",
    "charge_class",
    "project_id",
    "customer_type",
    "customer_id",
    "metric",
    "meter_type",
    "provider",
    "model",
    "component",
    "consumed_quantity",
    "priced_quantity",
    "unpriced_quantity",
    "unit_price_usd",
    "cost_usd",
    "currency",
    "unpriced_reason",
];

const UNPRICED: &str = "no price for this provider, model and component at the event's time";

/// What every row of a run carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    pub run_id: String,
    pub project_id: String,
    /// The log offsets the run read to (`partition:offset`, `;`-separated).
    pub watermark: String,
}

/// One cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cell {
    Null,
    Text(String),
    Quantity(i128),
    /// Dollars, as a decimal string.
    Money(String),
}

impl Cell {
    fn text(s: impl Into<String>) -> Cell {
        Cell::Text(s.into())
    }

    fn csv(&self) -> String {
        match self {
            Cell::Null => String::new(),
            Cell::Text(s) | Cell::Money(s) => s.clone(),
            Cell::Quantity(n) => n.to_string(),
        }
    }

    fn json(&self) -> Value {
        match self {
            Cell::Null => Value::Null,
            Cell::Text(s) | Cell::Money(s) => Value::String(s.clone()),
            Cell::Quantity(n) => match i64::try_from(*n) {
                Ok(v) => Value::from(v),
                Err(_) => Value::String(n.to_string()),
            },
        }
    }
}

/// Picodollars as dollars, exact.
fn dollars(picos: i128) -> io::Result<String> {
    Decimal::try_from_i128_with_scale(picos, 12)
        .map(|d| d.normalize().to_string())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("{picos} picodollars is out of range")))
}

/// A row's cells, in [`COLUMNS`] order.
pub fn cells(run: &RunInfo, row: &Row) -> io::Result<Vec<Cell>> {
    let line = &row.line;
    let (customer_type, customer_id) = match &line.dimension {
        Dimension::Project => ("project", run.project_id.clone()),
        Dimension::ApiKey(k) => ("api_key", k.to_string()),
        Dimension::Actor(a) => ("actor", a.clone()),
        Dimension::Agent(g) => ("agent", g.clone()),
        Dimension::User(u) => ("user", u.clone()),
        Dimension::AllApiKeys => {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the all-keys sum is not a customer"));
        }
    };
    let a = row.amounts;
    let null = || Cell::Null;
    let (metric, meter, provider, model, component) = match &line.item {
        Item::Metric(m) => match m.split_once(':') {
            Some((metric, meter)) => (metric.to_owned(), Cell::text(meter), null(), null(), null()),
            None => (m.clone(), null(), null(), null(), null()),
        },
        Item::Model { provider, model, component } => {
            ("tokens".to_owned(), null(), Cell::text(provider), Cell::text(model), Cell::text(component))
        }
    };
    let is_model = matches!(line.item, Item::Model { .. });
    let is_cost = metric == "cost_usd";
    let priced_some = is_cost || (is_model && (a.priced != 0 || a.cost != 0));
    let unit_price = match is_model && a.priced != 0 && a.cost % a.priced == 0 {
        true => Cell::Money(dollars(a.cost / a.priced)?),
        false => Cell::Null,
    };
    Ok(vec![
        Cell::text(&run.run_id),
        Cell::text(&run.watermark),
        Cell::text(&row.billing_period.key),
        Cell::text(line.period.start.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        Cell::text(line.period.end.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        Cell::text(match row.charge_class {
            ChargeClass::Usage => "usage",
            ChargeClass::Correction => "correction",
        }),
        Cell::text(&run.project_id),
        Cell::text(customer_type),
        Cell::Text(customer_id),
        Cell::Text(metric),
        meter,
        provider,
        model,
        component,
        if is_cost { Cell::Null } else { Cell::Quantity(a.consumed) },
        if is_model { Cell::Quantity(a.priced) } else { Cell::Null },
        if is_model { Cell::Quantity(a.unpriced) } else { Cell::Null },
        unit_price,
        if priced_some { Cell::Money(dollars(a.cost)?) } else { Cell::Null },
        if priced_some { Cell::text("USD") } else { Cell::Null },
        if is_model && a.unpriced != 0 { Cell::text(UNPRICED) } else { Cell::Null },
    ])
}

/// A CSV file of a run (RFC 4180), written as rows come.
pub struct CsvOut<W: Write> {
    out: csv::Writer<W>,
}

impl<W: Write> CsvOut<W> {
    /// Writes the header row.
    pub fn new(w: W) -> io::Result<CsvOut<W>> {
        let mut out = csv::WriterBuilder::new().terminator(csv::Terminator::CRLF).from_writer(w);
        out.write_record(COLUMNS)?;
        Ok(CsvOut { out })
    }

    pub fn row(&mut self, run: &RunInfo, row: &Row) -> io::Result<()> {
        let record: Vec<String> = cells(run, row)?.iter().map(Cell::csv).collect();
        self.out.write_record(&record)?;
        Ok(())
    }

    /// Flushes, and gives the writer back.
    pub fn finish(self) -> io::Result<W> {
        self.out.into_inner().map_err(|e| io::Error::other(e.to_string()))
    }
}

/// A JSON Lines file of a run, written as rows come.
pub struct JsonLinesOut<W: Write> {
    out: W,
}

impl<W: Write> JsonLinesOut<W> {
    pub fn new(out: W) -> JsonLinesOut<W> {
        JsonLinesOut { out }
    }

    pub fn row(&mut self, run: &RunInfo, row: &Row) -> io::Result<()> {
        let object: Map<String, Value> =
            COLUMNS.iter().zip(cells(run, row)?).map(|(name, cell)| ((*name).to_owned(), cell.json())).collect();
        serde_json::to_writer(&mut self.out, &object)?;
        self.out.write_all(b"\n")
    }

    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};

    use super::*;
    use crate::export::{Amounts, Line, Period};

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc)
    }

    fn july() -> Period {
        Period { key: "2026-07".into(), start: utc("2026-07-01T04:00:00Z"), end: utc("2026-08-01T04:00:00Z") }
    }

    fn run() -> RunInfo {
        RunInfo { run_id: "exr_1".into(), project_id: "proj_1".into(), watermark: "0:120;1:7".into() }
    }

    fn row(dimension: Dimension, item: Item, amounts: Amounts) -> Row {
        Row {
            billing_period: july(),
            charge_class: ChargeClass::Usage,
            line: Line { period: july(), dimension, item },
            amounts,
        }
    }

    fn model(component: &str) -> Item {
        Item::Model { provider: "openai".into(), model: "gpt-4o".into(), component: component.into() }
    }

    /// The header is the format: changing it is a new version.
    #[test]
    fn version_1s_header_is_fixed() {
        let out = CsvOut::new(Vec::new()).expect("header").finish().expect("flush");
        assert_eq!(
            String::from_utf8(out).expect("utf-8"),
            "export_run_id,watermark,billing_period,charge_period_start,charge_period_end,charge_class,project_id,\
             customer_type,customer_id,metric,meter_type,provider,model,component,consumed_quantity,priced_quantity,\
             unpriced_quantity,unit_price_usd,cost_usd,currency,unpriced_reason\r\n"
        );
    }

    #[test]
    fn csv_quotes_what_needs_it_and_leaves_null_empty() {
        let mut out = CsvOut::new(Vec::new()).expect("header");
        let calls = Amounts { consumed: 12, ..Amounts::default() };
        out.row(&run(), &row(Dimension::Actor("Smith, \"J\"".into()), Item::Metric("calls".into()), calls))
            .expect("row");
        let text = String::from_utf8(out.finish().expect("flush")).expect("utf-8");
        let line = text.lines().nth(1).expect("a row");
        assert_eq!(
            line,
            "exr_1,0:120;1:7,2026-07,2026-07-01T04:00:00Z,2026-08-01T04:00:00Z,usage,proj_1,actor,\"Smith, \"\"J\"\"\",\
             calls,,,,,12,,,,,,"
        );
    }

    /// A model's row: priced and unpriced apart, the unit price when one
    /// price applied, cost exact; fully unpriced: null cost and the reason.
    #[test]
    fn a_models_rows_keep_priced_and_unpriced_apart() {
        let priced = Amounts { consumed: 1000, priced: 1000, unpriced: 0, cost: 2_500_000_000 };
        let c = cells(&run(), &row(Dimension::Project, model("input_tokens"), priced)).expect("cells");
        let by = |name: &str| c[COLUMNS.iter().position(|n| *n == name).expect("column")].clone();
        assert_eq!(by("customer_id"), Cell::text("proj_1"));
        assert_eq!(by("unit_price_usd"), Cell::Money("0.0000025".into()));
        assert_eq!(
            (by("cost_usd"), by("currency"), by("unpriced_reason")),
            (Cell::Money("0.0025".into()), Cell::text("USD"), Cell::Null)
        );
        // Two prices in the period: no single unit price.
        let mixed = Amounts { consumed: 3, priced: 3, unpriced: 0, cost: 10 };
        let c = cells(&run(), &row(Dimension::Project, model("input_tokens"), mixed)).expect("cells");
        assert_eq!(c[17], Cell::Null);
        let unpriced = Amounts { consumed: 40, priced: 0, unpriced: 40, cost: 0 };
        let c = cells(&run(), &row(Dimension::Project, model("output_tokens"), unpriced)).expect("cells");
        assert_eq!((c[15].clone(), c[16].clone(), c[18].clone()), (Cell::Quantity(0), Cell::Quantity(40), Cell::Null));
        assert!(matches!(&c[20], Cell::Text(r) if r.contains("no price")));
    }

    #[test]
    fn json_lines_give_numbers_money_strings_and_nulls() {
        let mut out = JsonLinesOut::new(Vec::new());
        let cost = Amounts { cost: -1_500_000_000_000, ..Amounts::default() };
        let mut r = row(
            Dimension::ApiKey(crate::ApiKeyId::parse("key_1").expect("id")),
            Item::Metric("cost_usd:llm_tokens".into()),
            cost,
        );
        r.charge_class = ChargeClass::Correction;
        out.row(&run(), &r).expect("row");
        let text = String::from_utf8(out.finish().expect("flush")).expect("utf-8");
        let v: Value = serde_json::from_str(text.trim_end()).expect("one JSON object");
        assert_eq!(v["metric"], "cost_usd");
        assert_eq!(v["meter_type"], "llm_tokens");
        assert_eq!(v["cost_usd"], "-1.5", "a credit, exact");
        assert_eq!(v["consumed_quantity"], Value::Null);
        assert_eq!(v["charge_class"], "correction");
        assert_eq!(v["customer_type"], "api_key");
        assert_eq!(v.as_object().map(|o| o.len()), Some(COLUMNS.len()));
        let calls = Amounts { consumed: 7, ..Amounts::default() };
        let mut out = JsonLinesOut::new(Vec::new());
        out.row(&run(), &row(Dimension::Project, Item::Metric("calls".into()), calls)).expect("row");
        let v: Value = serde_json::from_slice(&out.finish().expect("flush")).expect("json");
        assert_eq!(v["consumed_quantity"], 7);
    }
}
