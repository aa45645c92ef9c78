"""Canaries for every private torch name elasticzero uses: each fails with a clear line when torch changes it.

elasticzero is tested against one torch (see ``pyproject.toml``); some pieces reach past torch's public API, each for
a reason given in docs/architecture.md ("Private torch names"). One :class:`Canary` per name below checks that the
name still exists with the shape we rely on (``inspect`` signatures, attributes torch's ``__init__`` assigns, the
C++ trampoline's method names). A source scan makes sure no private torch name is used without a canary, and the
docs table lists exactly the canaries.

To add one: use the name, add a ``Canary`` row here and a row to the table in docs/architecture.md.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticzero import torchcompat

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
DOC_SECTION = "## Private torch names"

#: a check gets the resolved object and returns what is wrong with it, or None
Check = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Canary:
    """A private torch name (``module.path.Obj.attr``), where we use it, and what must still hold."""

    name: str
    where: str
    check: Check | None = None
    #: the torch version that added the name; an older supported torch must not have it (we use it where it exists)
    since: str | None = None


def _params(*names: str) -> Check:
    """The callable takes these parameters, in this order, first (after ``self``)."""

    def check(obj: Any) -> str | None:
        got = [p for p in inspect.signature(obj).parameters if p != "self"]
        if got[: len(names)] != list(names):
            return f"parameters are {got}, expected {list(names)} first"
        return None

    return check


def _has_params(*names: str) -> Check:
    """The callable accepts these keyword parameters (anywhere)."""

    def check(obj: Any) -> str | None:
        got = set(inspect.signature(obj).parameters)
        missing = [n for n in names if n not in got]
        return f"no parameter(s) {missing}" if missing else None

    return check


def _assigns(*attrs: str) -> Check:
    """The class (or a torch base of it) assigns ``self.<attr>`` for each attr: instance attributes we read."""

    def check(cls: Any) -> str | None:
        source = "".join(_source(c) for c in cls.__mro__ if c.__module__.startswith("torch"))
        missing = [a for a in attrs if not re.search(rf"self\.{re.escape(a)}\s*[:=]", source)]
        return f"no longer assigns {['self.' + a for a in missing]}" if missing else None

    return check


def _fields(*names: str) -> Check:
    """The dataclass still has these fields (we read them from instances torch builds)."""

    def check(cls: Any) -> str | None:
        got = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        missing = [n for n in names if n not in got]
        return f"no field(s) {missing}" if missing else None

    return check


def _mentions(text: str) -> Check:
    """The module's source still mentions ``text`` (an environment variable torch reads)."""

    def check(module: Any) -> str | None:
        return None if text in _source(module) else f"no longer reads {text!r}"

    return check


def _apply_reaches_instances_and_skips_none(apply: Any) -> str | None:
    """``Module.to()``/``.half()`` reach a child's *instance* ``_apply`` (looked up on the object, children called
    through ``module._apply(fn)``), and ``_apply`` (``apply``) skips a ``None`` entry of ``_parameters``."""
    if _params("fn", "recurse")(apply) is not None:
        return _params("fn", "recurse")(apply)
    seen: list[str] = []
    parent, child = torch.nn.Module(), torch.nn.Linear(1, 1)
    parent.child = child
    own = type(child)._apply
    child._apply = lambda fn, recurse=True: (seen.append("child"), own(child, fn, recurse))[1]
    weight = child._parameters["weight"]
    child._parameters["weight"] = None
    parent.half()
    child._parameters["weight"] = weight
    if seen != ["child"]:
        return "a child's instance _apply was not called by the parent's conversion"
    if weight.dtype != torch.float32 or child.bias.dtype != torch.float16:
        return "a None entry of _parameters was not skipped (or the others not converted)"
    return None


