"""Command backend: each operation runs a configured program, for clusters no built-in backend knows.

A command is an argv template, never a shell line: ``{node}``-style placeholders are filled in per
argument, so an alert's text can never become shell syntax. The same fields are in the environment
(``GPUHEALTH_NODE``, ``GPUHEALTH_GPU``, ``GPUHEALTH_REASON``, ``GPUHEALTH_ALERTNAME``,
``GPUHEALTH_JOB_ID``, ``GPUHEALTH_EXCLUDE_NODES``, ``GPUHEALTH_OPERATION``). A non-zero exit or a
timeout is a ``BackendError`` carrying the tail of the program's stderr; the whole process group is
killed on timeout, so a hung helper cannot leave children behind.

Read-only operations have safe defaults when no command is set: ``jobs_on_node`` reports no jobs,
``fleet_size`` comes from the ``fleet_size`` number. ``signal_job`` (a checkpoint request)
and ``job_state`` (``{"active": true, "comment": ""}`` as JSON) are needed only by
``checkpoint_drain``; without them its jobs are not asked to checkpoint and the drain goes ahead.
``node_state`` is required as soon as a command changes nodes: without it an operator's drain
could not be seen, and it would not win.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from gpuhealth.contract.gpu import GPU
from gpuhealth.contract.validation import Location, Model, problems
from gpuhealth.webhook import process
from gpuhealth.webhook.backends.base import BackendError, JobState, NodeState
from gpuhealth.webhook.backends.helpers import HelperRegistry, TracksHelpers
from gpuhealth.webhook.labels import ALERT_NAME, UNNAMED_ALERT, clean_text, shown, valid_node
from pydantic import Field, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationError
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema
from pydantic_core.core_schema import CoreSchema

log = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000
# Operations that change a node: each needs node_state, to leave a node someone else drained alone.
NODE_CHANGING = ("drain", "resume", "reset_gpu", "reboot")

def _tail(data: bytes) -> str:
    text = data.decode(errors="replace").strip()
    return text[-STDERR_TAIL_CHARS:]


async def run_argv(argv: Sequence[str], *, env: Mapping[str, str] | None, timeout: float,
                   cwd: str | None = None, permanent_exit_codes: frozenset[int] = frozenset(),
                   helpers: HelperRegistry | None = None) -> str:
    """Run ``argv`` (``process.run``) and return its stdout; ``BackendError`` on failure or timeout.

    Missing programs and ``permanent_exit_codes`` are not retryable; other failures and timeouts are.
    ``helpers`` records the process group while it runs, for a restarted webhook to kill.
    """
    what = " ".join(argv)
    try:
        done = await process.run(argv, timeout=timeout, env=env, cwd=cwd, helpers=helpers)
    except process.NotStarted as exc:
        raise BackendError(f"{what}: {exc}", retryable=not exc.permanent) from None
    except process.TimedOut as exc:
        raise BackendError(f"{what}: {exc}") from None
    if done.returncode != 0:
        detail = _tail(done.stderr) or _tail(done.stdout) or "no output"
        raise BackendError(f"{what}: exit {done.returncode}: {detail}",
                           retryable=done.returncode not in permanent_exit_codes)
    return done.stdout.decode(errors="replace")


class _Template(string.Formatter):
    """``{reason!q}``: the value quoted for a POSIX shell, for an argument a remote shell will parse
    (``ssh`` joins its arguments into one line)."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        return shlex.quote(value) if conversion == "q" else super().convert_field(value, conversion)


_TEMPLATE = _Template()


# Programs that hand (some of) their arguments to a shell as one line: remote shells join them, shells
# run them, and su, runuser, flock, watch, script and GNU parallel run theirs through "sh -c". Free
# text reaches such a template only quoted (!q).
SHELL_PROGRAMS = frozenset({"ssh", "rsh", "pdsh", "clush", "dbclient", "mosh",
                            "sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "csh", "tcsh", "fish",
                            "su", "runuser", "flock", "watch", "script", "parallel"})
FREE_TEXT = frozenset({"reason"})  # the one field no grammar bounds


