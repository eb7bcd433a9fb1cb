//! The `hugepool-agent` command line. `resize` moves one pool to a target
//! without a cluster, for operators and benchmarks; `run` is the cluster
//! agent of the DaemonSet.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use hugepool_crds::PageSize;
use serde::Serialize;
use tokio::sync::watch;

use crate::kernel::kmsg::{self, KernelLogEvent};
use crate::kernel::{Kernel, PoolScope, SysfsKernel};
use crate::resize::model_file;
use crate::resize::{self, Event, Options, Outcome, Settings, ShortfallReason, Summary, Target};
use crate::{Error, Result};

#[derive(Debug, Parser)]
#[command(
    name = "hugepool-agent",
    version,
    about = "Sizes this node's hugetlb pools in budgeted kernel writes"
)]
pub struct Cli {
    #[command(flatten)]
    pub kernel: KernelArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Where the kernel's files are (a container mounts the host's there).
#[derive(Debug, Args)]
pub struct KernelArgs {
    /// Root of sysfs.
    #[arg(long, global = true, default_value = "/sys", env = "HUGEPOOL_SYS_ROOT")]
    pub sys_root: PathBuf,
    /// Root of procfs.
    #[arg(
        long,
        global = true,
        default_value = "/proc",
        env = "HUGEPOOL_PROC_ROOT"
    )]
    pub proc_root: PathBuf,
    /// The kernel log device watched for lockups during a resize.
    #[arg(
        long,
        global = true,
        default_value = "/dev/kmsg",
        env = "HUGEPOOL_KMSG"
    )]
    pub kmsg: PathBuf,
}

impl KernelArgs {
    pub fn sysfs(&self) -> SysfsKernel {
        SysfsKernel::new(&self.sys_root, &self.proc_root)
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Move one size's pool to a number of pages in budgeted writes.
    Resize(ResizeArgs),
    /// Run as the node agent: converge this node's HugePageNode and report.
    /// (Boxed: its flags outweigh the other commands'.)
    Run(Box<RunArgs>),
    /// Before the kubelet starts (a systemd unit): apply the targets the
    /// agent last converged to, from its boot file.
    Boot(BootArgs),
}

#[derive(Debug, Args)]
pub struct BootArgs {
    /// The file `run --boot-file` keeps (on the host).
    #[arg(long, value_name = "PATH", default_value_os_t = crate::boot::default_path())]
    pub boot_file: PathBuf,
    /// Refuse a file written for another node (default: this host's name).
    #[arg(long)]
    pub node_name: Option<String>,
}

/// `hugepool-agent boot`: applies the boot file; Reached when every pool is
/// at its target, Short when one is not, Error when the file cannot be read.
/// A missing file (a node that never converged) applies nothing.
pub async fn boot(
    args: &BootArgs,
    kernel: Arc<dyn Kernel>,
    out: &mut (dyn Write + Send),
) -> Result<Exit> {
    let say = |out: &mut (dyn Write + Send), line: String| {
        writeln!(out, "{line}").map_err(|source| Error::Write {
            path: PathBuf::from("stdout"),
            value: "boot report".into(),
            source,
        })
    };
    if !args.boot_file.exists() {
        say(
            out,
            format!(
                "{}: no boot file; nothing to apply",
                args.boot_file.display()
            ),
        )?;
        return Ok(Exit::Reached);
    }
    let node = args.node_name.clone().or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_lowercase())
    });
    let targets = crate::boot::load(&args.boot_file, node.as_deref())?;
    let applied = crate::boot::apply(kernel, &targets).await?;
    let mut exit = Exit::Reached;
    for pool in applied {
        if !pool.reached {
            exit = Exit::Short;
        }
        say(out, pool.line)?;
    }
    Ok(exit)
}

pub use hugepool_runtime::LogFormat;

/// A command line, split as a POSIX shell would (quotes and backslashes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandLine(pub Vec<String>);

