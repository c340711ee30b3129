//! The `agentbridge` binary as a child process, for what only a real process can show:
//! start-up failures, `check`, and surviving `kill -9`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_agentbridge");

pub struct BridgeProcess {
    pub child: Child,
    /// endpoint name → address it listens on, read from the start-up log.
    pub addrs: HashMap<String, SocketAddr>,
    /// Its log lines (JSON) after start-up, as they come.
    logs: mpsc::Receiver<String>,
}

impl BridgeProcess {
    /// Runs `agentbridge run --config <config>` and waits until every listener is up.
    pub fn spawn(config: &Path) -> BridgeProcess {
        let mut child = Command::new(BIN)
            .args(["run", "--log-format", "json", "--config"])
            .arg(config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("agentbridge starts");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Read to the end, listened to or not: a bridge whose stderr closed would fail
            // its next log line.
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut addrs = HashMap::new();
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("agentbridge logs its listeners");
            let Ok(entry) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            let fields = &entry["fields"];
            match fields["message"].as_str() {
                Some("listening") => {
                    let name = fields["endpoint"].as_str().unwrap().to_owned();
                    let addr = fields["addr"].as_str().unwrap().parse().unwrap();
                    addrs.entry(name).or_insert(addr);
                }
                Some("ready") => break,
                _ => {}
            }
        }
        BridgeProcess {
            child,
            addrs,
            logs: rx,
        }
    }

    /// The next log line whose JSON `select` says is the one, within `within`; `None` once
    /// that passed (every line before it is consumed).
    pub fn next_log(&self, within: Duration, select: impl Fn(&Value) -> bool) -> Option<Value> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            let line = self.logs.recv_timeout(left).ok()?;
            if let Ok(entry) = serde_json::from_str::<Value>(&line)
                && select(&entry)
            {
                return Some(entry);
            }
        }
    }

    /// Sends the process `signal` (a `libc::SIG…`).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        let sent = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(sent, 0, "the signal reaches the bridge");
    }

    /// Waits, up to `within`, for the process to exit; its status.
    pub fn exited(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn addr(&self, endpoint: &str) -> SocketAddr {
        self.addrs[endpoint]
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill_9(mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("reaped");
    }
}

impl Drop for BridgeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the binary to completion: (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    run_program(BIN, args, Duration::from_secs(120))
}

/// Runs `program` to completion, killed and failed if it takes longer than `within`:
/// (exit code, stdout, stderr). Its output is read while it runs, so a full pipe never
/// holds it up.
pub fn run_program(program: &str, args: &[&str], within: Duration) -> (i32, String, String) {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    let read = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = read(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = read(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = std::time::Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child can be waited on") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} {args:?} did not finish within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (
        status.code().unwrap_or(-1),
        stdout.join().unwrap(),
        stderr.join().unwrap(),
    )
}
