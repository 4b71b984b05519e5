//! Avro single-object encoding of usage events.
//!
//! Why it exists: a Kafka message carries no schema, so each event names its
//! writer schema in a 10-byte header — `0xC3 0x01` then the schema's 8-byte
//! little-endian fingerprint — followed by the Avro binary datum. This is the
//! framing of the [Avro specification], readable by any Avro library.
//!
//! What it guarantees:
//!
//! - [`encode_usage`] writes with the current schema; [`decode_usage`] reads
//!   any known version (looked up by fingerprint) and resolves it to the
//!   current schema with Avro's schema resolution, so fields added since get
//!   their defaults and fields removed since are skipped. A datum of the
//!   current version is read straight into its type (`serde_avro_fast`),
//!   any other through an apache-avro `Value`; a test holds the two to the
//!   same result.
//! - The whole message must be one datum: trailing bytes are an error, not
//!   ignored, so two frames glued together are never half-read; and a datum
//!   cut short is an error too, even where the decoder alone would read the
//!   missing trailing fields as null (see [`Exact`]).
//! - Decoding never panics on bad bytes; it returns a [`SchemaError`] whose
//!   `Display` is the DLQ reason.
//!
//! [Avro specification]: https://avro.apache.org/docs/current/specification/#single-object-encoding

use std::collections::HashMap;
use std::io::{self, BufRead, Read};
use std::sync::OnceLock;

use apache_avro::headers::HeaderBuilder;
use apache_avro::{
    GenericSingleObjectReader, from_avro_datum, from_value, to_avro_datum, to_value, write_avro_datum_ref,
};
use meter::UsageFact;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::registry::{
    SchemaVersion, audit_schema_versions, find_usage_schema, usage_schema_version, usage_schema_versions,
};
use crate::{SchemaError, UsageEvent};

/// The two bytes every single-object message starts with.
pub const MARKER: [u8; 2] = [0xC3, 0x01];
/// Marker plus fingerprint.
pub const HEADER_LEN: usize = 10;

/// Encodes a usage fact with the current schema, framed as a single object.
///
/// Refuses rows that do not fit in an Avro `long` rather than writing a
/// saturated count. Times are written to the microsecond (truncated).
///
/// # Errors
///
/// [`SchemaError::Invalid`] for rows above `i64::MAX`; [`SchemaError::Encode`]
/// if the value does not fit the schema (a bug, not a property of the fact).
pub fn encode_usage(fact: &UsageFact) -> Result<Vec<u8>, SchemaError> {
    if i64::try_from(fact.rows).is_err() {
        return Err(SchemaError::invalid("rows", format!("{} does not fit in an avro long", fact.rows)));
    }
    encode_event(&UsageEvent::of(fact))
}

/// Decodes a single-object usage event of any known schema version into a
/// usage fact.
///
/// # Errors
///
/// [`SchemaError::BadMarker`] and [`SchemaError::Malformed`] for bytes that
/// are not a single-object datum, [`SchemaError::UnknownFingerprint`] for a
/// writer schema this release does not know, [`SchemaError::Invalid`] (with
/// the field) for a datum that is not a valid usage fact. All permanent.
pub fn decode_usage(bytes: &[u8]) -> Result<UsageFact, SchemaError> {
    // A datum of the current version is read with its strings borrowed
    // from `bytes` (the projector decodes every record: no copy of an id
    // that is parsed and dropped at once); any other through a value.
    let what = ("usage schema", "usage event");
    match read_current::<UsageEvent<&str>>(bytes, find_usage_schema, usage_schema_version(), what)? {
        Some(event) => UsageFact::try_from(event),
        None => UsageFact::try_from(decode_event(bytes)?),
    }
}

/// As [`decode_event`], through apache-avro's `Value` and schema resolution
/// whatever the writer's version: the reference the direct path is held to
/// (`tests/roundtrip.rs`).
///
/// # Errors
///
/// As [`decode_event`].
pub fn decode_event_via_value(bytes: &[u8]) -> Result<UsageEvent, SchemaError> {
    unframe_via_value(bytes, find_usage_schema, usage_schema_version(), ("usage schema", "usage event"))
}

