//! Rank and world size from the launcher's environment.
//!
//! Launchers are tried in a fixed order, innermost first, so that a launcher started inside
//! another (torchrun or mpirun inside a Slurm allocation) wins over the allocation's variables:
//!
//! 1. byzcoll's own launcher: `BYZCOLL_RANK`, `BYZCOLL_WORLD_SIZE`, `BYZCOLL_LOCAL_RANK`
//! 2. Open MPI: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`
//! 3. PMI (MPICH, `srun --mpi=pmi2`): `PMI_RANK`, `PMI_SIZE`, `PMI_LOCAL_RANK`
//! 4. torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
//! 5. Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`
//!
//! A launcher counts as present when its rank variable is set; the first present one is used,
//! and a missing world-size variable is then an error rather than a reason to look further.
//! `BYZCOLL_LAUNCHER` (`byzcoll`, `openmpi`, `pmi`, `torchrun`, `slurm`) forces one.
//!
//! The rendezvous store's address is `BYZCOLL_STORE` (`host:port`), else `MASTER_ADDR` and
//! `MASTER_PORT`. It is needed only when the world has more than one rank.

use std::fmt;

use crate::{BootstrapError, Rank};

/// A launcher whose variables byzcoll understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `byzcoll launch`.
    Byzcoll,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// A PMI-1/PMI-2 launcher (MPICH's hydra, `srun --mpi=pmi2`).
    Pmi,
    /// `torchrun` or anything that sets `RANK`/`WORLD_SIZE`.
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// Set in code (`byzcoll::JobConfig::builder`), not read from a launcher's variables.
    Code,
}

struct Vars {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
}

const ORDER: [Vars; 5] = [
    Vars {
        launcher: Launcher::Byzcoll,
        rank: "BYZCOLL_RANK",
        size: "BYZCOLL_WORLD_SIZE",
        local_rank: "BYZCOLL_LOCAL_RANK",
    },
    Vars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    },
    Vars {
        launcher: Launcher::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "PMI_LOCAL_RANK",
    },
    Vars {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
    },
    Vars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
    },
];

impl Launcher {
    /// The name used in messages and in `BYZCOLL_LAUNCHER`.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Byzcoll => "byzcoll",
            Launcher::OpenMpi => "openmpi",
            Launcher::Pmi => "pmi",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::Code => "code",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where this process sits in the job, as its launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher the values came from.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: Rank,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the processes on this node, when the launcher says.
    pub local_rank: Option<usize>,
    /// `host:port` of the rendezvous store, when one is configured.
    pub store: Option<String>,
}

