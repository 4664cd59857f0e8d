"""What the tests share: a free port on 127.0.0.1, and an environment without any launcher's
variables (so that a test's job is described only by what the test sets)."""

import os
import random
import socket

LAUNCHER_PREFIXES = ("OMPI_", "PMI", "SLURM_", "BYZCOLL_", "MASTER_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def is_launcher_var(name):
    return name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_VARS


_LISTENERS = []


def loopback_store():
    """A torch ``TCPStore`` server listening on 127.0.0.1 only (``TCPStore(is_master=True)``
    alone listens on every interface): its socket is bound here and handed over as
    ``master_listen_fd``. Returns the store; ``store.port`` is its port."""
    import torch.distributed as dist

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    store = dist.TCPStore(
        "127.0.0.1", s.getsockname()[1], is_master=True, wait_for_workers=False, master_listen_fd=s.fileno()
    )
    _LISTENERS.append(s)  # open as long as the test process
    return store


def free_port():
    """A port on 127.0.0.1 that was free a moment ago, drawn below the kernel's ephemeral
    range: a launcher (torchrun, mpirun) started between the pick and the bind opens its own
    sockets on ephemeral ports and could take the store's port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768
    lowest = 10_000
    if ephemeral_start > lowest + 1_000:
        for _ in range(200):
            port = random.randrange(lowest, ephemeral_start)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra):
    """This process's environment without the launcher's variables, with `extra` on top. Jobs
    wait for every input (BYZCOLL_STRAGGLERS=0) unless `extra` says otherwise: the tests compare
    exact results, and with stragglers allowed (the library's default) a rank late on a loaded
    machine leaves its input out of a round; the tests of stragglers ask for them."""
    env = {k: v for k, v in os.environ.items() if not is_launcher_var(k)}
    env.setdefault("BYZCOLL_STRAGGLERS", "0")
    env.update(extra)
    return env