def _trampoline_names(*names: str) -> Check:
    """A Python ``Store`` defining only these names answers through ``PrefixStore`` (torch's C++ trampoline)."""

    def check(store_cls: Any) -> str | None:
        class Probe(store_cls):  # type: ignore[misc, valid-type]
            def getNumKeys(self) -> int:
                return 7

            def deleteKey(self, key: str) -> bool:
                return key == "p/k"

            def has_extended_api(self) -> bool:
                return True

        probe = Probe()
        wrapped = torch.distributed.PrefixStore("p", probe)
        try:
            ok = wrapped.num_keys() == 7 and wrapped.delete_key("k") and wrapped.has_extended_api()
        except RuntimeError as exc:
            return f"the trampoline no longer calls {list(names)}: {exc}"
        return None if ok else f"the trampoline answered differently through {list(names)}"

    return check


def _members(*names: str) -> Check:
    """The enum still has these members (we return them to torch's loop)."""

    def check(enum: Any) -> str | None:
        missing = [n for n in names if n not in getattr(enum, "__members__", {})]
        return f"no member(s) {missing}" if missing else None

    return check


def _method_params(method: str, *names: str) -> Check:
    """The object (a class attribute torch sets) has ``method`` taking these parameters first."""

    def check(obj: Any) -> str | None:
        bound = getattr(obj, method, None)
        return f"has no {method}()" if bound is None else _params(*names)(bound)

    return check


def _called_per_worker(func: Any) -> str | None:
    """``_set_local_rank_env(worker_env, local_rank, spec)``, called by ``_start_workers`` for each worker's env."""
    problem = _params("worker_env", "local_rank", "spec")(func)
    if problem is not None:
        return problem
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    call = "self._set_local_rank_env(worker_env, local_rank, spec)"
    return None if call in _source(LocalElasticAgent._start_workers) else f"_start_workers no longer calls {call}"


def _rendezvous_fills_the_group(func: Any) -> str | None:
    """``_rendezvous(worker_group)`` sets the group's new workers, ranks and master address, and the agent's store;
    the workers it assigns carry no id (the hand-off carries the running processes' ids over) and torch's monitor
    matches the group's worker ids against its process context's pids."""
    problem = _params(WG)(func)
    if problem is not None:
        return problem
    body = _source(func)
    sets = ("worker_group.workers =", "worker_group.group_rank =", "worker_group.master_port =", "self._store =")
    missing = [s for s in sets if s not in body]
    if missing:
        return f"no longer does {missing}"
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = _source(LocalElasticAgent._monitor_workers)
    return None if "w.id" in monitor or "worker.id" in monitor else "_monitor_workers no longer matches worker ids"


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


AGENT = "torch.distributed.elastic.agent.server.api.SimpleElasticAgent"
LOCAL_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent"
DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
HANDLER = f"{DR}.DynamicRendezvousHandler"
PROMPT_PY = "agent/prompt.py (PromptExecutor, make_prompt: a live job's re-formations without torch's fixed waits)"
AGENT_PY = "agent/agent.py (ElasticZeroAgent)"
HANDLER_PY = "rendezvous/handler.py (ElasticZeroRendezvousHandler)"
WG = "worker_group"

