//! # Billing exports as Parquet
//!
//! The same rows and columns as the CSV and JSON Lines files of
//! [`meter::export::format`] (format version [`format::VERSION`]): every
//! cell comes from [`format::cells`], so the three formats share one
//! mapping, and only the types are Parquet's own:
//!
//! | columns | Arrow type | Parquet type |
//! |---|---|---|
//! | `charge_period_start`, `charge_period_end` | `Timestamp(Microsecond, "UTC")` | `INT64`, `TIMESTAMP(MICROS, UTC)` |
//! | `consumed_quantity`, `priced_quantity`, `unpriced_quantity` | `Int64` | `INT64` |
//! | `unit_price_usd`, `cost_usd` | `Decimal128(38, 12)` | `DECIMAL(38, 12)`: exact picodollars |
//! | every other column | `Utf8` | `BYTE_ARRAY`, `STRING` |
//!
//! Money never goes through a float: the cell's decimal string of dollars is
//! rescaled to 12 places and its mantissa is the stored unscaled value, so a
//! reader gets back exactly what the CSV file says. A quantity outside
//! `i64`, or an amount with more than 12 decimal places, is an error rather
//! than a silently different number.
//!
//! Memory is bounded whatever the size of the run: rows are buffered in
//! Arrow column builders and written as a record batch, and a row group,
//! every [`BATCH_ROWS`] rows, so neither the rows nor the encoded file are
//! ever held whole. The file's key-value metadata carries
//! `tollgate.export.format` = [`format::VERSION`].

use std::io::{self, Write};
use std::str::FromStr;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Decimal128Builder, Int64Builder, RecordBatch, StringBuilder, TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use meter::export::Row;
use meter::export::format::{self, COLUMNS, Cell, RunInfo};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use rust_decimal::Decimal;

/// Rows per record batch and per row group: what is held in memory at most.
pub const BATCH_ROWS: usize = 8192;

/// The key of the format version in the file's key-value metadata.
pub const FORMAT_KEY: &str = "tollgate.export.format";

/// Money's scale: picodollars.
const MONEY_SCALE: u32 = 12;
const MONEY_PRECISION: u8 = 38;

/// The text columns that always have a value; the others can be null.
const REQUIRED_TEXT: [&str; 8] = [
    "export_run_id",
    "watermark",
    "billing_period",
    "charge_class",
    "project_id",
    "customer_type",
    "customer_id",
    "metric",
];

/// How a column is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text { nullable: bool },
    Instant,
    Quantity,
    Money,
}

fn kind(column: &str) -> Kind {
    match column {
        "charge_period_start" | "charge_period_end" => Kind::Instant,
        "consumed_quantity" | "priced_quantity" | "unpriced_quantity" => Kind::Quantity,
        "unit_price_usd" | "cost_usd" => Kind::Money,
        other => Kind::Text { nullable: !REQUIRED_TEXT.contains(&other) },
    }
}

/// The Arrow schema of format version 1: [`COLUMNS`], in order.
pub fn schema() -> Schema {
    let fields: Vec<Field> = COLUMNS
        .iter()
        .map(|name| match kind(name) {
            Kind::Text { nullable } => Field::new(*name, DataType::Utf8, nullable),
            Kind::Instant => Field::new(*name, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), false),
            Kind::Quantity => Field::new(*name, DataType::Int64, true),
            Kind::Money => Field::new(*name, DataType::Decimal128(MONEY_PRECISION, MONEY_SCALE as i8), true),
        })
        .collect();
    Schema::new(fields)
}

fn invalid(column: &str, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("column {column}: {what}"))
}

/// Dollars as a decimal string → picodollars, exactly (no float).
fn picodollars(dollars: &str) -> Result<i128, String> {
    let d = Decimal::from_str(dollars).map_err(|e| format!("{dollars:?} is not a decimal: {e}"))?;
    let mut scaled = d;
    scaled.rescale(MONEY_SCALE);
    if scaled.scale() != MONEY_SCALE || scaled != d {
        return Err(format!("{dollars:?} is not exact to the picodollar"));
    }
    Ok(scaled.mantissa())
}

/// One column's builder.
enum Column {
    Text(StringBuilder),
    Instant(TimestampMicrosecondBuilder),
    Quantity(Int64Builder),
    Money(Decimal128Builder),
}