/// Encodes a typed event with the current schema, framed as a single object.
/// Unlike [`encode_usage`], it does not check the event against the domain.
///
/// # Errors
///
/// [`SchemaError::Encode`] if the event does not fit the current schema.
pub fn encode_event<S: Serialize>(event: &UsageEvent<S>) -> Result<Vec<u8>, SchemaError> {
    // Straight from serde through the schema (no `Value` tree, no schema
    // resolution per record): this is on every check's path. A test holds
    // it to what apache-avro writes through a value.
    let current = usage_schema_version();
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(&MARKER);
    out.extend_from_slice(&current.fingerprint.to_le_bytes());
    match fast_schema(current) {
        Some(schema) => {
            let mut config = serde_avro_fast::ser::SerializerConfig::new(schema);
            serde_avro_fast::to_datum(event, out, &mut config).map_err(|e| SchemaError::Encode(e.to_string()))
        }
        // Enum symbols are written by the Rust variant's index, which a
        // test holds to the schema's symbol order.
        None => {
            write_avro_datum_ref(&current.schema, event, &mut out).map_err(|e| SchemaError::Encode(e.to_string()))?;
            Ok(out)
        }
    }
}

/// Decodes a single-object usage event of any known schema version, resolved
/// to the current schema, without the domain's checks.
///
/// # Errors
///
/// As [`decode_usage`], except [`SchemaError::Invalid`].
pub fn decode_event(bytes: &[u8]) -> Result<UsageEvent, SchemaError> {
    unframe(bytes, find_usage_schema, usage_schema_version(), ("usage schema", "usage event"))
}

/// Writes `record` with `current`, framed as a single object, through an
/// Avro value resolved against the schema (audit entries; usage events take
/// [`encode_event`]'s direct path, which a test holds to this one).
pub(crate) fn frame<T: Serialize>(current: &SchemaVersion, record: T) -> Result<Vec<u8>, SchemaError> {
    let value =
        to_value(record).and_then(|v| v.resolve(&current.schema)).map_err(|e| SchemaError::Encode(e.to_string()))?;
    let datum = to_avro_datum(&current.schema, value).map_err(|e| SchemaError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + datum.len());
    out.extend_from_slice(&MARKER);
    out.extend_from_slice(&current.fingerprint.to_le_bytes());
    out.extend_from_slice(&datum);
    Ok(out)
}

/// Reads a single object written with any version `find` knows, resolved to
/// `current`; `what` names the schema family and the record in errors.
///
/// A datum written with `current` itself (every record a running release
/// writes) is read straight into `T` ([`fast_schema`]); one written with
/// another version goes through an Avro value and Avro's schema resolution
/// ([`unframe_via_value`]), which gives fields added since their defaults.
pub(crate) fn unframe<T: DeserializeOwned>(
    bytes: &[u8],
    find: fn(u64) -> Option<&'static SchemaVersion>,
    current: &SchemaVersion,
    what: (&str, &str),
) -> Result<T, SchemaError> {
    match read_current(bytes, find, current, what)? {
        Some(value) => Ok(value),
        None => unframe_via_value(bytes, find, current, what),
    }
}

/// [`unframe`]'s direct path: `T` read straight from a datum written with
/// `current` (its strings may borrow from `bytes`); `None` for a datum of
/// another version, or a schema the direct reader cannot parse.
fn read_current<'de, T: Deserialize<'de>>(
    bytes: &'de [u8],
    find: fn(u64) -> Option<&'static SchemaVersion>,
    current: &SchemaVersion,
    what: (&str, &str),
) -> Result<Option<T>, SchemaError> {
    let (writer, body) = writer_of(bytes, find)?;
    if writer.fingerprint != current.fingerprint {
        return Ok(None);
    }
    let Some(schema) = fast_schema(writer) else { return Ok(None) };
    let mut state = serde_avro_fast::de::DeserializerState::from_slice(body, schema);
    let value = T::deserialize(state.deserializer())
        .map_err(|e| SchemaError::Malformed(format!("as {} v{}: {e}", what.0, writer.version)))?;
    let rest = state.into_reader().fill_buf().map_or(0, <[u8]>::len);
    if rest > 0 {
        return Err(SchemaError::Malformed(format!("{rest} trailing bytes after the datum")));
    }
    Ok(Some(value))
}