def template_errors(template: Any, allowed: frozenset[str]) -> list[str]:
    """Every problem with one argv template: its type, any placeholder ``allowed`` does not hold, any
    conversion but ``!q``, and free text left unquoted where a shell will parse it."""
    if not isinstance(template, list) or not template or not all(isinstance(a, str) for a in template):
        return ["a non-empty list of strings (argv, no shell)"]
    errors = []
    shell = next((a for a in template if _runs_a_shell(a)), None)
    for arg in template:
        try:
            parsed = [(f, conv) for _, f, _, conv in _TEMPLATE.parse(arg) if f is not None]
        except ValueError as exc:
            errors.append(f"bad placeholder in {arg!r}: {exc}")
            continue
        names = {f for f, _ in parsed}
        errors.extend(f"in {arg!r}, !{conv} is not a conversion; use !q to quote for a remote shell"
                      for _, conv in parsed if conv not in (None, "q"))
        if shell is not None:
            errors.extend(f"in {arg!r}, {{{f}}} is free text and {shell!r} hands it to a shell: "
                          f"write {{{f}!q}}" for f, conv in parsed if f in FREE_TEXT and conv != "q")
        unknown = sorted(names - allowed)
        if unknown:
            known = ", ".join("{" + a + "}" for a in sorted(allowed)) or "none"
            errors.append(f"unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)} "
                          f"in {arg!r}; allowed: {known}")
    return errors or _quoted_within_quotes(template)


def _quoted_within_quotes(template: list[str]) -> list[str]:
    """A ``{x!q}`` inside quotes the template opened: the value's own quotes would close them and leave
    it bare to the shell (``sh -c "logger '{reason!q}'"``). Quotes are followed across the arguments as
    ``ssh`` joins them, the way a POSIX shell reads them."""
    errors, quote, escaped = [], "", False
    for arg in template:
        for literal, name, _, conv in _TEMPLATE.parse(arg):
            for c in literal:
                if escaped:
                    escaped = False
                elif quote == "'":
                    quote = "" if c == "'" else quote
                elif c == "\\":
                    escaped = True
                elif c == quote or (not quote and c in "'\""):
                    quote = "" if quote else c
            if name is not None and conv == "q" and quote:
                errors.append(f"in {arg!r}, {{{name}!q}} stands inside the template's own {quote}...{quote}: "
                              "its quoting would end them; put it outside any quotes")
        escaped = False
    return errors


def _runs_a_shell(arg: str) -> bool:
    """``arg`` names a program of SHELL_PROGRAMS, alone or as the first word of a command line that a
    wrapper splits (``env -S "sh -c ..."``)."""
    words = arg.split()
    return bool(words) and os.path.basename(words[0]) in SHELL_PROGRAMS


@dataclass(frozen=True)
class Placeholders:
    """Field metadata: the value is an argv template that may use only these placeholders.

    Every problem of one template is one line at the template's location; the JSON Schema says
    argv, so an editor flags a shell line."""

    allowed: frozenset[str]

    def validate(self, value: Any) -> list[str]:
        errors = template_errors(value, self.allowed)
        if errors:
            raise PydanticCustomError("template", "{errors}", {"errors": "; ".join(errors)})
        return list(value)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        known = ", ".join("{" + a + "}" for a in sorted(self.allowed)) or "none"
        return {"type": "array", "items": {"type": "string"}, "minItems": 1,
                "description": f"An argv list, no shell; placeholders: {known} ({{name!q}}: quoted for a "
                               "remote shell)."}


NODE = frozenset({"node"})
ALERT = frozenset({"node", "reason", "alertname"})
NodeTemplate = Annotated[list[str], Placeholders(NODE)]
AlertTemplate = Annotated[list[str], Placeholders(ALERT)]
ResetGpuTemplate = Annotated[list[str], Placeholders(ALERT | {"gpu"})]
RebootTemplate = AlertTemplate

def fill(template: Sequence[str], fields: Mapping[str, str]) -> list[str]:
    """Substitute placeholders argument by argument; values are inserted verbatim (``!q``: shell-quoted),
    never re-parsed."""
    return [_TEMPLATE.vformat(arg, (), fields) for arg in template]


