//! `hugepool-agent`: see `hugepool_agent::cli`.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use clap::error::ErrorKind;
use hugepool_agent::agent::{self, Shared};
use hugepool_agent::cli::{self, Cli, Command, Exit, KernelArgs, LogFormat, RunArgs};
use prometheus_client::registry::Registry;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err)
            if matches!(
                err.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) =>
        {
            let _ = err.print();
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("{}", cli::one_line_error(&err.render().to_string()));
            return ExitCode::from(Exit::Error as u8);
        }
    };
    init_logging(&cli.command);
    match run(cli) {
        Ok(exit) => ExitCode::from(exit as u8),
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(Exit::Error as u8)
        }
    }
}

fn init_logging(command: &Command) {
    // `resize` prints its own progress; `run` logs at info by default.
    match command {
        Command::Resize(_) => hugepool_runtime::init_logging(LogFormat::Text, "warn"),
        Command::Run(args) => hugepool_runtime::init_logging(args.log_format, "info"),
        Command::Boot(_) => hugepool_runtime::init_logging(LogFormat::Text, "warn"),
    }
}

fn run(cli: Cli) -> anyhow::Result<Exit> {
    match &cli.command {
        Command::Run(args) => {
            // The cluster agent serves HTTP and watches while kernel writes run.
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            runtime.block_on(run_agent(&cli.kernel, args))?;
            Ok(Exit::Reached)
        }
        Command::Boot(args) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let kernel = Arc::new(cli.kernel.sysfs());
            let mut stdout = std::io::stdout();
            Ok(runtime.block_on(cli::boot(args, kernel, &mut stdout))?)
        }
        Command::Resize(args) => {
            // One thread for the engine; kernel writes go to tokio's blocking pool.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let kernel = Arc::new(cli.kernel.sysfs());
            let mut stdout = std::io::stdout();
            Ok(runtime.block_on(cli::resize(
                args,
                kernel,
                Some(cli.kernel.kmsg.clone()),
                &mut stdout,
            ))?)
        }
    }
}

/// `hugepool-agent run`: until SIGTERM or SIGINT, then a last status, exit 0.
async fn run_agent(kernel_args: &KernelArgs, args: &RunArgs) -> anyhow::Result<()> {
    let config = args.config(kernel_args);
    let kernel: Arc<dyn hugepool_agent::kernel::Kernel> = Arc::new(kernel_args.sysfs());
    let mut registry = Registry::default();
    let shared = Shared::with_liveness_timeout(
        agent::metrics::Metrics::register(&mut registry),
        args.liveness_timeout,
    );
    // Waiting for the writer lock is no wedged loop either.
    shared.liveness.idle_for(std::time::Duration::MAX);
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let (bound, _server) = hugepool_runtime::serve(
        args.metrics_addr,
        Arc::new(agent::server::AgentProbes {
            registry: Arc::new(registry),
            ready: Arc::clone(&shared.ready),
            liveness: Arc::clone(&shared.liveness),
        }),
        // Served until the process exits: the last status is written after
        // the signal, and probes may come meanwhile.
        std::future::pending(),
    )
    .await?;
    tracing::info!(node = %config.node_name, metrics = %bound, "hugepool agent starting");
    let client = hugepool_runtime::kube_client().await?;
    tokio::spawn(async move {
        hugepool_runtime::shutdown_signal().await;
        tracing::info!("signal received; finishing the write in flight");
        let _ = shutdown_tx.send(true);
    });
    // Held until this process exits: one writer of this node's pools.
    let _lock = match &args.writer_lock {
        Some(path) => {
            let path = path.clone();
            let stop = shutdown_rx.clone();
            let lock = tokio::task::spawn_blocking(move || {
                agent::writer_lock::acquire(
                    &path,
                    std::time::Duration::from_millis(200),
                    || tracing::info!(lock = %path.display(), "another agent holds the writer lock; waiting for it to exit"),
                    || *stop.borrow(),
                )
            })
            .await??;
            match lock {
                Some(lock) => {
                    tracing::info!(lock = %lock.path.display(), "writer lock held");
                    Some(lock)
                }
                None => return Ok(()),
            }
        }
        None => None,
    };
    agent::run(client, kernel, config, shared, shutdown_rx).await?;
    Ok(())
}