/// As [`unframe`], always through an Avro value resolved to `current`: the
/// reference the direct path is held to (tests).
pub(crate) fn unframe_via_value<T: DeserializeOwned>(
    bytes: &[u8],
    find: fn(u64) -> Option<&'static SchemaVersion>,
    current: &SchemaVersion,
    what: (&str, &str),
) -> Result<T, SchemaError> {
    let (writer, body) = writer_of(bytes, find)?;
    read_via_value(bytes, body, writer, current, what)
}

/// The version a single object was written with (by its header's
/// fingerprint, among those `find` knows) and its datum.
fn writer_of(
    bytes: &[u8],
    find: fn(u64) -> Option<&'static SchemaVersion>,
) -> Result<(&'static SchemaVersion, &[u8]), SchemaError> {
    let (fingerprint, body) = split_header(bytes)?;
    Ok((find(fingerprint).ok_or(SchemaError::UnknownFingerprint(fingerprint))?, body))
}

/// Reads the single object `bytes` (its datum `body`, written with
/// `writer`) through an Avro value resolved to `current`: the path of every
/// version but the current one.
fn read_via_value<T: DeserializeOwned>(
    bytes: &[u8],
    body: &[u8],
    writer: &SchemaVersion,
    current: &SchemaVersion,
    what: (&str, &str),
) -> Result<T, SchemaError> {
    // Resolution is only needed when the writer used another version.
    let reader = (writer.fingerprint != current.fingerprint).then_some(&current.schema);
    let malformed = |e: apache_avro::Error| SchemaError::Malformed(format!("as {} v{}: {e}", what.0, writer.version));
    let (value, datum) = match prepared(writer) {
        // The writer's names resolved once, not per record.
        Some(prepared) => {
            let mut datum = Exact { rest: bytes, overrun: false };
            let value = prepared.read_value(&mut datum).map_err(malformed)?;
            let value = match reader {
                Some(current) => value.resolve(current).map_err(malformed)?,
                None => value,
            };
            (value, datum)
        }
        None => {
            let mut datum = Exact { rest: body, overrun: false };
            (from_avro_datum(&writer.schema, &mut datum, reader).map_err(malformed)?, datum)
        }
    };
    if datum.overrun {
        return Err(SchemaError::Malformed(format!("as {} v{}: the datum is cut short", what.0, writer.version)));
    }
    if !datum.rest.is_empty() {
        return Err(SchemaError::Malformed(format!("{} trailing bytes after the datum", datum.rest.len())));
    }
    from_value(&value).map_err(|e| SchemaError::Malformed(format!("does not fit the {}: {e}", what.1)))
}

/// `writer` for `serde_avro_fast`, which reads a datum straight into its
/// serde type: no `Value` tree, no map of field names per record (a
/// quarter of the embedded projector's time went to that). Parsed once per
/// version; `None` for a schema it cannot parse (the caller reads through a
/// value). It does not resolve one version to another, so it only reads a
/// datum into the type of its own version. A datum cut short fails (it
/// never reads past the end as null, unlike apache-avro's decoder, see
/// [`Exact`]).
fn fast_schema(writer: &SchemaVersion) -> Option<&'static serde_avro_fast::Schema> {
    static FAST: OnceLock<HashMap<u64, serde_avro_fast::Schema>> = OnceLock::new();
    FAST.get_or_init(|| {
        usage_schema_versions()
            .iter()
            .chain(audit_schema_versions())
            .filter_map(|v| v.source.parse::<serde_avro_fast::Schema>().ok().map(|s| (v.fingerprint, s)))
            .collect()
    })
    .get(&writer.fingerprint)
}

