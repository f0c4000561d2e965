"""`encoderd`, the command (pyproject.toml's console script): `serve` (its flags: flags.py; the
configuration they make: configure.py), `gateway`, and `bench`, handed to the benchmark. Every
`serve` flag also reads an ENCODERD_* variable (for systemd EnvironmentFile=); a flag given on the
command line wins.
"""

from __future__ import annotations

import signal
import sys

from ...gateway.cli import run as run_gateway_command
from ...workers.contract.logs import configure_logging
from ...workers.contract.model_spec import ModelLoadError
from .configure import config_from_args
from .flags import build_parser


def _startup_errors() -> tuple[type[Exception], ...]:
    from ...gateway.envoy import GatewayError
    from ..base.startup import StartupError
    from ..scheduling.placement import PlacementError
    from ..scheduling.worker_client import WorkerStartError

    return StartupError, ModelLoadError, WorkerStartError, GatewayError, PlacementError


def _exit_cleanly_on_early_stop_signals() -> None:
    """SIGTERM or SIGHUP before the event loop takes them over (app.py, which drains): nothing is
    served yet, so exit 0 at once, as a stop while models load does, not die by the signal (143)."""

    def stop(signum, frame):
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from ...bench.runner import main as bench_main

        return bench_main(argv[1:], prog="encoderd bench")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except SystemExit as refused:  # a configuration refused in words: exit 2, as argparse's own refusals
            if not isinstance(refused.code, str):
                raise
            print(refused.code, file=sys.stderr)
            return 2
        configure_logging(config.log_level, config.log_format)
        _exit_cleanly_on_early_stop_signals()
        from ..scheduling.zygote_client import shared_zygote

        if zygote := shared_zygote(config):
            zygote.start()  # it imports torch and transformers while this process imports the frontend
        from .app import serve

        try:
            serve(config)
        except _startup_errors() as exc:
            # The operator's to fix (a port taken, a broken model, a dtype this hardware cannot run, a
            # failed fidelity self-check): one line that says why, not a traceback through the event
            # loop; the traceback only at --log-level debug.
            if config.log_level == "DEBUG":
                raise
            what = "cannot start " if type(exc).__name__ == "WorkerStartError" else ""  # it names the worker
            one_line = " ".join(str(exc).split())  # a library's message may run over several lines
            print(f"encoderd: {what}{one_line}", file=sys.stderr)
            return 2
    elif args.command == "gateway":
        return run_gateway_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
