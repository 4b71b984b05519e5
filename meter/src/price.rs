//! Money and the price book.
//!
//! Money is never a float. Every amount is a whole number of picodollars
//! (10⁻¹² USD) in an `i64`: a price per token such as $0.01875 per million
//! tokens (1.875 × 10⁻⁸ USD) is 18,750 picodollars, so quantity × price is
//! exact and sums of costs are exact. Decimal strings are parsed and printed
//! with `rust_decimal`; a value with more than 12 decimal places is refused
//! rather than rounded. The largest amount is about $9.2 million
//! (`i64::MAX` picodollars); sums saturate there.
//!
//! A price applies per (provider, model, component) from its `effective_from`
//! on; an event is priced by the price in effect at its event time.
//!
//! The book is **append-only in time**: every row is a version recorded at
//! some instant (the store sets it when the row is put), and a fold prices
//! a fact only with the versions recorded at or before the fact's receipt
//! ([`PriceBook::price_as_of`], [`price_tokens_as_of`]). So a price put
//! later, even one with an earlier `effective_from` or one replacing a row
//! of the same key and `effective_from`, never re-prices what was received
//! before it: the live fold and a replay from offset 0 price every event
//! alike, to the last picodollar, however late either runs. A book built
//! from plain [`Price`] rows ([`PriceBook::new`]) holds them as known since
//! always, which is what a lookup without a receipt time
//! ([`PriceBook::price_at`]) reads: the current book.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::{FieldError, named};

/// Picodollars per dollar.
pub const PICOS_PER_USD: i64 = 1_000_000_000_000;
/// Decimal places an amount may carry.
pub const USD_SCALE: u32 = 12;

/// An amount of US dollars, in picodollars.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Usd(pub i64);

impl Usd {
    pub const ZERO: Usd = Usd(0);

    pub fn picos(self) -> i64 {
        self.0
    }

    /// Whole dollars.
    pub fn from_dollars(d: i64) -> Option<Usd> {
        d.checked_mul(PICOS_PER_USD).map(Usd)
    }

    /// Parses a decimal string of dollars ("2.50", "0.000000018750").
    pub fn parse(s: &str) -> Result<Usd, String> {
        let d = Decimal::from_str_exact(s.trim()).map_err(|_| format!("{s:?} is not a decimal number"))?;
        Usd::from_decimal(d)
    }

    pub fn from_decimal(d: Decimal) -> Result<Usd, String> {
        let d = d.normalize();
        if d.scale() > USD_SCALE {
            return Err(format!("{d} has more than {USD_SCALE} decimal places"));
        }
        let picos = d
            .checked_mul(Decimal::from(PICOS_PER_USD))
            .and_then(|p| i64::try_from(p).ok())
            .ok_or_else(|| format!("{d} is too large"))?;
        Ok(Usd(picos))
    }

    pub fn to_decimal(self) -> Decimal {
        Decimal::from_i128_with_scale(i128::from(self.0), USD_SCALE).normalize()
    }

    pub fn saturating_add(self, other: Usd) -> Usd {
        Usd(self.0.saturating_add(other.0))
    }
}

impl fmt::Display for Usd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_decimal())
    }
}

impl FromStr for Usd {
    type Err = String;
    fn from_str(s: &str) -> Result<Usd, String> {
        Usd::parse(s)
    }
}

impl TryFrom<String> for Usd {
    type Error = String;
    fn try_from(s: String) -> Result<Usd, String> {
        Usd::parse(&s)
    }
}

impl From<Usd> for String {
    fn from(u: Usd) -> String {
        u.to_string()
    }
}

/// A priced component of token usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    /// Uncached input (prompt) tokens.
    InputTokens,
    OutputTokens,
    /// Input tokens served from the provider's cache.
    CachedTokens,
}

impl Component {
    pub const ALL: [Component; 3] = [Component::InputTokens, Component::OutputTokens, Component::CachedTokens];
    pub fn as_str(self) -> &'static str {
        match self {
            Component::InputTokens => "input_tokens",
            Component::OutputTokens => "output_tokens",
            Component::CachedTokens => "cached_tokens",
        }
    }
}

named!(Component, "component", Component::ALL);

