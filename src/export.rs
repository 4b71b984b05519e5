//! `tollgate export`: one run of a billing export (issue 11), for one
//! project or all, written to a file or to a directory laid out
//! `project=<id>/period=<billing period>/part-<run>.<ext>`, with a progress
//! bar (rows, bytes, rate). Runs of the same project, period and dimensions
//! are runs of the same export: each writes only what was folded since the
//! ones before (see [`gateway::service::exports`]).
//!
//! `--verify` then counts the log: it folds the usage topic from offset 0
//! up to the run's watermark into a shadow (a PostgreSQL schema, or a file
//! beside the embedded store) with the projector's own fold, and compares
//! every line's sum over all runs of the export with it. Any difference is
//! printed and the exit status is 1; it is recorded on the run.
//!
//! Exit status: 0 when every run is complete (and verified, if asked), 1
//! when one failed or differs, 2 when one stopped at a bound (`partial`:
//! the next run writes the rest).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use gateway::service::exports::{ExportRequest, Output, reconcile, run_export};
use gateway::state::SystemClock;
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use meter::export::{CustomerKind, ExportRun, ExportSpec, Format, Grace, RunStatus};
use meter::{Clock, ExportStore, Principal, ProjectId, TenantStore, WindowKind};
use store::sql::Backend;
use store::{KafkaReader, PgStore, SqlStore, SqliteStore};

use crate::Backends;

#[derive(Args)]
pub struct ExportArgs {
    #[command(flatten)]
    backends: Backends,
    /// Export the embedded store of `tollgate dev` in this directory
    /// instead of PostgreSQL (and, with `--verify`, its embedded log).
    #[arg(long, env = "TOLLGATE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The project's id, or `all` (then `--out` is a directory).
    #[arg(long)]
    project: String,
    /// The billing period: `day` or `calendar_month`, in the project's zone.
    #[arg(long, default_value = "calendar_month")]
    period: String,
    /// The customer dimensions, comma-separated: project, api_key, actor, agent, user.
    #[arg(long, value_delimiter = ',', default_value = "project")]
    dimensions: Vec<String>,
    /// `csv`, `jsonl` or `parquet`; by default the `--out` file's extension, else csv.
    #[arg(long)]
    format: Option<String>,
    /// A file, or a directory (one that exists, or a path ending in `/`).
    #[arg(long)]
    out: PathBuf,
    /// How long after a period ends its usage may still arrive before it closes (at most 72h).
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    grace: Duration,
    /// Most rows a run writes; past them it stops, marked ROWS.
    #[arg(long, env = "TOLLGATE_EXPORT_MAX_ROWS", default_value_t = 10_000_000)]
    max_rows: u64,
    /// How long a run may write; past it it stops, marked TIME.
    #[arg(long, env = "TOLLGATE_EXPORT_MAX_TIME", default_value = "10m", value_parser = humantime::parse_duration)]
    max_time: Duration,
    /// How many customers of a charge period it reads at once (what bounds its memory).
    #[arg(long, env = "TOLLGATE_EXPORT_SLICE", default_value_t = gateway::service::exports::SLICE as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    slice: u32,
    /// Fold the log up to the run's watermark and compare every line with it.
    #[arg(long)]
    verify: bool,
    /// The projector's consumer name (whose fold is exported).
    #[arg(long, env = "TOLLGATE_CONSUMER", default_value = "tollgate-projector")]
    consumer: String,
    /// The PostgreSQL schema `--verify` folds the log into (dropped and created afresh).
    #[arg(long, default_value = "tollgate_verify")]
    verify_schema: String,
}

impl ExportArgs {
    fn format(&self) -> anyhow::Result<Format> {
        match (&self.format, self.out.extension().and_then(|e| e.to_str())) {
            (Some(f), _) => f.parse::<Format>().map_err(anyhow::Error::msg).context("--format"),
            (None, Some(ext)) => Ok(ext.parse::<Format>().unwrap_or(Format::Csv)),
            (None, None) => Ok(Format::Csv),
        }
    }

    fn output(&self) -> Output {
        if self.out.is_dir() || self.out.as_os_str().to_string_lossy().ends_with('/') {
            Output::Dir(self.out.clone())
        } else {
            Output::File(self.out.clone())
        }
    }

    fn specs(&self, projects: Vec<ProjectId>) -> anyhow::Result<Vec<ExportSpec>> {
        let period = match self.period.as_str() {
            "day" => WindowKind::Day,
            "calendar_month" => WindowKind::CalendarMonth,
            p => bail!("--period must be day or calendar_month, not {p:?}"),
        };
        let mut dims = BTreeSet::new();
        for d in &self.dimensions {
            dims.insert(d.parse::<CustomerKind>().map_err(anyhow::Error::msg).context("--dimensions")?);
        }
        let grace = Grace::new(self.grace).map_err(|e| anyhow::anyhow!("--grace {}", e.message))?;
        projects
            .into_iter()
            .map(|p| ExportSpec::new(p, period, dims.clone(), grace).map_err(|e| anyhow::anyhow!("--{e}")))
            .collect()
    }
}