def environment(operation: str, fields: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra, "GPUHEALTH_OPERATION": operation}
    env.update({f"GPUHEALTH_{key.upper()}": value for key, value in fields.items()})
    return env


def check_node(node: str) -> str:
    """``node`` if it names exactly one node; a non-retryable ``BackendError`` otherwise."""
    if not valid_node(node):
        raise BackendError(f"{shown(node)} is not a single node name", retryable=False)
    return node


def check_gpu(gpu: str) -> str:
    """``gpu`` if empty (the whole node) or one GPU's index or UUID; a non-retryable error otherwise."""
    if gpu and not GPU.fullmatch(gpu):
        raise BackendError(f"{shown(gpu)} is neither a GPU index nor a GPU-<uuid>", retryable=False)
    return gpu


def check_alertname(alertname: str) -> str:
    """``alertname`` if empty or a Prometheus alert name; a non-retryable ``BackendError`` otherwise."""
    if alertname and not ALERT_NAME.fullmatch(alertname):
        raise BackendError(f"{shown(alertname)} is not a Prometheus alert name", retryable=False)
    return alertname


# A job as a scheduler names it (Slurm 123 or 123_4, PBS 123.server, a namespace/name): never an option,
# a list, white space or anything a shell would parse, when it goes into {job_id}.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,252}")


def check_job_id(job_id: str) -> str:
    """``job_id`` if it names one job; a non-retryable ``BackendError`` otherwise. Job ids come from the
    site's ``jobs_on_node`` command, and go on into other commands' arguments."""
    if not JOB_ID.fullmatch(job_id):
        raise BackendError(f"{shown(job_id)} is not one job id", retryable=False)
    return job_id


def alert_fields(node: str, reason: str, gpu: str | None = None, *, alertname: str = "") -> dict[str, str]:
    """The fields of an alert-driven operation, each as the engine passed it.

    The engine checked every value already; checking again here keeps a backend safe on its own.
    """
    fields = {"node": check_node(node), "reason": clean_text(reason),
              "alertname": check_alertname(alertname) or UNNAMED_ALERT}
    if gpu is not None:
        fields["gpu"] = check_gpu(gpu)
    return fields


class Commands(Model):
    """One argv template per operation, with the placeholders that operation may use; the environment
    carries the same fields."""

    node_state: NodeTemplate | None = None
    fleet_size: Annotated[list[str], Placeholders(frozenset())] | None = None
    drain: AlertTemplate | None = None
    resume: NodeTemplate | None = None
    jobs_on_node: NodeTemplate | None = None
    requeue: Annotated[list[str], Placeholders(frozenset({"job_id", "exclude_nodes"}))] | None = None
    signal_job: Annotated[list[str], Placeholders(frozenset({"job_id", "signal", "target"}))] | None = None
    job_state: Annotated[list[str], Placeholders(frozenset({"job_id"}))] | None = None
    reset_gpu: ResetGpuTemplate | None = None
    reboot: RebootTemplate | None = None

    def template(self, operation: str) -> list[str] | None:
        found: list[str] | None = getattr(self, operation)
        return found


class CommandSettings(Model):
    """The ``backend:`` section for ``type: command`` (without ``type``)."""

    commands: Commands = Commands()
    timeout_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 60.0
    fleet_size: Annotated[int, Field(ge=1)] | None = None  # or commands.fleet_size
    env: dict[str, str] = Field(default_factory=dict)  # added to the inherited environment
    cwd: Annotated[str, Field(min_length=1)] | None = None
    permanent_exit_codes: list[int] = Field(default_factory=list)  # exit codes a retry cannot change

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        commands = data.get("commands")
        named = set(commands) if isinstance(commands, dict) else set()
        found: list[tuple[Location, str]] = []
        changing = [op for op in NODE_CHANGING if op in named]
        if changing and "node_state" not in named:
            found.append((("commands", "node_state"),
                          f"required with {', '.join(changing)}: without it a node an operator drained "
                          "cannot be told from one we may act on"))
        if data.get("fleet_size") is None and "fleet_size" not in named:
            found.append(((), "set fleet_size (the node count) or commands.fleet_size; the circuit breaker "
                              "needs the fleet size"))
        return found