/// What a price is for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PriceKey {
    pub provider: String,
    pub model: String,
    pub component: Component,
}

/// One row of the price book: a unit price from a moment on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Price {
    #[serde(flatten)]
    pub key: PriceKey,
    /// Dollars per unit (one token).
    pub unit_price_usd: Usd,
    pub effective_from: DateTime<Utc>,
}

/// Most characters of a provider or model name.
pub const MAX_NAME: usize = 200;

/// Checks a provider or model name.
pub fn check_name(field: &str, s: &str) -> Result<(), FieldError> {
    if s.is_empty() || s.len() > MAX_NAME || s.chars().any(char::is_control) {
        return Err(FieldError::new(field, format!("must be 1-{MAX_NAME} printable characters")));
    }
    Ok(())
}

/// Checks a price the way the API does.
pub fn check_price(p: &Price) -> Result<(), FieldError> {
    check_name("provider", &p.key.provider)?;
    check_name("model", &p.key.model)?;
    if p.unit_price_usd.0 < 0 {
        return Err(FieldError::new("unit_price_usd", "must not be negative"));
    }
    Ok(())
}

/// One version of a row of the price book: the price, and when the book
/// learnt it (the store records it at [`put_prices`](crate::PriceStore::put_prices)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceVersion {
    #[serde(flatten)]
    pub price: Price,
    pub recorded_at: DateTime<Utc>,
}

/// One version of one key's row, as the book keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    effective_from: DateTime<Utc>,
    recorded_at: DateTime<Utc>,
    unit: Usd,
}

/// Prices by key, each key's versions ordered by (`effective_from`,
/// `recorded_at`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PriceBook {
    rows: BTreeMap<PriceKey, Vec<Row>>,
}

impl PriceBook {
    /// A book of rows known since always (as if recorded at the dawn of
    /// time): the current book, as the gateway reads it.
    pub fn new(prices: impl IntoIterator<Item = Price>) -> PriceBook {
        let mut book = PriceBook::default();
        for p in prices {
            book.insert(p);
        }
        book
    }

    /// A book of versions, each known from its `recorded_at`.
    pub fn with_versions(versions: impl IntoIterator<Item = PriceVersion>) -> PriceBook {
        let mut book = PriceBook::default();
        for v in versions {
            book.insert_version(v.price, v.recorded_at);
        }
        book
    }

    /// Adds a row known since always; a row with the same key and
    /// `effective_from` (known since always too) is replaced.
    pub fn insert(&mut self, p: Price) {
        self.insert_version(p, DateTime::<Utc>::MIN_UTC);
    }

    /// Adds a version of a row recorded at `recorded_at`; a version of the
    /// same key, `effective_from` and `recorded_at` is replaced.
    pub fn insert_version(&mut self, p: Price, recorded_at: DateTime<Utc>) {
        let rows = self.rows.entry(p.key).or_default();
        let at = (p.effective_from, recorded_at);
        match rows.binary_search_by(|r| (r.effective_from, r.recorded_at).cmp(&at)) {
            Ok(i) => rows[i].unit = p.unit_price_usd,
            Err(i) => rows.insert(i, Row { effective_from: p.effective_from, recorded_at, unit: p.unit_price_usd }),
        }
    }

    /// The unit price in effect at `at` in the current book (every version
    /// known), if any row covers it.
    pub fn price_at(&self, key: &PriceKey, at: DateTime<Utc>) -> Option<Usd> {
        self.price_as_of(key, at, DateTime::<Utc>::MAX_UTC)
    }

    /// The unit price in effect at `at` as the book stood at `known`: the
    /// row with the latest `effective_from` at or before `at` among the
    /// versions recorded at or before `known`, and of that row the latest
    /// such version.
    pub fn price_as_of(&self, key: &PriceKey, at: DateTime<Utc>, known: DateTime<Utc>) -> Option<Usd> {
        // Ordered by (effective_from, recorded_at): the last match is it.
        let rows = self.rows.get(key)?;
        rows.iter().rev().find(|r| r.effective_from <= at && r.recorded_at <= known).map(|r| r.unit)
    }