fn parse_command(text: &str) -> std::result::Result<CommandLine, String> {
    shlex::split(text)
        .map(CommandLine)
        .ok_or_else(|| format!("unbalanced quotes or a trailing backslash in {text:?}"))
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// This node's name (from the downward API in the DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "[::]:9478", env = "HUGEPOOL_METRICS_ADDR")]
    pub metrics_addr: std::net::SocketAddr,
    /// Command that restarts kubelet (`kubeletRestart: AfterResize`), split
    /// as a shell would (quote an argument with spaces); empty disables
    /// restarts.
    #[arg(
        long,
        default_value = "nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart kubelet",
        env = "HUGEPOOL_KUBELET_RESTART_COMMAND",
        value_parser = parse_command
    )]
    pub kubelet_restart_command: CommandLine,
    /// Command that prints the kubelet's recent log, split as a shell would;
    /// a restart that fails names the last error in it. Empty: none.
    #[arg(
        long,
        default_value = "nsenter --target 1 --mount --uts --ipc --net --pid -- journalctl --unit kubelet --lines 200 --no-pager --output cat",
        env = "HUGEPOOL_KUBELET_LOG_COMMAND",
        value_parser = parse_command
    )]
    pub kubelet_log_command: CommandLine,
    /// How long the kubelet-restart command may run before it is killed and
    /// counted as failed (failures are retried with backoff).
    #[arg(long, default_value = "2m", value_parser = hugepool_runtime::duration_arg)]
    pub kubelet_restart_timeout: Duration,
    /// How long the kubelet has, once the restart command returned, to
    /// report the pools on its Node; past it the restart counts as failed.
    #[arg(long, default_value = "2m", value_parser = hugepool_runtime::duration_arg)]
    pub kubelet_ready_timeout: Duration,
    /// The kubelet's root directory as the agent sees it (the chart:
    /// /var/lib/kubelet mounted at /host/var/lib/kubelet). With a Static
    /// Memory Manager its checkpoint is removed before a restart, and a
    /// restart waits while pods hold memory in it.
    #[arg(long, value_name = "PATH", env = "HUGEPOOL_KUBELET_ROOT_DIR")]
    pub kubelet_root_dir: Option<PathBuf>,
    /// Do not watch the kernel log for lockups.
    #[arg(long)]
    pub no_kmsg: bool,
    /// A file on the host to hold an exclusive lock on before writing any
    /// pool, so that two agents on one node never write at once (the chart
    /// sets it; a DaemonSet update overlaps the old and the new pod).
    #[arg(long, env = "HUGEPOOL_WRITER_LOCK")]
    pub writer_lock: Option<PathBuf>,
    /// How often a blocked shrink is re-checked.
    #[arg(long, default_value = "2s", value_parser = hugepool_runtime::duration_arg)]
    pub blocked_poll: Duration,
    /// How long after a shortfall growth is tried again.
    #[arg(long, default_value = "5m", value_parser = hugepool_runtime::duration_arg)]
    pub retry_interval: Duration,
    /// `/healthz` fails (and the kubelet restarts the agent) once the resize
    /// loop has not come round for this long outside a wait it announced.
    #[arg(long, default_value = "5m", value_parser = hugepool_runtime::duration_arg)]
    pub liveness_timeout: Duration,
    /// How often the kernel is re-read for status when nothing happens.
    #[arg(long, default_value = "15s", value_parser = hugepool_runtime::duration_arg)]
    pub refresh_interval: Duration,
    #[arg(long, value_enum, default_value = "text", env = "HUGEPOOL_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Keep the fitted write-cost models in this file (the chart: a hostPath
    /// under /run/hugepool): read at start, written after every resize.
    #[arg(long, value_name = "PATH")]
    pub model_file: Option<PathBuf>,
    /// Keep the targets each time the node converges in this file on the
    /// host, for `hugepool-agent boot` before the kubelet starts after a
    /// reboot (the chart: agent.bootFile).
    #[arg(long, value_name = "PATH", env = "HUGEPOOL_BOOT_FILE")]
    pub boot_file: Option<PathBuf>,
    /// Where the cgroup file system is, whose pod cgroups' hugetlb limits
    /// say what the node's pods request (default: `<sys-root>/fs/cgroup`).
    #[arg(long, value_name = "PATH", env = "HUGEPOOL_CGROUP_ROOT")]
    pub cgroup_root: Option<PathBuf>,
    /// Publish the node's ResourceSlice (driver hugepages.hugepool.dev) for
    /// pools consumed through Dynamic Resource Allocation, and delete it
    /// when there are none (the chart: dra.enabled; Kubernetes 1.36 or
    /// later). Without it such pools are sized but not claimable.
    #[arg(long, env = "HUGEPOOL_RESOURCE_SLICES")]
    pub resource_slices: bool,
    /// Serve the kubelet plugin of driver hugepages.hugepool.dev: its DRA
    /// socket and the prepared claims under --kubelet-plugins-dir (the chart
    /// mounts it at the kubelet's own path, which the kubelet dials), each
    /// prepared claim's CDI spec in --cdi-dir. Its registration is
    /// hugepool-hooks' (--kubelet-registry-dir).
    #[arg(long, env = "HUGEPOOL_KUBELET_PLUGIN")]
    pub kubelet_plugin: bool,
    #[arg(long, value_name = "PATH", default_value = "/var/lib/kubelet/plugins")]
    pub kubelet_plugins_dir: PathBuf,
    /// Where the kubelet plugin writes each prepared claim's CDI spec (a
    /// directory the container runtime reads CDI specs from).
    #[arg(long, value_name = "PATH", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
}

