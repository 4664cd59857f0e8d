"""What the tests share: a free port on 127.0.0.1, and an environment without any launcher's
variables (so that a test's job is described only by what the test sets)."""

import os
import socket

LAUNCHER_PREFIXES = ("OMPI_", "PMI", "SLURM_", "BYZCOLL_", "MASTER_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def is_launcher_var(name):
    return name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_VARS


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not is_launcher_var(k)}
    env.update(extra)
    return env