    /// The current book: of each (key, `effective_from`) its latest
    /// version, ordered by key then `effective_from`.
    pub fn prices(&self) -> impl Iterator<Item = Price> + '_ {
        self.rows.iter().flat_map(|(k, rows)| {
            rows.iter()
                .enumerate()
                .filter(|(i, r)| rows.get(i + 1).is_none_or(|next| next.effective_from != r.effective_from))
                .map(|(_, r)| Price { key: k.clone(), unit_price_usd: r.unit, effective_from: r.effective_from })
        })
    }

    /// Every version, ordered by key, `effective_from`, then `recorded_at`.
    pub fn versions(&self) -> impl Iterator<Item = PriceVersion> + '_ {
        self.rows.iter().flat_map(|(k, rows)| {
            rows.iter().map(|r| PriceVersion {
                price: Price { key: k.clone(), unit_price_usd: r.unit, effective_from: r.effective_from },
                recorded_at: r.recorded_at,
            })
        })
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// The meters a `cost_usd` quota can name. `llm_tokens` is the AI meter; the
/// others are platform meters, priced by the operator and never part of the
/// unpriced verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MeterType {
    LlmTokens,
    ComputeExecution,
    ApiRequest,
    Storage,
}

impl MeterType {
    pub const ALL: [MeterType; 4] =
        [MeterType::LlmTokens, MeterType::ComputeExecution, MeterType::ApiRequest, MeterType::Storage];
    pub fn as_str(self) -> &'static str {
        match self {
            MeterType::LlmTokens => "llm_tokens",
            MeterType::ComputeExecution => "compute_execution",
            MeterType::ApiRequest => "api_request",
            MeterType::Storage => "storage",
        }
    }
}

named!(MeterType, "meter type", MeterType::ALL);

/// Tokens used from one model of one provider, as an event reports them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct TokenUsage {
    pub provider: String,
    pub model: String,
    /// Uncached input tokens.
    #[serde(default)]
    pub input: u64,
    #[serde(default)]
    pub output: u64,
    /// Input tokens served from the provider's cache.
    #[serde(default)]
    pub cached: u64,
    /// Reasoning tokens: a detail, never billed or priced.
    #[serde(default)]
    pub reasoning: u64,
    /// Embedding tokens: priced into the cost, held out of the unpriced verdict.
    #[serde(default)]
    pub embedding: bool,
}

impl TokenUsage {
    fn components(&self) -> [(Component, u64); 3] {
        [
            (Component::InputTokens, self.input),
            (Component::OutputTokens, self.output),
            (Component::CachedTokens, self.cached),
        ]
    }

    /// Billable tokens: input + output + cached (never reasoning).
    pub fn billable(&self) -> u64 {
        self.input.saturating_add(self.output).saturating_add(self.cached)
    }
}

/// What pricing one tokens event found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Priced {
    pub meter: Option<MeterType>,
    /// Billable tokens (AI meter only).
    pub tokens: u64,
    /// The priced cost (the sum of the priced components).
    pub cost: Usd,
    /// Whether the event is a metered LLM event for the unpriced verdict:
    /// on the AI meter, not only embeddings, with a billable quantity.
    pub llm_event: bool,
    /// An LLM event with at least one priced (non-embedding) component.
    pub llm_priced: bool,
    /// An LLM event with at least one unpriced (non-embedding) component.
    pub llm_unpriced: bool,
    /// The distinct (provider, model, component) the verdict reads as unpriced.
    pub unpriced_rows: BTreeSet<PriceKey>,
}

/// Prices one event's token usage at its event time, by the current book.
pub fn price_tokens(usage: &[TokenUsage], meter: MeterType, at: DateTime<Utc>, book: &PriceBook) -> Priced {
    price_tokens_as_of(usage, meter, at, DateTime::<Utc>::MAX_UTC, book)
}

/// Prices one event's token usage at its event time `at`, by the book as it
/// stood at `known` (the event's receipt: see [`PriceBook::price_as_of`]).
pub fn price_tokens_as_of(
    usage: &[TokenUsage],
    meter: MeterType,
    at: DateTime<Utc>,
    known: DateTime<Utc>,
    book: &PriceBook,
) -> Priced {
    let ai = meter == MeterType::LlmTokens;
    let mut out = Priced { meter: Some(meter), ..Priced::default() };
    if ai {
        out.tokens = usage.iter().fold(0u64, |acc, u| acc.saturating_add(u.billable()));
    }
    // One pricing of each component, shared with the usage breakdown.
    for c in component_usage_as_of(usage, meter, at, known, book) {
        out.cost = out.cost.saturating_add(c.cost);
        if !ai || c.embedding {
            continue;
        }
        out.llm_event = true;
        if c.priced_quantity > 0 {
            out.llm_priced = true;
        } else {
            out.llm_unpriced = true;
            out.unpriced_rows.insert(c.key);
        }
    }
    out
}

