//! The embedded `secantusd-rs` server, run as a separate process.
//!
//! The server runs under a tiny `sh` controller whose standard input is a pipe from this
//! process. Commands on that pipe start, stop, kill, pause and resume the server; when the
//! pipe closes — this process exited, panicked or was killed — the controller stops the
//! server and removes its temporary directory. So no `secantusd-rs` outlives its owner.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::doc;

use crate::error::{Error, Result};

/// The pinned version of the surrogate server.
pub const SECANTUS_VERSION: &str = "0.5.3-beta.196";

/// How to install the embedded server on a Debian machine.
pub const INSTALL_HINT: &str = "Install it with:\n  apt-get update && apt-get install -y cmake\n  cargo install secantus-mdb --version 0.5.3-beta.196 --locked --ignore-rust-version\n(or run ./scripts/prereqs.sh, which does both; set MONGODB_URI to use a real MongoDB instead)";

const CONTROLLER: &str = r#"
dir="$1"; log="$2"; cleanup="$3"; bin="$4"
pid=""
# The controller outlives its parent while it stops the server (a test process that has
# exited): its errors go to the log, so it holds none of the parent's output open.
exec 3<&0 2>>"$log"
stop_server() {
  if [ -n "$pid" ]; then
    kill "-$1" "$pid" 2>/dev/null
    kill -CONT "$pid" 2>/dev/null
    ( sleep 15; kill -KILL "$pid" 2>/dev/null ) </dev/null >/dev/null 2>&1 & timer=$!
    wait "$pid"; status=$?
    kill "$timer" 2>/dev/null
    pid=""
  fi
}
while read -r cmd arg <&3; do
  case "$cmd" in
    start) set -- $arg; port="$1"; shift
           "$bin" --port "$port" --storage-path "$dir/db" "$@" >>"$log" 2>&1 </dev/null & pid=$!; echo "pid $pid" ;;
    stop) stop_server TERM; echo "stopped $status" ;;
    kill) stop_server KILL; echo "stopped $status" ;;
    pause) kill -STOP "$pid" 2>/dev/null; echo "ok" ;;
    resume) kill -CONT "$pid" 2>/dev/null; echo "ok" ;;
    alive) if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "yes"; else echo "no"; fi ;;
    *) echo "unknown" ;;
  esac
done
stop_server TERM
[ "$cleanup" = 1 ] && rm -rf "$dir"
exit 0
"#;

/// Options for [`EmbeddedServer::start`].
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ServerOptions {
    /// Keep the data (and the log) in this directory instead of a temporary one. A server
    /// whose data is kept is started durable unless [`ServerOptions::durable`] says
    /// otherwise.
    pub data_dir: Option<PathBuf>,
    /// Port to listen on; `0` (the default) picks a free one.
    pub port: u16,
    /// Make every acknowledged write survive a crash (`--sync-on-commit`: each commit is
    /// flushed to the journal before it is acknowledged). `None` (the default): durable
    /// exactly when the data is kept. Without it, `kill -9` of the server loses the last
    /// ~100 ms of acknowledged writes; with it, writes are several times slower.
    pub durable: Option<bool>,
    /// Enable MongoDB's test commands (`configureFailPoint` with `failCommand`), for fault
    /// injection. Default off.
    pub test_commands: bool,
}

impl ServerOptions {
    /// Sets [`ServerOptions::data_dir`].
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }
    /// Sets [`ServerOptions::port`].
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }
    /// Sets [`ServerOptions::durable`].
    pub fn durable(mut self, durable: bool) -> Self {
        self.durable = Some(durable);
        self
    }
    /// Sets [`ServerOptions::test_commands`].
    pub fn test_commands(mut self, on: bool) -> Self {
        self.test_commands = on;
        self
    }

    /// Whether the server will be started durable.
    pub fn is_durable(&self) -> bool {
        self.durable.unwrap_or(self.data_dir.is_some())
    }

    /// The server's command-line flags besides port and storage path.
    fn flags(&self) -> String {
        let mut flags = Vec::new();
        if self.is_durable() {
            flags.push("--sync-on-commit");
        }
        if self.test_commands {
            flags.push("--enable-test-commands");
        }
        flags.join(" ")
    }
}

