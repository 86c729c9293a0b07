//! Compile progress on stderr: a bar with counts and ETA for phases that can be
//! counted (writing the weights), and a periodic "still compiling <what>, Ns" line
//! for phases that cannot (LLVM's optimizer). Silent when disabled (`--quiet`,
//! `--log-format json`); bars draw only on a terminal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-counting bar, hidden when `enabled` is false or stderr is not a terminal.
pub fn bytes_bar(total: u64, what: &str, enabled: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), if enabled { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    bar.set_style(
        ProgressStyle::with_template("{msg:<16} {bar:30} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})").expect("a valid template"),
    );
    bar.set_message(what.to_string());
    bar
}

/// Prints "still compiling <what>, Ns" every `every` until dropped.
pub struct Ticker {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    pub fn start(what: String, every: Duration, enabled: bool) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let thread = enabled.then(|| {
            let done = done.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut next = every;
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if start.elapsed() >= next {
                        eprintln!("still compiling {what}, {}s", start.elapsed().as_secs());
                        next += every;
                    }
                }
            })
        });
        Ticker { done, thread }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