impl RunArgs {
    pub fn config(&self, kernel: &KernelArgs) -> crate::agent::AgentConfig {
        let mut config = crate::agent::AgentConfig::new(&self.node_name);
        config.kernel_release = crate::kernel::release();
        config.blocked_poll = self.blocked_poll;
        config.retry_interval = self.retry_interval;
        config.refresh_interval = self.refresh_interval;
        config.kubelet_restart_command = self.kubelet_restart_command.0.clone();
        config.kubelet_log_command = self.kubelet_log_command.0.clone();
        config.kubelet_restart_timeout = self.kubelet_restart_timeout;
        config.kubelet_ready_timeout = self.kubelet_ready_timeout;
        config.kubelet_root_dir = self
            .kubelet_root_dir
            .clone()
            .map(crate::kubelet_state::KubeletRootDir);
        config.kmsg_path = (!self.no_kmsg).then(|| kernel.kmsg.clone());
        config.model_file = self.model_file.clone();
        config.boot_file = self.boot_file.clone();
        config.resource_slices = self.resource_slices;
        config.kubelet_plugin = self.kubelet_plugin.then(|| crate::dra::PluginDirs {
            plugins: self.kubelet_plugins_dir.clone(),
            cdi: self.cdi_dir.clone(),
        });
        config.pod_cgroups = Some(
            self.cgroup_root
                .clone()
                .unwrap_or_else(|| kernel.sys_root.join("fs/cgroup")),
        );
        config
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct ResizeArgs {
    /// Page size, as in the API: 2Mi, 1Gi.
    #[arg(long, value_name = "SIZE", value_parser = parse_page_size)]
    pub page_size: PageSize,
    /// Target number of persistent pages.
    #[arg(long, value_name = "N", allow_hyphen_values = true, value_parser = parse_count)]
    pub pages: u64,
    /// Target one NUMA node's pool (its own nr_hugepages file).
    #[arg(long, value_name = "ID", allow_hyphen_values = true, value_parser = parse_node)]
    pub numa_node: Option<u32>,
    /// Time budget of one kernel write.
    #[arg(long, default_value = "50ms", value_parser = hugepool_runtime::duration_arg)]
    pub max_step_duration: Duration,
    /// Pause after a write that took the whole budget (shorter writes: in
    /// proportion).
    #[arg(long, default_value = "5ms", value_parser = hugepool_runtime::duration_arg)]
    pub step_pause: Duration,
    /// A write slower than this is reported as a stall.
    #[arg(long, default_value = "2s", value_parser = hugepool_runtime::duration_arg)]
    pub stall_threshold: Duration,
    /// Growth never takes MemAvailable below this.
    #[arg(long, default_value = "1Gi", value_parser = parse_bytes)]
    pub min_mem_available: u64,
    /// Compaction + retry rounds when growth comes up short.
    #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = parse_retries)]
    pub retries: u32,
    /// Do not compact memory before retrying a short grow.
    #[arg(long)]
    pub no_compact: bool,
    /// Do not read the free lists (/proc/buddyinfo, /proc/pagetypeinfo)
    /// before a grow: no compaction before the first write, no foreseen
    /// shortfall (as before issue 30; for comparison).
    #[arg(long)]
    pub no_free_lists: bool,
    /// When pages in use block a shrink, wait this long for their release.
    #[arg(long, default_value = "0s", value_parser = hugepool_runtime::duration_arg)]
    pub wait_blocked: Duration,
    #[arg(long, value_enum, default_value = "text")]
    pub output: Output,
    /// Keep the fitted write-cost models in this file: read before, written
    /// after, so the next resize starts from measured costs, not a probe.
    #[arg(long, value_name = "PATH")]
    pub model_file: Option<PathBuf>,
}

fn parse_page_size(text: &str) -> std::result::Result<PageSize, String> {
    text.parse()
        .map_err(|err: hugepool_crds::ParseError| err.to_string())
}

fn parse_count(text: &str) -> std::result::Result<u64, String> {
    text.parse()
        .map_err(|_| format!("expected a non-negative whole number of pages, got {text:?}"))
}

fn parse_node(text: &str) -> std::result::Result<u32, String> {
    text.parse()
        .map_err(|_| format!("expected a NUMA node id such as 0, got {text:?}"))
}

fn parse_retries(text: &str) -> std::result::Result<u32, String> {
    text.parse()
        .map_err(|_| format!("expected a non-negative number of retries, got {text:?}"))
}

fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    hugepool_crds::quantity::parse_bytes(text).map_err(|err| err.to_string())
}

/// What a finished command tells the shell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The target was reached.
    Reached = 0,
    /// An error, including writes that kept failing.
    Error = 1,
    /// Ended short of the target or blocked by pages in use.
    Short = 2,
}