CANARIES = [
    # -- the agent: the hooks torch's run loop calls, and the state it keeps -------------------------------------
    Canary(f"{AGENT}._invoke_run", AGENT_PY, _params("role")),
    Canary(f"{LOCAL_AGENT}._start_workers", AGENT_PY, _params(WG)),
    Canary(f"{LOCAL_AGENT}._set_local_rank_env", AGENT_PY, _called_per_worker),
    Canary(f"{LOCAL_AGENT}._monitor_workers", AGENT_PY, _params(WG)),
    Canary(f"{AGENT}._restart_workers", AGENT_PY, _params(WG)),
    Canary(f"{AGENT}._rendezvous", AGENT_PY, _rendezvous_fills_the_group),
    Canary(f"{LOCAL_AGENT}._stop_workers", AGENT_PY, _params(WG)),
    Canary(f"{LOCAL_AGENT}._shutdown", AGENT_PY, _params("death_sig")),  # `timeout` since 2.12: torchcompat
    Canary(f"{AGENT}._exit_barrier", AGENT_PY, _params()),
    Canary(f"{AGENT}._worker_group", AGENT_PY, None),
    Canary(f"{AGENT}._store", AGENT_PY, None),
    Canary(f"{AGENT}._remaining_restarts", AGENT_PY, None),
    Canary(f"{AGENT}._exit_barrier_timeout", AGENT_PY, None),
    Canary(f"{AGENT}._in_exit_barrier", AGENT_PY, None, since="2.12"),
    Canary("torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID", AGENT_PY),
    Canary("torch.distributed.elastic.utils.store._barrier_nonblocking", AGENT_PY, _params("store", "world_size")),
    Canary(
        "torch.distributed.elastic.agent.server.api.WorkerSpec:virtual_local_rank",
        "agent/launch.py (launch)",
        _has_params("virtual_local_rank", "numa_options", "duplicate_stdout_filters", "duplicate_stderr_filters"),
    ),
    Canary("torch.distributed.launcher.api._get_addr_and_port", "agent/launch.py (launch)", _params("rdzv_parameters")),
    Canary("torch.distributed.run._parse_rendezvous_config", "agent/plan.py (plan_agent)", _params("config_str")),
    Canary(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous:TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "agent/plan.py (torch_knobs), agent/launch.py (apply_torch_knobs)",
        _mentions("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"),
    ),
    # -- LogsSpecs: torch's DefaultLogsSpecs keeps its settings private ------------------------------------------
    Canary("torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._root_log_dir", "agent/logs.py"),
    Canary("torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._redirects", "agent/logs.py"),
    Canary("torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._tee", "agent/logs.py"),
    Canary("torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._local_ranks_filter", "agent/logs.py"),
    # -- the rendezvous handler: rank order by hint, fresh bootstrap info per round ------------------------------
    Canary(f"{HANDLER}._get_world", HANDLER_PY, _params()),
    Canary(f"{HANDLER}._node_desc_generator", HANDLER_PY, _method_params("generate", "local_addr")),
    Canary(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous._BackendRendezvousStateHolder",
        HANDLER_PY,
        _params("backend", "settings"),
    ),
    Canary(f"{HANDLER}._this_node", HANDLER_PY, None),
    Canary(f"{HANDLER}._state_holder", HANDLER_PY, None),
    Canary(f"{HANDLER}._bootstrap_store_info", HANDLER_PY, None),
    Canary(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous._RendezvousState",
        f"{HANDLER_PY}, agent/peers.py (last_heartbeats: who is still alive), agent/suspicion.py (an unanswered ask "
        "expires a node's last_heartbeats; only one of the participants may)",
        _assigns(
            "round", "participants", "last_heartbeats", "complete", "deadline", "closed", "wait_list", "redundancy_list"
        ),
    ),
    # -- peer liveness: the round's participants and their heartbeats, read as torch's num_nodes_waiting does ----
    Canary(f"{HANDLER}._heartbeat_lock", "agent/peers.py (PeerWatch: read the state without racing keep-alive)", None),
    Canary(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous._BackendRendezvousStateHolder._backend",
        "agent/peers.py (PeerWatch: a fresh read of the heartbeats, not the holder's 1 s cache; drop_nodes: one "
        "compare-and-set of the state)",
        None,
    ),
    # -- the prompt re-formation (live mode): torch's op executor, its SYNC waited by us --------------------------
    Canary(f"{DR}._DistributedRendezvousOpExecutor", PROMPT_PY, _params("node", "state_holder", "settings")),
    Canary(
        f"{DR}._DistributedRendezvousOpExecutor.run", PROMPT_PY, _params("state_handler", "deadline", "update_deadline")
    ),
    Canary(f"{DR}._DistributedRendezvousOpExecutor._state", PROMPT_PY, None),
    Canary(f"{DR}._DistributedRendezvousOpExecutor._node", PROMPT_PY, None),
    Canary(f"{DR}._DistributedRendezvousOpExecutor._settings", PROMPT_PY, None),
    Canary(f"{DR}._RendezvousContext", PROMPT_PY, _params("node", "state", "settings")),
    Canary(f"{DR}._RendezvousJoinOp", PROMPT_PY, _method_params("__call__", "ctx", "deadline")),
    Canary(f"{DR}._Action", PROMPT_PY, _members("SYNC", "MARK_RENDEZVOUS_COMPLETE")),
    Canary(f"{HANDLER}._op_executor", PROMPT_PY, None),
    Canary(f"{HANDLER}._settings", PROMPT_PY, None),
    Canary(f"{DR}._BackendRendezvousStateHolder._cache_duration", PROMPT_PY, None),
    Canary(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous._NodeDesc",
        "rendezvous/ordering.py (hint keys), rendezvous/handler.py (constructor)",
        _fields("addr", "pid", "local_id"),
    ),
    Canary(
        "torch.distributed.Store:getNumKeys",
        "rendezvous/etcd_store.py (EtcdStore)",
        _trampoline_names("getNumKeys", "deleteKey", "has_extended_api"),
    ),
    # -- engine ------------------------------------------------------------------------------------------------
    Canary("torch._amp_foreach_non_finite_check_and_unscale_", "engine/loss_scaler.py (_unscale_grads)"),
    Canary("torch.Tensor._values", "engine/loss_scaler.py (_grads_of, sparse gradients)"),
    Canary("torch._C._current_graph_task_id", "engine/zero/stage3.py (gather/free inside backward)"),
    Canary("torch.autograd._unsafe_preserve_version_counter", "engine/zero/stage3.py (_gather)", _params("tensors")),
    Canary(
        "torch.autograd.Variable._execution_engine.queue_callback",
        "engine/bucketer.py, engine/zero/stage3.py (end-of-backward callback)",
    ),
    Canary("torch.utils._pytree.tree_map", "engine/zero/casting.py", _params("func", "tree")),
    Canary("torch.utils._pytree.tree_flatten", "engine/zero/stage3.py", _params("tree")),
    Canary(
        "torch.nn.Module._parameters",
        "engine/zero/stage3.py (a module's own parameters), engine/zero/bindings.py (where a module holds one)",
        None,
    ),
    Canary(
        "torch.nn.Module._apply",
        "engine/zero/bindings.py (guard_conversions: module.to()/.half()/... followed or refused, FSDP2's hook)",
        _apply_reaches_instances_and_skips_none,
    ),
    Canary(
        "torch.nn.parallel.distributed:_ddp_params_and_buffers_to_ignore",
        "engine/zero/bindings.py (refuse_ddp: DDP around a ZeRO module finds nothing to reduce and raises)",
        _mentions("module._ddp_params_and_buffers_to_ignore"),
    ),
    Canary("torch.Tensor._make_wrapper_subclass", "engine/zero/standin.py (ShardedGrad: p.grad with no storage)"),
    Canary("torch._C._disabled_torch_function_impl", "engine/zero/standin.py (ShardedGrad: ops reach its dispatch)"),
    # -- checkpoint --------------------------------------------------------------------------------------------
    Canary(
        "torch.distributed.checkpoint.FileSystemReader._get_metadata_path",
        "checkpoint/planner.py (SafeFileSystemReader)",
        _params("rank"),
    ),
    Canary(
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "checkpoint/reader.py (FastFileSystemReader: where each item's bytes are)",
        _fields("relative_path", "offset", "length", "transform_descriptors"),
    ),
    Canary(
        "torch._utils._rebuild_tensor_v2",
        "checkpoint/reader.py (the one global admitted in an item's data.pkl, by name, never called)",
        _params("storage", "storage_offset", "size", "stride"),
    ),
]