/// A reader of single objects written with `writer` (its header, then its
/// datum), with the schema's named types resolved once for every record it
/// reads; `None` for a schema it could not be made of (the caller decodes
/// the slow way, which reports what is wrong).
fn prepared(writer: &SchemaVersion) -> Option<&'static GenericSingleObjectReader> {
    /// The header a version's objects start with.
    struct Framed(u64);
    impl HeaderBuilder for Framed {
        fn build_header(&self) -> Vec<u8> {
            let mut header = MARKER.to_vec();
            header.extend_from_slice(&self.0.to_le_bytes());
            header
        }
    }
    static READERS: OnceLock<HashMap<u64, GenericSingleObjectReader>> = OnceLock::new();
    READERS
        .get_or_init(|| {
            usage_schema_versions()
                .iter()
                .chain(audit_schema_versions())
                .filter_map(|v| {
                    let reader =
                        GenericSingleObjectReader::new_with_header_builder(v.schema.clone(), Framed(v.fingerprint));
                    reader.ok().map(|r| (v.fingerprint, r))
                })
                .collect()
        })
        .get(&writer.fingerprint)
}

/// The datum's bytes, remembering whether the decoder asked for more than
/// there were.
///
/// Why: apache-avro 0.21 decodes a union index, a boolean or a string at the
/// end of its input as null instead of failing. A message cut short just
/// before trailing nullable fields (since v4, `estimate_tokens` and
/// `estimate_cost`) would then decode with them null: an admitted request
/// silently losing its estimate. Decoding a whole datum never reads past its
/// last byte, so any read at the end means the datum is truncated.
struct Exact<'a> {
    rest: &'a [u8],
    overrun: bool,
}

impl Read for Exact<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !buf.is_empty() && self.rest.is_empty() {
            self.overrun = true;
        }
        self.rest.read(buf)
    }
}