impl ResizeArgs {
    fn invalid(name: &'static str, detail: impl Into<String>) -> Error {
        Error::InvalidArgument {
            name,
            detail: detail.into(),
        }
    }

    /// Checks the arguments against each other and the kernel; no writes.
    pub fn target(&self, kernel: &dyn Kernel) -> Result<Target> {
        if self.max_step_duration.is_zero() {
            return Err(Self::invalid(
                "--max-step-duration",
                "must be greater than 0",
            ));
        }
        if self.stall_threshold < self.max_step_duration {
            return Err(Self::invalid(
                "--stall-threshold",
                "must not be shorter than --max-step-duration",
            ));
        }
        kernel
            .check_size_offered(self.page_size)
            .map_err(|err| Self::invalid("--page-size", err.to_string()))?;
        let scope = match self.numa_node {
            None => PoolScope::Global,
            Some(node) => {
                kernel
                    .numa_pool(self.page_size, node)
                    .map_err(|err| Self::invalid("--numa-node", err.to_string()))?;
                PoolScope::Node(node)
            }
        };
        Ok(Target {
            size: self.page_size,
            pages: self.pages,
            scope,
        })
    }

    pub fn settings(&self) -> Settings {
        Settings {
            max_step_duration: self.max_step_duration,
            step_pause: self.step_pause,
            stall_threshold: self.stall_threshold,
            min_mem_available: self.min_mem_available,
            retries: self.retries,
            compact: !self.no_compact,
            free_lists: !self.no_free_lists,
            ..Settings::default()
        }
    }
}