/// Runs the export; `Ok(status)` is the exit status.
pub async fn run(args: ExportArgs) -> anyhow::Result<i32> {
    match args.data_dir.clone() {
        Some(dir) => {
            let path = dir.join("tollgate.db");
            if !path.exists() {
                bail!("{} does not exist (is {} the data directory of `tollgate dev`?)", path.display(), dir.display());
            }
            let live = SqliteStore::open(&path).await.with_context(|| format!("opening {}", path.display()))?;
            live.migrate().await.context("migrating the embedded store")?;
            let log = gateway::embedded::open_log(&path)
                .await
                .with_context(|| format!("opening the log beside {}", path.display()))?;
            let topic = log.usage_topic().to_owned();
            let verify = async |target: &std::collections::BTreeMap<i32, i64>| {
                let shadow_path = dir.join("tollgate-verify.db");
                let shadow = SqliteStore::create_shadow_file(&shadow_path)
                    .await
                    .with_context(|| format!("creating {}", shadow_path.display()))?;
                crate::replay::fold_log(&live, shadow, log.reader(), &args.consumer, &topic, target).await
            };
            export_all(&args, &live, &topic, verify).await
        }
        None => {
            let b = &args.backends;
            let live = b.store().await?;
            let kafka = b.kafka();
            let topic = kafka.usage_topic();
            let verify = async |target: &std::collections::BTreeMap<i32, i64>| {
                let shadow = PgStore::create_shadow_schema(&b.db.database_url, &args.verify_schema)
                    .await
                    .with_context(|| format!("creating the schema {}", args.verify_schema))?;
                let reader = KafkaReader::new(&kafka, &format!("{}-verify", args.consumer))
                    .context("creating the Kafka consumer")?;
                crate::replay::fold_log(&live, shadow, reader, &args.consumer, &topic, target).await
            };
            export_all(&args, &live, &topic, verify).await
        }
    }
}

async fn export_all<B, F>(args: &ExportArgs, live: &SqlStore<B>, topic: &str, verify: F) -> anyhow::Result<i32>
where
    B: Backend,
    F: AsyncFn(&std::collections::BTreeMap<i32, i64>) -> anyhow::Result<(SqlStore<B>, u64)>,
{
    let format = args.format()?;
    let out = args.output();
    let projects = if args.project == "all" {
        if !matches!(out, Output::Dir(_)) {
            bail!("--project all writes one file per project and period: give --out a directory (ending in /)");
        }
        live.projects().await?.into_iter().map(|p| p.id).collect()
    } else {
        vec![ProjectId::parse(args.project.clone()).map_err(|e| anyhow::anyhow!("--project: {e}"))?]
    };
    let mut status = 0;
    for spec in args.specs(projects)? {
        let req = ExportRequest {
            spec: spec.clone(),
            format,
            out: out.clone(),
            max_rows: args.max_rows,
            max_time: args.max_time,
            slice: args.slice as usize,
            consumer: args.consumer.clone(),
            topic: topic.to_owned(),
            principal: Some(Principal::new("admin", "cli")),
            schedule_id: None,
        };
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed_precise} {pos} rows · {per_sec} · {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(format!("{}", spec.project_id));
        bar.enable_steady_tick(Duration::from_millis(200));
        let progress = |rows: u64, bytes: u64| {
            bar.set_position(rows);
            bar.set_message(format!("{} · {}", spec.project_id, HumanBytes(bytes)));
        };
        let run = run_export(live, live, &SystemClock, &req, &progress).await?;
        bar.finish_and_clear();
        print_run(&run);
        status = status.max(match run.status {
            RunStatus::Complete => 0,
            RunStatus::Partial => 2,
            RunStatus::Failed | RunStatus::Running => 1,
        });
        if run.reconciliation.as_ref().is_some_and(|r| !r.ok()) {
            status = 1;
        }
        if args.verify && run.status == RunStatus::Complete {
            let (shadow, records) = verify(&run.watermark).await.context("folding the log to verify")?;
            let tz = live.project(&spec.project_id).await?.map(|p| p.timezone).context("the project is gone")?;
            let mut cut = shadow.fold_cut().await?;
            let check = reconcile(live, cut.as_mut(), &spec, tz, run.started_at, args.slice as usize).await?;
            cut.close().await?;
            let mut r = run.reconciliation.clone().unwrap_or_default();
            println!(
                "verify: {records} records of the log folded to the watermark; {} lines compared, {} differ",
                check.lines, check.differing
            );
            for d in &check.differences {
                println!("  DIFFERS {d}");
            }
            if !check.ok() {
                status = 1;
            }
            r.log = Some(check);
            live.set_reconciliation(&run.id, &r, SystemClock.now()).await?;
        }
    }
    Ok(status)
}

fn print_run(run: &ExportRun) {
    println!(
        "{} {} ({}): {} rows, {} in {} — watermark {}",
        run.id,
        run.status.as_str(),
        run.spec.key(),
        run.rows,
        HumanBytes(run.bytes),
        run.file.as_deref().unwrap_or("-"),
        run.watermark_text()
    );
    if let Some(m) = run.mark {
        println!("  stopped at {}: the next run of this export writes the rest", m.as_str());
    }
    if let Some(e) = &run.error {
        println!("  failed: {e}");
    }
    if let Some(r) = &run.reconciliation {
        println!("  reconciled with the fold: {} lines, {} differ", r.fold.lines, r.fold.differing);
        for d in &r.fold.differences {
            println!("  DIFFERS {d}");
        }
    }
}
