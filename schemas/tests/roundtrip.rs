//! Encoding then decoding any valid fact gives the fact back.

use chrono::{DateTime, Utc};
use meter::{
    ApiKeyId, Counter, CounterKey, Dimension, Estimate, EventId, EventKind, LoggedBreach, MeterType, Outcome,
    ProjectId, QuotaId, ReservationId, TokenUsage, UsageFact, WindowKind,
};
use proptest::prelude::*;
use schemas::{SchemaError, decode_usage, encode_usage};

const ID: &str = "[A-Za-z0-9_.:-]{1,128}";

fn occurred_at() -> impl Strategy<Value = DateTime<Utc>> {
    prop_oneof![
        // Around now, where real events are.
        (1_700_000_000_000_000_i64..1_900_000_000_000_000),
        // Anywhere chrono can represent, to the microsecond.
        any::<i64>(),
    ]
    .prop_filter_map("representable", DateTime::from_timestamp_micros)
}

fn fact() -> impl Strategy<Value = UsageFact> {
    (
        (ID, ID, proptest::option::of(ID), proptest::option::of(ID)),
        (proptest::option::of(".*"), proptest::option::of(".*"), ".*"),
        occurred_at(),
        proptest::sample::select(EventKind::ALL.to_vec()),
        prop_oneof![Just(Outcome::Success), Just(Outcome::Failure)],
        prop_oneof![Just(0_u64), 0..1_000_u64, 0..=i64::MAX as u64],
        (
            proptest::option::of("user:[a-z0-9]{1,12}"),
            proptest::collection::vec(token_usage(), 0..3),
            proptest::option::of(any::<i64>()),
            proptest::option::of(proptest::sample::select(MeterType::ALL.to_vec())),
        ),
        v3(),
        estimate(),
    )
        .prop_map(
            |(
                (id, project, key, reservation),
                (agent, actor, gateway),
                occurred_at,
                kind,
                outcome,
                rows,
                (user_id, tokens, storage_bytes, meter_type),
                (received_at, admitted, lease_until, held, breaches, corrects, void),
                estimate,
            )| {
                UsageFact {
                    estimate,
                    received_at,
                    admitted,
                    lease_until,
                    held,
                    breaches,
                    corrects,
                    void,
                    user_id,
                    tokens,
                    storage_bytes,
                    meter_type,
                    id: EventId::parse(id).expect("id alphabet"),
                    project_id: ProjectId::parse(project).expect("id alphabet"),
                    api_key_id: key.map(|k| ApiKeyId::parse(k).expect("id alphabet")),
                    agent_id: agent,
                    actor_id: actor,
                    occurred_at,
                    kind,
                    outcome,
                    rows,
                    reservation_id: reservation.map(|r| ReservationId::parse(r).expect("id alphabet")),
                    gateway,
                }
            },
        )
}

type V3 = (
    Option<DateTime<Utc>>,
    Option<bool>,
    Option<DateTime<Utc>>,
    Vec<Counter>,
    Vec<LoggedBreach>,
    Option<EventId>,
    bool,
);

/// The fields schema v3 added.
fn v3() -> impl Strategy<Value = V3> {
    let counter = (
        prop_oneof![
            Just(Dimension::Project),
            Just(Dimension::AllApiKeys),
            ID.prop_map(|k| Dimension::ApiKey(ApiKeyId::parse(k).expect("id alphabet"))),
            "[a-z0-9_.:-]{1,12}".prop_map(Dimension::Actor),
            "[a-z0-9_.:-]{1,12}".prop_map(Dimension::Agent),
        ],
        proptest::sample::select(WindowKind::ALL.to_vec()),
        "[0-9T:-]{1,16}",
        proptest::option::of(occurred_at()),
    )
        .prop_map(|(dimension, window, window_key, resets_at)| Counter {
            key: CounterKey { dimension, window, window_key },
            resets_at,
        });
    let breach = (ID, ".{0,12}", 0..=i64::MAX as u64, 0..=i64::MAX as u64, any::<bool>()).prop_map(
        |(q, window_key, limit, observed, enforce)| LoggedBreach {
            quota_id: QuotaId::parse(q).expect("id alphabet"),
            window_key,
            limit,
            observed,
            enforce,
        },
    );
    (
        proptest::option::of(occurred_at()),
        proptest::option::of(any::<bool>()),
        proptest::option::of(occurred_at()),
        proptest::collection::vec(counter, 0..3),
        proptest::collection::vec(breach, 0..3),
        proptest::option::of(ID.prop_map(|e| EventId::parse(e).expect("id alphabet"))),
        any::<bool>(),
    )
}

/// One component of the check's estimate: zero (written as null), a usual
/// amount, or anything an Avro `long` holds.
fn estimate_component() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0_u64), 1..1_000_000_u64, 0..=i64::MAX as u64]
}

/// The field schema v4 added.
fn estimate() -> impl Strategy<Value = Estimate> {
    (estimate_component(), estimate_component()).prop_map(|(tokens, cost)| Estimate { tokens, cost })
}

fn token_usage() -> impl Strategy<Value = TokenUsage> {
    (".{1,20}", ".{1,20}", 0..=i64::MAX as u64, 0..1_000_000_u64, 0..1_000_000_u64, 0..1_000_000_u64, any::<bool>())
        .prop_map(|(provider, model, input, output, cached, reasoning, embedding)| TokenUsage {
            provider,
            model,
            input,
            output,
            cached,
            reasoning,
            embedding,
        })
}