/// The JSON document `resize --output json` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    #[serde(flatten)]
    pub summary: Summary,
    /// Peak resident memory of this process (VmHWM).
    pub peak_rss_bytes: Option<u64>,
    /// Lockups, RCU stalls and hung tasks the kernel logged meanwhile.
    pub kernel_log: Vec<KernelLogEvent>,
}

/// Runs `resize`: validates, resizes, prints progress and the summary.
pub async fn resize(
    args: &ResizeArgs,
    kernel: Arc<dyn Kernel>,
    kmsg_path: Option<PathBuf>,
    out: &mut (dyn Write + Send),
) -> Result<Exit> {
    let target = args.target(kernel.as_ref())?;
    let mut kernel_log = kmsg_path.map(|path| kmsg::spawn(path, true));
    let (_goal_tx, mut goal_rx) = watch::channel(resize::Goal {
        target,
        settings: args.settings(),
    });
    let options = Options {
        blocked_wait: args.wait_blocked,
        blocked_poll: Duration::from_millis(200),
    };
    let text = args.output == Output::Text;
    let release = crate::kernel::release();
    let mut models = args
        .model_file
        .as_deref()
        .map(|path| model_file::load(path, &release))
        .unwrap_or_default();
    let summary = resize::run(kernel, &mut goal_rx, &options, &mut models, |event| {
        if text {
            // Progress is best effort; a closed stdout must not stop a resize.
            let _ = writeln!(out, "{}", describe(event));
        }
    })
    .await?;
    if let Some(path) = &args.model_file
        && let Err(err) = model_file::save(path, &models, &release)
    {
        tracing::warn!(path = %path.display(), %err, "cannot save the cost models");
    }
    let mut seen = Vec::new();
    if let Some(receiver) = &mut kernel_log {
        while let Ok(event) = receiver.try_recv() {
            seen.push(event);
        }
    }
    let exit = match &summary.outcome {
        Outcome::Reached => Exit::Reached,
        Outcome::Shortfall {
            reason: ShortfallReason::WriteError,
            ..
        } => Exit::Error,
        _ => Exit::Short,
    };
    let report = Report {
        summary,
        peak_rss_bytes: peak_rss_bytes(),
        kernel_log: seen,
    };
    let written = match args.output {
        Output::Json => serde_json::to_string(&report)
            .map_err(std::io::Error::other)
            .and_then(|json| writeln!(out, "{json}")),
        Output::Text => writeln!(out, "{}", describe_report(&report)),
    };
    written.map_err(|source| Error::Write {
        path: PathBuf::from("stdout"),
        value: "summary".into(),
        source,
    })?;
    Ok(exit)
}