impl LaunchEnv {
    /// Reads the launcher's variables through `get` (the process environment is read by
    /// `byzcoll::JobConfig` alone, which calls this).
    ///
    /// # Errors
    /// [`BootstrapError::NoLauncher`] when no launcher's variables are set;
    /// [`BootstrapError::MissingVar`] when the chosen launcher's world size is missing, or a
    /// store is needed and not configured; [`BootstrapError::InvalidVar`] for values that are
    /// not numbers, a rank outside the world, or an unknown `BYZCOLL_LAUNCHER`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let vars = match get("BYZCOLL_LAUNCHER") {
            Some(name) => ORDER
                .iter()
                .find(|v| v.launcher.name() == name.trim())
                .ok_or_else(|| BootstrapError::InvalidVar {
                    var: "BYZCOLL_LAUNCHER",
                    value: name.clone(),
                    why: "expected one of byzcoll, openmpi, pmi, torchrun, slurm".into(),
                })?,
            None => ORDER
                .iter()
                .find(|v| get(v.rank).is_some())
                .ok_or(BootstrapError::NoLauncher)?,
        };
        let launcher = vars.launcher;
        let number = |var: &'static str| -> Result<Option<usize>, BootstrapError> {
            get(var)
                .map(|value| {
                    value
                        .trim()
                        .parse::<usize>()
                        .map_err(|_| BootstrapError::InvalidVar {
                            var,
                            value: value.clone(),
                            why: "expected a non-negative integer".into(),
                        })
                })
                .transpose()
        };
        let required = |var: &'static str| {
            number(var)?.ok_or(BootstrapError::MissingVar {
                launcher: launcher.name(),
                var,
            })
        };
        let rank = required(vars.rank)?;
        let size = required(vars.size)?;
        let local_rank = number(vars.local_rank)?;
        if size == 0 {
            return Err(BootstrapError::InvalidVar {
                var: vars.size,
                value: "0".into(),
                why: "a world has at least one rank".into(),
            });
        }
        if rank >= size {
            return Err(BootstrapError::InvalidVar {
                var: vars.rank,
                value: rank.to_string(),
                why: format!("rank must be below {}={size}", vars.size),
            });
        }
        if let Some(l) = local_rank.filter(|&l| l >= size) {
            return Err(BootstrapError::InvalidVar {
                var: vars.local_rank,
                value: l.to_string(),
                why: format!("local rank must be below {}={size}", vars.size),
            });
        }
        let store = match (get("BYZCOLL_STORE"), get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(s), _, _) => Some(s),
            // torchrun's agent hosts torch's own store on MASTER_PORT: rank 0 could not bind
            // it, and the others would wait for a store that never answers.
            (None, Some(_), Some(port))
                if size > 1 && get("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") =>
            {
                return Err(BootstrapError::InvalidVar {
                    var: "MASTER_PORT",
                    value: port,
                    why: "torchrun's agent hosts torch's store there \
                          (TORCHELASTIC_USE_AGENT_STORE=True): set BYZCOLL_STORE=HOST:PORT, a free \
                          port on rank 0's host, for byzcoll's store; or, from Python, join \
                          through torch.distributed with byzcoll.torch.init_from_process_group()"
                        .into(),
                });
            }
            (None, Some(addr), Some(port)) => Some(format!("{addr}:{port}")),
            (None, Some(_), None) => {
                return Err(BootstrapError::MissingVar {
                    launcher: launcher.name(),
                    var: "MASTER_PORT",
                })
            }
            (None, None, Some(_)) => {
                return Err(BootstrapError::MissingVar {
                    launcher: launcher.name(),
                    var: "MASTER_ADDR",
                })
            }
            (None, None, None) => None,
        };
        if size > 1 && store.is_none() {
            return Err(BootstrapError::MissingVar {
                launcher: launcher.name(),
                var: "BYZCOLL_STORE (or MASTER_ADDR and MASTER_PORT)",
            });
        }
        Ok(LaunchEnv {
            launcher,
            rank,
            size,
            local_rank,
            store,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect(vars: &[(&str, &str)]) -> Result<LaunchEnv, BootstrapError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn each_launcher_is_recognised() {
        let cases: [(&[(&str, &str)], Launcher); 5] = [
            (
                &[("BYZCOLL_RANK", "1"), ("BYZCOLL_WORLD_SIZE", "4")],
                Launcher::Byzcoll,
            ),
            (
                &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")],
                Launcher::OpenMpi,
            ),
            (&[("PMI_RANK", "1"), ("PMI_SIZE", "4")], Launcher::Pmi),
            (&[("RANK", "1"), ("WORLD_SIZE", "4")], Launcher::Torchrun),
            (
                &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4")],
                Launcher::Slurm,
            ),
        ];
        for (vars, launcher) in cases {
            let mut vars = vars.to_vec();
            vars.push(("BYZCOLL_STORE", "127.0.0.1:1"));
            let env = detect(&vars).unwrap();
            assert_eq!((env.launcher, env.rank, env.size), (launcher, 1, 4));
        }
    }

    #[test]
    fn innermost_launcher_wins_and_can_be_forced() {
        let vars = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let env = detect(&vars).unwrap();
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert_eq!((env.rank, env.size, env.local_rank), (3, 8, Some(3)));
        assert_eq!(env.store.as_deref(), Some("127.0.0.1:29500"));
        let mut forced = vars.to_vec();
        forced.push(("BYZCOLL_LAUNCHER", "slurm"));
        assert_eq!(detect(&forced).unwrap().launcher, Launcher::Slurm);
    }

    #[test]
    fn incomplete_or_contradictory_environments_name_the_variable() {
        let err = detect(&[("SLURM_PROCID", "0")]).unwrap_err();
        assert!(err.to_string().contains("SLURM_NTASKS is not set"), "{err}");
        let err = detect(&[("RANK", "4"), ("WORLD_SIZE", "4")]).unwrap_err();
        assert!(err.to_string().contains("RANK=\"4\" is invalid"), "{err}");
        let err = detect(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("PMI_RANK"), "{err}");
        let err = detect(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT is not set"), "{err}");
        let err = detect(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("BYZCOLL_STORE"), "{err}");
        assert!(matches!(detect(&[]), Err(BootstrapError::NoLauncher)));
        let err = detect(&[("BYZCOLL_LAUNCHER", "lsf")]).unwrap_err();
        assert!(err.to_string().contains("BYZCOLL_LAUNCHER"), "{err}");
        // Under torchrun, MASTER_PORT is the agent's store: byzcoll needs a port of its own.
        let torchrun = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "41985"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        let err = detect(&torchrun).unwrap_err();
        assert!(err.to_string().contains("BYZCOLL_STORE=HOST:PORT"), "{err}");
        assert!(err.to_string().contains("MASTER_PORT=\"41985\""), "{err}");
        let mut own = torchrun.to_vec();
        own.push(("BYZCOLL_STORE", "127.0.0.1:29600"));
        assert_eq!(
            detect(&own).unwrap().store.as_deref(),
            Some("127.0.0.1:29600")
        );
        // A single rank needs no store.
        assert_eq!(
            detect(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().size,
            1
        );
    }
}
