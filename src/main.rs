//! The `agentbridge` command line.

use std::path::PathBuf;
use std::process::ExitCode;

mod cli;

use agentbridge::bridge::{LogLevelHook, Options, Signals};
use agentbridge::config::LogFormat;
use agentbridge::{Bridge, Config};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "agentbridge",
    version,
    about = "A multi-protocol message broker and bridge for fleets of AI agents"
)]
struct Cli {
    /// Path of the config file.
    #[arg(long, short, global = true, default_value = "bridge.toml")]
    config: PathBuf,
    /// Log format; overrides `[bridge] log_format`. The level comes from RUST_LOG.
    #[arg(long, global = true, value_enum)]
    log_format: Option<LogFormat>,
    /// The running bridge's admin listener, for health, trace and top (default: the
    /// config's `[admin] listen`), e.g. http://127.0.0.1:9464.
    #[arg(long, global = true, env = "AGENTBRIDGE_ADMIN")]
    admin: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the bridge (the default when no command is given).
    Run,
    /// Validate the config and print what would listen where.
    Check,
    /// Ask the running bridge's admin listener whether it is alive (`/healthz`): exit 0 if
    /// it is (a container's HEALTHCHECK).
    Health {
        /// Ask whether it is ready instead (`/readyz`).
        #[arg(long)]
        ready: bool,
    },
    /// Show the conversation a message belongs to, hop by hop, from the running bridge.
    Trace(cli::TraceArgs),
    /// Watch the running bridge: message rates, connections, drops, the busiest agents.
    Top(cli::TopArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(config) => config,
        Err(e) => return fail(&e),
    };
    let command = cli.command.unwrap_or(Command::Run);
    if let Command::Check = command {
        return check(&config);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => return fail(&format!("cannot start the runtime: {e}")),
    };
    let admin = || cli::AdminClient::for_config(&config, cli.admin.clone());
    match command {
        Command::Check => unreachable!("answered above"),
        Command::Health { ready } => runtime.block_on(cli::health(admin(), ready)),
        Command::Trace(args) => runtime.block_on(cli::trace(admin(), args)),
        Command::Top(args) => runtime.block_on(cli::top(admin(), args)),
        Command::Run => {
            let format = cli.log_format.or(config.bridge.log_format);
            let log_level = init_logging(format.unwrap_or_default(), &config.bridge.log_filter());
            let options = Options {
                config_path: Some(cli.config),
                log_level: Some(log_level),
            };
            runtime.block_on(async {
                let signals = match Signals::install() {
                    Ok(signals) => signals,
                    Err(e) => {
                        return fail(&format!("cannot take over SIGINT, SIGTERM and SIGHUP: {e}"));
                    }
                };
                match Bridge::start_with(config, options).await {
                    Ok(bridge) => {
                        bridge.run_until(signals).await;
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                }
            })
        }
    }
}

fn check(config: &Config) -> ExitCode {
    if let Err(e) = check_data_dir(&config.bridge.data_dir) {
        return fail(&e);
    }
    println!("config ok; data in {}", config.bridge.data_dir);
    let listeners = config.listeners();
    if listeners.is_empty() {
        println!("no listeners configured");
    }
    for (endpoint, role, addr) in listeners {
        println!("{endpoint:<8} {addr:<22} {role}");
    }
    ExitCode::SUCCESS
}

/// The data directory exists (or can be created) and is writable.
fn check_data_dir(dir: &str) -> Result<(), String> {
    if dir == agentbridge::store::IN_MEMORY {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot use data directory {dir}: {e}"))?;
    let probe = PathBuf::from(dir).join(".agentbridge-write-check");
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| format!("data directory {dir} is not writable: {e}"))
}

fn fail(reason: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("agentbridge: error: {reason}");
    ExitCode::FAILURE
}

/// Installs the log writer with `filter` (`info` where it does not parse); what sets its
/// filter again (a reload of `[bridge] log_level`).
fn init_logging(format: LogFormat, filter: &str) -> LogLevelHook {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            let builder = builder.with_env_filter(filter).with_filter_reloading();
            let handle = builder.reload_handle();
            builder.init();
            reloads(handle)
        }
        LogFormat::Json => {
            let builder = builder
                .json()
                .with_env_filter(filter)
                .with_filter_reloading();
            let handle = builder.reload_handle();
            builder.init();
            reloads(handle)
        }
    }
}

/// Sets the log filter through `handle`.
fn reloads<S: 'static>(
    handle: tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, S>,
) -> LogLevelHook {
    Box::new(move |level: &str| {
        let filter = tracing_subscriber::EnvFilter::try_new(level)
            .map_err(|e| format!("log_level {level:?}: {e}"))?;
        handle.reload(filter).map_err(|e| e.to_string())
    })
}
