"""The worker process: load a backend, then compute batches until told to stop.

Started by the frontend with multiprocessing's `spawn` method. Threads:
  * receiver: socket -> decode -> inbox (releases the GIL while waiting), so the
    next batch is decoded while the current one computes;
  * main: inbox -> backend.forward -> result socket;
  * urgent (where the backend computes on one CPU thread, Backend.urgent_lane): urgent
    (interactive) batches, computed beside main's bulk batch. Main then runs BULK_LANE_NICE
    nicer (and SCHED_IDLE where the workers run nicer than the frontend: _lower_bulk_lane), so
    the kernel gives the core to a query at once and for most of its compute, and the bulk
    batch loses only the cycles the query used. Elsewhere (GPU, several
    intra-op threads: one lane) urgent batches go first, and run in the pauses of a bulk batch
    computed in steps (the torch padding-free forward pauses after each layer), cut into
    sub-batches whose steps take about twice as long as an urgent batch does here
    (workers/pacing.py): a live query waits a bounded multiple of its own compute;
  * parent watch: exits the process when the frontend is gone;
  * heartbeat: tells the frontend every HEARTBEAT_INTERVAL that this process is alive, on its
    own socket (ZeroMQ sockets are not thread-safe), while main computes too. A worker that
    stops beating (stopped, deadlocked, stuck holding the GIL) is killed by the frontend.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import threading
import time

import msgspec
import zmq

from . import fidelity, memory, pacing
from .backends import create_backend
from .contract import ipc, protocol
from .contract.config import WorkerConfig
from .contract.errors import ErrorCode, WorkerError
from .contract.hardware import UnsupportedOnHardware
from .contract.logs import configure_logging
from .contract.tokenizer import tokenizer_json
from .st_modules import SentenceModules

log = logging.getLogger("encoderd.worker")

# With two lanes the bulk thread runs this much nicer than the urgent one, so the kernel hands the
# core to a query at once and for most of its compute. `python -m encoderd.bench.mixed --seconds 10`,
# 2 workers x 1 thread on 2 Zen 5 cores, quiet host, 2 runs each: query p95 under a saturating
# stream 13.9-15.0 ms at +5, 15.4-17.9 ms at +0 (idle 6.4-8.4), the stream 0.86-0.90 of its solo
# throughput either way; +9 took the stream down to 0.83.
BULK_LANE_NICE = 5


def _watch_parent(parent_pid: int, addresses: tuple[str, ...]) -> None:
    # A worker never outlives its frontend, however the frontend died (even SIGKILL); nor do
    # the socket files the frontend could not remove.
    while os.getppid() == parent_pid:
        time.sleep(0.25)
    ipc.remove_ipc_files(*addresses, with_directory=True)
    os._exit(3)


def _beat(ctx: zmq.Context, address: str, interval: float) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # beats are worthless once late: never queue many
    sock.connect(address)
    beat = protocol.encode_control(protocol.WorkerHeartbeat(os.getpid()))
    while True:
        try:
            sock.send_multipart(beat, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the frontend is not reading; it will notice the silence, not a queue of beats
        except zmq.ContextTerminated:
            return
        time.sleep(interval)


def _quiet_multiprocessing_locks() -> None:
    """tqdm (transformers' "Loading weights" bar) makes a multiprocessing RLock: a named
    semaphore registered with the frontend's resource tracker, which a killed worker never
    unregisters ("leaked semaphore objects" at shutdown). A thread lock is all a worker needs."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


class Inbox:
    """Received batches, urgent and bulk, each in arrival order; bulk-lane batches marked
    `ahead_of_bulk` (a split request's) go before the bulk batches queued (the scheduler sends a
    bulk batch ahead while no live work is around). Taken by one lane (`get`: urgent first) or by two
    (`get_urgent` and `get_bulk`, one thread each)."""

    def __init__(self):
        self._urgent: collections.deque = collections.deque()
        self._ahead: collections.deque = collections.deque()
        self._bulk: collections.deque = collections.deque()
        # One lock, a condition per kind of taker: a query wakes the urgent lane (or the one lane)
        # only. With one condition notify_all also woke the idle bulk lane twice a query (its wake
        # and the lock it then waited for), to find nothing for it.
        lock = threading.Lock()
        self._lock = lock
        self._urgent_arrived = threading.Condition(lock)
        self._bulk_arrived = threading.Condition(lock)
        self._any_arrived = threading.Condition(lock)

    def put(self, batch) -> None:
        urgent = isinstance(batch, protocol.TokenBatch) and batch.urgent  # media batches are never urgent
        queue = self._urgent if urgent else self._ahead if batch.ahead_of_bulk else self._bulk
        with self._lock:
            queue.append(batch)
            (self._urgent_arrived if urgent else self._bulk_arrived).notify()
            self._any_arrived.notify()

    def get(self):
        return self._wait_and_pop(self._any_arrived, self._urgent, self._ahead, self._bulk)

    def get_urgent(self):
        return self._wait_and_pop(self._urgent_arrived, self._urgent)

    def get_bulk(self):
        return self._wait_and_pop(self._bulk_arrived, self._ahead, self._bulk)

    @staticmethod
    def _wait_and_pop(arrived: threading.Condition, *queues: collections.deque):
        """The first batch of the first non-empty queue, waiting for one to arrive."""
        with arrived:
            arrived.wait_for(lambda: any(queues))
            return next(q for q in queues if q).popleft()

    def empty(self) -> bool:
        return not (self._urgent or self._ahead or self._bulk)

    def take_urgent(self):
        """The next urgent batch, or None without waiting."""
        with self._lock:
            return self._urgent.popleft() if self._urgent else None


def _receive_loop(sock: zmq.Socket, inbox: Inbox) -> None:
    while True:
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.ContextTerminated:
            return
        _, header, rest = protocol.decode(frames)
        if isinstance(header, protocol.BatchHeader):
            inbox.put(protocol.batch_from_frames(header, rest))


def run_worker(config: WorkerConfig, parent_pid: int) -> None:
    """Process entry point (must be importable for `spawn`)."""
    configure_logging(config.log_level, config.log_format, worker=config.label)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when we stop
    if config.nice:  # before this starts threads of its own: they inherit it
        _nice_every_thread(config.nice)
    if config.cpu_affinity:
        os.sched_setaffinity(0, config.cpu_affinity)
    if config.options.device == "cpu":
        # OpenMP threads that spin between parallel regions collapse when a core is shared (with
        # the frontend, a replica, anything); sleeping waiters cost little. Set before torch loads.
        if "GOMP_SPINCOUNT" not in os.environ:  # an operator's own spin setting wins
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        memory.bound_kernel_caches()  # shape-keyed oneDNN caches: see workers/memory.py
        if not memory.keep_freed_memory():  # before the first batch: its activations stay for the next
            log.debug("freed activations go back to the kernel after each batch (mallopt refused)")
    threading.Thread(
        target=_watch_parent,
        args=(parent_pid, (config.batch_address, config.result_address)),
        name="parent-watch",
        daemon=True,
    ).start()
    _quiet_multiprocessing_locks()

    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(config.result_address)
    try:
        backend, check = _load(config)
        modules = SentenceModules(config.spec)  # Dense layers after pooling, for every engine
        tokenizer = tokenizer_json(config.spec.path, config.spec.lowercase, backend.options.trust_remote_code)
    except Exception as exc:
        if isinstance(exc, UnsupportedOnHardware):  # a refusal, not a bug: its message is the whole story
            log.error("model load refused: %s", exc)
        elif not isinstance(exc, fidelity.LowFidelity):  # that one has logged its one clear line
            # One line, as every start-up failure; the traceback at --log-level debug only.
            log.error("model load failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        results.send_multipart(
            protocol.encode_control(protocol.WorkerFatal(os.getpid(), f"{type(exc).__name__}: {exc}"))
        )
        results.close()
        raise SystemExit(2) from exc

    inbox = Inbox()
    batch_socket = ctx.socket(zmq.PULL)
    batch_socket.connect(config.batch_address)
    threading.Thread(target=_receive_loop, args=(batch_socket, inbox), name="receiver", daemon=True).start()
    if config.heartbeat_interval > 0:  # from READY on: loading has its own (start) timeout
        threading.Thread(
            target=_beat, args=(ctx, config.result_address, config.heartbeat_interval), name="heartbeat", daemon=True
        ).start()
    trimmer = memory.HeapTrimmer()  # freed heap pages go back to the OS: see workers/memory.py
    lanes = config.urgent_lane and backend.urgent_lane
    if lanes:  # before READY: from then on batches come
        threading.Thread(
            target=_urgent_lane,
            args=(backend, modules, inbox, ctx.socket(zmq.PUSH), config.result_address, trimmer),
            name="urgent",
            daemon=True,
        ).start()
        _lower_bulk_lane(config.nice)  # after starting the urgent lane: it keeps ours
    results.send_multipart(
        protocol.encode_control(
            protocol.WorkerReady(
                # The backend's own engine/options: `auto` engine and dtype are resolved by then.
                os.getpid(),
                modules.output_dim(backend.output_dim),
                backend.engine,
                backend.options.device,
                backend.options.dtype,
                backend.is_padded,
                check.status,
                check.figures,
                lanes,
                tokenizer,
                check.tokens_per_s,
            )
        )
    )
    take, paced = (inbox.get_bulk, None) if lanes else (inbox.get, pacing.Pacer())
    while True:
        _compute_and_reply(backend, modules, take(), inbox, results, paced)
        trimmer.after_batch(idle=inbox.empty())


def _nice_every_thread(by: int) -> None:
    # Nice values are per thread on Linux, and a spawned worker is not alone when it gets here:
    # unpickling its config imported torch, which starts a thread of its own.
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            _renice(tid, by)


def _renice(tid: int, by: int) -> None:
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))


