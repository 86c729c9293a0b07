//! Command-line usage errors that clap cannot see (no input named, a flag that
//! needs another), shared by `maxc` and `maxrun`: both exit 2 for them, as for
//! clap's own (docs/user-guide.md, "Exit codes").

/// A usage error; [`exit_code`] maps it to 2.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// A usage error as an `anyhow::Error`.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(message.into()))
}

/// The exit code for a failed command: 2 for a usage error, 1 otherwise.
pub fn exit_code(e: &anyhow::Error) -> std::process::ExitCode {
    std::process::ExitCode::from(exit_status(e))
}

/// [`exit_code`] as a number (what `maxc compile --json` reports in its error object).
pub fn exit_status(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<Usage>().is_some() {
        2
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_errors_exit_2_and_others_1() {
        assert_eq!(exit_code(&usage("give --prompt")), std::process::ExitCode::from(2));
        assert_eq!(exit_code(&usage("x").context("while reading")), std::process::ExitCode::from(2));
        assert_eq!(exit_code(&anyhow::anyhow!("a refused input")), std::process::ExitCode::FAILURE);
        assert_eq!((exit_status(&usage("x")), exit_status(&anyhow::anyhow!("refused"))), (2, 1));
    }
}
