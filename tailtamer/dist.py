"""Workers on torch.distributed: one process per worker, coordination state in the c10d store.

On one machine `tailtamer train` spawns `run.workers` local processes; across machines the
same worker code runs under `torchrun` (it reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
from the environment either way). Collectives use gloo between CPU workers and NCCL between
GPUs; the tensors they reduce live on the worker's device.

What goes through the store rather than collectives: each worker's state (BUSY while it
generates, TRAINING while it spot-trains the drafter, IDLE while it waits, DONE at the end),
and a per-step counter of workers whose rollout shard is finished. A worker that finishes
early polls that counter between drafter steps, which is how spot training is preempted
within one drafter step of the last rollout's end, without any RPC. The last worker to finish
also writes the wall-clock time it finished, so the others can measure their preemption
latency against it.

With one worker there is no process group: every collective below is the identity.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import sys
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from tailtamer.device import collective_backend
from tailtamer.errors import ConfigError, TailtamerError
from tailtamer.stopping import CLOSED_PIPE, Interrupted, StopRequest, exit_with_parent, stdout_closed

STATES = ("BUSY", "TRAINING", "IDLE", "DONE")


def torchrun_env(env) -> tuple[int, int, int]:
    """(WORLD_SIZE, RANK, LOCAL_RANK) of a torchrun-style environment, checked: (1, 0, 0)
    without WORLD_SIZE, and a group of one needs nothing else; a ConfigError that names what
    is missing or wrong otherwise (a stray WORLD_SIZE, a rank outside the group), and says how
    to run alone."""
    if not env.get("WORLD_SIZE"):
        return 1, 0, 0
    alone = "unset WORLD_SIZE to run on this machine alone (run.workers)"

    def whole(name: str, default: str | None = None) -> int:
        text = env.get(name) or default
        if text is None or not text.strip().isdigit():
            raise ConfigError(f"the environment sets WORLD_SIZE={env['WORLD_SIZE']} but "
                              + (f"{name}={text}, not a whole number" if text else f"not {name}")
                              + f": a worker of a torchrun group needs RANK, MASTER_ADDR and MASTER_PORT; {alone}")
        return int(text)

    world = whole("WORLD_SIZE")
    if world == 1:
        return 1, 0, whole("LOCAL_RANK", "0")
    rank = whole("RANK")
    if not env.get("MASTER_ADDR"):
        raise ConfigError(f"the environment sets WORLD_SIZE={world} but not MASTER_ADDR: a worker of a torchrun "
                          f"group needs it; {alone}")
    whole("MASTER_PORT")
    if not 0 <= rank < world:
        raise ConfigError(f"the environment sets RANK={rank}, outside a group of WORLD_SIZE={world} workers; {alone}")
    return world, rank, whole("LOCAL_RANK", str(rank))


class WorkerError(TailtamerError):
    """A worker failed or died; the message says which and where the last checkpoint is."""


class Workers:
    """This process's place in the worker group, and the few operations the RL step needs."""

    def __init__(self, rank: int = 0, world: int = 1, store: dist.Store | None = None,
                 device: torch.device = torch.device("cpu")):
        self.rank, self.world, self.store, self.device = rank, world, store, device
        self._calls: dict[str, int] = {}

    @classmethod
    def from_env(cls, timeout_s: float, device: torch.device = torch.device("cpu")) -> "Workers":
        """Join the group described by the torchrun-style environment (one worker without it),
        over NCCL when this worker runs on a GPU, gloo otherwise."""
        world, rank, _ = torchrun_env(os.environ)
        if world == 1:
            return cls(device=device)
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        except (RuntimeError, ValueError) as e:  # the store's own errors, one line of them
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            late = f" within run.dist_timeout_s={timeout_s:g} s" if isinstance(e, dist.DistStoreError) else ""
            raise WorkerError(f"worker {rank} of {world} could not join the group at {where}{late} ({first})") from None
        store.set_timeout(timeout)
        dist.init_process_group(collective_backend(device), store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world, timeout=timeout)
        return cls(rank, world, dist.PrefixStore("tailtamer", store), device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Leave the group in order, after a run that ended normally: everyone is done with
        collectives, then worker 0, whose process hosts the store, leaves last (a peer still
        talking to a store that is gone aborts its process)."""
        if self.world == 1:
            return
        self.set_state("DONE")
        # through the store: a rollout engine that shares the process group (vLLM) takes it
        # down with it when it shuts down
        self.wait_for_all("close")
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store.add("closed", 1)
        if self.is_main:
            while self.store.add("closed", 0) < self.world:
                time.sleep(0.01)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # --- data -----------------------------------------------------------------------------

    def shard(self, n: int) -> tuple[int, int]:
        """This worker's contiguous share [lo, hi) of n items (sizes differ by at most one).
        Contiguous, so global item indices (which key the sampling streams) stay lo + i."""
        return n * self.rank // self.world, n * (self.rank + 1) // self.world

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over workers (a new tensor)."""
        if self.world == 1:
            return x.clone()
        y = x.to(self.device, copy=True)
        dist.all_reduce(y)
        return y.to(x.device)

    def any(self, flag: bool) -> bool:
        """True on every worker if `flag` is true on any."""
        return bool(self.sum(torch.tensor(float(flag))).item() > 0)

    def gather(self, obj) -> list:
        """[obj of worker 0, obj of worker 1, ...] on every worker."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def share(self, make: Callable[[], object]):
        """Worker 0 computes `make()` (may take long: the base model's SFT), the others wait for
        it in the store, without the collective timeout."""
        if self.world == 1:
            return make()
        if self.is_main:
            value = make()
            self.store.set("shared", pickle.dumps(value))
            return value
        self.store.wait(["shared"], datetime.timedelta(hours=2))
        return pickle.loads(self.store.get("shared"))

    # --- the update -----------------------------------------------------------------------

    def reduce_gradients(self, params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
        """Sum every parameter's gradient (missing ones count as zero) and `extra` over the
        workers in one all-reduce; returns the summed `extra`. Data-parallel SGD by hand rather
        than the DDP wrapper: workers run different numbers of micro-batches (long-tailed
        lengths), which DDP's per-backward hooks would need Join for, and one flat all-reduce
        per optimizer step is all the communication a sum needs."""
        if self.world == 1:
            return extra
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params]
                         + [extra.float().flatten()])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).to(p.dtype)
            offset += n
        return flat[offset:].view_as(extra)

    def start_average(self, module: torch.nn.Module, weight: float) -> Callable[[], None]:
        """Make `module` identical on every worker: θ ← Σ_r w_r θ_r / Σ_r w_r with w_r the
        drafter steps worker r took this step (local-SGD averaging; a worker that did not train
        adds nothing, and if none trained nothing changes). This starts the all-reduce and
        returns the call that waits for it and writes the average in, so the transfer overlaps
        whatever runs in between (the update); `module` must not change meanwhile."""
        if self.world == 1:
            return lambda: None
        params = [p for p in module.parameters() if p.requires_grad]
        flat = torch.cat([p.detach().float().flatten() * weight for p in params]
                         + [torch.tensor([float(weight)], device=params[0].device)])
        work = dist.all_reduce(flat, async_op=True)

        def finish() -> None:
            work.wait()
            total = flat[-1].item()
            if total == 0:
                return
            offset = 0
            with torch.no_grad():
                for p in params:
                    n = p.numel()
                    p.copy_((flat[offset: offset + n] / total).view_as(p))
                    offset += n
        return finish

    # --- coordination state in the store --------------------------------------------------

    def set_state(self, state: str) -> None:
        assert state in STATES, state
        if self.store is not None:
            self.store.set(f"state/{self.rank}", state)

    def finish_rollout(self, step: int) -> None:
        """Count this worker's rollout shard of `step` as done; the last one stamps the time."""
        if self.store is None:
            return
        if self.store.add(f"rollout/{step}", 1) == self.world:
            self.store.set(f"rollout/{step}/end", repr(time.time()))

    def rollout_over(self, step: int) -> bool:
        """True once every worker has finished its rollout shard of `step` (non-blocking)."""
        return self.store is None or self.store.check([f"rollout/{step}/end"])

    def wait_rollout(self, step: int) -> float:
        """Block until every shard of `step` is done; the wall-clock time the last one ended.
        No timeout: the long tail may take hours, and only a worker's death (which stops the
        run) ends the wait otherwise."""
        if self.store is None:
            return time.time()
        key = f"rollout/{step}/end"
        self._poll(lambda: self.store.check([key]))
        return float(self.store.get(key))

    def wait_for_all(self, tag: str) -> None:
        """A barrier through the store, without the collective timeout: for work of unequal
        length (evaluation shards), so the collective after it returns at once."""
        if self.store is None:
            return
        self._calls[tag] = n = self._calls.get(tag, 0) + 1
        key = f"arrived/{tag}/{n}"
        self.store.add(key, 1)
        self._poll(lambda: self.store.add(key, 0) >= self.world)

    @staticmethod
    def _poll(done: Callable[[], bool]) -> None:
        pause = 0.0005
        while not done():
            time.sleep(pause)
            pause = min(0.002, pause * 2)


def resolve_workers(requested: int, prompts_per_step: int, gpus: int = 0) -> int:
    """`run.workers`: 0 = one per GPU when the run is on GPUs (`gpus` of them), else one per
    CPU core; never more than there are prompts to shard."""
    n = requested or gpus or (os.cpu_count() or 1)
    return max(1, min(n, prompts_per_step))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, launcher: int, entry: Callable, args: tuple, results) -> None:
    exit_with_parent(launcher)
    # A tqdm bar (torch.compile's tracing makes one) would create a multiprocessing lock, which
    # the os._exit below leaves to the launcher's resource tracker to warn about.
    tqdm.set_lock(threading.RLock())
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        value = entry(*args)
    except Interrupted as e:  # stopped by Ctrl-C or SIGTERM between steps: a clean end, not a failure
        results.put(("interrupted", rank, (str(e), e.by)))
        value = None
    except KeyboardInterrupt:  # a second Ctrl-C: the launcher stops everyone and says so
        os._exit(130)
    except BaseException as e:  # one line for the launcher, in the order the workers failed
        message = str(e) if isinstance(e, TailtamerError) else f"{type(e).__name__}: {e}"
        if isinstance(e, BrokenPipeError) and stdout_closed():  # `| head` ended: not the worker's failure
            message = CLOSED_PIPE
        results.put(("error", rank, message))
        _exit(1)
    if rank == 0 and value is not None:
        results.put(("ok", rank, value))  # written to the pipe before put returns
    _exit(0)


def _exit(code: int) -> None:
    # Skip interpreter teardown: destroying the c10d store's threads at exit can abort a
    # worker (std::terminate), which the launcher would report as a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# After a worker fails, how long the others get to end on their own (they fail in their next
# collective, or finish the checkpoint a stop writes) before they are killed.
FAILURE_GRACE_S = 30.0


def spawn(world: int, entry: Callable, args: tuple, resume_note: Callable[[], str]):
    """Run `entry(*args)` in `world` local worker processes and return worker 0's result. If
    one raises or dies, the others get FAILURE_GRACE_S to end, then are killed, and a
    WorkerError says which failed first and why, and `resume_note()` what is left to resume
    (checkpoints are written atomically, so the last one stays valid). A SIGTERM to this
    process is passed on to the workers, which stop after their step, as with Ctrl-C."""
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    # When a failed worker's process (the store's host) is gone, a peer's store client logs a
    # C++ stack trace as a warning; the launcher says which worker failed and why in one line.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    results = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_spawned, args=(world, _free_port(), os.getpid(), entry, args, results),
                               nprocs=world, join=False, start_method="spawn").processes
    value, errors, interrupted = None, [], {}

    def drain():
        nonlocal value
        while not results.empty():
            kind, rank, payload = results.get()
            if kind == "ok":
                value = (payload,)
            elif kind == "interrupted":
                interrupted[rank] = payload
            else:
                errors.append((rank, payload))

    def pass_on_sigterm():  # idempotent in the workers, so a SIGTERM to the whole group is one stop
        for process in procs:
            if process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:  # it ended in between
                    pass

    failed_at, killed = None, []
    with StopRequest(on_term=pass_on_sigterm) as stop:
        try:
            while any(process.exitcode is None for process in procs):
                wait([process.sentinel for process in procs if process.exitcode is None], timeout=0.5)
                drain()
                if failed_at is None and any(process.exitcode not in (None, 0) for process in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                    killed = [rank for rank, process in enumerate(procs) if process.is_alive()]
                    _kill(procs)
        except KeyboardInterrupt:  # a second Ctrl-C
            _kill(procs)
            raise Interrupted(f"stopped at once by a second Ctrl-C; {resume_note()}") from None
    drain()
    if failed_at is not None:
        codes = [None if rank in killed else process.exitcode for rank, process in enumerate(procs)]
        raise _failure(codes, errors, stop.reason, resume_note())
    if interrupted:  # in the launcher's words where the signal came to it
        stopped = Interrupted(*(interrupted.get(0) or next(iter(interrupted.values()))))
        raise stopped.stopped_by(stop.reason) if stop.reason else stopped
    if value is None:
        raise WorkerError("worker 0 ended without a result")
    return value[0]


def _kill(procs) -> None:
    for process in procs:
        if process.is_alive():
            process.kill()
    for process in procs:
        process.join()


def _failure(codes: list, errors: list, stopped_by: str | None, resume: str) -> TailtamerError:
    """What to report when workers failed: `codes` are their exit codes (None: killed by the
    launcher once the others had failed), `errors` the messages they sent, in the order they
    failed. A worker killed outright makes its peers fail in their next collective, so the dead
    one is the cause; a stop before the workers' steps began (they die of the signal) is a
    stop, not a failure: the launcher's `stopped_by`, whatever signal passed it on (a Ctrl-C
    to the launcher reaches the workers as SIGTERM)."""
    stop_codes = {130: "Ctrl-C", -signal.SIGINT: "Ctrl-C", -signal.SIGTERM: "SIGTERM"}
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and (code not in stop_codes or stopped_by is None):
            return _died(rank, code, resume)
    stops = [stop_codes[code] for code in codes if code in stop_codes]
    if stops:  # the peers' errors (a collective without them) are its consequence
        return Interrupted(f"stopped by {stopped_by or stops[0]}; {resume}", stopped_by or stops[0])
    if errors:
        rank, message = errors[0]
        return WorkerError(f"worker {rank}: {message}")
    rank = next(r for r, code in enumerate(codes) if code not in (None, 0))
    return _died(rank, codes[rank], resume)


def _died(rank: int, exit_code: int, resume: str) -> WorkerError:
    reason = f"killed by {signal.Signals(-exit_code).name}" if exit_code < 0 else f"exit code {exit_code}"
    return WorkerError(f"worker {rank} died ({reason}); the other workers were stopped; {resume}")
