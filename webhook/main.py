"""``gpuhealth-webhook``: the command line entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import resource
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import prometheus_client
from aiohttp import web
from gpuhealth.webhook import stores
from gpuhealth.webhook.app import METRICS, SECURITY_HEADERS, create_app
from gpuhealth.webhook.auth import Authenticator, AuthSetupError
from gpuhealth.webhook.backends import Backend, create_backend
from gpuhealth.webhook.config import Config, ConfigError, TLSConfig, load_config, parse_listen
from gpuhealth.webhook.connections import LimitedRunner, effective_limit

log = logging.getLogger("gpuhealth.webhook")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhealth-webhook",
        description="Receive Alertmanager notifications and drain, requeue, reset or reboot GPU nodes, "
                    "behind guardrails (dry-run, circuit breaker, cooldown, rate limit, approval). "
                    "Flags override the config file.",
    )
    parser.add_argument("--config", required=True, type=Path, metavar="FILE",
                        help="YAML configuration (see webhook/config.example.yaml)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="address to serve on (default 0.0.0.0:9836)")
    parser.add_argument("--dry-run", action="store_true",
                        help="journal and log what would be done, change nothing on the cluster")
    parser.add_argument("--token-file", type=Path, metavar="FILE",
                        help="bearer token that callers must present (default <state-dir>/token, created "
                             "on first start)")
    parser.add_argument("--state-dir", type=Path, metavar="DIR", help="where the SQLite journal lives")
    parser.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    return parser


def _overrides(config: Config, args: argparse.Namespace) -> Config:
    changes: dict[str, Any] = {}
    if args.listen:
        parse_listen(args.listen)
        changes["listen"] = args.listen
    if args.dry_run:
        changes["dry_run"] = True
    if args.state_dir:
        changes["state_dir"] = args.state_dir.resolve()
    if args.token_file:
        changes["auth"] = config.auth.model_copy(update={"token_file": args.token_file.resolve(),
                                                         "disabled": False})
    return config.model_copy(update=changes)


def _ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def load(args: argparse.Namespace) -> tuple[Config, Backend]:
    """Config and backend, with every problem of both in one ``ConfigError``."""
    built: list[Backend] = []

    def check_backend(section: dict[str, Any]) -> list[str]:
        try:
            built.append(create_backend(section))
        except ValueError as exc:
            return [str(exc)]
        return []

    config = load_config(args.config, check_backend)
    try:
        config = _overrides(config, args)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    return config, built[0]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prometheus_client.disable_created_metrics()  # *_created series only double the exposition
    configure_logging(args.verbose)
    try:
        config, backend = load(args)
        context = _ssl_context(config.tls) if config.tls else None
        if args.check_config:
            print(f"configuration OK (backend {backend.name}, dry_run {config.dry_run})")
            return 0
        Authenticator.from_config(config)  # creates the default token on first start
        stores.check(config)
    except (ConfigError, AuthSetupError, OSError, ssl.SSLError, stores.StoreUnavailable) as exc:
        print(f"gpuhealth-webhook: {exc}", file=sys.stderr)
        return 2
    files = _raise_file_limit()
    logging.getLogger("asyncio").addFilter(_AcceptErrors())
    limit = effective_limit(config.connection_limit, files)
    if limit < config.connection_limit:
        log.warning("event=connection_limit_lowered configured=%d limit=%d open_files_limit=%d",
                    config.connection_limit, limit, files)
    log.info("event=listening host=%s port=%d tls=%s open_files_limit=%d connection_limit=%d idle_timeout=%g",
             config.listen_host, config.listen_port, context is not None, files, limit,
             config.connection_idle_timeout_seconds)
    try:
        with contextlib.suppress(web.GracefulExit, KeyboardInterrupt):
            asyncio.run(_serve(create_app(config, backend=backend), config, context, limit))
    except CannotListen as exc:
        print(f"gpuhealth-webhook: {exc}", file=sys.stderr)
        return 2
    return 0


LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def configure_logging(verbose: bool) -> None:
    """One-line records on stderr. ``LOG_FORMAT`` names no thread, process or source line: not
    gathering them (the caller lookup walks the stack on every record) makes every line, one per
    notification, cheaper, as the logging HOWTO's "Optimization" section advises."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # the HOWTO's documented switch for the caller lookup


def _escaped(text: str) -> str:
    """Control, format and escape characters as Python writes them in a string literal."""
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class OneLineFormatter(logging.Formatter):
    """Whatever a message holds (a value logged with %s, an exception's text from a backend or a
    library), it stays one line without terminal escapes; a traceback's lines are indented under it.
    So no value can forge a log line or rewrite an operator's terminal."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return _escaped(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return "  " + "\n  ".join(_escaped(line) for line in super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "  " + "\n  ".join(_escaped(line) for line in stack_info.splitlines())


class CannotListen(Exception):
    """The listening socket could not be opened; the message says where and why."""


async def _serve(app: web.Application, config: Config, context: ssl.SSLContext | None, limit: int) -> None:
    """``web.run_app`` with a ``LimitedRunner``: serve until SIGTERM or SIGINT, then shut down cleanly."""
    refused = app[METRICS].connections_refused
    runner = LimitedRunner(app, limit=limit, on_refused=lambda which: refused.labels(which).inc(),
                           security_headers=SECURITY_HEADERS, handle_signals=True, access_log=None,
                           keepalive_timeout=config.connection_idle_timeout_seconds)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, config.listen_host, config.listen_port, ssl_context=context).start()
        except OSError as exc:  # a host that does not resolve, a port in use or not ours to bind
            raise CannotListen(f"cannot serve on {config.listen}: {exc.strerror or exc}") from None
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class _AcceptErrors(logging.Filter):
    """When descriptors run out, asyncio logs a traceback for every refused accept() and for every
    retry it schedules (hundreds a second, and a burst at shutdown); keep one line per ``interval``
    seconds, with the count of those left out."""

    PREFIXES = ("socket.accept() out of system resource",
                "Exception in callback BaseSelectorEventLoop._start_serving")

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self.last = float("-inf")
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.PREFIXES):
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.left_out += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg, record.args, record.exc_info, record.exc_text = (
            "event=accept_failed error=%r left_out=%d (out of descriptors: raise LimitNOFILE or lower "
            "connection_idle_timeout_seconds or connection_limit)", (error, self.left_out), None, None)
        self.last, self.left_out = now, 0
        return True


def _raise_file_limit() -> int:
    """Raise the soft open-files limit to the hard one: every connection holds a descriptor, and
    clients that connect and idle must not starve /healthz or Alertmanager. The limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("event=open_files_limit_unchanged soft=%d hard=%d error=%r", soft, hard, exc)
    return soft


if __name__ == "__main__":
    sys.exit(main())