def _lower_bulk_lane(worker_nice: int) -> None:
    """This (the bulk) thread yields its core to the urgent lane: BULK_LANE_NICE nicer, and
    SCHED_IDLE where the workers already yield to the frontend (--worker-nice > 0, the default).

    SCHED_IDLE: a waking urgent lane preempts the bulk thread at once and keeps the whole core (at
    nice +5 it got 3/4 of it). `python -m encoderd.bench.mixed --seconds 10`, same host (Zen 5,
    2 vCPUs): query p95 under the stream 11.4-13.1 ms over six runs (mean 12.5; 1.71-2.14x idle)
    against 12.7-14.8 ms at nice +5 alone (mean 13.8); the stream 0.87-0.91 of its solo
    throughput either way. Not with --worker-nice 0, which asks that workers not yield to
    other busy services: a SCHED_IDLE thread gets a core only when no other process wants it, and
    without privilege it can never leave SCHED_IDLE.
    """
    # Linux nice values and policies are per thread; threads this one starts from now on inherit them.
    _renice(threading.get_native_id(), BULK_LANE_NICE)
    if worker_nice > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # a sandbox that forbids it: the nice value alone
            log.info("the bulk lane keeps SCHED_OTHER: %s", exc)


def _urgent_lane(backend, modules, inbox: Inbox, results: zmq.Socket, address: str, trimmer) -> None:
    """Urgent batches, computed as they arrive, beside whatever bulk batch main computes. Its own
    result socket: ZeroMQ sockets are not thread-safe."""
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(address)
    while True:
        _compute_and_reply(backend, modules, inbox.get_urgent(), inbox, results, None)
        trimmer.after_batch(idle=inbox.empty())


