//! Every version of the usage schema this crate has shipped, by fingerprint.
//!
//! Why it exists: a single-object message names its writer schema only by a
//! 64-bit fingerprint, so a reader must hold every schema it may meet. Each
//! `avro/usage_event.v<N>.avsc` is compiled in with `include_str!` and listed
//! in [`USAGE_SOURCES`]; a test fails if a file there is missing from the list.
//!
//! What it guarantees:
//!
//! - The versions are parsed once, on first use, and are listed oldest first;
//!   the last one is the current schema, which writers use and readers
//!   resolve to.
//! - Fingerprints are CRC-64-AVRO (Rabin) of the Parsing Canonical Form as
//!   the Avro specification defines it and the Java reference implements it
//!   (`SchemaNormalization.parsingFingerprint64`, which Java's
//!   `BinaryMessageDecoder` uses). apache-avro 0.21 (and the Python `avro`
//!   package) keep a logical type's primitive as `{"type":"long"}` in the
//!   canonical form where the specification's \[PRIMITIVES\] rule and Java
//!   write `"long"`, which changes the fingerprint of any schema with a
//!   logical type, ours included; [`canonical_form`] corrects that before
//!   fingerprinting, and a test pins the v1 fingerprint.
//! - Versions never share a fingerprint (a test checks this; two versions that
//!   differ only in docs or defaults have the same canonical form and are not
//!   separate versions).
//! - Schemas are never edited once shipped: a change is a new version file.
//!   Old readers meet a newer writer's fingerprint as
//!   [`SchemaError::UnknownFingerprint`],
//!   so readers (the projector) must be deployed with a new version before
//!   writers (the gateway) start writing it.

use std::sync::OnceLock;

use apache_avro::Schema;
use apache_avro::rabin::Rabin;

use crate::SchemaError;

/// The source of every shipped usage schema version, oldest first.
pub const USAGE_SOURCES: &[(u32, &str)] = &[
    (1, include_str!("../avro/usage_event.v1.avsc")),
    (2, include_str!("../avro/usage_event.v2.avsc")),
    (3, include_str!("../avro/usage_event.v3.avsc")),
    // The check's estimate on an admitted request (estimate_tokens, estimate_cost).
    (4, include_str!("../avro/usage_event.v4.avsc")),
];

/// The source of every shipped audit entry schema version
/// (`avro/audit_entry.v<N>.avsc`), oldest first; the same rules as
/// [`USAGE_SOURCES`].
pub const AUDIT_SOURCES: &[(u32, &str)] = &[
    (1, include_str!("../avro/audit_entry.v1.avsc")),
    // `project_id` nullable: installation-wide entries (prices).
    (2, include_str!("../avro/audit_entry.v2.avsc")),
];

/// One known version of a schema (usage event or audit entry).
#[derive(Debug, Clone)]
pub struct SchemaVersion {
    /// `N` of `usage_event.vN.avsc` (or `audit_entry.vN.avsc`).
    pub version: u32,
    /// The schema's JSON as shipped.
    pub source: &'static str,
    pub schema: Schema,
    /// The specification's Parsing Canonical Form.
    pub canonical_form: String,
    /// CRC-64-AVRO of [`Self::canonical_form`], as a little-endian `u64`
    /// (the 8 bytes after the marker, read with `u64::from_le_bytes`).
    pub fingerprint: u64,
}

impl SchemaVersion {
    /// Parses one schema version.
    pub fn parse(version: u32, source: &'static str) -> Result<Self, SchemaError> {
        let schema = Schema::parse_str(source)
            .map_err(|e| SchemaError::Malformed(format!("schema v{version} does not parse: {e}")))?;
        let canonical_form = canonical_form(&schema);
        let fingerprint = fingerprint_of_canonical(&canonical_form)?;
        Ok(SchemaVersion { version, source, schema, canonical_form, fingerprint })
    }
}

