"""Fault-tolerant robust training: torchft decides who is in each step, byzcoll aggregates.

torchft's lighthouse and ``Manager`` form a quorum of replicas at every step, leave out a replica
that died and let a restarted one back in, handing it the model state of a healthy replica
(torchft's checkpoint transport). byzcoll's process group (:class:`byzcoll.torch.ProcessGroupByzcoll`)
is the Manager's process group: at each quorum change torchft calls its ``configure``, which
joins a fresh byzcoll communicator of exactly that quorum, and the step's gradient is the
coordinate-wise median over it, so a Byzantine replica (``--byzantine``) moves nothing.

    python examples/python/torchft_train.py --replicas 4 --steps 80 --kill-at 15

starts a lighthouse and 4 replicas on 127.0.0.1, SIGKILLs replica 1 once it reaches step 15 and
starts it again, and prints one JSON line per replica at the end (step, final loss, a digest of
the parameters, whether it was restarted). The pattern in each replica::

    manager.start_quorum()                      # may reconfigure the process group, or heal
    loss.backward()
    pg.robust_all_reduce(flat_grads, "median", f=1)
    if manager.should_commit():                 # every replica agrees the step went through
        opt.step()

A step whose robust round fails (``TooManyFaults``, ...) is reported to the Manager
(``report_error``), so no replica commits it. The replica that returns is the application's
business as in any torchft job: here torchft's HTTP transport gives it the model and optimizer
state of a replica that was in the last quorum.

Everything binds to and is reached on 127.0.0.1. torchft 0.2.0 binds its manager server and
its HTTP checkpoint server to all interfaces and offers no setting for either, so each replica
wraps the two classes torchft builds them from (`loopback_only`) to bind them to 127.0.0.1;
torch's `TCPStore` server gets a socket already bound to 127.0.0.1 (`master_listen_fd`).
"""

import argparse
import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch

LOOPBACK = "127.0.0.1"


