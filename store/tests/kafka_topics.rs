//! The topics Tollgate creates carry an explicit retention (issue 9, item
//! 7): the usage topic forever by default (a replay rebuilds from offset 0;
//! a broker's default of 7 days would leave it nothing older), each topic
//! as configured, read back from the broker with the admin client's
//! DescribeConfigs. tansu 0.6 keeps the configuration a topic was created
//! with and answers DescribeConfigs with it.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use store::{KafkaConfig, Retention};

/// `retention.ms` of each topic, as the broker describes it.
async fn retention_ms(brokers: &str, topics: &[String]) -> Vec<Option<String>> {
    let admin: AdminClient<DefaultClientContext> =
        rdkafka::ClientConfig::new().set("bootstrap.servers", brokers).create().expect("admin client");
    let specs: Vec<ResourceSpecifier<'_>> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let described = admin.describe_configs(&specs, &opts).await.expect("describe configs");
    described
        .into_iter()
        .map(|r| r.expect("a topic's configs").get("retention.ms").and_then(|e| e.value.clone()))
        .collect()
}

#[tokio::test]
async fn created_topics_carry_their_retention() {
    testkit::require!(Kafka);
    let brokers = testkit::env::kafka();
    let defaults = KafkaConfig::new(&brokers, testkit::topic_prefix("tg-topics"));
    defaults.ensure_topics().await.expect("create topics");
    let names = [defaults.usage_topic(), defaults.dlq_topic(), defaults.audit_topic()];
    let got = retention_ms(&brokers, &names).await;
    let want = [Some("-1".to_owned()), Some("-1".to_owned()), Some("-1".to_owned())];
    assert_eq!(got, want, "usage, dlq and audit kept forever by default");

    let mut custom = KafkaConfig::new(&brokers, testkit::topic_prefix("tg-topics"));
    custom.usage_retention = "90days".parse().expect("a retention");
    custom.dlq_retention = Retention::For(Duration::from_secs(3600));
    custom.audit_retention = Retention::For(Duration::from_secs(400 * 86_400));
    custom.ensure_topics().await.expect("create topics");
    // Again: an existing topic is left as it is, without an error.
    custom.ensure_topics().await.expect("topics exist");
    let names = [custom.usage_topic(), custom.dlq_topic(), custom.audit_topic()];
    let got = retention_ms(&brokers, &names).await;
    let want =
        [Some((90u64 * 86_400_000).to_string()), Some("3600000".to_owned()), Some((400u64 * 86_400_000).to_string())];
    assert_eq!(got, want, "each topic as configured");
}

#[test]
fn retention_reads_forever_or_a_positive_duration() {
    assert_eq!("forever".parse::<Retention>(), Ok(Retention::Forever));
    assert_eq!(" Forever ".parse::<Retention>(), Ok(Retention::Forever));
    assert_eq!("400days".parse::<Retention>(), Ok(Retention::For(Duration::from_secs(400 * 86_400))));
    assert_eq!("12h".parse::<Retention>(), Ok(Retention::For(Duration::from_secs(12 * 3600))));
    for bad in ["", "0s", "-1", "never", "7 fortnights"] {
        assert!(bad.parse::<Retention>().is_err(), "{bad:?} must be refused");
    }
    assert_eq!(Retention::Forever.retention_ms(), "-1");
    assert_eq!(Retention::For(Duration::from_millis(1500)).retention_ms(), "1500");
}