/// Every known version, oldest first; the last is the current one.
pub fn usage_schema_versions() -> &'static [SchemaVersion] {
    static VERSIONS: OnceLock<Vec<SchemaVersion>> = OnceLock::new();
    VERSIONS.get_or_init(|| {
        USAGE_SOURCES
            .iter()
            .map(|(version, source)| {
                // Invariant: the sources are compiled in and every one is
                // parsed by the tests, so this cannot fail in a built release.
                SchemaVersion::parse(*version, source).expect("a bundled usage schema parses")
            })
            .collect()
    })
}

/// The current version: what writers write and readers resolve to.
pub fn usage_schema_version() -> &'static SchemaVersion {
    // Invariant: USAGE_SOURCES is a non-empty constant.
    usage_schema_versions().last().expect("at least one usage schema version")
}

/// The current usage schema.
pub fn usage_schema() -> &'static Schema {
    &usage_schema_version().schema
}

/// The known version with this fingerprint, if any.
pub fn find_usage_schema(fingerprint: u64) -> Option<&'static SchemaVersion> {
    usage_schema_versions().iter().find(|v| v.fingerprint == fingerprint)
}

/// Every known version of the audit entry schema, oldest first; the last is
/// the current one.
pub fn audit_schema_versions() -> &'static [SchemaVersion] {
    static VERSIONS: OnceLock<Vec<SchemaVersion>> = OnceLock::new();
    VERSIONS.get_or_init(|| {
        AUDIT_SOURCES
            .iter()
            .map(|(version, source)| {
                // Invariant: as for the usage schemas, compiled in and parsed by the tests.
                SchemaVersion::parse(*version, source).expect("a bundled audit schema parses")
            })
            .collect()
    })
}

/// The current audit entry schema version: what the relay writes.
pub fn audit_schema_version() -> &'static SchemaVersion {
    // Invariant: AUDIT_SOURCES is a non-empty constant.
    audit_schema_versions().last().expect("at least one audit schema version")
}

/// The known audit entry schema version with this fingerprint, if any.
pub fn find_audit_schema(fingerprint: u64) -> Option<&'static SchemaVersion> {
    audit_schema_versions().iter().find(|v| v.fingerprint == fingerprint)
}

const PRIMITIVES: [&str; 8] = ["null", "boolean", "int", "long", "float", "double", "bytes", "string"];

/// The [Parsing Canonical Form] of a schema, as the specification defines it.
///
/// apache-avro strips `logicalType` but leaves the object around the
/// primitive (`{"type":"long"}`); the specification's \[PRIMITIVES\] rule
/// reduces it to `"long"`. In canonical form such an object can only come
/// from that gap (names and symbols cannot hold braces or quotes, and docs
/// and defaults are stripped), so replacing it textually is exact.
///
/// [Parsing Canonical Form]: https://avro.apache.org/docs/current/specification/#parsing-canonical-form-for-schemas
pub fn canonical_form(schema: &Schema) -> String {
    let mut pcf = schema.canonical_form();
    for p in PRIMITIVES {
        pcf = pcf.replace(&format!("{{\"type\":\"{p}\"}}"), &format!("\"{p}\""));
    }
    pcf
}

/// CRC-64-AVRO of a canonical form, with apache-avro's Rabin digest.
///
/// The canonical form is re-parsed so apache-avro fingerprints exactly these
/// bytes: it holds no logical types any more, and apache-avro's canonical
/// form of such a schema is the specification's (a test checks this).
fn fingerprint_of_canonical(pcf: &str) -> Result<u64, SchemaError> {
    let plain =
        Schema::parse_str(pcf).map_err(|e| SchemaError::Malformed(format!("canonical form does not parse: {e}")))?;
    let bytes: [u8; 8] = plain
        .fingerprint::<Rabin>()
        .bytes
        .try_into()
        .map_err(|_| SchemaError::Malformed("rabin fingerprint is not 8 bytes".into()))?;
    Ok(u64::from_le_bytes(bytes))
}