/// One priced-or-not component of a tokens event, for the usage breakdown
/// by (provider, model, component): priced and unpriced quantities apart.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComponentUsage {
    pub key: PriceKey,
    pub meter: MeterType,
    pub embedding: bool,
    pub priced_quantity: u64,
    pub unpriced_quantity: u64,
    /// The cost of the priced quantity.
    pub cost: Usd,
}

/// Breaks one event's token usage down by (provider, model, component),
/// priced at its event time by the current book. Components that measured
/// zero are left out; reasoning tokens are never priced and never listed.
pub fn component_usage(
    usage: &[TokenUsage],
    meter: MeterType,
    at: DateTime<Utc>,
    book: &PriceBook,
) -> Vec<ComponentUsage> {
    component_usage_as_of(usage, meter, at, DateTime::<Utc>::MAX_UTC, book)
}

/// [`component_usage`] by the book as it stood at `known` (the event's
/// receipt). A component's cost saturates at the largest amount.
pub fn component_usage_as_of(
    usage: &[TokenUsage],
    meter: MeterType,
    at: DateTime<Utc>,
    known: DateTime<Utc>,
    book: &PriceBook,
) -> Vec<ComponentUsage> {
    let mut out = Vec::new();
    for u in usage {
        for (component, qty) in u.components() {
            if qty == 0 {
                continue;
            }
            let key = PriceKey { provider: u.provider.clone(), model: u.model.clone(), component };
            let row = match book.price_as_of(&key, at, known) {
                Some(unit) => ComponentUsage {
                    cost: Usd(i64::try_from(i128::from(qty) * i128::from(unit.0)).unwrap_or(i64::MAX)),
                    key,
                    meter,
                    embedding: u.embedding,
                    priced_quantity: qty,
                    unpriced_quantity: 0,
                },
                None => ComponentUsage {
                    key,
                    meter,
                    embedding: u.embedding,
                    priced_quantity: 0,
                    unpriced_quantity: qty,
                    cost: Usd::ZERO,
                },
            };
            out.push(row);
        }
    }
    out
}

/// Whether a window's LLM events make a blackout: at least 3 metered, none priced.
pub fn is_blackout(llm_events: u64, llm_priced_events: u64) -> bool {
    llm_events >= BLACKOUT_EVENTS && llm_priced_events == 0
}