def _load(config: WorkerConfig) -> tuple:
    """The loaded, warmed-up backend and its fidelity report (fidelity.LowFidelity: not servable)."""
    started = time.perf_counter()
    log.info(
        "loading %s from %s (engine=%s device=%s dtype=%s)",
        config.spec.name,
        config.spec.path,
        config.engine,
        config.options.device,
        config.options.dtype,
    )
    # The float32 reference first: its copy of the weights is gone before the served one loads.
    prepared = fidelity.prepare_reference(config.spec, config.options)
    backend = create_backend(config.engine, config.spec, config.options)
    backend.load()
    log.info("loaded in %.1fs; warming up", time.perf_counter() - started)
    warm_start = time.perf_counter()
    backend.warmup(config.spec.max_length)
    log.info("warm-up done in %.1fs", time.perf_counter() - warm_start)
    # A dtype the server chose itself (--dtype auto) that fails the check falls back to float32;
    # one the operator named is refused (LowFidelity) or, with --allow-low-fidelity, served.
    chosen = config.options.dtype == "auto" and backend.options.dtype != "float32"
    fallback = "float32" if chosen else ""
    check = fidelity.self_check(backend, config.spec, config.allow_low_fidelity, fallback, prepared)
    if chosen and check.status == fidelity.LOW:
        del backend
        return _load(msgspec.structs.replace(config, options=msgspec.structs.replace(config.options, dtype="float32")))
    log.info("ready")
    return backend, check