/// The specification's fingerprint of any schema (CRC-64-AVRO of its
/// Parsing Canonical Form), as a little-endian `u64`.
pub fn fingerprint(schema: &Schema) -> Result<u64, SchemaError> {
    fingerprint_of_canonical(&canonical_form(schema))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bundled_version_parses_in_order_with_a_unique_fingerprint() {
        let versions = usage_schema_versions();
        for (i, v) in versions.iter().enumerate() {
            assert_eq!(v.version as usize, i + 1, "versions are 1..=n, oldest first");
            assert!(!v.canonical_form.contains("logicalType"));
            for p in PRIMITIVES {
                assert!(!v.canonical_form.contains(&format!("{{\"type\":\"{p}\"}}")), "{}", v.canonical_form);
            }
            let again = Schema::parse_str(&v.canonical_form).expect("pcf parses");
            assert_eq!(again.canonical_form(), v.canonical_form, "apache-avro fingerprints the spec's bytes");
        }
        for a in versions {
            for b in versions {
                if a.version != b.version {
                    assert_ne!(a.fingerprint, b.fingerprint, "v{} and v{}", a.version, b.version);
                }
            }
        }
    }

    #[test]
    fn every_schema_file_is_in_the_registry() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("avro");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("avro dir") {
            let name = entry.expect("entry").file_name().into_string().expect("utf-8 name");
            let (n, sources) = if let Some(n) = name.strip_prefix("usage_event.v") {
                (n, USAGE_SOURCES)
            } else if let Some(n) = name.strip_prefix("audit_entry.v") {
                (n, AUDIT_SOURCES)
            } else {
                panic!("{name}: neither usage_event.v<N>.avsc nor audit_entry.v<N>.avsc");
            };
            let n: u32 = n.strip_suffix(".avsc").and_then(|n| n.parse().ok()).expect("<name>.v<N>.avsc");
            let on_disk = std::fs::read_to_string(dir.join(&name)).expect("read");
            let listed = sources.iter().find(|(v, _)| *v == n).unwrap_or_else(|| panic!("{name} not in the registry"));
            assert_eq!(listed.1, on_disk, "{name}");
            seen += 1;
        }
        assert_eq!(seen, USAGE_SOURCES.len() + AUDIT_SOURCES.len(), "every listed version is on disk");
    }

    #[test]
    fn audit_versions_parse_in_order_and_share_no_fingerprint_with_any_other_schema() {
        let audit = audit_schema_versions();
        for (i, v) in audit.iter().enumerate() {
            assert_eq!(v.version as usize, i + 1, "versions are 1..=n, oldest first");
            assert!(!v.canonical_form.contains("logicalType"));
        }
        for a in audit {
            for b in audit.iter().chain(usage_schema_versions()) {
                if !std::ptr::eq(a, b) {
                    assert_ne!(a.fingerprint, b.fingerprint, "audit v{} and v{}", a.version, b.version);
                }
            }
        }
    }

    #[test]
    fn the_fingerprint_agrees_with_apache_avro_where_it_follows_the_spec() {
        let s = Schema::parse_str(r#"{"type":"record","name":"a.B","fields":[{"name":"x","type":"long"}]}"#)
            .expect("parses");
        let theirs = u64::from_le_bytes(s.fingerprint::<Rabin>().bytes.try_into().expect("8 bytes"));
        assert_eq!(fingerprint(&s).expect("fingerprint"), theirs);
    }

    #[test]
    fn a_logical_type_is_reduced_to_its_primitive() {
        let with = Schema::parse_str(
            r#"{"type":"record","name":"a.B","fields":[{"name":"t","type":{"type":"long","logicalType":"timestamp-micros"}}]}"#,
        )
        .expect("parses");
        let without = Schema::parse_str(r#"{"type":"record","name":"a.B","fields":[{"name":"t","type":"long"}]}"#)
            .expect("parses");
        assert_eq!(canonical_form(&with), r#"{"name":"a.B","type":"record","fields":[{"name":"t","type":"long"}]}"#);
        assert_eq!(fingerprint(&with).expect("fp"), fingerprint(&without).expect("fp"));
    }

    #[test]
    fn the_specs_test_vector() {
        // share/test/data/schema-tests.txt of the Avro project: "int".
        let int = Schema::parse_str(r#""int""#).expect("parses");
        assert_eq!(fingerprint(&int).expect("fp"), 8_247_732_601_305_521_295);
    }

    #[test]
    fn v1_is_frozen() {
        // Computed once with the specification's algorithm, independently of
        // this crate. If this fails, v1 was edited: restore it and add a v2.
        let v1 = &usage_schema_versions()[0];
        assert_eq!(v1.fingerprint, 0x23c3_b9e7_7b4f_2fc3);
        assert!(v1.canonical_form.contains(r#"{"name":"occurred_at","type":"long"}"#));
    }

    #[test]
    fn v2_and_v3_are_frozen() {
        // Computed once with the specification's algorithm, independently of
        // this crate, and the fingerprints their golden vectors carry. If
        // this fails, usage_event.v<N>.avsc was edited: restore it and add a
        // new version.
        let versions = usage_schema_versions();
        assert_eq!(versions[1].fingerprint, 0x9ced_d480_e2e7_55fe, "v2");
        assert_eq!(versions[2].fingerprint, 0x2be1_a090_66ba_4aa3, "v3");
    }

    #[test]
    fn v4_is_frozen_and_current() {
        // Computed once with the specification's algorithm (CRC-64-AVRO of
        // the Parsing Canonical Form below), independently of this crate.
        // If this fails, usage_event.v4.avsc was edited: restore it and add a v5.
        let v4 = &usage_schema_versions()[3];
        assert_eq!(
            v4.canonical_form,
            r#"{"name":"tollgate.UsageEvent","type":"record","fields":[{"name":"id","type":"string"},{"name":"project_id","type":"string"},{"name":"api_key_id","type":["null","string"]},{"name":"agent_id","type":["null","string"]},{"name":"actor_id","type":["null","string"]},{"name":"user_id","type":["null","string"]},{"name":"occurred_at","type":"long"},{"name":"kind","type":{"name":"tollgate.UsageKind","type":"enum","symbols":["request","call","tokens","storage_delta","storage_snapshot","correction"]}},{"name":"outcome","type":{"name":"tollgate.Outcome","type":"enum","symbols":["success","failure"]}},{"name":"calls","type":"long"},{"name":"rows","type":"long"},{"name":"tokens","type":["null",{"type":"array","items":{"name":"tollgate.TokenUsage","type":"record","fields":[{"name":"provider","type":"string"},{"name":"model","type":"string"},{"name":"input","type":"long"},{"name":"output","type":"long"},{"name":"cached","type":"long"},{"name":"reasoning","type":"long"},{"name":"embedding","type":"boolean"}]}}]},{"name":"storage_bytes","type":["null","long"]},{"name":"meter_type","type":["null","string"]},{"name":"reservation_id","type":["null","string"]},{"name":"gateway","type":"string"},{"name":"received_at","type":["null","long"]},{"name":"admitted","type":["null","boolean"]},{"name":"lease_until","type":["null","long"]},{"name":"held","type":["null",{"type":"array","items":{"name":"tollgate.HeldCounter","type":"record","fields":[{"name":"counter","type":"string"},{"name":"resets_at","type":["null","long"]}]}}]},{"name":"breaches","type":["null",{"type":"array","items":{"name":"tollgate.QuotaBreach","type":"record","fields":[{"name":"quota_id","type":"string"},{"name":"window_key","type":"string"},{"name":"limit","type":"long"},{"name":"observed","type":"long"},{"name":"enforce","type":"boolean"}]}}]},{"name":"corrects","type":["null","string"]},{"name":"void","type":"boolean"},{"name":"estimate_tokens","type":["null","long"]},{"name":"estimate_cost","type":["null","long"]}]}"#
        );
        assert_eq!(v4.fingerprint, 0x9237_b399_d0dd_147c);
        assert_eq!(usage_schema_version().version, 4, "the writer writes v4");
    }
}