/// Splits a single-object message into its writer fingerprint and datum.
pub fn split_header(bytes: &[u8]) -> Result<(u64, &[u8]), SchemaError> {
    if bytes.len() < MARKER.len() || bytes[..2] != MARKER {
        return Err(SchemaError::BadMarker);
    }
    let Some((fingerprint, body)) = bytes[2..].split_first_chunk::<8>() else {
        return Err(SchemaError::Malformed(format!(
            "{} bytes is shorter than the {HEADER_LEN}-byte single-object header",
            bytes.len()
        )));
    };
    Ok((u64::from_le_bytes(*fingerprint), body))
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use meter::{ApiKeyId, EventId, EventKind, Outcome, ProjectId, ReservationId};

    use super::*;
    use crate::TokenUsage;

    fn fact() -> UsageFact {
        UsageFact {
            id: EventId::parse("e1").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            api_key_id: Some(ApiKeyId::parse("k1").expect("id")),
            agent_id: Some("agent-7".into()),
            actor_id: None,
            user_id: None,
            tokens: Vec::new(),
            storage_bytes: None,
            meter_type: None,
            occurred_at: DateTime::parse_from_rfc3339("2026-07-07T12:31:00.123456Z").expect("ts").with_timezone(&Utc),
            kind: EventKind::Call,
            outcome: Outcome::Success,
            rows: 12,
            reservation_id: Some(ReservationId::parse("r1").expect("id")),
            gateway: "gw-1".into(),
            ..UsageFact::new(
                EventId::parse("e1").expect("id"),
                ProjectId::parse("p1").expect("id"),
                EventKind::Call,
                DateTime::<Utc>::UNIX_EPOCH,
            )
        }
    }

    #[test]
    fn every_version_is_read_by_the_direct_reader() {
        // A schema serde_avro_fast could not parse would be read through a
        // value, silently slower.
        for v in usage_schema_versions().iter().chain(audit_schema_versions()) {
            assert!(fast_schema(v).is_some(), "v{} ({})", v.version, v.source.len());
        }
    }

    #[test]
    fn the_header_is_the_marker_then_the_current_fingerprint() {
        let bytes = encode_usage(&fact()).expect("encodes");
        assert_eq!(bytes[..2], MARKER);
        assert_eq!(bytes[2..10], usage_schema_version().fingerprint.to_le_bytes());
        assert_eq!(decode_usage(&bytes).expect("decodes"), fact());
    }

    #[test]
    fn every_kind_and_outcome_round_trips() {
        for kind in EventKind::ALL {
            for outcome in [Outcome::Success, Outcome::Failure] {
                let f = UsageFact { kind, outcome, ..fact() };
                assert_eq!(decode_usage(&encode_usage(&f).expect("encodes")).expect("decodes"), f);
            }
        }
    }

    #[test]
    fn sub_microseconds_are_truncated() {
        let mut f = fact();
        f.occurred_at += chrono::Duration::nanoseconds(999);
        assert_eq!(decode_usage(&encode_usage(&f).expect("encodes")).expect("decodes"), fact());
    }

    #[test]
    fn rows_beyond_an_avro_long_are_refused() {
        let f = UsageFact { rows: u64::MAX, ..fact() };
        assert!(matches!(encode_usage(&f), Err(SchemaError::Invalid { field, .. }) if field == "rows"));
    }

    #[test]
    fn a_full_event_round_trips() {
        let mut e = UsageEvent::from(&fact());
        e.kind = EventKind::Tokens;
        e.calls = 0;
        e.meter_type = Some("llm".into());
        e.storage_bytes = Some(-4096);
        e.tokens = Some(vec![
            TokenUsage {
                provider: "openai".into(),
                model: "gpt-5".into(),
                input: 1200,
                output: 300,
                cached: 1000,
                reasoning: 120,
                embedding: false,
            },
            TokenUsage {
                provider: "voyage".into(),
                model: "voyage-3".into(),
                input: 80,
                output: 0,
                cached: 0,
                reasoning: 0,
                embedding: true,
            },
        ]);
        assert_eq!(decode_event(&encode_event(&e).expect("encodes")).expect("decodes"), e);
    }

    #[test]
    fn bad_bytes_name_what_is_wrong() {
        let good = encode_usage(&fact()).expect("encodes");
        assert_eq!(decode_usage(&[]), Err(SchemaError::BadMarker));
        assert_eq!(decode_usage(&[0xC3]), Err(SchemaError::BadMarker));
        assert_eq!(decode_usage(b"{\"id\":\"e1\"}"), Err(SchemaError::BadMarker));
        assert!(matches!(decode_usage(&good[..6]), Err(SchemaError::Malformed(_))));

        let mut unknown = good.clone();
        unknown[2..10].copy_from_slice(&0x0123_4567_89ab_cdef_u64.to_le_bytes());
        let err = decode_usage(&unknown).expect_err("unknown schema");
        assert_eq!(err, SchemaError::UnknownFingerprint(0x0123_4567_89ab_cdef));
        assert_eq!(err.to_string(), "unknown writer schema fingerprint 0x0123456789abcdef");

        assert!(matches!(decode_usage(&good[..good.len() - 1]), Err(SchemaError::Malformed(_))));
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(decode_usage(&trailing), Err(SchemaError::Malformed("1 trailing bytes after the datum".into())));
    }

    #[test]
    fn no_prefix_of_a_message_decodes() {
        // The estimate's nullable longs end the datum: a cut before, between
        // or inside them must fail, not read them as null.
        let mut f = fact();
        f.kind = EventKind::Request;
        f.rows = 0;
        f.admitted = Some(true);
        f.estimate = meter::Estimate { tokens: 4096, cost: 12_288_000_000 };
        for fact in [fact(), f] {
            let good = encode_usage(&fact).expect("encodes");
            assert_eq!(decode_usage(&good).expect("decodes"), fact);
            for n in 0..good.len() {
                match decode_usage(&good[..n]) {
                    Err(SchemaError::BadMarker | SchemaError::Malformed(_)) => {}
                    other => panic!("{n} of {} bytes: {other:?}", good.len()),
                }
            }
        }
    }

    #[test]
    fn a_well_formed_datum_with_a_bad_value_is_invalid_not_malformed() {
        let mut e = UsageEvent::from(&fact());
        e.project_id = "has space".into();
        let err = decode_usage(&encode_event(&e).expect("encodes")).expect_err("bad id");
        assert_eq!(err.to_string(), "invalid project_id: may only contain letters, digits, '_', '-', '.' and ':'");
        assert_eq!(err.kind(), "invalid");
    }
}