def data(replica, width=8):
    g = torch.Generator().manual_seed(1000 + replica)
    x = torch.randn(64, width, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5


def net(width=8, hidden=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def digest(model):
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def loopback_only():
    """Makes torchft bind its manager server and HTTP checkpoint server to 127.0.0.1 (it binds
    both to every interface, `[::]`, with no setting to choose): wraps the classes that
    `torchft.manager` and `torchft.checkpointing.http_transport` build them from."""
    import socket
    from http.server import ThreadingHTTPServer

    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager

    server = manager.ManagerServer

    def manager_server(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[1]
        return server(**{**kwargs, "bind": f"{LOOPBACK}:{port}"})

    class LoopbackHTTPServer(ThreadingHTTPServer):
        address_family = socket.AF_INET
        request_queue_size = 1024

        def __init__(self, address, handler):
            super().__init__((LOOPBACK, address[1]), handler)

    manager.ManagerServer = manager_server
    http_transport._IPv6HTTPServer = LoopbackHTTPServer


def replica(args):
    """One replica group of one process: its own store, a Manager, the robust step."""
    import torch.distributed as dist
    from torchft import Manager
    from torchft.checkpointing.http_transport import HTTPTransport

    import byzcoll
    import byzcoll.torch as bt

    class LoopbackHTTPTransport(HTTPTransport):
        """torchft's HTTP checkpoint transport, advertised on 127.0.0.1 (it names the host
        name, whose address is not loopback)."""

        def address(self):
            return f"http://{LOOPBACK}:{self._server.socket.getsockname()[1]}/checkpoint/"

    loopback_only()
    torch.set_num_threads(1)
    # The Manager's store, listening on 127.0.0.1 only (a socket bound here, handed over).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen(1024)
    store = dist.TCPStore(
        LOOPBACK, listener.getsockname()[1], is_master=True, wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pg = bt.ProcessGroupByzcoll(step_timeout_ms=args.step_timeout_ms)
    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=pg,
        min_replica_size=args.min_replicas,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=LOOPBACK,
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        hostname=LOOPBACK,
        checkpoint_transport=LoopbackHTTPTransport(timeout=timeout, num_chunks=0),
    )
    x, y = data(args.replica)
    with torch.no_grad():
        initial = ((model(x) - y) ** 2).mean().item()
    byzantine = args.replica in args.byzantine
    failed, loss = 0, None
    while manager.current_step() < args.steps:
        manager.start_quorum()
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        if byzantine:
            flat.mul_(-10.0)
        try:
            pg.robust_all_reduce(flat, "median", f=args.f)
        except byzcoll.Error as e:  # this step is not committed anywhere
            failed += 1
            manager.report_error(e)
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        if manager.should_commit():
            opt.step()
        time.sleep(args.step_ms / 1000)  # the rest of a real step's work
        print(f"step {manager.current_step()} quorum {pg.size()} generation {pg.generation}", flush=True)
    with torch.no_grad():
        final = ((model(x) - y) ** 2).mean().item()
    print(
        json.dumps(
            {
                "replica": args.replica,
                "byzantine": byzantine,
                "restarted": args.restarted,
                "step": manager.current_step(),
                "initial_loss": initial,
                "loss": final,
                "params": digest(model),
                "failed_rounds": failed,
                "generations": pg.generation,
            }
        ),
        flush=True,
    )
    manager.shutdown(wait=False)


def launch(args):
    """The lighthouse and the replicas; kills one and restarts it; prints their results."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind=f"{LOOPBACK}:0", min_replicas=args.min_replicas, join_timeout_ms=1000, heartbeat_timeout_ms=2000
    )
    env = {**os.environ, "BYZCOLL_TCP_ADDR": LOOPBACK, "OMP_NUM_THREADS": "1"}
    # The lighthouse gives its address under the host's name; the replicas reach it on loopback.
    address = f"http://{LOOPBACK}:{lighthouse.address().rsplit(':', 1)[1]}"

    def start(r, restarted=False):
        argv = [sys.executable, os.path.abspath(__file__), "--replica", str(r), "--lighthouse", address]
        argv += ["--steps", str(args.steps), "--f", str(args.f), "--min-replicas", str(args.min_replicas)]
        argv += ["--step-timeout-ms", str(args.step_timeout_ms), "--step-ms", str(args.step_ms)]
        argv += [a for b in args.byzantine for a in ("--byzantine", str(b))]
        argv += ["--restarted"] if restarted else []
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)

    lines = queue.Queue()

    def follow(r, p):
        for text in p.stdout:
            lines.put((r, p, text.rstrip("\n")))
        lines.put((r, p, None))

    def run(r, restarted=False):
        p = start(r, restarted)
        threading.Thread(target=follow, args=(r, p), daemon=True).start()
        return p

    procs = {r: run(r) for r in range(args.replicas)}
    results, killed = {}, args.kill_at is None
    deadline = time.monotonic() + args.deadline_s
    try:
        while procs and time.monotonic() < deadline:
            try:
                r, p, text = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if procs.get(r) is not p:
                continue  # the killed process's last words
            if text is None:
                p.wait()
                del procs[r]
            elif text.startswith("{"):
                results[r] = json.loads(text)
            elif not killed and r == args.kill and text.startswith("step ") and int(text.split()[1]) >= args.kill_at:
                p.send_signal(signal.SIGKILL)
                p.wait()
                print(f"killed replica {r} at step {text.split()[1]}", flush=True)
                killed = True
                time.sleep(args.down_s)
                procs[r] = run(r, restarted=True)
                print(f"restarted replica {r}", flush=True)
    finally:
        for p in procs.values():
            p.kill()
        lighthouse.shutdown()
    for r in sorted(results):
        print(json.dumps(results[r]), flush=True)
    return 0 if len(results) == args.replicas and killed else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--step-ms", type=float, default=100.0, help="other work per step (ms)")
    ap.add_argument("--f", type=int, default=1, help="Byzantine replicas the median tolerates")
    ap.add_argument("--min-replicas", type=int, default=3)
    ap.add_argument("--kill", type=int, default=1, help="the replica to SIGKILL and restart")
    ap.add_argument("--kill-at", type=int, default=None, help="kill it once it reaches this step")
    ap.add_argument("--down-s", type=float, default=1.0, help="seconds before it restarts")
    ap.add_argument("--byzantine", type=int, action="append", default=[], help="a replica that lies")
    ap.add_argument("--step-timeout-ms", type=int, default=3000)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    # one replica (started by the launcher)
    ap.add_argument("--replica", type=int, default=None)
    ap.add_argument("--lighthouse", default=None)
    ap.add_argument("--restarted", action="store_true")
    args = ap.parse_args()
    if args.replica is not None:
        replica(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
