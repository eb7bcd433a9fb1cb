//! `kubectl hugepool`: status of pools and nodes, what applying a pool would
//! do, and why a node is where it is. Reads only (the plan's dry run stores
//! nothing).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use hugepool_operator::plugin;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// See and plan hugepool's hugepage pools: status of pools and nodes, what
/// applying a pool would do, and why a node is where it is.
#[derive(Parser, Debug)]
#[command(name = "kubectl-hugepool", bin_name = "kubectl hugepool", version)]
struct Cli {
    /// Path of the kubeconfig file (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Pools at a glance; with POOL, its nodes too.
    Status {
        /// One pool.
        pool: Option<String>,
    },
    /// What applying the pool in FILE would do: which nodes change, in which
    /// waves of maxUnavailable, which need a drain, which conflict.
    Plan {
        /// The HugePagePool manifest (YAML or JSON; - for standard input).
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
    },
    /// A node's conditions, last resizes, recent Events and the pods holding its pages.
    Why { node: String },
}

async fn client(cli: &Cli) -> anyhow::Result<kube::Client> {
    let options = KubeConfigOptions {
        context: cli.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &cli.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options).await?
        }
        None => kube::Config::from_kubeconfig(&options)
            .await
            .context("reading the kubeconfig (KUBECONFIG or ~/.kube/config)")?,
    };
    kube::Client::try_from(config).context("building the Kubernetes client")
}

fn print(
    output: Output,
    value: &impl serde::Serialize,
    text: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
        Output::Text => print!("{}", text()),
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let client = client(&cli).await?;
    match &cli.command {
        Command::Status { pool } => {
            let rows = plugin::status(&client, pool.as_deref()).await?;
            print(cli.output, &rows, || {
                plugin::render_status(&rows, pool.is_some())
            })
        }
        Command::Plan { file } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading standard input")?
            } else {
                std::fs::read_to_string(file)
                    .with_context(|| format!("reading {}", file.display()))?
            };
            let pool = plugin::dry_run_pool(&client, &file.display().to_string(), &text).await?;
            let report = plugin::plan_pool(&client, &pool).await?;
            print(cli.output, &report, || plugin::render_plan(&report))
        }
        Command::Why { node } => {
            let report = plugin::why(&client, node).await?;
            print(cli.output, &report, || plugin::render_why(&report))
        }
    }
}
