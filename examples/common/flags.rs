//! The examples' command-line flags, `--name value` each.

/// The flags given to this process.
pub(crate) struct Flags(Vec<(String, String)>);

impl Flags {
    /// This process's arguments as flags, each one of `known`.
    ///
    /// # Errors
    /// A flag not in `known`, a flag given twice, or one without a value.
    pub(crate) fn parse(known: &[&str]) -> Result<Flags, String> {
        let mut flags: Vec<(String, String)> = Vec::new();
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let Some(name) = arg.strip_prefix("--").filter(|n| known.contains(n)) else {
                let known: Vec<String> = known.iter().map(|k| format!("--{k}")).collect();
                return Err(format!(
                    "unknown argument {arg:?} (expected {})",
                    known.join(", ")
                ));
            };
            if flags.iter().any(|(n, _)| n == name) {
                return Err(format!("--{name} given twice"));
            }
            let value = args.next().ok_or(format!("--{name} needs a value"))?;
            flags.push((name.to_string(), value));
        }
        Ok(Flags(flags))
    }

    /// The value of `--name`, if given.
    pub(crate) fn word(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// `--name` as a whole number from `min` to `max`, or `default` when not given.
    ///
    /// # Errors
    /// A value that is not a whole number in that range, naming the flag.
    pub(crate) fn number(
        &self,
        name: &str,
        default: u64,
        min: u64,
        max: u64,
    ) -> Result<u64, String> {
        let Some(v) = self.word(name) else {
            return Ok(default);
        };
        v.parse::<u64>()
            .ok()
            .filter(|n| (min..=max).contains(n))
            .ok_or(format!(
                "--{name} {v:?}: expected a whole number from {min} to {max}"
            ))
    }
}
