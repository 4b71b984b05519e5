//! The log outlives the code: bytes written by every shipped schema version
//! must still decode, and every version must read every other.

use std::fs;
use std::path::{Path, PathBuf};

use apache_avro::schema_compatibility::SchemaCompatibility;
use apache_avro::types::Value;
use apache_avro::{Schema, from_avro_datum, to_avro_datum};
use meter::{Estimate, UsageFact};
use schemas::single_object::split_header;
use schemas::{
    AuditRecord, audit_schema_versions, decode_audit, decode_usage, find_audit_schema, find_usage_schema,
    usage_schema_versions,
};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// `(file name, expected fact)` of every golden vector of every version.
fn expectations() -> Vec<(String, UsageFact)> {
    let mut out = Vec::new();
    for v in usage_schema_versions() {
        let path = golden_dir().join(format!("usage_event.v{}.json", v.version));
        let text = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("every version has golden vectors ({}): {e}", path.display()));
        let entries: Vec<serde_json::Value> = serde_json::from_str(&text).expect("golden json parses");
        assert!(!entries.is_empty(), "{} lists vectors", path.display());
        for entry in entries {
            let file = entry["file"].as_str().expect("file name").to_owned();
            let fact: UsageFact = serde_json::from_value(entry["fact"].clone()).expect("expected fact parses");
            out.push((file, fact));
        }
    }
    out
}