def is_out_of_memory(exc: Exception) -> bool:
    """torch.cuda.OutOfMemoryError, or an engine's allocation failure, without importing the engine.
    torch on CPU says "DefaultCPUAllocator: can't allocate memory" where an address-space limit
    (ulimit -v, RLIMIT_AS) refuses a batch's buffers: that batch is halved like a GPU's."""
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or any(
        sign in text for sign in ("out of memory", "failed to allocate", "can't allocate memory")
    )


def error_code(exc: Exception) -> ErrorCode:
    """What a failed batch tells the frontend (server/base/errors.py maps it to a gRPC status)."""
    if isinstance(exc, WorkerError):
        return exc.code
    return ErrorCode.OUT_OF_MEMORY if is_out_of_memory(exc) else ErrorCode.INTERNAL


def forward_halving_on_oom(backend, batch: protocol.TokenBatch):
    """backend.forward, halving the batch on device out-of-memory instead of failing its requests."""
    try:
        return backend.forward(batch)
    except Exception as exc:
        if batch.size == 1 or not is_out_of_memory(exc):
            raise
        log.warning("out of device memory on a batch of %d; computing it in halves", batch.size)
        backend.release_memory()
        return protocol.join_outputs([forward_halving_on_oom(backend, half) for half in batch.split(batch.size // 2)])


def _compute_and_reply(
    backend, modules: SentenceModules, batch, inbox: Inbox, results: zmq.Socket, pacer: pacing.Pacer | None
) -> None:
    """Compute one batch and send its result (or its error: one bad batch fails its requests,
    not the worker). `pacer`: bulk batches run in paced steps, urgent batches in their pauses;
    None: each batch in one go (two lanes, or a batch run in a pause)."""
    started = time.perf_counter_ns()
    try:
        if isinstance(batch, protocol.MediaBatch):
            output = backend.forward_media(batch)
        elif batch.urgent or pacer is None:
            output = modules(forward_halving_on_oom(backend, batch))
            if pacer is not None:
                pacer.timed_urgent((time.perf_counter_ns() - started) / 1e9)
        else:
            output = modules(_forward_yielding(backend, modules, batch, inbox, results, pacer))
    except Exception as exc:
        log.exception("batch %d failed", batch.batch_id)
        code = error_code(exc)
        message = str(exc) if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"
        results.send_multipart(protocol.encode_error(batch.batch_id, message, code))
        return
    results.send_multipart(protocol.encode_result(batch.batch_id, output, time.perf_counter_ns() - started), copy=False)


def _forward_yielding(
    backend,
    modules: SentenceModules,
    batch: protocol.TokenBatch,
    inbox: Inbox,
    results: zmq.Socket,
    pacer: pacing.Pacer,
):
    """A bulk batch in sub-batches (pacer.cut), each in timed steps; at each pause, the urgent
    batches that arrived meanwhile run first."""
    try:
        parts = pacer.cut(batch)
        return protocol.join_outputs([_steps(backend, modules, part, inbox, results, pacer) for part in parts])
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        return forward_halving_on_oom(backend, batch)  # from the start, halving the batch as needed


def _steps(
    backend,
    modules: SentenceModules,
    batch: protocol.TokenBatch,
    inbox: Inbox,
    results: zmq.Socket,
    pacer: pacing.Pacer,
):
    steps = backend.forward_in_steps(batch)
    tokens, paused = len(batch.input_ids), False
    try:
        while True:
            started = time.perf_counter()
            try:
                next(steps)
            except StopIteration as done:
                if not paused:  # an engine without pause points: its one step is the whole forward
                    pacer.timed_step(tokens, time.perf_counter() - started)
                return done.value
            paused = True
            pacer.timed_step(tokens, time.perf_counter() - started)
            while (urgent := inbox.take_urgent()) is not None:
                _compute_and_reply(backend, modules, urgent, inbox, results, pacer)
    finally:
        steps.close()