/// LLM events a window needs, none of them priced, to be a blackout.
pub const BLACKOUT_EVENTS: u64 = 3;
/// Most `unpriced_rows` a refusal or an exception lists.
pub const MAX_UNPRICED_ROWS: usize = 10;

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc)
    }

    fn key(model: &str, c: Component) -> PriceKey {
        PriceKey { provider: "openai".into(), model: model.into(), component: c }
    }

    #[test]
    fn usd_parses_exactly_and_refuses_what_it_cannot_hold() {
        assert_eq!(Usd::parse("2.50"), Ok(Usd(2_500_000_000_000)));
        assert_eq!(Usd::parse("0.000000018750"), Ok(Usd(18_750)));
        assert_eq!(Usd::parse("0.000000000001"), Ok(Usd(1)));
        assert!(Usd::parse("0.0000000000001").is_err(), "13 places");
        assert!(Usd::parse("1e3").is_err());
        assert!(Usd::parse("abc").is_err());
        assert!(Usd::parse("99999999").is_err(), "beyond i64 picodollars");
        assert_eq!(Usd(2_500_000_000_000).to_string(), "2.5");
        assert_eq!(Usd(18_750).to_string(), "0.00000001875");
        assert_eq!(Usd(0).to_string(), "0");
        assert_eq!(Usd::from_dollars(25), Some(Usd(25 * PICOS_PER_USD)));
    }

    #[test]
    fn the_price_in_effect_at_the_event_time_applies() {
        let k = key("gpt-4o", Component::InputTokens);
        let book = PriceBook::new([
            Price { key: k.clone(), unit_price_usd: Usd(2_500_000), effective_from: utc("2026-01-01T00:00:00Z") },
            Price { key: k.clone(), unit_price_usd: Usd(2_000_000), effective_from: utc("2026-07-01T00:00:00Z") },
        ]);
        assert_eq!(book.price_at(&k, utc("2025-12-31T23:59:59Z")), None);
        assert_eq!(book.price_at(&k, utc("2026-01-01T00:00:00Z")), Some(Usd(2_500_000)));
        assert_eq!(book.price_at(&k, utc("2026-06-30T23:59:59Z")), Some(Usd(2_500_000)));
        assert_eq!(book.price_at(&k, utc("2026-07-01T00:00:00Z")), Some(Usd(2_000_000)));
        assert_eq!(book.price_at(&key("gpt-4o", Component::OutputTokens), utc("2026-08-01T00:00:00Z")), None);
    }

    #[test]
    fn a_version_prices_only_what_was_received_after_it_was_recorded() {
        let k = key("gpt-4o", Component::InputTokens);
        let p = |picos, from| Price { key: k.clone(), unit_price_usd: Usd(picos), effective_from: utc(from) };
        let mut book = PriceBook::default();
        // Recorded on 1 March, in effect from 1 January.
        book.insert_version(p(10, "2026-01-01T00:00:00Z"), utc("2026-03-01T00:00:00Z"));
        // A back-dated row put on 1 May, in effect from 1 February.
        book.insert_version(p(20, "2026-02-01T00:00:00Z"), utc("2026-05-01T00:00:00Z"));
        // The January row replaced on 1 June.
        book.insert_version(p(30, "2026-01-01T00:00:00Z"), utc("2026-06-01T00:00:00Z"));

        let jan = utc("2026-01-15T00:00:00Z");
        let feb = utc("2026-02-15T00:00:00Z");
        // Received before anything was recorded: unpriced, however late it is folded.
        assert_eq!(book.price_as_of(&k, feb, utc("2026-02-20T00:00:00Z")), None);
        // Received in April: the book of April, which had no February row yet.
        assert_eq!(book.price_as_of(&k, feb, utc("2026-04-01T00:00:00Z")), Some(Usd(10)));
        assert_eq!(book.price_as_of(&k, feb, utc("2026-05-01T00:00:00Z")), Some(Usd(20)), "recorded at the receipt");
        // The replacement re-prices nothing received before it.
        assert_eq!(book.price_as_of(&k, jan, utc("2026-05-31T23:59:59Z")), Some(Usd(10)));
        assert_eq!(book.price_as_of(&k, jan, utc("2026-06-01T00:00:00Z")), Some(Usd(30)));
        // The current book: the latest of each row.
        assert_eq!(book.price_at(&k, jan), Some(Usd(30)));
        assert_eq!(book.price_at(&k, feb), Some(Usd(20)));
        let current: Vec<(i64, DateTime<Utc>)> =
            book.prices().map(|p| (p.unit_price_usd.0, p.effective_from)).collect();
        assert_eq!(current, [(30, utc("2026-01-01T00:00:00Z")), (20, utc("2026-02-01T00:00:00Z"))]);
        assert_eq!(book.versions().count(), 3);
        assert_eq!(PriceBook::with_versions(book.versions()), book);

        // Rows known since always price whatever the receipt.
        let plain = PriceBook::new([p(5, "2026-01-01T00:00:00Z")]);
        assert_eq!(plain.price_as_of(&k, jan, utc("2026-01-15T00:00:00Z")), Some(Usd(5)));
        let usage = [TokenUsage { provider: "openai".into(), model: "gpt-4o".into(), input: 3, ..Default::default() }];
        let early = price_tokens_as_of(&usage, MeterType::LlmTokens, feb, utc("2026-04-01T00:00:00Z"), &book);
        let late = price_tokens_as_of(&usage, MeterType::LlmTokens, feb, utc("2026-07-01T00:00:00Z"), &book);
        assert_eq!((early.cost, late.cost), (Usd(30), Usd(60)));
        assert_eq!(price_tokens(&usage, MeterType::LlmTokens, feb, &book).cost, Usd(60), "the current book");
    }

    #[test]
    fn a_cost_saturates_at_the_largest_amount() {
        let k = key("gpt-4o", Component::InputTokens);
        let book = PriceBook::new([Price {
            key: k,
            unit_price_usd: Usd(PICOS_PER_USD),
            effective_from: utc("2026-01-01T00:00:00Z"),
        }]);
        let big =
            TokenUsage { provider: "openai".into(), model: "gpt-4o".into(), input: 1 << 53, ..Default::default() };
        let p = price_tokens(&[big.clone(), big], MeterType::LlmTokens, utc("2026-07-07T12:00:00Z"), &book);
        assert_eq!(p.cost, Usd(i64::MAX), "2^54 tokens at $1: far past $9.2M, held at it");
    }

    #[test]
    fn pricing_keeps_priced_and_unpriced_apart() {
        let at = utc("2026-07-07T12:00:00Z");
        let book = PriceBook::new([Price {
            key: key("gpt-4o", Component::InputTokens),
            unit_price_usd: Usd(2_500_000),
            effective_from: utc("2026-01-01T00:00:00Z"),
        }]);
        let usage = [TokenUsage {
            provider: "openai".into(),
            model: "gpt-4o".into(),
            input: 1000,
            output: 200,
            cached: 0,
            reasoning: 50,
            embedding: false,
        }];
        let p = price_tokens(&usage, MeterType::LlmTokens, at, &book);
        assert_eq!(p.tokens, 1200, "reasoning is not billable");
        assert_eq!(p.cost, Usd(2_500_000_000), "1000 × $0.0000025 = $0.0025");
        assert!(p.llm_event && p.llm_priced && p.llm_unpriced);
        assert_eq!(p.unpriced_rows.into_iter().collect::<Vec<_>>(), vec![key("gpt-4o", Component::OutputTokens)]);

        // Embeddings: priced into the cost if a price exists, never in the verdict.
        let emb = [TokenUsage {
            provider: "openai".into(),
            model: "te-3".into(),
            input: 10,
            embedding: true,
            ..Default::default()
        }];
        let p = price_tokens(&emb, MeterType::LlmTokens, at, &book);
        assert!(!p.llm_event && p.unpriced_rows.is_empty());
        assert_eq!(p.tokens, 10);

        // A platform meter: cost only, no tokens, no verdict.
        let p = price_tokens(&usage, MeterType::ComputeExecution, at, &book);
        assert_eq!((p.tokens, p.cost, p.llm_event), (0, Usd(2_500_000_000), false));
    }

    #[test]
    fn the_breakdown_adds_up_to_the_priced_cost() {
        let at = utc("2026-07-07T12:00:00Z");
        let book = PriceBook::new([Price {
            key: key("gpt-4o", Component::InputTokens),
            unit_price_usd: Usd(2_500_000),
            effective_from: utc("2026-01-01T00:00:00Z"),
        }]);
        let usage = [TokenUsage {
            provider: "openai".into(),
            model: "gpt-4o".into(),
            input: 1000,
            output: 200,
            cached: 0,
            reasoning: 9,
            embedding: false,
        }];
        let rows = component_usage(&usage, MeterType::LlmTokens, at, &book);
        assert_eq!(rows.len(), 2, "input and output; cached measured zero, reasoning is never listed");
        assert_eq!((rows[0].priced_quantity, rows[0].unpriced_quantity, rows[0].cost), (1000, 0, Usd(2_500_000_000)));
        assert_eq!((rows[1].priced_quantity, rows[1].unpriced_quantity, rows[1].cost), (0, 200, Usd::ZERO));
        let total = rows.iter().fold(Usd::ZERO, |a, r| a.saturating_add(r.cost));
        assert_eq!(total, price_tokens(&usage, MeterType::LlmTokens, at, &book).cost);
    }

    #[test]
    fn blackout_needs_three_events_and_none_priced() {
        assert!(!is_blackout(2, 0));
        assert!(is_blackout(3, 0));
        assert!(!is_blackout(3, 1));
        assert!(!is_blackout(0, 0));
    }
}