fn millis(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

/// One line per event.
pub fn describe(event: &Event) -> String {
    match event {
        Event::Step(step) => format!(
            "step {:>3} {:<6} {:>8} -> {:>8} pages (target {}, step {}): write {}{}{}{}{}{}",
            step.step,
            step.direction.as_str(),
            step.before,
            step.after,
            step.target,
            step.pages,
            millis(step.latency),
            step.cpu_wait
                .filter(|wait| *wait >= Duration::from_millis(1))
                .map(|wait| format!(" ({} of it waiting for a CPU)", millis(wait)))
                .unwrap_or_default(),
            step.estimate
                .map(|e| format!(", model {}", millis(e)))
                .unwrap_or_default(),
            if step.over_budget {
                ", over budget"
            } else {
                ""
            },
            if step.stalled { ", stalled" } else { "" },
            if step.guard_limited {
                ", limited by min-mem-available".to_string()
            } else {
                format!("; size: {}", step.why.describe())
            },
        ),
        Event::Stall {
            step,
            direction,
            pages,
            elapsed,
            ..
        } => format!(
            "step {step:>3} stalled: {} write of {pages} pages still running after {}",
            direction.as_str(),
            millis(*elapsed)
        ),
        Event::WriteFailed { step, error } => format!("step {step:>3} failed: {error}"),
        Event::Compacted { scope, error: None } => format!("compacted memory ({scope}), retrying"),
        Event::Compacted {
            scope,
            error: Some(error),
        } => format!("compaction ({scope}) failed: {error}; retrying anyway"),
        Event::Blocked(outcome) => format!("waiting: {}", describe_outcome(outcome)),
        Event::Retargeted(target) => format!("new target: {} pages", target.pages),
        Event::Resettled(_) => "new settings".to_string(),
    }
}

fn describe_outcome(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Reached => "target reached".into(),
        Outcome::Blocked {
            target,
            current,
            in_use,
            reserved,
            surplus,
            floor,
            ..
        } => format!(
            "blocked by pages in use: pool stays at {current} (target {target}; in use {in_use}, reserved {reserved}, surplus {surplus}, floor {floor})"
        ),
        Outcome::Shortfall {
            requested,
            achieved,
            reason,
            detail,
        } => format!(
            "shortfall: achieved {achieved} of {requested} pages ({reason:?}){}",
            detail
                .as_ref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default()
        ),
    }
}

fn describe_report(report: &Report) -> String {
    let s = &report.summary;
    let mut text = format!(
        "{}: {} {} pages {} -> {} (target {}) in {} writes, {:.3} s; max write {}, total write {}, {:.0} pages/s, {} stalls, {} compactions",
        describe_outcome(&s.outcome),
        s.page_size,
        s.scope,
        s.from,
        s.achieved,
        s.to,
        s.steps,
        s.duration_seconds,
        millis(Duration::from_secs_f64(s.max_write_seconds)),
        millis(Duration::from_secs_f64(s.total_write_seconds)),
        s.pages_per_second,
        s.stalls,
        s.compactions,
    );
    for event in &report.kernel_log {
        text.push_str(&format!(
            "\nkernel log ({}): {}",
            event.kind.as_str(),
            event.message
        ));
    }
    text
}

