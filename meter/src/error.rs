//! The error types every part of `meter` and its adapters share.
//!
//! Three kinds of "no": a caller's input refused ([`FieldError`], which
//! names the field), a name outside a closed set ([`UnknownName`], what a
//! `FromStr` of one of `meter`'s enums answers), and an adapter failure
//! ([`PortError`], which says once, where it is converted, whether retrying
//! can help).

/// A refusal of a caller's input, naming the field it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError { field: field.into(), message: message.into() }
    }

    /// The same refusal about a field nested under `prefix` (`events[3].`).
    pub fn under(self, prefix: &str) -> Self {
        FieldError { field: format!("{prefix}{}", self.field), message: self.message }
    }
}

/// A string that is none of the names of a closed set (a metric, a window…).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be one of {}; got {value:?}", allowed.join(", "))]
pub struct UnknownName {
    /// What the set is called (`metric`).
    pub what: &'static str,
    pub value: String,
    pub allowed: Vec<&'static str>,
}

impl UnknownName {
    pub fn new(what: &'static str, value: &str, allowed: impl IntoIterator<Item = &'static str>) -> Self {
        UnknownName { what, value: value.to_owned(), allowed: allowed.into_iter().collect() }
    }

    /// As a refusal of `field`.
    pub fn field(self, field: impl Into<String>) -> FieldError {
        FieldError::new(field, self.to_string())
    }
}

/// `Display` and `FromStr` (with [`UnknownName`]) for an enum with an
/// `as_str`, parsing the names of the variants listed.
macro_rules! named {
    ($t:ident, $what:literal, $all:expr) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $t {
            type Err = $crate::error::UnknownName;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $all.into_iter()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| $crate::error::UnknownName::new($what, s, $all.iter().map(|v| v.as_str())))
            }
        }
    };
}
pub(crate) use named;

/// An adapter failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    /// Worth retrying: a connection dropped, a broker is electing, a timeout.
    #[error("transient: {0}")]
    Transient(String),
    /// Retrying will not help: bad configuration, a schema mismatch, a bug.
    #[error("permanent: {0}")]
    Permanent(String),
    /// A uniqueness rule was hit (a duplicate quota identity, for instance).
    #[error("conflict: {0}")]
    Conflict(String),
    /// Another writer moved the offsets this batch started from.
    #[error("fenced: {0}")]
    Fenced(String),
}

impl PortError {
    pub fn is_transient(&self) -> bool {
        matches!(self, PortError::Transient(_))
    }
}

pub type PortResult<T> = Result<T, PortError>;
