"""The launcher-backend contract and its entry-point registry.

A backend turns a :class:`~elasticzero.launch.plan.LaunchPlan` into the local commands that start one
``elasticzero-run`` agent per node (``pdsh …``, ``mpirun …``, ``srun …``, or the agent itself). Backends are found
through the entry-point group ``elasticzero.launchers``; the ones shipped with elasticzero live in ``plugins/``.

A plan is bound to its backend once (torchx's ``submit_dryrun`` → ``schedule`` shape): :meth:`LauncherBackend.bind`
checks and types the options and builds the commands into a frozen :class:`~elasticzero.launch.plan.BoundPlan`.
``--dry-run`` prints that object and ``execute`` runs it; every hook (:meth:`~LauncherBackend.preflight`,
:meth:`~LauncherBackend.stage`, :meth:`~LauncherBackend.unstage`, ``stop_job``) receives it and checks nothing again.

Rules every backend follows:

* commands are argv lists; the only place a string is built for a shell is a remote-shell boundary (pdsh/ssh,
  or an argument a transport pastes into its own ssh string, as MVAPICH's ``mpirun_rsh`` does), and there every
  element goes through :func:`shlex.quote` once;
* environment crosses by *name* where the transport allows it (``mpirun -x NAME``, ``-genvlist``, srun's inherited
  environment), so values are never quoted;
* each node's agent learns which node it is from the plan's node table (see
  :meth:`LaunchPlan.agent_argv`), never from the order a transport happens to pick;
* environment *values* never appear in any process's argv, on any host (pdsh delivers them over ssh's stdin
  into a private file, see :meth:`LauncherBackend.stage`); :meth:`~LauncherBackend.bind` enforces it for the
  secret-looking ones, so the argv ``--dry-run`` prints verbatim never shows a secret.

Options: a backend declares what it accepts in :attr:`LauncherBackend.options` (torchx ``runopts`` style: name,
type, default, help). ``elasticzero-launch`` sets them with flags (``--ssh-port``, ``--per-rank``, …) or
``--launcher-opt KEY=VALUE``, and :meth:`LauncherBackend.bind` checks them against the declaration once: a bound
plan's ``options`` holds every declared option, typed, plus :data:`LAUNCHER_OPTIONS`.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, final, runtime_checkable

from elasticzero.errors import UsageError
from elasticzero.launch.plan import BoundPlan, Command, LaunchPlan, is_secret

__all__ = [
    "ENTRY_POINT_GROUP",
    "LAUNCHER_OPTIONS",
    "BackendOption",
    "BoundPlan",
    "Command",
    "LauncherBackend",
    "RestartsNodes",
    "available_launchers",
    "get_launcher",
    "launcher_class",
]

ENTRY_POINT_GROUP = "elasticzero.launchers"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class BackendOption:
    """One option a backend accepts: ``name``, value ``type`` (bool, int, float or str), ``default``, ``help``.

    ``default=None`` means "unset" (the value is then ``None`` or of ``type``); ``choices`` limits the values.
    ``flag`` names the ``elasticzero-launch`` flag that also sets it, for messages and ``--help``.
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] = ()
    flag: str | None = None

    def parse(self, value: object, backend: str) -> Any:
        """``value`` (a string from the command line, or an already typed value) as this option's type."""
        if value is None and self.default is None:
            return None
        if isinstance(value, str) and self.type is not str:
            value = self._from_text(value, backend)
        ok = isinstance(value, self.type) and not (self.type is not bool and isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise self._error(backend, value, f"expected {self.type.__name__}")
        if self.choices and value not in self.choices:
            raise self._error(backend, value, "expected one of " + ", ".join(map(str, self.choices)))
        return value

    def _from_text(self, text: str, backend: str) -> Any:
        if self.type is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise self._error(backend, text, "expected true or false")
        try:
            return self.type(text)
        except ValueError:
            raise self._error(backend, text, f"expected {self.type.__name__}") from None

    def _error(self, backend: str, value: object, expected: str) -> UsageError:
        return UsageError(f"launcher {backend!r}: option {self.name}={value!r}: {expected}")

    def describe(self) -> str:
        """One line for ``--help`` and the docs: ``name (type, default X): help``."""
        kind = "|".join(map(str, self.choices)) if self.choices else self.type.__name__
        flag = f"; flag {self.flag}" if self.flag else ""
        return f"{self.name} ({kind}, default {self.default!r}{flag}): {self.help}"


#: options every backend accepts: they belong to the launcher itself (``execute`` reads them)
LAUNCHER_OPTIONS = (
    BackendOption("save_pid", str, None, "write the launcher pid to this path while the job runs", flag="--save-pid"),
    BackendOption(
        "max_node_restarts",
        int,
        0,
        "start a lost node's agent again, up to this many times over the job (backends with per-node commands)",
        flag="--max-node-restarts",
    ),
)


@runtime_checkable
class RestartsNodes(Protocol):
    """A backend that can start one node's command again (``--max-node-restarts``): with the option set its
    commands are one per node (``Command.host``), and :meth:`restart_node` prepares the host for a new start."""

    def restart_node(self, bound: BoundPlan, host: str) -> str | None: ...


class LauncherBackend(ABC):
    """Base class of launcher backends (``--launcher NAME``)."""

    #: the ``--launcher`` name, equal to the entry-point name
    name: ClassVar[str]
    #: programs that must be on PATH for :meth:`check_available`
    required_programs: ClassVar[tuple[str, ...]] = ()
    #: the options this backend accepts (besides :data:`LAUNCHER_OPTIONS`)
    options: ClassVar[tuple[BackendOption, ...]] = ()
    #: the backend's one command runs on this machine and needs no live launcher (no :meth:`stage`, no
    #: ``stop_job``): without ``--save-pid`` the launcher *becomes* it (``execve``, same pid) instead of waiting
    #: on a child, so the command handles signals and exit codes itself (``local``, ``no-ssh``)
    replaces_launcher: ClassVar[bool] = False

    def check_available(self) -> None:
        """Raise :class:`UsageError` naming the missing program when this backend cannot run here."""
        for prog in self.required_programs:
            import shutil  # lazy: a backend without programs (local) never loads it (launch overhead)

            if shutil.which(prog) is None:
                raise UsageError(
                    f"launcher {self.name!r} needs {prog!r} on PATH; install it or pick another --launcher"
                )

    @final
    def bind(self, plan: LaunchPlan, sources: Mapping[str, str] | None = None) -> BoundPlan:
        """``plan`` bound to this backend, once: options checked and typed, commands built.

        ``sources`` names the flag that set each option, for the message of an unknown key. Secret-looking
        environment values reach :meth:`commands` as stand-ins (:func:`_stand_ins`): one found in an argv is a
        :class:`UsageError` (every user of a host can read a process's argv), one in a ``Command.env`` value is
        replaced by the real value. Pure apart from what :meth:`commands` itself reads; nothing starts.
        """
        checked = replace(plan, options=self.resolve_options(plan.options, sources))
        self._check_node_restarts(checked.options["max_node_restarts"])
        stand_ins = _stand_ins(checked.env)
        built = self.commands(replace(checked, env={**checked.env, **stand_ins}))
        return BoundPlan(checked, tuple(self._reveal(cmd, stand_ins, checked.env) for cmd in built))

    def _check_node_restarts(self, n: int) -> None:
        if n < 0:
            raise UsageError(f"--max-node-restarts {n}: must be >= 0")
        if n and not isinstance(self, RestartsNodes):
            raise UsageError(
                f"--max-node-restarts: launcher {self.name!r} cannot start one node's agent again (its transport "
                "owns the processes: see docs/launching.md, 'A node comes back'); use --launcher pdsh, or drop the flag"
            )

    def _reveal(self, cmd: Command, stand_ins: Mapping[str, str], env: Mapping[str, str]) -> Command:
        """``cmd`` with the real values in its env; a stand-in in its argv is a :class:`UsageError`."""
        for name, token in stand_ins.items():
            if any(token in arg for arg in cmd.argv):
                raise UsageError(
                    f"launcher {self.name!r} puts the value of {name} in a command line, where every user of the "
                    "host can read it; the backend must pass it by name (Command.env) or stage it on the nodes"
                )
        return replace(cmd, env={key: _put_back(value, stand_ins, env) for key, value in cmd.env.items()})

    def preflight(self, bound: BoundPlan) -> None:  # noqa: B027 - optional hook
        """Check the bound plan can start (e.g. passwordless ssh); raise :class:`UsageError` if not. Starts nothing."""

    @abstractmethod
    def commands(self, plan: LaunchPlan) -> list[Command]:
        """The commands that start one agent per node of ``plan``; called once, by :meth:`bind`.

        ``plan.options`` is already checked and typed (every declared option present). Secret-looking env values
        are stand-ins here: they may go into a ``Command.env`` value, never into an argv. Raise
        :class:`UsageError` for a plan this backend cannot start.
        """

    def stage(self, bound: BoundPlan) -> None:  # noqa: B027 - optional hook
        """Put on the nodes what the bound commands expect there (e.g. the exported environment's values).

        Called by ``execute`` right before the commands start (never by ``--dry-run``); raise
        :class:`UsageError` naming the host when that fails. Nothing may change on any host before this call.
        """

    def unstage(self, bound: BoundPlan) -> None:  # noqa: B027 - optional hook
        """Remove what :meth:`stage` left behind and the job did not consume; called when the run did not succeed."""

    @classmethod
    def all_options(cls) -> tuple[BackendOption, ...]:
        """The declared options and :data:`LAUNCHER_OPTIONS`."""
        return (*cls.options, *LAUNCHER_OPTIONS)

    @classmethod
    def resolve_options(cls, given: Mapping[str, object], sources: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Every option of this backend, typed: ``given`` (strings or typed values) checked, defaults filled.

        An unknown key is one :class:`UsageError` naming the backend, the key (and ``sources[key]``, the flag
        that set it) and the valid keys.
        """
        known = {o.name: o for o in cls.all_options()}
        for key in given:
            if key not in known:
                via = f" (set by {sources[key]})" if sources and key in sources else ""
                valid = ", ".join(sorted(known))
                raise UsageError(
                    f"launcher {cls.name!r} has no option {key!r}{via}; valid options: {valid}; "
                    "see elasticzero-launch --help"
                )
        return {name: opt.parse(given.get(name, opt.default), cls.name) for name, opt in known.items()}


def _put_back(value: str, stand_ins: Mapping[str, str], real: Mapping[str, str]) -> str:
    """``value`` with every stand-in replaced by the real value it stands for."""
    for name, token in stand_ins.items():
        value = value.replace(token, real[name])
    return value


def _stand_ins(env: Mapping[str, str]) -> dict[str, str]:
    """A random token per secret-looking variable: letters and digits only, so it survives any quoting and pdsh's
    ``%`` doubling unchanged, and no argv holds it by chance (a value searched for could be as short as ``"1"``)."""
    return {name: f"ezsecret{os.urandom(12).hex()}" for name in env if is_secret(name)}


def options_help(launchers: Mapping[str, type[LauncherBackend]]) -> str:
    """The per-backend option table for ``elasticzero-launch --help``."""
    lines = ["launcher options (--launcher-opt KEY=VALUE, repeatable; or the flag named):"]
    for name, cls in sorted(launchers.items()):
        lines.append(f"  {name}:")
        lines += [f"    {o.describe()}" for o in cls.options] or ["    (none)"]
    lines.append("  every launcher:")
    lines += [f"    {o.describe()}" for o in LAUNCHER_OPTIONS]
    return "\n".join(lines)


def available_launchers() -> dict[str, type[LauncherBackend]]:
    """All registered backends by name (loads the entry points)."""
    from importlib.metadata import entry_points

    found: dict[str, type[LauncherBackend]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.load()
    return found


#: ``entry_points.txt`` value: ``module[:attr[.attr…]] [extras]`` (importlib.metadata's ``EntryPoint.pattern``)
_EP_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")
_METADATA_DIRS = (".dist-info", ".egg-info")


def _group_entries(path: str, group: str) -> Iterator[tuple[str, str]]:
    """``(name, value)`` of ``group`` in one ``entry_points.txt`` (importlib.metadata's ``Sectioned`` rules)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    section = None
    for line in (raw.strip() for raw in lines):
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
        elif section == group:
            name, _, value = line.partition("=")
            yield name.strip(), value.strip()


def declared_launchers(path: Sequence[str]) -> dict[str, str]:
    """``{name: "module:attr"}`` of :data:`ENTRY_POINT_GROUP`, read straight from the distributions on ``path``.

    importlib.metadata's rules for plain directories: every ``*.dist-info``/``*.egg-info`` directory of each
    ``path`` entry in order, the first distribution of a (normalised) name shadowing later ones; a launcher name
    registered twice keeps the last, as :func:`launcher_class` always did. Why not importlib.metadata itself: importing
    it (email, zipfile, csv, …) was half the launcher's start-up. Anything else (zip files, custom finders) is
    found by :func:`launcher_class`'s fallback to importlib.metadata.
    """
    found: dict[str, str] = {}
    seen: set[str] = set()
    for entry in path:
        try:
            children = os.listdir(entry or ".")
        except OSError:
            continue
        for kind in _METADATA_DIRS:  # a directory's dist-infos before its egg-infos, as importlib.metadata
            for child in children:
                stem, ext = os.path.splitext(child)
                dist = re.sub(r"[-_.]+", "_", stem.partition("-")[0]).lower()
                if ext != kind or dist in seen:
                    continue
                seen.add(dist)
                found.update(_group_entries(os.path.join(entry or ".", child, "entry_points.txt"), ENTRY_POINT_GROUP))
    return found


def _load(name: str, value: str) -> type[LauncherBackend]:
    m = _EP_VALUE.match(value)
    if m is None:
        raise UsageError(f"launcher {name!r}: bad entry point {value!r} in group {ENTRY_POINT_GROUP}; fix its package")
    obj: Any = importlib.import_module(m.group("module"))
    for attr in filter(None, (m.group("attr") or "").split(".")):
        obj = getattr(obj, attr)
    return obj


def launcher_class(name: str) -> type[LauncherBackend]:
    """The backend class registered as ``name``; an unknown name lists the available ones."""
    value = declared_launchers(sys.path).get(name)
    if value is not None:
        return _load(name, value)
    from importlib.metadata import entry_points  # not found cheaply: the full registry (and the names to list)

    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in eps:
        names = ", ".join(sorted(eps)) or "none installed"
        raise UsageError(f"unknown --launcher {name!r}; available: {names}")
    cls: type[LauncherBackend] = eps[name].load()
    return cls


def get_launcher(name: str) -> LauncherBackend:
    """Instantiate the backend registered as ``name``; an unknown name lists the available ones."""
    return launcher_class(name)()