struct Control {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Control {
    fn send(&mut self, line: &str) -> std::io::Result<String> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| std::io::Error::other("server controller already closed"))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        let mut reply = String::new();
        if self.stdout.read_line(&mut reply)? == 0 {
            return Err(std::io::Error::other("server controller exited"));
        }
        Ok(reply.trim().to_owned())
    }

    fn close(&mut self) {
        // Closing stdin tells the controller to stop the server and clean up.
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `secantusd-rs`: started by [`EmbeddedServer::start`], stopped on drop.
pub struct EmbeddedServer {
    control: Arc<Mutex<Control>>,
    port: u16,
    dir: PathBuf,
    log: PathBuf,
    temporary: bool,
    durable: bool,
    flags: String,
}

impl std::fmt::Debug for EmbeddedServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedServer")
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish()
    }
}

impl EmbeddedServer {
    /// Finds the `secantusd-rs` binary on `PATH` or in `~/.cargo/bin`.
    ///
    /// # Errors
    /// [`Error::NotInstalled`] with the install commands.
    pub fn binary() -> Result<PathBuf> {
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        if let Some(home) = std::env::var_os("HOME") {
            dirs.push(Path::new(&home).join(".cargo/bin"));
        }
        dirs.into_iter()
            .map(|d| d.join("secantusd-rs"))
            .find(|p| p.is_file())
            .ok_or(Error::NotInstalled { hint: INSTALL_HINT })
    }