impl Column {
    fn new(kind: Kind) -> io::Result<Column> {
        Ok(match kind {
            Kind::Text { .. } => Column::Text(StringBuilder::with_capacity(BATCH_ROWS, BATCH_ROWS * 8)),
            Kind::Instant => {
                Column::Instant(TimestampMicrosecondBuilder::with_capacity(BATCH_ROWS).with_timezone("UTC"))
            }
            Kind::Quantity => Column::Quantity(Int64Builder::with_capacity(BATCH_ROWS)),
            Kind::Money => Column::Money(
                Decimal128Builder::with_capacity(BATCH_ROWS)
                    .with_precision_and_scale(MONEY_PRECISION, MONEY_SCALE as i8)
                    .map_err(io::Error::other)?,
            ),
        })
    }

    fn append(&mut self, name: &str, cell: Cell) -> io::Result<()> {
        match (self, cell) {
            (Column::Text(b), Cell::Text(s)) => b.append_value(s),
            (Column::Text(b), Cell::Null) => b.append_null(),
            (Column::Instant(b), Cell::Text(s)) => {
                let at = chrono::DateTime::parse_from_rfc3339(&s)
                    .map_err(|e| invalid(name, format!("{s:?} is not an RFC 3339 instant: {e}")))?;
                b.append_value(at.timestamp_micros());
            }
            (Column::Quantity(b), Cell::Quantity(n)) => {
                let n = i64::try_from(n).map_err(|_| invalid(name, format!("{n} does not fit in 64 bits")))?;
                b.append_value(n);
            }
            (Column::Quantity(b), Cell::Null) => b.append_null(),
            (Column::Money(b), Cell::Money(s)) => b.append_value(picodollars(&s).map_err(|e| invalid(name, e))?),
            (Column::Money(b), Cell::Null) => b.append_null(),
            (_, cell) => return Err(invalid(name, format!("unexpected cell {cell:?}"))),
        }
        Ok(())
    }

    /// The column so far; the builder starts again empty.
    fn finish(&mut self) -> ArrayRef {
        match self {
            Column::Text(b) => Arc::new(b.finish()),
            Column::Instant(b) => Arc::new(b.finish()),
            Column::Quantity(b) => Arc::new(b.finish()),
            Column::Money(b) => Arc::new(b.finish()),
        }
    }
}

/// A Parquet file of a run (snappy-compressed), written as rows come.
pub struct ParquetOut<W: Write + Send> {
    out: ArrowWriter<W>,
    schema: SchemaRef,
    columns: Vec<Column>,
    buffered: usize,
}