#: instance attributes: checked as "torch's __init__ (or class body) still assigns self.<attr>"
_INSTANCE_ATTRS = {
    f"{AGENT}._worker_group",
    f"{AGENT}._store",
    f"{AGENT}._remaining_restarts",
    f"{AGENT}._exit_barrier_timeout",
    f"{AGENT}._in_exit_barrier",
    "torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._root_log_dir",
    "torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._redirects",
    "torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._tee",
    "torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs._local_ranks_filter",
    f"{HANDLER}._state_holder",
    f"{HANDLER}._this_node",
    f"{HANDLER}._bootstrap_store_info",
    f"{HANDLER}._heartbeat_lock",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous._BackendRendezvousStateHolder._backend",
    "torch.nn.Module._parameters",
    f"{DR}._DistributedRendezvousOpExecutor._state",
    f"{DR}._DistributedRendezvousOpExecutor._node",
    f"{DR}._DistributedRendezvousOpExecutor._settings",
    f"{HANDLER}._op_executor",
    f"{HANDLER}._settings",
    f"{DR}._BackendRendezvousStateHolder._cache_duration",
}


def _resolve(dotted: str) -> Any:
    """Import the longest module prefix of ``dotted`` and walk the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _problem(canary: Canary) -> str | None:
    """What is wrong with ``canary`` under this torch, or None."""
    if canary.since is not None and torch.__version__ < canary.since:
        present = _present(canary) is None
        return f"it is there before torch {canary.since}: correct `since`" if present else None
    return _present(canary)


def _present(canary: Canary) -> str | None:
    """What is wrong with ``canary``'s name or shape under this torch, or None."""
    target = canary.name.split(":", 1)[0]
    if canary.name in _INSTANCE_ATTRS:
        owner, attr = target.rsplit(".", 1)
        try:
            return _assigns(attr)(_resolve(owner))
        except (ImportError, AttributeError) as exc:
            return f"{owner} is gone ({exc})"
    try:
        obj = _resolve(target)
    except (ImportError, AttributeError) as exc:
        return f"it is gone ({exc})"
    return canary.check(obj) if canary.check is not None else None