    /// Starts a server and waits until it answers `hello`.
    ///
    /// # Errors
    /// [`Error::NotInstalled`], or [`Error::StartFailed`] naming the kept log.
    pub async fn start(options: ServerOptions) -> Result<Self> {
        let binary = Self::binary()?;
        let (dir, temporary) = match &options.data_dir {
            Some(d) => {
                std::fs::create_dir_all(d).map_err(|source| Error::DataDir {
                    path: d.clone(),
                    source,
                })?;
                (d.clone(), false)
            }
            None => (
                tempfile::Builder::new()
                    .prefix("docwarden-embedded-")
                    .tempdir()?
                    .keep(),
                true,
            ),
        };
        let log = dir.join("server.log");
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(CONTROLLER)
            .arg("docwarden-server-controller")
            .arg(&dir)
            .arg(&log)
            .arg(if temporary { "1" } else { "0" })
            .arg(&binary)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("controller has no stdout"))?;
        let mut server = Self {
            control: Arc::new(Mutex::new(Control {
                child,
                stdin,
                stdout: BufReader::new(stdout),
            })),
            port: options.port,
            dir,
            log,
            temporary,
            durable: options.is_durable(),
            flags: options.flags(),
        };
        server.launch(options.port).await?;
        Ok(server)
    }

    /// `mongodb://127.0.0.1:PORT/?directConnection=true`.
    pub fn uri(&self) -> String {
        format!("mongodb://127.0.0.1:{}/?directConnection=true", self.port)
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The directory holding the data (`db/`) and the log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the server (SIGTERM) and starts it again on the same port and data.
    ///
    /// # Errors
    /// [`Error::StartFailed`] if it does not come back.
    pub async fn restart(&mut self) -> Result<()> {
        self.command("stop").await?;
        self.launch(self.port).await
    }

    /// Kills the server (SIGKILL, no clean shutdown) and starts it again on the same port
    /// and data: a crash followed by recovery. Only a durable server keeps every
    /// acknowledged write across this (see [`ServerOptions::durable`]).
    ///
    /// # Errors
    /// [`Error::StartFailed`] if it does not come back.
    pub async fn crash_and_restart(&mut self) -> Result<()> {
        if !self.durable {
            tracing::warn!(
                "crashing a server that is not durable: the last acknowledged writes may be lost"
            );
        }
        self.command("kill").await?;
        self.launch(self.port).await
    }

    /// Whether acknowledged writes survive a crash of this server.
    pub fn is_durable(&self) -> bool {
        self.durable
    }

    /// Freezes the server process (SIGSTOP): connections hang until [`resume`](Self::resume).
    ///
    /// # Errors
    /// [`Error::Io`] if the controller is gone.
    pub async fn pause(&self) -> Result<()> {
        self.command("pause").await.map(drop)
    }

    /// Thaws a paused server (SIGCONT).
    ///
    /// # Errors
    /// [`Error::Io`] if the controller is gone.
    pub async fn resume(&self) -> Result<()> {
        self.command("resume").await.map(drop)
    }

    /// Stops the server and, for a temporary one, removes its directory.
    pub fn stop(self) {
        drop(self);
    }

    async fn command(&self, line: &'static str) -> Result<String> {
        let control = Arc::clone(&self.control);
        let reply = tokio::task::spawn_blocking(move || {
            control.lock().unwrap_or_else(|p| p.into_inner()).send(line)
        })
        .await
        .map_err(std::io::Error::other)??;
        Ok(reply)
    }

    async fn launch(&mut self, port: u16) -> Result<()> {
        let log_start = std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
        let control = Arc::clone(&self.control);
        let line = format!("start {port} {}", self.flags);
        tokio::task::spawn_blocking(move || {
            control
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(&line)
        })
        .await
        .map_err(std::io::Error::other)??;
        let deadline = Instant::now() + Duration::from_secs(60);
        let found = loop {
            if let Some(p) = listening_port(&self.log, log_start) {
                break p;
            }
            if self.command("alive").await? != "yes" {
                return Err(self.start_failed("the server exited during startup"));
            }
            if Instant::now() > deadline {
                return Err(self.start_failed("no 'listening on' line within 60 s"));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        self.port = found;
        let options = mongodb::options::ClientOptions::parse(self.uri()).await?;
        let mut options = options;
        options.server_selection_timeout = Some(Duration::from_secs(20));
        let client = mongodb::Client::with_options(options)?;
        if let Err(e) = client
            .database("admin")
            .run_command(doc! { "hello": 1 })
            .await
        {
            return Err(self.start_failed(&format!("hello failed: {e}")));
        }
        tracing::info!(port = self.port, dir = %self.dir.display(), "embedded secantusd-rs is up");
        Ok(())
    }

    fn start_failed(&self, reason: &str) -> Error {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        // A temporary directory is removed when the controller exits: keep the log.
        let kept = if self.temporary {
            let kept = std::env::temp_dir().join(format!(
                "docwarden-server-failed-{}-{}.log",
                std::process::id(),
                rand::random::<u32>()
            ));
            match std::fs::copy(&self.log, &kept) {
                Ok(_) => kept,
                Err(_) => self.log.clone(),
            }
        } else {
            self.log.clone()
        };
        Error::StartFailed {
            reason: reason.to_owned(),
            log: kept,
            tail,
        }
    }
}

impl Drop for EmbeddedServer {
    fn drop(&mut self) {
        self.control
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .close();
    }
}

/// The port from the first `listening on 127.0.0.1:PORT` line after byte `from` of the log.
fn listening_port(log: &Path, from: u64) -> Option<u16> {
    let text = std::fs::read(log).ok()?;
    let start = usize::try_from(from).ok()?.min(text.len());
    let text = String::from_utf8_lossy(&text[start..]);
    text.lines().find_map(|l| {
        let rest = l.split("listening on ").nth(1)?;
        rest.trim().rsplit(':').next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_listening_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        std::fs::write(&log, "boot\nsecantusd-rs listening on 127.0.0.1:40123\n").expect("write");
        assert_eq!(listening_port(&log, 0), Some(40123));
        let len = std::fs::metadata(&log).expect("meta").len();
        assert_eq!(listening_port(&log, len), None);
    }
}