/// VmHWM of this process, from `/proc/self/status` (the process's own
/// memory, not the kernel under `--proc-root`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// One line for a command-line error: clap's message with its lists folded
/// in, without usage and hints.
pub fn one_line_error(rendered: &str) -> String {
    let message = rendered.split("\n\n").next().unwrap_or(rendered);
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::fixture::FakeSysfs;

    fn parse(args: &[&str]) -> std::result::Result<Cli, String> {
        Cli::try_parse_from(std::iter::once("hugepool-agent").chain(args.iter().copied()))
            .map_err(|err| one_line_error(&err.render().to_string()))
    }

    fn resize_args(args: &[&str]) -> ResizeArgs {
        let mut all = vec!["resize"];
        all.extend_from_slice(args);
        match parse(&all).unwrap().command {
            Command::Resize(args) => args,
            Command::Run(_) | Command::Boot(_) => unreachable!("parsed a resize command line"),
        }
    }

    fn run_args(args: &[&str]) -> std::result::Result<RunArgs, String> {
        let mut all = vec!["run", "--node-name", "n1"];
        all.extend_from_slice(args);
        match parse(&all)?.command {
            Command::Run(args) => Ok(*args),
            Command::Resize(_) | Command::Boot(_) => unreachable!("parsed a run command line"),
        }
    }

    #[test]
    fn the_kubelet_restart_command_is_split_as_a_shell_would() {
        let args = run_args(&[
            "--kubelet-restart-command",
            r#"nsenter -t 1 -m -- sh -c 'systemctl restart "kubelet"' a\ b"#,
        ])
        .unwrap();
        assert_eq!(
            args.kubelet_restart_command.0,
            [
                "nsenter",
                "-t",
                "1",
                "-m",
                "--",
                "sh",
                "-c",
                r#"systemctl restart "kubelet""#,
                "a b"
            ]
        );
        let disabled = run_args(&["--kubelet-restart-command="]).unwrap();
        assert!(disabled.kubelet_restart_command.0.is_empty());
        let default = run_args(&[]).unwrap();
        assert_eq!(
            default.kubelet_restart_command.0.last().map(String::as_str),
            Some("kubelet")
        );
        assert_eq!(default.metrics_addr.to_string(), "[::]:9478");
        let err = run_args(&["--kubelet-restart-command", "sh -c 'unclosed"]).unwrap_err();
        assert!(err.contains("--kubelet-restart-command"), "{err}");
        assert!(err.contains("unbalanced quotes"), "{err}");
    }

    #[test]
    fn bad_arguments_get_one_line_naming_the_argument() {
        let cases: [(&[&str], &str); 6] = [
            (
                &["resize", "--page-size", "3Mi", "--pages", "1"],
                "--page-size",
            ),
            (
                &["resize", "--page-size", "2Mi", "--pages", "-5"],
                "--pages",
            ),
            (
                &[
                    "resize",
                    "--page-size",
                    "2Mi",
                    "--pages",
                    "1",
                    "--max-step-duration",
                    "fast",
                ],
                "--max-step-duration",
            ),
            (
                &[
                    "resize",
                    "--page-size",
                    "2Mi",
                    "--pages",
                    "1",
                    "--min-mem-available",
                    "lots",
                ],
                "--min-mem-available",
            ),
            (
                &[
                    "resize",
                    "--page-size",
                    "2Mi",
                    "--pages",
                    "1",
                    "--numa-node",
                    "-1",
                ],
                "--numa-node",
            ),
            (&["resize", "--page-size", "2Mi"], "--pages"),
        ];
        for (args, name) in cases {
            let err = parse(args).unwrap_err();
            assert!(err.starts_with("error: "), "{err}");
            assert!(err.contains(name), "{args:?}: {err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn sizes_and_nodes_the_kernel_lacks_are_rejected_before_any_write() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeSysfs::two_nodes_1gi_missing_on_node1(dir.path());
        let kernel = fake.kernel();
        let err = resize_args(&["--page-size", "64Ki", "--pages", "1"])
            .target(&kernel)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --page-size: the kernel does not offer 64Ki huge pages (offered: 2Mi, 1Gi)"
        );
        let err = resize_args(&["--page-size", "1Gi", "--pages", "1", "--numa-node", "1"])
            .target(&kernel)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --numa-node: NUMA node 1 has no 1Gi pool"
        );
        let target = resize_args(&["--page-size", "1Gi", "--pages", "2", "--numa-node", "0"])
            .target(&kernel)
            .unwrap();
        assert_eq!(target.scope, PoolScope::Node(0));
        let err = resize_args(&[
            "--page-size",
            "2Mi",
            "--pages",
            "1",
            "--stall-threshold",
            "10ms",
        ])
        .target(&kernel)
        .unwrap_err();
        assert!(
            err.to_string().starts_with("invalid --stall-threshold"),
            "{err}"
        );
    }

    #[test]
    fn settings_follow_the_flags() {
        let args = resize_args(&[
            "--page-size",
            "2Mi",
            "--pages",
            "8",
            "--max-step-duration",
            "20ms",
            "--step-pause",
            "1ms",
            "--min-mem-available",
            "2Gi",
            "--retries",
            "5",
            "--no-compact",
        ]);
        let settings = args.settings();
        assert_eq!(settings.max_step_duration, Duration::from_millis(20));
        assert_eq!(settings.step_pause, Duration::from_millis(1));
        assert_eq!(settings.min_mem_available, 2 << 30);
        assert_eq!(settings.retries, 5);
        assert!(!settings.compact);
    }
}
