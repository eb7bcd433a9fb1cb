//! `kubectl hugepool`: status of pools and nodes, what applying a pool would
//! do, why a node or a pod is where it is, and whether the install works.
//! Reads only (the plan's dry run stores nothing).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use hugepool_operator::plugin;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// See, plan and check hugepool's hugepage pools: status of pools and
/// nodes, what applying a pool would do, why a node or a pod is where it
/// is, and whether the install works.
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
    /// Namespace of `why pod/NAME` (default: the context's); for `check`,
    /// where the install is (default: any namespace).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// Only pools with these labels (`status`, `top`, `check`), e.g. team=net.
    #[arg(short = 'l', long, global = true)]
    selector: Option<String>,
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
    /// Pools at a glance (Available and its reason, the rollout); with
    /// POOL, its nodes too.
    Status {
        /// One pool.
        pool: Option<String>,
        /// Print again whenever the status changes, until interrupted.
        #[arg(short, long)]
        watch: bool,
        /// With --watch: stop after printing this many times.
        #[arg(long, requires = "watch")]
        updates: Option<u64>,
    },
    /// What applying the pool in FILE would do: which nodes change, in which
    /// waves of maxUnavailable, which need a drain, which conflict.
    Plan {
        /// The HugePagePool manifest (YAML or JSON; - for standard input).
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
    },
    /// NODE: a node's taints, conditions, last resizes, recent Events and
    /// the pods holding its pages. pod/NAME: why a pod requesting
    /// hugepages-<size> is Pending.
    Why {
        /// NODE, node/NAME or pod/NAME.
        target: String,
    },
    /// Where huge page memory sits reserved with no pod requesting it:
    /// pools, then nodes, by allocated less requested memory, with what is
    /// allocated, requested by pods bound to the node, and in use.
    Top,
    /// Waits until every node POOL selects holds its pages (exit 0); exits 1
    /// at once, with the reason, when the rollout ended otherwise (no node
    /// selected, nodes failed or not answering, a conflict), and 2 when
    /// TIMEOUT passes first.
    Wait {
        pool: String,
        /// How long to wait at most (e.g. 90s, 10m).
        #[arg(long, default_value = "10m", value_parser = parse_duration)]
        timeout: std::time::Duration,
    },
    /// Whether the install works: CRDs served, the operator leading, an
    /// agent reporting on every selected node, versions matching. Exits 1
    /// when a check fails.
    Check,
}

/// The client, and the kubeconfig context's namespace.
async fn client(cli: &Cli) -> anyhow::Result<(kube::Client, String)> {
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
    let namespace = config.default_namespace.clone();
    let client = kube::Client::try_from(config).context("building the Kubernetes client")?;
    Ok((client, namespace))
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
    let (client, context_namespace) = client(&cli).await?;
    let selector = cli.selector.as_deref();
    match &cli.command {
        Command::Status {
            pool, watch: false, ..
        } => {
            let rows = plugin::status(&client, pool.as_deref(), selector).await?;
            print(cli.output, &rows, || {
                plugin::render_status(&rows, pool.is_some())
            })
        }
        Command::Status {
            pool,
            watch: true,
            updates,
        } => {
            let mut printed = 0u64;
            let mut failed = None;
            plugin::watch_status(
                &client,
                pool.as_deref(),
                selector,
                std::time::Duration::from_millis(200),
                interrupted(),
                |rows| {
                    if printed > 0 && matches!(cli.output, Output::Text) {
                        println!();
                    }
                    let shown = match cli.output {
                        Output::Json => serde_json::to_string(rows).map(|json| println!("{json}")),
                        Output::Text => {
                            print!("{}", plugin::render_status(rows, pool.is_some()));
                            Ok(())
                        }
                    };
                    // Each update reaches a pipe at once.
                    let _ = std::io::Write::flush(&mut std::io::stdout());
                    if let Err(err) = shown {
                        failed = Some(err);
                        return false;
                    }
                    printed += 1;
                    updates.is_none_or(|limit| printed < limit)
                },
            )
            .await?;
            match failed {
                Some(err) => Err(err.into()),
                None => Ok(()),
            }
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
        Command::Why { target } => match target.split_once('/') {
            Some(("pod" | "pods" | "po", name)) => {
                let namespace = cli.namespace.as_deref().unwrap_or(&context_namespace);
                let report = plugin::why_pod(&client, namespace, name).await?;
                print(cli.output, &report, || plugin::render_why_pod(&report))
            }
            Some(("node" | "nodes" | "no", name)) | Some(("", name)) => {
                let report = plugin::why(&client, name).await?;
                print(cli.output, &report, || plugin::render_why(&report))
            }
            Some((kind, _)) => anyhow::bail!("why explains a node or pod/NAME, not a {kind}"),
            None => {
                let report = plugin::why(&client, target).await?;
                print(cli.output, &report, || plugin::render_why(&report))
            }
        },
        Command::Top => {
            let report = plugin::top(&client, selector).await?;
            print(cli.output, &report, || plugin::render_top(&report))
        }
        Command::Wait { pool, timeout } => {
            use plugin::wait::Settled;
            match plugin::wait::wait(&client, pool, *timeout).await? {
                Settled::Done(message) => {
                    println!("{pool}: every selected node holds its pages ({message})");
                    Ok(())
                }
                Settled::Failed { reason, message } => {
                    eprintln!("{pool}: the rollout ended without every node: {reason}: {message}");
                    std::process::exit(1);
                }
                Settled::Waiting(last) => {
                    eprintln!("{pool}: not done after {timeout:?}: {last}");
                    std::process::exit(2);
                }
            }
        }
        Command::Check => {
            let report = plugin::check(&client, cli.namespace.as_deref(), selector).await?;
            print(cli.output, &report, || plugin::render_check(&report))?;
            if !report.passed() {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

/// A duration as the pools spell them (`90s`, `10m`, `1h`).
fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    hugepool_crds::duration::parse(text).map_err(|err| err.to_string())
}

/// Resolves on Ctrl-C or SIGTERM. The handlers are in place when this
/// returns, before the future is first polled (a signal between the
/// first print and the first wait must not kill the process).
fn interrupted() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).ok();
    let mut terminate = signal(SignalKind::terminate()).ok();
    async move {
        let interrupt = async {
            match &mut interrupt {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        let terminate = async {
            match &mut terminate {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate => {}
        }
    }
}