/// The bytes apache-avro writes for `fact` through a `Value` resolved
/// against the current schema: the reference the direct encoder must match.
fn encoded_via_value(fact: &UsageFact) -> Vec<u8> {
    let current = schemas::usage_schema_version();
    let value = apache_avro::to_value(schemas::UsageEvent::from(fact))
        .and_then(|v| v.resolve(&current.schema))
        .expect("a fact's event fits the schema");
    let datum = apache_avro::to_avro_datum(&current.schema, value).expect("a resolved value encodes");
    let mut out = schemas::single_object::MARKER.to_vec();
    out.extend_from_slice(&current.fingerprint.to_le_bytes());
    out.extend_from_slice(&datum);
    out
}

/// The direct encoder writes enum symbols by the Rust variant's index: the
/// schema must list them in the same order.
#[test]
fn enum_variants_are_in_the_schemas_symbol_order() {
    let apache_avro::Schema::Record(record) = &schemas::usage_schema_version().schema else {
        panic!("the usage schema is a record");
    };
    let symbols = |field: &str| -> Vec<String> {
        let f = record.fields.iter().find(|f| f.name == field).expect("field in the schema");
        match &f.schema {
            apache_avro::Schema::Enum(e) => e.symbols.clone(),
            other => panic!("{field} is an enum, not {other:?}"),
        }
    };
    let kinds: Vec<String> = EventKind::ALL.iter().map(|k| k.as_str().to_owned()).collect();
    assert_eq!(symbols("kind"), kinds);
    let outcomes: Vec<String> = Outcome::ALL.iter().map(|o| o.as_str().to_owned()).collect();
    assert_eq!(symbols("outcome"), outcomes);
}

proptest! {
    #[test]
    fn the_direct_encoder_writes_what_the_value_path_writes(fact in fact()) {
        prop_assume!(i64::try_from(fact.rows).is_ok());
        prop_assert_eq!(encode_usage(&fact).expect("encodes"), encoded_via_value(&fact));
    }

    #[test]
    fn encode_then_decode_is_identity(fact in fact()) {
        let bytes = encode_usage(&fact).expect("a valid fact encodes");
        prop_assert_eq!(decode_usage(&bytes).expect("its bytes decode"), fact);
    }

    #[test]
    fn an_estimate_beyond_an_avro_long_saturates_instead_of_failing(
        fact in fact(),
        tokens in (i64::MAX as u64 + 1)..=u64::MAX,
        cost in estimate_component(),
    ) {
        let fact = UsageFact { estimate: Estimate { tokens, cost }, ..fact };
        let bytes = encode_usage(&fact).expect("a valid fact encodes");
        let decoded = decode_usage(&bytes).expect("its bytes decode");
        prop_assert_eq!(decoded.estimate, Estimate { tokens: i64::MAX as u64, cost });
        prop_assert_eq!(UsageFact { estimate: fact.estimate, ..decoded }, fact);
    }

    #[test]
    fn the_direct_decoder_reads_what_the_value_path_reads(fact in fact(), flip in any::<(usize, u8)>(), cut in any::<usize>()) {
        // The current version's records are read straight into the event
        // (and into the fact, strings borrowed), any other through an Avro
        // value: both must agree on every record,
        // on one with a byte changed, and on one cut short (but for a long
        // too large for 64 bits, which only the direct reader refuses).
        let good = encode_usage(&fact).expect("a valid fact encodes");
        let mut changed = good.clone();
        let at = schemas::single_object::HEADER_LEN + flip.0 % (good.len() - schemas::single_object::HEADER_LEN);
        changed[at] ^= flip.1.max(1);
        let short = &good[..schemas::single_object::HEADER_LEN + cut % (good.len() - schemas::single_object::HEADER_LEN)];
        for bytes in [&good[..], &changed[..], short] {
            let direct = schemas::decode_event(bytes);
            let via_value = schemas::decode_event_via_value(bytes);
            match (&direct, &via_value) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                // apache-avro reads a long's tenth byte past the 64th bit
                // and drops what overflows; the direct reader refuses it.
                (Err(SchemaError::Malformed(why)), Ok(_)) if why.contains("varint") => {}
                _ => prop_assert!(false, "{:02x?}: direct {:?}, via a value {:?}", bytes, direct, via_value),
            }
            // The fact, read with its strings borrowed from the bytes.
            let direct = decode_usage(bytes);
            let via_value = schemas::decode_event_via_value(bytes).and_then(UsageFact::try_from);
            match (&direct, &via_value) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (Err(SchemaError::Malformed(why)), Ok(_)) if why.contains("varint") => {}
                _ => prop_assert!(false, "{:02x?}: direct {:?}, via a value {:?}", bytes, direct, via_value),
            }
        }
    }

    #[test]
    fn any_bytes_give_a_result_not_a_panic(tail in proptest::collection::vec(any::<u8>(), 0..64)) {
        // A known header followed by garbage exercises the datum decoder.
        let mut bytes = vec![0xC3, 0x01];
        bytes.extend(schemas::usage_schema_version().fingerprint.to_le_bytes());
        bytes.extend(tail);
        let _ = decode_usage(&bytes);
        let _ = schemas::decode_audit(&bytes);
    }
}