@pytest.mark.parametrize("canary", CANARIES, ids=[c.name.rsplit(".", 1)[-1] for c in CANARIES])
def test_private_torch_name_is_unchanged(canary: Canary) -> None:
    problem = _problem(canary)
    assert problem is None, (
        f"torch {torch.__version__} changed {canary.name}: {problem}; used in {canary.where}, "
        "see docs/architecture.md (Private torch names)"
    )


def test_a_changed_name_is_reported_clearly() -> None:
    gone = Canary("torch.distributed.elastic.agent.server.api.SimpleElasticAgent._no_such_hook", "x")
    assert "it is gone" in (_problem(gone) or "")
    moved = Canary(f"{AGENT}._restart_workers", "x", _params("group"))
    assert "expected ['group'] first" in (_problem(moved) or "")
    early = Canary(f"{AGENT}._restart_workers", "x", since="9.0")  # "added" in torch 9.0, yet here already
    assert "it is there before torch 9.0" in (_problem(early) or "")
    assert _problem(Canary(f"{AGENT}._no_such_hook", "x", since="9.0")) is None  # not there yet: as documented


# --- elasticzero.torchcompat: each difference between the supported torch versions is decided as documented -----

TORCH = torch.__version__  # a TorchVersion: compares with "2.12"
COMPAT = "src/elasticzero/torchcompat.py"


