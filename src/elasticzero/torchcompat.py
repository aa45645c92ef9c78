"""Where the supported torch versions (2.11 to 2.15) differ in what elasticzero touches: one name per difference.

Each decision reads what the installed torch offers (a public signature or default), not its version number; a canary
per difference in ``tests/unit/test_torch_canaries.py`` checks that the decision is the one documented for that
torch version, so a torch that changes it again fails there with one line. Importing this module imports no torch.

* **The workers' stop grace** (torch 2.12): torchrun's ``--shutdown-timeout``, ``LaunchConfig.shutdown_timeout``,
  ``LocalElasticAgent(shutdown_timeout=)`` and ``_shutdown(death_sig, timeout)``. torch 2.11 has none of them and
  always waits :data:`DEFAULT_SHUTDOWN_TIMEOUT` seconds between SIGTERM and SIGKILL (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
  is not read either).

(torchrun's ``--master-port`` defaults to 29500 before torch 2.12 and to ``None`` since: ``elasticzero-run`` unsets
that default on every version, as it does for ``--nnodes``, so that needs no name here.)
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

#: seconds between SIGTERM and SIGKILL when the workers are stopped: torch's default (``PContext.close``'s), the only
#: grace before torch 2.12
DEFAULT_SHUTDOWN_TIMEOUT = 30


def shutdown_timeout_settable() -> bool:
    """Whether this torch takes a stop grace (torch >= 2.12; see the module docstring)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters


def agent_shutdown_kwargs(shutdown_timeout: int) -> dict[str, Any]:
    """``LocalElasticAgent``'s keyword for the stop grace, where it has one."""
    return {"shutdown_timeout": shutdown_timeout} if shutdown_timeout_settable() else {}


def stop_kwargs(timeout: int) -> dict[str, Any]:
    """``LocalElasticAgent._shutdown``'s keyword for the stop grace, where it has one."""
    return {"timeout": timeout} if shutdown_timeout_settable() else {}


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's parser; its namespace has ``shutdown_timeout`` on every version (torch 2.11: always ``None``)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    if not shutdown_timeout_settable():
        parser.set_defaults(shutdown_timeout=None)
    return parser