impl<W: Write + Send> ParquetOut<W> {
    /// Writes the file's magic; the schema and metadata go in the footer.
    pub fn new(w: W) -> io::Result<ParquetOut<W>> {
        let schema = Arc::new(schema());
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(BATCH_ROWS))
            .set_key_value_metadata(Some(vec![KeyValue::new(FORMAT_KEY.to_owned(), format::VERSION.to_string())]))
            .build();
        let out = ArrowWriter::try_new(w, Arc::clone(&schema), Some(props)).map_err(io::Error::other)?;
        let columns = COLUMNS.iter().map(|name| Column::new(kind(name))).collect::<io::Result<_>>()?;
        Ok(ParquetOut { out, schema, columns, buffered: 0 })
    }

    pub fn row(&mut self, run: &RunInfo, row: &Row) -> io::Result<()> {
        let cells = format::cells(run, row)?;
        if cells.len() != COLUMNS.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} cells for {} columns", cells.len(), COLUMNS.len()),
            ));
        }
        // A failed row leaves the builders ragged: the batch then fails as a
        // whole, and the file with it, which is what an export run wants.
        for ((column, name), cell) in self.columns.iter_mut().zip(COLUMNS).zip(cells) {
            column.append(name, cell)?;
        }
        self.buffered += 1;
        if self.buffered >= BATCH_ROWS {
            self.write_batch()?;
        }
        Ok(())
    }

    /// Bytes written to `W` so far (row groups flushed; not the buffered
    /// rows): for a progress bar.
    pub fn bytes_written(&self) -> u64 {
        self.out.bytes_written() as u64
    }

    /// Writes the rows still buffered and the footer, and gives the writer back.
    pub fn finish(mut self) -> io::Result<W> {
        if self.buffered > 0 {
            self.write_batch()?;
        }
        self.out.into_inner().map_err(io::Error::other)
    }

    fn write_batch(&mut self) -> io::Result<()> {
        let arrays: Vec<ArrayRef> = self.columns.iter_mut().map(Column::finish).collect();
        self.buffered = 0;
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), arrays).map_err(io::Error::other)?;
        self.out.write(&batch).map_err(io::Error::other)?;
        // A batch is a row group: encode and hand it to `W` now.
        self.out.flush().map_err(io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use axum::body::Bytes;
    use chrono::{DateTime, Utc};
    use meter::export::{Amounts, ChargeClass, Item, Line, Period};
    use meter::{ApiKeyId, Dimension};
    use parquet::basic::{LogicalType, Type as PhysicalType};
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field as Value;

    use super::*;

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

    const ROWS: usize = 20_000;

    /// Row 0: a model row with priced and unpriced tokens; 1: a negative
    /// correction of cost; 2: a fully unpriced model row (null cost); the
    /// rest: `calls` metric rows of actors.
    fn rows() -> Vec<Row> {
        let mut rows = Vec::with_capacity(ROWS);
        let mixed = Amounts { consumed: 1500, priced: 1000, unpriced: 500, cost: 2_500_000_000 };
        rows.push(row(Dimension::Project, model("input_tokens"), mixed));
        let credit = Amounts { cost: -1_500_000_000_000, ..Amounts::default() };
        let mut r = row(
            Dimension::ApiKey(ApiKeyId::parse("key_1").expect("id")),
            Item::Metric("cost_usd:llm_tokens".into()),
            credit,
        );
        r.charge_class = ChargeClass::Correction;
        rows.push(r);
        let unpriced = Amounts { consumed: 40, priced: 0, unpriced: 40, cost: 0 };
        rows.push(row(Dimension::Project, model("output_tokens"), unpriced));
        for i in 3..ROWS {
            let calls = Amounts { consumed: i as i128, ..Amounts::default() };
            rows.push(row(Dimension::Actor(format!("actor_{}", i % 97)), Item::Metric("calls".into()), calls));
        }
        rows
    }

    fn write(rows: &[Row]) -> Vec<u8> {
        let mut out = ParquetOut::new(Vec::new()).expect("writer");
        let mut last = 0;
        for (i, r) in rows.iter().enumerate() {
            out.row(&run(), r).expect("row");
            if (i + 1) % BATCH_ROWS == 0 {
                assert!(out.bytes_written() > last, "a full batch goes out to the writer at once");
                last = out.bytes_written();
            }
        }
        out.finish().expect("footer")
    }

    fn reader(file: Vec<u8>) -> SerializedFileReader<Bytes> {
        SerializedFileReader::new(Bytes::from(file)).expect("a parquet file")
    }

    fn read(file: &SerializedFileReader<Bytes>) -> Vec<BTreeMap<String, Value>> {
        file.get_row_iter(None)
            .expect("rows")
            .map(|r| r.expect("row").get_column_iter().map(|(name, value)| (name.clone(), value.clone())).collect())
            .collect()
    }

    fn unscaled(v: &Value) -> (i128, i32) {
        match v {
            Value::Decimal(d) => {
                let bytes = d.data();
                assert!(bytes.len() <= 16, "{} bytes", bytes.len());
                let fill = if bytes.first().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
                let mut be = [fill; 16];
                be[16 - bytes.len()..].copy_from_slice(bytes);
                (i128::from_be_bytes(be), d.scale())
            }
            other => panic!("not a decimal: {other:?}"),
        }
    }

    #[test]
    fn parquet_round_trips_twenty_thousand_rows_in_bounded_row_groups() {
        let file = reader(write(&rows()));
        let meta = file.metadata();
        assert_eq!(meta.file_metadata().num_rows(), ROWS as i64);
        assert_eq!(meta.num_row_groups(), ROWS.div_ceil(BATCH_ROWS), "one row group per batch");
        assert!(meta.row_groups().iter().all(|g| g.num_rows() <= BATCH_ROWS as i64));
        let version = meta
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|kv| kv.key == FORMAT_KEY))
            .and_then(|kv| kv.value.clone());
        assert_eq!(version, Some(format::VERSION.to_string()));

        let rows = read(&file);
        assert_eq!(rows.len(), ROWS);
        let names: Vec<&str> = rows[0].keys().map(String::as_str).collect();
        let mut columns = COLUMNS.to_vec();
        columns.sort_unstable();
        assert_eq!(names, columns, "every column, once");

        // The model row: priced and unpriced apart, exact money, instants.
        let m = &rows[0];
        let start = utc("2026-07-01T04:00:00Z").timestamp_micros();
        assert_eq!(m["charge_period_start"], Value::TimestampMicros(start));
        assert_eq!(m["charge_period_end"], Value::TimestampMicros(utc("2026-08-01T04:00:00Z").timestamp_micros()));
        assert_eq!(m["export_run_id"], Value::Str("exr_1".into()));
        assert_eq!(m["watermark"], Value::Str("0:120;1:7".into()));
        assert_eq!(m["provider"], Value::Str("openai".into()));
        assert_eq!(
            (&m["consumed_quantity"], &m["priced_quantity"], &m["unpriced_quantity"]),
            (&Value::Long(1500), &Value::Long(1000), &Value::Long(500))
        );
        assert_eq!(unscaled(&m["cost_usd"]), (2_500_000_000, 12), "$0.0025");
        assert_eq!(unscaled(&m["unit_price_usd"]), (2_500_000, 12), "$0.0000025 a token");
        assert_eq!(m["currency"], Value::Str("USD".into()));
        assert!(matches!(&m["unpriced_reason"], Value::Str(r) if r.contains("no price")));

        // The correction: a credit of $1.50, exact and negative.
        let c = &rows[1];
        assert_eq!(unscaled(&c["cost_usd"]), (-1_500_000_000_000, 12));
        assert_eq!(c["charge_class"], Value::Str("correction".into()));
        assert_eq!(c["customer_type"], Value::Str("api_key".into()));
        assert_eq!(c["meter_type"], Value::Str("llm_tokens".into()));
        assert_eq!(c["consumed_quantity"], Value::Null);
        assert_eq!(c["unit_price_usd"], Value::Null);

        // Fully unpriced: no cost, no currency, the reason.
        let u = &rows[2];
        assert_eq!((&u["cost_usd"], &u["currency"]), (&Value::Null, &Value::Null));
        assert_eq!(u["unpriced_quantity"], Value::Long(40));

        // A metric row, past the first row group.
        let last = &rows[ROWS - 1];
        assert_eq!(last["consumed_quantity"], Value::Long(ROWS as i64 - 1));
        assert_eq!(last["customer_id"], Value::Str(format!("actor_{}", (ROWS - 1) % 97)));
        assert_eq!((&last["provider"], &last["priced_quantity"]), (&Value::Null, &Value::Null));
        assert_eq!(last["charge_period_start"], Value::TimestampMicros(start));
    }

    #[test]
    fn parquet_schema_is_version_1s_columns_with_decimal_and_utc_timestamps() {
        let file = reader(write(&rows()[..3]));
        let schema = file.metadata().file_metadata().schema_descr();
        let names: Vec<&str> = schema.columns().iter().map(|c| c.name()).collect();
        assert_eq!(names, COLUMNS);
        let column = |name: &str| {
            let c = &schema.columns()[COLUMNS.iter().position(|n| *n == name).expect("column")];
            (c.physical_type(), c.logical_type_ref().cloned(), c.self_type().is_optional())
        };
        for name in ["unit_price_usd", "cost_usd"] {
            let (physical, logical, optional) = column(name);
            assert_eq!(physical, PhysicalType::FIXED_LEN_BYTE_ARRAY, "{name}");
            assert_eq!(logical, Some(LogicalType::decimal(12, 38)), "{name}");
            assert!(optional, "{name}");
        }
        for name in ["charge_period_start", "charge_period_end"] {
            let (physical, logical, optional) = column(name);
            assert_eq!(physical, PhysicalType::INT64, "{name}");
            assert_eq!(logical, Some(LogicalType::timestamp(true, parquet::basic::TimeUnit::MICROS)), "{name}");
            assert!(!optional, "{name}");
        }
        for name in ["consumed_quantity", "priced_quantity", "unpriced_quantity"] {
            let (physical, _, optional) = column(name);
            assert_eq!(physical, PhysicalType::INT64, "{name}");
            assert!(optional, "{name}");
        }
        let (physical, logical, optional) = column("customer_id");
        assert_eq!((physical, logical, optional), (PhysicalType::BYTE_ARRAY, Some(LogicalType::String), false));
        assert!(column("unpriced_reason").2, "nullable");
        let codecs: Vec<_> = file.metadata().row_group(0).columns().iter().map(|c| c.compression()).collect();
        assert!(codecs.iter().all(|c| *c == Compression::SNAPPY), "{codecs:?}");
    }

    #[test]
    fn parquet_refuses_a_quantity_beyond_64_bits() {
        let huge = Amounts { consumed: i128::from(i64::MAX) + 1, ..Amounts::default() };
        let mut out = ParquetOut::new(Vec::new()).expect("writer");
        let e = out.row(&run(), &row(Dimension::Project, Item::Metric("calls".into()), huge)).expect_err("too big");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("consumed_quantity"), "{e}");
    }

    #[test]
    fn parquet_money_is_exact_picodollars() {
        assert_eq!(picodollars("-1.5"), Ok(-1_500_000_000_000));
        assert_eq!(picodollars("0.0000025"), Ok(2_500_000));
        assert_eq!(picodollars("0.000000000001"), Ok(1));
        assert_eq!(picodollars("79228162.514264337593543950335").ok(), None, "beyond 12 places");
        assert_eq!(picodollars("0.0000000000001").ok(), None, "below a picodollar");
        assert_eq!(picodollars("12345678901234567.000000000001"), Ok(12_345_678_901_234_567_000_000_000_001));
    }
}
