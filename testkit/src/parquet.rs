//! Reading a Parquet export back, for end-to-end tests.
//!
//! Written against the `parquet` crate's own row reader
//! ([`SerializedFileReader`] and [`Field`]), not the writer's types, so a
//! test checks the file as any other Parquet reader would see it.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use anyhow::{Context, bail};
use parquet::basic::{LogicalType, TimeUnit};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;

/// One cell, as a test compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParquetValue {
    Null,
    Text(String),
    Int(i64),
    /// A DECIMAL: `unscaled / 10^scale`.
    Decimal {
        unscaled: i128,
        scale: u32,
    },
    /// Microseconds since the Unix epoch.
    TimestampMicros(i64),
}

impl ParquetValue {
    fn from_field(name: &str, field: &Field) -> anyhow::Result<ParquetValue> {
        Ok(match field {
            Field::Null => ParquetValue::Null,
            Field::Str(s) => ParquetValue::Text(s.clone()),
            Field::Long(n) => ParquetValue::Int(*n),
            Field::Int(n) => ParquetValue::Int(i64::from(*n)),
            Field::TimestampMicros(t) => ParquetValue::TimestampMicros(*t),
            Field::Decimal(d) => {
                let bytes = d.data();
                if bytes.len() > 16 {
                    bail!("column {name}: a decimal of {} bytes", bytes.len());
                }
                // Big-endian two's complement, sign-extended to 128 bits.
                let fill = if bytes.first().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
                let mut be = [fill; 16];
                be[16 - bytes.len()..].copy_from_slice(bytes);
                let scale = u32::try_from(d.scale()).with_context(|| format!("column {name}: negative scale"))?;
                ParquetValue::Decimal { unscaled: i128::from_be_bytes(be), scale }
            }
            other => bail!("column {name}: unexpected value {other:?}"),
        })
    }
}

fn open(path: &Path) -> anyhow::Result<SerializedFileReader<File>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    SerializedFileReader::new(file).with_context(|| format!("reading {} as parquet", path.display()))
}

/// Every row of the file, by column name.
pub fn read_parquet(path: &Path) -> anyhow::Result<Vec<BTreeMap<String, ParquetValue>>> {
    let reader = open(path)?;
    let mut rows = Vec::new();
    for row in reader.get_row_iter(None)? {
        let row = row?;
        let cells = row
            .get_column_iter()
            .map(|(name, field)| Ok((name.clone(), ParquetValue::from_field(name, field)?)))
            .collect::<anyhow::Result<_>>()?;
        rows.push(cells);
    }
    Ok(rows)
}

/// Each column's name and type, in order: its logical type where it has one
/// (`DECIMAL(38,12)`, `TIMESTAMP(MICROS,UTC)`, `STRING`), else its physical
/// type (`INT64`).
pub fn parquet_schema(path: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let reader = open(path)?;
    let schema = reader.metadata().file_metadata().schema_descr();
    Ok(schema
        .columns()
        .iter()
        .map(|c| {
            let ty = match c.logical_type_ref() {
                Some(LogicalType::Decimal(d)) => format!("DECIMAL({},{})", d.precision, d.scale),
                Some(LogicalType::Timestamp(t)) => {
                    let unit = match t.unit {
                        TimeUnit::MILLIS => "MILLIS",
                        TimeUnit::MICROS => "MICROS",
                        TimeUnit::NANOS => "NANOS",
                    };
                    let zone = if t.is_adjusted_to_u_t_c { "UTC" } else { "LOCAL" };
                    format!("TIMESTAMP({unit},{zone})")
                }
                Some(LogicalType::String) => "STRING".to_owned(),
                Some(other) => format!("{other:?}").to_uppercase(),
                None => format!("{:?}", c.physical_type()),
            };
            (c.name().to_owned(), ty)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parquet::data_type::{ByteArray, ByteArrayType, FixedLenByteArray, FixedLenByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    use super::*;

    /// A file written with the crate's low-level writer reads back as
    /// written: nulls, a negative decimal, a UTC timestamp, text.
    #[test]
    fn read_parquet_gives_back_typed_cells_and_the_schema() {
        let schema = parse_message_type(
            "message export {
                REQUIRED INT64 at (TIMESTAMP(MICROS, true));
                OPTIONAL FIXED_LEN_BYTE_ARRAY (16) cost (DECIMAL(38, 12));
                OPTIONAL BYTE_ARRAY name (STRING);
                OPTIONAL INT64 n;
            }",
        )
        .expect("schema");
        let path = std::env::temp_dir().join(format!("testkit-{}.parquet", uuid::Uuid::new_v4()));
        let file = File::create(&path).expect("file");
        let mut w =
            SerializedFileWriter::new(file, Arc::new(schema), Arc::new(WriterProperties::default())).expect("writer");
        let mut rg = w.next_row_group().expect("row group");
        let mut col = rg.next_column().expect("column").expect("at");
        col.typed::<Int64Type>().write_batch(&[1_000_000, 2_000_000], None, None).expect("at");
        col.close().expect("at");
        let mut col = rg.next_column().expect("column").expect("cost");
        let credit = FixedLenByteArray::from((-1_500_000_000_000i128).to_be_bytes().to_vec());
        col.typed::<FixedLenByteArrayType>().write_batch(&[credit], Some(&[1, 0]), None).expect("cost");
        col.close().expect("cost");
        let mut col = rg.next_column().expect("column").expect("name");
        col.typed::<ByteArrayType>().write_batch(&[ByteArray::from("a")], Some(&[0, 1]), None).expect("name");
        col.close().expect("name");
        let mut col = rg.next_column().expect("column").expect("n");
        col.typed::<Int64Type>().write_batch(&[7], Some(&[1, 0]), None).expect("n");
        col.close().expect("n");
        rg.close().expect("row group");
        w.close().expect("footer");

        let rows = read_parquet(&path).expect("rows");
        let types = parquet_schema(&path).expect("schema");
        std::fs::remove_file(&path).expect("clean up");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0]["at"], ParquetValue::TimestampMicros(1_000_000));
        assert_eq!(rows[0]["cost"], ParquetValue::Decimal { unscaled: -1_500_000_000_000, scale: 12 });
        assert_eq!((&rows[0]["name"], &rows[0]["n"]), (&ParquetValue::Null, &ParquetValue::Int(7)));
        assert_eq!((&rows[1]["cost"], &rows[1]["n"]), (&ParquetValue::Null, &ParquetValue::Null));
        assert_eq!(rows[1]["name"], ParquetValue::Text("a".into()));
        let types: Vec<(&str, &str)> = types.iter().map(|(n, t)| (n.as_str(), t.as_str())).collect();
        assert_eq!(
            types,
            [("at", "TIMESTAMP(MICROS,UTC)"), ("cost", "DECIMAL(38,12)"), ("name", "STRING"), ("n", "INT64")]
        );
    }
}