def _settings(section: Mapping[str, Any]) -> CommandSettings:
    try:
        return CommandSettings.model_validate(dict(section))
    except ValidationError as exc:
        raise ValueError("command backend:\n  " + "\n  ".join(problems(exc, "backend"))) from None

class CommandBackend(TracksHelpers):
    """Runs one configured program per operation; an operation with no command fails clearly."""

    name = "command"

    def __init__(self, settings: CommandSettings) -> None:
        self.settings = settings

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> CommandBackend:
        """Build from the ``backend:`` section; raises ``ValueError`` listing every problem."""
        return cls(_settings(section))

    async def _run(self, operation: str, fields: Mapping[str, str]) -> str:
        template = self.settings.commands.template(operation)
        if template is None:
            raise BackendError(f"command backend: no '{operation}' command configured "
                               f"(backend.commands.{operation})", retryable=False)
        argv = fill(template, fields)
        log.info("event=command_run operation=%s argv=%s", operation, json.dumps(argv))
        return await run_argv(argv, env=environment(operation, fields, self.settings.env),
                              timeout=self.settings.timeout_seconds, cwd=self.settings.cwd,
                              permanent_exit_codes=frozenset(self.settings.permanent_exit_codes),
                              helpers=self.helpers)

    async def node_state(self, node: str) -> NodeState:
        if self.settings.commands.node_state is None:
            return NodeState(node, exists=True, drained=False)
        out = await self._run("node_state", {"node": check_node(node)})
        try:
            data = json.loads(out)
            return NodeState(node, exists=bool(data.get("exists", True)), drained=bool(data["drained"]),
                             reason=str(data.get("reason") or ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise BackendError(f"node_state command must print JSON like "
                               f'{{"exists": true, "drained": false, "reason": ""}}; got {out[:200]!r}',
                               retryable=False) from None

    async def fleet_size(self) -> int:
        if self.settings.commands.fleet_size is None:
            return self.settings.fleet_size or 0
        out = await self._run("fleet_size", {})
        try:
            return int(out.strip())
        except ValueError:
            raise BackendError(f"fleet_size command must print an integer; got {out[:200]!r}",
                               retryable=False) from None

    async def drain(self, node: str, reason: str, *, alertname: str = "") -> None:
        await self._run("drain", alert_fields(node, reason, alertname=alertname))

    async def resume(self, node: str) -> None:
        await self._run("resume", {"node": check_node(node)})

    async def jobs_on_node(self, node: str) -> list[str]:
        if self.settings.commands.jobs_on_node is None:
            return []
        out = await self._run("jobs_on_node", {"node": check_node(node)})
        return [check_job_id(job) for job in out.split()]

    async def requeue(self, job_id: str, exclude_nodes: list[str]) -> None:
        excluded = ",".join(check_node(n) for n in exclude_nodes)
        await self._run("requeue", {"job_id": check_job_id(job_id), "exclude_nodes": excluded})

    async def signal_job(self, job_id: str, signal: str, target: str) -> None:
        await self._run("signal_job", {"job_id": check_job_id(job_id), "signal": signal, "target": target})

    async def job_state(self, job_id: str) -> JobState:
        out = await self._run("job_state", {"job_id": check_job_id(job_id)})
        try:
            data = json.loads(out)
            return JobState(active=bool(data["active"]), comment=str(data.get("comment") or ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise BackendError(f'job_state command must print JSON like {{"active": true, "comment": ""}}; '
                               f"got {out[:200]!r}", retryable=False) from None

    async def reset_gpu(self, node: str, gpu: str | None, reason: str, *, alertname: str = "") -> None:
        await self._run("reset_gpu", alert_fields(node, reason, gpu or "", alertname=alertname))

    async def reboot(self, node: str, reason: str, *, alertname: str = "") -> None:
        await self._run("reboot", alert_fields(node, reason, alertname=alertname))
