//! `hugepool-agent`: see `hugepool_agent::cli`.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use clap::error::ErrorKind;
use hugepool_agent::cli::{self, Cli, Command, Exit};

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
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match run(cli) {
        Ok(exit) => ExitCode::from(exit as u8),
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(Exit::Error as u8)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<Exit> {
    // One thread for the engine; kernel writes go to tokio's blocking pool.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match &cli.command {
        Command::Resize(args) => {
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
