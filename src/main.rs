//! The `agentbridge` command line.

use std::path::PathBuf;
use std::process::ExitCode;

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
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the bridge (the default when no command is given).
    Run,
    /// Validate the config and print what would listen where.
    Check,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(config) => config,
        Err(e) => return fail(&e),
    };
    match cli.command.unwrap_or(Command::Run) {
        Command::Check => check(&config),
        Command::Run => {
            init_logging(
                cli.log_format
                    .or(config.bridge.log_format)
                    .unwrap_or_default(),
            );
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(runtime) => runtime,
                Err(e) => return fail(&format!("cannot start the runtime: {e}")),
            };
            runtime.block_on(async {
                match Bridge::start(config).await {
                    Ok(bridge) => {
                        bridge.run_until_signal().await;
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

fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