def _stop_grace_facets() -> dict[str, bool]:
    """Which of torch 2.12's ways to set the workers' stop grace this torch has."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import get_args_parser

    return {
        "torchrun --shutdown-timeout": "shutdown_timeout" in vars(get_args_parser().parse_args(["x.py"])),
        "LaunchConfig.shutdown_timeout": "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)},
        "LocalElasticAgent(shutdown_timeout=)": torchcompat.shutdown_timeout_settable(),
        "LocalElasticAgent._shutdown(timeout=)": "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters,
    }


def test_the_stop_grace_is_settable_from_torch_2_12() -> None:
    settable = TORCH >= "2.12"
    wrong = sorted(name for name, there in _stop_grace_facets().items() if there != settable)
    assert not wrong, (
        f"torch {TORCH} changed the workers' stop grace: {'missing' if settable else 'present'}: {wrong}; "
        f"{COMPAT} expects all of them from torch 2.12 on and none before"
    )
    assert torchcompat.agent_shutdown_kwargs(7) == ({"shutdown_timeout": 7} if settable else {})
    assert torchcompat.stop_kwargs(7) == ({"timeout": 7} if settable else {})
    assert "shutdown_timeout" in vars(torchcompat.torchrun_parser().parse_args(["x.py"]))


def test_torchs_stop_grace_default_is_ours() -> None:
    from torch.distributed.elastic.multiprocessing.api import PContext

    grace = inspect.signature(PContext.close).parameters["timeout"].default
    assert grace == torchcompat.DEFAULT_SHUTDOWN_TIMEOUT, (
        f"torch {TORCH} changed PContext.close's stop grace to {grace!r} s; {COMPAT} DEFAULT_SHUTDOWN_TIMEOUT is "
        f"{torchcompat.DEFAULT_SHUTDOWN_TIMEOUT} (the grace on torch 2.11, and elasticzero-run's default)"
    )


def test_torchruns_master_port_default_is_29500_before_2_12_then_unset() -> None:
    from torch.distributed.run import get_args_parser

    default, want = get_args_parser().get_default("master_port"), None if TORCH >= "2.12" else 29500
    assert default == want, (
        f"torch {TORCH} changed torchrun's --master-port default to {default!r} (expected {want!r}); elasticzero-run "
        "unsets it (agent/options.py) and applies 29500 itself (agent/plan.py _STATIC_MASTER_PORT): check both"
    )


# --- every private torch name used in src/ and plugins/ has a canary, and the docs table lists them -----------

#: private names of other libraries that the scan below would otherwise count as torch's
NOT_TORCH = {
    "_exit": "os._exit",
    "_actions": "argparse.ArgumentParser._actions",
    # the front doors' packages' own names, each with its canary beside the door's unit tests
    "_schedulers": "accelerate.Accelerator._schedulers (tests/unit/integrations/test_accelerate_door.py)",
    "_custom_objects": "accelerate.Accelerator._custom_objects (tests/unit/integrations/test_accelerate_door.py)",
    "_prepare_inputs": "transformers.Trainer._prepare_inputs (tests/unit/integrations/test_integrations_hf.py)",
    "_after_closure": "lightning's Precision._after_closure (tests/unit/integrations/test_lightning.py)",
}


def _covered_components() -> set[str]:
    return {part for c in CANARIES for part in re.split(r"[.:]", c.name)}


def _modules() -> Iterator[tuple[Path, str]]:
    for root, package_root in ((REPO / "src", REPO / "src"), (REPO / "plugins", REPO / "plugins")):
        for path in sorted(root.rglob("*.py")):
            yield path, ".".join(path.relative_to(package_root).with_suffix("").parts).removesuffix(".__init__")


def _ours() -> set[str]:
    """Private names our own code defines (functions, classes, assigned attributes and names)."""
    names: set[str] = set()
    for path, _ in _modules():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
    return {n for n in names if n.startswith("_")}


def _torch_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _from_imports(tree: ast.AST, where: str) -> Iterator[tuple[str, str]]:
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
            for part in [*n.module.split("."), *(a.name for a in n.names)]:
                if _torch_private(part):
                    yield part, f"{where}:{n.lineno}"


def _torch_attributes(tree: ast.AST, where: str, ours: set[str]) -> Iterator[tuple[str, str]]:
    """``torch._x`` chains, and ``obj._x`` where ``_x`` is nobody's in our code (a torch object's, then)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _torch_private(n.attr):
            if n.attr not in ours and n.attr not in NOT_TORCH:
                yield n.attr, f"{where}:{n.lineno}"
            elif ast.unparse(n).startswith("torch."):
                yield n.attr, f"{where}:{n.lineno}"


