"""Which environment variables the launcher exports to every node, and with which values.

Rules, in increasing precedence (a later source overrides an earlier one for the same name):

1. the launcher's environment, names starting with :data:`DEFAULT_PREFIXES` (DeepSpeed's NCCL, PYTHON, UCX, MV2,
   MLFLOW plus WANDB, HF\\_, TORCH\\_) or equal to :data:`DEFAULT_NAMES`, plus ``--export-prefix P`` prefixes and
   ``--export NAME`` names (an exported name that is not set is an error);
2. env files, each line ``KEY=VALUE`` / ``export KEY=VALUE``: ``~/.deepspeed_env``, ``~/.elasticzero_env``,
   ``./.deepspeed_env``, ``./.elasticzero_env`` (the working directory wins over home, elasticzero's file over
   DeepSpeed's).

Never exported by prefix: :data:`NOT_BY_PREFIX` (``PYTHONHOME`` and ``PYTHONEXECUTABLE`` describe this machine's
interpreter and break a remote node whose Python lives elsewhere; export them by name if you really mean it).
Never exported at all: :data:`RESERVED` names the agent sets per rank (``RANK``, ``MASTER_ADDR``,
``CUDA_VISIBLE_DEVICES``, ``TORCHELASTIC_*``…); naming one explicitly or in an env file is an error.

Env file syntax: blank lines and lines starting with ``#`` are ignored; ``'single'`` quotes keep everything
literally; ``"double"`` quotes honour the shell escapes ``\\"``, ``\\\\``, ``\\$`` and ``\\```; a quoted value may be
followed by a ``# comment``. An unquoted value is the rest of the line with surrounding blanks trimmed (a ``#``
inside it is part of the value). Nothing is expanded (``$HOME`` stays ``$HOME``). Keys must match
``[A-Za-z_][A-Za-z0-9_]*``; any other line is an error naming ``file:line``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from elasticzero.errors import UsageError

DEFAULT_PREFIXES = ("NCCL", "PYTHON", "UCX", "MV2", "MLFLOW", "WANDB", "HF_", "TORCH_")
DEFAULT_NAMES = ("OMP_NUM_THREADS",)
NOT_BY_PREFIX = frozenset({"PYTHONHOME", "PYTHONEXECUTABLE"})
RESERVED = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
    }
)
RESERVED_PREFIXES = ("TORCHELASTIC_",)
ENV_FILE_NAMES = (".deepspeed_env", ".elasticzero_env")

KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXPORT = re.compile(r"export\s+")
_DQ_ESCAPES = {'"', "\\", "$", "`"}


def is_reserved(name: str) -> bool:
    """True for names the agent sets per rank, which must never be exported."""
    return name in RESERVED or name.startswith(RESERVED_PREFIXES)


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """Parse an env file's ``text`` (``source`` names it in messages) into name → value, in file order."""
    out: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.lstrip()
        if not line.strip() or line.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        m = _EXPORT.match(line)
        if m:
            line = line[m.end() :]
        key, eq, rest = line.partition("=")
        if not eq:
            raise UsageError(f"{where}: expected KEY=VALUE (or 'export KEY=VALUE'), got {raw.strip()[:40]!r}")
        if not KEY.fullmatch(key):
            raise UsageError(f"{where}: invalid variable name {key!r}; names match [A-Za-z_][A-Za-z0-9_]*")
        if is_reserved(key):
            raise UsageError(f"{where}: {key} is set per rank by the agent and cannot be exported; remove the line")
        out[key] = _parse_value(rest, where)
    return out


def _parse_value(rest: str, where: str) -> str:
    value = rest.strip()
    if not value or value[0] not in "'\"":
        return value
    quote = value[0]
    chars: list[str] = []
    i = 1
    while i < len(value):
        ch = value[i]
        if ch == quote:
            tail = value[i + 1 :].strip()
            if tail and not tail.startswith("#"):
                raise UsageError(f"{where}: unexpected {tail[:20]!r} after the closing {quote}; quote the whole value")
            return "".join(chars)
        if quote == '"' and ch == "\\" and i + 1 < len(value) and value[i + 1] in _DQ_ESCAPES:
            chars.append(value[i + 1])
            i += 2
            continue
        chars.append(ch)
        i += 1
    raise UsageError(f"{where}: missing closing {quote}; values cannot span lines")


def read_env_files(home: Path | None, cwd: Path) -> dict[str, str]:
    """Merge the env files found in ``home`` then ``cwd`` (later files win); missing files are skipped."""
    dirs: list[Path] = []
    for d in (home, cwd):
        if d is not None and d.resolve() not in [x.resolve() for x in dirs]:
            dirs.append(d)
    merged: dict[str, str] = {}
    for d in dirs:
        for name in ENV_FILE_NAMES:
            path = d / name
            if not path.is_file():
                continue
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise UsageError(f"cannot read env file {str(path)!r}: {exc}") from None
            merged.update(parse_env_file(text, str(path)))
    return merged


def _validate_names(names: Iterable[str], prefixes: Iterable[str]) -> None:
    for name in names:
        if not KEY.fullmatch(name):
            raise UsageError(f"--export {name!r}: invalid variable name; names match [A-Za-z_][A-Za-z0-9_]*")
        if is_reserved(name):
            raise UsageError(f"--export {name}: set per rank by the agent; it cannot be exported")
    for prefix in prefixes:
        if not KEY.fullmatch(prefix):
            raise UsageError(f"--export-prefix {prefix!r}: a prefix is the start of a name, e.g. MYAPP_")


def select_env(
    environ: Mapping[str, str],
    names: Iterable[str] = (),
    prefixes: Iterable[str] = (),
    files: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The exported environment (sorted by name): see the module docstring for the rules."""
    names, prefixes = list(names), list(prefixes)
    _validate_names(names, prefixes)
    files = dict(files or {})
    all_prefixes = (*DEFAULT_PREFIXES, *prefixes)
    out: dict[str, str] = {}
    for key, value in environ.items():
        if is_reserved(key) or key in NOT_BY_PREFIX:
            continue
        if key in DEFAULT_NAMES or key.startswith(all_prefixes):
            out[key] = value
    for name in names:
        if name in environ:
            out[name] = environ[name]
        elif name not in files:
            raise UsageError(f"--export {name}: {name} is not set in the environment or any env file")
    out.update(files)
    return dict(sorted(out.items()))


def export_env(
    environ: Mapping[str, str],
    names: Iterable[str] = (),
    prefixes: Iterable[str] = (),
    home: Path | None = None,
    cwd: Path | None = None,
) -> dict[str, str]:
    """:func:`select_env` with the env files read from ``home`` and ``cwd`` (defaults: ``$HOME``, ``.``)."""
    if home is None and environ.get("HOME"):
        home = Path(environ["HOME"])
    files = read_env_files(home, cwd or Path.cwd())
    return select_env(environ, names, prefixes, files)
