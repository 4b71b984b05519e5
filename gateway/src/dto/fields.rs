//! The field types request bodies are made of, each refusing a wrong value
//! with the message the API has always given for it ("must be a string",
//! "must be a whole number ≥ 0"…), and containers ([`Object`], [`List`])
//! that refuse what is not an object or a list without losing the path to
//! the field inside them.
//!
//! The scalars read the value as JSON first (strings and numbers only ever
//! cost what the value itself costs) and then decide, so every wrong type
//! gets one clear message rather than serde's "invalid type: …, expected …".
//! `null` is absence, as it always was: a field of type `Option<Text>` is
//! `None` for a missing field and for `null` alike; a field that must tell
//! them apart (a declarative entry's `scope_ref`) uses [`nullable`].

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, de::value::MapAccessDeserializer};
use serde_json::Value;

fn refuse<E: de::Error>(message: &'static str) -> E {
    E::custom(message)
}

/// A string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Text(s)),
            _ => Err(refuse("must be a string")),
        }
    }
}

/// A whole number ≥ 0 that fits in PostgreSQL's `bigint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count(pub u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Number(n) => match n.as_u64() {
                Some(v) if v <= i64::MAX as u64 => Ok(Count(v)),
                _ => Err(refuse("must be a whole number ≥ 0")),
            },
            _ => Err(refuse("must be a number")),
        }
    }
}

/// A whole number, of either sign (a storage delta).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Whole(pub i64);

impl<'de> Deserialize<'de> for Whole {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)?.as_i64() {
            Some(v) => Ok(Whole(v)),
            None => Err(refuse("must be a whole number")),
        }
    }
}

/// `true` or `false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag(pub bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Bool(b) => Ok(Flag(b)),
            _ => Err(refuse("must be true or false")),
        }
    }
}

/// A quota limit as written: a whole number, or a decimal (a string, or a
/// JSON number with a fraction, taken as its shortest decimal form; only
/// `cost_usd` accepts one, and it is never computed with as a float).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitValue {
    Whole(i64),
    Decimal(String),
}

impl<'de> Deserialize<'de> for LimitValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Number(n) => match n.as_i64() {
                Some(v) => Ok(LimitValue::Whole(v)),
                None if n.is_f64() => Ok(LimitValue::Decimal(n.to_string())),
                None => Err(refuse("is too large")),
            },
            Value::String(s) => Ok(LimitValue::Decimal(s)),
            _ => Err(refuse("must be a number")),
        }
    }
}

/// An amount of dollars as written: a decimal string, or a JSON number
/// taken as the decimal it was written as (never computed with as a float).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecimalText(pub String);

impl<'de> Deserialize<'de> for DecimalText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) => Ok(DecimalText(s)),
            Value::Number(n) => Ok(DecimalText(n.to_string())),
            _ => Err(refuse("must be a decimal string")),
        }
    }
}

/// For a field that tells absence from `null` (use with
/// `#[serde(default, deserialize_with = "nullable")]`): `None` when
/// missing, `Some(None)` for `null`, `Some(Some(s))` for a string.
pub fn nullable<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    match Value::deserialize(d)? {
        Value::Null => Ok(Some(None)),
        Value::String(s) => Ok(Some(Some(s))),
        _ => Err(refuse("must be a string or null")),
    }
}

/// A JSON object read as `T`. A derived struct would also take a JSON array
/// (its fields by position); an object is the only shape the API accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object<T>(pub T);

impl<'de, T: DeserializeOwned> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: DeserializeOwned> Visitor<'de> for V<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map)).map(Object)
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

/// A JSON list of objects, each read as `T`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct List<T>(pub Vec<T>);

impl<'de, T: DeserializeOwned> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: DeserializeOwned> Visitor<'de> for V<T> {
            type Value = List<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List<T>, A::Error> {
                // Capped: a hostile size hint must not reserve the memory.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(Object(item)) = seq.next_element::<Object<T>>()? {
                    out.push(item);
                }
                Ok(List(out))
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
}