def _torch_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "torch"]


def _subclass_privates(tree: ast.AST, module: Any, where: str) -> Iterator[tuple[str, str]]:
    """In our subclasses of torch classes: overridden private methods, and ``self._x`` that torch's class owns."""
    for node in ast.walk(tree):
        cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not isinstance(cls, type):
            continue
        bases = _torch_bases(cls)
        source = "".join(_source(b) for b in bases)
        for n in ast.walk(node):
            name = n.name if isinstance(n, ast.FunctionDef) else n.attr if isinstance(n, ast.Attribute) else ""
            if not _torch_private(name):
                continue
            if any(name in vars(b) for b in bases) or re.search(rf"self\.{re.escape(name)}\b", source):
                yield name, f"{where}:{n.lineno}"


@functools.cache
def _private_uses() -> list[tuple[str, str]]:
    ours = _ours()
    found: list[tuple[str, str]] = []
    for path, modname in _modules():
        where = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        found += _from_imports(tree, where)
        found += _torch_attributes(tree, where, ours)
        if "class " in path.read_text() and "torch" in path.read_text():
            found += _subclass_privates(tree, importlib.import_module(modname), where)
    return found


def test_every_private_torch_name_in_the_source_has_a_canary() -> None:
    covered = _covered_components()
    missing = sorted({f"{name} ({where})" for name, where in _private_uses() if name not in covered})
    assert missing == [], (
        "private torch names used without a canary (add a Canary here and a row in docs/architecture.md):\n"
        + "\n".join(missing)
    )


def test_the_scan_finds_each_kind_of_use() -> None:
    names = {name for name, _ in _private_uses()}
    assert {"_pytree", "_current_graph_task_id", "_get_addr_and_port"} <= names  # imports, torch._ chains
    assert {"_start_workers", "_worker_group", "_get_world", "_state_holder", "_bootstrap_store_info"} <= names


def _doc_rows() -> list[str]:
    text = DOC.read_text()
    assert DOC_SECTION in text, f"{DOC} has no '{DOC_SECTION}' section"
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)`", section, flags=re.MULTILINE)


def test_the_docs_table_lists_exactly_the_canaries() -> None:
    rows, names = _doc_rows(), [c.name for c in CANARIES]
    assert sorted(rows) == sorted(names), (
        f"docs/architecture.md '{DOC_SECTION}' and tests/unit/test_torch_canaries.py disagree: "
        f"only in docs {sorted(set(rows) - set(names))}, only in canaries {sorted(set(names) - set(rows))}"
    )


def test_torch_still_reads_the_nccl_knobs_the_agent_sets() -> None:
    """elasticzero-run exports torch's NCCL error-handling variables (agent/collective.py, docs/agent.md): torch's
    shipped ProcessGroupNCCL header must still name each, and mode 3 must still be SkipCleanUp."""
    from pathlib import Path

    import torch

    from elasticzero.agent.collective import ASYNC_ERROR_HANDLING, BLOCKING_WAIT, HEARTBEAT_TIMEOUT

    headers = sorted(Path(torch.__file__).parent.glob("include/torch/csrc/distributed/c10d/**/ProcessGroupNCCL.hpp"))
    assert headers, "torch ships no ProcessGroupNCCL.hpp: find where it now declares its NCCL environment variables"
    text = headers[0].read_text()
    for name in (ASYNC_ERROR_HANDLING, BLOCKING_WAIT, HEARTBEAT_TIMEOUT):
        assert f'"{name}"' in text, f"torch no longer reads {name}"
    assert "SkipCleanUp = 3" in text