fn golden_bytes(file: &str) -> Vec<u8> {
    fs::read(golden_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

#[test]
fn golden_vectors_still_decode() {
    let expected = expectations();
    for (file, fact) in &expected {
        let decoded = decode_usage(&golden_bytes(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(&decoded, fact, "{file}");
    }
    // Every .bin is listed, so none is silently left unchecked.
    for entry in fs::read_dir(golden_dir()).expect("golden dir") {
        let name = entry.expect("entry").file_name().into_string().expect("utf-8");
        if name.starts_with("usage_event.") && name.ends_with(".bin") {
            assert!(expected.iter().any(|(f, _)| *f == name), "{name} is not in a golden json");
        }
    }
}

#[test]
fn golden_vectors_name_the_version_they_were_written_with() {
    for (file, _) in expectations() {
        let (fingerprint, _) = split_header(&golden_bytes(&file)).expect("header");
        let writer = find_usage_schema(fingerprint).expect("known fingerprint");
        assert!(file.starts_with(&format!("usage_event.v{}.", writer.version)), "{file}");
    }
}

/// The schema version a golden vector's file name says it was written with.
fn version_of(file: &str) -> u32 {
    file.strip_prefix("usage_event.v")
        .and_then(|rest| rest.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{file}: not usage_event.v<N>.<name>.bin"))
}

#[test]
fn the_estimate_reads_as_zero_before_v4_and_is_kept_from_v4_on() {
    let mut both_components = false;
    for (file, fact) in expectations() {
        let decoded = decode_usage(&golden_bytes(&file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        if version_of(&file) < 4 {
            // No field to hold it: such events estimated nothing.
            assert_eq!(decoded.estimate, Estimate::default(), "{file}");
        } else if !decoded.estimate.is_zero() {
            assert_eq!(decoded.estimate, fact.estimate, "{file}");
            assert_eq!(decoded.admitted, Some(true), "{file}: only an admitted request holds an estimate");
            assert!(!decoded.held.is_empty(), "{file}: the estimate is held on its counters");
            both_components |= decoded.estimate.tokens > 0 && decoded.estimate.cost > 0;
        }
    }
    assert!(both_components, "a v4 vector holds an estimate of both tokens and cost");
    let admitted = expectations()
        .into_iter()
        .find(|(f, _)| f == "usage_event.v4.request_admitted.bin")
        .expect("a v4 request_admitted vector");
    assert!(!admitted.1.estimate.is_zero(), "v4 request_admitted carries an estimate");
}

/// Whether data written with `writer` reads with `reader`: Avro's schema
/// compatibility check, then resolving an actual datum.
fn can_read(writer: &Schema, reader: &Schema, datum: &[u8]) -> Result<Value, String> {
    SchemaCompatibility::can_read(writer, reader).map_err(|e| format!("compatibility: {e}"))?;
    let mut body = datum;
    let value = from_avro_datum(writer, &mut body, Some(reader)).map_err(|e| format!("resolution: {e}"))?;
    if !body.is_empty() {
        return Err(format!("{} bytes left over", body.len()));
    }
    Ok(value)
}

#[test]
fn every_known_version_reads_every_other() {
    let versions = usage_schema_versions();
    for (file, _) in expectations() {
        let bytes = golden_bytes(&file);
        let (fingerprint, datum) = split_header(&bytes).expect("header");
        let writer = find_usage_schema(fingerprint).expect("known fingerprint");
        // Backward (new reads old) and forward (old reads new) alike.
        for reader in versions {
            if let Err(e) = can_read(&writer.schema, &reader.schema, datum) {
                panic!("{file}: v{} cannot read v{}: {e}", reader.version, writer.version);
            }
        }
    }
    for w in versions {
        for r in versions {
            SchemaCompatibility::can_read(&w.schema, &r.schema)
                .unwrap_or_else(|e| panic!("v{} cannot read v{}: {e}", r.version, w.version));
        }
    }
}

/// v1 plus one field; `default` is the new field's default, if any.
fn v2_with_new_field(default: Option<serde_json::Value>) -> Schema {
    let v1 = &usage_schema_versions()[0];
    let mut json: serde_json::Value = serde_json::from_str(v1.source).expect("v1 is json");
    let mut field = serde_json::json!({ "name": "region", "type": "string", "doc": "test-only" });
    if let Some(d) = default {
        field["default"] = d;
    }
    json["fields"].as_array_mut().expect("fields").push(field);
    Schema::parse_str(&json.to_string()).expect("v2 parses")
}

/// A datum of `v2_with_new_field`: the first v1 golden vector plus `region`.
fn v2_datum(v2: &Schema) -> Vec<u8> {
    let v1 = &usage_schema_versions()[0];
    let (file, _) = expectations().into_iter().next().expect("a golden vector");
    let bytes = golden_bytes(&file);
    let (_, datum) = split_header(&bytes).expect("header");
    let Value::Record(mut fields) = from_avro_datum(&v1.schema, &mut &datum[..], None).expect("decodes") else {
        panic!("a record");
    };
    fields.push(("region".into(), Value::String("eu-west".into())));
    to_avro_datum(v2, Value::Record(fields)).expect("encodes with v2")
}

#[test]
fn a_field_added_with_a_default_is_compatible_both_ways() {
    let v1 = &usage_schema_versions()[0];
    let v2 = v2_with_new_field(Some("unknown".into()));
    for (file, _) in expectations().into_iter().filter(|(f, _)| f.starts_with("usage_event.v1.")) {
        let bytes = golden_bytes(&file);
        let (_, v1_datum) = split_header(&bytes).expect("header");
        let Value::Record(fields) = can_read(&v1.schema, &v2, v1_datum).expect("v2 reads v1") else {
            panic!("a record");
        };
        assert_eq!(fields.last(), Some(&("region".into(), Value::String("unknown".into()))), "{file}");
    }
    can_read(&v2, &v1.schema, &v2_datum(&v2)).expect("v1 reads v2");
}

#[test]
fn a_field_added_without_a_default_is_caught() {
    let v1 = &usage_schema_versions()[0];
    let v2 = v2_with_new_field(None);
    let bytes = golden_bytes(&expectations()[0].0);
    let (_, v1_datum) = split_header(&bytes).expect("header");
    // Old data cannot be read by the new schema: not backward compatible.
    let err = can_read(&v1.schema, &v2, v1_datum).expect_err("v2 must not read v1");
    assert!(err.starts_with("compatibility"), "{err}");
    // The datum-level check alone catches it too.
    assert!(from_avro_datum(&v1.schema, &mut &v1_datum[..], Some(&v2)).is_err());
    // New data is still readable by old readers (the field is skipped).
    can_read(&v2, &v1.schema, &v2_datum(&v2)).expect("v1 reads v2");
}

/// `(file name, expected record)` of every golden vector of every audit
/// entry schema version.
fn audit_expectations() -> Vec<(String, AuditRecord)> {
    let mut out = Vec::new();
    for v in audit_schema_versions() {
        let path = golden_dir().join(format!("audit_entry.v{}.json", v.version));
        let text = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("every audit version has golden vectors ({}): {e}", path.display()));
        let entries: Vec<serde_json::Value> = serde_json::from_str(&text).expect("golden json parses");
        assert!(!entries.is_empty(), "{} lists vectors", path.display());
        for entry in entries {
            let file = entry["file"].as_str().expect("file name").to_owned();
            let record: AuditRecord = serde_json::from_value(entry["record"].clone()).expect("expected record parses");
            out.push((file, record));
        }
    }
    out
}

#[test]
fn audit_golden_vectors_still_decode_and_name_their_version() {
    let expected = audit_expectations();
    for (file, record) in &expected {
        let bytes = golden_bytes(file);
        let entry = decode_audit(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(&AuditRecord::of(&entry).expect("record"), record, "{file}");
        let (fingerprint, _) = split_header(&bytes).expect("header");
        let writer = find_audit_schema(fingerprint).expect("known fingerprint");
        assert!(file.starts_with(&format!("audit_entry.v{}.", writer.version)), "{file}");
    }
    // Every .bin is listed (usage vectors above, audit vectors here), so
    // none is silently left unchecked.
    for entry in fs::read_dir(golden_dir()).expect("golden dir") {
        let name = entry.expect("entry").file_name().into_string().expect("utf-8");
        if name.ends_with(".bin") && !name.starts_with("usage_event.") {
            assert!(expected.iter().any(|(f, _)| *f == name), "{name} is not in a golden json");
        }
    }
}

#[test]
fn the_current_audit_version_reads_every_earlier_one_and_v1_reads_what_it_can_hold() {
    let versions = audit_schema_versions();
    let current = versions.last().expect("a current version");
    for (file, record) in audit_expectations() {
        let bytes = golden_bytes(&file);
        let (fingerprint, datum) = split_header(&bytes).expect("header");
        let writer = find_audit_schema(fingerprint).expect("known fingerprint");
        // Backward: the current reader reads every version written.
        if let Err(e) = can_read(&writer.schema, &current.schema, datum) {
            panic!("{file}: v{} cannot read v{}: {e}", current.version, writer.version);
        }
        // Forward, from v2 on: a v1 reader reads an entry of a project, and
        // refuses an installation-wide one (its project_id cannot be null).
        let v1 = &versions[0];
        let mut body = datum;
        let read = from_avro_datum(&writer.schema, &mut body, Some(&v1.schema));
        match record.project_id {
            Some(_) => {
                read.unwrap_or_else(|e| panic!("{file}: v1 cannot read v{}: {e}", writer.version));
            }
            None => assert!(read.is_err(), "{file}: v1 has no way to hold a null project_id"),
        }
    }
    for w in versions {
        SchemaCompatibility::can_read(&w.schema, &current.schema)
            .unwrap_or_else(|e| panic!("v{} cannot read v{}: {e}", current.version, w.version));
    }
    assert!(
        audit_expectations().iter().any(|(f, r)| f.starts_with("audit_entry.v2.") && r.project_id.is_none()),
        "a v2 vector is installation-wide"
    );
}
